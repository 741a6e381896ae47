"""The vocabulary that flows between mmzoo's stages.

``Request`` (what a user asks) -> a family's ``prepare`` -> ``Prepared`` (token ids, positions and
``TowerInput``s, host arrays) -> an executor -> ``Result`` (what comes back). ``DTYPES`` names the
run dtypes every stage accepts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Annotated, Any

import numpy as np
import torch
from pydantic import ConfigDict, Field, Strict, ValidationError, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from mmzoo.errors import MmzooError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Strict scalars: a JSON "4" is not 4 and "false" is not a boolean (the request line is refused
# naming the field, where a lax parse would have read "false" as true).
_Int = Annotated[int, Strict()]
_NonNeg = Annotated[int, Strict(), Field(ge=0)]
MAX_NEW_TOKENS = 1 << 20  # a schema bound; the engine also refuses more than its max_model_len
MAX_TOP_K = 1 << 31  # past any vocabulary (the step holds top_k as int64)
MAX_N = 1 << 16  # a schema bound; the engine refuses more samples than its KV-cache slots
MAX_TEMPERATURE = 1e4  # past it float32 logits / temperature underflow to a uniform draw


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # what StructuredOutputs constrains by


@pydantic_dataclass(config=ConfigDict(extra="forbid"))
class StructuredOutputs:
    """What a request's output must match (vLLM's ``StructuredOutputsParams``): exactly one of a JSON
    schema (``json``: an object or its JSON text), any JSON object (``json_object: true``), a regular
    expression the whole output matches (``regex``), one of some strings (``choice``) or a Lark or
    GBNF grammar (``grammar``). JSON allows whitespace between its tokens unless
    ``disable_any_whitespace``. Applied as a token mask (:mod:`mmzoo.structured`)."""

    json: dict[str, Any] | Annotated[str, Strict()] | None = None
    regex: Annotated[str, Strict(), Field(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Strict(), Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: Annotated[str, Strict(), Field(min_length=1)] | None = None
    json_object: Annotated[bool, Strict()] | None = None
    disable_any_whitespace: Annotated[bool, Strict()] = False

    def __post_init__(self):
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(STRUCTURED_KINDS)}; got {', '.join(given) or 'none'}")

    def _given(self) -> list[str]:
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        """The one constraint given: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return self._given()[0]


@pydantic_dataclass(config=ConfigDict(arbitrary_types_allowed=True, validate_assignment=True, extra="forbid"))
class Request:
    """One generation request, as a user, a ``requests=`` line or the Python API gives it.

    A typed schema (a pydantic dataclass): every field is checked on construction and on
    assignment, strictly for scalars. :meth:`parse` turns a mapping (a JSON line, API keywords)
    into a Request or one :class:`MmzooError` naming the field and the value. Media and embeddings
    are checked where the family reads them (decoding, shapes, finite values).
    """

    prompt: Annotated[str, Strict()] = ""
    # a whole conversation instead of ``prompt``: transformers' chat messages, whose content parts
    # {"type": "image"} / {"type": "video"} / {"type": "audio"} stand for the media items in order
    messages: list[dict[str, Any]] | None = None
    images: list[Any] = field(default_factory=list)  # paths or PIL images
    videos: list[Any] = field(default_factory=list)  # paths, or lists of frames
    audios: list[Any] = field(default_factory=list)  # paths, or 1-D float arrays at the feature extractor's rate
    # 0: generate nothing (scoring a prompt: prompt_logprobs)
    max_new_tokens: Annotated[int, Strict(), Field(ge=0, le=MAX_NEW_TOKENS)] = 32
    ignore_eos: Annotated[bool, Strict()] = False
    temperature: Annotated[float, Strict(), Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)] = 0.0  # 0: greedy
    top_k: Annotated[int, Strict(), Field(ge=0, le=MAX_TOP_K)] = 0  # 0: no top-k cut
    top_p: Annotated[float, Strict(), Field(gt=0, le=1)] = 1.0  # 1: no nucleus cut
    seed: _NonNeg | None = None  # per-request sampling seed
    stop_token_ids: list[_NonNeg] = field(default_factory=list)  # stop (inclusive) at any of these, besides EOS
    # stop strings: the text ends before the first match (held back while it could still become one)
    stop: list[Annotated[str, Strict(), Field(min_length=1)]] = field(default_factory=list)
    # per generated token, its log-probability and those of the n most likely tokens (vLLM's
    # SamplingParams.logprobs; 0: the token's own only; None: none), up to the executor's max_logprobs
    logprobs: _NonNeg | None = None
    # per prompt token after the first, its log-probability given the ones before and those of the
    # n likeliest there (vLLM's SamplingParams.prompt_logprobs); None: none
    prompt_logprobs: _NonNeg | None = None
    # samples of the prompt (vLLM's n): the prompt is prefilled once, its KV cache copied into each
    # sample's slot; each sample draws from its own generator (the first from seed's, as with n=1)
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] = 1
    # the output follows a JSON schema, a regex, a choice or a grammar (vLLM's structured_outputs)
    structured_outputs: StructuredOutputs | None = None
    id: _Int | Annotated[str, Strict()] | None = None
    # -- other input modes (see README "Input modes") --
    prompt_token_ids: Annotated[list[_NonNeg], Field(min_length=1)] | None = None  # already tokenized (no chat template)
    image_embeds: Any = None  # [rows, hidden] (or a list of 2-D) precomputed image embeddings
    image_grid_thw: Any = None  # [num_images, 3] with image_embeds (Qwen2-VL)
    video_embeds: Any = None
    video_grid_thw: Any = None
    # with video_embeds: the seconds of each video's temporal steps, in order (Qwen3-VL writes them in the
    # prompt; mmzoo.encode writes them); without: as frames given without a rate and kept whole (24 fps)
    video_timestamps: Any = None
    audio_embeds: Any = None  # [tokens, hidden] per clip (a list of 2-D), or one 2-D split by audio_lengths
    audio_lengths: Any = None  # [clips] token rows of each clip in a 2-D audio_embeds (mmzoo.encode writes it)
    inputs_embeds: Any = None  # [s, hidden] embeddings of the whole prompt (soft prompts)
    embeds: Annotated[str, Strict()] | None = None  # an mmzoo.encode safetensors file supplying the *_embeds fields

    @field_validator("images", "videos", "audios", mode="before")
    @classmethod
    def _a_list(cls, value: Any, info) -> Any:
        if isinstance(value, (str, bytes)):  # pydantic refuses it too; say what was meant
            raise ValueError(f"must be a list of {info.field_name}, got one string; write [{value!r}]")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # one stop string, as vLLM and OpenAI take it

    @field_validator("prompt")
    @classmethod
    def _unicode(cls, value: str) -> str:
        _check_text(value)
        return value

    @classmethod
    def parse(cls, values: Mapping[str, Any], *, where: str = "request") -> "Request":
        """A Request from a mapping, or :class:`MmzooError` naming ``where``, each bad field and its value."""
        if not isinstance(values, Mapping):
            raise MmzooError(f"{where}: a request must be a JSON object, got {type(values).__name__}")
        unknown = sorted(set(values) - set(REQUEST_FIELDS))
        if unknown:
            raise MmzooError(f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(REQUEST_FIELDS)}")
        try:
            return cls(**values)
        except ValidationError as e:
            raise MmzooError(f"{where}: {describe_validation_error(e)}") from None


