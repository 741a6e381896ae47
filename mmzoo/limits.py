"""Per-request size limits, checked before any work: a server's request body and a ``requests=``
line before they are parsed, a prompt's text before it is tokenized, a request's media (how many,
their encoded bytes, their pixels from the files' headers) before anything is decoded.

Every limit is configurable (``limits.*`` in ``conf/limits/default.yaml``) and every refusal names
the limit, the request's number and the field, so one oversized request costs only itself: the
server answers it with 413 / 400 and the others go on; a batch run writes its error row and runs
the rest.

``max_prompt_chars: auto`` is derived from ``max_model_len``: no token of the tokenizer stands for
more than its longest vocabulary entry's characters, so a text longer than ``max_model_len`` times
that (times 4, for normalizers that merge characters) cannot fit, and is refused without being
tokenized.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from PIL import Image

from mmzoo.errors import MmzooError

MiB = 1 << 20
# A normalizer (NFC, NFKC) may merge a few characters into one before tokens are matched.
_NORMALIZE_SLACK = 4


@dataclass(frozen=True)
class Limits:
    """What one request may hold (see the module docstring); 0 or None: no limit.

    Attributes:
        max_request_bytes: a server request body / a ``requests=`` line, in bytes.
        max_prompt_chars: the characters of a request's text (prompt, or all messages' text);
            ``"auto"``: derived from ``max_model_len`` and the tokenizer (:func:`prompt_chars_bound`).
        max_media_items: images + videos + audios in one request.
        max_media_bytes: their encoded bytes together (files, ``data:`` URLs, an embeddings file;
            not objects already decoded).
        max_media_pixels: the pixels of a request's images and video frames together, read from
            the files' headers before anything is decoded.
    """

    max_request_bytes: int | None = 32 * MiB
    max_prompt_chars: int | str | None = "auto"
    max_media_items: int | None = 64
    max_media_bytes: int | None = 64 * MiB
    max_media_pixels: int | None = 2 * 89_478_485  # twice Pillow's one-image threshold: 0.5 GB as RGB

    @classmethod
    def from_config(cls, node: Any) -> "Limits":
        """From a ``limits`` config node (a mapping; None: the defaults); ``auto`` leaves a limit derived."""
        if node is None:
            return cls()
        values = dict(node)
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise MmzooError(f"limits: unknown field(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        out = {}
        for name, value in values.items():
            if value == "auto" and name == "max_prompt_chars":
                out[name] = value
                continue
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise MmzooError(f"limits.{name}={value!r} must be a whole number of "
                                 f"{'characters' if 'chars' in name else 'items' if 'items' in name else 'pixels' if 'pixels' in name else 'bytes'} "
                                 f"(0 or null: no limit){' or auto' if name == 'max_prompt_chars' else ''}")
            out[name] = value or None
        return cls(**out)


def prompt_chars_bound(tokenizer, max_model_len: int) -> int:
    """The most characters of text that could still fit in ``max_model_len`` tokens (see the module
    docstring): ``max_model_len`` x the longest vocabulary entry (added tokens too) x 4."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max_model_len * max(1, longest) * _NORMALIZE_SLACK


def request_text(request) -> tuple[int, int]:
    """The characters and UTF-8 bytes of a request's text: its prompt and its messages' text."""
    parts = [request.prompt]
    for msg in request.messages or []:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    chars = sum(len(p) for p in parts)
    return chars, sum(len(p.encode("utf-8", "surrogatepass")) for p in parts)


def check_request(request, limits: Limits, *, max_prompt_chars: int | None) -> None:
    """Refuse ``request`` if its text or media are over ``limits`` (``max_prompt_chars``: the limit
    in force, derived or configured). Reads only file sizes and image headers."""
    if max_prompt_chars:
        chars, nbytes = request_text(request)
        if chars > max_prompt_chars:
            how = "derived from max_model_len; set limits.max_prompt_chars to change it" \
                if limits.max_prompt_chars == "auto" else "limits.max_prompt_chars"
            raise MmzooError(f"the prompt's text is {chars} characters ({nbytes} bytes); a request may have at most "
                             f"{max_prompt_chars} ({how})")
    items = [("images", i, x) for i, x in enumerate(request.images or [])] + \
            [("videos", i, x) for i, x in enumerate(request.videos or [])] + \
            [("audios", i, x) for i, x in enumerate(request.audios or [])]
    if limits.max_media_items and len(items) > limits.max_media_items:
        counts = ", ".join(f"{len(getattr(request, k))} {k}" for k in ("images", "videos", "audios")
                           if getattr(request, k))
        raise MmzooError(f"the request has {len(items)} media items ({counts}); a request may have at most "
                         f"{limits.max_media_items} (limits.max_media_items)")
    if limits.max_media_bytes:
        total = sum(_nbytes(x) for _, _, x in items)
        if request.embeds is not None:
            total += _nbytes(request.embeds)
        if total > limits.max_media_bytes:
            raise MmzooError(f"the request's media are {total} bytes; a request may have at most "
                             f"{limits.max_media_bytes} (limits.max_media_bytes)")
    if limits.max_media_pixels:
        total = 0
        for kind, i, item in items:
            if kind != "audios":
                total += sum(_pixels(frame, all_frames=kind == "videos") for frame in _frames(kind, item))
            if total > limits.max_media_pixels:
                raise MmzooError(f"the request's images and video frames have {total} pixels or more (counted up to "
                                 f"{kind}[{i}]); a request may have at most {limits.max_media_pixels} "
                                 f"(limits.max_media_pixels)")


def _nbytes(item: Any) -> int:
    """An item's encoded bytes: a file's size, a ``bytes``' length (a ``data:`` URL's); a video: its
    frames'. Objects already decoded (PIL images, arrays, tensors: the Python API's) count 0 here;
    their pixels count in ``max_media_pixels``."""
    if isinstance(item, (bytes, bytearray)):
        return len(item)
    if isinstance(item, (list, tuple)):
        return sum(_nbytes(x) for x in item)
    if not isinstance(item, (str, Path)):
        return 0
    path = Path(str(item))
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        return path.stat().st_size
    except (OSError, ValueError):  # missing, unreadable, a NUL in the name: the loader names it
        return 0


def _frames(kind: str, item: Any) -> Iterator[Any]:
    """The images an item holds: itself for an image; a video's frames (a list, a 4-D array, a
    directory of frame files, or a GIF)."""
    if kind == "images":
        yield item
    elif isinstance(item, np.ndarray) and item.ndim == 4:
        yield from item
    elif isinstance(item, (list, tuple)):
        yield from item
    else:
        path = Path(str(item))
        try:
            frames = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        except (OSError, ValueError):  # the loader says why
            frames = []
        yield from frames


def _pixels(item: Any, *, all_frames: bool) -> int:
    """An image's pixels from its header (``all_frames``: of every frame of an animated file, a
    GIF video; an image is its first frame); 0 if it cannot be read (the loader then says why)."""
    if isinstance(item, np.ndarray):
        return int(np.prod(item.shape[:2])) if item.ndim >= 2 else 0
    if isinstance(item, Image.Image):
        return item.width * item.height
    source = item if isinstance(item, (bytes, bytearray)) else Path(str(item))
    try:
        if isinstance(source, Path) and not (source.is_file() and os.access(source, os.R_OK)):
            return 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as img:
                return img.width * img.height * (int(getattr(img, "n_frames", 1) or 1) if all_frames else 1)
    except Exception:  # noqa: BLE001 - not an image Pillow reads, a bomb it refuses: the loader says which
        return 0
