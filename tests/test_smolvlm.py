"""SmolVLM's and Idefics3's own tests (token parity on every executor and backend is tests/test_parity.py):
the tiles and the framed prompt against transformers' processor (split and unsplit images), SigLIP's
features against ``get_image_features`` (bucketed positions where they are not the identity), the
Idefics3 architecture's greedy tokens, token prompts, embeddings mode, the XLA warmup, and SmolVLM2's
videos."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import mmzoo
import parity
from mmzoo.errors import MmzooError
from mmzoo.encoders import bucketed_positions
from mmzoo.fixtures import make_image
from mmzoo.fixtures.smolvlm import make_tiny_smolvlm
from mmzoo.models import SmolVLM
from parity import GEN

PROMPT = "Compare the pictures."
SIZES = [(56, 56), (84, 56), (56, 112), (200, 30)]  # (w, h): 2x2, 2x2, 2x1 and 1x2 tiles (+ the global view)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("smolvlm_images")
    paths = []
    for i, (w, h) in enumerate(SIZES):
        paths.append(str(root / f"img{i}.png"))
        make_image(w, h, seed=20 + i).save(paths[-1])
    return paths


def _hf_inputs(processor, images, prompt: str = PROMPT):
    from PIL import Image

    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": prompt}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(text=[chat], images=[[Image.open(f).convert("RGB") for f in images]], return_tensors="pt")


@pytest.mark.parametrize("split", [True, False])
def test_tiles_and_prompt_match_the_processor(smolvlm_ckpt, images, tmp_path, split):
    """Each image's tiles and global view, and the prompt's row / column framing, are transformers'
    processor's; without splitting each image is one tile (layout ``[1, 1, 1]``)."""
    from transformers import AutoProcessor

    ckpt = smolvlm_ckpt if split else make_tiny_smolvlm(tmp_path / "unsplit", longest_edge=56)
    processor = AutoProcessor.from_pretrained(ckpt)
    prepared = parity.engine(ckpt, "eager").prepare(mmzoo.Request(prompt=PROMPT, images=images))
    want = _hf_inputs(processor, images)
    grid = [[5, 2, 2], [5, 2, 2], [3, 2, 1], [3, 1, 2]] if split else [[1, 1, 1]] * 4
    assert prepared.grids["image"].tolist() == grid
    assert prepared.input_ids.tolist() == want["input_ids"][0].tolist()
    tiles = sum(g[0] for g in grid)
    assert prepared.media[0].inputs["pixel_values"].shape == tuple(want["pixel_values"].shape[1:]) == (tiles, 3, 56, 56)
    np.testing.assert_array_equal(prepared.media[0].inputs["pixel_values"], want["pixel_values"][0].numpy())
    assert (prepared.mm_index >= 0).sum() == 4 * tiles  # 2x2 tokens per tile
    if split:
        text = processor.tokenizer.decode(prepared.input_ids)
        assert text.count("<row_2_col_1>") == 3 and text.count("<row_1_col_2>") == 3 and text.count("<global-img>") == 4


def test_bucketed_positions_are_transformers():
    """SmolVLM's and Idefics3's position rows of a full tile: the identity for most grid sides, not
    for all (19 patches per side: float32 rounding in the bucketing)."""
    assert torch.equal(bucketed_positions(4), torch.arange(16))
    assert not torch.equal(bucketed_positions(19), torch.arange(19 * 19))


