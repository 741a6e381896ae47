"""The family contract is closed: a new family is its own files alone, and every family honours the contract.

A throwaway family, ``mini_llava`` (a Llava-like variant: a CLIP ViT read at its last layer, the MLP
projector and a Qwen2 LM, LLaVA-Interleave style, under its own model name and config.json
architecture), is added as a user would add one, without touching mmzoo: its conf file in a
temporary conf dir, its family class and its tiny checkpoint builder defined here (transformers'
``save_pretrained`` on a tiny ``LlavaConfig``). It is discovered by the tools' discovery
(:func:`mmzoo.fixtures.families`), composes from its checkpoint's architecture, loads, and generates
the tokens of transformers' own class on both executors.

Then the contract every family of the zoo declares (and the new one inherits): its encoder is an
:class:`mmzoo.encoders.Encoder` whose ``rows_per_item`` and ``rotary_input`` say what the tower does,
and :meth:`~mmzoo.models.Family.embeds_items` counts the items of its own embeddings files.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import mmzoo
import parity
from mmzoo import embeds_file
from mmzoo.encoders import Encoder
from mmzoo.errors import MmzooError
from mmzoo.fixtures import families, tiny_checkpoint_builder
from mmzoo.layers import Rotary
from mmzoo.models import Llava
from parity import EXECUTORS, GEN, XLA

NAME, ARCH = "mini_llava", "MiniLlavaForConditionalGeneration"
PROMPT = "What shape is this?"
FAMILIES = families()  # the zoo's own, discovered from conf/model


class MiniLlava(Llava):
    """The new family's class: Llava's own code (placeholders, pixels, weight names), with its own
    declarations: its transformers reference and its tiny checkpoint builder (defined below)."""

    hf_class = "LlavaForConditionalGeneration"
    tiny_checkpoint = f"{__name__}.make_tiny_mini_llava"


def make_tiny_mini_llava(path: str | Path, *, seed: int = 0, image_size: int = 28) -> Path:
    """The new family's tiny checkpoint: a 2-block CLIP ViT at ``image_size`` px (patch 14: 4 tokens
    per image at 28 px), a 2-layer Qwen2 LM and a Llava processor, saved by transformers; config.json
    then names the family's own architecture (transformers reads its ``model_type``, llava)."""
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    from mmzoo.fixtures import LLAVA_IMAGE_TOKEN, llava_chat_template, tokenizer_with
    from mmzoo.fixtures.common import finish, lm_config

    path = Path(path)
    tokenizer = tokenizer_with((LLAVA_IMAGE_TOKEN,), seed=0, vocab_size=768)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (LLAVA_IMAGE_TOKEN, "<|im_end|>", "<|endoftext|>")}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    config = LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_channels=3, image_size=image_size, patch_size=14,
                           hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=32, initializer_range=0.1),
        text_config=lm_config(tokenizer, model_type="qwen2", eos=eos, pad=pad, rope_theta=1_000_000.0, init_std=0.1,
                              vocab_multiple=64, max_position_embeddings=1024),
        image_token_index=ids[LLAVA_IMAGE_TOKEN], image_seq_length=(image_size // 14) ** 2,
        projector_hidden_act="gelu", vision_feature_layer=-1, vision_feature_select_strategy="default",
    )
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    finish(model, tokenizer, seed=seed, std=0.1, eos=eos, pad=pad)
    model.save_pretrained(path)
    LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": image_size},
                                                      crop_size={"height": image_size, "width": image_size}),
                   tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, image_token=LLAVA_IMAGE_TOKEN,
                   chat_template=llava_chat_template()).save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "architectures": [ARCH]}, indent=2))
    return path


