"""Shared session fixtures: a tiny checkpoint of every family (and a Llava with a Qwen2 LM) built with
transformers by mmzoo.fixtures, test images and audio clips."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before anything imports torch_xla
# XLA:CPU's LLVM backend at its lowest optimization level: the suite compiles hundreds of graphs of tiny models,
# whose compile time dominates their run time (the XLA parity cases of Qwen3-VL and Gemma 3: 43.6 -> 29.9 s). It
# changes how XLA's code is generated, not what the graphs compute: every parity and tokens test holds as it is.
# The benchmark recipes run outside the tests, at XLA's default level. (Subprocesses the tests start inherit it.)
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import pytest  # noqa: E402

from mmzoo.fixtures import make_audio, make_image, write_wav  # noqa: E402


def tiny_checkpoint(name: str, family: str, doc: str, **kwargs):
    """A session fixture ``name``: the tiny random checkpoint ``family`` declares
    (``Family.tiny_checkpoint``, a function of mmzoo.fixtures), built once per run at
    ``<tmp>/<name without _ckpt>`` with ``seed=0`` and ``kwargs``."""

    def build(tmp_path_factory):
        from mmzoo.config import family_class
        from mmzoo.fixtures import tiny_checkpoint_builder

        make = tiny_checkpoint_builder(family_class(family))
        return make(tmp_path_factory.mktemp("ckpt") / name.removesuffix("_ckpt"), seed=0, **kwargs)

    build.__doc__ = doc
    return pytest.fixture(scope="session", name=name)(build)


qwen2_vl_ckpt = tiny_checkpoint("qwen2_vl_ckpt", "qwen2_vl",
                                "A random tiny Qwen2VLForConditionalGeneration + tokenizer + processor.")
qwen2_5_vl_ckpt = tiny_checkpoint("qwen2_5_vl_ckpt", "qwen2_5_vl", "A random tiny Qwen2_5_VLForConditionalGeneration "
                                  "(windowed RMSNorm ViT) + tokenizer + processor.")
qwen3_vl_ckpt = tiny_checkpoint("qwen3_vl_ckpt", "qwen3_vl", "A random tiny Qwen3VLForConditionalGeneration (learned "
                                "position grid, DeepStack, interleaved M-RoPE) + tokenizer + processor.")
llava_ckpt = tiny_checkpoint("llava_ckpt", "llava",
                             "A random tiny LlavaForConditionalGeneration (CLIP ViT + MLP projector + Llama).")
llava_qwen2_ckpt = tiny_checkpoint("llava_qwen2_ckpt", "llava",
                                   "A tiny Llava whose text model is Qwen2 (LLaVA-Interleave / OneVision style).",
                                   text_model_type="qwen2")
llava_onevision_ckpt = tiny_checkpoint("llava_onevision_ckpt", "llava_onevision", "A random tiny "
                                      "LlavaOnevisionForConditionalGeneration (SigLIP on 56 px anyres tiles + packed "
                                      "projector + Qwen2).")
internvl_ckpt = tiny_checkpoint("internvl_ckpt", "internvl", "A random tiny InternVLForConditionalGeneration "
                               "(InternViT on 56 px tiles + pixel shuffle + Qwen2).")
smolvlm_ckpt = tiny_checkpoint("smolvlm_ckpt", "smolvlm", "A random tiny SmolVLMForConditionalGeneration (SigLIP on 56 px "
                              "tiles + pixel shuffle + linear + Llama).")
gemma3_ckpt = tiny_checkpoint("gemma3_ckpt", "gemma3", "A random tiny Gemma3ForConditionalGeneration (SigLIP at 56 px + "
                             "average pool to 4 tokens + the Gemma 3 LM with sliding and full layers).")
qwen2_audio_ckpt = tiny_checkpoint("qwen2_audio_ckpt", "qwen2_audio", "A random tiny "
                                   "Qwen2AudioForConditionalGeneration (Whisper encoder + projector + Qwen2).")


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
def audio_files(tmp_path_factory):
    """0.5 s and 1.3 s at 16 kHz, 0.8 s at 8 kHz (librosa resamples it; the tiny window is 2 s)."""
    root = tmp_path_factory.mktemp("audio")
    return [str(write_wav(root / "a0.wav", make_audio(0.5, seed=0))),
            str(write_wav(root / "a1.wav", make_audio(1.3, seed=1))),
            str(write_wav(root / "a2.wav", make_audio(0.8, seed=2, sampling_rate=8000), 8000))]


@pytest.fixture(scope="session")
def tiny_checkpoints(request, tmp_path_factory):
    """One tiny checkpoint per conf/model family: its ``<name>_ckpt`` fixture above, or else the
    one its family declares (``Family.tiny_checkpoint``), built here."""
    import mmzoo.fixtures
    from mmzoo.config import family_class, options

    out = {}
    for name in options("model"):
        try:
            out[name] = request.getfixturevalue(f"{name}_ckpt")
        except pytest.FixtureLookupError:
            make = mmzoo.fixtures.tiny_checkpoint_builder(family_class(name))
            out[name] = make(tmp_path_factory.mktemp("ckpt") / name, seed=0)
    return out
