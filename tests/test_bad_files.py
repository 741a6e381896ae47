"""Bad checkpoints and media files (issue 21): each is refused where it enters with one
:class:`MmzooError` naming the file or field and the numbers, never another exception."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image
from torch import nn

import mmzoo
from mmzoo.checkpoint import load_strict
from mmzoo.errors import MmzooError
from mmzoo.fixtures import make_audio, make_image, write_wav
from mmzoo.models._media import MAX_ASPECT_RATIO, MAX_IMAGE_PIXELS, MIN_IMAGE_SIDE, load_audios

PROMPT = "What is this?"


# ----------------------------------------------------------------------------- checkpoints

def _halve(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _index(content):
    def write(ckpt: Path) -> None:  # the index wins over model.safetensors
        text = content if isinstance(content, str) else json.dumps(content)
        (ckpt / "model.safetensors.index.json").write_text(text)
    return write


def _architecture(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))


CHECKPOINTS = {
    "no_config": (lambda c: (c / "config.json").unlink(), r"checkpoint .*/ckpt has no config\.json$"),
    "config_not_json": (lambda c: (c / "config.json").write_text('{"architectures": '),
                        r"ckpt/config\.json is not valid JSON \(Expecting value: line 1 column 19"),
    "config_not_utf8": (lambda c: (c / "config.json").write_bytes(b"\xff\xfe{}"),
                        r"ckpt/config\.json is not valid JSON \(.*can't decode byte 0xff"),
    "config_a_list": (lambda c: (c / "config.json").write_text("[1, 2]"),
                      r"ckpt/config\.json is not a JSON object \(it holds a list\)"),
    "truncated_safetensors": (lambda c: _halve(c / "model.safetensors"),
                              r"checkpoint file .*ckpt/model\.safetensors is not a readable safetensors file "
                              r"\(.*incomplete metadata, file not fully covered\): it may be truncated or corrupt"),
    "garbage_safetensors": (lambda c: (c / "model.safetensors").write_bytes(b"x" * 100),
                            r"ckpt/model\.safetensors is not a readable safetensors file \(.*header too large\)"),
    "index_not_json": (_index("{weight_map"), r"ckpt/model\.safetensors\.index\.json is not valid JSON"),
    "index_no_weight_map": (_index({"metadata": {"total_size": 1}}),
                            r"model\.safetensors\.index\.json has no weight_map \(tensor name -> shard file name\)"),
    "index_weight_map_list": (_index({"weight_map": ["model.safetensors"]}),
                              r"index\.json: weight_map must map each tensor name to a shard file name, "
                              r"got \[\"model\.safetensors\"\]"),
    "index_weight_map_ints": (_index({"weight_map": {"lm_head.weight": 1}}),
                              r"weight_map must map each tensor name to a shard file name, got \{\"lm_head\.weight\": 1\}"),
    "index_shard_outside": (_index({"weight_map": {"lm_head.weight": "../model.safetensors"}}),
                            r"index\.json: tensor lm_head\.weight is in '\.\./model\.safetensors', outside the "
                            r"checkpoint directory"),
    "index_shard_absolute": (_index({"weight_map": {"lm_head.weight": "/etc/hostname"}}),
                             r"tensor lm_head\.weight is in '/etc/hostname', outside the checkpoint directory"),
    "index_shard_missing": (_index({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}),
                            r"checkpoint shard .*ckpt/model-00002-of-00002\.safetensors listed in "
                            r"model\.safetensors\.index\.json does not exist"),
    "unsupported_architecture": (_architecture, r"config\.json architecture 'LlamaForCausalLM' is not supported; "
                                                r"the zoo has llava .*qwen2_vl \(Qwen2VLForConditionalGeneration\)"),
}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_bad_checkpoint(qwen2_vl_ckpt, tmp_path, case):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(qwen2_vl_ckpt, ckpt)
    breaker, match = CHECKPOINTS[case]
    breaker(ckpt)
    with pytest.raises(MmzooError, match=match):
        mmzoo.load(ckpt, executor="eager")


class _Touch:
    """Unpickling this creates ``path``: the proof that a checkpoint was unpickled."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_pickle_checkpoint_is_refused_unread(qwen2_vl_ckpt, tmp_path):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "unpickled"
    shutil.copytree(qwen2_vl_ckpt, ckpt)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(_Touch(marker)))
    pickle.loads((ckpt / "pytorch_model.bin").read_bytes())  # the marker works...
    assert marker.exists()
    marker.unlink()
    with pytest.raises(MmzooError, match=r"ckpt has no model\.safetensors or model\.safetensors\.index\.json "
                                         r"\(found pytorch_model\.bin: pickle weights are not loaded; convert them"):
        mmzoo.load(ckpt, executor="eager")
    assert not marker.exists()  # ...and mmzoo never unpickled it


