"""``n`` samples of one prompt: prefilled once, its keys and values copied into the other samples'
KV-cache slots (a step of its own), each sample drawing from its own seeded generator; the first
draws as the request alone would. The server's ``n`` is in test_serve.py."""

from __future__ import annotations

import pytest

import mmzoo
from mmzoo.errors import MmzooError

SMALL = dict(max_model_len=128, max_batch=4, progress=False, compile={"on_recompile": "error"},
             buckets={"min_prefill": 32, "encoder": {"vision": [64, 128]}})
SAMPLED = dict(max_new_tokens=6, temperature=1.0, seed=5, ignore_eos=True)


def test_samples_share_the_prompt_and_draw_their_own(qwen2_vl_ckpt, image_files):
    xla = mmzoo.load(qwen2_vl_ckpt, executor="xla", warmup="needed", **SMALL)
    eager = mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=128, max_batch=4)
    for engine in (eager, xla):
        one = engine.generate("hello there", **SAMPLED)
        three = engine.generate("hello there", n=3, **SAMPLED)
        assert [len(s.token_ids) for s in three.samples] == [6, 6, 6]
        assert three.samples[0].token_ids == one.token_ids == three.token_ids  # the first draws as n=1 does
        assert len({tuple(s.token_ids) for s in three.samples}) == 3  # the others from their own streams
        assert three.graphs_compiled_after_warmup == 0
        # greedy samples read the copied keys and values: each equals the request alone
        greedy = engine.generate("what is this", images=image_files[:1], max_new_tokens=6, ignore_eos=True)
        two = engine.generate("what is this", images=image_files[:1], max_new_tokens=6, ignore_eos=True, n=2)
        assert [s.token_ids for s in two.samples] == [greedy.token_ids] * 2
        # 3 + 2 samples over 4 slots: the second request waits for slots, and gets the same samples
        both = engine.generate([{"prompt": "hello there", "n": 3, **SAMPLED},
                                {"prompt": "what is this", "images": image_files[:1], "n": 2, **SAMPLED}])
        assert [s.token_ids for s in both[0].samples] == [s.token_ids for s in three.samples]
        alone = engine.generate("what is this", images=image_files[:1], n=2, **SAMPLED)
        assert [s.token_ids for s in both[1].samples] == [s.token_ids for s in alone.samples]
        assert [x.graphs_compiled_after_warmup for x in both] == [0, 0]
    assert [s.token_ids for s in xla.generate("hello there", n=3, **SAMPLED).samples] == [
        s.token_ids for s in eager.generate("hello there", n=3, **SAMPLED).samples]
    row = three.to_json()
    assert [s["token_ids"] for s in row["samples"]] == [s.token_ids for s in three.samples]
    with pytest.raises(MmzooError, match=r"n=5 samples need 5 KV-cache slots at once; executor.max_batch=4"):
        eager.generate("hi", n=5)
    with pytest.raises(MmzooError, match=r"n=2: stream\(\) yields one sequence"):
        next(eager.stream("hi", n=2))
