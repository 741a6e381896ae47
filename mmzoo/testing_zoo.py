"""Tiny, real Hugging Face Llava and Qwen2-Audio checkpoints built locally, for tests and random defaults.

The companions of :func:`mmzoo.testing.make_tiny_qwen2_vl`, built the same way: the tokenizer is
:func:`mmzoo.testing.train_tokenizer` plus the family's own placeholder tokens, the weights are
drawn from a seeded generator, and everything is written with transformers' ``save_pretrained``.

Typical use::

    from mmzoo.testing_zoo import make_audio, make_tiny_llava, make_tiny_qwen2_audio, write_wav
    llava = make_tiny_llava(tmp_path / "llava", seed=0)
    audio = make_tiny_qwen2_audio(tmp_path / "qwen2_audio", seed=0)
    write_wav(tmp_path / "a.wav", make_audio(0.5, seed=1))
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mmzoo.testing import SPECIAL_TOKENS, _reinit_, train_tokenizer

__all__ = ["LLAVA_IMAGE_TOKEN", "AUDIO_TOKENS", "llava_chat_template", "make_tiny_llava", "make_tiny_qwen2_audio",
           "make_audio", "write_wav"]

LLAVA_IMAGE_TOKEN = "<image>"
AUDIO_TOKENS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")  # Qwen2-Audio's, in the order they get ids


def _tokenizer(extra: tuple[str, ...], *, seed: int, vocab_size: int):
    """:func:`mmzoo.testing.train_tokenizer` with ``extra`` special tokens after its own."""
    from tokenizers import AddedToken

    tokenizer = train_tokenizer(vocab_size, seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS) + [
        AddedToken(tok, special=True, normalized=False) for tok in extra]})
    return tokenizer


def _vocab(tokenizer, multiple: int) -> int:
    return -(-len(tokenizer) // multiple) * multiple


def _finish(model, tokenizer, *, seed: int, std: float, eos: int, pad: int) -> None:
    """Seeded weights; rows past the tokenizer zeroed (never produced, never decoded); eos in the
    generation config."""
    from transformers import GenerationConfig

    _reinit_(model, seed=seed, std=std)
    with torch.no_grad():
        model.get_output_embeddings().weight[len(tokenizer):] = 0.0
        model.get_input_embeddings().weight[len(tokenizer):] = 0.0
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False)


def llava_chat_template() -> str:
    """A Llava-1.5-style template: ``USER: <image>\\n...text\\nASSISTANT:``.

    Each turn is ``ROLE: content\\n`` (``USER``, ``ASSISTANT`` or ``SYSTEM``); an image item becomes
    ``<image>\\n`` (the processor expands it to one token per image feature), text items are
    written verbatim, and assistant turns end with ``<|im_end|>`` (the eos token).
    """
    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'user' -%}{{- 'USER: ' -}}"
        "{%- elif message['role'] == 'assistant' -%}{{- 'ASSISTANT: ' -}}"
        "{%- else -%}{{- 'SYSTEM: ' -}}{%- endif -%}"
        "{%- if message['content'] is string -%}"
        "{{- message['content'] -}}"
        "{%- else -%}"
        "{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'image' or 'image' in item -%}"
        "{{- '<image>\\n' -}}"
        "{%- elif item['type'] == 'text' -%}"
        "{{- item['text'] -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- endif -%}"
        "{%- if message['role'] == 'assistant' -%}{{- '<|im_end|>' -}}{%- endif -%}"
        "{{- '\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
    )


def make_tiny_llava(
    path: str | Path,
    *,
    seed: int = 0,
    tokenizer_seed: int = 0,
    tokenizer_vocab_size: int = 768,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    rope_theta: float = 10000.0,
    vision_hidden_size: int = 32,
    vision_layers: int = 3,
    vision_heads: int = 2,
    vision_intermediate_size: int = 64,
    image_size: int = 56,
    patch_size: int = 14,
    vision_feature_layer: int | list[int] = -2,
    vision_feature_select_strategy: str = "default",
    projector_hidden_act: str = "gelu",
    init_std: float = 0.1,
    vocab_multiple: int = 64,
) -> Path:
    """Builds and saves a random tiny ``LlavaForConditionalGeneration`` (CLIP ViT + MLP projector +
    Llama) with a ``LlavaProcessor`` (``CLIPImageProcessor`` resizing and center-cropping to
    ``image_size``) and :func:`llava_chat_template`.

    Args:
        path: output directory (created; existing files are overwritten).
        seed: seeds the weights; ``tokenizer_seed`` the tokenizer's corpus.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, rope_theta: the Llama LM.
        vision_hidden_size, vision_layers, vision_heads, vision_intermediate_size: the CLIP ViT.
        image_size, patch_size: the ViT's input side and patch side (``(image_size / patch_size)^2``
            patches, plus the class token).
        vision_feature_layer: the ViT hidden state(s) Llava feeds the projector (negative counts
            from the end; a list concatenates several).
        vision_feature_select_strategy: ``"default"`` drops the class token, ``"full"`` keeps it.
        projector_hidden_act: the projector's activation.
        init_std: standard deviation of the random weights (see :func:`mmzoo.testing.make_tiny_qwen2_vl`).
        vocab_multiple: the LM vocabulary is the tokenizer's length rounded up to this.

    Returns:
        ``path`` as a ``Path``.
    """
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    if image_size % patch_size:
        raise ValueError(f"image_size={image_size} is not a multiple of patch_size={patch_size}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer((LLAVA_IMAGE_TOKEN,), seed=tokenizer_seed, vocab_size=tokenizer_vocab_size)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS + (LLAVA_IMAGE_TOKEN,)}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    tokens_per_image = (image_size // patch_size) ** 2 + (vision_feature_select_strategy == "full")
    config = LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model", hidden_size=vision_hidden_size, intermediate_size=vision_intermediate_size,
            num_hidden_layers=vision_layers, num_attention_heads=vision_heads, num_channels=3, image_size=image_size,
            patch_size=patch_size, hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=vision_hidden_size,
            initializer_range=init_std,
        ),
        text_config=dict(
            model_type="llama", vocab_size=_vocab(tokenizer, vocab_multiple), hidden_size=hidden_size,
            intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)}, initializer_range=init_std,
            bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
        ),
        image_token_index=ids[LLAVA_IMAGE_TOKEN], image_seq_length=tokens_per_image,
        projector_hidden_act=projector_hidden_act, vision_feature_layer=vision_feature_layer,
        vision_feature_select_strategy=vision_feature_select_strategy,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    _finish(model, tokenizer, seed=seed, std=init_std, eos=eos, pad=pad)
    model.save_pretrained(path)
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy=vision_feature_select_strategy,
                               num_additional_image_tokens=1, image_token=LLAVA_IMAGE_TOKEN,
                               chat_template=llava_chat_template())
    processor.save_pretrained(path)
    return path


def make_tiny_qwen2_audio(
    path: str | Path,
    *,
    seed: int = 0,
    tokenizer_seed: int = 0,
    tokenizer_vocab_size: int = 768,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    rope_theta: float = 1_000_000.0,
    audio_d_model: int = 32,
    audio_layers: int = 2,
    audio_heads: int = 2,
    audio_ffn_dim: int = 64,
    num_mel_bins: int = 32,
    chunk_length: int = 2,
    sampling_rate: int = 16000,
    hop_length: int = 160,
    init_std: float = 0.1,
    vocab_multiple: int = 64,
) -> Path:
    """Builds and saves a random tiny ``Qwen2AudioForConditionalGeneration`` (Whisper-style encoder
    + average pooling + linear projector + Qwen2) with a ``Qwen2AudioProcessor``
    (``WhisperFeatureExtractor``) and the processor's own chat template.

    Whisper's window is 30 s (3000 mel frames, 1500 encoder positions); here it is ``chunk_length``
    seconds: the feature extractor pads every clip to ``chunk_length * sampling_rate / hop_length``
    frames and the encoder's ``max_source_positions`` is half that, as transformers' model requires.

    Args:
        path: output directory (created; existing files are overwritten).
        seed: seeds the weights; ``tokenizer_seed`` the tokenizer's corpus.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, rope_theta: the Qwen2 LM.
        audio_d_model, audio_layers, audio_heads, audio_ffn_dim: the audio encoder.
        num_mel_bins: mel channels of the features (Qwen2-Audio: 128).
        chunk_length: the window in seconds every clip is padded (or cut) to.
        sampling_rate, hop_length: the feature extractor's.
        init_std: standard deviation of the random weights.
        vocab_multiple: the LM vocabulary is the tokenizer's length rounded up to this.

    Returns:
        ``path`` as a ``Path``.
    """
    from transformers import (Qwen2AudioConfig, Qwen2AudioForConditionalGeneration, Qwen2AudioProcessor,
                              WhisperFeatureExtractor)

    frames = chunk_length * sampling_rate // hop_length
    if frames % 4:
        raise ValueError(f"chunk_length={chunk_length} s gives {frames} mel frames; the encoder needs a multiple of 4")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(AUDIO_TOKENS, seed=tokenizer_seed, vocab_size=tokenizer_vocab_size)
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS + AUDIO_TOKENS}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    config = Qwen2AudioConfig(
        audio_config=dict(
            model_type="qwen2_audio_encoder", num_mel_bins=num_mel_bins, encoder_layers=audio_layers,
            encoder_attention_heads=audio_heads, encoder_ffn_dim=audio_ffn_dim, d_model=audio_d_model,
            activation_function="gelu", max_source_positions=frames // 2, initializer_range=init_std,
        ),
        text_config=dict(
            model_type="qwen2", vocab_size=_vocab(tokenizer, vocab_multiple), hidden_size=hidden_size,
            intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)}, initializer_range=init_std,
            bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
        ),
        audio_token_index=ids["<|AUDIO|>"],
    )
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    _finish(model, tokenizer, seed=seed, std=init_std, eos=eos, pad=pad)
    model.save_pretrained(path)
    extractor = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=sampling_rate, hop_length=hop_length,
                                        chunk_length=chunk_length, n_fft=400)
    processor = Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tokenizer)
    processor.save_pretrained(path)
    return path


def make_audio(seconds: float, *, seed: int = 0, sampling_rate: int = 16000) -> np.ndarray:
    """A deterministic mono test clip: a few seeded sine tones with an envelope, plus a little noise.

    Returns:
        ``[round(seconds * sampling_rate)]`` float32 in [-1, 1].
    """
    if seconds < 0:
        raise ValueError(f"seconds={seconds} must be >= 0")
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * sampling_rate))) / sampling_rate
    wave = sum(rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * rng.uniform(100, 3000) * t + rng.uniform(0, 6.3))
               for _ in range(3))
    wave = wave * (0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(0.5, 3) * t)) + rng.normal(0, 0.01, t.shape)
    return np.clip(wave, -1, 1).astype(np.float32)


def write_wav(path: str | Path, audio: np.ndarray, sampling_rate: int = 16000) -> Path:
    """Write ``audio`` as 16-bit PCM WAV with soundfile (librosa's reader)."""
    import soundfile

    soundfile.write(str(path), np.asarray(audio, np.float32), sampling_rate, subtype="PCM_16")
    return Path(path)
