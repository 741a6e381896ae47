"""Where mmzoo's files are: the assets it ships, and the cache of files it builds (benchmark
checkpoints, compilation caches)."""

import os
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"  # the embedded demo checkpoint and sample image


def cache_dir() -> Path:
    """``$MMZOO_CACHE``, else ``~/.cache/mmzoo``."""
    path = Path(os.environ.get("MMZOO_CACHE") or Path.home() / ".cache" / "mmzoo")
    path.mkdir(parents=True, exist_ok=True)
    return path
