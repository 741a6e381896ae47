"""Writing files whole: a temp file beside the target, then a rename, so a reader never sees a
partial file and a crash leaves the old one (or none) in place."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

from mmzoo.errors import MmzooError


@contextlib.contextmanager
def atomic_path(path: str | Path, *, directory: bool = False) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to (a file, or a directory with ``directory=True``);
    renamed onto ``path`` when the block ends normally, removed if it raises (an OSError, such as a
    full disk, becomes one :class:`MmzooError` naming ``path``)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise MmzooError(f"output directory {path.parent} does not exist")
    try:
        if directory:
            tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
        else:
            fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            tmp = Path(name)
    except OSError as e:
        raise MmzooError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        # mkstemp / mkdtemp make it private (0600 / 0700): give it the mode the file it replaces has,
        # or what the umask gives a new file, as open() would
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else (0o777 if directory else 0o666) & ~_umask())
        yield tmp
        if directory and path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):  # disk full, no permission: the file it was writing, one line
            raise MmzooError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def _umask() -> int:
    """The process's umask (read by setting it and setting it back, once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Write all rows as JSON lines, atomically."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_json(path: str | Path, obj, *, indent: int = 2) -> None:
    """Write one JSON document, atomically."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(obj, indent=indent, default=str) + "\n")


def check_output_path(path: str | Path, *, field: str = "output") -> Path:
    """``path`` as a file to write, refused before any work: not a directory, its folder existing,
    writable if it is there already."""
    path = Path(path)
    if path.is_dir():
        raise MmzooError(f"{field}={path} is a directory; give a file path (e.g. {path / 'results.jsonl'})")
    if not path.parent.is_dir():
        raise MmzooError(f"{field}={path}: the directory {path.parent} does not exist")
    if path.exists() and not os.access(path, os.W_OK):
        raise MmzooError(f"{field}={path} is not writable")
    return path


class JsonlAppender:
    """Results streamed to a JSONL file: each row one whole line, flushed as it is written and
    fsync'd at least every ``sync_s`` seconds and on :meth:`close`, so a kill loses at most the
    rows not yet written and leaves at most one incomplete last line (which :func:`read_jsonl_rows`
    ignores). The file is opened at the first row: a run that writes nothing leaves it as it was.

    Args:
        path: the file.
        append: keep the rows already there (a resumed run); an incomplete last line is cut off
            first. Otherwise the file is started afresh.
    """

    def __init__(self, path: str | Path, *, append: bool, sync_s: float = 2.0):
        self.path, self.append, self.sync_s = Path(path), append, sync_s
        self.rows = 0
        self._f = None
        self._synced = time.monotonic()

    def write(self, row: dict) -> None:
        line = json.dumps(row, default=str) + "\n"
        if self._f is None:
            if self.append and self.path.exists():
                drop_partial_line(self.path)
            self._f = open(self.path, "a" if self.append else "w")
        self._f.write(line)
        self._f.flush()
        self.rows += 1
        if time.monotonic() - self._synced >= self.sync_s:
            self.sync()

    def sync(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
        self._synced = time.monotonic()

    def close(self) -> None:
        if self._f is not None:
            self.sync()
            self._f.close()
            self._f = None


def drop_partial_line(path: Path) -> None:
    """Cut a last line that has no newline (a write cut off by a kill)."""
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)


def read_jsonl_rows(path: str | Path) -> list[dict]:
    """The complete rows of a JSONL file in file order; an incomplete last line (no newline) is
    ignored; any other line that is not a JSON object is an error naming it."""
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")[:-1]  # what follows the last newline is incomplete
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MmzooError(f"{path}:{n} is not a JSON line ({e}); not resuming over a damaged file") from None
        if not isinstance(row, dict):
            raise MmzooError(f"{path}:{n} is not a JSON object")
        rows.append(row)
    return rows
