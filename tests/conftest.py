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
