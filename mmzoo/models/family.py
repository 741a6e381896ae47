"""The contract of a model family: what it adds to its encoder, adapter and LM.

A family is its conf file (``conf/model/<name>.yaml``: the three components, their sizes from the
checkpoint, and a ``family`` node) plus a :class:`Family` subclass holding only what is its own:

* which media it takes (:attr:`Family.modalities`, an allow-list; every other input is refused
  by name) and the tower they go through (:attr:`Family.tower`);
* how raw media become tower inputs and how many placeholder tokens each item fills
  (:meth:`Family.raw_media`), and how precomputed embeddings are counted (:meth:`Family.precomputed`;
  with the request fields beside their layout it takes, :attr:`Family.layout_extras`);
* what each item's placeholder becomes in a rendered prompt and in a token prompt
  (:meth:`Family.expand_placeholder`, :meth:`Family.expand_token_prompt`: its run of placeholders
  unless the family frames its items), and which modality's placeholder token a modality's items
  fill when it has none of its own (:attr:`Family.shared_placeholders`: InternVL's video frames
  fill the image token; the items are then told apart by their order in the prompt);
* the position scheme (:meth:`Family.positions`; 1-D unless overridden), the placeholders that
  attend both ways among their run (:attr:`Family.bidirectional_token`; none unless overridden)
  and the feature levels its tower rows carry for the LM's first layers
  (:attr:`Family.deepstack_levels`, Qwen3-VL's DeepStack; none unless overridden);
* its checkpoint's tensor names (:meth:`Family.convert_weights`) and what it relies on in the
  checkpoint's config.json and tokenizer (:meth:`Family.check_config`, :meth:`Family.check_processor`:
  a bad value is refused at load, naming the file, the field and the value);
* zero inputs for compiling the tower at a bucket (:meth:`Family.dummy_media`) and, where a
  tower's input rows are whole items, those buckets (:meth:`Family.encoder_buckets`; both written
  once for fixed-size square items, :class:`SquareItems`);
* its tensor-parallel plan (:attr:`Family.tp_plan`, parameter-name patterns: the shared
  components' :data:`TP_PLAN`, extended by the family with its own parts', :func:`extend_tp_plan`);
* how many items of a modality a precomputed-embeddings file holds (:meth:`Family.embeds_items`:
  the rows of its layout tensor, unless the family's items are of a fixed size);
* its reference and its tiny test checkpoint (:attr:`Family.hf_class`, :attr:`Family.tiny_checkpoint`):
  the transformers class its checkpoints load into, and the ``mmzoo.fixtures`` builder of a tiny
  random one, from which the shared parity tests and the benchmark work (named, never imported
  by the runtime).

:meth:`Family.prepare` is the shared template every request goes through: refuse foreign inputs,
prepare each modality (raw or precomputed), tokenize (chat template, or the caller's token ids)
with each placeholder expanded to its item's count, map placeholders to embedding rows, and
compute positions. vLLM's ``SupportsMultiModal`` plays the same role there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np
import torch

from mmzoo.errors import MmzooError
from mmzoo.lms.decoder import LAYER_TYPES
from mmzoo.models._prompt import check_chat_template, expand_runs, prepare_inputs_embeds, render_prompt
from mmzoo.types import Prepared, Request, TowerInput

# request fields per modality: the raw media, precomputed embeddings, and the embeddings' layout
MEDIA_FIELDS = {"image": ("images", "image_embeds", "image_grid_thw"),
                "video": ("videos", "video_embeds", "video_grid_thw"),
                "audio": ("audios", "audio_embeds", "audio_lengths")}
# request fields a family may take beside a modality's layout (Family.layout_extras) -> that modality
LAYOUT_EXTRAS = {"video_timestamps": "video"}
_ALL_MEDIA = {f for group in MEDIA_FIELDS.values() for f in group} | set(LAYOUT_EXTRAS)
TEXT_FIELDS = frozenset(f.name for f in fields(Request)) - _ALL_MEDIA  # what every family takes

# Tensor parallelism by parameter name (fnmatch patterns over the composition's names, first
# match wins), Megatron-LM's split: "colwise" splits a [out, in] weight's rows (and its bias),
# "rowwise" its columns (bias replicated), "vocab" the embedding / LM head rows; "colwise_kv" is
# colwise when the kv heads divide the model axis, else replicated (vLLM's kv-head replication).
# Anything unmatched is replicated. This plan names the shared components only (the shared
# attention and MLP layers of every LM, ViT block and encoder; the LM's embedding and head); a
# family adds the patterns of its own parts (its adapter's) with :func:`extend_tp_plan`.
TP_PLAN = {
    "*.attn.q_proj.*": "colwise",
    "*.attn.k_proj.*": "colwise_kv",
    "*.attn.v_proj.*": "colwise_kv",
    "*.attn.qkv_proj.*": "colwise",  # fused by the executor (fuse_projections)
    "*.attn.o_proj.*": "rowwise",
    "*.mlp.gate_proj.*": "colwise",
    "*.mlp.up_proj.*": "colwise",
    "*.mlp.gate_up_proj.*": "colwise",
    "*.mlp.down_proj.*": "rowwise",
    "*.mlp.fc1.*": "colwise",
    "*.mlp.fc2.*": "rowwise",
    "lm.embed_tokens.weight": "vocab",
    "lm.lm_head.weight": "vocab",
}


def extend_tp_plan(own: dict[str, str], base: dict[str, str] = TP_PLAN) -> dict[str, str]:
    """A family's tensor-parallel plan: its ``own`` patterns first (the first match wins, so they
    decide for the parameters they name, even where a ``base`` pattern matches too), then ``base``'s
    (:data:`TP_PLAN`, or a parent family's plan)."""
    return {**own, **{pattern: style for pattern, style in base.items() if pattern not in own}}


@dataclass
class Media:
    """One modality of one request, ready for the tower.

    Attributes:
        counts: placeholder tokens per item, in prompt order.
        calls: the tower calls (or precomputed embeddings) giving the items' rows, in order.
        rows: ``[sum(counts)]`` the row of the calls' concatenated output that each placeholder
            token reads; None: rows ``0 .. sum(counts) - 1``.
        grid: ``[items, 3]`` (t, h, w) patches per item, for families that position by it.
        extras: request fields of :data:`LAYOUT_EXTRAS` -> their values for these items (what
            ``mmzoo.encode`` writes beside the embeddings: Qwen3-VL's ``video_timestamps``).
    """

    counts: list[int]
    calls: list[TowerInput]
    rows: np.ndarray | None = None
    grid: np.ndarray | None = None
    extras: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class FramedMedia(Media):
    """:class:`Media` of videos with the video processor's metadata for each (its frame rate and the
    indices of the frames it kept), for families whose prompt writes the frames' timestamps
    (Qwen3-VL, SmolVLM).

    Attributes:
        metadata: one ``transformers.video_utils.VideoMetadata`` per video; None for images.
    """

    metadata: list[Any] | None = None


def unsampled_metadata(frames: int):
    """The ``VideoMetadata`` transformers' video processors give ``frames`` frames passed without a
    rate and kept whole: 24 fps, frame indices ``0 .. frames - 1`` (the timestamps of an embeddings
    file's video, which does not carry the raw video's)."""
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=int(frames), fps=24.0, frames_indices=np.arange(int(frames)))


