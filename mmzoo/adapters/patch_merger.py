"""The Qwen-VL patch merger (Qwen2-VL, 2.5-VL, 3-VL): a norm, each ``m x m`` block of patches joined, projected.

The processor orders patches so that each ``m x m`` spatial block is contiguous; the merger
views ``m^2`` consecutive patch features as one vector and maps it to the LM's width, giving one
LM token per block. Qwen2-VL normalizes with LayerNorm, Qwen2.5-VL with RMSNorm (``norm_layer``).

Qwen3-VL's final merger is Qwen2-VL's; its DeepStack mergers (one per tapped ViT block) normalize
after the ``m x m`` concatenation instead (``postshuffle_norm``). With ``deepstack_taps=k`` the
merger takes the encoder's ``1 + k`` streams side by side (the last block's features, then each
tapped block's) and returns their merged features side by side, one LM-width slice per stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mmzoo.layers import layer_norm


class PatchMerger(nn.Module):
    """``[n, (1 + k) * context_dim]`` patch features -> ``[n / m^2, (1 + k) * out_dim]`` LM embeddings.

    Args:
        context_dim: the encoder's width.
        out_dim: the LM's width.
        merge_size: ``m``: each ``m x m`` block of patches becomes one embedding.
        norm_eps: the norm's epsilon.
        norm_layer: ``norm_layer(dim, norm_eps)`` builds the norm (``ln_q``): LayerNorm (Qwen2-VL,
            Qwen3-VL) or :class:`~mmzoo.layers.RMSNorm` (Qwen2.5-VL).
        postshuffle_norm: False: the norm is over each patch (``context_dim``) before the merge
            (Qwen2-VL; Qwen3-VL's final merger). True: over each merged vector
            (``m^2 * context_dim``) after it (Qwen3-VL's DeepStack mergers).
        deepstack_taps: ``k``: how many DeepStack streams follow the main one in each input row
            (Qwen3-VL: ``len(deepstack_visual_indexes)``, the encoder's ``deepstack_blocks``);
            each gets a merger of its own (``deepstack[j]``, postshuffle-normed, as wide as this
            one). 0: a plain merger, ``[n, context_dim] -> [n / m^2, out_dim]``.
    """

    def __init__(self, *, context_dim: int, out_dim: int, merge_size: int, norm_eps: float = 1e-6,
                 norm_layer: Callable[[int, float], nn.Module] = layer_norm, postshuffle_norm: bool = False,
                 deepstack_taps: int = 0):
        super().__init__()
        if deepstack_taps < 0:
            raise ValueError(f"patch merger deepstack_taps={deepstack_taps}: a count of DeepStack streams")
        self.merge_size = merge_size
        self.context_dim, self.out_dim = context_dim, out_dim
        self.hidden = context_dim * merge_size * merge_size
        self.postshuffle_norm = postshuffle_norm
        self.ln_q = norm_layer(self.hidden if postshuffle_norm else context_dim, norm_eps)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))
        self.deepstack = nn.ModuleList(
            PatchMerger(context_dim=context_dim, out_dim=out_dim, merge_size=merge_size, norm_eps=norm_eps,
                        norm_layer=norm_layer, postshuffle_norm=True)
            for _ in range(deepstack_taps)
        ) if deepstack_taps else None

    @property
    def rows_per_output(self) -> int:
        return self.merge_size * self.merge_size

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """One stream: ``[n, context_dim]`` -> ``[n / m^2, out_dim]``."""
        if self.postshuffle_norm:
            return self.mlp(self.ln_q(x.reshape(-1, self.hidden)))  # [n / m^2, m^2 * c] normed -> [n / m^2, out]
        return self.mlp(self.ln_q(x).view(-1, self.hidden))  # [n, c] -> [n / m^2, m^2 * c] -> [n / m^2, out_dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deepstack is None:
            return self.merge(x)
        streams = 1 + len(self.deepstack)
        if x.shape[-1] != streams * self.context_dim:
            raise ValueError(f"patch merger: rows of width {x.shape[-1]}, but {streams} streams (1 + "
                             f"deepstack_taps={len(self.deepstack)}) of context_dim={self.context_dim} make "
                             f"{streams * self.context_dim}")
        parts = x.split(self.context_dim, dim=-1)  # 1 + k streams of [n, c]
        merged = [self.merge(parts[0])] + [m.merge(p) for m, p in zip(self.deepstack, parts[1:])]
        return torch.cat(merged, dim=-1)  # [n / m^2, (1 + k) * out_dim]
