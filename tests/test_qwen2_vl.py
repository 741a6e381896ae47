"""Numerical parity with transformers' own Qwen2-VL on a tiny random checkpoint.

Prefill logits allclose (fp32, atol 1e-4) and greedy token ids identical for 16 new tokens, with
0, 1 and 2 images of different sizes, on both executors and every attention backend.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

import mmzoo
from mmzoo.models._media import load_images

PROMPTS = {0: "Tell me a story.", 1: "What shape is this?", 2: "Compare the two pictures."}
EXECUTORS = ["eager", "xla"]
BACKENDS = ["sdpa", "eager", "pallas"]
# buckets sized for the tiny test images; graphs compile on first use here (warmup is tested elsewhere)
XLA_SMALL = {"max_encoder_rows": 256, "progress": False, "warmup": False}


@pytest.fixture(scope="module")
def reference(qwen2_vl_ckpt, image_files):
    """transformers' prompt ids, prefill logits and 16 greedy tokens (EOS disabled) per image count."""
    processor = AutoProcessor.from_pretrained(qwen2_vl_ckpt)
    model = Qwen2VLForConditionalGeneration.from_pretrained(qwen2_vl_ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = {}
    for n, prompt in PROMPTS.items():
        images = load_images(image_files[:n])
        content = [{"type": "image"}] * n + [{"type": "text", "text": prompt}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        with torch.no_grad():
            logits = model(**inputs).logits[0].float().numpy()
            gen = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=0)
        ids = inputs["input_ids"][0].tolist()
        out[n] = {"ids": ids, "logits": logits, "tokens": gen[0, len(ids):].tolist()}
    return out


@pytest.fixture(scope="module", params=[(e, b) for e in EXECUTORS for b in BACKENDS], ids=lambda p: f"{p[0]}-{p[1]}")
def engine(request, qwen2_vl_ckpt):
    executor, attention = request.param
    return mmzoo.load(qwen2_vl_ckpt, executor=executor, attention=attention, max_model_len=256,
                      **(XLA_SMALL if executor == "xla" else {}))


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_prefill_logits_match_transformers(engine, reference, image_files, n_images):
    ref = reference[n_images]
    req = mmzoo.Request(prompt=PROMPTS[n_images], images=image_files[:n_images])
    prepared = engine.prepare(req)
    assert prepared.input_ids.tolist() == ref["ids"]
    logits = engine.executor.prompt_logits(prepared)
    np.testing.assert_allclose(logits, ref["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_greedy_tokens_match_transformers(engine, reference, image_files, n_images):
    ref = reference[n_images]
    result = engine.generate(PROMPTS[n_images], images=image_files[:n_images], max_new_tokens=16, ignore_eos=True)
    assert result.prompt_token_ids == ref["ids"]
    assert result.token_ids == ref["tokens"]
    assert result.finish_reason == "length"


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
