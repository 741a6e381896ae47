"""Adapters (projectors) between an encoder's features and the language model's embeddings."""

from mmzoo.adapters.patch_merger import PatchMerger

__all__ = ["PatchMerger"]
