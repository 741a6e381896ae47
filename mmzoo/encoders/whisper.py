"""Whisper's audio encoder, as Qwen2-Audio uses it.

Radford et al., 2022, "Robust Speech Recognition via Large-Scale Weak Supervision"
(arXiv:2212.04356). A log-mel spectrogram padded to a fixed window (30 s: 3000 frames) goes
through two width-3 convolutions with GELU, the second of stride 2 (1500 positions), gets the
absolute positions (sinusoidal in Whisper, stored in the checkpoint as ``embed_positions``),
then pre-LN blocks and a final LayerNorm. Qwen2-Audio (Chu et al., 2024, arXiv:2407.10759)
average-pools pairs of positions *before* that final norm (``pool_stride=2``), so the pooling
lives here rather than in the adapter.

Clips shorter than the window are masked: each clip's valid mel length gives the number of
encoder positions its keys may be read from (``kv_lengths``), as transformers' Qwen2-Audio does,
so the result does not depend on what else is in the batch.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mmzoo.encoders._base import Encoder
from mmzoo.layers import layer_norm, vit_block


def conv_lengths(mel_frames):
    """Encoder positions after the stride-2 convolution for ``mel_frames`` valid frames (int or tensor)."""
    return (mel_frames - 1) // 2 + 1


class WhisperEncoder(Encoder):
    """Conv stem + positions + bidirectional pre-LN blocks (+ time pooling) + LayerNorm.

    Args:
        num_mel_bins: mel channels of the input features.
        embed_dim, depth, num_heads, ffn_dim, act: encoder sizes and MLP activation.
        max_positions: positions after the convolutions (Whisper: 1500); the input must have
            ``2 * max_positions`` frames.
        attn_fn: the attention backend for every block.
        pool_stride: average-pool this many consecutive positions before the final norm
            (1: Whisper, none; 2: Qwen2-Audio).
        norm_eps: LayerNorm epsilon.
    """

    def __init__(self, *, num_mel_bins: int, embed_dim: int, depth: int, num_heads: int, ffn_dim: int, act: str,
                 max_positions: int, attn_fn, pool_stride: int = 1, norm_eps: float = 1e-5):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"audio embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        if pool_stride < 1 or max_positions % pool_stride:
            raise ValueError(f"pool_stride={pool_stride} must be >= 1 and divide max_positions={max_positions}")
        self.num_mel_bins, self.max_positions, self.pool_stride = num_mel_bins, max_positions, pool_stride
        self.conv1 = nn.Conv1d(num_mel_bins, embed_dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(embed_dim, embed_dim, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(max_positions, embed_dim)
        self.blocks = nn.ModuleList(  # Whisper's key projection has no bias; the weight mapping loads a zero one
            vit_block(dim=embed_dim, num_heads=num_heads, hidden_dim=ffn_dim, act=act, attn_fn=attn_fn, layer_idx=i,
                      norm_eps=norm_eps)
            for i in range(depth)
        )
        self.norm = layer_norm(embed_dim, norm_eps)
        self.embed_dim = embed_dim

    @property
    def num_frames(self) -> int:
        """Mel frames the input window must have."""
        return 2 * self.max_positions

    @property
    def tokens_per_clip(self) -> int:
        """Output rows per clip (valid and masked together)."""
        return self.max_positions // self.pool_stride

    @property
    def rows_per_item(self) -> int:
        """Output rows per input row (one clip): an executor buckets this tower's inputs by clips
        (:class:`~mmzoo.encoders.Encoder`)."""
        return self.tokens_per_clip

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Encode clips padded to the window.

        Args:
            features: ``[n, num_mel_bins, num_frames]`` log-mel features (the feature extractor's,
                padded to the window).
            lengths: ``[n]`` valid mel frames per clip (the feature attention mask's sum).

        Returns:
            ``[n * tokens_per_clip, embed_dim]``, clip-major; the rows past each clip's valid
            length are computed but meaningless.
        """
        if features.shape[-1] != self.num_frames:
            raise ValueError(f"audio features have {features.shape[-1]} frames; the encoder takes {self.num_frames}")
        x = F.gelu(self.conv1(features.to(self.conv1.weight.dtype)))  # [n, e, frames]
        x = F.gelu(self.conv2(x))  # [n, e, positions]
        x = x.transpose(1, 2) + self.embed_positions.weight  # [n, positions, e]
        kwargs = {"kv_lengths": conv_lengths(lengths)}
        for block in self.blocks:
            x = block(x, attn_kwargs=kwargs)
        if self.pool_stride > 1:
            x = F.avg_pool1d(x.transpose(1, 2), self.pool_stride, self.pool_stride).transpose(1, 2)  # [n, t, e]
        return self.norm(x).flatten(0, 1)  # [n * t, e]


def whisper(*, num_mel_bins: int, embed_dim: int, depth: int, num_heads: int, ffn_dim: int, act: str = "gelu",
            max_positions: int = 1500, pool_stride: int = 1, norm_eps: float = 1e-5, attention="sdpa") -> WhisperEncoder:
    """Component builder (``conf/encoder/whisper.yaml``): Whisper's audio encoder, average-pooled by
    ``pool_stride`` before its final norm (Qwen2-Audio: 2)."""
    from mmzoo.backends import resolve

    return WhisperEncoder(num_mel_bins=num_mel_bins, embed_dim=embed_dim, depth=depth, num_heads=num_heads,
                          ffn_dim=ffn_dim, act=act, max_positions=max_positions, attn_fn=resolve(attention),
                          pool_stride=pool_stride, norm_eps=norm_eps)
