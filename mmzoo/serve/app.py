"""``python -m mmzoo.serve``: an OpenAI-compatible server on the shared executor, continuously batched.

Examples::

    python -m mmzoo.serve                                    # the embedded demo, 127.0.0.1:8000
    python -m mmzoo.serve model=qwen2_vl checkpoint=DIR attention=pallas media_dir=./images port=8001

Then, with the ``openai`` package::

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="qwen2_vl_shapes", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
        {"type": "text", "text": "What shape is this?"}]}], temperature=0)

Every bucket is compiled before the port opens (``warmup=all``). Handlers only validate,
prepare on the host and enqueue; one :class:`~mmzoo.engine_loop.EngineLoop` thread owns the device.
SIGINT / SIGTERM stop accepting connections, let the requests in flight finish (at most
``drain_timeout_s``), then exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from omegaconf import DictConfig
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmzoo.cli import hydra_main
from mmzoo.errors import MmzooError
from mmzoo.engine_loop import EngineLoop, Stream
from mmzoo.serve.protocol import (
    BadRequest,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessageOut,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Delta,
    MediaSource,
    ModelCard,
    ModelList,
    Usage,
    chat_logprobs,
    chat_request,
    completion_logprobs,
    vllm_prompt_logprobs,
    finish_reason,
    new_id,
    now,
)
from mmzoo.text import TextStream
from mmzoo.types import Request


def _error_body(message: str, param: str | None, status: int = 400) -> dict:
    """OpenAI's error body; ``code`` is the HTTP status, as vLLM's server gives it."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class ShuttingDown(MmzooError):
    """The server is draining (SIGINT / SIGTERM): a new request is refused, a cut one ends (HTTP 503)."""


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 with OpenAI's error body,
    from its Content-Length before anything is read, else as soon as the bytes read pass the limit
    (a chunked upload), so an oversized body costs the server at most ``limit`` bytes."""

    def __init__(self, app, limit: int | None):
        self.app, self.limit = app, limit

    def _message(self, size: str) -> str:
        return f"the request body is {size} bytes; the server takes at most {self.limit} (limits.max_request_bytes)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.limit:
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            response = JSONResponse(_error_body(self._message(length.decode()), None, 413), status_code=413)
            return await response(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # FastAPI re-raises an HTTPException from reading the body
                    raise StarletteHTTPException(413, self._message(f"over {self.limit}"))
            return message

        await self.app(scope, limited, send)


def _loc(loc: tuple) -> str:
    parts = [x for x in loc if x != "body"]
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in parts).lstrip(".") or "body"


def create_app(engine, *, served_model_name: str, media_dir: str | None = None,
               start_loop: bool = True, drain_timeout_s: float = 30.0):
    """The FastAPI application serving ``engine`` (built and warmed up).

    Args:
        engine: an :class:`~mmzoo.engine.Engine`; the app's engine loop owns it while the app runs.
        served_model_name: the name clients pass as ``model``.
        media_dir: the directory local image / embeddings paths may name; None: only ``data:`` URLs.
        start_loop: start the engine loop with the app's lifespan (tests may drive it themselves).
        drain_timeout_s: once :meth:`EngineLoop.drain` is called (SIGINT / SIGTERM), how long the
            requests in flight may take; then they end with ``finish_reason="abort"``.

    Requests are prepared on the host (decoding, tokenizing) in the server's threadpool, several at
    a time; ``engine.limits`` bound each one before any work (the body's bytes here, its text and
    media in :meth:`~mmzoo.engine.Engine.prepare`).
    """
    loop_ = EngineLoop(engine, drain_timeout_s=drain_timeout_s)
    media = MediaSource(media_dir)
    max_model_len = engine.executor.max_model_len

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start_loop:
            loop_.start()
        yield
        loop_.stop(timeout=60)

    app = FastAPI(title="mmzoo", lifespan=lifespan)
    app.state.engine_loop = loop_
    app.add_middleware(BodyLimit, limit=engine.limits.max_request_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return JSONResponse(_error_body(str(exc.detail), None, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ShuttingDown)
    async def _shutting_down(request, exc: ShuttingDown):
        return JSONResponse(_error_body(str(exc), None, 503), status_code=503)

    @app.exception_handler(BadRequest)
    async def _bad(request, exc: BadRequest):
        return JSONResponse(_error_body(str(exc), exc.param), status_code=400)

    @app.exception_handler(MmzooError)
    async def _mmzoo(request, exc: MmzooError):
        return JSONResponse(_error_body(str(exc), None), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
        param = _loc(tuple(first.get("loc", ())))

        def say(e: dict) -> str:
            where = _loc(tuple(e.get("loc", ())))
            if e.get("type") == "extra_forbidden":  # strict: a misspelling quietly ignored would change the output
                return f"{where}: unknown field (the fields mmzoo takes: docs/server.md)"
            return f"{where}: {e.get('msg')}"

        msg = "; ".join(say(e) for e in errors[:3])
        return JSONResponse(_error_body(msg, param), status_code=400)

    def token_text(token_id: int) -> str:
        return engine.processor.tokenizer.decode([token_id])

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise BadRequest(f"model {name!r} is not served here; this server serves {served_model_name!r}", "model")

    def prepare(fields: dict[str, Any], names: dict[str, str] | None = None):
        """The prepared request; an error names the item as the request did (``images[0]`` ->
        ``messages[1].content[0].image_url``)."""
        try:
            return engine.prepare(Request.parse(fields, where="request"))
        except MmzooError as e:
            msg = str(e)
            for item, param in (names or {}).items():
                if msg.startswith(item):
                    raise BadRequest(param + msg[len(item):], param) from None
            raise

    def submit(prepared) -> list[Stream]:
        """Queue a prepared request on the engine loop: a stream per sample (``n``)."""
        check_open()  # again: the drain may have begun while the request was prepared
        return loop_.submit(prepared, [Stream(loop=asyncio.get_running_loop()) for _ in range(prepared.request.n)])

    async def generate(prepared, stops: list[str], stream: Stream) -> AsyncIterator[Piece]:
        """One sample's pieces (:class:`Piece`) from its ``stream``: its prompt's log-probabilities
        first when it asked (``prompt``), a piece per token (the text may be empty: held back, or
        past a stop string's end, which is never yielded), then the end; a client that goes away
        cancels the sequence."""
        text = TextStream(engine.decode, stops)
        scored = prepared.request.prompt_logprobs is None
        finished = False
        try:
            while True:
                item = await stream.events.get()
                if not scored:  # computed before the first token (a step of its own)
                    scored = True
                    result = stream.result if item is None else stream.seq.result
                    yield Piece(scored=True, prompt=result.prompt_logprobs)
                if item is None:
                    break
                token, logprob = item  # the loop ends the sequence at a stop string's match (Request.stop)
                yield Piece(text=text.push(token), token=token, logprob=logprob)
            result = stream.result
            if result.error and not result.token_ids:
                raise MmzooError(result.error)
            tail = text.flush()
            if tail:
                yield Piece(text=tail)
            reason = finish_reason(result.finish_reason)
            finished = True
            yield Piece(end=(reason, list(text.tokens)))
        finally:
            if not finished:  # the client went away (or the handler failed): free the slot now
                loop_.cancel(stream)

    async def until_disconnected(http: HTTPRequest) -> None:
        while True:
            message = await http.receive()
            if message["type"] == "http.disconnect":
                return

    async def respond(kind: str, body, prepared: list, http: HTTPRequest, echo: list[str] | None = None):
        """Answer one choice per prepared request (completions: a prompt each), in order; ``echo``:
        the prompts' texts, sent before each choice's completion."""
        for p in prepared:
            if body.max_completion_tokens is None and body.max_tokens is None:  # vLLM's default: the rest of the context
                p.request.max_new_tokens = max(1, max_model_len - len(p.input_ids))
        rid, created = new_id("chatcmpl" if kind == "chat" else "cmpl"), now()
        stops = body.stops()
        if body.stream:
            return StreamingResponse(sse(kind, body, prepared, stops, rid, created, echo),
                                     media_type="text/event-stream")
        runs = [(i, p, stream) for i, p in enumerate(prepared) for stream in submit(p)]  # a choice each
        collect = asyncio.ensure_future(asyncio.gather(*(_collect(generate(p, stops, s)) for _, p, s in runs)))
        gone = asyncio.ensure_future(until_disconnected(http))
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if collect not in done:  # the client left: cancelling the collectors cancels the sequences
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await collect
            return PlainTextResponse("", status_code=499)
        gone.cancel()
        answers = collect.result()
        for answer in answers:
            reason, tokens = answer.end
            if reason == "abort":  # cut by the drain timeout (a client that left gets no answer)
                raise ShuttingDown(f"the server is shutting down; the request was cut after drain_timeout_s="
                                   f"{drain_timeout_s:g} with {len(tokens)} tokens generated")
        n_prompt = sum(len(p.input_ids) for p in prepared)  # once per prompt, however many samples
        n_out = sum(len(a.end[1]) for a in answers)
        usage = Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)
        wants = body.top_logprob_count() is not None
        if kind == "chat":
            return ChatCompletion(id=rid, created=created, model=body.model, usage=usage,
                                  prompt_logprobs=vllm_prompt_logprobs(answers[0].prompt, token_text), choices=[
                ChatChoice(index=j, message=ChatMessageOut(content=a.text), finish_reason=a.end[0],
                           logprobs=chat_logprobs(a.entries, token_text) if wants else None,
                           token_ids=a.end[1] if body.return_token_ids else None) for j, a in enumerate(answers)])
        choices = []
        for j, (a, (i, p, _)) in enumerate(zip(answers, runs)):
            head = echo[i] if echo else ""
            items = [(e["token_id"], e) for e in a.entries]
            if echo and wants:  # the prompt's tokens first, the first without a log-probability
                items = _prompt_items(p, a.prompt) + items
            choices.append(CompletionChoice(
                index=j, text=head + a.text, finish_reason=a.end[0],
                logprobs=completion_logprobs(items, token_text) if wants else None,
                prompt_logprobs=vllm_prompt_logprobs(a.prompt, token_text),
                token_ids=a.end[1] if body.return_token_ids else None))
        return Completion(id=rid, created=created, model=body.model, usage=usage, choices=choices)

    async def sse(kind, body, prepared, stops, rid, created, echo) -> AsyncIterator[str]:
        def event(obj) -> str:
            return f"data: {obj.model_dump_json()}\n\n"

        wants = body.top_logprob_count() is not None
        runs = [(i, p, stream) for i, p in enumerate(prepared) for stream in submit(p)]  # a choice each
        sent = [0] * len(runs)  # characters streamed so far per choice (the completions' text_offset)

        def chunk(i: int, delta: str | None, reason: str | None, first: bool = False, ids: list[int] | None = None,
                  items: list | None = None, prompt: list | None = None):
            if kind == "chat":
                lp = chat_logprobs([e for _, e in items], token_text) if items else None
                return ChatCompletionChunk(id=rid, created=created, model=body.model, choices=[ChunkChoice(
                    index=i, delta=Delta(role="assistant" if first else None, content=delta), finish_reason=reason,
                    logprobs=lp, token_ids=ids)], prompt_logprobs=vllm_prompt_logprobs(prompt, token_text))
            lp = completion_logprobs(items, token_text, sent[i]) if items else None
            return Completion(id=rid, created=created, model=body.model, choices=[CompletionChoice(
                index=i, text=delta or "", finish_reason=reason, logprobs=lp, token_ids=ids,
                prompt_logprobs=vllm_prompt_logprobs(prompt, token_text))])

        per_token = body.return_token_ids or wants
        queue: asyncio.Queue = asyncio.Queue()

        async def feed(j: int, p, stream) -> None:
            try:
                async for piece in generate(p, stops, stream):
                    await queue.put((j, piece))
            except MmzooError as e:
                await queue.put((j, e))
            await queue.put((j, None))

        tasks = [asyncio.ensure_future(feed(j, p, stream)) for j, (_, p, stream) in enumerate(runs)]
        usage, left, error = [sum(len(p.input_ids) for p in prepared), 0], len(runs), None
        try:
            if kind == "chat":
                for j in range(len(runs)):
                    yield event(chunk(j, "", None, first=True))
            elif echo:  # each prompt's text first (its log-probabilities come with its scoring)
                for j, (i, p, _) in enumerate(runs):
                    if not wants:  # with logprobs, the prompt is sent with its scores (below)
                        yield event(chunk(j, echo[i], None))
                        sent[j] += len(echo[i])
            while left:
                i, piece = await queue.get()
                if piece is None:
                    left -= 1
                    continue
                if isinstance(piece, MmzooError):
                    error = piece
                    continue
                if piece.scored:
                    if echo and wants:  # the echoed prompt with its log-probabilities
                        prompt_index, p, _ = runs[i]
                        yield event(chunk(i, echo[prompt_index], None, items=_prompt_items(p, piece.prompt),
                                          prompt=piece.prompt))
                        sent[i] += len(echo[prompt_index])
                    elif piece.prompt is not None:
                        yield event(chunk(i, "", None, prompt=piece.prompt))
                    continue
                if piece.end is None:
                    if per_token and piece.token is not None:  # a chunk per token, with its id and logprobs
                        items = [(piece.token, piece.logprob)] if wants and piece.logprob is not None else None
                        yield event(chunk(i, piece.text, None, ids=[piece.token] if body.return_token_ids else None,
                                          items=items))
                    elif piece.text:
                        yield event(chunk(i, piece.text, None))
                    sent[i] += len(piece.text)
                    continue
                reason, tokens = piece.end
                usage[1] += len(tokens)
                yield event(chunk(i, None if kind == "chat" else "", reason))
            if error is not None:
                raise error
            if body.include_usage:
                total = Usage(prompt_tokens=usage[0], completion_tokens=usage[1], total_tokens=sum(usage))
                cls = ChatCompletionChunk if kind == "chat" else Completion
                yield f"data: {cls(id=rid, created=created, model=body.model, choices=[], usage=total).model_dump_json()}\n\n"
        except MmzooError as e:
            yield f"data: {json.dumps(_error_body(str(e), None, 503 if isinstance(e, ShuttingDown) else 400))}\n\n"
        finally:
            for task in tasks:
                task.cancel()
        yield "data: [DONE]\n\n"

    def check_open() -> None:
        if loop_.draining:
            raise ShuttingDown("the server is shutting down; it takes no new requests")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        check_open()
        check_model(body.model)
        body.refuse_unsupported()
        body.stops()
        fields, names = chat_request(body, media, engine.family)
        prepared = await run_in_threadpool(prepare, fields, {**names, **body.structured()[1]})
        return await respond("chat", body, [prepared], http)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        check_open()
        check_model(body.model)
        body.refuse_unsupported()
        body.stops()
        prompts = body.prompts()
        prepared, texts, shared = [], [], None  # shared: the request fields every prompt takes, read once
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                if not prompt:
                    raise BadRequest(f"{param} is empty", param)
                ids = await run_in_threadpool(engine.tokenize, prompt)
            else:
                ids = prompt
            shared = shared or (body.request_fields(), body.structured()[1])
            fields, names = shared
            try:
                prepared.append(await run_in_threadpool(prepare, {"prompt_token_ids": list(ids), **fields}, names))
            except MmzooError as e:
                raise BadRequest(f"{param}: {e}" if len(prompts) > 1 else str(e), param) from None
            texts.append(prompt if isinstance(prompt, str) else engine.decode(list(ids)))
        return await respond("completion", body, prepared, http, echo=texts if body.echo else None)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=served_model_name, created=now(), max_model_len=max_model_len)])

    @app.get("/health")
    async def health():
        if loop_.error is not None or (start_loop and not loop_.alive):
            return JSONResponse({"status": "error", "error": repr(loop_.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        s = loop_.stats
        lines = []
        for name, kind, help_, value in (
                ("mmzoo_requests_running", "gauge", "Requests holding a KV-cache slot.", s.running),
                ("mmzoo_requests_waiting", "gauge", "Requests queued for a slot.", s.waiting),
                ("mmzoo_requests_running_max", "gauge", "The most requests decoded together so far.", s.running_max),
                ("mmzoo_requests_finished_total", "counter", "Requests finished, failed or cancelled.",
                 s.requests_finished),
                ("mmzoo_prompt_tokens_total", "counter", "Prompt tokens admitted.", s.prompt_tokens),
                ("mmzoo_generation_tokens_total", "counter", "Tokens generated.", s.generation_tokens),
                ("mmzoo_generation_tokens_per_second", "gauge", "Tokens generated per second, last 10 s.",
                 round(s.tokens_per_s(), 3)),
                ("mmzoo_graphs_compiled_after_warmup", "gauge", "Graphs compiled since warmup (0 expected).",
                 loop_.graphs_after_warmup())):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


@dataclass
class Piece:
    """One item of a request's output as the server reads it: text (possibly empty), the token it
    came with and that token's logprobs entry; ``prompt``: the prompt's log-probabilities;
    ``end``: ``(finish_reason, generated token ids)``."""

    text: str = ""
    token: int | None = None
    logprob: dict | None = None
    end: tuple | None = None
    scored: bool = False  # the piece that carries the prompt's log-probabilities (first, when asked)
    prompt: list | None = None


@dataclass
class Answer:
    """A whole choice: :func:`_collect` of a request's pieces."""

    text: str
    end: tuple
    entries: list[dict]
    prompt: list | None


async def _collect(gen) -> Answer:
    parts, end, entries, prompt = [], None, [], None
    async for piece in gen:
        parts.append(piece.text)
        if piece.logprob is not None:
            entries.append(piece.logprob)
        if piece.prompt is not None:
            prompt = piece.prompt
        if piece.end is not None:
            end = piece.end
    return Answer("".join(parts), end, entries, prompt)


def _prompt_items(prepared, prompt: list | None) -> list:
    """``(token id, logprobs entry or None)`` per prompt token (the first has none)."""
    ids = [int(t) for t in prepared.input_ids]
    return [(t, prompt[j] if prompt else None) for j, t in enumerate(ids)]


# ---------------------------------------------------------------------------------------- CLI

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it), for a server started next."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# how long after the drain timeout the cut requests have to send their answers before uvicorn closes
# their connections
DRAIN_GRACE_S = 5


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's graceful stop on SIGINT / SIGTERM (stop accepting, finish what is in flight),
        without re-raising the signal after it: a server that drained cleanly exits 0. The engine
        loop drains too (``on_drain``): past its timeout it ends the requests still running with
        ``finish_reason="abort"``, so each gets its answer before uvicorn's own, later, timeout
        (``timeout_graceful_shutdown``) would cut its connection."""

        def __init__(self, config, on_drain=None):
            super().__init__(config)
            self.on_drain = on_drain

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        def _on_signal(self, signum, frame) -> None:
            if self.should_exit:
                self.force_exit = True
                return
            print(f"mmzoo: {signal.Signals(signum).name}: not accepting new connections; finishing the requests in "
                  f"flight (at most {self.drain_timeout_s:g} s; again: exit now)", file=sys.stderr, flush=True)
            self.should_exit = True
            if self.on_drain is not None:
                self.on_drain()

        @property
        def drain_timeout_s(self) -> float:
            return max(0.0, (self.config.timeout_graceful_shutdown or 0) - DRAIN_GRACE_S)

    return Server


def run(cfg: DictConfig) -> None:
    """Build and warm up the engine from ``cfg``, then serve until SIGINT / SIGTERM."""
    import uvicorn

    from mmzoo.engine import build

    if cfg.media_dir is not None and not Path(cfg.media_dir).is_dir():
        raise MmzooError(f"media_dir={cfg.media_dir} is not a directory")
    t0 = time.perf_counter()
    engine = build(cfg, verbose=True)
    name = cfg.served_model_name or Path(str(engine.checkpoint)).name
    drain_s = float(cfg.drain_timeout_s)
    if drain_s < 0:
        raise MmzooError(f"drain_timeout_s={cfg.drain_timeout_s} must be 0 or more (seconds)")
    app = create_app(engine, served_model_name=name, media_dir=cfg.media_dir, drain_timeout_s=drain_s)
    config = uvicorn.Config(app, host=str(cfg.host), port=int(cfg.port), log_level=str(cfg.log_level),
                            timeout_graceful_shutdown=int(drain_s + 0.999) + DRAIN_GRACE_S,
                            access_log=bool(cfg.access_log))
    server = _server_class()(config, on_drain=app.state.engine_loop.drain)
    print(f"mmzoo: serving {name!r} on http://{cfg.host}:{cfg.port}/v1 (ready {time.perf_counter() - t0:.1f} s "
          f"after start; media_dir={cfg.media_dir})", file=sys.stderr, flush=True)
    server.run()
    print("mmzoo: stopped", file=sys.stderr, flush=True)


main = hydra_main(run, "serve")
