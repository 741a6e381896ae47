"""The one pre-norm transformer block shared by ViT towers, audio towers and LLM decoders."""

from __future__ import annotations

import torch
from torch import nn


class TransformerBlock(nn.Module):
    """``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``.

    The sub-modules are injected, so a CLIP/Qwen2-VL ViT block (LayerNorm, MLP, bidirectional
    attention) and a Llama/Qwen2 decoder layer (RMSNorm, gated MLP, causal attention with a KV
    cache) are the same class.
    """

    def __init__(self, *, attn: nn.Module, mlp: nn.Module, norm1: nn.Module, norm2: nn.Module):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp

    def forward(self, x: torch.Tensor, *, rope=None, cache=None, attn_kwargs=None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope=rope, cache=cache, attn_kwargs=attn_kwargs)
        return x + self.mlp(self.norm2(x))