# its conf file: conf/model/llava.yaml's layout with fixed components (no from_checkpoint) and its own class
CONF = f"""\
defaults:
  - /encoder@encoder: clip_vit
  - /adapter@adapter: mlp_projector
  - /lm@lm: qwen2
  - _self_

name: {NAME}
architectures: [{ARCH}]

family:
  _target_: {__name__}.MiniLlava
  name: ${{..name}}
  image_token_id: ${{hf:image_token_id}}
  image_size: ${{..encoder.image_size}}
  patch_size: ${{..encoder.patch_size}}
  in_channels: ${{..encoder.in_channels}}
  select_strategy: ${{..encoder.select_strategy}}
  num_layers: ${{..encoder.num_layers}}
  feature_layer: ${{..encoder.feature_layer}}

encoder:
  image_size: ${{hf:vision_config.image_size}}
  patch_size: ${{hf:vision_config.patch_size}}
  in_channels: ${{hf:vision_config.num_channels}}
  embed_dim: ${{hf:vision_config.hidden_size}}
  num_layers: ${{hf:vision_config.num_hidden_layers}}
  num_heads: ${{hf:vision_config.num_attention_heads}}
  intermediate_dim: ${{hf:vision_config.intermediate_size}}
  act: ${{hf:vision_config.hidden_act}}
  feature_layer: ${{hf:vision_feature_layer}}
  select_strategy: ${{hf:vision_feature_select_strategy}}
  norm_eps: ${{hf:vision_config.layer_norm_eps}}

adapter:
  in_dim: ${{..encoder.embed_dim}}
  act: ${{hf:projector_hidden_act}}

lm:
  vocab_size: ${{hf:text_config.vocab_size}}
  dim: ${{hf:text_config.hidden_size}}
  num_layers: ${{hf:text_config.num_hidden_layers}}
  num_heads: ${{hf:text_config.num_attention_heads}}
  num_kv_heads: ${{hf:text_config.num_key_value_heads}}
  head_dim: ${{hf:text_config.head_dim,null}}
  intermediate_dim: ${{hf:text_config.intermediate_size}}
  rope_theta: ${{hf:text_config.rope_parameters.rope_theta}}
  rope_type: ${{hf:text_config.rope_parameters.rope_type,default}}
  norm_eps: ${{hf:text_config.rms_norm_eps}}
  act: ${{hf:text_config.hidden_act}}
  tie_word_embeddings: ${{hf:tie_word_embeddings,false}}
  layer_types: ${{hf:text_config.layer_types,null}}
  sliding_window: ${{hf:text_config.sliding_window,null}}
"""


@pytest.fixture(scope="module")
def conf_dir(tmp_path_factory):
    """A user's conf dir holding the new family's conf file, its only file outside this module."""
    root = tmp_path_factory.mktemp("new_family_conf")
    (root / "model").mkdir()
    (root / "model" / f"{NAME}.yaml").write_text(CONF)
    return root


@pytest.fixture(scope="module")
def ckpt(conf_dir, tmp_path_factory):
    """Its tiny checkpoint, built as the tools build any family's: through the discovery."""
    return families(config_dir=conf_dir)[NAME].build(tmp_path_factory.mktemp("new_family") / NAME)


def test_discovered_as_the_zoo_is(conf_dir):
    found = families(config_dir=conf_dir)
    assert set(found) == set(FAMILIES) | {NAME}  # the zoo's families, and the new one beside them
    new = found[NAME]
    assert new.cls is MiniLlava and new.make is make_tiny_mini_llava and new.media == "image"
    assert NAME not in FAMILIES  # the zoo itself is unchanged
    # where the conftest fixtures and the benchmark look a family's builder up: its dotted path resolves there too
    assert tiny_checkpoint_builder(MiniLlava) is make_tiny_mini_llava
    nowhere = type("Nowhere", (MiniLlava,), {"tiny_checkpoint": "mmzoo.fixtures.nowhere.make"})
    with pytest.raises(MmzooError, match="no tiny checkpoint builder at 'mmzoo.fixtures.nowhere.make'"):
        tiny_checkpoint_builder(nowhere)


def test_composes_from_its_checkpoint(conf_dir, ckpt):
    """config.json's architecture picks the new family's conf file; its sizes come from the checkpoint."""
    assert json.loads((ckpt / "config.json").read_text())["architectures"] == [ARCH]
    cfg = mmzoo.compose(values={"checkpoint": str(ckpt)}, config_dir=conf_dir)
    model = cfg.model
    assert model.name == NAME and model.family._target_.endswith(".MiniLlava")
    assert (model.encoder._target_, model.adapter._target_, model.lm._target_) == (
        "mmzoo.encoders.clip_vit", "mmzoo.adapters.mlp_projector", "mmzoo.lms.qwen2")
    assert (model.encoder.num_layers, model.encoder.image_size, model.lm.dim, model.lm.num_layers) == (2, 28, 64, 2)


