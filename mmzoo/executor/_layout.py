"""Weight layouts the XLA CPU backend runs fastest with.

``nn.Linear`` keeps its weight as ``[out, in]``. XLA's CPU dot emitter wants the matrix of a
``x @ W.T`` product as ``W.T`` in row-major order, so it materializes that transpose (a full copy
of every weight) inside each step's graph, which dominated a batch-1 decode step. Holding each linear weight as its transpose ``[in, out]`` (with ``weight`` a
transposed view of it) removes them.
The modules are unchanged; only the stored tensor is.

Projections that read the same input are also stacked into one matrix (attention's q/k/v, the
gated MLP's gate/up: :func:`fuse_projections`). A decode step multiplies one row by each weight,
and XLA's CPU backend reads one wide matrix faster than several narrow ones.
"""

from __future__ import annotations

import threading

import torch
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


_PACKING = threading.Lock()  # one reorder at a time: a linear's first forward and the background packer


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is held in oneDNN's blocked layout, reordered once when it is
    placed instead of on every product (what torch.compile's CPU freezing does with
    ``mkldnn._linear_pointwise``). The same products: for a bfloat16 weight the decode steps' one to
    eight rows give identical outputs, and a prefill's many rows agree to bfloat16's rounding.

    Args:
        linear: the placed ``nn.Linear`` (its weight is read once; its bias is kept).
        rows: the row count the layout is tuned for (the executor's ``max_batch``).
        defer: keep the weight as it is (a checkpoint's is a view of its file) and reorder it at
            :meth:`pack`: the executor packs every deferred linear on a background thread while the
            first request is prepared and its media encoded, and a forward that comes first packs its
            own linear.
    """

    def __init__(self, linear: nn.Linear, rows: int, *, defer: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rows = linear.in_features, linear.out_features, rows
        self.register_buffer("packed", None, persistent=False)
        self.bias = linear.bias
        self._weight = linear.weight.detach()  # until packed
        if not defer:
            self.pack()

    def pack(self) -> torch.Tensor:
        """The packed weight, reordered now if it is not yet (the source weight is then let go)."""
        packed = self.packed
        if packed is None:
            with _PACKING:
                if self.packed is None:
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(self._weight, self.rows)
                    self._weight = None
                packed = self.packed
        return packed

    def forward(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.pack(), self.bias, "none", [], "")


def pack_pending(modules: list[PackedLinear]) -> None:
    """Pack each deferred linear in turn (the eager executor's background thread). A failure stops it
    quietly: the linear's own forward packs it again and raises there, in the request that needs it."""
    for m in modules:
        try:
            m.pack()
        except Exception:  # noqa: BLE001 - raised again where a request meets it
            return


def can_pack() -> bool:
    """Whether this torch build has oneDNN's packed linear (x86 and Arm CPU builds)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_linears(module: nn.Module, rows: int, *, recurse: bool = True, defer: bool = False) -> nn.Module:
    """Replace every ``nn.Linear`` under ``module`` by a :class:`PackedLinear` (``recurse=False``:
    ``module`` itself only; ``defer``: packed later, see :class:`PackedLinear`); returns ``module``, or
    its replacement when it is a linear itself."""
    if isinstance(module, nn.Linear):
        return PackedLinear(module, rows, defer=defer)
    if recurse:
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, PackedLinear(child, rows, defer=defer))
    return module
