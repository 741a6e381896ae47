"""The device steps: encode, prefill and decode, as plain functions over typed inputs.

These are the compiled units (gpt-fast keeps its per-step functions the same way): each takes the
model, the state it updates in place (the KV cache or the media buffer) and its inputs, all
already padded to a bucket, so one graph serves every call of that shape. A prefill is two
steps, as in vLLM's TPU runner: the prompts through the layers (a graph per token bucket), then
the LM head and the sampling head on the first token's rows (a graph per row bucket), so the
graphs add up instead of multiplying and one prompt's head computes one row. The executor
(:mod:`mmzoo.executor.base`) prepares the inputs on the host, moves them once and runs these,
traced or as replayed graphs.

The inputs are typed on the host (:class:`PrefillInputs`, :class:`DecodeInputs`,
:class:`Sampling`); a step's per-row integers travel to the device as one int64 array (two for a
prefill: per token and per prompt) and its sampling floats as one float32 array (each transfer
costs about as much as a small kernel), whose rows are named by :data:`DECODE_ROWS`,
:data:`PREFILL_TOKEN_ROWS`, :data:`PREFILL_PROMPT_ROWS` and :data:`SAMPLING_ROWS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from mmzoo.executor._sampling import greedy, sample

DECODE_ROWS = ("use_prev", "token", "write", "rope", "top_k")  # the int64 rows of a decode step, in order
SAMPLING_ROWS = ("temperature", "top_p", "uniform")  # the float32 rows of a sampling head, in order
PREFILL_TOKEN_ROWS = ("input_ids", "mm_index", "segment", "write_slot", "write_pos")  # then the rotary axes
PREFILL_PROMPT_ROWS = ("slot", "last")  # a packed prefill's int64 rows per prompt


class StepOut(NamedTuple):
    """What a head or decode step leaves on the device: its tokens (a decode step's: one per slot)
    and the float32 logits of its rows, which :meth:`Executor.logprobs` reads when asked."""

    tokens: torch.Tensor
    logits: torch.Tensor


@dataclass
class Sampling:
    """Per-row sampling parameters, ``[rows]`` each: temperature (0: greedy), top-k (0: off), top-p
    (1: off), one uniform draw (the request's own seeded generator) and whether the row follows a
    grammar (its token is drawn again from the masked logits: :func:`constrain_step`), host arrays."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    uniform: np.ndarray
    constrained: np.ndarray

    @classmethod
    def greedy_rows(cls, rows: int) -> "Sampling":
        return cls(np.zeros(rows, np.float32), np.zeros(rows, np.int64), np.ones(rows, np.float32),
                   np.zeros(rows, np.float32), np.zeros(rows, np.int64))

    @property
    def greedy(self) -> bool:
        """Every row greedy: the step takes the argmax head, with no sampling inputs."""
        return not bool((self.temperature > 0).any())

    def floats(self) -> np.ndarray:
        """``[3, rows]`` float32 in :data:`SAMPLING_ROWS` order."""
        return np.stack([self.temperature, self.top_p, self.uniform]).astype(np.float32)


@dataclass
class PrefillInputs:
    """Prompts packed into one row of ``s`` tokens (a prefill bucket; host arrays), vLLM-style: each
    prompt attends only to itself (its segment), each token's key and value go to its prompt's
    KV-cache slot, and the first token of every prompt is picked from its last position. One
    graph per bucket serves one prompt or several; the ``rows`` per-prompt entries are padded by
    repeating the first prompt's (``count`` are real).

    With ``window``, the step's attention runs in windows of that many tokens
    (:meth:`~mmzoo.backends._base.AttentionBackend.windowed`): a graph of its own, chosen when no
    prompt is longer, at a fraction of the scores.

    Padding tokens (past the prompts) form their own segment and write their keys at the last
    cache position of the first prompt's slot, which no prompt reaches (a prompt leaves at least
    one position to generate into) and which a decode step writes before it is ever attended to.
    """

    input_ids: np.ndarray  # [s] int64, zeros past the prompts
    positions: np.ndarray  # [axes, s] rotary positions
    mm_index: np.ndarray  # [s] media-buffer row of each placeholder, -1 elsewhere
    segment: np.ndarray  # [s] which prompt each token belongs to (padding: one more)
    write_slot: np.ndarray  # [s] the KV-cache slot each token is written into
    write_pos: np.ndarray  # [s] and the cache position
    slots: np.ndarray  # [rows] the slot each prompt fills
    last: np.ndarray  # [rows] each prompt's last token: its first new token is sampled there
    count: int  # real prompts
    window: int | None = None  # attention in windows of this many tokens (no prompt longer; the executor's choice)

    @classmethod
    def zeros(cls, s: int, axes: int, rows: int, max_len: int) -> "PrefillInputs":
        """All padding in bucket ``s`` with ``rows`` prompt entries (compiling the bucket at warmup)."""
        z = np.zeros(s, np.int64)
        return cls(z, np.zeros((axes, s), np.int64), np.full(s, -1, np.int64), z.copy(), z.copy(),
                   np.full(s, max_len - 1, np.int64), np.zeros(rows, np.int64), np.zeros(rows, np.int64), 0)

    @classmethod
    def pack(cls, s: int, rows: int, max_len: int, prompts: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]
             ) -> "PrefillInputs":
        """Pack ``prompts`` (``(input_ids [n], positions [axes, n], mm_index [n], slot)`` each, their
        ``mm_index`` already pointing at media-buffer rows) into bucket ``s``."""
        axes = prompts[0][1].shape[0]
        out = cls.zeros(s, axes, rows, max_len)
        at = 0
        for i, (ids, pos, index, slot) in enumerate(prompts):
            n = len(ids)
            span = slice(at, at + n)
            out.input_ids[span], out.positions[:, span], out.mm_index[span] = ids, pos, index
            out.segment[span], out.write_slot[span], out.write_pos[span] = i, slot, np.arange(n)
            out.slots[i], out.last[i] = slot, at + n - 1
            at += n
        out.segment[at:], out.write_slot[at:] = len(prompts), prompts[0][3]
        out.slots[len(prompts):], out.last[len(prompts):] = out.slots[0], out.last[0]
        out.count = len(prompts)
        return out

    def token_rows(self) -> np.ndarray:
        """``[5 + axes, s]`` int64 in :data:`PREFILL_TOKEN_ROWS` order, then the rotary positions."""
        return np.concatenate([np.stack([self.input_ids, self.mm_index, self.segment, self.write_slot,
                                         self.write_pos]), self.positions]).astype(np.int64)

    def prompt_rows(self) -> np.ndarray:
        """``[2, rows]`` int64 in :data:`PREFILL_PROMPT_ROWS` order."""
        return np.stack([self.slots, self.last]).astype(np.int64)


@dataclass
class DecodeInputs:
    """One decode step over the first ``rows`` KV-cache slots (host arrays, ``[rows]`` each: a
    bucket holding every running slot); unused slots compute garbage that is never read."""

    use_prev: np.ndarray  # 1: the slot's input token is the previous step's device output (not yet read back)
    token: np.ndarray  # the input token otherwise
    write: np.ndarray  # the cache position the token is written at (the sequence's length)
    rope: np.ndarray  # its rotary position (write + the sequence's position delta)
    kv_len: int  # the cache positions attended over (a bucket holding every sequence)

    @classmethod
    def zeros(cls, rows: int, kv_len: int) -> "DecodeInputs":
        """``rows`` slots at the last position of ``kv_len`` (compiling that bucket at warmup)."""
        z = np.zeros(rows, np.int64)
        return cls(z, z.copy(), np.full(rows, kv_len - 1, np.int64), np.full(rows, kv_len - 1, np.int64), kv_len)

    def rows(self, top_k: np.ndarray) -> np.ndarray:
        """``[5, rows]`` int64 in :data:`DECODE_ROWS` order (one host-to-device transfer)."""
        return np.stack([self.use_prev, self.token, self.write, self.rope, top_k]).astype(np.int64)


def _head(logits: torch.Tensor, top_k: torch.Tensor, floats: tuple) -> torch.Tensor:
    if not floats:
        return greedy(logits)
    (f,) = floats
    return sample(logits, f[SAMPLING_ROWS.index("temperature")], top_k, f[SAMPLING_ROWS.index("top_p")],
                  f[SAMPLING_ROWS.index("uniform")])


def encode_step(model, media: torch.Tensor, tower: str | None, names: list[str], at: torch.Tensor,
                *tensors: torch.Tensor) -> int:
    """Run ``tower`` on its padded inputs (or take precomputed rows, ``tower=None``) and write the
    ``[rows, dim]`` embeddings into ``media`` from row ``at`` on; returns the rows written."""
    emb = tensors[0] if tower is None else model.encode(tower, **dict(zip(names, tensors)))
    idx = torch.arange(emb.shape[0], device=media.device) + at
    media.index_copy_(0, idx, emb.to(media.dtype))
    return emb.shape[0]


def prefill_step(model, cache, window: int | None, tokens: torch.Tensor, prompts: torch.Tensor,
                 media: torch.Tensor) -> torch.Tensor:
    """Packed prompts (:class:`PrefillInputs`): ``tokens`` is its :meth:`~PrefillInputs.token_rows`
    and ``prompts`` its :meth:`~PrefillInputs.prompt_rows` on the device, ``window`` its
    :attr:`~PrefillInputs.window`. Merges token and media embeddings and writes each prompt's keys
    and values into its slot, each prompt attending to itself only -> the last layer's hidden state
    at every prompt's last position ``[rows, dim]``, for :func:`head_step`."""
    ids, index, segment, write_slot, write_pos = (tokens[PREFILL_TOKEN_ROWS.index(n)][None] for n in PREFILL_TOKEN_ROWS)
    positions = tokens[len(PREFILL_TOKEN_ROWS):, None]  # [axes, 1, s]
    slots, last = (prompts[PREFILL_PROMPT_ROWS.index(n)] for n in PREFILL_PROMPT_ROWS)
    view = cache.prefill(slots, write_pos, token_slots=write_slot)
    hidden = model(ids, positions, mm_embeds=media, mm_index=index, cache=view,
                   attn_kwargs={"q_segment_ids": segment, "kv_segment_ids": segment, "window": window},
                   logits_index=last[None], head=False)
    return hidden[0]


def head_step(model, rows: int, hidden: torch.Tensor, *sampling: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first token of a prefill step's first ``rows`` prompts from :func:`prefill_step`'s
    ``hidden [prompts, dim]``: the final norm, the LM head, then the greedy head, or the sampling
    head with ``sampling = (top_k [rows], floats [3, rows])`` (:meth:`Sampling.floats`) -> tokens
    ``[rows]`` and their float32 logits ``[rows, vocab]`` (for :func:`logprobs_step`)."""
    logits = model.lm.logits(hidden[:rows])
    if not sampling:
        return greedy(logits), logits
    top_k, floats = sampling
    return _head(logits, top_k, (floats,)), logits


def decode_step(model, cache, kv_len: int, prev: torch.Tensor, rows: torch.Tensor,
                *floats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of the first ``b`` slots, ``rows`` being :meth:`DecodeInputs.rows`
    ``[5, b]`` on the device and ``prev`` the previous step's output ``[slots]`` (the input token
    of the ``use_prev`` slots) -> ``[slots]``: the new tokens, then ``prev``'s past ``b`` (so every
    step's output has one shape, whatever its rows); and the float32 logits ``[b, vocab]``."""
    use_prev, token, write, rope, top_k = (rows[DECODE_ROWS.index(n)] for n in DECODE_ROWS)
    b = rows.shape[1]
    axes = model.lm.rotary.num_axes
    tokens = torch.where(use_prev != 0, prev[:b], token)[:, None]  # [b, 1]
    positions = rope[None, :, None].expand(axes, b, 1)  # [axes, b, 1]
    logits = model(tokens, positions, cache=cache.decode(write[:, None], kv_len),
                   attn_kwargs={"q_positions": write[:, None]}, logits_index=torch.zeros_like(write))
    out = _head(logits, top_k, floats)
    return (out if b == prev.shape[0] else torch.cat([out, prev[b:]])), logits


_BITS = np.left_shift(1, np.arange(32, dtype=np.int64)).astype(np.uint32).view(np.int32)  # bit i of an int32


def constrain_step(logits: torch.Tensor, tokens: torch.Tensor, bitmask: torch.Tensor, ints: torch.Tensor,
                   *floats: torch.Tensor) -> torch.Tensor:
    """Structured output's token mask (:mod:`mmzoo.structured`) on a head's or decode step's rows:
    ``logits [r, vocab]`` float32 masked by ``bitmask [r, words]`` int32 (bit ``t % 32`` of word
    ``t // 32`` allows token ``t``), then the greedy or sampling head again with the step's own
    parameters (``ints [2, r]``: whether the row is constrained, then top-k; ``floats``:
    :meth:`Sampling.floats`) -> ``tokens [T]`` (the step's, ``T >= r``) with each constrained
    row's token replaced (vLLM's TPU runner masks in a graph of its own the same way)."""
    r, vocab = logits.shape
    constrained, top_k = ints[0], ints[1]
    # each bit by an AND with its power of two: torch_xla 2.9's right shift of a negative int32 by a
    # tensor gives 0 (bit 31 set: a word's last token allowed), where an AND is exact
    bits = torch.from_numpy(_BITS).to(logits.device)
    allowed = (bitmask[:, :, None] & bits).reshape(r, -1)[:, :vocab] != 0  # [r, words, 32] -> [r, vocab]
    masked = logits.masked_fill(~allowed, float("-inf"))
    picked = torch.where(constrained != 0, _head(masked, top_k, floats), tokens[:r])
    return picked if r == tokens.shape[0] else torch.cat([picked, tokens[r:]])


def logprobs_step(k: int, logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Log-probabilities of a head's or decode step's rows (vLLM's TPU runner gathers them in a
    graph of their own the same way): ``logits [r, vocab]`` float32 and the tokens picked from them
    (``tokens``' first ``r``) -> the picked tokens' log-probabilities ``[r]`` and the ``k`` most
    likely tokens ``[r, k]`` with theirs ``[r, k]``, from the log-softmax of the raw logits (before
    temperature and the top-k / top-p cuts: vLLM's default)."""
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, tokens[: logits.shape[0], None]).squeeze(-1)
    values, ids = logp.topk(k, dim=-1)
    return picked, ids, values


def score_step(model, k: int, tokens: torch.Tensor, media: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The log-probability of every prompt token after the first, given the ones before it, for
    one prompt padded to bucket ``s`` (``tokens``: :meth:`PrefillInputs.token_rows`; padding after
    the prompt changes nothing under the causal mask), with the ``k`` likeliest tokens at each
    position -> ``[s - 1]``, ``[s - 1, k]`` ids, ``[s - 1, k]`` log-probabilities. No cache is read or written."""
    ids, index = tokens[PREFILL_TOKEN_ROWS.index("input_ids")], tokens[PREFILL_TOKEN_ROWS.index("mm_index")]
    positions = tokens[len(PREFILL_TOKEN_ROWS):, None]  # [axes, 1, s]
    logits = model(ids[None], positions, mm_embeds=media, mm_index=index[None])[0, :-1]  # predicting ids[1:]
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, ids[1:, None]).squeeze(-1)
    values, top = logp.topk(k, dim=-1)
    return picked, top, values
