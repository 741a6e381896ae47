"""InternViT, InternVL's vision tower: CLIP's ViT (:class:`ClipVisionEncoder`) parametrized, not a copy.

Chen et al., 2024, "InternVL: Scaling up Vision Foundation Models and Aligning for Generic
Visual-Linguistic Tasks" (arXiv:2312.14238); InternVL3: Zhu et al., 2025 (arXiv:2504.10479).
transformers' ``InternVLVisionModel``. Against CLIP's ViT it differs in its parameters only: the
patch embedding has a bias, there is no pre-norm, both residual branches of every block are
layer-scaled (``lambda_1``, ``lambda_2``: :class:`~mmzoo.layers.LayerScale`), the blocks' norms
are LayerNorm or RMSNorm (``norm_type``), the q/k/v projections may lack biases
(``attention_bias``), the 6B tower normalizes its queries and keys over their full width
(``use_qk_norm``), and without mean pooling (``use_mean_pooling=false``) a final LayerNorm
follows the last block, which transformers applies only when ``vision_feature_layer`` is -1.
Each tile (448 px for InternVL3) is one input row; its class token is dropped before the pixel
shuffle (:class:`~mmzoo.adapters.PixelShuffle`).
"""

from __future__ import annotations

from collections.abc import Sequence

from mmzoo.encoders.clip_vit import ClipVisionEncoder, resolve_feature_layers
from mmzoo.layers import LayerScale, RMSNorm, layer_norm

NORMS = {"layer_norm": layer_norm, "rms_norm": RMSNorm}  # transformers' NORM2FN, by config.json's norm_type


def square_side(value, name: str) -> int:
    """One side in pixels from an int or transformers' ``[height, width]`` pair, which must be square.

    Raises:
        ValueError: not a positive integer or a pair of two equal ones; the message names ``name``.
    """
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else list(value) \
        if isinstance(value, Sequence) and not isinstance(value, str) else None
    if items is None or len(items) not in (1, 2) or not all(isinstance(i, int) and not isinstance(i, bool) and i > 0
                                                              for i in items):
        raise ValueError(f"{name}={value!r} must be a positive integer or a [height, width] pair of them")
    if len(set(items)) != 1:
        raise ValueError(f"{name}={list(items)}: only square sizes are supported (height == width)")
    return int(items[0])


def intern_vit(*, image_size, patch_size, embed_dim: int, num_layers: int, num_heads: int, intermediate_dim: int,
               in_channels: int = 3, act: str = "gelu", norm_type: str = "layer_norm", norm_eps: float = 1e-6,
               qkv_bias: bool = True, qk_norm: bool = False, mean_pooling: bool = True,
               absolute_positions: bool = True, feature_layer: int | list[int] = -1,
               select_strategy: str = "default", attention="sdpa") -> ClipVisionEncoder:
    """Component builder (``conf/encoder/intern_vit.yaml``): an InternViT of ``num_layers`` blocks
    read at ``feature_layer`` (InternVL's ``vision_feature_layer``; the blocks past the deepest one
    are not built), without its class token unless ``select_strategy="full"``.

    Args:
        image_size, patch_size: a tile's side and a patch's, in pixels (an int or a square pair).
        norm_type: the blocks' norms, ``"layer_norm"`` or ``"rms_norm"`` (config.json's ``norm_type``).
        qkv_bias: biases on q/k/v (``attention_bias``); ``qk_norm``: RMSNorm on the queries and keys
            (``use_qk_norm``, epsilon 1e-6 as transformers').
        mean_pooling: ``use_mean_pooling``; False adds the final LayerNorm read at ``feature_layer=-1``.
        absolute_positions: ``use_absolute_position_embeddings``.

    Raises:
        ValueError: a size, ``norm_type``, ``select_strategy`` or ``feature_layer`` it cannot build.
    """
    from mmzoo.backends import resolve

    if norm_type not in NORMS:
        raise ValueError(f"norm_type={norm_type!r}; expected one of {sorted(NORMS)}")
    if select_strategy not in ("default", "full"):
        raise ValueError(f"select_strategy={select_strategy!r}; expected 'default' or 'full'")
    layers = resolve_feature_layers(feature_layer, num_layers)
    return ClipVisionEncoder(
        image_size=square_side(image_size, "image_size"), patch_size=square_side(patch_size, "patch_size"),
        in_channels=in_channels, embed_dim=embed_dim, depth=max(layers), num_heads=num_heads,
        intermediate_dim=intermediate_dim, act=act, feature_layers=layers, keep_cls=select_strategy == "full",
        attn_fn=resolve(attention), norm_eps=norm_eps, patch_bias=True, pre_norm=False,
        absolute_positions=absolute_positions, post_norm=not mean_pooling and feature_layer == -1,
        norm_layer=NORMS[norm_type], qkv_bias=qkv_bias, qk_norm_layer=RMSNorm if qk_norm else None,
        scale_layer=LayerScale)
