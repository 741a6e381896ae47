"""The XLA executor's options, in three config groups: ``executor.buckets`` (:class:`BucketSpec`),
``executor.layout`` (:class:`LayoutSpec`) and ``executor.compile`` (:class:`CompileSpec`).

Each group is a dataclass whose fields are its keys (``conf/executor/xla.yaml`` lists them with
their defaults); an unknown key is an error naming the group. ``auto`` values are decided once,
when the engine is built (:meth:`~mmzoo.executor.base.Executor.resolve`): :meth:`BucketSpec.resolve`
gives the :class:`~mmzoo.executor.buckets.Buckets`, the XLA executor the layouts and the replay.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from mmzoo.buckets import doubling, with_top
from mmzoo.errors import MmzooError
from mmzoo.executor.buckets import Buckets

MAX_ITEMS_PER_CALL = 16  # the largest default bucket of a tower whose input rows are whole items


@dataclass
class BucketSpec:
    """The XLA executor's ``executor.buckets`` config group (each field is one key).

    Attributes:
        prefill: padded token counts of a prefill step (one prompt, or several packed); None:
            doubling from ``min_prefill`` to the larger of ``max_model_len`` and
            ``max_prefill_tokens``, in steps of ``prefill_linear_step`` past ``prefill_linear_after``.
        encoder: tower name -> padded input-row counts (Qwen2-VL: patches per call; ``embeds``:
            precomputed-embedding rows). A tower not named: the family's item buckets, else, when
            its encoder's input rows are whole items (``rows_per_item``), doubling from 1 to as
            many items as the media buffer holds (at most 16), else doubling from
            ``min_encoder_rows`` to ``max_encoder_rows``.
        decode_kv: KV-cache lengths a decode step attends over (the smallest holding the longest
            running sequence; ``max_model_len`` is always one). None: doubling from
            ``min_decode_kv``, or only ``max_model_len`` when every LM attention backend skips the
            keys past each sequence's length itself (Pallas).
        decode_rows: the slots a decode step runs (the smallest bucket holding every running
            slot) and the rows of a prefill's head step; ``max_batch`` is always one. ``auto``:
            ``[1, max_batch]`` on the XLA CPU client without a mesh, doubling from
            ``min(8, max_batch)`` on an accelerator (it computes 8 rows at the cost of one),
            ``max_batch`` alone with a device mesh (its slots are split over the data axis).
        windowed_prefill: give each prefill bucket ``s`` a second graph whose attention runs in
            windows of ``w`` tokens (the bucket holding ``s / max_batch``, where ``w <= s / 8``
            divides ``s``), taken by a step whose prompts are none longer than ``w``. ``auto``:
            when every LM attention backend computes the scores its mask hides (sdpa, eager) and the
            family's placeholders attend causally (not Gemma 3's, whose runs attend both ways).
    """

    prefill: list[int] | None = None
    min_prefill: int = 16
    prefill_linear_after: int | None = None
    prefill_linear_step: int | None = None
    encoder: dict[str, list[int]] | None = None
    min_encoder_rows: int = 64
    max_encoder_rows: int = 16384
    decode_kv: list[int] | None = None
    min_decode_kv: int = 128
    decode_rows: Any = "auto"
    windowed_prefill: Any = "auto"

    @classmethod
    def from_config(cls, values: Mapping | None) -> "BucketSpec":
        return cls(**known("executor.buckets", cls, values))

    def check(self, *, max_model_len: int, max_batch: int, max_prefill_tokens: int) -> None:
        """Refuse lists that cannot work, before anything is built."""
        top = max(max_model_len, max_prefill_tokens)
        if self.prefill and max(int(b) for b in self.prefill) > top:
            raise ValueError(f"executor.buckets.prefill={sorted(int(b) for b in self.prefill)}: "
                             f"{max(int(b) for b in self.prefill)} exceeds max_model_len={max_model_len} "
                             f"and max_prefill_tokens={max_prefill_tokens}")
        if self.decode_kv is not None:
            with_top(self.decode_kv, max_model_len, "executor.buckets.decode_kv", "max_model_len")
        if self.decode_rows != "auto":
            with_top(self.decode_rows, max_batch, "executor.buckets.decode_rows", "max_batch")
        auto_or_bool("executor.buckets.windowed_prefill", self.windowed_prefill)

    def resolve(self, *, max_model_len: int, max_batch: int, max_prefill_tokens: int, towers: Mapping,
                lm_backends: list, cpu_alone: bool, mesh: bool, family=None) -> Buckets:
        """The buckets of a model whose towers' encoders are ``towers`` (name -> encoder) and whose
        LM attention backends are ``lm_backends``, on the XLA CPU client without a mesh
        (``cpu_alone``) or not, with a device ``mesh`` or not; ``family`` gives item buckets
        (:meth:`~mmzoo.models.Family.encoder_buckets`)."""
        self.check(max_model_len=max_model_len, max_batch=max_batch, max_prefill_tokens=max_prefill_tokens)
        top = max(max_model_len, max_prefill_tokens)
        prefill = (sorted({int(b) for b in self.prefill}) if self.prefill else
                   doubling(min(self.min_prefill, max_model_len), top, linear_after=self.prefill_linear_after,
                            step=self.prefill_linear_step))
        default = doubling(self.min_encoder_rows, self.max_encoder_rows)
        explicit = {str(k): sorted(int(x) for x in v) for k, v in (self.encoder or {}).items()}
        media_rows = max_model_len + max([default[-1]] + [b[-1] for b in explicit.values()])
        encoder = {}
        for name, enc in towers.items():
            items = family.encoder_buckets(max_model_len=max_model_len, max_media_rows=media_rows) if family else None
            per = enc.rows_per_item  # the Encoder contract (mmzoo.encoders.Encoder)
            encoder[name] = (explicit.get(name) or (sorted(int(n) for n in items) if items is not None else None)
                             or (doubling(1, max(1, min(MAX_ITEMS_PER_CALL, media_rows // per))) if per else default))
        encoder["embeds"] = explicit.get("embeds", default)
        media_rows = max_model_len + max(b[-1] for b in [default, *encoder.values()])
        if self.decode_kv is not None:
            decode_kv = with_top(self.decode_kv, max_model_len, "executor.buckets.decode_kv", "max_model_len")
        elif all(b.skips_past_length for b in lm_backends):
            decode_kv = [max_model_len]
        else:
            decode_kv = doubling(min(self.min_decode_kv, max_model_len), max_model_len)
        if self.decode_rows != "auto":
            rows = with_top(self.decode_rows, max_batch, "executor.buckets.decode_rows", "max_batch")
            if mesh and rows != [max_batch]:
                raise ValueError(f"executor.buckets.decode_rows={rows} is not supported with a device mesh (its "
                                 f"slots are split over the data axis); use auto or [{max_batch}]")
        else:
            rows = ([max_batch] if mesh else sorted({1, max_batch}) if cpu_alone else
                    doubling(min(8, max_batch), max_batch))
        windowed = self.windowed_prefill
        both_ways = family is not None and family.bidirectional_token is not None
        if windowed == "auto":  # a window cannot show a token the later keys of its run (Gemma 3's images)
            windowed = not all(b.skips_masked_blocks for b in lm_backends) and not both_ways
        elif windowed and both_ways:
            raise MmzooError(f"executor.buckets.windowed_prefill=true: model={family.name}'s image tokens attend to "
                             f"their whole run both ways, which a prefill cut into windows cannot see; use auto or "
                             f"false")
        windows = {}
        if windowed:
            for s in prefill:
                w = next((b for b in prefill if b * max_batch >= s), None)
                if w is not None and 8 * w <= s and s % w == 0:
                    windows[s] = w
        return Buckets(max_model_len, max_batch, min(max_prefill_tokens, prefill[-1]), media_rows,
                       prefill=tuple(prefill), encoder={k: tuple(v) for k, v in encoder.items()},
                       decode_kv=tuple(decode_kv), decode_rows=tuple(rows), windows=windows)


def known(group: str, cls, values: Mapping | None) -> dict:
    """``values`` as keyword arguments of the dataclass ``cls``; an unknown key is a clear error."""
    values = dict(values or {})
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise MmzooError(f"{group}: unknown option{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(names)}")
    return {k: _plain(v) for k, v in values.items()}


def _plain(value):
    """An OmegaConf container as plain Python (lists and dicts); anything else as it is."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