@pytest.mark.parametrize("architecture,sizes", [
    ("smolvlm", {}),
    # 19 patches of 2 px per tile side: positions that are not the identity; no pixel shuffle (k = 1)
    ("idefics3", {"tile_size": 38, "patch_size": 2, "scale_factor": 1, "longest_edge": 38}),
])
def test_vit_features_match_get_image_features(tmp_path, images, architecture, sizes):
    """engine.encode gives transformers' get_image_features rows (SigLIP, pixel shuffle, linear)."""
    import transformers
    from transformers import AutoProcessor

    ckpt = make_tiny_smolvlm(tmp_path / architecture, seed=1, architecture=architecture, **sizes)
    hf = "SmolVLMForConditionalGeneration" if architecture == "smolvlm" else "Idefics3ForConditionalGeneration"
    model = getattr(transformers, hf).from_pretrained(ckpt, dtype=torch.float32).eval()
    inputs = _hf_inputs(AutoProcessor.from_pretrained(ckpt), images[:3])
    with torch.no_grad():
        want = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"],
                                              return_dict=True).pooler_output
    want = torch.cat(list(want)) if isinstance(want, (list, tuple)) else want
    engine = mmzoo.load(ckpt, executor="eager", max_model_len=2048)
    got = engine.encode(images=images[:3])["image_embeds"]
    np.testing.assert_allclose(got.numpy(), want.reshape(-1, want.shape[-1]).numpy(), atol=1e-5, rtol=0)


def test_idefics3_tokens_match_transformers(tmp_path, images):
    """An Idefics3ForConditionalGeneration checkpoint (Idefics3Processor) runs as model=smolvlm and
    gives transformers' greedy tokens; it takes no videos (refused by name)."""
    ckpt = make_tiny_smolvlm(tmp_path / "idefics3", architecture="idefics3")
    ref = parity.reference(ckpt, "Idefics3ForConditionalGeneration", "image", images, [2], PROMPT)[2]
    engine = parity.engine(ckpt, "eager")
    assert engine.name == "smolvlm"
    out = engine.generate(mmzoo.Request(prompt=PROMPT, images=images[:2], **GEN))
    assert out.prompt_token_ids == ref["ids"] and out.token_ids == ref["tokens"]
    with pytest.raises(MmzooError, match=r"model=smolvlm: this checkpoint's Idefics3Processor takes no videos"):
        engine.prepare(mmzoo.Request(prompt=PROMPT, videos=[[make_image(56, 56)] * 2]))


def test_weight_names(smolvlm_ckpt):
    """Every tensor of the checkpoint maps to one parameter of the composition, SigLIP under CLIP's
    names and the connector's projection as the adapter's ``proj``."""
    from safetensors.torch import load_file

    from mmzoo.engine import build_model

    family, model = build_model(mmzoo.compose(values={"checkpoint": str(smolvlm_ckpt)}))
    hf = load_file(smolvlm_ckpt / "model.safetensors")
    assert "model.connector.modality_projection.proj.weight" in hf and "model.vision_model.post_layernorm.weight" in hf
    got = family.convert_weights(hf)
    params = dict(model.named_parameters())
    assert sorted(got) == sorted(params)
    assert all(got[k].shape == params[k].shape for k in got)
    torch.testing.assert_close(got["towers.vision.encoder.post_norm.weight"],
                               hf["model.vision_model.post_layernorm.weight"])


@pytest.mark.parametrize("executor", parity.EXECUTORS)
def test_image_embeds_and_token_prompts_match_raw_images(smolvlm_ckpt, images, executor):
    """Embeddings mode (mmzoo.encode's image_embeds + image_grid_thw [tiles, rows, cols]) gives the
    tokens of the raw images; so do token prompts holding the processor's whole text, and token
    prompts with one placeholder per image (expanded to that text's ids)."""
    engine = parity.engine(smolvlm_ckpt, executor, **parity.XLA)
    emb = parity.engine(smolvlm_ckpt, "eager").encode(images=images[1:3])
    assert emb["image_grid_thw"].tolist() == [[5, 2, 2], [3, 2, 1]]
    assert list(emb["image_embeds"].shape) == [32, 64]
    raw = engine.generate(mmzoo.Request(prompt=PROMPT, images=images[1:3], **GEN))
    via = engine.generate(mmzoo.Request(prompt=PROMPT, image_embeds=emb["image_embeds"],
                                        image_grid_thw=emb["image_grid_thw"], **GEN))
    assert via.token_ids == raw.token_ids and via.prompt_token_ids == raw.prompt_token_ids
    whole = engine.generate(mmzoo.Request(prompt_token_ids=raw.prompt_token_ids, images=images[1:3], **GEN))
    assert whole.token_ids == raw.token_ids
    if executor == "eager":
        tok = engine.processor.tokenizer
        chat = tok(f"<|im_start|>User:<image><image>{PROMPT}<end_of_utterance>\nAssistant:")["input_ids"]
        one = engine.generate(mmzoo.Request(prompt_token_ids=chat, images=images[1:3], **GEN))
        assert one.prompt_token_ids == raw.prompt_token_ids and one.token_ids == raw.token_ids


