"""``python -m mmzoo.infer``: generate for one prompt or a file of requests.

Examples::

    python -m mmzoo.infer model=qwen2_vl checkpoint=DIR prompt='Describe this image.' \\
        'images=[a.png,b.png]' max_new_tokens=16 executor=xla attention=sdpa output=out.jsonl
    python -m mmzoo.infer checkpoint=DIR requests=reqs.jsonl output=out.jsonl
    python -m mmzoo.infer checkpoint=DIR requests=reqs.jsonl output=out.jsonl resume=true

A batch run is safe to leave overnight:

* every line of ``requests=`` is checked against the request schema (:class:`mmzoo.types.Request`)
  before any work; a bad line becomes an error row for its id and every other request runs;
* each result is appended to ``output=`` as one JSON line the moment it finishes (flushed, and
  fsync'd every ``sync_s`` seconds), so a crash or kill loses only the requests in flight; when
  the run completes, the file is rewritten atomically in request order;
* ``resume=true`` keeps the rows already in ``output=`` whose request is unchanged and runs the
  rest (a request changed under the same id runs again, and says so);
* the first Ctrl-C / SIGTERM admits no more requests, lets those in flight finish (at most
  ``drain_timeout_s``), prints ``k of n done`` and exits 130 / 143; a second one exits at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mmzoo.cli import hydra_main
from mmzoo.errors import MmzooError
from mmzoo.executor import Drain
from mmzoo.files import JsonlAppender, check_output_path, read_jsonl_rows, write_jsonl
from mmzoo.paths import ASSETS
from mmzoo.types import Request, Result

SAMPLING_FIELDS = ("max_new_tokens", "ignore_eos", "temperature", "top_k", "top_p", "seed")


@dataclass
class Line:
    """One request of the run: where it came from, its id, a digest of what it asks, and either the
    validated :class:`Request` or why it was refused."""

    line: int
    id: Any
    sha: str
    request: Request | None = None
    error: str | None = None

    @property
    def key(self) -> str:
        return json.dumps(self.id)


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_defaults(cfg: DictConfig) -> dict:
    """The sampling fields the command line sets for every request, checked by the schema (a bad
    one, e.g. ``max_new_tokens=abc``, stops the run before any work)."""
    values = {k: cfg[k] for k in SAMPLING_FIELDS}
    Request.parse(values, where="command line")
    return values


def read_requests(path: str | Path, defaults: dict, *, max_line_bytes: int | None = None) -> list[Line]:
    """One :class:`Line` per non-empty line of a JSON Lines file (split on ``\\n`` only, so a JSON
    string may hold U+2028 or U+0085): the line's fields over ``defaults``, validated by the request
    schema; the id defaults to the line number. A bad line (over ``max_line_bytes``, not UTF-8, not
    JSON, refused by the schema), or two lines with one id, is refused for that line only; a line
    whose id cannot be read gets none (``null``), so it never takes another request's id."""
    path = Path(path)
    if not path.is_file():
        raise MmzooError(f"requests file {path} does not exist")
    out: list[Line] = []
    try:
        with open(path, "rb") as f:
            for n, data in enumerate(f, start=1):
                item = _read_line(data, n, path.name, defaults, max_line_bytes)
                if item is not None:
                    out.append(item)
    except OSError as e:
        raise MmzooError(f"requests file {path} could not be read ({e.strerror or e})") from None
    first: dict[str, Line] = {}
    for item in out:
        if item.id is None:
            continue
        if item.key in first:
            other = first[item.key]
            msg = f"id {item.id!r} is given twice in {path.name}: lines {other.line} and {item.line}"
            for dup in (other, item):
                dup.request, dup.error = None, msg
        else:
            first[item.key] = item
    return out


def _read_line(data: bytes, n: int, name: str, defaults: dict, max_bytes: int | None) -> Line | None:
    """Line ``n`` of a requests file as a :class:`Line` (None when it is blank)."""
    where = f"{name}:{n}"
    data = data[:-1] if data.endswith(b"\n") else data
    if not data.strip(b" \t\r"):  # blank: JSON's whitespace only
        return None
    if max_bytes and len(data) > max_bytes:
        return Line(n, None, _sha(data.hex()), error=f"{where}: the line is {len(data)} bytes; a request may have at "
                                                     f"most {max_bytes} (limits.max_request_bytes)")
    try:
        raw = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return Line(n, None, _sha(data.hex()), error=f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line)")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, an integer of over 4300 digits
        msg = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply" if isinstance(
            e, RecursionError) else str(e)
        return Line(n, None, _sha(raw), error=f"{where}: not valid JSON ({msg})")
    if not isinstance(obj, dict):
        return Line(n, None, _sha(raw), error=f"{where}: a request line must be a JSON object, not {type(obj).__name__}")
    values = {**defaults, **obj}
    if values.get("id") is None:  # absent or null: the line number
        values["id"] = n
    rid = values["id"]
    rid = rid if isinstance(rid, (int, str)) and not isinstance(rid, bool) else None
    try:
        return Line(n, rid, _sha(values), request=Request.parse(values, where=where))
    except MmzooError as e:
        return Line(n, rid, _sha(values), error=str(e))


