"""Structured output (``Request.structured_outputs``): a grammar followed as a token mask, applied on
the device by a constrain step of each head and decode row bucket (:mod:`mmzoo.structured`).

The reference is transformers' own ``generate`` with a logits processor applying the same grammar
through llguidance's own mask helpers: greedy tokens identical, on both executors, in a batch with
free-text requests whose tokens do not change. Outputs validate against their schema, regex,
choice or grammar, sampled ones too. The server's ``response_format`` and vLLM's fields are in
test_serve.py.
"""

from __future__ import annotations

import json
import re

import jsonschema_rs  # schemathesis's JSON Schema validator (a test dependency)
import numpy as np
import pytest
import torch

import mmzoo
from mmzoo.errors import MmzooError
from mmzoo.executor import warmup
from mmzoo.types import StructuredOutputs

SMALL = dict(max_model_len=128, max_batch=4, progress=False, compile={"on_recompile": "error"},
             buckets={"min_prefill": 32, "encoder": {"vision": [64, 128]}})
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["shape", "count", "filled"],
          "properties": {"shape": {"enum": ["circle", "square", "triangle"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "filled": {"type": "boolean"}}}
LARK = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
GUIDES = [{"json": SCHEMA, "disable_any_whitespace": True}, {"json": json.dumps(SCHEMA)}, {"regex": r"[0-9]{3}-[a-z]{2,4}"},
          {"choice": ["red", "green", "dark blue"]}, {"grammar": LARK}, {"json_object": True}]


def _valid(spec: dict, text: str) -> bool:
    if "json" in spec or "json_object" in spec:
        value = json.loads(text)
        schema = {"type": "object"} if "json_object" in spec else SCHEMA
        return jsonschema_rs.is_valid(schema, value)
    if "regex" in spec:
        return re.fullmatch(spec["regex"], text) is not None
    if "choice" in spec:
        return text in spec["choice"]
    return re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", text) is not None


def _reference(ckpt, engine, prompt_ids: list[int], spec: dict, new_tokens: int) -> list[int]:
    """transformers' greedy tokens with each step's logits masked by the grammar (llguidance's numpy
    helpers on a matcher of its own)."""
    import transformers
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

    grammars = engine.grammars
    matcher = LLMatcher(grammars.ll_tokenizer, grammars.compile(StructuredOutputs(**spec)))

    class Mask(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > len(prompt_ids):
                assert matcher.consume_token(int(input_ids[0, -1]))
            mask = allocate_token_bitmask(1, scores.shape[-1])
            fill_next_token_bitmask(matcher, mask)
            masked = scores.float().numpy().copy()
            apply_token_bitmask_inplace(masked, mask)
            return torch.from_numpy(masked)

    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         logits_processor=transformers.LogitsProcessorList([Mask()]),
                         eos_token_id=engine.eos_token_ids, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_structured_tokens_equal_transformers_masked(qwen2_vl_ckpt, image_files):
    """Each grammar's greedy tokens are transformers' under the same mask, on both executors, in one
    batch with free-text requests (an image one among them) whose tokens stay their own; the XLA
    executor compiles nothing past its plan. Whitespace is free in the second schema's JSON (the
    tiny random model's picks), not in the first's."""
    xla = mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="needed", **SMALL)
    eager = mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=128, max_batch=4)
    reqs = [{"prompt": f"answer {i}", "structured_outputs": spec, "max_new_tokens": 24} for i, spec in enumerate(GUIDES)]
    free = [{"prompt": "what shape", "images": image_files[:1], "max_new_tokens": 6, "ignore_eos": True},
            {"prompt": "tell me", "max_new_tokens": 6, "ignore_eos": True}]
    batch = [reqs[0], free[0], reqs[1], reqs[2], free[1], reqs[3], reqs[4], reqs[5]]
    got = {name: engine.generate(batch) for name, engine in (("eager", eager), ("xla", xla))}
    assert [r.error for r in got["xla"]] == [None] * len(batch)
    assert [r.graphs_compiled_after_warmup for r in got["xla"]] == [0] * len(batch)
    assert [r.token_ids for r in got["xla"]] == [r.token_ids for r in got["eager"]]
    assert [r.token_ids for r in (got["xla"][1], got["xla"][4])] == [
        r.token_ids for r in xla.generate(free)]  # free text beside grammars is unchanged
    for r, req in zip(got["eager"], batch):
        if "structured_outputs" in req:
            want = _reference(qwen2_vl_ckpt, eager, r.prompt_token_ids, req["structured_outputs"], 24)
            assert r.token_ids == want, req["structured_outputs"]
    done = [(r, req) for r, req in zip(got["eager"], batch) if "structured_outputs" in req and r.finish_reason == "stop"]
    assert len(done) >= 4  # most grammars end within 24 tokens (the free-whitespace JSON may not)
    for r, req in done:
        assert _valid(req["structured_outputs"], r.text), (req["structured_outputs"], r.text)


