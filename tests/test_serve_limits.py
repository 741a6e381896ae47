"""The server's limits and ends, in process (FastAPI's TestClient on the app): bodies over
``limits.max_request_bytes`` are 413 before they are read, a prompt or media over their limits are
400 before any work, one slow preparation does not hold the others, and the drain timeout ends
the requests still running with ``finish_reason="abort"`` (streams) or 503 (plain requests)."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import mmzoo
from mmzoo.serve.app import create_app

LIMITS = ["limits.max_request_bytes=200000", "limits.max_media_items=3", "limits.max_media_bytes=100000"]


@pytest.fixture(scope="module")
def engine(qwen2_vl_ckpt):
    return mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=1024, overrides=LIMITS)


@pytest.fixture()
def client(engine):
    app = create_app(engine, served_model_name="tiny", drain_timeout_s=0.5)
    with TestClient(app) as c:
        c.app_ = app
        yield c


def _chat(text: str, images: list[str] = (), **fields) -> dict:
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        Path(p).read_bytes()).decode()}} for p in images] + [{"type": "text", "text": text}]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 4,
            **fields}


def _error(r) -> dict:
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    assert body["error"]["code"] == r.status_code
    return body["error"]


def test_a_body_over_the_limit_is_413_before_it_is_read(client):
    big = json.dumps(_chat("x" * 300_000)).encode()
    r = client.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    err = _error(r)
    assert f"{len(big)} bytes" in err["message"] and "limits.max_request_bytes" in err["message"]

    def chunks():  # no Content-Length: a chunked upload, cut when it passes the limit
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    r = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limits.max_request_bytes" in _error(r)["message"]
    assert client.post("/v1/chat/completions", json=_chat("hi")).status_code == 200


def test_prompt_and_media_limits_are_400_before_any_work(client, engine, image_files, monkeypatch):
    calls = []
    real = engine.family.prepare
    monkeypatch.setattr(engine.family, "prepare", lambda *a, **k: calls.append(1) or real(*a, **k))
    # the derived text limit: max_model_len tokens x the longest vocabulary entry x 4
    bound = engine.max_prompt_chars
    assert bound == 1024 * max(len(t) for t in engine.processor.tokenizer.get_vocab()) * 4
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "y" * (bound + 1), "max_tokens": 2})
    assert r.status_code == 400 and f"{bound + 1} characters" in _error(r)["message"], r.text
    r = client.post("/v1/chat/completions", json=_chat("z" * (bound + 1)))
    assert r.status_code == 400 and "derived from max_model_len" in _error(r)["message"]
    r = client.post("/v1/chat/completions", json=_chat("?", [image_files[0]] * 4))
    assert r.status_code == 400 and "4 media items" in _error(r)["message"]
    assert "limits.max_media_items" in _error(r)["message"]
    assert not calls  # refused before the processor ran
    big = Path(image_files[0]).read_bytes()
    n = 100_000 // len(big) + 1
    if n <= 3:
        r = client.post("/v1/chat/completions", json=_chat("?", [image_files[0]] * n))
        assert r.status_code == 400 and "limits.max_media_bytes" in _error(r)["message"]


def test_a_slow_preparation_does_not_hold_the_others(client, engine, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real = engine.family.prepare

    def prepare(request, *a, **k):
        if "slow" in json.dumps(request.messages):
            entered.set()
            assert release.wait(60)
        return real(request, *a, **k)

    monkeypatch.setattr(engine.family, "prepare", prepare)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(client.post, "/v1/chat/completions", json=_chat("slow one"))
        assert entered.wait(60)
        t0 = time.monotonic()
        fast = client.post("/v1/chat/completions", json=_chat("fast one"))
        assert fast.status_code == 200 and not slow.done()  # answered while the slow one is still preparing
        assert time.monotonic() - t0 < 30
        release.set()
        assert slow.result(timeout=60).status_code == 200


def test_the_drain_timeout_ends_requests_cleanly(client):
    loop_ = client.app_.state.engine_loop
    body = _chat("Tell a long story.", max_tokens=1000, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        def stream():
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                return r.status_code, [line for line in r.iter_lines() if line]

        streamed = pool.submit(stream)
        plain = pool.submit(client.post, "/v1/chat/completions", json=body)
        deadline = time.monotonic() + 60
        while loop_.stats.running < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop_.stats.running == 2
        loop_.drain()
        r = client.post("/v1/chat/completions", json=_chat("late"))
        assert r.status_code == 503 and "shutting down" in _error(r)["message"]
        status, lines = streamed.result(timeout=60)
        r = plain.result(timeout=60)
    assert status == 200 and lines[-1] == "data: [DONE]"
    last = json.loads(lines[-3][len("data: "):]) if "usage" in lines[-2] else json.loads(lines[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert r.status_code == 503
    err = _error(r)
    assert "cut after drain_timeout_s=0.5" in err["message"] and err["type"] == "server_error"


def test_limits_config_is_checked():
    from mmzoo.errors import MmzooError
    from mmzoo.limits import Limits

    assert Limits.from_config(None).max_prompt_chars == "auto"
    assert Limits.from_config({"max_prompt_chars": 0, "max_media_items": None}).max_prompt_chars is None
    assert Limits.from_config({"max_media_items": None}).max_media_items is None
    for bad, needle in (({"max_media_items": -1}, "limits.max_media_items=-1"),
                        ({"max_request_bytes": "32M"}, "whole number of bytes"),
                        ({"max_prompt_chars": "many"}, "or auto"), ({"max_media_pixel": 5}, "unknown field")):
        with pytest.raises(MmzooError, match=needle):
            Limits.from_config(bad)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_strict_fields(client, path):
    """A field the server does not know is a 400 naming it (a misspelling must not quietly change
    the output); OpenAI's fields that do not change the output are accepted and ignored."""
    from mmzoo.serve.protocol import Sampling

    body = _chat("What is this?", return_token_ids=True) if "chat" in path else \
        {"model": "tiny", "prompt": "What is this?", "temperature": 0, "max_tokens": 4, "return_token_ids": True}
    want = client.post(path, json=body)
    assert want.status_code == 200, want.text
    for field, value in (("temprature", 0), ("guided_decoding_backend", "xgrammar"), ("min_tokens", 1),
                         ("use_beam_search", False)):
        r = client.post(path, json={**body, field: value})
        assert r.status_code == 400 and _error(r)["param"] == field, r.text
        assert f"{field}: unknown field" in _error(r)["message"]
    ignored = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "prompt_cache_key": "k",
               "safety_identifier": "s", "parallel_tool_calls": True, "frequency_penalty": 0, "presence_penalty": 0}
    assert set(Sampling.IGNORED) <= set(ignored)
    r = client.post(path, json={**body, **ignored})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
    ids = want.json()["choices"][0]["token_ids"]
    r = client.post(path, json={**body, "stop_token_ids": [ids[1]]})  # vLLM's extension: stop at it, inclusive
    assert r.json()["choices"][0]["token_ids"] == ids[:ids.index(ids[1]) + 1]