def check_output(cfg: DictConfig) -> Path | None:
    """``output=`` as a path, refused before any work when it cannot take the results."""
    if cfg.output is None:
        if cfg.get("resume"):
            raise MmzooError("resume=true needs output= (the file whose results to keep)")
        return None
    out = check_output_path(cfg.output)
    if cfg.requests is not None and Path(cfg.requests).exists() and out.exists() and \
            os.path.samefile(out, cfg.requests):
        raise MmzooError(f"output={out} is the requests file; writing results there would destroy it")
    return out


def _modalities(cfg: DictConfig) -> tuple[str, ...]:
    """The media kinds the configured family takes (its class's ``modalities``)."""
    from hydra.utils import get_class

    from mmzoo.models import Family

    cls = get_class(cfg.model.family._target_)
    return cls.modalities if issubclass(cls, Family) else ()


def _paths_of(items: list) -> list:
    """Media items as JSON: paths as strings (a video given as frames: a list of them); arrays as a note."""
    return [_paths_of(i) if isinstance(i, (list, tuple)) else str(i) if isinstance(i, (str, Path))
            else f"<{type(i).__name__}>" for i in items]


def _row(item: Line, result: Result | None) -> dict:
    """The output row of ``item``: its result (or error), its media paths, its line and digest."""
    if item.request is None or result is None:
        return {"id": item.id, "error": item.error, "line": item.line, "request_sha": item.sha}
    r = item.request
    row = {**result.to_json(), "images": _paths_of(r.images)}
    row.update({k: _paths_of(getattr(r, k)) for k in ("videos", "audios") if getattr(r, k)})
    return {**row, "line": item.line, "request_sha": item.sha}


class _Interrupted(Exception):
    """A second signal while the results are rewritten: the rewrite stops (its temporary file removed)."""


class _OutputFailed(Exception):
    """``output=`` could not be written (disk full, permissions): the run stops."""


