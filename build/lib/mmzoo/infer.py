"""``python -m mmzoo.infer``: generate for one prompt or a file of requests.

Examples::

    python -m mmzoo.infer model=qwen2_vl checkpoint=DIR prompt='Describe this image.' \\
        'images=[a.png,b.png]' max_new_tokens=16 executor=xla attention=sdpa output=out.jsonl
    python -m mmzoo.infer checkpoint=DIR requests=reqs.jsonl output=out.jsonl
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mmzoo.cli import hydra_main
from mmzoo.errors import MmzooError
from mmzoo.files import write_jsonl
from mmzoo.paths import ASSETS
from mmzoo.types import Request

_REQUEST_FIELDS = {f.name for f in fields(Request)}


def read_requests(path: str | Path, defaults: dict) -> list[Request | MmzooError]:
    """One :class:`Request` per JSONL line; a bad line becomes an error for that line only."""
    path = Path(path)
    if not path.is_file():
        raise MmzooError(f"requests file {path} does not exist")
    out: list[Request | MmzooError] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            out.append(MmzooError(f"{path}:{n}: not valid JSON ({e.msg})"))
            continue
        if not isinstance(obj, dict):
            out.append(MmzooError(f"{path}:{n}: a request must be a JSON object, got {type(obj).__name__}"))
            continue
        unknown = sorted(set(obj) - _REQUEST_FIELDS)
        if unknown:
            out.append(MmzooError(f"{path}:{n}: unknown request fields {unknown}; known: {sorted(_REQUEST_FIELDS)}"))
            continue
        out.append(Request(**{**defaults, "id": n, **obj}))
    return out


def _modalities(cfg: DictConfig) -> tuple[str, ...]:
    """The media kinds the configured family takes (its class's ``modalities``)."""
    from hydra.utils import get_class

    return getattr(get_class(cfg.model.family._target_), "modalities", ())


def _paths_of(items: list) -> list:
    """Media items as JSON: paths as strings (a video given as frames: a list of them); arrays as a note."""
    return [_paths_of(i) if isinstance(i, (list, tuple)) else str(i) if isinstance(i, (str, Path))
            else f"<{type(i).__name__}>" for i in items]


def run(cfg: DictConfig) -> list[dict]:
    """Build the pipeline from ``cfg``, run the requests, print and write the results."""
    from mmzoo.engine import build

    if cfg.output is not None and not Path(cfg.output).parent.is_dir():
        raise MmzooError(f"output directory {Path(cfg.output).parent} does not exist")
    images = cfg.images
    if images is None:
        default = OmegaConf.select(cfg, "model.default_checkpoint")
        embedded_demo = (default is not None and cfg.checkpoint == default and cfg.embeds is None
                         and cfg.requests is None and "image" in _modalities(cfg))
        images = [str(ASSETS / "sample.png")] if embedded_demo else []
        if images:
            print(f"mmzoo: no images given; using the bundled sample image {images[0]}", file=sys.stderr)
    defaults = {"max_new_tokens": int(cfg.max_new_tokens), "ignore_eos": bool(cfg.ignore_eos),
                "temperature": float(cfg.temperature), "top_k": int(cfg.top_k), "top_p": float(cfg.top_p),
                "seed": None if cfg.seed is None else int(cfg.seed)}
    if cfg.requests is not None:
        requests = read_requests(cfg.requests, defaults)
    else:
        requests = [Request(prompt=str(cfg.prompt), images=[str(i) for i in images],
                            videos=OmegaConf.to_container(cfg.videos) or [],
                            audios=[str(a) for a in OmegaConf.to_container(cfg.audios) or []],
                            embeds=cfg.embeds, id=0, **defaults)]
    # towers are built only when some request has raw media: embeds-only and text-only runs skip them
    towers = any(isinstance(r, Request) and (r.images or r.videos or r.audios) for r in requests)
    engine = build(cfg, towers=towers, verbose=True)
    if not towers:
        print("mmzoo: no raw media in the requests; the encoder towers are not loaded", file=sys.stderr)
    print(f"mmzoo: checkpoint {engine.checkpoint}", file=sys.stderr)

    def show(result) -> None:
        if result.error:
            print(f"error: request {result.id}: {result.error}", file=sys.stderr)
        else:
            print(result.text, flush=True)

    valid = [r for r in requests if isinstance(r, Request)]
    if cfg.requests is None:
        results = [engine.generate(valid[0])]  # a bad single request raises: exit 1, nothing written
        show(results[0])
    else:
        for bad in (r for r in requests if not isinstance(r, Request)):
            print(f"error: {bad}", file=sys.stderr)
        results = engine.generate(valid, on_result=show)
    by_id = {id(r): res for r, res in zip(valid, results)}
    out = []
    for r in requests:
        if isinstance(r, Request):
            res = by_id[id(r)]
            media = {"images": [str(i) for i in r.images]}  # videos/audios only when given
            media.update({k: _paths_of(getattr(r, k)) for k in ("videos", "audios") if getattr(r, k)})
            out.append({**res.to_json(), **media})
        else:
            out.append({"error": str(r)})
    if cfg.output is not None:
        write_jsonl(cfg.output, out)
        print(f"mmzoo: wrote {len(out)} results to {cfg.output}", file=sys.stderr)
    if out and all("error" in row for row in out):
        raise MmzooError("every request failed")
    return out


main = hydra_main(run, "infer")


if __name__ == "__main__":
    main()
