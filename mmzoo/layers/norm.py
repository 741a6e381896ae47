"""Normalization layers."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019), statistics in float32.

    Not ``torch.nn.RMSNorm``: that one normalizes in the input's dtype, while transformers' Qwen2 and
    Llama norms compute in float32 and cast back, which bfloat16 parity needs."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def layer_norm(dim: int, eps: float) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=eps)
