"""Vision and audio towers: plain nn.Modules mapping preprocessed media to features."""

from mmzoo.encoders.qwen2_vl_vit import PatchEmbed3D, Qwen2VisionEncoder, frame_segments, patch_positions

__all__ = ["PatchEmbed3D", "Qwen2VisionEncoder", "frame_segments", "patch_positions"]
