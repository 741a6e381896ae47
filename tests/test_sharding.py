"""Sharding tier: tensor and data parallelism over a device mesh with torch_xla SPMD.

SPMD is process-wide and must be on before the first XLA tensor, with ``CPU_NUM_DEVICES`` set
before torch_xla starts, so every sharded engine runs in one subprocess on 4 virtual CPU devices
(``tests/_spmd_worker.py``, started once for the module) that writes its findings as JSON. The
single-device reference is computed there too, by the eager executor (plain CPU tensors, which
SPMD leaves alone; the unsharded XLA executor matches it token for token, test_executor.py).

Checked: greedy tokens identical to the reference for tp=2 (every attention backend), tp=4 and
dp=2 x tp=2 on Qwen2-VL, and for every other conf/model family (:func:`mmzoo.fixtures.families`, on
its tiny checkpoint) at dp=2 x tp=2 with Pallas run per shard; no graph compiled after warmup; the
sharding of each weight (the family's own plan, ``Family.tp_plan``) and of the KV cache. The plans
and bad meshes are checked in this process: they fail before SPMD is switched on.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import mmzoo
from mmzoo import config
from mmzoo.errors import MmzooError
from mmzoo.executor import MeshSpec
from mmzoo.executor._sharding import ShardingPlan, mesh_option
from mmzoo.fixtures import families, make_audio, make_image, make_tiny_qwen2_vl, write_wav
from mmzoo.models import Family

GEN = {"max_new_tokens": 8, "ignore_eos": True}
FAMILIES = families()  # every conf/model option: its family class and tiny checkpoint builder
MESH = "qwen2_vl-4heads"  # the checkpoint of the mesh and backend cases: Qwen2-VL with 4 vision heads (tp=4 divides)
QWEN2_VL_XLA = {"max_model_len": 128, "max_batch": 2, "buckets": {"prefill": [64], "encoder": {"vision": [64]},
                                                                   "min_encoder_rows": 64, "max_encoder_rows": 64}}
# every family's case: the tower's own buckets (patches up to 64 rows, or whole items), room for two 1 s clips
FAMILY_XLA = {"max_model_len": 160, "max_batch": 2,
              "buckets": {"prefill": [128], "min_encoder_rows": 64, "max_encoder_rows": 64}}
# (name, family, checkpoint, mesh, attention, executor options): every backend at tp=2, then the other meshes,
# one with fused q/k/v and gate/up projections (split column-wise like their parts); then every family at
# dp=2 x tp=2 with Pallas, whose kernels run per shard on each tower's own attention inputs (segments, lengths);
# Qwen2-VL's own there is qwen2_vl-tp2-pallas and qwen2_vl-dp2tp2-sdpa together (its 4-head tower at both)
OTHER_FAMILIES = sorted(set(FAMILIES) - {"qwen2_vl"})
CASES = [("qwen2_vl-tp2-sdpa", "qwen2_vl", MESH, {"model": 2}, "sdpa", QWEN2_VL_XLA),
         ("qwen2_vl-tp2-sdpa-fused", "qwen2_vl", MESH, {"model": 2}, "sdpa", dict(QWEN2_VL_XLA, layout={"fuse_projections": True})),
         ("qwen2_vl-tp2-eager", "qwen2_vl", MESH, {"model": 2}, "eager", QWEN2_VL_XLA),
         ("qwen2_vl-tp2-pallas", "qwen2_vl", MESH, {"model": 2}, "pallas", QWEN2_VL_XLA),
         ("qwen2_vl-tp4-pallas", "qwen2_vl", MESH, {"model": 4}, "pallas", QWEN2_VL_XLA),  # 2 kv heads < 4: replicated
         ("qwen2_vl-dp2tp2-sdpa", "qwen2_vl", MESH, {"data": 2, "model": 2}, "sdpa", QWEN2_VL_XLA),
         *((f"{name}-dp2tp2-pallas", name, name, {"data": 2, "model": 2}, "pallas", FAMILY_XLA)
           for name in OTHER_FAMILIES)]
# each family's dp=2 x tp=2 case -> its checkpoint
FAMILY_CASES = {"qwen2_vl-dp2tp2-sdpa": MESH, **{f"{name}-dp2tp2-pallas": name for name in OTHER_FAMILIES}}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tiny_checkpoints):
    """Every family's tiny checkpoint (by family), and Qwen2-VL's with 4 vision heads (``MESH``)."""
    root = tmp_path_factory.mktemp("spmd")
    return {**tiny_checkpoints, MESH: make_tiny_qwen2_vl(root / "qwen2_vl", seed=0, vision_num_heads=4)}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("spmd_media")
    images = []
    for i, (w, h) in enumerate([(56, 84), (56, 56)]):
        images.append(str(root / f"img{i}.png"))
        make_image(w, h, seed=i).save(images[-1])
    audios = [str(write_wav(root / "a0.wav", make_audio(0.6, seed=0))),
              str(write_wav(root / "a1.wav", make_audio(1.2, seed=1)))]
    return {"images": images, "audios": audios}


def requests_for(family: str, media) -> list[dict]:
    """Three requests through two slots (one reuses a freed slot), with and without the family's media."""
    kind = FAMILIES[family].media + "s"
    return [{"prompt": "what is in this", kind: media[kind][:1], **GEN},
            {"prompt": "hello there friend", **GEN},
            {"prompt": "describe it", kind: media[kind][1:], **GEN}]


