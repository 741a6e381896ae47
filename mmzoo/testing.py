"""Tiny, real Hugging Face Qwen2-VL checkpoints built locally, for tests and the random-weight default.

Nothing here touches the network: the tokenizer is a byte-level BPE trained on a synthetic corpus
generated in code, the weights are drawn from a seeded generator, and everything is written with
transformers' own ``save_pretrained`` so that the directory is exactly what ``from_pretrained``
(transformers' or mmzoo's) reads from a hub download.

Typical use::

    from mmzoo.testing import make_image, make_tiny_qwen2_vl
    ckpt = make_tiny_qwen2_vl(tmp_path / "qwen2_vl", seed=0)
    image = make_image(84, 56, seed=1)
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image

__all__ = [
    "SPECIAL_TOKENS",
    "chat_template",
    "synthetic_corpus",
    "train_tokenizer",
    "qwen2_vl_config",
    "generation_config",
    "save_processor",
    "make_tiny_qwen2_vl",
    "make_image",
]

# Qwen2-VL's control tokens, in the order they get ids (right after the BPE vocabulary, as on the hub).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

DEFAULT_SYSTEM = "You describe images and answer questions."

_COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white", "gray", "pink", "brown"]
_SHAPES = ["circle", "square", "triangle", "star", "rectangle", "line", "dot", "heart", "hexagon", "cross"]
_SIZES = ["small", "large", "tiny", "big", "thin", "wide"]
_PLACES = ["left", "right", "top", "bottom", "center", "corner", "middle", "edge"]
_NOUNS = ["cat", "dog", "house", "tree", "car", "bird", "boat", "story", "picture", "image", "video", "frame",
          "person", "table", "road", "river", "city", "garden", "flower", "window", "door", "book", "ball"]
_VERBS = ["is", "has", "shows", "looks", "sits", "runs", "moves", "stands", "holds", "contains", "appears"]
_ADVERBS = ["quickly", "slowly", "quietly", "often", "never", "always", "here", "there", "again", "together"]
_QUESTIONS = [
    "What shape is this?", "What color is it?", "Describe this image.", "Describe the video.",
    "How many shapes are there?", "Where is the {shape}?", "Is the {shape} {color}?",
    "Compare the two pictures.", "Tell me a story.", "What do you see?", "What is in the {place}?",
    "Which one is bigger?", "hello there", "Hello, who are you?", "Please answer briefly.",
]


def synthetic_corpus(seed: int = 0, num_lines: int = 600) -> list[str]:
    """A deterministic English-like corpus: questions and answers about shapes, plus plain sentences.

    Args:
        seed: seeds the line generator; the same seed gives the same corpus.
        num_lines: how many generated lines follow a few fixed ones (600 give about 33 KB).

    Returns:
        The corpus, one sentence or short question/answer pair per line.
    """
    rng = random.Random(seed)
    lines = [DEFAULT_SYSTEM, "system user assistant", "You are a helpful assistant.",
             "The quick brown fox jumps over the lazy dog.", "0 1 2 3 4 5 6 7 8 9 10 11 12 20 100",
             "Yes. No. Maybe, I think so!"]
    for i in range(num_lines):
        fill = {"shape": rng.choice(_SHAPES), "color": rng.choice(_COLORS), "place": rng.choice(_PLACES)}
        kind = i % 5
        if kind == 0:
            question = rng.choice(_QUESTIONS).format(**fill)
            answer = f"A {rng.choice(_SIZES)} {fill['color']} {fill['shape']} in the {fill['place']}."
            lines.append(f"{question} {answer}")
        elif kind == 1:
            n = rng.randint(1, 12)
            lines.append(f"There are {n} {rng.choice(_COLORS)} {rng.choice(_SHAPES)}s and {rng.randint(0, 9)} "
                         f"{rng.choice(_NOUNS)}s on the {rng.choice(_PLACES)}.")
        elif kind == 2:
            words = [rng.choice(_NOUNS).capitalize() if j == 0 else rng.choice(_NOUNS + _VERBS + _ADVERBS + _COLORS)
                     for j in range(rng.randint(4, 10))]
            lines.append(" ".join(words) + rng.choice([".", "!", "?", ", and then it ends."]))
        elif kind == 3:
            role = rng.choice(["system", "user", "assistant"])
            lines.append(f"{role}\n{rng.choice(_QUESTIONS).format(**fill)} The {role} says {rng.choice(_ADVERBS)}.")
        else:
            lines.append(f"The {rng.choice(_NOUNS)} {rng.choice(_VERBS)} {rng.choice(_ADVERBS)} near the "
                         f"{rng.choice(_COLORS)} {rng.choice(_NOUNS)}, while the {rng.choice(_SHAPES)} "
                         f"{rng.choice(_VERBS)} {rng.choice(_PLACES)}.")
    return lines


def train_tokenizer(vocab_size: int = 768, *, seed: int = 0, corpus: list[str] | None = None):
    """Trains a byte-level BPE tokenizer and wraps it as a transformers fast tokenizer.

    The BPE model covers all 256 bytes, so any text round-trips. The Qwen2-VL control tokens
    (:data:`SPECIAL_TOKENS`) are added as special tokens with the ids right after the BPE
    vocabulary, ``<|im_end|>`` is the eos token, ``<|endoftext|>`` the pad token, and there is no
    bos token (nothing is prepended on encode), as with Qwen2-VL.

    Args:
        vocab_size: upper bound on the BPE vocabulary before the special tokens (at least 256,
            the byte alphabet); training stops earlier when no pair occurs twice (the default
            corpus gives about 680 entries). The tokenizer's length is the BPE vocabulary plus
            ``len(SPECIAL_TOKENS)``.
        seed: seeds :func:`synthetic_corpus` when ``corpus`` is not given.
        corpus: lines to train on instead of the synthetic corpus.

    Returns:
        A ``PreTrainedTokenizerFast`` (transformers 5's ``TokenizersBackend``).

    Raises:
        ValueError: if ``vocab_size`` is below 256.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256:
        raise ValueError(f"vocab_size={vocab_size} is below the 256-byte alphabet of a byte-level BPE")
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], min_frequency=2, show_progress=False)
    bpe.train_from_iterator(corpus if corpus is not None else synthetic_corpus(seed), trainer=trainer)
    # Added here, before wrapping, so their ids follow the BPE vocabulary in SPECIAL_TOKENS order.
    bpe.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        clean_up_tokenization_spaces=False, model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})  # already present: no new ids
    return tokenizer


