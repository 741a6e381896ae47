"""Qwen2-VL's dynamic-resolution vision transformer, and Qwen2.5-VL's windowed variant of it.

Wang et al., 2024, "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any
Resolution". Images and videos are cut into ``temporal_patch_size x patch_size x patch_size``
patches (by the processor), embedded by a 3-D patch projection, and run through pre-norm ViT
blocks with 2-D rotary positions. Several images are packed into one sequence; attention is
block-diagonal, one block per frame of each image or video (given here as ``segment_ids``).

Bai et al., 2025, "Qwen2.5-VL Technical Report" (arXiv:2502.13923): the same tower with RMSNorm,
a gated SiLU MLP, and window attention. The patches come reordered by window (on the host:
:func:`window_order`), most blocks attend within a window (``window_ids``) and the blocks in
``full_attention_blocks`` over the whole frame (``segment_ids``). The norm and MLP are the
block's injected layers (``norm_layer``, ``mlp_layer``).

Qwen Team, 2025, "Qwen3-VL Technical Report": the same tower with a bias on the patch embedding,
learned absolute position embeddings (a square grid, bilinearly resampled to each image's patch
grid: the taps and weights come from the host, :func:`pos_interpolation`), a ``gelu_pytorch_tanh``
MLP, and DeepStack (Meng et al., 2024, "DeepStack: Deeply Stacking Visual Tokens is Surprisingly
Simple and Effective for LMMs"): the outputs of the blocks in ``deepstack_blocks`` leave the tower
beside the last block's, each merged by a patch merger of its own (the adapter's,
:class:`~mmzoo.adapters.PatchMerger` with ``deepstack_taps``). Built by :func:`qwen3_vl_vit`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from mmzoo.encoders._base import Encoder
from mmzoo.layers import MLP, layer_norm, rope_2d, vit_block


class PatchEmbed3D(nn.Module):
    """Linear embedding of flattened ``[c, t, p, p]`` patches (a Conv3d whose stride is its kernel).

    Args:
        bias: the projection's bias (Qwen3-VL's; Qwen2-VL's and Qwen2.5-VL's have none).
    """

    def __init__(self, *, in_channels: int, temporal_patch_size: int, patch_size: int, embed_dim: int,
                 bias: bool = False):
        super().__init__()
        # Stored with the Conv3d weight layout [embed_dim, c, t, p, p] so checkpoints load as they are.
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(embed_dim, in_channels, temporal_patch_size, patch_size, patch_size))
        nn.init.normal_(self.proj.weight, std=0.02)
        self.proj.bias = nn.Parameter(torch.zeros(embed_dim)) if bias else None
        self.patch_dim = in_channels * temporal_patch_size * patch_size * patch_size

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # patches: [n, c * t * p * p] -> [n, embed_dim]
        return F.linear(patches.to(self.proj.weight.dtype), self.proj.weight.flatten(1), self.proj.bias)


class Qwen2VisionEncoder(Encoder):
    """Patch embedding + ViT blocks with 2-D RoPE; returns per-patch features (merging is the adapter's).

    Args:
        in_channels, temporal_patch_size, patch_size: the processor's patch layout.
        embed_dim, depth, num_heads, act: tower sizes and the MLP's activation.
        mlp_ratio: the MLP's width as a multiple of ``embed_dim`` (Qwen2-VL's config), unless
            ``intermediate_dim`` gives it (Qwen2.5-VL's).
        attn_fn: the attention backend for every block.
        rope_theta: base of the 2-D rotary frequencies.
        norm_eps: the norms' epsilon.
        intermediate_dim: the MLP's width; None: ``int(embed_dim * mlp_ratio)``.
        norm_layer: ``norm_layer(dim, eps)``, each block's two norms (LayerNorm; RMSNorm for Qwen2.5-VL).
        mlp_layer: each block's MLP (:class:`~mmzoo.layers.MLP`; the gated one for Qwen2.5-VL),
            see :func:`~mmzoo.layers.vit_block`.
        full_attention_blocks: None: every block attends over ``segment_ids`` (Qwen2-VL). A list
            of block indexes (Qwen2.5-VL's ``fullatt_block_indexes``): those blocks attend over
            ``segment_ids``, every other block within its window (``window_ids``).
        patch_bias: a bias on the patch embedding (Qwen3-VL).
        num_position_embeddings: None: no absolute positions (Qwen2-VL, Qwen2.5-VL). A square
            number ``side^2`` (Qwen3-VL): a learned ``side x side`` grid of position embeddings
            (``pos_embed``), resampled to each image's grid by the host's taps and weights
            (``interp_indices``, ``interp_weights``: :func:`pos_interpolation`) and added to the
            patch embeddings.
        deepstack_blocks: block indexes (Qwen3-VL's ``deepstack_visual_indexes``) whose outputs
            are returned beside the last block's, in this order, for the adapter's DeepStack
            mergers; empty: the last block's output alone.
    """

    # the Encoder contract: the input rows are patches of several items (rows_per_item None), and
    # patch_pos holds self.rotary's positions (a patch's row or column in its image grid, so below
    # the rows of one call: an executor may tabulate the rotary to its largest bucket)
    rotary_input = "patch_pos"

    def __init__(self, *, in_channels: int, temporal_patch_size: int, patch_size: int, embed_dim: int,
                 depth: int, num_heads: int, mlp_ratio: float, act: str, attn_fn, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-6, intermediate_dim: int | None = None,
                 norm_layer: Callable[[int, float], nn.Module] = layer_norm, mlp_layer: Callable[..., nn.Module] = MLP,
                 full_attention_blocks: Sequence[int] | None = None, patch_bias: bool = False,
                 num_position_embeddings: int | None = None, deepstack_blocks: Sequence[int] = ()):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"vision embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        blocks = None if full_attention_blocks is None else sorted({int(i) for i in full_attention_blocks})
        bad = [i for i in blocks or () if not 0 <= i < depth]
        if bad:
            raise ValueError(f"vision full_attention_blocks={list(full_attention_blocks)}: {bad[0]} is not a block "
                             f"index (depth={depth})")
        self.full_attention_blocks = blocks
        # per block: attends within windows (window_ids), or over each frame (segment_ids)
        self.windowed = [blocks is not None and i not in blocks for i in range(depth)]
        taps = [int(i) for i in deepstack_blocks]
        bad = [i for i in taps if not 0 <= i < depth]
        if bad or len(set(taps)) != len(taps):
            raise ValueError(f"vision deepstack_blocks={taps}: "
                             + (f"{bad[0]} is not a block index (depth={depth})" if bad else "an index repeats"))
        self.deepstack_blocks = taps
        head_dim = embed_dim // num_heads
        self.patch_embed = PatchEmbed3D(in_channels=in_channels, temporal_patch_size=temporal_patch_size,
                                        patch_size=patch_size, embed_dim=embed_dim, bias=patch_bias)
        self.pos_embed, self.pos_grid = None, None
        if num_position_embeddings is not None:
            side = math.isqrt(int(num_position_embeddings))
            if num_position_embeddings < 1 or side * side != num_position_embeddings:
                raise ValueError(f"vision num_position_embeddings={num_position_embeddings} is not a square grid "
                                 f"(side^2 for an integer side)")
            self.pos_embed = nn.Embedding(num_position_embeddings, embed_dim)
            self.pos_grid = side  # the learned grid's side, for the host's pos_interpolation
        self.rotary = rope_2d(head_dim, rope_theta)
        hidden = int(embed_dim * mlp_ratio) if intermediate_dim is None else int(intermediate_dim)
        self.blocks = nn.ModuleList(
            vit_block(dim=embed_dim, num_heads=num_heads, hidden_dim=hidden, act=act, attn_fn=attn_fn, layer_idx=i,
                      norm_eps=norm_eps, norm_layer=norm_layer, mlp_layer=mlp_layer)
            for i in range(depth)
        )
        self.embed_dim = embed_dim

    def forward(self, patches: torch.Tensor, patch_pos: torch.Tensor, segment_ids: torch.Tensor,
                window_ids: torch.Tensor | None = None, interp_indices: torch.Tensor | None = None,
                interp_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Encode packed patches.

        Args:
            patches: ``[n, c * t * p * p]`` flattened patches of all images, in processor order
                (with window attention: in window order, :func:`window_order`).
            patch_pos: ``[n, 2]`` (row, column) of each patch in its image grid.
            segment_ids: ``[n]`` one id per attention block (per frame per image).
            window_ids: ``[n]`` one id per attention window, for the blocks not in
                ``full_attention_blocks`` (needed when there are some; unused otherwise).
            interp_indices: ``[n, 4]`` int64, with ``num_position_embeddings``: the rows of
                ``pos_embed`` that each patch's position embedding blends (:func:`pos_interpolation`;
                padding rows: any valid row).
            interp_weights: ``[n, 4]`` float32, their bilinear weights (padding rows: zeros).

        Returns:
            ``[n, (1 + len(deepstack_blocks)) * embed_dim]`` patch features in the order of the input
            rows: the last block's output, then each ``deepstack_blocks`` block's output in turn
            (``[n, embed_dim]`` alone without DeepStack).
        """
        if window_ids is None and any(self.windowed):
            raise ValueError(f"vision encoder: the blocks outside full_attention_blocks={self.full_attention_blocks} "
                             f"attend within windows and need window_ids")
        if self.pos_embed is not None and (interp_indices is None or interp_weights is None):
            raise ValueError(f"vision encoder: its {self.pos_grid}x{self.pos_grid} learned position grid is resampled "
                             f"to each image by interp_indices and interp_weights (pos_interpolation); pass both")
        x = self.patch_embed(patches)  # [n, e]
        if self.pos_embed is not None:
            # [n, 4, e] taps weighted in float32 (as transformers' float32 weights promote them), then summed
            pos = (self.pos_embed(interp_indices) * interp_weights.float()[:, :, None]).sum(1)  # [n, e]
            x = x + pos.to(x.dtype)
        x = x.unsqueeze(0)  # [1, n, e]
        rope = self.rotary(patch_pos.t().unsqueeze(1))  # positions [2, 1, n] -> cos, sin [1, n, hd]
        seg = segment_ids.unsqueeze(0)  # [1, n]
        full = {"q_segment_ids": seg, "kv_segment_ids": seg}
        if window_ids is not None:
            win = window_ids.unsqueeze(0)  # [1, n]
            windows = {"q_segment_ids": win, "kv_segment_ids": win}
        taps = {}
        for i, (block, windowed) in enumerate(zip(self.blocks, self.windowed)):
            x = block(x, rope=rope, attn_kwargs=windows if windowed else full)
            if i in self.deepstack_blocks:
                taps[i] = x
        if not taps:
            return x.squeeze(0)
        return torch.cat([x] + [taps[i] for i in self.deepstack_blocks], dim=-1).squeeze(0)  # [n, (1 + k) * e]


def patch_positions(grid_thw: np.ndarray, merge_size: int) -> np.ndarray:
    """(row, column) per patch, in the processor's order (``merge x merge`` blocks are contiguous).

    Args:
        grid_thw: ``[num_items, 3]`` patches along time, height and width per image or video.
        merge_size: the spatial merge size of the patch merger.

    Returns:
        ``[sum(t * h * w), 2]`` int64.
    """
    out = []
    for t, h, w in np.asarray(grid_thw, dtype=np.int64).tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")  # [h, w]
        block = (h // merge_size, merge_size, w // merge_size, merge_size)
        rows = rows.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out, axis=0) if out else np.zeros((0, 2), np.int64)


def frame_segments(grid_thw: np.ndarray, start: int = 0) -> np.ndarray:
    """Segment id per patch: each frame of each image or video attends only within itself."""
    sizes = [h * w for t, h, w in np.asarray(grid_thw, dtype=np.int64).tolist() for _ in range(t)]
    return np.repeat(np.arange(start, start + len(sizes), dtype=np.int64), sizes)


def pos_interpolation(grid_thw: np.ndarray, side: int, merge_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-VL's learned position grid resampled to each item's patch grid: 4 taps and weights per patch.

    Bilinear with aligned corners (``F.interpolate(mode="bilinear", align_corners=True)`` of the
    ``side x side`` grid to ``h x w``): patch row ``r`` reads the grid at ``r * (side - 1) / (h - 1)``
    (0 when ``h == 1``), columns alike. The float32 arithmetic is transformers' own
    (``get_vision_interpolation_indices_and_weights``; its 4.57 ``fast_pos_embed_interpolate``
    differs from it by an ulp at most), so the weights are bit-identical to its. Patches are listed
    in the processor's order (``merge x merge`` blocks contiguous; a video's frames repeat the grid).

    Args:
        grid_thw: ``[num_items, 3]`` patches along time, height and width per image or video.
        side: the learned grid's side (``sqrt(num_position_embeddings)``).
        merge_size: the spatial merge size of the patch merger.

    Returns:
        ``indices [sum(t * h * w), 4]`` int64 rows of ``pos_embed`` (row-major ``side x side``) and
        ``weights [sum(t * h * w), 4]`` float32, the taps ordered (top-left, top-right, bottom-left,
        bottom-right).
    """
    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        # index [n] -> taps [n, 2] into one side of the grid, weights [n, 2]
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))  # [n]
        floor = np.floor(src)
        offsets = np.arange(2)
        taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
        distance = np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32))  # [n, 2] float32
        return taps, np.maximum(np.float32(1) - distance, np.float32(0))

    if side < 1:
        raise ValueError(f"position grid side={side}: the learned grid needs at least one row")
    indices, weights = [np.zeros((0, 4), np.int64)], [np.zeros((0, 4), np.float32)]
    for g in np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3):
        _, h, w = (int(x) for x in g)
        pos = patch_positions(g[None], merge_size)  # [t * h * w, 2] (row, column), processor order
        h_taps, h_w = axis(pos[:, 0], h)
        w_taps, w_w = axis(pos[:, 1], w)
        indices.append((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4))  # [n, 2, 2] -> [n, 4]
        weights.append((h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4))
    return np.concatenate(indices).astype(np.int64), np.concatenate(weights).astype(np.float32)


def window_order(grid_thw: np.ndarray, merge_size: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's window layout of merged units (``merge x merge`` blocks of patches).

    Each frame's grid of merged units is cut into ``window x window`` windows from its top-left
    corner (the last row and column of windows may be partial); the units are listed window by
    window (frames in order, windows row-major, units row-major inside a window), as transformers'
    ``get_vision_window_index`` lists them.

    Args:
        grid_thw: ``[num_items, 3]`` patches along time, height and width per image or video.
        merge_size: the spatial merge size of the patch merger.
        window: a window's side in merged units (``window_size // (patch_size * merge_size)``).

    Returns:
        ``order [units]``: the units (indexes in processor order, over all items) in window order,
        and ``window_id [units]``: the window of each unit in that order (0, 1, ... over all
        items). A patch-level order is ``(order[:, None] * merge^2 + arange(merge^2)).ravel()``;
        ``argsort(order)`` undoes it.
    """
    if window < 1:
        raise ValueError(f"window={window} merged units: a window must hold at least one")
    orders, windows, start, first = [], [], 0, 0
    for t, h, w in np.asarray(grid_thw, dtype=np.int64).tolist():
        gh, gw = h // merge_size, w // merge_size
        across = -(-gw // window)  # windows per row of windows
        per_frame = -(-gh // window) * across
        row_win = np.arange(gh) // window  # [gh]
        col_win = np.arange(gw) // window  # [gw]
        ids = (np.arange(t)[:, None, None] * per_frame + row_win[None, :, None] * across
               + col_win[None, None, :]).ravel()  # [t * gh * gw] window of each unit, processor order
        order = np.argsort(ids, kind="stable")  # by window; row-major inside each (a stable sort)
        orders.append(order + start)
        windows.append(ids[order] + first)
        start += t * gh * gw
        first += t * per_frame
    if not orders:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(orders).astype(np.int64), np.concatenate(windows).astype(np.int64)


def qwen2_vl_vit(*, embed_dim: int, depth: int, num_heads: int, mlp_ratio: float = 4.0, in_channels: int = 3,
                 temporal_patch_size: int = 2, patch_size: int = 14, act: str = "quick_gelu",
                 rope_theta: float = 10000.0, norm_eps: float = 1e-6, attention="sdpa",
                 intermediate_dim: int | None = None, norm_layer: Callable[[int, float], nn.Module] = layer_norm,
                 mlp_layer: Callable[..., nn.Module] = MLP,
                 full_attention_blocks: Sequence[int] | None = None) -> Qwen2VisionEncoder:
    """Component builder (``conf/encoder/qwen2_vl_vit.yaml``, ``qwen2_5_vl_vit.yaml``): the ViT with
    the attention backend ``attention`` (a backend or a ``conf/attention`` name); Qwen2-VL's with
    the defaults, Qwen2.5-VL's with RMSNorm, the gated MLP and window attention (see
    :class:`Qwen2VisionEncoder`)."""
    from mmzoo.backends import resolve

    return Qwen2VisionEncoder(in_channels=in_channels, temporal_patch_size=temporal_patch_size, patch_size=patch_size,
                              embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, act=act,
                              attn_fn=resolve(attention), rope_theta=rope_theta, norm_eps=norm_eps,
                              intermediate_dim=intermediate_dim, norm_layer=norm_layer, mlp_layer=mlp_layer,
                              full_attention_blocks=None if full_attention_blocks is None
                              else list(full_attention_blocks))


def qwen3_vl_vit(*, embed_dim: int, depth: int, num_heads: int, intermediate_dim: int,
                 num_position_embeddings: int, deepstack_blocks: Sequence[int] = (), in_channels: int = 3,
                 temporal_patch_size: int = 2, patch_size: int = 16, act: str = "gelu_pytorch_tanh",
                 rope_theta: float = 10000.0, norm_eps: float = 1e-6, attention="sdpa") -> Qwen2VisionEncoder:
    """Component builder (``conf/encoder/qwen3_vl_vit.yaml``): Qwen3-VL's ViT, the same
    :class:`Qwen2VisionEncoder` as Qwen2-VL's with a patch-embedding bias, a learned position grid
    of ``num_position_embeddings`` (a square) and the DeepStack taps ``deepstack_blocks``;
    LayerNorm blocks with the two-layer MLP (``linear_fc1`` / ``linear_fc2``). Its own builder,
    not more arguments of :func:`qwen2_vl_vit`, so each family's defaults and required sizes stay
    its own (Qwen3-VL has no ``mlp_ratio`` and always a position grid)."""
    from mmzoo.backends import resolve

    return Qwen2VisionEncoder(in_channels=in_channels, temporal_patch_size=temporal_patch_size, patch_size=patch_size,
                              embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=4.0, act=act,
                              attn_fn=resolve(attention), rope_theta=rope_theta, norm_eps=norm_eps,
                              intermediate_dim=intermediate_dim, patch_bias=True,
                              num_position_embeddings=num_position_embeddings,
                              deepstack_blocks=list(deepstack_blocks))


# transformers' Qwen3-VL vision keys (relative to the tower: ``model.visual.`` stripped) -> mmzoo's,
# relative to a Tower(encoder, adapter); the blocks' fused qkv is split by qwen3_vl_vision_weights
_QWEN3_VL_VISION_RENAMES = [
    (r"^merger\.norm\.", "adapter.ln_q."),
    (r"^merger\.linear_fc1\.", "adapter.mlp.0."),
    (r"^merger\.linear_fc2\.", "adapter.mlp.2."),
    (r"^deepstack_merger_list\.(\d+)\.norm\.", r"adapter.deepstack.\1.ln_q."),
    (r"^deepstack_merger_list\.(\d+)\.linear_fc1\.", r"adapter.deepstack.\1.mlp.0."),
    (r"^deepstack_merger_list\.(\d+)\.linear_fc2\.", r"adapter.deepstack.\1.mlp.2."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.blocks.\1.attn.o_proj."),
    (r"^blocks\.(\d+)\.mlp\.linear_fc1\.", r"encoder.blocks.\1.mlp.fc1."),
    (r"^blocks\.(\d+)\.mlp\.linear_fc2\.", r"encoder.blocks.\1.mlp.fc2."),
    (r"^(blocks\.\d+\.norm[12]\.|patch_embed\.proj\.|pos_embed\.)", r"encoder.\1"),
]


def qwen3_vl_vision_weights(hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' ``Qwen3VLVisionModel`` state -> a ``Tower(encoder=qwen3_vl_vit(...),
    adapter=PatchMerger(..., deepstack_taps=k))`` state, for a family's ``convert_weights`` (strip
    ``model.visual.`` before, prefix ``towers.vision.`` after).

    ``blocks.i.attn.qkv`` is split into ``q_proj / k_proj / v_proj`` (thirds of its rows),
    ``attn.proj`` is ``o_proj``, the MLP's ``linear_fc1 / linear_fc2`` are ``fc1 / fc2``; the final
    ``merger`` is the adapter (``norm`` -> ``ln_q``, ``linear_fc1 / linear_fc2`` -> ``mlp.0 / mlp.2``)
    and ``deepstack_merger_list.j`` its ``deepstack.j``. A key that matches no rule is kept as it
    is, for the strict loader to report.

    Args:
        hf: ``{key: tensor}`` with keys relative to the vision model (``blocks.0.attn.qkv.weight``).

    Returns:
        ``{key: tensor}`` with keys relative to the tower (``encoder.blocks.0.attn.q_proj.weight``).
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in hf.items():
        m = re.match(r"^blocks\.(\d+)\.attn\.qkv\.(weight|bias)$", key)
        if m:
            if value.shape[0] % 3:
                raise ValueError(f"{key} has {value.shape[0]} rows, not q, k and v thirds")
            for part, chunk in zip("qkv", value.chunk(3, dim=0)):
                out[f"encoder.blocks.{m.group(1)}.attn.{part}_proj.{m.group(2)}"] = chunk.contiguous()
            continue
        new = key
        for pattern, repl in _QWEN3_VL_VISION_RENAMES:
            new, hits = re.subn(pattern, repl, new)
            if hits:
                break
        out[new] = value
    return out
