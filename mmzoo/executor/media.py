"""The media half of the runner: the persistent media buffer and the encode steps that fill it.

Each tower call (or precomputed-embeddings write) is one step at an input-row bucket, writing its
``[rows, dim]`` embeddings into the media buffer at an offset, so the prompt graphs never depend on
media sizes; a prompt's placeholders then point at those rows (``mm_index``).
"""

from __future__ import annotations

import numpy as np
import torch

from mmzoo.buckets import round_up
from mmzoo.errors import MmzooError
from mmzoo.executor.steps import encode_step
from mmzoo.types import Prepared, TowerInput


class MediaSteps:
    """The encode steps of :class:`~mmzoo.executor.base.Executor` (which holds ``media``, the
    buffer, ``buckets``, ``model`` and ``run_step``)."""

    def _check_tower_positions(self, item: TowerInput) -> None:
        """The rotary positions of a tower with a tabulated rotary (its encoder's ``rotary_input``)
        must be in its table: on XLA a gather past it would clamp silently."""
        encoder = self.model.towers[item.tower].encoder
        name = encoder.rotary_input
        table = encoder.rotary.positions if name else None
        top = int(item.inputs[name].max(initial=0)) if table is not None else 0
        if table is not None and top >= table:
            raise MmzooError(f"{item.tower} rotary position {top} ({name}) is past the "
                             f"{table} positions the tower's rotary table holds (its largest input-row bucket)")

    def _check_media_rows(self, item, offset: int, n: int) -> None:
        if offset + n > self.media.shape[0]:
            raise MmzooError(f"{item.tower} inputs need {offset + n} media rows; the buffer holds {self.media.shape[0]}")

    # -- encode --------------------------------------------------------------------------------
    def _encode_key(self, item: TowerInput) -> tuple[tuple, int]:
        """The encode step's key (its kind and static shape) and padded input rows for ``item``."""
        if item.embeds is not None:
            rows = self.buckets.encoder_rows("embeds", item.embeds.shape[0])  # the write depends only on rows
            return ("embeds", rows), rows
        rows = self.buckets.encoder_rows(item.tower, round_up(item.rows, item.row_multiple))
        return ("encode", item.tower, rows, tuple(sorted(item.inputs))), rows

    def media_rows(self, item: TowerInput) -> int:
        """The media-buffer rows :meth:`encode` writes for ``item`` (real and padding): known once its
        step has run (at warmup), else the tower's output rows scaled to the padded input rows."""
        key, rows = self._encode_key(item)
        if item.embeds is not None:
            return rows
        known = self._encoded_rows.get(key)
        return known if known is not None else -(-rows * item.num_embeds // max(item.rows, 1))

    @torch.no_grad()
    def encode(self, item: TowerInput, offset: int = 0) -> int:
        """Run one tower (or take its precomputed embeddings) and write rows at ``offset`` of the
        media buffer; returns the number of rows written (real and padding)."""
        key, rows = self._encode_key(item)
        if item.embeds is not None:
            emb = torch.as_tensor(item.embeds)  # rows as wide as the buffer's, or the LM's (inputs_embeds)
            padded = torch.zeros(rows, self.media.shape[1], dtype=self.dtype)
            padded[: emb.shape[0], : emb.shape[1]] = emb.to(self.dtype)
            tower, names, tensors = None, [], [padded.to(self.device())]
        else:
            self._check_tower_positions(item)
            tower, names, tensors = item.tower, sorted(item.inputs), []
            for name in names:
                arr = item.inputs[name]
                padded = np.full((rows,) + arr.shape[1:], item.pad.get(name, 0), dtype=arr.dtype)
                padded[: arr.shape[0]] = arr
                floating = torch.float32 if name in item.float32 else self.dtype
                tensors.append(self._tensor(padded, floating if arr.dtype.kind == "f" else torch.long))
        n = self._encoded_rows.get(key)  # known from the step's first (traced) call
        if n is not None:
            self._check_media_rows(item, offset, n)

        def step(at, *tensors):
            written = encode_step(self.model, self.media, tower, names, at, *tensors)
            self._encoded_rows[key] = written
            self._check_media_rows(item, offset, written)
            return ()

        self.run_step(key, step, [self._tensor([offset])] + tensors, "media")
        self._step_done()
        return self._encoded_rows[key]

    def encode_prompt(self, prepared: Prepared, offset: int) -> tuple[np.ndarray, int]:
        """Run the prompt's towers (one encode step per :class:`TowerInput`), writing the media
        buffer from row ``offset``; returns its ``mm_index`` pointing at those rows, and the rows
        written."""
        remap, start, at = prepared.mm_index.copy(), 0, offset
        for item in prepared.media:
            written = self.encode(item, at)
            sel = (prepared.mm_index >= start) & (prepared.mm_index < start + item.num_embeds)
            remap[sel] = prepared.mm_index[sel] - start + at
            start += item.num_embeds
            at += written
        return remap, at - offset

    @torch.no_grad()
    def encode_media(self, item: TowerInput) -> torch.Tensor:
        """Run one tower alone and return its ``[num_embeds, media_width]`` embeddings on the host.

        The whole media buffer comes back (a transfer, not a new graph), so no shape-dependent
        slice is compiled."""
        self.encode(item, 0)
        return self.media.cpu()[: item.num_embeds].clone()
