"""Recipe: encode images once, serve several LMs that share the encoder from the embeddings.

The encoder runs in one engine (``mmzoo.encode``'s path); each LM is then loaded without its towers
(``towers=False``: only their weights' fingerprint is checked against the embeddings file) and
answers every question from the same embeddings.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig

import mmzoo
from mmzoo import embeds_file
from mmzoo.cli import hydra_main
from mmzoo.files import write_jsonl
from mmzoo.paths import ASSETS, cache_dir


def demo_checkpoints() -> list[Path]:
    """Two random LMs with one shared (random) vision tower, built once in the cache."""
    from safetensors.torch import load_file, save_file

    from mmzoo.fixtures import make_tiny_qwen2_vl

    root = cache_dir() / "serve_many_demo"
    paths = [root / "lm_a", root / "lm_b"]
    if not all((p / "config.json").is_file() for p in paths):
        a = make_tiny_qwen2_vl(paths[0], seed=0)
        b = make_tiny_qwen2_vl(paths[1], seed=1)
        shared = {k: v for k, v in load_file(a / "model.safetensors").items() if "visual" in k}
        weights = {**load_file(b / "model.safetensors"), **shared}
        save_file(weights, b / "model.safetensors", metadata={"format": "pt"})
    print("mmzoo: demo LMs have RANDOM weights (shared encoder, different LMs)", file=sys.stderr)
    return paths


def run(cfg: DictConfig) -> list[dict]:
    checkpoints = [Path(c) for c in cfg.checkpoints] if cfg.checkpoints else demo_checkpoints()
    images = [str(i) for i in cfg.images] if cfg.images else [str(ASSETS / "sample.png")]
    enc_ckpt = cfg.encoder_checkpoint or checkpoints[0]
    kw = dict(model=str(cfg.model), attention=instantiate(cfg.attention), dtype=cfg.dtype)

    encoder = mmzoo.load(enc_ckpt, executor="eager", **kw)
    t0 = time.perf_counter()
    tensors = encoder.encode(images=images)
    encode_s = time.perf_counter() - t0
    path = cfg.embeds_file or os.path.join(tempfile.mkdtemp(prefix="mmzoo-"), "embeds.safetensors")
    embeds_file.write(path, tensors, {**encoder.embeds_metadata(), "images": str(images)})
    print(f"encode: {len(images)} images once in {encode_s:.3f} s -> {path}")

    rows = []
    for ckpt in checkpoints:
        t0 = time.perf_counter()
        engine = mmzoo.load(ckpt, executor=instantiate(cfg.executor), towers=False, **kw)
        load_s = time.perf_counter() - t0
        reqs = [{"prompt": q, "embeds": path, "max_new_tokens": int(cfg.max_new_tokens)} for q in cfg.questions]
        t0 = time.perf_counter()
        results = engine.generate(reqs)
        gen_s = time.perf_counter() - t0
        print(f"LM {ckpt}: load+warmup {load_s:.2f} s, {len(reqs)} answers in {gen_s:.3f} s")
        for q, r in zip(cfg.questions, results):
            if r.error:
                raise mmzoo.MmzooError(f"{ckpt}: {r.error}")
            print(f"  Q: {q}\n  A: {r.text}")
            rows.append({"checkpoint": str(ckpt), "question": q, "text": r.text, "token_ids": r.token_ids,
                         "encode_s": encode_s, "generate_s": gen_s})
    if cfg.output:
        write_jsonl(cfg.output, rows)
    return rows


main = hydra_main(run, "encode_once_serve_many", config_dir=Path(__file__).resolve().parent)


if __name__ == "__main__":
    main()
