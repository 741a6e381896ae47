"""Multi-head self-attention with an injected backend, optional rotary and an optional KV cache."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mmzoo.layers.linear import stack_linears
from mmzoo.layers.rotary import apply_rotary


class Attention(nn.Module):
    """Self-attention used by every tower and decoder in mmzoo.

    Projections are separate ``q_proj / k_proj / v_proj / o_proj`` (checkpoints with a fused qkv
    are split when loaded); :meth:`fuse_projections` can stack q/k/v into one ``qkv_proj`` after
    loading. The backend (``attn_fn``) is fixed at construction.

    Args:
        dim: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads (``< num_heads`` for grouped-query attention).
        head_dim: channels per head.
        attn_fn: an :mod:`mmzoo.backends` backend.
        causal: whether queries see only earlier keys.
        qkv_bias: bias on the q/k/v projections.
        out_bias: bias on the output projection.
        layer_idx: index of this layer in its stack (selects its slot in a KV cache).
        sliding_window: causal attention over the last this many keys up to each query's own
            (a sliding-window layer of Qwen2, Gemma 3); None: every earlier key.
        q_norm, k_norm: norms of the queries and keys over their full width (``[b, s, heads * head_dim]``,
            before the heads are split: InternViT-6B's q/k norm); None: none.
        qk_norm_per_head: ``q_norm`` and ``k_norm`` normalize each head over its ``head_dim``
            channels instead (``[b, s, heads, head_dim]``, after the split, before the rotary:
            Gemma 3's, Qwen3's); the norms are then built for ``head_dim``.
        scale: the attention scores' factor; None: ``head_dim ** -0.5`` (Gemma 3:
            ``query_pre_attn_scalar ** -0.5``).
    """

    def __init__(self, *, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, attn_fn,
                 causal: bool, qkv_bias: bool, out_bias: bool, layer_idx: int = 0, sliding_window: int | None = None,
                 q_norm: nn.Module | None = None, k_norm: nn.Module | None = None, qk_norm_per_head: bool = False,
                 scale: float | None = None):
        super().__init__()
        attn_fn.check_shape(head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads)
        if sliding_window is not None and (not causal or sliding_window <= 0):
            raise ValueError(f"attention: sliding_window={sliding_window} needs causal attention and a positive "
                             f"window (causal={causal})")
        self.sliding_window = sliding_window
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        if scale is not None and not scale > 0:
            raise ValueError(f"attention: scale={scale} must be positive")
        self.scale = head_dim ** -0.5 if scale is None else float(scale)
        self.causal = causal
        self.layer_idx = layer_idx
        self.attn_fn = attn_fn
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=out_bias)
        self.qkv_proj = None  # set by fuse_projections()
        self.q_norm, self.k_norm = q_norm, k_norm
        self.qk_norm_per_head = qk_norm_per_head

    def fuse_projections(self) -> None:
        """Replace ``q_proj / k_proj / v_proj`` by one ``qkv_proj`` holding their weights (and
        biases) stacked in that order: one matrix product instead of three, computing the same
        dot products. A layout for executors (XLA's CPU backend reads one wide matrix faster than
        three narrow ones); checkpoints load into the separate projections, so fuse after loading."""
        if self.qkv_proj is not None:
            return
        fused = stack_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = fused

    def forward(self, x: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache=None, attn_kwargs: dict[str, Any] | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x [b, s, dim]`` -> ``[b, s, dim]`` (``[b, n, dim]`` with ``rows``).

        Args:
            rope: ``(cos, sin)`` from :class:`mmzoo.layers.rotary.Rotary`, or None.
            cache: an object with ``update(layer_idx, k, v) -> (k, v)`` that stores the new keys
                and values and returns the ones to attend to (see :mod:`mmzoo.lms.kv_cache`).
            attn_kwargs: masking arguments passed through to the backend
                (``q_segment_ids``, ``kv_segment_ids``, ``q_positions``, ``kv_lengths``); with
                ``window`` (prompts packed in a row, none longer than it), the backend's
                :meth:`~mmzoo.backends._base.AttentionBackend.windowed` form.
            rows: ``[b, n]`` the positions of ``x`` whose outputs are wanted: every position's keys
                and values are computed (and cached), the queries only at ``rows`` (their
                ``q_positions``, ``q_segment_ids`` and ``q_blocks`` taken at ``rows``; no window).
        """
        b, s, _ = x.shape
        if self.qkv_proj is not None:
            hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([hq, hkv, hkv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        full_width = not self.qk_norm_per_head
        if self.q_norm is not None and full_width:
            q = self.q_norm(q)  # [b, s, hq * d]
        if self.k_norm is not None and full_width:
            k = self.k_norm(k)  # [b, s, hkv * d]
        q = q.view(b, s, self.num_heads, self.head_dim)  # [b, s, hq, d]
        k = k.view(b, s, self.num_kv_heads, self.head_dim)  # [b, s, hkv, d]
        if self.q_norm is not None and not full_width:
            q = self.q_norm(q)  # each head over its d channels
        if self.k_norm is not None and not full_width:
            k = self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [b, hq, s, d], [b, hkv, s, d]
        v = v.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        kwargs = dict(attn_kwargs or {})
        window = kwargs.pop("window", None)
        if self.sliding_window is not None:
            kwargs["sliding_window"] = self.sliding_window
        if rows is not None:
            q, s, window = take_rows(q.transpose(1, 2), rows).transpose(1, 2), rows.shape[1], None
            qpos = kwargs.get("q_positions")
            kwargs["q_positions"] = rows if qpos is None else take_rows(qpos, rows)
            for name in ("q_segment_ids", "q_blocks"):
                if kwargs.get(name) is not None:
                    kwargs[name] = take_rows(kwargs[name], rows)
        if window:  # packed prompts of at most `window` tokens each (an executor's layout)
            if not self.causal:
                raise ValueError("attention: a window applies to causal attention over packed prompts")
            out = self.attn_fn.windowed(q, k, v, scale=self.scale, window=window, **kwargs)
        else:
            out = self.attn_fn(q, k, v, scale=self.scale, causal=self.causal, **kwargs)
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)  # [b, s, hq * d]
        return self.o_proj(out)


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x [b, s, ...]`` at ``rows [b, n]`` (positions along ``s``, per batch row) -> ``[b, n, ...]``."""
    return x[torch.arange(x.shape[0], device=x.device)[:, None], rows]
