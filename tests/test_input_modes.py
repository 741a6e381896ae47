"""Input modes: raw media vs precomputed embeddings (identical tokens), inputs_embeds, token ids,
the encode CLI, and the validation of every embeddings field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import mmzoo
from mmzoo.errors import MmzooError
from mmzoo.fixtures import make_image, make_tiny_qwen2_vl

GEN = {"max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def engines(qwen2_vl_ckpt):
    xla = dict(max_model_len=256, buckets={"encoder": {"vision": [64, 256]}, "min_encoder_rows": 16,
                                           "max_encoder_rows": 256},
               progress=False, warmup="needed", compile={"on_recompile": "error"})
    return {"eager": mmzoo.load(qwen2_vl_ckpt, executor="eager", max_model_len=256),
            "xla": mmzoo.load(qwen2_vl_ckpt, executor="xla", **xla)}


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    return [make_image(56, 56, seed=10 + i) for i in range(4)]


@pytest.mark.parametrize("executor", ["eager", "xla"])
def test_image_embeds_match_raw_images(engines, image_files, executor):
    engine = engines[executor]
    emb = engines["eager"].encode(images=image_files[:2])
    raw = engine.generate("Compare them.", images=image_files[:2], **GEN)
    via = engine.generate(mmzoo.Request(prompt="Compare them.", image_embeds=emb["image_embeds"],
                                        image_grid_thw=emb["image_grid_thw"], **GEN))
    assert via.token_ids == raw.token_ids and via.prompt_token_ids == raw.prompt_token_ids
    # a list of per-image 2-D embeddings works too
    rows = [int(n) // 4 for n in emb["image_grid_thw"].prod(dim=1)]
    split = list(torch.split(emb["image_embeds"], rows))
    again = engine.generate(mmzoo.Request(prompt="Compare them.", image_embeds=split,
                                          image_grid_thw=emb["image_grid_thw"], **GEN))
    assert again.token_ids == raw.token_ids


@pytest.mark.parametrize("executor", ["eager", "xla"])
def test_video_embeds_match_raw_video(engines, frames, executor):
    engine = engines[executor]
    emb = engines["eager"].encode(videos=[frames])
    assert emb["video_grid_thw"].tolist() == [[2, 4, 4]]
    raw = engine.generate(mmzoo.Request(prompt="What happens?", videos=[frames], **GEN))
    via = engine.generate(mmzoo.Request(prompt="What happens?", video_embeds=emb["video_embeds"],
                                        video_grid_thw=emb["video_grid_thw"], **GEN))
    assert via.token_ids == raw.token_ids


def test_mixed_raw_image_and_video_embeds(engines, image_files, frames):
    engine = engines["eager"]
    vid = engine.encode(videos=[frames])
    raw = engine.generate(mmzoo.Request(prompt="Both?", images=image_files[:1], videos=[frames], **GEN))
    mixed = engine.generate(mmzoo.Request(prompt="Both?", images=image_files[:1], video_embeds=vid["video_embeds"],
                                          video_grid_thw=vid["video_grid_thw"], **GEN))
    assert mixed.token_ids == raw.token_ids


def test_gif_video_file(engines, frames, tmp_path):
    gif = tmp_path / "clip.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=100, loop=0)
    a = engines["eager"].generate(mmzoo.Request(prompt="What happens?", videos=[str(gif)], **GEN))
    assert len(a.token_ids) == GEN["max_new_tokens"]


@pytest.mark.parametrize("executor", ["eager", "xla"])
def test_inputs_embeds_and_token_ids(engines, executor):
    engine = engines[executor]
    text = engine.generate("Tell me a story.", **GEN)
    ids = torch.tensor(text.prompt_token_ids)
    soft = engine.model.lm.embed_tokens.weight.detach().cpu()[ids].float()
    assert engine.generate(mmzoo.Request(inputs_embeds=soft, **GEN)).token_ids == text.token_ids
    assert engine.generate(mmzoo.Request(prompt_token_ids=text.prompt_token_ids, **GEN)).token_ids == text.token_ids


def test_token_ids_with_one_placeholder_per_image(engines, image_files):
    engine = engines["eager"]
    raw = engine.generate("Compare them.", images=image_files[:2], **GEN)
    pad = engine.config.image_token_id
    collapsed = [t for i, t in enumerate(raw.prompt_token_ids) if t != pad or raw.prompt_token_ids[i - 1] != pad]
    emb = engine.encode(images=image_files[:2])
    got = engine.generate(mmzoo.Request(prompt_token_ids=collapsed, image_embeds=emb["image_embeds"],
                                        image_grid_thw=emb["image_grid_thw"], **GEN))
    assert got.token_ids == raw.token_ids
    with pytest.raises(MmzooError, match=r"2 image placeholder runs .* but 1 images are given \(grid_thw rows\)"):
        engine.prepare(mmzoo.Request(prompt_token_ids=collapsed, image_embeds=emb["image_embeds"][:4],
                                     image_grid_thw=emb["image_grid_thw"][:1]))


def test_tower_never_runs_in_embeds_mode(engines, image_files, qwen2_vl_ckpt, monkeypatch):
    emb = engines["eager"].encode(images=image_files[:1])
    expected = engines["eager"].generate("What?", images=image_files[:1], **GEN).token_ids
    tower = engines["eager"].model.towers["vision"]

    def boom(*a, **k):
        raise AssertionError("vision tower ran in embeds mode")

    monkeypatch.setattr(tower, "forward", boom)
    req = mmzoo.Request(prompt="What?", image_embeds=emb["image_embeds"], image_grid_thw=emb["image_grid_thw"], **GEN)
    assert engines["eager"].generate(req).token_ids == expected
    lean = mmzoo.load(qwen2_vl_ckpt, executor="eager", towers=False)
    assert len(lean.model.towers) == 0
    assert lean.generate(req).token_ids == expected
    with pytest.raises(MmzooError, match="without its encoder towers"):
        lean.generate("What?", images=image_files[:1])


def _req(emb, **kw):
    base = dict(prompt="x", image_embeds=emb["image_embeds"], image_grid_thw=emb["image_grid_thw"])
    return mmzoo.Request(**{**base, **kw})


@pytest.mark.parametrize("change,match", [
    ({"image_embeds": torch.zeros(2, 3, 64)}, r"image_embeds must be 2-D \[rows, hidden\], got shape \[2, 3, 64\]"),
    ({"image_grid_thw": [[1, 4]]}, r"image_grid_thw must be \[num_items, 3\].*\[1, 2\]"),
    ({"image_grid_thw": [[1.5, 4, 4]]}, r"image_grid_thw must hold integers"),
    ({"image_embeds": torch.zeros(5, 64)}, r"image_embeds has 5 rows but image_grid_thw \[\[1, 4, 4\]\] implies 4"),
    ({"image_embeds": torch.zeros(4, 32)}, r"image_embeds has hidden size 32 but the LM's hidden size is 64"),
    ({"image_grid_thw": None}, r"image_embeds needs image_grid_thw"),
    ({"images": ["a.png"]}, r"give images or image_embeds, not both"),
])
def test_embeds_validation(engines, image_files, change, match):
    emb = engines["eager"].encode(images=image_files[:1])
    with pytest.raises(MmzooError, match=match):
        engines["eager"].prepare(_req(emb, **change))


def test_dtype_mismatch_is_cast_with_a_note(engines, image_files, capsys):
    emb = engines["eager"].encode(images=image_files[:1])
    expected = engines["eager"].generate(_req(emb, **GEN)).token_ids
    got = engines["eager"].generate(_req(emb, image_embeds=emb["image_embeds"].double(), **GEN)).token_ids
    assert got == expected
    assert "image_embeds is float64; cast to float32" in capsys.readouterr().err


def _cli(module, *args, cwd):
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def _run(module: str, *overrides: str):
    """``python -m mmzoo.<module> overrides...`` in this process (Hydra compose + the module's run)."""
    import importlib

    from hydra import compose, initialize_config_dir

    from mmzoo.config import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name=module, overrides=list(overrides))
    return importlib.import_module(f"mmzoo.{module}").run(cfg)


