"""Executor tier: warmup covers every graph, the compile guard, batching, sampling, bad requests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mmzoo
from mmzoo.backends import SDPAAttention
from mmzoo.executor.options import BucketSpec
from mmzoo.executor.xla import RecompileError
from mmzoo.fixtures import make_image
from mmzoo.types import Request

BUCKETS = {"min_prefill": 32, "min_decode_kv": 32, "encoder": {"vision": [64, 256]}}
SMALL = dict(max_model_len=128, buckets=BUCKETS, progress=False)


def _resolve(spec, *, max_batch: int, max_model_len: int = 128):
    """``spec``'s buckets for a text-only model with matmul attention on the XLA CPU client."""
    return spec.resolve(max_model_len=max_model_len, max_batch=max_batch, max_prefill_tokens=max_model_len, towers={},
                        lm_backends=[SDPAAttention()], cpu_alone=True, mesh=False)


@pytest.fixture(scope="module")
def xla_engine(qwen2_vl_ckpt):
    return mmzoo.load(qwen2_vl_ckpt, executor="xla", attention="sdpa", max_batch=3, **SMALL)


@pytest.fixture(scope="module")
def eager_engine(qwen2_vl_ckpt):
    return mmzoo.load(qwen2_vl_ckpt, executor="eager", attention="sdpa", max_model_len=128, max_batch=3)


def workload(image_files):
    """Mixed prompt lengths, 0 to 3 images of mixed sizes, greedy and sampled requests."""
    reqs = []
    for i in range(10):
        reqs.append({"prompt": "what shape is this " * (1 + i % 4), "images": image_files[: i % 4],
                     "max_new_tokens": 3 + i % 5, "ignore_eos": True,
                     "temperature": 0.0 if i % 3 else 0.8, "top_k": 5 * (i % 2), "top_p": 0.9, "seed": i})
    return reqs


def test_mixed_workload_compiles_nothing_after_warmup(xla_engine, image_files):
    exe = xla_engine.executor
    before = exe.compiled_graphs()
    results = xla_engine.generate(workload(image_files))
    assert all(r.error is None for r in results), [r.error for r in results]
    assert exe.compiled_graphs() == before
    assert all(r.graphs_compiled_after_warmup == 0 for r in results)
    assert [len(r.token_ids) for r in results] == [3 + i % 5 for i in range(10)]


def test_padded_xla_matches_unpadded_eager(xla_engine, eager_engine, image_files):
    greedy = [dict(r, temperature=0.0) for r in workload(image_files)]
    assert [r.token_ids for r in xla_engine.generate(greedy)] == [r.token_ids for r in eager_engine.generate(greedy)]


def test_decode_attends_over_the_smallest_cache_bucket_holding_the_batch(xla_engine, eager_engine, image_files,
                                                                        monkeypatch):
    """Each decode step attends over the smallest KV-cache length bucket that holds its longest
    sequence: the mixed workload runs at several buckets, each step's bucket holds every active
    sequence, and the tokens equal eager's (which always reads the whole cache)."""
    exe = xla_engine.executor
    from mmzoo.executor import loop

    assert exe.buckets.decode_kv == (32, 64, 128)
    picked, decode_inputs = [], loop.decode_inputs

    def recording(buckets, active, *args, **kwargs):
        inputs = decode_inputs(buckets, active, *args, **kwargs)
        picked.append((max(seq.length for seq in active.values()) + 1, inputs.kv_len))
        return inputs

    monkeypatch.setattr(loop, "decode_inputs", recording)
    greedy = [dict(r, temperature=0.0, max_new_tokens=12) for r in workload(image_files)]
    assert [r.token_ids for r in xla_engine.generate(greedy)] == [r.token_ids for r in eager_engine.generate(greedy)]
    assert len({kv for _, kv in picked}) >= 2, picked  # sequences grew across a bucket boundary
    assert all(n <= kv and (kv == 32 or n > kv // 2) for n, kv in picked), picked
    with pytest.raises(ValueError, match=r"executor.buckets.decode_kv=\[64, 256\] must lie in \[1, max_model_len=128\]"):
        mmzoo.executor.XLAExecutor(max_model_len=128, buckets={"decode_kv": [64, 256]})
    assert _resolve(BucketSpec(decode_kv=[64]), max_batch=1).decode_kv == (64, 128)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(eager_engine, image_files):
    req = {"prompt": "tell me a story", "max_new_tokens": 12, "ignore_eos": True, "temperature": 1.0, "seed": 7}
    alone = eager_engine.generate([req])[0].token_ids
    crowded = eager_engine.generate([dict(req, seed=1), req, dict(req, seed=2)])
    assert crowded[1].token_ids == alone
    assert len({tuple(r.token_ids) for r in crowded}) > 1  # different seeds, different samples


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 1, "seed": 3},
                                    {"temperature": 1.0, "top_p": 1e-6, "seed": 3}])
