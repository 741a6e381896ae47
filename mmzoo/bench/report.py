"""What the benchmark shows and keeps: the tables it prints, the targets, and the JSON result.

The serving table follows vLLM's ``benchmark_serving`` layout, one column per system; the sweeps,
the roofline and the decode-step profile follow it as plain lines. The targets are pass/fail
lines, each from figures taken side by side (printed, never asserted: the benchmark measures, it
does not test). The JSON result is written whole at the end, atomically.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from mmzoo.bench.runner import SYSTEMS
from mmzoo.files import write_json

_ROWS = [("Successful requests", "completed", "{:.0f}"), ("Benchmark duration (s)", "duration_s", "{:.2f}"),
         ("Total input tokens", "total_input_tokens", "{:.0f}"),
         ("Total generated tokens", "total_output_tokens", "{:.0f}"),
         ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
         ("Output token throughput (tok/s)", "output_throughput", "{:.1f}"),
         ("Total token throughput (tok/s)", "total_token_throughput", "{:.1f}")]
for _m, _title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                   ("itl", "Inter-token Latency")):
    _ROWS.append((f"-- {_title} --", None, None))
    _ROWS += [(f"{s.capitalize()} {_m.upper()} (ms)", f"{s}_{_m}_ms", "{:.1f}") for s in ("mean", "median", "p99")]
_ROWS += [("-- XLA --", None, None), ("Graphs compiled after warmup", "graphs_compiled_after_warmup", "{:.0f}")]


def _fmt(fmt, v) -> str:
    return "-" if v is None else fmt.format(v)


def print_table(title: str, metrics: dict[str, dict], extra: list[tuple[str, dict[str, str]]] = ()) -> None:
    """vLLM's serving table, a column per system, plus ``extra`` rows of preformatted cells."""
    names = list(metrics)
    width = 42 + 14 * len(names)
    print(f"{' ' + title + ' ':=^{width}}")
    print(f"{'':<42}" + "".join(f"{n:>14}" for n in names))
    for label, key, fmt in _ROWS:
        if key is None:
            print(f"{label}")
            continue
        print(f"{label:<42}" + "".join(f"{_fmt(fmt, metrics[n].get(key)):>14}" for n in names))
    for label, cells in extra:
        print(f"{label:<42}" + "".join(f"{cells.get(n, '-'):>14}" for n in names))
    print("=" * width)


def print_serving(n_requests: int, metrics: dict[str, dict], agree: dict, warmup: dict, serve=None) -> None:
    """The main workload's table, with the XLA warmup and the agreement of the outputs; ``serve``:
    the mmzoo-serve clients' settings, when that system ran."""
    xla = "mmzoo-xla" if "mmzoo-xla" in metrics else "mmzoo-serve"  # the system whose engine warmed up
    extra = [("Warmup cold / warm (s)", {xla: f"{warmup.get('cold_s', 0):.1f}/"
                                              f"{warmup.get('warm_s', float('nan')):.1f}"})] if warmup else []
    extra += [(f"Outputs identical to {ref} (requests)", {s: f"{n}/{n_requests}" for s, n in row.items()})
              for ref, row in agree.items()]
    how = "all at t=0"
    if serve is not None and "mmzoo-serve" in metrics:
        rate = serve.get("request_rate")
        how = (f"engines: all at t=0; mmzoo-serve: HTTP clients, at most {serve['concurrency']} in flight, "
               + ("all sent at t=0" if not rate else f"{float(rate):g} req/s Poisson"))
    print_table(f"Serving benchmark: {n_requests} requests, {how}", metrics, extra)
    if warmup:
        print(f"XLA warmup: cold {warmup['cold_s']:.1f} s ({warmup['cold_graphs']} graphs compiled)"
              + (f", warm {warmup['warm_s']:.1f} s ({warmup['warm_graphs']} graphs compiled)" if "warm_s" in warmup
                 else ""))
        if "note" in warmup:
            print(f"  note: {warmup['note']}")


def print_sweeps(image_rows: list[dict], sweep_rows: list[dict], systems: list[str],
                 image_note: str | None = None) -> None:
    """The decode batch sweep and the image-size sweep (or why the latter did not run)."""
    if sweep_rows:
        print("Decode batch sweep (text-only, every request in the batch at t=0):")
        print(f"  {'system':<14}{'batch':>6}{'reqs':>6}{'step ms (ITL p50)':>19}{'decode tok/s':>14}"
              f"{'output tok/s':>14}{'TTFT p50 ms':>13}")
        for r in sweep_rows:
            print(f"  {r['system']:<14}{r['batch']:>6}{r['requests']:>6}{r['median_itl_ms']:>19.1f}"
                  f"{r['decode_tok_s']:>14.1f}{r['output_throughput']:>14.1f}{r['median_ttft_ms']:>13.1f}")
    if image_note:
        print(f"TTFT vs image size: {image_note}")
    if image_rows:
        shown = [s for s in systems if any(s in row for row in image_rows)]
        print("TTFT vs image size (one image, one request at a time, median ms):")
        print(f"  {'image':<10}{'prompt tok':>11}" + "".join(f"{s:>14}" for s in shown))
        for row in image_rows:
            print(f"  {row['image']:<10}{row.get('prompt_tokens', 0):>11}"
                  + "".join(f"{_fmt('{:.1f}', row.get(s)):>14}" for s in shown))


