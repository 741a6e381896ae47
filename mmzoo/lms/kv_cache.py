"""A preallocated, slot-based KV cache written in place (gpt-fast style, with vLLM-like slots).

The cache holds ``[num_slots, kv_heads, max_len, head_dim]`` keys and values per layer. A slot
holds one sequence; writing at explicit positions keeps every shape static, so one compiled
graph serves every step. Attention layers see a *view* with ``update(layer_idx, k, v)``:

* :class:`PrefillView` writes a prompt's keys into its slot and lets the prompt attend to itself.
* :class:`DecodeView` writes one (or a few) new tokens per slot of the first ``b`` slots (all
  by default) and attends over the first ``kv_len`` positions of their rows (the whole row by
  default); the causal rule with
  ``q_positions`` hides everything past each sequence's length. An executor that knows no
  sequence is longer than ``kv_len`` passes it, so attention reads only that part of the cache.

A prompt does not clear its slot: past its own length the slot keeps what the previous sequence
left there, and attention hides those positions. Hidden positions are still read: a dense
attention (sdpa, eager) multiplies their values by zero weights, and ``0 * NaN`` is NaN. So the
cache holds finite numbers only: every write stores a non-finite key or value as 0 (one select per
written element, fused into the write). A request whose activations turned non-finite therefore
leaves zeros, not NaN, for the later requests of its slot (its own outputs are already
non-finite). A prefill costs what its prompts write, whatever ``max_len`` is. Clearing the slots
instead (a fill of each prompt entry's row in every layer, at a static shape: all ``max_batch``
entries of the step) made a one-prompt prefill of 64 tokens on the bench model 1.26x slower at
``max_len=1024`` and 2.7x slower at 4096 (docs/benchmarks.md).

With ``keys_transposed`` the keys are held as ``[num_slots, kv_heads, head_dim, max_len]``. An
attention that multiplies ``q @ k^T`` then finds ``k^T`` already in memory: XLA's CPU dot wants
that operand row-major, so with the usual layout it copied every cached key of every layer on
every decode step (the executor chooses this layout; attention still sees ``[b, h, s, d]``
keys, as a transposed view).

On the host (a CPU device) the cache is one anonymous memory mapping of zeros: the system gives a
page memory when it is first written, so the cache grows in the process's memory as its slots fill,
as transformers' ``DynamicCache`` grows by concatenation, while its addresses and shapes stay fixed
(a batch-1 request of 256 positions commits a thirty-second of the 8 slots x 1024 positions it
reserves). Positions attention reads that were never written read as zeros.
"""

from __future__ import annotations

import math
import mmap

import torch


