"""The executor: everything the modules do not know about.

Placement, dtype, padding to static shapes, the KV cache in slots and the media buffer, the
generation loop (the :class:`~mmzoo.executor.scheduler.Scheduler` decides who runs; the
:mod:`~mmzoo.executor.steps` compute) and sampling. Inputs are prepared on the host with numpy and
moved once per step, as vLLM's TPU runner does. The eager and XLA executors differ only in the
hooks at the top of :class:`Executor` (device, buckets, how a step is run).

Three kinds of device step, each a fixed set of shapes on XLA:

* **encode** (per tower and input-row bucket): a tower's embeddings written into the persistent
  media buffer at an offset, so the prompt graph never depends on media sizes;
* **prefill** (per prompt-token bucket): the prompts admitted together packed into one row, each
  attending to itself: merge token and media embeddings, fill each prompt's KV-cache slot, sample
  each one's first token;
* **decode** (per cache-length bucket): one token for every slot, then sampling. One decode step
  stays in flight: step N+1 takes its input tokens from step N's device output and is launched
  before step N's tokens are read back, so the host's per-step work overlaps the device's.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import numpy as np
import torch

from mmzoo.buckets import round_up
from mmzoo.errors import MmzooError
from mmzoo.executor.scheduler import Drain, Scheduler, Sequence
from mmzoo.executor.steps import (DecodeInputs, PrefillInputs, Sampling, decode_step, encode_step, head_step,
                                  prefill_step)
from mmzoo.lms import KVCache
from mmzoo.types import DTYPES, Prepared, Result, TowerInput


class Executor:
    """Runs a :class:`~mmzoo.models.MultimodalLM` on one device.

    Args:
        max_model_len: prompt plus generated tokens, the KV cache length per slot.
        max_batch: KV-cache slots, i.e. sequences decoded together.
        max_prefill_tokens: prompt tokens one prefill step takes (vLLM's ``max_num_batched_tokens``):
            prompts admitted together are packed into one step up to this many (None:
            ``max_model_len``).
        progress: show a progress bar over requests.

    Attributes:
        encoder_buckets: tower -> padded input-row counts (empty: no padding, or the executor's
            defaults); :func:`mmzoo.build` fills in a family's item buckets.
        do_warmup: whether :func:`mmzoo.build` calls :meth:`warmup` after :meth:`setup`.
    """

    name = "?"
    do_warmup = False

    def __init__(self, *, max_model_len: int = 1024, max_batch: int = 4, max_prefill_tokens: int | None = None,
                 progress: bool = False):
        if max_model_len <= 0 or max_batch <= 0:
            raise ValueError(f"max_model_len={max_model_len} and max_batch={max_batch} must be positive")
        if max_prefill_tokens is not None and max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens} must be positive")
        self.max_model_len, self.max_batch, self.progress = max_model_len, max_batch, progress
        self.max_prefill_tokens = max_prefill_tokens or max_model_len
        self.encoder_buckets: dict[str, list[int]] = {}
        self.model = None
        self.warm: set = set()  # the warmup Graphs compiled so far (mmzoo.executor.warmup)

    # -- what the executors differ in ------------------------------------------------------
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

    def decode_rows(self, n: int) -> int:
        """The rows of a decode step whose highest running slot is ``n - 1``: it runs the first
        that many slots (the scheduler fills the lowest free slot first); here all of them."""
        return self.max_batch

    def prefill_rows(self, n: int) -> int:
        """The rows of the head step of a prefill step that packs ``n`` prompts (its first token's
        LM head and sampling: :func:`~mmzoo.executor.steps.head_step`); here all ``max_batch``."""
        return self.max_batch

    def max_media_rows(self) -> int:
        """Rows of the media buffer: every placeholder of the longest prompt, plus padding room."""
        return self.max_model_len

    def step_begin(self) -> None:
        """Called before each device step (the XLA executor counts compiles per step from here)."""

    def step_done(self) -> None:
        """Called after each device step (XLA cuts and runs the graph here)."""

    def graphs_since_warmup(self) -> int | None:
        return 0

    def describe(self) -> str:
        return self.name

    def hold_keys_transposed(self, model) -> bool:
        """Whether the KV cache holds keys as ``[.., head_dim, len]`` (:class:`~mmzoo.lms.KVCache`)."""
        return False

    def prepare_model(self, model) -> None:
        """Prepare the executor's model before its weights are placed (buffers: the XLA executor
        tabulates the rotaries here)."""

    def layout(self, name: str, unit, whole: bool):
        """Lay out one unit of the model (``name`` in it) on the host, after its weights are read and
        before they are placed (:func:`mmzoo._weights.materialize`): ``unit`` with everything under it
        (an attention or gated MLP, ``whole``), or a module's own parameters. Returns a module that
        replaces ``unit``, or None. The XLA executor fuses projections and transposes linear weights
        here, the eager one packs them for oneDNN."""

    def shard(self) -> None:
        """Annotate the placed weights and KV cache with a device-mesh sharding (the XLA executor
        with a mesh: :mod:`mmzoo.executor._sharding`); called by setup() before they materialize."""

    def use_mesh(self, mesh, model, plan=None) -> None:
        raise MmzooError(f"mesh {mesh} needs executor=xla; the {self.name} executor runs on one device")

    def warmup(self, dummy_media=None) -> float:
        """Compile every step ahead of time (the XLA executor); returns the seconds taken."""
        return 0.0

    def warm_for(self, prepared: list[Prepared], dummy_media=None, *, generate: bool = True) -> float:
        """Compile the steps a run of ``prepared`` needs that are not compiled yet, when this
        executor warms up per run (the XLA executor with ``warmup=needed``); returns the seconds."""
        return 0.0

    def run_step(self, key, fn: Callable[..., tuple], inputs: list[torch.Tensor], state: str) -> list[torch.Tensor]:
        """Run the device step ``fn(*inputs) -> outputs``, which updates the executor's ``state``
        ("cache": the KV cache, "media": the media buffer, None: nothing) in place. ``key`` names the step's
        static shape; the XLA executor replays the compiled graph of each key after its first call."""
        self.step_begin()
        return list(fn(*inputs))

    # -- setup -----------------------------------------------------------------------------
    def setup(self, model, *, dtype: str = "float32", eos_token_ids=(), take_ownership: bool = False,
              weights=None, progress=None) -> None:
        """Place ``model`` on the device in ``dtype`` (``self.model``), laid out for this executor
        (:meth:`layout`); allocate the KV cache and the media buffer.

        Args:
            model: the pipeline. With ``weights``, its parameters are on the meta device
                (:func:`mmzoo._weights.parameters_on_meta`) and ``weights`` gives their values.
            take_ownership: lay out and place ``model`` itself (the engine, which built it for this
                executor alone); else a copy is, and the caller's module is left as it was.
            weights: ``name -> tensor or LazyTensor`` under ``model``'s parameter names (checked
                already), read and placed unit by unit (:func:`mmzoo._weights.materialize`): the
                host holds one unit's tensors at a time besides the placed weights.
            progress: ``(done_bytes, total_bytes)`` after each unit is placed.
        """
        from mmzoo import _weights
        from mmzoo.layers import Attention, GatedMLP

        if dtype not in DTYPES:
            raise MmzooError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        self.dtype = DTYPES[dtype]
        dev = self.device()
        if weights is None:
            model = model if take_ownership else copy.deepcopy(model)
            weights = {name: p.data for name, p in model.named_parameters()}
        model = model.eval()
        self.prepare_model(model)
        _weights.materialize(model, weights, dtype=self.dtype, device=dev, layout=self.layout,
                             whole=(Attention, GatedMLP), map_files=self.maps_files, progress=progress)
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

    def maps_files(self, name: str) -> bool:
        """Whether the checkpoint tensors of unit ``name`` that are already in the run dtype are used
        in place, as views of their file's mapping (they stay on the host and :meth:`layout` changes
        none of them)."""
        return False

    def memory_plan(self, model, dtype: str) -> dict[str, int]:
        """Bytes :meth:`setup` will allocate for ``model`` (built, parameters possibly on the meta
        device) in ``dtype``: ``weights`` (as this executor lays them out), ``kv_cache``, ``media``."""
        size = DTYPES[dtype].itemsize
        lm = model.lm
        weights = sum(p.numel() * (size if p.is_floating_point() else p.element_size())
                      for p in model.parameters())
        weights += self.layout_extra_params(model) * size
        kv = 2 * lm.num_layers * self.max_batch * lm.num_kv_heads * self.max_model_len * lm.head_dim * size
        return {"weights": weights, "kv_cache": kv, "media": self.max_media_rows() * lm.dim * size}

    def memory_available(self) -> int | None:
        """Bytes of memory the device can still give (None: unknown). The CPU: the host's available
        memory (``MemAvailable``)."""
        return host_memory_available()

    def layout_extra_params(self, model) -> int:
        """Parameters :meth:`layout` adds to ``model``'s (a tied head given a layout of its own)."""
        return 0

    def _tensor(self, array, dtype=None) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype).to(self.device())

    # -- the steps, from typed host inputs ---------------------------------------------------
    def _encode_key(self, item: TowerInput) -> tuple[tuple, int]:
        """The encode step's key (its kind and static shape) and padded input rows for ``item``."""
        if item.embeds is not None:
            rows = self.encoder_rows("embeds", item.embeds.shape[0])  # the buffer write depends only on rows
            return ("embeds", rows), rows
        rows = self.encoder_rows(item.tower, round_up(item.rows, item.row_multiple))
        return ("encode", item.tower, rows, tuple(sorted(item.inputs))), rows

    @torch.no_grad()
    def encode(self, item: TowerInput, offset: int = 0) -> int:
        """Run one tower (or take its precomputed embeddings) and write rows at ``offset`` of the
        media buffer; returns the number of rows written (real and padding)."""
        key, rows = self._encode_key(item)
        if item.embeds is not None:
            emb = torch.as_tensor(item.embeds)
            padded = torch.zeros(rows, emb.shape[1], dtype=self.dtype)
            padded[: emb.shape[0]] = emb.to(self.dtype)
            tower, names, tensors = None, [], [padded.to(self.device())]
        else:
            self._check_tower_positions(item)
            tower, names, tensors = item.tower, sorted(item.inputs), []
            for name in names:
                arr = item.inputs[name]
                padded = np.full((rows,) + arr.shape[1:], item.pad.get(name, 0), dtype=arr.dtype)
                padded[: arr.shape[0]] = arr
                tensors.append(self._tensor(padded, self.dtype if arr.dtype.kind == "f" else torch.long))
        n = self._encoded_rows.get(key)  # known from the step's first (traced) call
        if n is not None:
            self._check_media_rows(item, offset, n)

        def step(at, *tensors):
            written = encode_step(self.model, self.media, tower, names, at, *tensors)
            self._encoded_rows[key] = written
            self._check_media_rows(item, offset, written)
            return ()

        self.run_step(key, step, [self._tensor([offset])] + tensors, "media")
        return self._encoded_rows[key]

    def _check_tower_positions(self, item: TowerInput) -> None:
        """The rotary positions of a tower with a tabulated rotary (its encoder's ``rotary_input``)
        must be in its table: on XLA a gather past it would clamp silently."""
        encoder = self.model.towers[item.tower].encoder
        name = encoder.rotary_input
        table = encoder.rotary.positions if name else None
        top = int(item.inputs[name].max(initial=0)) if table is not None else 0
        if table is not None and top >= table:
            raise MmzooError(f"{item.tower} rotary position {top} ({name}) is past the "
                             f"{table} positions the tower's rotary table holds (its largest input-row bucket)")

    def _check_media_rows(self, item, offset: int, n: int) -> None:
        if offset + n > self.media.shape[0]:
            raise MmzooError(f"{item.tower} inputs need {offset + n} media rows; the buffer holds {self.media.shape[0]}")

    @torch.no_grad()
    def encode_media(self, item: TowerInput) -> torch.Tensor:
        """Run one tower alone and return its ``[num_embeds, dim]`` embeddings on the host.

        The whole media buffer comes back (a transfer, not a new graph), so no shape-dependent
        slice is compiled."""
        self.encode(item, 0)
        self.step_done()
        return self.media.cpu()[: item.num_embeds].clone()

    def media_rows(self, item: TowerInput) -> int:
        """The media-buffer rows :meth:`encode` writes for ``item`` (real and padding): known once its
        step has run (at warmup), else the tower's output rows scaled to the padded input rows."""
        key, rows = self._encode_key(item)
        if item.embeds is not None:
            return rows
        known = self._encoded_rows.get(key)
        return known if known is not None else -(-rows * item.num_embeds // max(item.rows, 1))

    def prefill_budget(self) -> int:
        """The most prompt tokens one packed prefill step takes."""
        return self.max_prefill_tokens

    def check_prompt(self, prepared: Prepared) -> None:
        """Refuse a prompt no prefill step can take (too long for the cache, or for every bucket, or
        its rotary positions past the LM's table)."""
        n = len(prepared.input_ids)
        if n + 1 > self.max_model_len:
            raise MmzooError(f"prompt has {n} tokens; max_model_len={self.max_model_len} leaves no room to generate")
        self.prefill_len(n)  # raises when no bucket holds it
        self._check_positions(prepared)

    def _check_positions(self, prepared: Prepared) -> None:
        """With a tabulated rotary (:meth:`~mmzoo.layers.Rotary.tabulate`), every position the
        sequence can reach, in its prompt or while it decodes (cache index ``i`` at ``i + delta``,
        ``i < max_model_len``), must be in the table: on XLA a gather past it would clamp silently."""
        table = self.model.lm.rotary.positions
        if table is None:
            return
        top = max(int(prepared.positions.max(initial=0)), self.max_model_len - 1 + prepared.position_delta)
        if top >= table:
            raise MmzooError(f"rotary position {top} is past the {table} positions the LM's rotary table holds "
                             f"(max_model_len={self.max_model_len})")

    def prefill_groups(self, prepared: list[Prepared]) -> list[list[int]]:
        """Split prompts (each passing :meth:`check_prompt`) into consecutive groups that one packed
        prefill step takes: at most ``max_batch``, their tokens within :meth:`prefill_budget` and
        their media within the media buffer. A prompt over a budget alone is a group of its own."""
        groups: list[list[int]] = []
        tokens = rows = 0
        budget, room = self.prefill_budget(), self.media.shape[0]
        for i, p in enumerate(prepared):
            try:
                n, m = len(p.input_ids), sum(self.media_rows(item) for item in p.media)
            except MmzooError:  # media no bucket holds: the prompt fails alone, at its encode
                n, m = len(p.input_ids), 0
            if groups and len(groups[-1]) < self.max_batch and tokens + n <= budget and rows + m <= room:
                groups[-1].append(i)
                tokens, rows = tokens + n, rows + m
            else:
                groups.append([i])
                tokens, rows = n, m
        return groups

    def _encode_prompt_media(self, prepared: Prepared, offset: int) -> tuple[np.ndarray, int]:
        """Run the prompt's towers (one encode step per :class:`TowerInput`), writing the media
        buffer from row ``offset``; returns its ``mm_index`` pointing at those rows, and the rows
        written."""
        remap, start, at = prepared.mm_index.copy(), 0, offset
        for item in prepared.media:
            written = self.encode(item, at)
            self.step_done()
            sel = (prepared.mm_index >= start) & (prepared.mm_index < start + item.num_embeds)
            remap[sel] = prepared.mm_index[sel] - start + at
            start += item.num_embeds
            at += written
        return remap, at - offset

    def prefill_inputs(self, prepared: list[Prepared], slots: list[int]
                       ) -> tuple[PrefillInputs | None, dict[int, MmzooError]]:
        """Prompts (one :meth:`prefill_groups` group) packed into their bucket for ``slots``, their
        media encoded one after another into the media buffer. A prompt whose media fail is left
        out, with its error under its index; None when none is left."""
        packed, failed, offset = [], {}, 0
        for i, (p, slot) in enumerate(zip(prepared, slots)):
            try:
                index, written = self._encode_prompt_media(p, offset)
            except MmzooError as e:
                failed[i] = e
                continue
            offset += written
            packed.append((p.input_ids, p.positions, index, slot))
        if not packed:
            return None, failed
        s = self.prefill_len(sum(len(ids) for ids, *_ in packed))
        inputs = PrefillInputs.pack(s, self.max_batch, self.max_model_len, packed)
        inputs.window = self.prefill_window(s, max(len(ids) for ids, *_ in packed))
        return inputs, failed

    def window_of(self, s: int) -> int | None:
        """The attention window of prefill bucket ``s``'s windowed graph, or None: it has none."""
        return None

    def prefill_window(self, s: int, longest: int) -> int | None:
        """The attention window of a packed prefill step of bucket ``s`` whose longest prompt has
        ``longest`` tokens (:attr:`PrefillInputs.window`), or None: attend over the whole row."""
        w = self.window_of(s)
        return w if w is not None and longest <= w else None

    @torch.no_grad()
    def prefill(self, inputs: PrefillInputs, sampling: Sampling | None = None) -> torch.Tensor:
        """The packed prompts into their cache slots; returns each prompt's first token
        ``[prefill_rows(count)]`` (on the device; the first ``inputs.count`` are real; ``sampling``
        has that many rows). Two steps: :meth:`prefill_hidden`, then :meth:`prefill_head`."""
        hidden = self.prefill_hidden(inputs)
        self.step_done()  # the layers' graph ends here: the head is a graph of its own
        return self.prefill_head(hidden, self.prefill_rows(inputs.count), sampling)

    @torch.no_grad()
    def prefill_hidden(self, inputs: PrefillInputs) -> torch.Tensor:
        """The layers' step of a prefill: writes the prompts' keys and values, returns the hidden
        states at their last positions ``[max_batch, dim]`` (on the device)."""
        window = inputs.window

        def step(*args):
            return (prefill_step(self.model, self.cache, window, *args),)

        args = [self._tensor(inputs.token_rows()), self._tensor(inputs.prompt_rows()), self.media]
        (hidden,) = self.run_step(("prefill", len(inputs.input_ids), window), step, args, "cache")
        return hidden

    @torch.no_grad()
    def prefill_head(self, hidden: torch.Tensor, rows: int, sampling: Sampling | None = None) -> torch.Tensor:
        """The head's step of a prefill: the first token of the first ``rows`` prompts from
        :meth:`prefill_hidden`'s output -> ``[rows]`` (on the device)."""
        sampling = sampling or Sampling.greedy_rows(rows)
        extra = [] if sampling.greedy else [self._tensor(sampling.top_k), self._tensor(sampling.floats())]

        def step(hidden, *extra):
            return (head_step(self.model, rows, hidden, *extra),)

        (tokens,) = self.run_step(("head", rows, sampling.greedy), step, [hidden] + extra, None)
        return tokens

    @torch.no_grad()
    def prompt_logits(self, prepared: Prepared) -> np.ndarray:
        """``[n, vocab]`` float32 logits at every prompt position (no cache; for scoring and tests)."""
        n = len(prepared.input_ids)
        self._check_positions(prepared)
        index, _ = self._encode_prompt_media(prepared, 0)
        p = PrefillInputs.pack(self.prefill_len(n), 1, self.max_model_len,
                               [(prepared.input_ids, prepared.positions, index, 0)])
        self.step_begin()
        logits = self.model(self._tensor(p.input_ids[None]), self._tensor(p.positions[:, None]), mm_embeds=self.media,
                            mm_index=self._tensor(p.mm_index[None]))
        self.step_done()
        return logits[0].cpu().numpy()[:n]

    @torch.no_grad()
    def decode(self, inputs: DecodeInputs, sampling: Sampling | None = None,
               prev: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of the first ``len(inputs.token)`` slots -> ``[max_batch]`` (on the
        device; the slots past those keep ``prev``'s); ``prev`` is the previous step's output,
        read by the ``use_prev`` slots."""
        b = len(inputs.token)
        sampling = sampling or Sampling.greedy_rows(b)
        rows = inputs.rows(sampling.top_k)
        floats = [] if sampling.greedy else [self._tensor(sampling.floats())]
        if prev is None:
            prev = self._tensor(np.zeros(self.max_batch, np.int64))
        kv_len = inputs.kv_len

        def step(prev, rows, *floats):
            return (decode_step(self.model, self.cache, kv_len, prev, rows, *floats),)

        (tokens,) = self.run_step(("decode", sampling.greedy, kv_len, b), step,
                                  [prev, self._tensor(rows)] + floats, "cache")
        return tokens

    # -- from sequences to step inputs -------------------------------------------------------
    @staticmethod
    def sampling_for(seqs: dict[int, Sequence], rows: int) -> Sampling:
        """Row ``i``'s sampling parameters from ``seqs[i]``'s request, with one uniform draw from its
        own seeded generator when it samples (so its tokens do not depend on its batch)."""
        s = Sampling.greedy_rows(rows)
        for row, seq in seqs.items():
            r = seq.request
            s.temperature[row], s.top_k[row], s.top_p[row] = r.temperature, r.top_k, r.top_p
            s.uniform[row] = seq.rng.random() if r.temperature > 0 else 0.0
        return s

    def decode_inputs(self, seqs: dict[int, Sequence], from_prev: set[int] = frozenset()) -> DecodeInputs:
        """The decode step of the sequences in ``seqs`` (slot -> sequence); the ``from_prev`` slots
        read their input token from the previous step's device output. The step runs the first
        :meth:`decode_rows` slots, enough for the highest of ``seqs``."""
        inputs = DecodeInputs.zeros(self.decode_rows(max(seqs) + 1), 1)  # unused slots: token 0 at position 0
        for slot, seq in seqs.items():
            use_prev = slot in from_prev
            inputs.use_prev[slot], inputs.token[slot] = use_prev, 0 if use_prev else seq.last
            inputs.write[slot], inputs.rope[slot] = seq.length, seq.length + seq.prepared.position_delta
        inputs.kv_len = self.decode_kv_len(max(seq.length for seq in seqs.values()) + 1)
        return inputs

    # -- the generation loop -------------------------------------------------------------------
    def generate(self, prepared: list[Prepared], *, decode_text: Callable[[list[int]], str],
                 on_result: Callable[[Result], None] | None = None, stop: Drain | None = None) -> list[Result]:
        """Generate for every request, ``max_batch`` at a time, refilling slots as sequences finish.

        Results come back in request order; ``on_result`` is called as each one finishes. A request
        that cannot run (too long, bad parameters) gets a result with ``error`` and the rest go on.
        Once ``stop`` is set nothing more is admitted; the requests that did not finish come back
        with ``finish_reason="abort"`` (not passed to ``on_result``).
        """
        results: list[Result | None] = [None] * len(prepared)
        bar = None
        if self.progress:
            from mmzoo.executor.progress import Progress

            bar = Progress(len(prepared))

        def done(seq: Sequence) -> None:
            results[seq.index] = seq.result
            if bar:
                bar.update(seq.result)
            if on_result:
                on_result(seq.result)

        run = Generation(self, decode_text=decode_text, on_done=done)
        for i, p in enumerate(prepared):
            run.add(p, index=i)
        while run.busy:
            if stop is not None and stop.draining:
                run.drain()
                if stop.expired or not run.sched.running:
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

    def __init__(self, executor: Executor, *, decode_text: Callable[[list[int]], str],
                 on_done: Callable[[Sequence], None] | None = None,
                 on_token: Callable[[Sequence, int], None] | None = None):
        if executor.model is None:
            raise RuntimeError("call setup(model) before generating")
        self.exe, self.decode_text, self.on_done, self.on_token = executor, decode_text, on_done, on_token
        self.sched = Scheduler(executor.max_batch, executor.max_model_len, executor.eos)
        self.inflight = None  # (token ids on the device, [(slot, seq, tokens cached after the step)])
        self._added = 0

    @property
    def busy(self) -> bool:
        """Something is waiting, running or still on the device."""
        return not self.sched.done or self.inflight is not None

    def add(self, prepared: Prepared, *, index: int | None = None) -> Sequence:
        """Queue a request; it is admitted at a coming :meth:`step` (in arrival order)."""
        req = prepared.request
        result = Result(id=req.id, prompt=req.prompt, prompt_token_ids=(
            [] if req.inputs_embeds is not None else [int(t) for t in prepared.input_ids]))
        seq = Sequence(prepared=prepared, result=result, index=self._added if index is None else index,
                       rng=np.random.default_rng(req.seed))
        self._added += 1
        self.sched.add(seq)
        return seq

    def cancel(self, seq: Sequence, reason: str = "abort") -> None:
        """Stop ``seq`` now (a client went away, a stop string matched): its slot is free for the
        next waiting request, its result ends with ``finish_reason=reason``."""
        if seq.result.finish_reason or seq.result.error:  # over already
            return
        if seq in self.sched.waiting:
            self.sched.waiting.remove(seq)
        self.sched.drop(seq)
        seq.result.finish_reason = reason
        seq.result.text = self.decode_text(seq.result.token_ids)
        self._done(seq)

    def drain(self) -> None:
        """Admit nothing more: the waiting sequences leave the queue (not finished); the running
        ones go on."""
        self.sched.waiting.clear()

    def _done(self, seq: Sequence) -> None:
        r = seq.result
        r.latency_s = time.perf_counter() - self.sched.t0 - seq.t_added
        r.graphs_compiled_after_warmup = self.exe.graphs_since_warmup()
        if self.on_done:
            self.on_done(seq)

    def _emit(self, seq: Sequence, token: int, cached: int) -> None:
        finished = self.sched.emit(seq, token, cached, self.decode_text)
        if self.on_token:
            self.on_token(seq, token)
        if finished:
            self._done(seq)

    def step(self) -> None:
        """Admit what fits (prefill, first token), then one decode step for every running sequence."""
        exe, sched = self.exe, self.sched
        admitted = []
        for seq in sched.admit():
            try:
                exe.check_prompt(seq.prepared)
                admitted.append(seq)
            except MmzooError as e:
                self._fail(seq, e)
        for group in exe.prefill_groups([seq.prepared for seq in admitted]):
            self._prefill([admitted[i] for i in group])
        inflight = self.inflight
        flying = {slot: seq for slot, seq, _ in inflight[1]} if inflight else {}
        ahead = {slot for slot, seq in sched.running.items() if flying.get(slot) is seq}  # a token in flight
        go = sched.to_decode(ahead)
        launched = None
        if go:
            inputs = exe.decode_inputs(go, ahead & set(go))
            out = exe.decode(inputs, exe.sampling_for(go, len(inputs.token)), prev=inflight[0] if inflight else None)
            exe.step_done()
            for seq in go.values():
                seq.length += 1
            launched = (out, [(slot, seq, seq.length) for slot, seq in go.items()])
        if inflight:
            tokens = inflight[0].cpu().numpy()
            for slot, seq, cached in inflight[1]:
                if sched.running.get(slot) is seq:
                    self._emit(seq, int(tokens[slot]), cached)
        self.inflight = launched

    def _fail(self, seq: Sequence, error: MmzooError) -> None:
        self.sched.drop(seq)
        seq.result.error = str(error)
        self._done(seq)

    def _prefill(self, seqs: list[Sequence]) -> None:
        """One packed prefill step for ``seqs``; each gets its first token (or its error)."""
        exe = self.exe
        try:
            inputs, failed = exe.prefill_inputs([seq.prepared for seq in seqs], [seq.slot for seq in seqs])
            for i, e in failed.items():
                self._fail(seqs[i], e)
            seqs = [seq for i, seq in enumerate(seqs) if i not in failed]
            if inputs is None:
                return
            first = exe.prefill(inputs, exe.sampling_for(dict(enumerate(seqs)), exe.prefill_rows(len(seqs))))
            exe.step_done()
            tokens = first.cpu().numpy()
        except MmzooError as e:
            for seq in seqs:
                self._fail(seq, e)
            return
        now = time.perf_counter() - self.sched.t0
        for seq, token in zip(seqs, tokens):
            seq.result.ttft_s = now - seq.t_added
            self._emit(seq, int(token), seq.length)

    def settle(self) -> None:
        """Wait for a launched step whose tokens nobody will read (a run stopped early)."""
        if self.inflight is not None:
            self.inflight[0].cpu()
            self.inflight = None


def host_memory_available() -> int | None:
    """The host memory available to new allocations (Linux's ``MemAvailable``), or None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
