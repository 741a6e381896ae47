"""Compiling a layer once (``executor.compile.layer_graphs``).

Every step's graph normally holds every layer of the model (the unrolled form): XLA's compile time
grows with depth (docs/benchmarks.md: XLA compiles the 11 graphs of a 28-layer / 32-block toy
Qwen2-VL in 18.5 s, of a 4 / 4 one of the same width in 5.2 s). With layer graphs, each transformer block of the model (the LM's layers, each tower's
blocks: one :class:`~mmzoo.layers.TransformerBlock` class for all) runs as a graph of its own. A
block's weights and its layer's KV-cache tensors are that graph's parameters, not part of it, so
every block of a stack traces to the same graph and XLA compiles it once per step shape (a few
kinds where blocks differ: the first block of a stack, whose inputs come straight from the traced
step, the last layer of a prefill, which runs at the prompts' last rows only, sliding-window
layers, a ViT's windowed blocks); what comes before the first block and after the last
(embeddings, the media merge, the LM head) is traced as usual.

Two ways to run them, both from the executor's own copy of the model (the modules' code is not
changed; the executor wraps each block's ``forward`` on its copy):

* replayed (:class:`LayerReplay`, the executor replays its steps): each block call is a
  :class:`~mmzoo.executor._replay.ReplayedStep` per block and call shape, traced once, whose
  inputs are the block's activations and per-step tensors and whose state is its layer's keys and
  values, donated and written in place; between blocks, nothing is traced again.
* cut (:func:`cut_at_blocks`, with a device mesh, where steps are traced on every call): a
  ``torch_xla.sync()`` before and after each block, so torch_xla runs what was traced so far as a
  graph of its own, found by its hash.
"""

from __future__ import annotations

import copy
from collections import deque

import torch


def blocks(model) -> list:
    """Every transformer block of ``model``, in module order."""
    from mmzoo.layers import TransformerBlock

    return [m for m in model.modules() if isinstance(m, TransformerBlock)]


def cut_at_blocks(model, sync) -> list:
    """Cut every traced step at each block's boundaries with ``sync`` (``torch_xla.sync``); returns the hooks' handles."""
    def cut(*_):
        sync()

    handles = []
    for block in blocks(model):
        handles += [block.register_forward_pre_hook(cut), block.register_forward_hook(cut)]
    return handles


class LayerReplay:
    """Each block of a model run as its own replayed graph (:class:`~mmzoo.executor._replay.ReplayedStep`),
    one per block and call shape, traced on the block's first call at that shape (warmup)."""

    def __init__(self, model):
        import torch_xla

        self._C, self._sync = torch_xla._XLAC, torch_xla.sync
        self.steps: dict = {}  # (block, call shape) -> ReplayedStep
        found = blocks(model)
        # the KV-cache tensors donated to the last two steps' blocks: dropping a donated tensor waits
        # for the graph that consumed it, so they are let go only once that graph is surely done
        self._retired: deque = deque(maxlen=2 * len(found) + 2)
        for block in found:
            block.forward = self._wrap(block, block.forward)

    def _wrap(self, block, forward):
        def run(x, *, rope=None, cache=None, attn_kwargs=None, rows=None):
            return self.call(block, forward, x, rope=rope, cache=cache, attn_kwargs=attn_kwargs, rows=rows)

        return run

    def call(self, block, forward, x, *, rope, cache, attn_kwargs, rows) -> torch.Tensor:
        layer = block.attn.layer_idx
        index = None
        if cache is not None:  # the cache's write index, built once per step out here (not by the first block)
            index = cache.index(block.attn.num_kv_heads)
        # the call's arguments by name: tensors are the graph's inputs, the rest (a window, None) part of its key
        kwargs = attn_kwargs or {}
        named = [("x", x), ("rows", rows), *((f"rope{i}", t) for i, t in enumerate(rope or ())),
                 *((f"index{i}", t) for i, t in enumerate(index or ())), *sorted(kwargs.items())]
        names = [n for n, v in named if isinstance(v, torch.Tensor)]
        tensors = [v for _, v in named if isinstance(v, torch.Tensor)]
        pending = self._C._check_tensor_need_materialization(tensors)
        if any(pending):  # what the step traced before this block (a view of it: a copy) runs now, as a graph
            tensors = [t.clone() if p else t for t, p in zip(tensors, pending)]
            self._sync()
        view_key = None if cache is None else (type(cache), getattr(cache, "kv_len", None), getattr(cache, "rows", None))
        key = (id(block), rope is None, attn_kwargs is None, view_key,
               tuple((n, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (n, v) for n, v in named))
        state = [] if cache is None else [cache.cache.k[layer], cache.cache.v[layer]]
        step = self.steps.get(key)
        if step is None:
            from mmzoo.executor._replay import ReplayedStep

            def traced(ins, held):
                given = dict(named, **dict(zip(names, ins)))
                rope_ = None if rope is None else tuple(given[f"rope{i}"] for i in range(len(rope)))
                index_ = None if index is None else tuple(given[f"index{i}"] for i in range(len(index)))
                kwargs_ = None if attn_kwargs is None else {k: given[k] for k in kwargs}
                x_, rows_ = given["x"], given["rows"]
                view = None
                block.attn.attn_fn.forget()  # the mask is built in this graph, not taken from another block's trace
                if cache is not None:  # the view, reading the given index, over the traced copies of this layer's k/v
                    view = copy.copy(cache)
                    view._index = index_
                    real = self._hold(cache, layer, held)
                try:
                    return [forward(x_, rope=rope_, cache=view, attn_kwargs=kwargs_, rows=rows_)]
                finally:
                    block.attn.attn_fn.forget()  # nor left for the next one (its tensors are dropped unrun)
                    if cache is not None:
                        self._hold(cache, layer, real)

            step = self.steps[key] = ReplayedStep(traced, tensors, state)
        (out,), new = step(tensors, state)
        if cache is not None:
            self._retired.append(state)
            self._hold(cache, layer, new)
        return out

    def graphs(self) -> set:
        """The distinct graphs the blocks have run as so far (their hashes): one per kind of block and
        call shape, however many blocks of each kind the model has."""
        return {str(step.graph_hash) for step in self.steps.values()}

    def calls(self) -> int:
        """(Block, call shape) pairs traced so far."""
        return len(self.steps)

    @staticmethod
    def _hold(view, layer: int, tensors: list) -> list:
        """Put ``tensors`` (keys, values) in ``view``'s cache at ``layer``; returns what was there."""
        kv = view.cache
        old = [kv.k[layer], kv.v[layer]]
        kv.k[layer], kv.v[layer] = tensors
        return old
