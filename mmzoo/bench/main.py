"""``run(cfg)``: the benchmark's stages in order, each a function of its own.

1. :func:`start`: the checkpoint, the environment, the transformers peer and the prompt text.
2. :func:`run_workload`: the seeded workload through every system (the XLA engine after its
   warmup, cold and warm), printed as the serving table.
3. :func:`image_sweep`: TTFT against the image size, on the main run's engines (image families).
4. :func:`batch_sweep`: text-only decode at each batch size; its batch-1 point in rounds, every
   system in turn, the copy bandwidth measured around each mmzoo-xla run; the decode-step profile.
5. :func:`tp_sweep`: the tensor-parallel sweep, a process per point (:mod:`mmzoo.bench.mesh`).
6. The roofline, the printed sweeps and targets, the JSON result (:mod:`mmzoo.bench.report`).

Before them, with ``first_answer.run``: fresh processes on the embedded demo model, from their
start to their first answer (:mod:`mmzoo.bench.first_answer`); with ``real_size.run``: Qwen2-VL at
published sizes, a fresh process per row (:mod:`mmzoo.bench.real_size`); with ``peers.run``: transformers
compiled (static cache + ``torch.compile``) beside its eager generate and mmzoo per attention
backend, at batch 1 and 8 (:mod:`mmzoo.bench.peers`).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from mmzoo.bench import first_answer, peers, real_size, report
from mmzoo.bench.runner import (SYSTEMS, Run, Transformers, agreement, batch1_rounds, build_engine, copy_bandwidth,
                                decode_breakdown, kv_cache_bytes, model_sizes, roofline, run_mmzoo, run_system,
                                sweep_row)
from mmzoo.bench.serving import run_server
from mmzoo.bench.workload import (Family, PromptText, bench_checkpoint, family, image_request, make_workload,
                                  sampling_rate, say, text_requests)
from mmzoo.cli import hydra_main
from mmzoo.errors import MmzooError


@dataclass
class Bench:
    """What every stage shares."""

    cfg: DictConfig
    family: Family
    checkpoint: Path
    processor: object  # the checkpoint's transformers processor
    text: PromptText
    hf: Transformers | None  # the transformers peer, when "transformers" is in systems
    result: dict  # the JSON result, filled stage by stage
    bandwidth: list[float]  # copy bandwidths measured along the run (bytes/s)
    started: float = field(default_factory=time.perf_counter)


@dataclass
class MainRun:
    """The main workload's runs and what later stages reuse of it."""

    runs: dict[str, Run]
    warmup: dict  # the XLA engine's warmup, cold and warm
    lm_info: dict  # parameter counts and the LM bytes a decode step reads
    engines: dict  # system -> the engine it ran on (kept for the sweeps)


@dataclass
class BatchSweep:
    rows: list[dict]
    batch1: dict  # the batch-1 point's rounds
    profile: dict | None  # mmzoo-xla's batch-1 decode step, phase by phase
    kv_bytes_b1: int | None


