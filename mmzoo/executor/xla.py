"""The XLA executor: torch_xla on the PJRT device (TPU where present, the CPU client here).

Every step runs at a padded, bucketed shape so that XLA compiles a small, fixed set of graphs:
prompts are padded to a prefill bucket and encoder inputs to an encoder bucket (padding rows
carry their own attention segment, so they change nothing); decode always runs all slots.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from mmzoo.executor._buckets import doubling, pick
from mmzoo.executor._loop import Executor


def ensure_pjrt_device() -> str:
    """Default ``PJRT_DEVICE`` to CPU when no TPU runtime is installed; the environment wins."""
    if "PJRT_DEVICE" not in os.environ:
        os.environ["PJRT_DEVICE"] = "TPU" if importlib.util.find_spec("libtpu") else "CPU"
    return os.environ["PJRT_DEVICE"]


class XLAExecutor(Executor):
    """Bucketed execution on an XLA device.

    Args:
        max_model_len: KV-cache length per slot; the largest prefill bucket.
        max_batch: decode slots.
        prefill_buckets: padded prompt lengths; default doubling from ``min_prefill`` to ``max_model_len``.
        min_prefill: the smallest prefill bucket.
        encoder_buckets: tower name -> padded input row counts (for Qwen2-VL: patches per call).
        min_encoder_rows, max_encoder_rows: default encoder buckets double between these.
    """

    name = "xla"

    def __init__(self, *, max_model_len: int = 1024, max_batch: int = 4, prefill_buckets: list[int] | None = None,
                 min_prefill: int = 16, encoder_buckets: dict[str, list[int]] | None = None,
                 min_encoder_rows: int = 64, max_encoder_rows: int = 16384):
        super().__init__(max_model_len=max_model_len, max_batch=max_batch)
        self.prefill_buckets = sorted(prefill_buckets) if prefill_buckets else doubling(min(min_prefill, max_model_len), max_model_len)
        if self.prefill_buckets[-1] > max_model_len:
            raise ValueError(f"prefill bucket {self.prefill_buckets[-1]} exceeds max_model_len={max_model_len}")
        self.encoder_buckets = {k: sorted(v) for k, v in (encoder_buckets or {}).items()}
        self.default_encoder_buckets = doubling(min_encoder_rows, max_encoder_rows)
        ensure_pjrt_device()
        import torch_xla  # noqa: F401  (after PJRT_DEVICE is set)

        self._xla = torch_xla

    def device(self) -> torch.device:
        return self._xla.device()

    def prefill_len(self, n: int) -> int:
        return pick(self.prefill_buckets, n, "prompt length")

    def encoder_rows(self, tower: str, n: int) -> int:
        return pick(self.encoder_buckets.get(tower, self.default_encoder_buckets), n, f"{tower} encoder input rows")

    def step_done(self) -> None:
        self._xla.sync()

    @staticmethod
    def compiled_graphs() -> int:
        """Graphs XLA has compiled in this process so far."""
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def describe(self) -> str:
        return f"xla (PJRT_DEVICE={os.environ.get('PJRT_DEVICE')}, device {self.device()})"
