"""Config tier: every file in conf/ composes and builds (lightning-hydra-template style)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from hydra.utils import instantiate

from mmzoo import config
from mmzoo.backends import AttentionBackend
from mmzoo.executor import Executor, MeshSpec

CONF = str(config.CONF_DIR)
GROUPS = ["model", "attention", "executor", "mesh"]


def compose_infer(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(config_name="infer", overrides=list(overrides))


@pytest.mark.parametrize("group,name", [(g, n) for g in GROUPS for n in config.options(g)])
def test_every_option_composes_and_builds(group, name):
    cfg = compose_infer(f"{group}={name}")
    obj = instantiate(cfg[group])
    if group == "attention":
        assert isinstance(obj, AttentionBackend) and obj.name == name
    elif group == "executor":
        assert isinstance(obj, Executor) and obj.name == name
    elif group == "mesh":
        assert isinstance(obj, MeshSpec) and obj.spmd == (name != "single")
    else:
        assert obj.name == name and obj.architectures


def test_groups_have_the_expected_options():
    assert {"sdpa", "eager", "pallas"} <= set(config.options("attention"))
    assert {"eager", "xla"} <= set(config.options("executor"))
    assert "qwen2_vl" in config.options("model")


def test_unknown_attention_lists_the_options():
    with pytest.raises(MissingConfigException) as e:
        compose_infer("attention=flashy")
    msg = str(e.value)
    assert "flashy" in msg
    for name in ("eager", "pallas", "sdpa"):
        assert name in msg


def test_root_defaults():
    cfg = compose_infer()
    assert cfg.checkpoint is None and cfg.dtype == "float32"
    assert cfg.executor._target_.endswith("XLAExecutor")
