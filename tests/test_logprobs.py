"""Log-probabilities of generated tokens (``Request.logprobs``): computed on the device from each
head's and decode step's logits in a graph of their own, so asking for them changes no token and,
after warmup, compiles nothing. Their agreement with transformers, per family, executor and
backend, is in test_parity.py; the server's shapes in test_serve.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mmzoo
from mmzoo.errors import MmzooError
from mmzoo.executor import warmup

SMALL = dict(max_model_len=128, max_batch=2, progress=False, compile={"on_recompile": "error"},
             buckets={"min_prefill": 32, "encoder": {"vision": [64, 128]}})


def test_logprobs_change_no_token_and_compile_nothing_past_the_plan(qwen2_vl_ckpt, image_files):
    engine = mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="needed", **SMALL)
    reqs = [{"prompt": "what shape", "images": image_files[:1], "max_new_tokens": 5, "ignore_eos": True, "logprobs": 3},
            {"prompt": "hello there", "max_new_tokens": 7, "ignore_eos": True, "temperature": 0.8, "seed": 3,
             "logprobs": 0},
            {"prompt": "and this one", "max_new_tokens": 4, "ignore_eos": True}]
    got = engine.generate(reqs)
    assert [r.graphs_compiled_after_warmup for r in got] == [0, 0, 0]
    plain = engine.generate([{k: v for k, v in r.items() if k != "logprobs"} for r in reqs])
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert got[2].logprobs is None and "logprobs" not in got[2].to_json()
    for r, req in zip(got[:2], reqs):
        assert [e["token_id"] for e in r.logprobs] == r.token_ids
        for e in r.logprobs:
            top = [lp for _, lp in e["top_logprobs"]]
            assert len(top) == req["logprobs"] and top == sorted(top, reverse=True)
            assert not top or top[0] >= e["logprob"] - 1e-6
    # the sampled tokens' log-probabilities: the raw logits' log-softmax (no temperature), as a
    # whole-sequence forward pass of the eager executor gives them
    eager = mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=128)
    r = got[1]
    prepared = eager.prepare(mmzoo.Request(prompt_token_ids=r.prompt_token_ids + r.token_ids[:-1]))
    logp = torch.log_softmax(torch.from_numpy(eager.executor.prompt_logits(prepared)), dim=-1).numpy()
    n = len(r.prompt_token_ids)
    want = logp[np.arange(n - 1, n - 1 + len(r.token_ids)), r.token_ids]
    np.testing.assert_allclose([e["logprob"] for e in r.logprobs], want, atol=1e-4, rtol=0)


def test_logprobs_graphs_in_the_warmup_plan_and_the_limit(qwen2_vl_ckpt):
    engine = mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="none", **SMALL)
    exe = engine.executor
    assert exe.buckets.decode_rows == (1, 2)
    graphs = [str(g) for g in warmup.plan(exe, []) if g.kind == "logprobs"]  # head rows r: r tokens; decode: 2
    assert graphs == ["logprobs b1/1", "logprobs b1/2", "logprobs b2/2"]
    with pytest.raises(MmzooError, match=r"logprobs=21 is more than this engine computes: executor.max_logprobs=20"):
        engine.generate("hi", logprobs=21)
    off = mmzoo.load(qwen2_vl_ckpt, executor="eager", max_logprobs=0)
    with pytest.raises(MmzooError, match=r"executor.max_logprobs=0 \(log-probabilities are off\)"):
        off.generate("hi", logprobs=0)
    with pytest.raises(MmzooError, match=r"logprobs=-1"):
        off.generate("hi", logprobs=-1)
    assert not [g for g in warmup.plan(mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="none", max_logprobs=0,
                                                  **SMALL).executor, []) if g.kind == "logprobs"]


def test_prompt_logprobs_and_no_new_tokens(qwen2_vl_ckpt, image_files):
    """``prompt_logprobs``: each prompt token given the ones before it (images included), from a
    scoring step of the prompt's bucket; ``max_new_tokens=0`` scores without generating. The values
    are the eager executor's whole-prompt logits' log-softmax; nothing compiles past the plan."""
    engine = mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="needed", **SMALL)
    reqs = [{"prompt": "score me please", "max_new_tokens": 0, "prompt_logprobs": 2},
            {"prompt": "what shape", "images": image_files[:1], "max_new_tokens": 3, "prompt_logprobs": 0,
             "ignore_eos": True},
            {"prompt": "nothing at all", "max_new_tokens": 0}]
    got = engine.generate(reqs)
    assert [r.graphs_compiled_after_warmup for r in got] == [0, 0, 0] and all(r.error is None for r in got)
    assert [r.token_ids for r in (got[0], got[2])] == [[], []] and got[0].finish_reason == "length"
    assert got[2].prompt_logprobs is None
    assert got[1].token_ids == engine.generate({k: v for k, v in reqs[1].items() if k != "prompt_logprobs"}).token_ids
    eager = mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=128)
    for r, req in zip(got[:2], reqs):
        prepared = eager.prepare(mmzoo.Request(prompt=req["prompt"], images=req.get("images", [])))
        ids = prepared.input_ids
        logp = torch.log_softmax(torch.from_numpy(eager.executor.prompt_logits(prepared)), dim=-1).numpy()
        assert r.prompt_logprobs[0] is None and [e["token_id"] for e in r.prompt_logprobs[1:]] == ids[1:].tolist()
        np.testing.assert_allclose([e["logprob"] for e in r.prompt_logprobs[1:]], logp[np.arange(len(ids) - 1), ids[1:]],
                                   atol=1e-4, rtol=0)
        assert all(len(e["top_logprobs"]) == req["prompt_logprobs"] for e in r.prompt_logprobs[1:])
    off = mmzoo.load(qwen2_vl_ckpt, executor="eager", score_prompts=False)
    with pytest.raises(MmzooError, match=r"prompt_logprobs=1: this engine does not score prompts"):
        off.generate("hi", prompt_logprobs=1)
    with pytest.raises(MmzooError, match=r"prompt_logprobs needs the prompt's token ids"):
        eager.generate(mmzoo.Request(inputs_embeds=torch.zeros(3, eager.hidden_size), prompt_logprobs=0))
