"""LLaVA-OneVision's own tests (one image on every executor and backend is tests/test_parity.py): the host's
packing taps against transformers' ``pack_image_features`` / ``apply_pooling`` for grids that are cut
by rows or columns and shrunk, images of several sizes (one image: anyres tiles; several: base views),
a video and both together token-identical to its class on both executors with nothing compiled after
warmup, embeddings mode, and the server."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import mmzoo
import parity
from mmzoo.errors import MmzooError
from mmzoo.fixtures import make_image
from mmzoo.models.llava_onevision import pack_image, pack_video

GEN = {"max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf(llava_onevision_ckpt):
    """transformers' own class and processor on the tiny checkpoint (EOS off, as parity.reference)."""
    from transformers import AutoProcessor, LlavaOnevisionForConditionalGeneration

    model = LlavaOnevisionForConditionalGeneration.from_pretrained(llava_onevision_ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model, AutoProcessor.from_pretrained(llava_onevision_ckpt)


@pytest.fixture(scope="module")
def images(image_files, tmp_path_factory):
    """The shared test images (56x56, 84x56, 56x112) and a 200x120 one whose 2x3-tile map is shrunk
    (anyres_max_2)."""
    path = tmp_path_factory.mktemp("onevision") / "wide.png"
    make_image(200, 120, seed=7).save(path)
    return [*image_files, str(path)]


@pytest.fixture(scope="module")
def frames():
    return [make_image(56, 56, seed=20 + i) for i in range(4)]


def _hf_inputs(processor, prompt: str, images=(), videos=()):
    """The processor on one conversation (its images one sample: several are base views, as a chat of them)."""
    from PIL import Image

    content = [{"type": "image"}] * len(images) + [{"type": "video"}] * len(videos) + [{"type": "text", "text": prompt}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return processor(text=[chat], images=[[Image.open(f).convert("RGB") for f in images]] if images else None,
                     videos=list(videos) or None, return_tensors="pt")


# ---------------------------------------------------------------- the packing against transformers'

@pytest.mark.parametrize("size,tiles,max_tiles", [
    ((56, 84), (1, 2), 9), ((112, 56), (2, 1), 9), ((120, 200), (2, 3), 2), ((120, 200), (2, 3), 9),
    ((50, 300), (1, 3), 1), ((300, 70), (3, 1), 1), ((56, 56), (1, 1), 9), ((100, 100), (2, 2), 1)])
def test_packing_matches_transformers(size, tiles, max_tiles):
    """Random features of a base view and a grid of tiles, packed by transformers' pack_image_features
    (unpadding by rows or columns; shrunk past anyres_max_N, or not) and by the host's taps, agree."""
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    side, image_size = 4, 56
    pins = [[tiles[0] * image_size, tiles[1] * image_size]]
    config = types.SimpleNamespace(vision_config=types.SimpleNamespace(image_size=image_size, patch_size=14),
                                   image_grid_pinpoints=pins)
    feats = torch.randn(1 + tiles[0] * tiles[1], side * side, 8, generator=torch.Generator().manual_seed(0))
    newline = torch.randn(8)
    (want,), _ = LlavaOnevisionModel.pack_image_features(types.SimpleNamespace(config=config), [feats],
                                                         torch.tensor([size]), image_newline=newline,
                                                         vision_aspect_ratio=f"anyres_max_{max_tiles}")
    taps, weights = pack_image(size, tiles, side, max_tiles, multi=False)
    table = torch.cat([newline[None], feats.flatten(0, 1)])
    got = (table[torch.from_numpy(taps)] * torch.from_numpy(weights)[..., None]).sum(1)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6, rtol=0)


def test_video_pooling_matches_transformers():
    """Each frame's map shrunk 2x (bilinear, 5x5 -> 3x3 here) then the newline: apply_pooling's rows."""
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    side, frames = 5, 3
    config = types.SimpleNamespace(vision_config=types.SimpleNamespace(image_size=side * 14, patch_size=14))
    feats = torch.randn(frames, side * side, 8, generator=torch.Generator().manual_seed(1))
    newline = torch.randn(8)
    pooled = LlavaOnevisionModel.apply_pooling(types.SimpleNamespace(config=config), feats).reshape(-1, 8)
    want = torch.cat([pooled, newline[None]])
    taps, weights = pack_video(frames, side)
    table = torch.cat([newline[None], feats.flatten(0, 1)])
    got = (table[torch.from_numpy(taps)] * torch.from_numpy(weights)[..., None]).sum(1)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- generation against transformers'

REQUESTS = {
    "wide": lambda images, frames: {"prompt": "Describe it.", "images": images[3:4]},  # 2x3 tiles, shrunk
    "tall": lambda images, frames: {"prompt": "Describe it.", "images": images[2:3]},  # 2x1 tiles, columns cut
    "several": lambda images, frames: {"prompt": "Compare them.", "images": images[:3]},  # base views
    "video": lambda images, frames: {"prompt": "What happens?", "videos": [frames]},
    "both": lambda images, frames: {"prompt": "Compare them.", "images": images[1:2], "videos": [frames]},
}


@pytest.fixture(scope="module")
def references(hf, images, frames):
    """transformers' prompt ids, prefill logits and 12 greedy tokens for each of REQUESTS."""
    model, processor = hf
    out = {}
    for name, req in REQUESTS.items():
        r = req(images, frames)
        inputs = _hf_inputs(processor, r["prompt"], r.get("images", ()), r.get("videos", ()))
        with torch.no_grad():
            logits = model(**inputs).logits[0].float().numpy()
            gen = model.generate(**inputs, max_new_tokens=12, do_sample=False, pad_token_id=0)
        ids = inputs["input_ids"][0].tolist()
        out[name] = {"ids": ids, "logits": logits, "tokens": gen[0, len(ids):].tolist(), "inputs": inputs}
    return out


def test_images_and_video_match_transformers(llava_onevision_ckpt, references, images, frames):
    """Each request: the prompt ids (the processor's placeholder counts), prefill logits (atol 1e-4)
    and 12 greedy tokens of transformers' class (eager executor)."""
    engine = parity.engine(llava_onevision_ckpt, "eager")
    for name, req in REQUESTS.items():
        ref = references[name]
        prepared = engine.prepare(mmzoo.Request(**req(images, frames)))
        assert prepared.input_ids.tolist() == ref["ids"], name
        np.testing.assert_allclose(engine.executor.prompt_logits(prepared), ref["logits"], atol=1e-4, rtol=0)
        assert engine.generate(mmzoo.Request(**req(images, frames), **GEN)).token_ids == ref["tokens"], name


def test_embeddings_match_transformers(llava_onevision_ckpt, hf, references, images, frames):
    """engine.encode's rows are transformers' packed features (get_image_features' pooler_output for
    the shrunk image, get_video_features' for the video), their layouts [tiles, height, width] and
    [frames, s, s]; a layout that does not fit its image is refused."""
    model, _ = hf
    engine = parity.engine(llava_onevision_ckpt, "eager")
    emb = engine.encode(images=images[3:4])
    inputs = references["wide"]["inputs"]
    with torch.no_grad():
        want = model.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"],
                                              batch_num_images=inputs["batch_num_images"]).pooler_output[0]
    assert emb["image_grid_thw"].tolist() == [[7, 120, 200]]
    np.testing.assert_allclose(emb["image_embeds"].numpy(), want.numpy(), atol=1e-5, rtol=0)
    video = engine.encode(videos=[frames])
    with torch.no_grad():
        want = model.model.get_video_features(references["video"]["inputs"]["pixel_values_videos"]).pooler_output[0]
    assert video["video_grid_thw"].tolist() == [[4, 2, 2]]
    np.testing.assert_allclose(video["video_embeds"].numpy(), want.numpy(), atol=1e-5, rtol=0)
    with pytest.raises(MmzooError, match=r"image_grid_thw\[0\] = \[3, 120, 200\]: a 120x200 image is 1 \+ 6 tiles"):
        engine.prepare(mmzoo.Request(prompt="x", image_embeds=emb["image_embeds"], image_grid_thw=[[3, 120, 200]]))