def print_tp_sweep(rows: list[dict]) -> None:
    """The tensor-parallel sweep (:mod:`mmzoo.bench.mesh`), a line per point."""
    if not rows:
        return
    print("Tensor-parallel sweep (text-only decode; mesh data=1 x model=tp; each point its own process):")
    print(f"  {'tp':>3}{'devices':>9}{'batch':>7}{'step ms (ITL p50)':>19}{'decode tok/s':>14}{'output tok/s':>14}"
          f"{'graphs':>8}{'same tokens as tp=1':>21}")
    for r in rows:
        same = "-" if r["same_tokens_as_tp1"] is None else f"{r['same_tokens_as_tp1']}/{r['requests']}"
        print(f"  {r['tp']:>3}{r['devices']:>9}{r['batch']:>7}{r['median_itl_ms']:>19.1f}{r['decode_tok_s']:>14.1f}"
              f"{r['output_throughput']:>14.1f}{r['graphs_compiled']:>8}{same:>21}")


def print_roofline(roof: dict, lm_info: dict, dtype: str) -> None:
    """The decode roofline, each system's batch-1 step against it, and the side-by-side rounds."""
    print(f"Decode roofline: copy bandwidth {roof['copy_bandwidth_GBps']:.2f} GB/s (read+write, best of the runs "
          f"{', '.join(f'{x:.2f}' for x in roof['copy_bandwidth_runs_GBps'])})")
    if "weight_bytes" not in roof:
        return
    print(f"  LM weights read per decode step: {roof['weight_bytes'] / 1e6:.1f} MB ({dtype}; "
          f"{lm_info['lm_params'] / 1e6:.1f} M LM params of {lm_info['all_params'] / 1e6:.1f} M; embedding: only "
          f"the looked-up rows) -> at least {roof['min_step_ms']:.2f} ms per step")
    if "mmzoo_kv_cache_bytes_b1" in roof:
        print(f"  (mmzoo also reads its whole batch-1 KV-cache row each step: "
              f"{roof['mmzoo_kv_cache_bytes_b1'] / 1e6:.1f} MB, not counted)")
    print(f"  read bandwidth {roof['read_bandwidth_GBps']:.2f} GB/s (a sum over the same size): a step reading its "
          f"weights at that rate takes {roof['min_step_ms_at_read_bw']:.2f} ms, "
          f"{100 * roof['best_fraction_at_read_bw']:.1f}% of the copy roofline")
    for s in SYSTEMS:
        if s in roof:
            print(f"  {s:<14} batch-1 step {roof[s]['step_ms']:8.2f} ms = {100 * roof[s]['fraction']:5.1f}% of the "
                  f"roofline (weights read at {roof[s]['weights_read_GBps']:.1f} GB/s)")
    paired = roof.get("paired")
    if paired and "fraction_median" in paired:
        _print_rounds(paired)


def _print_rounds(paired: dict) -> None:
    print("  side by side (batch-1 rounds; copy bandwidth measured just before and after each mmzoo-xla run):")
    for k, r in enumerate(paired["rounds"], 1):
        vs = (f"; decode tok/s {r['vs_transformers']['decode_tok_s']:.2f}x, output tok/s "
              f"{r['vs_transformers']['output_throughput']:.2f}x transformers'" if "vs_transformers" in r else "")
        print(f"    round {k}: copy {r['copy_bandwidth_GBps'][0]:.1f} / {r['copy_bandwidth_GBps'][1]:.1f} GB/s -> "
              f"at least {r['min_step_ms']:.2f} ms; mmzoo-xla step {r['mmzoo-xla']['median_tpot_ms']:.2f} ms = "
              f"{100 * r['fraction']:.1f}%{vs}")
    lo, hi = paired["fraction_range"]
    print(f"  mmzoo-xla batch-1 step, median of the rounds: {100 * paired['fraction_median']:.1f}% of the roofline "
          f"measured around it ({100 * lo:.1f}-{100 * hi:.1f}%)")


