"""Bad checkpoints, config.json values, tokenizers, embeddings files and media files (issue 21 and
the loaders' review): each is refused where it enters with one :class:`MmzooError` naming the file
or field and the numbers, never another exception, and never taken silently."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import nn

import mmzoo
from mmzoo import embeds_file
from mmzoo.checkpoint import load_strict
from mmzoo.errors import MmzooError
from mmzoo.fixtures import make_audio, make_image, write_wav
from mmzoo.models._media import MAX_ASPECT_RATIO, MAX_IMAGE_PIXELS, MIN_IMAGE_SIDE, load_audios

PROMPT = "What is this?"


# ----------------------------------------------------------------------------- checkpoints

def _halve(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _index(content):
    def write(ckpt: Path) -> None:  # the index wins over model.safetensors
        text = content if isinstance(content, str) else json.dumps(content)
        (ckpt / "model.safetensors.index.json").write_text(text)
    return write


def _architecture(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))


CHECKPOINTS = {
    "no_config": (lambda c: (c / "config.json").unlink(), r"checkpoint .*/ckpt has no config\.json$"),
    "config_not_json": (lambda c: (c / "config.json").write_text('{"architectures": '),
                        r"ckpt/config\.json is not valid JSON \(Expecting value: line 1 column 19"),
    "config_not_utf8": (lambda c: (c / "config.json").write_bytes(b"\xff\xfe{}"),
                        r"ckpt/config\.json is not valid JSON \(.*can't decode byte 0xff"),
    "config_a_list": (lambda c: (c / "config.json").write_text("[1, 2]"),
                      r"ckpt/config\.json is not a JSON object \(it holds a list\)"),
    "truncated_safetensors": (lambda c: _halve(c / "model.safetensors"),
                              r"checkpoint file .*ckpt/model\.safetensors is not a readable safetensors file "
                              r"\(.*incomplete metadata, file not fully covered\): it may be truncated or corrupt"),
    "garbage_safetensors": (lambda c: (c / "model.safetensors").write_bytes(b"x" * 100),
                            r"ckpt/model\.safetensors is not a readable safetensors file \(.*header too large\)"),
    "index_not_json": (_index("{weight_map"), r"ckpt/model\.safetensors\.index\.json is not valid JSON"),
    "index_no_weight_map": (_index({"metadata": {"total_size": 1}}),
                            r"model\.safetensors\.index\.json has no weight_map \(tensor name -> shard file name\)"),
    "index_weight_map_list": (_index({"weight_map": ["model.safetensors"]}),
                              r"index\.json: weight_map must map each tensor name to a shard file name, "
                              r"got \[\"model\.safetensors\"\]"),
    "index_weight_map_ints": (_index({"weight_map": {"lm_head.weight": 1}}),
                              r"weight_map must map each tensor name to a shard file name, got \{\"lm_head\.weight\": 1\}"),
    "index_shard_outside": (_index({"weight_map": {"lm_head.weight": "../model.safetensors"}}),
                            r"index\.json: tensor lm_head\.weight is in '\.\./model\.safetensors', outside the "
                            r"checkpoint directory"),
    "index_shard_absolute": (_index({"weight_map": {"lm_head.weight": "/etc/hostname"}}),
                             r"tensor lm_head\.weight is in '/etc/hostname', outside the checkpoint directory"),
    "index_shard_missing": (_index({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}),
                            r"checkpoint shard .*ckpt/model-00002-of-00002\.safetensors listed in "
                            r"model\.safetensors\.index\.json does not exist"),
    "unsupported_architecture": (_architecture, r"config\.json architecture 'LlamaForCausalLM' is not supported; "
                                                r"the zoo has .*llava .*qwen2_vl \(Qwen2VLForConditionalGeneration\)"),
}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_bad_checkpoint(qwen2_vl_ckpt, tmp_path, case):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(qwen2_vl_ckpt, ckpt)
    breaker, match = CHECKPOINTS[case]
    breaker(ckpt)
    with pytest.raises(MmzooError, match=match):
        mmzoo.load(ckpt, executor="eager")


class _Touch:
    """Unpickling this creates ``path``: the proof that a checkpoint was unpickled."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_pickle_checkpoint_is_refused_unread(qwen2_vl_ckpt, tmp_path):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "unpickled"
    shutil.copytree(qwen2_vl_ckpt, ckpt)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(_Touch(marker)))
    pickle.loads((ckpt / "pytorch_model.bin").read_bytes())  # the marker works...
    assert marker.exists()
    marker.unlink()
    with pytest.raises(MmzooError, match=r"ckpt has no model\.safetensors or model\.safetensors\.index\.json "
                                         r"\(found pytorch_model\.bin: pickle weights are not loaded; convert them"):
        mmzoo.load(ckpt, executor="eager")
    assert not marker.exists()  # ...and mmzoo never unpickled it


def test_another_family_checkpoint_is_refused(qwen2_vl_ckpt):
    with pytest.raises(MmzooError, match=r"config\.json is a Qwen2VLForConditionalGeneration checkpoint, which "
                                         r"model=llava does not support \(it takes LlavaForConditionalGeneration\)"):
        mmzoo.load(qwen2_vl_ckpt, model="llava", executor="eager")


@pytest.mark.parametrize("change, match", [
    ("missing", r"weights in ckpt do not match the model: missing 1 tensors: fc2\.bias$"),
    ("extra", r"weights in ckpt do not match the model: unexpected 2 tensors: extra, fc3\.weight$"),
    ("shape", r"shape mismatch \(checkpoint vs model\): fc1\.weight \(4, 3\) vs \(3, 4\)$"),
])
def test_strict_loading_names_each_tensor(change, match):
    module = nn.ModuleDict({"fc1": nn.Linear(4, 3), "fc2": nn.Linear(3, 2)})
    state = dict(module.state_dict())
    if change == "missing":
        del state["fc2.bias"]
    elif change == "extra":
        state["extra"], state["fc3.weight"] = state["fc2.bias"], state["fc2.weight"]
    else:
        state["fc1.weight"] = state["fc1.weight"].T
    with pytest.raises(MmzooError, match=match):
        load_strict(module, state, source="ckpt")


# ----------------------------------------------------------------------------- config.json values

def _json_edit(name: str, edit):
    """A breaker that loads ``name`` (JSON) from the checkpoint, lets ``edit`` change it, writes it back."""
    def breaker(ckpt: Path) -> None:
        data = json.loads((ckpt / name).read_text())
        edit(data)
        (ckpt / name).write_text(json.dumps(data))  # NaN and Infinity as Python's json writes them
    return breaker


def _walk(data: dict, path: str):
    *parents, key = path.split(".")
    for part in parents:
        data = data[part]
    return data, key


def _set(path: str, value, name: str = "config.json"):
    def edit(data):
        node, key = _walk(data, path)
        node[key] = value
    return _json_edit(name, edit)


def _drop(path: str, name: str = "config.json"):
    def edit(data):
        node, key = _walk(data, path)
        del node[key]
    return _json_edit(name, edit)


