"""SigLIP's vision transformer: CLIP's ViT (:class:`ClipVisionEncoder`) parametrized, not a copy.

Zhai et al., 2023, "Sigmoid Loss for Language Image Pre-Training" (arXiv:2303.15343); transformers'
``SiglipVisionTransformer``. Against CLIP's ViT it differs in its parameters only: the patch
embedding has a bias, there is no class token and no pre-norm, the MLP is tanh-approximated GELU,
and a final LayerNorm (``post_layernorm``) follows the last block. The vision-language models read
that normalized last hidden state, every patch a row: Idefics3 / SmolVLM (Laurençon et al., 2024,
arXiv:2408.12637; Marafioti et al., 2025, arXiv:2504.05299) through a pixel shuffle, and later
Gemma 3 and PaliGemma through their projectors; the attention-pooling head is never built.

Idefics3's and SmolVLM's SigLIP (``Idefics3VisionTransformer``, ``SmolVLMVisionTransformer``) look
their position embeddings up by NaViT-style bucketed fractional coordinates (Dehghani et al., 2023,
arXiv:2307.06304), which for a full tile is the identity for most grid sides but not all (float32
rounding in ``torch.bucketize``: 19, 25, 29, 31, ... patches per side): :func:`bucketed_positions`
computes them as transformers does, once, at construction.
"""

from __future__ import annotations

import torch

from mmzoo.encoders.clip_vit import ClipVisionEncoder, resolve_feature_layers
from mmzoo.encoders.intern_vit import square_side


def bucketed_positions(side: int) -> torch.Tensor:
    """``[side * side]`` position-embedding rows of a full ``side x side`` patch grid, as Idefics3's
    and SmolVLM's vision embeddings compute them (fractional coordinates ``i / side`` in float32,
    bucketed against the boundaries ``arange(1 / side, 1, 1 / side)``)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    step = 1.0 / torch.tensor(side)  # float32, as transformers' 1.0 / (patch-mask sums)
    coords = torch.clamp(torch.arange(side, dtype=torch.float32) * step, max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)  # [side]
    return (buckets[:, None] * side + buckets[None, :]).flatten()  # [side * side], row-major


def siglip_vit(*, image_size, patch_size, embed_dim: int, num_layers: int, num_heads: int, intermediate_dim: int,
               in_channels: int = 3, act: str = "gelu_pytorch_tanh", norm_eps: float = 1e-6,
               bucketed: bool = False, feature_layer: int | list[int] | None = None,
               attention="sdpa") -> ClipVisionEncoder:
    """Component builder (``conf/encoder/siglip_vit.yaml``): a SigLIP ViT of ``num_layers`` blocks,
    read after its final LayerNorm (or at hidden layers), one row per patch.

    Args:
        image_size, patch_size: an item's side and a patch's, in pixels (an int or a square pair).
        embed_dim, num_heads, intermediate_dim, act: block sizes and the MLP's activation.
        norm_eps: the LayerNorms' epsilon (``layer_norm_eps``).
        bucketed: look positions up as Idefics3 / SmolVLM do (:func:`bucketed_positions`);
            False: row ``i`` for patch ``i``, as ``SiglipVisionEmbeddings``.
        feature_layer: None: the last block's output after the final LayerNorm (SmolVLM, Gemma 3);
            else the hidden state(s) read without it, as Llava's ``vision_feature_layer``
            (LLaVA-OneVision: ``-1``, the last block's output; only the blocks up to the deepest
            one are built; a list concatenates several).

    Raises:
        ValueError: sizes that are not square or not a whole number of patches.
    """
    from mmzoo.backends import resolve

    image, patch = square_side(image_size, "image_size"), square_side(patch_size, "patch_size")
    if image % patch:
        raise ValueError(f"image_size={image} is not a multiple of patch_size={patch}")
    layers = [num_layers] if feature_layer is None else resolve_feature_layers(feature_layer, num_layers)
    return ClipVisionEncoder(
        image_size=image, patch_size=patch, in_channels=in_channels, embed_dim=embed_dim, depth=max(layers),
        num_heads=num_heads, intermediate_dim=intermediate_dim, act=act, feature_layers=layers,
        keep_cls=False, attn_fn=resolve(attention), norm_eps=norm_eps, patch_bias=True, pre_norm=False,
        post_norm=feature_layer is None, class_token=False,
        position_ids=bucketed_positions(image // patch) if bucketed else None)