def test_xla_matches_transformers_with_no_compile_after_warmup(llava_onevision_ckpt, references, images, frames):
    """XLA with warmup=needed and recompiles refused, two slots: the shrunk image, several images, the
    image with the video, and the shrunk image again from engine.encode's embeddings give transformers'
    tokens, and nothing compiles after the warmup."""
    emb = parity.engine(llava_onevision_ckpt, "eager").encode(images=images[3:4])
    engine = mmzoo.load(llava_onevision_ckpt, executor="xla", max_model_len=256, max_batch=2, warmup="needed",
                        progress=False, compile={"on_recompile": "error"},
                        buckets={"min_encoder_rows": 64, "max_encoder_rows": 64})
    reqs = [REQUESTS["wide"](images, frames), REQUESTS["several"](images, frames), REQUESTS["both"](images, frames),
            {"prompt": "Describe it.", **emb}]
    results = engine.generate([mmzoo.Request(**r, **GEN) for r in reqs])
    assert [r.graphs_compiled_after_warmup for r in results] == [0, 0, 0, 0]
    assert results[0].token_ids == results[3].token_ids == references["wide"]["tokens"]
    assert results[1].token_ids == references["several"]["tokens"]
    assert results[2].token_ids == references["both"]["tokens"]
    assert results[3].prompt_token_ids == references["wide"]["ids"]


def test_server_chat_matches_transformers(llava_onevision_ckpt, references, images):
    """The OpenAI server (in process): a chat with the shrunk image gives transformers' prompt length and tokens."""
    ref = references["wide"]
    engine = parity.engine(llava_onevision_ckpt, "eager")
    prompt_tokens, tokens = parity.served_chat(engine, images[3:4], "Describe it.", 12)
    assert prompt_tokens == len(ref["ids"]) and tokens == ref["tokens"]
