"""Llava's own tests (parity with transformers is tests/test_parity.py): a list of feature layers
and the full strategy, its buckets, embeddings mode, bad input, the CLI, a Qwen2 text model, and a
bare composition on the XLA executor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import mmzoo
import parity
from mmzoo.fixtures import make_tiny_llava
from mmzoo.models import Llava
from parity import EXECUTORS, GEN, XLA

PROMPT = "What shape is this?"


def hf_reference(ckpt, images, counts, prompt=PROMPT, new_tokens=16):
    return parity.reference(ckpt, "LlavaForConditionalGeneration", "image", images, counts, prompt, new_tokens)


@pytest.fixture(scope="module")
def eager(llava_ckpt):
    return parity.engine(llava_ckpt, "eager")


def test_feature_layer_list_and_full_strategy(tmp_path, image_files):
    """Two concatenated hidden layers (one negative, one positive) and the class token kept."""
    ckpt = make_tiny_llava(tmp_path / "llava_full", seed=1, vision_feature_layer=[-3, 2],
                           vision_feature_select_strategy="full", image_size=28)
    ref = hf_reference(ckpt, image_files, [2], new_tokens=4)[2]
    engine = mmzoo.load(ckpt, executor="eager")
    assert len(engine.model.towers["vision"].encoder.blocks) == 2  # the third block feeds nothing
    prepared = engine.prepare(mmzoo.Request(prompt=PROMPT, images=image_files[:2]))
    assert prepared.input_ids.tolist() == ref["ids"]
    np.testing.assert_allclose(engine.executor.prompt_logits(prepared), ref["logits"], atol=1e-4, rtol=0)


def test_family_sizes_its_xla_buckets(llava_ckpt, eager):
    family = eager.family
    assert isinstance(family, Llava) and family.tokens_per_image == 16
    assert family.encoder_buckets(max_model_len=256, max_media_rows=320) == [1, 2, 4, 8, 16]
    assert family.encoder_buckets(max_model_len=1024, max_media_rows=80) == [1, 2, 4, 5]
    engine = mmzoo.load(llava_ckpt, executor="xla", max_model_len=64, progress=False, warmup=False,
                        buckets={"encoder": {"vision": [2]}})
    assert engine.executor.buckets.tower("vision") == (2,)  # the executor's config wins


@pytest.mark.parametrize("executor", EXECUTORS)
def test_image_embeds_match_raw_images(eager, llava_ckpt, image_files, executor):
    engine = parity.engine(llava_ckpt, executor, **XLA)
    emb = eager.encode(images=image_files[:3])["image_embeds"]
    assert list(emb.shape) == [3 * 16, 64]
    raw = engine.generate(mmzoo.Request(prompt=PROMPT, images=image_files[:3], **GEN))
    via = engine.generate(mmzoo.Request(prompt=PROMPT, image_embeds=emb, **GEN))
    assert via.token_ids == raw.token_ids and via.prompt_token_ids == raw.prompt_token_ids
    per_image = engine.generate(mmzoo.Request(prompt=PROMPT, image_embeds=list(torch.split(emb, 16)), **GEN))
    assert per_image.token_ids == raw.token_ids
    # token ids with one placeholder per image are expanded as the processor would
    pad = engine.config.image_token_id
    ids = raw.prompt_token_ids
    collapsed = [t for i, t in enumerate(ids) if t != pad or ids[i - 1] != pad]
    assert engine.generate(mmzoo.Request(prompt_token_ids=collapsed, image_embeds=emb, **GEN)).token_ids == raw.token_ids


def test_bad_input(eager, image_files, tmp_path):
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not an image")
    emb = torch.zeros(16, 64)
    cases = [
        (dict(images=[str(tmp_path / "missing.png")]), r"images\[0\]: image file .*missing.png does not exist"),
        (dict(images=[image_files[0], str(garbage)]), r"images\[1\]: .*garbage.png is not a readable image"),
        (dict(prompt="<image> what?", images=image_files[:1]), r"prompt contains the image placeholder '<image>'"),
        (dict(prompt_token_ids=[5, 6, 7], images=image_files[:1]),
         r"prompt_token_ids has 0 image placeholder runs .* but 1 images are given"),
        (dict(image_embeds=torch.zeros(20, 64)), r"image_embeds has 20 rows, not a multiple of the 16 tokens per image"),
        (dict(image_embeds=torch.zeros(16, 32)), r"image_embeds has hidden size 32 but the LM's hidden size is 64"),
        (dict(image_embeds=emb, images=image_files[:1]), r"give images or image_embeds, not both"),
        (dict(audios=["a.wav"]), r"model=llava does not take audios"),
        (dict(videos=[image_files[:2]]), r"model=llava does not take videos"),
    ]
    parity.assert_refused(eager, cases, PROMPT, kind="image", files=image_files)


def test_cli(llava_ckpt, image_files, tmp_path):
    out = tmp_path / "out.jsonl"
    p = subprocess.run([sys.executable, "-m", "mmzoo.infer", "model=llava", f"checkpoint={llava_ckpt}",
                        f"images=[{image_files[0]},{image_files[1]}]", "prompt=Compare the two pictures.",
                        "executor=eager", "max_new_tokens=5", "ignore_eos=true", f"output={out}"],
                       cwd=tmp_path, env={**os.environ, "PJRT_DEVICE": "CPU"}, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    assert "model=llava" in p.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(row["token_ids"]) == 5 and row["images"] == image_files[:2]


def test_qwen3_text_model_matches_transformers(tmp_path, image_files):
    """A Llava checkpoint with a Qwen3 text_config composes conf/lm/qwen3.yaml (plain Qwen3: 1-D RoPE,
    per-head q/k norms) from text_config.model_type and gives transformers' tokens."""
    from mmzoo.fixtures import make_tiny_llava

    ckpt = make_tiny_llava(tmp_path / "llava_qwen3", seed=0, text_model_type="qwen3")
    ref = hf_reference(ckpt, image_files, [2])[2]
    engine = mmzoo.load(ckpt, executor="eager", max_model_len=256)
    assert engine.cfg.model.lm._target_ == "mmzoo.lms.qwen3" and engine.model.lm.layers[0].attn.q_norm is not None
    result = engine.generate(mmzoo.Request(prompt=PROMPT, images=image_files[:2], **GEN))
    assert result.prompt_token_ids == ref["ids"] and result.token_ids == ref["tokens"]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_qwen2_text_model_matches_transformers(llava_qwen2_ckpt, image_files, executor):
    """A Llava checkpoint with a Qwen2 text_config (LLaVA-Interleave / OneVision style): the LM
    component comes from text_config.model_type, no family code of its own, and the tokens are
    transformers' generate()'s."""
    from mmzoo.engine import backends_of

    ref = hf_reference(llava_qwen2_ckpt, image_files, [2])[2]
    engine = mmzoo.load(llava_qwen2_ckpt, executor=executor, max_model_len=256, **(XLA if executor == "xla" else {}))
    assert engine.cfg.model.name == "llava" and engine.cfg.model.lm._target_ == "mmzoo.lms.qwen2"
    assert any(name.endswith("bias") for name, _ in engine.model.lm.layers[0].attn.named_parameters())  # Qwen2's q/k/v bias
    assert backends_of(engine.model.lm) == ["sdpa"]
    prepared = engine.prepare(mmzoo.Request(prompt=PROMPT, images=image_files[:2]))
    np.testing.assert_allclose(engine.executor.prompt_logits(prepared), ref["logits"], atol=1e-4, rtol=0)
    result = engine.generate(mmzoo.Request(prompt=PROMPT, images=image_files[:2], **GEN))
    assert result.prompt_token_ids == ref["ids"] and result.token_ids == ref["tokens"]


def test_bare_composition_gets_item_buckets(llava_ckpt):
    """The XLA executor on a composition built without a family: a CLIP tower's rows are images, so
    its buckets count images (up to 16), not 64-16384 patches."""
    from mmzoo.engine import build_model
    from mmzoo.executor.xla import XLAExecutor

    _, model = build_model(mmzoo.compose(values={"checkpoint": str(llava_ckpt)}))
    exe = XLAExecutor(max_model_len=64, max_batch=1, buckets={"prefill": [64]}, compile={"warmup": False}, progress=False)
    exe.setup(model)
    assert exe.buckets.tower("vision") == (1, 2, 4, 8, 16)
