"""Qwen2-VL's dynamic-resolution vision transformer.

Wang et al., 2024, "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any
Resolution". Images and videos are cut into ``temporal_patch_size x patch_size x patch_size``
patches (by the processor), embedded by a 3-D patch projection, and run through pre-LN ViT
blocks with 2-D rotary positions. Several images are packed into one sequence; attention is
block-diagonal, one block per frame of each image or video (given here as ``segment_ids``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from mmzoo.encoders._base import Encoder
from mmzoo.layers import rope_2d, vit_block


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
        embed_dim, depth, num_heads, mlp_ratio, act: tower sizes.
        attn_fn: the attention backend for every block.
        rope_theta: base of the 2-D rotary frequencies.
        norm_eps: LayerNorm epsilon.
    """

    # the Encoder contract: the input rows are patches of several items (rows_per_item None), and
    # patch_pos holds self.rotary's positions (a patch's row or column in its image grid, so below
    # the rows of one call: an executor may tabulate the rotary to its largest bucket)
    rotary_input = "patch_pos"

    def __init__(self, *, in_channels: int, temporal_patch_size: int, patch_size: int, embed_dim: int,
                 depth: int, num_heads: int, mlp_ratio: float, act: str, attn_fn, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-6):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"vision embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        head_dim = embed_dim // num_heads
        self.patch_embed = PatchEmbed3D(in_channels=in_channels, temporal_patch_size=temporal_patch_size,
                                        patch_size=patch_size, embed_dim=embed_dim)
        self.rotary = rope_2d(head_dim, rope_theta)
        hidden = int(embed_dim * mlp_ratio)
        self.blocks = nn.ModuleList(
            vit_block(dim=embed_dim, num_heads=num_heads, hidden_dim=hidden, act=act, attn_fn=attn_fn, layer_idx=i,
                      norm_eps=norm_eps)
            for i in range(depth)
        )
        self.embed_dim = embed_dim

    def forward(self, patches: torch.Tensor, patch_pos: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
        """Encode packed patches.

        Args:
            patches: ``[n, c * t * p * p]`` flattened patches of all images, in processor order.
            patch_pos: ``[n, 2]`` (row, column) of each patch in its image grid.
            segment_ids: ``[n]`` one id per attention block (per frame per image).

        Returns:
            ``[n, embed_dim]`` patch features.
        """
        x = self.patch_embed(patches).unsqueeze(0)  # [1, n, e]
        rope = self.rotary(patch_pos.t().unsqueeze(1))  # positions [2, 1, n] -> cos, sin [1, n, hd]
        seg = segment_ids.unsqueeze(0)  # [1, n]
        kwargs = {"q_segment_ids": seg, "kv_segment_ids": seg}
        for block in self.blocks:
            x = block(x, rope=rope, attn_kwargs=kwargs)
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


def qwen2_vl_vit(*, embed_dim: int, depth: int, num_heads: int, mlp_ratio: float = 4.0, in_channels: int = 3,
                 temporal_patch_size: int = 2, patch_size: int = 14, act: str = "quick_gelu",
                 rope_theta: float = 10000.0, norm_eps: float = 1e-6, attention="sdpa") -> Qwen2VisionEncoder:
    """Component builder (``conf/encoder/qwen2_vl_vit.yaml``): Qwen2-VL's ViT with the attention
    backend ``attention`` (a backend or a ``conf/attention`` name)."""
    from mmzoo.backends import resolve

    return Qwen2VisionEncoder(in_channels=in_channels, temporal_patch_size=temporal_patch_size, patch_size=patch_size,
                              embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, act=act,
                              attn_fn=resolve(attention), rope_theta=rope_theta, norm_eps=norm_eps)