def print_profile(p: dict | None) -> None:
    """mmzoo-xla's batch-1 decode step, phase by phase (nothing when it was not profiled)."""
    if not p:
        return
    t = p["xla_timers_ms_per_step"]
    python = "Python (inputs, graph replay)" if p["replayed"] else "Python (inputs, lazy tracing)"
    print(f"mmzoo-xla batch-1 decode step, phase by phase (median of {p['steps']}): {p['step_ms']:.2f} ms = "
          f"{python} {p['python_ms']:.2f} + sync {p['sync_ms']:.2f} + wait {p['wait_ms']:.2f}; "
          f"torch_xla timers per step: LazyTracing {t['LazyTracing']:.2f}, ExecuteTime {t['ExecuteTime']:.2f}, "
          f"TransferToDevice {t['TransferToDeviceTime']:.2f}, TransferFromDevice {t['TransferFromDeviceTime']:.2f}; "
          f"graph nodes {p['graph_nodes']}, buffers updated in place {p['aliased_buffers']}, "
          f"graphs compiled {p['graphs_compiled']}")


# ---------------------------------------------------------------- the targets

def targets(t: DictConfig, roof: dict, sweep_rows: list[dict], metrics: dict) -> list[dict]:
    """The issue's targets (``cfg.targets``) as ``{name, value, threshold, pass, detail}``; ``pass``
    is None where a figure is missing (a system or sweep point not run)."""
    paired = roof.get("paired") or {}
    out = [_roofline_target(float(t.batch1_roofline_fraction), roof, paired)]
    # batch 1: the decode speed (1 / ITL p50) the issue names, and the output tok/s of the whole
    # requests (prefill included), each the median of the rounds' side-by-side ratios; batch 8:
    # output tok/s against transformers' batch-1 figure
    checks = ((1, "batch1_vs_transformers", "decode_tok_s", "decode tok/s (1 / ITL p50)"),
              (1, "batch1_vs_transformers", "output_throughput", "output tok/s (prefill included)"),
              (8, "batch8_vs_transformers", "output_throughput", "output tok/s"))
    out += [_speedup_target(batch, float(t[key]), name, what, sweep_rows, paired) for batch, key, name, what in checks]
    g = metrics.get("mmzoo-xla", {}).get("graphs_compiled_after_warmup")
    limit = int(t.max_graphs_after_warmup)
    n = metrics.get("mmzoo-xla", {}).get("completed")
    out.append({"name": f"mmzoo-xla graphs compiled after warmup <= {limit} over the {n}-request workload",
                "value": g, "threshold": limit, "pass": None if g is None else g <= limit,
                "detail": "n/a" if g is None else str(g)})
    return out


def _roofline_target(frac: float, roof: dict, paired: dict) -> dict:
    x = roof.get("mmzoo-xla")
    if "fraction_median" in paired:  # side by side with the bandwidth measured around each run
        lo, hi = paired["fraction_range"]
        value = paired["fraction_median"]
        detail = (f"{value:.1%} (median of {len(paired['rounds'])} rounds, {lo:.1%}-{hi:.1%}, each against the copy "
                  f"bandwidth measured around it; {x['fraction']:.1%} against the run's best copy bandwidth)")
    else:
        value = x and x["fraction"]
        detail = "n/a" if x is None else (f"{x['fraction']:.1%} ({x['step_ms']:.2f} ms/step vs "
                                          f"{roof['min_step_ms']:.2f} ms)")
    return {"name": f"mmzoo-xla batch-1 decode >= {frac:.0%} of the roofline", "value": value, "threshold": frac,
            "pass": None if value is None else value >= frac, "detail": detail}


def _speedup_target(batch: int, want: float, name: str, what: str, sweep_rows: list[dict], paired: dict) -> dict:
    def row(system, b):
        return next((r for r in sweep_rows if r["system"] == system and r["batch"] == b), None)

    hf, mine = row("transformers", 1), row("mmzoo-xla", batch)
    ratio = mine[name] / hf[name] if mine and hf else None
    detail = "n/a" if ratio is None else f"{ratio:.2f}x ({mine[name]:.1f} vs {hf[name]:.1f} tok/s)"
    if batch == 1 and f"{name}_vs_transformers_median" in paired:
        ratio = paired[f"{name}_vs_transformers_median"]
        lo, hi = paired[f"{name}_vs_transformers_range"]
        detail = (f"{ratio:.2f}x (median of {len(paired['rounds'])} rounds, {lo:.2f}-{hi:.2f}x; all rounds "
                  f"together {mine[name]:.1f} vs {hf[name]:.1f} tok/s)")
    return {"name": f"mmzoo-xla batch-{batch} {what} >= {want:g}x transformers' (batch 1)",
            "value": ratio, "threshold": want, "pass": None if ratio is None else ratio >= want, "detail": detail}


def print_targets(rows: list[dict]) -> None:
    print("Targets:")
    for t in rows:
        print(f"  [{'PASS' if t['pass'] else 'FAIL' if t['pass'] is not None else 'n/a '}] {t['name']}: {t['detail']}")


def write_result(path: str, result: dict) -> None:
    """The JSON result, written whole (temp file, then rename), with the load average at the end."""
    result["environment"]["load_average_at_end"] = os.getloadavg()[0]  # other jobs on a shared host skew every figure
    write_json(path, result)