def chat_template(default_system: str | None = DEFAULT_SYSTEM) -> str:
    """A Jinja chat template rendering the Qwen2-VL chat format.

    Each turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. Content is a string or a list of
    items: ``{"type": "image"}`` becomes ``<|vision_start|><|image_pad|><|vision_end|>``,
    ``{"type": "video"}`` becomes ``<|vision_start|><|video_pad|><|vision_end|>``, and text items
    are written verbatim. The processor later expands each pad token to one token per merged patch.
    With ``add_generation_prompt`` the template ends with ``<|im_start|>assistant\\n``.

    Args:
        default_system: system message prepended when the conversation does not open with a
            system turn; ``None`` for no default system turn.

    Returns:
        The template source.

    Raises:
        ValueError: if ``default_system`` holds characters that would break the Jinja source.
    """
    if default_system is not None and any(c in default_system for c in "{}%'\\"):
        raise ValueError(f"default_system is pasted into a Jinja string: no braces, %, quotes or backslashes, "
                         f"got {default_system!r}")
    opening = ""
    if default_system is not None:
        opening = ("{%- if not messages or messages[0]['role'] != 'system' -%}"
                   "{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' -}}"
                   "{%- endif -%}")
    return (
        opening
        + "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['content'] is string -%}"
        "{{- message['content'] -}}"
        "{%- else -%}"
        "{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'image' or 'image' in item or 'image_url' in item -%}"
        "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
        "{%- elif item['type'] == 'video' or 'video' in item -%}"
        "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
        "{%- elif item['type'] == 'text' -%}"
        "{{- item['text'] -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- endif -%}"
    )


def _reinit_(model: torch.nn.Module, *, seed: int, std: float) -> None:
    """Redraws every parameter from one seeded generator, in name order.

    Weights get ``N(0, std)``; biases get ``N(0, std)`` too and norm scales ``1 + N(0, std)``, so
    that a loader that drops a bias or a norm weight changes the logits instead of passing unseen.
    The draw does not depend on transformers' own init scheme, only on the parameter names and
    shapes, so it stays put across transformers versions that keep the module names.
    """
    gen = torch.Generator().manual_seed(seed)
    norms = {id(m.weight) for m in model.modules()
             if isinstance(m, torch.nn.LayerNorm) or type(m).__name__.endswith("RMSNorm")}
    with torch.no_grad():
        for _, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.copy_(noise + 1.0 if id(param) in norms else noise)


