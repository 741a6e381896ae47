"""Fuzzing the loaders (hypothesis): random values for the config.json fields mmzoo reads,
and random ``model.safetensors.index.json`` contents. Every case either loads and generates (text,
and the family's media) or raises :class:`MmzooError`: never another exception.

The tiny checkpoints are built once per session (conftest) and copied per example: each example
gets a directory of its own (the config cache is keyed by the directory and config.json's mtime).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import mmzoo
from mmzoo.errors import MmzooError
from mmzoo.fixtures import make_audio, make_image

SETTINGS = dict(deadline=None, derandomize=True, database=None,  # reproducible; no explain phase (slow tracing)
                phases=[Phase.explicit, Phase.generate, Phase.shrink],
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

_TEXT = ["hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size", "num_hidden_layers",
         "intermediate_size", "head_dim", "rms_norm_eps", "hidden_act", "rope_parameters", "rope_parameters.rope_theta",
         "rope_parameters.rope_type", "eos_token_id", "use_sliding_window", "model_type"]
# family -> the config.json paths mmzoo reads (conf/model/*.yaml's ${hf:...}, the families' checks), and the
# sections and top-level keys around them
FIELDS = {
    "qwen2_vl": [f"text_config.{k}" for k in [*_TEXT, "rope_parameters.mrope_section"]]
                + [f"vision_config.{k}" for k in ["depth", "embed_dim", "num_heads", "patch_size", "spatial_merge_size",
                                                  "temporal_patch_size", "in_channels", "mlp_ratio", "hidden_size",
                                                  "hidden_act", "rope_parameters.rope_theta"]]
                + ["image_token_id", "video_token_id", "vision_config", "text_config"],
    "llava": [f"text_config.{k}" for k in _TEXT]
             + [f"vision_config.{k}" for k in ["image_size", "patch_size", "num_channels", "hidden_size",
                                               "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                               "hidden_act", "layer_norm_eps", "model_type"]]
             + ["vision_feature_layer", "vision_feature_select_strategy", "projector_hidden_act",
                "multimodal_projector_bias", "image_token_index", "vision_config", "text_config"],
    "qwen2_audio": [f"text_config.{k}" for k in _TEXT]
                   + [f"audio_config.{k}" for k in ["num_mel_bins", "d_model", "encoder_layers",
                                                    "encoder_attention_heads", "encoder_ffn_dim",
                                                    "activation_function", "max_source_positions"]]
                   + ["audio_token_index", "audio_config", "text_config"],
}
for _fields in FIELDS.values():
    _fields += ["architectures", "model_type", "dtype", "tie_word_embeddings"]

DELETE, NEAR = object(), "near"  # NEAR: the file's own value, nudged by a step in -2..2 (0: unchanged)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-4, 300),
    st.sampled_from([0, 1, 2, 4, 16, 32, 64, 128, 681, 704, 1 << 20, (1 << 20) + 1, 2 ** 31, 10 ** 30]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-6, 0.5, 4.0, 1e4, 1e6]),
    st.text(max_size=6),
    st.sampled_from(["silu", "gelu", "default", "full", "mrope", "llama", "qwen2", "bfloat16", "clip_vision_model"]),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=4), st.dictionaries(st.text(max_size=6), SCALARS, max_size=3))


@st.composite
def config_damage(draw):
    """``(family, [(path, value or DELETE), ...])``: one to three fields of one family's config.json."""
    family = draw(st.sampled_from(sorted(FIELDS)))
    value = st.one_of(st.just(DELETE), VALUES, st.tuples(st.just(NEAR), st.integers(-2, 2)))
    changes = draw(st.lists(st.tuples(st.sampled_from(FIELDS[family]), value), min_size=1, max_size=3))
    return family, changes


def _nudge(value, step: int):
    """A value of the same kind near ``value``: what a slightly wrong config (or a right one) holds."""
    if isinstance(value, bool):
        return value if step == 0 else not value
    if isinstance(value, int):
        return value + step
    if isinstance(value, float):
        return value * (1 + step / 4)
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [value[0] + step, *value[1:]]
    return value


def _apply(data: dict, path: str, value) -> None:
    *parents, key = path.split(".")
    for part in parents:
        data = data.get(part) if isinstance(data, dict) else None
    if not isinstance(data, dict):  # an earlier change replaced or removed the section
        return
    if value is DELETE:
        data.pop(key, None)
    elif isinstance(value, tuple) and value[0] == NEAR:
        if key in data:
            data[key] = _nudge(data[key], value[1])
    else:
        data[key] = value


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A directory for the examples' copies, and one torch thread (tiny matmuls on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path_factory.mktemp("fuzz")
    torch.set_num_threads(threads)


def _copy(source: Path, work: Path) -> Path:
    ckpt = Path(tempfile.mkdtemp(dir=work)) / "ckpt"
    shutil.copytree(source, ckpt)
    return ckpt


