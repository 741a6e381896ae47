"""torch.nn.functional.scaled_dot_product_attention as an mmzoo backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmzoo.backends._base import AttentionBackend, check_inputs, fold_gqa


class SDPAAttention(AttentionBackend):
    """PyTorch's fused SDPA with an explicit boolean mask; GQA folds the query heads of each kv
    head into its query rows (:func:`fold_gqa`), so the kv heads are never repeated."""

    name = "sdpa"
    matmul_keys = True

    def __call__(self, q, k, v, *, scale, causal=False, q_segment_ids=None, kv_segment_ids=None,
                 q_positions=None, kv_lengths=None, sliding_window=None, q_blocks=None, kv_blocks=None):
        check_inputs(q, k, v)
        if q.device.type == "xla":
            # torch_xla lowers SDPA to its math form, which scales q and k by sqrt(scale) each: a
            # multiply over every key (the whole KV cache, in decode) per call. Scaling the few
            # queries instead leaves the keys as they are.
            q, scale = q * scale, 1.0
        sq, skv = q.shape[2], k.shape[2]
        if causal and sq == skv and q_positions is None and q_segment_ids is None \
                and kv_segment_ids is None and kv_lengths is None and sliding_window is None \
                and q_blocks is None and kv_blocks is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        mask = self.folded_mask(q, k, causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                q_positions=q_positions, kv_lengths=kv_lengths, sliding_window=sliding_window,
                                q_blocks=q_blocks, kv_blocks=kv_blocks)
        q, unfold = fold_gqa(q, k)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        if mask is not None:
            # SDPA gives NaN for a row with no visible key; the contract says zeros.
            out = torch.where(mask.any(dim=-1, keepdim=True), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return unfold(out)