@dataclass
class LayoutSpec:
    """``executor.layout``: how weights, the KV cache and the rotaries are held on the device. Each
    is ``auto``, true or false; ``auto`` is decided at setup (the measurements behind each rule:
    docs/benchmarks.md).

    Attributes:
        transpose_weights: linear weights as ``[in, out]`` (:mod:`mmzoo.executor._layout`), which
            removes a weight copy per step on the XLA CPU client; ``auto``: there, without a mesh.
        fuse_projections: attention's q/k/v and the gated MLP's gate/up stacked into one linear
            each (:func:`mmzoo.executor._layout.fuse_projections`); ``auto``: on the XLA CPU
            client without a mesh.
        transpose_keys: the KV cache's keys as ``[.., head_dim, len]``, so decode's ``q @ k^T``
            reads them in place (:class:`~mmzoo.lms.KVCache`); ``auto``: on the XLA CPU client
            without a mesh, when every LM attention backend is matmul-based (sdpa, eager; not
            Pallas, whose kernels read ``[len, head_dim]`` tiles).
        rotary_table: the rotary cos/sin of the LM (positions up to ``max_model_len``) and of each
            tower that names its positions input (``rotary_input``; up to its largest input-row
            bucket) precomputed and gathered per step (:meth:`~mmzoo.layers.Rotary.tabulate`,
            vLLM's ``cos_sin_cache``): computed in the step, XLA evaluates them inside every
            layer's q and k rotation. ``auto``: on.
    """

    transpose_weights: Any = "auto"
    fuse_projections: Any = "auto"
    transpose_keys: Any = "auto"
    rotary_table: Any = "auto"

    def __post_init__(self):
        for f in fields(self):
            auto_or_bool(f"executor.layout.{f.name}", getattr(self, f.name))


