"""``python -m mmzoo.bench``: a serving benchmark of mmzoo against transformers on one checkpoint.

Examples::

    PJRT_DEVICE=CPU python -m mmzoo.bench --config-dir recipes --config-name bench_qwen2_vl
    PJRT_DEVICE=CPU python -m mmzoo.bench --config-dir recipes --config-name bench_llava_smoke
    python -m mmzoo.bench workload.num_requests=20 'systems=[mmzoo-xla,transformers]' output=b.json

One process runs the same seeded workload (mixed prompt lengths, a few images or audio clips of
mixed sizes per request, a fixed number of output tokens with EOS ignored) through mmzoo's XLA
executor (after its warmup), mmzoo's eager executor and transformers' ``generate()`` on the
family's own class (one request at a time, greedy), and prints vLLM-style serving figures per
system. All requests arrive at t=0 (vLLM's ``--request-rate inf``), so TTFT includes queueing.
Then: XLA warmup cold and warm, a sweep over the image size (image families) and over the decode
batch (its batch-1 point in rounds, every system in turn, the copy bandwidth measured around each
mmzoo-xla run), optionally a tensor-parallel sweep, a decode roofline (weight bytes read per step
over that bandwidth), and the issue's targets as pass/fail lines, each from figures taken side by
side. Figures only: this is not a test, and the targets are printed, not asserted.

``family`` picks the family (qwen2_vl, llava, qwen2_audio: any conf/model family declaring its tiny checkpoint).
The modules: :mod:`~mmzoo.bench.workload` (checkpoint, prompts, requests),
:mod:`~mmzoo.bench.runner` (one system's run, the measurements), :mod:`~mmzoo.bench.report`
(tables, targets, JSON), :mod:`~mmzoo.bench.mesh` (the tensor-parallel sweep's processes) and
:mod:`~mmzoo.bench.main` (``run(cfg)``, the stages in order).
"""

from mmzoo.bench.main import main, run
from mmzoo.bench.runner import SYSTEMS, Run, Transformers, run_mmzoo
from mmzoo.bench.workload import bench_checkpoint, family, make_workload

__all__ = ["run", "main", "SYSTEMS", "family", "Run", "Transformers", "run_mmzoo", "bench_checkpoint",
           "make_workload"]
