"""End-to-end runs of ``python -m mmzoo.bench`` on the smoke recipes: they complete and their JSON holds the figures.

Qwen2-VL's recipe is checked figure by figure; every conf/model family (:func:`mmzoo.fixtures.families`)
runs ``recipes/bench_family_smoke.yaml`` on its tiny test checkpoint for the same facts. Only what
does not depend on timing (every request finished with exactly its token count, the systems agree,
nothing compiled after warmup); never the timings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mmzoo import config
from mmzoo.fixtures import families

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = families()  # every conf/model option: its family class and tiny checkpoint builder
SYSTEMS = ("mmzoo-xla", "mmzoo-eager", "transformers")
METRICS = ("completed", "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
           *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl") for s in ("mean", "median", "p99")),
           "graphs_compiled_after_warmup")


def _bench(tmp_path, recipe: str, *overrides: str) -> subprocess.CompletedProcess:
    """``python -m mmzoo.bench`` on ``recipes/<recipe>.yaml``, writing ``tmp_path/bench.json``; with an
    empty mmzoo cache, as on a fresh machine (the random checkpoint is built under it)."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "MMZOO_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "mmzoo.bench", "--config-dir", str(ROOT / "recipes"),
                        "--config-name", recipe, f"output={tmp_path / 'bench.json'}", *overrides],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def test_smoke_recipe_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    p = _bench(tmp_path, "bench_qwen2_vl_smoke")
    assert "Serving benchmark" in p.stdout and "Targets:" in p.stdout
    res = json.loads(out.read_text())
    assert not list(tmp_path.glob(".bench.json*"))  # the temp file was renamed, not left behind

    cfg = res["config"]["workload"]
    n, new = cfg["num_requests"], cfg["max_new_tokens"]
    assert set(res["systems"]) == set(SYSTEMS)
    for name, m in res["systems"].items():
        assert all(k in m for k in METRICS), (name, sorted(set(METRICS) - set(m)))
        assert m["completed"] == n and m["total_output_tokens"] == n * new, (name, m)
        assert 0 < m["median_ttft_ms"] and 0 < m["median_itl_ms"]
    assert res["systems"]["mmzoo-xla"]["graphs_compiled_after_warmup"] == 0
    assert res["agreement"]["mmzoo-eager"] == {"mmzoo-xla": n, "transformers": n}  # greedy fp32: same tokens

    assert res["warmup"]["cold_s"] > 0 and res["warmup"]["warm_s"] > 0 and "note" in res["warmup"]
    roof = res["roofline"]
    assert roof["copy_bandwidth_GBps"] > 0 and roof["weight_bytes"] > 0 and roof["min_step_ms"] > 0
    assert roof["read_bandwidth_GBps"] > 0
    assert roof["min_step_ms_at_read_bw"] == pytest.approx(roof["weight_bytes"] / roof["read_bandwidth_GBps"] / 1e6)
    for name in SYSTEMS:
        assert 0 < roof[name]["fraction"]
        assert roof[name]["weights_read_GBps"] == pytest.approx(roof["weight_bytes"] / roof[name]["step_ms"] / 1e6)
    paired = roof["paired"]  # the batch-1 point in rounds, side by side with the bandwidth around it
    assert len(paired["rounds"]) == res["config"]["sweep"]["batch1_rounds"] == 2
    for r in paired["rounds"]:
        assert len(r["copy_bandwidth_GBps"]) == 2 and min(r["copy_bandwidth_GBps"]) > 0
        assert r["fraction"] == pytest.approx(r["min_step_ms"] / r["mmzoo-xla"]["median_tpot_ms"])
        assert set(SYSTEMS) <= set(r) and all(r[s]["requests"] == res["config"]["sweep"]["min_requests"] for s in SYSTEMS)
    assert paired["fraction_range"][0] <= paired["fraction_median"] <= paired["fraction_range"][1]
    assert roof["copy_bandwidth_GBps"] >= max(x for r in paired["rounds"] for x in r["copy_bandwidth_GBps"])
    assert res["targets"][0]["value"] == paired["fraction_median"]
    assert res["targets"][1]["value"] == paired["decode_tok_s_vs_transformers_median"]
    b1 = {r["system"]: r for r in res["batch_sweep"] if r["batch"] == 1}  # every round's requests together
    assert all(b1[s]["requests"] == 2 * res["config"]["sweep"]["min_requests"] for s in SYSTEMS)
    assert {(r["system"], r["batch"]) for r in res["batch_sweep"]} == {
        (s, b) for b in res["config"]["sweep"]["batch_sizes"] for s in res["config"]["sweep"]["systems"]
    } | {("transformers", 1)}
    assert [r["image"] for r in res["image_sweep"]] == [f"{w}x{h}" for w, h in res["config"]["sweep"]["image_sizes"]]
    assert all(r[s] > 0 for r in res["image_sweep"] for s in SYSTEMS)
    assert res["decode_profile"]["graphs_compiled"] == 0 and res["decode_profile"]["step_ms"] > 0
    names = [t["name"] for t in res["targets"]]
    assert len(names) == 5 and all(t["pass"] in (True, False, None) for t in res["targets"])
    assert res["targets"][-1]["pass"] is True  # 0 graphs compiled after warmup