def test_sampled_outputs_follow_their_grammar(qwen2_vl_ckpt):
    """Sampled outputs (n samples, each its own stream) match their grammar on both executors, the
    same tokens from the same seeds; a bad grammar fails alone, naming the field."""
    xla = mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="needed", **SMALL)
    eager = mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=128, max_batch=4)
    specs = [GUIDES[0], GUIDES[2], GUIDES[3], GUIDES[4]]
    reqs = [{"prompt": "go", "structured_outputs": spec, "max_new_tokens": 40, "temperature": 1.0, "seed": 7,
             "n": 2} for spec in specs]
    reqs.insert(1, {"prompt": "bad", "structured_outputs": {"regex": "[a-"}})
    for engine in (eager, xla):
        got = engine.generate(reqs)
        assert "structured_outputs.regex: " in got[1].error and "unclosed character class" in got[1].error
        del got[1]
        assert all(r.graphs_compiled_after_warmup == 0 for r in got)
        for r, spec in zip(got, specs):
            for s in r.samples:
                assert s.finish_reason == "stop" and _valid(spec, s.text), (spec, s.text)
        if engine is eager:
            first = got
    assert [[s.token_ids for s in r.samples] for r in got] == [[s.token_ids for s in r.samples] for r in first]


def test_refusals_and_the_warmup_plan(qwen2_vl_ckpt):
    engine = mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="none", **SMALL)
    for spec, msg in [({"regex": "a", "choice": ["b"]}, r"give exactly one of json, regex, choice, grammar, json_object; "
                                                       r"got regex, choice"),
                      ({"regexp": "a"}, r"structured_outputs.regexp='a': unexpected keyword argument"),
                      ({"choice": []}, r"structured_outputs.choice=\[\]: list should have at least 1 item"),
                      ({"json": {"type": "nope"}}, r"structured_outputs.json: Invalid type: nope"),
                      ({"json": "{not json"}, r"structured_outputs.json: Expecting property name"),
                      ({"grammar": "start: foo"}, r"structured_outputs.grammar: .*foo")]:
        with pytest.raises(MmzooError, match=msg):
            engine.generate("hi", structured_outputs=spec)
    graphs = [str(g) for g in warmup.plan(engine.executor, []) if g.kind == "constrain"]
    assert graphs == ["constrain b1/1/greedy", "constrain b1/1/sample", "constrain b1/4/greedy", "constrain b1/4/sample",
                      "constrain b4/4/greedy", "constrain b4/4/sample"]  # head rows r: r tokens; decode: 4
    off = mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="none", structured_outputs=False, **SMALL)
    assert not [g for g in warmup.plan(off.executor, []) if g.kind == "constrain"]
    with pytest.raises(MmzooError, match=r"executor.structured_outputs=false"):
        off.generate("hi", structured_outputs={"json_object": True})
    needed = warmup.needed(engine.executor, [engine.prepare(mmzoo.Request(prompt="x", max_new_tokens=4,
                                                                          structured_outputs={"choice": ["a"]}))])
    assert [str(g) for g in needed if g.kind == "constrain"] == ["constrain b1/1/greedy", "constrain b1/4/greedy"]


def test_constrain_step_masks_exactly_the_bitmask(qwen2_vl_ckpt):
    """The device step allows exactly the bitmask's tokens (bit t % 32 of word t // 32, the sign bit
    too), leaves the rows without a grammar their own token and keeps the step's tokens past its
    rows, on the CPU and on the XLA device alike."""
    import torch_xla

    from mmzoo.executor.steps import constrain_step

    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.standard_normal((3, 70)).astype(np.float32))
    bits = rng.random((3, 96)) < 0.2
    bits[:, 70:] = False
    bits[:, [31, 63]] = True  # negative words
    bitmask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)  # [3, 3] words
    tokens = torch.tensor([5, 6, 7, 8])
    ints = torch.tensor([[1, 0, 1], [0, 0, 0]])
    allowed = [np.flatnonzero(bits[r, :70]) for r in range(3)]
    want = [int(allowed[0][logits[0, allowed[0]].argmax()]), 6, int(allowed[2][logits[2, allowed[2]].argmax()]), 8]
    assert constrain_step(logits, tokens, torch.from_numpy(bitmask), ints).tolist() == want
    dev = torch_xla.device()
    on_xla = constrain_step(logits.to(dev), tokens.to(dev), torch.from_numpy(bitmask).to(dev), ints.to(dev))
    assert on_xla.cpu().tolist() == want
    sampled = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.99, 0.5, 0.01]])  # temperature, top_p, uniform
    for row in (0, 2):  # a draw lands on an allowed token whatever its uniform number
        picks = constrain_step(logits.to(dev), tokens.to(dev), torch.from_numpy(bitmask).to(dev), ints.to(dev),
                               sampled.to(dev)).cpu()
        assert int(picks[row]) in allowed[row]


def test_stream_follows_the_grammar_as_generate_does(qwen2_vl_ckpt):
    engine = mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=128, max_batch=2)
    req = {"prompt": "pick", "structured_outputs": GUIDES[2], "max_new_tokens": 20, "temperature": 1.0, "seed": 3}
    want = engine.generate(req)
    outs = list(engine.stream(req))
    assert [t for o in outs for t in o.token_ids] == want.token_ids and outs[-1].result.finish_reason == "stop"
    assert "".join(o.text for o in outs) == want.text and _valid(GUIDES[2], want.text)
