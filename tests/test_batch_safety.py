"""Batch runs that survive (issue #21): bad lines cost only themselves, results stream to disk,
a killed or interrupted run resumes to the file an uninterrupted run writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from mmzoo.files import read_jsonl_rows

TIMING = ("ttft_s", "latency_s", "graphs_compiled_after_warmup")


def _env() -> dict:
    return {**os.environ, "PJRT_DEVICE": "CPU"}


def _cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def infer(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd("mmzoo.infer", *args), cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _write_lines(path: Path, objs: list) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def _stable(rows: list[dict]) -> list[dict]:
    """Rows without the fields that measure time."""
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def test_bad_lines_each_become_an_error_row_and_the_rest_run(qwen2_vl_ckpt, image_files, tmp_path):
    good = {"prompt": "What is this?", "images": [image_files[0]], "max_new_tokens": 3, "ignore_eos": True}
    lines = [
        {**good, "id": "good-1"},
        {"id": "str-int", "prompt": "x", "max_new_tokens": "4"},
        {"id": "zero", "prompt": "x", "max_new_tokens": 0, "prompt_logprobs": -1},
        {"id": "negative", "prompt": "x", "max_new_tokens": -2},
        {"id": "absurd", "prompt": "x", "max_new_tokens": 10 ** 9},
        {"id": "bool-str", "prompt": "x", "ignore_eos": "false"},
        {"id": "list-str", "prompt": "x", "images": image_files[0]},
        {"id": "unknown", "prompt": "x", "max_tokens": 3},
        {"id": "oov", "prompt_token_ids": [1, 2, 10 ** 6]},
        {"id": "str-ids", "prompt_token_ids": ["1", "2"]},
        {"id": "long", "prompt_token_ids": [5] * 600},
        {"id": "too-many-images", "prompt_token_ids": [3, 4], "images": [image_files[0]]},
        '{"id": "nan", "inputs_embeds": [[NaN' + ', 0.0' * 63 + ']]}',  # the LM's width, a NaN
        {"id": "dup", "prompt": "a"},
        {"id": "dup", "prompt": "b"},
        "{not json",
        {**good, "id": "good-2", "images": [image_files[1]]},
    ]
    reqs = _write_lines(tmp_path / "reqs.jsonl", lines)
    out = tmp_path / "out.jsonl"
    p = infer(f"checkpoint={qwen2_vl_ckpt}", f"requests={reqs}", f"output={out}", "executor=eager",
              "executor.max_model_len=256", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    rows = read_jsonl_rows(out)
    assert [r["line"] for r in rows] == list(range(1, len(lines) + 1))  # rewritten in request order
    by_id = {r["id"]: r for r in rows if r["id"] != "dup"}
    by_id[16] = rows[15]  # "{not json": its id cannot be read, so it has none (its row names line 16)
    assert rows[15]["id"] is None
    for rid in ("good-1", "good-2"):
        assert "error" not in by_id[rid] and len(by_id[rid]["token_ids"]) == 3
    expect = {"str-int": "max_new_tokens='4'", "zero": "prompt_logprobs=-1", "negative": "max_new_tokens=-2",
              "absurd": "max_new_tokens=1000000000", "bool-str": "ignore_eos='false'", "list-str": "images=",
              "unknown": "'max_tokens'", "oov": "outside the vocabulary", "str-ids": "prompt_token_ids[0]='1'",
              "long": "max_model_len=256", "too-many-images": "image placeholder", "nan": "non-finite",
              16: "not valid JSON"}
    for rid, needle in expect.items():
        assert needle in by_id[rid].get("error", ""), (rid, by_id[rid])
    dups = [r for r in rows if r["id"] == "dup"]
    assert len(dups) == 2 and all("lines 14 and 15" in r["error"] for r in dups)
    # each refusal is one line on stderr naming the request
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == len(lines) - 2


@pytest.mark.parametrize("case", ["output_is_requests", "output_is_dir", "bad_default"])
def test_refused_before_any_work(qwen2_vl_ckpt, tmp_path, case):
    reqs = _write_lines(tmp_path / "reqs.jsonl", [{"prompt": "hi"}])
    before = reqs.read_text()
    args = {"output_is_requests": [f"requests={reqs}", f"output={reqs}"],
            "output_is_dir": [f"requests={reqs}", f"output={tmp_path}"],
            "bad_default": [f"requests={reqs}", f"output={tmp_path / 'o.jsonl'}", "max_new_tokens=abc"]}[case]
    p = infer(f"checkpoint={qwen2_vl_ckpt}", "executor=eager", *args, cwd=tmp_path, timeout=120)
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
    assert {"output_is_requests": "requests file", "output_is_dir": "is a directory",
            "bad_default": "max_new_tokens='abc'"}[case] in errors[0]
    assert "mmzoo: model=" not in p.stderr  # nothing was built
    assert reqs.read_text() == before


# ---------------------------------------------------------------------------- kill, Ctrl-C, resume

N = 20
SLOW = ["executor=eager", "executor.max_batch=1", "max_new_tokens=24", "ignore_eos=true"]


@pytest.fixture(scope="module")
def twenty(tmp_path_factory):
    """20 text requests and the rows an uninterrupted run writes for them."""
    root = tmp_path_factory.mktemp("twenty")
    reqs = _write_lines(root / "reqs.jsonl", [{"id": f"r{i:02d}", "prompt": f"Count to {i}."} for i in range(N)])
    return reqs, root


def _uninterrupted(ckpt, reqs: Path, root: Path) -> list[dict]:
    out = root / "full.jsonl"
    if not out.exists():
        p = infer(f"checkpoint={ckpt}", f"requests={reqs}", f"output={out}", *SLOW, cwd=root)
        assert p.returncode == 0, p.stderr
    return read_jsonl_rows(out)


def _start(ckpt, reqs: Path, out: Path, cwd: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(_cmd("mmzoo.infer", f"checkpoint={ckpt}", f"requests={reqs}", f"output={out}", *SLOW,
                                 *extra), cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_rows(out: Path, proc: subprocess.Popen, n: int, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if out.exists() and out.read_bytes().count(b"\n") >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {n} rows: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {n} rows in {timeout} s")


@pytest.mark.parametrize("how", ["SIGKILL", pytest.param("SIGINT", marks=pytest.mark.slow), "SIGTERM"])  # INT: TERM's handler
def test_interrupted_run_resumes_to_the_uninterrupted_file(qwen2_vl_ckpt, twenty, tmp_path, how):
    reqs, root = twenty
    full = _uninterrupted(qwen2_vl_ckpt, reqs, root)
    assert len(full) == N and all("error" not in r for r in full)
    out = tmp_path / "out.jsonl"
    proc = _start(qwen2_vl_ckpt, reqs, out, tmp_path)
    _wait_for_rows(out, proc, 6)
    proc.send_signal(getattr(signal, how))
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    data = out.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    rows = [json.loads(line) for line in complete.splitlines()]  # every complete line is a whole row
    assert 6 <= len(rows) < N
    if how == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL
    else:  # drained: every admitted request finished and was written, then a clean exit
        assert proc.returncode == 128 + getattr(signal, how), err
        assert data.endswith(b"\n")
        assert f"{len(rows)} of {N} requests done" in err and "resume=true" in err, err
    # what is on disk is what the uninterrupted run gave for those ids
    full_by_id = {r["id"]: r for r in _stable(full)}
    for row in _stable(rows):
        assert row == full_by_id[row["id"]]
    p = infer(f"checkpoint={qwen2_vl_ckpt}", f"requests={reqs}", f"output={out}", "resume=true", *SLOW,
              cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert f"resume: {len(rows)} of {N} requests already in" in p.stderr
    assert _stable(read_jsonl_rows(out)) == _stable(full)


def test_resume_reruns_a_changed_request_and_ignores_a_cut_last_line(qwen2_vl_ckpt, twenty, tmp_path):
    reqs, root = twenty
    full = _uninterrupted(qwen2_vl_ckpt, reqs, root)
    out = tmp_path / "out.jsonl"
    # the first 5 rows, then half of the sixth (a kill in the middle of a write)
    text = "".join(json.dumps(r) + "\n" for r in full[:5]) + json.dumps(full[5])[:40]
    out.write_text(text)
    changed = tmp_path / "reqs.jsonl"
    lines = [json.loads(line) for line in reqs.read_text().splitlines()]
    lines[2]["prompt"] = "Something else."
    _write_lines(changed, lines)
    p = infer(f"checkpoint={qwen2_vl_ckpt}", f"requests={changed}", f"output={out}", "resume=true", *SLOW,
              cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "request 'r02' changed" in p.stderr
    assert "resume: 4 of 20" in p.stderr
    rows = read_jsonl_rows(out)
    assert [r["id"] for r in rows] == [f"r{i:02d}" for i in range(N)]
    assert rows[2]["prompt"] == "Something else."
    assert _stable(rows[:2] + rows[3:]) == _stable(full[:2] + full[3:])


# -------------------------------------------------------------------------------------- encode

def test_encode_names_a_bad_item_and_encodes_the_rest(qwen2_vl_ckpt, image_files, tmp_path):
    out = tmp_path / "emb.safetensors"
    bad = tmp_path / "broken.png"
    bad.write_bytes(Path(image_files[0]).read_bytes()[:60])  # a truncated PNG
    p = subprocess.run(_cmd("mmzoo.encode", f"checkpoint={qwen2_vl_ckpt}",
                            f"images=[{image_files[0]},{bad},{image_files[1]}]", f"output={out}"),
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "images[1]" in errors[0] and "broken.png" in errors[0], p.stderr
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
        grid = f.get_tensor("image_grid_thw")
    assert grid.shape[0] == 2
    assert json.loads(meta["skipped"])[0].startswith("images[1]")
    assert "broken.png" not in meta["images"] and image_files[1] in meta["images"]
    assert not list(tmp_path.glob(".emb*"))  # no temp file left beside it