class Family:
    """Base of the model families (see the module docstring).

    Args:
        name: the conf option name (``qwen2_vl``), used in messages and embeddings files.
    """

    tower: ClassVar[str] = "vision"
    modalities: ClassVar[tuple[str, ...]] = ()
    tp_plan: ClassVar[dict[str, str]] = TP_PLAN  # the shared components'; a family adds its parts' (extend_tp_plan)
    hf_class: ClassVar[str] = ""  # e.g. "Qwen2VLForConditionalGeneration"
    tiny_checkpoint: ClassVar[str] = ""  # e.g. "make_tiny_qwen2_vl": a function of mmzoo.fixtures, or a dotted path
    # config.json's sub-configs the family reads: transformers fills a missing one with defaults of
    # another size, so each must be in the file
    config_sections: ClassVar[tuple[str, ...]] = ()
    # a modality whose items fill another's placeholder token (InternVL's video frames: {"video": "image"}):
    # its tokens are told apart by the items' order in the prompt
    shared_placeholders: ClassVar[dict[str, str]] = {}
    # the LAYOUT_EXTRAS request fields it takes with a modality's embeddings (Qwen3-VL: video_timestamps),
    # handed to precomputed() by name
    layout_extras: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, name: str):
        self.name = name

    # -- what a family defines -------------------------------------------------------------
    @property
    def bidirectional_token(self) -> int | None:
        """A placeholder token whose runs attend to themselves both ways in a prompt (Gemma 3's
        image tokens; :class:`~mmzoo.models.MultimodalLM`), or None: every token attends causally."""
        return None

    @property
    def deepstack_levels(self) -> int:
        """Feature levels each tower row carries after its embedding, each added to the LM's hidden
        states after one of its first layers at the placeholder positions (Qwen3-VL's DeepStack; a
        row is then ``(1 + levels) * dim`` wide: :class:`~mmzoo.models.MultimodalLM`); 0: none."""
        return 0

    @property
    def position_axes(self) -> int:
        """Rotary position axes its LM reads (1; 3 for M-RoPE)."""
        return 1

    def placeholder(self, kind: str, processor) -> tuple[str, int]:
        """The placeholder text the chat template renders for one ``kind`` item and its token id (the
        token of the modality it shares, :attr:`shared_placeholders`)."""
        token = getattr(self, f"{self.shared_placeholders.get(kind, kind)}_token_id")
        return getattr(processor, f"{kind}_token"), int(token)

    def placeholder_token(self, kind: str, processor) -> str:
        """The text of the placeholder token (whose id is the config's ``{kind}_token_id``): the
        rendered placeholder itself unless the family expands another (Gemma 3's ``<start_of_image>``);
        for a modality that fills another's token (:attr:`shared_placeholders`), that one's (InternVL's
        and SmolVLM's rendered ``<video>`` becomes frames of the image token)."""
        shared = self.shared_placeholders.get(kind)
        return self.placeholder_token(shared, processor) if shared else self.placeholder(kind, processor)[0]

    def expand_placeholder(self, kind: str, media: Media, item: int, processor) -> str:
        """The text the rendered placeholder of ``media``'s ``item`` becomes in the prompt: its count
        of placeholders (InternVL frames them with ``<img>`` ... ``</img>``, SmolVLM lays out its tiles)."""
        return self.placeholder(kind, processor)[0] * media.counts[item]

    def expand_token_prompt(self, kind: str, ids: np.ndarray, media: Media | None, processor) -> np.ndarray:
        """Token-prompt ids (``prompt_token_ids``) with the ``kind`` items' placeholders expanded:
        the ``i``-th run of the placeholder token becomes item ``i``'s count (a run already of that
        length passes through; :func:`~mmzoo.models._prompt.expand_runs`). ``media`` is None
        without ``kind`` items."""
        note = " (grid_thw rows)" if MEDIA_FIELDS[kind][2].endswith("grid_thw") else ""
        counts = media.counts if media is not None else []
        return expand_runs(ids, self.placeholder(kind, processor)[1], counts, what=kind, note=note)

    def raw_media(self, kind: str, items: list, processor) -> Media:
        """Raw ``kind`` items (paths, arrays) -> tower inputs and placeholder counts; raise
        :class:`MmzooError` naming the item for anything unreadable."""
        raise NotImplementedError

    def precomputed(self, kind: str, embeds: Any, layout: Any, hidden_size: int, **extras: Any) -> Media:
        """``{kind}_embeds`` (and its layout field, ``*_grid_thw`` / ``*_lengths``, or None; and the
        given :attr:`layout_extras` of ``kind``, by name) -> placeholder counts and one
        precomputed-embeddings call."""
        raise NotImplementedError

    def positions(self, input_ids: np.ndarray, media: dict[str, Media]) -> tuple[np.ndarray, int]:
        """``([axes, s] rotary positions, delta)``; cache index ``i`` decodes at ``i + delta``."""
        return np.arange(len(input_ids), dtype=np.int64)[None], 0

    def convert_weights(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors under the composition's names (``towers.<tower>.encoder.*``,
        ``towers.<tower>.adapter.*``, ``lm.*``); anything left unmapped is reported by the strict loader."""
        raise NotImplementedError

    def dummy_media(self, rows: int) -> TowerInput:
        """Zero tower inputs of ``rows`` input rows, for compiling the tower at that bucket."""
        raise NotImplementedError

    def encoder_buckets(self, *, max_model_len: int, max_media_rows: int) -> list[int] | None:
        """XLA buckets of the tower's input rows when its rows are whole items (images, clips);
        None: the executor's defaults (packed patches)."""
        return None

    def embeds_items(self, tensors: dict, kind: str) -> int:
        """How many ``kind`` items an embeddings file's ``tensors`` hold (``mmzoo.embeds_file``;
        the server gives a request one placeholder per item): the rows of the ``kind``'s layout
        tensor (``image_grid_thw``, ``audio_lengths``: one per item), 1 for ``{kind}_embeds``
        without one, 0 when the file has no ``kind``. A family whose items have a fixed size and no
        layout (Llava) counts the embedding rows instead."""
        layout = MEDIA_FIELDS[kind][2]
        if layout in tensors:
            return int(tensors[layout].shape[0])
        return int(f"{kind}_embeds" in tensors)

    # -- what the checkpoint must hold ----------------------------------------------------------
    @classmethod
    def check_config(cls, config, raw: dict, source: str) -> None:
        """Refuse a checkpoint config this family cannot run as the file says: called once when a
        checkpoint of one of its architectures is loaded, before anything is built (the values'
        types and ranges are checked as config.json is read: :func:`mmzoo.config.check_config_json`).

        Args:
            config: transformers' config of the checkpoint.
            raw: config.json as it is in the file (which keys it sets).
            source: the file's path, for messages.

        The base refuses a missing :attr:`config_sections` entry and a placeholder token id
        outside the vocabulary or shared by two modalities; a family adds its own checks."""
        for name in cls.config_sections:
            if name not in raw:
                raise MmzooError(f"{source} has no {name} (the {name.split('_')[0]} model's settings); transformers "
                                 f"would fill in the defaults of another model")
        text = config.get_text_config()
        other = [i for i, kind in enumerate(getattr(text, "layer_types", None) or []) if kind not in LAYER_TYPES]
        if other:
            raise MmzooError(f"{source}: the text model's layers {other} are {text.layer_types[other[0]]!r} "
                             f"(layer_types): mmzoo's LMs have full_attention and sliding_attention layers")
        vocab = text.vocab_size
        seen: dict[int, str] = {}
        for kind in (k for k in cls.modalities if k not in cls.shared_placeholders):
            token = getattr(config, f"{kind}_token_id", None)
            key = next((k for k in (f"{kind}_token_id", f"{kind}_token_index") if k in raw), None)
            name = key or f"{kind}_token_id"
            note = "" if key else " (transformers' default: config.json has none)"
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise MmzooError(f"{source}: {name}={token!r}{note} is not a token id of the vocabulary "
                                 f"(text_config.vocab_size={vocab})")
            if token in seen:
                raise MmzooError(f"{source}: {name}={token} is also {seen[token]}; each placeholder needs a token "
                                 f"of its own")
            seen[token] = name

    def check_processor(self, processor, *, vocab_size: int, source: str) -> None:
        """Refuse a checkpoint's tokenizer and processor that do not fit its config, once at load:
        an empty tokenizer, token ids past the LM's ``vocab_size`` embedding rows, a placeholder
        the tokenizer does not know as the config's token id, a chat template that does not render.
        ``source``: the checkpoint directory, for messages."""
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is None:
            raise MmzooError(f"the processor of {source} has no tokenizer")
        vocab = tokenizer.get_vocab()
        if not vocab:
            raise MmzooError(f"the tokenizer of {source} is empty (no tokens)")
        size = max(len(tokenizer), max(vocab.values()) + 1)
        if size > vocab_size:
            raise MmzooError(f"the tokenizer of {source} has token ids up to {size - 1}, but the LM's vocabulary "
                             f"(text_config.vocab_size) has {vocab_size} rows: its embedding has none for the ids "
                             f"from {vocab_size}")
        for kind in self.modalities:
            try:
                text, token = self.placeholder_token(kind, processor), self.placeholder(kind, processor)[1]
            except AttributeError:
                raise MmzooError(f"the processor of {source} ({type(processor).__name__}) has no {kind} placeholder "
                                 f"({kind}_token)") from None
            got = vocab.get(text)
            if got != token:
                where = f"id {got}" if got is not None else "not one of its tokens"
                raise MmzooError(f"{source}/config.json: {kind}_token_id={token}, but the tokenizer's {kind} "
                                 f"placeholder {text!r} is {where}")
        check_chat_template(processor, source)

    # -- the shared template -------------------------------------------------------------------
    def accepts(self) -> frozenset[str]:
        """The request fields this family takes."""
        return TEXT_FIELDS | {f for kind in self.modalities for f in MEDIA_FIELDS[kind]} | set(self.layout_extras)

    def refuse(self, request: Request) -> None:
        given = [f.name for f in fields(Request) if f.name not in self.accepts() and _given(getattr(request, f.name))]
        if given:
            raise MmzooError(f"model={self.name} does not take {', '.join(given)}")

    def prepare(self, request: Request, processor, *, hidden_size: int) -> Prepared:
        """One request -> token ids, positions, the placeholder -> embedding-row map and the tower
        calls, all on the host. ``hidden_size`` is the LM's width (precomputed embeddings must match)."""
        self.refuse(request)
        if request.messages is not None and (request.prompt or request.prompt_token_ids is not None
                                             or request.inputs_embeds is not None):
            raise MmzooError("messages is the whole conversation; do not also give prompt, prompt_token_ids "
                             "or inputs_embeds")
        if request.inputs_embeds is not None:
            return prepare_inputs_embeds(request, hidden=hidden_size, position_axes=self.position_axes)
        media: dict[str, Media] = {}
        for kind in self.modalities:
            raw_field, emb_field, layout_field = MEDIA_FIELDS[kind]
            raw, emb, layout = (getattr(request, f) for f in MEDIA_FIELDS[kind])
            extras = {f: getattr(request, f) for f in self.layout_extras
                      if LAYOUT_EXTRAS[f] == kind and getattr(request, f) is not None}
            if emb is not None:
                if raw:
                    raise MmzooError(f"give {raw_field} or {emb_field}, not both")
                media[kind] = self.precomputed(kind, emb, layout, hidden_size, **extras)
            elif layout is not None or extras:
                raise MmzooError(f"{layout_field if layout is not None else next(iter(extras))} given without "
                                 f"{emb_field}")
            elif raw:
                if isinstance(raw, (str, bytes)):
                    raise MmzooError(f"{raw_field} must be a list, got the string {raw!r}")
                media[kind] = self.raw_media(kind, list(raw), processor)
        counts = {kind: media[kind].counts if kind in media else [] for kind in self.modalities}
        tokens = {kind: self.placeholder(kind, processor) for kind in self.modalities}
        if request.prompt_token_ids is not None:
            input_ids = np.asarray(request.prompt_token_ids, dtype=np.int64)
            for kind in self.modalities:
                others = [k for k in self.modalities if k != kind and tokens[k][1] == tokens[kind][1]]
                if others and kind not in media:
                    continue  # its placeholder token is another modality's (InternVL's videos: the image token)
                if any(k in media for k in others):
                    raise MmzooError(_tell_apart(sorted([kind, *[k for k in others if k in media]]), tokens[kind][1]))
                input_ids = self.expand_token_prompt(kind, input_ids, media.get(kind), processor)
        order = None  # each item's kind in prompt order: known for a rendered prompt
        if request.prompt_token_ids is None:
            input_ids, order = render_prompt(
                processor, request, list(self.modalities),
                {kind: (tokens[kind][0], [self.expand_placeholder(kind, media[kind], i, processor)
                                          for i in range(len(counts[kind]))]) for kind in self.modalities})
        places = _placeholder_positions(input_ids, {k: t for k, (_, t) in tokens.items()}, counts, order)
        mm_index = np.full(len(input_ids), -1, dtype=np.int64)
        calls: list[TowerInput] = []
        offset = 0
        for kind in self.modalities:
            if kind not in media:
                continue
            item, where = media[kind], places[kind]
            mm_index[where] = offset + (item.rows if item.rows is not None else np.arange(len(where)))
            offset += sum(call.num_embeds for call in item.calls)
            calls += item.calls
        positions, delta = self.positions(input_ids, media)
        grids = {k: m.grid for k, m in media.items() if m.grid is not None}
        lengths = {k: np.asarray(m.counts, np.int64) for k, m in media.items()
                   if MEDIA_FIELDS[k][2].endswith("_lengths")}
        extras = {name: value for m in media.values() for name, value in m.extras.items()}
        return Prepared(request=request, input_ids=input_ids, positions=positions, position_delta=delta,
                        mm_index=mm_index, media=calls, grids=grids, lengths=lengths, extras=extras)


