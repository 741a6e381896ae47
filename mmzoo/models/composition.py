"""Composition of encoder towers, adapters and a decoder LM into one multimodal model."""

from __future__ import annotations

import inspect

import torch
from torch import nn


class Tower(nn.Module):
    """An encoder followed by its adapter: media inputs -> LM-width embeddings, one row per placeholder.

    The inputs go to the encoder, except those the adapter's ``forward`` names as keyword parameters
    after the features (LLaVA-OneVision's ``pack_index`` / ``pack_weight``), which go to the adapter.
    """

    def __init__(self, *, encoder: nn.Module, adapter: nn.Module):
        super().__init__()
        self.encoder, self.adapter = encoder, adapter
        params = list(inspect.signature(adapter.forward).parameters.values())[1:]  # after the features
        self.adapter_inputs = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        own = {k: inputs.pop(k) for k in self.adapter_inputs if k in inputs}
        return self.adapter(self.encoder(**inputs), **own)


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
        deepstack_levels: ``k``: each media row is ``(1 + k) * dim`` wide, the embedding that
            replaces the token's, then ``k`` levels added to the hidden states after layers
            ``0 .. k - 1`` at the placeholder positions (Qwen3-VL's DeepStack; text rows add
            nothing); 0: rows are ``dim`` wide.
    """

    def __init__(self, *, lm: nn.Module, towers: dict[str, Tower], bidirectional_token: int | None = None,
                 deepstack_levels: int = 0):
        super().__init__()
        self.lm = lm
        self.towers = nn.ModuleDict(towers)
        self.bidirectional_token = bidirectional_token
        self.deepstack_levels = int(deepstack_levels)

    @property
    def media_width(self) -> int:
        """The width of a media row (the executor's media buffer, precomputed embeddings)."""
        return self.lm.dim * (1 + self.deepstack_levels)

    def encode(self, tower: str, **inputs: torch.Tensor) -> torch.Tensor:
        """Run one tower: ``[rows, ...]`` inputs -> ``[embeds, lm_dim]``."""
        return self.towers[tower](**inputs)

    def embed(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
              mm_index: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with media rows merged in.

        Args:
            input_ids: ``[b, s]``.
            mm_embeds: ``[m, media_width]`` media embeddings of the batch, or None.
            mm_index: ``[b, s]`` row of ``mm_embeds`` for each placeholder position, -1 elsewhere.

        Returns:
            ``[b, s, dim]``.
        """
        return self._merge(input_ids, mm_embeds, mm_index)[0]

    def _merge(self, input_ids, mm_embeds, mm_index) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`embed`'s ``[b, s, dim]`` and the DeepStack levels ``[k, b, s, dim]`` (zeros at text
        positions; None without levels or media)."""
        x = self.lm.embed_tokens(input_ids)
        if mm_embeds is None:
            return x, None
        media = (mm_index >= 0).unsqueeze(-1)  # [b, s, 1]
        rows = mm_embeds.to(x.dtype)[mm_index.clamp(min=0)]  # [b, s, (1 + k) * dim]
        dim = x.shape[-1]
        merged = torch.where(media, rows[..., :dim], x)
        if not self.deepstack_levels:
            return merged, None
        levels = rows[..., dim:].unflatten(-1, (self.deepstack_levels, dim))  # [b, s, k, dim]
        levels = torch.where(media.unsqueeze(-1), levels, torch.zeros((), dtype=levels.dtype, device=levels.device))
        return merged, levels.permute(2, 0, 1, 3)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *, mm_embeds=None, mm_index=None,
                attn_kwargs=None, **lm_kwargs) -> torch.Tensor:
        if self.bidirectional_token is not None and input_ids.shape[1] > 1:  # a decode step's token is text
            runs = token_runs(input_ids == self.bidirectional_token)  # [b, s], one tensor for every layer
            attn_kwargs = {**(attn_kwargs or {}), "q_blocks": runs, "kv_blocks": runs}
        x, deepstack = self._merge(input_ids, mm_embeds, mm_index)
        if deepstack is not None:
            lm_kwargs["deepstack"] = deepstack
        return self.lm(x, positions, attn_kwargs=attn_kwargs, **lm_kwargs)


def token_runs(marked: torch.Tensor) -> torch.Tensor:
    """``marked [b, s]`` bool -> ``[b, s]`` int64: each maximal run of marked positions numbered
    0, 1, ... along the row, -1 where unmarked (transformers' ``get_block_sequence_ids_for_mask``)."""
    before = torch.cat([torch.zeros_like(marked[:, :1]), marked[:, :-1]], dim=1)  # [b, s]: the previous one marked
    starts = (marked & ~before).long()
    return torch.where(marked, torch.cumsum(starts, dim=1) - 1, torch.full_like(starts, -1))
