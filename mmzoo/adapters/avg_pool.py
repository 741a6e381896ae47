"""Average-pool projector: an image's patch grid pooled to a fixed token grid, normed, projected to the LM's width.

Gemma 3 (Gemma Team, 2025, arXiv:2503.19786; transformers' ``Gemma3MultiModalProjector``): the
SigLIP tower's ``64 x 64`` patch features of an 896 px image are averaged over ``4 x 4`` blocks
into 256 tokens, each normed (Gemma's ``1 + w`` RMSNorm, :func:`~mmzoo.layers.gemma_rms_norm`) and
multiplied by a ``[vision width, LM width]`` matrix (stored that way round, as the checkpoint has
it: ``mm_input_projection_weight``).
"""

from __future__ import annotations

import torch
from torch import nn

from mmzoo.encoders import square_side
from mmzoo.layers import gemma_rms_norm


class AvgPoolProjector(nn.Module):
    """``[items * side^2, in_dim]`` patch features (item-major, each item's patches row-major) ->
    ``[items * (side / k)^2, out_dim]`` LM embeddings: the mean of each ``k x k`` block of patches,
    ``norm``, then ``@ weight``.

    Args:
        side: patches per side of one item; ``kernel``: ``k``, dividing it.
        in_dim, out_dim: the encoder's and the LM's widths.
        norm_eps: the norm's epsilon (the vision tower's ``layer_norm_eps``).
    """

    def __init__(self, *, side: int, kernel: int, in_dim: int, out_dim: int, norm_eps: float = 1e-6):
        super().__init__()
        if kernel < 1 or side % kernel:
            raise ValueError(f"avg-pool projector: a kernel of {kernel} does not divide the {side} patches per side")
        self.side, self.kernel = side, kernel
        self.norm = gemma_rms_norm(in_dim, norm_eps)
        self.weight = nn.Parameter(torch.zeros(in_dim, out_dim))

    @property
    def tokens_per_item(self) -> int:
        """LM tokens per item: ``(side / k)^2``."""
        return (self.side // self.kernel) ** 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, k, c = self.side, self.kernel, x.shape[-1]
        x = x.reshape(-1, s // k, k, s // k, k, c)  # [items, rows, k, cols, k, c]
        x = x.mean(dim=(2, 4), dtype=torch.float32).to(x.dtype)  # [items, rows, cols, c], float32 sums
        x = self.norm(x.flatten(0, 2))  # [items * tokens, c]
        return x @ self.weight.to(x.dtype)


def avg_pool_projector(*, in_dim: int, out_dim: int, image_size, patch_size, tokens_per_image: int,
                       norm_eps: float = 1e-6) -> AvgPoolProjector:
    """Component builder (``conf/adapter/avg_pool_projector.yaml``): Gemma 3's projector pooling each
    image's ``image_size / patch_size`` patches per side to ``tokens_per_image`` tokens
    (``mm_tokens_per_image``, a square).

    Raises:
        ValueError: sizes that are not square, or a token grid that does not evenly pool the patches.
    """
    image, patch = square_side(image_size, "image_size"), square_side(patch_size, "patch_size")
    per_side = round(tokens_per_image ** 0.5)
    if image % patch or per_side ** 2 != tokens_per_image or (image // patch) % per_side:
        raise ValueError(f"mm_tokens_per_image={tokens_per_image} does not pool the {image // patch} x "
                         f"{image // patch} patches (image_size={image} / patch_size={patch}) evenly")
    return AvgPoolProjector(side=image // patch, kernel=image // patch // per_side, in_dim=in_dim, out_dim=out_dim,
                            norm_eps=norm_eps)