def test_xla_warmup_covers_every_tile_count(smolvlm_ckpt, images):
    """The family's tile buckets and its dummy tiles compile everything requests of 3 to 13 tiles
    run: nothing compiles after warmup, and the tokens are the eager executor's."""
    assert isinstance(parity.engine(smolvlm_ckpt, "eager").family, SmolVLM)
    engine = mmzoo.load(smolvlm_ckpt, executor="xla", max_model_len=128, max_batch=2, progress=False,
                        buckets={"prefill": [128], "min_encoder_rows": 64, "max_encoder_rows": 64},
                        compile={"on_recompile": "error"})
    assert engine.executor.buckets.tower("vision") == (1, 2, 4, 8, 16, 32)  # 4 tokens a tile, 128 in a prompt
    sets = [images[2:3], images[:1], images[:3]]  # 3, 5 and 13 tiles
    results = engine.generate([{"prompt": PROMPT, "images": s, **GEN} for s in sets])
    eager = parity.engine(smolvlm_ckpt, "eager")
    for s, r in zip(sets, results):
        assert r.error is None and r.graphs_compiled_after_warmup == 0
        assert r.token_ids == eager.generate(mmzoo.Request(prompt=PROMPT, images=s, **GEN)).token_ids


def _video_reference(ckpt, videos, prompt: str = "What happens?") -> dict:
    """transformers' prompt ids, prefill logits and 16 greedy tokens for ``videos`` (lists of frames)."""
    from transformers import AutoProcessor, SmolVLMForConditionalGeneration

    processor = AutoProcessor.from_pretrained(ckpt)
    model = SmolVLMForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    content = [{"type": "video"}] * len(videos) + [{"type": "text", "text": prompt}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    inputs = processor(text=[chat], videos=list(videos), return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0].float().numpy()
        gen = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=0)
    ids = inputs["input_ids"][0].tolist()
    return {"ids": ids, "logits": logits, "tokens": gen[0, len(ids):].tolist()}


