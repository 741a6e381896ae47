"""The tiny checkpoint builder: what it writes loads back in transformers and behaves like Qwen2-VL."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

from mmzoo.fixtures import SPECIAL_TOKENS, chat_template, make_image, make_tiny_qwen2_vl, train_tokenizer

TWO_IMAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                           {"type": "text", "text": "Describe this image."}]}]
SYSTEM = "<|im_start|>system\nYou describe images and answer questions.<|im_end|>\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _tensors(ckpt) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(p.name for p in ckpt.glob("*.safetensors")):
        with safe_open(ckpt / name, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def processor(qwen2_vl_ckpt):
    return AutoProcessor.from_pretrained(qwen2_vl_ckpt)


@pytest.fixture(scope="module")
def model(qwen2_vl_ckpt):
    return Qwen2VLForConditionalGeneration.from_pretrained(qwen2_vl_ckpt, dtype=torch.float32).eval()


def test_config_ids_and_sizes_match_the_tokenizer(qwen2_vl_ckpt, processor):
    cfg = json.loads((qwen2_vl_ckpt / "config.json").read_text())
    gen = json.loads((qwen2_vl_ckpt / "generation_config.json").read_text())
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert sorted(ids.values()) == list(range(len(tok) - len(SPECIAL_TOKENS), len(tok)))
    assert (cfg["image_token_id"], cfg["video_token_id"]) == (ids["<|image_pad|>"], ids["<|video_pad|>"])
    assert (cfg["vision_start_token_id"], cfg["vision_end_token_id"]) == (ids["<|vision_start|>"],
                                                                          ids["<|vision_end|>"])
    tc, vc = cfg["text_config"], cfg["vision_config"]
    assert (tc["eos_token_id"], tc["pad_token_id"], tc["bos_token_id"]) == (
        ids["<|im_end|>"], ids["<|endoftext|>"], ids["<|endoftext|>"])
    assert gen["eos_token_id"] == ids["<|im_end|>"] == tok.eos_token_id
    assert tok.pad_token_id == ids["<|endoftext|>"] and tok.bos_token is None
    assert tc["vocab_size"] >= len(tok) and tc["vocab_size"] % 64 == 0
    head_dim = tc["hidden_size"] // tc["num_attention_heads"]
    assert sum(tc["rope_parameters"]["mrope_section"]) == head_dim // 2
    assert vc["hidden_size"] == tc["hidden_size"] and cfg["tie_word_embeddings"] is False


def test_weights_use_the_hub_key_names(qwen2_vl_ckpt):
    keys = set(_tensors(qwen2_vl_ckpt))
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
    assert "visual.patch_embed.proj.weight" in keys and "visual.merger.mlp.2.weight" in keys
    assert "model.layers.1.self_attn.q_proj.bias" in keys and "visual.blocks.1.attn.qkv.weight" in keys
    assert not any(k.startswith(("model.visual.", "model.language_model.")) for k in keys)


def test_tokenizer_round_trips_and_keeps_special_tokens_whole(qwen2_vl_ckpt):
    tok = AutoTokenizer.from_pretrained(qwen2_vl_ckpt)
    text = "What shape is this? A red circle. Ünïcödé ✓ 12345\n\tzebra"
    assert tok.decode(tok(text)["input_ids"]) == text
    ids = tok("<|im_start|>user\n" + IMAGE + "hi<|im_end|>")["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[0] == "<|im_start|>" and pieces[-1] == "<|im_end|>"
    assert pieces[pieces.index("<|vision_start|>"):][:3] == ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    a, b = train_tokenizer(), train_tokenizer()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_chat_template_renders_the_qwen2_vl_format(processor):
    text = processor.apply_chat_template(TWO_IMAGES, tokenize=False, add_generation_prompt=True)
    assert text == (SYSTEM + "<|im_start|>user\n" + IMAGE + IMAGE + "Describe this image.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
             {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "and this?"}]}]
    assert processor.apply_chat_template(convo, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>and this?<|im_end|>\n")
    bare = processor.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=chat_template(None),
                                         tokenize=False, add_generation_prompt=True)
    assert bare == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_processor_expands_image_placeholders(processor):
    text = processor.apply_chat_template(TWO_IMAGES, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[make_image(28, 28, 0), make_image(112, 84, 1)], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 2], [1, 6, 8]]  # native sizes: not resized
    assert tuple(inputs["pixel_values"].shape) == (4 + 48, 3 * 2 * 14 * 14)
    ids, types = inputs["input_ids"][0], inputs["mm_token_type_ids"][0]
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((ids == image_id).sum()) == (4 + 48) // 4
    assert torch.equal(types == 1, ids == image_id) and not bool((types == 2).any())


def test_generate_runs_and_is_deterministic(processor, model):
    text = processor.apply_chat_template(TWO_IMAGES, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[make_image(56, 56, 0), make_image(84, 56, 1)], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        again = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        logits = model(**inputs).logits[0, -1]
    new = out[0, inputs["input_ids"].shape[1]:]
    assert 1 <= len(new) <= 8 and torch.equal(out, again)
    assert int(new.max()) < len(processor.tokenizer)  # the zeroed padding rows never win
    top2 = logits.topk(2).values
    assert float(logits.std()) > 0.1 and float(top2[0] - top2[1]) > 1e-4  # far from uniform


def test_same_seed_same_weights_other_seed_differs(qwen2_vl_ckpt, tmp_path):
    ref = _tensors(qwen2_vl_ckpt)
    same = _tensors(make_tiny_qwen2_vl(tmp_path / "same", seed=0))
    other = make_tiny_qwen2_vl(tmp_path / "other", seed=1)
    assert same.keys() == ref.keys() and all(torch.equal(same[k], ref[k]) for k in ref)
    diff = _tensors(other)
    assert not torch.equal(diff["model.layers.0.mlp.up_proj.weight"], ref["model.layers.0.mlp.up_proj.weight"])
    assert (other / "tokenizer.json").read_text() == (qwen2_vl_ckpt / "tokenizer.json").read_text()
    assert not torch.equal(ref["model.norm.weight"], torch.ones_like(ref["model.norm.weight"]))
    assert ref["visual.blocks.0.attn.qkv.bias"].abs().min() > 0  # biases are drawn, not zero


def test_tied_and_sharded_checkpoint_loads(tmp_path):
    ckpt = make_tiny_qwen2_vl(tmp_path / "tied", tie_word_embeddings=True, max_shard_size="100KB")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "lm_head.weight" not in index["weight_map"]
    model = Qwen2VLForConditionalGeneration.from_pretrained(ckpt)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("kwargs", [{"mrope_section": (2, 2, 2)}, {"num_heads": 3}, {"num_kv_heads": 3},
                                    {"vision_num_heads": 4, "vision_embed_dim": 24}])
def test_inconsistent_sizes_are_refused(tmp_path, kwargs):
    with pytest.raises(ValueError):
        make_tiny_qwen2_vl(tmp_path / "bad", **kwargs)


def test_make_image_is_deterministic_and_not_constant():
    a, b, c = make_image(84, 56, seed=3), make_image(84, 56, seed=3), make_image(84, 56, seed=4)
    assert a.size == (84, 56) and a.mode == "RGB"
    arr = np.asarray(a)
    assert np.array_equal(arr, np.asarray(b)) and not np.array_equal(arr, np.asarray(c))
    assert arr.std() > 10 and len(np.unique(arr.reshape(-1, 3), axis=0)) > 10
