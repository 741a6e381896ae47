"""CLIP's vision transformer, as Llava uses it: the hidden states of a chosen layer, not the pooled output.

Radford et al., 2021, "Learning Transferable Visual Models From Natural Language Supervision"
(arXiv:2103.00020). A fixed-size image is cut into ``patch_size`` squares by a strided
convolution; a learned class token is prepended, learned absolute positions added, and the
sequence is normalized once (``pre_layrnorm``) before pre-LN blocks with quick-GELU MLPs. Llava
(Liu et al., 2023, arXiv:2304.08485) feeds the projector the hidden state of one block (by
default the second to last, ``vision_feature_layer=-2``) without the class token, so the blocks
past the deepest selected one, and CLIP's ``post_layernorm``, are never built.

The same module, parametrized, is InternViT (:func:`mmzoo.encoders.intern_vit`): a patch
embedding with a bias, no pre-norm, layer-scaled blocks with LayerNorm or RMSNorm, optional q/k
norms, and a final LayerNorm on the last block's output when that is the layer read; and SigLIP
(:func:`mmzoo.encoders.siglip_vit`): a biased patch embedding, no class token, no pre-norm, a final
LayerNorm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from mmzoo.encoders._base import Encoder
from mmzoo.layers import MLP, layer_norm, vit_block

# transformers' CLIP and SigLIP vision names (after the tower's prefix, ``vision_model.``) -> ClipVisionEncoder's
CLIP_RENAMES = [
    (r"^embeddings\.patch_embedding\.", "patch_embed."),
    (r"^embeddings\.class_embedding$", "class_embedding"),
    (r"^embeddings\.position_embedding\.", "position_embedding."),
    (r"^pre_layrnorm\.", "pre_norm."),
    (r"^post_layernorm\.", "post_norm."),
    (r"^encoder\.layers\.", "blocks."),
    (r"\.self_attn\.out_proj\.", ".attn.o_proj."),
    (r"\.self_attn\.", ".attn."),
    (r"\.layer_norm1\.", ".norm1."),
    (r"\.layer_norm2\.", ".norm2."),
]


def resolve_feature_layers(layers: int | Sequence[int], num_layers: int) -> list[int]:
    """Hidden-state indices (0: the normalized embeddings, ``i``: after block ``i``) from Llava's
    ``vision_feature_layer`` (an int or a list; negative counts from the end, ``-1`` = the last block).

    Raises:
        ValueError: an index outside ``[-(num_layers + 1), num_layers]``.
    """
    items = [layers] if isinstance(layers, int) else list(layers)
    if not items:
        raise ValueError("vision_feature_layer is an empty list")
    out = []
    for i in items:
        if not -(num_layers + 1) <= int(i) <= num_layers:
            raise ValueError(f"vision_feature_layer {i} is outside the {num_layers + 1} hidden states of a "
                             f"{num_layers}-layer vision tower")
        out.append(int(i) % (num_layers + 1))
    return out


class ClipVisionEncoder(Encoder):
    """Conv patch embedding + class token + learned positions + pre-norm + ViT blocks; returns the
    selected hidden states, one row per image token.

    Args:
        image_size: input side in pixels (the processor resizes and crops to it).
        patch_size: patch side in pixels.
        in_channels: image channels.
        embed_dim, num_heads, intermediate_dim, act: block sizes and MLP activation.
        depth: blocks to build: the deepest selected hidden state (see :func:`resolve_feature_layers`).
        feature_layers: hidden-state indices in ``[0, depth]`` whose features are concatenated along
            channels (Llava: one, or several for a list ``vision_feature_layer``).
        keep_cls: keep the class token's row (Llava's ``full`` strategy) or drop it (``default``).
        attn_fn: the attention backend for every block.
        norm_eps: the norms' epsilon.
        patch_bias: a bias on the patch embedding (InternViT's; CLIP's has none).
        pre_norm: a LayerNorm over the embeddings before the blocks (CLIP's ``pre_layrnorm``).
        absolute_positions: learned absolute positions added to the embeddings.
        post_norm: a LayerNorm over the features read (InternViT's final ``layernorm``, SigLIP's
            ``post_layernorm``, which transformers applies to the last block's output only): needs
            ``feature_layers == [depth]``.
        class_token: a learned class token before the patches (CLIP's, InternViT's; SigLIP has none).
        position_ids: ``[num_patches (+ 1)]`` the position-embedding row each token reads (SigLIP in
            Idefics3 buckets fractional coordinates, which is not always the identity); None: row ``i``
            for token ``i``.
        norm_layer, qkv_bias, qk_norm_layer, scale_layer: each block's norms, q/k/v biases, q/k
            norms and layer scales (:func:`~mmzoo.layers.vit_block`): CLIP's by default.
    """

    def __init__(self, *, image_size: int, patch_size: int, in_channels: int, embed_dim: int, depth: int,
                 num_heads: int, intermediate_dim: int, act: str, feature_layers: Sequence[int], keep_cls: bool,
                 attn_fn, norm_eps: float = 1e-5, patch_bias: bool = False, pre_norm: bool = True,
                 absolute_positions: bool = True, post_norm: bool = False,
                 norm_layer: Callable[[int, float], nn.Module] = layer_norm, qkv_bias: bool = True,
                 qk_norm_layer: Callable[[int], nn.Module] | None = None,
                 scale_layer: Callable[[int], nn.Module] | None = None, class_token: bool = True,
                 position_ids: torch.Tensor | None = None):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size={image_size} is not a multiple of patch_size={patch_size}")
        if embed_dim % num_heads:
            raise ValueError(f"vision embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        if not feature_layers or not all(0 <= i <= depth for i in feature_layers):
            raise ValueError(f"feature_layers {list(feature_layers)} must be non-empty indices in [0, depth={depth}]")
        if post_norm and list(feature_layers) != [depth]:
            raise ValueError(f"post_norm applies to the last block's output, but feature_layers={list(feature_layers)} "
                             f"with depth={depth}")
        if keep_cls and not class_token:
            raise ValueError("keep_cls needs a class token (class_token=True)")
        self.image_size, self.patch_size = image_size, patch_size
        self.num_patches = (image_size // patch_size) ** 2
        self.feature_layers, self.keep_cls = list(feature_layers), keep_cls
        self.patch_embed = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size,
                                     bias=patch_bias)
        self.class_embedding = nn.Parameter(torch.zeros(embed_dim)) if class_token else None
        tokens = self.num_patches + int(class_token)
        self.position_embedding = nn.Embedding(tokens, embed_dim) if absolute_positions else None
        if position_ids is not None and tuple(position_ids.shape) != (tokens,):
            raise ValueError(f"position_ids has shape {list(position_ids.shape)}; expected [{tokens}] (one per token)")
        self.register_buffer("position_ids", position_ids, persistent=False)
        self.pre_norm = layer_norm(embed_dim, norm_eps) if pre_norm else None
        self.blocks = nn.ModuleList(
            vit_block(dim=embed_dim, num_heads=num_heads, hidden_dim=intermediate_dim, act=act, attn_fn=attn_fn,
                      layer_idx=i, norm_eps=norm_eps, norm_layer=norm_layer, mlp_layer=MLP, qkv_bias=qkv_bias,
                      qk_norm_layer=qk_norm_layer, scale_layer=scale_layer)
            for i in range(depth)
        )
        self.post_norm = layer_norm(embed_dim, norm_eps) if post_norm else None
        self.embed_dim = embed_dim

    @property
    def tokens_per_image(self) -> int:
        return self.num_patches + int(self.keep_cls)

    @property
    def rows_per_item(self) -> int:
        """Output rows per input row (one image): an executor buckets this tower's inputs by images
        (:class:`~mmzoo.encoders.Encoder`)."""
        return self.tokens_per_image

    @property
    def out_dim(self) -> int:
        return self.embed_dim * len(self.feature_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``pixel_values [n, c, image_size, image_size]`` -> ``[n * tokens_per_image, out_dim]``
        (image-major). Images never attend to each other, so padding images change nothing."""
        n = pixel_values.shape[0]
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))  # [n, e, h, w]
        x = x.flatten(2).transpose(1, 2)  # [n, h * w, e], row-major patches
        if self.class_embedding is not None:
            cls = self.class_embedding.to(x.dtype).expand(n, 1, -1)  # [n, 1, e]
            x = torch.cat([cls, x], dim=1)  # [n, 1 + h * w, e]
        if self.position_embedding is not None:
            pos = self.position_embedding.weight
            x = x + (pos if self.position_ids is None else pos[self.position_ids])
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        states = {0: x}
        for i, block in enumerate(self.blocks, start=1):
            x = block(x)
            states[i] = x
        if self.post_norm is not None:  # the one feature layer is the last block's (checked at construction)
            states[len(self.blocks)] = self.post_norm(x)
        start = 0 if self.keep_cls or self.class_embedding is None else 1
        out = torch.cat([states[i][:, start:] for i in self.feature_layers], dim=-1)  # [n, t, e * layers]
        return out.flatten(0, 1)  # [n * t, e * layers]