MEDIA = {"qwen2_vl": {"images": [make_image(56, 56, seed=0)]}, "llava": {"images": [make_image(56, 56, seed=0)]},
         "qwen2_audio": {"audios": [make_audio(0.5, seed=0)]}}


def load_and_generate(ckpt: Path, family: str) -> str:
    """``"loaded"`` after a load and a text and a media generation, or ``"refused"`` for an
    :class:`MmzooError` (at load or at generation); anything else raises."""
    try:
        engine = mmzoo.load(ckpt, executor="eager", max_model_len=128)
        for media in ({}, MEDIA[family]):
            result = engine.generate("What is this?", max_new_tokens=2, **media)
            assert 1 <= len(result.token_ids) <= 2
            assert all(0 <= t < engine.model.lm.vocab_size for t in result.token_ids)
    except MmzooError as e:
        assert str(e).strip() and "\n" not in str(e) and "Traceback" not in str(e), str(e)
        return "refused"
    finally:
        shutil.rmtree(ckpt.parent, ignore_errors=True)
    return "loaded"


@settings(max_examples=60, **SETTINGS)
@given(damage=config_damage())
@example(damage=("qwen2_vl", [("text_config.hidden_size", (NEAR, 0))]))  # untouched: must load
@example(damage=("llava", [("text_config.rms_norm_eps", (NEAR, 2))]))  # another epsilon: a model that runs
@example(damage=("qwen2_audio", [("text_config.num_key_value_heads", (NEAR, 2))]))  # 4 kv heads of 4: ditto
def test_config_values_load_or_are_refused(tiny_checkpoints, work, damage):
    family, changes = damage
    ckpt = _copy(tiny_checkpoints[family], work)
    original = json.loads((ckpt / "config.json").read_text())
    data = json.loads(json.dumps(original))
    for path, value in changes:
        _apply(data, path, value)
    (ckpt / "config.json").write_text(json.dumps(data))
    outcome = load_and_generate(ckpt, family)
    if data == original:  # the changes undid each other, or nudged by 0: nothing may be refused
        assert outcome == "loaded", changes
    event(f"{family}: {outcome}")


# ----------------------------------------------------------------------------- model.safetensors.index.json

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
NAMES = st.one_of(st.sampled_from([*SHARDS, "model.safetensors", "config.json", "tokenizer.json", "missing.safetensors",
                                   "", ".", "..", "../ckpt/" + SHARDS[0], "/etc/hostname", "sub/x.safetensors",
                                   "x" * 300, "a\x00b"]), st.text(max_size=8))


@pytest.fixture(scope="module")
def sharded(qwen2_vl_ckpt, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The tiny Qwen2-VL checkpoint in two shards with its index, and the index's weight_map."""
    root = tmp_path_factory.mktemp("sharded") / "ckpt"
    shutil.copytree(qwen2_vl_ckpt, root)
    tensors = load_file(root / "model.safetensors")
    keys = sorted(tensors)
    weight_map = {}
    for name, part in zip(SHARDS, (keys[:len(keys) // 2], keys[len(keys) // 2:])):
        save_file({k: tensors[k] for k in part}, root / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (root / "model.safetensors").unlink()
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root, weight_map


@st.composite
def index_damage(draw, keys: list[str]):
    """What to write as the index: the true weight_map with some entries moved, dropped or added, or
    another weight_map, or another document altogether (JSON or not)."""
    kind = draw(st.sampled_from(["entries", "entries", "entries", "weight_map", "document", "text"]))
    if kind == "text":
        return draw(st.one_of(st.text(max_size=20), st.sampled_from(["", "{", "null", '{"weight_map": '])))
    if kind == "document":
        return json.dumps(draw(VALUES))
    if kind == "weight_map":
        return json.dumps({"weight_map": draw(VALUES)})
    edits = draw(st.lists(st.tuples(st.sampled_from(["move", "drop", "add"]), st.sampled_from(keys), NAMES),
                          min_size=1, max_size=4))
    return edits


@given(data=st.data())
@settings(max_examples=50, **SETTINGS)
def test_index_contents_load_or_are_refused(sharded, work, data):
    source, weight_map = sharded
    damage = data.draw(index_damage(sorted(weight_map)))
    ckpt = _copy(source, work)
    if isinstance(damage, list):
        new = dict(weight_map)
        for op, key, name in damage:
            if op == "drop":
                new.pop(key, None)
            else:  # move a tensor to another file, or list one the shards do not hold
                new[key if op == "move" else key + ".extra"] = name
        text = json.dumps({"metadata": {}, "weight_map": new})
    else:
        text = damage
    (ckpt / "model.safetensors.index.json").write_text(text)
    outcome = load_and_generate(ckpt, "qwen2_vl")
    if isinstance(damage, list) and new == weight_map:  # moves to where a tensor is: the index is right
        assert outcome == "loaded", damage
    event(outcome)
