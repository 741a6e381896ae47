"""Where mmzoo keeps files it builds (the embedded default checkpoint, compilation caches)."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$MMZOO_CACHE``, else ``~/.cache/mmzoo``."""
    path = Path(os.environ.get("MMZOO_CACHE") or Path.home() / ".cache" / "mmzoo")
    path.mkdir(parents=True, exist_ok=True)
    return path


ASSETS = Path(__file__).resolve().parent / "assets"
