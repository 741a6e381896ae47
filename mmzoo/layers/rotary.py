"""Rotary position embeddings: one module for 1-D RoPE, Qwen2-VL's M-RoPE and 2-D vision RoPE.

RoPE (Su et al., 2021, "RoFormer") rotates pairs of channels by ``position * inv_freq``.
The variants differ only in which position axis drives each frequency:

* 1-D RoPE (Llama, Qwen2, Gemma 3): every frequency reads axis 0 (with ``linear`` scaling, the
  frequencies divided by a factor).
* M-RoPE (Qwen2-VL, Wang et al., 2024): frequencies are split into sections that read the
  temporal, height and width axes in turn (``mrope_section``).
* Interleaved M-RoPE (Qwen3-VL): the same counts per axis, dealt out round-robin (t, h, w, t, h,
  w, ...) so that every axis gets high and low frequencies alike; the temporal axis takes the
  frequencies left over at the top.
* 2-D vision RoPE (Qwen2-VL's ViT): the first half of the frequencies reads the patch row,
  the second half the patch column, each half with its own frequency ladder.

So the module holds a per-frequency table ``(inv_freq[f], axis[f])`` and computes
``angle[b, s, f] = positions[axis[f], b, s] * inv_freq[f]``.

:meth:`Rotary.tabulate` precomputes cos and sin of every position up to a bound (vLLM's
``cos_sin_cache``), so that the forward looks rows up instead of evaluating them. Under XLA this
matters: the compiler fuses the cos/sin into each consumer (every layer's q and k rotation) and
evaluates them there per element, once per head, in every layer.
"""

from __future__ import annotations

import torch
from torch import nn


def _ladder(dim: int, theta: float) -> torch.Tensor:
    """``1 / theta^(2i/dim)`` for ``i < dim/2``: the usual RoPE frequencies for ``dim`` channels."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class Rotary(nn.Module):
    """Cos/sin tables for rotary embeddings from multi-axis positions.

    Args:
        inv_freq: ``[F]`` frequencies; the rotated head dim is ``2 * F``.
        axes: ``[F]`` which position axis drives each frequency.
    """

    def __init__(self, inv_freq: torch.Tensor, axes: torch.Tensor):
        super().__init__()
        if inv_freq.shape != axes.shape or inv_freq.dim() != 1:
            raise ValueError(f"inv_freq {tuple(inv_freq.shape)} and axes {tuple(axes.shape)} must be equal 1-D")
        self.num_axes = int(axes.max()) + 1
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("axes", axes.long(), persistent=False)
        self.register_buffer("table", None, persistent=False)  # [positions, 2, F] cos/sin rows (tabulate)

    @property
    def positions(self) -> int | None:
        """Positions :meth:`tabulate` covers (``0 .. positions - 1``), or None: computed as needed."""
        return None if self.table is None else int(self.table.shape[0])

    def tabulate(self, positions: int) -> None:
        """Precompute cos and sin for positions ``0 .. positions - 1`` (float32, on the frequencies'
        device); the forward then gathers them. A position past them is out of range: eager torch
        raises, an XLA gather clamps, so the caller (the executor) checks them on the host."""
        angles = torch.arange(positions, dtype=torch.float32, device=self.inv_freq.device)[:, None] * self.inv_freq
        self.table = torch.stack((angles.cos(), angles.sin()), dim=1)

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)``, each ``[b, s, head_dim]`` float32, from ``positions [axes, b, s]``."""
        if positions.dim() != 3 or positions.shape[0] != self.num_axes:
            raise ValueError(f"positions must be [{self.num_axes}, b, s], got {tuple(positions.shape)}")
        if self.table is not None:
            rows = self.table[positions]  # [axes, b, s, 2, F]: each axis's rows
            tab = rows[0]
            for a in range(1, self.num_axes):  # frequency f reads axis axes[f]
                tab = torch.where(self.axes == a, rows[a], tab)
            cos, sin = tab.unbind(-2)  # [b, s, F] each
            return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        pos = positions.float()[self.axes]  # [F, b, s]
        angles = pos.permute(1, 2, 0) * self.inv_freq  # [b, s, F]
        emb = torch.cat((angles, angles), dim=-1)  # [b, s, 2F]
        return emb.cos(), emb.sin()


