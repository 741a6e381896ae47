"""The eager executor: plain PyTorch on the CPU, no padding. The reference path."""

from __future__ import annotations

import torch

from mmzoo.executor.base import Executor


class EagerExecutor(Executor):
    """Runs the pipeline with plain torch on CPU at each request's exact shapes."""

    name = "eager"

    def device(self) -> torch.device:
        return torch.device("cpu")
