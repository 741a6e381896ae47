"""Writing files whole: a temp file beside the target, then a rename, so a reader never sees a
partial file and a crash leaves the old one (or none) in place."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from mmzoo.errors import MmzooError


@contextlib.contextmanager
def atomic_path(path: str | Path, *, directory: bool = False) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to (a file, or a directory with ``directory=True``);
    renamed onto ``path`` when the block ends normally, removed if it raises."""
    path = Path(path)
    if not path.parent.is_dir():
        raise MmzooError(f"output directory {path.parent} does not exist")
    if directory:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    else:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        if directory and path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Write all rows as JSON lines, atomically."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_json(path: str | Path, obj, *, indent: int = 2) -> None:
    """Write one JSON document, atomically."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(obj, indent=indent, default=str) + "\n")
