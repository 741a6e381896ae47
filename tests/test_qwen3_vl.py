"""Qwen3-VL's own tests (image parity on every executor and backend is tests/test_parity.py): M-RoPE
positions of images and timestamped video steps against transformers' ``get_rope_index``, the
tower's embeddings and DeepStack features against its ``get_image_features``, a video beside images
token-identical to its class on both executors with nothing compiled after warmup, embeddings mode
(the DeepStack levels travel in the rows, and they matter), and token prompts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmzoo
import parity
from mmzoo.errors import MmzooError
from mmzoo.fixtures import make_image
from mmzoo.models import Media

GEN = {"max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf(qwen3_vl_ckpt):
    """transformers' own class and processor on the tiny checkpoint (EOS off, as parity.reference)."""
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(qwen3_vl_ckpt, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model, AutoProcessor.from_pretrained(qwen3_vl_ckpt)


@pytest.fixture(scope="module")
def frames():
    """A 4-frame 56x56 video (24 fps assumed: the processor keeps every frame): two temporal steps
    of 8x8 patches (16 tokens each), at 0.0 and 0.1 seconds."""
    return [make_image(56, 56, seed=20 + i) for i in range(4)]


REQUESTS = {"video": lambda images, frames: {"prompt": "What happens?", "videos": [frames]},
            "mixed": lambda images, frames: {"prompt": "Compare them.", "images": images[:2], "videos": [frames]}}


@pytest.fixture(scope="module")
def references(hf, image_files, frames):
    """transformers' prompt ids, prefill logits and 16 greedy tokens for each of REQUESTS."""
    model, processor = hf
    out = {}
    for name, req in REQUESTS.items():
        inputs = parity.qwen_vl_inputs(processor, **req(image_files, frames))
        with torch.no_grad():
            logits = model(**inputs).logits[0].float().numpy()
            gen = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=0)
        ids = inputs["input_ids"][0].tolist()
        out[name] = {"ids": ids, "logits": logits, "tokens": gen[0, len(ids):].tolist(), "inputs": inputs}
    return out


def test_positions_match_transformers(qwen3_vl_ckpt, hf):
    """Text, an image and two videos whose temporal steps are runs apart (timestamp text between
    them): transformers' get_rope_index positions and delta, each step positioned as a one-frame image."""
    model, _ = hf
    family = parity.engine(qwen3_vl_ckpt, "eager").family
    img, vid = family.image_token_id, family.video_token_id
    image_grid, video_grid = np.array([[1, 8, 10]]), np.array([[2, 8, 8], [3, 4, 6]])
    spans = [(5, 0), (20, 1), (3, 0), (16, 2), (4, 0), (16, 2), (2, 0), (6, 2), (3, 0), (6, 2), (1, 0), (6, 2), (4, 0)]
    ids = np.concatenate([np.full(n, {0: 7, 1: img, 2: vid}[k]) for n, k in spans]).astype(np.int64)
    media = {"image": Media(counts=[20], calls=[], grid=image_grid), "video": Media(counts=[32, 18], calls=[],
                                                                                  grid=video_grid)}
    pos, delta = family.positions(ids, media)
    types = torch.tensor(np.concatenate([np.full(n, k) for n, k in spans]))[None]
    want, want_delta = model.model.get_rope_index(torch.tensor(ids)[None], types,
                                                  image_grid_thw=torch.tensor(image_grid),
                                                  video_grid_thw=torch.tensor(video_grid))
    np.testing.assert_array_equal(pos, want[:, 0].numpy())
    assert delta == int(want_delta[0, 0])


def test_embeddings_carry_the_deepstack_levels(qwen3_vl_ckpt, hf, image_files, frames):
    """engine.encode's rows are transformers' get_image_features / get_video_features: the merged
    embedding, then each DeepStack level, side by side (3 x the LM's width here)."""
    model, processor = hf
    inputs = parity.qwen_vl_inputs(processor, "x", images=image_files[:2], videos=[frames])
    emb = parity.engine(qwen3_vl_ckpt, "eager").encode(images=image_files[:2], videos=[frames])
    for kind, pixels in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        with torch.no_grad():
            out = getattr(model.model, f"get_{kind}_features")(inputs[pixels], inputs[f"{kind}_grid_thw"],
                                                              return_dict=True)
        want = torch.cat([torch.cat(out.pooler_output)] + [torch.cat(level) for level in out.deepstack_features], -1)
        assert emb[f"{kind}_grid_thw"].tolist() == inputs[f"{kind}_grid_thw"].tolist()
        assert emb[f"{kind}_embeds"].shape == (want.shape[0], 3 * model.config.text_config.hidden_size)
        np.testing.assert_allclose(emb[f"{kind}_embeds"].numpy(), want.numpy(), atol=1e-5, rtol=0)


