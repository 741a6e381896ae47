"""Eager attention: explicit matmul, mask and softmax. The readable reference backend."""

from __future__ import annotations

import torch

from mmzoo.backends._base import AttentionBackend, check_inputs, fold_gqa


class EagerAttention(AttentionBackend):
    """``softmax(q k^T * scale + mask) v`` written out, in float32 for the softmax."""

    name = "eager"
    matmul_keys = True

    def __call__(self, q, k, v, *, scale, causal=False, q_segment_ids=None, kv_segment_ids=None,
                 q_positions=None, kv_lengths=None, sliding_window=None, q_blocks=None, kv_blocks=None):
        check_inputs(q, k, v)
        mask = self.folded_mask(q, k, causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                q_positions=q_positions, kv_lengths=kv_lengths, sliding_window=sliding_window,
                                q_blocks=q_blocks, kv_blocks=kv_blocks)
        q, unfold = fold_gqa(q, k)  # GQA: query heads of a kv head as its extra rows
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [b, hkv, groups * sq, skv]
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [b, hkv, groups * sq, d]
        if mask is not None:  # rows that see nothing -> 0, by selection: their out averages unseen values
            out = torch.where(mask.any(dim=-1, keepdim=True), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return unfold(out)
