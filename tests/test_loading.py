"""Loading weights once, in place, in the run dtype (mmzoo._weights): modules built with their
parameters on the meta device, each checkpoint tensor read lazily, cast, laid out and placed unit by
unit; the memory this takes, and the memory plan's refusal of a configuration that cannot fit."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import mmzoo
from mmzoo import checkpoint as ckpt_io
from mmzoo import _weights
from mmzoo.errors import MmzooError
from mmzoo.fixtures import make_tiny_qwen2_vl


def test_parameters_on_meta_keeps_buffers():
    from mmzoo.lms.decoder import qwen2

    with _weights.parameters_on_meta():
        lm = qwen2(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_dim=64,
                   mrope_section=[1, 1, 2])
    assert all(p.is_meta for p in lm.parameters())
    assert not lm.rotary.inv_freq.is_meta and torch.isfinite(lm.rotary.inv_freq).all()
    assert not nn.Linear(2, 2).weight.is_meta  # the patch ends with the block


def test_lazy_tensors_read_only_what_is_asked(qwen2_vl_ckpt):
    lazy = _weights.checkpoint_tensors(qwen2_vl_ckpt)
    eager = ckpt_io.read_safetensors(qwen2_vl_ckpt)
    assert lazy.keys() == eager.keys()
    key = next(k for k in lazy if k.endswith("attn.qkv.weight"))
    assert lazy[key].shape == eager[key].shape and lazy[key].dtype == eager[key].dtype
    for part, ref in zip(lazy[key].chunk(3, dim=0), eager[key].chunk(3, dim=0)):
        assert part.shape == ref.shape and torch.equal(part.load(), ref)
    bias = next(k for k in lazy if k.endswith("attn.qkv.bias"))
    assert torch.equal(lazy[bias].chunk(3)[2].load(), eager[bias].chunk(3)[2])


def _engine_tensors(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in engine.executor.model.state_dict().items()}


@pytest.mark.parametrize("executor", ["eager", "xla"])
def test_checkpoint_load_equals_loading_into_a_random_init(tmp_path, executor):
    """The lazy, unit-by-unit path gives every placed tensor (fused, transposed, tied) the values
    that the whole-model path (the seeded random init with the checkpoint copied in) gives."""
    ckpt = make_tiny_qwen2_vl(tmp_path / "tied", tie_word_embeddings=True, max_shard_size="100KB")
    opts = {"warmup": "none", "max_model_len": 64} if executor == "xla" else {"max_model_len": 64}
    lazy = mmzoo.load(ckpt, executor=executor, **opts)
    assert lazy.executor.model.lm.embed_tokens.weight.device.type == ("xla" if executor == "xla" else "cpu")
    # the reference: a random-init engine whose modules get the checkpoint's tensors copied in before setup
    from mmzoo import config, engine as engine_mod

    cfg = config.compose([f"executor={executor}", "weights=random"], values={
        "checkpoint": str(ckpt), "executor": {"max_model_len": 64}, "warmup": "none"})
    family, model = engine_mod.build_model(cfg)
    state = family.convert_weights(ckpt_io.read_safetensors(ckpt))
    ckpt_io.load_strict(model, state, source="ckpt")
    exe = config.instantiate_part(cfg.executor, "executor")
    exe.setup(model, dtype="float32")
    ref = {k: v.detach().cpu() for k, v in exe.model.state_dict().items()}
    got = _engine_tensors(lazy)
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    if executor == "xla":  # laid out: fused and held transposed, the head a transposed copy of the embedding
        lm = lazy.executor.model.lm
        assert lm.layers[0].attn.qkv_proj is not None
        torch.testing.assert_close(lm.lm_head.weight.cpu(), lm.embed_tokens.weight.cpu(), rtol=0, atol=0)


def test_memory_plan_refuses_what_cannot_fit(qwen2_vl_ckpt, capsys):
    with pytest.raises(MmzooError, match=r"the model does not fit: it needs [\d.]+ GB \(weights .* \+ KV cache "
                                         r"[\d.]+ GB \(max_batch=64 x max_model_len=2000000 x \d+ layers\) .*\) but "
                                         r"[\d.]+ GB of memory is available; lower dtype=bfloat16 .*, or "
                                         r"executor\.max_model_len \(now 2000000\) or executor\.max_batch \(now 64\)"):
        mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=2_000_000, max_batch=64)


_MEASURE = textwrap.dedent("""
    import json, os, sys
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import mmzoo, torch, torch_xla
    from transformers import AutoProcessor
    import mmzoo.executor.eager, mmzoo.executor.xla

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    ckpt, executor, dtype = sys.argv[1:4]
    AutoProcessor.from_pretrained(ckpt)  # the imports and the processor's memory are not the loader's
    mmzoo.config.compose([], values={"checkpoint": ckpt})
    opts = {"warmup": "none"} if executor == "xla" else {}
    if executor == "xla":
        (torch.zeros(4, 4, device=torch_xla.device()) + 1).cpu()  # nor is the XLA runtime's (and its compiler's)
    elif torch.backends.mkldnn.is_available():  # nor oneDNN's (the eager executor packs bf16 weights with it)
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64, dtype=torch.bfloat16), 1)
    before = rss("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
    engine = mmzoo.load(ckpt, executor=executor, dtype=dtype, max_model_len=32, max_batch=1, **opts)
    exe = engine.executor
    exe.wait_ready()  # the eager executor's bf16 weights, packed in the background
    params = list(exe.model.parameters()) + [b for n, b in exe.model.named_buffers() if n.endswith("packed")]
    buffers = [exe.media] + exe.cache.k + exe.cache.v  # the executor's own allocations beside the weights
    print(json.dumps({"growth": rss("VmHWM:") - before, "bytes": sum(p.numel() * p.element_size() for p in params),
                      "buffers": sum(b.numel() * b.element_size() for b in buffers),
                      "dtypes": sorted({str(p.dtype) for p in params})}))
""")


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """A ~170 MB (float32) checkpoint of many small layers: its largest tensor is a few MB, so a
    loader that holds one unit at a time grows by about the weights alone."""
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("wide") / "ckpt", hidden_size=512, num_layers=12,
                              num_heads=8, num_kv_heads=2, intermediate_size=1792, vision_embed_dim=64,
                              vision_depth=2, vision_num_heads=2, max_shard_size="60MB")


@pytest.mark.parametrize("executor,dtype", [("eager", "float32"), ("eager", "bfloat16"), ("xla", "float32"),
                                            ("xla", "bfloat16")])
def test_loading_grows_memory_by_the_weights_alone(wide_checkpoint, executor, dtype):
    index = json.loads((wide_checkpoint / "model.safetensors.index.json").read_text())
    size = 2 if dtype == "bfloat16" else 4
    weights = index["metadata"]["total_size"] // 4 * size  # the checkpoint is float32
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(wide_checkpoint), executor, dtype],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["dtypes"] == [f"torch.{dtype}"] and got["bytes"] >= weights  # (a laid-out tied head would add to it)
    # at most one unit's tensors on the host besides the placed weights (a float32 tensor read for a float32
    # run may stay backed by the file's pages until it is touched: then the growth is below the weights)
    # (+ 16 MB: the XLA runtime's and oneDNN's own allocations move by ~10 MB from run to run)
    assert got["growth"] <= 1.2 * weights + got["buffers"] + 16e6, (got, weights)


@pytest.mark.skipif(not __import__("mmzoo.executor._layout", fromlist=["can_pack"]).can_pack(),
                    reason="this torch build has no oneDNN")
def test_packed_linear_computes_the_same_products():
    from mmzoo.executor._layout import PackedLinear

    torch.manual_seed(0)
    linear = nn.Linear(96, 200).to(torch.bfloat16)
    packed = PackedLinear(linear, rows=8)
    for shape in [(1, 1, 96), (8, 1, 96), (3, 96)]:  # decode steps' rows: the same products exactly
        x = torch.randn(*shape).to(torch.bfloat16)
        assert torch.equal(packed(x), linear(x)), shape
    x = torch.randn(1, 64, 96).to(torch.bfloat16)  # a prefill's rows: to bfloat16's rounding
    torch.testing.assert_close(packed(x), linear(x), rtol=2 ** -7, atol=1e-2)


def test_eager_bfloat16_packs_the_lm_layers_and_keeps_the_tokens(qwen2_vl_ckpt):
    packed = mmzoo.load(qwen2_vl_ckpt, executor="eager", dtype="bfloat16", max_model_len=128)
    plain = mmzoo.load(qwen2_vl_ckpt, executor="eager", dtype="bfloat16", max_model_len=128, pack_weights=False)
    from mmzoo.executor._layout import PackedLinear

    layers = packed.executor.model.lm.layers
    assert isinstance(layers[0].attn.q_proj, PackedLinear) and isinstance(layers[-1].mlp.down_proj, PackedLinear)
    assert not isinstance(packed.executor.model.lm.lm_head, PackedLinear)
    assert not any(isinstance(m, PackedLinear) for m in plain.executor.model.modules())
    req = dict(prompt="Tell me a story.", max_new_tokens=12, ignore_eos=True)
    a, b = packed.generate(req), plain.generate(req)
    # the prompt's products may round differently; the decode steps' are the same products
    assert a.token_ids[:4] == b.token_ids[:4], (a.token_ids, b.token_ids)


@pytest.mark.skipif(not __import__("mmzoo.executor._layout", fromlist=["can_pack"]).can_pack(),
                    reason="this torch build has no oneDNN")
def test_eager_packs_weights_mapped_from_a_bfloat16_checkpoint_in_the_background(tmp_path, monkeypatch):
    """A bf16 checkpoint's LM weights are views of their files at load, packed after it on a thread
    (or by the first forward that needs one): the tokens are those of weights packed at load."""
    from mmzoo.executor import _layout
    from mmzoo.fixtures.real_size import make_real_size_qwen2_vl

    ckpt = make_real_size_qwen2_vl(tmp_path / "bf16", preset="tiny_shallow", dtype="bfloat16")
    req = dict(prompt="Tell me a story.", max_new_tokens=12, ignore_eos=True)
    background = mmzoo.load(ckpt, executor="eager", dtype="bfloat16", max_model_len=128)
    background.executor.wait_ready()
    linears = [m for m in background.executor.model.lm.layers.modules() if isinstance(m, _layout.PackedLinear)]
    assert len(linears) == 4 * 7 and all(m.packed is not None and m._weight is None for m in linears)
    monkeypatch.setattr(_layout, "pack_pending", lambda modules: None)  # no thread: each packed by its forward
    on_demand = mmzoo.load(ckpt, executor="eager", dtype="bfloat16", max_model_len=128)
    pending = [m for m in on_demand.executor.model.lm.layers.modules() if isinstance(m, _layout.PackedLinear)]
    assert all(m.packed is None for m in pending)  # views of the files, nothing reordered at load
    assert on_demand.generate(req).token_ids == background.generate(req).token_ids
    assert all(m.packed is not None for m in pending)
    monkeypatch.undo()
    f32 = make_real_size_qwen2_vl(tmp_path / "f32", preset="tiny_shallow", dtype="float32")
    cast = mmzoo.load(f32, executor="eager", dtype="bfloat16", max_model_len=128)  # read and cast: packed at load
    assert all(m.packed is not None for m in cast.executor.model.lm.layers.modules()
               if isinstance(m, _layout.PackedLinear))
    assert cast.generate(req).token_ids == background.generate(req).token_ids
