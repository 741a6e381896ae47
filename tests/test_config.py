"""Config tier: every option of every conf/ group composes and builds (lightning-hydra-template
style), the search path, the resolvers and the choices a checkpoint implies."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import mmzoo
from mmzoo import config
from mmzoo.backends import AttentionBackend
from mmzoo.errors import MmzooError
from mmzoo.executor import Executor, MeshSpec
from mmzoo.models import Family

GROUPS = ["model", "attention", "executor", "mesh", "encoder", "adapter", "lm"]
# each component option at a tiny size; the adapters' widths (read from their neighbours in a
# pipeline) given directly
TINY = {
    "qwen2_vl_vit": {"embed_dim": 32, "depth": 1, "num_heads": 2},
    "qwen2_5_vl_vit": {"embed_dim": 32, "depth": 2, "num_heads": 2, "intermediate_dim": 48,
                       "full_attention_blocks": [1]},
    "clip_vit": {"image_size": 28, "patch_size": 14, "embed_dim": 32, "num_layers": 2, "num_heads": 2,
                 "intermediate_dim": 64},
    "intern_vit": {"image_size": [28, 28], "patch_size": 14, "embed_dim": 32, "num_layers": 2, "num_heads": 2,
                   "intermediate_dim": 64},
    "siglip_vit": {"image_size": 28, "patch_size": 14, "embed_dim": 32, "num_layers": 2, "num_heads": 2,
                   "intermediate_dim": 64},
    "qwen3_vl_vit": {"embed_dim": 32, "depth": 2, "num_heads": 2, "intermediate_dim": 64,
                     "num_position_embeddings": 16, "deepstack_blocks": [0]},
    "whisper": {"num_mel_bins": 8, "embed_dim": 32, "depth": 1, "num_heads": 2, "ffn_dim": 64, "max_positions": 10},
    "patch_merger": {"context_dim": 32, "out_dim": 48},
    "mlp_projector": {"in_dim": 32, "out_dim": 48},
    "packed_projector": {"in_dim": 32, "out_dim": 48},
    "audio_projector": {"in_dim": 32, "out_dim": 48},
    "pixel_shuffle": {"in_dim": 32, "out_dim": 48, "image_size": 56, "patch_size": 14},
    "pixel_shuffle_linear": {"in_dim": 32, "out_dim": 48, "image_size": 56, "patch_size": 14},
    "avg_pool_projector": {"in_dim": 32, "out_dim": 48, "image_size": 56, "patch_size": 14, "tokens_per_image": 4},
    **{lm: {"vocab_size": 64, "dim": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "intermediate_dim": 64}
       for lm in ("llama", "qwen2")},
    "gemma3": {"vocab_size": 64, "dim": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
               "intermediate_dim": 64, "sliding_window": 4},
    "qwen3": {"vocab_size": 64, "dim": 32, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
              "intermediate_dim": 64, "mrope_section": [2, 1, 1], "mrope_interleaved": True},
}


def test_groups_have_the_expected_options():
    assert {"sdpa", "eager", "pallas"} <= set(config.options("attention"))
    assert {"eager", "xla"} <= set(config.options("executor"))
    assert {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_onevision", "qwen2_audio", "internvl", "smolvlm",
            "gemma3"} <= set(config.options("model"))
    assert set(config.options("encoder")) == {"qwen2_vl_vit", "qwen2_5_vl_vit", "qwen3_vl_vit", "clip_vit", "intern_vit",
                                              "siglip_vit", "whisper"}
    assert set(config.options("adapter")) == {"patch_merger", "mlp_projector", "audio_projector", "pixel_shuffle",
                                              "pixel_shuffle_linear", "avg_pool_projector", "packed_projector"}
    assert set(config.options("lm")) == {"llama", "qwen2", "qwen3", "gemma3"}


@pytest.mark.parametrize("group,name", [(g, n) for g in ("encoder", "adapter", "lm") for n in config.options(g)])
def test_every_component_option_instantiates_a_plain_module(group, name):
    node = OmegaConf.merge(OmegaConf.load(config.CONF_DIR / group / f"{name}.yaml"), TINY[name])
    assert node._target_.startswith("mmzoo.lms." if group == "lm" else f"mmzoo.{group}s.")
    if "attention" in node:
        node.attention = "eager"  # a conf/attention name, as model.<part>.attention=eager gives it
    module = instantiate(node)
    assert isinstance(module, torch.nn.Module)
    assert all(p.device.type == "cpu" for p in module.parameters())  # modules know nothing of devices
    if "attention" in node:
        from mmzoo.engine import backends_of

        assert backends_of(module) == ["eager"]


def test_components_instantiate_from_a_composed_pipeline(qwen2_vl_ckpt):
    """``hydra.utils.instantiate(cfg.model.encoder)`` (and adapter, lm) give the modules the pipeline
    builds, sized by the checkpoint."""
    cfg = mmzoo.compose(values={"checkpoint": str(qwen2_vl_ckpt)})
    encoder, adapter, lm = (instantiate(cfg.model[p]) for p in ("encoder", "adapter", "lm"))
    assert type(encoder).__name__ == "Qwen2VisionEncoder" and len(encoder.blocks) == cfg.model.encoder.depth
    assert type(adapter).__name__ == "PatchMerger" and type(lm).__name__ == "DecoderLM"
    assert lm.rotary.num_axes == 3  # M-RoPE: mrope_section from config.json


@pytest.mark.parametrize("name", ["attention", "executor", "mesh"])
def test_every_runtime_option_composes_and_builds(name):
    for option in config.options(name):
        obj = instantiate(mmzoo.compose([f"{name}={option}"])[name])
        if name == "attention":
            assert isinstance(obj, AttentionBackend) and obj.name == option
        elif name == "executor":
            assert isinstance(obj, Executor) and obj.name == option
        else:
            assert isinstance(obj, MeshSpec) and obj.spmd == (option != "single")


def test_every_model_option_builds_from_its_checkpoint(tiny_checkpoints):
    from mmzoo.engine import build_model

    for name in config.options("model"):
        cfg = mmzoo.compose([f"model={name}"], values={"checkpoint": str(tiny_checkpoints[name])})
        assert list(cfg.model.architectures) and {"encoder", "adapter", "lm", "family"} <= set(cfg.model)
        family, model = build_model(cfg)
        assert isinstance(family, Family) and family.name == name
        assert set(model.towers) == {family.tower} and model.lm.dim == cfg.model.lm.dim


def test_unknown_option_lists_the_choices():
    with pytest.raises(MmzooError) as e:
        mmzoo.compose(["attention=flashy"])
    assert "flashy" in str(e.value)
    with pytest.raises(MmzooError, match=r"attention='flashy' is not an option; choose one of \['eager', 'pallas', 'sdpa'\]"):
        config.build_option("attention", "flashy")


def test_root_defaults():
    cfg = mmzoo.compose()
    assert cfg.model.name == "qwen2_vl" and cfg.weights == "checkpoint" and cfg.dtype == "float32"
    assert cfg.checkpoint == str(config.CONF_DIR.parent / "mmzoo" / "assets" / "qwen2_vl_shapes") or \
        cfg.checkpoint.endswith("assets/qwen2_vl_shapes")
    assert cfg.executor._target_.endswith("XLAExecutor")
    raw = OmegaConf.to_container(cfg.model.encoder, resolve=False)
    assert raw["attention"] == "${attention}" and raw["depth"] == "${hf:vision_config.depth}"


def test_hf_resolver_reads_the_checkpoint_and_names_what_is_missing(qwen2_vl_ckpt):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(qwen2_vl_ckpt)
    cfg = mmzoo.compose(values={"checkpoint": str(qwen2_vl_ckpt)})
    assert cfg.model.encoder.depth == hf.vision_config.depth
    assert cfg.model.lm.dim == hf.text_config.hidden_size
    assert list(cfg.model.lm.mrope_section) == list(hf.text_config.rope_parameters["mrope_section"])
    cfg = mmzoo.compose(["model=llava"], values={"checkpoint": str(qwen2_vl_ckpt)})  # model= given: kept
    with pytest.raises(Exception) as e:
        cfg.model.encoder.image_size
    assert "has no vision_config.image_size" in str(e.value) and "model=llava" in str(e.value)
    cfg = mmzoo.compose(values={"checkpoint": None})
    with pytest.raises(Exception, match="no checkpoint is given"):
        cfg.model.lm.dim


def test_model_and_lm_chosen_from_the_checkpoint(tiny_checkpoints, llava_qwen2_ckpt):
    assert mmzoo.compose(values={"checkpoint": str(tiny_checkpoints["qwen2_audio"])}).model.name == "qwen2_audio"
    llava = mmzoo.compose(values={"checkpoint": str(tiny_checkpoints["llava"])})
    assert llava.model.name == "llava" and llava.model.lm._target_ == "mmzoo.lms.llama"
    interleave = mmzoo.compose(values={"checkpoint": str(llava_qwen2_ckpt)})
    assert interleave.model.name == "llava" and interleave.model.lm._target_ == "mmzoo.lms.qwen2"
    forced = mmzoo.compose(["lm@model.lm=llama"], values={"checkpoint": str(llava_qwen2_ckpt)})
    assert forced.model.lm._target_ == "mmzoo.lms.llama"  # a choice given on the command line wins


def test_user_config_dir_joins_the_search_path(recipes):
    assert "vit_llama" not in config.options("model")
    assert "vit_llama" in config.options("model", config_dir=recipes)
    with pytest.raises(MmzooError):
        mmzoo.compose(["model=vit_llama"])


def test_every_family_declares_its_reference_and_tiny_checkpoint():
    """The family contract's test declarations: a transformers class that exists and an
    mmzoo.fixtures builder, from which the parity tests, the fixtures and the benchmark work."""
    import transformers

    import mmzoo.fixtures
    from mmzoo.models import Family

    for name in config.options("model"):
        cls = config.family_class(name)
        assert issubclass(cls, Family) and cls.modalities, name
        assert hasattr(transformers, cls.hf_class), (name, cls.hf_class)
        assert callable(getattr(mmzoo.fixtures, cls.tiny_checkpoint, None)), (name, cls.tiny_checkpoint)
