"""Qwen2-Audio's own tests (parity with transformers is tests/test_parity.py): embeddings mode, XLA
warmup with the tower's clip buckets, bad input and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import mmzoo
import parity
from mmzoo.fixtures import make_audio, write_wav
from mmzoo.models import Qwen2Audio
from parity import EXECUTORS, GEN, XLA

PROMPT = "What do you hear?"


@pytest.fixture(scope="module")
def eager(qwen2_audio_ckpt):
    return parity.engine(qwen2_audio_ckpt, "eager")


def clip_embeds(engine, files) -> list[torch.Tensor]:
    """Each clip's valid ``[tokens, hidden]`` embeddings, from ``Engine.encode``'s rows and lengths."""
    out = engine.encode(audios=files)
    assert set(out) == {"audio_embeds", "audio_lengths"}
    return list(torch.split(out["audio_embeds"], out["audio_lengths"].tolist()))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_audio_embeds_match_raw_audio(eager, qwen2_audio_ckpt, audio_files, executor):
    engine = parity.engine(qwen2_audio_ckpt, executor, **XLA)
    parts = clip_embeds(eager, audio_files)
    assert [p.shape[0] for p in parts] == [12, 32, 20]  # ((L - 1) // 2 + 1) // 2 for L = 50, 130, 80 mel frames
    raw = engine.generate(mmzoo.Request(prompt=PROMPT, audios=audio_files, **GEN))
    via = engine.generate(mmzoo.Request(prompt=PROMPT, audio_embeds=parts, **GEN))
    assert via.token_ids == raw.token_ids and via.prompt_token_ids == raw.prompt_token_ids
    packed = engine.generate(mmzoo.Request(prompt=PROMPT, audio_embeds=torch.cat(parts), audio_lengths=[12, 32, 20],
                                           **GEN))
    assert packed.token_ids == raw.token_ids
    if executor == "eager":  # one 2-D array is one clip (on XLA this would only add compiles)
        one = engine.generate(mmzoo.Request(prompt=PROMPT, audio_embeds=parts[1], **GEN))
        assert one.token_ids == engine.generate(mmzoo.Request(prompt=PROMPT, audios=audio_files[1:2], **GEN)).token_ids
    # token ids with one placeholder per clip are expanded to each clip's count
    pad = engine.config.audio_token_id
    ids = raw.prompt_token_ids
    collapsed = [t for i, t in enumerate(ids) if t != pad or ids[i - 1] != pad]
    for kw in ({"audios": audio_files}, {"audio_embeds": parts}):
        assert engine.generate(mmzoo.Request(prompt_token_ids=collapsed, **kw, **GEN)).token_ids == raw.token_ids


def test_xla_warmup_covers_every_clip_count(qwen2_audio_ckpt, audio_files):
    """The tower's buckets (clips per call, from the encoder's rows per clip) and the family's dummy clips
    compile everything a real request runs."""
    assert isinstance(parity.engine(qwen2_audio_ckpt, "eager").family, Qwen2Audio)
    engine = mmzoo.load(qwen2_audio_ckpt, executor="xla", max_model_len=160, max_batch=2, progress=False,
                        buckets={"prefill": [160], "min_encoder_rows": 64, "max_encoder_rows": 64},
                        compile={"on_recompile": "error"})
    assert engine.executor.buckets.tower("audio") == (1, 2, 4)  # 4 clips of 50 rows fill the 160 + 64 media rows
    results = engine.generate([{"prompt": PROMPT, "audios": audio_files[:n], **GEN} for n in (3, 1)])
    eager = parity.engine(qwen2_audio_ckpt, "eager")
    for n, r in zip((3, 1), results):
        assert r.error is None and r.graphs_compiled_after_warmup == 0
        assert r.token_ids == eager.generate(mmzoo.Request(prompt=PROMPT, audios=audio_files[:n], **GEN)).token_ids


def test_bad_input(eager, audio_files, tmp_path):
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"RIFF but not really a wave file")
    empty = write_wav(tmp_path / "empty.wav", np.zeros(0, np.float32))
    short = write_wav(tmp_path / "short.wav", make_audio(0.01))
    cases = [
        (dict(audios=[str(tmp_path / "missing.wav")]), r"audios\[0\]: audio file .*missing.wav does not exist"),
        (dict(audios=[audio_files[0], str(garbage)]), r"audios\[1\]: .*garbage.wav is not a readable audio file"),
        (dict(audios=[str(empty)]), r"audios\[0\]: .*empty.wav is empty \(no samples\)"),
        (dict(audios=[audio_files[0], str(short)]), r"audios\[1\] is too short \(160 samples"),
        (dict(audios=[np.zeros((2, 100), np.float32)]), r"audios\[0\]: an audio array must be 1-D float"),
        (dict(prompt="<|AUDIO|> what?", audios=audio_files[:1]), r"prompt contains the audio placeholder"),
        (dict(prompt_token_ids=[5, 6, 7], audios=audio_files[:1]),
         r"prompt_token_ids has 0 audio placeholder runs .* but 1 audios are given"),
        (dict(audio_embeds=[torch.zeros(4, 64), torch.zeros(4, 32)]),
         r"audio_embeds\[1\] has hidden size 32 but the LM's hidden size is 64"),
        (dict(audio_embeds=torch.zeros(2, 3, 64)), r"audio_embeds must be 2-D"),
        (dict(audio_embeds=[torch.zeros(0, 64)]), r"audio_embeds\[0\] has no rows"),
        (dict(audio_embeds=[torch.zeros(4, 64)], audios=audio_files[:1]), r"give audios or audio_embeds, not both"),
        (dict(images=["a.png"]), r"model=qwen2_audio does not take images"),
        (dict(audio_embeds=torch.zeros(6, 64), audio_lengths=[2, 3]),
         r"audio_lengths \[2, 3\] sum to 5 rows but audio_embeds has 6"),
        (dict(audio_embeds=torch.zeros(6, 64), audio_lengths=[6, 0]), r"audio_lengths must be a 1-D list of positive"),
        (dict(audio_embeds=[torch.zeros(6, 64)], audio_lengths=[6]), r"audio_lengths splits a 2-D audio_embeds"),
    ]
    parity.assert_refused(eager, cases, PROMPT, kind="audio", files=audio_files)


@pytest.mark.slow  # the CLI: test_cli; audio requests through XLA: test_xla_warmup_covers_every_clip_count, test_serve
def test_cli(qwen2_audio_ckpt, audio_files, tmp_path):
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    p = subprocess.run([sys.executable, "-m", "mmzoo.infer", "model=qwen2_audio", f"checkpoint={qwen2_audio_ckpt}",
                        f"audios=[{audio_files[0]},{audio_files[2]}]", "prompt=What do you hear?", "executor=eager",
                        "max_new_tokens=5", "ignore_eos=true", f"output={out}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "model=qwen2_audio" in p.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(row["token_ids"]) == 5 and row["audios"] == [audio_files[0], audio_files[2]]
    # encode once, then serve from the embeddings file: the same tokens, the tower not loaded
    emb = tmp_path / "emb.safetensors"
    p = subprocess.run([sys.executable, "-m", "mmzoo.encode", "model=qwen2_audio", f"checkpoint={qwen2_audio_ckpt}",
                        f"audios=[{audio_files[0]},{audio_files[2]}]", f"output={emb}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "audio_lengths [2]" in p.stderr
    out2 = tmp_path / "out2.jsonl"
    p = subprocess.run([sys.executable, "-m", "mmzoo.infer", "model=qwen2_audio", f"checkpoint={qwen2_audio_ckpt}",
                        f"embeds={emb}", "prompt=What do you hear?", "executor=eager", "max_new_tokens=5",
                        "ignore_eos=true", f"output={out2}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "encoder towers are not loaded" in p.stderr
    (row2,) = [json.loads(line) for line in out2.read_text().splitlines()]
    assert row2["token_ids"] == row["token_ids"] and row2["prompt_token_ids"] == row["prompt_token_ids"]
