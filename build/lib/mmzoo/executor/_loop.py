"""The generation loop shared by the eager and XLA executors.

The executor owns everything the modules do not know about: device placement, dtype, padding
to static shapes, the KV cache in slots, the prefill/decode schedule (a finished sequence frees
its slot for the next request: continuous batching) and sampling. Inputs are prepared on the
host with numpy and moved once per step (as vLLM's TPU runner does).

Three kinds of device step, each a fixed set of shapes on XLA:

* **encode** (per tower and input-row bucket): run a tower and write its embeddings into a
  persistent media buffer at an offset, so the prompt graph never depends on media sizes;
* **prefill** (per prompt bucket): merge token and media embeddings, fill one KV-cache slot,
  sample the first token;
* **decode** (per cache-length bucket): one token for every slot, attending over the first
  ``kv_len`` cache positions (the smallest bucket that holds every active sequence), then
  sampling. One decode step stays in flight: step N+1 takes its input tokens from step N's
  device output and is launched before step N's tokens are read back, so the host's per-step
  work overlaps the device's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from mmzoo.errors import MmzooError
from mmzoo.buckets import round_up
from mmzoo.executor._sampling import greedy, sample
from mmzoo.lms import KVCache
from mmzoo.types import DTYPES, Prepared, Result

@dataclass
class _Seq:
    prepared: Prepared
    result: Result
    slot: int
    length: int  # tokens in the cache
    index: int  # position in the request list
    rng: np.random.Generator
    last: int = 0  # the newest token, not yet in the cache


class Executor:
    """Runs a :class:`~mmzoo.models.composition.MultimodalLM` on one device.

    Args:
        max_model_len: prompt plus generated tokens, the KV cache length per slot.
        max_batch: KV-cache slots, i.e. sequences decoded together.
        progress: show a progress bar over requests.
    """

    name = "?"

    def __init__(self, *, max_model_len: int = 1024, max_batch: int = 4, progress: bool = False):
        if max_model_len <= 0 or max_batch <= 0:
            raise ValueError(f"max_model_len={max_model_len} and max_batch={max_batch} must be positive")
        self.max_model_len, self.max_batch, self.progress = max_model_len, max_batch, progress
        self.model = None

    # -- what the two executors differ in ------------------------------------------------
    def device(self) -> torch.device:
        raise NotImplementedError

    def prefill_len(self, n: int) -> int:
        """The padded prompt length for a prompt of ``n`` tokens."""
        return n

    def encoder_rows(self, tower: str, n: int) -> int:
        """The padded input-row count for ``n`` input rows of ``tower``."""
        return n

    def decode_kv_len(self, n: int) -> int | None:
        """The KV-cache positions a decode step whose longest sequence will hold ``n`` tokens
        attends over; None: the whole cache."""
        return None

    def max_media_rows(self) -> int:
        """Rows of the media buffer: every placeholder of the longest prompt, plus padding room."""
        return self.max_model_len

    def step_begin(self) -> None:
        """Called before each device step (the XLA executor counts compiles per step from here)."""

    def step_done(self) -> None:
        """Called after each device step (XLA cuts and runs the graph here)."""

    def graphs_since_warmup(self) -> int:
        return 0

    def describe(self) -> str:
        return self.name

    def hold_keys_transposed(self, model) -> bool:
        """Whether the KV cache holds keys as ``[.., head_dim, len]`` (:class:`~mmzoo.lms.KVCache`)."""
        return False

    def shard(self) -> None:
        """Annotate the placed weights and KV cache with a device-mesh sharding (the XLA executor
        with a mesh: :mod:`mmzoo.executor._sharding`); called by setup() before they materialize."""

    # -- setup ---------------------------------------------------------------------------
    def setup(self, model, *, dtype: str = "float32", eos_token_ids=()) -> None:
        """Place ``model`` on the device in ``dtype``; allocate the KV cache and the media buffer."""
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
                             max_len=self.max_model_len, head_dim=lm.head_dim, dtype=self.dtype, device=dev,
                             keys_transposed=self.hold_keys_transposed(model))
        self.media = torch.zeros(self.max_media_rows(), lm.dim, dtype=self.dtype, device=dev)
        self.eos = set(int(e) for e in eos_token_ids)
        self._encoded_rows: dict = {}  # encode step key -> embedding rows it writes
        self.shard()
        self.step_done()  # materialize weights and buffers, so no step graph contains their creation

    def _tensor(self, array, dtype=None) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype).to(self.device())

    # -- device steps --------------------------------------------------------------------
    def run_step(self, key, fn: Callable[..., tuple], inputs: list[torch.Tensor], state: str) -> list[torch.Tensor]:
        """Run the device step ``fn(*inputs) -> outputs``, which updates the executor's ``state``
        ("cache": the KV cache, "media": the media buffer) in place. ``key`` names the step's
        static shape; the XLA executor replays the compiled graph of each key after its first call."""
        self.step_begin()
        return list(fn(*inputs))

    @torch.no_grad()
    def encode_into_buffer(self, item, offset: int) -> int:
        """Run one tower (or take its precomputed embeddings) and write rows at ``offset`` of the
        media buffer; returns the number of rows written (real and padding)."""
        if item.embeds is not None:
            emb = torch.as_tensor(item.embeds)
            rows = self.encoder_rows("embeds", emb.shape[0])  # the buffer write depends only on rows
            padded = torch.zeros(rows, emb.shape[1], dtype=self.dtype)
            padded[: emb.shape[0]] = emb.to(self.dtype)
            key, names, tensors = ("embeds", rows), [], [padded.to(self.device())]
        else:
            rows = self.encoder_rows(item.tower, round_up(item.rows, item.row_multiple))
            names, tensors = sorted(item.inputs), []
            for name in names:
                arr = item.inputs[name]
                padded = np.full((rows,) + arr.shape[1:], item.pad.get(name, 0), dtype=arr.dtype)
                padded[: arr.shape[0]] = arr
                tensors.append(self._tensor(padded, self.dtype if arr.dtype.kind == "f" else torch.long))
            key = ("encode", item.tower, rows, tuple(names))
        n = self._encoded_rows.get(key)  # known from the step's first (traced) call
        if n is not None:
            self._check_media_rows(item, offset, n)

        def step(at, *tensors):
            emb = tensors[0] if not names else self.model.encode(item.tower, **dict(zip(names, tensors)))
            self._encoded_rows[key] = emb.shape[0]  # [rows / row_multiple, dim] for a tower
            self._check_media_rows(item, offset, emb.shape[0])
            idx = torch.arange(emb.shape[0], device=self.media.device) + at
            self.media.index_copy_(0, idx, emb.to(self.dtype))
            return ()

        self.run_step(key, step, [self._tensor([offset])] + tensors, "media")
        return self._encoded_rows[key]

    def _check_media_rows(self, item, offset: int, n: int) -> None:
        if offset + n > self.media.shape[0]:
            raise MmzooError(f"{item.tower} inputs need {offset + n} media rows; the buffer holds {self.media.shape[0]}")

    @torch.no_grad()
    def encode_media(self, item) -> torch.Tensor:
        """Run one tower alone and return its ``[num_embeds, dim]`` embeddings on the host.

        The whole media buffer comes back (a transfer, not a new graph), so no shape-dependent
        slice is compiled."""
        self.encode_into_buffer(item, 0)
        self.step_done()
        return self.media.cpu()[: item.num_embeds].clone()

    def _prompt_arrays(self, prepared: Prepared):
        """Token ids, positions and media-buffer rows, padded to the prompt's bucket; runs the towers."""
        n = len(prepared.input_ids)
        s = self.prefill_len(n)
        ids = np.zeros(s, np.int64)
        ids[:n] = prepared.input_ids
        pos = np.zeros((prepared.positions.shape[0], s), np.int64)
        pos[:, :n] = prepared.positions
        index = np.full(s, -1, np.int64)
        remap, start, offset = prepared.mm_index.copy(), 0, 0
        for item in prepared.media:
            written = self.encode_into_buffer(item, offset)
            self.step_done()
            sel = (prepared.mm_index >= start) & (prepared.mm_index < start + item.num_embeds)
            remap[sel] = prepared.mm_index[sel] - start + offset
            start += item.num_embeds
            offset += written
        index[:n] = remap
        return self._tensor(ids[None]), self._tensor(pos[:, None]), self._tensor(index[None])

    @staticmethod
    def _sampling_arrays(seqs: list[tuple[int, Any]], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-row sampling parameters and one uniform draw per sampled row (host arrays):
        ``top_k [rows]`` int64 and ``[temperature, top_p, uniform] [3, rows]`` float32."""
        top_k = np.zeros(rows, np.int64)
        floats = np.zeros((3, rows), np.float32)
        floats[1] = 1.0  # top_p
        for row, seq in seqs:
            r = seq.prepared.request
            top_k[row] = r.top_k
            floats[:, row] = r.temperature, r.top_p, seq.rng.random() if r.temperature > 0 else 0.0
        return top_k, floats

    @staticmethod
    def _sample(logits: torch.Tensor, top_k: torch.Tensor, floats: torch.Tensor) -> torch.Tensor:
        """:func:`sample` with the parameters of :meth:`_sampling_arrays`."""
        return sample(logits, floats[0], top_k, floats[1], floats[2])

    @staticmethod
    def _greedy_only(seqs) -> bool:
        return all(seq.prepared.request.temperature == 0 for _, seq in seqs)

    @torch.no_grad()
    def prefill(self, seq: _Seq) -> torch.Tensor:
        """Encode media, run the prompt into the sequence's cache slot, return the first token ``[1]``."""
        ids, pos, index = self._prompt_arrays(seq.prepared)
        s, n = ids.shape[1], len(seq.prepared.input_ids)
        seqs = [(0, seq)]
        greedy_only = self._greedy_only(seqs)
        sampling = [] if greedy_only else [self._tensor(a) for a in self._sampling_arrays(seqs, 1)]

        def step(ids, pos, index, slot, logits_index, media, *sampling):
            view = self.cache.prefill(slot, torch.arange(s, device=slot.device)[None])
            logits = self.model(ids, pos, mm_embeds=media, mm_index=index, cache=view, logits_index=logits_index)
            return (self._sample(logits, *sampling) if sampling else greedy(logits),)

        inputs = [ids, pos, index, self._tensor([seq.slot]), self._tensor([n - 1]), self.media] + sampling
        (token,) = self.run_step(("prefill", s, greedy_only), step, inputs, "cache")
        return token

    @torch.no_grad()
    def prompt_logits(self, prepared: Prepared) -> np.ndarray:
        """``[s, vocab]`` float32 logits at every prompt position (no cache; for scoring and tests)."""
        ids, pos, index = self._prompt_arrays(prepared)
        self.step_begin()
        logits = self.model(ids, pos, mm_embeds=self.media, mm_index=index)
        self.step_done()
        return logits[0].cpu().numpy()[: len(prepared.input_ids)]

    @torch.no_grad()
    def decode(self, active: dict[int, _Seq], prev: torch.Tensor | None = None,
               from_prev: frozenset[int] = frozenset()) -> torch.Tensor:
        """One token for every slot (empty slots compute garbage that is ignored) -> ``[slots]``.

        Each sequence's input token is its ``last``, or for the slots in ``from_prev`` the entry of
        ``prev`` (the previous decode step's device output, not yet read back): so the next step
        can be launched before the host has the tokens of this one."""
        b = self.max_batch
        kv_len = self.decode_kv_len(max(seq.length for seq in active.values()) + 1)
        # the per-row inputs in one int64 array, so a greedy step makes one host-to-device transfer
        # (each costs about as much as a small kernel): [use_prev, token, write position, rope
        # position, top_k] x slots, plus the sampling floats when any row samples
        rows = np.zeros((5, b), np.int64)
        for slot, seq in active.items():
            use_prev = slot in from_prev
            rows[:4, slot] = (use_prev, 0 if use_prev else seq.last, seq.length,
                              seq.length + seq.prepared.position_delta)
        seqs = list(active.items())
        greedy_only = self._greedy_only(seqs)
        floats = []
        if not greedy_only:
            rows[4], f = self._sampling_arrays(seqs, b)
            floats = [f]
        axes = self.model.lm.rotary.num_axes

        def step(prev, rows, *floats):
            tokens = torch.where(rows[0] != 0, prev, rows[1])[:, None]  # [b, 1]
            write = rows[2][:, None]  # [b, 1]
            rope = rows[3][None, :, None].expand(axes, b, 1)  # [axes, b, 1]
            logits = self.model(tokens, rope, cache=self.cache.decode(write, kv_len),
                                attn_kwargs={"q_positions": write}, logits_index=torch.zeros_like(rows[0]))
            return (self._sample(logits, rows[4], *floats) if floats else greedy(logits),)

        if prev is None:
            prev = self._tensor(np.zeros(b, np.int64))
        inputs = [prev, self._tensor(rows)] + [self._tensor(f) for f in floats]
        (token_ids,) = self.run_step(("decode", greedy_only, kv_len), step, inputs, "cache")
        return token_ids

    # -- the schedule --------------------------------------------------------------------
    def generate(self, prepared: list[Prepared], *, decode_text: Callable[[list[int]], str],
                 on_result: Callable[[Result], None] | None = None) -> list[Result]:
        """Generate for every request, ``max_batch`` at a time, refilling slots as sequences finish.

        Results come back in request order; ``on_result`` is called as each one finishes. A request
        that cannot run (too long, bad parameters) gets a result with ``error`` and the rest go on.
        """
        if self.model is None:
            raise RuntimeError("call setup(model) before generate()")
        t0 = time.perf_counter()
        results: list[Result | None] = [None] * len(prepared)
        pending = deque(range(len(prepared)))
        active: dict[int, _Seq] = {}
        bar = _Progress(len(prepared)) if self.progress else None

        def done(i: int, r: Result) -> None:
            r.latency_s = time.perf_counter() - t0
            r.graphs_compiled_after_warmup = self.graphs_since_warmup()
            results[i] = r
            if bar:
                bar.update(r)
            if on_result:
                on_result(r)

        def emit(seq: _Seq, token: int, cached: int) -> None:
            """Hand out ``token``; ``cached``: the sequence's tokens in the cache when it was computed."""
            req, res = seq.prepared.request, seq.result
            res.token_ids.append(token)
            res.token_times_s.append(time.perf_counter() - t0)
            seq.last = token
            reason = ("stop" if (token in self.eos and not req.ignore_eos) or token in req.stop_token_ids else
                      "length" if len(res.token_ids) >= req.max_new_tokens else
                      "max_model_len" if cached >= self.max_model_len else None)
            if reason:
                res.finish_reason = reason
                res.text = decode_text(res.token_ids)
                del active[seq.slot]
                done(seq.index, res)

        # One decode step stays in flight: step N+1 is launched (its input tokens taken from step
        # N's device output) before step N's tokens are read back, so the host's work for a step
        # overlaps the device's. A sequence that stops at step N has had step N+1 computed for it
        # too; that token is dropped (its cache slot is rewritten by the next prompt's prefill).
        inflight = None  # (token ids on the device, [(slot, seq, tokens cached after the step)])
        while pending or active:
            for slot in range(self.max_batch):
                if slot in active or not pending:
                    continue
                i = pending.popleft()
                p = prepared[i]
                req = p.request
                result = Result(id=req.id, prompt=req.prompt, prompt_token_ids=(
                    [] if req.inputs_embeds is not None else [int(t) for t in p.input_ids]))
                n = len(p.input_ids)
                try:
                    req.check()
                    if n + 1 > self.max_model_len:
                        raise MmzooError(f"prompt has {n} tokens; max_model_len={self.max_model_len} leaves no "
                                         f"room to generate")
                    seq = _Seq(prepared=p, result=result, slot=slot, length=n, index=i,
                               rng=np.random.default_rng(req.seed))
                    first = self.prefill(seq)
                    self.step_done()
                    token = int(first.cpu()[0])
                except MmzooError as e:
                    result.error = str(e)
                    done(i, result)
                    continue
                result.ttft_s = time.perf_counter() - t0
                active[slot] = seq
                emit(seq, token, seq.length)
            # launch the next step for every sequence that still needs a token not yet computed
            flying = {slot: seq for slot, seq, _ in inflight[1]} if inflight else {}
            ahead = frozenset(slot for slot, seq in active.items() if flying.get(slot) is seq)  # a token in flight
            go = {slot: seq for slot, seq in active.items() if seq.length < self.max_model_len and
                  len(seq.result.token_ids) + (slot in ahead) < seq.prepared.request.max_new_tokens}
            launched = None
            if go:
                out = self.decode(go, prev=inflight[0] if inflight else None, from_prev=ahead.intersection(go))
                self.step_done()
                for seq in go.values():
                    seq.length += 1
                launched = (out, [(slot, seq, seq.length) for slot, seq in go.items()])
            if inflight:
                tokens = inflight[0].cpu().numpy()
                for slot, seq, cached in inflight[1]:
                    if active.get(slot) is seq:
                        emit(seq, int(tokens[slot]), cached)
            inflight = launched
        if bar:
            bar.close()
        return results


class _Progress:
    """Requests done, with input and output tokens per second."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="req", dynamic_ncols=True, leave=False, disable=None)  # off when not a tty
        self.t0, self.tok_in, self.tok_out = time.perf_counter(), 0, 0

    def update(self, r: Result) -> None:
        self.tok_in += len(r.prompt_token_ids)
        self.tok_out += len(r.token_ids)
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"in {self.tok_in / dt:.0f} tok/s, out {self.tok_out / dt:.0f} tok/s")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
