"""Gemma 3's own tests (token parity on every executor and backend is tests/test_parity.py): the
framed prompt and pixels against transformers' processor, the image tokens' two-way attention (it
matters, and it is transformers' mask), the weight names of both layouts, token prompts, embeddings
mode, no windowed prefill graphs on XLA, the server, the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmzoo
import parity
from mmzoo.errors import MmzooError
from mmzoo.models import Gemma3
from mmzoo.models.composition import token_runs
from parity import GEN

PROMPT = "Compare the two pictures please."


def test_prompt_and_pixels_match_the_processor(gemma3_ckpt, image_files):
    """``<start_of_image>`` becomes the processor's ``\\n\\n<start_of_image>`` + soft tokens +
    ``<end_of_image>\\n\\n``; the pixels are its image processor's."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(gemma3_ckpt)
    engine = parity.engine(gemma3_ckpt, "eager")
    prepared = engine.prepare(mmzoo.Request(prompt=PROMPT, images=image_files[:2]))
    content = [{"type": "image"}] * 2 + [{"type": "text", "text": PROMPT}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    want = processor(text=[chat], images=[Image.open(f).convert("RGB") for f in image_files[:2]], return_tensors="np")
    assert prepared.input_ids.tolist() == want["input_ids"][0].tolist()
    np.testing.assert_array_equal(prepared.media[0].inputs["pixel_values"], want["pixel_values"])
    soft = prepared.input_ids == engine.family.image_token_id
    assert soft.sum() == 8 and (prepared.mm_index >= 0).sum() == 8  # 4 tokens per image
    np.testing.assert_array_equal(soft, want["token_type_ids"][0] == 1)  # transformers' two-way tokens


def test_token_runs_are_transformers_blocks():
    """The runs the composition hands the backends are transformers' ``get_block_sequence_ids_for_mask``."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    types = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0, 1], [1, 1, 0, 1, 0, 0, 0, 0, 1, 1]])
    assert torch.equal(token_runs(types == 1), get_block_sequence_ids_for_mask(types))


def test_image_tokens_attend_both_ways(gemma3_ckpt, image_files):
    """The two-way attention of each image's tokens changes the prompt's logits (so the parity
    tests see it); without it they move by far more than parity's tolerance."""
    engine = mmzoo.load(gemma3_ckpt, executor="eager", max_model_len=256)
    assert engine.model.bidirectional_token == engine.family.image_token_id
    prepared = engine.prepare(mmzoo.Request(prompt=PROMPT, images=image_files[:2]))
    both = engine.executor.prompt_logits(prepared)
    engine.model.bidirectional_token = None
    causal = engine.executor.prompt_logits(prepared)
    assert np.abs(both - causal).max() > 1e-2


def test_weight_names_of_both_layouts(gemma3_ckpt):
    """The hub's tensor names (what save_pretrained writes) and transformers 5's module names map to
    the same tensors, one per parameter of the composition (the LM head tied to the embedding)."""
    from safetensors.torch import load_file

    from mmzoo.engine import build_model

    family, model = build_model(mmzoo.compose(values={"checkpoint": str(gemma3_ckpt)}))
    hub = load_file(gemma3_ckpt / "model.safetensors")
    assert "multi_modal_projector.mm_input_projection_weight" in hub
    v5 = {("model." + k if k.startswith(("vision_tower.", "multi_modal_projector.")) else
           "model.language_model." + k[len("language_model.model."):] if k.startswith("language_model.model.") else
           k): v for k, v in hub.items()}
    a, b = family.convert_weights(hub), family.convert_weights(v5)
    params = dict(model.named_parameters())
    assert sorted(a) == sorted(b) == sorted(params)
    assert all(torch.equal(a[k], b[k]) and a[k].shape == params[k].shape for k in a)
    torch.testing.assert_close(a["lm.layers.0.post_attn_norm.weight"],
                               hub["language_model.model.layers.0.post_attention_layernorm.weight"])
    torch.testing.assert_close(a["lm.layers.0.norm2.weight"],
                               hub["language_model.model.layers.0.pre_feedforward_layernorm.weight"])


@pytest.mark.parametrize("executor", parity.EXECUTORS)
def test_image_embeds_and_token_prompts_match_raw_images(gemma3_ckpt, image_files, executor):
    """Embeddings mode (image_embeds from mmzoo.encode) gives the raw images' tokens; so do token
    prompts with the whole run of soft tokens, or one per image inside its framing."""
    engine = parity.engine(gemma3_ckpt, executor, **parity.XLA)
    emb = parity.engine(gemma3_ckpt, "eager").encode(images=image_files[:2])
    assert list(emb["image_embeds"].shape) == [8, 64]
    raw = engine.generate(mmzoo.Request(prompt=PROMPT, images=image_files[:2], **GEN))
    via = engine.generate(mmzoo.Request(prompt=PROMPT, image_embeds=emb["image_embeds"], **GEN))
    assert via.token_ids == raw.token_ids and via.prompt_token_ids == raw.prompt_token_ids
    ids = raw.prompt_token_ids
    assert engine.generate(mmzoo.Request(prompt_token_ids=ids, images=image_files[:2], **GEN)).token_ids == \
        raw.token_ids
    pad = engine.family.image_token_id
    collapsed = [t for i, t in enumerate(ids) if t != pad or ids[i - 1] != pad]
    assert engine.generate(mmzoo.Request(prompt_token_ids=collapsed, images=image_files[:2], **GEN)).token_ids == \
        raw.token_ids


def test_no_windowed_prefill(gemma3_ckpt):
    """A window cannot show an image token its run's later tokens, so the XLA executor gives Gemma 3
    no windowed prefill graphs (auto), where the same bucket options give a causal family windows,
    and refuses to be told to. (Its warmup compiling everything its requests run, 0 graphs after,
    is checked with the other families' in tests/test_sharding.py.)"""
    engine = parity.engine(gemma3_ckpt, "xla", **parity.XLA)
    assert isinstance(engine.family, Gemma3) and engine.executor.buckets.windows == {}
    spec, exe = engine.executor.bucket_spec, engine.executor
    kw = dict(max_model_len=256, max_batch=8, max_prefill_tokens=exe.max_prefill_tokens, cpu_alone=True, mesh=False,
              towers={t: m.encoder for t, m in engine.model.towers.items()},
              lm_backends=[engine.model.lm.layers[0].attn.attn_fn])
    assert spec.resolve(**kw).windows  # 8 slots: the larger prefill buckets have windows for a causal family
    assert spec.resolve(**kw, family=engine.family).windows == {}
    with pytest.raises(MmzooError, match=r"windowed_prefill=true: model=gemma3's image tokens attend to their "
                                         r"whole run both ways"):
        mmzoo.load(gemma3_ckpt, executor="xla", max_model_len=64, warmup=False, progress=False,
                   buckets={"windowed_prefill": True})


def test_bad_input(gemma3_ckpt, image_files):
    emb = torch.zeros(6, 64)
    cases = [
        (dict(prompt="<start_of_image> what?", images=image_files[:1]),
         r"prompt contains the image placeholder '<start_of_image>'"),
        (dict(image_embeds=emb), r"image_embeds has 6 rows, not a multiple of the 4 tokens per image"),
        (dict(image_embeds=torch.zeros(8, 64), image_grid_thw=[[1, 2, 2]]),
         r"image_embeds has 8 rows but image_grid_thw \[\[1, 2, 2\]\] implies 4 \(views x 4 tokens per view\)"),
        (dict(image_embeds=torch.zeros(8, 64), image_grid_thw=[[2, 1, 4]]),
         r"image_grid_thw\[0\] = \[2, 1, 4\]: each view gives 2x2 tokens"),
        (dict(videos=[image_files[:2]]), r"model=gemma3 does not take videos"),
    ]
    parity.assert_refused(parity.engine(gemma3_ckpt, "eager"), cases, PROMPT, kind="image", files=image_files)


def test_server_chat_with_two_images_equals_transformers(gemma3_ckpt, image_files):
    """The OpenAI chat endpoint with two image_url parts answers transformers' greedy tokens for the
    same conversation (its images' tokens attending both ways there too)."""
    ref = parity.reference(gemma3_ckpt, "Gemma3ForConditionalGeneration", "image", image_files, [2], PROMPT,
                           new_tokens=8)[2]
    prompt_tokens, tokens = parity.served_chat(parity.engine(gemma3_ckpt, "eager"), image_files[:2], PROMPT, 8)
    assert prompt_tokens == len(ref["ids"]) and tokens == ref["tokens"]


def test_pan_and_scan_as_the_processor_does(tmp_path):
    """Gemma3Processor's image defaults turn pan-and-scan off even where preprocessor_config.json turns
    it on, and so does mmzoo (transformers' tokens for a wide image); views given as embeddings
    (``image_grid_thw`` ``[views, 2, 2]``: an image and its crops) take the processor's crop text, as
    its ``do_pan_and_scan=True`` writes it."""
    from PIL import Image
    from transformers import AutoProcessor

    from mmzoo.fixtures import make_image
    from mmzoo.fixtures.gemma3 import make_tiny_gemma3

    ckpt = make_tiny_gemma3(tmp_path / "pas", pan_and_scan=True)
    wide = str(tmp_path / "wide.png")
    make_image(200, 56, seed=5).save(wide)
    ref = parity.reference(ckpt, "Gemma3ForConditionalGeneration", "image", [wide], [1], PROMPT)[1]
    engine = parity.engine(ckpt, "eager")
    out = engine.generate(mmzoo.Request(prompt=PROMPT, images=[wide], **GEN))
    assert out.prompt_token_ids == ref["ids"] and out.token_ids == ref["tokens"]
    processor = AutoProcessor.from_pretrained(ckpt)
    content = [{"type": "image"}, {"type": "text", "text": PROMPT}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    want = processor(text=[chat], images=[Image.open(wide).convert("RGB")], do_pan_and_scan=True,
                     pan_and_scan_min_crop_size=16, return_tensors="np")
    views = int((want["input_ids"][0] == engine.family.image_token_id).sum()) // 4
    assert views > 2  # the wide image is cut into crops
    prepared = engine.prepare(mmzoo.Request(prompt=PROMPT, image_embeds=torch.zeros(views * 4, 64),
                                            image_grid_thw=[[views, 2, 2]]))
    assert prepared.input_ids.tolist() == want["input_ids"][0].tolist()
