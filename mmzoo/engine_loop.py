"""The engine loop: the one thread that owns the device while a server or Python streams run.

HTTP handlers (and :meth:`mmzoo.Engine.stream`) never touch the executor. They prepare a request
on the host (validation, media decoding, tokenizing), then :meth:`EngineLoop.submit` it and read
its tokens from a :class:`Stream` (on an event loop) or a :class:`QueueStream` (in any thread).
The loop thread admits what arrived into the running
:class:`~mmzoo.executor.loop.Generation` before every step, so a request that arrives while
others decode joins the batch at the next step (continuous batching); a cancelled one (a client
gone, a stop string matched) frees its KV-cache slot at once.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mmzoo.executor.loop import Generation
from mmzoo.executor.scheduler import Sequence
from mmzoo.types import Prepared, Result


@dataclass
class Stream:
    """One request's side of the loop: ``(token id, its logprobs entry or None)`` as they come, then
    its :class:`Result` (``None`` in :attr:`events` marks the end). Filled from the loop thread,
    read on the event loop."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    result: Result | None = None
    seq: Sequence | None = None

    def _put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


@dataclass
class QueueStream:
    """A :class:`Stream` read from a thread: :meth:`get` blocks for the next item."""

    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    result: Result | None = None
    seq: Sequence | None = None

    def _put(self, item) -> None:
        self.events.put(item)

    def get(self) -> Any:
        return self.events.get()


@dataclass
class Stats:
    """What ``/metrics`` reports, kept by the loop thread."""

    running: int = 0
    running_max: int = 0  # the most sequences decoded together so far
    waiting: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=1 << 16))  # when each recent token came

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        """Generated tokens per second over the last ``window_s`` seconds."""
        now = time.monotonic()
        return sum(1 for t in list(self.recent) if now - t <= window_s) / window_s


class EngineLoop:
    """Runs an :class:`~mmzoo.engine.Engine`'s executor for a server: one thread, one
    :class:`Generation` over the engine's KV cache, fed through a queue.

    Args:
        engine: a built engine (warmed up); the loop holds its lock while it runs, so the
            engine's own ``generate`` waits until the loop stops.
        idle_exit: end the thread whenever nothing is queued or running (releasing the engine's
            lock); the next :meth:`submit` starts it again (``Engine.stream``'s loop).
    """

    def __init__(self, engine, *, drain_timeout_s: float = 30.0, idle_exit: bool = False):
        self.engine, self.drain_timeout_s, self.idle_exit = engine, drain_timeout_s, idle_exit
        self._start_lock = threading.Lock()  # a submit and the idle thread's exit decide under it
        self._exiting = False
        self.draining = False
        self.stats = Stats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmzoo-engine-loop", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is running (it was drained by the server already), then end the thread."""
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def graphs_after_warmup(self) -> int:
        return int(self.engine.executor.graphs_since_warmup() or 0)

    def submit(self, prepared: Prepared, stream):
        """Queue a prepared request; its tokens and result arrive on ``stream`` (returned), or, for
        ``n`` samples, on a list of ``n`` streams (a sample each)."""
        self.stats.waiting += 1
        with self._start_lock:
            self._inbox.put(("add", (prepared, stream)))
            if self.idle_exit and (self._exiting or not self._thread.is_alive()):
                self._exiting = False
                self._thread = threading.Thread(target=self._run, name="mmzoo-engine-loop", daemon=True)
                self._thread.start()
        return stream

    def cancel(self, stream: Stream, reason: str = "abort") -> None:
        """Stop a request now (safe from any thread); its slot frees at the loop's next turn."""
        self._inbox.put(("cancel", (stream, reason)))

    def drain(self) -> None:
        """The server is stopping (safe from any thread, e.g. a signal handler): take no new
        requests; ``drain_timeout_s`` from now, end every request still queued or running with
        ``finish_reason="abort"``."""
        if self.draining:
            return
        self.draining = True
        timer = threading.Timer(self.drain_timeout_s, lambda: self._inbox.put(("abort_all", None)))
        timer.daemon = True
        timer.start()

    # -- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        streams: dict[int, Stream] = {}  # id(seq) -> stream

        def on_token(seq: Sequence, token: int) -> None:
            self.stats.generation_tokens += 1
            self.stats.recent.append(time.monotonic())
            logprobs = seq.result.logprobs
            streams[id(seq)]._put((token, logprobs[-1] if logprobs else None))

        def on_done(seq: Sequence) -> None:
            stream = streams.pop(id(seq))
            stream.result = seq.result
            self.stats.requests_finished += 1
            stream._put(None)

        try:
            with engine._lock:
                gen = Generation(engine.executor, decode_text=engine.decode, on_done=on_done, on_token=on_token)
                while True:
                    if not self._take(gen, streams, block=not gen.busy):
                        break
                    if gen.busy:
                        gen.step()
                    self.stats.running = len(gen.sched.running)
                    self.stats.running_max = max(self.stats.running_max, self.stats.running)
                    self.stats.waiting = len(gen.sched.waiting) + self._inbox.qsize()
                gen.settle()
        except BaseException as e:  # noqa: BLE001 - reported by /health; every open stream is ended
            self.error = e
            for stream in streams.values():
                stream.result = Result(id=None, prompt="", error=f"the engine loop failed: {e!r}")
                stream._put(None)
            raise

    def _take(self, gen: Generation, streams: dict[int, Stream], *, block: bool) -> bool:
        """Apply what the handlers queued (block for the first when idle); False when stopping."""
        while True:
            if self._stop.is_set() and not gen.busy and self._inbox.empty():
                return False
            if self.idle_exit and block:
                with self._start_lock:
                    if self._inbox.empty():  # idle: end the thread (a later submit starts another)
                        self._exiting = True
                        return False
            try:
                kind, payload = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                return True
            if kind == "add":
                prepared, sinks = payload
                seq = gen.add(prepared)
                for member, stream in zip(seq.members, sinks if isinstance(sinks, list) else [sinks]):
                    stream.seq = member
                    streams[id(member)] = stream
                self.stats.prompt_tokens += len(prepared.input_ids)
            elif kind == "cancel":
                stream, reason = payload
                if stream.seq is not None:
                    gen.cancel(stream.seq, reason)
            elif kind == "abort_all":  # the drain timeout passed
                for stream in list(streams.values()):
                    gen.cancel(stream.seq, "abort")
            block = False