def test_another_family_checkpoint_is_refused(qwen2_vl_ckpt):
    with pytest.raises(MmzooError, match=r"config\.json is a Qwen2VLForConditionalGeneration checkpoint, which "
                                         r"model=llava does not support \(it takes LlavaForConditionalGeneration\)"):
        mmzoo.load(qwen2_vl_ckpt, model="llava", executor="eager")


@pytest.mark.parametrize("change, match", [
    ("missing", r"weights in ckpt do not match the model: missing 1 tensors: fc2\.bias$"),
    ("extra", r"weights in ckpt do not match the model: unexpected 2 tensors: extra, fc3\.weight$"),
    ("shape", r"shape mismatch \(checkpoint vs model\): fc1\.weight \(4, 3\) vs \(3, 4\)$"),
])
def test_strict_loading_names_each_tensor(change, match):
    module = nn.ModuleDict({"fc1": nn.Linear(4, 3), "fc2": nn.Linear(3, 2)})
    state = dict(module.state_dict())
    if change == "missing":
        del state["fc2.bias"]
    elif change == "extra":
        state["extra"], state["fc3.weight"] = state["fc2.bias"], state["fc2.weight"]
    else:
        state["fc1.weight"] = state["fc1.weight"].T
    with pytest.raises(MmzooError, match=match):
        load_strict(module, state, source="ckpt")


# ----------------------------------------------------------------------------- images

