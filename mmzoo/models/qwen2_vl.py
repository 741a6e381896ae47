"""Qwen2-VL: dynamic-resolution ViT + patch merger + Qwen2 decoder with M-RoPE.

Wang et al., 2024, "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any
Resolution" (arXiv:2409.12191). Checkpoints: ``Qwen2VLForConditionalGeneration``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from mmzoo.adapters import PatchMerger
from mmzoo.encoders import Qwen2VisionEncoder, frame_segments, patch_positions
from mmzoo.errors import MmzooError
from mmzoo._paths import ASSETS
from mmzoo.layers import mrope
from mmzoo.lms import DecoderLM
from mmzoo.models._embeds import as_embeds, as_grid
from mmzoo.models._media import load_images, load_videos
from mmzoo.models._prompt import expand_runs, prepare_inputs_embeds, refuse, render_prompt
from mmzoo.models._types import Prepared, Request, TowerInput
from mmzoo.models.composition import MultimodalLM, Tower


# ---------------------------------------------------------------- component builders

def qwen2_vl_vision_tower(*, in_channels: int, temporal_patch_size: int, patch_size: int, embed_dim: int,
                          depth: int, num_heads: int, mlp_ratio: float, act: str, merge_size: int,
                          out_dim: int, attn_fn, rope_theta: float = 10000.0) -> Tower:
    """Qwen2-VL's ViT and patch merger, mapping patches to ``out_dim``-wide LM embeddings."""
    encoder = Qwen2VisionEncoder(in_channels=in_channels, temporal_patch_size=temporal_patch_size,
                                 patch_size=patch_size, embed_dim=embed_dim, depth=depth, num_heads=num_heads,
                                 mlp_ratio=mlp_ratio, act=act, attn_fn=attn_fn, rope_theta=rope_theta)
    return Tower(encoder=encoder, adapter=PatchMerger(context_dim=embed_dim, out_dim=out_dim, merge_size=merge_size))


def qwen2_lm(*, vocab_size: int, dim: int, num_layers: int, num_heads: int, num_kv_heads: int,
             intermediate_dim: int, rope_theta: float, mrope_section: list[int] | None, norm_eps: float,
             attn_fn, act: str = "silu", tie_word_embeddings: bool = False, head_dim: int | None = None) -> DecoderLM:
    """The Qwen2 decoder (qkv bias, RMSNorm, SwiGLU), with M-RoPE when ``mrope_section`` is given."""
    from mmzoo.layers import rope_1d

    head_dim = head_dim or dim // num_heads
    rotary = mrope(head_dim, rope_theta, list(mrope_section)) if mrope_section else rope_1d(head_dim, rope_theta)
    return DecoderLM(vocab_size=vocab_size, dim=dim, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_dim=intermediate_dim,
                     rotary=rotary, attn_fn=attn_fn, qkv_bias=True, norm_eps=norm_eps, act=act,
                     tie_word_embeddings=tie_word_embeddings)


# ---------------------------------------------------------------- M-RoPE positions

def rope_index(input_ids: np.ndarray, grids: dict[int, np.ndarray], *, merge_size: int) -> tuple[np.ndarray, int]:
    """Qwen2-VL's 3-axis (t, h, w) rotary positions for one sequence.

    Text tokens advance all three axes together. The ``t*h*w/m^2`` placeholder tokens of an image
    or video take ``start + (t, row, column)`` of its merged grid, and the text after it resumes
    at ``start + max(h, w) / m`` (as transformers 5.x computes it).

    Args:
        input_ids: ``[s]`` token ids.
        grids: placeholder token id -> ``[k, 3]`` grid_thw of its images (or videos) in prompt order.
        merge_size: the spatial merge size.

    Returns:
        ``positions [3, s]`` and the decode-time delta (``position of cache index i = i + delta``).
    """
    s = len(input_ids)
    pos = np.zeros((3, s), dtype=np.int64)
    queues = {tok: [tuple(int(x) for x in g) for g in np.asarray(gr).reshape(-1, 3)] for tok, gr in grids.items()}
    i, cur = 0, 0
    while i < s:
        queue = queues.get(int(input_ids[i]))
        if queue:
            t, h, w = queue.pop(0)
            gh, gw = h // merge_size, w // merge_size
            n = t * gh * gw
            if not np.all(input_ids[i:i + n] == input_ids[i]):
                raise MmzooError(f"prompt has fewer placeholder tokens at index {i} than grid_thw {[t, h, w]} needs ({n})")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
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