def run(cfg: DictConfig) -> dict:
    """Run the benchmark described by ``cfg``; print the figures and write the JSON result."""
    check_config(cfg)
    fresh = {"config": OmegaConf.to_container(cfg, resolve=True),
             "environment": {"load_average_at_start": os.getloadavg()[0]}}
    if cfg.first_answer.run:  # fresh processes, before this one loads anything
        fresh["first_answer"] = first_answer.run(cfg)
        first_answer.print_rows(fresh["first_answer"])
    if cfg.real_size.run:  # fresh processes too; the result so far written after each row
        fresh["real_size"] = real_size.run(cfg, on_progress=lambda r: report.write_result(
            cfg.output, {**fresh, "real_size": r}))
    if (cfg.first_answer.run or cfg.real_size.run) and not _more_stages(cfg):
        report.write_result(cfg.output, fresh)
        say(f"wrote {cfg.output}")
        return fresh
    b = start(cfg)
    b.result.update({k: v for k, v in fresh.items() if k in ("first_answer", "real_size")})
    if cfg.peers.run:  # the compiled transformers peer beside the eager one and mmzoo's backends
        rows = peers.run(cfg, b.checkpoint, b.family.hf_class)
        peers.print_rows(rows, int(cfg.peers.prompt_len), int(cfg.peers.max_new_tokens))
        b.result["peers"] = rows
    if not _more_stages(cfg):
        return finish(b)
    main = run_workload(b, make_workload(cfg.workload, b.text, b.family, sampling_rate=sampling_rate(b.processor)))
    images, image_note = image_sweep(b, main.engines)
    reuse = {s: main.engines.pop(s) for s in ("mmzoo-xla",) if s in main.engines}  # the batch sweep's, from here
    main.engines.clear()
    gc.collect()
    if reuse:
        b.result["model"]["kv_cache_bytes_main"] = kv_cache_bytes(reuse["mmzoo-xla"].executor)
    batches = batch_sweep(b, reuse, main.lm_info)
    tp_rows = tp_sweep(b)
    roof = roofline(cfg, b.bandwidth, main.lm_info, batches.rows, batches.kv_bytes_b1, batches.batch1)
    b.result.update(tp_sweep=tp_rows, image_sweep=images, batch_sweep=batches.rows, roofline=roof,
                    decode_profile=batches.profile)
    report.print_sweeps(images, batches.rows, list(cfg.systems), image_note)
    report.print_tp_sweep(tp_rows)
    report.print_roofline(roof, main.lm_info, cfg.dtype)
    report.print_profile(batches.profile)
    b.result["targets"] = report.targets(cfg.targets, roof, batches.rows, b.result["systems"])
    report.print_targets(b.result["targets"])
    return finish(b)


def _more_stages(cfg: DictConfig) -> bool:
    """Whether the workload or a sweep is asked for (a first-answer or peers run may be all there is)."""
    return bool(cfg.systems or cfg.sweep.batch_sizes or cfg.sweep.image_sizes or cfg.sweep.tp)


def check_config(cfg: DictConfig) -> None:
    """Refuse unknown systems, a transformers sweep and a missing output directory before any work."""
    family(str(cfg.family))
    for where in ("systems", "sweep.systems"):
        for s in OmegaConf.select(cfg, where):
            if s not in SYSTEMS:
                raise MmzooError(f"{where}: unknown system {s!r}; choose from {list(SYSTEMS)}")
    if "transformers" in cfg.sweep.systems:
        raise MmzooError("sweep.systems: transformers runs the sweep's batch-1 point whenever it is in "
                         "`systems`; list only mmzoo systems here")
    if "mmzoo-serve" in cfg.sweep.systems:
        raise MmzooError("sweep.systems: the sweeps run engines directly; mmzoo-serve runs the main workload only")
    if cfg.real_size.run:
        real_size.check_config(cfg.real_size)
    if not Path(cfg.output).resolve().parent.is_dir():
        raise MmzooError(f"output directory {Path(cfg.output).parent} does not exist")


def start(cfg: DictConfig) -> Bench:
    """The checkpoint (built if random), the environment, the transformers peer, the prompt text
    and a first copy-bandwidth measurement."""
    import torch

    from mmzoo.executor.xla import ensure_pjrt_device

    if cfg.threads is not None:
        torch.set_num_threads(int(cfg.threads))
    pjrt = ensure_pjrt_device()
    started = time.perf_counter()
    checkpoint = bench_checkpoint(cfg)
    import torch_xla
    import transformers

    env = {"PJRT_DEVICE": pjrt, "torch": torch.__version__, "torch_xla": torch_xla.__version__,
           "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
           "cpu_count": os.cpu_count(), "dtype": cfg.dtype, "load_average_at_start": os.getloadavg()[0]}
    say(f"checkpoint {checkpoint}; systems {list(cfg.systems)}; " + ", ".join(f"{k}={v}" for k, v in env.items()))
    bandwidth = [copy_bandwidth(cfg.roofline.copy_mb, cfg.roofline.repeats)]
    fam = family(str(cfg.family))
    hf = Transformers(checkpoint, cfg.dtype, fam) if "transformers" in cfg.systems else None
    processor = hf.processor if hf else transformers.AutoProcessor.from_pretrained(str(checkpoint),
                                                                                   local_files_only=True)
    result = {"config": OmegaConf.to_container(cfg, resolve=True), "environment": env,
              "checkpoint": str(checkpoint), "systems": {}, "notes": []}
    return Bench(cfg=cfg, family=fam, checkpoint=checkpoint, processor=processor,
                 text=PromptText(processor.tokenizer, int(cfg.workload.seed)), hf=hf, result=result,
                 bandwidth=bandwidth, started=started)


