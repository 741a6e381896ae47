"""Qwen2.5-VL's own tests (image parity on every executor and backend is tests/test_parity.py): the
window order against transformers' ``get_vision_window_index``, video positions in time against
its ``get_rope_index``, the tower's embeddings and the full-attention blocks against its vision
model, videos and images of several sizes in one prompt token-identical to its class on both
executors, embeddings mode, and no XLA compile after warmup."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmzoo
import parity
from mmzoo.encoders import window_order
from mmzoo.fixtures import make_image
from mmzoo.models.qwen2_5_vl import TimedMedia

HF_CLASS = "Qwen2_5_VLForConditionalGeneration"
GEN = {"max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf(qwen2_5_vl_ckpt):
    """transformers' own class and processor on the tiny checkpoint (EOS off, as parity.reference)."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model, AutoProcessor.from_pretrained(qwen2_5_vl_ckpt)


@pytest.fixture(scope="module")
def frames():
    """A 6-frame 56x56 video (84x84 once resized: 3x3 merged units, 4 windows a frame): 3 temporal
    grid steps, at positions 0, 2, 5 (30 tokens/s, 24 fps, 2 frames a step)."""
    return [make_image(56, 56, seed=20 + i) for i in range(6)]


def _hf_reference(model, processor, prompt: str, images=(), videos=()) -> dict:
    """transformers' prompt ids, prefill logits and 16 greedy tokens (EOS off)."""
    inputs = parity.qwen_vl_inputs(processor, prompt, images, videos)
    with torch.no_grad():
        logits = model(**inputs).logits[0].float().numpy()
        gen = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=0)
    ids = inputs["input_ids"][0].tolist()
    return {"ids": ids, "logits": logits, "tokens": gen[0, len(ids):].tolist()}


# ---------------------------------------------------------------- host-side window order and positions

@pytest.mark.parametrize("grids,window", [
    ([[1, 6, 6]], 2), ([[1, 6, 8], [1, 10, 6]], 2), ([[3, 6, 4]], 2),  # partial windows; two items; a video
    ([[1, 16, 12]], 4), ([[2, 8, 8]], 4), ([[1, 4, 4]], 1), ([[1, 2, 10], [2, 6, 2]], 3)])
def test_window_order_matches_transformers(grids, window):
    """The merged units in window order and each window's extent are transformers' (window_index,
    cu_window_seqlens), for grids whose sides are and are not multiples of the window."""
    from transformers.vision_utils import get_vision_window_index

    merge, patch = 2, 14
    order, ids = window_order(np.array(grids), merge, window)
    want_order, want_cu = get_vision_window_index(torch.tensor(grids), spatial_merge_size=merge,
                                                  window_size=window * merge * patch, patch_size=patch)
    np.testing.assert_array_equal(order, want_order.numpy())
    assert sorted(order.tolist()) == list(range(len(order)))  # a permutation of every unit
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    cu = np.r_[starts, len(ids)] * merge * merge  # each window's patch rows, contiguous
    np.testing.assert_array_equal(cu, want_cu.numpy())
    assert len(set(ids.tolist())) == len(starts)  # a window id names one run of rows


@pytest.mark.parametrize("fps", [24.0, 25.0, 29.97, 3.0, 2.0, 0.5])
def test_video_positions_match_transformers(qwen2_5_vl_ckpt, hf, fps):
    """Text, an image and two videos (temporal index scaled by tokens_per_second *
    second_per_grid_t, truncated) at transformers' get_rope_index positions and delta, for
    frame rates whose products round differently."""
    model, _ = hf
    family = parity.engine(qwen2_5_vl_ckpt, "eager").family
    img, vid = family.image_token_id, family.video_token_id
    image_grid, video_grid = np.array([[1, 6, 8]]), np.array([[3, 6, 4], [7, 4, 4]])
    seconds = np.array([2 / fps, 2 / (fps + 1)], np.float32)
    spans = [(5, 0), (12, 1), (3, 0), (18, 2), (4, 0), (28, 2), (6, 0)]  # (tokens, 0 text / 1 image / 2 video)
    ids = np.concatenate([np.full(n, {0: 7, 1: img, 2: vid}[k]) for n, k in spans]).astype(np.int64)
    media = {"image": TimedMedia(counts=[12], calls=[], grid=image_grid),
             "video": TimedMedia(counts=[18, 28], calls=[], grid=video_grid, seconds=seconds)}
    pos, delta = family.positions(ids, media)
    types = torch.tensor(np.concatenate([np.full(n, k) for n, k in spans]))[None]
    want, want_delta = model.model.get_rope_index(
        torch.tensor(ids)[None], types, image_grid_thw=torch.tensor(image_grid), video_grid_thw=torch.tensor(video_grid),
        second_per_grid_ts=torch.tensor(seconds.tolist()))
    np.testing.assert_array_equal(pos, want[:, 0].numpy())
    assert delta == int(want_delta[0, 0])