def expand_placeholders(ids: np.ndarray, tokens: dict[str, int], counts: dict[str, list[int]]) -> np.ndarray:
    """Token ids with each item's placeholder expanded to its embedding count.

    Already-expanded ids (as many placeholder tokens as embeddings) pass through; otherwise each
    run of placeholder tokens (one per item, as in vLLM's token prompts) becomes
    ``counts[kind][i]`` tokens.
    """
    for kind, token in tokens.items():
        want = counts.get(kind, [])
        if int((ids == token).sum()) != sum(want):
            ids = expand_runs(ids, token, want, what=kind, note=" (grid_thw rows)")
    return ids


# ---------------------------------------------------------------- the family

_HF_RENAMES = [  # (pattern, replacement) applied to checkpoint keys after the prefix is mapped
    (r"\.self_attn\.", ".attn."),
    (r"\.input_layernorm\.", ".norm1."),
    (r"\.post_attention_layernorm\.", ".norm2."),
    (r"\.attn\.proj\.", ".attn.o_proj."),
]


class Qwen2VL:
    """The Qwen2-VL family: builds the modules from a transformers config, maps weights, prepares requests."""

    name = "qwen2_vl"
    architectures = ("Qwen2VLForConditionalGeneration",)
    towers = ("vision",)

    def default_checkpoint(self) -> Path:
        """The embedded default: the small trained shapes demo shipped in ``mmzoo/assets``
        (``recipes/train_demo.py`` retrains it)."""
        path = ASSETS / "qwen2_vl_shapes"
        if not (path / "config.json").is_file():
            raise MmzooError(f"the embedded default checkpoint {path} is missing; retrain it with "
                             "`python recipes/train_demo.py`, or give checkpoint=DIR")
        return path

    def build(self, config, attn_fn) -> MultimodalLM:
        """Modules sized by a ``Qwen2VLConfig`` (random weights until loaded)."""
        tc, vc = config.text_config, config.vision_config
        rope = dict(tc.rope_parameters or {})
        vrope = dict(getattr(vc, "rope_parameters", None) or {})
        lm = qwen2_lm(vocab_size=tc.vocab_size, dim=tc.hidden_size, num_layers=tc.num_hidden_layers,
                      num_heads=tc.num_attention_heads, num_kv_heads=tc.num_key_value_heads,
                      intermediate_dim=tc.intermediate_size, rope_theta=float(rope.get("rope_theta", 1e6)),
                      mrope_section=rope.get("mrope_section", [16, 24, 24]), norm_eps=tc.rms_norm_eps,
                      attn_fn=attn_fn, act=tc.hidden_act, tie_word_embeddings=bool(config.tie_word_embeddings),
                      head_dim=getattr(tc, "head_dim", None))
        vision = qwen2_vl_vision_tower(in_channels=vc.in_channels, temporal_patch_size=vc.temporal_patch_size,
                                       patch_size=vc.patch_size, embed_dim=vc.embed_dim, depth=vc.depth,
                                       num_heads=vc.num_heads, mlp_ratio=vc.mlp_ratio, act=vc.hidden_act,
                                       merge_size=vc.spatial_merge_size, out_dim=vc.hidden_size,
                                       attn_fn=attn_fn, rope_theta=float(vrope.get("rope_theta", 10000.0)))
        if vc.hidden_size != tc.hidden_size:
            raise MmzooError(f"config.json: vision_config.hidden_size={vc.hidden_size} differs from the LM's "
                             f"hidden_size={tc.hidden_size}")
        return MultimodalLM(lm=lm, towers={"vision": vision})

    def convert_weights(self, hf: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """Map transformers' keys (v5 ``model.visual.* / model.language_model.*`` or the hub's older
        ``visual.* / model.*``) onto mmzoo's module names; split the ViT's fused qkv."""
        out: dict[str, torch.Tensor] = {}
        for key, value in hf.items():
            if key.startswith(("model.visual.merger.", "visual.merger.")):
                new = "towers.vision.adapter." + key.split("merger.", 1)[1]
            elif key.startswith(("model.visual.", "visual.")):
                new = "towers.vision.encoder." + key.split("visual.", 1)[1]
            elif key.startswith("model.language_model."):
                new = "lm." + key[len("model.language_model."):]
            elif key.startswith("lm_head."):
                new = "lm." + key
            elif key.startswith("model."):
                new = "lm." + key[len("model."):]
            else:
                new = key  # reported as unexpected by the strict loader
            for pattern, repl in _HF_RENAMES:
                new = re.sub(pattern, repl, new)
            m = re.match(r"(towers\.vision\.encoder\.blocks\.\d+\.attn\.)qkv\.(weight|bias)$", new)
            if m:
                for part, chunk in zip("qkv", value.chunk(3, dim=0)):
                    out[f"{m.group(1)}{part}_proj.{m.group(2)}"] = chunk.contiguous()
                continue
            out[new] = value
        if config.tie_word_embeddings:
            out.pop("lm.lm_head.weight", None)
        return out

    def dummy_media(self, config, tower: str, rows: int) -> TowerInput:
        """Zero inputs of ``rows`` patches for compiling the tower at that bucket."""
        vc = config.vision_config
        merge = vc.spatial_merge_size
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size * vc.patch_size
        return TowerInput(tower=tower, inputs={"patches": np.zeros((rows, dim), np.float32),
                                               "patch_pos": np.zeros((rows, 2), np.int64),
                                               "segment_ids": np.zeros(rows, np.int64)},
                          num_embeds=rows // (merge * merge), row_multiple=merge * merge, pad={"segment_ids": -1})

    def prepare(self, processor, config, request: Request) -> Prepared:
        """One request -> token ids, M-RoPE positions and the media to encode (or precomputed).

        Raw images/videos go through transformers' image/video processors (resize within
        min/max pixels, patchify); ``image_embeds``/``video_embeds`` with their ``*_grid_thw`` skip
        the tower; ``inputs_embeds`` replaces the whole prompt. The chat template renders one user
        turn (images, videos, then the text) unless ``prompt_token_ids`` is given, and each
        placeholder is expanded to its item's ``t*h*w/merge^2`` tokens, as the processor does.
        """
        tc, vc = config.text_config, config.vision_config
        merge = vc.spatial_merge_size
        refuse(request, self.name, ("audios", "audio_embeds", "audio_lengths"))
        if request.inputs_embeds is not None:
            return prepare_inputs_embeds(request, hidden=tc.hidden_size, position_axes=3)
        kinds = {}
        for kind, raw, emb_field, grid_field in (("image", request.images, "image_embeds", "image_grid_thw"),
                                                 ("video", request.videos, "video_embeds", "video_grid_thw")):
            emb, grid = getattr(request, emb_field), getattr(request, grid_field)
            if emb is not None:
                if raw:
                    raise MmzooError(f"give {kind}s or {emb_field}, not both")
                if grid is None:
                    raise MmzooError(f"{emb_field} needs {grid_field} (Qwen2-VL places and positions each item by it)")
                grid = as_grid(grid, grid_field)
                emb = as_embeds(emb, emb_field, hidden=tc.hidden_size)
                expected = int(grid.prod(axis=1).sum()) // (merge * merge)
                if emb.shape[0] != expected:
                    raise MmzooError(f"{emb_field} has {emb.shape[0]} rows but {grid_field} {grid.tolist()} implies "
                                     f"{expected} (sum(t*h*w) / merge_size^2, merge_size={merge})")
                kinds[kind] = (None, grid, emb)
            elif grid is not None:
                raise MmzooError(f"{grid_field} given without {emb_field}")
            elif raw:
                if kind == "image":
                    out = processor.image_processor(images=load_images(raw), return_tensors="np")
                    kinds[kind] = (out["pixel_values"], as_grid(out["image_grid_thw"], "image_grid_thw"), None)
                else:
                    out = processor.video_processor(videos=load_videos(raw), return_tensors="np")
                    kinds[kind] = (out["pixel_values_videos"], as_grid(out["video_grid_thw"], "video_grid_thw"), None)
        counts = {k: [int(n) for n in v[1].prod(axis=1) // (merge * merge)] for k, v in kinds.items()}
        tokens = {"image": config.image_token_id, "video": config.video_token_id}
        if request.prompt_token_ids is not None:
            input_ids = expand_placeholders(np.asarray(request.prompt_token_ids, dtype=np.int64), tokens, counts)
        else:
            input_ids = render_prompt(processor, request, ["image", "video"],
                                      {"image": (processor.image_token, counts.get("image", [])),
                                       "video": (processor.video_token, counts.get("video", []))})
        return self.prepare_ids(config, request, input_ids, image=kinds.get("image"), video=kinds.get("video"))

    def prepare_ids(self, config, request: Request, input_ids: np.ndarray, *, image=None, video=None) -> Prepared:
        """Positions and media rows for token ids whose placeholders are already expanded.

        ``image`` / ``video`` are ``(pixels, grid_thw, embeds)`` with either pixels or embeds set.
        Each raw image and video is its own call of the vision tower, so the dense attention of a
        call (and its bucket's padding) covers one item, not all of them together; image rows
        come first.
        """
        merge = config.vision_config.spatial_merge_size
        mm_index = np.full(len(input_ids), -1, dtype=np.int64)
        grid_by_token, grids, entries = {}, {}, []
        row = 0
        for kind, token, entry in (("image", config.image_token_id, image), ("video", config.video_token_id, video)):
            pixels, grid, emb = entry if entry is not None else (None, np.zeros((0, 3), np.int64), None)
            n = int(grid.prod(axis=1).sum()) // (merge * merge)
            where = np.flatnonzero(input_ids == token)
            if len(where) != n:
                raise MmzooError(f"prompt has {len(where)} {kind} placeholder tokens but the {kind}s' "
                                 f"grid_thw {grid.tolist()} give {n} embeddings")
            if n:
                mm_index[where] = row + np.arange(n)
                grid_by_token[token] = grid
                grids[kind] = grid
                entries.append((pixels, grid, emb, n))
                row += n

        def tower_call(pixels, grid, n):
            return TowerInput(
                tower="vision",
                inputs={"patches": np.asarray(pixels, np.float32), "patch_pos": patch_positions(grid, merge),
                        "segment_ids": frame_segments(grid)},
                num_embeds=n, row_multiple=merge * merge, pad={"segment_ids": -1})

        media = []
        for pixels, grid, emb, n in entries:
            if emb is not None:
                media.append(TowerInput(tower="vision", inputs={}, num_embeds=n, embeds=emb))
                continue
            start = 0
            for g in grid:  # one tower call per image / video: attention (and padding) stays per item
                size = int(g.prod())
                media.append(tower_call(pixels[start:start + size], g[None], size // (merge * merge)))
                start += size
        positions, delta = rope_index(input_ids, grid_by_token, merge_size=merge)
        return Prepared(request=request, input_ids=input_ids, positions=positions, position_delta=delta,
                        mm_index=mm_index, media=media, grids=grids)
