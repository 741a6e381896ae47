"""The generation loop: continuous batching over a runner's KV-cache slots.

Each :meth:`Generation.step` admits waiting requests into free slots (the
:class:`~mmzoo.executor.scheduler.Scheduler` decides who), packs the admitted prompts into prefill
steps within the token budget and the media buffer (:func:`prefill_groups`), encodes their media
and prefills them, then decodes one token for every running sequence. The runner
(:class:`~mmzoo.executor.base.Executor`) only runs steps; every size comes from its
:class:`~mmzoo.executor.buckets.Buckets`.

One decode step stays in flight: step N+1 is launched (its input tokens taken from step N's device
output) before step N's tokens are read back, so the host's per-step work overlaps the device's.
A request with ``structured_outputs`` keeps it so: once step N's tokens are read back and its
grammar has taken them, the token mask of step N+1 is written and a constrain step draws step
N+1's token again from its masked logits, before step N+2 reads it on the device.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import numpy as np

from mmzoo.errors import MmzooError
from mmzoo.executor.buckets import Buckets
from mmzoo.executor.scheduler import Drain, Scheduler, Sequence
from mmzoo.executor.steps import DecodeInputs, PrefillInputs, Sampling, StepOut
from mmzoo.structured import words
from mmzoo.text import TextStream
from mmzoo.types import Prepared, Result


def _wants_logprobs(seq: Sequence) -> bool:
    return seq.request.logprobs is not None


def _entry(token: int, logprob, ids, values, k: int) -> dict:
    """One token's entry of :attr:`mmzoo.Result.logprobs`: its log-probability and the ``k`` likeliest."""
    return {"token_id": token, "logprob": float(logprob),
            "top_logprobs": [[int(i), float(v)] for i, v in zip(ids[:k], values[:k])]}


def sampling_for(seqs: dict[int, Sequence], rows: int) -> Sampling:
    """Row ``i``'s sampling parameters from ``seqs[i]``'s request, with one uniform draw from its
    own seeded generator when it samples (so its tokens do not depend on its batch)."""
    s = Sampling.greedy_rows(rows)
    for row, seq in seqs.items():
        r = seq.request
        s.temperature[row], s.top_k[row], s.top_p[row] = r.temperature, r.top_k, r.top_p
        s.uniform[row] = seq.rng.random() if r.temperature > 0 else 0.0
    return s


def decode_inputs(buckets: Buckets, seqs: dict[int, Sequence], from_prev: set[int] = frozenset()) -> DecodeInputs:
    """The decode step of the sequences in ``seqs`` (slot -> sequence); the ``from_prev`` slots
    read their input token from the previous step's device output. The step runs the first
    :meth:`~Buckets.rows` slots, enough for the highest of ``seqs``."""
    inputs = DecodeInputs.zeros(buckets.rows(max(seqs) + 1), 1)  # unused slots: token 0 at position 0
    for slot, seq in seqs.items():
        use_prev = slot in from_prev
        inputs.use_prev[slot], inputs.token[slot] = use_prev, 0 if use_prev else seq.last
        inputs.write[slot], inputs.rope[slot] = seq.length, seq.length + seq.prepared.position_delta
    inputs.kv_len = buckets.decode_kv_len(max(seq.length for seq in seqs.values()) + 1)
    return inputs


def prefill_groups(executor, prepared: list[Prepared]) -> list[list[int]]:
    """Split prompts (each passing :meth:`~mmzoo.executor.base.Executor.check_prompt`) into
    consecutive groups that one packed prefill step takes: at most ``max_batch``, their tokens
    within the prefill budget and their media within the media buffer. A prompt over a budget
    alone is a group of its own."""
    groups: list[list[int]] = []
    tokens = rows = 0
    buckets = executor.buckets
    budget, room = buckets.prefill_budget, buckets.media_rows
    for i, p in enumerate(prepared):
        try:
            n, m = len(p.input_ids), sum(executor.media_rows(item) for item in p.media)
        except MmzooError:  # media no bucket holds: the prompt fails alone, at its encode
            n, m = len(p.input_ids), 0
        if groups and len(groups[-1]) < buckets.max_batch and tokens + n <= budget and rows + m <= room:
            groups[-1].append(i)
            tokens, rows = tokens + n, rows + m
        else:
            groups.append([i])
            tokens, rows = n, m
    return groups


