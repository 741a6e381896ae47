"""Numerical parity with transformers, shared by every family: on a tiny random checkpoint, the prompt
ids equal the processor's, prefill logits are allclose (fp32, atol 1e-4) and 16 greedy tokens are
identical (EOS off on both sides), on both executors and every attention backend in conf/attention/.

Every conf/model family is checked: by its ``Case`` below when it has one (its tiny checkpoint
fixture, its media, the item counts, XLA options), else by the default case (:func:`_case`: its
declared tiny checkpoint, 0 and 1 items of its media); the transformers class is the family's own
declaration (``Family.hf_class``).
The item counts make the XLA tower pad (e.g. 3 images in a bucket of 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

import mmzoo
import parity
from mmzoo import config


@dataclass
class Case:
    checkpoint: str  # the conftest fixture that builds the tiny checkpoint (from the family's tiny_checkpoint)
    files: str  # the conftest fixture with the media files
    kind: str  # "image" or "audio"
    counts: dict[str, list[int]]  # executor -> item counts per request
    prompt: str | dict[int, str]
    xla: dict = field(default_factory=dict)  # XLA executor options (graphs compile on first use here)


CASES = {
    "qwen2_vl": Case("qwen2_vl_ckpt", "image_files", "image",
                     {"eager": [0, 1, 2], "xla": [0, 1, 2]},
                     {0: "Tell me a story.", 1: "What shape is this?", 2: "Compare the two pictures."},
                     {"buckets": {"max_encoder_rows": 256}, "progress": False, "warmup": False}),
    # two images of different sizes and aspect ratios in one prompt (84x84 and 112x84 px once resized), each
    # reordered by window (windows of 2x2 merged units: 4 windows each, some partial)
    "qwen2_5_vl": Case("qwen2_5_vl_ckpt", "image_files", "image",
                       {"eager": [2], "xla": [2]}, "Compare the two pictures.",
                       {"buckets": {"max_encoder_rows": 64}, "progress": False, "warmup": False}),
    # two images of 8x8 and 6x8 patches (the 4x4 position grid resampled to each), two DeepStack levels
    "qwen3_vl": Case("qwen3_vl_ckpt", "image_files", "image",
                     {"eager": [2], "xla": [2]}, "Compare the two pictures.",
                     {"buckets": {"max_encoder_rows": 64}, "progress": False, "warmup": False}),
    # one 56x56 image: a base view and its 1x1 grid, each row newline-ended (grids cut and shrunk, several images,
    # videos: tests/test_llava_onevision.py)
    "llava_onevision": Case("llava_onevision_ckpt", "image_files", "image", {"eager": [1], "xla": [1]},
                            "Describe the picture.",
                            {"progress": False, "warmup": False, "max_batch": 2,
                             "buckets": {"min_encoder_rows": 64, "max_encoder_rows": 64}}),
    "llava": Case("llava_ckpt", "image_files", "image",
                  {"eager": [0, 1, 3], "xla": [3]}, "What shape is this?",
                  {"progress": False, "warmup": False, "buckets": {"min_encoder_rows": 64, "max_encoder_rows": 64}, "max_batch": 2}),
    # images cut into 1, 3 and 3 tiles of 56 px (a thumbnail beside the two tiles of 84x56 and 56x112): 7 tiles
    # in one tower call, which the XLA executor pads to 8
    "internvl": Case("internvl_ckpt", "image_files", "image",
                     {"eager": [0, 3], "xla": [3]}, "Compare the two pictures.",
                     {"progress": False, "warmup": False, "buckets": {"min_encoder_rows": 64, "max_encoder_rows": 64},
                      "max_batch": 2}),
    # images split into 2x2, 2x2 and 2x1 tiles of 56 px, each with a global view: 13 tiles in one tower call, which
    # the XLA executor pads to 16
    "smolvlm": Case("smolvlm_ckpt", "image_files", "image",
                    {"eager": [3], "xla": [3]}, "Compare the pictures.",
                    {"progress": False, "warmup": False, "buckets": {"min_encoder_rows": 64, "max_encoder_rows": 64},
                     "max_batch": 2}),
    # two images (4 tokens each, attending to each other both ways) in prompts longer than the sliding window (8)
    "gemma3": Case("gemma3_ckpt", "image_files", "image",
                   {"eager": [0, 2], "xla": [2]}, "Compare the two pictures please.",
                   {"progress": False, "warmup": False, "buckets": {"min_encoder_rows": 16, "max_encoder_rows": 16},
                    "max_batch": 2}),
    "qwen2_audio": Case("qwen2_audio_ckpt", "audio_files", "audio",
                        {"eager": [0, 1, 3], "xla": [3]}, "What do you hear?",
                        {"progress": False, "warmup": False, "buckets": {"min_encoder_rows": 64, "max_encoder_rows": 64},
                         "max_batch": 2}),
}
_REFS: dict = {}


def _case(family: str) -> Case:
    """``family``'s row of CASES, or for a family without one the default: 0 and 1 items of its
    media (the first it takes) on each executor, its tiny checkpoint from ``tiny_checkpoints``."""
    if family in CASES:
        return CASES[family]
    from mmzoo.fixtures import families

    kind = families()[family].media
    return Case("tiny_checkpoints", f"{kind}_files", kind, {"eager": [0, 1], "xla": [1]}, "What is this?",
                {"progress": False, "warmup": False, "buckets": {"min_encoder_rows": 64, "max_encoder_rows": 64}, "max_batch": 2})


def _inputs(request, family: str, case: Case):
    """The case's checkpoint directory and media files."""
    ckpt = request.getfixturevalue(case.checkpoint)
    return (ckpt[family] if case.checkpoint == "tiny_checkpoints" else ckpt), request.getfixturevalue(case.files)


