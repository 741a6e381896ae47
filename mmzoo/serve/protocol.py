"""OpenAI's request and response schemas (the subset mmzoo serves), as pydantic models, and the
conversion of a request into an :class:`mmzoo.Request`.

Media reach the model only as ``data:`` URLs or as files under the configured media directory;
nothing is ever fetched. mmzoo's own content part ``{"type": "mmzoo_embeds", "mmzoo_embeds":
{"path": "emb.safetensors"}}`` names an ``mmzoo.encode`` file (under the media directory) whose
embeddings replace the images / audios of that request.
"""

from __future__ import annotations

import base64
import binascii
import os
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from mmzoo.errors import MmzooError


class BadRequest(MmzooError):
    """A request the server refuses (HTTP 400), naming the offending field (``param``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ------------------------------------------------------------------------------------ requests

class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(BaseModel):
    data: str  # base64
    format: str = "wav"


class AudioPart(BaseModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class EmbedsRef(BaseModel):
    path: str


class EmbedsPart(BaseModel):
    type: Literal["mmzoo_embeds"]
    mmzoo_embeds: EmbedsRef


ContentPart = Annotated[Union[TextPart, ImagePart, AudioPart, EmbedsPart], Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ...: not used

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = True


class Sampling(BaseModel):
    """The fields both endpoints share. Strict: a field the schema does not know (a misspelling, an
    extension of another server) is refused, naming it. OpenAI's fields that do not change the
    output (``user``, ``metadata``, ``store``, ...) are accepted and ignored; those mmzoo does not
    implement are refused when set to anything but their neutral value (:meth:`refuse_unsupported`)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extension; -1 or 0: off
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)  # samples of the prompt: a choice each
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension
    return_token_ids: bool = False  # vLLM's extension: the generated token ids in each choice
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # vLLM's extension
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0)  # vLLM's extension: the prompt's, scored
    # structured output: OpenAI's response_format, vLLM's structured_outputs (mmzoo.types.StructuredOutputs)
    # and its older guided_json / guided_regex / guided_choice / guided_grammar; one of them (:meth:`structured`)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted and ignored: they do not change the output (IGNORED)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    # not implemented: refused unless neutral (_NEUTRAL)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    logit_bias: dict[str, float] | None = None

    IGNORED: ClassVar[tuple[str, ...]] = ("user", "metadata", "store", "service_tier", "prompt_cache_key",
                                          "safety_identifier", "parallel_tool_calls")
    _NEUTRAL: ClassVar[dict[str, Any]] = {
        "frequency_penalty": 0, "presence_penalty": 0, "tools": None, "tool_choice": None, "logit_bias": None,
        "best_of": None, "suffix": None}
    _GUIDED: ClassVar[dict[str, str]] = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                                         "guided_grammar": "grammar"}

    def refuse_unsupported(self) -> None:
        for name in self._NEUTRAL:
            value = getattr(self, name, None)
            if value not in (self._NEUTRAL[name], None):
                raise BadRequest(f"{name}={value!r} is not supported by mmzoo", name)

    def structured(self) -> tuple[dict[str, Any] | None, dict[str, str]]:
        """The request's :class:`mmzoo.types.StructuredOutputs` fields (None: free text), and how
        an error about them names the field this request gave (``names`` of the server's prepare)."""
        given: dict[str, tuple[dict[str, Any], dict[str, str]]] = {}
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                given["response_format"] = {"json_object": True}, {}
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise BadRequest("response_format.json_schema.schema must be a JSON schema object", "response_format")
                given["response_format"] = {"json": schema}, {
                    "structured_outputs.json": "response_format.json_schema.schema"}
            elif kind != "text":
                raise BadRequest(f"response_format.type={kind!r}: choose text, json_object or json_schema",
                                 "response_format")
        if self.structured_outputs is not None:
            given["structured_outputs"] = dict(self.structured_outputs), {
                "request: structured_outputs": "structured_outputs", "structured_outputs": "structured_outputs"}
        for name, key in self._GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                given[name] = {key: value}, {f"request: structured_outputs.{key}": name,
                                             f"structured_outputs.{key}": name}
        if len(given) > 1:
            raise BadRequest(f"{' and '.join(given)} both constrain the output; give one", list(given)[1])
        return next(iter(given.values()), (None, {}))

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise BadRequest("stop strings must not be empty", "stop")
        return stops

    def request_fields(self) -> dict[str, Any]:
        """The :class:`mmzoo.Request` sampling fields (OpenAI's defaults: temperature 1)."""
        out: dict[str, Any] = {"temperature": 1.0 if self.temperature is None else float(self.temperature),
                               "ignore_eos": self.ignore_eos}
        limit = self.max_completion_tokens or self.max_tokens
        if limit is not None:
            out["max_new_tokens"] = limit
        if self.top_p is not None:
            out["top_p"] = float(self.top_p)
        if self.top_k is not None and self.top_k > 0:
            out["top_k"] = self.top_k
        if self.seed is not None:
            out["seed"] = self.seed
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        stops, logprobs = self.stops(), self.top_logprob_count()
        if stops:  # the loop ends the sequence at a match (mmzoo.text), as Python's generate does
            out["stop"] = stops
        if logprobs is not None:
            out["logprobs"] = logprobs
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        if self.n != 1:
            out["n"] = self.n
        spec, _ = self.structured()
        if spec is not None:
            out["structured_outputs"] = spec
        return out

    def top_logprob_count(self) -> int | None:
        """How many alternatives per token the response lists log-probabilities of (None: no logprobs)."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is None or self.stream_options.include_usage


class ChatCompletionRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: StrictBool | None = None  # each generated token's log-probability ...
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # ... and those of this many alternatives

    def top_logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Sampling):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # several: a choice each, in order
    max_tokens: int | None = Field(default=None, ge=0)  # 0 with echo: score the prompt only
    best_of: int | None = None
    echo: StrictBool = False  # the prompt's text (and, with logprobs, its tokens') before the completion
    suffix: str | None = None
    logprobs: StrictInt | None = Field(default=None, ge=0)  # the sampled token's and this many alternatives'

    def top_logprob_count(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice: a string, token ids, or a list of either."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        if not self.prompt:
            raise BadRequest("prompt is an empty list", "prompt")
        return list(self.prompt)

    def request_fields(self) -> dict[str, Any]:
        out = super().request_fields()
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens carry theirs too
            out["prompt_logprobs"] = max(self.logprobs, self.prompt_logprobs or 0)
        return out


# ----------------------------------------------------------------------------------- responses

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's extension


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists per generated token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's extension


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mmzoo"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def chat_logprobs(entries: list[dict], token_text) -> ChatLogprobs:
    """OpenAI's chat ``logprobs`` from :attr:`mmzoo.Result.logprobs` entries; ``token_text(id)`` is
    a token's text."""
    def top(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return ChatLogprobs(content=[TokenLogprob(**top(e["token_id"], e["logprob"]),
                                              top_logprobs=[TopLogprob(**top(i, lp)) for i, lp in e["top_logprobs"]])
                                 for e in entries])


def completion_logprobs(items: list[tuple[int, dict | None]], token_text, offset: int = 0) -> CompletionLogprobs:
    """The completions ``logprobs`` of ``(token id, its mmzoo.Result.logprobs entry or None)`` items
    (None: a prompt's first token, which has none), the first token's text at ``offset`` of the choice's text."""
    tokens = [token_text(t) for t, _ in items]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    tops: list[dict[str, float] | None] = []
    for t, e in items:
        if e is None:
            tops.append(None)
            continue
        alternatives: dict[str, float] = {}
        for i, lp in e["top_logprobs"]:
            alternatives.setdefault(token_text(i), lp)  # two ids may share a text: the likelier one
        alternatives.setdefault(token_text(t), e["logprob"])  # the sampled token too, as vLLM
        tops.append(alternatives)
    return CompletionLogprobs(tokens=tokens, token_logprobs=[None if e is None else e["logprob"] for _, e in items],
                              top_logprobs=tops, text_offset=offsets)


def vllm_prompt_logprobs(entries: list[dict | None] | None, token_text) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {"logprob",
    "decoded_token"}}`` for the token itself and its alternatives."""
    if entries is None:
        return None
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        one: dict[str, dict[str, Any]] = {}
        for i, lp in [(e["token_id"], e["logprob"])] + [tuple(x) for x in e["top_logprobs"]]:
            one.setdefault(str(i), {"logprob": lp, "decoded_token": token_text(i)})
        out.append(one)
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(reason: str) -> str:
    """mmzoo's finish reasons in OpenAI's words."""
    return {"max_model_len": "length"}.get(reason, reason)


# ------------------------------------------------------------------------ OpenAI -> mmzoo.Request

class MediaSource:
    """Where a request's media may come from: ``data:`` URLs, and files under ``media_dir`` (none
    when it is None). ``file://`` URLs and plain paths are resolved (symlinks too) and must stay
    inside the directory."""

    def __init__(self, media_dir: str | Path | None):
        self.root = Path(media_dir).resolve() if media_dir else None

    def data_url(self, url: str, param: str) -> bytes:
        head, _, payload = url.partition(",")
        if not head.endswith(";base64") or not payload:
            raise BadRequest(f"{param}: a data: URL must be base64 (data:<mime>;base64,<data>)", param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise BadRequest(f"{param}: the data: URL is not valid base64 ({e})", param) from None

    def file(self, ref: str, param: str) -> Path:
        if self.root is None:
            raise BadRequest(f"{param}: local files are not served (start the server with media_dir=DIR)", param)
        path = Path(ref[len("file://"):] if ref.startswith("file://") else ref)
        try:
            path = (path if path.is_absolute() else self.root / path).resolve()
            path.exists()  # raises for a name too long
        except (OSError, ValueError) as e:  # a NUL byte, a name too long, a symlink loop
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise BadRequest(f"{param}: {ref[:200]!r} is not a usable path ({why})", param) from None
        if os.path.commonpath([path, self.root]) != str(self.root):
            raise BadRequest(f"{param}: {ref} is outside the allowed media directory {self.root}", param)
        return path

    def image(self, url: str, param: str) -> bytes | str:
        if url.startswith("data:"):
            return self.data_url(url, param)
        if "://" in url and not url.startswith("file://"):
            raise BadRequest(f"{param}: {url.split('://')[0]}:// URLs are not fetched; send a data: URL or a "
                             f"path under the media directory", param)
        return str(self.file(url, param))


def chat_request(body: ChatCompletionRequest, media: MediaSource, family) -> tuple[dict[str, Any], dict[str, str]]:
    """The :class:`mmzoo.Request` fields of a chat completion (transformers-style messages whose
    media parts stand for ``images`` / ``audios`` in order, or an ``embeds`` file), and the
    request's name of each media item (``images[0]`` -> ``messages[1].content[0].image_url``)."""
    modalities = family.modalities
    names: dict[str, str] = {}
    messages: list[dict[str, Any]] = []
    images: list[Any] = []
    audios: list[Any] = []
    embeds: str | None = None
    for i, msg in enumerate(body.messages):
        if msg.content is None or isinstance(msg.content, str):
            messages.append({"role": "system" if msg.role == "developer" else msg.role, "content": msg.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content):
            param = f"messages[{i}].content[{j}]"
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, ImagePart):
                if "image" not in modalities:
                    raise BadRequest(f"{param}: this model does not take images", param)
                names[f"images[{len(images)}]"] = f"{param}.image_url"
                images.append(media.image(part.image_url.url, f"{param}.image_url"))
                parts.append({"type": "image"})
            elif isinstance(part, AudioPart):
                if "audio" not in modalities:
                    raise BadRequest(f"{param}: this model does not take audio", param)
                names[f"audios[{len(audios)}]"] = f"{param}.input_audio"
                try:
                    audios.append(base64.b64decode(part.input_audio.data, validate=True))
                except (binascii.Error, ValueError) as e:
                    raise BadRequest(f"{param}.input_audio.data is not valid base64 ({e})", param) from None
                parts.append({"type": "audio"})
            elif isinstance(part, EmbedsPart):
                if embeds is not None:
                    raise BadRequest(f"{param}: one mmzoo_embeds file per request", param)
                embeds = str(media.file(part.mmzoo_embeds.path, f"{param}.mmzoo_embeds.path"))
                kind = "image" if "image" in modalities else "audio"
                parts.append({"type": kind, "embeds": True})
        messages.append({"role": "system" if msg.role == "developer" else msg.role, "content": parts})
    if embeds is not None:
        if images or audios:
            raise BadRequest("a request gives media parts or an mmzoo_embeds file, not both", "messages")
        # the file's items: one placeholder part per item, in place of the single embeds part
        messages = _expand_embeds_parts(messages, embeds, family)
    out: dict[str, Any] = {"messages": messages, **body.request_fields()}
    if images:
        out["images"] = images
    if audios:
        out["audios"] = audios
    if embeds is not None:
        out["embeds"] = embeds
    return out, names


def _expand_embeds_parts(messages: list[dict], path: str, family) -> list[dict]:
    """Replace the one embeds part by one media part per item the file holds (the family counts
    them: :meth:`~mmzoo.models.Family.embeds_items`)."""
    from mmzoo import embeds_file

    tensors, _ = embeds_file.read(path)
    counts = {kind: family.embeds_items(tensors, kind) for kind in ("image", "audio")}
    out = []
    for msg in messages:
        content = msg["content"]
        if isinstance(content, list):
            new = []
            for part in content:
                if part.get("embeds"):
                    for kind, n in counts.items():
                        new += [{"type": kind}] * n
                else:
                    new.append(part)
            msg = {**msg, "content": new}
        out.append(msg)
    return out
