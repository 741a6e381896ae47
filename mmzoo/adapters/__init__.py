"""Adapters (projectors) between an encoder's features and the language model's embeddings.

``conf/adapter/*.yaml`` name these as their ``_target_``: ``PatchMerger`` (Qwen2-VL; Qwen3-VL with its DeepStack
mergers), ``mlp_projector`` (Llava), ``AudioProjector`` (Qwen2-Audio), ``pixel_shuffle_projector`` (InternVL: the shared
:class:`PixelShuffle` with a LayerNorm and an MLP), ``pixel_shuffle_linear`` (Idefics3 / SmolVLM: the same
shuffle with one linear map), ``avg_pool_projector`` (Gemma 3), ``PackedProjector`` (LLaVA-OneVision: Llava's MLP, then
each item's features packed into its rows: unpadded, resized, newline-ended).
"""

from mmzoo.adapters.audio_projector import AudioProjector
from mmzoo.adapters.avg_pool import AvgPoolProjector, avg_pool_projector
from mmzoo.adapters.mlp_projector import mlp_projector
from mmzoo.adapters.packed_projector import PackedProjector
from mmzoo.adapters.patch_merger import PatchMerger
from mmzoo.adapters.pixel_shuffle import PixelShuffle, pixel_shuffle, pixel_shuffle_linear, pixel_shuffle_projector

__all__ = ["PatchMerger", "mlp_projector", "AudioProjector", "PixelShuffle", "pixel_shuffle", "pixel_shuffle_projector",
           "pixel_shuffle_linear", "AvgPoolProjector", "avg_pool_projector", "PackedProjector"]
