"""Time to first answer: fresh processes, from their start to the first answer printed.

What a user feels first is not the steady state but how long a fresh ``python -m mmzoo.infer``
takes to answer. Two cases on the embedded demo model: the default command (one image, one
question) and a ``requests=`` file of ``first_answer.batch`` questions about drawn images of mixed
sizes and aspect ratios. Each system is a new process: mmzoo's XLA executor compiling only what
the run needs (``warmup=needed``, the CLI's default) and every bucket (``warmup=all``), the eager
executor, and transformers' ``generate()`` (:mod:`mmzoo.bench.hf_answer`, the same prompts). For
each: seconds from the process start to the first answer line and to the end, the graphs it
compiled and their seconds (from its own output), and how many answers were right.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import DictConfig

from mmzoo.bench.workload import say

SYSTEMS = {
    "mmzoo-xla-needed": ["-m", "mmzoo.infer", "executor=xla", "warmup=needed"],
    "mmzoo-xla-all": ["-m", "mmzoo.infer", "executor=xla", "warmup=all"],
    "mmzoo-eager": ["-m", "mmzoo.infer", "executor=eager"],
    "transformers": ["-m", "mmzoo.bench.hf_answer"],
}


def _requests(root: Path, n: int, seed: int) -> tuple[Path, list[str]]:
    """``n`` questions about drawn scenes (mixed sizes), as a requests file; and their answers."""
    from mmzoo.demo.shapes import make_examples

    lines, answers = [], []
    for i, ex in enumerate(make_examples(n, seed)):
        path = root / f"scene{i}_{ex.image.width}x{ex.image.height}.png"
        ex.image.save(path)
        lines.append(json.dumps({"id": i, "prompt": ex.question, "images": [str(path)]}))
        answers.append(ex.answer)
    reqs = root / "requests.jsonl"
    reqs.write_text("\n".join(lines) + "\n")
    return reqs, answers


def _run(args: list[str], cwd: Path, timeout: float) -> dict:
    """One fresh process: when its first stdout line came, when it ended, its answers and what it
    says it compiled."""
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first, lines = None, []
    for line in proc.stdout:  # the answers, one line each, as the process prints them
        if first is None:
            first = time.perf_counter() - t0
        lines.append(line.rstrip("\n"))
    err = proc.stderr.read()
    proc.wait(timeout=timeout)
    total = time.perf_counter() - t0
    graphs = [(int(n), float(s)) for n, s in re.findall(r"compiled (\d+) graphs? in ([\d.]+) s", err)]
    if proc.returncode != 0:
        return {"error": (err.strip().splitlines() or ["?"])[-1], "total_s": total}
    return {"first_answer_s": first, "total_s": total, "answers": lines,
            "graphs_compiled": sum(n for n, _ in graphs), "compile_s": sum(s for _, s in graphs)}


def run(cfg: DictConfig) -> list[dict]:
    """Every system on the one-shot and the batch case; returns a row per (case, system)."""
    fa = cfg.first_answer
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmzoo-first-answer-") as tmp:
        root = Path(tmp)
        reqs, answers = _requests(root, int(fa.batch), int(fa.seed))
        out = root / "out.jsonl"
        cases = {"one-shot": ([], ["triangle"]),  # the default command's prompt and bundled image
                 f"batch of {len(answers)}": ([f"requests={reqs}", f"output={out}"], answers)}
        for case, (extra, expected) in cases.items():
            for system in fa.systems:
                say(f"first answer: {case}, {system}")
                r = _run(SYSTEMS[system] + extra, root, float(fa.timeout_s))
                if "answers" in r:
                    got = r.pop("answers")
                    r["correct"] = sum(a.strip().lower() == e for a, e in zip(got, expected))
                    r["requests"] = len(expected)
                rows.append({"case": case, "system": system, **r})
    return rows


def print_rows(rows: list[dict]) -> None:
    if not rows:
        return
    print("Time to first answer (fresh processes on the embedded demo model, from process start):")
    print(f"  {'case':<12}{'system':<20}{'first answer s':>15}{'total s':>9}{'graphs':>8}{'compile s':>11}"
          f"{'correct':>9}")
    for r in rows:
        if "error" in r:
            print(f"  {r['case']:<12}{r['system']:<20}  error: {r['error']}")
            continue
        print(f"  {r['case']:<12}{r['system']:<20}{r['first_answer_s']:>15.1f}{r['total_s']:>9.1f}"
              f"{r['graphs_compiled']:>8}{r['compile_s']:>11.1f}{r['correct']:>5}/{r['requests']:<3}")