class Generation:
    """One continuous-batching run on an executor: requests join whenever they come (a server adds
    them as they arrive), each :meth:`step` admits waiting ones into free KV-cache slots (their
    prefill) and decodes one token for every running one, and a finished or cancelled sequence
    frees its slot at once for the next waiting request.

    One decode step stays in flight: step N+1 is launched (its input tokens taken from step N's
    device output) before step N's tokens are read back. A sequence that stops at step N has had
    step N+1 computed for it too; that token is dropped (the next prompt in its slot writes over
    its key and value, or attention hides them).

    Not thread-safe: one thread drives it (:meth:`add`, :meth:`cancel`, :meth:`step`).

    Args:
        executor: a set-up executor.
        decode_text: token ids -> text, for a finished result.
        on_done: called with each sequence when it finishes, fails or is cancelled.
        on_token: called with a sequence and each new token as it is read back.
    """

    def __init__(self, executor, *, decode_text: Callable[[list[int]], str],
                 on_done: Callable[[Sequence], None] | None = None,
                 on_token: Callable[[Sequence, int], None] | None = None):
        if executor.model is None:
            raise RuntimeError("call setup(model) before generating")
        self.exe, self.decode_text, self.on_done, self.on_token = executor, decode_text, on_done, on_token
        self.buckets: Buckets = executor.buckets
        self.sched = Scheduler(executor.max_batch, executor.max_model_len, executor.eos)
        self.inflight = None  # (the step's StepOut on the device, [(slot, seq, tokens cached after the step)])
        self._added = 0

    @property
    def busy(self) -> bool:
        """Something is waiting, running or still on the device."""
        return not self.sched.done or self.inflight is not None

    def add(self, prepared: Prepared, *, index: int | None = None) -> Sequence:
        """Queue a request; it is admitted at a coming :meth:`step` (in arrival order). Returns its
        sequence (with ``n`` samples, the first; ``seq.group`` holds them all)."""
        req = prepared.request
        ids = [] if req.inputs_embeds is not None else [int(t) for t in prepared.input_ids]
        members = []
        for i in range(req.n):  # sample i > 0 draws from (seed, i): its own stream, reproducible
            rng = np.random.default_rng(req.seed if i == 0 or req.seed is None else [req.seed, i])
            result = Result(id=req.id, prompt=req.prompt, prompt_token_ids=list(ids),
                            logprobs=[] if req.logprobs is not None else None)
            members.append(Sequence(prepared=prepared, result=result, index=self._added if index is None else index,
                                    rng=rng, text=TextStream(self.decode_text, req.stop) if req.stop else None,
                                    sample=i, guide=prepared.guide() if prepared.guide else None))
        self._added += 1
        self.sched.add(members[0])
        if req.n > 1:
            for m in members:
                m.group, m.t_added = members, members[0].t_added
        return members[0]

    def cancel(self, seq: Sequence, reason: str = "abort") -> None:
        """Stop ``seq`` now (a client went away, a stop string matched): its slot is free for the
        next waiting request, its result ends with ``finish_reason=reason``."""
        if seq.result.finish_reason or seq.result.error:  # over already
            return
        leader = seq.group[0] if seq.group else seq
        if leader in self.sched.waiting:  # not admitted yet: every sample of the request ends
            self.sched.waiting.remove(leader)
            for m in seq.members:
                if m is not seq:
                    self.cancel(m, reason)
        self.sched.drop(seq)
        seq.result.finish_reason = reason
        seq.result.text = self.decode_text(seq.result.token_ids)
        self._done(seq)

    def drain(self) -> None:
        """Admit nothing more: the waiting sequences leave the queue (not finished); the running
        ones go on."""
        self.sched.waiting.clear()

    def step(self) -> None:
        """Score the prompts that ask for it, admit what fits (prefill, first token), then one decode
        step for every running sequence."""
        exe, sched = self.exe, self.sched
        self._score()
        admitted = []
        for seq in sched.admit():
            try:
                exe.check_prompt(seq.prepared)
                admitted.append(seq)
            except MmzooError as e:
                self._fail(seq, e)
        for group in prefill_groups(exe, [seq.prepared for seq in admitted]):
            self._prefill([admitted[i] for i in group])
        inflight = self.inflight
        flying = {slot: seq for slot, seq, _ in inflight[1]} if inflight else {}
        ahead = {slot for slot, seq in sched.running.items() if flying.get(slot) is seq}  # a token in flight
        go = sched.to_decode(ahead)
        launched = None
        if go:
            inputs = decode_inputs(self.buckets, go, ahead & set(go))
            sampling = sampling_for(go, len(inputs.token))
            out = exe.decode(inputs, sampling, prev=inflight[0].tokens if inflight else None)
            for seq in go.values():
                seq.length += 1
            launched = (out, [(slot, seq, seq.length) for slot, seq in go.items()])
        if inflight:
            out, ran = inflight
            tokens = out.tokens.cpu().numpy()
            wanted = any(_wants_logprobs(seq) and sched.running.get(slot) is seq for slot, seq, _ in ran)
            logprobs = exe.logprobs(out) if wanted else None
            for slot, seq, cached in ran:
                if sched.running.get(slot) is seq:
                    self._emit(seq, int(tokens[slot]), cached, logprobs, slot)
        if launched and any(seq.guide is not None for seq in go.values()):  # their grammars took step N's tokens
            running = {slot: seq for slot, seq in go.items() if sched.running.get(slot) is seq}
            launched = (self._constrain(launched[0], running, sampling), launched[1])
        self.inflight = launched
        if not self.busy:
            self.exe.idle()

    def settle(self) -> None:
        """Wait for a launched step whose tokens nobody will read (a run stopped early)."""
        if self.inflight is not None:
            self.inflight[0].tokens.cpu()
            self.inflight = None

    # -- inside a step ---------------------------------------------------------------------------
    def _score(self) -> None:
        """The waiting prompts' ``prompt_logprobs`` (a scoring step each, no KV-cache slot); a
        request for no new tokens finishes here."""
        for seq in [seq for seq in self.sched.waiting if not seq.scored]:
            seq.scored = True
            req, p = seq.request, seq.prepared
            if req.prompt_logprobs is not None:
                try:
                    self.exe.check_prompt(p)
                    picked, ids, values = self.exe.score(p)
                except MmzooError as e:
                    self.sched.waiting.remove(seq)
                    self._fail(seq, e)
                    continue
                scores = [None] + [_entry(int(t), picked[i], ids[i], values[i], req.prompt_logprobs)
                                   for i, t in enumerate(p.input_ids[1:])]
                for m in seq.members:
                    m.result.prompt_logprobs = scores
            if req.max_new_tokens == 0:
                self.sched.waiting.remove(seq)
                for m in seq.members:
                    m.result.finish_reason = "length"
                    self._done(m)

    def _pack(self, seqs: list[Sequence]) -> tuple[PrefillInputs | None, dict[int, MmzooError]]:
        """``seqs`` (one :func:`prefill_groups` group) packed into their prefill bucket, their media
        encoded one after another into the media buffer. A prompt whose media fail is left out,
        with its error under its index; None when none is left."""
        packed, failed, offset = [], {}, 0
        for i, seq in enumerate(seqs):
            p = seq.prepared
            try:
                index, written = self.exe.encode_prompt(p, offset)
            except MmzooError as e:
                failed[i] = e
                continue
            offset += written
            packed.append((p.input_ids, p.positions, index, seq.slot))
        if not packed:
            return None, failed
        s = self.buckets.prefill_len(sum(len(ids) for ids, *_ in packed))
        inputs = PrefillInputs.pack(s, self.exe.max_batch, self.exe.max_model_len, packed)
        inputs.window = self.buckets.prefill_window(s, max(len(ids) for ids, *_ in packed))
        # a request's n samples take n head rows at its prompt's last position (its first tokens)
        kept = [seq for i, seq in enumerate(seqs) if i not in failed]
        members = [m for seq in kept for m in seq.members]
        if len(members) > len(kept):
            last = np.repeat(inputs.last[:len(kept)], [len(seq.members) for seq in kept])
            inputs.last[:] = last[0]
            inputs.last[:len(last)] = last
            inputs.slots[:] = members[0].slot
            inputs.slots[:len(members)] = [m.slot for m in members]
        return inputs, failed

    def _prefill(self, seqs: list[Sequence]) -> None:
        """One packed prefill step for ``seqs``; each gets its first token (or its error)."""
        try:
            inputs, failed = self._pack(seqs)
            for i, e in failed.items():
                self._fail(seqs[i], e)
            seqs = [seq for i, seq in enumerate(seqs) if i not in failed]
            if inputs is None:
                return
            members = [m for seq in seqs for m in seq.members]
            sampling = sampling_for(dict(enumerate(members)), self.buckets.head_rows(len(members)))
            out = self._constrain(self.exe.prefill(inputs, sampling), dict(enumerate(members)), sampling)
            copies = [(seq.slot, m.slot) for seq in seqs for m in seq.members[1:]]
            if copies:  # the prompt's keys and values into its other samples' slots
                self.exe.copy_slots(copies)
            tokens = out.tokens.cpu().numpy()
            logprobs = self.exe.logprobs(out) if any(_wants_logprobs(m) for m in members) else None
        except MmzooError as e:
            for seq in seqs:
                self._fail(seq, e)
            return
        now = time.perf_counter() - self.sched.t0
        for row, (seq, token) in enumerate(zip(members, tokens)):
            seq.result.ttft_s = now - seq.t_added
            self._emit(seq, int(token), seq.length, logprobs, row)

    def _constrain(self, out: StepOut, seqs: dict[int, Sequence], sampling: Sampling) -> StepOut:
        """``out`` with the tokens of the rows whose sequence follows a grammar (``seqs``: row ->
        sequence) drawn again from the logits their grammar's token mask allows
        (:meth:`~mmzoo.executor.base.Executor.constrain`); ``out`` itself when none does."""
        guided = {row: seq.guide for row, seq in seqs.items() if seq.guide is not None}
        if not guided:
            return out
        rows = out.logits.shape[0]
        bitmask = np.full((rows, words(self.exe.model.lm.vocab_size)), -1, np.int32)
        on = np.zeros(rows, np.int64)
        for row, guide in guided.items():
            guide.fill(bitmask[row])
            on[row] = 1
        return self.exe.constrain(out, bitmask, replace(sampling, constrained=on))

    def _emit(self, seq: Sequence, token: int, cached: int, logprobs=None, row: int = 0) -> None:
        """Hand ``token`` to ``seq`` (with its log-probabilities from row ``row`` of ``logprobs``,
        :meth:`~mmzoo.executor.base.Executor.logprobs`, when its request asks for them)."""
        if logprobs is not None and _wants_logprobs(seq):
            picked, ids, values = logprobs
            seq.result.logprobs.append(_entry(token, picked[row], ids[row], values[row], seq.request.logprobs))
        stopped = False
        if seq.guide is not None:  # its grammar takes the token
            if seq.guide.stopped:  # complete already: its mask allowed only EOS, which ends the sequence
                stopped = True
            else:
                try:
                    seq.guide.accept(token)
                except MmzooError as e:
                    self.sched.drop(seq)
                    seq.result.error = str(e)
                    self._done(seq)
                    return
        if seq.text is not None:  # stop strings: the server's held-back matching (mmzoo.text)
            seq.text.push(token)
            stopped = stopped or seq.text.stopped
        finished = self.sched.emit(seq, token, cached, self.decode_text)
        if stopped:
            if not finished:
                self.sched.drop(seq)
            held = seq.text is not None and seq.text.stopped  # the text ends before the stop string
            seq.result.text = seq.text.text if held else self.decode_text(seq.result.token_ids)
            seq.result.finish_reason, finished = "stop", True
        if self.on_token:
            self.on_token(seq, token)
        if finished:
            self._done(seq)

    def _fail(self, seq: Sequence, error: MmzooError) -> None:
        for m in seq.members:  # a request's samples fail together (its prompt did)
            self.sched.drop(m)
            m.result.error = str(error)
            self._done(m)

    def _done(self, seq: Sequence) -> None:
        r = seq.result
        r.latency_s = time.perf_counter() - self.sched.t0 - seq.t_added
        r.graphs_compiled_after_warmup = self.exe.graphs_since_warmup()
        if self.on_done:
            self.on_done(seq)


