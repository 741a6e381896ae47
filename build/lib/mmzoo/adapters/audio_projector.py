"""Qwen2-Audio's projector: one linear map from the audio encoder's width to the LM's.

Chu et al., 2024, "Qwen2-Audio Technical Report" (arXiv:2407.10759). Qwen2-Audio also halves the
encoder's 1500 positions by average pooling (kernel 2, stride 2), but *before* the encoder's final
LayerNorm, so that pooling is the encoder's (:class:`mmzoo.encoders.WhisperEncoder`,
``pool_stride=2``): pooling after the norm, here, would change the numbers.
"""

from __future__ import annotations

import torch
from torch import nn


class AudioProjector(nn.Module):
    """``[n, in_dim]`` pooled audio features -> ``[n, out_dim]`` LM embeddings."""

    def __init__(self, *, in_dim: int, out_dim: int, bias: bool = True):
        super().__init__()
        self.linear = nn.Linear(in_dim, out_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