@pytest.fixture(scope="module")
def spmd(ckpts, media, tmp_path_factory):
    """Runs every case in one subprocess on 4 virtual CPU devices; ``{"cases": {name: record}}``."""
    root = tmp_path_factory.mktemp("spmd_run")
    cases = [{"name": name, "checkpoint": str(ckpts[ckpt]), "mesh": mesh, "attention": attention,
              "executor": executor, "requests": requests_for(family, media)}
             for name, family, ckpt, mesh, attention, executor in CASES]
    (root / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    worker = Path(__file__).with_name("_spmd_worker.py")
    p = subprocess.run([sys.executable, str(worker), str(root / "cases.json"), str(root / "out.json")],
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads((root / "out.json").read_text())
    assert out["devices"] == 4
    return out


def _case(spmd, name: str) -> dict:
    rec = spmd["cases"][name]
    assert "exception" not in rec, rec["exception"]
    return rec


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_sharded_tokens_equal_single_device(spmd, name):
    rec = _case(spmd, name)
    assert not rec["errors"]
    assert rec["tokens"] == rec["reference"] and all(len(t) == GEN["max_new_tokens"] for t in rec["tokens"])


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_no_graph_compiles_after_warmup(spmd, name):
    rec = _case(spmd, name)
    assert rec["compiled_during_run"] == 0 and rec["graphs_after_warmup"] == [0, 0, 0]


def test_pallas_runs_per_shard(spmd):
    for name in (c[0] for c in CASES):
        want = ["PallasAttention"] if name.endswith("pallas") else []
        assert _case(spmd, name)["partitioned_backends"] == want, name


def tiles(spec: str, ndim: int) -> tuple[int, ...]:
    """The per-dimension tile counts of an HLO sharding (``{replicated}`` -> all ones)."""
    if spec == "{replicated}":
        return (1,) * ndim
    m = re.match(r"\{devices=\[([\d,]+)\]", spec)
    assert m, spec
    return tuple(int(x) for x in m.group(1).split(","))[:ndim]


def test_weight_shardings_at_tp4(spmd):
    rec = _case(spmd, "qwen2_vl-tp4-pallas")
    assert "kv heads replicated" in rec["describe"]
    specs = rec["specs"]
    column, row, rep = (4, 1), (1, 4), (1, 1)
    want = {"lm.embed_tokens.weight": column, "lm.lm_head.weight": column,
            "lm.layers.0.attn.q_proj.weight": column, "lm.layers.0.attn.q_proj.bias": (4,),
            "lm.layers.0.attn.k_proj.weight": rep, "lm.layers.0.attn.v_proj.bias": (1,),  # 2 kv heads < 4
            "lm.layers.0.attn.o_proj.weight": row,
            "lm.layers.1.mlp.gate_proj.weight": column, "lm.layers.1.mlp.up_proj.weight": column,
            "lm.layers.1.mlp.down_proj.weight": row, "lm.layers.0.norm1.weight": (1,), "lm.norm.weight": (1,),
            "towers.vision.encoder.blocks.0.attn.k_proj.weight": column,  # 4 heads, 4 kv heads: split
            "towers.vision.encoder.blocks.0.attn.o_proj.weight": row,
            "towers.vision.encoder.blocks.0.attn.o_proj.bias": (1,),
            "towers.vision.encoder.blocks.1.mlp.fc1.weight": column, "towers.vision.encoder.blocks.1.mlp.fc2.weight": row,
            "towers.vision.encoder.blocks.0.norm1.weight": (1,),
            "towers.vision.encoder.patch_embed.proj.weight": (1, 1, 1, 1, 1),
            "towers.vision.adapter.mlp.0.weight": column, "towers.vision.adapter.mlp.2.weight": row,
            "towers.vision.adapter.ln_q.weight": (1,)}
    for name, tile in want.items():
        assert tiles(specs[name], len(tile)) == tile, (name, specs[name])
    assert all(name in specs for name in want) and len(specs) > len(want)
    assert rec["cache_spec"] == "{replicated}"  # [slots, kv heads, len, d]: kv heads replicated, data=1


def test_fused_projections_split_column_wise(spmd):
    """Fusion (q/k/v and gate/up stacked into one linear, on the executor's copy) composes with a
    mesh: the fused weights are split like their parts, and the tokens equal the reference's
    (test_sharded_tokens_equal_single_device runs this case too)."""
    specs = _case(spmd, "qwen2_vl-tp2-sdpa-fused")["specs"]
    fused = [n for n in specs if n.startswith("lm.") and ("qkv_proj.weight" in n or "gate_up_proj.weight" in n)]
    assert fused and not any(n.endswith("q_proj.weight") and "qkv" not in n for n in specs if n.startswith("lm."))
    for name in fused:
        assert tiles(specs[name], 2) == (2, 1), (name, specs[name])


def test_kv_cache_sharding(spmd):
    assert tiles(_case(spmd, "qwen2_vl-tp2-sdpa")["cache_spec"], 4) == (1, 2, 1, 1)  # + 2 replicas
    assert "2 replicas" in _case(spmd, "qwen2_vl-tp2-sdpa")["describe"]
    assert tiles(_case(spmd, "qwen2_vl-dp2tp2-sdpa")["cache_spec"], 4) == (2, 2, 1, 1)


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_every_family_is_sharded_as_its_plan_says(spmd, ckpts, case):
    """On the devices, every weight of a family's engine is split as its family's plan
    (``Family.tp_plan``) says, its tower's too, and its KV cache over the data axis and the kv heads."""
    rec = _case(spmd, case)
    family, model = _built(ckpts[FAMILY_CASES[case]])
    plan = ShardingPlan(MeshSpec(data=2, model=2), model, max_batch=2, rules=family.tp_plan)
    assert set(rec["specs"]) == set(plan.specs)
    for name, spec in plan.specs.items():
        want = tuple(2 if axis else 1 for axis in spec)  # 'model' (2 ways) or None per dimension
        assert tiles(rec["specs"][name], len(spec)) == want, (name, rec["specs"][name])
    assert any(n.startswith("towers.") and any(spec) for n, spec in plan.specs.items())  # the tower is split too
    assert tiles(rec["cache_spec"], 4) == (2, 2 if plan.kv_sharded else 1, 1, 1)


# The one tensor-parallel plan every family had before each declared its own parts' patterns
# (Family.tp_plan = the shared components' TP_PLAN + its own): it named Llava's and Qwen2-VL's adapters.
PLAN_BEFORE = {
    "*.attn.q_proj.*": "colwise", "*.attn.k_proj.*": "colwise_kv", "*.attn.v_proj.*": "colwise_kv",
    "*.attn.qkv_proj.*": "colwise", "*.attn.o_proj.*": "rowwise",
    "*.mlp.gate_proj.*": "colwise", "*.mlp.up_proj.*": "colwise", "*.mlp.gate_up_proj.*": "colwise",
    "*.mlp.down_proj.*": "rowwise", "*.mlp.fc1.*": "colwise", "*.mlp.fc2.*": "rowwise",
    "towers.*.adapter.fc1.*": "colwise", "towers.*.adapter.fc2.*": "rowwise",
    "towers.*.adapter.mlp.0.*": "colwise", "towers.*.adapter.mlp.2.*": "rowwise",
    "lm.embed_tokens.weight": "vocab", "lm.lm_head.weight": "vocab",
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_plan_splits_every_parameter_as_before(ckpts, name):
    """A family's plan splits every parameter of its model as the one shared plan did (``PLAN_BEFORE``)
    with the family's own patterns first: for the families that plan named, exactly as before; a new
    family's own patterns decide for its own parts alone. Each of its own patterns names a parameter."""
    family, model = _built(ckpts[name])
    own = {p: style for p, style in family.tp_plan.items() if Family.tp_plan.get(p) != style}
    mesh = MeshSpec(model=2)
    want = ShardingPlan(mesh, model, max_batch=2, rules={**own, **PLAN_BEFORE}).specs
    assert ShardingPlan(mesh, model, max_batch=2, rules=family.tp_plan).specs == want
    names = [n for n, _ in model.named_parameters()]
    assert all(any(fnmatch.fnmatchcase(n, p) for n in names) for p in own), own


def test_the_default_plan_is_the_shared_components(ckpts):
    """Without a family's plan, the adapters are not split (their patterns are the families')."""
    plan = ShardingPlan(MeshSpec(model=2), _built(ckpts["qwen2_vl"])[1], max_batch=2)
    assert plan.rules == Family.tp_plan and not any(p.startswith("towers.") for p in plan.rules)
    assert plan.specs["towers.vision.adapter.mlp.0.weight"] == (None, None)
    assert plan.specs["towers.vision.encoder.blocks.0.mlp.fc1.weight"] == ("model", None)


# ---------------------------------------------------------------- bad meshes (this process, no SPMD)

def test_mesh_config_group():
    assert {"single", "tp", "dp_tp"} <= set(config.options("mesh"))
    with initialize_config_dir(config_dir=str(config.CONF_DIR), version_base=None):
        cfg = compose(config_name="infer", overrides=["mesh=tp", "mesh.model=4"])
        assert mesh_option(cfg.mesh) == MeshSpec(data=1, model=4)
        assert mesh_option(compose(config_name="infer").mesh) == MeshSpec()  # the default: single, no SPMD
    assert not mesh_option("single").spmd and mesh_option("dp_tp") == MeshSpec(data=2, model=2)
    assert mesh_option({"model": 2}) == MeshSpec(model=2)
    with pytest.raises(MmzooError, match=r"mesh.model=0 must be a positive integer"):
        MeshSpec(model=0)
    with pytest.raises(MmzooError, match=r"unknown fields \['tensor'\]"):
        mesh_option({"tensor": 2})


def test_heads_not_divisible(ckpts):
    with pytest.raises(MmzooError, match=r"mesh.model=8 does not divide num_heads=4 of lm.layers.0"):
        mmzoo.load(ckpts["qwen2_vl"], executor="xla", mesh={"model": 8}, warmup=False)
    # Llava's LM has 4 heads (2 kv heads: replicated at model=4), its CLIP tower 2
    with pytest.raises(MmzooError, match=r"mesh.model=4 does not divide num_heads=2 of towers.vision.encoder.blocks.0"):
        ShardingPlan(MeshSpec(model=4), _built(ckpts["llava"])[1], max_batch=2)


def _built(ckpt):
    """``(family, modules)`` for ``ckpt`` (parameters on the meta device: structure only)."""
    from mmzoo.engine import build_model

    return build_model(mmzoo.compose(values={"checkpoint": str(ckpt)}), empty=True)


def test_kv_heads_neither_divides():
    from mmzoo.layers import rope_1d
    from mmzoo.lms import DecoderLM
    from mmzoo.backends import SDPAAttention
    from mmzoo.models import MultimodalLM

    lm = DecoderLM(vocab_size=64, dim=48, num_layers=1, num_heads=6, num_kv_heads=3, head_dim=8, intermediate_dim=32,
                   rotary=rope_1d(8, 10000.0), attn_fn=SDPAAttention(), qkv_bias=True, norm_eps=1e-6)
    with pytest.raises(MmzooError, match=r"mesh.model=2 and num_kv_heads=3 of lm.layers.0: neither divides"):
        ShardingPlan(MeshSpec(model=2), MultimodalLM(lm=lm, towers={}), max_batch=2)
    plan = ShardingPlan(MeshSpec(model=3), MultimodalLM(lm=lm, towers={}), max_batch=2)
    assert plan.kv_sharded and plan.specs["lm.layers.0.attn.k_proj.weight"] == ("model", None)


def test_batch_not_divisible_and_too_many_devices(ckpts):
    with pytest.raises(MmzooError, match=r"executor.max_batch=3 is not a multiple of mesh.data=2"):
        mmzoo.load(ckpts["qwen2_vl"], executor="xla", mesh="dp_tp", max_batch=3, warmup=False)
    with pytest.raises(MmzooError, match=r"mesh.data=64 x mesh.model=1 needs 64 devices but PJRT_DEVICE=CPU has \d"):
        mmzoo.load(ckpts["qwen2_vl"], executor="xla", mesh={"data": 64}, max_batch=64, warmup=False)
    with pytest.raises(MmzooError, match=r"needs executor=xla"):
        mmzoo.load(ckpts["qwen2_vl"], executor="eager", mesh="tp")