def _placeholder_positions(ids: np.ndarray, tokens: dict[str, int], counts: dict[str, list[int]],
                           order: list[str] | None) -> dict[str, np.ndarray]:
    """Each modality's placeholder positions in ``ids``: its token's, or, for modalities whose items
    fill one token (:attr:`Family.shared_placeholders`), that token's split among the items in prompt
    ``order`` (each item's kind; None for a token prompt, which then may hold items of one of them).

    Raises:
        MmzooError: a token's positions do not add up to its items' counts; items of modalities
            sharing a token in a token prompt."""
    out = {}
    for token in dict.fromkeys(tokens.values()):
        kinds = [k for k, t in tokens.items() if t == token]
        where = np.flatnonzero(ids == token)
        want = sum(sum(counts[k]) for k in kinds)
        if len(where) != want:
            given = " and ".join(f"the {len(counts[k])} {k}s give {sum(counts[k])} ({counts[k]})" for k in kinds)
            names = "/".join(kinds)
            raise MmzooError(f"prompt has {len(where)} {names} placeholder tokens but {given}")
        present = [k for k in kinds if counts[k]]
        if len(present) <= 1:
            out.update({k: where if k in present else where[:0] for k in kinds})
            continue
        if order is None:
            raise MmzooError(_tell_apart(present, token))
        taken = {k: [] for k in kinds}
        at, seen = 0, {k: 0 for k in kinds}
        for kind in (k for k in order if k in kinds):
            n = counts[kind][seen[kind]]
            taken[kind].append(where[at:at + n])
            at, seen[kind] = at + n, seen[kind] + 1
        out.update({k: np.concatenate(v) if v else where[:0] for k, v in taken.items()})
    return out