def qwen2_vl_config(
    tokenizer,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    mrope_section: tuple[int, int, int] | None = None,
    rope_theta: float = 1_000_000.0,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    vision_embed_dim: int = 32,
    vision_depth: int = 2,
    vision_num_heads: int = 2,
    patch_size: int = 14,
    spatial_merge_size: int = 2,
    temporal_patch_size: int = 2,
    init_std: float = 0.02,
    vocab_multiple: int = 64,
):
    """A ``Qwen2VLConfig`` of the given sizes whose token ids are those of ``tokenizer``.

    Args:
        tokenizer: a tokenizer from :func:`train_tokenizer` (it supplies the control-token ids).
        vocab_multiple: the model's vocab is the tokenizer's length rounded up to a multiple of
            this, so that rows past the tokenizer exist, as on the hub (Qwen2-VL: 151936 rows for
            151657 tokens).
        hidden_size: LM width, also the vision merger's output width.
        num_layers: LM decoder layers.
        num_heads: LM query heads.
        num_kv_heads: LM key/value heads (grouped-query attention when below ``num_heads``).
        intermediate_size: LM SwiGLU MLP width.
        mrope_section: rotary pairs given to the (temporal, height, width) positions; must sum to
            ``head_dim // 2``. Default splits ``head_dim // 2`` as 2:3:3, like Qwen2-VL's [16, 24, 24].
        rope_theta: LM rotary base.
        rms_norm_eps: LM RMSNorm epsilon.
        tie_word_embeddings: share ``lm_head`` with the token embedding (no ``lm_head.weight`` saved).
        vision_embed_dim: ViT width.
        vision_depth: ViT blocks.
        vision_num_heads: ViT heads.
        patch_size: ViT spatial patch size in pixels.
        spatial_merge_size: side of the square of patches the merger fuses into one LM token.
        temporal_patch_size: frames per patch (an image is repeated to fill it).
        init_std: the configs' ``initializer_range`` (transformers' init draws from it).

    Returns:
        The config.

    Raises:
        ValueError: if the head sizes or ``mrope_section`` do not fit together.
    """
    from transformers import Qwen2VLConfig

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}: "
                         "hidden_size must divide by num_heads and num_heads by num_kv_heads")
    if vision_embed_dim % vision_num_heads or (vision_embed_dim // vision_num_heads) % 4:
        raise ValueError(f"vision_embed_dim={vision_embed_dim} with vision_num_heads={vision_num_heads}: the head "
                         "dim must be a multiple of 4 (2D rotary over height and width)")
    half = hidden_size // num_heads // 2
    if mrope_section is None:
        t = half // 4
        mrope_section = (t, (half - t) // 2, half - t - (half - t) // 2)
    if len(mrope_section) != 3 or sum(mrope_section) != half:
        raise ValueError(f"mrope_section={list(mrope_section)} must have 3 parts summing to head_dim // 2 = {half}")

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    vocab_size = -(-len(tokenizer) // vocab_multiple) * vocab_multiple
    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
            hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta),
                             "mrope_section": list(mrope_section)},
            initializer_range=init_std, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=vision_depth, embed_dim=vision_embed_dim, hidden_size=hidden_size, num_heads=vision_num_heads,
            mlp_ratio=4, hidden_act="quick_gelu", in_channels=3, patch_size=patch_size,
            spatial_merge_size=spatial_merge_size, temporal_patch_size=temporal_patch_size,
            initializer_range=init_std,
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
    )


def generation_config(tokenizer):
    """Greedy decoding that stops at ``<|im_end|>`` (``generation_config.json``)."""
    from transformers import GenerationConfig

    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad, do_sample=False)


def save_processor(
    path: str | Path,
    tokenizer,
    config,
    *,
    min_pixels: int = 28 * 28,
    max_pixels: int = 224 * 224,
    default_system: str | None = DEFAULT_SYSTEM,
):
    """Writes the Qwen2-VL processor of a checkpoint: tokenizer, image and video processor configs,
    ``chat_template.jinja``.

    Args:
        path: the checkpoint directory.
        tokenizer: the checkpoint's tokenizer (from :func:`train_tokenizer`).
        config: the checkpoint's ``Qwen2VLConfig``: patch, temporal patch and merge sizes.
        min_pixels: image processor's lower bound on resized area (``size["shortest_edge"]``).
        max_pixels: image processor's upper bound on resized area (``size["longest_edge"]``).
        default_system: system message the chat template adds when none is given (``None``: none).

    Returns:
        The ``Qwen2VLProcessor`` that was saved.
    """
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    vc = config.vision_config
    vision_kwargs = dict(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=vc.patch_size,
                         temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**vision_kwargs), tokenizer=tokenizer,
                                 video_processor=Qwen2VLVideoProcessor(**vision_kwargs, cap_pixels_per_frame=True),
                                 chat_template=chat_template(default_system))
    processor.save_pretrained(path)
    return processor


