"""``python -m mmzoo.serve`` with the real ``openai`` client, on loopback (issue #17).

One XLA server (small buckets, every graph compiled before the port opens) serves the tests of
agreement, streaming, concurrency and bad requests; an eager one serves the tests that stop it.
The offline reference is an in-process engine on the same checkpoint, greedy.
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest

import mmzoo
from mmzoo.serve import free_port

XLA_SMALL = ["executor=xla", "executor.max_model_len=128", "executor.buckets.min_prefill=64",
             "executor.buckets.min_encoder_rows=64", "executor.buckets.max_encoder_rows=64", "executor.max_batch=4",
             "executor.progress=false"]


class Server:
    """A ``python -m mmzoo.serve`` process on a free loopback port."""

    def __init__(self, ckpt: Path, media_dir: Path, *overrides: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmzoo.serve", f"checkpoint={ckpt}", f"port={self.port}", f"media_dir={media_dir}",
             "served_model_name=tiny", *overrides],
            env={**os.environ, "PJRT_DEVICE": "CPU"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited: {self.proc.stderr.read()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            self.proc.kill()
            raise AssertionError("the server did not come up in 300 s")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=120, max_retries=0)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        return {k: float(v) for k, v in (line.split() for line in text.splitlines() if line and line[0] != "#")}

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


def _data_url(path: str) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def _chat(image: str | None, text: str) -> list[dict]:
    content = ([{"type": "image_url", "image_url": {"url": image}}] if image else []) + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


GREEDY = dict(temperature=0, max_tokens=8, extra_body={"return_token_ids": True})


@pytest.fixture(scope="module")
def media(tmp_path_factory, image_files):
    root = tmp_path_factory.mktemp("media")
    for f in image_files:
        shutil.copy(f, root)
    return root


@pytest.fixture(scope="module")
def xla_server(qwen2_vl_ckpt, media):
    server = Server(qwen2_vl_ckpt, media, *XLA_SMALL)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(qwen2_vl_ckpt):
    """The offline engine's greedy tokens for a (image path or None, prompt) request."""
    engine = mmzoo.load(qwen2_vl_ckpt, executor="eager")
    cache: dict = {}

    def tokens(image: str | None, prompt: str, max_new_tokens: int = 8) -> list[int]:
        key = (image, prompt, max_new_tokens)
        if key not in cache:
            cache[key] = engine.generate(prompt, images=[image] if image else [],
                                         max_new_tokens=max_new_tokens).token_ids
        return cache[key]

    tokens.engine = engine
    return tokens


def test_chat_with_an_image_equals_offline_greedy(xla_server, offline, image_files, media):
    want = offline(image_files[0], "What is in the image?")
    for url in (_data_url(image_files[0]), Path(image_files[0]).name):  # a data: URL, a file under media_dir
        r = xla_server.client.chat.completions.create(model="tiny", messages=_chat(url, "What is in the image?"),
                                                      **GREEDY)
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == want
        assert choice.message.content == offline.engine.decode(want)
        assert r.usage.completion_tokens == len(want) and r.usage.prompt_tokens > 0
        assert choice.finish_reason == ("stop" if len(want) < 8 else "length")


def test_stream_concatenates_to_the_same_text(xla_server, offline, image_files):
    want = offline.engine.decode(offline(image_files[1], "Describe it."))
    stream = xla_server.client.chat.completions.create(model="tiny", messages=_chat(_data_url(image_files[1]),
                                                                                    "Describe it."),
                                                       stream=True, temperature=0, max_tokens=8)
    text, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(text) == want
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    assert usage is not None and usage.completion_tokens >= 1


def test_completions_and_models(xla_server, offline):
    ids = offline.engine.processor.tokenizer("Once upon a time")["input_ids"]
    want = offline.engine.generate({"prompt_token_ids": ids, "max_new_tokens": 6}).token_ids
    r = xla_server.client.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=6,
                                             extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.usage.prompt_tokens == len(ids)
    assert [m.id for m in xla_server.client.models.list().data] == ["tiny"]


