"""Reading Hugging Face checkpoint weights (safetensors only, never pickle) and strict loading."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mmzoo.errors import MmzooError


def read_safetensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``."""
    root = Path(checkpoint)
    index, single = root / "model.safetensors.index.json", root / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        files = [single.name]
    else:
        pickles = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
        hint = f" (found {', '.join(pickles)}: pickle weights are not loaded; convert them to safetensors)" if pickles else ""
        raise MmzooError(f"checkpoint {root} has no model.safetensors or model.safetensors.index.json{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = root / name
        if not path.is_file():
            raise MmzooError(f"checkpoint shard {path} listed in model.safetensors.index.json does not exist")
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def load_strict(module: nn.Module, state_dict: dict[str, torch.Tensor], *, source: str) -> None:
    """Copy ``state_dict`` into ``module``; any missing, unexpected or mis-shaped tensor is an error."""
    expected = module.state_dict()
    tied = {name for name, p in module.named_parameters(remove_duplicate=False)} - {
        name for name, _ in module.named_parameters()}  # aliases of shared weights (tied LM head)
    missing = sorted(set(expected) - set(state_dict) - tied)
    unexpected = sorted(set(state_dict) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors: {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensors: {', '.join(unexpected[:20])}{' ...' if len(unexpected) > 20 else ''}")
    shapes = [f"{k} {tuple(state_dict[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in state_dict and state_dict[k].shape != v.shape]
    if shapes:
        problems.append(f"shape mismatch (checkpoint vs model): {'; '.join(shapes[:10])}")
    if problems:
        raise MmzooError(f"weights in {source} do not match the model: " + "; ".join(problems))
    module.load_state_dict({k: v for k, v in state_dict.items()}, strict=False, assign=False)
