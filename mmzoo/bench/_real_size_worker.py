"""One row of the real-size stage (:mod:`mmzoo.bench.real_size`), as a fresh process:
``python -m mmzoo.bench._real_size_worker SPEC.json OUT.json``.

``SPEC.json`` names the mode (``bench`` or ``logits``), the system (``transformers``,
``mmzoo-xla``, ``mmzoo-xla-layers`` (``executor.compile.layer_graphs=true``), ``mmzoo-eager``), the checkpoint, the run dtype and the requests; ``OUT.json``
gets the figures, or ``{"error": ...}`` (exit status 1). One model per process, so that the
process's peak RSS (``ru_maxrss``, read at its end) is that system's own.

* ``bench``: load (timed, the libraries imported before); with ``mmzoo-xla[-layers]``, compile
  what the requests need (``Engine.warm``); one run of each request set with 2 new tokens (one-time
  costs out of the figures; the first one's end, from the start of the load, is the first answer's
  time); then, timed: the image request alone (TTFT, batch-1 decode) and the batch of text
  requests at once (transformers: one left-padded ``generate``).
* ``logits``: the image request's logits at every prompt position, float32, saved as ``.npy``
  (the parent compares the runs: the last row is the first generated position).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path


def _gb_hwm() -> float:
    """This process's peak RSS so far, GB (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def _gb_rss() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def _median_gap(times: list[float]) -> float | None:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


class _System:
    """The model under test: ``load`` it, then ``run`` request dicts (the batch at once) ->
    (prompt length of the first, token ids of the first, the batch's token times)."""

    def __init__(self, spec: dict):
        self.spec, self.system, self.dtype = spec, spec["system"], spec["dtype"]
        self.engine = self.hf = None

    def load(self) -> None:
        if self.system == "transformers":
            from mmzoo.bench.runner import Transformers
            from mmzoo.bench.workload import family

            self.hf = Transformers(Path(self.spec["checkpoint"]), self.dtype, family("qwen2_vl"))
            return
        import mmzoo

        kind = self.system.split("-")[1]
        extra = {"warmup": "needed", "compile": {"on_recompile": "warn", "layer_graphs": self.system.endswith("-layers")}
                 } if kind == "xla" else {}
        self.engine = mmzoo.load(self.spec["checkpoint"], model="qwen2_vl", executor=kind, dtype=self.dtype,
                                 max_model_len=int(self.spec["max_model_len"]), max_batch=int(self.spec["batch"]),
                                 progress=False, **extra)

    def run(self, reqs: list[dict]) -> tuple[int, list[int], list[float]]:
        if self.hf is not None:
            return self._run_hf(reqs)
        from mmzoo.bench.runner import run_mmzoo

        r = run_mmzoo(self.engine, self.system, reqs)
        # the batch's clock: its k-th token comes when the last request's k-th does
        times = [max(t[k] for t in r.token_times_s) for k in range(min(len(t) for t in r.token_times_s))]
        return r.prompt_lens[0], r.outputs[0], times

    def _run_hf(self, reqs: list[dict]) -> tuple[int, list[int], list[float]]:
        import torch

        from mmzoo.bench.peers import _clock

        if len(reqs) == 1:
            r = self.hf.run(reqs)
            return r.prompt_lens[0], r.outputs[0], r.token_times_s[0]
        processor = self.hf.processor
        box = [time.perf_counter()]
        texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": q["prompt"]}]}],
                                               tokenize=False, add_generation_prompt=True) for q in reqs]
        processor.tokenizer.padding_side = "left"  # a decoder-only batch: the new tokens right after each prompt
        inputs = processor(text=texts, padding=True, return_tensors="pt")
        clock = _clock(box)
        with torch.no_grad():
            out = self.hf.model.generate(**inputs, max_new_tokens=reqs[0]["max_new_tokens"], do_sample=False,
                                         pad_token_id=self.hf.pad, streamer=clock)
        n = inputs["input_ids"].shape[1]
        return int(inputs["attention_mask"][0].sum()), out[0, n:].tolist(), clock.times

    def logits(self, req: dict):
        """``[n, vocab]`` float32 logits of the prompt and its token ids."""
        import numpy as np
        import torch

        if self.hf is not None:
            inputs = self.hf.inputs(req)
            with torch.no_grad():
                logits = self.hf.model(**inputs).logits[0]  # [n, vocab]
            return logits.float().numpy(), inputs["input_ids"][0].tolist()
        from mmzoo.types import Request

        prepared = self.engine.prepare(Request(**req))
        values = np.asarray(self.engine.executor.prompt_logits(prepared), np.float32)
        return values, [int(t) for t in prepared.input_ids]


