"""The shared pieces of every attention backend: argument checks and the reference mask."""

from __future__ import annotations

from collections.abc import Callable

import torch


class AttentionBackend:
    """Base of the attention backends: holds the name and the construction-time shape check.

    Subclasses implement ``__call__`` with the signature documented in :mod:`mmzoo.backends`.
    """

    name: str = "?"
    # whether the backend multiplies q by k^T with a plain matmul: an executor may then hold a KV
    # cache's keys transposed, and the matmul reads them in place (a kernel reading [s, d] key
    # tiles, like Pallas', would instead need them copied back)
    matmul_keys: bool = False
    # whether the backend itself skips the keys past each query's position (Pallas' decode kernel
    # stops at the last block a sequence reaches): an executor then gains nothing by handing it a
    # shorter, bucketed view of the KV cache, and hands it the whole cache
    skips_past_length: bool = False
    # whether the backend skips the blocks of keys its mask hides entirely (Pallas' flash kernel
    # does, per segment): prompts packed in one row then cost it no scores across prompts, and an
    # executor gains nothing by cutting the row into windows (:meth:`windowed`)
    skips_masked_blocks: bool = False

    def check_shape(self, *, head_dim: int, num_heads: int, num_kv_heads: int) -> None:
        """Raise ``ValueError`` if this backend cannot run attention of this shape.

        Called by attention layers in ``__init__`` so that an unsupported shape fails at
        construction, not in the middle of a forward pass.
        """
        if head_dim <= 0:
            raise ValueError(f"{self.name} attention: head_dim must be positive, got {head_dim}")
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"{self.name} attention: num_heads={num_heads} is not a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __deepcopy__(self, memo) -> "AttentionBackend":
        # a backend is a shared, stateless strategy (its settings fixed at construction): a copied
        # module keeps using the same one (an executor copies the modules it is given)
        return self

    def with_mesh(self, mesh) -> "AttentionBackend":
        """This backend for tensors split over a device mesh (an executor's
        :class:`~mmzoo.executor._sharding.DeviceMesh`): itself when GSPMD can partition its ops (the
        torch backends); a kernel GSPMD cannot see into (Pallas) returns a copy that runs per shard."""
        return self

    def folded_mask(self, q: torch.Tensor, k: torch.Tensor, *, causal: bool, q_segment_ids, kv_segment_ids,
                    q_positions, kv_lengths, sliding_window: int | None = None, q_blocks=None,
                    kv_blocks=None) -> torch.Tensor | None:
        """:func:`visibility_mask` folded for GQA (:func:`fold_gqa`), built once per forward.

        Every layer of a forward passes the same position / segment / length / block tensors, so
        the mask of the previous call is reused while those are the same objects (the memo holds
        them, so their identities stay valid), one memo per sliding window (layers that alternate
        between a window and none each find theirs). On XLA this keeps the traced graph smaller.
        """
        b, hq, sq, _ = q.shape
        skv, groups = k.shape[2], hq // k.shape[1]
        key = (b, sq, skv, groups, causal, str(q.device), q_segment_ids, kv_segment_ids, q_positions, kv_lengths,
               q_blocks, kv_blocks)
        args = (b, sq, skv, groups, q.device, causal, q_segment_ids, kv_segment_ids, q_positions, kv_lengths,
                sliding_window, q_blocks, kv_blocks)
        if not any(isinstance(t, torch.Tensor) for t in key):
            # shapes only: a memo would outlive the forward, and on XLA the next graph would take
            # the materialized mask as an input instead of building it (a different graph than
            # the one warmup compiled)
            return self._folded(*args)
        memos = self.__dict__.setdefault("_mask_memo", {})
        memo = memos.get(sliding_window)
        if memo is not None and len(memo[0]) == len(key) and all(
                a is c if isinstance(a, torch.Tensor) or isinstance(c, torch.Tensor) else a == c
                for a, c in zip(memo[0], key)):
            return memo[1]
        mask = self._folded(*args)
        memos[sliding_window] = (key, mask)
        return mask

    def forget(self) -> None:
        """Drop what :meth:`folded_mask` and :meth:`windowed` keep for the rest of a forward: a caller
        tracing each layer as a graph of its own (:mod:`mmzoo.executor._layers`) builds each
        layer's mask inside that layer's graph."""
        self.__dict__.pop("_mask_memo", None)
        self.__dict__.pop("_window_memo", None)

    def windowed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, window: int,
                 q_segment_ids: torch.Tensor, kv_segment_ids: torch.Tensor,
                 sliding_window: int | None = None, q_blocks: torch.Tensor | None = None,
                 kv_blocks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention over prompts packed in one row (``q [1, hq, s, d]``, ``k, v [1, hkv, s, d]``,
        segment ids ``[1, s]``), when no prompt is longer than ``window`` tokens: the same keys
        visible as ``self(q, k, v, causal=True, q_segment_ids=..., kv_segment_ids=...)``, at
        ``s * 2 * window`` scores instead of ``s * s``.

        The row is cut into chunks of ``window`` queries (``s`` a multiple of it). A prompt of at
        most ``window`` tokens that reaches into chunk ``j`` began in chunk ``j - 1`` or ``j``, so
        chunk ``j`` attends to those two chunks only: the chunks become the batch of one call of
        this backend, with the same segment and causal masking inside.

        Bidirectional blocks (``q_blocks`` / ``kv_blocks``) are refused: a query of chunk ``j``
        may see the rest of its block in chunk ``j + 1``, which this form never reads.
        """
        if q_blocks is not None or kv_blocks is not None:
            raise ValueError(f"{self.name} attention: the windowed form of packed prompts cannot honour "
                             f"q_blocks/kv_blocks (a block may reach into a later chunk of {window} queries); "
                             f"call the backend on the whole row")
        b, hq, s, d = q.shape
        if b != 1 or s % window or k.shape[2] != s:
            raise ValueError(f"{self.name} attention: a window of {window} needs one packed row whose length is "
                             f"a multiple of it, got q{tuple(q.shape)} k{tuple(k.shape)}")
        n = s // window
        seg, kv_seg, positions = self._window_ids(q_segment_ids, kv_segment_ids, n, window)
        qc = q.reshape(hq, n, window, d).transpose(0, 1)  # [n, hq, w, d]
        extra = {} if sliding_window is None else {"sliding_window": sliding_window}  # key distances kept
        out = self(qc, _two_chunks(k, n, window), _two_chunks(v, n, window), scale=scale, causal=True,
                   q_segment_ids=seg, kv_segment_ids=kv_seg, q_positions=positions, **extra)
        return out.transpose(0, 1).reshape(1, hq, s, out.shape[-1])

    def _window_ids(self, q_segment_ids, kv_segment_ids, n: int, window: int):
        """Per chunk: the queries' segment ids ``[n, w]``, the segment ids of the two chunks they
        attend to ``[n, 2w]`` (before the first chunk: -1, no prompt's) and the queries' positions
        in those ``2w`` keys. Built once per forward, like :meth:`folded_mask` (so its memo, keyed
        on these tensors, hits in every layer)."""
        memo = getattr(self, "_window_memo", None)
        if memo is not None and memo[0] is q_segment_ids and memo[1] is kv_segment_ids and memo[2] == (n, window):
            return memo[3]
        seg = q_segment_ids.reshape(n, window)
        cur = kv_segment_ids.reshape(n, window)
        prev = torch.cat([torch.full_like(cur[:1], -1), cur[:-1]])
        positions = (torch.arange(window, device=seg.device) + window).expand(n, window)
        ids = (seg, torch.cat([prev, cur], dim=1), positions)
        self._window_memo = (q_segment_ids, kv_segment_ids, (n, window), ids)
        return ids

    @staticmethod
    def _folded(b, sq, skv, groups, device, causal, q_segment_ids, kv_segment_ids, q_positions, kv_lengths,
                sliding_window=None, q_blocks=None, kv_blocks=None):
        mask = visibility_mask(b, sq, skv, device, causal=causal, q_segment_ids=q_segment_ids,
                               kv_segment_ids=kv_segment_ids, q_positions=q_positions, kv_lengths=kv_lengths,
                               sliding_window=sliding_window, q_blocks=q_blocks, kv_blocks=kv_blocks)
        if mask is not None and groups > 1:
            mask = mask.unsqueeze(2).expand(b, 1, groups, sq, skv).reshape(b, 1, groups * sq, skv)
        return mask


def _two_chunks(x: torch.Tensor, n: int, window: int) -> torch.Tensor:
    """``[1, h, n * w, d]`` -> ``[n, h, 2w, d]``: chunk ``j - 1`` (zeros before the first) then chunk ``j``."""
    h, d = x.shape[1], x.shape[3]
    cur = x.reshape(h, n, window, d)
    prev = torch.cat([torch.zeros_like(cur[:, :1]), cur[:, :-1]], dim=1)
    return torch.cat([prev, cur], dim=2).transpose(0, 1)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Check the layouts named in :mod:`mmzoo.backends` (shape metadata only, no tensor values)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects [b, h, s, d] tensors, got q{tuple(q.shape)} k{tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k{tuple(k.shape)} and v{tuple(v.shape)} differ")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: q{tuple(q.shape)} and k{tuple(k.shape)} disagree on batch or head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads is not a multiple of {k.shape[1]} kv heads")


def check_blocks(causal: bool, q_blocks: torch.Tensor | None, kv_blocks: torch.Tensor | None,
                 b: int, sq: int, skv: int) -> None:
    """Check the bidirectional-block arguments of :mod:`mmzoo.backends` (shapes only, no values):
    both or neither, causal attention only, ``q_blocks [b, sq]`` and ``kv_blocks [b, skv]``."""
    if (q_blocks is None) != (kv_blocks is None):
        raise ValueError("attention: pass both q_blocks and kv_blocks, or neither")
    if q_blocks is None:
        return
    if not causal:
        raise ValueError("attention: q_blocks/kv_blocks open blocks of causal attention; without causal every "
                         "key is already visible")
    if tuple(q_blocks.shape) != (b, sq) or tuple(kv_blocks.shape) != (b, skv):
        raise ValueError(f"attention: q_blocks{tuple(q_blocks.shape)} and kv_blocks{tuple(kv_blocks.shape)} "
                         f"must be [b, sq] = {(b, sq)} and [b, skv] = {(b, skv)}")


def visibility_mask(
    b: int,
    sq: int,
    skv: int,
    device: torch.device,
    *,
    causal: bool,
    q_segment_ids: torch.Tensor | None,
    kv_segment_ids: torch.Tensor | None,
    q_positions: torch.Tensor | None,
    kv_lengths: torch.Tensor | None,
    sliding_window: int | None = None,
    q_blocks: torch.Tensor | None = None,
    kv_blocks: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Boolean ``[b, 1, sq, skv]`` mask, True where a key is visible; ``None`` if all are.

    The rules of :mod:`mmzoo.backends`; with blocks, transformers' Gemma 3 masks
    (``create_masks_for_vision_model``): ``(causal OR same block) AND sliding window``.
    """
    mask = None
    kv_idx = torch.arange(skv, device=device)  # [skv]
    if sliding_window is not None and not causal:
        raise ValueError("attention: a sliding window applies to causal attention")
    check_blocks(causal, q_blocks, kv_blocks, b, sq, skv)
    if causal:
        if q_positions is None:
            q_positions = (torch.arange(sq, device=device) + (skv - sq)).expand(b, sq)
        mask = kv_idx.view(1, 1, skv) <= q_positions.view(b, sq, 1)  # [b, sq, skv]
        if q_blocks is not None:  # a block's tokens see each other both ways
            q_blk = q_blocks.view(b, sq, 1)
            mask = mask | ((q_blk >= 0) & (q_blk == kv_blocks.view(b, 1, skv)))
        if sliding_window is not None:  # the last sliding_window keys up to the query's own
            mask = mask & (kv_idx.view(1, 1, skv) > q_positions.view(b, sq, 1) - sliding_window)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("attention: pass both q_segment_ids and kv_segment_ids, or neither")
    if q_segment_ids is not None:
        seg = q_segment_ids.view(b, sq, 1) == kv_segment_ids.view(b, 1, skv)  # [b, sq, skv]
        mask = seg if mask is None else mask & seg
    if kv_lengths is not None:
        lens = (kv_idx.view(1, 1, skv) < kv_lengths.view(b, 1, 1)).expand(b, sq, skv)
        mask = lens if mask is None else mask & lens
    return None if mask is None else mask.unsqueeze(1)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[b, hkv, s, d]`` -> ``[b, hkv * groups, s, d]``: each kv head serves ``groups`` query heads."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def fold_gqa(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """GQA without repeating kv heads: the ``groups`` query heads that share a kv head become
    extra query rows of it, so every key is read in place (no per-step copy of the KV cache).

    ``q [b, hq, sq, d]`` -> ``[b, hkv, groups * sq, d]`` (the matching mask is
    :meth:`AttentionBackend.folded_mask`). Returns ``(q, unfold)`` where ``unfold(out)`` restores
    ``[b, hq, sq, d]``. Query head ``i`` uses kv head ``i // groups``, as :func:`repeat_kv` does.
    """
    b, hq, sq, d = q.shape
    groups = hq // k.shape[1]
    if groups == 1:
        return q, lambda out: out
    return q.reshape(b, k.shape[1], groups * sq, d), lambda out: out.reshape(b, hq, sq, out.shape[-1])


def checked_full_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the layouts, then repeat kv heads to the query heads (the dense backends' GQA)."""
    check_inputs(q, k, v)
    groups = q.shape[1] // k.shape[1]
    return repeat_kv(k, groups), repeat_kv(v, groups)
