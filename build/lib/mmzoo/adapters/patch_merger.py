"""Qwen2-VL's patch merger: LayerNorm, then concatenate each ``m x m`` block of patches and project.

The processor orders patches so that each ``m x m`` spatial block is contiguous; the merger
views ``m^2`` consecutive patch features as one vector and maps it to the LM's width, giving one
LM token per block.
"""

from __future__ import annotations

import torch
from torch import nn


class PatchMerger(nn.Module):
    """``[n, context_dim]`` patch features -> ``[n / m^2, out_dim]`` LM embeddings."""

    def __init__(self, *, context_dim: int, out_dim: int, merge_size: int, norm_eps: float = 1e-6):
        super().__init__()
        self.merge_size = merge_size
        self.hidden = context_dim * merge_size * merge_size
        self.ln_q = nn.LayerNorm(context_dim, eps=norm_eps)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    @property
    def rows_per_output(self) -> int:
        return self.merge_size * self.merge_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))  # [n / m^2, out_dim]
