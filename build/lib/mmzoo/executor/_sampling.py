"""Token selection on device: greedy, or temperature / top-k / top-p sampling.

Randomness comes from the host, one uniform number per sequence per step drawn from that
request's own seeded generator, so a seeded request gives the same tokens whatever else shares
its batch. On device the number picks a token by inverse CDF over the filtered distribution.
"""

from __future__ import annotations

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``[b, vocab]`` float logits -> ``[b]`` int64 argmax (lowest index wins ties, as in transformers)."""
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           uniform: torch.Tensor) -> torch.Tensor:
    """Sample one token per row; rows with ``temperature == 0`` take the argmax.

    Args:
        logits: ``[b, vocab]`` float32.
        temperature: ``[b]`` float32; 0 means greedy.
        top_k: ``[b]`` int64; keep the k most likely tokens (0: all).
        top_p: ``[b]`` float32; keep the smallest set whose probability reaches p (1: all).
        uniform: ``[b]`` float32 in [0, 1).

    Returns:
        ``[b]`` int64 token ids.
    """
    vocab = logits.shape[-1]
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / safe_t.unsqueeze(-1), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [b, vocab]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # probability mass ranked above each token
    keep = (rank < k) & ((before < top_p.unsqueeze(-1)) | (rank == 0))
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    cdf = kept.cumsum(dim=-1)
    target = uniform.unsqueeze(-1) * cdf[:, -1:]
    pick = (cdf <= target).sum(dim=-1).clamp(max=vocab - 1)  # first rank whose cdf exceeds target
    pick = torch.minimum(pick, keep.sum(dim=-1) - 1)
    sampled = order.gather(-1, pick.unsqueeze(-1)).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy(logits))
