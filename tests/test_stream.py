"""One request surface for Python and HTTP: stop strings in ``generate`` (the server's held-back
matching, :mod:`mmzoo.text`), a streaming iterator (``Engine.stream``) usable while other
requests run, and messages whose parts carry their images and audio as the server takes them."""

from __future__ import annotations

import base64
import threading
from pathlib import Path

import pytest

import mmzoo
from mmzoo.errors import MmzooError
from mmzoo.fixtures import make_image

GEN = dict(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(qwen2_vl_ckpt):
    return mmzoo.load(qwen2_vl_ckpt, executor="eager", max_batch=1)


def test_stop_strings_in_generate(engine):
    full = engine.generate("hello there", **GEN)
    stop = full.text[4:7]
    assert len(stop) == 3 and full.text.find(stop) == 4, full.text
    r = engine.generate("hello there", stop=[stop, "never there"], **GEN)
    assert r.finish_reason == "stop" and r.text == full.text[:4]
    # the tokens up to the one that completed the match
    assert r.token_ids == full.token_ids[:len(r.token_ids)] and engine.decode(r.token_ids).find(stop) == 4
    assert not engine.decode(r.token_ids[:-1]).find(stop) == 4
    assert engine.generate("hello there", stop=stop, **GEN).text == r.text  # one string, as vLLM takes it
    with pytest.raises(MmzooError, match=r"stop\[0\]=''"):
        engine.generate("hello there", stop=[""])


def test_stream_yields_what_generate_returns(engine, image_files):
    for kw in ({}, {"images": image_files[:1], "logprobs": 1}):
        want = engine.generate("hello there", **GEN, **kw)
        outs = list(engine.stream("hello there", **GEN, **kw))
        assert [o.finished for o in outs] == [False] * len(want.token_ids) + [True]
        assert "".join(o.text for o in outs) == want.text
        assert [t for o in outs for t in o.token_ids] == want.token_ids
        assert outs[-1].result.token_ids == want.token_ids and outs[-1].result.finish_reason == "length"
        if kw:
            assert [e for o in outs[:-1] for e in o.logprobs] == outs[-1].result.logprobs
    full = engine.generate("hello there", **GEN)
    outs = list(engine.stream("hello there", stop=[full.text[4:7]], **GEN))
    assert "".join(o.text for o in outs) == full.text[:4] and outs[-1].result.finish_reason == "stop"


def test_streams_run_together_and_free_their_slot(qwen2_vl_ckpt):
    engine = mmzoo.load(qwen2_vl_ckpt, executor="eager", max_batch=2)
    prompts = ["hello there", "what is this", "say something"]
    alone = [engine.generate(p, **GEN).text for p in prompts]
    texts = ["", "", ""]

    def read(i: int) -> None:
        for out in engine.stream(prompts[i], **GEN):
            texts[i] += out.text

    threads = [threading.Thread(target=read, args=(i,)) for i in range(3)]  # 3 requests, 2 slots
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert texts == alone
    a, b = engine.stream(prompts[0], **GEN), engine.stream(prompts[1], **GEN)  # two in one thread
    got = ["", ""]
    for x, y in zip(a, b):
        got[0], got[1] = got[0] + x.text, got[1] + y.text
    assert got == alone[:2]
    for _ in engine.stream(prompts[2], max_new_tokens=100, ignore_eos=True):  # leave after one token
        break
    assert engine.generate(prompts[2], **GEN).text == alone[2]  # the slot came back; generate runs


def test_messages_carry_their_media_as_the_server_takes_them(engine, image_files, qwen2_audio_ckpt, audio_files):
    question = {"type": "text", "text": "What is in the image?"}
    want = engine.generate(mmzoo.Request(messages=[{"role": "user", "content": [{"type": "image"}, question]}],
                                         images=image_files[:1], **GEN)).token_ids
    for part in ({"type": "image", "image": image_files[0]}, {"type": "image", "path": image_files[0]},
                 {"type": "image_url", "image_url": {"url": image_files[0]}}):
        messages = [{"role": "user", "content": [part, question]}]
        assert engine.generate(mmzoo.Request(messages=messages, **GEN)).token_ids == want, part
    frames = [make_image(56, 56, seed=10 + i) for i in range(4)]  # a video as its frames
    ask = {"type": "text", "text": "What happens?"}
    want = engine.generate(mmzoo.Request(messages=[{"role": "user", "content": [{"type": "video"}, ask]}],
                                         videos=[frames], **GEN)).token_ids
    messages = [{"role": "user", "content": [{"type": "video", "video": frames}, ask]}]
    assert engine.generate(mmzoo.Request(messages=messages, **GEN)).token_ids == want
    with pytest.raises(MmzooError, match=r"messages carry 1 image\(s\) in their parts and images gives 1 more"):
        engine.generate(mmzoo.Request(messages=[{"role": "user", "content": [{"type": "image", "image": image_files[0]},
                                                                            question]}], images=image_files[:1]))
    audio = mmzoo.load(qwen2_audio_ckpt, executor="eager")
    ask = {"type": "text", "text": "What do you hear?"}
    want = audio.generate(mmzoo.Request(messages=[{"role": "user", "content": [{"type": "audio"}, ask]}],
                                        audios=audio_files[:1], **GEN)).token_ids
    data = base64.b64encode(Path(audio_files[0]).read_bytes()).decode()
    for part in ({"type": "audio", "audio": audio_files[0]}, {"type": "input_audio", "input_audio": {"data": data}}):
        messages = [{"role": "user", "content": [part, ask]}]
        assert audio.generate(mmzoo.Request(messages=messages, **GEN)).token_ids == want, part