def test_video_and_images_match_transformers(qwen3_vl_ckpt, references, image_files, frames):
    """A video, and two images of different sizes beside it: the prompt ids (each temporal step
    with its timestamp), prefill logits (atol 1e-4) and 16 greedy tokens of transformers' class."""
    engine = parity.engine(qwen3_vl_ckpt, "eager")
    for name, req in REQUESTS.items():
        ref = references[name]
        prepared = engine.prepare(mmzoo.Request(**req(image_files, frames)))
        assert prepared.input_ids.tolist() == ref["ids"], name
        np.testing.assert_allclose(engine.executor.prompt_logits(prepared), ref["logits"], atol=1e-4, rtol=0)
        assert engine.generate(mmzoo.Request(**req(image_files, frames), **GEN)).token_ids == ref["tokens"], name
    text = engine.processor.tokenizer.decode(references["video"]["ids"])
    assert "<0.0 seconds><|vision_start|>" in text and "<0.1 seconds><|vision_start|>" in text


@pytest.mark.parametrize("count", [6, 30, 61])
def test_sampled_video_prompts_match_the_processor(qwen3_vl_ckpt, hf, tmp_path, count):
    """Longer videos, whose frames the processor samples (2 a second of 24): the same grid and
    prompt ids, timestamps of the frames it kept included; the same again from an mmzoo.encode file,
    which carries each step's timestamp (video_timestamps)."""
    from mmzoo import embeds_file

    _, processor = hf
    engine = parity.engine(qwen3_vl_ckpt, "eager")
    video = [make_image(56, 56, seed=i) for i in range(count)]
    prepared = engine.prepare(mmzoo.Request(prompt="What happens?", videos=[video]))
    want = parity.qwen_vl_inputs(processor, "What happens?", videos=[video])
    assert prepared.grids["video"].tolist() == want["video_grid_thw"].tolist()
    assert prepared.input_ids.tolist() == want["input_ids"][0].tolist()
    emb = engine.encode(videos=[video])
    assert emb["video_timestamps"].shape == (int(want["video_grid_thw"][0, 0]),)
    embeds_file.write(tmp_path / "video.safetensors", emb, engine.embeds_metadata())
    via = engine.prepare(mmzoo.Request(prompt="What happens?", embeds=str(tmp_path / "video.safetensors")))
    assert via.input_ids.tolist() == want["input_ids"][0].tolist()
    np.testing.assert_array_equal(via.positions, prepared.positions)


def test_video_timestamps_are_checked(qwen3_vl_ckpt, qwen2_vl_ckpt, frames):
    """video_timestamps: one finite, non-negative second per temporal step, only with video_embeds,
    only for a family that writes them (Qwen2-VL refuses the field by name)."""
    engine = parity.engine(qwen3_vl_ckpt, "eager")
    emb = engine.encode(videos=[frames])
    cases = [({"video_timestamps": [0.0, 1.0, 2.0]}, r"video_timestamps has 3 entries but video_grid_thw gives 2 "
                                                      r"temporal steps"),
             ({"video_timestamps": [0.0, float("nan")]}, r"video_timestamps must be finite seconds >= 0"),
             ({"video_timestamps": [0.0, -1.0]}, r"video_timestamps must be finite seconds >= 0")]
    for extra, message in cases:
        with pytest.raises(MmzooError, match=message):
            engine.prepare(mmzoo.Request(prompt="x", **{**emb, **extra}))
    with pytest.raises(MmzooError, match=r"video_timestamps given without video_embeds"):
        engine.prepare(mmzoo.Request(prompt="x", video_timestamps=[0.0]))
    shifted = engine.prepare(mmzoo.Request(prompt="x", **{**emb, "video_timestamps": [3.0, 4.5]}))
    text = engine.processor.tokenizer.decode(shifted.input_ids)
    assert "<3.0 seconds><|vision_start|>" in text and "<4.5 seconds><|vision_start|>" in text
    with pytest.raises(MmzooError, match=r"model=qwen2_vl does not take video_timestamps"):
        parity.engine(qwen2_vl_ckpt, "eager").prepare(mmzoo.Request(prompt="x", video_timestamps=[0.0]))


def test_xla_matches_transformers_with_no_compile_after_warmup(qwen3_vl_ckpt, references, image_files, frames):
    """XLA with warmup=needed and recompiles refused, two slots: the video, the mixed prompt, and
    the mixed prompt again from engine.encode's embeddings give transformers' tokens, and nothing
    compiles after the warmup."""
    emb = parity.engine(qwen3_vl_ckpt, "eager").encode(images=image_files[:2], videos=[frames])
    engine = mmzoo.load(qwen3_vl_ckpt, executor="xla", max_model_len=256, max_batch=2, warmup="needed",
                        progress=False, compile={"on_recompile": "error"},
                        buckets={"encoder": {"vision": [64, 192]}, "min_encoder_rows": 64, "max_encoder_rows": 192})
    embeds = {"prompt": "Compare them.", **emb}
    reqs = [{**REQUESTS["video"](image_files, frames), **GEN}, {**REQUESTS["mixed"](image_files, frames), **GEN},
            {**embeds, **GEN}]
    results = engine.generate([mmzoo.Request(**r) for r in reqs])
    assert [r.graphs_compiled_after_warmup for r in results] == [0, 0, 0]
    assert results[0].token_ids == references["video"]["tokens"]
    assert results[1].token_ids == results[2].token_ids == references["mixed"]["tokens"]
    assert results[2].prompt_token_ids == references["mixed"]["ids"]


