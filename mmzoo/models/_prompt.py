"""Prompt helpers of the family template (:mod:`mmzoo.models.family`): chat-template rendering with
placeholder expansion, token-prompt placeholder runs, ``inputs_embeds`` prompts."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from mmzoo.errors import MmzooError
from mmzoo.models._embeds import as_embeds
from mmzoo.types import Prepared, Request, TowerInput


def expand_runs(ids: np.ndarray, token: int, counts: list[int], *, what: str, note: str = "") -> np.ndarray:
    """Token ids with the ``i``-th run of ``token`` resized to ``counts[i]`` tokens.

    Already-expanded ids pass through; otherwise each run (one placeholder per item, as in
    vLLM's token prompts) becomes its item's count.
    """
    where = np.flatnonzero(ids == token)
    runs = np.split(where, np.flatnonzero(np.diff(where) != 1) + 1) if len(where) else []
    if len(runs) == len(counts) and all(len(r) == n for r, n in zip(runs, counts)):
        return ids
    if len(runs) != len(counts):
        raise MmzooError(f"prompt_token_ids has {len(runs)} {what} placeholder runs (token id {token}) but "
                         f"{len(counts)} {what}s are given{note}")
    out, last = [], 0
    for run, n in zip(runs, counts):
        out += [ids[last:run[0]], np.full(n, token, np.int64)]
        last = run[-1] + 1
    return np.concatenate(out + [ids[last:]])


def render_prompt(processor, request: Request, kinds: list[str], placeholders: dict[str, tuple[str, list[str]]]):
    """The chat template over the request's conversation, with each item's placeholder replaced by
    its expansion; returns the token ids. The conversation is ``request.messages`` (its media parts
    standing for the items in order), or one user turn: the items of ``kinds`` in order, then
    ``request.prompt``.

    ``placeholders`` maps a kind to ``(placeholder text, per-item expansions)`` (the placeholder
    repeated to the item's count, :meth:`~mmzoo.models.Family.expand_placeholder`); a text that
    already holds a placeholder string is refused, since the items could no longer be told apart.

    Returns:
        ``(ids, order)``: the token ids and each item's kind in the order the template placed them.
    """
    if request.messages is not None:
        messages = request.messages
        texts = _check_messages(messages, {kind: len(placeholders[kind][1]) for kind in kinds})
    else:
        content = [{"type": kind} for kind in kinds for _ in placeholders[kind][1]]
        content.append({"type": "text", "text": request.prompt})
        messages, texts = [{"role": "user", "content": content}], [("prompt", request.prompt)]
    for kind in kinds:
        pad = placeholders[kind][0]
        for where, text in texts:
            if pad in text:
                raise MmzooError(f"{where} contains the {kind} placeholder {pad!r}; the chat template adds one per "
                                 f"{kind} given in {kind}s (or use prompt_token_ids)")
    text = _apply_chat_template(processor, messages)
    found = sorted((m.start(), kind) for kind in kinds for m in re.finditer(re.escape(placeholders[kind][0]), text))
    order = [kind for _, kind in found]
    for kind in kinds:
        pad, expansions = placeholders[kind]
        pieces = text.split(pad)
        if len(pieces) - 1 != len(expansions):
            raise MmzooError(f"the chat template rendered {len(pieces) - 1} {pad!r} placeholders for "
                             f"{len(expansions)} {kind}s")
        text = pieces[0] + "".join(item + rest for item, rest in zip(expansions, pieces[1:]))
    return np.asarray(processor.tokenizer(text)["input_ids"], dtype=np.int64), order


def _apply_chat_template(processor, messages: list[dict]) -> str:
    source = getattr(getattr(processor, "tokenizer", None), "name_or_path", "") or "the checkpoint"
    if getattr(processor, "chat_template", None) is None:
        raise MmzooError(f"{source} has no chat template (chat_template.jinja) to render a prompt with; give "
                         f"prompt_token_ids instead, or add a template to the checkpoint")
    try:
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja raises anything: a template, or a conversation it refuses
        raise MmzooError(f"the chat template of {source} cannot render this conversation ({_reason(e)})") from None


def check_chat_template(processor, source) -> None:
    """Refuse, at load, a chat template that does not render a one-line text conversation (a
    checkpoint without one loads: its prompts then need ``prompt_token_ids``)."""
    if getattr(processor, "chat_template", None) is None:
        return
    try:
        processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                      tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - as above
        where = next((f"{source}/{n}" for n in ("chat_template.jinja", "chat_template.json")
                      if (Path(source) / n).is_file()), f"the chat template of {source}")
        raise MmzooError(f"{where} does not render a one-line text conversation ({_reason(e)})") from None


def _reason(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


MEDIA_PARTS = ("image", "video", "audio")
# where a part carries its item: transformers' chat parts ({"type": "image", "image" | "url" | "path": ...})
# and OpenAI's ({"type": "image_url", "image_url": {"url": ...}}, {"type": "input_audio", ...})
_CARRIERS = {"image": ("image", "url", "path"), "video": ("video", "url", "path"), "audio": ("audio", "url", "path")}


def media_from_messages(request: Request) -> Request:
    """``request`` with the media its message parts carry moved to ``images`` / ``videos`` /
    ``audios`` (in order), each such part left as the placeholder ``{"type": kind}``: a conversation
    written as for transformers' processors or for OpenAI's API runs as the server runs it. Media
    given both in parts and in the lists are refused (which goes where would be a guess)."""
    from dataclasses import replace

    if not request.messages:
        return request
    found: dict[str, list] = {kind: [] for kind in MEDIA_PARTS}
    messages = []
    for i, message in enumerate(request.messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind, item = _carried(part, f"messages[{i}].content[{j}]")
            if kind is None:
                parts.append(part)
                continue
            found[kind].append(item)
            parts.append({"type": kind})
        messages.append({**message, "content": parts})
    if not any(found.values()):
        return request
    fields = {"images": "image", "videos": "video", "audios": "audio"}
    for name, kind in fields.items():
        if found[kind] and getattr(request, name):
            raise MmzooError(f"messages carry {len(found[kind])} {kind}(s) in their parts and {name} gives "
                             f"{len(getattr(request, name))} more; give the {kind}s one way")
    return replace(request, messages=messages, **{name: found[kind] for name, kind in fields.items() if found[kind]})


def _carried(part, where: str) -> tuple[str | None, object]:
    """A media part's kind and the item it carries, or ``(None, None)`` for any other part."""
    if not isinstance(part, dict):
        return None, None
    kind = part.get("type")
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise MmzooError(f"{where}.image_url must be {{'url': ...}} or a string, got {url!r}"[:300])
        return "image", url
    if kind == "input_audio":
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, dict) else None
        if not isinstance(data, str):
            raise MmzooError(f"{where}.input_audio must be {{'data': base64 text, 'format': ...}}"[:300])
        import base64
        import binascii

        try:
            return "audio", base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MmzooError(f"{where}.input_audio.data is not valid base64 ({e})") from None
    for key in _CARRIERS.get(kind, ()):
        if part.get(key) is not None:
            return kind, part[key]
    return None, None


def _check_messages(messages: list[dict], items: dict[str, int]) -> list[tuple[str, str]]:
    """Refuse a malformed conversation, or one whose media parts do not match the items given;
    returns its texts as ``(where, text)``."""
    if not messages:
        raise MmzooError("messages is empty")
    texts, seen = [], dict.fromkeys(MEDIA_PARTS, 0)
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message.get("role"), str):
            raise MmzooError(f"{where}.role must be a string, got {message.get('role')!r}")
        content = message.get("content")
        if isinstance(content, str):
            texts.append((f"{where}.content", content))
            continue
        if not isinstance(content, list):
            raise MmzooError(f"{where}.content must be a string or a list of parts, got {type(content).__name__}")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append((f"{where}.content[{j}].text", part["text"]))
            elif kind in MEDIA_PARTS:
                seen[kind] += 1
            else:
                raise MmzooError(f"{where}.content[{j}] must be a text part or one of {MEDIA_PARTS}, got {part!r}"[:300])
    for where, text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise MmzooError(f"{where} holds {text[e.start:e.end]!r} at {e.start}, which is not valid Unicode text") from None
    for kind in MEDIA_PARTS:
        if seen[kind] != items.get(kind, 0):
            raise MmzooError(f"messages hold {seen[kind]} {kind} parts but {items.get(kind, 0)} {kind}s are given")
    return texts


def prepare_inputs_embeds(request: Request, *, hidden: int, position_axes: int = 1) -> Prepared:
    """``inputs_embeds`` replaces the whole prompt: positions ``0..s-1`` on each rotary axis."""
    if request.images or request.videos or request.audios or any(
            getattr(request, f) is not None for f in ("image_embeds", "video_embeds", "audio_embeds")):
        raise MmzooError("inputs_embeds replaces the whole prompt; do not also give images, videos, audios or *_embeds")
    emb = as_embeds(request.inputs_embeds, "inputs_embeds", hidden=hidden)
    s = emb.shape[0]
    return Prepared(request=request, input_ids=np.zeros(s, np.int64), positions=np.tile(np.arange(s), (position_axes, 1)),
                    position_delta=0, mm_index=np.arange(s),
                    media=[TowerInput(tower="inputs_embeds", inputs={}, num_embeds=s, embeds=emb)])