def _png_header(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR claiming ``width x height`` pixels, with almost no data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def _image_file(kind: str, root: Path) -> Path:
    path = root / f"{kind}.png"
    if kind == "not_an_image":
        path.write_text("a text file named .png")
    elif kind == "empty":
        path.touch()
    elif kind == "truncated":
        make_image(64, 64, seed=0).save(path)
        _halve(path)
    elif kind == "bomb":  # a few bytes claiming 20000 x 20000: Pillow refuses it in Image.open
        path.write_bytes(_png_header(20000, 20000))
    elif kind == "over_limit":  # 10000 x 10000: over the limit, under Pillow's error (a warning there)
        path.write_bytes(_png_header(10000, 10000))
    elif kind == "directory":
        path.mkdir()
    elif kind != "missing":
        width, height = {"one_pixel": (1, 1), "too_wide": (20000, 10)}[kind]
        Image.new("RGB", (width, height)).save(path)
    return path


IMAGE_FILES = {
    "missing": r"images\[1\]: image file .*missing\.png does not exist",
    "directory": r"images\[1\]: .*directory\.png is not a file",
    "empty": r"images\[1\]: image file .*empty\.png is empty \(0 bytes\)",
    "not_an_image": r"images\[1\]: .*not_an_image\.png is not a readable image \(not a format Pillow knows\)",
    "truncated": r"images\[1\]: .*truncated\.png is not a readable image \(image file is truncated",
    "bomb": r"images\[1\]: .*bomb\.png is too large to decode: Image size \(400000000 pixels\) exceeds limit of "
            r"178956970 pixels",
    "over_limit": rf"images\[1\]: .*over_limit\.png is 10000x10000 pixels \(100000000\); an image may have at most "
                  rf"{MAX_IMAGE_PIXELS} pixels",
    "one_pixel": rf"images\[1\]: .*one_pixel\.png is 1x1 pixels; the shortest side must be at least {MIN_IMAGE_SIDE}",
    "too_wide": rf"images\[1\]: .*too_wide\.png is 20000x10 pixels, an aspect ratio of 2000:1; it may be at most "
                rf"{MAX_ASPECT_RATIO}:1",
}


@pytest.fixture(scope="module")
def vl_engine(qwen2_vl_ckpt):
    return mmzoo.load(qwen2_vl_ckpt, executor="eager")


@pytest.mark.parametrize("kind", list(IMAGE_FILES))
def test_bad_image_file(vl_engine, image_files, tmp_path, kind):
    bad = _image_file(kind, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)  # refused the same way when warnings raise
        with pytest.raises(MmzooError, match=IMAGE_FILES[kind]):
            vl_engine.prepare(mmzoo.Request(prompt=PROMPT, images=[image_files[0], str(bad)]))


IMAGE_OBJECTS = {
    "pil_one_pixel": (Image.new("RGB", (1, 1)), r"images\[0\]: the image is 1x1 pixels; the shortest side"),
    "pil_over_limit": (Image.new("1", (10000, 9000)),  # mode "1": 11 MB for the test, not 270 MB
                       rf"images\[0\]: the image is 10000x9000 pixels \(90000000\); an image may have at most "
                       rf"{MAX_IMAGE_PIXELS} pixels"),
    "array_one_row": (np.zeros((1, 50, 3), np.uint8), r"images\[0\]: the array is 50x1 pixels; the shortest side"),
    "array_too_tall": (np.zeros((20000, 10, 3), np.uint8),
                       r"images\[0\]: the array is 10x20000 pixels, an aspect ratio of 2000:1; it may be at most 200:1"),
    "array_over_limit": (np.broadcast_to(np.zeros((1, 1, 3), np.uint8), (9000, 10000, 3)),  # a view: no memory
                         r"images\[0\]: the array is 10000x9000 pixels \(90000000\)"),
}


@pytest.mark.parametrize("kind", list(IMAGE_OBJECTS))
def test_bad_image_object(vl_engine, kind):
    image, match = IMAGE_OBJECTS[kind]
    with pytest.raises(MmzooError, match=match):
        vl_engine.prepare(mmzoo.Request(prompt=PROMPT, images=[image]))


def test_images_at_the_limits_are_taken(vl_engine, llava_ckpt):
    """The smallest side and the widest aspect ratio allowed go through both families' processors
    (Qwen2-VL's refuses a ratio over 200 itself)."""
    edge = [np.zeros((MIN_IMAGE_SIDE, MIN_IMAGE_SIDE, 3), np.uint8),
            np.zeros((MIN_IMAGE_SIDE, MIN_IMAGE_SIDE * MAX_ASPECT_RATIO, 3), np.uint8)]
    assert len(vl_engine.prepare(mmzoo.Request(prompt=PROMPT, images=edge)).media) == 2  # a tower call each
    llava = mmzoo.load(llava_ckpt, executor="eager")
    assert len(llava.prepare(mmzoo.Request(prompt=PROMPT, images=edge)).media) == 1
    with pytest.raises(MmzooError, match=r"images\[0\]: the array is 402x2 pixels, an aspect ratio of 201:1"):
        llava.prepare(mmzoo.Request(prompt=PROMPT, images=[np.zeros((2, 402, 3), np.uint8)]))


def test_bad_video_frames(vl_engine, tmp_path):
    frames = tmp_path / "frames"
    frames.mkdir()
    make_image(56, 56, seed=0).save(frames / "0.png")
    Image.new("RGB", (1, 1)).save(frames / "1.png")
    with pytest.raises(MmzooError, match=r"videos\[0\]\[1\]: .*frames/1\.png is 1x1 pixels"):
        vl_engine.prepare(mmzoo.Request(prompt=PROMPT, videos=[str(frames)]))
    frames = [np.zeros((56, 56, 3), np.uint8), np.zeros((84, 56, 3), np.uint8)]
    with pytest.raises(MmzooError, match=r"videos\[0\]\[1\] is 56x84 pixels but videos\[0\]\[0\] is 56x56: a "
                                         r"video's frames must have one size"):
        vl_engine.prepare(mmzoo.Request(prompt=PROMPT, videos=[frames]))
    gif = tmp_path / "wide.gif"
    Image.new("RGB", (20000, 10)).save(gif)
    with pytest.raises(MmzooError, match=r"videos\[0\]: .*wide\.gif is 20000x10 pixels, an aspect ratio of 2000:1"):
        vl_engine.prepare(mmzoo.Request(prompt=PROMPT, videos=[str(gif)]))


# ----------------------------------------------------------------------------- audio

@pytest.fixture(scope="module")
def audio_engine(qwen2_audio_ckpt):
    return mmzoo.load(qwen2_audio_ckpt, executor="eager")


def _audio(kind: str, root: Path):
    path = root / f"{kind}.wav"
    if kind == "empty":
        path.touch()
    elif kind == "not_audio":
        path.write_text("a text file named .wav")
    elif kind == "too_long":  # the tiny checkpoint's window is 2 s
        write_wav(path, make_audio(2.5, seed=0))
    elif kind == "too_long_8khz":  # 2.5 s at 8 kHz: 40000 samples once resampled
        write_wav(path, make_audio(2.5, seed=0, sampling_rate=8000), 8000)
    elif kind == "too_long_array":
        return make_audio(2.5, seed=0)
    elif kind == "nan_array":
        return np.array([0.0, np.nan, 0.5], np.float32)
    return str(path)


AUDIOS = {
    "empty": r"audios\[0\]: audio file .*empty\.wav is empty \(0 bytes\)",
    "not_audio": r"audios\[0\]: .*not_audio\.wav is not a readable audio file",
    "too_long": r"audios\[0\] is 2\.50 s long \(40000 samples at 16000 Hz\); the audio encoder hears at most 2 s "
                r"\(32000 samples\): split it into shorter clips",
    "too_long_8khz": r"audios\[0\] is 2\.50 s long \(40000 samples at 16000 Hz\); the audio encoder hears at most 2 s",
    "too_long_array": r"audios\[0\] is 2\.50 s long \(40000 samples at 16000 Hz\)",
    "nan_array": r"audios\[0\]: the array has non-finite samples",
}


@pytest.mark.parametrize("kind", list(AUDIOS))
def test_bad_audio(audio_engine, tmp_path, kind):
    with pytest.raises(MmzooError, match=AUDIOS[kind]):
        audio_engine.prepare(mmzoo.Request(prompt=PROMPT, audios=[_audio(kind, tmp_path)]))


def test_stereo_and_other_rates_are_converted(audio_engine, tmp_path):
    """Stereo is mixed down to mono, another rate is resampled, and a clip of exactly the window is taken."""
    left, right = make_audio(1.0, seed=0), make_audio(1.0, seed=1)
    stereo = tmp_path / "stereo.wav"
    soundfile.write(stereo, np.stack([left, right], axis=1), 16000, subtype="FLOAT")
    low = write_wav(tmp_path / "low.wav", make_audio(1.0, seed=2, sampling_rate=8000), 8000)
    full = write_wav(tmp_path / "full.wav", make_audio(2.0, seed=3))
    mono, resampled, whole = load_audios([str(stereo), str(low), str(full)], 16000)
    np.testing.assert_allclose(mono, (left + right) / 2, atol=1e-6)
    assert resampled.shape == (16000,) and whole.shape == (32000,)
    prepared = audio_engine.prepare(mmzoo.Request(prompt=PROMPT, audios=[str(stereo), str(low), str(full)]))
    assert prepared.lengths["audio"].tolist() == [25, 25, 50]  # valid tokens of 100, 100 and 200 mel frames


# ----------------------------------------------------------------------------- the CLI

def test_cli_truncated_checkpoint_is_one_error_line(qwen2_vl_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(qwen2_vl_ckpt, ckpt)
    _halve(ckpt / "model.safetensors")
    out = tmp_path / "out.jsonl"
    p = subprocess.run([sys.executable, "-m", "mmzoo.infer", f"checkpoint={ckpt}", "executor=eager", "images=[]",
                        f"output={out}"], cwd=tmp_path, env={**os.environ, "PJRT_DEVICE": "CPU"},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: checkpoint file {ckpt / 'model.safetensors'} is not a readable safetensors file "
                      f"(Error while deserializing header: incomplete metadata, file not fully covered): it may be "
                      f"truncated or corrupt"], p.stderr
    assert "Traceback" not in p.stderr and not out.exists()
