"""The eager executor: plain PyTorch on the CPU, no padding. The reference path."""

from __future__ import annotations

import threading

import torch

from mmzoo.executor.base import Executor


class EagerExecutor(Executor):
    """Runs the pipeline with plain torch on CPU at each request's exact shapes
    (:meth:`~mmzoo.executor.buckets.Buckets.exact_sizes`).

    Args:
        fuse_projections: stack attention's q/k/v and the gated MLP's gate/up projections into one
            linear each as the weights are placed (:func:`mmzoo.executor._layout.fuse_projections`).
            Off by default: torch's CPU matrix products gain nothing from it (Qwen2-VL-2B bf16,
            batch-1 decode: 4.75 tok/s fused, 4.91 separate).
        pack_weights: hold the LM decoder layers' linear weights in oneDNN's blocked layout,
            reordered once (:class:`mmzoo.executor._layout.PackedLinear`) instead of inside every
            product: on a background thread started when the weights are placed, overlapping the
            first request's preparation and media encoding (a layer that runs first packs its own;
            :meth:`wait_ready` waits for all). Qwen2-VL-2B bf16, the image request right after the
            load: 6.3 s with packing in the background against 7.6 s packing first. ``auto``: in
            bfloat16, where a 1536 x 8960 product of 1 or 8 rows took 0.60 ms packed against 1.0 ms
            on an Intel CPU with AMX (1.20 / 1.23 against 1.36 / 1.57 ms on an AMD EPYC). Float32 is
            on only by choice: there it depends on the CPU (one row: 1.67 against 1.06 ms on the Intel
            CPU, 2.36 against 3.62 ms on the AMD one; eight rows: 1.19 against 3.0, 2.02 against 6.32).
        max_model_len, max_batch, max_prefill_tokens, progress: as :class:`Executor`.

    Checkpoint tensors already in the run dtype that no layout changes are used in place, as views
    of their file's mapping (:meth:`maps_files`), as transformers' loader does.
    """

    name = "eager"

    def __init__(self, *, fuse_projections: bool = False, pack_weights: bool | str = "auto", **kwargs):
        super().__init__(**kwargs)
        if fuse_projections not in (True, False):
            raise ValueError(f"fuse_projections={fuse_projections!r}: choose true or false")
        if pack_weights not in ("auto", True, False):
            raise ValueError(f"pack_weights={pack_weights!r}: choose auto, true or false")
        self.fuse_projections, self.pack_weights = fuse_projections, pack_weights
        self._packer: threading.Thread | None = None

    def setup(self, model, **kwargs) -> None:
        from mmzoo.executor import _layout

        super().setup(model, **kwargs)
        pending = [m for m in self.model.modules() if isinstance(m, _layout.PackedLinear) and m.packed is None]
        if pending:
            # not a daemon: a process that ends before the packing does waits for it (a daemon thread
            # stopped inside oneDNN at interpreter exit could outlive what it uses)
            self._packer = threading.Thread(target=_layout.pack_pending, args=(pending,), name="mmzoo-pack")
            self._packer.start()

    def wait_ready(self) -> None:
        if self._packer is not None:
            self._packer.join()
            self._packer = None

    def device(self) -> torch.device:
        return torch.device("cpu")

    def _packing(self) -> bool:
        from mmzoo.executor import _layout

        if self.pack_weights == "auto":
            return self.dtype == torch.bfloat16 and _layout.can_pack()
        if self.pack_weights and not _layout.can_pack():
            raise ValueError("pack_weights=true needs a torch build with oneDNN (torch.backends.mkldnn)")
        return bool(self.pack_weights)

    def _packs(self, name: str) -> bool:
        """Whether unit ``name``'s linears are packed: the LM's decoder layers (the decode steps' products;
        the towers' and the embedding's weights stay views of the checkpoint, read only when used)."""
        return self._packing() and name.startswith("lm.layers.")

    def maps_files(self, name: str) -> bool:
        return not self.fuse_projections and not self._packs(name)

    def describe(self) -> str:
        return f"eager (pack_weights={self.pack_weights})" if self.pack_weights != "auto" else "eager"

    def layout(self, name: str, unit, whole: bool, mapped: bool = False):
        from mmzoo.executor import _layout

        if whole and self.fuse_projections:
            _layout.fuse_projections(unit)
        if self._packs(name):
            # a weight still a view of its file is packed in the background (reading it is most of the
            # cost); one read already (cast from the checkpoint's dtype, or fused) now, not held twice meanwhile
            fused = whole and self.fuse_projections
            return _layout.pack_linears(unit, self.max_batch, recurse=whole, defer=mapped and not fused)
        return None
