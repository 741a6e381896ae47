"""The ``mmzoo-serve`` system: the workload sent to ``mmzoo.serve`` over loopback HTTP.

The engine is served in-process (uvicorn in a thread, the app of :func:`mmzoo.serve.create_app`);
the clients are ``openai.AsyncOpenAI`` streaming chat completions, at most ``concurrency`` at a
time, each sent when its arrival time comes (``request_rate`` requests per second, Poisson
arrivals as vLLM's ``bench serve`` draws them; null: all at once). Media go as ``data:`` URLs
(PNG images, WAV clips), encoded before the clock starts. TTFT is the first chunk carrying a
token, ITL the gaps between token chunks (``return_token_ids`` makes a chunk per token), the
outputs the token ids the chunks carry.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time

import numpy as np

from mmzoo.bench.runner import Run
from mmzoo.bench.workload import Family, say
from mmzoo.errors import MmzooError


def _data_url(item, fam: Family, rate: int) -> dict:
    """One media item as an OpenAI content part."""
    buf = io.BytesIO()
    if fam.media == "image":
        item.save(buf, format="PNG")
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                   base64.b64encode(buf.getvalue()).decode()}}
    import soundfile

    soundfile.write(buf, np.asarray(item, np.float32), rate, format="WAV", subtype="FLOAT")
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(),
                                                   "format": "wav"}}


def run_server(engine, reqs: list[dict], fam: Family, *, concurrency: int, request_rate: float | None,
               seed: int, sampling_rate: int) -> Run:
    """``reqs`` through an in-process ``mmzoo.serve`` on ``engine``; the engine is free again after."""
    import uvicorn

    from mmzoo.serve import create_app, free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, served_model_name="bench"), host="127.0.0.1",
                                           port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="mmzoo-bench-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise MmzooError("the benchmark's server did not start")
        time.sleep(0.02)
    bodies = [{"model": "bench", "temperature": 0, "max_tokens": int(r["max_new_tokens"]), "stream": True,
               "messages": [{"role": "user", "content": [_data_url(x, fam, sampling_rate) for x in r.get(fam.field, [])]
                             + [{"type": "text", "text": r["prompt"]}]}]} for r in reqs]
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / request_rate, len(reqs)) if request_rate else np.zeros(len(reqs))
    arrivals = np.cumsum(gaps) - gaps[0]
    say(f"mmzoo-serve: {len(reqs)} requests to http://127.0.0.1:{port}/v1, concurrency {concurrency}, "
        f"request rate {request_rate or 'inf'}")
    before = engine.executor.graphs_since_warmup()
    try:
        t0 = time.perf_counter()
        results = asyncio.run(_clients(f"http://127.0.0.1:{port}/v1", bodies, arrivals, concurrency, t0))
        duration = time.perf_counter() - t0
    finally:
        server.should_exit = True
        thread.join(60)
    after = engine.executor.graphs_since_warmup()
    return Run(system="mmzoo-serve", duration_s=duration, prompt_lens=[r["prompt_tokens"] for r in results],
               outputs=[r["tokens"] for r in results], ttft_s=[r["times"][0] - r["sent"] for r in results],
               latency_s=[r["times"][-1] - r["sent"] for r in results],
               token_times_s=[[t - r["sent"] for t in r["times"]] for r in results],
               graphs_after_warmup=None if before is None else after - before)


async def _clients(base_url: str, bodies: list[dict], arrivals, concurrency: int, t0: float) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=3600)
    gate = asyncio.Semaphore(concurrency)

    async def one(body: dict, at: float) -> dict:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        async with gate:
            sent = time.perf_counter() - t0
            out = {"sent": sent, "times": [], "tokens": [], "prompt_tokens": 0}
            stream = await client.chat.completions.create(
                **body, stream_options={"include_usage": True},
                extra_body={"return_token_ids": True, "ignore_eos": True})
            async for chunk in stream:
                now = time.perf_counter() - t0
                for choice in chunk.choices:
                    ids = (choice.model_extra or {}).get("token_ids")
                    if ids:
                        out["tokens"] += ids
                        out["times"] += [now] * len(ids)
                if chunk.usage is not None:
                    out["prompt_tokens"] = chunk.usage.prompt_tokens
            return out

    try:
        return await asyncio.gather(*(one(b, float(at)) for b, at in zip(bodies, arrivals)))
    finally:
        await client.close()
