"""Vision and audio towers: plain nn.Modules mapping preprocessed media to features.

Each encoder has a component builder (``qwen2_vl_vit``, ``qwen3_vl_vit``, ``clip_vit``, ``intern_vit``,
``siglip_vit``, ``whisper``) that ``conf/encoder/*.yaml`` names as its ``_target_``, and is an
:class:`Encoder`: the contract of what an executor reads of it (``rows_per_item``, ``rotary_input``).
"""

from mmzoo.encoders._base import Encoder
from mmzoo.encoders.clip_vit import CLIP_RENAMES, ClipVisionEncoder, clip_vit, resolve_feature_layers
from mmzoo.encoders.intern_vit import intern_vit, square_side
from mmzoo.encoders.qwen2_vl_vit import (PatchEmbed3D, Qwen2VisionEncoder, frame_segments, patch_positions,
                                         pos_interpolation, qwen2_vl_vit, qwen3_vl_vision_weights, qwen3_vl_vit,
                                         window_order)
from mmzoo.encoders.siglip import bucketed_positions, siglip_vit
from mmzoo.encoders.whisper import WhisperEncoder, conv_lengths, whisper

__all__ = ["Encoder", "qwen2_vl_vit", "qwen3_vl_vit", "clip_vit", "intern_vit", "siglip_vit", "whisper",
           "Qwen2VisionEncoder", "ClipVisionEncoder", "WhisperEncoder", "PatchEmbed3D", "frame_segments",
           "patch_positions", "window_order", "pos_interpolation", "qwen3_vl_vision_weights", "resolve_feature_layers",
           "square_side", "conv_lengths", "bucketed_positions", "CLIP_RENAMES"]
