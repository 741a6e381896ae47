"""The config is the pipeline: what ``--cfg job`` prints is what is built, sizes come from the
checkpoint and can be overridden, a new composition is YAML alone, and a user's conf dir joins the
zoo for the CLI and the API alike."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import mmzoo
from mmzoo.engine import backends_of
from mmzoo.errors import MmzooError

GEN = {"max_new_tokens": 6, "ignore_eos": True}
XLA_SMALL = {"progress": False, "compile": {"warmup": False}, "max_model_len": 128, "max_batch": 1,
             "buckets": {"prefill": [128], "min_encoder_rows": 256, "max_encoder_rows": 256, "decode_kv": [128]}}


def infer(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    return subprocess.run([sys.executable, "-m", "mmzoo.infer", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_cfg_job_prints_the_three_components_with_their_sizes(qwen2_vl_ckpt, tmp_path):
    from transformers import AutoConfig

    p = infer("model=qwen2_vl", f"checkpoint={qwen2_vl_ckpt}", "model.encoder.attention=pallas", "--cfg", "job",
              "--resolve", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    model = yaml.safe_load(p.stdout)["model"]
    hf = AutoConfig.from_pretrained(qwen2_vl_ckpt)
    assert model["encoder"]["_target_"] == "mmzoo.encoders.qwen2_vl_vit"
    assert model["encoder"]["depth"] == hf.vision_config.depth and model["encoder"]["attention"] == "pallas"
    assert model["adapter"]["_target_"] == "mmzoo.adapters.PatchMerger"
    assert model["adapter"]["out_dim"] == model["lm"]["dim"] == hf.text_config.hidden_size
    assert model["lm"]["_target_"] == "mmzoo.lms.qwen2"
    assert model["lm"]["num_layers"] == hf.text_config.num_hidden_layers
    assert model["lm"]["attention"] == {"_target_": "mmzoo.backends.SDPAAttention"}


def test_cli_picks_the_family_and_lm_from_the_checkpoint(llava_qwen2_ckpt, tmp_path):
    p = infer(f"checkpoint={llava_qwen2_ckpt}", "--cfg", "job", "--resolve", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    model = yaml.safe_load(p.stdout)["model"]
    assert model["name"] == "llava" and model["lm"]["_target_"] == "mmzoo.lms.qwen2"
    assert model["encoder"]["_target_"] == "mmzoo.encoders.clip_vit"


def test_size_override_builds_it_and_strict_loading_names_the_tensor(qwen2_vl_ckpt):
    with pytest.raises(MmzooError, match=r"unexpected .*lm\.layers\.1\."):
        mmzoo.load(qwen2_vl_ckpt, executor="eager", overrides=["model.lm.num_layers=1"])
    engine = mmzoo.load(qwen2_vl_ckpt, executor="eager", overrides=["model.lm.num_layers=1", "weights=random"])
    assert len(engine.model.lm.layers) == 1  # asked for explicitly: a seeded random init
    again = mmzoo.load(qwen2_vl_ckpt, executor="eager", overrides=["model.lm.num_layers=1", "weights=random"])
    assert torch.equal(engine.model.lm.embed_tokens.weight, again.model.lm.embed_tokens.weight)


def test_no_checkpoint_no_silent_random_weights(tmp_path):
    with pytest.raises(MmzooError, match="model=llava has no embedded default checkpoint: give checkpoint=DIR"):
        mmzoo.load(model="llava", executor="eager")
    p = infer("model=qwen2_audio", "executor=eager", cwd=tmp_path)
    assert p.returncode == 1 and "has no embedded default checkpoint" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("executor", ["eager", "xla"])
def test_research_recipe_builds_runs_forward_and_generates(recipes, executor):
    """recipes/research_vit_llama.yaml: Qwen2-VL's ViT + patch merger feeding a Llama LM at chosen
    sizes, random init; the tokenizer and image processor from the demo checkpoint."""
    values = {"executor": XLA_SMALL} if executor == "xla" else {}
    cfg = mmzoo.compose([f"executor={executor}"], config_name="research_vit_llama", config_dir=recipes, values=values)
    assert cfg.model.name == "vit_llama" and cfg.weights == "random"
    engine = mmzoo.build(cfg)
    assert type(engine.model.towers["vision"].encoder).__name__ == "Qwen2VisionEncoder"
    assert engine.model.lm.rotary.num_axes == 1 and engine.model.lm.dim == 96 and len(engine.model.lm.layers) == 2
    prepared = engine.prepare(mmzoo.Request(prompt="Describe this image.", images=list(cfg.images)))
    logits = engine.executor.prompt_logits(prepared)
    assert logits.shape == (len(prepared.input_ids), cfg.model.lm.vocab_size) and bool(torch.isfinite(
        torch.as_tensor(logits)).all())
    result = engine.generate(mmzoo.Request(prompt="Describe this image.", images=list(cfg.images), **GEN))
    assert len(result.token_ids) == GEN["max_new_tokens"] and result.error is None


def test_research_recipe_cli(recipes, tmp_path):
    out = tmp_path / "out.jsonl"
    p = infer("--config-dir", str(recipes), "--config-name", "research_vit_llama", "executor=eager",
              f"output={out}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "model=vit_llama encoder=qwen2_vl_vit(sdpa) adapter=PatchMerger lm=llama(sdpa)" in p.stderr
    assert "weights=random" in p.stderr and out.is_file()


def _my_conf(root: Path) -> Path:
    """A downstream project's own conf dir: a family variant with Pallas in its ViT."""
    (root / "model").mkdir(parents=True)
    (root / "model" / "mine.yaml").write_text(
        "defaults:\n  - qwen2_vl\n  - _self_\n\nname: mine\nencoder:\n  attention: pallas\n")
    return root


