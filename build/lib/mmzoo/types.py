"""The vocabulary that flows between mmzoo's stages.

``Request`` (what a user asks) -> a family's ``prepare`` -> ``Prepared`` (token ids, positions and
``TowerInput``s, host arrays) -> an executor -> ``Result`` (what comes back). ``DTYPES`` names the
run dtypes every stage accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mmzoo.errors import MmzooError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Request:
    """One generation request, as a user or a ``requests=`` line gives it."""

    prompt: str = ""
    images: list[Any] = field(default_factory=list)  # paths or PIL images
    videos: list[Any] = field(default_factory=list)  # paths, or lists of frames
    audios: list[Any] = field(default_factory=list)  # paths, or 1-D float arrays at the feature extractor's rate
    max_new_tokens: int = 32
    ignore_eos: bool = False
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int | None = None  # per-request sampling seed
    stop_token_ids: list[int] = field(default_factory=list)  # stop (inclusive) at any of these, besides EOS
    id: Any = None
    # -- other input modes (see README "Input modes") --
    prompt_token_ids: list[int] | None = None  # the prompt already tokenized (no chat template applied)
    image_embeds: Any = None  # [rows, hidden] (or a list of 2-D) precomputed image embeddings
    image_grid_thw: Any = None  # [num_images, 3] with image_embeds (Qwen2-VL)
    video_embeds: Any = None
    video_grid_thw: Any = None
    audio_embeds: Any = None  # [tokens, hidden] per clip (a list of 2-D), or one 2-D split by audio_lengths
    audio_lengths: Any = None  # [clips] token rows of each clip in a 2-D audio_embeds (mmzoo.encode writes it)
    inputs_embeds: Any = None  # [s, hidden] embeddings of the whole prompt (soft prompts)
    embeds: str | None = None  # an mmzoo.encode safetensors file supplying the *_embeds fields

    def check(self) -> None:
        """Raise :class:`MmzooError` naming the field for out-of-range sampling parameters."""
        if self.max_new_tokens <= 0:
            raise MmzooError(f"max_new_tokens={self.max_new_tokens} must be positive")
        if self.temperature < 0:
            raise MmzooError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise MmzooError(f"top_k={self.top_k} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise MmzooError(f"top_p={self.top_p} must be in (0, 1]")


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
    embeds: Any = None  # precomputed [num_embeds, dim] embeddings: the tower is not run

    @property
    def rows(self) -> int:
        return next(iter(self.inputs.values())).shape[0] if self.inputs else 0


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
    grids: dict[str, np.ndarray] = field(default_factory=dict)  # "image"/"video" -> grid_thw (Qwen2-VL)
    lengths: dict[str, np.ndarray] = field(default_factory=dict)  # "audio" -> embedding rows per clip


@dataclass
class Result:
    """The outcome of one request."""

    id: Any
    prompt: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list, repr=False)  # arrival of each token
    graphs_compiled_after_warmup: int = 0
    error: str | None = None

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "token_times_s"}
        if out["error"] is None:
            del out["error"]
        return out
