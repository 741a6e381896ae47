"""The tensor-parallel sweep of ``python -m mmzoo.bench`` (``sweep.tp``, e.g. ``'sweep.tp=[1,2,4]'``).

Each point is one process, ``python -m mmzoo._bench_mesh POINT.json``: SPMD is process-wide and
torch_xla reads ``CPU_NUM_DEVICES`` once, at start. A point at ``tp`` loads the benchmark
checkpoint text-only (no towers) on the XLA executor with mesh ``data=1 x model=tp`` (tp=1: the
plain single-device executor, no SPMD), primes it with one untimed request (the sweep's engines
compile lazily, as the batch sweep's do), then decodes the same text-only requests at
``sweep.tp_batch`` and reports the median step time (ITL), decode tok/s, the graphs compiled in
the timed run and the token ids, which the parent compares with tp=1's.

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


def sweep(cfg, checkpoint: Path, text, say) -> list[dict]:
    """One row per ``cfg.sweep.tp`` entry (each from its own process); ``text(n, rng)`` makes a
    prompt of ``n`` tokens. Every point decodes the same requests."""
    import numpy as np
    from omegaconf import OmegaConf

    from mmzoo.errors import MmzooError

    batch = int(cfg.sweep.tp_batch)
    rng = np.random.default_rng(int(cfg.workload.seed) + 2000)
    requests = [{"prompt": text(int(cfg.sweep.prompt_len), rng), "images": [], "ignore_eos": True,
                 "max_new_tokens": int(cfg.workload.max_new_tokens)} for _ in range(max(batch, int(cfg.sweep.min_requests)))]
    over = OmegaConf.to_container(cfg.sweep.xla_overrides, resolve=True)
    xla = {**OmegaConf.to_container(cfg.executors.xla, resolve=True), **over,
           "max_batch": batch, "on_recompile": "warn", "progress": False}
    for key in ("transpose_weights", "transpose_keys", "replay_steps"):  # single-device only: off for every point alike
        if key in xla:
            xla[key] = False
    rows = []
    for tp in [int(t) for t in cfg.sweep.tp]:
        say(f"tp sweep: tp={tp}, batch {xla['max_batch']}, {len(requests)} requests (a process of its own)")
        point = {"checkpoint": str(checkpoint), "tp": tp, "executor": xla, "dtype": cfg.dtype,
                 "requests": requests, "model": str(cfg.model),
                 "attention": OmegaConf.to_container(cfg.attention, resolve=True)}
        env = dict(os.environ)
        if env.get("PJRT_DEVICE", "CPU") == "CPU":
            env["CPU_NUM_DEVICES"] = str(tp)
        with tempfile.TemporaryDirectory() as tmp:
            spec, out = Path(tmp) / "point.json", Path(tmp) / "row.json"
            spec.write_text(json.dumps(point))
            p = subprocess.run([sys.executable, "-m", "mmzoo._bench_mesh", str(spec), str(out)], env=env,
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise MmzooError(f"tp sweep: the tp={tp} point failed:\n{p.stderr[-3000:]}")
            rows.append(json.loads(out.read_text()))
    ref = next((r["token_ids"] for r in rows if r["tp"] == 1), None)
    for r in rows:
        r["same_tokens_as_tp1"] = None if ref is None else sum(a == b for a, b in zip(r["token_ids"], ref))
    return rows


def print_sweep(rows: list[dict]) -> None:
    if not rows:
        return
    print("Tensor-parallel sweep (text-only decode; mesh data=1 x model=tp; each point its own process):")
    print(f"  {'tp':>3}{'devices':>9}{'batch':>7}{'step ms (ITL p50)':>19}{'decode tok/s':>14}{'output tok/s':>14}"
          f"{'graphs':>8}{'same tokens as tp=1':>21}")
    for r in rows:
        same = "-" if r["same_tokens_as_tp1"] is None else f"{r['same_tokens_as_tp1']}/{r['requests']}"
        print(f"  {r['tp']:>3}{r['devices']:>9}{r['batch']:>7}{r['median_itl_ms']:>19.1f}{r['decode_tok_s']:>14.1f}"
              f"{r['output_throughput']:>14.1f}{r['graphs_compiled']:>8}{same:>21}")


def _point(spec_path: str, out_path: str) -> None:
    from hydra.utils import instantiate

    import mmzoo
    from mmzoo.bench import _sweep_row, run_mmzoo
    from mmzoo.executor.xla import XLAExecutor

    point = json.loads(Path(spec_path).read_text())
    tp = point["tp"]
    exe = XLAExecutor(**{k: v for k, v in point["executor"].items() if k != "_target_"})
    engine = mmzoo.load(point["checkpoint"], model=point["model"], executor=exe,
                        attention=instantiate(point["attention"]), dtype=point["dtype"], towers=False,
                        mesh={"model": tp} if tp > 1 else None)
    reqs = point["requests"]
    run_mmzoo(engine, "mmzoo-xla", [dict(reqs[0], max_new_tokens=2)])  # priming: compiles lazily, untimed
    r = run_mmzoo(engine, "mmzoo-xla", reqs)
    import torch_xla.runtime as xr

    row = {"tp": tp, "devices": xr.global_runtime_device_count(), **_sweep_row("mmzoo-xla", exe.max_batch, r),
           "describe": exe.describe(), "token_ids": r.outputs}
    Path(out_path).write_text(json.dumps(row))


if __name__ == "__main__":
    _point(sys.argv[1], sys.argv[2])