def test_logprobs_in_openai_shapes(xla_server, offline, image_files):
    """Chat (``logprobs``, ``top_logprobs``), a streamed chat and completions (``logprobs=k``) carry
    each token's log-probability and its alternatives', equal to the engine's own
    (``Request.logprobs``), in OpenAI's shapes."""
    engine = offline.engine
    text = engine.processor.tokenizer.decode
    want = engine.generate("What is in the image?", images=[image_files[0]], max_new_tokens=6, logprobs=2).logprobs
    kw = dict(model="tiny", messages=_chat(_data_url(image_files[0]), "What is in the image?"), temperature=0,
              max_tokens=6, logprobs=True, top_logprobs=2)
    content = xla_server.client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [c for chunk in xla_server.client.chat.completions.create(**kw, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    for got in (content, streamed):
        assert [c.token for c in got] == [text([e["token_id"]]) for e in want]
        assert [c.logprob for c in got] == pytest.approx([e["logprob"] for e in want], abs=1e-4)
        assert [[t.token for t in c.top_logprobs] for c in got] == [[text([i]) for i, _ in e["top_logprobs"]]
                                                                    for e in want]
        assert [[t.logprob for t in c.top_logprobs] for c in got] == [
            pytest.approx([lp for _, lp in e["top_logprobs"]], abs=1e-4) for e in want]
        assert all(c.bytes == list(c.token.encode()) for c in got)
    ids = engine.processor.tokenizer("Once upon a time")["input_ids"]
    want = engine.generate({"prompt_token_ids": ids, "max_new_tokens": 5, "logprobs": 3}).logprobs
    lp = xla_server.client.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=5,
                                              logprobs=3).choices[0].logprobs
    assert lp.tokens == [text([e["token_id"]]) for e in want]
    assert lp.token_logprobs == pytest.approx([e["logprob"] for e in want], abs=1e-4)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    for alternatives, e in zip(lp.top_logprobs, want):  # the 3 likeliest and the sampled token, by text
        assert alternatives[text([e["token_id"]])] == pytest.approx(e["logprob"], abs=1e-4)
        assert set(alternatives) == {text([i]) for i, _ in e["top_logprobs"]} | {text([e["token_id"]])}
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs=true"):
        xla_server.client.chat.completions.create(model="tiny", messages=_chat(None, "hi"), top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs=21 is more than this engine computes"):
        xla_server.client.completions.create(model="tiny", prompt="hi", logprobs=21)


def test_scoring_echo_and_several_prompts(xla_server, offline):
    """lm-evaluation-harness's loglikelihood request (``echo``, ``logprobs=1``, several prompts) and
    ``max_tokens=0``: the echoed prompt's tokens carry their log-probabilities, equal to the
    engine's ``prompt_logprobs``; one choice per prompt, in order, streamed too."""
    engine, client = offline.engine, xla_server.client
    text = engine.processor.tokenizer.decode
    prompts = ["The cat sat on the", "Once upon a time"]
    ids = [engine.processor.tokenizer(p)["input_ids"] for p in prompts]
    scored = [engine.generate({"prompt_token_ids": i, "max_new_tokens": 0, "prompt_logprobs": 1}) for i in ids]
    assert all(r.token_ids == [] and r.finish_reason == "length" for r in scored)
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == prompts
    assert r.usage.prompt_tokens == sum(len(i) for i in ids) and r.usage.completion_tokens == 0
    for choice, i, want in zip(r.choices, ids, scored):
        lp = choice.logprobs
        assert lp.tokens == [text([t]) for t in i] and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx([e["logprob"] for e in want.prompt_logprobs[1:]], abs=1e-4)
    # one generated token after the echoed prompt, token ids as prompts (the harness's shape)
    want = [engine.generate({"prompt_token_ids": i, "max_new_tokens": 1}).token_ids for i in ids]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0,
                                  extra_body={"return_token_ids": True})
    for choice, i, w in zip(r.choices, ids, want):
        assert choice.model_extra["token_ids"] == w and len(choice.logprobs.tokens) == len(i) + 1
        assert choice.text == text(i) + text(w)
    # several prompts streamed: each choice's text, by index, as the whole answer's
    plain = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0)
    parts = {0: "", 1: ""}
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0, stream=True):
        for c in chunk.choices:
            parts[c.index] += c.text
    assert [parts[0], parts[1]] == [c.text for c in plain.choices]
    # vLLM's prompt_logprobs extension in chat: the templated prompt's tokens, the first None
    r = client.chat.completions.create(model="tiny", messages=_chat(None, "hi"), max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    prompt = r.model_extra["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == r.usage.prompt_tokens and all(len(p) == 1 for p in prompt[1:])
    with pytest.raises(openai.BadRequestError, match=r"prompt is an empty list"):
        client.completions.create(model="tiny", prompt=[], max_tokens=1)


def test_n_samples_are_choices(xla_server, offline, image_files):
    """``n``: a choice per sample, the prompt prefilled once (its tokens counted once); greedy
    samples equal the offline answer, seeded ones equal the engine's own samples, streamed too."""
    client = xla_server.client
    want = offline(image_files[0], "What is in the image?")
    r = client.chat.completions.create(model="tiny", messages=_chat(_data_url(image_files[0]), "What is in the image?"),
                                       n=2, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1] and [c.model_extra["token_ids"] for c in r.choices] == [want] * 2
    single = client.chat.completions.create(model="tiny", messages=_chat(_data_url(image_files[0]),
                                                                         "What is in the image?"), **GREEDY)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    ids = offline.engine.processor.tokenizer("Once upon a time")["input_ids"]
    samples = offline.engine.generate({"prompt_token_ids": ids, "max_new_tokens": 5, "temperature": 1.0, "seed": 7,
                                       "n": 3}).samples
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=7, n=3,
              extra_body={"return_token_ids": True})
    r = client.completions.create(**kw)
    assert [c.model_extra["token_ids"] for c in r.choices] == [s.token_ids for s in samples]
    streamed = {0: [], 1: [], 2: []}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.model_extra.get("token_ids") or []
    assert [streamed[i] for i in range(3)] == [s.token_ids for s in samples]


def test_sixteen_concurrent_clients_match_offline_with_no_compiles(xla_server, offline, image_files):
    jobs = [(image_files[i % 3] if i % 4 else None, f"Question {i}: what is this?") for i in range(16)]
    want = [offline(img, q) for img, q in jobs]

    def ask(job):
        img, q = job
        r = xla_server.client.chat.completions.create(model="tiny", messages=_chat(_data_url(img) if img else None, q),
                                                      **GREEDY)
        return r.choices[0].model_extra["token_ids"]

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, jobs, timeout=240))
    assert got == want
    assert time.monotonic() - t0 < 240
    m = xla_server.metrics()
    assert m["mmzoo_graphs_compiled_after_warmup"] == 0
    assert m["mmzoo_requests_running"] == 0 and m["mmzoo_requests_waiting"] == 0
    assert m["mmzoo_requests_finished_total"] >= 16
    assert m["mmzoo_requests_running_max"] >= 2  # requests that arrived while others decoded joined their batch