def generate(executor, prepared: list[Prepared], *, decode_text: Callable[[list[int]], str],
             on_result: Callable[[Result], None] | None = None, drain: Drain | None = None) -> list[Result]:
    """Generate for every request on ``executor``, ``max_batch`` at a time, refilling slots as
    sequences finish.

    Results come back in request order; ``on_result`` is called as each one finishes. A request
    that cannot run (too long, bad parameters) gets a result with ``error`` and the rest go on.
    Once ``drain`` is set nothing more is admitted; the requests that did not finish come back
    with ``finish_reason="abort"`` (not passed to ``on_result``).
    """
    results: list[Result | None] = [None] * len(prepared)
    bar = None
    if executor.progress:
        from mmzoo.executor.progress import Progress

        bar = Progress(len(prepared))

    samples: dict[int, dict[int, Result]] = {}

    def done(seq: Sequence) -> None:
        result = seq.result
        if seq.group is not None:  # a request's n samples: one Result when the last is done
            parts = samples.setdefault(seq.index, {})
            parts[seq.sample] = result
            if len(parts) < len(seq.group):
                return
            ordered = [parts[i] for i in range(len(seq.group))]
            result = replace(ordered[0], samples=ordered)
        results[seq.index] = result
        if bar:
            bar.update(result)
        if on_result:
            on_result(result)

    run = Generation(executor, decode_text=decode_text, on_done=done)
    for i, p in enumerate(prepared):
        run.add(p, index=i)
    while run.busy:
        if drain is not None and drain.draining:
            run.drain()
            if drain.expired or not run.sched.running:
                break
        run.step()
    run.settle()
    if bar:
        bar.close()
    for i, r in enumerate(results):
        if r is None:
            p = prepared[i]
            results[i] = Result(id=p.request.id, prompt=p.request.prompt, finish_reason="abort",
                                error="stopped before it finished")
    return results
