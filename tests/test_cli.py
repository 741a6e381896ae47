"""End-to-end runs of ``python -m mmzoo.infer`` and its bad-input contract."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def infer(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    return subprocess.run([sys.executable, "-m", "mmzoo.infer", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


# few buckets: warmup compiles 8 graphs instead of the default config's 40-odd
SMALL_XLA = ["executor.max_model_len=128", "executor.buckets.min_prefill=64", "executor.buckets.min_encoder_rows=64",
             "executor.buckets.max_encoder_rows=64", "executor.max_batch=1"]


def test_cli_contract_xla(qwen2_vl_ckpt, image_files, tmp_path):
    out = tmp_path / "out.jsonl"
    p = infer("model=qwen2_vl", f"checkpoint={qwen2_vl_ckpt}", "prompt=Describe this image.",
              f"images=[{image_files[0]},{image_files[1]}]", "max_new_tokens=16", "executor=xla",
              "attention=sdpa", f"output={out}", *SMALL_XLA, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "encoder=qwen2_vl_vit(sdpa)" in p.stderr and "lm=qwen2(sdpa)" in p.stderr and "executor=xla" in p.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    for key in ("prompt", "text", "token_ids", "prompt_token_ids", "ttft_s", "latency_s"):
        assert key in row
    assert row["prompt"] == "Describe this image."
    assert 1 <= len(row["token_ids"]) <= 16
    assert 0 < row["ttft_s"] <= row["latency_s"]
    assert row["text"] in p.stdout


def test_requests_file_reports_bad_request_and_carries_on(qwen2_vl_ckpt, image_files, tmp_path):
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("\n".join([
        json.dumps({"prompt": "What is this?", "images": [image_files[2]], "max_new_tokens": 4}),
        json.dumps({"prompt": "And this?", "images": [str(tmp_path / "missing.png")]}),
        "{not json",
        json.dumps({"prompt": "Hello", "max_new_tokens": 3, "ignore_eos": True}),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    p = infer(f"checkpoint={qwen2_vl_ckpt}", f"requests={reqs}", f"output={out}", "executor=eager", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    assert "error" not in rows[0] and len(rows[0]["token_ids"]) <= 4
    assert "missing.png" in rows[1]["error"] and "does not exist" in rows[1]["error"]
    assert "not valid JSON" in rows[2]["error"]
    assert len(rows[3]["token_ids"]) == 3
    assert "missing.png" in p.stderr


def _assert_clean_failure(p: subprocess.CompletedProcess, out: Path, *needles: str) -> None:
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, p.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert "Traceback" not in p.stderr
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}*"))


def test_missing_checkpoint_dir(tmp_path):
    out = tmp_path / "out.jsonl"
    p = infer(f"checkpoint={tmp_path / 'nope'}", "images=[]", "executor=eager", f"output={out}", cwd=tmp_path)
    _assert_clean_failure(p, out, "nope", "does not exist")


def test_unsupported_architecture(qwen2_vl_ckpt, tmp_path):
    ckpt = tmp_path / "llama"
    shutil.copytree(qwen2_vl_ckpt, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out.jsonl"
    p = infer("model=qwen2_vl", f"checkpoint={ckpt}", "images=[]", "executor=eager", f"output={out}", cwd=tmp_path)
    _assert_clean_failure(p, out, "LlamaForCausalLM", "qwen2_vl")


@pytest.mark.parametrize("kind", ["missing", "not_an_image"])
def test_bad_image(qwen2_vl_ckpt, image_files, tmp_path, kind):
    bad = tmp_path / ("missing.png" if kind == "missing" else "notes.png")
    if kind == "not_an_image":
        bad.write_text("this is text, not a PNG")
    out = tmp_path / "out.jsonl"
    p = infer(f"checkpoint={qwen2_vl_ckpt}", f"images=[{image_files[0]},{bad}]", "executor=eager",
              f"output={out}", cwd=tmp_path)
    _assert_clean_failure(p, out, "images[1]", bad.name)
