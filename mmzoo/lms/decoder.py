"""Decoder-only language model: token embedding, pre-norm blocks with RoPE, final norm, LM head.

One class serves Qwen2 (qkv bias, M-RoPE or 1-D RoPE) and Llama (no bias, 1-D RoPE); the
differences are constructor arguments. The rotary module is injected.
"""

from __future__ import annotations

import torch
from torch import nn

from mmzoo.layers import Attention, GatedMLP, RMSNorm, Rotary, TransformerBlock
from mmzoo.layers.attention import take_rows


class DecoderLM(nn.Module):
    """A causal decoder LM.

    Args:
        vocab_size, dim, num_layers, num_heads, num_kv_heads, head_dim, intermediate_dim: sizes.
        rotary: the rotary module (:func:`mmzoo.layers.rope_1d` or :func:`mmzoo.layers.mrope`).
        attn_fn: the attention backend for every layer.
        qkv_bias: bias on q/k/v (Qwen2: True; Llama: False).
        norm_eps: RMSNorm epsilon.
        act: MLP activation.
        tie_word_embeddings: share the LM head with the token embedding.
        layer_types: per layer, ``"full_attention"`` or ``"sliding_attention"`` (transformers'
            ``layer_types``); None: every layer full.
        sliding_window: the sliding layers' window (keys up to each query's own).
    """

    def __init__(self, *, vocab_size: int, dim: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate_dim: int, rotary: Rotary, attn_fn, qkv_bias: bool,
                 norm_eps: float, act: str = "silu", tie_word_embeddings: bool = False,
                 layer_types: list[str] | None = None, sliding_window: int | None = None):
        super().__init__()
        if rotary.head_dim != head_dim:
            raise ValueError(f"rotary covers {rotary.head_dim} channels but head_dim={head_dim}")
        windows = layer_windows(num_layers, layer_types, sliding_window)
        self.dim, self.num_layers, self.num_kv_heads, self.head_dim = dim, num_layers, num_kv_heads, head_dim
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.rotary = rotary
        self.layers = nn.ModuleList(
            TransformerBlock(
                attn=Attention(dim=dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               attn_fn=attn_fn, causal=True, qkv_bias=qkv_bias, out_bias=False, layer_idx=i,
                               sliding_window=windows[i]),
                mlp=GatedMLP(dim=dim, hidden_dim=intermediate_dim, act=act),
                norm1=RMSNorm(dim, norm_eps),
                norm2=RMSNorm(dim, norm_eps),
            )
            for i in range(num_layers)
        )
        self.norm = RMSNorm(dim, norm_eps)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.num_embeddings

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, *, cache=None,
                attn_kwargs=None, logits_index: torch.Tensor | None = None, head: bool = True) -> torch.Tensor:
        """Run the decoder and return logits.

        Args:
            inputs_embeds: ``[b, s, dim]`` (token embeddings, possibly merged with media embeddings).
            positions: ``[axes, b, s]`` rotary positions (1 axis for RoPE, 3 for M-RoPE).
            cache: a KV-cache view (see :mod:`mmzoo.lms.kv_cache`) or None.
            attn_kwargs: masking arguments for the backend (``q_positions``, ``kv_lengths``, ...).
            logits_index: ``[b]`` the one position per row to compute logits at, ``[b, n]`` the
                ``n`` positions per row (prompts packed in a row), or None for all. Given, the last
                layer runs its queries, attention output and MLP at those positions only (every
                position's keys and values still reach ``cache``).
            head: False: return the last layer's hidden states at those positions instead, for
                :meth:`logits` to finish (an executor running the LM head as a step of its own).

        Returns:
            ``[b, s, vocab]`` logits, or ``[b, vocab]`` / ``[b, n, vocab]`` with ``logits_index``
            (``dim`` instead of ``vocab`` without ``head``).
        """
        rope = self.rotary(positions)
        x = inputs_embeds
        rows = None if logits_index is None else logits_index[:, None] if logits_index.dim() == 1 else logits_index
        # the last layer computes its queries, attention output and MLP at the wanted positions only:
        # nothing else reads them (its keys and values, which the cache keeps, come from its input);
        # a step of one position per row (decode) has nothing to cut
        cut = rows is not None and x.shape[1] > 1
        for i, layer in enumerate(self.layers):
            last = cut and i == len(self.layers) - 1
            x = layer(x, rope=rope, cache=cache, attn_kwargs=attn_kwargs, rows=rows if last else None)
        if rows is not None:
            x = x if cut else take_rows(x, rows)  # [b, n, dim]
            x = x[:, 0] if logits_index.dim() == 1 else x  # [b, dim] / [b, n, dim]
        return self.logits(x) if head else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head: ``[..., dim]`` last-layer hidden states -> float32 ``[..., vocab]``."""
        return self.lm_head(self.norm(hidden)).float()


LAYER_TYPES = ("full_attention", "sliding_attention")  # the layer_types mmzoo's LMs build


def layer_windows(num_layers: int, layer_types: list[str] | None, sliding_window: int | None) -> list[int | None]:
    """Each layer's sliding window (None: full attention) from transformers' ``layer_types``."""
    kinds = list(layer_types or [])
    bad = sorted({k for k in kinds if k not in LAYER_TYPES})
    if bad:
        raise ValueError(f"layer_types holds {bad}: mmzoo's LMs have full_attention and sliding_attention layers")
    if "sliding_attention" not in kinds:  # all full (a depth set by hand need not restate them)
        return [None] * num_layers
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for num_layers={num_layers}")
    if not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(f"layer_types has sliding_attention layers but sliding_window={sliding_window!r} is not a "
                         f"positive integer")
    return [sliding_window if k == "sliding_attention" else None for k in kinds]


# ---------------------------------------------------------------- component builders (conf/lm/*.yaml)

def _plain_rope(rope_type: str) -> None:
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not supported (only plain RoPE)")


def qwen2(*, vocab_size: int, dim: int, num_layers: int, num_heads: int, num_kv_heads: int, intermediate_dim: int,
          head_dim: int | None = None, rope_theta: float = 1e6, mrope_section: list[int] | None = None,
          rope_type: str = "default", norm_eps: float = 1e-6, act: str = "silu", tie_word_embeddings: bool = False,
          layer_types: list[str] | None = None, sliding_window: int | None = None, attention="sdpa") -> DecoderLM:
    """The Qwen2 decoder (q/k/v bias, RMSNorm, SwiGLU): 1-D RoPE, or Qwen2-VL's M-RoPE when
    ``mrope_section`` (frequencies per t/h/w axis) is given; the ``sliding_attention`` layers of
    ``layer_types`` (``use_sliding_window``: those from ``max_window_layers`` on) attend over the
    last ``sliding_window`` tokens."""
    from mmzoo.backends import resolve
    from mmzoo.layers import mrope, rope_1d

    _plain_rope(rope_type)
    head_dim = head_dim or dim // num_heads
    rotary = mrope(head_dim, rope_theta, list(mrope_section)) if mrope_section else rope_1d(head_dim, rope_theta)
    return DecoderLM(vocab_size=vocab_size, dim=dim, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_dim=intermediate_dim, rotary=rotary,
                     attn_fn=resolve(attention), qkv_bias=True, norm_eps=norm_eps, act=act,
                     tie_word_embeddings=tie_word_embeddings, layer_types=layer_types, sliding_window=sliding_window)


def llama(*, vocab_size: int, dim: int, num_layers: int, num_heads: int, num_kv_heads: int, intermediate_dim: int,
          head_dim: int | None = None, rope_theta: float = 10000.0, rope_type: str = "default", norm_eps: float = 1e-5,
          act: str = "silu", tie_word_embeddings: bool = False, layer_types: list[str] | None = None,
          sliding_window: int | None = None, attention="sdpa") -> DecoderLM:
    """The Llama decoder: no q/k/v bias, RMSNorm, SwiGLU, 1-D RoPE (with ``layer_types``' sliding
    layers, as :func:`qwen2`'s, when a config has them)."""
    from mmzoo.backends import resolve
    from mmzoo.layers import rope_1d

    _plain_rope(rope_type)  # a checkpoint with attention/MLP biases fails strict loading (unexpected tensors)
    head_dim = head_dim or dim // num_heads
    return DecoderLM(vocab_size=vocab_size, dim=dim, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_dim=intermediate_dim,
                     rotary=rope_1d(head_dim, rope_theta), attn_fn=resolve(attention), qkv_bias=False,
                     norm_eps=norm_eps, act=act, tie_word_embeddings=tie_word_embeddings, layer_types=layer_types,
                     sliding_window=sliding_window)
