"""``python -m mmzoo.encode``: encode images/videos/audios once, for serving several LMs from the embeddings.

Example::

    python -m mmzoo.encode model=qwen2_vl checkpoint=DIR 'images=[a.png,b.png]' output=emb.safetensors
    python -m mmzoo.infer model=qwen2_vl checkpoint=OTHER_LM embeds=emb.safetensors prompt='Compare them.'

The file holds ``image_embeds [rows, hidden]`` and ``image_grid_thw [images, 3]`` (and the video
pair; ``audio_embeds`` and ``audio_lengths [clips]`` for Qwen2-Audio), with metadata: the model family, a fingerprint of the encoder and adapter weights, the LM
hidden size, the dtype, the mmzoo version and the checkpoint path.
"""

from __future__ import annotations

import sys
import time

from omegaconf import DictConfig, OmegaConf

from mmzoo import embeds_file
from mmzoo.cli import hydra_main
from mmzoo.errors import MmzooError


def run(cfg: DictConfig) -> dict:
    from mmzoo.engine import build

    images, videos = list(cfg.images or []), OmegaConf.to_container(cfg.videos) or []
    audios = [str(a) for a in OmegaConf.to_container(cfg.audios) or []]
    if not images and not videos and not audios:
        raise MmzooError("nothing to encode: give images=[...], videos=[...] and/or audios=[...]")
    print("mmzoo: encode", file=sys.stderr)
    engine = build(cfg, verbose=True)
    t0 = time.perf_counter()
    tensors = engine.encode(images=[str(i) for i in images], videos=videos, audios=audios)
    secs = time.perf_counter() - t0
    meta = {**engine.embeds_metadata(), "images": str([str(i) for i in images]), "audios": str(audios),
            "encode_s": f"{secs:.4f}"}
    embeds_file.write(cfg.output, tensors, meta)
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
    print(f"mmzoo: encoded {len(images)} images, {len(videos)} videos, {len(audios)} audios in {secs:.3f} s -> {cfg.output} ({shapes})",
          file=sys.stderr)
    return {"tensors": tensors, "encode_s": secs}


main = hydra_main(run, "encode")


if __name__ == "__main__":
    main()