@pytest.mark.slow  # tensor-parallel tokens and sharding: test_sharding
def test_tensor_parallel_sweep_rows(tmp_path):
    """``sweep.tp=[1,2]`` on the smoke model: a row per point (each its own process, tp=2 on 2
    virtual CPU devices under SPMD), the same tokens as tp=1, nothing compiled in the timed run."""
    out = tmp_path / "bench.json"
    p = _bench(tmp_path, "bench_qwen2_vl_smoke", "systems=[]", "sweep.systems=[]", "sweep.image_sizes=[]",
               "sweep.batch_sizes=[]", "sweep.decode_profile_steps=0", "sweep.tp=[1,2]", "sweep.tp_batch=2")
    assert "Tensor-parallel sweep" in p.stdout
    rows = json.loads(out.read_text())["tp_sweep"]
    assert [(r["tp"], r["devices"], r["batch"]) for r in rows] == [(1, 1, 2), (2, 2, 2)]
    assert all(r["same_tokens_as_tp1"] == r["requests"] and r["graphs_compiled"] == 0 for r in rows), rows
    assert "mesh data=1 x model=2" in rows[1]["describe"] and rows[0]["median_itl_ms"] > 0


def _random_sizes(recipe: str, *overrides: str) -> tuple[str, dict]:
    """A smoke recipe's family and the keyword arguments it hands that family's checkpoint builder."""
    cfg = config.compose(list(overrides), config_name=recipe, config_dir=ROOT / "recipes")
    sizes = OmegaConf.to_container(cfg.checkpoint.random, resolve=True)
    return cfg.family, {k: v for k, v in sizes.items() if v is not None}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_smoke_recipe_fits_every_family(name):
    """bench_family_smoke composes for every family and hands its checkpoint builder nothing but the
    seed (conf/bench.yaml's Qwen2-VL sizes all dropped): the builder's defaults are the tests' sizes."""
    assert _random_sizes("bench_family_smoke", f"family={name}") == (name, {"seed": 0})


# the per-family smoke recipes that are bench_family_smoke with their family set (documented commands)
ALIASES = sorted(p.stem for p in (ROOT / "recipes").glob("bench_*_smoke.yaml")
                 if "bench_family_smoke" in (OmegaConf.load(p).get("defaults") or []))


@pytest.mark.parametrize("recipe", ALIASES)
def test_per_family_smoke_recipes_are_the_family_recipe(recipe):
    family, sizes = _random_sizes(recipe)
    assert recipe == f"bench_{family}_smoke" and family in FAMILIES and sizes == {"seed": 0}


