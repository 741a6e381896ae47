"""Feed-forward blocks: the two-layer MLP of ViTs and the gated (SwiGLU) MLP of LLM decoders."""

from __future__ import annotations

import torch
from torch import nn

from mmzoo.layers.linear import stack_linears


def activation(name: str):
    """The activation a Hugging Face config names (``hidden_act``: ``quick_gelu``, ``gelu``, ``silu``,
    ``gelu_pytorch_tanh``, ...), as transformers computes it (its ``ACT2FN``), so parity holds."""
    from transformers.activations import ACT2FN

    try:
        return ACT2FN[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(ACT2FN)}") from None


class MLP(nn.Module):
    """``fc2(act(fc1(x)))``."""

    def __init__(self, *, dim: int, hidden_dim: int, act: str, bias: bool = True, out_dim: int | None = None):
        super().__init__()
        self.act = activation(act)
        self.fc1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.fc2 = nn.Linear(hidden_dim, out_dim or dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (SwiGLU when ``act="silu"``).

    :meth:`fuse_projections` can stack gate and up into one ``gate_up_proj`` after loading."""

    def __init__(self, *, dim: int, hidden_dim: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.act = activation(act)
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.gate_up_proj = None  # set by fuse_projections()

    def fuse_projections(self) -> None:
        """Replace ``gate_proj / up_proj`` by one ``gate_up_proj`` (weights stacked, gate first):
        one matrix product instead of two, the same dot products (see
        :meth:`mmzoo.layers.Attention.fuse_projections`)."""
        if self.gate_up_proj is not None:
            return
        fused = stack_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj
        self.gate_up_proj = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)
