"""Llava's projector: two linear layers with an activation between, vision width -> LM width.

Liu et al., 2023, "Improved Baselines with Visual Instruction Tuning" (LLaVA-1.5,
arXiv:2310.03744) replaced LLaVA's single linear map with this MLP. It is the shared
:class:`mmzoo.layers.MLP` (``fc1 = linear_1``, ``fc2 = linear_2``), not a copy of it.
"""

from __future__ import annotations

from mmzoo.layers import MLP


def mlp_projector(*, in_dim: int, out_dim: int, act: str = "gelu", bias: bool = True) -> MLP:
    """``linear_2(act(linear_1(x)))``: ``[..., in_dim]`` -> ``[..., out_dim]`` (hidden width ``out_dim``)."""
    return MLP(dim=in_dim, hidden_dim=out_dim, out_dim=out_dim, act=act, bias=bias)
