"""Adapters (projectors) between an encoder's features and the language model's embeddings."""

from mmzoo.adapters.patch_merger import PatchMerger

__all__ = ["PatchMerger"]

from mmzoo.adapters.audio_projector import AudioProjector  # noqa: E402
from mmzoo.adapters.mlp_projector import mlp_projector  # noqa: E402

__all__ += ["AudioProjector", "mlp_projector"]
