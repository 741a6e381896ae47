"""The generation loop shared by the eager and XLA executors.

The executor owns everything the modules do not know about: device placement, dtype, padding
to static shapes, the KV cache in slots, the prefill/decode schedule (a finished sequence frees
its slot for the next request) and sampling. Inputs are prepared on the host with numpy and
moved once per step (vLLM's TPU runner does the same).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from mmzoo.errors import MmzooError
from mmzoo.executor._buckets import round_up
from mmzoo.executor._sampling import greedy
from mmzoo.lms import KVCache
from mmzoo.models._types import Prepared

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Result:
    """The outcome of one request."""

    id: Any
    prompt: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    error: str | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not (k == "error" and v is None)}


@dataclass
class _Seq:
    prepared: Prepared
    result: Result
    slot: int
    length: int  # tokens in the cache
    index: int  # position in the request list
    last: int = 0  # the newest token, not yet in the cache


class Executor:
    """Runs a :class:`~mmzoo.models.composition.MultimodalLM` on one device.

    Args:
        max_model_len: prompt plus generated tokens, the KV cache length per slot.
        max_batch: KV-cache slots, i.e. sequences decoded together.
    """

    name = "?"

    def __init__(self, *, max_model_len: int = 1024, max_batch: int = 4):
        if max_model_len <= 0 or max_batch <= 0:
            raise ValueError(f"max_model_len={max_model_len} and max_batch={max_batch} must be positive")
        self.max_model_len, self.max_batch = max_model_len, max_batch
        self.model = None

    # -- hooks the two executors fill in -------------------------------------------------
    def device(self) -> torch.device:
        raise NotImplementedError

    def prefill_len(self, n: int) -> int:
        """The padded prompt length for a prompt of ``n`` tokens."""
        return n

    def encoder_rows(self, tower: str, n: int) -> int:
        """The padded row count for ``n`` input rows of ``tower``."""
        return n

    def step_done(self) -> None:
        """Called after each prefill and decode step (XLA cuts and runs the graph here)."""

    # -- setup ---------------------------------------------------------------------------
    def setup(self, model, *, dtype: str = "float32", eos_token_ids=()) -> None:
        """Place ``model`` on the device in ``dtype`` and allocate the KV cache."""
        if dtype not in DTYPES:
            raise MmzooError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        self.dtype = DTYPES[dtype]
        dev = self.device()
        model = model.eval().to(dev)
        for p in model.parameters():  # parameters only: rotary frequency buffers stay float32
            p.data = p.data.to(self.dtype)
        self.model = model
        lm = model.lm
        self.cache = KVCache(num_layers=lm.num_layers, num_slots=self.max_batch, num_kv_heads=lm.num_kv_heads,
                             max_len=self.max_model_len, head_dim=lm.head_dim, dtype=self.dtype, device=dev)
        self.eos = set(int(e) for e in eos_token_ids)

    # -- the device steps ----------------------------------------------------------------
    def _tensor(self, array, dtype=None) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype).to(self.device())

    @torch.no_grad()
    def encode(self, prepared: Prepared) -> tuple[torch.Tensor | None, np.ndarray]:
        """Run every tower of a request; returns padded embeddings and the remapped ``mm_index``."""
        if not prepared.media:
            return None, prepared.mm_index
        chunks, remap, offset, start = [], prepared.mm_index.copy(), 0, 0
        for item in prepared.media:
            rows = self.encoder_rows(item.tower, round_up(item.rows, item.row_multiple))
            inputs = {}
            for key, arr in item.inputs.items():
                padded = np.full((rows,) + arr.shape[1:], item.pad.get(key, 0), dtype=arr.dtype)
                padded[: arr.shape[0]] = arr
                inputs[key] = self._tensor(padded, torch.float32 if arr.dtype.kind == "f" else torch.long)
            if "patches" in inputs:
                inputs["patches"] = inputs["patches"].to(self.dtype)
            emb = self.model.encode(item.tower, **inputs)  # [rows / row_multiple, dim]
            sel = (prepared.mm_index >= start) & (prepared.mm_index < start + item.num_embeds)
            remap[sel] = prepared.mm_index[sel] - start + offset
            chunks.append(emb)
            start += item.num_embeds
            offset += emb.shape[0]
        return (chunks[0] if len(chunks) == 1 else torch.cat(chunks)), remap

    def _prompt_arrays(self, prepared: Prepared):
        """Token ids, positions and media rows padded to the prompt's bucket."""
        n = len(prepared.input_ids)
        s = self.prefill_len(n)
        ids = np.zeros(s, np.int64)
        ids[:n] = prepared.input_ids
        pos = np.zeros((prepared.positions.shape[0], s), np.int64)
        pos[:, :n] = prepared.positions
        mm_embeds, mm_index = self.encode(prepared)
        index = np.full(s, -1, np.int64)
        index[:n] = mm_index
        return (self._tensor(ids[None]), self._tensor(pos[:, None]), mm_embeds,
                self._tensor(index[None]) if mm_embeds is not None else None)

    @torch.no_grad()
    def prefill(self, prepared: Prepared, slot: int) -> torch.Tensor:
        """Encode media, run the prompt into ``slot`` of the cache and return the first token ``[1]``."""
        ids, pos, mm_embeds, mm_index = self._prompt_arrays(prepared)
        s, n = ids.shape[1], len(prepared.input_ids)
        view = self.cache.prefill(self._tensor([slot]), self._tensor(np.arange(s)[None]))
        logits = self.model(ids, pos, mm_embeds=mm_embeds, mm_index=mm_index, cache=view,
                            logits_index=self._tensor([n - 1]))
        return greedy(logits)

    @torch.no_grad()
    def prompt_logits(self, prepared: Prepared) -> np.ndarray:
        """``[s, vocab]`` float32 logits at every prompt position (no cache; for scoring and tests)."""
        ids, pos, mm_embeds, mm_index = self._prompt_arrays(prepared)
        logits = self.model(ids, pos, mm_embeds=mm_embeds, mm_index=mm_index)
        self.step_done()
        return logits[0].cpu().numpy()[: len(prepared.input_ids)]

    @torch.no_grad()
    def decode(self, tokens: np.ndarray, write_pos: np.ndarray, rope_pos: np.ndarray) -> torch.Tensor:
        """One token for every slot: ``tokens, write_pos, rope_pos [slots]`` -> next tokens ``[slots]``."""
        axes = self.model.lm.rotary.num_axes
        wp = self._tensor(write_pos[:, None])  # [B, 1]
        view = self.cache.decode(wp)
        logits = self.model(self._tensor(tokens[:, None]), self._tensor(np.broadcast_to(rope_pos[None, :, None], (axes, len(rope_pos), 1))),
                            cache=view, attn_kwargs={"q_positions": wp}, logits_index=self._tensor(np.zeros(len(tokens), np.int64)))
        return greedy(logits)

    # -- the schedule --------------------------------------------------------------------
    def generate(self, prepared: list[Prepared], *, decode_text: Callable[[list[int]], str],
                 on_result: Callable[[Result], None] | None = None) -> list[Result]:
        """Generate for every request, ``max_batch`` at a time, refilling slots as sequences finish.

        Results come back in request order; ``on_result`` is called as each one finishes.
        """
        if self.model is None:
            raise RuntimeError("call setup(model) before generate()")
        t0 = time.perf_counter()
        results: list[Result | None] = [None] * len(prepared)
        pending = deque(range(len(prepared)))
        active: dict[int, _Seq] = {}

        def done(i: int, r: Result) -> None:
            r.latency_s = time.perf_counter() - t0
            results[i] = r
            if on_result:
                on_result(r)

        def emit(seq: _Seq, token: int) -> None:
            req = seq.prepared.request
            seq.result.token_ids.append(token)
            seq.last = token
            reason = ("stop" if token in self.eos and not req.ignore_eos else
                      "length" if len(seq.result.token_ids) >= req.max_new_tokens else
                      "max_model_len" if seq.length >= self.max_model_len else None)
            if reason:
                seq.result.finish_reason = reason
                seq.result.text = decode_text(seq.result.token_ids)
                del active[seq.slot]
                done(seq.index, seq.result)

        while pending or active:
            for slot in range(self.max_batch):
                if slot in active or not pending:
                    continue
                i = pending.popleft()
                p = prepared[i]
                req = p.request
                result = Result(id=req.id, prompt=req.prompt, prompt_token_ids=[int(t) for t in p.input_ids])
                n = len(p.input_ids)
                if n + 1 > self.max_model_len:
                    result.error = (f"prompt has {n} tokens; max_model_len={self.max_model_len} leaves no room "
                                    f"to generate")
                elif req.max_new_tokens <= 0:
                    result.error = f"max_new_tokens={req.max_new_tokens} must be positive"
                if result.error:
                    done(i, result)
                    continue
                first = self.prefill(p, slot)
                self.step_done()
                token = int(first.cpu()[0])
                result.ttft_s = time.perf_counter() - t0
                active[slot] = seq = _Seq(prepared=p, result=result, slot=slot, length=n, index=i)
                emit(seq, token)
            if not active:
                continue
            tokens = np.zeros(self.max_batch, np.int64)
            write = np.zeros(self.max_batch, np.int64)
            rope = np.zeros(self.max_batch, np.int64)
            for slot, seq in active.items():
                tokens[slot], write[slot] = seq.last, seq.length
                rope[slot] = seq.length + seq.prepared.position_delta
            nxt = self.decode(tokens, write, rope)
            self.step_done()
            nxt = nxt.cpu().numpy()
            for slot, seq in list(active.items()):
                seq.length += 1
                emit(seq, int(nxt[slot]))
        return results
