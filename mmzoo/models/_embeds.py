"""Validation of precomputed embeddings where they enter: each error names the field and the numbers."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmzoo.errors import MmzooError


def as_embeds(value: Any, field: str, *, hidden: int) -> torch.Tensor:
    """``[rows, hidden]`` from a 2-D tensor/array, a list of 2-D ones (concatenated in order), or a
    JSON-style list of rows (a list of lists of numbers: one 2-D matrix)."""
    rows_of_numbers = (isinstance(value, (list, tuple)) and len(value) > 0 and isinstance(value[0], (list, tuple))
                       and len(value[0]) > 0 and isinstance(value[0][0], (int, float)))
    parts = value if isinstance(value, (list, tuple)) and not rows_of_numbers else [value]
    tensors = []
    for i, part in enumerate(parts):
        name = f"{field}[{i}]" if len(parts) > 1 or parts[0] is not value else field
        try:
            t = torch.as_tensor(np.asarray(part) if not isinstance(part, torch.Tensor) else part)
        except (TypeError, ValueError) as e:
            raise MmzooError(f"{name} is not a numeric array ({e})") from None
        if t.dim() != 2:
            raise MmzooError(f"{name} must be 2-D [rows, hidden], got shape {list(t.shape)}")
        if not t.is_floating_point():
            raise MmzooError(f"{name} must be floating point, got {t.dtype}")
        if t.shape[1] != hidden:
            raise MmzooError(f"{name} has hidden size {t.shape[1]} but the LM's hidden size is {hidden}")
        if t.shape[0] == 0:
            raise MmzooError(f"{name} has no rows")
        bad = ~torch.isfinite(t)
        if bad.any():  # refused here: a NaN in a cache slot would reach whatever shares the batch
            row, col = (int(i) for i in bad.nonzero()[0])
            raise MmzooError(f"{name} holds {int(bad.sum())} non-finite values (NaN or inf), the first at "
                             f"[{row}, {col}] = {t[row, col].item()}")
        tensors.append(t)
    if not tensors:
        raise MmzooError(f"{field} is empty")
    return tensors[0] if len(tensors) == 1 else torch.cat([t.to(tensors[0].dtype) for t in tensors])


def as_grid(value: Any, field: str) -> np.ndarray:
    """``[num_items, 3]`` positive integers (at most :data:`MAX_GRID` each)."""
    try:
        g = np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError, OverflowError) as e:
        raise MmzooError(f"{field} is not an integer array ({e})") from None
    if g.ndim == 1 and g.shape == (3,):
        g = g[None]
    if g.ndim != 2 or g.shape[1] != 3:
        raise MmzooError(f"{field} must be [num_items, 3] (t, h, w), got shape {list(g.shape)}")
    if g.size and g.dtype.kind not in "iuf" or g.dtype == object:
        raise MmzooError(f"{field} must hold integers, got {g.dtype} ({g.ravel()[0]!r})")
    if g.size and g.dtype.kind == "f" and not (np.all(np.isfinite(g)) and np.all(np.equal(np.mod(g, 1), 0))):
        raise MmzooError(f"{field} must hold integers, got {g.dtype}")
    if g.size and (g.min() <= 0 or g.max() > MAX_GRID):
        raise MmzooError(f"{field} entries must be in [1, {MAX_GRID}], got {g.tolist()}"[:300])
    return g.astype(np.int64)


def embeds_media(embeds: Any, field: str, *, hidden: int, counts: list[int], grid: np.ndarray | None, tower: str,
                 implied: str):
    """Precomputed embeddings of items of ``counts`` placeholder tokens each (from their layout
    ``grid``) as a :class:`~mmzoo.models.Media` of one embeddings call; ``implied`` names what the
    counts came from, for the message (``"tiles x 4 tokens per tile"``).

    Raises:
        MmzooError: the rows are not the counts' sum (or :func:`as_embeds`'s checks)."""
    from mmzoo.models.family import Media
    from mmzoo.types import TowerInput

    emb = as_embeds(embeds, field, hidden=hidden)
    if emb.shape[0] != sum(counts):
        layout = "" if grid is None else f" {field.replace('_embeds', '_grid_thw')} {grid.tolist()}"
        raise MmzooError(f"{field} has {emb.shape[0]} rows but{layout} implies {sum(counts)} ({implied})")
    return Media(counts=counts, grid=grid, calls=[TowerInput(tower=tower, inputs={}, num_embeds=emb.shape[0],
                                                             embeds=emb)])


MAX_GRID = 1 << 16  # patches along one axis: far past any image (and the int64 products stay exact)