class _Signals:
    """SIGINT / SIGTERM during a run, by what it is doing (:attr:`state`):

    * ``loading``: exit at once (nothing to keep);
    * ``generating``: the first signal sets the :class:`Drain` (admit no more, finish those in
      flight), a second exits at once (every finished row is on disk already);
    * ``writing`` (the final rewrite): the first signal is kept until the file is written whole,
      a second stops the rewrite (:class:`_Interrupted`; ``output=`` keeps its rows as they were).
    """

    def __init__(self, drain: Drain):
        self.drain, self.signum, self.state = drain, None, "loading"
        self._old: dict = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():  # only there can Python take signals
            self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        again = self.signum is not None
        if self.state == "writing":
            if again:
                raise _Interrupted(name)
            self.signum = signum
            print(f"\nmmzoo: {name}: finishing writing the results ({name} again stops now; the output file keeps "
                  f"its rows)", file=sys.stderr, flush=True)
            return
        if again or self.state == "loading":
            print(f"\nmmzoo: {name}: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)  # the rows written so far are flushed already
        self.signum = signum
        self.drain.set()
        print(f"\nmmzoo: {name}: admitting no more requests; finishing those in flight (at most "
              f"{self.drain.timeout_s:g} s; {name} again exits now)", file=sys.stderr, flush=True)

    @property
    def exit_code(self) -> int | None:
        return None if self.signum is None else 128 + self.signum


def _plan(lines: list[Line], done: dict[str, dict], out_path: Path | None, resume: bool) -> tuple[list[Line], dict]:
    """The lines to run and the rows kept from ``output=`` (by line): a row is kept when its
    request is unchanged and did not end in an error (resume retries those)."""
    todo, kept, retried = [], {}, 0
    for item in lines:
        row = done.get(item.key) if item.id is not None else None
        if row is not None and row.get("request_sha") == item.sha and "error" not in row:
            kept[item.line] = row
            continue
        if row is not None and "error" in row:
            retried += 1
        elif row is not None:
            print(f"mmzoo: request {item.id!r} changed since its result in {out_path} was written; "
                  f"running it again", file=sys.stderr)
        todo.append(item)
    if resume:
        print(f"mmzoo: resume: {len(kept)} of {len(lines)} requests already in {out_path}; running {len(todo)}"
              + (f" ({retried} of them ended in an error before)" if retried else ""), file=sys.stderr)
    return todo, kept


def run(cfg: DictConfig) -> list[dict]:
    """Build the pipeline from ``cfg``, run the requests, print and stream the results to ``output=``."""
    from mmzoo.engine import build
    from mmzoo.limits import Limits

    out_path = check_output(cfg)
    resume = bool(cfg.get("resume", False))
    defaults = run_defaults(cfg)
    limits = Limits.from_config(cfg.get("limits"))
    if cfg.requests is not None:
        lines = read_requests(cfg.requests, defaults, max_line_bytes=limits.max_request_bytes)
    else:
        images = cfg.images
        if images is None:
            default = OmegaConf.select(cfg, "model.default_checkpoint")
            embedded_demo = (default is not None and cfg.checkpoint == default and cfg.embeds is None
                             and "image" in _modalities(cfg))
            images = [str(ASSETS / "sample.png")] if embedded_demo else []
            if images:
                print(f"mmzoo: no images given; using the bundled sample image {images[0]}", file=sys.stderr)
        values = {"prompt": cfg.prompt, "images": [str(i) for i in images],
                  "videos": OmegaConf.to_container(cfg.videos) or [],
                  "audios": [str(a) for a in OmegaConf.to_container(cfg.audios) or []],
                  "embeds": cfg.embeds, "id": 0, **defaults}
        lines = [Line(0, 0, _sha(values), request=Request.parse(values, where="command line"))]

    done: dict[str, dict] = {}  # id -> the row already in output= (resume)
    if resume and out_path is not None and out_path.exists():
        done = {json.dumps(row.get("id")): row for row in read_jsonl_rows(out_path)}
    todo, kept = _plan(lines, done, out_path, resume)

    writer = JsonlAppender(out_path, append=resume, sync_s=float(cfg.get("sync_s", 2.0))) if out_path else None
    rows: dict[int, dict] = dict(kept)  # line -> row

    def progress() -> str:
        return (f"{len(rows)} of {len(lines)} requests done"
                + (f" (in {out_path}); rerun with resume=true to run the rest" if out_path else ""))

    def record(item: Line, result: Result | None) -> None:
        row = _row(item, result)
        if writer is not None:
            try:
                writer.write(row)
            except OSError as e:
                raise _OutputFailed(f"cannot write output={out_path}: {e.strerror or e}") from None
        rows[item.line] = row
        try:
            if "error" in row:
                who = f"request {item.id!r}: " if item.id is not None else ""  # else the error names its line
                print(f"error: {who}{row['error']}", file=sys.stderr, flush=True)
            else:
                print(result.text, flush=True)
        except BrokenPipeError:  # stdout piped into a reader that left (``| head``): output= still gets every row
            sys.stdout = open(os.devnull, "w")

    drain = Drain(timeout_s=float(cfg.get("drain_timeout_s", 60.0)))
    with _Signals(drain) as sig:
        runnable = [item for item in todo if item.request is not None]
        # towers are built only when some request has raw media: embeds-only and text-only runs skip them
        towers = any(item.request.images or item.request.videos or item.request.audios for item in runnable)
        engine = build(cfg, towers=towers, verbose=True) if runnable else None
        if engine is not None and not towers:
            print("mmzoo: no raw media in the requests; the encoder towers are not loaded", file=sys.stderr)
        if engine is not None:
            print(f"mmzoo: checkpoint {engine.checkpoint}", file=sys.stderr)
        sig.state = "generating"
        try:
            for item in todo:
                if item.request is None:
                    record(item, None)
            if engine is not None:
                by_key = {item.key: item for item in runnable}  # ids are unique: duplicates were refused
                if cfg.requests is None:  # one request: a bad one is the run's error (exit 1, nothing written)
                    (result,) = engine.generate([runnable[0].request], drain=drain)
                    if result.error is None:
                        record(runnable[0], result)
                    elif sig.exit_code is None:
                        raise MmzooError(result.error)
                else:
                    engine.generate([item.request for item in runnable], drain=drain,
                                    on_result=lambda res: record(by_key[json.dumps(res.id)], res))
        except _OutputFailed as e:
            raise MmzooError(f"{e}; {progress()}") from None
        finally:
            sig.state = "writing"
            if writer is not None:
                try:
                    writer.close()
                except OSError as e:
                    raise MmzooError(f"cannot write output={out_path}: {e.strerror or e}; {progress()}") from None
        if sig.exit_code is not None:
            print(f"mmzoo: {progress()}", file=sys.stderr, flush=True)
            sys.exit(sig.exit_code)

        ordered = [rows[item.line] for item in lines if item.line in rows]
        if out_path is not None:
            known = {item.key for item in lines}
            extra = [row for key, row in done.items() if key not in known]  # rows of ids no longer asked for
            try:
                write_jsonl(out_path, ordered + extra)  # in request order, atomically
            except (MmzooError, _Interrupted) as e:
                why = f"{e} during the rewrite" if isinstance(e, _Interrupted) else str(e)
                print(f"error: could not rewrite output={out_path} in request order ({why}); it holds every "
                      f"result (in the order they finished); rerun with resume=true to write it in order",
                      file=sys.stderr, flush=True)
                sys.exit(sig.exit_code or 1)
            print(f"mmzoo: wrote {len(ordered) + len(extra)} results to {out_path}", file=sys.stderr)
        if sig.exit_code is not None:
            sys.exit(sig.exit_code)
    if ordered and all("error" in row for row in ordered):
        raise MmzooError("every request failed")
    return ordered


main = hydra_main(run, "infer")


if __name__ == "__main__":
    main()
