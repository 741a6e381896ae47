"""Checkpoint loading: sharded files, both key namings, strict errors, rotary pieces."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import mmzoo
from mmzoo.errors import MmzooError
from mmzoo.fixtures import make_tiny_qwen2_vl


def _logits(ckpt) -> np.ndarray:
    engine = mmzoo.load(ckpt, executor="eager", attention="eager", max_model_len=64)
    return engine.executor.prompt_logits(engine.prepare(mmzoo.Request(prompt="hello there")))


def test_sharded_checkpoint_matches_single_file(qwen2_vl_ckpt, tmp_path):
    sharded = make_tiny_qwen2_vl(tmp_path / "sharded", seed=0, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    np.testing.assert_array_equal(_logits(sharded), _logits(qwen2_vl_ckpt))


def test_v5_key_names_load_too(qwen2_vl_ckpt, tmp_path):
    """transformers 5 module names (model.language_model.*, model.visual.*) map like the hub's."""
    ckpt = tmp_path / "v5"
    shutil.copytree(qwen2_vl_ckpt, ckpt)
    sd = load_file(ckpt / "model.safetensors")
    renamed = {}
    for k, v in sd.items():
        if k.startswith("visual."):
            k = "model." + k
        elif k.startswith("model.") and not k.startswith("model.visual."):
            k = "model.language_model." + k[len("model."):]
        renamed[k] = v
    assert set(renamed) != set(sd)
    save_file(renamed, ckpt / "model.safetensors")
    np.testing.assert_array_equal(_logits(ckpt), _logits(qwen2_vl_ckpt))


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_strict_loading_names_the_tensors(qwen2_vl_ckpt, tmp_path, change):
    ckpt = tmp_path / change
    shutil.copytree(qwen2_vl_ckpt, ckpt)
    sd = load_file(ckpt / "model.safetensors")
    victim = next(k for k in sd if k.endswith("layers.1.mlp.up_proj.weight"))
    if change == "missing":
        del sd[victim]
    elif change == "unexpected":
        sd["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    else:
        sd[victim] = torch.zeros(3, 3)
    save_file(sd, ckpt / "model.safetensors")
    with pytest.raises(MmzooError) as e:
        mmzoo.load(ckpt, executor="eager")
    assert change in str(e.value) or "mismatch" in str(e.value)
    assert ("extra" if change == "unexpected" else "up_proj") in str(e.value)


def test_pickle_only_checkpoint_is_refused(qwen2_vl_ckpt, tmp_path):
    ckpt = tmp_path / "pickled"
    shutil.copytree(qwen2_vl_ckpt, ckpt)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(MmzooError, match="pickle"):
        mmzoo.load(ckpt, executor="eager")
