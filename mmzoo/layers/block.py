"""The one pre-norm transformer block shared by ViT towers, audio towers and LLM decoders."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mmzoo.layers.attention import Attention, take_rows
from mmzoo.layers.mlp import MLP
from mmzoo.layers.norm import layer_norm


class LayerScale(nn.Module):
    """A learned per-channel scale of a residual branch: ``x * weight`` (``[..., dim]``).

    Touvron et al., 2021, "Going deeper with Image Transformers" (CaiT, arXiv:2103.17239); timm's
    ``LayerScale``. InternViT's blocks scale both branches (``lambda_1``, ``lambda_2``)."""

    def __init__(self, dim: int, init_value: float = 1.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), float(init_value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class TransformerBlock(nn.Module):
    """``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``; with layer scales,
    ``x + scale1(attn(norm1(x)))`` then ``x + scale2(mlp(norm2(x)))``; with post-norms,
    ``x + post_attn_norm(attn(norm1(x)))`` then ``x + post_mlp_norm(mlp(norm2(x)))``.

    The sub-modules are injected, so a CLIP/Qwen2-VL ViT block (LayerNorm, MLP, bidirectional
    attention), a Qwen2.5-VL ViT block (RMSNorm, gated MLP with biases), an InternViT block (either
    norm, both branches layer-scaled), a Llama/Qwen2 decoder layer (RMSNorm, gated MLP, causal
    attention with a KV cache) and a Gemma 3 decoder layer (four norms: each branch's output normed
    before the residual add) are the same class.

    Args:
        attn, mlp: the two branches.
        norm1, norm2: the norms of each branch's input.
        scale1, scale2: each branch's layer scale (:class:`LayerScale`); None: unscaled.
        post_attn_norm, post_mlp_norm: the norms of each branch's output, before the residual add
            (Gemma 3's ``post_attention_layernorm`` / ``post_feedforward_layernorm``); None: none.
    """

    def __init__(self, *, attn: nn.Module, mlp: nn.Module, norm1: nn.Module, norm2: nn.Module,
                 scale1: nn.Module | None = None, scale2: nn.Module | None = None,
                 post_attn_norm: nn.Module | None = None, post_mlp_norm: nn.Module | None = None):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = norm1, attn, norm2, mlp
        self.scale1, self.scale2 = scale1, scale2
        self.post_attn_norm, self.post_mlp_norm = post_attn_norm, post_mlp_norm

    def forward(self, x: torch.Tensor, *, rope=None, cache=None, attn_kwargs=None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x [b, s, dim]`` -> ``[b, s, dim]``; with ``rows [b, n]`` only those positions' outputs
        ``[b, n, dim]`` (every position's keys and values still reach the cache)."""
        residual = x if rows is None else take_rows(x, rows)
        h = self.attn(self.norm1(x), rope=rope, cache=cache, attn_kwargs=attn_kwargs, rows=rows)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x = residual + (h if self.scale1 is None else self.scale1(h))
        h = self.mlp(self.norm2(x))
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + (h if self.scale2 is None else self.scale2(h))


def vit_block(*, dim: int, num_heads: int, hidden_dim: int, act: str, attn_fn, layer_idx: int,
              norm_eps: float, norm_layer: Callable[[int, float], nn.Module] = layer_norm,
              mlp_layer: Callable[..., nn.Module] = MLP, qkv_bias: bool = True,
              qk_norm_layer: Callable[[int], nn.Module] | None = None,
              scale_layer: Callable[[int], nn.Module] | None = None) -> TransformerBlock:
    """The encoder block of CLIP, Qwen2-VL's and Qwen2.5-VL's ViTs, InternViT and Whisper:
    bidirectional attention with an output bias, an MLP with biases, pre-norm.

    Args:
        norm_layer: ``norm_layer(dim, eps)`` builds each of the two norms: LayerNorm (CLIP,
            Qwen2-VL, Whisper) or :class:`~mmzoo.layers.RMSNorm` (Qwen2.5-VL).
        mlp_layer: ``mlp_layer(dim=, hidden_dim=, act=, bias=True)`` builds the MLP: the two-layer
            :class:`~mmzoo.layers.MLP` or the gated :class:`~mmzoo.layers.GatedMLP` (Qwen2.5-VL).
        qkv_bias: biases on the q/k/v projections (InternViT's ``attention_bias`` may drop them).
        qk_norm_layer: ``qk_norm_layer(dim)`` builds the norms of the queries and of the keys over
            their full width (InternViT-6B's ``use_qk_norm``); None: none.
        scale_layer: ``scale_layer(dim)`` builds each branch's layer scale (:class:`LayerScale`,
            InternViT's ``lambda_1`` / ``lambda_2``); None: unscaled branches.
    """
    if dim % num_heads:
        raise ValueError(f"embed_dim={dim} is not divisible by num_heads={num_heads}")
    return TransformerBlock(
        attn=Attention(dim=dim, num_heads=num_heads, num_kv_heads=num_heads, head_dim=dim // num_heads,
                       attn_fn=attn_fn, causal=False, qkv_bias=qkv_bias, out_bias=True, layer_idx=layer_idx,
                       q_norm=None if qk_norm_layer is None else qk_norm_layer(dim),
                       k_norm=None if qk_norm_layer is None else qk_norm_layer(dim)),
        mlp=mlp_layer(dim=dim, hidden_dim=hidden_dim, act=act, bias=True),
        norm1=norm_layer(dim, norm_eps),
        norm2=norm_layer(dim, norm_eps),
        scale1=None if scale_layer is None else scale_layer(dim),
        scale2=None if scale_layer is None else scale_layer(dim),
    )
