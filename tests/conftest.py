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
def tiny_checkpoints(tmp_path_factory, qwen2_vl_ckpt):
    """One tiny checkpoint per conf/model family."""
    from mmzoo.fixtures import make_tiny_llava, make_tiny_qwen2_audio

    root = tmp_path_factory.mktemp("zoo")
    return {"qwen2_vl": qwen2_vl_ckpt, "llava": make_tiny_llava(root / "llava", seed=0),
            "qwen2_audio": make_tiny_qwen2_audio(root / "qwen2_audio", seed=0)}


@pytest.fixture(scope="session")
def llava_qwen2_ckpt(tmp_path_factory):
    """A tiny Llava whose text model is Qwen2 (LLaVA-Interleave / OneVision style)."""
    from mmzoo.fixtures import make_tiny_llava

    return make_tiny_llava(tmp_path_factory.mktemp("llava_qwen2") / "llava_qwen2", seed=0, text_model_type="qwen2")
