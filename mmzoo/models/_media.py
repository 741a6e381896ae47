"""Loading media given as paths (or already-loaded objects), with errors that name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from mmzoo.errors import MmzooError

_FRAME_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif"}


def load_image(item: Any, field: str) -> Image.Image:
    """A PIL RGB image from a path, a PIL image or an ``[h, w, 3]`` uint8 array."""
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, np.ndarray):
        if item.ndim != 3 or item.shape[-1] != 3:
            raise MmzooError(f"{field}: an image array must be [height, width, 3], got {list(item.shape)}")
        return Image.fromarray(item.astype(np.uint8))
    path = Path(str(item))
    if not path.exists():
        raise MmzooError(f"{field}: image file {path} does not exist")
    if not path.is_file():
        raise MmzooError(f"{field}: {path} is not a file")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise MmzooError(f"{field}: {path} is not a readable image ({e.__class__.__name__})") from None


def load_images(items: list[Any], field: str = "images") -> list[Image.Image]:
    return [load_image(item, f"{field}[{i}]") for i, item in enumerate(items or [])]


def load_videos(items: list[Any], field: str = "videos") -> list[list[Image.Image]]:
    """Each video as a list of RGB frames: a list of frames (paths, images or arrays), a
    ``[frames, h, w, 3]`` array, or a directory of frame images (sorted by name)."""
    videos = []
    for i, item in enumerate(items or []):
        name = f"{field}[{i}]"
        if isinstance(item, np.ndarray) and item.ndim == 4:
            frames = list(item)
        elif isinstance(item, (list, tuple)):
            frames = list(item)
        else:
            path = Path(str(item))
            if not path.exists():
                raise MmzooError(f"{name}: video {path} does not exist")
            if path.is_file() and path.suffix.lower() == ".gif":
                frames = _gif_frames(path, name)
            elif not path.is_dir():
                raise MmzooError(f"{name}: {path} is neither a directory of frames nor a .gif (other video files "
                                 f"need a decoder mmzoo does not install; pass the frames as images)")
            else:
                frames = sorted(p for p in path.iterdir() if p.suffix.lower() in _FRAME_SUFFIXES)
        if not frames:
            raise MmzooError(f"{name}: the video has no frames")
        videos.append([load_image(f, f"{name}[{j}]") for j, f in enumerate(frames)])
    return videos


def _gif_frames(path: Path, field: str) -> list[Image.Image]:
    """Every frame of an animated GIF (pillow reads it; no video decoder needed)."""
    from PIL import ImageSequence

    try:
        with Image.open(path) as img:
            return [frame.convert("RGB") for frame in ImageSequence.Iterator(img)]
    except (UnidentifiedImageError, OSError) as e:
        raise MmzooError(f"{field}: {path} is not a readable GIF ({e.__class__.__name__})") from None