def run_workload(b: Bench, reqs: list[dict]) -> MainRun:
    """``reqs`` through every system of ``cfg.systems`` in order; prints the serving table."""
    main = MainRun(runs={}, warmup={}, lm_info={}, engines={})
    for system in b.cfg.systems:
        say(f"{system}: {len(reqs)} requests")
        if system == "transformers":
            main.runs[system] = b.hf.run(reqs)
            continue
        kind = system.split("-", 1)[1]
        if kind == "serve":  # the XLA engine behind the HTTP server: the main run's, or one of its own
            engine = main.engines.get("mmzoo-xla")
            if engine is None:
                engine, main.warmup = xla_engine(b)
            main.lm_info = main.lm_info or model_sizes(engine, b.cfg.dtype)
            main.runs[system] = run_server(engine, reqs, b.family, concurrency=int(b.cfg.serve.concurrency),
                                           request_rate=b.cfg.serve.request_rate, seed=int(b.cfg.workload.seed),
                                           sampling_rate=sampling_rate(b.processor))
            main.engines.setdefault("mmzoo-xla", engine)
            continue
        if kind == "xla":
            engine, main.warmup = xla_engine(b)
        else:
            engine, _ = build_engine(b.cfg, b.checkpoint, kind)
        main.lm_info = main.lm_info or model_sizes(engine, b.cfg.dtype)
        main.runs[system] = run_mmzoo(engine, system, reqs)
        main.engines[system] = engine
    metrics = {s: r.metrics() for s, r in main.runs.items()}
    agree = agreement(main.runs)
    report.print_serving(len(reqs), metrics, agree, main.warmup, OmegaConf.to_container(b.cfg.serve))
    if "note" in main.warmup:
        b.result["notes"].append(main.warmup["note"])
    b.result.update(systems=metrics, warmup=main.warmup, agreement=agree, model=main.lm_info)
    return main


def xla_engine(b: Bench):
    """The XLA engine and its warmup figures, cold; with ``warm_warmup``, the first engine is
    dropped and a second one built (torch_xla's in-process graph cache now warm), whose warmup is
    timed too and which is returned."""
    cfg = b.cfg
    engine, load_s = build_engine(cfg, b.checkpoint, "xla")
    graphs = engine.executor.compiled_graphs()
    warmup = {"cold_s": engine.executor.warmup_s, "cold_load_s": load_s, "cold_graphs": graphs}
    if cfg.warm_warmup:
        engine = None
        gc.collect()
        engine, load_s = build_engine(cfg, b.checkpoint, "xla")
        warmup.update(warm_s=engine.executor.warmup_s, warm_load_s=load_s,
                      warm_graphs=engine.executor.compiled_graphs() - graphs)
    if os.environ.get("PJRT_DEVICE") == "CPU":
        warmup["note"] = ("warm = a second engine in the same process (torch_xla's in-process graph "
                          "cache); PJRT's CPU client cannot deserialize executables, so the persistent "
                          "on-disk cache (executor.compile.cache_dir) only works on TPU/GPU")
    elif cfg.executors.xla.compile.cache_dir:
        warmup["note"] = (f"executor.compile.cache_dir={cfg.executors.xla.compile.cache_dir} is on: the cold "
                          f"warmup reads executables a previous run left there")
    return engine, warmup


def image_sweep(b: Bench, engines: dict) -> tuple[list[dict], str | None]:
    """TTFT with one image of each ``sweep.image_sizes``, one request at a time, median of
    ``sweep.image_repeats``, on the main run's engines; returns the rows and, when the family
    takes no images, why there are none."""
    cfg = b.cfg
    if not cfg.sweep.image_sizes:
        return [], None
    if b.family.media != "image":
        note = f"skipped (family={cfg.family} takes {b.family.media}, not images)"
        b.result["notes"].append(f"image-size sweep {note}")
        return [], note
    systems = [s for s in cfg.systems if s in engines or s == "transformers"]
    rows = []
    for w, h in (tuple(int(v) for v in s) for s in cfg.sweep.image_sizes):
        req = image_request(b.text, b.family, int(cfg.workload.seed), w, h, cfg.sweep.image_prompt_len)
        row = {"image": f"{w}x{h}"}
        for system in systems:
            if not rows:  # an untimed first request per system: one-time costs stay out of the figures
                run_system(system, [req], engines, b.hf)
            trials = [run_system(system, [req], engines, b.hf) for _ in range(int(cfg.sweep.image_repeats))]
            row["prompt_tokens"] = trials[0].prompt_lens[0]
            row[system] = statistics.median(t.ttft_s[0] for t in trials) * 1e3
            if trials[0].graphs_after_warmup:
                row.setdefault("graphs_compiled", {})[system] = sum(t.graphs_after_warmup for t in trials)
        rows.append(row)
    return rows, None


