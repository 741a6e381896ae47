"""InternVL's own tests (token parity on every executor and backend is tests/test_parity.py): the tiles
of images of several sizes against transformers' processor, the pixel shuffle against transformers'
InternVL and Idefics3 ``pixel_shuffle``, the layer-scaled ViT's features against
``get_image_features`` (LayerNorm and RMSNorm towers, q/k norms, the final LayerNorm read at -1 or
not), the weight names of both layouts, videos (frames as tiles, told apart from images by their order in
the prompt), embeddings mode and the XLA warmup."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmzoo
import parity
from mmzoo.adapters import pixel_shuffle
from mmzoo.fixtures import make_image
from mmzoo.fixtures.internvl import make_tiny_internvl
from mmzoo.models import InternVL
from parity import GEN, XLA

PROMPT = "Compare the two pictures."
SIZES = [(56, 56), (84, 56), (56, 112), (112, 112), (224, 56), (30, 200)]  # (w, h): 1, 3, 3, 5, 5, 5 tiles


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Images whose aspect ratios give each tile grid the 56 px tiles and max_patches=4 allow."""
    root = tmp_path_factory.mktemp("internvl_images")
    paths = []
    for i, (w, h) in enumerate(SIZES):
        paths.append(str(root / f"img{i}.png"))
        make_image(w, h, seed=10 + i).save(paths[-1])
    return paths


def _hf(ckpt):
    from transformers import AutoProcessor, InternVLForConditionalGeneration

    model = InternVLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(ckpt)


def _hf_inputs(processor, images, prompt: str = PROMPT):
    from PIL import Image

    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": prompt}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return processor(text=[chat], images=[Image.open(f).convert("RGB") for f in images], return_tensors="pt")


def test_tiles_and_prompt_match_the_processor(internvl_ckpt, images):
    """Each image's tiles (a thumbnail beside two or more) and the prompt's ``<img>`` + tokens +
    ``</img>`` runs are transformers' processor's, for every tile grid the sizes give."""
    _, processor = _hf(internvl_ckpt)
    engine = parity.engine(internvl_ckpt, "eager")
    prepared = engine.prepare(mmzoo.Request(prompt=PROMPT, images=images))
    want = _hf_inputs(processor, images)
    tiles = [processor.image_processor.get_number_of_image_patches(h, w, {}) for w, h in SIZES]
    assert tiles == [1, 3, 3, 5, 5, 5]
    assert prepared.grids["image"].tolist() == [[n, 2, 2] for n in tiles]
    assert prepared.input_ids.tolist() == want["input_ids"][0].tolist()
    assert prepared.media[0].inputs["pixel_values"].shape == tuple(want["pixel_values"].shape) == (22, 3, 56, 56)
    np.testing.assert_array_equal(prepared.media[0].inputs["pixel_values"], want["pixel_values"].numpy())
    ids = prepared.input_ids
    starts = np.flatnonzero(ids == processor.start_image_token_id)
    ends = np.flatnonzero(ids == processor.end_image_token_id)
    assert (ends - starts - 1).tolist() == [4 * n for n in tiles]  # 2x2 tokens per tile between <img> and </img>
    assert (prepared.mm_index >= 0).sum() == 4 * sum(tiles)


