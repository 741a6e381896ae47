"""Numerics at real depth: a Qwen2-VL checkpoint as deep as Qwen2-VL-2B (28 LM layers, 32 ViT blocks)
but narrow (LM 128 wide, ViT 64) is token-identical to transformers' own
``Qwen2VLForConditionalGeneration`` in float32, on both executors and every attention backend in
conf/attention/ (Pallas' kernels on the XLA executor: the eager executor runs the same kernel
source through JAX in interpret mode, the slowest case here, and test_parity checks it per family): prompt ids equal, prefill logits allclose (atol 1e-4, as tests/test_parity.py; the
differences seen were at most 1.1e-5 with logits up to about 5.6) and 16 greedy tokens identical
(EOS off), for a request with two images of different sizes and a text-only one; also with layer
graphs (``executor.compile.layer_graphs``, Pallas: its kernels inside each block's replayed graph),
whose 28 + 32 blocks run the same compiled graphs as a 4 + 4 model of the same width.

The other parity tests use 2-8 layers; rounding that compounds layer by layer, or a bug that only a
deep stack reaches (a per-layer index, a cache slot per layer), shows here. Mutation-checked: with
LM layers 26 and 27 swapped, ViT blocks 30 and 31 swapped, or layer 27's down_proj scaled by
1 + 1e-3 in the checkpoint mmzoo loads, the logits fail (the ViT ones in the image request only).

Peak RSS 2.3 GB; the time goes mostly to XLA compiling the unrolled 28- and 32-layer graphs,
pallas the most (about 18 s): nothing here is marked slow.
"""

from __future__ import annotations

import numpy as np
import pytest

import mmzoo
import parity
from mmzoo import config

DEPTH = {"num_layers": 28, "vision_depth": 32}  # Qwen2-VL-2B's
WIDTH = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "vision_embed_dim": 64, "vision_num_heads": 4}
# the text-only prompt and the two-image one; a deep random model drifts into repeating one token
# for many prompts: these two give 7 and 6 distinct greedy tokens, with top-1/top-2 logit gaps of
# at least 5e-3 and 3e-2 (hundreds of times the differences between the two sides)
PROMPTS = {0: "Tell me a story.", 2: "Describe both images."}
# graphs compiled on first use, in one 64-token prefill bucket and one 64-patch tower bucket (the two
# images are 24 + 32 patches): the file's time is mostly XLA compiling each graph once per backend
XLA = {"progress": False, "warmup": False, "max_batch": 2,
       "buckets": {"prefill": [64], "min_encoder_rows": 64, "max_encoder_rows": 64}}
ATOL = 1e-4  # fp32, as tests/test_parity.py


@pytest.fixture(scope="module")
def deep_ckpt(tmp_path_factory):
    """A random Qwen2-VL checkpoint of real depth and small width (about 2 s to build)."""
    from mmzoo.fixtures import make_tiny_qwen2_vl

    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("ckpt") / "qwen2_vl_deep", seed=0, **DEPTH, **WIDTH)


@pytest.fixture(scope="module")
def images(image_files):
    """Two images of different sizes: 84 x 56 and 56 x 112 (24 and 32 patches)."""
    return image_files[1:3]


@pytest.fixture(scope="module")
def reference(deep_ckpt, images):
    return parity.reference(deep_ckpt, "Qwen2VLForConditionalGeneration", "image", images, sorted(PROMPTS), PROMPTS)


# executor.compile.layer_graphs: each block a graph of its own, compiled once per kind of block
LAYERS = dict(XLA, warmup="needed", compile={"layer_graphs": True, "on_recompile": "ignore"})


@pytest.fixture(scope="module", ids="-".join,
                params=[(e, a) for e in parity.EXECUTORS for a in config.options("attention")
                        if (e, a) != ("eager", "pallas")] + [("xla", "pallas", "layers")])
def engine(request, deep_ckpt):
    """One engine per (executor, backend[, layer graphs]), the tests grouped by it; dropped from
    parity's session cache when its tests are done, so that one deep engine is alive at a time,
    not seven for the rest of the session."""
    executor, attention, *layers = request.param
    engine = parity.engine(deep_ckpt, executor, attention, **(LAYERS if layers else XLA))
    yield engine
    for key in [k for k, v in parity._ENGINES.items() if v is engine]:
        del parity._ENGINES[key]


@pytest.mark.parametrize("n", sorted(PROMPTS), ids=lambda n: f"{n}images")
def test_deep_matches_transformers(engine, images, reference, n):
    ref = reference[n]
    assert (engine.cfg.model.lm.num_layers, engine.cfg.model.encoder.depth) == (28, 32)
    req = {"prompt": PROMPTS[n], "images": images[:n]}
    prepared = engine.prepare(mmzoo.Request(**req))
    assert prepared.input_ids.tolist() == ref["ids"]
    np.testing.assert_allclose(engine.executor.prompt_logits(prepared), ref["logits"], atol=ATOL, rtol=0)
    result = engine.generate(mmzoo.Request(**req, **parity.GEN))
    assert result.prompt_token_ids == ref["ids"]
    assert result.token_ids == ref["tokens"]
    assert result.finish_reason == "length"


def test_layer_graphs_do_not_grow_with_depth(engine, images, tmp_path):
    """With layer graphs, the 28-layer LM and the 32-block ViT run as the graphs a 4-layer, 4-block
    model of the same width runs: the same set of compiled block graphs, so compile time does not
    grow with depth (the unrolled form's graphs hold every layer)."""
    replay = getattr(engine.executor, "layer_replay", None)
    if replay is None:
        pytest.skip("the unrolled form")
    from mmzoo.fixtures import make_tiny_qwen2_vl

    shallow_ckpt = make_tiny_qwen2_vl(tmp_path / "shallow", seed=0, num_layers=4, vision_depth=4, **WIDTH)
    backend = engine.executor.model.lm.layers[0].attn.attn_fn.name
    shallow = mmzoo.load(shallow_ckpt, executor="xla", attention=backend, max_model_len=256, **LAYERS)
    for e in (engine, shallow):  # what test_deep_matches_transformers does, whether it ran or not
        for n in sorted(PROMPTS):
            req = mmzoo.Request(prompt=PROMPTS[n], images=images[:n], **parity.GEN)
            e.executor.prompt_logits(e.prepare(req))
            e.warm([req])  # warmed up for the request, its run compiles nothing
            compiled = e.executor.compiled_graphs()
            assert e.generate(req).error is None
            assert e.executor.compiled_graphs() == compiled
    deep_graphs, shallow_graphs = replay.graphs(), shallow.executor.layer_replay.graphs()
    assert deep_graphs == shallow_graphs
    assert replay.calls() >= 28 + 32 > len(deep_graphs)
