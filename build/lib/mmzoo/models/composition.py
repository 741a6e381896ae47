"""Composition of encoder towers, adapters and a decoder LM into one multimodal model."""

from __future__ import annotations

import torch
from torch import nn


class Tower(nn.Module):
    """An encoder followed by its adapter: media inputs -> LM-width embeddings, one row per placeholder."""

    def __init__(self, *, encoder: nn.Module, adapter: nn.Module):
        super().__init__()
        self.encoder, self.adapter = encoder, adapter

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.encoder(**inputs))


class MultimodalLM(nn.Module):
    """Towers + decoder LM (torchtune's DeepFusion idea, for early fusion by placeholder tokens).

    Media embeddings replace the LM's token embeddings at placeholder positions; everything else
    is the decoder's own forward.

    Args:
        lm: a :class:`mmzoo.lms.DecoderLM`.
        towers: name -> :class:`Tower` (e.g. ``{"vision": ...}``); towers may serve several modalities.
    """

    def __init__(self, *, lm: nn.Module, towers: dict[str, Tower]):
        super().__init__()
        self.lm = lm
        self.towers = nn.ModuleDict(towers)

    def encode(self, tower: str, **inputs: torch.Tensor) -> torch.Tensor:
        """Run one tower: ``[rows, ...]`` inputs -> ``[embeds, lm_dim]``."""
        return self.towers[tower](**inputs)

    def embed(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
              mm_index: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with media rows merged in.

        Args:
            input_ids: ``[b, s]``.
            mm_embeds: ``[m, dim]`` media embeddings of the batch, or None.
            mm_index: ``[b, s]`` row of ``mm_embeds`` for each placeholder position, -1 elsewhere.

        Returns:
            ``[b, s, dim]``.
        """
        x = self.lm.embed_tokens(input_ids)
        if mm_embeds is None:
            return x
        rows = mm_embeds.to(x.dtype)[mm_index.clamp(min=0)]  # [b, s, dim]
        return torch.where((mm_index >= 0).unsqueeze(-1), rows, x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *, mm_embeds=None, mm_index=None,
                **lm_kwargs) -> torch.Tensor:
        return self.lm(self.embed(input_ids, mm_embeds, mm_index), positions, **lm_kwargs)