def test_video_seconds_come_from_the_processor(qwen2_5_vl_ckpt, hf, frames):
    """A raw video's second_per_grid_ts is the processor's (its frames carry no rate: 24 fps)."""
    _, processor = hf
    prepared = parity.engine(qwen2_5_vl_ckpt, "eager").prepare(mmzoo.Request(prompt="What happens?", videos=[frames]))
    want = parity.qwen_vl_inputs(processor, "What happens?", videos=[frames])
    assert prepared.grids["video"].tolist() == want["video_grid_thw"].tolist() == [[3, 6, 6]]
    assert want["second_per_grid_ts"].tolist() == pytest.approx([2 / 24])
    t = prepared.positions[0][prepared.input_ids == parity.engine(qwen2_5_vl_ckpt, "eager").family.video_token_id]
    assert sorted(set((t - t.min()).tolist())) == [0, 2, 5]  # 2.5 positions a step, truncated


# ---------------------------------------------------------------- the tower against transformers'

def test_embeddings_and_full_attention_blocks_match_transformers(qwen2_5_vl_ckpt, hf, image_files, frames):
    """engine.encode (images of three sizes; a video) gives transformers' get_image_features /
    get_video_features rows in placeholder order; with other full-attention blocks (none, both)
    too, and the choice changes the embeddings: the windows matter at these sizes."""
    model, processor = hf
    inputs = parity.qwen_vl_inputs(processor, "x", images=image_files, videos=[frames])
    got = {}
    for blocks in ([1], [], [0, 1]):
        engine = mmzoo.load(qwen2_5_vl_ckpt, executor="eager", max_model_len=256,
                            overrides=["model=qwen2_5_vl", f"model.encoder.full_attention_blocks={blocks}"])
        assert [not w for w in engine.model.towers["vision"].encoder.windowed] == [i in blocks for i in (0, 1)]
        model.model.visual.fullatt_block_indexes = blocks
        with torch.no_grad():
            want_img = torch.cat(model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"],
                                                                return_dict=True).pooler_output)
            want_vid = torch.cat(model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"],
                                                                return_dict=True).pooler_output)
        emb = engine.encode(images=image_files, videos=[frames])
        assert emb["image_grid_thw"].tolist() == inputs["image_grid_thw"].tolist()
        np.testing.assert_allclose(emb["image_embeds"].numpy(), want_img.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(emb["video_embeds"].numpy(), want_vid.numpy(), atol=1e-5, rtol=0)
        got[tuple(blocks)] = emb["image_embeds"]
    model.model.visual.fullatt_block_indexes = [1]
    assert not torch.allclose(got[(1,)], got[()], atol=1e-3)
    assert not torch.allclose(got[(1,)], got[(0, 1)], atol=1e-3)


def test_weight_names_of_both_layouts(qwen2_5_vl_ckpt):
    """The hub's tensor names (``visual.*``, ``model.*``, ``lm_head``: what the fixture's
    save_pretrained writes, as the published checkpoints have them) and transformers 5's module
    names (``model.visual.*``, ``model.language_model.*``) map to the same tensors, one per
    parameter of the composition (the ViT's fused qkv split, ``attn.proj`` as ``o_proj``)."""
    from safetensors.torch import load_file

    from mmzoo.engine import build_model

    family, model = build_model(mmzoo.compose(values={"checkpoint": str(qwen2_5_vl_ckpt)}))
    hub = load_file(qwen2_5_vl_ckpt / "model.safetensors")
    assert any(k.startswith("visual.blocks.0.mlp.gate_proj") for k in hub) and "visual.merger.ln_q.weight" in hub
    v5 = {("model." + k if k.startswith("visual.") else
           "model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in hub.items()}
    a, b = family.convert_weights(hub), family.convert_weights(v5)
    assert sorted(a) == sorted(b) == sorted(n for n, _ in model.named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a)
    qkv = hub["visual.blocks.1.attn.qkv.weight"]
    assert torch.equal(torch.cat([a[f"towers.vision.encoder.blocks.1.attn.{p}_proj.weight"] for p in "qkv"]), qkv)


# ---------------------------------------------------------------- generation against transformers'

REQUESTS = {"video": lambda images, frames: {"prompt": "What happens?", "videos": [frames]},
            "mixed": lambda images, frames: {"prompt": "Compare them.", "images": images[1:], "videos": [frames]}}


@pytest.fixture(scope="module")
def references(hf, image_files, frames):
    """transformers' prompt ids, prefill logits and greedy tokens for each of REQUESTS."""
    model, processor = hf
    return {name: _hf_reference(model, processor, **req(image_files, frames)) for name, req in REQUESTS.items()}


def test_video_and_images_match_transformers(qwen2_5_vl_ckpt, references, image_files, frames):
    """A video, and two images of different sizes with a video in one prompt: prompt ids, prefill
    logits (atol 1e-4) and 16 greedy tokens of transformers' class (eager executor)."""
    engine = parity.engine(qwen2_5_vl_ckpt, "eager")
    for name, req in REQUESTS.items():
        ref = references[name]
        prepared = engine.prepare(mmzoo.Request(**req(image_files, frames)))
        assert prepared.input_ids.tolist() == ref["ids"], name
        np.testing.assert_allclose(engine.executor.prompt_logits(prepared), ref["logits"], atol=1e-4, rtol=0)
        result = engine.generate(mmzoo.Request(**req(image_files, frames), **GEN))
        assert result.token_ids == ref["tokens"], name


def test_xla_matches_transformers_with_no_compile_after_warmup(qwen2_5_vl_ckpt, references, image_files, frames):
    """XLA with warmup=needed and recompiles refused, two slots: the video, the mixed prompt, one
    image, and the mixed prompt again from engine.encode's embeddings (rows in placeholder order:
    the window order is undone by the placeholders' rows alone) give transformers' tokens, and
    nothing compiles after the warmup."""
    emb = parity.engine(qwen2_5_vl_ckpt, "eager").encode(images=image_files[1:], videos=[frames])
    engine = mmzoo.load(qwen2_5_vl_ckpt, executor="xla", max_model_len=256, max_batch=2, warmup="needed",
                        progress=False, compile={"on_recompile": "error"},
                        buckets={"encoder": {"vision": [64, 128]}, "min_encoder_rows": 64, "max_encoder_rows": 128})
    embeds = {"prompt": "Compare them.", "image_embeds": emb["image_embeds"], "image_grid_thw": emb["image_grid_thw"],
              "video_embeds": emb["video_embeds"], "video_grid_thw": emb["video_grid_thw"]}
    reqs = [{**REQUESTS["video"](image_files, frames), **GEN}, {**REQUESTS["mixed"](image_files, frames), **GEN},
            {"prompt": "What shape is this?", "images": image_files[:1], **GEN}, {**embeds, **GEN}]
    results = engine.generate([mmzoo.Request(**r) for r in reqs])
    assert [r.graphs_compiled_after_warmup for r in results] == [0, 0, 0, 0]
    assert results[0].token_ids == references["video"]["tokens"]
    assert results[1].token_ids == results[3].token_ids == references["mixed"]["tokens"]
    assert results[3].prompt_token_ids == references["mixed"]["ids"]
