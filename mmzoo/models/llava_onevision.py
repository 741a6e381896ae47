"""LLaVA-OneVision's own part: anyres tiles, the packing of each item's features, the video pooling.

Li et al., 2024, "LLaVA-OneVision: Easy Visual Task Transfer" (arXiv:2408.03326). Checkpoints:
``LlavaOnevisionForConditionalGeneration``. The modules are components
(``conf/model/llava_onevision.yaml``: the ``siglip_vit`` encoder read at its last block, the
``packed_projector`` adapter, the ``qwen2`` LM). What is the family's own, all on the host:

* tiles: the checkpoint's image processor picks each image's grid among ``image_grid_pinpoints``
  and cuts it into tiles beside a base view of the whole image (a prompt of several images: the
  base view alone, padded square); a video's frames are items of one call. The tower runs whole
  tiles, so its XLA buckets are tile counts (:class:`~mmzoo.models.family.SquareItems`).
* packing (transformers' ``pack_image_features`` / ``apply_pooling``): the base view's features,
  then the grid's feature map with the padding's rows or columns cut off (unpadding), shrunk
  bilinearly when it holds more than ``1.1^2 x N`` tiles' features (``anyres_max_N``), each row
  ended by the learned ``image_newline``; a video's frames each shrunk 2x bilinearly, one
  ``image_newline`` after the last. :func:`pack_image` / :func:`pack_video` give every output row
  its (at most) four feature rows and weights, which the adapter blends
  (:class:`~mmzoo.adapters.PackedProjector`); a call of ``k`` tiles has room for ``k * (t + s)``
  rows (``t = s * s`` features a tile), more than any item packs into (an image of a grid of ``g``
  tiles, ``r`` of them a column, packs at most ``t + g t + r s``; a video of ``f`` frames ``f ceil(s / 2)^2 + 1``).
* placeholders: ``<image>`` / ``<video>``, one per packed row, counted by the processor's own
  ``replace_image_token`` / ``replace_video_token`` (checked against the packing).
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch

from mmzoo.encoders import CLIP_RENAMES
from mmzoo.errors import MmzooError
from mmzoo.models._embeds import as_grid, embeds_media
from mmzoo.models._media import load_images, load_videos
from mmzoo.models.family import Media, SquareItems, extend_tp_plan, lm_key
from mmzoo.types import TowerInput

NEWLINE = 0  # the packing's row of the learned image_newline (feature row i is 1 + i)
PACK_FLOAT32 = frozenset({"pack_weight"})  # the blend weights reach the adapter in float32 in any run dtype


def _taps(rows: list[np.ndarray], weights: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate(rows).astype(np.int64), np.concatenate(weights).astype(np.float32)


def _one(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Output rows that copy feature rows ``index`` (``[n]``): ``[n, 4]`` taps and weights."""
    taps = np.zeros((len(index), 4), np.int64)
    taps[:, 0] = index
    weights = np.zeros((len(index), 4), np.float32)
    weights[:, 0] = 1.0
    return taps, weights


