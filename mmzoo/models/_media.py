"""Loading media given as paths (or already-loaded objects), with errors that name the field:
images and video frames with pillow, audio with librosa.

Not ``transformers.image_utils.load_image``: that one also fetches URLs (a server must never fetch
what a request names) and its errors do not say which item of which field failed."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
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


def load_audios(items: list[Any], sampling_rate: int, field: str = "audios") -> list[np.ndarray]:
    """Mono float32 clips at ``sampling_rate``: files are read and resampled with librosa; 1-D arrays
    are taken as already at that rate. Errors name the item."""
    import librosa

    clips = []
    for i, item in enumerate(items or []):
        name = f"{field}[{i}]"
        if isinstance(item, (np.ndarray, torch.Tensor)):
            clip = np.asarray(item.cpu() if isinstance(item, torch.Tensor) else item)
            if clip.ndim != 1 or clip.dtype.kind != "f":
                raise MmzooError(f"{name}: an audio array must be 1-D float samples at {sampling_rate} Hz, "
                                 f"got {clip.dtype} {list(clip.shape)}")
            where = "the array"
        else:
            path = Path(str(item))
            if not path.exists():
                raise MmzooError(f"{name}: audio file {path} does not exist")
            if not path.is_file():
                raise MmzooError(f"{name}: {path} is not a file")
            try:
                with warnings.catch_warnings():  # librosa warns before its fallback decoder; the error says it all
                    warnings.simplefilter("ignore")
                    clip, _ = librosa.load(str(path), sr=sampling_rate, mono=True)
            except Exception as e:  # soundfile, audioread and resampling errors have no common base
                raise MmzooError(f"{name}: {path} is not a readable audio file ({e.__class__.__name__})") from None
            where = str(path)
        if clip.size == 0:
            raise MmzooError(f"{name}: {where} is empty (no samples)")
        if not np.all(np.isfinite(clip)):
            raise MmzooError(f"{name}: {where} has non-finite samples")
        clips.append(clip.astype(np.float32))
    return clips