@pytest.mark.slow  # the bench's stages: test_smoke_recipe_writes_every_figure; these families' tokens: test_parity
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_smoke_recipe_of_every_family(tmp_path, name):
    """Every conf/model family through every system on its tiny checkpoint (bench_family_smoke):
    every request completes, greedy outputs agree between mmzoo-eager, mmzoo-xla and transformers'
    own class (the family's ``hf_class``), nothing compiles after warmup; the image-size sweep runs
    on image families only (skipped, with a note, on audio)."""
    media = FAMILIES[name].media
    p = _bench(tmp_path, "bench_family_smoke", f"family={name}")
    assert "Serving benchmark" in p.stdout and "Targets:" in p.stdout
    res = json.loads((tmp_path / "bench.json").read_text())
    cfg = res["config"]["workload"]
    n, new = cfg["num_requests"], cfg["max_new_tokens"]
    assert set(res["systems"]) == set(SYSTEMS)
    for system, m in res["systems"].items():
        assert m["completed"] == n and m["total_output_tokens"] == n * new, (system, m)
    assert len({m["total_input_tokens"] for m in res["systems"].values()}) == 1  # the same prompts, media tokens too
    assert res["systems"]["mmzoo-xla"]["graphs_compiled_after_warmup"] == 0
    assert res["agreement"]["mmzoo-eager"] == {"mmzoo-xla": n, "transformers": n}  # greedy fp32: same tokens
    assert res["targets"][-1]["pass"] is True  # 0 graphs compiled after warmup
    assert res["decode_profile"]["graphs_compiled"] == 0
    if media == "image":
        assert [r["image"] for r in res["image_sweep"]] == [f"{w}x{h}" for w, h in res["config"]["sweep"]["image_sizes"]]
        assert all(r[s] > 0 for r in res["image_sweep"] for s in SYSTEMS)
    else:
        assert res["image_sweep"] == [] and res["config"]["sweep"]["image_sizes"]
        assert "TTFT vs image size: skipped" in p.stdout and any("skipped" in note for note in res["notes"])


@pytest.mark.slow  # the server itself: test_serve
def test_serving_mode_over_http(tmp_path):
    """mmzoo-serve: the workload as concurrent streaming openai clients of mmzoo.serve on the XLA
    engine; every request completes with the engines' tokens and nothing compiles after warmup."""
    p = _bench(tmp_path, "bench_qwen2_vl_smoke", "systems=[mmzoo-xla,mmzoo-serve,mmzoo-eager,transformers]",
               "sweep.batch_sizes=[]", "sweep.image_sizes=[]", "serve.concurrency=3", "serve.request_rate=20")
    assert "mmzoo-serve: HTTP clients, at most 3 in flight, 20 req/s Poisson" in p.stdout
    res = json.loads((tmp_path / "bench.json").read_text())
    n, new = res["config"]["workload"]["num_requests"], res["config"]["workload"]["max_new_tokens"]
    m = res["systems"]["mmzoo-serve"]
    assert all(k in m for k in METRICS)
    assert m["completed"] == n and m["total_output_tokens"] == n * new
    assert m["graphs_compiled_after_warmup"] == 0 and 0 < m["median_ttft_ms"]
    assert res["agreement"]["mmzoo-eager"]["mmzoo-serve"] == n


def test_peers_stage_compiled_transformers_beside_mmzoo(tmp_path):
    """bench peers: transformers compiled (static cache + torch.compile), its eager generate and
    mmzoo-xla, each with prefill, decode tok/s and the ratios to the compiled peer (no timing asserted)."""
    p = _bench(tmp_path, "bench_qwen2_vl_smoke", "systems=[]", "peers.run=true", "peers.batch_sizes=[1]",
               "peers.prompt_len=16", "peers.max_new_tokens=4", "peers.repeats=1", "peers.attention=[sdpa]")
    assert "Peers (text-only" in p.stdout
    rows = {r["system"]: r for r in json.loads((tmp_path / "bench.json").read_text())["peers"]}
    assert set(rows) == {"transformers", "transformers-compiled", "mmzoo-xla (sdpa)"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["prefill_ms"] > 0 and r["decode_tok_s"] > 0
    assert rows["transformers-compiled"]["decode_vs_compiled"] == 1.0
    assert rows["mmzoo-xla (sdpa)"]["decode_vs_compiled"] > 0


@pytest.mark.slow  # the CLI's warmup=needed and its first answer: test_warmup_needed, test_cli
def test_first_answer_stage(tmp_path):
    """bench first_answer: fresh infer processes on the embedded demo, timed to their first answer,
    with what they compiled (warmup=needed: a few graphs) and whether they answered right."""
    p = _bench(tmp_path, "bench_first_answer", "first_answer.systems=[mmzoo-xla-needed]", "first_answer.batch=2")
    assert "Time to first answer" in p.stdout
    rows = json.loads((tmp_path / "bench.json").read_text())["first_answer"]
    assert [r["case"] for r in rows] == ["one-shot", "batch of 2"]
    for r in rows:
        assert "error" not in r, r
        assert 0 < r["first_answer_s"] <= r["total_s"] and 0 < r["graphs_compiled"] < 20 and r["compile_s"] > 0
        assert r["correct"] == r["requests"]