def test_degenerate_sampling_equals_greedy(eager_engine, params):
    base = {"prompt": "hello there", "max_new_tokens": 8, "ignore_eos": True}
    greedy = eager_engine.generate([base])[0].token_ids
    assert eager_engine.generate([dict(base, **params)])[0].token_ids == greedy


def test_stop_tokens(eager_engine):
    base = {"prompt": "hello there", "max_new_tokens": 8, "ignore_eos": True}
    tokens = eager_engine.generate([base])[0].token_ids
    stopped = eager_engine.generate([dict(base, stop_token_ids=[tokens[2]])])[0]
    cut = tokens.index(tokens[2]) + 1
    assert stopped.token_ids == tokens[:cut] and stopped.finish_reason == "stop"


def test_the_loop_releases_host_memory_once_it_has_nothing_to_run(eager_engine, monkeypatch):
    """``Executor.idle`` (the freed host memory back to the system) runs once each time the loop empties,
    never between the steps of a run."""
    exe = eager_engine.executor
    calls, steps = [], []
    idle, decode = exe.idle, exe.decode
    monkeypatch.setattr(exe, "idle", lambda: (calls.append(len(steps)), idle())[1])
    monkeypatch.setattr(exe, "decode", lambda *a, **k: (steps.append(1), decode(*a, **k))[1])
    reqs = [{"prompt": "hello there", "max_new_tokens": n, "ignore_eos": True} for n in (3, 6)]
    eager_engine.generate(reqs)
    assert calls == [len(steps)] and len(steps) >= 5
    eager_engine.generate(reqs[:1])
    assert len(calls) == 2 and calls[1] == len(steps)


@pytest.mark.parametrize("engine", ["xla_engine", "eager_engine"])
def test_early_stops_in_a_full_batch_equal_each_request_alone(engine, request, image_files):
    """Decode runs one step ahead of the tokens read back, so a sequence that stops has had one
    more step computed into its slot before the next request takes it: results still equal each
    request's alone (greedy and sampled, stops at different steps, slots refilled)."""
    eng = request.getfixturevalue(engine)
    reqs = workload(image_files) * 2
    for i, r in enumerate(reqs):
        r.update(max_new_tokens=6 + i % 3, id=i)
    full = eng.generate(reqs)
    for i, (r, res) in enumerate(zip(reqs, full)):
        if i % 2:  # stop at the token generated at step 1 + i % 4
            r["stop_token_ids"] = [res.token_ids[1 + i % 4]]
    batched = eng.generate(reqs)
    assert any(r.finish_reason == "stop" for r in batched) and any(r.finish_reason == "length" for r in batched)
    alone = [eng.generate([r])[0] for r in reqs]
    assert [(r.token_ids, r.finish_reason) for r in batched] == [(r.token_ids, r.finish_reason) for r in alone]


def test_bad_requests_fail_alone(xla_engine, image_files):
    too_long = {"prompt": "word " * 200, "max_new_tokens": 2}
    # 24 images (one tower call each, 16-32 patches: every call fits) whose 144 image tokens overflow the prompt
    too_many_images = {"prompt": "x", "images": image_files * 8, "max_new_tokens": 2}
    bad_param = {"prompt": "x", "top_p": 0.0}
    ok = {"prompt": "hello", "max_new_tokens": 2, "ignore_eos": True}
    results = xla_engine.generate([too_long, ok, too_many_images, bad_param, ok])
    assert "max_model_len=128" in results[0].error
    assert "max_model_len=128" in results[2].error and "the prompt is" in results[2].error, results[2].error
    assert "top_p" in results[3].error
    assert results[1].error is None and results[4].error is None and len(results[4].token_ids) == 2


