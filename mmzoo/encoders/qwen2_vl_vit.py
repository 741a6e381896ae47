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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from mmzoo.encoders._base import Encoder
from mmzoo.layers import MLP, layer_norm, rope_2d, vit_block


class PatchEmbed3D(nn.Module):
    """Linear embedding of flattened ``[c, t, p, p]`` patches (a Conv3d whose stride is its kernel)."""

    def __init__(self, *, in_channels: int, temporal_patch_size: int, patch_size: int, embed_dim: int):
        super().__init__()
        # Stored with the Conv3d weight layout [embed_dim, c, t, p, p] so checkpoints load as they are.
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(embed_dim, in_channels, temporal_patch_size, patch_size, patch_size))
        nn.init.normal_(self.proj.weight, std=0.02)
        self.patch_dim = in_channels * temporal_patch_size * patch_size * patch_size

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # patches: [n, c * t * p * p] -> [n, embed_dim]
        return F.linear(patches.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


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
    """

    # the Encoder contract: the input rows are patches of several items (rows_per_item None), and
    # patch_pos holds self.rotary's positions (a patch's row or column in its image grid, so below
    # the rows of one call: an executor may tabulate the rotary to its largest bucket)
    rotary_input = "patch_pos"

    def __init__(self, *, in_channels: int, temporal_patch_size: int, patch_size: int, embed_dim: int,
                 depth: int, num_heads: int, mlp_ratio: float, act: str, attn_fn, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-6, intermediate_dim: int | None = None,
                 norm_layer: Callable[[int, float], nn.Module] = layer_norm, mlp_layer: Callable[..., nn.Module] = MLP,
                 full_attention_blocks: Sequence[int] | None = None):
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
        head_dim = embed_dim // num_heads
        self.patch_embed = PatchEmbed3D(in_channels=in_channels, temporal_patch_size=temporal_patch_size,
                                        patch_size=patch_size, embed_dim=embed_dim)
        self.rotary = rope_2d(head_dim, rope_theta)
        hidden = int(embed_dim * mlp_ratio) if intermediate_dim is None else int(intermediate_dim)
        self.blocks = nn.ModuleList(
            vit_block(dim=embed_dim, num_heads=num_heads, hidden_dim=hidden, act=act, attn_fn=attn_fn, layer_idx=i,
                      norm_eps=norm_eps, norm_layer=norm_layer, mlp_layer=mlp_layer)
            for i in range(depth)
        )
        self.embed_dim = embed_dim

    def forward(self, patches: torch.Tensor, patch_pos: torch.Tensor, segment_ids: torch.Tensor,
                window_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Encode packed patches.

        Args:
            patches: ``[n, c * t * p * p]`` flattened patches of all images, in processor order
                (with window attention: in window order, :func:`window_order`).
            patch_pos: ``[n, 2]`` (row, column) of each patch in its image grid.
            segment_ids: ``[n]`` one id per attention block (per frame per image).
            window_ids: ``[n]`` one id per attention window, for the blocks not in
                ``full_attention_blocks`` (needed when there are some; unused otherwise).

        Returns:
            ``[n, embed_dim]`` patch features, in the order of the input rows.
        """
        if window_ids is None and any(self.windowed):
            raise ValueError(f"vision encoder: the blocks outside full_attention_blocks={self.full_attention_blocks} "
                             f"attend within windows and need window_ids")
        x = self.patch_embed(patches).unsqueeze(0)  # [1, n, e]
        rope = self.rotary(patch_pos.t().unsqueeze(1))  # positions [2, 1, n] -> cos, sin [1, n, hd]
        seg = segment_ids.unsqueeze(0)  # [1, n]
        full = {"q_segment_ids": seg, "kv_segment_ids": seg}
        if window_ids is not None:
            win = window_ids.unsqueeze(0)  # [1, n]
            windows = {"q_segment_ids": win, "kv_segment_ids": win}
        for block, windowed in zip(self.blocks, self.windowed):
            x = block(x, rope=rope, attn_kwargs=windows if windowed else full)
        return x.squeeze(0)


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
