"""The server fuzzed from its own OpenAPI schema (schemathesis): requests that follow the schema
and requests that break it, on every endpoint, in process (no socket: loopback by construction),
bounded in count and deterministic (``derandomize``). No answer may be a 5xx, every error must be
OpenAI's error body, and a good request sent over and over from another thread meanwhile must
keep getting its greedy tokens."""

from __future__ import annotations

import base64
import threading

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

import mmzoo
from mmzoo.fixtures import make_image
from mmzoo.serve.app import create_app

EXAMPLES = {"post": 60, "get": 5}  # per operation and generation mode
# strings the schema allows that have broken servers: a NUL byte, a name too long for the OS, a
# path out of the media directory, data: URLs that are not images
NASTY = ["a\x00b", "x" * 5000, "../../etc/passwd", "file:///etc/passwd", "data:image/png;base64,AAAA",
         "data:image/png;base64," + "A" * 4000, "img.png", "emb.safetensors", "notes.txt", "sub", ""]


@pytest.fixture(scope="module")
def served(qwen2_vl_ckpt, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    make_image(40, 28, seed=1).save(media / "img.png")
    (media / "notes.txt").write_text("not an image")
    (media / "emb.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}  not a header")
    (media / "sub").mkdir()
    engine = mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=128, max_batch=2)
    app = create_app(engine, served_model_name="tiny", media_dir=str(media))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client


def _good_body(image: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"model": "tiny", "temperature": 0, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": "What is this?"}]}]}


def _steer(body, data) -> None:
    """Most cases name the served model (else all stop at the model check) and some carry a
    nasty string where a path or URL goes."""
    if not isinstance(body, dict):
        return
    if "model" in body and data.draw(st.integers(0, 3), label="serve") > 0:
        body["model"] = "tiny"
        if data.draw(st.booleans(), label="n=1"):
            body.pop("n", None)
    for msg in body.get("messages") or []:
        for part in (msg.get("content") if isinstance(msg, dict) and isinstance(msg.get("content"), list) else []):
            if not isinstance(part, dict):
                continue
            for key in ("image_url", "mmzoo_embeds"):
                ref = part.get(key)
                if isinstance(ref, dict) and data.draw(st.booleans(), label="nasty"):
                    ref["url" if key == "image_url" else "path"] = data.draw(st.sampled_from(NASTY), label=key)


def test_no_server_errors_and_a_good_request_is_unaffected(served, tmp_path):
    app, client = served
    image = tmp_path / "good.png"
    make_image(56, 56, seed=3).save(image)
    good = _good_body(image.read_bytes())
    first = client.post("/v1/chat/completions", json=good)
    assert first.status_code == 200, first.text
    want = first.json()["choices"][0]["token_ids"]
    assert len(want) == 6

    stop, seen, wrong = threading.Event(), [], []

    def keep_asking():
        while not stop.is_set():
            r = client.post("/v1/chat/completions", json=good)
            got = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text
            (seen if got == want else wrong).append(got)

    schema = schemathesis.openapi.from_dict(app.openapi())
    worker = threading.Thread(target=keep_asking, daemon=True)
    worker.start()
    failures, codes = [], {}
    try:
        for result in schema.get_all_operations():
            op = result.ok()
            # the GET endpoints take nothing: no request can break their schema
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[:2 if op.method == "post" else 1]:
                @settings(max_examples=EXAMPLES[op.method], deadline=None, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode), data=st.data())
                def check(case, data):
                    _steer(case.body, data)
                    kw = case.as_transport_kwargs()
                    r = client.request(**{k: kw[k] for k in ("method", "url", "headers", "params", "json", "content")
                                          if k in kw})
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1
                    if r.status_code >= 500:
                        failures.append((op.path, r.status_code, r.text[:300], repr(case.body)[:300]))
                    elif r.status_code >= 400:
                        err = r.json().get("error")
                        assert isinstance(err, dict) and err.get("message"), r.text

                check()
    finally:
        stop.set()
        worker.join(timeout=120)
    assert not failures, failures
    assert not wrong, wrong[:3]
    # the examples drawn differ from run to run despite derandomize (10-27 of the 243 answered 200 in runs
    # here, the fewest on a loaded machine): some must be answered, and most refused
    assert len(seen) >= 1 and codes.get(200, 0) >= 5 and codes.get(400, 0) > 50, codes


@pytest.mark.parametrize("ref", NASTY)
@pytest.mark.parametrize("kind", ["image_url", "mmzoo_embeds"])
def test_nasty_media_references_are_client_errors(served, kind, ref):
    _, client = served
    part = {"type": kind, kind: {"url": ref} if kind == "image_url" else {"path": ref}}
    r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": [part, {"type": "text", "text": "?"}]}]})
    if ref == "img.png" and kind == "image_url":
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        assert f"messages[0].content[0]" in r.json()["error"]["message"] or "embeds file" in r.json()["error"]["message"]
