"""Decode step time against the keys it attends over: what a window-sized KV ring for sliding layers could save.

    PJRT_DEVICE=CPU python benchmarks/decode_kv.py [--recipe recipes/bench_qwen2_vl.yaml] [--rounds 4]

The serving benchmark's model (the recipe's random checkpoint) on the XLA executor with two decode
KV buckets, 128 and 1024: requests of 60-token prompts decode in the first, of 960-token prompts
in the second. Prints the median inter-token latency per batch size and bucket. A sliding layer
holds the whole cache and masks it (docs/benchmarks.md, "Sliding-window layers"); the gap
between the buckets bounds what attending over a window-sized ring instead could take off a step.
Not a test: figures only.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from omegaconf import OmegaConf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/bench_qwen2_vl.yaml", help="its checkpoint.random sizes")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)

    import mmzoo
    from mmzoo.bench.workload import bench_checkpoint

    recipe = OmegaConf.load(Path(args.recipe))
    ckpt = bench_checkpoint(OmegaConf.create({"family": recipe.get("family", "qwen2_vl"),
                                              "checkpoint": recipe.checkpoint}))
    engine = mmzoo.load(ckpt, executor="xla", warmup="needed", max_model_len=1024, max_batch=4, progress=False,
                        buckets={"prefill": [128, 1024], "decode_kv": [128, 1024]})
    ids = engine.processor.tokenizer("the quick brown fox jumps over the lazy dog " * 200)["input_ids"]
    print("| batch | keys attended (bucket) | median ITL (ms) |")
    print("| ---: | ---: | ---: |")
    for batch in (1, 4):
        for bucket, n in ((128, 60), (1024, 960)):
            reqs = [{"prompt_token_ids": ids[:n], "max_new_tokens": 24, "ignore_eos": True}] * batch
            engine.warm(reqs)
            itl = []
            for _ in range(args.rounds):
                for r in engine.generate(reqs):
                    t = r.token_times_s
                    itl += [b - a for a, b in zip(t[1:], t[2:])]
            print(f"| {batch} | {bucket} | {statistics.median(itl) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
