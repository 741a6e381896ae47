"""torch.nn.functional.scaled_dot_product_attention as an mmzoo backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmzoo.backends._base import AttentionBackend, checked_full_kv, visibility_mask


class SDPAAttention(AttentionBackend):
    """PyTorch's fused SDPA with an explicit boolean mask (kv heads repeated for GQA)."""

    name = "sdpa"

    def __call__(self, q, k, v, *, scale, causal=False, q_segment_ids=None, kv_segment_ids=None,
                 q_positions=None, kv_lengths=None):
        k, v = checked_full_kv(q, k, v)
        b, _, sq, _ = q.shape
        skv = k.shape[2]
        only_causal = causal and sq == skv and q_positions is None and q_segment_ids is None \
            and kv_segment_ids is None and kv_lengths is None
        mask = None if only_causal else visibility_mask(
            b, sq, skv, q.device, causal=causal, q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids, q_positions=q_positions, kv_lengths=kv_lengths)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=only_causal, scale=scale)
        if mask is not None:
            # SDPA gives NaN for a row with no visible key; the contract says zeros.
            out = torch.where(mask.any(dim=-1, keepdim=True), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out