def _old_style_mrope(data: dict) -> None:  # transformers 4's rope_scaling, still read by 5
    del data["text_config"]["rope_parameters"]
    data["text_config"]["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 2]}


def _chunked_layers(data: dict) -> None:  # a layer type transformers knows and mmzoo's LMs do not have
    data["text_config"]["layer_types"] = ["full_attention", "chunked_attention"]


def _also(*breakers):
    def breaker(ckpt: Path) -> None:
        for b in breakers:
            b(ckpt)
    return breaker


CFG = r"ckpt/config\.json: "
# family -> damage -> (breaker, the message); every one used to load (with wrong output), or fail
# with a traceback, or name the wrong thing, before this check
CONFIG_VALUES = {
    "qwen2_vl": {
        "hidden_size_string": (_set("text_config.hidden_size", "64"),
                               CFG + r'text_config\.hidden_size="64" must be a positive integer$'),
        "hidden_size_negative": (_set("text_config.hidden_size", -64), CFG + r"text_config\.hidden_size=-64 must be"),
        "hidden_size_fraction": (_set("text_config.hidden_size", 64.5),
                                 r"hidden_size=64\.5 must be a positive integer"),
        "hidden_size_bool": (_set("text_config.hidden_size", True), r"hidden_size=true must be a positive integer"),
        "hidden_size_huge": (_set("text_config.hidden_size", 1 << 22),
                             r"hidden_size=4194304 is larger than any model's \(mmzoo takes at most 1048576\)$"),
        "hidden_size_not_heads_multiple": (_set("text_config.hidden_size", 63),
                                           CFG + r"text_config\.hidden_size=63 is not a multiple of "
                                                 r"num_attention_heads=4 \(and no head_dim is given\)$"),
        "heads_zero": (_set("text_config.num_attention_heads", 0), r"num_attention_heads=0 must be a positive integer"),
        "kv_heads_not_dividing": (_set("text_config.num_key_value_heads", 3),
                                  CFG + r"text_config\.num_key_value_heads=3 does not divide num_attention_heads=4$"),
        "vocab_size_string": (_set("text_config.vocab_size", "704"), r'vocab_size="704" must be a positive integer'),
        "layers_fraction": (_set("text_config.num_hidden_layers", 2.5), r"num_hidden_layers=2\.5 must be a positive"),
        "intermediate_negative": (_set("text_config.intermediate_size", -5),
                                  r"intermediate_size=-5 must be a positive"),
        "rms_norm_eps_negative": (_set("text_config.rms_norm_eps", -1e-6),
                                  CFG + r"text_config\.rms_norm_eps=-1e-06 must be a positive finite number$"),
        "rms_norm_eps_nan": (_set("text_config.rms_norm_eps", float("nan")),
                             r"rms_norm_eps=nan must be a positive finite"),
        "rope_theta_negative": (_set("text_config.rope_parameters.rope_theta", -1.0),
                                CFG + r"text_config\.rope_parameters\.rope_theta=-1\.0 must be a positive finite "
                                      r"number$"),
        "rope_theta_inf": (_set("text_config.rope_parameters.rope_theta", float("inf")), r"rope_theta=inf must be"),
        "rope_parameters_list": (_set("text_config.rope_parameters", [1]),
                                 r"text_config\.rope_parameters=\[1\] must be an object \(rope_theta, rope_type, "
                                 r"\.\.\.\)$"),
        "mrope_section_sum": (_set("text_config.rope_parameters.mrope_section", [2, 3, 2]),
                              CFG + r"text_config\.rope_parameters\.mrope_section=\[2, 3, 2\] sums to 7, but "
                                    r"head_dim/2 = 8 \(hidden_size=64 / num_attention_heads=4 / 2\)$"),
        "mrope_section_two_parts": (_set("text_config.rope_parameters.mrope_section", [2, 3]),
                                    r"mrope_section=\[2, 3\] must be 3 positive integers \(the rotary pairs of "
                                    r"the t, h, w position axes\)$"),
        "mrope_section_rope_scaling": (_json_edit("config.json", _old_style_mrope),
                                       r"text_config\.rope_scaling\.mrope_section=\[2, 3, 2\] sums to 7, but "
                                       r"head_dim/2 = 8"),
        "head_dim_zero": (_set("text_config.head_dim", 0),
                          r"text_config\.head_dim=0 must be a positive integer \(or null\)$"),
        "hidden_act_number": (_set("text_config.hidden_act", 3),
                              r"text_config\.hidden_act=3 must be a non-empty string$"),
        "chunked_attention_layers": (_json_edit("config.json", _chunked_layers),
                                     CFG + r"the text model's layers \[1\] are 'chunked_attention' \(layer_types\): "
                                           r"mmzoo's LMs have full_attention and sliding_attention layers$"),
        "dtype_garbage": (_set("dtype", "garbage"), CFG + r'dtype="garbage" is not a torch dtype; expected one of \['),
        "torch_dtype_number": (_set("torch_dtype", 5), CFG + r"torch_dtype=5 is not a torch dtype"),
        "architectures_string": (_set("architectures", "Qwen2VLForConditionalGeneration"),
                                 CFG + r'architectures="Qwen2VLForConditionalGeneration" must be a list of model class '
                                       r'names$'),
        "architectures_object": (_set("architectures", {"a": 1}), r'architectures=\{"a": 1\} must be a list'),
        "architectures_numbers": (_set("architectures", [1]),
                                  r"architectures=\[1\] must be a list of model class names"),
        "text_config_list": (_set("text_config", [1, 2]),
                             CFG + r"text_config must be an object of the text model's settings, got \[1, 2\]$"),
        "text_config_missing": (_drop("text_config"), r"ckpt/config\.json has no text_config \(nor the text model's "
                                                      r"hidden_size at the top, as the hub's Qwen2-VL configs "
                                                      r"have it\)$"),
        "vision_config_missing": (_drop("vision_config"),
                                  r"ckpt/config\.json has no vision_config \(the vision model's settings\); "
                                  r"transformers would fill in the defaults"),
        "vision_embed_dim_not_heads_multiple": (_set("vision_config.embed_dim", 33),
                                                CFG + r"vision_config\.embed_dim=33 is not a multiple of num_heads=2$"),
        "vision_head_dim_for_2d_rotary": (_set("vision_config.num_heads", 16),
                                          CFG + r"vision_config\.embed_dim=32 / num_heads=16 = 2: the ViT's 2-D rotary "
                                                r"needs a head dim divisible by 4$"),
        "vision_hidden_size": (_set("vision_config.hidden_size", 32),
                               CFG + r"vision_config\.hidden_size=32 \(the patch merger's output width\) differs from "
                                     r"the text model's hidden_size=64$"),
        "merge_size_zero": (_set("vision_config.spatial_merge_size", 0), r"spatial_merge_size=0 must be a positive"),
        "mlp_ratio_negative": (_set("vision_config.mlp_ratio", -1), r"vision_config\.mlp_ratio=-1 must be a positive"),
        "vision_rope_theta": (_set("vision_config.rope_parameters.rope_theta", -1),
                              r"vision_config\.rope_parameters\.rope_theta=-1 must be a positive finite number$"),
        "image_token_outside_vocab": (_set("image_token_id", 10 ** 9),
                                      CFG + r"image_token_id=1000000000 is not a token id of the vocabulary "
                                            r"\(text_config\.vocab_size=704\)$"),
        "image_token_negative": (_set("image_token_id", -1),
                                 CFG + r"image_token_id=-1 must be a token id \(an integer"),
        "image_token_not_the_tokenizers": (_set("image_token_id", 678),
                                           CFG + r"image_token_id=678, but the tokenizer's image placeholder "
                                                 r"'<\|image_pad\|>' is id 681$"),
        "video_token_same_as_image": (_set("video_token_id", 681),
                                      CFG + r"video_token_id=681 is also image_token_id; each placeholder needs "
                                            r"a token"),
        "video_token_missing": (_drop("video_token_id"),
                                CFG + r"video_token_id=151656 \(transformers' default: config\.json has none\) "
                                      r"is not a token id of the vocabulary"),
        "config_empty": (lambda c: (c / "config.json").write_text(""), r"ckpt/config\.json is not valid JSON"),
        "config_no_model_type": (_drop("model_type"),
                                 CFG + r"transformers cannot read this config \(Unrecognized model"),
    },
    "qwen2_5_vl": {
        "full_attention_block_past_depth": (_set("vision_config.fullatt_block_indexes", [1, 2]),
                                            CFG + r"vision_config\.fullatt_block_indexes=\[1, 2\]: 2 is not a block of "
                                                  r"the depth=2 ViT$"),
        "window_below_a_merged_unit": (_set("vision_config.window_size", 14),
                                       CFG + r"vision_config\.window_size=14 is below one merged unit \(patch_size=14 x "
                                             r"spatial_merge_size=2 = 28 px\)$"),
        "window_size_zero": (_set("vision_config.window_size", 0),
                             CFG + r"vision_config\.window_size=0 must be a positive integer$"),
        "tokens_per_second_negative": (_set("vision_config.tokens_per_second", -2),
                                       CFG + r"vision_config\.tokens_per_second=-2 must be a positive finite number$"),
        "merger_width": (_set("vision_config.out_hidden_size", 32),
                         CFG + r"vision_config\.out_hidden_size=32 \(the patch merger's output width\) differs from "
                               r"the text model's hidden_size=64$"),
        "vision_head_dim_for_2d_rotary": (_set("vision_config.num_heads", 16),
                                          CFG + r"vision_config\.hidden_size=32 / num_heads=16 = 2: the ViT's 2-D "
                                                r"rotary needs a head dim divisible by 4$"),
    },
    "qwen3_vl": {
        "position_grid_not_square": (_set("vision_config.num_position_embeddings", 15),
                                     CFG + r"vision_config\.num_position_embeddings=15 must be a square number \(the "
                                           r"learned position grid is side x side\)$"),
        "deepstack_tap_past_depth": (_set("vision_config.deepstack_visual_indexes", [0, 3]),
                                     CFG + r"vision_config\.deepstack_visual_indexes=\[0, 3\]: 3 is not a block of "
                                           r"the depth=3 ViT$"),
        "more_deepstack_levels_than_layers": (_set("vision_config.deepstack_visual_indexes", [0, 1, 2, 0]),
                                              CFG + r"4 DeepStack levels \(vision_config\.deepstack_visual_indexes\) "
                                                    r"but the text model has 3 layers to add them to$"),
        "merger_width": (_set("vision_config.out_hidden_size", 32),
                         CFG + r"vision_config\.out_hidden_size=32 \(the patch merger's output width\) differs from "
                               r"the text model's hidden_size=64$"),
    },
    "llava_onevision": {
        "vision_tower_not_siglip": (_set("vision_config.model_type", "clip_vision_model"),
                                    CFG + r"vision_config\.model_type='clip_vision_model': model=llava_onevision's "
                                          r"vision tower is SigLIP's \(siglip_vision_model\)$"),
        "select_strategy_default": (_set("vision_feature_select_strategy", "default"),
                                    CFG + r"vision_feature_select_strategy='default': SigLIP has no class token to "
                                          r"drop"),
        "aspect_ratio_unknown": (_set("vision_aspect_ratio", "anyres"),
                                 CFG + r"vision_aspect_ratio='anyres': mmzoo takes 'anyres_max_N'"),
        "pinpoint_not_whole_tiles": (_set("image_grid_pinpoints", [[56, 56], [56, 100]]),
                                     CFG + r"image_grid_pinpoints=\[\[56, 56\], \[56, 100\]\]: each must be "
                                           r"\[height, width\], multiples of vision_config\.image_size=56$"),
    },
    "llava": {
        "head_dim_odd": (_set("text_config.head_dim", 7),
                         CFG + r"text_config\.head_dim=7 is odd; rotary embeddings rotate pairs of channels$"),
        "text_config_missing": (_drop("text_config"),
                                r"ckpt/config\.json has no text_config \(the text model's settings"),
        "image_size_not_patch_multiple": (_set("vision_config.image_size", 57),
                                          CFG + r"vision_config\.image_size=57 is not a multiple of patch_size=14$"),
        "vision_width_not_heads_multiple": (_set("vision_config.hidden_size", 33),
                                            r"vision_config\.hidden_size=33 is not a multiple of "
                                            r"num_attention_heads=2"),
        "vision_tower_not_clip": (_set("vision_config.model_type", "siglip_vision_model"),
                                  CFG + r"vision_config\.model_type='siglip_vision_model': model=llava's vision "
                                        r"tower is CLIP's \(clip_vision_model\)$"),
        "vision_layers_fewer_than_the_weights": (_set("vision_config.num_hidden_layers", 1),
                                                 r"do not match the model: unexpected 32 tensors: "
                                                 r"towers\.vision\.encoder\.blocks\.1\."),
        "feature_layer_string": (_set("vision_feature_layer", "x"),
                                 CFG + r'vision_feature_layer="x" must be a layer index \(an integer\) or a non-empty '
                                       r'list of them$'),
        "feature_layer_empty_list": (_set("vision_feature_layer", []),
                                     r"vision_feature_layer=\[\] must be a layer index"),
        "image_token_index_outside_vocab": (_set("image_token_index", 704),
                                            CFG + r"image_token_index=704 is not a token id of the vocabulary"),
        "select_strategy": (_set("vision_feature_select_strategy", "foo"),
                            CFG + r"transformers cannot read this config \(Field 'vision_feature_select_strategy' "
                                  r"expected one of \('default', 'full'\), got foo\)$"),
    },
    "internvl": {
        "tile_not_square": (_set("vision_config.image_size", [56, 112]),
                            CFG + r"vision_config\.image_size=\[56, 112\]: model=internvl takes square tiles"),
        "image_size_pair_of_three": (_set("vision_config.image_size", [56, 56, 56]),
                                     CFG + r"vision_config\.image_size=\[56, 56, 56\] must be a positive integer or a "
                                           r"\[height, width\] pair of them$"),
        "downsample_ratio_not_a_reciprocal": (_set("downsample_ratio", 0.3),
                                              r"model\.adapter\.scale_factor: 0\.3 is not 1 / k for a positive "
                                              r"integer k"),
        "feature_layer_list": (_set("vision_feature_layer", [-1, -2]),
                               CFG + r"vision_feature_layer=\[-1, -2\]: InternVL reads one hidden layer"),
        "select_strategy_full": (_set("vision_feature_select_strategy", "full"),
                                 CFG + r"vision_feature_select_strategy='full': InternVL drops the class token"),
        "norm_type_unknown": (_set("vision_config.norm_type", "batch_norm"),
                              r"norm_type='batch_norm'; expected one of \['layer_norm', 'rms_norm'\]"),
        "tile_of_other_tokens_than_the_processor": (_set("vision_config.image_size", 112),
                                                    r"the processor's image_seq_length=4, but a tile gives 16 tokens "
                                                    r"\(\(image_size / patch_size / scale_factor\)\^2 = "
                                                    r"\(112 / 14 / 2\)\^2\)$"),
        "final_norm_missing": (_set("vision_config.use_mean_pooling", False),
                               r"missing .*towers\.vision\.encoder\.post_norm\.weight"),
    },
    "smolvlm": {
        "vision_tower_not_smolvlm": (_set("vision_config.model_type", "siglip_vision_model"),
                                     CFG + r"vision_config\.model_type='siglip_vision_model': model=smolvlm's vision "
                                           r"tower is one of \['smolvlm_vision', 'idefics3_vision'\]$"),
        "tile_not_square": (_set("vision_config.image_size", [56, 112]),
                            CFG + r"vision_config\.image_size=\[56, 112\]: model=smolvlm takes square tiles"),
        "tile_of_other_tokens_than_the_processor": (_set("vision_config.image_size", 112),
                                                    r"the processor's image_seq_len=4, but a tile gives 16 tokens"),
        "scale_factor_not_dividing_the_tile": (_set("scale_factor", 3),
                                               r"pixel shuffle scale_factor=3 does not divide the 4 patches per side"),
    },
    "gemma3": {
        "vision_tower_not_siglip": (_set("vision_config.model_type", "clip_vision_model"),
                                    CFG + r"vision_config\.model_type='clip_vision_model': model=gemma3's vision tower "
                                          r"is SigLIP \(siglip_vision_model\)$"),
        "tokens_per_image_not_pooling_the_grid": (_set("mm_tokens_per_image", 9),
                                                  r"mm_tokens_per_image=9 does not pool the 4 x 4 patches"),
        "boi_token_outside_vocab": (_set("boi_token_index", 5000),
                                    CFG + r"boi_token_index=5000 is not a token id of the vocabulary"),
        "attention_softcapping": (_set("text_config.attn_logit_softcapping", 50.0),
                                  r"attn_logit_softcapping=50\.0 is not supported"),
        "bidirectional_text_model": (_set("text_config.use_bidirectional_attention", True),
                                     CFG + r"text_config\.use_bidirectional_attention=true \(an embedding model\)"),
    },
    "qwen2_audio": {
        "tie_word_embeddings_string": (_set("tie_word_embeddings", "yes"),
                                       CFG + r'tie_word_embeddings="yes" must be true or false$'),
        "kv_heads_more_than_heads": (_set("text_config.num_key_value_heads", 8),
                                     r"text_config\.num_key_value_heads=8 does not divide num_attention_heads=4$"),
        "audio_width_not_heads_multiple": (_set("audio_config.d_model", 33),
                                           CFG + r"audio_config\.d_model=33 is not a multiple of "
                                                 r"encoder_attention_heads=2$"),
        "max_source_positions_huge": (_set("audio_config.max_source_positions", 1 << 21),
                                      r"audio_config\.max_source_positions=2097152 is larger than any model's"),
        "audio_token_string": (_set("audio_token_index", "684"),
                               CFG + r'audio_token_index="684" must be a token id \(an integer >= 0\)$'),
        "audio_config_missing": (_drop("audio_config"), r"ckpt/config\.json has no audio_config \(the audio model's"),
    },
}
CONFIG_CASES = [(family, case) for family, cases in CONFIG_VALUES.items() for case in cases]


def _damaged(source: Path, tmp_path: Path, breaker) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(source, ckpt)
    breaker(ckpt)
    return ckpt


@pytest.mark.parametrize("family, case", CONFIG_CASES, ids=[f"{f}-{c}" for f, c in CONFIG_CASES])
def test_bad_config_value(tiny_checkpoints, tmp_path, family, case):
    breaker, match = CONFIG_VALUES[family][case]
    ckpt = _damaged(tiny_checkpoints[family], tmp_path, breaker)
    with pytest.raises(MmzooError, match=match):
        mmzoo.load(ckpt, executor="eager")


@pytest.mark.parametrize("family", sorted(CONFIG_VALUES))
def test_an_undamaged_copy_loads(tiny_checkpoints, tmp_path, family):
    """The control of the tables here: the copy and the JSON round trip alone break nothing."""
    ckpt = _damaged(tiny_checkpoints[family], tmp_path, _json_edit("config.json", lambda data: None))
    assert len(mmzoo.load(ckpt, executor="eager").generate(PROMPT, max_new_tokens=2).token_ids) == 2


# ----------------------------------------------------------------------------- tokenizer, processor, generation config

def _token_past_the_vocab(ckpt: Path) -> None:
    data = json.loads((ckpt / "tokenizer.json").read_text())
    data["model"]["vocab"]["zzzz"] = 750  # the tiny LM has 704 rows
    (ckpt / "tokenizer.json").write_text(json.dumps(data))


def _renamed_placeholder(ckpt: Path) -> None:
    data = json.loads((ckpt / "tokenizer.json").read_text())
    for token in data["added_tokens"]:
        if token["content"] == "<|image_pad|>":
            token["content"] = "<|image_pad_renamed|>"
    (ckpt / "tokenizer.json").write_text(json.dumps(data))


def _drop_file(name: str):
    return lambda ckpt: (ckpt / name).unlink()


def _write(name: str, text: str):
    return lambda ckpt: (ckpt / name).write_text(text)


GEN = "generation_config.json"
PROCESSOR_FILES = {
    "tokenizer_missing": (_drop_file("tokenizer.json"),
                          r"checkpoint .*ckpt has no tokenizer \(one of tokenizer\.json, vocab\.json, "
                          r"tokenizer\.model\)$"),
    "tokenizer_empty": (_write("tokenizer.json", ""), r"ckpt/tokenizer\.json is not valid JSON \(Expecting value"),
    "tokenizer_a_list": (_write("tokenizer.json", "[]"),
                         r"ckpt/tokenizer\.json is not a JSON object \(it holds a list\)$"),
    "tokenizer_config_corrupt": (_write("tokenizer_config.json", "{"),
                                 r"ckpt/tokenizer_config\.json is not valid JSON"),
    "token_past_the_vocab": (_token_past_the_vocab,
                             r"the tokenizer of .*ckpt has token ids up to 750, but the LM's vocabulary "
                             r"\(text_config\.vocab_size\) has 704 rows"),
    "placeholder_not_the_configs": (_renamed_placeholder,
                                    r"ckpt/config\.json: image_token_id=681, but the tokenizer's image placeholder "
                                    r"'<\|image_pad\|>' is id \d+$"),
    "processor_config_missing": (_drop_file("processor_config.json"),
                                 r"ckpt has no processor_config\.json or preprocessor_config\.json \(the image "
                                 r"or audio processor's settings\)"),
    "processor_config_corrupt": (_write("processor_config.json", "{"),
                                 r"ckpt/processor_config\.json is not valid JSON"),
    "chat_template_broken": (_write("chat_template.jinja", "{% for m in messages %}{{ m.content "),
                             r"ckpt/chat_template\.jinja does not render a one-line text conversation "
                             r"\(TemplateSyntaxError: unexpected end of template"),
    "generation_config_not_json": (_write(GEN, "{"), r"ckpt/generation_config\.json is not valid JSON"),
    "generation_config_a_list": (_write(GEN, "[678]"), r"ckpt/generation_config\.json is not a JSON object"),
    "eos_string": (_set("eos_token_id", "abc", GEN),
                   r'ckpt/generation_config\.json: eos_token_id="abc" must be a token id of the vocabulary \(0 to '
                   r'703\) or a non-empty list of them$'),
    "eos_fraction": (_set("eos_token_id", 1.5, GEN), r"eos_token_id=1\.5 must be a token id"),
    "eos_bool": (_set("eos_token_id", True, GEN), r"eos_token_id=true must be a token id"),
    "eos_negative": (_set("eos_token_id", -1, GEN), r"eos_token_id=-1 must be a token id of the vocabulary"),
    "eos_outside_vocab": (_set("eos_token_id", 10 ** 9, GEN), r"eos_token_id=1000000000 must be a token id"),
    "eos_empty_list": (_set("eos_token_id", [], GEN), r"eos_token_id=\[\] must be a token id .* or a non-empty list"),
    "eos_list_with_a_string": (_set("eos_token_id", [678, "x"], GEN), r'eos_token_id=\[678, "x"\] .*; "x" is not$'),
    "eos_string_in_config": (_also(_drop_file(GEN), _set("text_config.eos_token_id", "abc")),
                             r'ckpt/config\.json: text_config\.eos_token_id="abc" must be a token id \(an integer >= '
                             r'0\) or a non-empty list of them$'),
}


def test_missing_chat_template_is_named_when_a_prompt_needs_it(llava_ckpt, tmp_path):
    """A checkpoint without a chat template loads (token prompts need none); a text prompt is refused."""
    engine = mmzoo.load(_damaged(llava_ckpt, tmp_path, _drop_file("chat_template.jinja")), executor="eager")
    with pytest.raises(MmzooError, match=r"ckpt has no chat template \(chat_template\.jinja\) to render a prompt "
                                         r"with; give prompt_token_ids instead"):
        engine.generate(PROMPT, max_new_tokens=2)
    assert len(engine.generate(mmzoo.Request(prompt_token_ids=[5, 6, 7], max_new_tokens=2)).token_ids) == 2


# ----------------------------------------------------------------------------- weights

def _weights_edit(edit):
    def breaker(ckpt: Path) -> None:
        tensors = load_file(ckpt / "model.safetensors")
        edit(tensors)
        save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    return breaker


def _retype(name: str, dtype: torch.dtype):
    def edit(tensors):
        tensors[name] = tensors[name].to(dtype)
    return _weights_edit(edit)


def _header(edit):
    """A breaker rewriting the safetensors header (JSON after its 8-byte length) with ``edit``."""
    def breaker(ckpt: Path) -> None:
        path = ckpt / "model.safetensors"
        data = path.read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        header = edit(data[8:8 + n])
        path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n:])
    return breaker