def test_guard_raises_on_a_new_shape(qwen2_vl_ckpt):
    engine = mmzoo.load(qwen2_vl_ckpt, executor="xla", attention="sdpa", max_batch=1, compile={"on_recompile": "error"},
                        max_model_len=64, buckets={"min_prefill": 64, "encoder": {"vision": [64]}}, progress=False)
    engine.generate("hello", max_new_tokens=2)  # warmed-up shapes: fine
    # torch_xla's compile counter is process-wide: another engine warming up in this process
    # compiles graphs, which are not this engine's and must not trip its guard
    before = engine.executor.compiled_graphs()
    other = mmzoo.load(qwen2_vl_ckpt, executor="xla", attention="sdpa", max_batch=1, compile={"on_recompile": "error"},
                       max_model_len=32, buckets={"min_prefill": 32, "encoder": {"vision": [64]}}, progress=False)
    assert other.executor.compiled_graphs() > before
    assert engine.generate("hello", max_new_tokens=2).graphs_compiled_after_warmup == 0
    assert other.generate("hi", max_new_tokens=2).graphs_compiled_after_warmup == 0
    too_big = make_image(140, 112, seed=0)  # 80 patches in one image: no vision bucket holds it
    (bad, ok) = engine.generate([{"prompt": "x", "images": [too_big]}, {"prompt": "hi", "max_new_tokens": 2}])
    assert "vision encoder input rows is 80, more than the largest bucket 64" in bad.error and ok.error is None
    with pytest.raises(RecompileError, match="after warmup"):
        engine.executor.prompt_logits(engine.prepare(mmzoo.Request(prompt="hello")))  # a graph warmup never built


@pytest.mark.parametrize("executor", ["eager", "xla"])
def test_bfloat16(qwen2_vl_ckpt, image_files, executor):
    """bfloat16 weights and activations: logits stay close to float32 and generation runs."""
    kw = dict(max_model_len=128, **({"buckets": {"encoder": {"vision": [64]}, "min_prefill": 64}, "warmup": False,
                                      "progress": False} if executor == "xla" else {}))
    req = mmzoo.Request(prompt="What shape is this?", images=image_files[:1])
    ref = mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=128)
    bf = mmzoo.load(qwen2_vl_ckpt, executor=executor, dtype="bfloat16", **kw)
    assert bf.executor.dtype == torch.bfloat16
    a, b = ref.executor.prompt_logits(ref.prepare(req)), bf.executor.prompt_logits(bf.prepare(req))
    assert abs(a - b).max() < 0.15 * abs(a).max()
    assert len(bf.generate(req.prompt, images=req.images, max_new_tokens=4, ignore_eos=True).token_ids) == 4


