"""Pixel shuffle: each ``k x k`` block of an item's patch features becomes one token of ``k^2`` times the width.

Shi et al., 2016 ("Real-Time Single Image and Video Super-Resolution Using an Efficient Sub-Pixel
Convolutional Neural Network", arXiv:1609.05158) named the rearrangement; here it runs in reverse
(space to depth) to cut the tokens an image costs the LM by ``k^2``. InternVL (Chen et al., 2024,
arXiv:2312.14238; transformers' ``InternVLModel.pixel_shuffle`` with ``downsample_ratio = 1 / k``)
follows it with a LayerNorm and a two-layer MLP; Idefics3 / SmolVLM (``Idefics3Connector``, its
``scale_factor`` is ``k``) with one linear map. The rearrangement is the same in both:
:func:`pixel_shuffle`, and :class:`PixelShuffle` composes it with the projection a family injects.
"""

from __future__ import annotations

import torch
from torch import nn

from mmzoo.encoders import square_side
from mmzoo.layers import MLP


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """``[n, h, w, c]`` -> ``[n, h / k, w / k, k * k * c]`` (``k = scale_factor``): output ``(i, j)``
    holds input positions ``(k i + a, k j + b)`` concatenated along channels, ``a`` (the row offset)
    outer and ``b`` inner, as transformers' InternVL and Idefics3 arrange them."""
    n, h, w, c = x.shape
    k = scale_factor
    x = x.reshape(n, h // k, k, w // k, k, c)  # [n, h/k, a, w/k, b, c]
    x = x.permute(0, 1, 3, 2, 4, 5)  # [n, h/k, w/k, a, b, c]
    return x.reshape(n, h // k, w // k, k * k * c)


class PixelShuffle(nn.Module):
    """``[items * side^2, in_dim]`` patch features (item-major, each item's patches row-major) ->
    ``[items * (side / k)^2, out_dim]`` LM embeddings: :func:`pixel_shuffle`, then ``norm`` (if
    any) and ``proj`` over each ``k^2 * in_dim`` token.

    Args:
        side: patches per side of one item (a tile: ``image_size / patch_size``).
        scale_factor: ``k``, dividing ``side``.
        proj: maps ``[..., k^2 * in_dim]`` to the LM's width (InternVL's MLP; Idefics3's linear).
        norm: applied to each shuffled token first (InternVL's LayerNorm), or None.

    Raises:
        ValueError: ``scale_factor`` below 1 or not dividing ``side``.
    """

    def __init__(self, *, side: int, scale_factor: int, proj: nn.Module, norm: nn.Module | None = None):
        super().__init__()
        if isinstance(scale_factor, bool) or not isinstance(scale_factor, int) or scale_factor < 1:
            raise ValueError(f"pixel shuffle scale_factor={scale_factor!r} must be a positive integer")
        if side % scale_factor:
            raise ValueError(f"pixel shuffle scale_factor={scale_factor} does not divide the {side} patches per side "
                             f"of an item")
        self.side, self.scale_factor = side, scale_factor
        self.norm, self.proj = norm, proj

    @property
    def tokens_per_item(self) -> int:
        """LM tokens per item: ``(side / k)^2``."""
        return (self.side // self.scale_factor) ** 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.side
        x = x.reshape(-1, s, s, x.shape[-1])  # [items, side, side, c]
        x = pixel_shuffle(x, self.scale_factor).flatten(0, 2)  # [items * (side/k)^2, k^2 * c]
        if self.norm is not None:
            x = self.norm(x)
        return self.proj(x)


def shuffled_tokens(image_size: int, patch_size: int, scale_factor: int) -> str:
    """Why an item gives its token count after the shuffle, for messages: the formula and its numbers."""
    return (f" ((image_size / patch_size / scale_factor)^2 = ({image_size} / {patch_size} / "
            f"{scale_factor})^2)")


def pixel_shuffle_projector(*, in_dim: int, out_dim: int, image_size, patch_size, scale_factor: int = 2,
                            act: str = "gelu", bias: bool = True, norm_eps: float = 1e-5) -> PixelShuffle:
    """Component builder (``conf/adapter/pixel_shuffle.yaml``): InternVL's projector
    (``InternVLMultiModalProjector``): pixel shuffle by ``scale_factor``, LayerNorm, then
    ``linear_2(act(linear_1(x)))`` to ``out_dim`` (the shared :class:`~mmzoo.layers.MLP`).

    Args:
        in_dim: the encoder's width; ``out_dim``: the LM's (also the MLP's hidden width).
        image_size, patch_size: an item's side and a patch's, in pixels (an int or a square pair):
            ``image_size / patch_size`` patches per side.
        scale_factor: ``k`` (InternVL's ``1 / downsample_ratio``).

    Raises:
        ValueError: sizes that are not square, or a patch grid ``k`` does not divide.
    """
    side, wide = _side(image_size, patch_size), in_dim * scale_factor * scale_factor
    return PixelShuffle(side=side, scale_factor=scale_factor, norm=nn.LayerNorm(wide, eps=norm_eps),
                        proj=MLP(dim=wide, hidden_dim=out_dim, out_dim=out_dim, act=act, bias=bias))


def pixel_shuffle_linear(*, in_dim: int, out_dim: int, image_size, patch_size, scale_factor: int = 2,
                         bias: bool = False) -> PixelShuffle:
    """Component builder (``conf/adapter/pixel_shuffle_linear.yaml``): Idefics3's and SmolVLM's
    connector (``Idefics3Connector``): pixel shuffle by ``scale_factor``, then one linear map
    (``modality_projection.proj``, no bias) to ``out_dim``.

    Args:
        in_dim: the encoder's width; ``out_dim``: the LM's.
        image_size, patch_size: an item's side and a patch's, in pixels (an int or a square pair).
        scale_factor: ``k`` (config.json's ``scale_factor``).

    Raises:
        ValueError: sizes that are not square, or a patch grid ``k`` does not divide.
    """
    return PixelShuffle(side=_side(image_size, patch_size), scale_factor=scale_factor,
                        proj=nn.Linear(in_dim * scale_factor * scale_factor, out_dim, bias=bias))


def _side(image_size, patch_size) -> int:
    """Patches per side of an item."""
    image, patch = square_side(image_size, "image_size"), square_side(patch_size, "patch_size")
    if image % patch:
        raise ValueError(f"image_size={image} is not a multiple of patch_size={patch}")
    return image // patch
