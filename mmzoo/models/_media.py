"""Loading media given as paths (or already-loaded objects), with errors that name the field:
images and video frames with pillow, to the pixels transformers gives for the same input (its own
functions do the converting); audio with librosa.

The reference is what a transformers user writes: ``transformers.image_utils.load_image(path)``,
then the processor (``AutoProcessor`` picks the fast, torchvision image processors here; the slow PIL
ones convert the same way), then ``generate``. Per kind of input:

* a file (a path, the bytes of a server's ``data:`` URL, a video's frame file): ``load_image``, called
  on the opened file: the EXIF orientation applied, then Pillow's ``convert("RGB")``. That drops an
  alpha channel (RGBA, LA, an APNG; a palette's per-entry alpha): a transparent pixel shows the colour
  stored under it (often black), not white. A single transparent colour (a palette's or a GIF's
  transparent index, a PNG's tRNS colour) survives as ``info["transparency"]``, and the image
  processor's ``convert_to_rgb`` composites every pixel of that colour onto white; the video
  processor takes a frame's pixels as they are, so a video frame loses it too.
* a PIL image object: what the image processors do with it (``do_convert_rgb``):
  ``transformers.image_transforms.convert_to_rgb``, transparency composited onto white, no EXIF
  rotation. A video's RGB frame object: its pixels, as the video processor takes them (that processor
  refuses frames of other modes, or reads YCbCr's channels as RGB: mmzoo converts those as images).
* an ``[h, w, 3]`` uint8 array: as it is.
* a .gif video: pillow's composed frames (no video decoder is installed to compare with), each
  through ``load_image`` as an image object.

Where transformers loses information mmzoo does the same, and prints one line to stderr naming the
field, the mode and what is lost:

* a transparent image whose transparency is dropped (above);
* 16-bit and 32-bit grayscale (modes ``I;16``, ``I``) with values past 0..255: clipped, not scaled (a
  16-bit photo turns mostly white); float (mode ``F``): truncated and clipped to integers 0..255;
* an animated GIF / APNG given as an image: its first frame only (as a video, a .gif gives them all);
* a PIL image object with an EXIF orientation: not rotated.

Modes 1, L, P, CMYK and YCbCr go through Pillow's conversions as in transformers (a CMYK
file's ICC profile is ignored there too); mode ``La`` is refused (Pillow cannot convert it).

Not ``transformers.image_utils.load_image`` on what a request names: that one also fetches URLs (a
server must never fetch what a request names) and its errors do not say which item of which field
failed."""

from __future__ import annotations

