"""Attention backends: one signature, chosen once at construction.

Every attention call in mmzoo (vision towers, audio towers, LM prefill and LM decode) goes
through a backend object with this call signature::

    out = backend(q, k, v, scale=..., causal=..., q_segment_ids=..., kv_segment_ids=...,
                  q_positions=..., kv_lengths=..., sliding_window=..., q_blocks=..., kv_blocks=...)

Shapes: ``q`` is ``[b, hq, sq, d]``; ``k`` and ``v`` are ``[b, hkv, skv, d]`` with
``hq % hkv == 0`` (grouped-query attention when ``hkv < hq``). The result is ``[b, hq, sq, d]``.

Masking rules, combined with AND (a key is visible to a query only if every rule given allows it):

* ``causal``: key ``j`` is visible to query ``i`` iff ``j <= q_positions[b, i]``. When
  ``q_positions`` is omitted the queries are the last ``sq`` positions of the keys
  (``q_positions = skv - sq + arange(sq)``), which is plain causal prefill when ``sq == skv``.
* ``q_blocks [b, sq]`` / ``kv_blocks [b, skv]`` (causal only, both or neither): bidirectional
  blocks, such as the tokens of one image in Gemma 3. Integer ids, -1 for a token in no block,
  equal non-negative ids for one block (a contiguous run of positions). They widen the causal
  rule, not the others: ``j <= q_positions[b, i]`` OR (``q_blocks[b, i] >= 0`` and
  ``q_blocks[b, i] == kv_blocks[b, j]``). As transformers' Gemma 3 masks
  (``create_masks_for_vision_model``: ``or_masks(causal, blockwise_overlay)``, then
  ``and_masks`` with the sliding window).
* ``sliding_window`` (causal only): key ``j`` is visible iff ``j > q_positions[b, i] - sliding_window``
  (the last ``sliding_window`` keys up to the query's own; transformers' ``sliding_window_overlay``).
* ``q_segment_ids [b, sq]`` / ``kv_segment_ids [b, skv]``: visible iff the ids are equal
  (block-diagonal attention over packed images, or padding kept apart from real tokens).
* ``kv_lengths [b]``: key ``j`` is visible iff ``j < kv_lengths[b]`` (a partly filled cache).

A query row that sees no key at all returns zeros.

Hidden keys leave the scores by selection, so their keys may hold anything. Their values still
meet zero weights in the dense backends' (sdpa, eager) ``weights @ v``, and ``0 * NaN`` is NaN:
selecting them away would be one more pass over every key of every decode step, so a hidden
value must be finite. The executors' KV cache ensures it (it stores every non-finite key or value
as 0, :func:`mmzoo.lms.kv_cache.finite`). The Pallas kernels also cut the values past each
tile's last visible key by selection, in the one tile that holds it.
"""

from mmzoo.backends._base import AttentionBackend, repeat_kv
from mmzoo.backends.eager import EagerAttention
from mmzoo.backends.sdpa import SDPAAttention

__all__ = ["AttentionBackend", "EagerAttention", "SDPAAttention", "PallasAttention", "resolve", "set_attention", "repeat_kv"]


def resolve(attention) -> AttentionBackend:
    """A backend from a backend object, a ``conf/attention`` option name (``"sdpa"``, ``"pallas"``,
    ``"eager"``: built with that file's settings) or a config node with ``_target_``."""
    if isinstance(attention, AttentionBackend):
        return attention
    if isinstance(attention, str):
        from mmzoo.config import build_option

        return build_option("attention", attention)
    if hasattr(attention, "get") and attention.get("_target_"):
        from hydra.utils import instantiate

        return resolve(instantiate(attention))
    raise TypeError(f"attention={attention!r}: give a backend, a conf/attention name or a config with _target_")


def set_attention(module, attention) -> int:
    """Give every :class:`~mmzoo.layers.Attention` inside ``module`` the backend ``attention`` (see
    :func:`resolve`), checked against each layer's shape; returns how many layers were set. For
    research code on built modules; pipelines choose backends in their config
    (``model.encoder.attention=pallas``)."""
    from mmzoo.layers import Attention

    backend = resolve(attention)
    layers = [m for m in module.modules() if isinstance(m, Attention)]
    for layer in layers:
        backend.check_shape(head_dim=layer.head_dim, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads)
    for layer in layers:
        layer.attn_fn = backend
    return len(layers)


def __getattr__(name):
    # The Pallas backend imports jax; keep that cost off `import mmzoo.backends`.
    if name == "PallasAttention":
        from mmzoo.backends.pallas import PallasAttention

        return PallasAttention
    raise AttributeError(name)
