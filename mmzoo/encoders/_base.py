"""The contract of an encoder: what an executor reads of a tower's first module besides its forward.

Like vLLM's ``SupportsMultiModal`` for a model, it is a few declared facts with documented
defaults, read directly (never probed with ``getattr``): an encoder that has nothing to say
inherits the defaults.
"""

from __future__ import annotations

from torch import nn


class Encoder(nn.Module):
    """Base of the encoders (``mmzoo.encoders``; a component whose conf file is in ``conf/encoder/``).

    ``forward`` takes the tower's inputs by name (a :class:`~mmzoo.types.TowerInput`'s ``inputs``,
    ``[rows, ...]`` each) and returns ``[embeds, out_dim]`` features for the adapter. An encoder
    declares, as class attributes or properties:

    Attributes:
        rows_per_item: output rows per input row when each input row is one whole item (Llava's
            images, Qwen2-Audio's clips): the XLA executor then buckets the tower's input rows by
            items (doubling from 1 to as many items as its media buffer holds, at most 16), unless
            the executor config or the family gives the buckets. None (the default): the input rows
            are not whole items (Qwen2-VL's packed patches), bucketed by the executor's
            ``min_encoder_rows`` / ``max_encoder_rows``.
        rotary_input: the forward input holding the rotary positions (Qwen2-VL's ``patch_pos``), for
            an encoder whose :class:`~mmzoo.layers.Rotary` is its ``rotary`` attribute: the XLA
            executor tabulates that rotary up to the tower's largest input-row bucket (its positions
            are below the rows of one call) and refuses an input whose positions are past the table,
            since a gather past it would clamp silently. None (the default): no rotary input.
    """

    rows_per_item: int | None = None
    rotary_input: str | None = None
