"""Shared fixtures: a tiny Qwen2-VL checkpoint built with transformers, and test images."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before anything imports torch_xla

import pytest  # noqa: E402

from mmzoo.fixtures import make_image, make_tiny_qwen2_vl  # noqa: E402


@pytest.fixture(scope="session")
def qwen2_vl_ckpt(tmp_path_factory):
    """A random tiny Qwen2VLForConditionalGeneration + tokenizer + processor, saved with save_pretrained."""
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("ckpt") / "qwen2_vl", seed=0)


@pytest.fixture(scope="session")
def image_files(tmp_path_factory):
    """Three PNGs of different sizes and aspect ratios."""
    root = tmp_path_factory.mktemp("images")
    paths = []
    for i, (w, h) in enumerate([(56, 56), (84, 56), (56, 112)]):
        path = root / f"img{i}.png"
        make_image(w, h, seed=i).save(path)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="session")
def recipes():
    """The repository's recipes/ folder: a user's config dir (a model file of its own in recipes/model/)."""
    from pathlib import Path

    return Path(__file__).resolve().parent.parent / "recipes"


@pytest.fixture(scope="session")
def llava_ckpt(tmp_path_factory):
    """A random tiny LlavaForConditionalGeneration (CLIP ViT + MLP projector + Llama)."""
    from mmzoo.fixtures import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("ckpt") / "llava", seed=0)


@pytest.fixture(scope="session")
def qwen2_audio_ckpt(tmp_path_factory):
    """A random tiny Qwen2AudioForConditionalGeneration (Whisper encoder + projector + Qwen2)."""
    from mmzoo.fixtures import make_tiny_qwen2_audio

    return make_tiny_qwen2_audio(tmp_path_factory.mktemp("ckpt") / "qwen2_audio", seed=0)


@pytest.fixture(scope="session")
def audio_files(tmp_path_factory):
    """0.5 s and 1.3 s at 16 kHz, 0.8 s at 8 kHz (librosa resamples it; the tiny window is 2 s)."""
    from mmzoo.fixtures import make_audio, write_wav

    root = tmp_path_factory.mktemp("audio")
    return [str(write_wav(root / "a0.wav", make_audio(0.5, seed=0))),
            str(write_wav(root / "a1.wav", make_audio(1.3, seed=1))),
            str(write_wav(root / "a2.wav", make_audio(0.8, seed=2, sampling_rate=8000), 8000))]


@pytest.fixture(scope="session")
def tiny_checkpoints(qwen2_vl_ckpt, llava_ckpt, qwen2_audio_ckpt):
    """One tiny checkpoint per conf/model family."""
    return {"qwen2_vl": qwen2_vl_ckpt, "llava": llava_ckpt, "qwen2_audio": qwen2_audio_ckpt}


@pytest.fixture(scope="session")
def llava_qwen2_ckpt(tmp_path_factory):
    """A tiny Llava whose text model is Qwen2 (LLaVA-Interleave / OneVision style)."""
    from mmzoo.fixtures import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("llava_qwen2") / "llava_qwen2", seed=0, text_model_type="qwen2")