@pytest.fixture(scope="module")
def reference(ckpt, image_files):
    """transformers' own class (the family's ``hf_class``) on the checkpoint: 0 and 3 images."""
    return parity.reference(ckpt, MiniLlava.hf_class, "image", image_files, [0, 3], PROMPT)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_generates_as_transformers(conf_dir, ckpt, image_files, reference, executor):
    """Loads by its architecture alone and matches transformers: prompt ids, prefill logits (fp32,
    atol 1e-4) and 16 greedy tokens, with and without images (3 images: the XLA tower pads to 4)."""
    engine = mmzoo.load(ckpt, executor=executor, config_dir=conf_dir, max_model_len=256,
                        **(XLA if executor == "xla" else {}))
    assert engine.name == NAME and type(engine.family) is MiniLlava
    assert isinstance(engine.model.towers["vision"].encoder, Encoder)
    for n, ref in reference.items():
        req = {"prompt": PROMPT, "images": image_files[:n]}
        prepared = engine.prepare(mmzoo.Request(**req))
        assert prepared.input_ids.tolist() == ref["ids"]
        np.testing.assert_allclose(engine.executor.prompt_logits(prepared), ref["logits"], atol=1e-4, rtol=0)
        result = engine.generate(mmzoo.Request(**req, **GEN))
        assert result.token_ids == ref["tokens"] and result.finish_reason == "length", n


# ---------------------------------------------------------------- the contract, for every family of the zoo

def _built(ckpt):
    """``(family, modules)`` for ``ckpt``, seeded random weights (the contract is about shapes)."""
    from mmzoo.engine import build_model

    return build_model(mmzoo.compose(values={"checkpoint": str(ckpt)}))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_encoder_declares_what_its_tower_does(tiny_checkpoints, name):
    """The encoder is an Encoder: ``rows_per_item`` is the rows one input item gives (2 dummy items
    -> twice as many), ``rotary_input`` names a forward input read by its ``rotary``; the inputs the
    adapter takes (``Tower.adapter_inputs``) are not the encoder's."""
    family, model = _built(tiny_checkpoints[name])
    tower = model.towers[family.tower]
    encoder = tower.encoder
    assert isinstance(encoder, Encoder)
    inputs = {k: torch.as_tensor(v) for k, v in family.dummy_media(2).inputs.items() if k not in tower.adapter_inputs}
    with torch.no_grad():
        rows = encoder(**inputs).shape[0]  # [rows, out_dim]
    if encoder.rows_per_item is not None:
        assert rows == 2 * encoder.rows_per_item
    if encoder.rotary_input is not None:
        assert encoder.rotary_input in inspect.signature(encoder.forward).parameters
        assert isinstance(encoder.rotary, Rotary)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_embeds_items_counts_its_own_embeddings_files(request, tiny_checkpoints, tmp_path, name):
    """What the server asks of a family: the items of each kind an embeddings file (``mmzoo.encode``'s
    output) holds, so that a chat request gets one placeholder per item."""
    kind = FAMILIES[name].media
    engine = parity.engine(tiny_checkpoints[name], "eager")
    files = request.getfixturevalue(f"{kind}_files")
    for n in (1, 2):
        embeds_file.write(tmp_path / "emb.safetensors", engine.encode(**{f"{kind}s": files[:n]}),
                          engine.embeds_metadata())
        tensors, _ = embeds_file.read(tmp_path / "emb.safetensors")
        assert engine.family.embeds_items(tensors, kind) == n
        assert all(engine.family.embeds_items(tensors, other) == 0 for other in ("image", "video", "audio")
                   if other != kind)


def test_an_encoder_outside_the_contract_is_refused_at_build():
    with pytest.raises(MmzooError, match=r"model\.encoder builds a Identity, not an mmzoo\.encoders\.Encoder"):
        mmzoo.load(None, executor="eager", overrides=["model.encoder._target_=torch.nn.Identity"])
