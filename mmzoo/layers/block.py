"""The one pre-norm transformer block shared by ViT towers, audio towers and LLM decoders."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mmzoo.layers.attention import Attention, take_rows
from mmzoo.layers.mlp import MLP
from mmzoo.layers.norm import layer_norm


class TransformerBlock(nn.Module):
    """``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``.

    The sub-modules are injected, so a CLIP/Qwen2-VL ViT block (LayerNorm, MLP, bidirectional
    attention), a Qwen2.5-VL ViT block (RMSNorm, gated MLP with biases) and a Llama/Qwen2 decoder
    layer (RMSNorm, gated MLP, causal attention with a KV cache) are the same class.
    """

    def __init__(self, *, attn: nn.Module, mlp: nn.Module, norm1: nn.Module, norm2: nn.Module):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp

    def forward(self, x: torch.Tensor, *, rope=None, cache=None, attn_kwargs=None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x [b, s, dim]`` -> ``[b, s, dim]``; with ``rows [b, n]`` only those positions' outputs
        ``[b, n, dim]`` (every position's keys and values still reach the cache)."""
        residual = x if rows is None else take_rows(x, rows)
        x = residual + self.attn(self.norm1(x), rope=rope, cache=cache, attn_kwargs=attn_kwargs, rows=rows)
        return x + self.mlp(self.norm2(x))


def vit_block(*, dim: int, num_heads: int, hidden_dim: int, act: str, attn_fn, layer_idx: int,
              norm_eps: float, norm_layer: Callable[[int, float], nn.Module] = layer_norm,
              mlp_layer: Callable[..., nn.Module] = MLP) -> TransformerBlock:
    """The encoder block of CLIP, Qwen2-VL's and Qwen2.5-VL's ViTs and Whisper: bidirectional
    attention with q/k/v and output biases, an MLP with biases, pre-norm.

    Args:
        norm_layer: ``norm_layer(dim, eps)`` builds each of the two norms: LayerNorm (CLIP,
            Qwen2-VL, Whisper) or :class:`~mmzoo.layers.RMSNorm` (Qwen2.5-VL).
        mlp_layer: ``mlp_layer(dim=, hidden_dim=, act=, bias=True)`` builds the MLP: the two-layer
            :class:`~mmzoo.layers.MLP` or the gated :class:`~mmzoo.layers.GatedMLP` (Qwen2.5-VL).
    """
    if dim % num_heads:
        raise ValueError(f"embed_dim={dim} is not divisible by num_heads={num_heads}")
    return TransformerBlock(
        attn=Attention(dim=dim, num_heads=num_heads, num_kv_heads=num_heads, head_dim=dim // num_heads,
                       attn_fn=attn_fn, causal=False, qkv_bias=True, out_bias=True, layer_idx=layer_idx),
        mlp=mlp_layer(dim=dim, hidden_dim=hidden_dim, act=act, bias=True),
        norm1=norm_layer(dim, norm_eps),
        norm2=norm_layer(dim, norm_eps),
    )