class KVCache:
    """Keys and values for ``num_slots`` sequences of up to ``max_len`` tokens."""

    def __init__(self, *, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", keys_transposed: bool = False):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        kshape = (num_slots, num_kv_heads, head_dim, max_len) if keys_transposed else shape
        if torch.device(device).type == "cpu":
            held = zeros_committed_on_write([kshape, shape] * num_layers, dtype)
            self.k, self.v = held[0::2], held[1::2]
        else:
            self.k = [torch.zeros(kshape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_len, self.keys_transposed = num_slots, max_len, keys_transposed

    def keys(self, layer: int) -> torch.Tensor:
        """The keys of ``layer`` as ``[num_slots, kv_heads, max_len, head_dim]`` (a view when held transposed)."""
        return self.k[layer].transpose(-1, -2) if self.keys_transposed else self.k[layer]

    @staticmethod
    def write_index(slots: torch.Tensor, positions: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, ...]:
        """``(slot, head, position)`` indices ``[b, hkv, s]`` for writing ``[b, hkv, s, d]`` keys:
        ``slots [b]`` (a row's tokens go to one slot) or ``[b, s]`` (each token's own: several
        prompts packed in one row), ``positions [b, s]``.

        Every leading axis gets an index, so the scatter runs in the cache's own layout (indexing
        with a slice in the middle would move the advanced axes first: XLA then copies the whole
        cache into that layout and back on every step)."""
        b, s = positions.shape
        shape = (b, num_heads, s)
        heads = torch.arange(num_heads, device=positions.device).view(1, num_heads, 1)
        slots = slots.view(b, 1, s) if slots.dim() == 2 else slots.view(b, 1, 1)
        return slots.expand(shape), heads.expand(shape), positions.view(b, 1, s).expand(shape)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, index: tuple[torch.Tensor, ...]):
        # k, v: [b, hkv, s, d] -> cache[slot, h, pos] = k[:, h], non-finite entries stored as 0
        k, v = finite(k), finite(v)
        if self.keys_transposed:  # cache[slot, h, :, pos] = k[:, h], every axis indexed (see write_index)
            shape = k.shape
            dims = torch.arange(shape[-1], device=k.device).view(1, 1, 1, shape[-1]).expand(shape)
            slot, head, pos = (i.unsqueeze(-1).expand(shape) for i in index)
            self.k[layer].index_put_((slot, head, dims, pos), k)
        else:
            self.k[layer].index_put_(index, k)
        self.v[layer].index_put_(index, v)

    def prefill(self, slots: torch.Tensor, positions: torch.Tensor,
                token_slots: torch.Tensor | None = None) -> "PrefillView":
        """A view writing ``[b, s]`` prompt positions into ``slots [b]`` (row ``i`` into
        ``slots[i]``), or each token into its own ``token_slots [b, s]`` (prompts packed in one
        row). The rest of each slot is left as it is (see the module's notes)."""
        return PrefillView(self, slots if token_slots is None else token_slots, positions)

    def decode(self, positions: torch.Tensor, kv_len: int | None = None) -> "DecodeView":
        """A view writing ``positions [b, s]`` into the first ``b <= num_slots`` slots (one row per
        slot) and attending over their first ``kv_len`` cache positions (None: all ``max_len``);
        every write position must be below ``kv_len``."""
        return DecodeView(self, positions, kv_len)


class PrefillView:
    """Write a prompt into its slots; attention uses the prompt's own keys."""

    def __init__(self, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor):
        self.cache, self.slots, self.positions = cache, slots, positions
        self._index = None  # built by the first layer, reused by the others

    def index(self, num_heads: int) -> tuple[torch.Tensor, ...]:
        if self._index is None:
            self._index = KVCache.write_index(self.slots, self.positions, num_heads)
        return self._index

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.cache._write(layer, k, v, self.index(k.shape[1]))
        return k, v


class DecodeView(PrefillView):
    """Write new tokens of the first ``b`` slots and attend over the first ``kv_len`` positions of
    their rows."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, kv_len: int | None = None):
        b = positions.shape[0]
        if not 0 < b <= cache.num_slots:
            raise ValueError(f"a decode step of {b} rows needs 1 to num_slots={cache.num_slots} of them")
        super().__init__(cache, torch.arange(b, device=positions.device), positions)
        if kv_len is not None and not 0 < kv_len <= cache.max_len:
            raise ValueError(f"kv_len={kv_len} must be in [1, max_len={cache.max_len}]")
        self.kv_len, self.rows = kv_len, b

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.cache._write(layer, k, v, self.index(k.shape[1]))
        keys, values = self.cache.keys(layer), self.cache.v[layer]
        if self.rows < self.cache.num_slots:
            keys, values = keys[: self.rows], values[: self.rows]
        if self.kv_len is None or self.kv_len == self.cache.max_len:
            return keys, values
        return keys[:, :, : self.kv_len], values[:, :, : self.kv_len]


_PAGE = mmap.PAGESIZE


def zeros_committed_on_write(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """CPU tensors of zeros of ``shapes`` in one private anonymous mapping (each starting on a page):
    a page takes memory when it is first written, not when it is allocated (``torch.zeros`` writes
    every page). Reading a page never written reads zeros and takes none."""
    sizes = [-(-math.prod(s) * dtype.itemsize // _PAGE) * _PAGE for s in shapes]
    if not sum(sizes):
        return [torch.zeros(s, dtype=dtype) for s in shapes]
    region = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    flat = torch.frombuffer(region, dtype=torch.uint8)  # holds ``region`` while a view of it lives
    out, start = [], 0
    for shape, size in zip(shapes, sizes):
        n = math.prod(shape) * dtype.itemsize
        out.append(flat[start: start + n].view(dtype).view(shape))
        start += size
    return out


def finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with every NaN and infinity replaced by 0: what a KV cache stores (see the module's notes)."""
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
