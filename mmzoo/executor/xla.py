"""The XLA executor: torch_xla on the PJRT device (TPU where present, the CPU client here).

Every step runs at a padded, bucketed shape so that XLA compiles a small, fixed set of graphs,
all of them at warmup: each tower at each input-row bucket (padding rows carry their own
attention segment, so they change nothing), the prompts at each prefill bucket, and the decode
step at each KV-length and row bucket, each with greedy and sampling heads. After warmup a
compile guard watches torch_xla's compilation counter, and each step runs as its compiled graph
without being traced again (:mod:`mmzoo.executor._replay`).

Its options come in three config groups, each ``auto`` resolved once (:meth:`XLAExecutor.resolve`)
and printed at start: ``executor.buckets`` (:class:`~mmzoo.executor.options.BucketSpec`),
``executor.layout`` and ``executor.compile`` (:mod:`mmzoo.executor.options`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import warnings
from collections import deque
from dataclasses import asdict
from typing import Mapping

import torch

from mmzoo.errors import MmzooError
from mmzoo.executor.base import Executor
from mmzoo.executor.buckets import Buckets
from mmzoo.executor.options import BucketSpec, CompileSpec, LayoutSpec, known, misplaced

_CACHE_DIR: str | None = None


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
        max_logprobs: alternatives per token a request may ask log-probabilities of (:class:`Executor`).
        score_prompts: compile a prompt-scoring step per prefill bucket (:class:`Executor`).
        structured_outputs: compile a constrain step per head and decode row bucket (:class:`Executor`).
        buckets: the ``executor.buckets`` group (:class:`~mmzoo.executor.options.BucketSpec`).
        layout: the ``executor.layout`` group (:class:`~mmzoo.executor.options.LayoutSpec`).
        compile: the ``executor.compile`` group (:class:`~mmzoo.executor.options.CompileSpec`).
        progress: progress bars for warmup and generation.
    """

    name = "xla"

    def __init__(self, *, max_model_len: int = 1024, max_batch: int = 4, max_prefill_tokens: int | None = None,
                 max_logprobs: int = 20, score_prompts: bool = True, structured_outputs: bool = True,
                 buckets: Mapping | None = None,
                 layout: Mapping | None = None, compile: Mapping | None = None, progress: bool = False, **unknown):
        if unknown:
            raise MmzooError(misplaced(unknown))
        super().__init__(max_model_len=max_model_len, max_batch=max_batch, max_prefill_tokens=max_prefill_tokens,
                         max_logprobs=max_logprobs, score_prompts=score_prompts,
                         structured_outputs=structured_outputs, progress=progress)
        self.bucket_spec = BucketSpec.from_config(buckets)
        self.bucket_spec.check(max_model_len=max_model_len, max_batch=max_batch,
                               max_prefill_tokens=self.max_prefill_tokens)
        self.layout_spec = LayoutSpec(**known("executor.layout", LayoutSpec, layout))  # each checked as it is made
        self.compile_spec = spec = CompileSpec(**known("executor.compile", CompileSpec, compile))
        self.warmup_mode, self.on_recompile = spec.mode, spec.on_recompile
        self.do_warmup = spec.mode == "all"
        self.layouts: LayoutSpec | None = None  # resolve(): every layout as true or false
        self.replaying = False  # resolve(): replay_steps against the mesh
        self.layer_graphs = False  # resolve(): layer_graphs as true or false
        self.replaying_blocks = False  # resolve(): with layer_graphs, each block's graph replayed
        self._blocks = None  # prepare_model() with layer_graphs: the LayerReplay, or the cut hooks' handles
        self._replays: dict = {}  # step key (kind and static shape) -> ReplayedStep
        # the state tensors donated to the last two replayed steps: dropping a donated tensor waits
        # for the step that consumed it, so they are let go only once that step is surely done
        self._retired: deque = deque(maxlen=2)
        self._replayed = False  # the last step was replayed: nothing is left to sync
        self.warmup_s: float | None = None
        self._after: int | None = None  # graphs this executor's steps compiled after warmup
        self._seen = 0  # the process-wide compile count when the current step began
        ensure_pjrt_device()
        if spec.cache_dir and os.environ["PJRT_DEVICE"] != "CPU":
            # PJRT's CPU client cannot deserialize executables, so the cache only helps on TPU/GPU.
            _init_cache(os.path.expanduser(str(spec.cache_dir)))
        import torch_xla

        self._xla = torch_xla

    # -- every auto, decided once ---------------------------------------------------------------
    def _buckets(self, model, family) -> Buckets:
        """Resolve the three groups against ``model``'s towers and attention backends, the device
        and the mesh (:meth:`~mmzoo.executor.base.Executor.resolve` calls this once)."""
        mesh, alone = self.sharding is not None, self._cpu_alone()
        spec, backends = self.layout_spec, self._lm_backends(model)
        for key in ("transpose_weights", "transpose_keys"):
            if getattr(spec, key) is True and mesh:
                raise ValueError(f"executor.layout.{key}=true is not supported with a device mesh (the sharding "
                                 f"rules name the usual layout); use auto or false")
        if self.compile_spec.replay_steps is True and mesh:
            raise ValueError("executor.compile.replay_steps=true is not supported with a device mesh; use auto or false")
        auto = {"transpose_weights": alone, "fuse_projections": alone, "rotary_table": True,
                "transpose_keys": alone and all(b.matmul_keys for b in backends)}
        self.layouts = LayoutSpec(**{k: auto[k] if v == "auto" else bool(v) for k, v in asdict(spec).items()})
        cut = self.compile_spec.layer_graphs
        self.layer_graphs = False if cut == "auto" else bool(cut)
        replay = self.compile_spec.replay_steps
        replaying = not mesh if replay == "auto" else bool(replay)
        # with layer graphs, the blocks are replayed (mmzoo.executor._layers) and the rest of a step traced per call
        self.replaying, self.replaying_blocks = replaying and not self.layer_graphs, replaying and self.layer_graphs
        return self.bucket_spec.resolve(max_model_len=self.max_model_len, max_batch=self.max_batch,
                                        max_prefill_tokens=self.max_prefill_tokens,
                                        towers={t: m.encoder for t, m in model.towers.items()},
                                        lm_backends=backends, cpu_alone=alone, mesh=mesh, family=family)

    def resolved(self) -> str:
        on = ", ".join(f"{k}={'on' if v else 'off'}" for k, v in asdict(self.layouts).items())
        return (f"buckets: {self.buckets.describe()}; layout: {on}; compile: warmup={self.warmup_mode}, "
                f"replay_steps={'on' if self.replaying or self.replaying_blocks else 'off'}, "
                f"layer_graphs={'on' if self.layer_graphs else 'off'}, on_recompile={self.on_recompile}")

    def _cpu_alone(self) -> bool:
        """On the XLA CPU client without a device mesh: where the ``auto`` layouts apply."""
        return os.environ.get("PJRT_DEVICE") == "CPU" and self.sharding is None

    @staticmethod
    def _lm_backends(model) -> list:
        """The LM's attention backends: :class:`~mmzoo.backends.AttentionBackend`s, whose declared
        facts (``matmul_keys``, ``skips_past_length``, ``skips_masked_blocks``) pick the layouts."""
        from mmzoo.layers.attention import Attention

        return [m.attn_fn for m in model.lm.modules() if isinstance(m, Attention)]

    # -- layout ---------------------------------------------------------------------------------
    def prepare_model(self, model) -> None:
        """Tabulate the rotaries of the LM and the towers (``rotary_table``) before the model is
        placed; with ``layer_graphs``, run each of its transformer blocks as a graph of its own
        (:mod:`mmzoo.executor._layers`)."""
        if self.layer_graphs:
            from mmzoo.executor import _layers

            if self.replaying_blocks:
                self._blocks = _layers.LayerReplay(model)
            else:
                self._blocks = _layers.cut_at_blocks(model, self._xla.sync)
        if self.layouts.rotary_table:
            model.lm.rotary.tabulate(self.max_model_len)
            if model.lm.sliding_rotary is not None:  # the sliding layers' own RoPE (Gemma 3), same positions
                model.lm.sliding_rotary.tabulate(self.max_model_len)
            for name, tower in model.towers.items():
                if tower.encoder.rotary_input:
                    tower.encoder.rotary.tabulate(self.buckets.tower(name)[-1])

    @property
    def layer_replay(self):
        """With ``layer_graphs`` and replay: the :class:`~mmzoo.executor._layers.LayerReplay` running
        the model's blocks (its graphs); else None."""
        from mmzoo.executor._layers import LayerReplay

        return self._blocks if isinstance(self._blocks, LayerReplay) else None

    def layout(self, name: str, unit, whole: bool, mapped: bool = False) -> None:
        """Stack q/k/v and gate/up into one linear each (``fuse_projections``), then hold linear
        weights transposed (``transpose_weights``), one unit at a time as it is read
        (:mod:`mmzoo.executor._layout`)."""
        from mmzoo.executor import _layout

        if whole and self.layouts.fuse_projections:
            _layout.fuse_projections(unit)
        if self.layouts.transpose_weights:
            _layout.hold_linears_transposed(unit, recurse=whole)

    def layout_extra_params(self, model) -> int:
        head = model.lm.lm_head
        return head.weight.numel() if self.layouts.transpose_weights and model.lm.tie_word_embeddings else 0

    def hold_keys_transposed(self, model) -> bool:
        return self.layouts.transpose_keys

    def memory_available(self) -> int | None:
        """The host's available memory on the XLA CPU client; None on an accelerator (its memory is
        known only once the runtime starts, which must wait for a mesh to be set up)."""
        return super().memory_available() if os.environ.get("PJRT_DEVICE") == "CPU" else None

    def device(self) -> torch.device:
        return self._xla.device()

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
        self._step_begin()
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

    def _step_begin(self) -> None:
        if self._after is not None:
            self._seen = self.compiled_graphs()

    def _step_done(self) -> None:
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

    @property
    def warms_per_run(self) -> bool:
        return self.warmup_mode == "needed"

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
