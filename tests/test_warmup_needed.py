"""``warmup=needed`` (the CLI's default on XLA): only the graphs a run's requests hit are compiled,
and the run then passes with the compile guard set to ``error``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mmzoo
from mmzoo.executor import warmup

SMALL = dict(max_model_len=128, buckets={"min_prefill": 32, "encoder": {"vision": [64, 128]}}, max_batch=2, progress=False,
             compile={"on_recompile": "error"})


def test_needed_plan_is_a_subset_of_all_and_the_run_compiles_nothing_more(qwen2_vl_ckpt, image_files):
    engine = mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="needed", **SMALL)
    exe = engine.executor
    assert not exe.warm and exe.graphs_since_warmup() is None  # nothing compiled at load
    reqs = [{"prompt": "What is this?", "images": [image_files[0]], "max_new_tokens": 3},
            {"prompt": "Say something.", "max_new_tokens": 4, "temperature": 0.8, "seed": 1}]
    prepared = [engine.prepare(mmzoo.Request.parse(r)) for r in reqs]
    plan = warmup.needed(exe, prepared)
    full = warmup.plan(exe, list(engine.model.towers))
    assert set(plan) <= set(full) and len(plan) < len(full)
    kinds = {(g.kind, g.greedy) for g in plan}
    assert ("head", True) in kinds and ("head", False) in kinds  # one greedy, one sampled prompt
    assert {g.rows for g in plan if g.kind == "head"} == {1, 2}  # alone or side by side
    assert ("decode", True) in kinds and ("decode", False) in kinds
    results = engine.generate(reqs)  # compiles the plan, then runs with the guard on: error if anything else compiles
    assert all(r.error is None for r in results)
    assert exe.warm == set(plan) and exe.graphs_since_warmup() == 0
    # a later call with a shape not seen yet compiles just that, before it runs
    more = engine.generate({"prompt_token_ids": [5] * 10, "max_new_tokens": 2})  # a shorter prefill bucket (32)
    assert more.error is None and exe.graphs_since_warmup() == 0
    assert len(exe.warm) > len(plan)
    # the same tokens as an engine that compiled every bucket up front
    full_engine = mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=128, max_batch=2, progress=False)
    assert [r.token_ids for r in full_engine.generate(reqs)] == [r.token_ids for r in results]



def test_a_run_that_only_samples_compiles_no_greedy_graph(qwen2_vl_ckpt):
    """Every decode batch and every head of a run whose requests all sample has a sampling row, so
    no greedy head or decode graph is compiled; the run passes with the guard on."""
    engine = mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="needed", **SMALL)
    reqs = [{"prompt": "Say something.", "max_new_tokens": 4, "temperature": 0.8, "seed": 1},
            {"prompt": "Say more.", "max_new_tokens": 6, "temperature": 0.5, "top_k": 5, "seed": 2}]
    plan = warmup.needed(engine.executor, [engine.prepare(mmzoo.Request.parse(r)) for r in reqs])
    assert {(g.kind, g.greedy) for g in plan if g.kind in ("head", "decode")} == {("head", False), ("decode", False)}
    results = engine.generate(reqs)
    assert all(r.error is None and len(r.token_ids) > 0 for r in results)
    assert engine.executor.warm == set(plan) and engine.executor.graphs_since_warmup() == 0


def test_cli_default_compiles_what_the_requests_need(qwen2_vl_ckpt, image_files, tmp_path):
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("\n".join(json.dumps({"prompt": f"Q{i}", "images": [image_files[i % 3]], "max_new_tokens": 3})
                              for i in range(4)) + "\n")
    p = subprocess.run([sys.executable, "-m", "mmzoo.infer", f"checkpoint={qwen2_vl_ckpt}", f"requests={reqs}",
                        f"output={tmp_path / 'out.jsonl'}", "executor.compile.on_recompile=error", "executor.max_model_len=256",
                        "executor.progress=false"], cwd=tmp_path, env={**os.environ, "PJRT_DEVICE": "CPU"},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    plan = [line for line in p.stderr.splitlines() if line.startswith("mmzoo: compiling")]
    assert len(plan) == 1 and all(k in plan[0] for k in ("encode vision", "prefill", "head b", "decode"))
    assert "warmup compiled" not in p.stderr  # no every-bucket warmup
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all("error" not in r and r["graphs_compiled_after_warmup"] == 0 for r in rows)


def test_engine_warm_compiles_what_generate_then_runs(qwen2_vl_ckpt, image_files):
    """``Engine.warm(requests)``: the needed graphs compiled without running anything (a
    benchmark's untimed priming); the requests then run with the guard on and compile nothing. A
    request that cannot run is skipped; warming the same requests again compiles nothing."""
    engine = mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="needed", **SMALL)
    exe = engine.executor
    reqs = [{"prompt": "What is this?", "images": [image_files[0]], "max_new_tokens": 3},
            {"prompt": "Say something.", "max_new_tokens": 4, "ignore_eos": True},
            {"prompt": "word " * 200}]  # longer than max_model_len: skipped
    engine.warm(reqs)
    compiled = exe.compiled_graphs()
    assert compiled > 0 and {g.kind for g in exe.warm} == {"encode", "prefill", "head", "decode"}
    assert any(g.kind == "decode" and g.rows == 2 for g in exe.warm)  # two requests can run side by side
    results = engine.generate(reqs[:2])
    assert all(r.error is None for r in results) and exe.compiled_graphs() == compiled
    engine.warm(reqs[:2])
    assert exe.compiled_graphs() == compiled
    assert mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=128).warm(reqs) == 0.0
