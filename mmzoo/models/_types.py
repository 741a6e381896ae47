"""Requests and their host-side preparation, shared by every model family and executor."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Request:
    """One generation request, as a user or a ``requests=`` line gives it."""

    prompt: str = ""
    images: list[Any] = field(default_factory=list)  # paths or PIL images
    videos: list[Any] = field(default_factory=list)  # paths, or lists of frames
    max_new_tokens: int = 32
    ignore_eos: bool = False
    id: Any = None


@dataclass
class TowerInput:
    """What one tower call of one request needs: arrays with a leading row axis.

    ``pad`` gives the value padding rows take per input (default 0) and ``row_multiple`` the
    granularity of rows (the adapter maps ``row_multiple`` rows to one embedding).
    """

    tower: str
    inputs: dict[str, np.ndarray]
    num_embeds: int
    row_multiple: int = 1
    pad: dict[str, int] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return next(iter(self.inputs.values())).shape[0]


@dataclass
class Prepared:
    """A request turned into arrays: token ids, rotary positions and the media to encode.

    ``mm_index[i]`` is the row of the request's concatenated media embeddings (towers in the
    order of ``media``) that replaces token ``i``, or -1 for a text token.
    """

    request: Request
    input_ids: np.ndarray  # [s] int64
    positions: np.ndarray  # [axes, s] int64
    position_delta: int  # rotary position of cache index i during decode: i + delta
    mm_index: np.ndarray  # [s] int64
    media: list[TowerInput] = field(default_factory=list)
