"""Qwen2-VL's and Qwen2.5-VL's patch merger: a norm, then concatenate each ``m x m`` block of patches and project.

The processor orders patches so that each ``m x m`` spatial block is contiguous; the merger
views ``m^2`` consecutive patch features as one vector and maps it to the LM's width, giving one
LM token per block. Qwen2-VL normalizes with LayerNorm, Qwen2.5-VL with RMSNorm (``norm_layer``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mmzoo.layers import layer_norm


class PatchMerger(nn.Module):
    """``[n, context_dim]`` patch features -> ``[n / m^2, out_dim]`` LM embeddings.

    Args:
        context_dim: the encoder's width.
        out_dim: the LM's width.
        merge_size: ``m``: each ``m x m`` block of patches becomes one embedding.
        norm_eps: the norm's epsilon.
        norm_layer: ``norm_layer(context_dim, norm_eps)`` builds the norm applied to each patch
            before merging (``ln_q``): LayerNorm (Qwen2-VL) or :class:`~mmzoo.layers.RMSNorm`
            (Qwen2.5-VL).
    """

    def __init__(self, *, context_dim: int, out_dim: int, merge_size: int, norm_eps: float = 1e-6,
                 norm_layer: Callable[[int, float], nn.Module] = layer_norm):
        super().__init__()
        self.merge_size = merge_size
        self.hidden = context_dim * merge_size * merge_size
        self.ln_q = norm_layer(context_dim, norm_eps)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    @property
    def rows_per_output(self) -> int:
        return self.merge_size * self.merge_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))  # [n, c] -> [n / m^2, m^2 * c] -> [n / m^2, out_dim]
