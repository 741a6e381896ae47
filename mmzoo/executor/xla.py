"""The XLA executor: torch_xla on the PJRT device (TPU where present, the CPU client here).

Every step runs at a padded, bucketed shape so that XLA compiles a small, fixed set of graphs,
all of them at warmup: each tower at each input-row bucket (padding rows carry their own
attention segment, so they change nothing), the prompts at each prefill bucket, and one decode
step, each with greedy and sampling heads. After warmup a compile guard watches torch_xla's
compilation counter, and each step runs as its compiled graph without being traced again
(:mod:`mmzoo.executor._replay`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import warnings
from collections import deque

import torch

from mmzoo.buckets import doubling, pick, with_top
from mmzoo.executor.base import Executor

_CACHE_DIR: str | None = None
MAX_ITEMS_PER_CALL = 16  # the default largest bucket of a tower whose rows are images or clips


class RecompileError(RuntimeError):
    """A graph was compiled after warmup while ``on_recompile=error``."""


def ensure_pjrt_device() -> str:
    """Default ``PJRT_DEVICE`` to CPU when no TPU runtime is installed; the environment wins."""
    if "PJRT_DEVICE" not in os.environ:
        os.environ["PJRT_DEVICE"] = "TPU" if importlib.util.find_spec("libtpu") else "CPU"
    return os.environ["PJRT_DEVICE"]


class XLAExecutor(Executor):
    """Bucketed execution on an XLA device.

    Args:
        max_model_len: KV-cache length per slot; the largest prefill bucket.
        max_batch: decode slots.
        max_prefill_tokens: prompt tokens one packed prefill step takes (:class:`Executor`);
            None: ``max_model_len``.
        prefill_buckets: padded token counts of a prefill step (one prompt, or several packed);
            default: doubling from ``min_prefill`` to the larger of ``max_model_len`` and
            ``max_prefill_tokens``, in steps of ``prefill_linear_step`` past ``prefill_linear_after``.
        encoder_buckets: tower name -> padded input-row counts (Qwen2-VL: patches per call);
            default: doubling from ``min_encoder_rows`` to ``max_encoder_rows``.
        decode_kv_buckets: KV-cache lengths a decode step attends over (the smallest that holds
            the longest active sequence), so a step with short sequences reads only the start of
            the cache; ``max_model_len`` is always one. Default: doubling from ``min_decode_kv``,
            or only ``max_model_len`` when every LM attention backend skips the keys past each
            sequence's length itself (Pallas).
        decode_batch_buckets: rows of a decode step: it runs the first ``n`` KV-cache slots, the
            smallest bucket holding every running slot (the scheduler fills the lowest free slot
            first), so a batch-1 step pays for one row, not ``max_batch`` (on the XLA CPU client a
            64M-parameter step cost ~9 ms at 1 row and ~19 ms at 8). A prefill's head step (the
            LM head and sampling of its prompts' first tokens) takes the bucket holding its
            prompts. ``max_batch`` is always one.
            Default (``"auto"``): ``[1, max_batch]`` on the XLA CPU client without a mesh (one
            request alone runs one row; each bucket adds a graph per KV bucket and head to
            ``warmup=all``, so finer ones are left to an explicit list); elsewhere doubling from
            ``min(8, max_batch)`` (an accelerator computes 8 rows at the cost of one; vLLM pads to
            8 on TPU); ``max_batch`` only with a device mesh (its slots are split over the data
            axis).
        warmup: ``all`` (or true): compile every graph of every bucket when the engine is loaded
            (a server: requests come later); ``needed``: before each run, compile only the graphs
            its requests hit (:meth:`warm_for`: a one-shot run or a requests file, known up front);
            ``none`` (or false): compile as shapes come, with no guard.
        on_recompile: ``error``, ``warn`` or ``ignore`` when a graph compiles after warmup.
        compile_cache_dir: persistent XLA compilation cache (None: off).
        progress: progress bars for warmup and generation.
        transpose_weights: hold linear weights as ``[in, out]`` (:mod:`mmzoo.executor._layout`);
            ``"auto"``: on the XLA CPU client without a mesh, where it removes a weight copy per step.
        fuse_projections: stack attention's q/k/v and the gated MLP's gate/up projections into one
            linear each (:func:`mmzoo.executor._layout.fuse_projections`); ``"auto"``: on the XLA
            CPU client without a mesh.
        transpose_keys: hold the KV cache's keys as ``[.., head_dim, len]``, so the decode step's
            ``q @ k^T`` reads them in place (:class:`~mmzoo.lms.KVCache`); ``"auto"``: on the XLA
            CPU client without a mesh, when every LM attention backend is matmul-based (sdpa,
            eager; not Pallas, whose kernels read ``[len, head_dim]`` tiles).
        windowed_prefill: give each prefill bucket ``s`` a second graph whose attention runs in
            windows of ``w`` tokens, the bucket that holds ``s / max_batch`` (the share of an even
            full step), where ``w <= s / 8`` divides ``s``; a step whose prompts are none longer
            than ``w`` takes it (:meth:`~mmzoo.backends._base.AttentionBackend.windowed`:
            ``s * 2w`` scores instead of ``s * s``, at most a quarter). With 4 slots (``w = s / 4``)
            a 512-token step gained 11%, not worth a graph per bucket in every such server's
            warmup. ``"auto"``: when every LM attention backend computes the scores its mask
            hides (sdpa, eager; Pallas' kernel skips them).
        rotary_table: precompute the rotary cos/sin of the LM (positions ``0 .. max_model_len - 1``)
            and of each tower that names its positions input (``rotary_input``; positions up to
            its largest input-row bucket) (:meth:`~mmzoo.layers.Rotary.tabulate`, vLLM's
            ``cos_sin_cache``) and gather them per step: XLA otherwise fuses the cos/sin into
            every layer's q and k rotation and evaluates them there per element and per head (on
            the XLA CPU client the bench model's prefill steps took ~10% longer, a 448 x 448
            image's first token ~6%). ``"auto"``: on. Positions are checked on the host
            (:meth:`~mmzoo.executor.base.Executor.check_prompt`, :meth:`~mmzoo.executor.base.Executor.encode`).
        replay_steps: after warmup, run each step (encode, prefill, decode) as its compiled graph
            with new inputs instead of tracing it again on every call
            (:mod:`mmzoo.executor._replay`); ``"auto"``: without a device mesh.
    """

    name = "xla"

    def __init__(self, *, max_model_len: int = 1024, max_batch: int = 4, max_prefill_tokens: int | None = None,
                 prefill_buckets: list[int] | None = None,
                 min_prefill: int = 16, prefill_linear_after: int | None = None, prefill_linear_step: int | None = None,
                 encoder_buckets: dict[str, list[int]] | None = None, min_encoder_rows: int = 64,
                 max_encoder_rows: int = 16384, decode_kv_buckets: list[int] | None = None,
                 min_decode_kv: int = 128, warmup: bool | str = "all", on_recompile: str = "warn",
                 compile_cache_dir: str | None = None, progress: bool = False, transpose_weights: bool | str = "auto",
                 fuse_projections: bool | str = "auto", transpose_keys: bool | str = "auto",
                 replay_steps: bool | str = "auto", windowed_prefill: bool | str = "auto",
                 decode_batch_buckets: list[int] | str | None = "auto", rotary_table: bool | str = "auto"):
        super().__init__(max_model_len=max_model_len, max_batch=max_batch, max_prefill_tokens=max_prefill_tokens,
                         progress=progress)
        if on_recompile not in ("error", "warn", "ignore"):
            raise ValueError(f"on_recompile={on_recompile!r}: choose error, warn or ignore")
        top = max(max_model_len, self.max_prefill_tokens)
        self.prefill_buckets = (sorted(int(b) for b in prefill_buckets) if prefill_buckets else
                                doubling(min(min_prefill, max_model_len), top,
                                         linear_after=prefill_linear_after, step=prefill_linear_step))
        if self.prefill_buckets[-1] > top:
            raise ValueError(f"prefill bucket {self.prefill_buckets[-1]} exceeds max_model_len={max_model_len} "
                             f"and max_prefill_tokens={self.max_prefill_tokens}")
        self.encoder_buckets = {k: sorted(int(x) for x in v) for k, v in (encoder_buckets or {}).items()}
        self.default_encoder_buckets = doubling(min_encoder_rows, max_encoder_rows)
        if decode_kv_buckets is not None:
            self._kv_buckets = with_top(decode_kv_buckets, max_model_len, "decode_kv_buckets", "max_model_len")
        else:
            self._kv_buckets = None  # resolved in setup(), against the model's attention backends
        self.min_decode_kv = min_decode_kv
        self.decode_kv_buckets: list[int] = []
        if decode_batch_buckets in (None, "auto"):
            self._batch_buckets = None  # resolved in setup(), against the device and the mesh
        else:
            self._batch_buckets = with_top(decode_batch_buckets, max_batch, "decode_batch_buckets", "max_batch")
        self.decode_batch_buckets: list[int] = []
        self.transpose_weights = _auto_or_bool("transpose_weights", transpose_weights)
        self.fuse_projections = _auto_or_bool("fuse_projections", fuse_projections)
        self.transpose_keys = _auto_or_bool("transpose_keys", transpose_keys)
        self.replay_steps = _auto_or_bool("replay_steps", replay_steps)
        self.windowed_prefill = _auto_or_bool("windowed_prefill", windowed_prefill)
        self.rotary_table = _auto_or_bool("rotary_table", rotary_table)
        self.replaying = False  # set by setup(): replay_steps resolved against the mesh
        self._replays: dict = {}  # step key (kind and static shape) -> ReplayedStep
        # the state tensors donated to the last two replayed steps: dropping a donated tensor waits
        # for the step that consumed it, so they are let go only once that step is surely done
        self._retired: deque = deque(maxlen=2)
        self._replayed = False  # the last step was replayed: nothing is left to sync
        mode = {True: "all", False: "none"}.get(warmup, warmup)
        if mode not in ("all", "needed", "none"):
            raise ValueError(f"warmup={warmup!r}: choose all, needed or none")
        self.warmup_mode, self.on_recompile = mode, on_recompile
        self.do_warmup = mode == "all"
        self.warmup_s: float | None = None
        self._after: int | None = None  # graphs this executor's steps compiled after warmup
        self._seen = 0  # the process-wide compile count when the current step began
        ensure_pjrt_device()
        if compile_cache_dir and os.environ["PJRT_DEVICE"] != "CPU":
            # PJRT's CPU client cannot deserialize executables, so the cache only helps on TPU/GPU.
            _init_cache(os.path.expanduser(str(compile_cache_dir)))
        import torch_xla

        self._xla = torch_xla

    def setup(self, model, *, dtype: str = "float32", eos_token_ids=(), take_ownership: bool = False,
              weights=None, progress=None) -> None:
        if self.transpose_weights is True and self.sharding is not None:
            raise ValueError("transpose_weights=true is not supported with a device mesh (the sharding rules "
                             "name [out, in] weights); use auto or false")
        if self.replay_steps is True and self.sharding is not None:
            raise ValueError("replay_steps=true is not supported with a device mesh; use auto or false")
        for tower, module in model.towers.items():  # towers whose input rows are whole items (images, clips)
            per = module.encoder.rows_per_item  # the Encoder contract (mmzoo.encoders.Encoder)
            if tower not in self.encoder_buckets and per:
                self.encoder_buckets[tower] = doubling(1, max(1, min(MAX_ITEMS_PER_CALL, self.max_media_rows() // per)))
        super().setup(model, dtype=dtype, eos_token_ids=eos_token_ids, take_ownership=take_ownership,
                      weights=weights, progress=progress)
        self.replaying = self.sharding is None if self.replay_steps == "auto" else bool(self.replay_steps)
        skipping = all(b.skips_past_length for b in self._lm_backends(self.model))
        self.decode_kv_buckets = self._kv_buckets or (
            [self.max_model_len] if skipping else doubling(min(self.min_decode_kv, self.max_model_len),
                                                           self.max_model_len))
        if self._batch_buckets is not None and self.sharding is not None and self._batch_buckets != [self.max_batch]:
            raise ValueError(f"decode_batch_buckets={self._batch_buckets} is not supported with a device mesh (its "
                             f"slots are split over the data axis); use auto or [{self.max_batch}]")
        self.decode_batch_buckets = self._batch_buckets or (
            [self.max_batch] if self.sharding is not None else
            sorted({1, self.max_batch}) if self._cpu_alone() else doubling(min(8, self.max_batch), self.max_batch))
        if self.windowed_prefill == "auto":
            self.windowed_prefill = not all(b.skips_masked_blocks for b in self._lm_backends(self.model))

    def _transposing(self) -> bool:
        return self._cpu_alone() if self.transpose_weights == "auto" else bool(self.transpose_weights)

    def _fusing(self) -> bool:
        return self._cpu_alone() if self.fuse_projections == "auto" else bool(self.fuse_projections)

    def prepare_model(self, model) -> None:
        """Tabulate the rotaries of the LM and the towers (``rotary_table``) before the model is placed."""
        if self.rotary_table in ("auto", True):
            model.lm.rotary.tabulate(self.max_model_len)
            for name, tower in model.towers.items():
                if tower.encoder.rotary_input:
                    tower.encoder.rotary.tabulate(self.tower_buckets(name)[-1])

    def layout(self, name: str, unit, whole: bool) -> None:
        """Stack q/k/v and gate/up into one linear each (``fuse_projections``), then hold linear
        weights transposed (``transpose_weights``), one unit at a time as it is read
        (:mod:`mmzoo.executor._layout`)."""
        from mmzoo.executor import _layout

        if whole and self._fusing():
            _layout.fuse_projections(unit)
        if self._transposing():
            _layout.hold_linears_transposed(unit, recurse=whole)

    def memory_available(self) -> int | None:
        """The host's available memory on the XLA CPU client; None on an accelerator (its memory is
        known only once the runtime starts, which must wait for a mesh to be set up)."""
        return super().memory_available() if os.environ.get("PJRT_DEVICE") == "CPU" else None

    def layout_extra_params(self, model) -> int:
        head = model.lm.lm_head
        return head.weight.numel() if self._transposing() and model.lm.tie_word_embeddings else 0

    def hold_keys_transposed(self, model) -> bool:
        if self.transpose_keys is True and self.sharding is not None:
            raise ValueError("transpose_keys=true is not supported with a device mesh (the sharding rules name "
                             "[slots, heads, len, head_dim] keys); use auto or false")
        if self.transpose_keys != "auto":
            return bool(self.transpose_keys)
        return self._cpu_alone() and all(b.matmul_keys for b in self._lm_backends(model))

    def _cpu_alone(self) -> bool:
        """On the XLA CPU client without a device mesh: where the ``auto`` layouts apply."""
        return os.environ.get("PJRT_DEVICE") == "CPU" and self.sharding is None

    @staticmethod
    def _lm_backends(model) -> list:
        """The LM's attention backends: :class:`~mmzoo.backends.AttentionBackend`s, whose declared
        facts (``matmul_keys``, ``skips_past_length``, ``skips_masked_blocks``) pick the layouts."""
        from mmzoo.layers.attention import Attention

        return [m.attn_fn for m in model.lm.modules() if isinstance(m, Attention)]

    # -- steps: traced once, then replayed ----------------------------------------------------
    def _state(self, name: str | None) -> list[torch.Tensor]:
        return self.cache.k + self.cache.v if name == "cache" else [self.media] if name == "media" else []

    def _hold(self, name: str | None, tensors: list[torch.Tensor]) -> None:
        if name is None:
            return
        if name == "cache":
            n = len(self.cache.k)
            self.cache.k[:], self.cache.v[:] = tensors[:n], tensors[n:]
        else:
            (self.media,) = tensors

    def run_step(self, key, fn, inputs, state):
        if not self.replaying:
            return super().run_step(key, fn, inputs, state)
        self.step_begin()
        step = self._replays.get(key)
        if step is None:  # the first call at this shape (warmup): trace and compile it
            from mmzoo.executor._replay import ReplayedStep

            def traced(ins, tensors):  # fn on the state copies ReplayedStep traces with
                real = self._state(state)
                self._hold(state, tensors)
                try:
                    return fn(*ins)
                finally:
                    self._hold(state, real)

            step = self._replays[key] = ReplayedStep(traced, inputs, self._state(state))
        old = self._state(state)
        outputs, new = step(inputs, old)
        self._retired.append(old)
        self._hold(state, new)
        self._replayed = True
        return outputs

    # -- shapes ----------------------------------------------------------------------------
    def device(self) -> torch.device:
        return self._xla.device()

    def tower_buckets(self, tower: str) -> list[int]:
        return self.encoder_buckets.get(tower, self.default_encoder_buckets)

    def prefill_len(self, n: int) -> int:
        return pick(self.prefill_buckets, n, "prompt length (tokens)")

    def prefill_budget(self) -> int:
        return min(self.max_prefill_tokens, self.prefill_buckets[-1])

    def window_of(self, s: int) -> int | None:
        """The window of prefill bucket ``s``'s windowed graph (``windowed_prefill``), or None."""
        if self.windowed_prefill is not True:
            return None
        w = next((b for b in self.prefill_buckets if b * self.max_batch >= s), None)
        return w if w is not None and 8 * w <= s and s % w == 0 else None

    def encoder_rows(self, tower: str, n: int) -> int:
        return pick(self.tower_buckets(tower), n, f"{tower} encoder input rows")

    def decode_kv_len(self, n: int) -> int:
        return pick(self.decode_kv_buckets, n, "decode KV-cache length (tokens)")

    def decode_rows(self, n: int) -> int:
        return pick(self.decode_batch_buckets, n, "decode rows (KV-cache slots)")

    def prefill_rows(self, n: int) -> int:
        return pick(self.decode_batch_buckets, max(n, 1), "prefill head rows (prompts)")

    def max_media_rows(self) -> int:
        largest = max([self.default_encoder_buckets[-1]] + [b[-1] for b in self.encoder_buckets.values()])
        return self.max_model_len + largest

    # -- compile accounting ----------------------------------------------------------------
    @staticmethod
    def _compile_metric() -> tuple[int, float]:
        """torch_xla's CompileTime metric: graphs compiled in this process so far, and seconds spent."""
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return (int(data[0]), float(data[1]) / 1e9) if data else (0, 0.0)

    @classmethod
    def compiled_graphs(cls) -> int:
        """Graphs XLA has compiled in this process so far."""
        return cls._compile_metric()[0]

    @classmethod
    def compile_seconds(cls) -> float:
        """Seconds XLA's compiler has spent in this process so far."""
        return cls._compile_metric()[1]

    def graphs_since_warmup(self) -> int | None:
        """Graphs this executor's own steps compiled after its warmup (None before it). torch_xla's
        counter is process-wide, so compiles between this executor's steps (another engine's
        warmup, say) are not counted."""
        return self._after

    def step_begin(self) -> None:
        if self._after is not None:
            self._seen = self.compiled_graphs()

    def step_done(self) -> None:
        if not self._replayed:  # a replayed step is already running: a sync would only wait for it
            self._xla.sync()
        self._replayed = False
        if self._after is None:
            return
        count = self.compiled_graphs()
        if count > self._seen:
            new, self._seen = count - self._seen, count
            self._after += new
            msg = (f"mmzoo: {new} XLA graph(s) compiled after warmup ({self._after} in all): "
                   f"a shape outside the warmed-up buckets")
            if self.on_recompile == "error":
                raise RecompileError(msg)
            if self.on_recompile == "warn":
                warnings.warn(msg, stacklevel=2)

    def describe(self) -> str:
        # the device count, not torch_xla.device(): asking for the device would fix the process to
        # non-SPMD before a mesh can be set up (infer prints this before loading)
        import torch_xla.runtime as xr

        n = xr.global_runtime_device_count()
        mesh = f", {self.sharding.describe()}" if self.sharding is not None else ""
        return f"xla (PJRT_DEVICE={os.environ.get('PJRT_DEVICE')}, {n} device{'s' if n > 1 else ''}{mesh})"

    # -- sharding over a device mesh (torch_xla SPMD: mmzoo/executor/_sharding.py) --------------
    sharding = None  # a DeviceMesh after use_mesh()

    def use_mesh(self, mesh, model, plan=None) -> None:
        """Split ``model`` (built, not yet placed) over ``mesh`` (a :class:`MeshSpec`) by ``plan``
        (parameter-name patterns -> styles; None: :data:`mmzoo.models.TP_PLAN`): validates the mesh
        against the model's heads, ``max_batch`` and the devices, then turns SPMD on. Call before
        :meth:`setup`, which then annotates the weights and the KV cache."""
        from mmzoo.executor._sharding import DeviceMesh, ShardingPlan

        if self.model is not None:
            raise RuntimeError("use_mesh() must come before setup()")
        self.sharding = DeviceMesh(ShardingPlan(mesh, model, max_batch=self.max_batch, rules=plan))

    def shard(self) -> None:
        if self.sharding is not None:
            self.sharding.place(self.model, self.cache)

    # -- warmup ----------------------------------------------------------------------------
    def warmup(self, dummy_media=None) -> float:
        """Compile every graph (:mod:`mmzoo.executor.warmup`); ``dummy_media(tower, rows)`` gives a
        :class:`TowerInput` of that many rows (None: the towers are not compiled). Returns the
        seconds taken; afterwards the compile guard is armed."""
        from mmzoo.executor import warmup

        t0 = time.perf_counter()
        towers = list(self.model.towers) if dummy_media is not None else []
        warmup.run(self, warmup.plan(self, towers), dummy_media, progress=self.progress)
        self.warmup_s = time.perf_counter() - t0
        self._seen, self._after = self.compiled_graphs(), 0
        return self.warmup_s

    def warm_for(self, prepared, dummy_media=None, *, generate: bool = True) -> float:
        """With ``warmup=needed``: compile the graphs ``prepared`` can hit that are not compiled
        yet (:func:`mmzoo.executor.warmup.needed`), printing the plan, then arm the compile guard
        (if the run uses any other graph, ``on_recompile`` says what happens)."""
        if self.warmup_mode != "needed":
            return 0.0
        from mmzoo.executor import warmup

        graphs = [g for g in warmup.needed(self, prepared, generate=generate) if g not in self.warm]
        if dummy_media is None:
            graphs = [g for g in graphs if g.kind != "encode"]
        t0 = time.perf_counter()
        if graphs:
            print(f"mmzoo: compiling {len(graphs)} graph{'s' * (len(graphs) > 1)}: {warmup.describe(graphs)}",
                  file=sys.stderr, flush=True)
            after = self._after
            self._after = None  # these compiles are the warmup's, not the run's
            xla_s = self.compile_seconds()
            warmup.run(self, graphs, dummy_media, progress=self.progress)
            xla_s = self.compile_seconds() - xla_s
            self._after = after
        secs = time.perf_counter() - t0
        if graphs:
            print(f"mmzoo: compiled {len(graphs)} graph{'s' * (len(graphs) > 1)} in {secs:.1f} s (XLA's compiler "
                  f"{xla_s:.1f} s; tracing, lowering and the first runs {secs - xla_s:.1f} s)",
                  file=sys.stderr, flush=True)
        self.warmup_s = (self.warmup_s or 0.0) + secs
        self._seen = self.compiled_graphs()
        if self._after is None:
            self._after = 0
        return secs


def _auto_or_bool(name: str, value):
    """``value`` of the option ``name`` if it is ``"auto"``, True or False; else a clear error."""
    if value not in ("auto", True, False):
        raise ValueError(f"{name}={value!r}: choose auto, true or false")
    return value


def _init_cache(path: str) -> None:
    """torch_xla's persistent compilation cache; must precede the first computation, once per process."""
    global _CACHE_DIR
    if _CACHE_DIR is not None:
        if _CACHE_DIR != path:
            print(f"mmzoo: XLA compilation cache already at {_CACHE_DIR}; ignoring {path}", file=sys.stderr)
        return
    import torch_xla.runtime as xr

    os.makedirs(path, exist_ok=True)
    try:
        xr.initialize_cache(path, readonly=False)
    except RuntimeError as e:  # a computation already ran in this process
        print(f"mmzoo: XLA compilation cache not enabled ({e})", file=sys.stderr)
        return
    _CACHE_DIR = path