def test_encode_then_infer_cli_with_fingerprint_check(qwen2_vl_ckpt, image_files, tmp_path, capsys):
    emb_path = tmp_path / "emb.safetensors"
    _run("encode", "model=qwen2_vl", f"checkpoint={qwen2_vl_ckpt}", f"images=[{image_files[0]},{image_files[1]}]",
         f"output={emb_path}")
    tensors = load_file(emb_path)
    assert set(tensors) == {"image_embeds", "image_grid_thw"} and tensors["image_embeds"].shape[1] == 64
    raw_out, emb_out = tmp_path / "raw.jsonl", tmp_path / "emb.jsonl"
    common = ["prompt=Compare them.", "max_new_tokens=8", "ignore_eos=true", "executor=eager"]
    _run("infer", f"checkpoint={qwen2_vl_ckpt}", f"images=[{image_files[0]},{image_files[1]}]", f"output={raw_out}",
         *common)
    capsys.readouterr()
    _run("infer", f"checkpoint={qwen2_vl_ckpt}", f"embeds={emb_path}", f"output={emb_out}", *common)
    assert "encoder towers are not loaded" in capsys.readouterr().err
    a, b = (json.loads(f.read_text()) for f in (raw_out, emb_out))
    assert a["token_ids"] == b["token_ids"]
    # embeddings from another encoder: an error naming the fingerprints (exit 1, nothing written), unless overridden
    other = make_tiny_qwen2_vl(tmp_path / "other", seed=1)
    bad_out = tmp_path / "bad.jsonl"
    p3 = _cli("mmzoo.infer", f"checkpoint={other}", f"embeds={emb_path}", f"output={bad_out}", *common, cwd=tmp_path)
    assert p3.returncode == 1 and "encoder weights" in p3.stderr and "allow_fingerprint_mismatch" in p3.stderr
    assert not bad_out.exists()
    _run("infer", f"checkpoint={other}", f"embeds={emb_path}", "allow_fingerprint_mismatch=true", f"output={bad_out}",
         *common)
    assert "warning" in capsys.readouterr().err and bad_out.exists()


def test_encode_cli_bad_image_writes_nothing(qwen2_vl_ckpt, tmp_path):
    out = tmp_path / "emb.safetensors"
    p = _cli("mmzoo.encode", f"checkpoint={qwen2_vl_ckpt}", f"images=[{tmp_path / 'nope.png'}]", f"output={out}",
             cwd=tmp_path)
    assert p.returncode == 1 and "nope.png" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists() and not list(tmp_path.glob(".emb*"))


def test_encode_once_serve_many_recipe(tmp_path):
    out = tmp_path / "answers.jsonl"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "MMZOO_CACHE": str(tmp_path / "cache")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "recipes", "encode_once_serve_many.py"), "executor=eager",
                        f"output={out}", "max_new_tokens=4"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and len({r["checkpoint"] for r in rows}) == 2
    assert len({r["encode_s"] for r in rows}) == 1  # encoded once
    assert p.stdout.count("encode:") == 1 and p.stdout.count("LM ") == 2
