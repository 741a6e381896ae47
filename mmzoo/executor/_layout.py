"""Weight layouts the XLA CPU backend runs fastest with.

``nn.Linear`` keeps its weight as ``[out, in]``. XLA's CPU dot emitter wants the matrix of a
``x @ W.T`` product as ``W.T`` in row-major order, so it materializes that transpose (a full copy
of every weight) inside each step's graph, which dominated a batch-1 decode step
(docs/benchmarks.md). Holding each linear weight as its transpose ``[in, out]`` (with ``weight`` a
transposed view of it) removes them.
The modules are unchanged; only the stored tensor is.

Projections that read the same input are also stacked into one matrix (attention's q/k/v, the
gated MLP's gate/up: :func:`fuse_projections`). A decode step multiplies one row by each weight,
and XLA's CPU backend reads one wide matrix faster than several narrow ones.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize

from mmzoo.layers import Attention, GatedMLP


class _StoredTransposed(nn.Module):
    """A parametrization: the parameter holds ``W.T``; ``module.weight`` is its transposed view."""

    def forward(self, stored):
        return stored.t()

    def right_inverse(self, weight):
        return weight.t().contiguous()


def hold_linears_transposed(model: nn.Module, *, recurse: bool = True) -> int:
    """Store every ``nn.Linear`` weight of ``model`` (``recurse=False``: ``model`` itself only) as
    ``[in, out]``; returns how many.

    A weight tied to an embedding (a tied LM head) gets its own transposed copy, so the embedding
    lookup and the head each read their best layout (the copy costs that weight's memory once).
    """
    n = 0
    for module in model.modules() if recurse else [model]:
        if isinstance(module, nn.Linear) and not parametrize.is_parametrized(module, "weight"):
            parametrize.register_parametrization(module, "weight", _StoredTransposed(), unsafe=True)
            n += 1
    return n


def fuse_projections(model: nn.Module) -> int:
    """Stack the q/k/v projections of every attention and gate/up of every gated MLP of ``model``
    into one linear each (:meth:`Attention.fuse_projections`); returns how many were fused."""
    fusable = [m for m in model.modules() if isinstance(m, (Attention, GatedMLP))]
    for m in fusable:
        m.fuse_projections()
    return len(fusable)
