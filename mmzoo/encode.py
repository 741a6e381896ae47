"""``python -m mmzoo.encode``: encode images/videos/audios once, for serving several LMs from the embeddings.

Example::

    python -m mmzoo.encode model=qwen2_vl checkpoint=DIR 'images=[a.png,b.png]' output=emb.safetensors
    python -m mmzoo.infer model=qwen2_vl checkpoint=OTHER_LM embeds=emb.safetensors prompt='Compare them.'

The file holds ``image_embeds [rows, hidden]`` and ``image_grid_thw [images, 3]`` (and the video
pair; ``audio_embeds`` and ``audio_lengths [clips]`` for Qwen2-Audio), with metadata: the model family, a fingerprint of the encoder and adapter weights, the LM
hidden size, the dtype, the mmzoo version and the checkpoint path.
"""

from __future__ import annotations

import json
import re
import sys
import time

from omegaconf import DictConfig, OmegaConf

from mmzoo import embeds_file
from mmzoo.cli import hydra_main
from mmzoo.errors import MmzooError
from mmzoo.files import check_output_path


def run(cfg: DictConfig) -> dict:
    """Encode every item; an item that cannot be read is named as an ``error:`` line and left out
    (the file's metadata lists what it holds and what was skipped). Nothing is written when every
    item fails; the file is written atomically."""
    import torch

    from mmzoo.engine import build

    items = {"images": [str(i) for i in cfg.images or []], "videos": OmegaConf.to_container(cfg.videos) or [],
             "audios": [str(a) for a in OmegaConf.to_container(cfg.audios) or []]}
    if not any(items.values()):
        raise MmzooError("nothing to encode: give images=[...], videos=[...] and/or audios=[...]")
    check_output_path(cfg.output)
    print("mmzoo: encode", file=sys.stderr)
    engine = build(cfg, verbose=True)
    t0 = time.perf_counter()
    parts: dict[str, list] = {}
    kept: dict[str, list] = {kind: [] for kind in items}
    skipped: list[str] = []
    for kind, values in items.items():
        for i, item in enumerate(values):  # one item at a time: a bad one costs only itself
            try:
                tensors = engine.encode(**{kind: [item]})
            except MmzooError as e:
                msg = re.sub(rf"^{kind}\[0\]", f"{kind}[{i}]", str(e))
                print(f"error: {msg}", file=sys.stderr)
                skipped.append(msg)
                continue
            kept[kind].append(item)
            for k, v in tensors.items():
                parts.setdefault(k, []).append(v)
    if not parts:
        raise MmzooError(f"no item could be encoded ({len(skipped)} failed); nothing written")
    tensors = {k: torch.cat(v) for k, v in parts.items()}
    secs = time.perf_counter() - t0
    meta = {**engine.embeds_metadata(), **{k: str(v) for k, v in kept.items()}, "encode_s": f"{secs:.4f}"}
    if skipped:
        meta["skipped"] = json.dumps(skipped)
    embeds_file.write(cfg.output, tensors, meta)
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
    counts = ", ".join(f"{len(v)} {k}" for k, v in kept.items())
    print(f"mmzoo: encoded {counts} in {secs:.3f} s -> {cfg.output} ({shapes})"
          + (f"; {len(skipped)} skipped (errors above)" if skipped else ""), file=sys.stderr)
    return {"tensors": tensors, "encode_s": secs, "skipped": skipped}


main = hydra_main(run, "encode")


if __name__ == "__main__":
    main()
