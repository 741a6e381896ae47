"""Decoder-only language model: token embedding, pre-norm blocks with RoPE, final norm, LM head.

One class serves Qwen2 (qkv bias, M-RoPE or 1-D RoPE), Llama (no bias, 1-D RoPE), Qwen3 and
Qwen3-VL's text model (per-head q/k RMSNorms; 1-D RoPE, or Qwen3-VL's interleaved M-RoPE) and Gemma 3
(Gemma Team, 2025, "Gemma 3 Technical Report", arXiv:2503.19786: ``1 + w`` RMSNorms, post-norms on
both branches, per-head q/k norms, a scaled token embedding, GeGLU, and a RoPE of its own for the
sliding-window layers); the differences are constructor arguments. The rotary modules and the
norm factories are injected.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
from torch import nn

from mmzoo.layers import Attention, GatedMLP, RMSNorm, Rotary, TransformerBlock
from mmzoo.layers.attention import take_rows


class ScaledEmbedding(nn.Embedding):
    """A token embedding whose rows are multiplied by ``scale`` (Gemma's ``sqrt(dim)``), the factor
    first rounded to the weight's dtype as transformers' ``Gemma3TextScaledWordEmbedding`` does
    (in bfloat16, ``sqrt(2560) = 50.596`` becomes 50.5).

    An ``nn.Embedding`` (``weight``, ``num_embeddings``, the ``embed_tokens.weight`` name), so
    whatever embeds token ids through the module (``MultimodalLM.embed``) gets the scale; media
    rows merged in afterwards are not scaled, as in transformers. Reading ``.weight`` directly
    bypasses it (a tied LM head must: the head is not scaled)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, scale: float):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = float(scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(input_ids)  # [b, s, dim]
        return x * _rounded(self.scale, x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:g}"


@functools.lru_cache(maxsize=None)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as a float32 tensor cast to ``dtype`` (transformers' buffer ``.to(weight.dtype)``),
    back as a Python number (a constant in a traced graph)."""
    return torch.tensor(value, dtype=torch.float32).to(dtype).item()


class DecoderLM(nn.Module):
    """A causal decoder LM.

    Args:
        vocab_size, dim, num_layers, num_heads, num_kv_heads, head_dim, intermediate_dim: sizes.
        rotary: the rotary module (:func:`mmzoo.layers.rope_1d` or :func:`mmzoo.layers.mrope`);
            with ``sliding_rotary``, the full-attention layers' only.
        attn_fn: the attention backend for every layer.
        qkv_bias: bias on q/k/v (Qwen2: True; Llama: False).
        out_bias: bias on the attention output projection ``o_proj`` (Qwen3's ``attention_bias``
            puts one on all four projections; Qwen2, Llama, Gemma 3: False).
        norm_eps: RMSNorm epsilon.
        act: MLP activation.
        tie_word_embeddings: share the LM head with the token embedding.
        layer_types: per layer, ``"full_attention"`` or ``"sliding_attention"`` (transformers'
            ``layer_types``); None: every layer full.
        sliding_window: the sliding layers' window (keys up to each query's own).
        norm_layer: ``norm_layer(dim, eps)`` builds every norm over the model width (the blocks'
            and the final one): :class:`~mmzoo.layers.RMSNorm` (Qwen2, Llama) or
            :func:`~mmzoo.layers.gemma_rms_norm` (``1 + w``).
        post_norms: each block also norms its attention and MLP outputs before the residual add
            (``post_attn_norm``, ``post_mlp_norm``: Gemma 2/3's four norms per layer).
        qk_norm_layer: ``qk_norm_layer(head_dim, eps)`` builds the per-head norms of the queries and
            keys (``attn.q_norm``, ``attn.k_norm``, over ``head_dim``, before the rotary: Gemma 3's
            ``1 + w``, Qwen3's plain :class:`~mmzoo.layers.RMSNorm`); None: none.
        attn_scale: the attention scores' factor; None: ``head_dim ** -0.5`` (Gemma 3:
            ``query_pre_attn_scalar ** -0.5``).
        embed_scale: multiply the token embeddings by this (Gemma: ``sqrt(dim)``, see
            :class:`ScaledEmbedding`); None: a plain ``nn.Embedding``.
        sliding_rotary: the rotary of the ``sliding_attention`` layers, when it differs from the
            full layers' (Gemma 3: base 10000 locally, 1e6 with linear scaling globally); None:
            ``rotary`` for every layer.
        final_logit_softcapping: ``cap * tanh(logits / cap)`` on the float32 logits (Gemma 2's
            30.0); None: none.
    """

    def __init__(self, *, vocab_size: int, dim: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate_dim: int, rotary: Rotary, attn_fn, qkv_bias: bool,
                 norm_eps: float, act: str = "silu", out_bias: bool = False, tie_word_embeddings: bool = False,
                 layer_types: list[str] | None = None, sliding_window: int | None = None,
                 norm_layer: Callable[[int, float], nn.Module] = RMSNorm, post_norms: bool = False,
                 qk_norm_layer: Callable[[int, float], nn.Module] | None = None, attn_scale: float | None = None,
                 embed_scale: float | None = None, sliding_rotary: Rotary | None = None,
                 final_logit_softcapping: float | None = None):
        super().__init__()
        for name, rot in (("rotary", rotary), ("sliding_rotary", sliding_rotary)):
            if rot is not None and rot.head_dim != head_dim:
                raise ValueError(f"{name} covers {rot.head_dim} channels but head_dim={head_dim}")
        if sliding_rotary is not None and sliding_rotary.num_axes != rotary.num_axes:
            raise ValueError(f"sliding_rotary reads {sliding_rotary.num_axes} position axes but rotary reads "
                             f"{rotary.num_axes}")
        if final_logit_softcapping is not None and not final_logit_softcapping > 0:
            raise ValueError(f"final_logit_softcapping={final_logit_softcapping} must be positive (or None)")
        windows = layer_windows(num_layers, layer_types, sliding_window)
        self.dim, self.num_layers, self.num_kv_heads, self.head_dim = dim, num_layers, num_kv_heads, head_dim
        self.embed_tokens = (nn.Embedding(vocab_size, dim) if embed_scale is None
                             else ScaledEmbedding(vocab_size, dim, scale=embed_scale))
        self.rotary = rotary
        self.sliding_rotary = sliding_rotary
        self.layers = nn.ModuleList(
            TransformerBlock(
                attn=Attention(dim=dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               attn_fn=attn_fn, causal=True, qkv_bias=qkv_bias, out_bias=out_bias, layer_idx=i,
                               sliding_window=windows[i], scale=attn_scale,
                               q_norm=None if qk_norm_layer is None else qk_norm_layer(head_dim, norm_eps),
                               k_norm=None if qk_norm_layer is None else qk_norm_layer(head_dim, norm_eps),
                               qk_norm_per_head=qk_norm_layer is not None),
                mlp=GatedMLP(dim=dim, hidden_dim=intermediate_dim, act=act),
                norm1=norm_layer(dim, norm_eps),
                norm2=norm_layer(dim, norm_eps),
                post_attn_norm=norm_layer(dim, norm_eps) if post_norms else None,
                post_mlp_norm=norm_layer(dim, norm_eps) if post_norms else None,
            )
            for i in range(num_layers)
        )
        self.norm = norm_layer(dim, norm_eps)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        self.final_logit_softcapping = final_logit_softcapping
        self.tie_word_embeddings = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.num_embeddings

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, *, cache=None,
                attn_kwargs=None, logits_index: torch.Tensor | None = None, head: bool = True,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:
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
            deepstack: ``[k, b, s, dim]`` added to the hidden states after layers ``0 .. k - 1``
                (Qwen3-VL's DeepStack: the vision tower's intermediate features at the visual
                positions, zeros elsewhere, which adds nothing there), or None.

        Returns:
            ``[b, s, vocab]`` logits, or ``[b, vocab]`` / ``[b, n, vocab]`` with ``logits_index``
            (``dim`` instead of ``vocab`` without ``head``).
        """
        rope = self.rotary(positions)  # (cos, sin), each [b, s, head_dim]
        local = rope if self.sliding_rotary is None else self.sliding_rotary(positions)  # sliding layers'
        x = inputs_embeds
        rows = None if logits_index is None else logits_index[:, None] if logits_index.dim() == 1 else logits_index
        # the last layer computes its queries, attention output and MLP at the wanted positions only:
        # nothing else reads them (its keys and values, which the cache keeps, come from its input);
        # a step of one position per row (decode) has nothing to cut
        cut = rows is not None and x.shape[1] > 1
        for i, layer in enumerate(self.layers):
            last = cut and i == len(self.layers) - 1
            x = layer(x, rope=rope if layer.attn.sliding_window is None else local, cache=cache,
                      attn_kwargs=attn_kwargs, rows=rows if last else None)
            if deepstack is not None and i < deepstack.shape[0]:  # transformers' _deepstack_process
                x = x + (take_rows(deepstack[i], rows) if last else deepstack[i]).to(x.dtype)
        if rows is not None:
            x = x if cut else take_rows(x, rows)  # [b, n, dim]
            x = x[:, 0] if logits_index.dim() == 1 else x  # [b, dim] / [b, n, dim]
        return self.logits(x) if head else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head: ``[..., dim]`` last-layer hidden states -> float32 ``[..., vocab]``
        (soft-capped with ``final_logit_softcapping``)."""
        logits = self.lm_head(self.norm(hidden)).float()
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


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


def qwen3(*, vocab_size: int, dim: int, num_layers: int, num_heads: int, num_kv_heads: int, intermediate_dim: int,
          head_dim: int | None = None, rope_theta: float = 1e6, mrope_section: list[int] | None = None,
          mrope_interleaved: bool = False, rope_type: str = "default", norm_eps: float = 1e-6, act: str = "silu",
          tie_word_embeddings: bool = False, layer_types: list[str] | None = None, sliding_window: int | None = None,
          attention="sdpa", attention_bias: bool = False) -> DecoderLM:
    """The Qwen3 decoder (transformers' ``Qwen3Model``) and Qwen3-VL's text model
    (``Qwen3VLTextModel``, without DeepStack): RMSNorm, SwiGLU, and each query and key head
    RMS-normed over its ``head_dim`` channels (``q_norm``, ``k_norm``) before the rotary.

    Args:
        vocab_size, dim, num_layers, num_heads, num_kv_heads, intermediate_dim, head_dim: sizes
            (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads``, ``intermediate_size``, ``head_dim``; None: ``dim / num_heads``;
            Qwen3's configs give ``head_dim`` = 128 whatever ``dim / num_heads`` is).
        rope_theta, rope_type: ``rope_parameters``' ``rope_theta`` and ``rope_type`` (only ``default``).
        mrope_section: frequencies per t/h/w position axis (``rope_parameters["mrope_section"]``,
            Qwen3-VL: ``[24, 20, 20]``); None: 1-D RoPE (Qwen3).
        mrope_interleaved: ``rope_parameters["mrope_interleaved"]``: Qwen3-VL's interleaved M-RoPE
            (:func:`mmzoo.layers.mrope`); False: Qwen2-VL's consecutive sections. Needs ``mrope_section``.
        norm_eps: ``rms_norm_eps`` (every norm's, the q/k norms' too). act: ``hidden_act``.
        tie_word_embeddings, layer_types, sliding_window: as :class:`DecoderLM`.
        attention: the attention backend (name or object, :func:`mmzoo.backends.resolve`).
        attention_bias: biases on ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (Qwen3: False).

    Weight names: transformers' (``Qwen3ForCausalLM``'s ``model.*``, ``Qwen3VLForConditionalGeneration``'s
    ``model.language_model.*``) map with the Qwen2/Llama renames (``mmzoo.models.family.lm_key``);
    the q/k norms keep theirs::

        layers.N.self_attn.{q,k,v,o}_proj.weight          -> layers.N.attn.{q,k,v,o}_proj.weight
        layers.N.self_attn.{q,k}_norm.weight              -> layers.N.attn.{q,k}_norm.weight  ([head_dim])
        layers.N.input_layernorm.weight                   -> layers.N.norm1.weight
        layers.N.post_attention_layernorm.weight          -> layers.N.norm2.weight
        embed_tokens, layers.N.mlp.*, norm, lm_head       -> unchanged
    """
    from mmzoo.backends import resolve
    from mmzoo.layers import mrope, rope_1d

    _plain_rope(rope_type)
    if mrope_interleaved and not mrope_section:
        raise ValueError(f"mrope_interleaved=True needs mrope_section (got {mrope_section!r}); plain Qwen3 "
                         f"(1-D RoPE) sets mrope_interleaved=False")
    head_dim = head_dim or dim // num_heads
    rotary = (mrope(head_dim, rope_theta, list(mrope_section), interleaved=mrope_interleaved) if mrope_section
              else rope_1d(head_dim, rope_theta))
    return DecoderLM(vocab_size=vocab_size, dim=dim, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_dim=intermediate_dim, rotary=rotary,
                     attn_fn=resolve(attention), qkv_bias=attention_bias, out_bias=attention_bias, norm_eps=norm_eps,
                     act=act, tie_word_embeddings=tie_word_embeddings, layer_types=layer_types,
                     sliding_window=sliding_window, qk_norm_layer=RMSNorm)


def gemma3(*, vocab_size: int, dim: int, num_layers: int, num_heads: int, num_kv_heads: int, intermediate_dim: int,
           head_dim: int | None = None, query_pre_attn_scalar: float | None = None, rope_theta: float = 1e6,
           rope_type: str = "default", rope_factor: float = 1.0, sliding_rope_theta: float = 10000.0,
           sliding_rope_type: str = "default", norm_eps: float = 1e-6, act: str = "gelu_pytorch_tanh",
           tie_word_embeddings: bool = True, layer_types: list[str] | None = None, sliding_window: int | None = None,
           sliding_window_pattern: int | None = None, final_logit_softcapping: float | None = None,
           attn_logit_softcapping: float | None = None, attention="sdpa") -> DecoderLM:
    """The Gemma 3 text decoder (transformers' ``Gemma3TextModel`` + ``Gemma3ForCausalLM``'s head).

    Every norm is Gemma's RMSNorm (``1 + w``, scaled in float32); each layer norms its attention
    and MLP outputs before the residual add, and its queries and keys per head (over ``head_dim``);
    scores are scaled by ``query_pre_attn_scalar ** -0.5``; token embeddings are multiplied by
    ``sqrt(dim)`` (media rows merged in later are not); the MLP is GeGLU (``gelu_pytorch_tanh``).
    The ``sliding_attention`` layers of ``layer_types`` attend over the last ``sliding_window``
    tokens with a RoPE of their own (transformers 5's ``rope_parameters["sliding_attention"]``).

    Args:
        vocab_size, dim, num_layers, num_heads, num_kv_heads, intermediate_dim, head_dim: sizes
            (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
            ``num_key_value_heads``, ``intermediate_size``, ``head_dim``; None: ``dim / num_heads``).
        query_pre_attn_scalar: the attention scale is its ``** -0.5``; None: ``head_dim``.
        rope_theta, rope_type, rope_factor: the full-attention layers' RoPE
            (``rope_parameters["full_attention"]``: ``rope_theta``, ``rope_type`` ``default`` or
            ``linear``, and linear's ``factor``; Gemma 3 4B/12B/27B: 1e6, linear, 8).
        sliding_rope_theta, sliding_rope_type: the sliding layers' (``rope_parameters["sliding_attention"]``;
            ``rope_local_base_freq`` in older configs): 10000, ``default``.
        norm_eps: ``rms_norm_eps``. act: ``hidden_activation``.
        layer_types, sliding_window: as :class:`DecoderLM`.
        sliding_window_pattern: without ``layer_types``, every this-many-th layer is full and the
            others slide (transformers' derivation from older configs' key; Gemma 3: 6); None: as
            ``layer_types`` says.
        final_logit_softcapping: soft-cap the logits (``cap * tanh(logits / cap)``); Gemma 3: None.
        attn_logit_softcapping: not supported (no attention backend soft-caps scores): must be None,
            as in Gemma 3.
        attention: the attention backend (name or object, :func:`mmzoo.backends.resolve`).

    Weight names (transformers' ``Gemma3ForCausalLM``, ``model.`` prefix dropped -> this module;
    :func:`gemma3_lm_key` does it; the checkpoint's norm weights are ``w`` of ``1 + w`` and load as
    they are)::

        embed_tokens.weight                               -> embed_tokens.weight (scaled in forward)
        layers.N.self_attn.{q,k,v,o}_proj.weight          -> layers.N.attn.{q,k,v,o}_proj.weight
        layers.N.self_attn.{q,k}_norm.weight              -> layers.N.attn.{q,k}_norm.weight  ([head_dim])
        layers.N.input_layernorm.weight                   -> layers.N.norm1.weight
        layers.N.post_attention_layernorm.weight          -> layers.N.post_attn_norm.weight
        layers.N.pre_feedforward_layernorm.weight         -> layers.N.norm2.weight
        layers.N.post_feedforward_layernorm.weight        -> layers.N.post_mlp_norm.weight
        layers.N.mlp.{gate,up,down}_proj.weight           -> layers.N.mlp.{gate,up,down}_proj.weight
        norm.weight                                       -> norm.weight
        lm_head.weight (tied: absent)                     -> lm_head.weight

    Note ``post_attention_layernorm`` is the attention *output's* norm here, not the MLP input's
    as in Llama/Qwen2 (whose renames, ``mmzoo.models.family.lm_key``, map it to ``norm2``).
    """
    from mmzoo.backends import resolve
    from mmzoo.layers import gemma_rms_norm, rope_1d

    if attn_logit_softcapping is not None:
        raise ValueError(f"attn_logit_softcapping={attn_logit_softcapping} is not supported (mmzoo's attention "
                         f"backends do not soft-cap scores); Gemma 3 sets it to null")
    if layer_types is None and sliding_window_pattern is not None:
        if not isinstance(sliding_window_pattern, int) or sliding_window_pattern <= 0:
            raise ValueError(f"sliding_window_pattern={sliding_window_pattern!r} must be a positive integer")
        layer_types = ["sliding_attention" if (i + 1) % sliding_window_pattern else "full_attention"
                       for i in range(num_layers)]
    head_dim = head_dim or dim // num_heads
    scalar = head_dim if query_pre_attn_scalar is None else query_pre_attn_scalar
    if not scalar > 0:
        raise ValueError(f"query_pre_attn_scalar={query_pre_attn_scalar} must be positive")
    full = rope_1d(head_dim, rope_theta, _rope_factor("rope", rope_type, rope_factor))
    local = rope_1d(head_dim, sliding_rope_theta, _rope_factor("sliding_rope", sliding_rope_type, 1.0))
    return DecoderLM(vocab_size=vocab_size, dim=dim, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_dim=intermediate_dim, rotary=full,
                     attn_fn=resolve(attention), qkv_bias=False, norm_eps=norm_eps, act=act,
                     tie_word_embeddings=tie_word_embeddings, layer_types=layer_types, sliding_window=sliding_window,
                     norm_layer=gemma_rms_norm, post_norms=True, qk_norm_layer=gemma_rms_norm,
                     attn_scale=float(scalar) ** -0.5, embed_scale=dim ** 0.5, sliding_rotary=local,
                     final_logit_softcapping=final_logit_softcapping)


def _rope_factor(name: str, rope_type: str, factor: float) -> float:
    """The frequency divisor of a ``default`` (1) or ``linear`` (``factor``) RoPE."""
    if rope_type == "default":
        if factor != 1.0:
            raise ValueError(f"{name}_factor={factor} needs {name}_type='linear', not 'default'")
        return 1.0
    if rope_type == "linear":
        return factor
    raise ValueError(f"{name}_type={rope_type!r} is not supported (only 'default' and 'linear' RoPE)")


# transformers' Gemma 3 text-model names -> DecoderLM's (see :func:`gemma3`)
GEMMA3_RENAMES = [(r"\.self_attn\.", ".attn."), (r"\.input_layernorm\.", ".norm1."),
                  (r"\.post_attention_layernorm\.", ".post_attn_norm."),
                  (r"\.pre_feedforward_layernorm\.", ".norm2."),
                  (r"\.post_feedforward_layernorm\.", ".post_mlp_norm.")]


def gemma3_lm_key(key: str) -> str:
    """A Gemma 3 text-model weight name (``layers.0.self_attn.q_norm.weight``, with whatever prefix
    before ``layers.``) renamed to :func:`gemma3`'s module (``layers.0.attn.q_norm.weight``); other
    names (``embed_tokens``, ``norm``, ``mlp.*``, ``lm_head``) are unchanged."""
    for pattern, sub in GEMMA3_RENAMES:
        key = re.sub(pattern, sub, key)
    return key