def test_linear_weights_held_transposed_on_xla_cpu(xla_engine, qwen2_vl_ckpt, image_files):
    """On the XLA CPU client every linear weight is stored [in, out] (no per-step weight copies);
    results equal the untransposed layout's."""
    from torch import nn
    from torch.nn.utils import parametrize

    linears = [m for m in xla_engine.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(parametrize.is_parametrized(m, "weight") for m in linears)
    head = xla_engine.model.lm.lm_head
    assert head.parametrizations.weight.original.shape == (head.in_features, head.out_features)
    assert head.weight.shape == (head.out_features, head.in_features)
    plain = mmzoo.load(qwen2_vl_ckpt, executor="xla", attention="sdpa", max_batch=3, warmup=False,
                       layout={"transpose_weights": False}, **SMALL)
    assert not any(parametrize.is_parametrized(m) for m in plain.model.modules())
    req = mmzoo.Request(prompt="Describe.", images=image_files[:1], max_new_tokens=6, ignore_eos=True)
    prepared = xla_engine.prepare(req)
    torch.testing.assert_close(xla_engine.executor.prompt_logits(prepared), plain.executor.prompt_logits(prepared),
                               rtol=0, atol=1e-4, check_dtype=False)
    assert xla_engine.generate(req).token_ids == plain.generate(req).token_ids


def test_projections_fused_on_xla_cpu(xla_engine, qwen2_vl_ckpt, image_files):
    """On the XLA CPU client attention's q/k/v (LM and vision tower) and the gated MLP's gate/up
    are one linear each; logits and tokens equal the separate projections'."""
    from mmzoo.layers import Attention, GatedMLP

    attns = [m for m in xla_engine.model.modules() if isinstance(m, Attention)]
    mlps = [m for m in xla_engine.model.modules() if isinstance(m, GatedMLP)]
    assert attns and all(m.qkv_proj is not None and not hasattr(m, "q_proj") for m in attns)
    assert mlps and all(m.gate_up_proj is not None and not hasattr(m, "gate_proj") for m in mlps)
    lm_attn = xla_engine.model.lm.layers[0].attn
    assert lm_attn.qkv_proj.out_features == (lm_attn.num_heads + 2 * lm_attn.num_kv_heads) * lm_attn.head_dim
    separate = mmzoo.load(qwen2_vl_ckpt, executor="xla", attention="sdpa", max_batch=3, warmup=False,
                          layout={"fuse_projections": False}, **SMALL)
    assert all(m.qkv_proj is None for m in separate.model.modules() if isinstance(m, Attention))
    req = mmzoo.Request(prompt="Describe.", images=image_files[:2], max_new_tokens=6, ignore_eos=True)
    prepared = xla_engine.prepare(req)
    torch.testing.assert_close(xla_engine.executor.prompt_logits(prepared),
                               separate.executor.prompt_logits(prepared), rtol=0, atol=1e-4, check_dtype=False)
    reqs = workload(image_files)
    assert [r.token_ids for r in xla_engine.generate(reqs)] == [r.token_ids for r in separate.generate(reqs)]
    with pytest.raises(ValueError, match="executor.layout.fuse_projections='yes': choose auto, true or false"):
        mmzoo.executor.XLAExecutor(layout={"fuse_projections": "yes"})


def test_rotary_table_rows_equal_the_computed_ones():
    """Rotary.tabulate: the gathered cos/sin equal the computed ones bit for bit (1-D RoPE, M-RoPE,
    2-D vision RoPE); a position past the table is out of range."""
    from mmzoo.layers import mrope, rope_1d, rope_2d

    for rotary, axes in ((rope_1d(16, 1e6), 1), (mrope(16, 1e6, [2, 3, 3]), 3), (rope_2d(16, 1e4), 2)):
        positions = torch.randint(0, 64, (axes, 2, 9))
        positions[0, 0, 0] = 63
        want = rotary(positions)
        assert rotary.positions is None
        rotary.tabulate(64)
        assert rotary.positions == 64
        got = rotary(positions)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        with pytest.raises(IndexError):
            rotary(positions + 1)


def test_rotary_tabulated_on_xla(xla_engine, qwen2_vl_ckpt, image_files):
    """The XLA executor gathers the rotary cos/sin of the LM (a table of max_model_len positions)
    and of the vision tower (its largest input-row bucket) from tables (rotary_table); logits and
    tokens equal the computed rotary's, and a sequence or an image whose positions would pass a
    table is refused where it enters, naming the position."""
    import numpy as np

    from mmzoo.errors import MmzooError

    assert xla_engine.model.lm.rotary.positions == SMALL["max_model_len"]
    assert xla_engine.model.towers["vision"].encoder.rotary.positions == BUCKETS["encoder"]["vision"][-1]
    computed = mmzoo.load(qwen2_vl_ckpt, executor="xla", attention="sdpa", max_batch=3, warmup=False,
                          layout={"rotary_table": False}, **SMALL)
    assert computed.model.lm.rotary.positions is None
    req = mmzoo.Request(prompt="Describe.", images=image_files[:1], max_new_tokens=6, ignore_eos=True)
    prepared = xla_engine.prepare(req)
    torch.testing.assert_close(xla_engine.executor.prompt_logits(prepared),
                               computed.executor.prompt_logits(prepared), rtol=0, atol=1e-4, check_dtype=False)
    assert xla_engine.generate(req).token_ids == computed.generate(req).token_ids
    past = dataclasses.replace(prepared, positions=np.full_like(prepared.positions, SMALL["max_model_len"]))
    with pytest.raises(MmzooError, match="rotary position 128 is past the 128 positions"):
        xla_engine.executor.check_prompt(past)
    ahead = dataclasses.replace(prepared, position_delta=1)  # decoding would reach max_model_len
    with pytest.raises(MmzooError, match="rotary position 128"):
        xla_engine.executor.check_prompt(ahead)
    computed.executor.check_prompt(past)  # no table: nothing to pass
    (image,) = prepared.media
    far = dataclasses.replace(image, inputs={**image.inputs, "patch_pos": image.inputs["patch_pos"] + 256})
    with pytest.raises(MmzooError, match=r"vision rotary position \d+ \(patch_pos\) is past the 256 positions"):
        xla_engine.executor.encode(far)
    with pytest.raises(ValueError, match="executor.layout.rotary_table"):
        mmzoo.executor.XLAExecutor(layout={"rotary_table": "yes"})


def test_executor_leaves_the_callers_module_as_it_was(qwen2_vl_ckpt, image_files):
    """setup() lays out and places its own copy: the module a research script built keeps its
    separate projections, its [out, in] weights, its state_dict and its device; and it still runs."""
    from mmzoo.engine import build_model
    from mmzoo.executor.xla import XLAExecutor

    cfg = mmzoo.compose(["model.encoder.attention=pallas"], values={"checkpoint": str(qwen2_vl_ckpt)})
    _, model = build_model(cfg)  # a Pallas backend (it holds JAX entry points) is shared by the copy, not copied
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exe = XLAExecutor(max_model_len=64, max_batch=1, buckets={"prefill": [64]}, compile={"warmup": False}, progress=False)
    exe.setup(model)
    assert exe.model is not model and exe.model.lm.layers[0].attn.qkv_proj is not None  # fused, in its copy
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert model.lm.layers[0].attn.qkv_proj is None and all(p.device.type == "cpu" for p in model.parameters())


def test_fused_projections_compute_the_separate_ones():
    """Attention.fuse_projections and GatedMLP.fuse_projections keep the module's function (q/k/v
    with biases, GQA widths; gate/up), on plain CPU tensors."""
    from mmzoo.backends import EagerAttention
    from mmzoo.layers import Attention, GatedMLP, rope_1d

    torch.manual_seed(0)
    attn = Attention(dim=32, num_heads=4, num_kv_heads=2, head_dim=8, attn_fn=EagerAttention(), causal=True,
                     qkv_bias=True, out_bias=False)
    mlp = GatedMLP(dim=32, hidden_dim=48)
    x = torch.randn(2, 5, 32)
    rope = rope_1d(8, 10000.0)(torch.arange(5).expand(1, 2, 5))
    want_attn, want_mlp = attn(x, rope=rope), mlp(x)
    attn.fuse_projections()
    mlp.fuse_projections()
    assert attn.qkv_proj.weight.shape == (32 + 2 * 16, 32) and mlp.gate_up_proj.weight.shape == (96, 32)
    torch.testing.assert_close(attn(x, rope=rope), want_attn, rtol=0, atol=1e-6)
    torch.testing.assert_close(mlp(x), want_mlp, rtol=0, atol=1e-6)



@pytest.mark.parametrize("backend", ["eager", "sdpa", "pallas"])
def test_last_layer_runs_at_the_wanted_positions_only(backend):
    """With ``logits_index`` the LM's last layer computes queries, attention output and MLP at those
    positions only: the logits equal the full forward's at them (one position per row, and several
    per row with packed prompts' segment ids), and every layer's keys and values reach the cache."""
    from mmzoo.lms import qwen2

    torch.manual_seed(0)
    lm = qwen2(vocab_size=50, dim=32, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_dim=48,
               attention=backend).eval()
    x, positions = torch.randn(2, 12, 32), torch.arange(12).expand(1, 2, 12)

    class Cache:  # keeps what each layer writes
        def __init__(self):
            self.kv = {}

        def update(self, layer, k, v):
            self.kv[layer] = (k, v)
            return k, v

    seg = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3] * 2)
    for kwargs, index in (({}, torch.tensor([11, 6])),
                          ({"q_segment_ids": seg, "kv_segment_ids": seg}, torch.tensor([[4, 8, 11], [4, 8, 11]]))):
        with torch.no_grad():
            full_cache, cut_cache = Cache(), Cache()
            full = lm(x, positions, cache=full_cache, attn_kwargs=kwargs)
            cut = lm(x, positions, cache=cut_cache, attn_kwargs=kwargs, logits_index=index)
        rows = torch.arange(2) if index.dim() == 1 else torch.arange(2)[:, None]
        torch.testing.assert_close(cut, full[rows, index], rtol=0, atol=1e-5)
        for layer in range(3):
            for a, b in zip(cut_cache.kv[layer], full_cache.kv[layer]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_steps_replay_their_compiled_graphs(xla_engine, qwen2_vl_ckpt, image_files, monkeypatch):
    """After warmup every step (encode at each bucket, prefill at each bucket, its head and
    decode at each row bucket; greedy and sampling heads) runs as its compiled graph, never traced
    again: the tokens equal the traced path's (greedy and sampled rows, images, slots refilled),
    with no graph compiled."""
    exe = xla_engine.executor
    kinds = {key[0] for key in exe._replays}
    assert kinds == {"encode", "embeds", "prefill", "head", "decode", "logprobs", "constrain", "score", "copy"}, \
        exe._replays.keys()
    assert exe.buckets.decode_rows == (1, 3)  # auto on the XLA CPU client: one row, or every slot
    assert {k for k in exe._replays if k[0] == "decode"} == {("decode", g, kv, b) for g in (True, False)
                                                             for kv in exe.buckets.decode_kv
                                                             for b in exe.buckets.decode_rows}
    assert {k[1:] for k in exe._replays if k[0] == "prefill"} == {(s, None) for s in exe.buckets.prefill}  # no
    # windows at 3 slots; the head: a graph per row bucket and head, whatever the prompts' bucket
    assert {k[1:] for k in exe._replays if k[0] == "head"} == {(b, g) for b in [1, 3] for g in (True, False)}
    traced = mmzoo.load(qwen2_vl_ckpt, executor="xla", attention="sdpa", max_batch=3,
                        compile={"on_recompile": "error", "replay_steps": False}, warmup="needed", **SMALL)
    assert traced.executor._replays == {}
    reqs = workload(image_files)
    expected = [r.token_ids for r in traced.generate(reqs)]

    def no_tracing(*args, **kwargs):
        raise AssertionError("a step was traced after warmup")

    for name in ("forward", "encode"):
        monkeypatch.setattr(exe.model, name, no_tracing)
    monkeypatch.setattr(exe.model.lm, "logits", no_tracing)
    before = exe.compiled_graphs()
    assert [r.token_ids for r in xla_engine.generate(reqs)] == expected
    assert exe.compiled_graphs() == before


@pytest.mark.parametrize("replay", [True, False], ids=["replayed", "cut"])
def test_layer_graphs_give_the_unrolled_graphs_tokens(xla_engine, qwen2_vl_ckpt, image_files, replay):
    """``executor.compile.layer_graphs``: each transformer block a graph of its own, replayed per
    block, or (``replay_steps=false``, as under a device mesh) the traced step cut before and
    after each block. The mixed workload (greedy and sampled rows, 0-3 images, slots refilled)
    gives the unrolled graphs' tokens, with nothing compiled after its warmup."""
    engine = mmzoo.load(qwen2_vl_ckpt, executor="xla", attention="sdpa", max_batch=3, warmup="needed",
                        compile={"on_recompile": "error", "layer_graphs": True,
                                 "replay_steps": "auto" if replay else False}, **SMALL)
    exe = engine.executor
    assert exe.layer_graphs and (exe.layer_replay is not None) == replay and exe._replays == {}
    assert "replay_steps=" + ("on" if replay else "off") + ", layer_graphs=on" in exe.resolved()
    assert "layer_graphs=off" in xla_engine.executor.resolved()  # auto: the unrolled graphs
    reqs = workload(image_files)
    assert [r.token_ids for r in engine.generate(reqs)] == [r.token_ids for r in xla_engine.generate(reqs)]
    if replay:  # every block of the LM and of the ViT ran as replayed graphs (tests/test_depth.py: shared at depth)
        from mmzoo.executor._layers import blocks

        assert len(blocks(exe.model)) == len(exe.model.lm.layers) + len(exe.model.towers["vision"].encoder.blocks)
        assert {key[0] for key in exe.layer_replay.steps} == {id(b) for b in blocks(exe.model)}
    with pytest.raises(ValueError, match="executor.compile.layer_graphs='yes': choose auto, true or false"):
        mmzoo.load(qwen2_vl_ckpt, executor="xla", compile={"layer_graphs": "yes"}, **SMALL)


def test_replayed_steps_emit_the_state_in_its_parameters_order(xla_engine):
    """XLA pairs donated buffers with the outputs of their shape in order, so every replayed step
    emits its updated state in the order the state's parameters enter the graph. A decode step
    reads the cache layer by layer (k0, v0, k1, v1): emitted in the cache's own order (k0, k1, v0,
    v1) each layer's keys were paired with another tensor's buffer, and XLA copied the whole cache
    on every step."""
    exe = xla_engine.executor
    n = len(exe.cache.k)
    for key, step in exe._replays.items():
        donated = [p[1] for p in step.params if isinstance(p, tuple) and p[0] == "state"]
        assert donated == step.order, key
    decode = exe._replays[("decode", True, exe.buckets.decode_kv[0], exe.max_batch)]
    assert decode.order == [i for layer in range(n) for i in (layer, n + layer)]


def test_keys_held_transposed_on_xla_cpu(xla_engine, qwen2_vl_ckpt, image_files):
    """With matmul attention on the XLA CPU client the cache holds keys as [.., head_dim, len]
    (decode's q @ k^T reads them in place); tokens equal the usual layout's, and Pallas attention
    (whose kernels read [len, head_dim] tiles) keeps the usual layout."""
    cache = xla_engine.executor.cache
    assert cache.keys_transposed and cache.k[0].shape == cache.v[0].shape[:2] + cache.v[0].shape[:1:-1]
    assert cache.keys(0).shape == cache.v[0].shape
    plain = mmzoo.load(qwen2_vl_ckpt, executor="xla", attention="sdpa", max_batch=3, warmup=False,
                       layout={"transpose_keys": False}, **SMALL)
    assert not plain.executor.cache.keys_transposed
    reqs = workload(image_files)
    assert [r.token_ids for r in xla_engine.generate(reqs)] == [r.token_ids for r in plain.generate(reqs)]
    pallas = mmzoo.load(qwen2_vl_ckpt, executor="xla", attention="pallas", max_batch=1, warmup=False, **SMALL)
    assert not pallas.executor.cache.keys_transposed
    assert pallas.executor.buckets.decode_kv == (128,)  # its decode kernel stops at each sequence's length
    with pytest.raises(ValueError, match="executor.layout.transpose_keys"):
        mmzoo.executor.XLAExecutor(layout={"transpose_keys": "sometimes"})


def test_prompts_admitted_together_share_one_prefill_step(xla_engine, image_files, monkeypatch):
    """Prompts admitted together are packed into one prefill step (each attending to itself
    only), up to ``max_prefill_tokens``; every one gets the tokens it gets alone, with no graph
    compiled after warmup."""
    exe = xla_engine.executor
    reqs = [{"prompt": "what shape is this " * (1 + i), "images": image_files[:1 - min(i, 1)],
             "max_new_tokens": 4, "ignore_eos": True} for i in range(3)]  # an image in the first
    lengths = [len(xla_engine.prepare(Request(**r)).input_ids) for r in reqs]
    assert sum(lengths) <= exe.buckets.prefill_budget, lengths
    alone = [xla_engine.generate([r])[0].token_ids for r in reqs]
    counts, prefill = [], exe.prefill

    def recording(inputs, *args, **kwargs):
        counts.append(inputs.count)
        return prefill(inputs, *args, **kwargs)

    monkeypatch.setattr(exe, "prefill", recording)
    before = exe.compiled_graphs()
    assert [r.token_ids for r in xla_engine.generate(reqs)] == alone
    assert counts == [3]
    counts.clear()
    budget = dataclasses.replace(exe.buckets, prefill_budget=lengths[0] + lengths[1])  # the third does not fit
    monkeypatch.setattr(exe, "buckets", budget)
    assert [r.token_ids for r in xla_engine.generate(reqs)] == alone
    assert counts == [2, 1]
    assert exe.compiled_graphs() == before


def test_short_prompts_packed_attend_in_windows(xla_engine, qwen2_vl_ckpt, image_files, monkeypatch):
    """``windowed_prefill``: with 8 slots the 512-token bucket has a graph attending in windows of
    64 tokens; a step of prompts none longer than 64 takes it, a step holding a longer prompt the
    whole-row graph; every prompt gets the tokens it gets alone (full attention, another engine),
    with nothing compiled past the plan. With 4 slots (a window of s/4) there is none."""
    kw = dict(executor="xla", attention="sdpa", max_model_len=512, progress=False)
    engine = mmzoo.load(qwen2_vl_ckpt, max_batch=8, buckets={"prefill": [64, 512], "encoder": {"vision": [64]}},
                        warmup="needed", compile={"on_recompile": "error"}, **kw)
    exe = engine.executor
    assert exe.buckets.windows == {512: 64} and exe.buckets.window_of(64) is None
    short = [{"prompt": "what shape " * (1 + i), "images": image_files[:1 - min(i, 1)], "max_new_tokens": 3,
              "ignore_eos": True} for i in range(4)]
    long = short[:2] + [{"prompt": "what shape is this " * 10, "max_new_tokens": 3, "ignore_eos": True}]
    lengths = [len(engine.prepare(Request(**r)).input_ids) for r in short + long[2:]]
    assert max(lengths[:4]) <= 64 < lengths[4] and 64 < sum(lengths[:2] + lengths[4:]), lengths
    windows, prefill = [], exe.prefill

    def recording(inputs, *args, **kwargs):
        if inputs.count:  # not warmup's
            windows.append((inputs.count, inputs.window))
        return prefill(inputs, *args, **kwargs)

    monkeypatch.setattr(exe, "prefill", recording)
    for reqs, want in ((short, [(4, 64)]), (long, [(3, None)])):
        alone = [xla_engine.generate([r])[0].token_ids for r in reqs]
        windows.clear()
        assert [r.token_ids for r in engine.generate(reqs)] == alone
        assert windows == want
    assert sorted(str(g) for g in exe.warm if g.kind == "prefill") == [
        "prefill 512", "prefill 512 w64", "prefill 64"]
    prefill = {"prefill": [64, 512]}
    assert mmzoo.load(qwen2_vl_ckpt, max_batch=4, warmup=False, buckets=prefill, **kw).executor.buckets.windows == {}
    off = mmzoo.load(qwen2_vl_ckpt, max_batch=8, warmup=False, buckets={**prefill, "windowed_prefill": False}, **kw)
    assert off.executor.buckets.windows == {}
    pallas = mmzoo.load(qwen2_vl_ckpt, max_batch=8, warmup=False, buckets=prefill, **{**kw, "attention": "pallas"})
    assert pallas.executor.buckets.windows == {}  # its kernel skips the other prompts' blocks itself


def test_decode_runs_the_rows_its_slots_need(xla_engine, eager_engine, image_files, monkeypatch):
    """``buckets.decode_rows``: a decode step runs the first slots, up to the bucket holding the
    highest running one. One request alone decodes 1 row of 3 (buckets [1, 3]); as sequences
    finish the rows shrink, and a request joining a running one makes them grow, each step's input tokens read
    from the previous step's output of other rows. Every request gets the tokens the eager
    executor (all slots, every step) gives it, and nothing compiles past warmup."""
    from mmzoo.executor.loop import Generation

    exe = xla_engine.executor
    rows, decode = [], exe.decode

    def recording(inputs, *args, **kwargs):
        rows.append(len(inputs.token))
        return decode(inputs, *args, **kwargs)

    monkeypatch.setattr(exe, "decode", recording)
    before = exe.compiled_graphs()
    one = {"prompt": "what shape is this", "images": image_files[:1], "max_new_tokens": 6, "ignore_eos": True}
    assert xla_engine.generate([one])[0].token_ids == eager_engine.generate([one])[0].token_ids
    assert set(rows) == {1}
    # slots 0-2 at once; slot 1 finishes first and the fourth request takes it; slots 1 and 2 end,
    # then slot 0 decodes alone (rows 3 -> 1)
    reqs = [dict(one, max_new_tokens=12), dict(one, prompt="say", images=[], max_new_tokens=2),
            dict(one, prompt="what colour", max_new_tokens=4),
            dict(one, prompt="hello there", images=image_files[1:2], max_new_tokens=6, temperature=0.8, seed=3)]
    rows.clear()
    assert [r.token_ids for r in xla_engine.generate(reqs)] == [r.token_ids for r in eager_engine.generate(reqs)]
    assert rows == sorted(rows, reverse=True) and set(rows) == {3, 1}, rows
    # growing: a request joins slot 1 while slot 0 decodes alone
    rows.clear()
    run = Generation(exe, decode_text=xla_engine.decode)
    first = run.add(xla_engine.prepare(Request(**reqs[0])))
    for _ in range(4):
        run.step()
    second = run.add(xla_engine.prepare(Request(**reqs[3])))
    while run.busy:
        run.step()
    assert rows[:3] == [1, 1, 1] and 3 in rows[3:] and rows[-1] == 1, rows
    assert [first.result.token_ids, second.result.token_ids] == [
        r.token_ids for r in eager_engine.generate([reqs[0], reqs[3]])]
    assert exe.compiled_graphs() == before
    with pytest.raises(ValueError, match=r"executor.buckets.decode_rows=\[0, 2\] must lie in \[1, max_batch=4\]"):
        mmzoo.executor.XLAExecutor(max_batch=4, buckets={"decode_rows": [0, 2]})
    assert _resolve(BucketSpec(decode_rows=[2]), max_batch=4).decode_rows == (2, 4)
    four = mmzoo.load(xla_engine.checkpoint, executor="xla", attention="sdpa", max_batch=4, warmup=False,
                      **dict(SMALL, buckets={**BUCKETS, "decode_rows": [1, 2]})).executor.buckets
    assert four.decode_rows == (1, 2, 4) and [four.rows(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]


def test_packed_prefill_inputs_layout():
    """Two prompts packed into a 16-token bucket: segments, cache slots and positions per token,
    each prompt's last token; padding in a segment of its own, writing the first slot's last cache
    position (which no prompt reaches); the per-prompt rows padded with the first prompt's."""
    import numpy as np

    from mmzoo.executor.steps import PrefillInputs

    a = (np.array([5, 6, 7]), np.arange(3)[None], np.array([-1, 0, -1]), 2)
    b = (np.array([8, 9]), np.arange(2)[None] + 10, np.array([-1, -1]), 0)
    p = PrefillInputs.pack(8, 4, 32, [a, b])
    assert p.input_ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert p.positions.tolist() == [[0, 1, 2, 10, 11, 0, 0, 0]]
    assert p.mm_index.tolist() == [-1, 0, -1, -1, -1, -1, -1, -1]
    assert p.segment.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert p.write_slot.tolist() == [2, 2, 2, 0, 0, 2, 2, 2]
    assert p.write_pos.tolist() == [0, 1, 2, 0, 1, 31, 31, 31]
    assert p.slots.tolist() == [2, 0, 2, 2] and p.last.tolist() == [2, 4, 2, 2] and p.count == 2
