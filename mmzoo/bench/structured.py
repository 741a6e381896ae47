"""What structured outputs cost: the same decode steps with and without a grammar, side by side.

    PJRT_DEVICE=CPU python -m mmzoo.bench.structured [--recipe recipes/bench_qwen2_vl.yaml] [--rounds 3]

The serving benchmark's model (the recipe's random checkpoint: Qwen2-VL, vocabulary 32000) on the
XLA executor, text prompts, ``batch`` requests at once, 64 new tokens each, greedy: free text
against a regex no output completes within 64 tokens (every request decodes 64 steps) and a JSON
schema with a long string field. Per case: the median inter-token latency (the decode step
seen by a request), the host's mask time per constrained token (llguidance filling a bitmask row)
and the graphs compiled after warmup. One process, cases interleaved by round, so the ratios are
what to read on a noisy machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from omegaconf import OmegaConf

CASES = {
    "free text": None,
    "regex": {"regex": "[a-z ,.]{600}"},
    "json schema": {"json": {"type": "object", "required": ["caption", "count"], "additionalProperties": False,
                             "properties": {"caption": {"type": "string", "minLength": 400},
                                            "count": {"type": "integer"}}}, "disable_any_whitespace": True},
}
NEW_TOKENS = 64


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/bench_qwen2_vl.yaml", help="its checkpoint.random sizes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args(argv)

    import mmzoo
    from mmzoo.bench.workload import bench_checkpoint, say
    from mmzoo.structured import Guide

    recipe = OmegaConf.load(Path(args.recipe))
    ckpt = bench_checkpoint(OmegaConf.create({"family": recipe.get("family", "qwen2_vl"),
                                              "checkpoint": recipe.checkpoint}))
    engine = mmzoo.load(ckpt, executor="xla", warmup="needed", max_model_len=256, max_batch=max(args.batches),
                        progress=False, buckets={"prefill": [64]})
    fill_s: list[float] = []
    fill = Guide.fill

    def timed_fill(self, row):
        t0 = time.perf_counter()
        fill(self, row)
        fill_s.append(time.perf_counter() - t0)

    Guide.fill = timed_fill
    prompts = ["Describe the picture in detail.", "Write a caption for a photo of a red circle.",
               "What shapes are drawn here?", "Count the squares and the triangles."]

    def requests(case: str, batch: int) -> list[dict]:
        spec = CASES[case]
        return [{"prompt": prompts[i % len(prompts)], "max_new_tokens": NEW_TOKENS,
                 **({"structured_outputs": spec} if spec else {"ignore_eos": True})} for i in range(batch)]

    for batch in args.batches:
        for case in CASES:
            engine.warm(requests(case, batch))
    rows = []
    for batch in args.batches:
        itl = {case: [] for case in CASES}
        masks = {case: [] for case in CASES}
        compiled = {case: 0 for case in CASES}
        for _ in range(args.rounds):
            for case in CASES:
                fill_s.clear()
                results = engine.generate(requests(case, batch))
                for r in results:
                    assert r.error is None and len(r.token_ids) == NEW_TOKENS, (case, r.error, len(r.token_ids))
                    t = r.token_times_s
                    itl[case] += [b - a for a, b in zip(t, t[1:])]
                compiled[case] += max(r.graphs_compiled_after_warmup for r in results)
                masks[case] += fill_s
        base = statistics.median(itl["free text"])
        for case in CASES:
            med = statistics.median(itl[case])
            mask = statistics.median(masks[case]) * 1e6 if masks[case] else None
            rows.append({"batch": batch, "case": case, "itl_ms": med * 1e3, "vs_free": med / base, "mask_us": mask,
                         "graphs_after_warmup": compiled[case]})
    say(f"structured outputs on {ckpt.name} (vocab {engine.model.lm.vocab_size}), XLA executor, greedy, "
        f"{NEW_TOKENS} tokens per request, {args.rounds} rounds")
    print("| batch | case | median ITL (ms) | vs free text | host mask per token (us) | graphs after warmup |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        mask = "-" if r["mask_us"] is None else f"{r['mask_us']:.0f}"
        print(f"| {r['batch']} | {r['case']} | {r['itl_ms']:.2f} | {r['vs_free']:.2f}x | {mask} | "
              f"{r['graphs_after_warmup']} |")
    return {"rows": rows}


if __name__ == "__main__":
    main()