def rope_1d(head_dim: int, theta: float, factor: float = 1.0) -> Rotary:
    """Plain RoPE over one position axis (Llama, Qwen2); ``factor`` > 1: transformers' ``linear``
    ``rope_type`` (position interpolation, Chen et al., 2023: every frequency divided by ``factor``;
    Gemma 3's full-attention layers use 8)."""
    if not factor > 0:
        raise ValueError(f"linear RoPE scaling factor={factor} must be positive")
    inv = _ladder(head_dim, theta)
    if factor != 1.0:
        inv = inv / factor
    return Rotary(inv, torch.zeros_like(inv, dtype=torch.long))


def mrope(head_dim: int, theta: float, sections: list[int], interleaved: bool = False) -> Rotary:
    """Multimodal RoPE: ``sections`` frequencies each for the t, h and w position axes.

    Args:
        head_dim: rotated channels per head (``2 * sum(sections)``).
        theta: the RoPE base.
        sections: ``mrope_section``, frequencies per t/h/w axis (Qwen2-VL: ``[16, 24, 24]``;
            Qwen3-VL: ``[24, 20, 20]``).
        interleaved: False: consecutive sections, the first ``sections[0]`` frequencies read t,
            the next ``sections[1]`` h, the rest w (Qwen2-VL, Qwen2.5-VL). True: Qwen3-VL's
            interleaved layout (transformers' ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``):
            frequency ``f`` reads h for ``f`` in ``range(1, 3 * sections[1], 3)``, w for ``f`` in
            ``range(2, 3 * sections[2], 3)``, t otherwise; for ``[24, 20, 20]`` over 64 frequencies,
            ``t h w t h w ... t h w`` (60 frequencies) then ``t t t t``.
    """
    freqs = head_dim // 2
    if sum(sections) != freqs:
        raise ValueError(f"mrope_section {list(sections)} sums to {sum(sections)}, expected head_dim/2 = {freqs}")
    inv = _ladder(head_dim, theta)
    if not interleaved:
        axes = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(sections)])
        return Rotary(inv, axes)
    if len(sections) != 3:
        raise ValueError(f"interleaved mrope_section {list(sections)} must give 3 counts (t, h, w)")
    _, h, w = sections
    # the h and w strides must fit in the frequencies, or transformers' slices come out short of the
    # counts asked for (and t takes the rest): refuse a table that would not hold `sections`
    if 3 * h - 2 >= freqs or 3 * w - 1 >= freqs:
        raise ValueError(f"interleaved mrope_section {list(sections)}: the h frequencies (every 3rd from 1, "
                         f"{h} of them) and w frequencies (every 3rd from 2, {w}) must fit in head_dim/2 = {freqs}")
    axes = torch.zeros(freqs, dtype=torch.long)  # t unless overwritten
    axes[1:3 * h:3] = 1
    axes[2:3 * w:3] = 2
    return Rotary(inv, axes)


def rope_2d(head_dim: int, theta: float) -> Rotary:
    """2-D RoPE for ViT patches: half the frequencies follow the row, half the column."""
    if head_dim % 4:
        raise ValueError(f"2-D rotary needs head_dim divisible by 4, got {head_dim}")
    inv = _ladder(head_dim // 2, theta)  # [head_dim / 4]
    axes = torch.cat([torch.zeros_like(inv, dtype=torch.long), torch.ones_like(inv, dtype=torch.long)])
    return Rotary(torch.cat([inv, inv]), axes)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, h, s, d]`` by ``cos, sin [b, s, d]`` (computed in float32, returned in x's dtype)."""
    xf = x.float()
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, s, d]
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
