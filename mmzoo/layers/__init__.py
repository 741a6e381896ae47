"""Building blocks shared by every model family."""

from mmzoo.layers.attention import Attention
from mmzoo.layers.block import LayerScale, TransformerBlock, vit_block
from mmzoo.layers.mlp import MLP, GatedMLP, activation
from mmzoo.layers.norm import RMSNorm, gemma_rms_norm, layer_norm
from mmzoo.layers.rotary import Rotary, apply_rotary, mrope, rope_1d, rope_2d

__all__ = ["Attention", "TransformerBlock", "LayerScale", "vit_block", "MLP", "GatedMLP", "activation", "RMSNorm",
           "gemma_rms_norm", "layer_norm", "Rotary", "apply_rotary", "mrope", "rope_1d", "rope_2d"]
