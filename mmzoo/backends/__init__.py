"""Attention backends: one signature, chosen once at construction.

Every attention call in mmzoo (vision towers, audio towers, LM prefill and LM decode) goes
through a backend object with this call signature::

    out = backend(q, k, v, scale=..., causal=..., q_segment_ids=..., kv_segment_ids=...,
                  q_positions=..., kv_lengths=...)

Shapes: ``q`` is ``[b, hq, sq, d]``; ``k`` and ``v`` are ``[b, hkv, skv, d]`` with
``hq % hkv == 0`` (grouped-query attention when ``hkv < hq``). The result is ``[b, hq, sq, d]``.

Masking rules, combined with AND (a key is visible to a query only if every rule given allows it):

* ``causal``: key ``j`` is visible to query ``i`` iff ``j <= q_positions[b, i]``. When
  ``q_positions`` is omitted the queries are the last ``sq`` positions of the keys
  (``q_positions = skv - sq + arange(sq)``), which is plain causal prefill when ``sq == skv``.
* ``q_segment_ids [b, sq]`` / ``kv_segment_ids [b, skv]``: visible iff the ids are equal
  (block-diagonal attention over packed images, or padding kept apart from real tokens).
* ``kv_lengths [b]``: key ``j`` is visible iff ``j < kv_lengths[b]`` (a partly filled cache).

A query row that sees no key at all returns zeros.
"""

from mmzoo.backends._base import AttentionBackend
from mmzoo.backends.eager import EagerAttention
from mmzoo.backends.sdpa import SDPAAttention

__all__ = ["AttentionBackend", "EagerAttention", "SDPAAttention", "PallasAttention"]


def __getattr__(name):
    # The Pallas backend imports jax; keep that cost off `import mmzoo.backends`.
    if name == "PallasAttention":
        from mmzoo.backends.pallas import PallasAttention

        return PallasAttention
    raise AttributeError(name)
