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


def read_requests(path: str | Path, defaults: dict) -> list[Line]:
    """One :class:`Line` per non-empty JSONL line: the line's fields over ``defaults``, validated by
    the request schema; the id defaults to the line number. A bad line, or two lines with one id,
    is refused for that line only."""
    path = Path(path)
    if not path.is_file():
        raise MmzooError(f"requests file {path} does not exist")
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise MmzooError(f"requests file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    out: list[Line] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path.name}:{n}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            out.append(Line(n, n, _sha(raw), error=f"{where}: not valid JSON ({e.msg})"))
            continue
        values = {**defaults, "id": n, **obj} if isinstance(obj, dict) else obj
        rid = values.get("id", n) if isinstance(values, dict) else n
        rid = rid if isinstance(rid, (int, str)) and not isinstance(rid, bool) else n
        try:
            out.append(Line(n, rid, _sha(values), request=Request.parse(values, where=where)))
        except MmzooError as e:
            out.append(Line(n, rid, _sha(values), error=str(e)))
    first: dict[str, Line] = {}
    for item in out:
        if item.key in first:
            other = first[item.key]
            msg = f"id {item.id!r} is given twice in {path.name}: lines {other.line} and {item.line}"
            for dup in (other, item):
                dup.request, dup.error = None, msg
        else:
            first[item.key] = item
    return out


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


class _Signals:
    """SIGINT / SIGTERM during a run: before generation starts, exit at once (nothing to keep);
    during it, the first signal sets the :class:`Drain`, a second exits at once."""

    def __init__(self, drain: Drain):
        self.drain, self.signum, self.generating = drain, None, False
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
        if self.signum is not None or not self.generating:
            print(f"\nmmzoo: {name}: exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)  # the rows written so far are flushed already
        self.signum = signum
        self.drain.set()
        print(f"\nmmzoo: {name}: admitting no more requests; finishing those in flight (at most "
              f"{self.drain.timeout_s:g} s; {name} again exits now)", file=sys.stderr, flush=True)

    @property
    def exit_code(self) -> int | None:
        return None if self.signum is None else 128 + self.signum


def run(cfg: DictConfig) -> list[dict]:
    """Build the pipeline from ``cfg``, run the requests, print and stream the results to ``output=``."""
    from mmzoo.engine import build

    out_path = check_output(cfg)
    resume = bool(cfg.get("resume", False))
    defaults = run_defaults(cfg)
    if cfg.requests is not None:
        lines = read_requests(cfg.requests, defaults)
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
    todo, kept = [], {}
    for item in lines:
        row = done.get(item.key)
        if row is not None and row.get("request_sha") == item.sha:
            kept[item.line] = row
        else:
            if row is not None:
                print(f"mmzoo: request {item.id!r} changed since its result in {out_path} was written; "
                      f"running it again", file=sys.stderr)
            todo.append(item)
    if resume:
        print(f"mmzoo: resume: {len(kept)} of {len(lines)} requests already in {out_path}; running "
              f"{len(todo)}", file=sys.stderr)

    writer = JsonlAppender(out_path, append=resume, sync_s=float(cfg.get("sync_s", 2.0))) if out_path else None
    rows: dict[int, dict] = dict(kept)  # line -> row

    def record(item: Line, result: Result | None) -> None:
        rows[item.line] = row = _row(item, result)
        if writer is not None:
            writer.write(row)
        if "error" in row:
            print(f"error: request {item.id!r}: {row['error']}", file=sys.stderr, flush=True)
        else:
            print(result.text, flush=True)

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
        try:
            for item in todo:
                if item.request is None:
                    record(item, None)
            if engine is not None:
                sig.generating = True
                by_key = {item.key: item for item in runnable}  # ids are unique: duplicates were refused
                if cfg.requests is None:  # one request: a bad one is the run's error (exit 1, nothing written)
                    (result,) = engine.generate([runnable[0].request], stop=drain)
                    if result.error is None:
                        record(runnable[0], result)
                    elif sig.exit_code is None:
                        raise MmzooError(result.error)
                else:
                    engine.generate([item.request for item in runnable], stop=drain,
                                    on_result=lambda res: record(by_key[json.dumps(res.id)], res))
                sig.generating = False
        finally:
            if writer is not None:
                writer.close()
        if sig.exit_code is not None:
            print(f"mmzoo: {len(rows)} of {len(lines)} requests done"
                  + (f" (in {out_path}); rerun with resume=true to run the rest" if out_path else ""),
                  file=sys.stderr, flush=True)
            sys.exit(sig.exit_code)

    ordered = [rows[item.line] for item in lines if item.line in rows]
    if out_path is not None:
        known = {item.key for item in lines}
        extra = [row for key, row in done.items() if key not in known]  # rows of ids no longer asked for
        write_jsonl(out_path, ordered + extra)  # in request order, atomically
        print(f"mmzoo: wrote {len(ordered) + len(extra)} results to {out_path}", file=sys.stderr)
    if ordered and all("error" in row for row in ordered):
        raise MmzooError("every request failed")
    return ordered


main = hydra_main(run, "infer")


if __name__ == "__main__":
    main()
