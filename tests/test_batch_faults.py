"""A batch run under bad files and faults: requests files read as JSON Lines, per-line limits,
resume retrying failed rows, a full disk, a closed stdout, signals during the final rewrite, the
output files' mode."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmzoo
from mmzoo import files, infer as infer_mod
from mmzoo.files import read_jsonl_rows

FAST = ["executor=eager", "executor.max_model_len=256", "max_new_tokens=3", "ignore_eos=true"]


def _env() -> dict:
    return {**os.environ, "PJRT_DEVICE": "CPU"}


def infer(*args: str, cwd: Path, timeout: int = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmzoo.infer", *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout, **kw)


def test_requests_file_is_json_lines(qwen2_vl_ckpt, image_files, tmp_path):
    """Split on \\n only (U+2028, U+0085 and \\r inside strings stay), an invalid UTF-8 line and an
    over-long line cost only their own rows, line numbers match the file, a broken line takes no id."""
    lines = [
        json.dumps({"id": "sep", "prompt": "a\u2028b\u0085c\u2029d"}, ensure_ascii=False).encode(),  # line 1
        b'{"id": "latin1", "prompt": "caf\xe9"}',  # 2: not UTF-8
        b"{broken",  # 3: its default id would be 3, which line 5 uses
        json.dumps({"id": "big", "prompt": "x" * 9000}).encode(),  # 4: over limits.max_request_bytes
        json.dumps({"id": 3, "prompt": "three", "images": [image_files[0]]}).encode(),  # 5
        b"",  # 6: blank
        json.dumps({"prompt": "no id"}).encode() + b"\r",  # 7: a CRLF line; id 7
        b"12345678901234567890" * 300,  # 8: an integer of 6000 digits
    ]
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "out.jsonl"
    p = infer(f"checkpoint={qwen2_vl_ckpt}", f"requests={reqs}", f"output={out}", "limits.max_request_bytes=8192",
              *FAST, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    rows = read_jsonl_rows(out)
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5, 7, 8]
    by_line = {r["line"]: r for r in rows}
    assert by_line[1]["id"] == "sep" and by_line[1]["prompt"] == "a\u2028b\u0085c\u2029d"
    assert len(by_line[1]["token_ids"]) == 3
    assert "not UTF-8" in by_line[2]["error"] and "reqs.jsonl:2" in by_line[2]["error"]
    assert "not valid JSON" in by_line[3]["error"] and by_line[3]["id"] is None
    assert f"{len(lines[3])} bytes" in by_line[4]["error"] and "limits.max_request_bytes" in by_line[4]["error"]
    assert by_line[5]["id"] == 3 and len(by_line[5]["token_ids"]) == 3  # not refused as a duplicate of line 3
    assert by_line[7]["id"] == 7 and "error" not in by_line[7]
    assert "not valid JSON" in by_line[8]["error"] and "digits" in by_line[8]["error"]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 4 and any(e.startswith("error: reqs.jsonl:3:") for e in errors), errors


def test_limits_cost_only_their_own_row_and_resume_retries_errors(qwen2_vl_ckpt, image_files, tmp_path):
    missing = tmp_path / "later.png"
    lines = [{"id": "long", "prompt": "y" * 3000},  # over limits.max_prompt_chars
             {"id": "many", "prompt": "?", "images": [image_files[0]] * 5},  # over limits.max_media_items
             {"id": "later", "prompt": "What is it?", "images": [str(missing)]},  # the file is made before resume
             {"id": "ok", "prompt": "What is it?", "images": [image_files[1]]}]
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    args = [f"checkpoint={qwen2_vl_ckpt}", f"requests={reqs}", f"output={out}", "limits.max_prompt_chars=2000",
            "limits.max_media_items=4", *FAST]
    p = infer(*args, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    rows = {r["id"]: r for r in read_jsonl_rows(out)}
    assert "3000 characters" in rows["long"]["error"] and "limits.max_prompt_chars" in rows["long"]["error"]
    assert "5 media items" in rows["many"]["error"] and "limits.max_media_items" in rows["many"]["error"]
    assert "does not exist" in rows["later"]["error"]
    assert len(rows["ok"]["token_ids"]) == 3
    shutil.copy(image_files[2], missing)
    p = infer(*args, "resume=true", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "resume: 1 of 4 requests already in" in p.stderr and "3 of them ended in an error" in p.stderr, p.stderr
    rows = {r["id"]: r for r in read_jsonl_rows(out)}
    assert len(rows["later"]["token_ids"]) == 3 and "error" not in rows["later"]
    assert "error" in rows["long"]  # still over the limit


def test_a_full_disk_stops_the_run_with_one_line(qwen2_vl_ckpt, tmp_path):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("".join(json.dumps({"id": i, "prompt": f"Count to {i}."}) + "\n" for i in range(4)))
    p = infer(f"checkpoint={qwen2_vl_ckpt}", f"requests={reqs}", "output=/dev/full", *FAST, cwd=tmp_path)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, p.stderr
    assert "cannot write output=/dev/full" in errors[0] and "No space left" in errors[0]
    assert "0 of 4 requests done" in errors[0] and "resume=true" in errors[0]


def test_a_closed_stdout_keeps_writing_the_output(qwen2_vl_ckpt, tmp_path):
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("".join(json.dumps({"id": i, "prompt": f"Count to {i}."}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "mmzoo.infer", f"checkpoint={qwen2_vl_ckpt}", f"requests={reqs}",
                             f"output={out}", *FAST], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # `| head -0`: the reader is gone before the first result
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert [r["id"] for r in read_jsonl_rows(out)] == [0, 1, 2]


@pytest.fixture(scope="module")
def engine(qwen2_vl_ckpt):
    return mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=256)


@pytest.mark.parametrize("signals", [1, 2])
def test_signals_during_the_final_rewrite(engine, qwen2_vl_ckpt, tmp_path, monkeypatch, capsys, signals):
    """One signal while the results are rewritten: the rewrite finishes, then exit 128+signum; two:
    the rewrite stops, no temporary file is left, the file keeps its rows."""
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("".join(json.dumps({"id": i, "prompt": f"Count to {i}."}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr("mmzoo.engine.build", lambda cfg, **kw: engine)

    def write_with_signals(path, rows):
        with files.atomic_path(path) as tmp, open(tmp, "w") as f:
            f.write(json.dumps(rows[0]) + "\n")
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, between two rows
            for row in rows[1:]:
                f.write(json.dumps(row) + "\n")

    monkeypatch.setattr(infer_mod, "write_jsonl", write_with_signals)
    before = signal.getsignal(signal.SIGTERM)
    cfg = mmzoo.compose(FAST, values={"checkpoint": str(qwen2_vl_ckpt), "requests": str(reqs), "output": str(out)})
    with pytest.raises(SystemExit) as e:
        infer_mod.run(cfg)
    assert e.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "finishing writing the results" in err
    assert signal.getsignal(signal.SIGTERM) is before  # the run's handler is gone
    rows = read_jsonl_rows(out)
    assert sorted(r["id"] for r in rows) == [0, 1, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.jsonl")]  # no temporary file
    if signals == 2:
        assert "could not rewrite" in err and "resume=true" in err
    else:
        assert "wrote 3 results" in err and [r["id"] for r in rows] == [0, 1, 2]  # rewritten in order


def test_output_files_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        files.write_jsonl(tmp_path / "new.jsonl", [{"a": 1}])
        files.write_json(tmp_path / "new.json", {"a": 1})
        with files.atomic_path(tmp_path / "dir", directory=True) as d:
            (d / "x").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "new.jsonl").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "new.json").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "dir").stat().st_mode & 0o777 == 0o750
    existing = tmp_path / "new.jsonl"
    existing.chmod(0o604)
    files.write_jsonl(existing, [{"a": 2}])  # a rewrite keeps the file's mode
    assert existing.stat().st_mode & 0o777 == 0o604


# -------------------------------------------------------------------- hypothesis: any requests file

_ids = st.one_of(st.integers(-5, 30), st.text(max_size=4), st.none(), st.booleans(), st.floats(allow_nan=False))
_values = st.one_of(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\n"), max_size=12)
                    | st.sampled_from(["a\u2028b", "c\u0085d", "\r", "\u2029"]),
                    st.integers(-3, 10 ** 6), st.booleans(), st.none(), st.lists(st.integers(0, 9), max_size=3))
_objects = st.fixed_dictionaries({}, optional={"id": _ids, "prompt": _values, "max_new_tokens": _values,
                                               "temperature": _values, "images": _values, "bogus": _values})
_lines = st.one_of(_objects.map(lambda o: json.dumps(o, ensure_ascii=False).encode()),
                   _objects.map(lambda o: json.dumps(o).encode()),
                   st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
                   st.sampled_from([b"", b"   ", b"[]", b"null", b"{", b'{"id": 1}\r', b"\xff\xfe", b"1" * 5000]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_lines, max_size=10))
def test_any_requests_file_is_read_line_by_line(tmp_path, lines):
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_bytes(b"\n".join(lines))
    read = infer_mod.read_requests(reqs, {"max_new_tokens": 4}, max_line_bytes=4096)
    blank = {n for n, line in enumerate(lines, 1) if not line.strip(b" \t\r")}  # JSON's whitespace
    assert [x.line for x in read] == [n for n in range(1, len(lines) + 1) if n not in blank]  # one per line, in order
    ids = [x.key for x in read if x.request is not None]
    assert len(ids) == len(set(ids))  # no two runnable requests share an id
    for x in read:
        assert (x.request is None) == (x.error is not None)
        assert x.id is not None or x.error  # a line without a readable id never runs
        if x.error:
            assert isinstance(x.error, str) and "\n" not in x.error.strip()
        raw = lines[x.line - 1]
        try:
            obj = json.loads(raw.decode())
        except (ValueError, UnicodeDecodeError, RecursionError):
            obj = None
        if isinstance(obj, dict) and x.request is not None:
            given = obj.get("id")
            assert x.request.id == (x.line if given is None else given)  # the line's own id, else its line number


def test_a_write_that_fails_is_one_error_naming_the_file(tmp_path):
    import errno

    target = tmp_path / "emb.safetensors"
    with pytest.raises(mmzoo.MmzooError, match=f"cannot write {target}: No space left on device"):
        with files.atomic_path(target) as tmp:
            tmp.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary
    with pytest.raises(mmzoo.MmzooError, match="cannot write /proc/x.jsonl"):
        files.write_jsonl("/proc/x.jsonl", [{"a": 1}])