def make_tiny_qwen2_vl(
    path: str | Path,
    *,
    seed: int = 0,
    tokenizer_seed: int = 0,
    tokenizer_vocab_size: int = 768,
    min_pixels: int = 28 * 28,
    max_pixels: int = 224 * 224,
    init_std: float = 0.1,
    default_system: str | None = DEFAULT_SYSTEM,
    max_shard_size: str | int | None = None,
    **sizes,
) -> Path:
    """Builds and saves a random tiny ``Qwen2VLForConditionalGeneration`` with its processor.

    The directory holds ``config.json``, ``generation_config.json`` (eos ``<|im_end|>``),
    ``model.safetensors`` (or shards plus ``model.safetensors.index.json``), the tokenizer, the
    image and video processor configs and ``chat_template.jinja``, all written by transformers'
    ``save_pretrained``; it loads back offline with ``AutoProcessor.from_pretrained`` and
    ``Qwen2VLForConditionalGeneration.from_pretrained``. The same arguments give the same bytes of
    weights.

    Args:
        path: output directory (created; existing files are overwritten).
        seed: seeds the weights.
        tokenizer_seed: seeds the tokenizer's corpus; kept apart from ``seed`` so that
            checkpoints of different seeds share one tokenizer (same prompt ids).
        tokenizer_vocab_size: upper bound on the BPE vocabulary (see :func:`train_tokenizer`).
        min_pixels: image processor's lower bound on resized area (``size["shortest_edge"]``).
        max_pixels: image processor's upper bound on resized area (``size["longest_edge"]``).
        init_std: standard deviation of the random weights (also written as the configs'
            ``initializer_range``); large enough (vs transformers' 0.02) that logits are far from
            uniform and greedy decoding is not decided by float noise: with the defaults the
            top-1/top-2 logit gap over greedy steps has a median near 0.2 and rarely goes below 1e-3.
        default_system: system message the chat template adds when none is given (``None``: none).
        max_shard_size: passed to ``save_pretrained`` (e.g. ``"100KB"``) to write sharded weights.
        sizes: the model's sizes, passed to :func:`qwen2_vl_config` (``hidden_size=64``,
            ``num_layers=2``, ``vision_embed_dim=32``, ..., ``vocab_multiple=64``). The rows past
            the tokenizer are zero in ``lm_head`` and the embedding, so greedy decoding never
            produces an id the tokenizer cannot decode.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: if the head sizes or ``mrope_section`` do not fit together.
    """
    from transformers import Qwen2VLForConditionalGeneration

    path = Path(path)
    tokenizer = train_tokenizer(tokenizer_vocab_size, seed=tokenizer_seed)
    config = qwen2_vl_config(tokenizer, init_std=init_std, **sizes)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    _reinit_(model, seed=seed, std=init_std)
    with torch.no_grad():  # rows past the tokenizer: never produced (logit 0 loses to the max), never decoded
        model.get_output_embeddings().weight[len(tokenizer):] = 0.0
        model.get_input_embeddings().weight[len(tokenizer):] = 0.0
    model.generation_config = generation_config(tokenizer)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)
    save_processor(path, tokenizer, config, min_pixels=min_pixels, max_pixels=max_pixels,
                   default_system=default_system)
    return path


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic RGB test image: a seeded color gradient with a few solid rectangles.

    Args:
        width: image width in pixels.
        height: image height in pixels.
        seed: selects the colors and rectangles.

    Returns:
        A PIL ``RGB`` image of size ``(width, height)``; never one flat color (from 2 pixels up).
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size {width}x{height} must be positive")
    rng = np.random.default_rng(seed)
    ys = np.linspace(0.0, 1.0, height)[:, None, None]  # [h, 1, 1]
    xs = np.linspace(0.0, 1.0, width)[None, :, None]  # [1, w, 1]
    a, b, c = (rng.uniform(0, 255, size=3) for _ in range(3))
    pixels = a * (1 - xs) * (1 - ys) + b * xs + c * ys * (1 - xs)  # [h, w, 3]
    pixels = np.broadcast_to(pixels, (height, width, 3)).copy()
    for _ in range(3):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        x1, y1 = x0 + rng.integers(1, max(2, width // 2)), y0 + rng.integers(1, max(2, height // 2))
        pixels[y0:y1, x0:x1] = rng.uniform(0, 255, size=3)
    pixels[0, 0], pixels[-1, -1] = 0.0, 255.0  # first and last pixels differ: never one flat color
    return Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8))  # [h, w, 3] uint8: RGB