def test_users_conf_dir_from_cli_and_api(qwen2_vl_ckpt, image_files, tmp_path):
    conf = _my_conf(tmp_path / "myconf")
    out = tmp_path / "out.jsonl"
    p = infer("--config-dir", str(conf), "model=mine", f"checkpoint={qwen2_vl_ckpt}", f"images=[{image_files[0]}]",
              "executor=eager", "max_new_tokens=4", "ignore_eos=true", f"output={out}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "model=mine encoder=qwen2_vl_vit(pallas)" in p.stderr and "lm=qwen2(sdpa)" in p.stderr
    engine = mmzoo.load(qwen2_vl_ckpt, model="mine", config_dir=conf, executor="eager")
    assert backends_of(engine.model.towers["vision"].encoder) == ["pallas"] and backends_of(engine.model.lm) == ["sdpa"]
    import json

    row = json.loads(out.read_text())
    got = engine.generate(mmzoo.Request(prompt="What shape is this?", images=[image_files[0]], max_new_tokens=4,
                                        ignore_eos=True))
    assert got.token_ids == row["token_ids"]


def test_users_family_from_hydra_searchpath(qwen2_vl_ckpt, tmp_path):
    """``hydra.searchpath`` adds a user's dir as ``--config-dir`` does: its family composes, with its
    own choices and the checkpoint's sizes. (A primary config, ``--config-name``, only in such a dir
    is not found: Hydra 1.3 looks the primary config up before it adds the searchpath.)"""
    conf = _my_conf(tmp_path / "myconf")
    p = infer(f"hydra.searchpath=[file://{conf}]", "model=mine", f"checkpoint={qwen2_vl_ckpt}", "--cfg", "job",
              "--resolve", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    model = yaml.safe_load(p.stdout)["model"]
    assert model["name"] == "mine" and model["encoder"]["attention"] == "pallas"
    assert model["lm"]["_target_"] == "mmzoo.lms.qwen2" and model["lm"]["num_layers"] == 2


def test_load_one_component_and_set_its_backend(qwen2_vl_ckpt):
    """Research code on single modules: a component built on its own, the family checkpoint's weights
    loaded into it (prefixes handled), its backend swapped."""
    from hydra.utils import instantiate

    from mmzoo.backends import set_attention
    from mmzoo.checkpoint import load_component

    engine = mmzoo.load(qwen2_vl_ckpt, executor="eager")
    cfg = mmzoo.compose(values={"checkpoint": str(qwen2_vl_ckpt)})
    for part, ref in (("encoder", engine.model.towers["vision"].encoder), ("lm", engine.model.lm)):
        module = load_component(instantiate(cfg.model[part]), qwen2_vl_ckpt, part)
        theirs = ref.state_dict()
        assert all(torch.equal(v, theirs[k]) for k, v in module.state_dict().items())
    assert set_attention(module, "eager") == len(module.layers) and backends_of(module) == ["eager"]
    with pytest.raises(MmzooError, match="part='tower'"):
        load_component(module, qwen2_vl_ckpt, "tower")
