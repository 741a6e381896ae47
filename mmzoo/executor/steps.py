"""The device steps: encode, prefill and decode, as plain functions over typed inputs.

These are the compiled units (gpt-fast keeps its per-step functions the same way): each takes the
model, the state it updates in place (the KV cache or the media buffer) and its inputs, all
already padded to a bucket, so one graph serves every call of that shape. The executor
(:mod:`mmzoo.executor.base`) prepares the inputs on the host, moves them once and runs these,
traced or as replayed graphs.

The inputs are typed on the host (:class:`PrefillInputs`, :class:`DecodeInputs`,
:class:`Sampling`); a step's per-row integers travel to the device as one int64 array and its
sampling floats as one float32 array (each transfer costs about as much as a small kernel), whose
rows are named by :data:`DECODE_ROWS` and :data:`SAMPLING_ROWS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmzoo.executor._sampling import greedy, sample

DECODE_ROWS = ("use_prev", "token", "write", "rope", "top_k")  # the int64 rows of a decode step, in order
SAMPLING_ROWS = ("temperature", "top_p", "uniform")  # the float32 rows of a sampling head, in order


@dataclass
class Sampling:
    """Per-row sampling parameters, ``[rows]`` each: temperature (0: greedy), top-k (0: off), top-p
    (1: off) and one uniform draw (the request's own seeded generator), host arrays."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    uniform: np.ndarray

    @classmethod
    def greedy_rows(cls, rows: int) -> "Sampling":
        return cls(np.zeros(rows, np.float32), np.zeros(rows, np.int64), np.ones(rows, np.float32),
                   np.zeros(rows, np.float32))

    @property
    def greedy(self) -> bool:
        """Every row greedy: the step takes the argmax head, with no sampling inputs."""
        return not bool((self.temperature > 0).any())

    def floats(self) -> np.ndarray:
        """``[3, rows]`` float32 in :data:`SAMPLING_ROWS` order."""
        return np.stack([self.temperature, self.top_p, self.uniform]).astype(np.float32)


@dataclass
class PrefillInputs:
    """One prompt padded to its bucket ``s`` (host arrays)."""

    input_ids: np.ndarray  # [s] int64, zeros past the prompt
    positions: np.ndarray  # [axes, s] rotary positions
    mm_index: np.ndarray  # [s] media-buffer row of each placeholder, -1 elsewhere
    slot: int  # the KV-cache slot the prompt fills
    length: int  # real prompt tokens: the first token is sampled at position length - 1

    @classmethod
    def zeros(cls, s: int, axes: int, slot: int = 0) -> "PrefillInputs":
        """An all-padding prompt of bucket ``s`` (compiling the bucket at warmup)."""
        return cls(np.zeros(s, np.int64), np.zeros((axes, s), np.int64), np.full(s, -1, np.int64), slot, 1)


@dataclass
class DecodeInputs:
    """One decode step over every KV-cache slot (host arrays, ``[slots]`` each); unused slots compute
    garbage that is never read."""

    use_prev: np.ndarray  # 1: the slot's input token is the previous step's device output (not yet read back)
    token: np.ndarray  # the input token otherwise
    write: np.ndarray  # the cache position the token is written at (the sequence's length)
    rope: np.ndarray  # its rotary position (write + the sequence's position delta)
    kv_len: int  # the cache positions attended over (a bucket holding every sequence)

    @classmethod
    def zeros(cls, slots: int, kv_len: int) -> "DecodeInputs":
        """Every slot at the last position of ``kv_len`` (compiling that bucket at warmup)."""
        z = np.zeros(slots, np.int64)
        return cls(z, z.copy(), np.full(slots, kv_len - 1, np.int64), np.full(slots, kv_len - 1, np.int64), kv_len)

    def rows(self, top_k: np.ndarray) -> np.ndarray:
        """``[5, slots]`` int64 in :data:`DECODE_ROWS` order (one host-to-device transfer)."""
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


def prefill_step(model, cache, ids: torch.Tensor, pos: torch.Tensor, index: torch.Tensor, slot: torch.Tensor,
                 logits_index: torch.Tensor, media: torch.Tensor, top_k: torch.Tensor | None = None,
                 *floats: torch.Tensor) -> torch.Tensor:
    """Merge token and media embeddings of one padded prompt ``[1, s]``, write its keys and values
    into ``slot`` (its whole row reset first: nothing of its previous sequence stays), and pick the
    first token from the logits at ``logits_index`` -> ``[1]``."""
    s = ids.shape[1]
    view = cache.prefill(slot, torch.arange(s, device=slot.device)[None])
    logits = model(ids, pos, mm_embeds=media, mm_index=index, cache=view, logits_index=logits_index)
    return _head(logits, top_k, floats)


def decode_step(model, cache, kv_len: int, prev: torch.Tensor, rows: torch.Tensor, *floats: torch.Tensor) -> torch.Tensor:
    """One token for every slot -> ``[slots]``; ``rows`` is :meth:`DecodeInputs.rows` on the device
    and ``prev`` the previous step's output (the input token of the ``use_prev`` slots)."""
    use_prev, token, write, rope, top_k = (rows[DECODE_ROWS.index(n)] for n in DECODE_ROWS)
    b = rows.shape[1]
    axes = model.lm.rotary.num_axes
    tokens = torch.where(use_prev != 0, prev, token)[:, None]  # [b, 1]
    positions = rope[None, :, None].expand(axes, b, 1)  # [axes, b, 1]
    logits = model(tokens, positions, cache=cache.decode(write[:, None], kv_len),
                   attn_kwargs={"q_positions": write[:, None]}, logits_index=torch.zeros_like(write))
    return _head(logits, top_k, floats)
