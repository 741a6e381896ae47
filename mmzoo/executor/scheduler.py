"""Continuous batching: which sequences hold a KV-cache slot, which need a token next step, when one is done.

Host-only bookkeeping (no tensors): requests wait in arrival order; a free slot takes the next
waiting one (its prefill runs); every running sequence that still needs a token takes part in
the next decode step; a sequence that finishes frees its slot at once for the next waiting
request, so a batch never waits to drain. Requests may be added at any time (a server adds them
as they arrive).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from mmzoo.types import Prepared, Result


@dataclass
class Sequence:
    """One request while it runs: its slot, how much of it is in the cache, its sampling generator."""

    prepared: Prepared
    result: Result
    index: int  # its position among the requests handed to the executor
    rng: np.random.Generator
    slot: int = -1
    length: int = 0  # tokens in the cache
    last: int = 0  # the newest token, not yet in the cache
    t_added: float = 0.0  # when it was queued, in seconds after the run's start
    scored: bool = False  # its prompt_logprobs are computed (or it needs none)
    text: object = None  # its mmzoo.text.TextStream when its request has stop strings
    sample: int = 0  # which of its request's n samples
    group: list | None = None  # with n > 1: every sample's Sequence, the first (which waits in the queue) first
    guide: object = None  # its mmzoo.structured.Guide when its request has structured_outputs

    @property
    def request(self):
        return self.prepared.request

    @property
    def members(self) -> list["Sequence"]:
        """Its request's samples: ``group``, or itself alone."""
        return self.group or [self]


@dataclass
class Drain:
    """A request to stop a generation run early (Ctrl-C, SIGTERM, a server shutting down): once
    :meth:`set`, no waiting request is admitted and the running ones may finish within ``timeout_s``;
    past that they are abandoned too. Setting it is safe from a signal handler or another thread."""

    timeout_s: float = 60.0
    since: float | None = None

    def set(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    @property
    def draining(self) -> bool:
        return self.since is not None

    @property
    def expired(self) -> bool:
        return self.since is not None and time.monotonic() - self.since > self.timeout_s


@dataclass
class Scheduler:
    """Slots and queues of one generation run.

    Args:
        num_slots: KV-cache slots (the decode batch).
        max_model_len: cache positions per slot.
        eos: end-of-sequence token ids.
    """

    num_slots: int
    max_model_len: int
    eos: set[int]
    waiting: deque = field(default_factory=deque)
    running: dict[int, Sequence] = field(default_factory=dict)  # slot -> sequence
    t0: float = field(default_factory=time.perf_counter)

    def add(self, seq: Sequence) -> None:
        seq.t_added = time.perf_counter() - self.t0
        self.waiting.append(seq)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def admit(self) -> Iterator[Sequence]:
        """The waiting sequences that get free slots now (in order, the lowest slots first), each
        already placed; a request of n samples is admitted when n slots are free, its samples all
        placed and its first yielded. One that fails its prefill is removed with :meth:`drop`."""
        free = [slot for slot in range(self.num_slots) if slot not in self.running]
        while self.waiting:
            seq = self.waiting[0]
            members = seq.members
            if len(members) > len(free):
                return
            self.waiting.popleft()
            for m in members:
                m.slot, m.length = free.pop(0), len(m.prepared.input_ids)
                self.running[m.slot] = m
            yield seq

    def drop(self, seq: Sequence) -> None:
        """Free ``seq``'s slot (it failed, or its client went away)."""
        if self.running.get(seq.slot) is seq:
            del self.running[seq.slot]

    def to_decode(self, in_flight: set[int]) -> dict[int, Sequence]:
        """The running sequences that need a token the device has not computed yet: ``in_flight``
        slots already have one step launched for them."""
        return {slot: seq for slot, seq in self.running.items() if seq.length < self.max_model_len and
                len(seq.result.token_ids) + (slot in in_flight) < seq.request.max_new_tokens}

    def emit(self, seq: Sequence, token: int, cached: int, decode_text: Callable[[list[int]], str]) -> bool:
        """Hand out ``token`` (computed with ``cached`` tokens of ``seq`` in the cache); True when it
        finished the sequence (its slot is free from now on)."""
        req, res = seq.request, seq.result
        res.token_ids.append(token)
        res.token_times_s.append(time.perf_counter() - self.t0 - seq.t_added)
        seq.last = token
        reason = ("stop" if (token in self.eos and not req.ignore_eos) or token in req.stop_token_ids else
                  "length" if len(res.token_ids) >= req.max_new_tokens else
                  "max_model_len" if cached >= self.max_model_len else None)
        if reason is None:
            return False
        res.finish_reason = reason
        res.text = decode_text(res.token_ids)
        self.drop(seq)
        return True
