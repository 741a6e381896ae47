"""Sliding-window layers (transformers' ``layer_types`` with ``sliding_window``): a Qwen2 LM whose
second layer attends over the last few tokens only, token-identical to transformers' own class on
both executors and every backend, with prompts (and images) longer than the window. The backends'
rule itself is in test_backends.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import mmzoo
import parity

WINDOW = 6
PROMPT = "Describe the picture in a few words."
XLA = {"progress": False, "warmup": False, "max_batch": 2, "buckets": {"encoder": {"vision": [64, 128]}}}


@pytest.fixture(scope="module")
def sliding_ckpt(qwen2_vl_ckpt, tmp_path_factory):
    """The tiny Qwen2-VL checkpoint with ``use_sliding_window``: layer 1 (from ``max_window_layers``
    on) slides over the last :data:`WINDOW` tokens; transformers derives ``layer_types``."""
    path = tmp_path_factory.mktemp("sliding") / "ckpt"
    shutil.copytree(qwen2_vl_ckpt, path)
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    text.pop("layer_types", None)
    text.update(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_sliding_layers_match_transformers(sliding_ckpt, qwen2_vl_ckpt, image_files):
    """An image prompt of more than 4 windows: the prompt's logits and 12 greedy tokens equal
    transformers' (whose logits the window changes), on both executors, the torch backends and
    Pallas' kernels (prefill and decode)."""
    hf = "Qwen2VLForConditionalGeneration"
    ref = parity.reference(sliding_ckpt, hf, "image", image_files, [1], PROMPT, new_tokens=12)[1]
    full = parity.reference(qwen2_vl_ckpt, hf, "image", image_files, [1], PROMPT, new_tokens=12)[1]
    assert len(ref["ids"]) > 4 * WINDOW and not np.allclose(ref["logits"], full["logits"], atol=1e-3)
    for executor, attention in [("eager", "sdpa"), ("eager", "eager"), ("xla", "sdpa"), ("xla", "pallas")]:
        engine = parity.engine(sliding_ckpt, executor, attention, **XLA)
        assert [layer.attn.sliding_window for layer in engine.model.lm.layers] == [None, WINDOW]
        r = engine.generate(PROMPT, images=image_files[:1], max_new_tokens=12, ignore_eos=True)
        assert r.prompt_token_ids == ref["ids"], (executor, attention)
        assert r.token_ids == ref["tokens"], (executor, attention)
        if executor == "eager":
            logits = engine.executor.prompt_logits(engine.prepare(mmzoo.Request(prompt=PROMPT, images=image_files[:1])))
            np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)
