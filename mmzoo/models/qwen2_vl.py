"""Qwen2-VL's own part: per-item placeholder expansion, image/video preparation, M-RoPE positions.

Wang et al., 2024, "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any
Resolution" (arXiv:2409.12191). Checkpoints: ``Qwen2VLForConditionalGeneration``. The modules
are components (``conf/model/qwen2_vl.yaml``: the ``qwen2_vl_vit`` encoder, the ``patch_merger``
adapter, the ``qwen2`` LM with ``mrope_section``); this file holds only what they do not.
"""

from __future__ import annotations

import re
from typing import ClassVar

import numpy as np
import torch

from mmzoo.encoders import frame_segments, patch_positions
from mmzoo.errors import MmzooError
from mmzoo.models._embeds import as_embeds, as_grid
from mmzoo.models._media import load_images, load_videos
from mmzoo.models.family import Family, Media, extend_tp_plan, lm_key
from mmzoo.types import TowerInput


_VISION_RENAMES = [(r"\.attn\.proj\.", ".attn.o_proj.")]  # applied to vision keys after the prefix is mapped


class Qwen2VL(Family):
    """Qwen2-VL: images and videos through one dynamic-resolution vision tower.

    Args:
        name: the conf option name.
        image_token_id, video_token_id: the placeholder tokens (``config.json``).
        merge_size: the patch merger's spatial merge (``m x m`` patches -> one LM token).
        in_channels, temporal_patch_size, patch_size: the processor's patch layout (warmup's
            dummy patches).
        mrope: 3-axis (t, h, w) rotary positions for an M-RoPE LM; False: 1-D positions, for a
            composition with a 1-D RoPE LM.
    """

    tower = "vision"
    modalities = ("image", "video")
    hf_class = "Qwen2VLForConditionalGeneration"
    tiny_checkpoint = "make_tiny_qwen2_vl"
    config_sections = ("vision_config",)
    # the patch merger's two linears (mlp.1 is its GELU), Megatron's pair like the shared MLPs
    tp_plan = extend_tp_plan({"towers.*.adapter.mlp.0.*": "colwise", "towers.*.adapter.mlp.2.*": "rowwise"})
    # config.json's vision_config keys of the ViT's width and of the patch merger's output width
    vit_width_key: ClassVar[str] = "embed_dim"
    merger_width_key: ClassVar[str] = "hidden_size"
    # what the video processor is asked besides the pixels (Qwen2.5-VL: each video's frame rate)
    video_kwargs: ClassVar[dict] = {}

    def __init__(self, *, name: str, image_token_id: int, video_token_id: int, merge_size: int, in_channels: int,
                 temporal_patch_size: int, patch_size: int, mrope: bool = True):
        super().__init__(name=name)
        self.image_token_id, self.video_token_id = int(image_token_id), int(video_token_id)
        self.merge_size, self.mrope = int(merge_size), bool(mrope)
        self.temporal_patch_size, self.patch_size = int(temporal_patch_size), int(patch_size)
        self.patch_dim = in_channels * temporal_patch_size * patch_size * patch_size

    @property
    def position_axes(self) -> int:
        return 3 if self.mrope else 1

    @classmethod
    def check_config(cls, config, raw: dict, source: str) -> None:
        """The base's checks, a text model (``text_config``, or the hub's flat layout), the patch
        merger's output width equal to the LM's, and a ViT head dim its 2-D rotary can split."""
        if "text_config" not in raw and "hidden_size" not in raw:
            raise MmzooError(f"{source} has no text_config (nor the text model's hidden_size at the top, as the hub's "
                             f"Qwen2-VL configs have it)")
        super().check_config(config, raw, source)
        vc, tc = config.vision_config, config.get_text_config()
        out, width = getattr(vc, cls.merger_width_key), getattr(vc, cls.vit_width_key)
        if out != tc.hidden_size:
            raise MmzooError(f"{source}: vision_config.{cls.merger_width_key}={out} (the patch merger's output width) "
                             f"differs from the text model's hidden_size={tc.hidden_size}")
        head = width // vc.num_heads
        if head % 4:
            raise MmzooError(f"{source}: vision_config.{cls.vit_width_key}={width} / num_heads={vc.num_heads} = "
                             f"{head}: the ViT's 2-D rotary needs a head dim divisible by 4")

    def raw_media(self, kind: str, items: list, processor) -> Media:
        """Images / videos through transformers' image / video processor (resize within min/max
        pixels, patchify); each item is its own tower call, so a call's dense attention (and its
        bucket's padding) covers one item."""
        pixels, grid, _ = self.process(kind, items, processor)
        return self.item_calls(pixels, grid)

    def process(self, kind: str, items: list, processor) -> tuple[np.ndarray, np.ndarray, dict]:
        """transformers' image or video processor on the items: ``patches [sum(t*h*w), patch_dim]``
        in processor order, ``grid_thw [items, 3]`` and the processor's whole output."""
        if kind == "image":
            out = processor.image_processor(images=load_images(items), return_tensors="np")
            return out["pixel_values"], as_grid(out["image_grid_thw"], "image_grid_thw"), out
        out = processor.video_processor(videos=load_videos(items), return_tensors="np", **self.video_kwargs)
        return out["pixel_values_videos"], as_grid(out["video_grid_thw"], "video_grid_thw"), out

    def item_calls(self, pixels: np.ndarray, grid: np.ndarray) -> Media:
        """One tower call per item of ``pixels [sum(t*h*w), patch_dim]``, ``grid [items, 3]``: its
        patches, their (row, column) and one attention segment per frame."""
        m2 = self.merge_size ** 2
        calls, start = [], 0
        for g in grid:
            size = int(g.prod())
            calls.append(TowerInput(
                tower=self.tower,
                inputs={"patches": np.asarray(pixels[start:start + size], np.float32),
                        "patch_pos": patch_positions(g[None], self.merge_size), "segment_ids": frame_segments(g[None])},
                num_embeds=size // m2, row_multiple=m2, pad={"segment_ids": -1}))
            start += size
        return Media(counts=[c.num_embeds for c in calls], calls=calls, grid=grid)

    def precomputed(self, kind: str, embeds, layout, hidden_size: int) -> Media:
        emb_field, grid_field = f"{kind}_embeds", f"{kind}_grid_thw"
        if layout is None:
            raise MmzooError(f"{emb_field} needs {grid_field} (Qwen2-VL places and positions each item by it)")
        grid = as_grid(layout, grid_field)
        m = self.merge_size
        odd = np.flatnonzero((grid[:, 1] % m) | (grid[:, 2] % m))
        if len(odd):
            raise MmzooError(f"{grid_field}[{odd[0]}] = {grid[odd[0]].tolist()}: h and w must be multiples of "
                             f"merge_size={m} (each {m}x{m} block of patches is one embedding row)")
        emb = as_embeds(embeds, emb_field, hidden=hidden_size)
        m2 = self.merge_size ** 2
        counts = [int(n) for n in grid.prod(axis=1) // m2]
        if emb.shape[0] != sum(counts):
            raise MmzooError(f"{emb_field} has {emb.shape[0]} rows but {grid_field} {grid.tolist()} implies "
                             f"{sum(counts)} (sum(t*h*w) / merge_size^2, merge_size={self.merge_size})")
        return Media(counts=counts, calls=[TowerInput(tower=self.tower, inputs={}, num_embeds=sum(counts), embeds=emb)],
                     grid=grid)

    def positions(self, input_ids: np.ndarray, media: dict[str, Media]) -> tuple[np.ndarray, int]:
        if not self.mrope:
            return super().positions(input_ids, media)
        grids = {tok: media[kind].grid for kind, tok in (("image", self.image_token_id), ("video", self.video_token_id))
                 if kind in media}
        return rope_index(input_ids, grids, merge_size=self.merge_size)

    def convert_weights(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """transformers' keys (v5 ``model.visual.* / model.language_model.*`` or the hub's older
        ``visual.* / model.*``) -> the composition's; the ViT's fused qkv is split."""
        out: dict[str, torch.Tensor] = {}
        for key, value in hf.items():
            if key.startswith(("model.visual.merger.", "visual.merger.")):
                out["towers.vision.adapter." + key.split("merger.", 1)[1]] = value
                continue
            if key.startswith(("model.visual.", "visual.")):
                new = "towers.vision.encoder." + key.split("visual.", 1)[1]
                for pattern, repl in _VISION_RENAMES:
                    new = re.sub(pattern, repl, new)
                m = re.match(r"(towers\.vision\.encoder\.blocks\.\d+\.attn\.)qkv\.(weight|bias)$", new)
                if m:
                    for part, chunk in zip("qkv", value.chunk(3, dim=0)):
                        out[f"{m.group(1)}{part}_proj.{m.group(2)}"] = chunk.contiguous()
                    continue
                out[new] = value
                continue
            new = lm_key(key) or (lm_key("model.language_model." + key[len("model."):]) if key.startswith("model.")
                                  else None)
            out[new or key] = value  # an unknown key is reported as unexpected by the strict loader
        return out

    def dummy_media(self, rows: int) -> TowerInput:
        """Zero patches, for compiling the tower at ``rows`` patches per call."""
        m2 = self.merge_size ** 2
        return TowerInput(tower=self.tower, inputs={"patches": np.zeros((rows, self.patch_dim), np.float32),
                                                    "patch_pos": np.zeros((rows, 2), np.int64),
                                                    "segment_ids": np.zeros(rows, np.int64)},
                          num_embeds=rows // m2, row_multiple=m2, pad={"segment_ids": -1})


def check_vit_blocks(vision_config, field: str, source: str) -> list[int]:
    """``vision_config.<field>`` (a list of ViT block indexes: Qwen2.5-VL's full-attention blocks,
    Qwen3-VL's DeepStack taps), refused unless each is a block of its ``depth``-block ViT."""
    blocks = list(getattr(vision_config, field))
    depth = vision_config.depth
    bad = [i for i in blocks if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < depth]
    if bad:
        raise MmzooError(f"{source}: vision_config.{field}={blocks}: {bad[0]!r} is not a block of the "
                         f"depth={depth} ViT")
    return blocks


# ---------------------------------------------------------------- M-RoPE positions

def rope_index(input_ids: np.ndarray, grids: dict[int, np.ndarray], *, merge_size: int,
               time_steps: dict[int, np.ndarray] | None = None) -> tuple[np.ndarray, int]:
    """Qwen2-VL's 3-axis (t, h, w) rotary positions for one sequence.

    Text tokens advance all three axes together. The ``t*h*w/m^2`` placeholder tokens of an image
    or video take ``start + (t, row, column)`` of its merged grid, and the text after it resumes
    at ``start + max(h, w) / m`` (as transformers 5.x computes it). With ``time_steps``
    (Qwen2.5-VL's videos), temporal index ``k`` takes ``int(k * step)`` (computed in float32 and
    truncated, as transformers does) instead of ``k``.

    Args:
        input_ids: ``[s]`` token ids.
        grids: placeholder token id -> ``[k, 3]`` grid_thw of its images (or videos) in prompt order.
        merge_size: the spatial merge size.
        time_steps: placeholder token id -> ``[k]`` positions per temporal grid step of each of its
            items (Qwen2.5-VL: ``tokens_per_second * second_per_grid_t``); a token without: 1.

    Returns:
        ``positions [3, s]`` and the decode-time delta (``position of cache index i = i + delta``).
    """
    s = len(input_ids)
    pos = np.zeros((3, s), dtype=np.int64)
    queues = {tok: [tuple(int(x) for x in g) for g in np.asarray(gr).reshape(-1, 3)] for tok, gr in grids.items()}
    steps = {tok: list(np.asarray(st, np.float32).reshape(-1)) for tok, st in (time_steps or {}).items()}
    for tok, st in steps.items():
        if len(st) != len(queues.get(tok, ())):
            raise MmzooError(f"{len(st)} time steps for the {len(queues.get(tok, ()))} grids of placeholder {tok}")
    i, cur = 0, 0
    while i < s:
        tok = int(input_ids[i])
        queue = queues.get(tok)
        if queue:
            t, h, w = queue.pop(0)
            gh, gw = h // merge_size, w // merge_size
            n = t * gh * gw
            if not np.all(input_ids[i:i + n] == input_ids[i]):
                raise MmzooError(f"prompt has fewer placeholder tokens at index {i} than grid_thw {[t, h, w]} needs ({n})")
            frames = np.arange(t)
            if tok in steps:  # float32 product, truncated toward zero: transformers' (arange * interval).long()
                frames = (frames.astype(np.float32) * steps[tok].pop(0)).astype(np.int64)
            tt, hh, ww = np.meshgrid(frames, np.arange(gh), np.arange(gw), indexing="ij")
            pos[:, i:i + n] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur
            cur += max(h, w) // merge_size
            i += n
        else:
            pos[:, i] = cur
            cur += 1
            i += 1
    left = sum(len(q) for q in queues.values())
    if left:
        raise MmzooError(f"{left} image/video grids have no placeholder tokens left in the prompt")
    delta = int(pos.max()) + 1 - s if s else 0
    return pos, delta


