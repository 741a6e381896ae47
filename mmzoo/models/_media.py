"""Loading media given as paths (or already-loaded objects), with errors that name the field:
images and video frames with pillow, audio with librosa.

Not ``transformers.image_utils.load_image``: that one also fetches URLs (a server must never fetch
what a request names) and its errors do not say which item of which field failed."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from mmzoo.errors import MmzooError

_FRAME_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif"}

# An image's size limits, checked from a file's header before it is decoded and for PIL images and
# arrays given directly; the message gives the size and the limit.
# A side of 1 pixel is a mistake (a tracking pixel, an array slice that lost an axis); the processors
# upscale anything larger (Qwen2-VL to its min_pixels, CLIP to its input side).
MIN_IMAGE_SIDE = 2
# Qwen2-VL's processor refuses more (smart_resize); CLIP's would keep only 1/ratio of the image.
MAX_ASPECT_RATIO = 200
# Pillow's default decompression-bomb threshold (Image.MAX_IMAGE_PIXELS): 0.25 GB as RGB.
MAX_IMAGE_PIXELS = 89_478_485


def load_image(item: Any, field: str) -> Image.Image:
    """A PIL RGB image from a path, the bytes of an image file (a server's ``data:`` URL), a PIL
    image or an ``[h, w, 3]`` uint8 array, within the size limits above."""
    if isinstance(item, (bytes, bytearray)):
        if not item:
            raise MmzooError(f"{field}: the image data is empty (0 bytes)")
        with _open_image(io.BytesIO(item), field, name="the image data") as img:
            return img.convert("RGB")
    if isinstance(item, Image.Image):
        _check_size(*item.size, field, "the image")
        return item.convert("RGB")
    if isinstance(item, np.ndarray):
        if item.ndim != 3 or item.shape[-1] != 3:
            raise MmzooError(f"{field}: an image array must be [height, width, 3], got {list(item.shape)}")
        _check_size(item.shape[1], item.shape[0], field, "the array")
        return Image.fromarray(item.astype(np.uint8))
    with _open_image(_file(item, field, "image file"), field) as img:
        return img.convert("RGB")  # decodes: a truncated file fails here


@contextlib.contextmanager
def _open_image(path: Path | io.BytesIO, field: str, name: str | None = None) -> Iterator[Image.Image]:
    """The opened image file, its size checked from the header before anything is decoded; the
    errors of opening and of decoding it (in the ``with`` body) name the item (``name``: how to
    call it in messages; the path by default)."""
    source, path = path, name or path
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # _check_size refuses it, with the size
            with Image.open(source) as img:
                _check_size(*img.size, field, str(path))
                yield img
    except Image.DecompressionBombError as e:  # over twice Pillow's threshold: Image.open refuses it itself
        raise MmzooError(f"{field}: {path} is too large to decode: {e}") from None
    except UnidentifiedImageError:
        raise MmzooError(f"{field}: {path} is not a readable image (not a format Pillow knows)") from None
    except OSError as e:
        raise MmzooError(f"{field}: {path} is not a readable image ({e})") from None


def _check_size(width: int, height: int, field: str, what: str) -> None:
    """Refuse an image outside MIN_IMAGE_SIDE, MAX_IMAGE_PIXELS and MAX_ASPECT_RATIO."""
    size = f"{field}: {what} is {width}x{height} pixels"
    short, long = sorted((width, height))
    if short < MIN_IMAGE_SIDE:
        raise MmzooError(f"{size}; the shortest side must be at least {MIN_IMAGE_SIDE}")
    if width * height > MAX_IMAGE_PIXELS:
        raise MmzooError(f"{size} ({width * height}); an image may have at most {MAX_IMAGE_PIXELS} pixels")
    if long > MAX_ASPECT_RATIO * short:
        raise MmzooError(f"{size}, an aspect ratio of {long / short:.0f}:1; it may be at most {MAX_ASPECT_RATIO}:1")


def _file(item: Any, field: str, what: str) -> Path:
    """``item`` as the path of an existing, non-empty file."""
    path = Path(str(item))
    if not path.exists():
        raise MmzooError(f"{field}: {what} {path} does not exist")
    if not path.is_file():
        raise MmzooError(f"{field}: {path} is not a file")
    if path.stat().st_size == 0:
        raise MmzooError(f"{field}: {what} {path} is empty (0 bytes)")
    return path


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
        videos.append(_one_size([load_image(f, f"{name}[{j}]") for j, f in enumerate(frames)], name))
    return videos


def _one_size(frames: list[Image.Image], field: str) -> list[Image.Image]:
    """``frames``, refused unless all have the first one's size (the video processor stacks them)."""
    w, h = frames[0].size
    for j, frame in enumerate(frames):
        if frame.size != (w, h):
            raise MmzooError(f"{field}[{j}] is {frame.width}x{frame.height} pixels but {field}[0] is {w}x{h}: "
                             f"a video's frames must have one size")
    return frames


def _gif_frames(path: Path, field: str) -> list[Image.Image]:
    """Every frame of an animated GIF (pillow reads it; no video decoder needed)."""
    from PIL import ImageSequence

    with _open_image(path, field) as img:
        return [frame.convert("RGB") for frame in ImageSequence.Iterator(img)]


def load_audios(items: list[Any], sampling_rate: int, field: str = "audios") -> list[np.ndarray]:
    """Mono float32 clips at ``sampling_rate``: files are read and resampled with librosa; 1-D arrays
    are taken as already at that rate. Errors name the item."""
    clips = []
    for i, item in enumerate(items or []):
        name = f"{field}[{i}]"
        if isinstance(item, (np.ndarray, torch.Tensor)):
            clip = np.asarray(item.cpu() if isinstance(item, torch.Tensor) else item)
            if clip.ndim != 1 or clip.dtype.kind != "f":
                raise MmzooError(f"{name}: an audio array must be 1-D float samples at {sampling_rate} Hz, "
                                 f"got {clip.dtype} {list(clip.shape)}")
            where = "the array"
        elif isinstance(item, (bytes, bytearray)):  # an encoded file (wav, flac, ogg: what soundfile reads)
            if not item:
                raise MmzooError(f"{name}: the audio data is empty (0 bytes)")
            clip = _read_audio(io.BytesIO(item), sampling_rate, name, "the audio data")
            where = "the audio data"
        else:
            path = _file(item, name, "audio file")
            clip = _read_audio(str(path), sampling_rate, name, str(path))
            where = str(path)
        if clip.size == 0:
            raise MmzooError(f"{name}: {where} is empty (no samples)")
        if not np.all(np.isfinite(clip)):
            raise MmzooError(f"{name}: {where} has non-finite samples")
        clips.append(clip.astype(np.float32))
    return clips


def _read_audio(source, sampling_rate: int, field: str, what: str) -> np.ndarray:
    """Mono samples at ``sampling_rate`` (librosa reads and resamples), or an error naming ``what``."""
    import librosa

    try:
        with warnings.catch_warnings():  # librosa warns before its fallback decoder; the error says it all
            warnings.simplefilter("ignore")
            clip, _ = librosa.load(source, sr=sampling_rate, mono=True)
    except Exception as e:  # soundfile, audioread and resampling errors have no common base
        raise MmzooError(f"{field}: {what} is not a readable audio file ({e.__class__.__name__})") from None
    return clip