def _bilinear(size: int, out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One axis of ``F.interpolate(mode="bilinear", align_corners=False)`` from ``size`` to ``out``
    samples, in float32 as PyTorch's CPU kernel: the two source indices and weights per output."""
    scale = np.float32(size) / np.float32(out)
    src = np.maximum(scale * (np.arange(out, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5), np.float32(0))
    i0 = src.astype(np.int64)
    i1 = i0 + (i0 < size - 1)
    w1 = src - i0.astype(np.float32)
    return i0, i1, np.float32(1) - w1, w1


def _resized(grid: np.ndarray, out_h: int, out_w: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps of ``grid [h, w]`` (feature rows) resized to ``out_h x out_w``: ``[out_h, out_w, 4]``
    rows and weights (the taps (y0, x0), (y0, x1), (y1, x0), (y1, x1))."""
    h0, h1, hw0, hw1 = _bilinear(grid.shape[0], out_h)
    x0, x1, xw0, xw1 = _bilinear(grid.shape[1], out_w)
    rows = np.stack([grid[h0][:, x0], grid[h0][:, x1], grid[h1][:, x0], grid[h1][:, x1]], -1)
    weights = np.stack([hw0[:, None] * xw0, hw0[:, None] * xw1, hw1[:, None] * xw0, hw1[:, None] * xw1], -1)
    return rows, weights.astype(np.float32)


def unpadded(height: int, width: int, grid_h: int, grid_w: int) -> tuple[slice, slice]:
    """The rows and columns of a ``grid_h x grid_w`` feature map of a ``height x width`` image (resized
    into the map keeping its aspect ratio, centred) that cover the image (transformers' ``unpad_image``)."""
    if width / height > grid_w / grid_h:
        new = int(round(height * (grid_w / width), 7))
        pad = (grid_h - new) // 2
        return slice(pad, grid_h - pad), slice(0, grid_w)
    new = int(round(width * (grid_h / height), 7))
    pad = (grid_w - new) // 2
    return slice(0, grid_h), slice(pad, grid_w - pad)


def pack_image(size: tuple[int, int], tiles_hw: tuple[int, int], side: int, max_tiles: int,
               multi: bool) -> tuple[np.ndarray, np.ndarray]:
    """Taps of one image's packed rows (feature row ``1 + tile * side^2 + patch`` of its call, tile 0
    the base view).

    Args:
        size: the image's ``(height, width)`` in pixels.
        tiles_hw: its grid's tiles ``(rows, columns)`` (the base view is not among them).
        side: patches per tile side.
        max_tiles: ``N`` of ``anyres_max_N``.
        multi: a prompt of several images: the base view and one newline only.

    Returns:
        ``[rows, 4]`` taps and weights: the base view's ``side^2`` rows, then the grid's map row by
        row, each ending with the newline (multi: the newline alone).
    """
    t = side * side
    base = _one(1 + np.arange(t))
    if multi:
        return _taps([base[0], _one(np.array([NEWLINE]))[0]], [base[1], _one(np.array([NEWLINE]))[1]])
    th, tw = tiles_hw
    y, x = np.meshgrid(np.arange(th * side), np.arange(tw * side), indexing="ij")  # the grid's feature map
    feature = 1 + (1 + (y // side) * tw + x // side) * t + (y % side) * side + x % side  # [th*side, tw*side]
    rows_sel, cols_sel = unpadded(size[0], size[1], th * side, tw * side)
    feature = feature[rows_sel, cols_sel]
    h, w = feature.shape
    ratio = math.sqrt(h * w / (max_tiles * side ** 2))
    if ratio > 1.1:
        taps, weights = _resized(feature, int(h // ratio), int(w // ratio))  # [h', w', 4]
    else:
        taps, weights = _one(feature.reshape(-1))
        taps, weights = taps.reshape(h, w, 4), weights.reshape(h, w, 4)
    nl_taps, nl_weights = _one(np.full(taps.shape[0], NEWLINE))
    taps = np.concatenate([taps, nl_taps[:, None]], 1).reshape(-1, 4)  # each row ends with the newline
    weights = np.concatenate([weights, nl_weights[:, None]], 1).reshape(-1, 4)
    return _taps([base[0], taps], [base[1], weights])


def pack_video(frames: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Taps of one video's packed rows: each frame's ``side x side`` map shrunk to
    ``ceil(side / 2)`` a side (bilinear), frame after frame, then one newline."""
    t, pooled = side * side, math.ceil(side / 2)
    parts, weights = [], []
    for f in range(frames):
        taps, w = _resized(1 + f * t + np.arange(t).reshape(side, side), pooled, pooled)
        parts.append(taps.reshape(-1, 4))
        weights.append(w.reshape(-1, 4))
    nl = _one(np.array([NEWLINE]))
    return _taps(parts + [nl[0]], weights + [nl[1]])


class LlavaOnevision(SquareItems):
    """LLaVA-OneVision: images (anyres tiles) and videos through SigLIP, packed by the projector.

    Args:
        name: the conf option name.
        image_token_id, video_token_id: the placeholders (``config.json``).
        image_size, patch_size, in_channels: a tile's input (every tile and frame is processed to it).
        grid_pinpoints: ``image_grid_pinpoints``, the anyres resolutions ``[height, width]``.
        vision_aspect_ratio: ``anyres_max_N``.
    """

    tower = "vision"
    modalities = ("image", "video")
    hf_class = "LlavaOnevisionForConditionalGeneration"
    tiny_checkpoint = "make_tiny_llava_onevision"
    config_sections = ("text_config", "vision_config")
    # the projector: the shared MLP under the adapter's own names (not *.mlp.*), split as the MLPs are
    tp_plan = extend_tp_plan({"towers.*.adapter.fc1.*": "colwise", "towers.*.adapter.fc2.*": "rowwise"})

    def __init__(self, *, name: str, image_token_id: int, video_token_id: int, image_size: int, patch_size: int,
                 in_channels: int, grid_pinpoints: list, vision_aspect_ratio: str):
        super().__init__(name=name)
        self.image_token_id, self.video_token_id = int(image_token_id), int(video_token_id)
        self.image_size, self.in_channels = int(image_size), int(in_channels)
        self.side = self.image_size // int(patch_size)
        self.pinpoints = [[int(h), int(w)] for h, w in grid_pinpoints]
        self.max_tiles = max_tiles(vision_aspect_ratio, "model.family.vision_aspect_ratio")
        self.tokens_per_item = self.side * self.side + self.side  # rows a tile holds: its features and a newline each

    @classmethod
    def check_config(cls, config, raw: dict, source: str) -> None:
        """The base's checks, a SigLIP tower read at a hidden layer with all its patches
        (``vision_feature_select_strategy="full"``), ``anyres_max_N`` and pinpoints of whole tiles."""
        super().check_config(config, raw, source)
        vc = config.vision_config
        if vc.model_type != "siglip_vision_model":
            raise MmzooError(f"{source}: vision_config.model_type={vc.model_type!r}: model=llava_onevision's vision "
                             f"tower is SigLIP's (siglip_vision_model)")
        if config.vision_feature_select_strategy != "full":
            raise MmzooError(f"{source}: vision_feature_select_strategy={config.vision_feature_select_strategy!r}: "
                             f"SigLIP has no class token to drop; LLaVA-OneVision reads every patch ('full')")
        max_tiles(config.vision_aspect_ratio, f"{source}: vision_aspect_ratio")
        pins = config.image_grid_pinpoints
        bad = [p for p in pins if not (isinstance(p, (list, tuple)) and len(p) == 2
                                       and all(isinstance(v, int) and v > 0 and v % vc.image_size == 0 for v in p))]
        if not pins or bad:
            raise MmzooError(f"{source}: image_grid_pinpoints={pins!r}"[:200] + f": each must be [height, width], "
                             f"multiples of vision_config.image_size={vc.image_size}")

    def check_processor(self, processor, *, vocab_size: int, source) -> None:
        """The base's checks, and a LLaVA-OneVision processor counting a tile's features and shrinking
        grids as the config does (its placeholder counts are the packing's)."""
        super().check_processor(processor, vocab_size=vocab_size, source=source)
        t = self.side * self.side
        per = getattr(processor, "num_image_tokens", None)
        if per != t:
            raise MmzooError(f"{source}: the processor's num_image_tokens={per!r}, but a {self.image_size} px tile of "
                             f"the vision tower gives {t} features (model=llava_onevision takes "
                             f"LlavaOnevisionProcessor)")
        ratio = getattr(processor, "vision_aspect_ratio", None)
        if max_tiles(ratio, f"{source}: the processor's vision_aspect_ratio") != self.max_tiles:
            raise MmzooError(f"{source}: the processor's vision_aspect_ratio={ratio!r} differs from config.json's "
                             f"(anyres_max_{self.max_tiles})")

    # -- media ---------------------------------------------------------------------------------
    def grid_tiles(self, height: int, width: int) -> tuple[int, int]:
        """The anyres grid's tiles ``(rows, columns)`` for an image of ``height x width`` pixels."""
        from transformers.image_processing_utils import select_best_resolution

        h, w = select_best_resolution((height, width), self.pinpoints)
        return h // self.image_size, w // self.image_size

    def packed(self, kind: str, layout: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One item's taps from its layout row (``image_grid_thw`` / ``video_grid_thw``, :meth:`raw_media`)."""
        if kind == "video":
            return pack_video(int(layout[0]), self.side)
        tiles, height, width = (int(v) for v in layout)
        return pack_image((height, width), self.grid_tiles(height, width), self.side, self.max_tiles, multi=tiles == 1)

    def raw_media(self, kind: str, items: list, processor) -> Media:
        """The processor's tiles (images: one sample of all the request's images, as a chat of them)
        or frames, one tower call per item with its packing taps. The layout rows
        (``image_grid_thw``): ``[tiles, height, width]`` of each image in pixels (1 tile: the base
        view alone, in a prompt of several images); ``[frames, s, s]`` of each video, ``s`` its pooled
        side."""
        if kind == "image":
            out = processor.image_processor(images=[load_images(items)], return_tensors="np")
            sizes, multi = np.asarray(out["image_sizes"]), len(items) > 1
            layout = []
            for (height, width) in sizes.tolist():
                th, tw = self.grid_tiles(height, width)
                layout.append([1 if multi else 1 + th * tw, height, width])
            pixels = [out["pixel_values"][i][:n] for i, (n, _, _) in enumerate(layout)]
            want = [len(processor.replace_image_token(out, i)) // len(processor.image_token) for i in range(len(items))]
        else:
            out = processor.video_processor(videos=load_videos(items), return_tensors="np")
            pixels = list(out["pixel_values_videos"])
            pooled = math.ceil(self.side / 2)
            layout = [[len(p), pooled, pooled] for p in pixels]
            want = [len(processor.replace_video_token(out, i)) // len(processor.video_token) for i in range(len(items))]
        calls, rows, counts, start = [], [], [], 0
        for i, (tiles, row) in enumerate(zip(pixels, layout)):
            taps, weights = self.packed(kind, np.asarray(row))
            if len(taps) != want[i]:
                raise MmzooError(f"{kind}s[{i}]: {len(taps)} packed rows but the processor writes {want[i]} "
                                 f"placeholders")
            per = self.tokens_per_item
            n = len(tiles)
            index = np.zeros((n * per, 4), np.int64)
            weight = np.zeros((n * per, 4), np.float32)
            index[:len(taps)], weight[:len(taps)] = taps, weights
            inputs = {"pixel_values": np.asarray(tiles, np.float32), "pack_index": index.reshape(n, per, 4),
                      "pack_weight": weight.reshape(n, per, 4)}
            calls.append(TowerInput(tower=self.tower, num_embeds=n * per, inputs=inputs, float32=PACK_FLOAT32))
            rows.append(start + np.arange(len(taps)))
            counts.append(len(taps))
            start += n * per
        return Media(counts=counts, calls=calls, rows=np.concatenate(rows), grid=np.asarray(layout, np.int64))

    def precomputed(self, kind: str, embeds, layout, hidden_size: int) -> Media:
        """``{kind}_embeds`` in placeholder order with their layout rows (``image_grid_thw``
        ``[tiles, height, width]``, ``video_grid_thw`` ``[frames, s, s]``, as :meth:`mmzoo.Engine.encode`
        writes them): each item's rows counted as its raw pixels' packing."""
        field = f"{kind}_grid_thw"
        if layout is None:
            raise MmzooError(f"{kind}_embeds needs {field} (each item's rows depend on its size: "
                             f"[tiles, height, width] of an image, [frames, s, s] of a video)")
        grid = as_grid(layout, field)
        if kind == "video":
            pooled = math.ceil(self.side / 2)
            odd = np.flatnonzero((grid[:, 1] != pooled) | (grid[:, 2] != pooled))
            if len(odd):
                raise MmzooError(f"{field}[{odd[0]}] = {grid[odd[0]].tolist()}: a frame is {pooled}x{pooled} rows")
            implied = f"frames x {pooled * pooled} + 1 rows per video"
        else:
            for i, (tiles, height, width) in enumerate(grid.tolist()):
                th, tw = self.grid_tiles(height, width)
                if tiles != 1 and tiles != 1 + th * tw:
                    raise MmzooError(f"{field}[{i}] = {[tiles, height, width]}: a {height}x{width} image is 1 + "
                                     f"{th * tw} tiles (or 1: the base view alone, in a prompt of several images)")
            implied = "each image's packed rows from its tiles and size"
        counts = [len(self.packed(kind, row)[0]) for row in grid]
        return embeds_media(embeds, f"{kind}_embeds", hidden=hidden_size, counts=counts, grid=grid, tower=self.tower,
                            implied=implied)

    def convert_weights(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' keys (``model.vision_tower.vision_model.* / model.multi_modal_projector.* /
        model.image_newline / model.language_model.* / lm_head.*``) -> the composition's: SigLIP under
        CLIP's names (its ``post_layernorm``, which the hidden layer read skips, dropped), the projector's
        ``linear_1 / linear_2`` as ``fc1 / fc2``, ``image_newline`` as the adapter's ``newline``."""
        out: dict[str, torch.Tensor] = {}
        for key, value in hf.items():
            k = re.sub(r"^model\.", "", key)
            if k.startswith("vision_tower."):
                k = re.sub(r"^vision_tower\.(vision_model\.)?", "", k)
                if k.startswith("post_layernorm."):
                    continue
                for pattern, repl in CLIP_RENAMES:
                    k = re.sub(pattern, repl, k)
                out["towers.vision.encoder." + k] = value
            elif k.startswith("multi_modal_projector."):
                k = k[len("multi_modal_projector."):].replace("linear_1.", "fc1.").replace("linear_2.", "fc2.")
                out["towers.vision.adapter." + k] = value
            elif k == "image_newline":
                out["towers.vision.adapter.newline"] = value
            else:
                out[lm_key(key) or key] = value  # anything else is reported as unexpected by the strict loader
        return out

    def dummy_media(self, rows: int) -> TowerInput:
        """``rows`` blank tiles with empty packing (every output row zero)."""
        call = super().dummy_media(rows)
        per = self.tokens_per_item
        return TowerInput(tower=self.tower, num_embeds=call.num_embeds, float32=PACK_FLOAT32, inputs={
            **call.inputs, "pack_index": np.zeros((rows, per, 4), np.int64),
            "pack_weight": np.zeros((rows, per, 4), np.float32)})


def max_tiles(aspect_ratio, where: str) -> int:
    """``N`` of ``anyres_max_N`` (LLaVA-OneVision's ``vision_aspect_ratio``)."""
    m = re.fullmatch(r"anyres_max_(\d+)", str(aspect_ratio))
    if not m or int(m.group(1)) < 1:
        raise MmzooError(f"{where}={aspect_ratio!r}: mmzoo takes 'anyres_max_N' (N tiles' features at most before "
                         f"the map is shrunk)")
    return int(m.group(1))
