"""LLaVA-OneVision's projector: Llava's two-layer MLP, then each item's features packed into its LM rows.

Li et al., 2024, "LLaVA-OneVision: Easy Visual Task Transfer" (arXiv:2408.03326), after LLaVA-NeXT's
"AnyRes" (Liu et al., 2024). An image is seen as a base view plus a grid of tiles; the tiles'
features are laid out as one large feature map, the rows and columns that only cover the padding
are cut off, a map larger than the ``anyres_max_N`` budget is shrunk bilinearly, and every row of
the map ends with a learned ``image_newline`` vector; a video's frames are each shrunk 2x
bilinearly, and one ``image_newline`` closes the video. Each of those steps takes, for one output
row, at most four feature rows with weights: the family computes them on the host from the image's
size (``pack_index`` / ``pack_weight``, like Qwen3-VL's position-grid taps), so the adapter is one
projection and one weighted gather, whatever the image's shape: the XLA graphs depend on the tile
count only.
"""

from __future__ import annotations

import torch
from torch import nn

from mmzoo.layers import MLP


class PackedProjector(MLP):
    """Llava's projector (:class:`~mmzoo.layers.MLP`: ``fc1``, activation, ``fc2``) and a learned
    ``newline`` row; the projected features are packed by weighted taps.

    Args:
        in_dim: the encoder's feature width; out_dim: the LM's width (also the MLP's hidden width).
        act: the activation (``projector_hidden_act``); bias: the linears' biases.
    """

    def __init__(self, *, in_dim: int, out_dim: int, act: str = "gelu", bias: bool = True):
        super().__init__(dim=in_dim, hidden_dim=out_dim, out_dim=out_dim, act=act, bias=bias)
        self.newline = nn.Parameter(torch.zeros(out_dim))

    def forward(self, x: torch.Tensor, pack_index: torch.Tensor, pack_weight: torch.Tensor) -> torch.Tensor:
        """Project and pack.

        Args:
            x: ``[items * t, in_dim]`` the encoder's features, ``t`` rows per item (tile or frame).
            pack_index: ``[items, r, 4]`` int64: for each of the ``r`` output rows an item holds, the
                rows of ``[newline, projected x]`` it blends (0: the newline; ``1 + i``: feature row ``i``
                of the call, any item's).
            pack_weight: ``[items, r, 4]`` their weights (an unused output row: zeros).

        Returns:
            ``[items * r, out_dim]``.
        """
        feats = super().forward(x)  # [items * t, out]
        table = torch.cat([self.newline[None].to(feats.dtype), feats])  # [1 + items * t, out]
        taps = table[pack_index.reshape(-1)].unflatten(0, (-1, 4))  # [items * r, 4, out]
        weights = pack_weight.reshape(-1, 4, 1).to(torch.float32)
        return (taps.float() * weights).sum(1).to(feats.dtype)  # weighted in float32, as the bilinear resize