import contextlib
import io
import sys
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
    image or an ``[h, w, 3]`` uint8 array, within the size limits above, with the pixels transformers
    gives for it (see the module docstring); a line on stderr says what transformers loses of it."""
    image, lost = _load(item, field)
    if lost:
        _warn(field, lost)
    return image


def _load(item: Any, field: str, *, video: bool = False) -> tuple[Image.Image, list[str]]:
    """``item`` decoded as an image (or, ``video``, as a video's frame) and what is lost of it."""
    if isinstance(item, (bytes, bytearray)):
        if not item:
            raise MmzooError(f"{field}: the image data is empty (0 bytes)")
        with _open_image(io.BytesIO(item), field, name="the image data") as img:
            return _from_file(img, field, "the image data", video=video)
    if isinstance(item, Image.Image):
        _check_size(*item.size, field, "the image")
        return _from_object(item, field, video=video)
    if isinstance(item, np.ndarray):
        if item.ndim != 3 or item.shape[-1] != 3:
            raise MmzooError(f"{field}: an image array must be [height, width, 3], got {list(item.shape)}")
        _check_size(item.shape[1], item.shape[0], field, "the array")
        return Image.fromarray(item.astype(np.uint8)), []
    path = _file(item, field, "image file")
    with _open_image(path, field) as img:
        return _from_file(img, field, str(path), video=video)  # decodes: a truncated file fails here


def _from_file(img: Image.Image, field: str, what: str, *, video: bool) -> tuple[Image.Image, list[str]]:
    """An opened image file as ``transformers.image_utils.load_image(path)`` gives it (that function,
    on the opened file: EXIF orientation applied, then ``convert("RGB")``, which keeps a transparent
    colour as ``info["transparency"]`` for the image processor's ``convert_to_rgb``)."""
    from transformers.image_utils import load_image as hf_load_image

    lost = _lost_file(img, video=video)
    try:
        with warnings.catch_warnings():  # a palette's per-entry alpha: Pillow's word for what _lost_file says
            warnings.filterwarnings("ignore", "Palette images with Transparency expressed in bytes", UserWarning)
            return hf_load_image(img), lost
    except ValueError as e:  # a mode Pillow cannot convert to RGB (La): transformers fails the same way
        raise MmzooError(f"{field}: {what} is a mode {img.mode} image, which transformers cannot read as RGB "
                         f"({e})") from None


def _from_object(img: Image.Image, field: str, *, video: bool) -> tuple[Image.Image, list[str]]:
    """A PIL image object as the image processors convert it (``do_convert_rgb``):
    ``transformers.image_transforms.convert_to_rgb``, transparency composited onto white. A video's
    RGB frame as the video processor takes it: its pixels (the processor ignores ``info``)."""
    from transformers.image_transforms import convert_to_rgb

    try:
        lost = _lost_clipped(img)
        if (orientation := img.getexif().get(0x0112, 1)) != 1:  # 0x0112: Orientation
            lost.append(f"the image object's EXIF orientation ({orientation}) is not applied, as transformers' "
                        f"processors do not apply it; pass the file's path (read upright) or apply "
                        f"PIL.ImageOps.exif_transpose first")
        if video and img.mode == "RGB":
            return Image.fromarray(np.asarray(img)), lost
        return Image.fromarray(convert_to_rgb(img, return_numpy=True)), lost
    except ValueError as e:
        raise MmzooError(f"{field}: the image is a mode {img.mode} image, which transformers cannot read as RGB "
                         f"({e})") from None
    except OSError as e:  # a lazily opened file that fails to decode
        raise MmzooError(f"{field}: the image is not readable ({e})") from None


def _lost_file(img: Image.Image, *, video: bool, frame: bool = False) -> list[str]:
    """What transformers' reading of an image file loses (mmzoo reads it the same way), one phrase
    each: clipped pixels, dropped transparency, the frames after the first (unless ``frame``: one of
    a .gif video's frames). An image's single transparent colour (a palette index, a PNG's tRNS
    colour) is not lost: the image processor composites it onto white; a ``video`` frame's is (the
    video processor takes the pixels as they are)."""
    lost = _lost_clipped(img)
    if _has_transparent_pixels(img):
        key = img.info.get("transparency")
        keyed = img.mode not in _ALPHA_MODES and key is not None and not isinstance(key, bytes)
        if video or not keyed:
            how = "" if key is None else " with palette alpha" if isinstance(key, bytes) else \
                " with a transparent colour"
            lost.append(f"a transparent image (mode {img.mode}{how}) loses its transparency as transformers "
                        f"drops it{' from a video frame' if video else ''}: transparent pixels show the colour "
                        f"stored under them (often black); composite it onto a background first")
    if not frame and getattr(img, "is_animated", False):
        lost.append(f"an animated {img.format} image is read as its first frame only, as transformers' load_image "
                    f"reads it; pass the frames as a video to use them all")
    return lost


def _lost_clipped(img: Image.Image) -> list[str]:
    """Deep grayscale and float pixels: Pillow's ``convert("RGB")`` clips them to 0..255."""
    if img.mode.startswith("I"):
        low, high = img.getextrema()
        if low < 0 or high > 255:
            depth = "a 16-bit" if img.mode.startswith("I;16") else "a 32-bit"
            return [f"{depth} grayscale image (mode {img.mode}, values {low}..{high}) is clipped to 0..255, not "
                    f"scaled, as transformers does; scale it to 8 bits first"]
    elif img.mode == "F":
        return ["a float image (mode F) is truncated and clipped to integers 0..255, not scaled, as transformers "
                "does; scale it to 8 bits first"]
    return []


_ALPHA_MODES = ("LA", "La", "PA", "RGBA", "RGBa")


def _has_transparent_pixels(img: Image.Image) -> bool:
    """Whether some pixel of ``img`` is not fully opaque (alpha channel, palette alpha or a
    transparency entry), read without an RGBA copy where the histogram tells."""
    if img.mode == "P" and img.palette is None and "transparency" not in img.info:
        return False  # a palette image without its palette (a PNG with no PLTE chunk): Pillow's check asserts
    if not img.has_transparency_data:
        return False
    if img.mode in _ALPHA_MODES:
        return img.getchannel(img.mode[-1]).getextrema()[0] < 255
    key = img.info.get("transparency")
    if img.mode in ("P", "L") and isinstance(key, int):
        return img.histogram()[key] > 0
    if img.mode == "P" and isinstance(key, bytes):  # per-palette-entry alpha (a PNG tRNS chunk)
        return any(count and alpha < 255 for count, alpha in zip(img.histogram(), key))
    return img.convert("RGBA").getchannel("A").getextrema()[0] < 255


def _warn(field: str, lost: list[str]) -> None:
    print(f"mmzoo: warning: {field}: {'; '.join(lost)}", file=sys.stderr)


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
    try:
        if not path.exists():
            raise MmzooError(f"{field}: {what} {path} does not exist")
        if not path.is_file():
            raise MmzooError(f"{field}: {path} is not a file")
        if path.stat().st_size == 0:
            raise MmzooError(f"{field}: {what} {path} is empty (0 bytes)")
    except (OSError, ValueError) as e:  # a NUL byte, a name too long, no permission
        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise MmzooError(f"{field}: {what} {str(path)[:200]!r} cannot be read ({why})") from None
    return path


def load_images(items: list[Any], field: str = "images") -> list[Image.Image]:
    return [load_image(item, f"{field}[{i}]") for i, item in enumerate(items or [])]


def load_videos(items: list[Any], field: str = "videos") -> list[list[Image.Image]]:
    """Each video as a list of RGB frames: a list of frames (paths, images or arrays), a
    ``[frames, h, w, 3]`` array, a directory of frame images (sorted by name) or a .gif; each frame
    read as :func:`load_image` reads an image, what is lost said once per video."""
    videos = []
    for i, item in enumerate(items or []):
        name = f"{field}[{i}]"
        lost: list[str] = []
        if isinstance(item, np.ndarray) and item.ndim == 4:
            frames = list(item)
        elif isinstance(item, (list, tuple)):
            frames = list(item)
        else:
            path = Path(str(item))
            if not path.exists():
                raise MmzooError(f"{name}: video {path} does not exist")
            if path.is_file() and path.suffix.lower() == ".gif":
                frames, lost = _gif_frames(path, name)
            elif not path.is_dir():
                raise MmzooError(f"{name}: {path} is neither a directory of frames nor a .gif (other video files "
                                 f"need a decoder mmzoo does not install; pass the frames as images)")
            else:
                frames = sorted(p for p in path.iterdir() if p.suffix.lower() in _FRAME_SUFFIXES)
        if not frames:
            raise MmzooError(f"{name}: the video has no frames")
        decoded = []
        for j, frame in enumerate(frames):
            image, more = _load(frame, f"{name}[{j}]", video=True)
            decoded.append(image)
            lost += [x for x in more if x not in lost]
        if lost:
            _warn(name, lost)
        videos.append(_one_size(decoded, name))
    return videos


def _one_size(frames: list[Image.Image], field: str) -> list[Image.Image]:
    """``frames``, refused unless all have the first one's size (the video processor stacks them)."""
    w, h = frames[0].size
    for j, frame in enumerate(frames):
        if frame.size != (w, h):
            raise MmzooError(f"{field}[{j}] is {frame.width}x{frame.height} pixels but {field}[0] is {w}x{h}: "
                             f"a video's frames must have one size")
    return frames


def _gif_frames(path: Path, field: str) -> tuple[list[Image.Image], list[str]]:
    """Every frame of an animated GIF as RGB (pillow composes them; no video decoder needed), each
    converted by ``transformers.image_utils.load_image`` as an image object, and what is lost."""
    from PIL import ImageSequence
    from transformers.image_utils import load_image as hf_load_image

    frames: list[Image.Image] = []
    lost: list[str] = []
    with _open_image(path, field) as img:
        for frame in ImageSequence.Iterator(img):
            lost += [x for x in _lost_file(frame, video=True, frame=True) if x not in lost]
            frames.append(hf_load_image(frame))
    return frames, lost


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
