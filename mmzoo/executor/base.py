"""The runner: the model on a device, and the device steps that run it.

Placement, dtype and layout of the weights, the KV cache in slots and the media buffer, and three
kinds of device step, each ending its own graph (a caller never cuts one):

* **encode** (:meth:`Executor.encode`, per tower and input-row bucket; :mod:`mmzoo.executor.media`):
  a tower's embeddings written into the persistent media buffer at an offset, so the prompt graph
  never depends on media sizes;
* **prefill** (:meth:`Executor.prefill`, per prompt-token bucket): the prompts admitted together
  packed into one row, each attending to itself: merge token and media embeddings, fill each
  prompt's KV-cache slot; then its head step samples each one's first token;
* **decode** (:meth:`Executor.decode`, per cache-length and row bucket): one token for every
  running slot, then sampling. Its input tokens may come from the previous step's device output,
  so the loop can launch step N+1 before reading step N back.

Every size comes from the executor's :class:`~mmzoo.executor.buckets.Buckets`, decided once at
setup. Which sequences run, and when, is the loop's (:mod:`mmzoo.executor.loop`). Inputs are
prepared on the host with numpy and moved once per step, as vLLM's TPU runner does. The eager and
XLA executors differ only in the hooks at the top of :class:`Executor`.
"""

from __future__ import annotations

import copy
from typing import Callable

import numpy as np
import torch

from mmzoo.errors import MmzooError
from mmzoo.executor.buckets import Buckets
from mmzoo.executor.media import MediaSteps
from mmzoo.executor.readout import ReadoutSteps
from mmzoo.executor.steps import DecodeInputs, PrefillInputs, Sampling, StepOut, decode_step, head_step, prefill_step
from mmzoo.lms import KVCache
from mmzoo.types import DTYPES, Prepared


