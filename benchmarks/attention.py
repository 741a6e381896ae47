"""Time every attention backend on Qwen2-VL-shaped vision-encoder and LM-prefill/decode calls.

    PJRT_DEVICE=CPU python benchmarks/attention.py [--repeats 5] [--backends sdpa pallas] [--json out.json]

Each case runs inside a torch_xla graph on the PJRT device (the XLA CPU client here, where the
Pallas kernels run in interpret mode; natively on a TPU). Prints compile time and the median
steady-state time per call. Not a test: figures only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402

from mmzoo.config import build_option, options  # noqa: E402

# (name, b, hq, hkv, sq, skv, d, kind): Qwen2-VL-2B's ViT is 16 heads x 80; its LM 12 x 128 with 2 kv heads
CASES = [
    ("vision 1 image, 1024 patches", 1, 16, 16, 1024, 1024, 80, "segments1"),
    ("vision 4 images, 4x256 patches", 1, 16, 16, 1024, 1024, 80, "segments4"),
    ("LM prefill 512", 1, 12, 2, 512, 512, 128, "causal"),
    ("LM prefill 1024", 1, 12, 2, 1024, 1024, 128, "causal"),
    ("LM decode b8, cache 1024", 8, 12, 2, 1, 1024, 128, "decode"),
]


def make_inputs(b, hq, hkv, sq, skv, d, kind, dev):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, sq, d, generator=g)
    k = torch.randn(b, hkv, skv, d, generator=g)
    v = torch.randn(b, hkv, skv, d, generator=g)
    kw = {}
    if kind.startswith("segments"):
        seg = torch.arange(sq).div(sq // int(kind[-1]), rounding_mode="floor").view(1, sq).expand(b, sq)
        kw = {"q_segment_ids": seg, "kv_segment_ids": seg}
    elif kind == "causal":
        kw = {"causal": True}
    elif kind == "decode":
        kw = {"causal": True, "q_positions": torch.randint(skv // 2, skv, (b, 1), generator=g)}
    to = lambda t: t.to(dev)  # noqa: E731
    return to(q), to(k), to(v), {k_: (to(v_) if isinstance(v_, torch.Tensor) else v_) for k_, v_ in kw.items()}


def bench(backend, case, repeats, dev):
    name, b, hq, hkv, sq, skv, d, kind = case
    q, k, v, kw = make_inputs(b, hq, hkv, sq, skv, d, kind, dev)
    torch_xla.sync()
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out = backend(q, k, v, scale=d ** -0.5, **kw)
        torch_xla.sync()
        out.cpu()
        times.append(time.perf_counter() - t0)
    return {"first_call_s": times[0], "median_s": statistics.median(times[1:])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", nargs="+", choices=options("attention"), default=options("attention"),
                    help="conf/attention options to time (default: all)")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch_xla.device()
    backends = {n: build_option("attention", n) for n in args.backends}
    print(f"device {dev} (PJRT_DEVICE={os.environ['PJRT_DEVICE']}); pallas runs "
          f"{'natively' if os.environ['PJRT_DEVICE'] == 'TPU' else 'in interpret mode'}")
    rows = []
    print(f"{'case':34s} {'backend':8s} {'first call (compile) s':>22s} {'steady ms':>10s}")
    for case in CASES:
        for bname, backend in backends.items():
            r = bench(backend, case, args.repeats, dev)
            rows.append({"case": case[0], "backend": bname, **r})
            print(f"{case[0]:34s} {bname:8s} {r['first_call_s']:22.2f} {1e3 * r['median_s']:10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
