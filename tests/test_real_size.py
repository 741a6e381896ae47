"""The real-size stage's parts: the checkpoint builder (what it writes loads in transformers, in little
memory), the stage's memory plan and watchdog, and a smoke run of fresh processes on ``tiny_deep``.
Nothing here is timed: the figures are the stage's output, not the tests' assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mmzoo.bench import real_size as stage
from mmzoo.fixtures import make_tiny_qwen2_vl
from mmzoo.fixtures.real_size import PRESETS, make_real_size_qwen2_vl, real_size_qwen2_vl

ROOT = Path(__file__).resolve().parent.parent


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_deep_loads_in_transformers_with_every_tensor(tmp_path, tied):
    from transformers import Qwen2VLForConditionalGeneration

    sizes = {**PRESETS["tiny_deep"], "tie_word_embeddings": tied}
    path = make_real_size_qwen2_vl(tmp_path / "rs", preset=sizes, max_shard_bytes=1 << 20)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards  # every shard listed, none extra
    tensors = _tensors(path)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert ("lm_head.weight" in tensors) is not tied

    # the names and shapes transformers' own save_pretrained writes for the same sizes
    ref = _tensors(make_tiny_qwen2_vl(tmp_path / "ref", **sizes))
    assert {k: v.shape for k, v in tensors.items()} == {k: v.shape for k, v in ref.items()}

    model, info = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["text_config"]["num_hidden_layers"] == 28 and cfg["vision_config"]["depth"] == 32
    from transformers import AutoProcessor

    n = len(AutoProcessor.from_pretrained(path).tokenizer)
    emb = tensors["model.embed_tokens.weight"]
    assert not emb[n:].any()  # rows past the tokenizer: 0
    assert emb[:n].float().std().item() == pytest.approx(0.02, rel=0.1)
    norm = tensors["model.norm.weight"].float()
    assert (norm - 1).abs().max() < 0.2 and (norm - 1).abs().max() > 0  # 1 + noise

    # the draw follows the names, not the shard layout
    again = _tensors(make_real_size_qwen2_vl(tmp_path / "one_shard", preset=sizes))
    assert all(torch.equal(again[k], v) for k, v in tensors.items())


def test_cache_builds_once_and_leaves_nothing_half_built(tmp_path):
    path = real_size_qwen2_vl("tiny_deep", root=tmp_path, verbose=False)
    assert path.name == "tiny_deep-bfloat16-0-v1" and (path / "config.json").is_file()
    stamp = path.stat().st_mtime_ns
    assert real_size_qwen2_vl("tiny_deep", root=tmp_path, verbose=False) == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary directory left beside it
    with pytest.raises(ValueError, match="preset='qwen2_vl_3b' is not one of"):
        real_size_qwen2_vl("qwen2_vl_3b", root=tmp_path)


_BUILD = """
import json, sys
from mmzoo.fixtures.real_size import make_real_size_qwen2_vl, checkpoint_bytes
root = sys.argv[1]
make_real_size_qwen2_vl(root + "/warm", preset="tiny_deep")  # every import and the tokenizer, before the baseline
status = lambda field: int(open("/proc/self/status").read().split(field)[1].split()[0]) * 1024
base = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here, not from the warm-up's
sizes = dict(hidden_size=512, num_layers=16, num_heads=8, num_kv_heads=2, intermediate_size=2048, vocab_multiple=64,
             tie_word_embeddings=True, vision_embed_dim=256, vision_depth=8, vision_num_heads=4)
path = make_real_size_qwen2_vl(root + "/big", preset=sizes, dtype="float32", max_shard_bytes=32 << 20)
print(json.dumps({"growth": status("VmHWM:") - base,
                  "bytes": checkpoint_bytes(path)}))