def clip_vit(*, image_size: int, patch_size: int, embed_dim: int, num_layers: int, num_heads: int,
             intermediate_dim: int, in_channels: int = 3, act: str = "quick_gelu", feature_layer: int | list[int] = -2,
             select_strategy: str = "default", norm_eps: float = 1e-5, attention="sdpa") -> ClipVisionEncoder:
    """Component builder (``conf/encoder/clip_vit.yaml``): a CLIP ViT of ``num_layers`` blocks read at
    ``feature_layer`` (Llava's ``vision_feature_layer``; only the blocks up to the deepest one are
    built), keeping the class token with ``select_strategy="full"`` (``"default"`` drops it)."""
    from mmzoo.backends import resolve

    if select_strategy not in ("default", "full"):
        raise ValueError(f"select_strategy={select_strategy!r}; expected 'default' or 'full'")
    for name, value in (("image_size", image_size), ("patch_size", patch_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r}; only square sizes (one integer) are supported")
    layers = resolve_feature_layers(feature_layer, num_layers)
    return ClipVisionEncoder(image_size=image_size, patch_size=patch_size, in_channels=in_channels,
                             embed_dim=embed_dim, depth=max(layers), num_heads=num_heads,
                             intermediate_dim=intermediate_dim, act=act, feature_layers=layers,
                             keep_cls=select_strategy == "full", attn_fn=resolve(attention), norm_eps=norm_eps)
