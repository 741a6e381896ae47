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
        bidirectional_token: a placeholder token whose runs attend to themselves both ways in a
            prompt's forward (Gemma 3's image tokens: each image's tokens see each other, the rest
            of the prompt stays causal): every step of more than one token passes each token's run
            as ``q_blocks`` / ``kv_blocks`` to the attention backends (:func:`token_runs`); None:
            plain causal attention.
    """

    def __init__(self, *, lm: nn.Module, towers: dict[str, Tower], bidirectional_token: int | None = None):
        super().__init__()
        self.lm = lm
        self.towers = nn.ModuleDict(towers)
        self.bidirectional_token = bidirectional_token

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
                attn_kwargs=None, **lm_kwargs) -> torch.Tensor:
        if self.bidirectional_token is not None and input_ids.shape[1] > 1:  # a decode step's token is text
            runs = token_runs(input_ids == self.bidirectional_token)  # [b, s], one tensor for every layer
            attn_kwargs = {**(attn_kwargs or {}), "q_blocks": runs, "kv_blocks": runs}
        return self.lm(self.embed(input_ids, mm_embeds, mm_index), positions, attn_kwargs=attn_kwargs, **lm_kwargs)


def token_runs(marked: torch.Tensor) -> torch.Tensor:
    """``marked [b, s]`` bool -> ``[b, s]`` int64: each maximal run of marked positions numbered
    0, 1, ... along the row, -1 where unmarked (transformers' ``get_block_sequence_ids_for_mask``)."""
    before = torch.cat([torch.zeros_like(marked[:, :1]), marked[:, :-1]], dim=1)  # [b, s]: the previous one marked
    starts = (marked & ~before).long()
    return torch.where(marked, torch.cumsum(starts, dim=1) - 1, torch.full_like(starts, -1))
