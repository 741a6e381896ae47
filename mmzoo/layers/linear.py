"""Linear-layer helpers shared by the blocks."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def stack_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` computing ``parts`` side by side: their weights (and biases) stacked along
    the output axis in order, on the same device and dtype. The parts must share an input width."""
    w = parts[0].weight
    if any(p.in_features != parts[0].in_features or (p.bias is None) != (parts[0].bias is None) for p in parts):
        raise ValueError("stack_linears: the parts differ in input width or in having a bias")
    fused = nn.Linear(w.shape[1], sum(p.out_features for p in parts), bias=parts[0].bias is not None,
                      device="meta")  # no init: the stacked values are assigned
    fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=w.requires_grad)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=w.requires_grad)
    return fused
