"""Recipe: held-out accuracy of the shapes demo per question category and aspect-ratio bucket.

Draws ``examples`` fresh scenes (``mmzoo.demo.shapes``, the held-out seed), asks each its
question through ``mmzoo.load`` (greedy), and prints the accuracy per category, per aspect-ratio
bucket (long side / short side) and overall, with the first wrong answers. ``side_range`` draws
image sides from a range (null: the first demo model's grid of 56-140 px in steps of 28) and
``shape_sides`` the shapes' sizes (null: 20-44 px).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from omegaconf import DictConfig

import mmzoo
from mmzoo.cli import hydra_main
from mmzoo.demo import shapes
from mmzoo.files import write_json

BUCKETS = ((1.0, 1.5), (1.5, 2.5), (2.5, float("inf")))  # aspect ratio (long / short side)


def bucket(width: int, height: int) -> str:
    ratio = max(width, height) / min(width, height)
    lo, hi = next(b for b in BUCKETS if b[0] <= ratio < b[1])
    return f"{lo:g}-{hi:g}" if hi != float("inf") else f">{lo:g}"


def run(cfg: DictConfig) -> dict:
    side_range, shape_sides = (None if cfg.get(k) is None else tuple(int(v) for v in cfg[k])
                               for k in ("side_range", "shape_sides"))
    examples = shapes.make_examples(int(cfg.examples), int(cfg.seed), side_range=side_range, shape_sides=shape_sides)
    engine = mmzoo.load(cfg.checkpoint, model="qwen2_vl", executor=str(cfg.executor))
    results = engine.generate([{"prompt": ex.question, "images": [ex.image], "max_new_tokens": 4}
                               for ex in examples])
    tally: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    wrong = []
    for ex, r in zip(examples, results):
        ok = r.error is None and r.text.strip() == ex.answer
        for key in ("all", f"category {ex.category}", f"aspect {bucket(*ex.image.size)}"):
            tally[key][0] += ok
            tally[key][1] += 1
        if not ok:
            wrong.append({"size": list(ex.image.size), "question": ex.question, "answer": ex.answer,
                          "got": r.text if r.error is None else f"error: {r.error}"})
    sizes = f"sides {side_range[0]}-{side_range[1]} px" if side_range else "sides of 56-140 px in steps of 28"
    sizes += f", shapes {shape_sides[0]}-{shape_sides[1]} px" if shape_sides else ", shapes 20-44 px"
    print(f"held-out accuracy of {engine.checkpoint} on {len(examples)} scenes ({sizes}, seed {cfg.seed}):")
    for key in sorted(tally, key=lambda k: (k != "all", k)):
        right, n = tally[key]
        print(f"  {key:<22}{right:>5}/{n:<5}{right / n:>8.1%}")
    for w in wrong[: int(cfg.show_wrong)]:
        print(f"  wrong: {w['size'][0]}x{w['size'][1]} {w['question']!r}: {w['got']!r}, not {w['answer']!r}")
    out = {"checkpoint": str(engine.checkpoint), "side_range": side_range, "shape_sides": shape_sides,
           "seed": int(cfg.seed),
           "accuracy": {k: v[0] / v[1] for k, v in tally.items()}, "counts": dict(tally), "wrong": wrong}
    if cfg.output:
        write_json(cfg.output, out)
        print(f"mmzoo: wrote {cfg.output}", file=sys.stderr)
    return out


main = hydra_main(run, "eval_demo", config_dir=Path(__file__).resolve().parent)

if __name__ == "__main__":
    main()