def _reference(request, family: str) -> dict:
    case = _case(family)
    if family not in _REFS:
        ckpt, files = _inputs(request, family, case)
        counts = sorted({n for c in case.counts.values() for n in c})
        hf_class = config.family_class(family).hf_class  # the family's declared reference
        _REFS[family] = parity.reference(ckpt, hf_class, case.kind, files, counts, case.prompt)
    return _REFS[family]


def _counts(family: str, executor: str, attention: str) -> list[int]:
    """The item counts a (family, executor, backend) case runs: every count of the family's case,
    but Pallas on the eager executor (its kernels run by JAX on the host in interpret mode, the
    slowest cases) at the largest only: the XLA executor runs the same kernels at it too, and the
    other counts go through every other backend."""
    counts = _case(family).counts[executor]
    return counts[-1:] if (executor, attention) == ("eager", "pallas") else counts


@pytest.mark.parametrize("family,executor,attention,n", [
    (f, e, b, n) for f in config.options("model") for e in ("eager", "xla") for b in config.options("attention")
    for n in _counts(f, e, b)])
def test_matches_transformers(request, family, executor, attention, n):
    case = _case(family)
    ref = _reference(request, family)[n]
    ckpt, files = _inputs(request, family, case)
    engine = parity.engine(ckpt, executor, attention, **case.xla)
    assert engine.name == family
    text = case.prompt[n] if isinstance(case.prompt, dict) else case.prompt
    req = {"prompt": text, f"{case.kind}s": files[:n]}
    prepared = engine.prepare(mmzoo.Request(**req))
    assert prepared.input_ids.tolist() == ref["ids"]
    np.testing.assert_allclose(engine.executor.prompt_logits(prepared), ref["logits"], atol=1e-4, rtol=0)
    result = engine.generate(mmzoo.Request(**req, max_new_tokens=16, ignore_eos=True, logprobs=parity.LOGPROBS,
                                           prompt_logprobs=1))
    assert result.prompt_token_ids == ref["ids"]
    assert result.token_ids == ref["tokens"]
    assert result.finish_reason == "length"
    # each token's log-probability and its alternatives', from the head's logits on the device
    assert [e["token_id"] for e in result.logprobs] == ref["tokens"]
    np.testing.assert_allclose([e["logprob"] for e in result.logprobs], ref["logprobs"], atol=1e-4, rtol=0)
    top = np.array([[lp for _, lp in e["top_logprobs"]] for e in result.logprobs])
    np.testing.assert_allclose(top, ref["top_logprobs"], atol=1e-4, rtol=0)
    ids = np.array([[i for i, _ in e["top_logprobs"]] for e in result.logprobs])
    apart = np.abs(np.diff(ref["top_logprobs"], axis=1)) > 1e-4  # ranks a near-tie does not blur
    firm = np.concatenate([apart[:, :1], apart[:, 1:] & apart[:, :-1], apart[:, -1:]], axis=1)
    assert (ids == ref["top_ids"])[firm].all()
    # the prompt scored (a step of its own): each token given the ones before it
    logp = ref["logits"] - np.logaddexp.reduce(ref["logits"], axis=-1, keepdims=True)
    want = logp[np.arange(len(ref["ids"]) - 1), ref["ids"][1:]]
    assert result.prompt_logprobs[0] is None and [e["token_id"] for e in result.prompt_logprobs[1:]] == ref["ids"][1:]
    np.testing.assert_allclose([e["logprob"] for e in result.prompt_logprobs[1:]], want, atol=1e-4, rtol=0)
