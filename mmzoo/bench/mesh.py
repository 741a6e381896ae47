"""The tensor-parallel sweep of ``python -m mmzoo.bench`` (``sweep.tp``, e.g. ``'sweep.tp=[1,2,4]'``).

Each point is one process, ``python -m mmzoo.bench.mesh POINT.json ROW.json``: SPMD is
process-wide and torch_xla reads ``CPU_NUM_DEVICES`` once, at start. A point at ``tp`` loads the
benchmark checkpoint text-only (no towers, so every family runs it the same way) on the XLA
executor with mesh ``data=1 x model=tp`` (tp=1: the plain single-device executor, no SPMD), primes
it with one untimed request (the sweep's engines compile lazily, as the batch sweep's do), then
decodes the same text-only requests at ``sweep.tp_batch`` and reports the median step time (ITL),
decode tok/s, the graphs compiled in the timed run and the token ids, which the parent compares
with tp=1's.

On the XLA CPU client the point gets ``CPU_NUM_DEVICES=tp`` virtual devices that share the host's
cores, so the figures show correctness and the partitioning overhead, not a speed-up. On a TPU
the point uses the first ``tp`` chips' worth of the mesh (the rest hold replicas).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from mmzoo.bench.runner import run_mmzoo, sweep_row
from mmzoo.bench.workload import PromptText, say, text_requests
from mmzoo.errors import MmzooError


def sweep(cfg: DictConfig, checkpoint: Path, text: PromptText) -> list[dict]:
    """One row per ``cfg.sweep.tp`` entry, each from its own process; every point decodes the same requests."""
    batch = int(cfg.sweep.tp_batch)
    rng = np.random.default_rng(int(cfg.workload.seed) + 2000)
    requests = text_requests(text, max(batch, int(cfg.sweep.min_requests)), cfg.sweep.prompt_len,
                             cfg.workload.max_new_tokens, rng)
    xla = _executor(cfg, batch)
    rows = []
    for tp in [int(t) for t in cfg.sweep.tp]:
        say(f"tp sweep: tp={tp}, batch {xla['max_batch']}, {len(requests)} requests (a process of its own)")
        point = {"checkpoint": str(checkpoint), "tp": tp, "executor": xla, "dtype": cfg.dtype,
                 "requests": requests, "model": str(cfg.family),
                 "attention": OmegaConf.to_container(cfg.attention, resolve=True)}
        rows.append(_run_point(point))
    ref = next((r["token_ids"] for r in rows if r["tp"] == 1), None)
    for r in rows:
        r["same_tokens_as_tp1"] = None if ref is None else sum(a == b for a, b in zip(r["token_ids"], ref))
    return rows


def _executor(cfg: DictConfig, batch: int) -> dict:
    """The points' XLA executor options: the sweep's, with the single-device-only layouts off for every point alike."""
    off = {"layout": {"transpose_weights": False, "transpose_keys": False}, "compile": {"replay_steps": False}}
    merged = OmegaConf.merge(cfg.executors.xla, cfg.sweep.xla_overrides, off,
                             {"max_batch": batch, "progress": False, "compile": {"on_recompile": "warn"}})
    return OmegaConf.to_container(merged, resolve=True)


def _run_point(point: dict) -> dict:
    tp = point["tp"]
    env = dict(os.environ)
    if env.get("PJRT_DEVICE", "CPU") == "CPU":
        env["CPU_NUM_DEVICES"] = str(tp)
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "point.json", Path(tmp) / "row.json"
        spec.write_text(json.dumps(point))
        p = subprocess.run([sys.executable, "-m", "mmzoo.bench.mesh", str(spec), str(out)], env=env,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise MmzooError(f"tp sweep: the tp={tp} point failed:\n{p.stderr[-3000:]}")
        return json.loads(out.read_text())


def point(spec_path: str, out_path: str) -> None:
    """One point, in this process: the spec :func:`sweep` wrote in, the row out."""
    from hydra.utils import instantiate

    import mmzoo
    from mmzoo.executor.xla import XLAExecutor

    spec = json.loads(Path(spec_path).read_text())
    tp = spec["tp"]
    exe = XLAExecutor(**{k: v for k, v in spec["executor"].items() if k != "_target_"})
    engine = mmzoo.load(spec["checkpoint"], model=spec["model"], executor=exe,
                        attention=instantiate(spec["attention"]), dtype=spec["dtype"], towers=False,
                        mesh={"model": tp} if tp > 1 else None)
    reqs = spec["requests"]
    engine.warm(reqs)  # untimed: compiles the graphs these requests hit (warmup=needed)
    r = run_mmzoo(engine, "mmzoo-xla", reqs)
    import torch_xla.runtime as xr

    row = {"tp": tp, "devices": xr.global_runtime_device_count(), **sweep_row("mmzoo-xla", exe.max_batch, r),
           "describe": exe.describe(), "token_ids": r.outputs}
    Path(out_path).write_text(json.dumps(row))


if __name__ == "__main__":
    point(sys.argv[1], sys.argv[2])
