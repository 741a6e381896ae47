"""Reading Hugging Face checkpoints: config.json, weights (safetensors only, never pickle), strict loading.

``read_config`` (from :mod:`mmzoo.config`) gives the transformers config; :func:`read_safetensors`
the tensors; :func:`load_strict` copies them into a module, naming every missing, unexpected or
mis-shaped tensor; :func:`load_component` loads a family checkpoint's weights into one component
(encoder, adapter or LM) built on its own, for research code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from mmzoo.config import read_config
from mmzoo.errors import MmzooError

__all__ = ["read_config", "read_safetensors", "load_strict", "load_component"]


def read_safetensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``.

    The shards are read with safetensors itself; transformers' sharded loader loads into a
    transformers model, and the names here are mapped by the family before strict loading. A
    truncated or corrupt file, or a malformed index, is an :class:`MmzooError` naming the file."""
    root = Path(checkpoint)
    index, single = root / "model.safetensors.index.json", root / "model.safetensors"
    if index.is_file():
        files = _shards(index)
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
            raise MmzooError(f"checkpoint shard {path} listed in {index.name} does not exist")
        tensors.update(_read_file(path))
    return tensors


def _shards(index: Path) -> list[str]:
    """The shard file names an index's ``weight_map`` lists (tensor name -> file name in the
    checkpoint directory), refusing a malformed index and any file outside the directory."""
    try:
        raw = json.loads(index.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise MmzooError(f"{index} is not valid JSON ({e})") from None
    if not isinstance(raw, dict) or "weight_map" not in raw:
        raise MmzooError(f"{index} has no weight_map (tensor name -> shard file name)")
    weight_map = raw["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise MmzooError(f"{index}: weight_map must map each tensor name to a shard file name, "
                         f"got {json.dumps(weight_map)[:80]}")
    for key, name in weight_map.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise MmzooError(f"{index}: tensor {key} is in {name!r}, outside the checkpoint directory")
    return sorted(set(weight_map.values()))


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; a truncated or corrupt one is an error naming it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as e:
        raise MmzooError(f"checkpoint file {path} is not a readable safetensors file ({e}): it may be "
                         f"truncated or corrupt") from None


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


def load_component(module: nn.Module, checkpoint: str | Path, part: str, *, model: str | None = None,
                   config_dir=None) -> nn.Module:
    """Load ``part`` (``"encoder"``, ``"adapter"`` or ``"lm"``) of a family checkpoint into ``module``,
    a component built on its own (``instantiate(cfg.model.encoder)``, ``mmzoo.encoders.clip_vit(...)``):
    the family maps the checkpoint's names (``model`` = its conf option; None: from config.json's
    architectures), and the component's prefix (``towers.vision.encoder.``, ``lm.``) is stripped.
    Strict: every tensor of ``module`` must be in the checkpoint with its shape. Returns ``module``."""
    from mmzoo.config import compose
    from mmzoo.engine import instantiate_part

    if part not in ("encoder", "adapter", "lm"):
        raise MmzooError(f"part={part!r}: choose encoder, adapter or lm")
    overrides = [f"model={model}"] if model else []
    cfg = compose(overrides, config_dir=config_dir, values={"checkpoint": str(checkpoint)})
    family = instantiate_part(cfg.model.family, "model.family")
    prefix = "lm." if part == "lm" else f"towers.{family.tower}.{part}."
    state = {k[len(prefix):]: v for k, v in family.convert_weights(read_safetensors(checkpoint)).items()
             if k.startswith(prefix)}
    if part == "lm" and getattr(module, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    load_strict(module, state, source=f"{checkpoint} ({prefix}*)")
    return module
