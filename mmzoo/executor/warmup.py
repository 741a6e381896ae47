"""Warmup: the steps compiled before the requests run (vLLM's TPU runner's dummy run).

Two plans. :func:`plan` enumerates every graph of the executor's buckets (``warmup=all``: a
server, the benchmark, where requests come later): each tower at each input-row bucket, the
precomputed-embeddings write at each row bucket, the prompts' layers at each prefill bucket (and
a bucket's windowed graph, where it has one), the prefill's head at each row bucket and the
decode step at each KV-length and row bucket, the last two with a greedy and a sampling head, and the
logprobs step at each row bucket (with ``max_logprobs``), the constrain step of each head and
decode graph's rows and head (with ``structured_outputs``) and the scoring step at each prefill
bucket (with ``score_prompts``). :func:`needed` takes
prepared requests and returns only the graphs they can hit (``warmup=needed``: a one-shot CLI run
or a requests file, known up front). :func:`run` compiles a plan on all-padding typed inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from mmzoo.executor.steps import DecodeInputs, PrefillInputs, Sampling, StepOut
from mmzoo.structured import words
from mmzoo.types import Prepared, TowerInput


@dataclass(frozen=True)
class Graph:
    """One compiled step: its kind (encode, embeds, prefill, head, decode, logprobs, constrain, score,
    copy), tower, bucket, head (greedy or sampling: a prefill's head step, decode and constrain), a
    prefill's attention window (:attr:`PrefillInputs.window`) and the rows of a head, decode,
    logprobs or constrain step."""

    kind: str
    size: int
    tower: str | None = None
    greedy: bool = True
    window: int | None = None
    rows: int | None = None

    def __str__(self) -> str:
        if self.kind in ("logprobs", "constrain"):
            head = "" if self.kind == "logprobs" else "/greedy" if self.greedy else "/sample"
            return f"{self.kind} b{self.rows}/{self.size}{head}"
        head = "" if self.kind in ("encode", "embeds", "prefill", "score", "copy") else "/greedy" if self.greedy else "/sample"
        window = f" w{self.window}" if self.window else ""
        if self.kind == "decode":
            return f"decode b{self.rows}/kv{self.size}{head}"
        if self.kind == "head":
            return f"head b{self.rows}{head}"
        return f"{self.kind}{' ' + self.tower if self.tower else ''} {self.size}{window}{head}"


def plan(executor, towers: list[str]) -> list[Graph]:
    """Every graph a run with ``executor``'s buckets can use (towers: the model's, when warmup can
    build their dummy inputs)."""
    b = executor.buckets
    out = [Graph("encode", rows, tower) for tower in towers for rows in b.tower(tower)]
    out += [Graph("embeds", rows) for rows in b.tower("embeds")]
    out += [Graph("prefill", s, window=w) for s in b.prefill for w in dict.fromkeys([None, b.window_of(s)])]
    out += [Graph("head", r, greedy=g, rows=r) for r in b.decode_rows for g in (True, False)]
    out += [Graph("decode", kv, greedy=g, rows=r) for r in b.decode_rows for kv in b.decode_kv for g in (True, False)]
    if executor.max_logprobs:
        out += sorted(set(_logprobs(executor, b.decode_rows, b.decode_rows)), key=lambda g: (g.rows, g.size))
    if executor.structured_outputs:
        out += sorted(set(_constrain(executor, out)), key=lambda g: (g.rows, g.size, not g.greedy))
    if executor.score_prompts:
        out += [Graph("score", s) for s in b.prefill]
    if executor.max_batch > 1:  # a request's samples share its prompt's keys and values
        out.append(Graph("copy", executor.max_batch - 1))
    return out


def _logprobs(executor, head_rows, decode_rows) -> list[Graph]:
    """The logprobs graphs of heads of ``head_rows`` rows and decode steps of ``decode_rows`` rows
    (a decode step's tokens are one per slot)."""
    return ([Graph("logprobs", r, rows=r) for r in head_rows] +
            [Graph("logprobs", executor.max_batch, rows=r) for r in decode_rows])


def _constrain(executor, graphs) -> list[Graph]:
    """The constrain graphs of the head and decode steps among ``graphs``: the same rows and head
    (a decode step's tokens are one per slot)."""
    return [Graph("constrain", g.rows if g.kind == "head" else executor.max_batch, greedy=g.greedy, rows=g.rows)
            for g in graphs if g.kind in ("head", "decode")]


def needed(executor, prepared: list, *, generate: bool = True) -> list[Graph]:
    """The graphs a run of ``prepared`` can use, in :func:`plan`'s order: each media call's encode
    (or embeddings) bucket; with ``generate``, the prefill bucket of every run of prompts one step
    can pack, with its head's rows and its requests' head, and every decode KV bucket between the shortest prompt's
    first step and the longest sequence's last, with the heads the requests sample with (a batch
    is greedy only when all its rows are, so a run whose requests all sample compiles no greedy
    graph). A request whose shapes fit no bucket adds nothing: it fails alone when it runs."""
    from mmzoo.buckets import round_up
    from mmzoo.errors import MmzooError

    b = executor.buckets
    out: set[Graph] = set()
    lo, hi, heads, logprobs, copies, constrained = None, 0, set(), False, False, False
    prompts = []  # (tokens, greedy, samples) of each prompt that can run, in order
    for p in prepared:
        try:
            graphs = set()
            for item in p.media:
                if item.embeds is not None:
                    graphs.add(Graph("embeds", b.encoder_rows("embeds", item.embeds.shape[0])))
                else:
                    rows = b.encoder_rows(item.tower, round_up(item.rows, item.row_multiple))
                    graphs.add(Graph("encode", rows, item.tower))
            if generate:
                n, req = len(p.input_ids), p.request
                greedy = not req.temperature > 0
                executor.check_prompt(p)
                logprobs = logprobs or req.logprobs is not None
                copies = copies or req.n > 1
                constrained = constrained or req.structured_outputs is not None
                if req.prompt_logprobs is not None:
                    graphs.add(Graph("score", b.prefill_len(n)))
                if req.max_new_tokens == 0:  # scored only: no slot, no prefill
                    out |= graphs
                    continue
                if req.max_new_tokens > 1 and n + 1 < executor.max_model_len:
                    last = min(n + req.max_new_tokens, executor.max_model_len)
                    lo = n + 1 if lo is None else min(lo, n + 1)
                    hi = max(hi, last)
                    heads.add(greedy)
        except MmzooError:
            continue
        out |= graphs
        if generate:
            prompts.append((n, greedy, req.n))
    # the prompts admitted together are packed into one prefill step: admission takes waiting
    # requests in order, so a step holds a consecutive run of up to max_batch prompts (any run,
    # as slots free up) within the token budget
    budget = b.prefill_budget
    for i in range(len(prompts)):
        tokens, longest, greedy, any_greedy, k = 0, 0, True, False, 0
        for n, g, samples in prompts[i:i + executor.max_batch]:
            tokens, longest, greedy, any_greedy = tokens + n, max(longest, n), greedy and g, any_greedy or g
            k += samples  # head rows: a row per sample
            if tokens > budget or k > executor.max_batch:
                break
            s = b.prefill_len(tokens)
            out.add(Graph("prefill", s, window=b.prefill_window(s, longest)))
            # the head's rows hold the prompts that encoded their media; one failing leaves fewer
            # (and a run whose sampled prompts all failed is greedy, if it has a greedy one)
            rows = [r for r in b.decode_rows if r <= b.head_rows(k)]
            out |= {Graph("head", r, greedy=h, rows=r) for r in rows for h in {greedy, any_greedy}}
    if lo is not None:
        first, last = b.decode_kv_len(lo), b.decode_kv_len(hi)
        # the slots of the running sequences: the lowest free first, so below min(requests, max_batch),
        # and the highest running one anywhere below that as sequences finish
        slots = [r for r in b.decode_rows if r <= b.rows(min(sum(p[2] for p in prompts), executor.max_batch))]
        # a decode batch is some of the running sequences: greedy where a greedy request can be
        # among them alone, sampling where a sampling one can be among them
        for kv in (k for k in b.decode_kv if first <= k <= last):
            out |= {Graph("decode", kv, greedy=g, rows=r) for g in heads for r in slots}
    if copies:
        out.add(Graph("copy", executor.max_batch - 1))
    if logprobs:  # the rows of every head and decode step the run can take
        out |= set(_logprobs(executor, {g.rows for g in out if g.kind == "head"},
                             {g.rows for g in out if g.kind == "decode"}))
    if constrained:  # a batch's constrain step has its rows and head (a grammar's request may be greedy or not)
        out |= set(_constrain(executor, out))
    order = {"encode": 0, "embeds": 1, "prefill": 2, "head": 3, "decode": 4, "logprobs": 5, "constrain": 6,
             "score": 7, "copy": 8}
    return sorted(out, key=lambda g: (order[g.kind], g.tower or "", g.rows or 0, g.size, g.window or 0, not g.greedy))


def describe(graphs: list[Graph]) -> str:
    """``encode vision 256, prefill 128, head b1/greedy, decode b1/kv128/greedy``: a plan in one line."""
    return ", ".join(str(g) for g in graphs)


def _sampling(rows: int, greedy: bool) -> Sampling:
    s = Sampling.greedy_rows(rows)
    if not greedy:
        s.temperature[:] = 1.0
    return s


def run(executor, graphs: list[Graph], dummy_media: Callable[[str, int], TowerInput] | None, *,
        progress: bool = False) -> None:
    """Compile ``graphs`` by running each once on padding inputs (``dummy_media(tower, rows)``: a
    family's zero tower inputs of that many rows)."""
    steps = graphs
    if progress:
        from tqdm import tqdm

        steps = tqdm(graphs, desc="mmzoo warmup", unit="graph", leave=False, disable=None)
    axes = executor.model.lm.rotary.num_axes
    for g in steps:
        if g.kind == "encode":
            executor.encode(dummy_media(g.tower, g.size), 0)
        elif g.kind == "embeds":
            executor.encode(TowerInput(tower="embeds", inputs={}, num_embeds=g.size,
                                       embeds=torch.zeros(g.size, executor.model.lm.dim)), 0)
        elif g.kind == "prefill":
            inputs = PrefillInputs.zeros(g.size, axes, executor.max_batch, executor.max_model_len)
            inputs.window = g.window
            out = executor.prefill_hidden(inputs)
        elif g.kind == "head":
            hidden = executor._tensor(np.zeros((executor.max_batch, executor.model.lm.dim), np.float32),
                                      executor.dtype)
            out = executor.prefill_head(hidden, _sampling(g.rows, g.greedy))
        elif g.kind == "decode":
            out = executor.decode(DecodeInputs.zeros(g.rows, g.size), _sampling(g.rows, g.greedy))
        elif g.kind == "copy":
            executor.copy_slots([(0, 0)])
        elif g.kind == "constrain":
            vocab = executor.model.lm.vocab_size
            logits = executor._tensor(np.zeros((g.rows, vocab), np.float32))
            step = StepOut(executor._tensor(np.zeros(g.size, np.int64)), logits)
            out = executor.constrain(step, np.full((g.rows, words(vocab)), -1, np.int32), _sampling(g.rows, g.greedy))
        elif g.kind == "score":
            executor.score(Prepared(request=None, input_ids=np.zeros(g.size, np.int64),
                                    positions=np.zeros((axes, g.size), np.int64), position_delta=0,
                                    mm_index=np.full(g.size, -1, np.int64)))  # read back already
        else:
            tokens = executor._tensor(np.zeros(g.size, np.int64))
            logits = executor._tensor(np.zeros((g.rows, executor.model.lm.vocab_size), np.float32))
            executor.logprobs(StepOut(tokens, logits))  # read back already
        if g.kind == "prefill":
            out.cpu()
        elif g.kind in ("head", "decode", "constrain"):
            out.tokens.cpu()
        executor.warm.add(g)
