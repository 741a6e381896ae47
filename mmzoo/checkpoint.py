"""Reading Hugging Face checkpoints: config.json, weights (safetensors only, never pickle), strict loading.

``read_config`` (from :mod:`mmzoo.config`) gives the transformers config; :func:`read_processor`
the tokenizer and processor; :func:`read_safetensors` the tensors; :func:`load_strict` copies them
into a module, naming every missing, unexpected, mis-shaped or mis-typed tensor;
:func:`load_component` loads a family checkpoint's weights into one component (encoder, adapter
or LM) built on its own, for research code. Each refuses a bad file with one :class:`MmzooError`
naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mmzoo._weights import check_names, checkpoint_tensors, floating_names, load, parameter_shapes, tied_aliases
from mmzoo.config import instantiate_part, read_config, read_json_object
from mmzoo.errors import MmzooError

__all__ = ["read_config", "read_processor", "read_safetensors", "load_strict", "load_component"]

# the files a tokenizer is read from (one is needed): a fast tokenizer, a BPE vocabulary, a sentencepiece model
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
# JSON files transformers' processor classes read, when present
PROCESSOR_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                  "chat_template.json")


def read_processor(checkpoint: str | Path):
    """The checkpoint's processor (tokenizer, image / audio processor, chat template) with
    transformers' ``AutoProcessor``; a missing tokenizer, a file that is not JSON, or anything
    transformers cannot load is an :class:`MmzooError` naming the file."""
    from transformers import AutoProcessor

    root = Path(checkpoint)
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise MmzooError(f"checkpoint {root} has no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    try:
        return AutoProcessor.from_pretrained(str(root), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises anything on a bad file
        for name in PROCESSOR_JSON:  # which file, when one is not a JSON object
            if (root / name).is_file():
                try:
                    read_json_object(root / name)
                except MmzooError as bad:
                    raise bad from None
        if not any((root / n).is_file() for n in ("processor_config.json", "preprocessor_config.json")):
            raise MmzooError(f"checkpoint {root} has no processor_config.json or preprocessor_config.json (the image "
                             f"or audio processor's settings): transformers cannot load its processor") from None
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise MmzooError(f"checkpoint {root}: transformers cannot load its processor "
                         f"({type(e).__name__}: {lines[0][:200] if lines else ''})") from None


def read_safetensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``,
    read now (:func:`mmzoo._weights.checkpoint_tensors` gives them lazily). A truncated or corrupt
    file, or a malformed index, is an :class:`MmzooError` naming the file."""
    return {key: t.load() for key, t in checkpoint_tensors(checkpoint).items()}


def load_strict(module: nn.Module, state_dict: dict, *, source: str) -> None:
    """Copy ``state_dict`` (tensors or :class:`~mmzoo._weights.LazyTensor`) into ``module``; any
    missing, unexpected or mis-shaped tensor is an error (a tied alias may be absent)."""
    check_names(parameter_shapes(module), state_dict, source=source, optional=set(tied_aliases(module)),
                floating=floating_names(module))
    module.load_state_dict({k: load(v) for k, v in state_dict.items()}, strict=False, assign=False)


def load_component(module: nn.Module, checkpoint: str | Path, part: str, *, model: str | None = None,
                   config_dir=None) -> nn.Module:
    """Load ``part`` (``"encoder"``, ``"adapter"`` or ``"lm"``) of a family checkpoint into ``module``,
    a component built on its own (``instantiate(cfg.model.encoder)``, ``mmzoo.encoders.clip_vit(...)``):
    the family maps the checkpoint's names (``model`` = its conf option; None: from config.json's
    architectures), and the component's prefix (``towers.vision.encoder.``, ``lm.``) is stripped.
    Strict: every tensor of ``module`` must be in the checkpoint with its shape. Returns ``module``."""
    from mmzoo.config import compose

    if part not in ("encoder", "adapter", "lm"):
        raise MmzooError(f"part={part!r}: choose encoder, adapter or lm")
    overrides = [f"model={model}"] if model else []
    cfg = compose(overrides, config_dir=config_dir, values={"checkpoint": str(checkpoint)})
    family = instantiate_part(cfg.model.family, "model.family")
    prefix = "lm." if part == "lm" else f"towers.{family.tower}.{part}."
    state = {k[len(prefix):]: v for k, v in family.convert_weights(checkpoint_tensors(checkpoint)).items()
             if k.startswith(prefix)}
    if part == "lm" and getattr(module, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    load_strict(module, state, source=f"{checkpoint} ({prefix}*)")
    return module