class Executor(MediaSteps, ReadoutSteps):
    """Runs a :class:`~mmzoo.models.MultimodalLM` on one device.

    Args:
        max_model_len: prompt plus generated tokens, the KV cache length per slot.
        max_batch: KV-cache slots, i.e. sequences decoded together.
        max_prefill_tokens: prompt tokens one prefill step takes (vLLM's ``max_num_batched_tokens``):
            prompts admitted together are packed into one step up to this many (None:
            ``max_model_len``).
        max_logprobs: the most alternatives a request may ask log-probabilities of (vLLM's
            ``max_logprobs``): every logprobs step computes this many; 0: no logprobs.
        score_prompts: a scoring step per prefill bucket (:meth:`score`: ``prompt_logprobs``,
            the server's ``echo``), compiled at warmup like the others; false: refuse them.
        structured_outputs: a constrain step per head and decode row bucket (:meth:`constrain`: a
            request's ``structured_outputs`` as a token mask), compiled at warmup; false: refuse them.
        progress: show a progress bar over requests.

    Attributes:
        buckets: the :class:`~mmzoo.executor.buckets.Buckets` every step's size comes from (None
            until :meth:`resolve`).
        do_warmup: whether :func:`mmzoo.build` calls :meth:`warmup` after :meth:`setup`.
    """

    name = "?"
    do_warmup = False

    def __init__(self, *, max_model_len: int = 1024, max_batch: int = 4, max_prefill_tokens: int | None = None,
                 max_logprobs: int = 20, score_prompts: bool = True, structured_outputs: bool = True,
                 progress: bool = False):
        if max_model_len <= 0 or max_batch <= 0:
            raise ValueError(f"max_model_len={max_model_len} and max_batch={max_batch} must be positive")
        if not 0 <= max_logprobs <= 1024:
            raise ValueError(f"max_logprobs={max_logprobs} must lie in [0, 1024]")
        for name, value in (("score_prompts", score_prompts), ("structured_outputs", structured_outputs)):
            if value not in (True, False):
                raise ValueError(f"{name}={value!r}: choose true or false")
        self.structured_outputs = structured_outputs
        self.max_logprobs, self.score_prompts = max_logprobs, score_prompts and max_logprobs > 0
        if max_prefill_tokens is not None and max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens} must be positive")
        self.max_model_len, self.max_batch, self.progress = max_model_len, max_batch, progress
        self.max_prefill_tokens = max_prefill_tokens or max_model_len
        self.buckets: Buckets | None = None
        self.model = None
        self.warm: set = set()  # the warmup Graphs compiled so far (mmzoo.executor.warmup)

    # -- what the executors differ in ------------------------------------------------------
    def device(self) -> torch.device:
        raise NotImplementedError

    def _buckets(self, model, family) -> Buckets:
        """This executor's size policies for ``model`` (:meth:`resolve`)."""
        return Buckets.exact_sizes(max_model_len=self.max_model_len, max_batch=self.max_batch,
                                   max_prefill_tokens=self.max_prefill_tokens)

    def _step_begin(self) -> None:
        """Called before each device step (the XLA executor counts compiles per step from here)."""

    def _step_done(self) -> None:
        """Called after each device step: the step's graph ends here (XLA cuts and launches it)."""

    def graphs_since_warmup(self) -> int | None:
        return 0

    def wait_ready(self) -> None:
        """Return once the work :meth:`setup` left running in the background is done (the eager
        executor's weight packing); requests need not wait for it."""

    def idle(self) -> None:
        """The loop has run everything it was given: the host memory its steps freed goes back to the
        system (:func:`~mmzoo._weights.release_freed_memory`). The allocator keeps freed activations
        for reuse, and across requests of other shapes they add up: Qwen2-VL-2B bf16 on the eager
        executor held 0.27 GB more after an image request and a batch of eight (a peak RSS of 5.58
        GB against 5.47 released at each end); a release takes 9-14 ms there."""
        from mmzoo._weights import release_freed_memory

        release_freed_memory()

    def describe(self) -> str:
        return self.name

    def resolved(self) -> str:
        """Every choice :meth:`resolve` made, in one line (printed at start)."""
        return self.buckets.describe() if self.buckets is not None else "unresolved"

    def hold_keys_transposed(self, model) -> bool:
        """Whether the KV cache holds keys as ``[.., head_dim, len]`` (:class:`~mmzoo.lms.KVCache`)."""
        return False

    def prepare_model(self, model) -> None:
        """Prepare ``model``'s buffers before its weights are placed (XLA: the rotary tables)."""

    def layout(self, name: str, unit, whole: bool, mapped: bool = False):
        """Lay out unit ``name`` on the host between reading and placing its weights
        (:func:`mmzoo._weights.materialize`; ``whole``: an attention or gated MLP with everything
        under it; ``mapped``: its tensors are views of their checkpoint files, not read yet); returns
        a module replacing ``unit``, or None. XLA fuses and transposes, eager packs."""

    def maps_files(self, name: str) -> bool:
        """Whether unit ``name``'s checkpoint tensors already in the run dtype stay views of their file."""
        return False

    def layout_extra_params(self, model) -> int:
        """Parameters :meth:`layout` adds to ``model``'s (a tied head given a layout of its own)."""
        return 0

    def shard(self) -> None:
        """Annotate the placed weights and KV cache with a mesh sharding (:mod:`mmzoo.executor._sharding`)."""

    def use_mesh(self, mesh, model, plan=None) -> None:
        raise MmzooError(f"mesh {mesh} needs executor=xla; the {self.name} executor runs on one device")

    def warmup(self, dummy_media=None) -> float:
        """Compile every step ahead of time (the XLA executor); returns the seconds taken."""
        return 0.0

    @property
    def warms_per_run(self) -> bool:
        """Whether :meth:`warm_for` compiles anything (XLA with ``warmup=needed``)."""
        return False

    def warm_for(self, prepared: list[Prepared], dummy_media=None, *, generate: bool = True) -> float:
        """Compile what a run of ``prepared`` needs and lacks (XLA, ``warmup=needed``); returns the seconds."""
        return 0.0

    def run_step(self, key, fn: Callable[..., tuple], inputs: list[torch.Tensor], state: str) -> list[torch.Tensor]:
        """Run the device step ``fn(*inputs) -> outputs``, which updates the executor's ``state``
        ("cache": the KV cache, "media": the media buffer, None: nothing) in place. ``key`` names the step's
        static shape; the XLA executor replays the compiled graph of each key after its first call."""
        self._step_begin()
        return list(fn(*inputs))

    def memory_available(self) -> int | None:
        """Bytes of memory the device can still give (None: unknown); the CPU's ``MemAvailable``."""
        return host_memory_available()

    # -- setup -----------------------------------------------------------------------------
    def resolve(self, model, family=None) -> Buckets:
        """Decide every size policy (and, on XLA, every ``auto`` option) for ``model`` (built, its
        parameters possibly on the meta device), once: a later call returns the same buckets.
        ``family`` gives a tower's item buckets (:meth:`~mmzoo.models.Family.encoder_buckets`)."""
        if self.buckets is None:
            self.buckets = self._buckets(model, family)
        return self.buckets

    def setup(self, model, *, dtype: str = "float32", eos_token_ids=(), take_ownership: bool = False,
              weights=None, progress=None, family=None) -> None:
        """Place ``model`` on the device in ``dtype`` (``self.model``), laid out for this executor
        (:meth:`layout`); allocate the KV cache and the media buffer.

        Args:
            model: the pipeline; with ``weights``, its parameters are on the meta device.
            take_ownership: lay out and place ``model`` itself (the engine built it for this
                executor alone); else a copy, leaving the caller's module as it was.
            weights: ``name -> tensor or LazyTensor`` (checked already), read and placed unit by
                unit (:func:`mmzoo._weights.materialize`): one unit's tensors at a time on the host.
            progress: ``(done_bytes, total_bytes)`` after each unit is placed.
            family: as :meth:`resolve`, when it has not run yet.
        """
        from mmzoo import _weights
        from mmzoo.layers import Attention, GatedMLP

        if dtype not in DTYPES:
            raise MmzooError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
        self.dtype = DTYPES[dtype]
        buckets = self.resolve(model, family)
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
        self.media = torch.zeros(buckets.media_rows, model.media_width, dtype=self.dtype, device=dev)
        self.eos = set(int(e) for e in eos_token_ids)
        self._encoded_rows: dict = {}  # encode step key -> embedding rows it writes
        self.shard()
        self._step_done()  # materialize weights and buffers, so no step graph contains their creation

    def _tensor(self, array, dtype=None) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype).to(self.device())

    # -- checks on the host ----------------------------------------------------------------
    def check_prompt(self, prepared: Prepared) -> None:
        """Refuse a prompt no prefill step can take (too long for the cache, or for every bucket, or
        its rotary positions past the LM's table)."""
        n = len(prepared.input_ids)
        if n + 1 > self.max_model_len:
            raise MmzooError(f"prompt has {n} tokens; max_model_len={self.max_model_len} leaves no room to generate")
        self.buckets.prefill_len(n)  # raises when no bucket holds it
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

    # -- prefill and decode ------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, inputs: PrefillInputs, sampling: Sampling) -> StepOut:
        """The packed prompts into their cache slots; returns each prompt's first token
        ``[len(sampling.top_k)]`` (a head-rows bucket, on the device; the first ``inputs.count``
        are real). Two steps: :meth:`prefill_hidden`, then :meth:`prefill_head`."""
        return self.prefill_head(self.prefill_hidden(inputs), sampling)

    @torch.no_grad()
    def prefill_hidden(self, inputs: PrefillInputs) -> torch.Tensor:
        """The layers' step of a prefill: writes the prompts' keys and values, returns the hidden
        states at their last positions ``[max_batch, dim]`` (on the device)."""
        window = inputs.window

        def step(*args):
            return (prefill_step(self.model, self.cache, window, *args),)

        args = [self._tensor(inputs.token_rows()), self._tensor(inputs.prompt_rows()), self.media]
        (hidden,) = self.run_step(("prefill", len(inputs.input_ids), window), step, args, "cache")
        self._step_done()  # the layers' graph ends here: the head is a graph of its own
        return hidden

    @torch.no_grad()
    def prefill_head(self, hidden: torch.Tensor, sampling: Sampling) -> StepOut:
        """The head's step of a prefill: the first token of the first ``len(sampling.top_k)``
        prompts from :meth:`prefill_hidden`'s output -> ``[rows]`` (on the device)."""
        rows = len(sampling.top_k)
        extra = [] if sampling.greedy else [self._tensor(sampling.top_k), self._tensor(sampling.floats())]

        def step(hidden, *extra):
            return head_step(self.model, rows, hidden, *extra)

        tokens, logits = self.run_step(("head", rows, sampling.greedy), step, [hidden] + extra, None)
        self._step_done()
        return StepOut(tokens, logits)

    @torch.no_grad()
    def decode(self, inputs: DecodeInputs, sampling: Sampling | None = None,
               prev: torch.Tensor | None = None) -> StepOut:
        """One token for each of the first ``len(inputs.token)`` slots -> ``[max_batch]`` (on the
        device; the slots past those keep ``prev``'s); ``prev`` is the previous step's output,
        read by the ``use_prev`` slots. The step is launched, not waited for."""
        b = len(inputs.token)
        sampling = sampling or Sampling.greedy_rows(b)
        rows = inputs.rows(sampling.top_k)
        floats = [] if sampling.greedy else [self._tensor(sampling.floats())]
        if prev is None:
            prev = self._tensor(np.zeros(self.max_batch, np.int64))
        kv_len = inputs.kv_len

        def step(prev, rows, *floats):
            return decode_step(self.model, self.cache, kv_len, prev, rows, *floats)

        tokens, logits = self.run_step(("decode", sampling.greedy, kv_len, b), step,
                                       [prev, self._tensor(rows)] + floats, "cache")
        self._step_done()
        return StepOut(tokens, logits)

    @torch.no_grad()
    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV-cache slots, ``(source, destination)`` each (a prompt's keys and values into
        its other samples' slots): one step of ``max_batch - 1`` pairs, padded by copying the first
        source onto itself."""
        m = self.max_batch - 1
        src, dst = [s for s, _ in pairs], [d for _, d in pairs]
        src, dst = src + [src[0]] * (m - len(src)), dst + [src[0]] * (m - len(dst))

        def step(src, dst):
            for layer in range(len(self.cache.k)):
                for held in (self.cache.k, self.cache.v):
                    held[layer].index_copy_(0, dst, held[layer].index_select(0, src))
            return ()

        self.run_step(("copy", m), step, [self._tensor(np.array(src)), self._tensor(np.array(dst))], "cache")
        self._step_done()


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