def test_deepstack_rows_matter_and_their_width_is_checked(qwen3_vl_ckpt, references, image_files, frames):
    """Embeddings mode: the DeepStack columns zeroed move the logits (the LM adds them after its
    first layers); rows of the LM's width alone are refused, naming the width wanted."""
    engine = parity.engine(qwen3_vl_ckpt, "eager")
    emb = engine.encode(images=image_files[:2])
    dim = engine.hidden_size
    full = engine.prepare(mmzoo.Request(prompt="Compare them.", **emb))
    flat = engine.prepare(mmzoo.Request(prompt="Compare them.", image_embeds=torch.cat(
        [emb["image_embeds"][:, :dim], torch.zeros_like(emb["image_embeds"][:, dim:])], -1),
        image_grid_thw=emb["image_grid_thw"]))
    gap = np.abs(engine.executor.prompt_logits(full) - engine.executor.prompt_logits(flat)).max()
    assert gap > 1e-2
    with pytest.raises(MmzooError, match=rf"image_embeds has {dim} columns but Qwen3-VL's image rows are {3 * dim} "
                                         rf"wide: the LM's hidden size {dim} .* 2 DeepStack levels"):
        engine.prepare(mmzoo.Request(prompt="x", image_embeds=emb["image_embeds"][:, :dim],
                                     image_grid_thw=emb["image_grid_thw"]))


def test_token_prompts(qwen3_vl_ckpt, references, image_files, frames):
    """A token prompt's image placeholder is expanded to its item; a video's must come as the
    processor writes it (its steps' runs apart, timestamps between them): then transformers'
    tokens, else refused by count."""
    engine = parity.engine(qwen3_vl_ckpt, "eager")
    ref = references["video"]
    result = engine.generate(mmzoo.Request(prompt_token_ids=ref["ids"], videos=[frames], **GEN))
    assert result.token_ids == ref["tokens"]
    vid = engine.family.video_token_id
    short = [t for i, t in enumerate(ref["ids"]) if t != vid or ref["ids"][i - 1] != vid]  # one token per run
    with pytest.raises(MmzooError, match=r"prompt_token_ids has 2 video placeholder tokens but the 1 videos give 32 "
                                         r"\(\[32\]\); Qwen3-VL writes each temporal step"):
        engine.prepare(mmzoo.Request(prompt_token_ids=short, videos=[frames]))
    mixed = references["mixed"]["ids"]
    img = engine.family.image_token_id
    one = [t for i, t in enumerate(mixed) if t != img or mixed[i - 1] != img]  # each image's run as one token
    prepared = engine.prepare(mmzoo.Request(prompt_token_ids=one, images=image_files[:2], videos=[frames]))
    assert prepared.input_ids.tolist() == mixed


def test_server_chat_matches_transformers(qwen3_vl_ckpt, image_files):
    """The OpenAI server (in process): a chat with two images gives transformers' prompt length and
    tokens (the DeepStack rows through the server's path too)."""
    ref = parity.reference(qwen3_vl_ckpt, "Qwen3VLForConditionalGeneration", "image", image_files, [2], "Compare them.",
                           new_tokens=8)[2]
    engine = parity.engine(qwen3_vl_ckpt, "eager")
    prompt_tokens, tokens = parity.served_chat(engine, image_files[:2], "Compare them.", 8)
    assert prompt_tokens == len(ref["ids"]) and tokens == ref["tokens"]


def test_grid_weights_stay_float32_in_a_bfloat16_run(qwen3_vl_ckpt, image_files):
    """In a bfloat16 run the patches reach the tower in bfloat16 and the host's position-grid weights
    in float32 (transformers keeps them float32 too), on both executors; the XLA warmup's blank
    inputs carry the same dtypes, so nothing compiles after it."""
    seen = {}
    for executor in ("eager", "xla"):
        xla = {"warmup": "needed", "compile": {"on_recompile": "error"},
               "buckets": {"min_encoder_rows": 64, "max_encoder_rows": 64}} if executor == "xla" else {}
        engine = mmzoo.load(qwen3_vl_ckpt, executor=executor, dtype="bfloat16", max_model_len=256, progress=False,
                            **xla)
        encoder = engine.model.towers["vision"].encoder
        hook = encoder.register_forward_hook(
            lambda module, args, kwargs, out: seen.__setitem__(executor, {k: v.dtype for k, v in kwargs.items()}),
            with_kwargs=True)
        result = engine.generate(mmzoo.Request(prompt="What is this?", images=image_files[:1], max_new_tokens=2))
        hook.remove()
        assert result.error is None and result.graphs_compiled_after_warmup == 0
    assert set(seen) == {"eager", "xla"}
    for dtypes in seen.values():
        assert dtypes["interp_weights"] == torch.float32 and dtypes["patches"] == torch.bfloat16
