"""Qwen2-VL's own tests (parity with transformers is tests/test_parity.py): requests of different
image counts batched together, and a per-module backend (Pallas in the ViT, SDPA in the LM), each
token-identical to transformers."""

from __future__ import annotations

import pytest

import mmzoo
import parity

PROMPTS = {0: "Tell me a story.", 1: "What shape is this?", 2: "Compare the two pictures."}
EXECUTORS = ["eager", "xla"]
# buckets sized for the tiny test images; graphs compile on first use here (warmup is tested elsewhere)
XLA_SMALL = {"buckets": {"max_encoder_rows": 256}, "progress": False, "warmup": False}


@pytest.fixture(scope="module")
def reference(qwen2_vl_ckpt, image_files):
    return parity.reference(qwen2_vl_ckpt, "Qwen2VLForConditionalGeneration", "image", image_files, [0, 1, 2], PROMPTS)


def test_batched_requests_match_one_at_a_time(qwen2_vl_ckpt, reference, image_files):
    """Several requests of different image counts share the decode batch and still match."""
    engine = mmzoo.load(qwen2_vl_ckpt, executor="xla", attention="sdpa", max_model_len=256, max_batch=2,
                        **XLA_SMALL)
    reqs = [{"prompt": PROMPTS[n], "images": image_files[:n], "max_new_tokens": 16, "ignore_eos": True}
            for n in (2, 0, 1, 2)]
    results = engine.generate(reqs)
    assert [r.token_ids for r in results] == [reference[n]["tokens"] for n in (2, 0, 1, 2)]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_per_module_attention_matches_transformers(qwen2_vl_ckpt, reference, image_files, executor):
    """``model.encoder.attention=pallas`` reaches the ViT alone: Pallas there, SDPA in the LM, and the
    tokens are still transformers'."""
    from mmzoo.engine import backends_of

    engine = mmzoo.load(qwen2_vl_ckpt, executor=executor, attention="sdpa", max_model_len=256,
                        overrides=["model.encoder.attention=pallas"], **(XLA_SMALL if executor == "xla" else {}))
    assert backends_of(engine.model.towers["vision"].encoder) == ["pallas"]
    assert backends_of(engine.model.lm) == ["sdpa"]
    assert engine.cfg.model.encoder.attention == "pallas"
    result = engine.generate(PROMPTS[2], images=image_files[:2], max_new_tokens=16, ignore_eos=True)
    assert result.token_ids == reference[2]["tokens"]