@dataclass
class CompileSpec:
    """``executor.compile``: when graphs compile and how steps run them.

    Attributes:
        warmup: ``all`` (or true): every graph of every bucket when the engine is loaded (a
            server: requests come later); ``needed``: before each run, only the graphs its
            requests hit (:meth:`XLAExecutor.warm_for`: a one-shot run or a requests file);
            ``none`` (or false): compile as shapes come, with no guard.
        on_recompile: ``error``, ``warn`` or ``ignore`` when a graph compiles after warmup.
        cache_dir: persistent XLA compilation cache (None: off; PJRT's CPU client cannot read it back).
        replay_steps: after warmup, run each step as its compiled graph with new inputs instead of
            tracing it again on every call (:mod:`mmzoo.executor._replay`); with ``layer_graphs``,
            each block's graph instead (the rest of a step is traced per call); ``auto``: without a
            device mesh.
        layer_graphs: compile each layer once: each transformer block of the model (the LM's
            layers, each tower's blocks) runs as a graph of its own, so the blocks of a stack share
            one compiled graph and compile time does not grow with depth
            (:mod:`mmzoo.executor._layers`). ``auto``: off, the unrolled graphs, which decode
            faster once compiled on the XLA CPU client (measured: docs/benchmarks.md).
    """

    warmup: Any = "all"
    on_recompile: str = "warn"
    cache_dir: str | None = None
    replay_steps: Any = "auto"
    layer_graphs: Any = "auto"

    def __post_init__(self):
        if self.on_recompile not in ("error", "warn", "ignore"):
            raise ValueError(f"executor.compile.on_recompile={self.on_recompile!r}: choose error, warn or ignore")
        auto_or_bool("executor.compile.replay_steps", self.replay_steps)
        auto_or_bool("executor.compile.layer_graphs", self.layer_graphs)
        if self.mode not in ("all", "needed", "none"):
            raise ValueError(f"executor.compile.warmup={self.warmup!r}: choose all, needed or none")

    @property
    def mode(self) -> str:
        """``warmup`` as ``all``, ``needed`` or ``none`` (true and false are ``all`` and ``none``)."""
        return {True: "all", False: "none"}.get(self.warmup, self.warmup)


def auto_or_bool(name: str, value) -> None:
    """Refuse ``value`` of the option ``name`` unless it is ``"auto"``, True or False."""
    if value not in ("auto", True, False):
        raise ValueError(f"{name}={value!r}: choose auto, true or false")


def misplaced(options: Mapping) -> str:
    """The error for XLA executor options given outside their group: where each one belongs."""
    groups = {"buckets": BucketSpec, "layout": LayoutSpec, "compile": CompileSpec}
    where = {f.name: group for group, cls in groups.items() for f in fields(cls)}
    parts = [f"{name!r} (it is executor.{where[name]}.{name})" if name in where else repr(name) for name in options]
    return (f"executor: unknown option{'s' * (len(parts) > 1)} {', '.join(parts)}; the XLA executor takes "
            f"max_model_len, max_batch, max_prefill_tokens, max_logprobs, score_prompts, structured_outputs, progress "
            f"and the groups buckets, layout and compile (conf/executor/xla.yaml)")
