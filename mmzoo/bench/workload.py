"""What the benchmark runs on: the checkpoint, the prompts and the seeded request workload.

The family-specific parts come from the family's own declarations (:func:`family`): the fixture
that builds a random checkpoint (``checkpoint.random`` holds its keyword arguments), the
transformers class of the peer, and the media kind of the requests (images or audio clips), which also picks the
workload's media fields (``max_images`` / ``image_sizes`` or ``max_audios`` / ``audio_seconds``).
Everything else (the prompt text, the request mix, the text-only sweep requests) is the same for
every family, so that the same config measures each family the same way. The base of the
package: :func:`say`, the progress line every stage prints, lives here too.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from mmzoo.errors import MmzooError
from mmzoo.files import atomic_path

CKPT_VERSION = 1  # bump when a make_tiny_* fixture's output changes, to rebuild cached benchmark checkpoints
AUDIO_RATE = 16000  # Hz: the clips' rate when the processor names none
_T0 = time.perf_counter()


def say(msg: str) -> None:
    """A progress line on stderr (every stage's), stamped with the seconds since the benchmark was imported."""
    print(f"bench [{time.perf_counter() - _T0:6.1f} s]: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Family:
    """What the benchmark needs to know about one conf/model family."""

    fixture: str  # the mmzoo.fixtures function that builds a random checkpoint
    hf_class: str  # the transformers class of the peer
    media: str  # "image" or "audio": what a request carries

    @property
    def field(self) -> str:
        """The request field of the media (``images`` / ``audios``)."""
        return f"{self.media}s"

    def workload_keys(self) -> tuple[str, str]:
        """The workload's keys for this media: the most items per request, the item sizes to draw from."""
        return ("max_images", "image_sizes") if self.media == "image" else ("max_audios", "audio_seconds")

    def make_item(self, size, seed: int, sampling_rate: int = AUDIO_RATE) -> Any:
        """One test item: a PIL image of ``size = (width, height)``, or a 1-D float32 clip of
        ``size`` seconds at ``sampling_rate``."""
        from mmzoo.fixtures import make_audio, make_image

        if self.media == "image":
            width, height = (int(v) for v in size)
            return make_image(width, height, seed=seed)
        return make_audio(float(size), seed=seed, sampling_rate=sampling_rate)

    def processor_media(self, items: list, processor) -> dict:
        """The media keyword arguments of the transformers processor's call on ``items``: a request's
        images as one sample, as ``apply_chat_template`` hands a conversation's (LLaVA-OneVision reads
        several images of one sample as base views; every other family is the same either way)."""
        if self.media == "image":
            return {"images": [items] if items else None}
        return {"audio": items or None, "sampling_rate": sampling_rate(processor)}


def family(name: str) -> Family:
    """What the benchmark needs of ``family=name``, from the family's own declarations
    (:attr:`~mmzoo.models.Family.tiny_checkpoint`, :attr:`~mmzoo.models.Family.hf_class`, its first
    modality): a family joins the benchmark by its conf file alone."""
    from mmzoo.config import family_class

    try:
        cls = family_class(name)
    except MmzooError as e:
        raise MmzooError(f"family={name}: {e}") from None
    media = next((m for m in cls.modalities if m in ("image", "audio")), None)
    if not (cls.tiny_checkpoint and cls.hf_class and media):
        raise MmzooError(f"family={name}: {cls.__name__} declares no tiny_checkpoint / hf_class / image or audio "
                         f"modality, which the benchmark needs")
    return Family(cls.tiny_checkpoint, cls.hf_class, media)


def sampling_rate(processor) -> int:
    """The rate the checkpoint's feature extractor takes clips at (mmzoo reads 1-D arrays at it)."""
    fe = getattr(processor, "feature_extractor", None)
    return int(getattr(fe, "sampling_rate", None) or AUDIO_RATE)


# ---------------------------------------------------------------- the checkpoint

def bench_checkpoint(cfg: DictConfig) -> Path:
    """``checkpoint.path``, or a random checkpoint of ``cfg.family`` built by its fixture from
    ``checkpoint.random`` (a null entry: the fixture's default), cached under the mmzoo cache."""
    fam = family(str(cfg.family))
    if cfg.checkpoint.path is not None:
        return _given_checkpoint(Path(cfg.checkpoint.path), fam, str(cfg.family))
    sizes = {k: v for k, v in OmegaConf.to_container(cfg.checkpoint.random, resolve=True).items() if v is not None}
    key = hashlib.sha256(json.dumps({"v": CKPT_VERSION, **sizes}, sort_keys=True).encode()).hexdigest()[:12]
    from mmzoo.paths import cache_dir

    path = cache_dir() / "bench" / f"{cfg.family}-{key}"
    if not (path / "config.json").is_file():
        _build(path, fam, sizes)
    return path


def _given_checkpoint(path: Path, fam: Family, model: str) -> Path:
    if not (path / "config.json").is_file():
        raise MmzooError(f"checkpoint.path={path} has no config.json")
    archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    if archs and fam.hf_class not in archs:
        raise MmzooError(f"checkpoint.path={path} is a {archs[0]} checkpoint, not family={model}'s {fam.hf_class}; "
                         f"set model= to its family")
    return path


def _build(path: Path, fam: Family, sizes: dict) -> None:
    from mmzoo.fixtures.registry import by_path

    say(f"building a random {fam.hf_class} checkpoint at {path}")
    path.parent.mkdir(parents=True, exist_ok=True)  # the cache folder on a fresh machine
    try:
        with atomic_path(path, directory=True) as tmp:
            by_path(fam.fixture if "." in fam.fixture else f"mmzoo.fixtures.{fam.fixture}")(tmp, **sizes)
    except TypeError as e:  # a size name the family's fixture does not take
        raise MmzooError(f"checkpoint.random: {e}; it holds the keyword arguments of mmzoo.fixtures.{fam.fixture} "
                         f"(conf/bench.yaml's are Qwen2-VL's: a recipe for another family sets those it lacks "
                         f"to null, as recipes/bench_llava_smoke.yaml does)") from None


# ---------------------------------------------------------------- prompts and requests

class PromptText:
    """Prompts of a given number of text tokens, cut from the tokenizer's own synthetic corpus."""

    def __init__(self, tokenizer, seed: int):
        from mmzoo.fixtures import synthetic_corpus

        self.tokenizer = tokenizer
        self.pool = tokenizer(" ".join(synthetic_corpus(seed)))["input_ids"]

    def __call__(self, n: int, rng: np.random.Generator) -> str:
        if n > len(self.pool):
            raise MmzooError(f"a prompt of {n} tokens is longer than the corpus ({len(self.pool)} tokens)")
        start = int(rng.integers(0, len(self.pool) - n + 1))
        return self.tokenizer.decode(self.pool[start:start + n])


def make_workload(wl: DictConfig, text: PromptText, fam: Family, *, sampling_rate: int = AUDIO_RATE) -> list[dict]:
    """``num_requests`` request dicts from ``wl.seed``: the prompt length, the media count and each
    item's size (an image's ``(width, height)``, a clip's seconds) drawn per request."""
    count_key, sizes_key = fam.workload_keys()
    rng = np.random.default_rng(int(wl.seed))
    lo, hi = (int(x) for x in wl.prompt_len)
    sizes = list(wl[sizes_key])
    reqs = []
    for i in range(int(wl.num_requests)):
        n_text = int(rng.integers(lo, hi + 1))
        n_items = int(rng.integers(0, int(wl[count_key]) + 1)) if sizes else 0
        items = [fam.make_item(sizes[int(rng.integers(len(sizes)))], int(wl.seed) * 100_000 + i * 10 + j,
                               sampling_rate) for j in range(n_items)]
        reqs.append({"prompt": text(n_text, rng), fam.field: items, "max_new_tokens": int(wl.max_new_tokens),
                     "ignore_eos": True})
    return reqs


def text_requests(text: PromptText, n: int, prompt_len: int, max_new_tokens: int,
                  rng: np.random.Generator) -> list[dict]:
    """``n`` text-only requests of ``prompt_len`` text tokens (the batch and tensor-parallel sweeps')."""
    return [{"prompt": text(int(prompt_len), rng), "max_new_tokens": int(max_new_tokens), "ignore_eos": True}
            for _ in range(n)]


def image_request(text: PromptText, fam: Family, seed: int, width: int, height: int, prompt_len: int) -> dict:
    """The image-size sweep's request: one ``width x height`` image and one output token."""
    rng = np.random.default_rng(seed + width * 7 + height)
    return {"prompt": text(int(prompt_len), rng), "images": [fam.make_item((width, height), width + height)],
            "max_new_tokens": 1, "ignore_eos": True}