def _tell_apart(kinds: list[str], token: int) -> str:
    return (f"prompt_token_ids: {' and '.join(k + 's' for k in kinds)} fill the same placeholder token (id {token}), "
            f"so a token prompt cannot tell their items apart; give them with a prompt or messages")


def _given(value) -> bool:
    return value is not None and not (isinstance(value, (list, tuple)) and not value)


# ---------------------------------------------------------------- weight names shared by families

_LM_RENAMES = [(r"\.self_attn\.", ".attn."), (r"\.input_layernorm\.", ".norm1."),
               (r"\.post_attention_layernorm\.", ".norm2.")]


def lm_key(key: str) -> str | None:
    """The composition's name for a language-model key of a ``*ForConditionalGeneration`` checkpoint
    (transformers 5's ``model.language_model.* / lm_head.*``, Idefics3's and SmolVLM's
    ``model.text_model.*``, or the hub's ``language_model.model.* / language_model.lm_head.*``), or
    None if it is not one."""
    for prefix, repl in (("model.language_model.", "lm."), ("language_model.model.", "lm."),
                         ("model.text_model.", "lm."), ("language_model.lm_head.", "lm.lm_head."),
                         ("lm_head.", "lm.lm_head.")):
        if key.startswith(prefix):
            new = repl + key[len(prefix):]
            for pattern, sub in _LM_RENAMES:
                new = re.sub(pattern, sub, new)
            return new
    return None


