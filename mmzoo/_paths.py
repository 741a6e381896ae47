"""Where mmzoo keeps files it builds (the embedded default checkpoint, compilation caches)."""

import os
import shutil
import sys
from pathlib import Path


def cache_dir() -> Path:
    """``$MMZOO_CACHE``, else ``~/.cache/mmzoo``."""
    path = Path(os.environ.get("MMZOO_CACHE") or Path.home() / ".cache" / "mmzoo")
    path.mkdir(parents=True, exist_ok=True)
    return path


ASSETS = Path(__file__).resolve().parent / "assets"


def cached_default(name: str, family: str, make) -> Path:
    """A random-weight checkpoint built once under the cache directory (until a trained one ships)."""
    path = cache_dir() / name
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        make(tmp, seed=0)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    print(f"mmzoo: WARNING: the embedded default {family} checkpoint has RANDOM weights "
          "(no trained checkpoint ships yet); its answers are meaningless", file=sys.stderr)
    return path