def batch_sweep(b: Bench, reuse: dict, lm_info: dict) -> BatchSweep:
    """Text-only decode at each ``sweep.batch_sizes`` entry, one engine per system and batch (an
    engine of ``reuse``, the main run's, at its own ``max_batch``: taken out of the dict, so that it
    goes once used); the batch-1 point in rounds with transformers
    (:func:`~mmzoo.bench.runner.batch1_rounds`) and mmzoo-xla's decode step profiled there."""
    cfg = b.cfg
    out = BatchSweep(rows=[], batch1={}, profile=None, kv_bytes_b1=None)
    reuse_batch = int(cfg.executors.xla.max_batch)
    batches = sorted(int(n) for n in cfg.sweep.batch_sizes)
    for batch in sorted(batches, key=lambda n: n != reuse_batch):  # the engine kept from the main run first
        n = max(batch, int(cfg.sweep.min_requests))
        rng = np.random.default_rng(int(cfg.workload.seed) + 1000 + batch)
        reqs = text_requests(b.text, n, cfg.sweep.prompt_len, cfg.workload.max_new_tokens, rng)
        engines = {}
        for system in cfg.sweep.systems:
            if batch == reuse_batch and system in reuse:
                engine = reuse.pop(system)
            else:
                engine = _sweep_engine(b, system, batch)
            engine.warm(reqs)  # untimed: compiles the graphs these requests hit (warmup=needed; the reused engine has all)
            if batch != 1:  # one engine at a time
                say(f"sweep {system} batch {batch}: {n} requests")
                out.rows.append(sweep_row(system, batch, run_mmzoo(engine, system, reqs)))
                engine = None
                gc.collect()
                continue
            engines[system] = engine
        if batch == 1:
            _batch1_point(b, engines, reqs, lm_info, out)
            engines.clear()
            gc.collect()
    reuse.clear()
    out.rows.sort(key=lambda r: (r["batch"], SYSTEMS.index(r["system"])))
    return out


def _sweep_engine(b: Bench, system: str, batch: int):
    kind = system.split("-", 1)[1]
    over = OmegaConf.to_container(b.cfg.sweep.xla_overrides, resolve=True) if kind == "xla" else {}
    engine, _ = build_engine(b.cfg, b.checkpoint, kind, max_batch=batch, **over)
    return engine


def _batch1_point(b: Bench, engines: dict, reqs: list[dict], lm_info: dict, out: BatchSweep) -> None:
    rows, out.batch1 = batch1_rounds(b.cfg, engines, b.hf, reqs, lm_info)
    out.rows += rows
    xla = engines.get("mmzoo-xla")
    if xla is not None:
        out.kv_bytes_b1 = kv_cache_bytes(xla.executor)
        if int(b.cfg.sweep.decode_profile_steps) > 0:
            out.profile = decode_breakdown(xla, int(b.cfg.sweep.decode_profile_steps))


def tp_sweep(b: Bench) -> list[dict]:
    """The tensor-parallel sweep's rows (none without ``sweep.tp``)."""
    if not b.cfg.sweep.get("tp"):
        return []
    from mmzoo.bench import mesh  # here, not at the top: ``python -m mmzoo.bench.mesh`` imports this package

    return mesh.sweep(b.cfg, b.checkpoint, b.text)


def finish(b: Bench) -> dict:
    """Write the JSON result; returns it."""
    b.result["wall_s"] = time.perf_counter() - b.started
    report.write_result(b.cfg.output, b.result)
    say(f"wrote {b.cfg.output} ({b.result['wall_s']:.0f} s in all)")
    return b.result


main = hydra_main(run, "bench")
