"""Vision and audio towers: plain nn.Modules mapping preprocessed media to features."""

from mmzoo.encoders.qwen2_vl_vit import PatchEmbed3D, Qwen2VisionEncoder, frame_segments, patch_positions

__all__ = ["PatchEmbed3D", "Qwen2VisionEncoder", "frame_segments", "patch_positions"]

from mmzoo.encoders.clip_vit import ClipVisionEncoder, resolve_feature_layers  # noqa: E402
from mmzoo.encoders.whisper import WhisperEncoder, conv_lengths  # noqa: E402

__all__ += ["ClipVisionEncoder", "resolve_feature_layers", "WhisperEncoder", "conv_lengths"]