def test_structured_outputs_in_both_endpoints(xla_server, offline):
    """OpenAI's ``response_format`` (json_schema, json_object), vLLM's ``structured_outputs`` and its
    older ``guided_*`` fields give the Python API's tokens under the same grammar; a bad grammar or
    two constraints at once are a 400 naming the field; nothing compiles after warmup."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = _chat(None, "Answer in JSON.")
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
              {"json": schema}),
             ({"response_format": {"type": "json_object"}}, {"json_object": True}),
             ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, {"choice": ["yes", "no"]}),
             ({"extra_body": {"guided_regex": "[0-9]{2}"}}, {"regex": "[0-9]{2}"})]
    for fields, spec in cases:
        extra = {**fields.pop("extra_body", {}), "return_token_ids": True}
        r = xla_server.client.chat.completions.create(model="tiny", messages=chat, temperature=0, max_tokens=12,
                                                      extra_body=extra, **fields)
        want = offline.engine.generate(messages=chat, max_new_tokens=12, structured_outputs=spec)
        assert r.choices[0].model_extra["token_ids"] == want.token_ids, spec
        assert r.choices[0].message.content == want.text
    assert want.text in {f"{i:02d}" for i in range(100)} and want.finish_reason == "stop"
    ids = offline.engine.processor.tokenizer("Pick one:")["input_ids"]
    r = xla_server.client.completions.create(model="tiny", prompt="Pick one:", temperature=0, max_tokens=6,
                                             extra_body={"guided_choice": ["alpha", "beta"]})
    want = offline.engine.generate({"prompt_token_ids": ids, "max_new_tokens": 6,
                                    "structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].text == want.text and want.text in ("alpha", "beta")
    for fields, param, needle in [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format",
             "response_format.json_schema.schema must be a JSON schema object"),
            ({"response_format": {"type": "xml"}}, "response_format", "choose text, json_object or json_schema"),
            ({"guided_regex": "[a-"}, "guided_regex", "guided_regex: "),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}},
             "response_format.json_schema.schema", "Invalid type: nope"),
            ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "structured_outputs.regexp='a'"),
            ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice",
             "response_format and guided_choice both constrain the output")]:
        with pytest.raises(openai.BadRequestError) as e:
            xla_server.client.chat.completions.create(model="tiny", messages=chat, max_tokens=4, extra_body=fields)
        assert e.value.body["param"] == param and needle in e.value.body["message"], e.value.body
    assert xla_server.metrics()["mmzoo_graphs_compiled_after_warmup"] == 0


BAD = {
    "unknown model": (dict(model="gpt-9"), "model"),
    "n over the slots": (dict(n=5), "n=5 samples need 5 KV-cache slots"),
    "too many images": (dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "IMG"}}] * 40 + [{"type": "text", "text": "all of them?"}]}]),
        "max_model_len"),
    "prompt too long": (dict(messages=[{"role": "user", "content": "word " * 400}]), "max_model_len"),
    "image does not decode": (dict(messages=_chat("data:image/png;base64," + base64.b64encode(b"not a png").decode(),
                                                  "x")), "image_url"),
    "path outside media_dir": (dict(messages=_chat("/etc/hostname", "x")), "outside the allowed media directory"),
    "wrong type": (dict(max_tokens="many"), "max_tokens"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_is_400_while_a_good_one_completes(xla_server, offline, image_files, case):
    fields, needle = BAD[case]
    body = {"model": "tiny", "messages": _chat(None, "hi"), "max_tokens": 4, **fields}
    if case == "too many images":
        body["messages"][0]["content"] = [
            {"type": "image_url", "image_url": {"url": _data_url(image_files[0])}}] * 40 + [{"type": "text", "text": "?"}]
    want = offline(None, "Good question.")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(xla_server.client.chat.completions.create, model="tiny",
                           messages=_chat(None, "Good question."), **GREEDY)
        with pytest.raises(openai.BadRequestError) as e:
            xla_server.client.chat.completions.create(**{k: v for k, v in body.items()})
        assert good.result(timeout=120).choices[0].model_extra["token_ids"] == want
    assert e.value.status_code == 400
    error = e.value.body
    assert needle in (error.get("message", "") + str(error.get("param"))), error


def test_disconnect_frees_the_slot_and_sigterm_finishes_in_flight(qwen2_vl_ckpt, media):
    server = Server(qwen2_vl_ckpt, media, "executor=eager", "executor.max_batch=1", "executor.max_model_len=512")
    try:
        # a client that leaves after one chunk: its 400-token request stops at once
        stream = server.client.chat.completions.create(model="tiny", messages=_chat(None, "Tell a story."), stream=True,
                                                       temperature=0, max_tokens=400, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        t0 = time.monotonic()
        r = server.client.chat.completions.create(model="tiny", messages=_chat(None, "hi"), temperature=0, max_tokens=3)
        assert r.choices[0].message is not None and time.monotonic() - t0 < 60
        assert server.metrics()["mmzoo_generation_tokens_total"] < 300  # the story did not run on
        # SIGTERM while a request is in flight: it completes whole, then the server exits 0
        results = {}

        def long_request():
            results["r"] = server.client.chat.completions.create(
                model="tiny", messages=_chat(None, "Count."), temperature=0, max_tokens=120,
                extra_body={"ignore_eos": True})

        worker = threading.Thread(target=long_request)
        worker.start()
        deadline = time.monotonic() + 60
        while server.metrics()["mmzoo_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        code, err = server.stop()
        worker.join(timeout=60)
        assert code == 0, err
        assert results["r"].usage.completion_tokens == 120 and results["r"].choices[0].finish_reason == "length"
        with pytest.raises(openai.APIConnectionError):  # not accepting any more
            server.client.models.list()
    finally:
        server.stop()


def test_sigterm_past_the_drain_timeout_ends_every_request_cleanly(qwen2_vl_ckpt, media):
    server = Server(qwen2_vl_ckpt, media, "executor=eager", "executor.max_model_len=4096", "drain_timeout_s=1")
    body = dict(model="tiny", messages=_chat(None, "Tell a long story."), temperature=0, max_tokens=4000,
                extra_body={"ignore_eos": True})
    try:
        def streamed():
            return [c for c in server.client.chat.completions.create(stream=True, **body)]

        def plain():
            with pytest.raises(openai.APIStatusError) as e:
                server.client.chat.completions.create(**body)
            return e.value

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            chunks, cut = pool.submit(streamed), pool.submit(plain)
            deadline = time.monotonic() + 60
            while server.metrics()["mmzoo_requests_running"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            t0 = time.monotonic()
            code, err = server.stop()
            chunks, cut = chunks.result(timeout=60), cut.result(timeout=60)
        assert code == 0 and time.monotonic() - t0 < 30, err
        assert "Traceback" not in err and "Exception" not in err, err
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "abort" and 0 < len(finishes) < 4000
        assert cut.status_code == 503 and "drain_timeout_s=1" in cut.body["message"]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def eager_server(qwen2_vl_ckpt, media):
    server = Server(qwen2_vl_ckpt, media, "executor=eager", "executor.max_model_len=256")
    yield server
    server.stop()


def test_embeds_part_stop_strings_and_streamed_completions(eager_server, offline, image_files, media):
    from mmzoo import embeds_file

    engine = offline.engine
    embeds_file.write(media / "emb.safetensors", engine.encode(images=[image_files[0]]), engine.embeds_metadata())
    want = offline(image_files[0], "What is in the image?")
    r = eager_server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
        {"type": "mmzoo_embeds", "mmzoo_embeds": {"path": "emb.safetensors"}},
        {"type": "text", "text": "What is in the image?"}]}], **GREEDY)
    assert r.choices[0].model_extra["token_ids"] == want  # the file's embeddings stand for the image
    # stop strings: the text ends before the first match, finish_reason "stop"
    full = engine.decode(offline(None, "Tell me more.", 12))
    k = next(k for k in range(1, len(full) - 2) if "\ufffd" not in full[k:k + 2] and full.find(full[k:k + 2]) == k)
    for stream in (False, True):
        r = eager_server.client.chat.completions.create(model="tiny", messages=_chat(None, "Tell me more."),
                                                        temperature=0, max_tokens=12, stop=[full[k:k + 2], "\x00"],
                                                        stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert (text, reason) == (full[:k], "stop")
    # no max_tokens: generate to the end of the context (vLLM's default), here with EOS off
    r = eager_server.client.completions.create(model="tiny", prompt="Once", temperature=0,
                                               extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 256 and r.choices[0].finish_reason == "length"
    # a streamed plain completion concatenates to the unstreamed one
    plain = eager_server.client.completions.create(model="tiny", prompt="Once upon", temperature=0, max_tokens=6)
    parts = [c.choices[0].text for c in eager_server.client.completions.create(
        model="tiny", prompt="Once upon", temperature=0, max_tokens=6, stream=True) if c.choices]
    assert "".join(parts) == plain.choices[0].text


def test_audio_family_takes_input_audio(qwen2_audio_ckpt, audio_files, media):
    engine = mmzoo.load(qwen2_audio_ckpt, executor="eager")
    want = engine.generate("What do you hear?", audios=[audio_files[1]], max_new_tokens=8).token_ids
    server = Server(qwen2_audio_ckpt, media, "executor=eager")
    try:
        clip = base64.b64encode(Path(audio_files[1]).read_bytes()).decode()
        r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
            {"type": "text", "text": "What do you hear?"}]}], **GREEDY)
        assert r.choices[0].model_extra["token_ids"] == want
        with pytest.raises(openai.BadRequestError, match="does not take images"):
            server.client.chat.completions.create(model="tiny", messages=_chat(_data_url(audio_files[0]), "x"))
    finally:
        server.stop()
