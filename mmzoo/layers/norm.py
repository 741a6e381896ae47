"""Normalization layers."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019), statistics in float32.

    Not ``torch.nn.RMSNorm``: that one normalizes in the input's dtype, while transformers' Qwen2 and
    Llama norms compute in float32 and cast back, which bfloat16 parity needs.

    Args:
        dim: the normalized (last) axis.
        eps: added to the mean square.
        unit_offset: Gemma's form: the scale is ``1 + weight`` (``weight`` starts at zero) and is
            applied in float32 before the cast back (``(x * (1 + w)).to(dtype)``, where Llama's is
            ``w * x.to(dtype)``); checkpoints store ``weight`` itself, so they load unchanged.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def gemma_rms_norm(dim: int, eps: float) -> RMSNorm:
    """Gemma's RMSNorm (``1 + weight``, float32 scale): a ``norm_layer(dim, eps)`` factory."""
    return RMSNorm(dim, eps, unit_offset=True)


def layer_norm(dim: int, eps: float) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=eps)