def _requests(spec: dict, new: int) -> tuple[dict, list[dict]]:
    """The image request and the batch of text requests, ``new`` tokens each, EOS ignored."""
    from transformers.image_utils import load_image

    image = load_image(str(spec["image"]))  # the file as transformers reads it; both systems get this image
    one = {"prompt": spec["prompt"], "images": [image], "max_new_tokens": new, "ignore_eos": True}
    batch = [{"prompt": p, "max_new_tokens": new, "ignore_eos": True} for p in spec["batch_prompts"]]
    return one, batch


def _import(system: str) -> None:
    """The libraries every system uses, imported before the clock starts: load s is the loading."""
    import torch  # noqa: F401
    import transformers
    from transformers import AutoProcessor  # noqa: F401

    import mmzoo.engine  # noqa: F401
    from mmzoo.bench.runner import Transformers  # noqa: F401

    transformers.Qwen2VLForConditionalGeneration  # noqa: B018 - transformers imports a model's module when it is named
    if system.startswith("mmzoo-xla"):
        import torch_xla  # noqa: F401


def bench(spec: dict) -> dict:
    out: dict = {}
    system = _System(spec)
    _import(system.system)
    t0 = time.perf_counter()
    system.load()
    out.update(load_s=time.perf_counter() - t0, rss_after_load_gb=_gb_rss(), hwm_after_load_gb=_gb_hwm())
    new = int(spec["max_new_tokens"])
    one, batch = _requests(spec, new)
    prime_one, prime_batch = _requests(spec, 2)
    exe = system.engine.executor if system.engine is not None else None
    if system.system.startswith("mmzoo-xla"):  # untimed: every graph these runs hit (a call per run: a run packs its prompts)
        out["warmup_s"] = sum(system.engine.warm(run) for run in ([one], batch, [prime_one], prime_batch))
        out["compile_s"] = exe.compile_seconds()  # XLA's compiler, in this process
        out["graphs_compiled"] = exe.compiled_graphs()
    system.run([prime_one])  # untimed: one-time costs (allocations, kernel selection, first graph runs)
    out["first_answer_s"] = time.perf_counter() - t0  # from the start of the load (warmup included)
    system.run(prime_batch)
    before = exe.compiled_graphs() if system.system.startswith("mmzoo-xla") else None
    prompt_len, tokens, times = system.run([one])
    gap = _median_gap(times)
    out.update(prompt_tokens=prompt_len, ttft_ms=times[0] * 1e3, decode_b1_tok_s=1 / gap if gap else None,
               tokens=tokens, new_tokens=len(tokens))
    batch_len, _, times = system.run(batch)
    gap = _median_gap(times)
    out.update(batch=len(batch), batch_prompt_tokens=batch_len, batch_ttft_ms=times[0] * 1e3,
               decode_batch_tok_s=len(batch) / gap if gap else None)
    if before is not None:
        out["graphs_after_warmup"] = exe.compiled_graphs() - before
    return out


def logits(spec: dict) -> dict:
    import numpy as np

    system = _System(spec)
    t0 = time.perf_counter()
    system.load()
    load_s = time.perf_counter() - t0
    one, _ = _requests(spec, 1)
    t0 = time.perf_counter()
    values, ids = system.logits(one)
    np.save(spec["logits_path"], values)
    return {"load_s": load_s, "logits_s": time.perf_counter() - t0, "prompt_ids": ids,
            "logits_path": spec["logits_path"], "shape": list(values.shape)}


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        import torch

        torch.set_num_threads(int(spec["threads"]))
    rc = 0
    try:
        result = {"bench": bench, "logits": logits}[spec["mode"]](spec)
    except Exception as e:  # noqa: BLE001 - the row says what failed; the stage goes on
        frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        where = f" ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
        result = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}{where}"}
        traceback.print_exc()
        rc = 1
    result["peak_rss_gb"] = _gb_hwm()  # ru_maxrss at the end: the whole process's peak
    Path(out_path).write_text(json.dumps(result, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