def _bad_offsets(header: bytes) -> bytes:
    meta = json.loads(header)
    first = sorted(k for k in meta if k != "__metadata__")[0]
    meta[first]["data_offsets"] = [0, 4]
    text = json.dumps(meta).encode()
    return text + b" " * (-len(text) % 8)


def _sharded(damage=None):
    """A breaker splitting model.safetensors into two shards with an index, then ``damage(weight_map,
    first_shard_keys, ckpt)`` (the index is written after it)."""
    def breaker(ckpt: Path) -> None:
        tensors = load_file(ckpt / "model.safetensors")
        keys = sorted(tensors)
        parts = {"model-00001-of-00002.safetensors": keys[:len(keys) // 2],
                 "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
        for name, names in parts.items():
            save_file({k: tensors[k] for k in names}, ckpt / name, metadata={"format": "pt"})
        (ckpt / "model.safetensors").unlink()
        weight_map = {k: name for name, names in parts.items() for k in names}
        if damage is not None:
            damage(weight_map, parts["model-00001-of-00002.safetensors"], ckpt)
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return breaker


def _twice(weight_map, first, ckpt):  # the second shard holds a copy of a first-shard tensor too
    second = ckpt / "model-00002-of-00002.safetensors"
    tensors = load_file(second)
    tensors[first[0]] = load_file(ckpt / "model-00001-of-00002.safetensors")[first[0]]
    save_file(tensors, second, metadata={"format": "pt"})


SHARD1, SHARD2 = "model-00001-of-00002\\.safetensors", "model-00002-of-00002\\.safetensors"
INDEX = r"ckpt/model\.safetensors\.index\.json: "
WEIGHTS = {
    "integer_embedding": (_retype("model.embed_tokens.weight", torch.int32),
                          r"weights in .*ckpt do not match the model: not floating point \(the model's weights are\): "
                          r"lm\.embed_tokens\.weight int32$"),
    "boolean_norm": (_retype("model.norm.weight", torch.bool), r"not floating point .*: lm\.norm\.weight bool$"),
    "header_not_json": (_header(lambda h: b"{" + b"x" * (len(h) - 1)),
                        r"ckpt/model\.safetensors is not a readable safetensors file \(.*invalid JSON in header"),
    "header_bad_offsets": (_header(_bad_offsets), r"not a readable safetensors file \(.*invalid shape, data type, or "
                                                  r"offset for tensor\): it may be truncated or corrupt$"),
    "empty_file": (lambda c: (c / "model.safetensors").write_bytes(b""), r"not a readable safetensors file \(.*header "
                                                                         r"too small\)"),
    "index_wrong_shard": (_sharded(lambda wm, first, c: wm.update({first[0]: "model-00002-of-00002.safetensors"})),
                          INDEX + rf"shard {SHARD1} holds tensor .*, but weight_map puts it in {SHARD2}$"),
    "index_missing_entry": (_sharded(lambda wm, first, c: wm.pop(first[0])),
                            INDEX + rf"shard {SHARD1} holds tensor .*, but weight_map does not list it$"),
    "index_tensor_in_no_shard": (_sharded(lambda wm, first, c: wm.update(
                                     {"model.extra": "model-00001-of-00002.safetensors"})),
                                 INDEX + rf"weight_map lists 1 tensors its shards do not hold, e.g. model\.extra in "
                                         rf"{SHARD1}$"),
    "index_tensor_twice": (_sharded(_twice), rf"checkpoint tensor .* is in both {SHARD1} and {SHARD2}$"),
    "index_empty_weight_map": (_sharded(lambda wm, first, c: wm.clear()),
                               INDEX + r"weight_map is empty \(it lists no tensor\)$"),
    "index_not_an_object": (_also(_sharded(), _write("model.safetensors.index.json", "[1]")),
                            r"ckpt/model\.safetensors\.index\.json is not a JSON object \(it holds a list\)$"),
}


@pytest.mark.parametrize("case", list(PROCESSOR_FILES) + list(WEIGHTS))
def test_bad_processor_files_or_weights(qwen2_vl_ckpt, tmp_path, case):
    """The tokenizer, processor, generation config, weights and index: one error each."""
    breaker, match = {**PROCESSOR_FILES, **WEIGHTS}[case]
    ckpt = _damaged(qwen2_vl_ckpt, tmp_path, breaker)
    with pytest.raises(MmzooError, match=match):
        mmzoo.load(ckpt, executor="eager")


@pytest.mark.parametrize("change", ["float64", "sharded"])
def test_wider_floats_and_a_good_index_load_the_same(qwen2_vl_ckpt, tmp_path, change):
    """What is accepted is right: float64 weights are cast to the run dtype (as transformers does) and a
    consistent index reads the same tensors: the same tokens as the checkpoint itself."""
    breaker = _weights_edit(lambda t: t.update({k: v.double() for k, v in t.items()})) if change == "float64" \
        else _sharded()
    ckpt = _damaged(qwen2_vl_ckpt, tmp_path, breaker)
    want = mmzoo.load(qwen2_vl_ckpt, executor="eager").generate(PROMPT, max_new_tokens=4, ignore_eos=True).token_ids
    assert mmzoo.load(ckpt, executor="eager").generate(PROMPT, max_new_tokens=4, ignore_eos=True).token_ids == want


# ----------------------------------------------------------------------------- images

def _png_header(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR claiming ``width x height`` pixels, with almost no data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def _image_file(kind: str, root: Path) -> Path:
    path = root / f"{kind}.png"
    if kind == "not_an_image":
        path.write_text("a text file named .png")
    elif kind == "empty":
        path.touch()
    elif kind == "truncated":
        make_image(64, 64, seed=0).save(path)
        _halve(path)
    elif kind == "bomb":  # a few bytes claiming 20000 x 20000: Pillow refuses it in Image.open
        path.write_bytes(_png_header(20000, 20000))
    elif kind == "over_limit":  # 10000 x 10000: over the limit, under Pillow's error (a warning there)
        path.write_bytes(_png_header(10000, 10000))
    elif kind == "directory":
        path.mkdir()
    elif kind != "missing":
        width, height = {"one_pixel": (1, 1), "too_wide": (20000, 10)}[kind]
        Image.new("RGB", (width, height)).save(path)
    return path


IMAGE_FILES = {
    "missing": r"images\[1\]: image file .*missing\.png does not exist",
    "directory": r"images\[1\]: .*directory\.png is not a file",
    "empty": r"images\[1\]: image file .*empty\.png is empty \(0 bytes\)",
    "not_an_image": r"images\[1\]: .*not_an_image\.png is not a readable image \(not a format Pillow knows\)",
    "truncated": r"images\[1\]: .*truncated\.png is not a readable image \(image file is truncated",
    "bomb": r"images\[1\]: .*bomb\.png is too large to decode: Image size \(400000000 pixels\) exceeds limit of "
            r"178956970 pixels",
    "over_limit": rf"images\[1\]: .*over_limit\.png is 10000x10000 pixels \(100000000\); an image may have at most "
                  rf"{MAX_IMAGE_PIXELS} pixels",
    "one_pixel": rf"images\[1\]: .*one_pixel\.png is 1x1 pixels; the shortest side must be at least {MIN_IMAGE_SIDE}",
    "too_wide": rf"images\[1\]: .*too_wide\.png is 20000x10 pixels, an aspect ratio of 2000:1; it may be at most "
                rf"{MAX_ASPECT_RATIO}:1",
}


@pytest.fixture(scope="module")
def vl_engine(qwen2_vl_ckpt):
    return mmzoo.load(qwen2_vl_ckpt, executor="eager")


@pytest.mark.parametrize("kind", list(IMAGE_FILES))
def test_bad_image_file(vl_engine, image_files, tmp_path, kind):
    bad = _image_file(kind, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)  # refused the same way when warnings raise
        with pytest.raises(MmzooError, match=IMAGE_FILES[kind]):
            vl_engine.prepare(mmzoo.Request(prompt=PROMPT, images=[image_files[0], str(bad)]))


IMAGE_OBJECTS = {
    "pil_one_pixel": (Image.new("RGB", (1, 1)), r"images\[0\]: the image is 1x1 pixels; the shortest side"),
    "pil_over_limit": (Image.new("1", (10000, 9000)),  # mode "1": 11 MB for the test, not 270 MB
                       rf"images\[0\]: the image is 10000x9000 pixels \(90000000\); an image may have at most "
                       rf"{MAX_IMAGE_PIXELS} pixels"),
    "array_one_row": (np.zeros((1, 50, 3), np.uint8), r"images\[0\]: the array is 50x1 pixels; the shortest side"),
    "array_too_tall": (np.zeros((20000, 10, 3), np.uint8),
                       r"images\[0\]: the array is 10x20000 pixels, an aspect ratio of 2000:1; it may be at most 200:1"),
    "array_over_limit": (np.broadcast_to(np.zeros((1, 1, 3), np.uint8), (9000, 10000, 3)),  # a view: no memory
                         r"images\[0\]: the array is 10000x9000 pixels \(90000000\)"),
}


@pytest.mark.parametrize("kind", list(IMAGE_OBJECTS))
def test_bad_image_object(vl_engine, kind):
    image, match = IMAGE_OBJECTS[kind]
    with pytest.raises(MmzooError, match=match):
        vl_engine.prepare(mmzoo.Request(prompt=PROMPT, images=[image]))


def test_images_at_the_limits_are_taken(vl_engine, llava_ckpt):
    """The smallest side and the widest aspect ratio allowed go through both families' processors
    (Qwen2-VL's refuses a ratio over 200 itself)."""
    edge = [np.zeros((MIN_IMAGE_SIDE, MIN_IMAGE_SIDE, 3), np.uint8),
            np.zeros((MIN_IMAGE_SIDE, MIN_IMAGE_SIDE * MAX_ASPECT_RATIO, 3), np.uint8)]
    assert len(vl_engine.prepare(mmzoo.Request(prompt=PROMPT, images=edge)).media) == 2  # a tower call each
    llava = mmzoo.load(llava_ckpt, executor="eager")
    assert len(llava.prepare(mmzoo.Request(prompt=PROMPT, images=edge)).media) == 1
    with pytest.raises(MmzooError, match=r"images\[0\]: the array is 402x2 pixels, an aspect ratio of 201:1"):
        llava.prepare(mmzoo.Request(prompt=PROMPT, images=[np.zeros((2, 402, 3), np.uint8)]))


def test_bad_video_frames(vl_engine, tmp_path):
    frames = tmp_path / "frames"
    frames.mkdir()
    make_image(56, 56, seed=0).save(frames / "0.png")
    Image.new("RGB", (1, 1)).save(frames / "1.png")
    with pytest.raises(MmzooError, match=r"videos\[0\]\[1\]: .*frames/1\.png is 1x1 pixels"):
        vl_engine.prepare(mmzoo.Request(prompt=PROMPT, videos=[str(frames)]))
    frames = [np.zeros((56, 56, 3), np.uint8), np.zeros((84, 56, 3), np.uint8)]
    with pytest.raises(MmzooError, match=r"videos\[0\]\[1\] is 56x84 pixels but videos\[0\]\[0\] is 56x56: a "
                                         r"video's frames must have one size"):
        vl_engine.prepare(mmzoo.Request(prompt=PROMPT, videos=[frames]))
    gif = tmp_path / "wide.gif"
    Image.new("RGB", (20000, 10)).save(gif)
    with pytest.raises(MmzooError, match=r"videos\[0\]: .*wide\.gif is 20000x10 pixels, an aspect ratio of 2000:1"):
        vl_engine.prepare(mmzoo.Request(prompt=PROMPT, videos=[str(gif)]))


# ----------------------------------------------------------------------------- audio

@pytest.fixture(scope="module")
def audio_engine(qwen2_audio_ckpt):
    return mmzoo.load(qwen2_audio_ckpt, executor="eager")


def _audio(kind: str, root: Path):
    path = root / f"{kind}.wav"
    if kind == "empty":
        path.touch()
    elif kind == "not_audio":
        path.write_text("a text file named .wav")
    elif kind == "too_long":  # the tiny checkpoint's window is 2 s
        write_wav(path, make_audio(2.5, seed=0))
    elif kind == "too_long_8khz":  # 2.5 s at 8 kHz: 40000 samples once resampled
        write_wav(path, make_audio(2.5, seed=0, sampling_rate=8000), 8000)
    elif kind == "too_long_array":
        return make_audio(2.5, seed=0)
    elif kind == "nan_array":
        return np.array([0.0, np.nan, 0.5], np.float32)
    return str(path)


AUDIOS = {
    "empty": r"audios\[0\]: audio file .*empty\.wav is empty \(0 bytes\)",
    "not_audio": r"audios\[0\]: .*not_audio\.wav is not a readable audio file",
    "too_long": r"audios\[0\] is 2\.50 s long \(40000 samples at 16000 Hz\); the audio encoder hears at most 2 s "
                r"\(32000 samples\): split it into shorter clips",
    "too_long_8khz": r"audios\[0\] is 2\.50 s long \(40000 samples at 16000 Hz\); the audio encoder hears at most 2 s",
    "too_long_array": r"audios\[0\] is 2\.50 s long \(40000 samples at 16000 Hz\)",
    "nan_array": r"audios\[0\]: the array has non-finite samples",
}


@pytest.mark.parametrize("kind", list(AUDIOS))
def test_bad_audio(audio_engine, tmp_path, kind):
    with pytest.raises(MmzooError, match=AUDIOS[kind]):
        audio_engine.prepare(mmzoo.Request(prompt=PROMPT, audios=[_audio(kind, tmp_path)]))


def test_stereo_and_other_rates_are_converted(audio_engine, tmp_path):
    """Stereo is mixed down to mono, another rate is resampled, and a clip of exactly the window is taken."""
    left, right = make_audio(1.0, seed=0), make_audio(1.0, seed=1)
    stereo = tmp_path / "stereo.wav"
    soundfile.write(stereo, np.stack([left, right], axis=1), 16000, subtype="FLOAT")
    low = write_wav(tmp_path / "low.wav", make_audio(1.0, seed=2, sampling_rate=8000), 8000)
    full = write_wav(tmp_path / "full.wav", make_audio(2.0, seed=3))
    mono, resampled, whole = load_audios([str(stereo), str(low), str(full)], 16000)
    np.testing.assert_allclose(mono, (left + right) / 2, atol=1e-6)
    assert resampled.shape == (16000,) and whole.shape == (32000,)
    prepared = audio_engine.prepare(mmzoo.Request(prompt=PROMPT, audios=[str(stereo), str(low), str(full)]))
    assert prepared.lengths["audio"].tolist() == [25, 25, 50]  # valid tokens of 100, 100 and 200 mel frames


# ----------------------------------------------------------------------------- embeddings files (mmzoo.encode)

@pytest.fixture(scope="module")
def llava_engine(llava_ckpt):
    return mmzoo.load(llava_ckpt, executor="eager")


def _items(family: str) -> dict:
    """The media each family's embeddings file below holds (two items where the family takes them)."""
    if family == "qwen2_audio":
        return {"audios": [make_audio(0.5, seed=0), make_audio(0.3, seed=1)]}
    return {"images": [make_image(56, 56, seed=0), make_image(84, 56, seed=1)][:1 if family == "llava" else 2]}


@pytest.fixture(scope="module")
def encoded(vl_engine, llava_engine, audio_engine):
    """family -> (engine, the tensors mmzoo.encode writes for :func:`_items`, its metadata)."""
    engines = {"qwen2_vl": vl_engine, "llava": llava_engine, "qwen2_audio": audio_engine}
    return {name: (e, e.encode(**_items(name)), e.embeds_metadata()) for name, e in engines.items()}


def _rows(tensors, key, rows):
    return {**tensors, key: tensors[key][rows]}


def _first_grid(grid):
    def change(tensors):
        g = tensors["image_grid_thw"].clone()
        g[0] = torch.tensor(grid)
        return {**tensors, "image_grid_thw": g}
    return change


def _nan(key):
    def change(tensors):
        t = tensors[key].clone()
        t[1, 2] = float("nan")
        return {**tensors, key: t}
    return change


def _drop_key(key):
    return lambda tensors: {k: v for k, v in tensors.items() if k != key}


def _meta(**fields):
    return lambda meta: {k: v for k, v in {**meta, **fields}.items() if v is not None}


KEEP = (lambda tensors: tensors)
SAME = (lambda meta: meta)
EMB = r"embeds file .*emb\.safetensors"
# family -> damage -> (change of the tensors, change of the metadata, the message)
EMBEDS = {
    "qwen2_vl": {
        "rows_short": (lambda t: _rows(t, "image_embeds", slice(0, -1)), SAME,
                       r"image_embeds has 9 rows but image_grid_thw \[\[1, 4, 4\], \[1, 4, 6\]\] implies 10 "
                       r"\(sum\(t\*h\*w\) / merge_size\^2, merge_size=2\)$"),
        "grid_not_merge_multiple": (_first_grid([1, 1, 16]), SAME,  # 16 patches: 4 rows, as [1, 4, 4] gives
                                    r"image_grid_thw\[0\] = \[1, 1, 16\]: h and w must be multiples of merge_size=2"),
        "grid_without_embeds": (_drop_key("image_embeds"), SAME,
                                EMB + r" holds no embeddings \(image_embeds, video_embeds or audio_embeds\)$"),
        "grid_missing": (_drop_key("image_grid_thw"), SAME, r"image_embeds needs image_grid_thw"),
        "grid_fractional": (lambda t: {**t, "image_grid_thw": t["image_grid_thw"].float() + 0.5}, SAME,
                            r"image_grid_thw must hold integers, got float32"),
        "wider_than_the_lm": (lambda t: {**t, "image_embeds": torch.cat([t["image_embeds"]] * 2, 1)}, SAME,
                              r"image_embeds has hidden size 128 but the LM's hidden size is 64$"),
        "integer_embeds": (lambda t: {**t, "image_embeds": t["image_embeds"].to(torch.int32)}, SAME,
                           r"image_embeds must be floating point, got torch\.int32$"),
        "nan": (_nan("image_embeds"), SAME,
                r"image_embeds holds 1 non-finite values \(NaN or inf\), the first at \[1, 2\]"),
        "unknown_tensor": (lambda t: {**t, "pixel_values": torch.zeros(2)}, SAME, EMB + r" has unknown tensors "
                                                                                       r"\['pixel_values'\]$"),
        "hidden_size_metadata_garbage": (KEEP, _meta(lm_hidden_size="abc"),
                                         EMB + r": metadata lm_hidden_size='abc' must be a positive integer$"),
        "hidden_size_metadata_missing": (KEEP, _meta(lm_hidden_size=None),
                                         EMB + r" has no lm_hidden_size in its metadata \(mmzoo\.encode writes it\)$"),
        "hidden_size_metadata_other": (KEEP, _meta(lm_hidden_size="128"),
                                       EMB + r" has LM hidden size 128 but this LM's is 64$"),
        "fingerprint_missing": (KEEP, _meta(fingerprint=None), EMB + r" has no fingerprint in its metadata"),
        "another_tower": (KEEP, _meta(fingerprint="0" * 32),
                          EMB + r" was made by encoder weights 0{32} .*; pass allow_fingerprint_mismatch=true"),
        "another_family": (KEEP, _meta(model="llava"), EMB + r" was made by model=llava, not qwen2_vl$"),
        "not_from_encode": (KEEP, _meta(format="other/1"),
                            EMB + r" was not written by mmzoo\.encode \(format 'other/1'\)$"),
    },
    "llava": {
        "rows_not_images": (lambda t: _rows(t, "image_embeds", slice(0, -1)), SAME,
                            r"image_embeds has 15 rows, not a multiple of the 16 tokens per image"),
        "with_a_grid": (lambda t: {**t, "image_grid_thw": torch.tensor([[1, 4, 4]])}, SAME,
                        r"model=llava does not take image_grid_thw \(each image is 16 rows of image_embeds\)$"),
        "inf": (lambda t: {**t, "image_embeds": t["image_embeds"].index_fill(0, torch.tensor([3]), float("inf"))}, SAME,
                r"image_embeds holds 64 non-finite values \(NaN or inf\), the first at \[3, 0\] = inf$"),
    },
    "qwen2_audio": {
        "lengths_missing": (_drop_key("audio_lengths"), SAME,
                            EMB + r" has audio_embeds but no audio_lengths \(each clip's rows"),
        "lengths_too_many_rows": (lambda t: {**t, "audio_lengths": t["audio_lengths"] + 1}, SAME,
                                  r"audio_lengths \[\d+, \d+\] sum to \d+ rows but audio_embeds has \d+$"),
        "lengths_zero": (lambda t: {**t, "audio_lengths": t["audio_lengths"] * 0}, SAME,
                         r"audio_lengths must be a 1-D list of positive integers, got \[0, 0\]$"),
        "lengths_without_embeds": (_drop_key("audio_embeds"), SAME, EMB + r" holds no embeddings"),
        "float64_embeds_wider": (lambda t: {**t, "audio_embeds": torch.cat([t["audio_embeds"]] * 2, 1).double()}, SAME,
                                 r"audio_embeds has hidden size 128 but the LM's hidden size is 64$"),
    },
}
EMBEDS_CASES = [(family, case) for family, cases in EMBEDS.items() for case in cases]


@pytest.mark.parametrize("family, case", EMBEDS_CASES, ids=[f"{f}-{c}" for f, c in EMBEDS_CASES])
def test_bad_embeddings_file(encoded, tmp_path, family, case):
    engine, tensors, meta = encoded[family]
    change, change_meta, match = EMBEDS[family][case]
    path = tmp_path / "emb.safetensors"
    save_file({k: v.contiguous() for k, v in change(tensors).items()}, str(path),
              metadata=change_meta({"format": embeds_file.FORMAT, **meta}))
    with pytest.raises(MmzooError, match=match):
        engine.generate(PROMPT, embeds=str(path), max_new_tokens=2)


@pytest.mark.parametrize("family", list(EMBEDS))
def test_an_undamaged_embeddings_file_gives_the_raw_inputs_tokens(encoded, tmp_path, family):
    """The control of the table above: the file as mmzoo.encode writes it runs as its raw media do."""
    engine, tensors, meta = encoded[family]
    path = tmp_path / "emb.safetensors"
    embeds_file.write(path, tensors, meta)
    want = engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True, **_items(family)).token_ids
    assert engine.generate(PROMPT, embeds=str(path), max_new_tokens=4, ignore_eos=True).token_ids == want


# ----------------------------------------------------------------------------- the CLI

def test_cli_truncated_checkpoint_is_one_error_line(qwen2_vl_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(qwen2_vl_ckpt, ckpt)
    _halve(ckpt / "model.safetensors")
    out = tmp_path / "out.jsonl"
    p = subprocess.run([sys.executable, "-m", "mmzoo.infer", f"checkpoint={ckpt}", "executor=eager", "images=[]",
                        f"output={out}"], cwd=tmp_path, env={**os.environ, "PJRT_DEVICE": "CPU"},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: checkpoint file {ckpt / 'model.safetensors'} is not a readable safetensors file "
                      f"(Error while deserializing header: incomplete metadata, file not fully covered): it may be "
                      f"truncated or corrupt"], p.stderr
    assert "Traceback" not in p.stderr and not out.exists()


def test_cli_bad_config_value_is_one_error_line(qwen2_audio_ckpt, tmp_path):
    ckpt = _damaged(qwen2_audio_ckpt, tmp_path, _set("text_config.num_key_value_heads", 3))
    p = subprocess.run([sys.executable, "-m", "mmzoo.infer", f"checkpoint={ckpt}", "prompt=hi", "max_new_tokens=2",
                        "executor=eager"], cwd=tmp_path, env={**os.environ, "PJRT_DEVICE": "CPU"}, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 1, p.stderr
    assert [line for line in p.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {ckpt}/config.json: text_config.num_key_value_heads=3 does not divide num_attention_heads=4"], p.stderr
    assert "Traceback" not in p.stderr