REQUEST_FIELDS = tuple(f.name for f in fields(Request))


def _check_text(text: str) -> None:
    """Refuse text the tokenizer cannot take: a lone surrogate (JSON's "\\ud800") is not Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds {text[e.start:e.end]!r} at {e.start}, which is not valid Unicode text") from None


def _union_tag(part: Any) -> bool:
    """Whether a pydantic error location's part names a union member (``int``, ``dict[str,any]``), not a field."""
    return isinstance(part, str) and (part in ("int", "str", "float", "bool", "bytes", "none") or "[" in part
                                      or part[:1].isupper())


def describe_validation_error(e: ValidationError) -> str:
    """Each failed field as ``name=value: reason``, joined by ``; `` (a union's alternatives as one)."""
    by_field: dict[str, tuple[Any, list[str]]] = {}
    for err in e.errors(include_url=False):
        loc = [x for i, x in enumerate(err["loc"]) if i == 0 or not _union_tag(x)]
        name = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or "request"
        msgs = by_field.setdefault(name, (err.get("input"), []))[1]
        msg = err["msg"][0].lower() + err["msg"][1:]
        if msg not in msgs:
            msgs.append(msg)
    parts = []
    for name, (value, msgs) in by_field.items():
        text = repr(value)
        text = text if len(text) <= 60 else text[:57] + "..."
        parts.append(f"{name}={text}: {' or '.join(msgs)}")
    return "; ".join(parts)


@dataclass
class TowerInput:
    """What one tower call of one request needs: arrays with a leading row axis.

    ``pad`` gives the value padding rows take per input (default 0) and ``row_multiple`` the
    granularity of rows (the adapter maps ``row_multiple`` rows to one embedding). Floating inputs
    reach the tower in the run dtype, except those named in ``float32`` (weights computed on the host,
    as Qwen3-VL's position-grid taps and LLaVA-OneVision's packing, which transformers keeps in
    float32 in a bfloat16 run too).
    """

    tower: str
    inputs: dict[str, np.ndarray]
    num_embeds: int
    row_multiple: int = 1
    pad: dict[str, int] = field(default_factory=dict)
    float32: frozenset[str] = frozenset()
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
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # request field -> what mmzoo.encode writes of it
    # with structured_outputs: makes each sample's grammar matcher (mmzoo.structured.Guide), the
    # grammar compiled and checked already (mmzoo.structured.Grammars)
    guide: Callable[[], Any] | None = None


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
    # with Request.logprobs: one entry per generated token, {"token_id", "logprob", "top_logprobs":
    # [[token_id, logprob], ...] (the most likely first)}, from the log-softmax of the raw logits
    logprobs: list[dict] | None = None
    # with Request.prompt_logprobs: one entry per prompt token, as logprobs' (None for the first)
    prompt_logprobs: list[dict | None] | None = None
    # with Request.n > 1: every sample's Result, in order (this one's fields are the first's)
    samples: list["Result"] | None = None

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "token_times_s"}
        for key in ("error", "logprobs", "prompt_logprobs", "samples"):
            if out[key] is None:
                del out[key]
        if "samples" in out:
            out["samples"] = [s.to_json() for s in out["samples"]]
        return out


@dataclass
class StreamOutput:
    """One item of :meth:`mmzoo.Engine.stream`: the text a token adds (possibly empty: held back),
    its id and its :attr:`Result.logprobs` entry (when asked); the last item has ``finished`` and
    the whole :class:`Result` (``text`` then holds what was held back, if anything)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    finished: bool = False
    result: Result | None = None