@pytest.mark.parametrize("side,k", [(2, 2), (4, 2), (8, 2), (8, 4), (12, 4)])
def test_pixel_shuffle_matches_transformers(side, k):
    """The shared rearrangement is InternVL's ``pixel_shuffle`` (``scale_factor = 1 / k``) and
    Idefics3's (``scale_factor = k``) on a ``side x side`` grid of patches."""
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector
    from transformers.models.internvl.modeling_internvl import InternVLModel

    x = torch.randn(3, side, side, 5, generator=torch.Generator().manual_seed(side * k))
    got = pixel_shuffle(x, k)
    assert got.shape == (3, side // k, side // k, 5 * k * k)
    torch.testing.assert_close(got, InternVLModel.pixel_shuffle(None, x, scale_factor=1 / k), rtol=0, atol=0)
    idefics = Idefics3Connector.pixel_shuffle(None, x.flatten(1, 2), scale_factor=k)  # [n, tokens, k^2 c]
    torch.testing.assert_close(got.flatten(1, 2), idefics, rtol=0, atol=0)
    if side > k:  # several blocks: not a plain reshape of the row-major patches
        assert not torch.equal(got.flatten(1, 2), x.reshape(3, -1, 5 * k * k))


@pytest.mark.parametrize("variant", [
    {},  # the fixture's: LayerNorm blocks with q/k/v biases, mean pooling (no final LayerNorm)
    {"norm_type": "rms_norm", "use_qk_norm": True, "attention_bias": False, "use_mean_pooling": False},  # -1: normed
    {"use_mean_pooling": False, "vision_feature_layer": -2, "vision_layers": 3},  # block 2 read: no final norm
])
def test_vit_features_match_get_image_features(tmp_path, images, variant):
    """engine.encode gives transformers' get_image_features rows (ViT, pixel shuffle, projector) for
    InternViT's variants; the layer scales are read (set to ones, the features change)."""
    ckpt = make_tiny_internvl(tmp_path / "internvl", seed=1, **variant)
    model, processor = _hf(ckpt)
    engine = mmzoo.load(ckpt, executor="eager", max_model_len=256)
    encoder = engine.model.towers["vision"].encoder
    assert (encoder.post_norm is not None) == (variant.get("use_mean_pooling") is False
                                               and variant.get("vision_feature_layer", -1) == -1)
    assert len(encoder.blocks) == 2  # read at -2 of 3, the third block is not built
    inputs = _hf_inputs(processor, images[:3])
    with torch.no_grad():
        want = model.model.get_image_features(inputs["pixel_values"], return_dict=True).pooler_output
    got = engine.encode(images=images[:3])["image_embeds"]
    np.testing.assert_allclose(got.numpy(), want.reshape(-1, want.shape[-1]).numpy(), atol=1e-5, rtol=0)
    with torch.no_grad():
        for block in encoder.blocks:
            block.scale1.weight.fill_(1.0)
    assert not torch.allclose(engine.encode(images=images[:3])["image_embeds"], got, atol=1e-3)


def test_weight_names_of_both_layouts(internvl_ckpt):
    """The hub's tensor names (``vision_tower.*``, ``multi_modal_projector.*``,
    ``language_model.model.*``: what save_pretrained writes) and transformers 5's module names
    (``model.vision_tower.*``, ``model.language_model.*``, ``lm_head``) map to the same tensors, one
    per parameter of the composition, InternViT's class token and positions in CLIP's shapes."""
    from safetensors.torch import load_file

    from mmzoo.engine import build_model

    family, model = build_model(mmzoo.compose(values={"checkpoint": str(internvl_ckpt)}))
    hub = load_file(internvl_ckpt / "model.safetensors")
    assert "vision_tower.encoder.layer.0.lambda_1" in hub and "multi_modal_projector.linear_1.weight" in hub
    v5 = {("model." + k if k.startswith(("vision_tower.", "multi_modal_projector.")) else
           "model.language_model." + k[len("language_model.model."):] if k.startswith("language_model.model.") else
           "lm_head.weight" if k == "language_model.lm_head.weight" else k): v for k, v in hub.items()}
    a, b = family.convert_weights(hub), family.convert_weights(v5)
    params = dict(model.named_parameters())
    assert sorted(a) == sorted(b) == sorted(params)
    assert all(torch.equal(a[k], b[k]) and a[k].shape == params[k].shape for k in a)
    torch.testing.assert_close(a["towers.vision.encoder.blocks.1.scale2.weight"],
                               hub["vision_tower.encoder.layer.1.lambda_2"])
    torch.testing.assert_close(a["towers.vision.encoder.class_embedding"],
                               hub["vision_tower.embeddings.cls_token"][0, 0])


@pytest.mark.parametrize("executor", parity.EXECUTORS)
def test_image_embeds_match_raw_images(internvl_ckpt, images, executor):
    """Embeddings mode (mmzoo.encode's image_embeds + image_grid_thw [tiles, 2, 2]) gives the tokens
    of the raw images; token prompts with one placeholder per image inside <img> ... </img> too."""
    engine = parity.engine(internvl_ckpt, executor, **XLA)
    emb = parity.engine(internvl_ckpt, "eager").encode(images=images[:3])
    assert emb["image_grid_thw"].tolist() == [[1, 2, 2], [3, 2, 2], [3, 2, 2]]  # [tiles, 2, 2] per image
    assert list(emb["image_embeds"].shape) == [28, 64]
    raw = engine.generate(mmzoo.Request(prompt=PROMPT, images=images[:3], **GEN))
    via = engine.generate(mmzoo.Request(prompt=PROMPT, image_embeds=emb["image_embeds"],
                                        image_grid_thw=emb["image_grid_thw"], **GEN))
    assert via.token_ids == raw.token_ids and via.prompt_token_ids == raw.prompt_token_ids
    pad = engine.config.image_token_id
    ids = raw.prompt_token_ids
    collapsed = [t for i, t in enumerate(ids) if t != pad or ids[i - 1] != pad]
    assert engine.generate(mmzoo.Request(prompt_token_ids=collapsed, images=images[:3], **GEN)).token_ids == \
        raw.token_ids


def test_xla_warmup_covers_every_tile_count(internvl_ckpt, images):
    """The family's tile buckets (as many tiles as a prompt holds: 16 of 4 tokens in 64) and its
    dummy tiles compile everything requests of 1 to 6 tiles run: nothing compiles after warmup, and
    the tokens are the eager executor's."""
    assert isinstance(parity.engine(internvl_ckpt, "eager").family, InternVL)
    engine = mmzoo.load(internvl_ckpt, executor="xla", max_model_len=64, max_batch=2, progress=False,
                        buckets={"prefill": [64], "min_encoder_rows": 64, "max_encoder_rows": 64},
                        compile={"on_recompile": "error"})
    assert engine.executor.buckets.tower("vision") == (1, 2, 4, 8, 16)
    sets = [images[3:4], images[:1], images[1:3]]  # 5, 1 and 6 tiles
    results = engine.generate([{"prompt": PROMPT, "images": s, **GEN} for s in sets])
    eager = parity.engine(internvl_ckpt, "eager")
    for s, r in zip(sets, results):
        assert r.error is None and r.graphs_compiled_after_warmup == 0
        assert r.token_ids == eager.generate(mmzoo.Request(prompt=PROMPT, images=s, **GEN)).token_ids


def test_bad_input(internvl_ckpt, images, tmp_path):
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not an image")
    emb = torch.zeros(12, 64)
    cases = [
        (dict(images=[images[0], str(garbage)]), r"images\[1\]: .*garbage.png is not a readable image"),
        (dict(prompt="<IMG_CONTEXT> what?", images=images[:1]),
         r"prompt contains the image placeholder '<IMG_CONTEXT>'"),
        (dict(image_embeds=emb), r"image_embeds needs image_grid_thw \(\[tiles, 2, 2\] per image"),
        (dict(image_embeds=emb, image_grid_thw=[[3, 4, 1]]),
         r"image_grid_thw\[0\] = \[3, 4, 1\]: each tile gives 2x2 tokens"),
        (dict(image_embeds=emb, image_grid_thw=[[2, 2, 2]]),
         r"image_embeds has 12 rows but image_grid_thw \[\[2, 2, 2\]\] implies 8 \(tiles x 4 tokens per tile\)"),
        (dict(video_embeds=emb, video_grid_thw=[[2, 2, 2]]),
         r"video_embeds has 12 rows but video_grid_thw \[\[2, 2, 2\]\] implies 8 \(frames x 4 tokens per tile\)"),
        (dict(prompt_token_ids=[5, 6, 7], images=images[:1], videos=[images[:1] * 2]),
         r"prompt_token_ids: images and videos fill the same placeholder token \(id \d+\), so a token prompt cannot "
         r"tell their items apart"),
    ]
    parity.assert_refused(parity.engine(internvl_ckpt, "eager"), cases, PROMPT, kind="image", files=images)


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    """A three-frame video of 70x56 frames (each resized to one 56 px tile)."""
    root = tmp_path_factory.mktemp("internvl_frames")
    paths = []
    for i in range(3):
        paths.append(str(root / f"frame{i}.png"))
        make_image(70, 56, seed=40 + i).save(paths[-1])
    return paths


def _hf_generate(ckpt, content, images, videos, new_tokens: int = 12):
    """transformers' prompt ids and greedy tokens (EOS off) for one user turn of ``content`` parts."""
    from PIL import Image

    model, processor = _hf(ckpt)
    model.generation_config.eos_token_id = None
    chat = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    inputs = processor(text=[chat], images=[Image.open(f).convert("RGB") for f in images] or None,
                       videos=[[Image.open(f).convert("RGB") for f in v] for v in videos] or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("executor", parity.EXECUTORS)
def test_videos_and_images_in_either_order_match_transformers(internvl_ckpt, images, frames, executor):
    """A video's frames (``FrameN: <img>...</img>``, the image placeholder token) beside an image, in
    either order, and a video alone: transformers' prompt ids and greedy tokens."""
    engine = parity.engine(internvl_ckpt, executor, **XLA)
    for content, imgs in [([{"type": "video"}, {"type": "text", "text": "What happens?"}], []),
                          ([{"type": "image"}, {"type": "video"}, {"type": "text", "text": PROMPT}], images[1:2]),
                          ([{"type": "video"}, {"type": "image"}, {"type": "text", "text": PROMPT}], images[1:2])]:
        ids, tokens = _hf_generate(internvl_ckpt, content, imgs, [frames])
        out = engine.generate(mmzoo.Request(messages=[{"role": "user", "content": content}], images=imgs,
                                            videos=[frames], max_new_tokens=12, ignore_eos=True))
        assert out.error is None and out.prompt_token_ids == ids and out.token_ids == tokens


def test_video_embeds_match_raw_video(internvl_ckpt, images, frames):
    """Embeddings mode for a video (video_embeds + video_grid_thw [frames, 2, 2]) beside a raw image
    gives the tokens of the raw video."""
    engine = parity.engine(internvl_ckpt, "eager")
    emb = engine.encode(videos=[frames])
    assert emb["video_grid_thw"].tolist() == [[3, 2, 2]] and list(emb["video_embeds"].shape) == [12, 64]
    content = [{"type": "video"}, {"type": "image"}, {"type": "text", "text": PROMPT}]
    raw = engine.generate(mmzoo.Request(messages=[{"role": "user", "content": content}], images=images[:1],
                                        videos=[frames], **GEN))
    via = engine.generate(mmzoo.Request(messages=[{"role": "user", "content": content}], images=images[:1],
                                        video_embeds=emb["video_embeds"], video_grid_thw=emb["video_grid_thw"], **GEN))
    assert via.prompt_token_ids == raw.prompt_token_ids and via.token_ids == raw.token_ids