class SquareItems(Family):
    """A family whose tower items are fixed-size square images (Llava's images, InternVL's and
    SmolVLM's tiles, Gemma 3's views), each giving the LM the same number of tokens: the tower's XLA
    buckets are item counts and its compile-time inputs blank images. A subclass sets
    ``image_size``, ``in_channels`` and ``tokens_per_item`` in its ``__init__``."""

    image_size: int
    in_channels: int
    tokens_per_item: int

    def encoder_buckets(self, *, max_model_len: int, max_media_rows: int) -> list[int]:
        """Items per call: doubling up to as many items as a ``max_model_len`` prompt holds and as
        the executor's media buffer of ``max_media_rows`` embeddings takes."""
        from mmzoo.buckets import doubling

        return doubling(1, max(1, min(max_model_len, max_media_rows) // self.tokens_per_item))

    def check_item_tokens(self, processor, attr: str, source, *, what: str, why: str) -> None:
        """Refuse a processor whose placeholder count per item (its ``attr``: ``image_seq_length``,
        ``image_seq_len``) is not ``tokens_per_item``; the message says that ``what`` gives that many
        tokens and ``why``."""
        per = getattr(processor, attr, None)
        if per != self.tokens_per_item:
            raise MmzooError(f"{source}: the processor's {attr}={per!r}, but {what} gives {self.tokens_per_item} "
                             f"tokens{why}")

    def dummy_media(self, rows: int) -> TowerInput:
        """``rows`` blank items."""
        pixels = np.zeros((rows, self.in_channels, self.image_size, self.image_size), np.float32)
        return TowerInput(tower=self.tower, inputs={"pixel_values": pixels}, num_embeds=rows * self.tokens_per_item)