"""


def test_builder_memory_stays_far_below_the_checkpoint(tmp_path):
    """~280 MB of float32 weights in 32 MB shards: the process grows by a shard and a draw (~40 MB), not the
    checkpoint."""
    p = subprocess.run([sys.executable, "-c", _BUILD, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["bytes"] > 250e6
    assert got["growth"] < 0.3 * got["bytes"], got


def test_memory_plan_refuses_what_the_machine_cannot_hold():
    memory = {"margin": 0.15, "overhead_gb": 1.5}
    plan = stage.memory_plan(8_291_375_616, "float32", memory, available=24 * 10**9)  # Qwen2-VL-7B in fp32
    assert not plan["fits"] and plan["weights_gb"] == pytest.approx(33.17, abs=0.01)
    assert plan["note"].startswith("does not fit: needs 39.6 GB (8.29 B params x 4 B x 1.15 + 1.5 GB), 24.0 GB")
    assert stage.memory_plan(8_291_375_616, "bfloat16", memory, available=24 * 10**9)["fits"]
    total = stage._meminfo()["MemTotal"]
    assert not stage.memory_plan(total, "float32", memory)["fits"]  # 4 bytes a parameter: more than the machine


def test_stage_reports_rows_that_do_not_fit_without_running_them(tmp_path, monkeypatch, capsys):
    import mmzoo

    monkeypatch.setenv("MMZOO_CACHE", str(tmp_path / "cache"))
    cfg = mmzoo.compose(["real_size.memory.overhead_gb=1000000", "real_size.logits.runs=[transformers:float32]"],
                        config_name="bench_real_size_smoke", config_dir=ROOT / "recipes")
    monkeypatch.setattr(stage, "launch", lambda *a, **k: pytest.fail("a row that does not fit was launched"))
    res = stage.run(cfg)
    assert len(res["rows"]) == 3 and all(
        r["does_not_fit"].startswith("does not fit: needs 1000000.0 GB (1.6 M params") for r in res["rows"])
    assert "does not fit" in res["logits"]["tiny_deep"]["runs"]["transformers float32"]["error"]
    out = capsys.readouterr().out
    assert out.count("| does not fit: needs") == 3 and "no pair of runs to compare" in out


def test_a_worker_past_its_limits_is_killed_and_reported(tmp_path):
    spec = {"mode": "bench", "system": "transformers", "dtype": "float32", "checkpoint": str(tmp_path)}
    r = stage.launch(spec, tmp_path, "slow", timeout_s=0.5, reserve_gb=0)
    assert r["error"] == "killed: still running after timeout_s=0.5" and r["wall_s"] < 30
    r = stage.launch(spec, tmp_path, "big", timeout_s=60, reserve_gb=stage.memory_available() / 1e9 + 1)
    assert r["error"].startswith("killed: its memory reached") and r["wall_s"] < 30


def test_compare_logits():
    ref = np.array([[0.0, 1.0, 0.5], [2.0, 0.0, 1.0]], np.float32)
    run = ref + np.array([[0.0, -0.6, 0.0], [0.1, 0.0, 0.0]], np.float32)
    c = stage.compare_logits(run, ref)
    assert c["last_max_abs_diff"] == pytest.approx(0.1) and c["last_top1_same"]
    assert c["all_max_abs_diff"] == pytest.approx(0.6) and c["all_top1_agreement"] == 0.5
    assert c["ref_top_gap_median"] == pytest.approx(0.75)


@pytest.mark.slow  # five fresh processes (~10 s each on 2 busy cores); the parts: the tests above
def test_smoke_stage_in_fresh_processes(tmp_path):
    out = tmp_path / "real_size.json"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "MMZOO_CACHE": str(tmp_path / "cache")}
    p = subprocess.run([sys.executable, "-m", "mmzoo.bench", "--config-dir", str(ROOT / "recipes"),
                        "--config-name", "bench_real_size_smoke", f"output={out}",
                        "real_size.systems=[transformers,mmzoo-eager]", "real_size.dtypes=[bfloat16]",
                        "real_size.logits.runs=[transformers:float32,transformers:bfloat16,mmzoo-eager:bfloat16]"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(out.read_text())["real_size"]
    rows = {r["system"]: r for r in res["rows"]}
    assert set(rows) == {"transformers", "mmzoo-eager"}
    for r in rows.values():
        assert "error" not in r and "does_not_fit" not in r, r
        assert r["new_tokens"] == 4 and r["batch"] == 8 and r["peak_rss_gb"] > 0
        assert all(r[k] > 0 for k in ("load_s", "first_answer_s", "ttft_ms", "decode_b1_tok_s", "decode_batch_tok_s"))
        assert r["prompt_tokens"] == res["presets"]["tiny_deep"]["prompt_tokens"]
    pairs = {(c["run"], c["reference"]): c for c in res["logits"]["tiny_deep"]["comparisons"]}
    assert set(pairs) == {("transformers bfloat16", "transformers float32"),
                          ("mmzoo-eager bfloat16", "transformers bfloat16"),
                          ("mmzoo-eager bfloat16", "transformers float32")}
    for c in pairs.values():
        assert c["positions"] == rows["transformers"]["prompt_tokens"] and 0 < c["all_max_abs_diff"] < 0.5
    assert "Real-size logits agreement, tiny_deep" in p.stdout
