"""Token selection on device."""

from __future__ import annotations

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``[b, vocab]`` float logits -> ``[b]`` int64 argmax (lowest index wins ties, as in transformers)."""
    return logits.argmax(dim=-1)