def test_videos_match_transformers(smolvlm_ckpt, tmp_path):
    """SmolVLM2's videos: each frame one tile, written with the processor's introduction and timestamps
    (two videos of 3 and 2 frames: the shorter one's introduction counts the longer one's frames, as
    the processor's padded batch does): transformers' prompt ids, logits and tokens on both executors
    (XLA: nothing compiled after warmup, and the videos again from engine.encode's embeddings); a
    token prompt must hold the videos' whole text; a video processor that samples frames by rate
    refuses frames given without one, as transformers' does, named."""
    videos = [[make_image(56, 84, seed=i) for i in range(3)], [make_image(70, 50, seed=9 + i) for i in range(2)]]
    ref = _video_reference(smolvlm_ckpt, videos)
    eager = parity.engine(smolvlm_ckpt, "eager")
    prepared = eager.prepare(mmzoo.Request(prompt="What happens?", videos=videos))
    assert prepared.input_ids.tolist() == ref["ids"] and prepared.grids["video"].tolist() == [[3, 1, 1], [2, 1, 1]]
    np.testing.assert_allclose(eager.executor.prompt_logits(prepared), ref["logits"], atol=1e-4, rtol=0)
    assert eager.generate(mmzoo.Request(prompt="What happens?", videos=videos, **GEN)).token_ids == ref["tokens"]
    emb = eager.encode(videos=videos)
    xla = mmzoo.load(smolvlm_ckpt, executor="xla", max_model_len=256, max_batch=2, progress=False, warmup="needed",
                     buckets={"min_encoder_rows": 64, "max_encoder_rows": 64}, compile={"on_recompile": "error"})
    results = xla.generate([mmzoo.Request(prompt="What happens?", videos=videos, **GEN),
                            mmzoo.Request(prompt="What happens?", **emb, **GEN)])
    assert [r.graphs_compiled_after_warmup for r in results] == [0, 0]
    assert results[0].token_ids == results[1].token_ids == ref["tokens"]
    assert results[1].prompt_token_ids == ref["ids"]
    assert eager.generate(mmzoo.Request(prompt_token_ids=ref["ids"], videos=videos, **GEN)).token_ids == ref["tokens"]
    image = eager.family.image_token_id
    with pytest.raises(MmzooError, match=r"prompt_token_ids has 1 image placeholder tokens but the 2 videos' frames "
                                         r"fill 20 \(\[12, 8\]\)"):
        eager.prepare(mmzoo.Request(prompt_token_ids=[5, image, 6], videos=videos))
    sampling = tmp_path / "sampling"
    shutil.copytree(smolvlm_ckpt, sampling)
    config = json.loads((sampling / "processor_config.json").read_text())
    config["video_processor"]["do_sample_frames"] = True
    (sampling / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(MmzooError, match=r"videos\[0\]: the checkpoint's video processor refuses it: Asked to sample "
                                         r"frames per second but no video metadata"):
        mmzoo.load(sampling, executor="eager").prepare(mmzoo.Request(prompt="x", videos=videos[:1]))


def test_bad_input(smolvlm_ckpt, images):
    emb = torch.zeros(12, 64)
    cases = [
        (dict(prompt="<image> what?", images=images[:1]), r"prompt contains the image placeholder '<image>'"),
        (dict(image_embeds=emb), r"image_embeds needs image_grid_thw \(\[tiles, rows, cols\] per image"),
        (dict(image_embeds=emb, image_grid_thw=[[3, 2, 2]]),
         r"image_grid_thw\[0\] = \[3, 2, 2\]: an image of rows x cols tiles has rows \* cols \+ 1"),
        (dict(image_embeds=emb, image_grid_thw=[[2, 1, 1]]), r"image_grid_thw\[0\] = \[2, 1, 1\]: .*or is one tile"),
        (dict(image_embeds=emb, image_grid_thw=[[1, 1, 1]]),
         r"image_embeds has 12 rows but image_grid_thw \[\[1, 1, 1\]\] implies 4 \(tiles x 4 tokens per tile\)"),
        (dict(prompt_token_ids=[5, 6, 7], images=images[:1]),
         r"prompt_token_ids has 0 image placeholders \(token id \d+\) in runs of \[\] but 1 images are given"),
        (dict(images=images[:1], videos=[images[:2]]), r"model=smolvlm takes images or videos in one request, not "
                                                       r"both"),
    ]
    parity.assert_refused(parity.engine(smolvlm_ckpt, "eager"), cases, PROMPT, kind="image", files=images)


def test_server_chat_with_two_images_equals_transformers(smolvlm_ckpt, images):
    """The OpenAI chat endpoint with two image_url parts answers transformers' greedy tokens for the
    same conversation."""
    ref = parity.reference(smolvlm_ckpt, "SmolVLMForConditionalGeneration", "image", images[1:3], [2], PROMPT,
                           new_tokens=8)[2]
    prompt_tokens, tokens = parity.served_chat(parity.engine(smolvlm_ckpt, "eager"), images[1:3], PROMPT, 8)
    assert prompt_tokens == len(ref["ids"]) and tokens == ref["tokens"]  # both images' tiles, framed
