"""Warmup: every step of every bucket compiled before the first request (vLLM's TPU runner's dummy run).

:func:`plan` enumerates the graphs from the executor's buckets (no requests involved): each tower
at each input-row bucket, the precomputed-embeddings write at each row bucket, the prompt at each
prefill bucket and the decode step at each KV-length bucket, the last two with a greedy and a
sampling head. :func:`run` compiles them on all-padding typed inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mmzoo.executor.steps import DecodeInputs, PrefillInputs, Sampling
from mmzoo.types import TowerInput


@dataclass(frozen=True)
class Graph:
    """One compiled step: its kind (encode, embeds, prefill, decode), tower, bucket and head."""

    kind: str
    size: int
    tower: str | None = None
    greedy: bool = True

    def __str__(self) -> str:
        head = "" if self.kind in ("encode", "embeds") else "/greedy" if self.greedy else "/sample"
        return f"{self.kind}{' ' + self.tower if self.tower else ''} {self.size}{head}"


def plan(executor, towers: list[str]) -> list[Graph]:
    """Every graph a run with ``executor``'s buckets can use (towers: the model's, when warmup can
    build their dummy inputs)."""
    out = [Graph("encode", rows, tower) for tower in towers for rows in executor.tower_buckets(tower)]
    out += [Graph("embeds", rows) for rows in executor.default_encoder_buckets]
    out += [Graph("prefill", s, greedy=g) for s in executor.prefill_buckets for g in (True, False)]
    out += [Graph("decode", kv, greedy=g) for kv in executor.decode_kv_buckets for g in (True, False)]
    return out


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
            out = executor.prefill(PrefillInputs.zeros(g.size, axes), _sampling(1, g.greedy))
        else:
            out = executor.decode(DecodeInputs.zeros(executor.max_batch, g.size), _sampling(executor.max_batch, g.greedy))
        executor.step_done()
        if g.kind in ("prefill", "decode"):
            out.cpu()
