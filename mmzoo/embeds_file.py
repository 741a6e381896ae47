"""The safetensors file ``mmzoo.encode`` writes: embeddings, their layout (grid_thw, lengths) and what made them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mmzoo.errors import MmzooError
from mmzoo.files import atomic_path

FORMAT = "mmzoo.embeds/1"
TENSOR_FIELDS = ("image_embeds", "image_grid_thw", "video_embeds", "video_grid_thw", "video_timestamps", "audio_embeds",
                 "audio_lengths")


def fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over the names, dtypes, shapes and bytes of the encoder and adapter weights
    (:class:`mmzoo._weights.Fingerprint`: the loader computes the same one as it reads them)."""
    from mmzoo._weights import Fingerprint

    fp = Fingerprint()
    for name, t in weights.items():
        fp.add(name, t)
    return fp.hexdigest()


def write(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write atomically: a temp file in the same directory, then rename."""
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": FORMAT, **metadata})


def read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of an embeddings file, with a clear error for anything else: not a
    safetensors file, not written by ``mmzoo.encode``, unknown tensors, metadata missing or
    malformed (model, fingerprint, lm_hidden_size), no embeddings, a layout without its embeddings,
    audio embeddings without each clip's length. The rows' consistency with the layout and the LM
    is checked where the request is prepared (:mod:`mmzoo.models._embeds`, the family)."""
    path = Path(path)
    if not path.is_file():
        raise MmzooError(f"embeds file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise MmzooError(f"embeds file {path} is not a safetensors file ({e})") from None
    if meta.get("format") != FORMAT:
        raise MmzooError(f"embeds file {path} was not written by mmzoo.encode (format {meta.get('format')!r})")
    unknown = sorted(set(tensors) - set(TENSOR_FIELDS))
    if unknown:
        raise MmzooError(f"embeds file {path} has unknown tensors {unknown}")
    for key in ("model", "fingerprint"):
        if not meta.get(key):
            raise MmzooError(f"embeds file {path} has no {key} in its metadata (mmzoo.encode writes it)")
    hidden = meta.get("lm_hidden_size")
    if hidden is None:
        raise MmzooError(f"embeds file {path} has no lm_hidden_size in its metadata (mmzoo.encode writes it)")
    if not (hidden.isascii() and hidden.isdigit() and int(hidden) > 0):
        raise MmzooError(f"embeds file {path}: metadata lm_hidden_size={hidden!r} must be a positive integer")
    if not any(k.endswith("_embeds") for k in tensors):
        raise MmzooError(f"embeds file {path} holds no embeddings (image_embeds, video_embeds or audio_embeds)")
    for emb, layout in (("image_embeds", "image_grid_thw"), ("video_embeds", "video_grid_thw"),
                        ("video_embeds", "video_timestamps"), ("audio_embeds", "audio_lengths")):
        if layout in tensors and emb not in tensors:
            raise MmzooError(f"embeds file {path} has {layout} but no {emb}")
    if "audio_embeds" in tensors and "audio_lengths" not in tensors:  # without it the clips would run together
        raise MmzooError(f"embeds file {path} has audio_embeds but no audio_lengths (each clip's rows, which "
                         f"mmzoo.encode writes)")
    return tensors, meta


def describe(meta: dict[str, str]) -> str:
    return json.dumps({k: meta[k] for k in ("model", "checkpoint", "dtype") if k in meta})
