"""JAX Pallas attention kernels behind :class:`mmzoo.backends.pallas.PallasAttention`.

Two kernels, one online-softmax step (Dao et al., "FlashAttention", 2022):

* :func:`flash_attention`: blocked attention for encoder and prefill calls. Grid
  ``(b, hq, q blocks, kv blocks)``; each query head reads its kv head through the index map, so
  grouped-query attention never materializes repeated kv heads.
* :func:`decode_attention`: a few queries per sequence against a KV cache. Grid
  ``(b, hkv, kv blocks)``; the ``groups * sq`` query rows that share a kv head form one tile, so
  each cache block is read once per kv head.

Both take the masking arguments of :mod:`mmzoo.backends` as JAX arrays (``None`` when absent;
bidirectional blocks, ``q_blocks``/``kv_blocks``, in the flash kernel only) and skip the kv
blocks that no query of a tile can see: the index map clamps to the last
needed block (no copy on TPU) and ``pl.when`` skips the arithmetic (also in interpret mode).
In the block that holds that bound, the values past it are cut to zeros by selection
(:func:`_fold_tile`): a KV cache row holds anything past a sequence's end, and a zero softmax
weight times NaN is NaN.

The same source compiles with Mosaic on TPU (``interpret=False``) and runs through Pallas'
HLO interpreter anywhere else (``interpret=True``). Layouts follow the TPU's (8, 128) tiling:
per-query metadata (positions, segment ids) is broadcast over 128 lanes and per-key metadata
over 8 sublanes, so no kernel ever transposes a vector.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
SUBLANES = 8
# Finite stand-in for -inf: exp(MASK_VALUE - m) underflows to 0 and MASK_VALUE - MASK_VALUE == 0,
# so rows that have seen nothing yet never produce NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_NT_DIMS = (((1,), (1,)), ((), ()))  # contract the last dims: q [r, d] . k [bk, d] -> [r, bk]


def vmem_bytes(*, rows: int, block_kv: int, head_dim: int, itemsize: int = 4) -> int:
    """Upper estimate of the VMEM one kernel step holds: double-buffered q/k/v/out tiles,
    float32 accumulators and the ``[rows, block_kv]`` score intermediates."""
    tiles = 2 * (2 * rows + 2 * block_kv) * head_dim * itemsize  # q, out, k, v; two buffers each
    # positions, segment ids and blocks per query row; segment ids and blocks per key
    meta = 2 * (3 * rows * LANES + 2 * SUBLANES * block_kv) * 4
    scratch = (rows * head_dim + 2 * rows * LANES) * 4  # acc, m, l
    scores = 3 * rows * block_kv * 4  # s, p and the mask
    return tiles + meta + scratch + scores


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _block(n: int, block: int) -> tuple[int, int]:
    """(block size, padded length): one full-length block when ``n <= block`` (no padding; a
    block equal to the array dim is always a legal TPU tile), else ``block`` and ``n`` rounded up."""
    return (n, n) if n <= block else (block, _round_up(n, block))


def _init_accumulators(m_ref, l_ref, acc_ref):
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _online_softmax_step(q, k, v, visible, m_ref, l_ref, acc_ref, scale):
    """Fold one kv block into the running max ``m``, sum ``l`` and output ``acc`` of each row.

    ``m``/``l`` are kept replicated over 128 lanes (``[rows, 128]``), the TPU-native layout of a
    per-row scalar. Masked scores become MASK_VALUE (a selection, so a NaN key never counts);
    while a row has seen no visible key its ``m`` stays exactly MASK_VALUE and the junk it sums is
    wiped (``alpha == 0``) by the first visible key, or dropped at the end by
    :func:`_write_output`. Masked values meet zero weights in ``p @ v``: ``v`` must be finite
    wherever no row of the tile looks (:func:`_fold_tile` cuts the keys past them all).
    """
    s = jax.lax.dot_general(q, k, _NT_DIMS, preferred_element_type=jnp.float32) * scale  # [r, bk]
    if visible is not None:
        s = jnp.where(visible, s, MASK_VALUE)
    m_prev = m_ref[...]  # [r, 128]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [r, 128]
    alpha = jnp.exp(m_prev - m_next)  # [r, 128]
    p = jnp.exp(s - m_next[:, :1])  # [r, bk]
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)  # [r, d]
    acc_ref[...] = acc_ref[...] * alpha[:, :1] + pv
    m_ref[...] = m_next


def _fold_tile(q_ref, k_ref, v_ref, visible, start, stop, block_kv, m_ref, l_ref, acc_ref, scale, lo=None):
    """Fold the kv tile starting at key ``start`` into the accumulators if any of its keys is below
    ``stop``, the key from which on no query row of the tile looks (``visible()``: the tile's mask),
    and at or past ``lo``, the first key any row looks at (a sliding window; None: 0).

    The tile that holds ``stop`` gets its values at and past it cut to zeros, by selection: they
    would meet zero weights in ``p @ v``, and a cache row past a sequence's end may hold anything
    (0 * NaN is NaN). Only that one tile pays for the cut; the tiles below ``stop`` are taken as
    they are and the ones past it (or wholly below ``lo``: earlier keys of the same rows, finite)
    are skipped.
    """
    def fold(v):
        _online_softmax_step(q_ref[...], k_ref[...], v, visible(), m_ref, l_ref, acc_ref, scale)

    live = True if lo is None else start + block_kv > lo

    @pl.when((start + block_kv <= stop) & live)
    def _():
        fold(v_ref[...])

    @pl.when((start < stop) & (start + block_kv > stop) & live)
    def _():
        v = v_ref[...]  # [bk, d]
        below = jax.lax.broadcasted_iota(jnp.int32, v.shape, 0) < stop - start
        fold(jnp.where(below, v, jnp.zeros_like(v)))


def _write_output(o_ref, m_ref, l_ref, acc_ref):
    """``acc / l``, and zeros for rows that never saw a visible key (``m`` still MASK_VALUE)."""
    seen = m_ref[:, :1] > MASK_VALUE  # [r, 1]
    l = jnp.where(seen, l_ref[:, :1], 1.0)
    o_ref[...] = jnp.where(seen, acc_ref[...] / l, 0.0).astype(o_ref.dtype)


def _tile_mask(start, shape, kv_len, q_pos, window=None, q_block=None, kv_block=None):
    """Which keys of the tile starting at key ``start`` each query row sees (``shape`` = [rows, bk]):
    below ``kv_len`` (a partly filled cache), at most ``q_pos`` ([rows, 1], causal) or in the
    row's bidirectional block (``q_block [rows, 1] == kv_block [1, bk]``, ids >= 0) and, with a
    sliding ``window``, past ``q_pos - window``; None: all."""
    if kv_len is None and q_pos is None:
        return None
    kv_idx = start + jax.lax.broadcasted_iota(jnp.int32, shape, 1)  # [rows, bk]
    visible = None if kv_len is None else kv_idx < kv_len
    if q_pos is not None:
        rule = kv_idx <= q_pos
        if q_block is not None:
            rule = rule | ((q_block >= 0) & (q_block == kv_block))
        if window is not None:
            rule = rule & (kv_idx > q_pos - window)
        visible = rule if visible is None else visible & rule
    return visible


def _flash_kernel(kv_len_ref, kv_stop_ref, kv_lo_ref, *refs, block_kv, num_q_blocks, scale, causal,
                  segments, mask_length, window, blocks=False):
    q_ref, k_ref, v_ref, *refs = refs
    q_pos_ref = refs.pop(0) if causal else None
    q_seg_ref, kv_seg_ref = (refs.pop(0), refs.pop(0)) if segments else (None, None)
    q_blk_ref, kv_blk_ref = (refs.pop(0), refs.pop(0)) if blocks else (None, None)
    o_ref, m_ref, l_ref, acc_ref = refs
    bi, qi, kj = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(kj == 0)
    def _():
        _init_accumulators(m_ref, l_ref, acc_ref)

    start = kj * block_kv

    def visible():
        mask = _tile_mask(start, (q_ref.shape[0], block_kv), kv_len_ref[bi] if mask_length else None,
                          q_pos_ref[:, :1] if causal else None, window,
                          *((q_blk_ref[:, :1], kv_blk_ref[:1, :]) if blocks else ()))  # [bq, 1], [1, bk]
        if segments:
            rule = q_seg_ref[:, :1] == kv_seg_ref[:1, :]  # [bq, 1] == [1, bk]
            mask = rule if mask is None else mask & rule
        return mask

    tile = bi * num_q_blocks + qi
    _fold_tile(q_ref, k_ref, v_ref, visible, start, kv_stop_ref[tile], block_kv, m_ref, l_ref, acc_ref, scale,
               kv_lo_ref[tile] if window is not None else None)

    @pl.when(kj == pl.num_programs(3) - 1)
    def _():
        _write_output(o_ref, m_ref, l_ref, acc_ref)


def _window_start(pos, window: int | None, kv_stop) -> jax.Array:
    """The first key any query of a tile sees under a sliding ``window``: ``pos [..., rows]`` the
    tile's query positions (padding rows at -1 see nothing) -> ``[...]``, 0 without a window (a
    tile of padding only: its ``kv_stop``, so it folds nothing)."""
    if window is None:
        return jnp.zeros_like(kv_stop)
    real = jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max)
    return jnp.minimum(jnp.maximum(real.min(axis=-1) - window + 1, 0), kv_stop)


def _block_ends(q_blocks, kv_blocks, b: int, sq: int, skv: int) -> jax.Array:
    """``[b, sq]`` int32: the last key index whose block id is the query's (``q_blocks [b, sq]``
    against ``kv_blocks [b, skv]``), -1 for a query in no block or whose block no key has.

    Ids are arbitrary integers, so no segment max over a fixed number of ids: a stable sort of
    each row's key ids (ties keep index order) and a right-side search for each query's id,
    O(skv log skv) per sequence, not O(sq * skv).
    """
    q_ids = q_blocks.astype(jnp.int32).reshape(b, sq)
    kv_ids = kv_blocks.astype(jnp.int32).reshape(b, skv)
    order = jnp.argsort(kv_ids, axis=1, stable=True).astype(jnp.int32)  # [b, skv] key index by (id, index)
    sorted_ids = jnp.take_along_axis(kv_ids, order, axis=1)  # [b, skv]
    at = jax.vmap(lambda ids, q: jnp.searchsorted(ids, q, side="right"))(sorted_ids, q_ids) - 1  # [b, sq]
    at = jnp.clip(at, 0, skv - 1)
    found = (q_ids >= 0) & (jnp.take_along_axis(sorted_ids, at, axis=1) == q_ids)
    return jnp.where(found, jnp.take_along_axis(order, at, axis=1), -1)


def _kv_lengths(kv_lengths, b: int, skv: int) -> jax.Array:
    """``[b]`` int32 number of real keys per sequence, clamped to the array length."""
    if kv_lengths is None:
        return jnp.full((b,), skv, jnp.int32)
    return jnp.minimum(kv_lengths.astype(jnp.int32).reshape(b), skv)


def _q_positions(q_positions, b: int, sq: int, skv: int) -> jax.Array:
    if q_positions is None:  # the queries are the last sq keys
        return jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32) + (skv - sq), (b, sq))
    return q_positions.astype(jnp.int32).reshape(b, sq)


def _one_call_per_sequence_and_kv_head(call, per_seq, per_head):
    """``call(seq_slices, head_slices)`` for every (sequence, kv head), stacked to ``[b, hkv, ...]``.

    Interpret mode only. Pallas' HLO interpreter writes every input block back after each grid
    step, and XLA answers with a copy of each whole input per step, so a grid over ``b * hkv``
    costs O(steps x inputs). Mapping the two leading grid axes outside the kernel keeps each
    pallas_call's inputs at one (sequence, kv head). Native TPU runs the full grid.

    Args:
        per_seq: arrays with a leading ``b`` axis (lengths, per-query metadata).
        per_head: arrays with leading ``[b, hkv]`` axes (q, k, v).
    """
    def one_sequence(xs):
        seq, heads = xs
        return jax.lax.map(lambda hs: call(seq, hs), heads)

    return jax.lax.map(one_sequence, (per_seq, per_head))


def flash_attention(q, k, v, q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                    kv_lengths=None, q_blocks=None, kv_blocks=None, *, scale: float, causal: bool, block_q: int,
                    block_kv: int, interpret: bool, vmem_limit_bytes: int | None = None, window: int | None = None):
    """Blocked attention with the full mmzoo masking contract.

    Args:
        q: ``[b, hq, sq, d]``; k, v: ``[b, hkv, skv, d]`` with ``hq % hkv == 0``.
        q_segment_ids / kv_segment_ids: ``[b, sq]`` / ``[b, skv]`` or None (both or neither).
        q_positions: ``[b, sq]`` or None; kv_lengths: ``[b]`` or None.
        q_blocks / kv_blocks: ``[b, sq]`` / ``[b, skv]`` bidirectional block ids (causal only; -1:
            none) or None (both or neither): a query also sees the keys of its own block, past its
            position too; each q tile reads up to the last key of its rows' blocks.
        window: a sliding window (causal only): a query at position ``p`` sees keys ``p - window
            < j <= p``; the kv tiles wholly below every row's window are skipped.
        block_q: query rows per tile (a multiple of 8); block_kv: keys per tile (a multiple of 128).
            A sequence no longer than its block is one full-length tile; a longer one is padded
            up to a multiple of the block, and the padding is masked.

    Returns:
        ``[b, hq, sq, d]`` in q's dtype; rows that see no key are zeros.
    """
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    groups = hq // hkv
    segments = q_segment_ids is not None
    blocks = q_blocks is not None
    if blocks and not causal:
        raise ValueError("flash_attention: q_blocks/kv_blocks apply to causal attention")
    bq, sq_p = _block(sq, block_q)
    bk, skv_p = _block(skv, block_kv)
    nq = sq_p // bq

    kv_len = _kv_lengths(kv_lengths, b, skv)  # [b]
    meta = []  # per-sequence tiles of query / key metadata
    if causal:
        pos = _pad_axis(_q_positions(q_positions, b, sq, skv), 1, sq_p, value=-1)  # [b, sq_p]
        # A q tile needs the keys below min(kv_len, its last visible key + 1): a row's last
        # visible key is its position, or the last key of its block when that lies further.
        last = pos
        if blocks:
            last = jnp.maximum(last, _pad_axis(_block_ends(q_blocks, kv_blocks, b, sq, skv), 1, sq_p, value=-1))
        kv_stop = jnp.minimum(kv_len[:, None], last.reshape(b, nq, bq).max(axis=2) + 1)  # [b, nq]
        meta.append(jnp.broadcast_to(pos[:, :, None], (b, sq_p, LANES)))
    else:
        kv_stop = jnp.broadcast_to(kv_len[:, None], (b, nq))
    if window is not None and not causal:
        raise ValueError("flash_attention: a sliding window applies to causal attention")
    kv_lo = _window_start(pos.reshape(b, nq, bq) if causal else None, window, kv_stop)  # [b, nq]
    if segments:
        q_seg = _pad_axis(q_segment_ids.astype(jnp.int32).reshape(b, sq), 1, sq_p)
        kv_seg = _pad_axis(kv_segment_ids.astype(jnp.int32).reshape(b, skv), 1, skv_p)
        meta.append(jnp.broadcast_to(q_seg[:, :, None], (b, sq_p, LANES)))
        meta.append(jnp.broadcast_to(kv_seg[:, None, :], (b, SUBLANES, skv_p)))
    if blocks:  # padding rows and keys in no block (-1)
        q_blk = _pad_axis(q_blocks.astype(jnp.int32).reshape(b, sq), 1, sq_p, value=-1)
        kv_blk = _pad_axis(kv_blocks.astype(jnp.int32).reshape(b, skv), 1, skv_p, value=-1)
        meta.append(jnp.broadcast_to(q_blk[:, :, None], (b, sq_p, LANES)))
        meta.append(jnp.broadcast_to(kv_blk[:, None, :], (b, SUBLANES, skv_p)))
    q = _pad_axis(q, 2, sq_p).reshape(b, hkv, groups, sq_p, d)  # free: a kv head's q heads are adjacent
    k, v = _pad_axis(k, 2, skv_p), _pad_axis(v, 2, skv_p)

    call = functools.partial(
        _flash_call, bq=bq, bk=bk, scale=scale, causal=causal, segments=segments,
        mask_length=kv_lengths is not None or skv_p != skv, interpret=interpret,
        vmem_limit_bytes=vmem_limit_bytes, window=window, blocks=blocks)
    if interpret:
        def one(seq, heads):
            length, stop, lo, *m = seq  # [], [nq], [nq], [sq_p, 128] / [8, skv_p]
            qh, kh, vh = heads  # [groups, sq_p, d], [skv_p, d], [skv_p, d]
            return call(length[None], stop, lo, qh[None], kh[None, None], vh[None, None], *(x[None] for x in m))[0]

        out = _one_call_per_sequence_and_kv_head(one, (kv_len, kv_stop, kv_lo, *meta), (q, k, v))
    else:
        out = call(kv_len, kv_stop.reshape(b * nq), kv_lo.reshape(b * nq), q.reshape(b, hq, sq_p, d), k, v, *meta)
    out = out.reshape(b, hq, sq_p, d)
    return out[:, :, :sq] if sq_p != sq else out


def _flash_call(kv_len, kv_stop, kv_lo, q, k, v, *meta, bq, bk, scale, causal, segments, mask_length,
                interpret, vmem_limit_bytes, window, blocks=False):
    """The flash pallas_call on padded inputs: q ``[b, hq, sq_p, d]``, k/v ``[b, hkv, skv_p, d]``,
    kv_len ``[b]``, kv_stop and kv_lo ``[b * nq]``, meta as built by :func:`flash_attention`."""
    b, hq, sq_p, d = q.shape
    groups = hq // k.shape[1]
    nq, nk = sq_p // bq, k.shape[2] // bk

    def kv_block(bi, qi, kj, kv_stop_ref, kv_lo_ref):
        # Past the last needed block keep pointing at it (and before the first needed one at that
        # one): an unchanged index is not re-fetched.
        tile = bi * nq + qi
        last = jnp.maximum(kv_stop_ref[tile] - 1, 0) // bk
        return jnp.minimum(jnp.maximum(kj, kv_lo_ref[tile] // bk), last)

    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, h, qi, kj, *_: (bi, h, qi, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda bi, h, qi, kj, _, stop, lo: (
        bi, h // groups, kv_block(bi, qi, kj, stop, lo), 0))
    in_specs = [q_spec, kv_spec, kv_spec]
    if causal:
        in_specs.append(pl.BlockSpec((None, bq, LANES), lambda bi, h, qi, kj, *_: (bi, qi, 0)))
    for _ in range(segments + blocks):  # per-query then per-key ids: segment ids, then blocks
        in_specs.append(pl.BlockSpec((None, bq, LANES), lambda bi, h, qi, kj, *_: (bi, qi, 0)))
        in_specs.append(pl.BlockSpec((None, SUBLANES, bk), lambda bi, h, qi, kj, _, stop, lo: (
            bi, 0, kv_block(bi, qi, kj, stop, lo))))

    kernel = functools.partial(_flash_kernel, block_kv=bk, num_q_blocks=nq, scale=scale, causal=causal,
                               segments=segments, mask_length=mask_length, window=window, blocks=blocks)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, hq, nq, nk),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
                            pltpu.VMEM((bq, d), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
        name="mmzoo_flash_attention",
    )(kv_len, kv_stop.astype(jnp.int32), kv_lo.astype(jnp.int32), q, k, v, *meta)


def _decode_kernel(kv_len_ref, kv_stop_ref, kv_lo_ref, q_ref, k_ref, v_ref, *refs, block_kv, scale, causal,
                   mask_length, window):
    q_pos_ref = refs[0] if causal else None
    o_ref, m_ref, l_ref, acc_ref = refs[-4:]
    bi, kj = pl.program_id(0), pl.program_id(2)

    @pl.when(kj == 0)
    def _():
        _init_accumulators(m_ref, l_ref, acc_ref)

    start = kj * block_kv

    def visible():
        return _tile_mask(start, (q_ref.shape[0], block_kv), kv_len_ref[bi] if mask_length else None,
                          q_pos_ref[:, :1] if causal else None, window)

    _fold_tile(q_ref, k_ref, v_ref, visible, start, kv_stop_ref[bi], block_kv, m_ref, l_ref, acc_ref, scale,
               kv_lo_ref[bi] if window is not None else None)

    @pl.when(kj == pl.num_programs(2) - 1)
    def _():
        _write_output(o_ref, m_ref, l_ref, acc_ref)


def decode_attention(q, k, v, q_positions=None, kv_lengths=None, *, scale: float, causal: bool,
                     block_kv: int, interpret: bool, vmem_limit_bytes: int | None = None, window: int | None = None):
    """A few queries per sequence against a partly filled KV cache.

    Args:
        q: ``[b, hq, sq, d]`` with small ``sq`` (the new tokens); k, v: ``[b, hkv, S, d]`` caches.
        q_positions: ``[b, sq]`` position of each new token (per sequence), or None for the last
            ``sq`` cache rows; used by the causal rule.
        kv_lengths: ``[b]`` filled length of each cache row, or None.
        block_kv: cache rows per tile (a multiple of 128). A cache longer than one block whose
            length is not a multiple of it is padded (a copy): size caches in whole blocks.
        window: a sliding window (causal only), as :func:`flash_attention`'s: the cache blocks
            wholly below every query's window are skipped.

    Returns:
        ``[b, hq, sq, d]`` in q's dtype; rows that see no key are zeros.
    """
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    groups = hq // hkv
    rows = groups * sq
    bk, skv_p = _block(skv, block_kv)

    kv_len = _kv_lengths(kv_lengths, b, skv)  # [b]
    meta = []
    if causal:
        pos = _q_positions(q_positions, b, sq, skv)  # [b, sq]
        kv_stop = jnp.minimum(kv_len, pos.max(axis=1) + 1)  # [b]
        pos_rows = jnp.broadcast_to(pos[:, None, :], (b, groups, sq)).reshape(b, rows)
        meta.append(jnp.broadcast_to(pos_rows[:, :, None], (b, rows, LANES)))
    else:
        kv_stop = kv_len
    if window is not None and not causal:
        raise ValueError("decode_attention: a sliding window applies to causal attention")
    kv_lo = _window_start(pos if causal else None, window, kv_stop)  # [b]
    # The groups query heads of a kv head are adjacent: [b, hq, sq, d] -> [b, hkv, groups * sq, d]
    # is a free reshape, and row r of a tile is query r % sq.
    q = q.reshape(b, hkv, rows, d)
    k, v = _pad_axis(k, 2, skv_p), _pad_axis(v, 2, skv_p)

    call = functools.partial(_decode_call, bk=bk, scale=scale, causal=causal,
                             mask_length=kv_lengths is not None or skv_p != skv, interpret=interpret,
                             vmem_limit_bytes=vmem_limit_bytes, window=window)
    if interpret:
        def one(seq, heads):
            length, stop, lo, *m = seq  # [], [], [], [rows, 128]
            qh, kh, vh = heads  # [rows, d], [skv_p, d], [skv_p, d]
            return call(length[None], stop[None], lo[None], qh[None, None], kh[None, None], vh[None, None],
                        *(x[None] for x in m))[0, 0]

        out = _one_call_per_sequence_and_kv_head(one, (kv_len, kv_stop, kv_lo, *meta), (q, k, v))
    else:
        out = call(kv_len, kv_stop, kv_lo, q, k, v, *meta)
    return out.reshape(b, hq, sq, d)


def _decode_call(kv_len, kv_stop, kv_lo, q, k, v, *meta, bk, scale, causal, mask_length, interpret,
                 vmem_limit_bytes, window):
    """The decode pallas_call: q ``[b, hkv, rows, d]``, k/v ``[b, hkv, S_p, d]``, kv_len, kv_stop
    and kv_lo ``[b]``, meta as built by :func:`decode_attention`."""
    b, hkv, rows, d = q.shape

    def kv_spec_index(bi, h, kj, _, kv_stop_ref, kv_lo_ref):
        first, last = kv_lo_ref[bi] // bk, jnp.maximum(kv_stop_ref[bi] - 1, 0) // bk
        return bi, h, jnp.minimum(jnp.maximum(kj, first), last), 0

    q_spec = pl.BlockSpec((None, None, rows, d), lambda bi, h, kj, *_: (bi, h, 0, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), kv_spec_index)
    in_specs = [q_spec, kv_spec, kv_spec]
    if causal:
        in_specs.append(pl.BlockSpec((None, rows, LANES), lambda bi, h, kj, *_: (bi, 0, 0)))

    kernel = functools.partial(_decode_kernel, block_kv=bk, scale=scale, causal=causal,
                               mask_length=mask_length, window=window)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, hkv, k.shape[2] // bk),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((rows, LANES), jnp.float32), pltpu.VMEM((rows, LANES), jnp.float32),
                            pltpu.VMEM((rows, d), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
        name="mmzoo_decode_attention",
    )(kv_len, kv_stop.astype(jnp.int32), kv_lo.astype(jnp.int32), q, k, v, *meta)
