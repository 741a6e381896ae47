"""Every size policy of an executor, in one object decided once at setup.

A step's static shape is chosen by these rules alone: the padded token count of a prefill step
(and the attention window of its windowed graph), the padded input rows of each tower's encode
step and of a precomputed-embeddings write, the KV-cache length a decode step attends over and
the slots it runs, the rows of a prefill's head step, the prompt tokens one packed prefill takes,
and the media buffer's rows. The XLA executor pads to buckets (each bucket is one compiled graph;
:class:`~mmzoo.executor.options.BucketSpec` is its ``executor.buckets`` config group, resolved
against the model and the device); the eager executor runs every step at its exact size
(:meth:`Buckets.exact`). The generation loop, the warmup plan and the runner all ask this object,
so a shape rule lives in one place (vLLM's TPU runner computes its paddings once the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from mmzoo.buckets import pick


@dataclass(frozen=True)
class Buckets:
    """The sizes every step runs at (all host integers).

    Attributes:
        max_model_len: KV-cache positions per slot.
        max_batch: KV-cache slots.
        prefill_budget: the most prompt tokens one packed prefill step takes.
        media_rows: rows of the media buffer (every placeholder of the longest prompt, plus the
            padding of the largest encode step).
        prefill: padded prompt-token counts of a prefill step, ascending.
        encoder: tower name (and ``"embeds"``, the precomputed-embeddings write) -> padded input
            rows of its encode step.
        decode_kv: KV-cache lengths a decode step attends over.
        decode_rows: the slots a decode step runs (the first ``n``), and the rows of a prefill's
            head step.
        windows: prefill bucket -> the attention window of its windowed graph (buckets without
            one are absent).
        exact: no padding at all (the eager executor): every rule returns its input.
    """

    max_model_len: int
    max_batch: int
    prefill_budget: int
    media_rows: int
    prefill: tuple[int, ...] = ()
    encoder: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    decode_kv: tuple[int, ...] = ()
    decode_rows: tuple[int, ...] = ()
    windows: Mapping[int, int] = field(default_factory=dict)
    exact: bool = False

    @classmethod
    def exact_sizes(cls, *, max_model_len: int, max_batch: int, max_prefill_tokens: int) -> "Buckets":
        """Every step at its exact size: a decode step runs the slots up to the highest running one
        and attends over the positions its longest sequence holds, a prefill's head the prompts it
        packs, the media buffer one prompt's placeholders."""
        return cls(max_model_len, max_batch, max_prefill_tokens, max_model_len, exact=True)

    # -- the rules --------------------------------------------------------------------------------
    def prefill_len(self, n: int) -> int:
        """The padded token count of a prefill step of ``n`` prompt tokens."""
        return n if self.exact else pick(self.prefill, n, "prompt length (tokens)")

    def tower(self, name: str) -> tuple[int, ...]:
        """The input-row buckets of tower ``name`` (or ``"embeds"``)."""
        return self.encoder[name]

    def encoder_rows(self, tower: str, n: int) -> int:
        """The padded input rows of an encode step of ``n`` rows of ``tower`` (or ``"embeds"``)."""
        return n if self.exact else pick(self.encoder[tower], n, f"{tower} encoder input rows")

    def decode_kv_len(self, n: int) -> int:
        """The KV-cache positions a decode step whose longest sequence will hold ``n`` tokens attends over."""
        return min(n, self.max_model_len) if self.exact else pick(self.decode_kv, n, "decode KV-cache length (tokens)")

    def rows(self, n: int) -> int:
        """The rows of a decode step whose highest running slot is ``n - 1`` (the scheduler fills
        the lowest free slot first, so it runs the first that many slots)."""
        return n if self.exact else pick(self.decode_rows, n, "decode rows (KV-cache slots)")

    def head_rows(self, n: int) -> int:
        """The rows of the head step of a prefill that packs ``n`` prompts."""
        return max(n, 1) if self.exact else pick(self.decode_rows, max(n, 1), "prefill head rows (prompts)")

    def window_of(self, s: int) -> int | None:
        """The attention window of prefill bucket ``s``'s windowed graph, or None: it has none."""
        return self.windows.get(s)

    def prefill_window(self, s: int, longest: int) -> int | None:
        """The window of a packed prefill step of bucket ``s`` whose longest prompt has ``longest``
        tokens, or None: it attends over the whole row."""
        w = self.window_of(s)
        return w if w is not None and longest <= w else None

    def describe(self) -> str:
        """One line: every bucket list, for the start-up report."""
        if self.exact:
            return f"exact sizes (prefill budget {self.prefill_budget} tokens, media buffer {self.media_rows} rows)"
        towers = ", ".join(f"{t} {_short(b)}" for t, b in self.encoder.items())
        windows = f", windows {dict(self.windows)}" if self.windows else ""
        return (f"prefill {_short(self.prefill)} (budget {self.prefill_budget}{windows}); encoder {towers}; "
                f"decode kv {_short(self.decode_kv)}, rows {list(self.decode_rows)}; media buffer {self.media_rows} rows")


def _short(values) -> str:
    values = list(values)
    return str(values) if len(values) <= 6 else f"[{values[0]}, {values[1]}, ... {values[-1]}] ({len(values)})"
