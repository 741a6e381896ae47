"""``python -m mmzoo.bench``: a serving benchmark of mmzoo against transformers on one checkpoint.

Examples::

    PJRT_DEVICE=CPU python -m mmzoo.bench --config-dir recipes --config-name bench_qwen2_vl
    PJRT_DEVICE=CPU python -m mmzoo.bench --config-dir recipes --config-name bench_qwen2_vl_smoke
    python -m mmzoo.bench workload.num_requests=20 'systems=[mmzoo-xla,transformers]' output=b.json

One process runs the same seeded workload (mixed prompt lengths, 0 to 3 images of mixed sizes,
a fixed number of output tokens with EOS ignored) through mmzoo's XLA executor (after its warmup),
mmzoo's eager executor and transformers' ``generate()`` (one request at a time, greedy), and
prints vLLM-style serving figures per system. All requests arrive at t=0 (vLLM's
``--request-rate inf``), so TTFT includes queueing. Then: XLA warmup cold and warm, a sweep over
the image size and over the decode batch (its batch-1 point in rounds, every system in turn, the
copy bandwidth measured around each mmzoo-xla run), a decode roofline (weight bytes read per step
over that bandwidth), and the issue's targets as pass/fail lines, each from figures taken side
by side. Figures only: this is not a test, and the targets are printed, not asserted.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from mmzoo.errors import MmzooError
from mmzoo.cli import hydra_main
from mmzoo.files import write_json

SYSTEMS = ("mmzoo-xla", "mmzoo-eager", "transformers")
_CKPT_VERSION = 1  # bump when make_tiny_qwen2_vl's output changes, to rebuild cached benchmark checkpoints
_T0 = time.perf_counter()


def say(msg: str) -> None:
    """A progress line on stderr, stamped with the seconds since the module was imported."""
    print(f"bench [{time.perf_counter() - _T0:6.1f} s]: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- inputs

def bench_checkpoint(cfg: DictConfig) -> Path:
    """``checkpoint.path``, or a random Qwen2-VL checkpoint built from ``checkpoint.random`` (cached)."""
    from mmzoo.paths import cache_dir
    from mmzoo.fixtures import make_tiny_qwen2_vl

    if cfg.checkpoint.path is not None:
        path = Path(cfg.checkpoint.path)
        if not (path / "config.json").is_file():
            raise MmzooError(f"checkpoint.path={path} has no config.json")
        return path
    sizes = OmegaConf.to_container(cfg.checkpoint.random, resolve=True)
    key = hashlib.sha256(json.dumps({"v": _CKPT_VERSION, **sizes}, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir() / "bench" / f"qwen2_vl-{key}"
    if not (path / "config.json").is_file():
        say(f"building a random Qwen2-VL checkpoint at {path}")
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            make_tiny_qwen2_vl(tmp, **sizes)
        except TypeError as e:  # an unknown size name in checkpoint.random
            raise MmzooError(f"checkpoint.random: {e}") from None
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return path


class _PromptText:
    """Prompts of a given number of text tokens, cut from the tokenizer's own synthetic corpus."""

    def __init__(self, tokenizer, seed: int):
        from mmzoo.fixtures import synthetic_corpus

        self.tokenizer = tokenizer
        self.pool = tokenizer(" ".join(synthetic_corpus(seed)))["input_ids"]

    def __call__(self, n: int, rng: np.random.Generator) -> str:
        if n > len(self.pool):
            raise MmzooError(f"a prompt of {n} tokens is longer than the corpus ({len(self.pool)} tokens)")
        start = int(rng.integers(0, len(self.pool) - n + 1))
        return self.tokenizer.decode(self.pool[start:start + n])


def make_workload(wl: DictConfig, text: _PromptText) -> list[dict]:
    """``num_requests`` request dicts from ``wl.seed``: prompt lengths, image counts and sizes drawn per request."""
    from mmzoo.fixtures import make_image

    rng = np.random.default_rng(int(wl.seed))
    lo, hi = (int(x) for x in wl.prompt_len)
    sizes = [tuple(int(v) for v in s) for s in wl.image_sizes]
    reqs = []
    for i in range(int(wl.num_requests)):
        n_text = int(rng.integers(lo, hi + 1))
        n_img = int(rng.integers(0, int(wl.max_images) + 1)) if sizes else 0
        images = [make_image(*sizes[int(rng.integers(len(sizes)))], seed=int(wl.seed) * 100_000 + i * 10 + j)
                  for j in range(n_img)]
        reqs.append({"prompt": text(n_text, rng), "images": images, "max_new_tokens": int(wl.max_new_tokens),
                     "ignore_eos": True})
    return reqs


# ---------------------------------------------------------------- one system's run

@dataclass
class Run:
    """One system on one list of requests; every time is in seconds from the run's start."""

    system: str
    duration_s: float
    prompt_lens: list[int]
    outputs: list[list[int]]
    ttft_s: list[float]
    latency_s: list[float]
    token_times_s: list[list[float]] = field(repr=False)
    graphs_after_warmup: int | None = None

    @classmethod
    def merge(cls, runs: list["Run"]) -> "Run":
        """Several runs of one system as one: their requests together, their durations added."""
        return cls(system=runs[0].system, duration_s=sum(r.duration_s for r in runs),
                   prompt_lens=[n for r in runs for n in r.prompt_lens], outputs=[o for r in runs for o in r.outputs],
                   ttft_s=[t for r in runs for t in r.ttft_s], latency_s=[t for r in runs for t in r.latency_s],
                   token_times_s=[t for r in runs for t in r.token_times_s],
                   graphs_after_warmup=None if runs[0].graphs_after_warmup is None else
                   sum(r.graphs_after_warmup for r in runs))

    def metrics(self) -> dict:
        """vLLM's serving figures: throughputs, and TTFT / TPOT / ITL / E2E latency in ms."""
        n_out = [len(o) for o in self.outputs]
        tpot = [(lat - ttft) / (n - 1) for lat, ttft, n in zip(self.latency_s, self.ttft_s, n_out) if n > 1]
        itl = [b - a for times in self.token_times_s for a, b in zip(times, times[1:])]
        out = {"completed": len(self.outputs), "duration_s": self.duration_s,
               "total_input_tokens": sum(self.prompt_lens), "total_output_tokens": sum(n_out),
               "request_throughput": len(self.outputs) / self.duration_s,
               "output_throughput": sum(n_out) / self.duration_s,
               "total_token_throughput": (sum(n_out) + sum(self.prompt_lens)) / self.duration_s}
        for name, xs in (("ttft", self.ttft_s), ("tpot", tpot), ("itl", itl), ("e2el", self.latency_s)):
            ms = np.asarray(xs, dtype=np.float64) * 1e3
            out[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else None
            out[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else None
            out[f"p99_{name}_ms"] = float(np.percentile(ms, 99)) if ms.size else None
        out["graphs_compiled_after_warmup"] = self.graphs_after_warmup
        return out


def run_mmzoo(engine, system: str, reqs: list[dict]) -> Run:
    """The requests through mmzoo at once (continuous batching); counts XLA compiles.

    What ``Engine.generate`` does, in two timed parts: the host preparation of every request
    (tokenizing, image preprocessing) and the executor's schedule. The executor's times count from
    its own start, so they are shifted by the preparation time: every time counts from the run's
    start, as transformers' do (which prepares each request just before it runs).
    """
    from mmzoo.types import Request

    exe = engine.executor
    count = getattr(exe, "compiled_graphs", None)
    before = count() if count else None
    t0 = time.perf_counter()
    prepared = [engine.prepare(Request(id=i, **r)) for i, r in enumerate(reqs)]
    offset = time.perf_counter() - t0
    results = exe.generate(prepared, decode_text=engine.decode)
    duration = time.perf_counter() - t0
    errors = [r.error for r in results if r.error]
    if errors:
        raise MmzooError(f"{system}: {len(errors)} requests failed, the first: {errors[0]}")
    return Run(system=system, duration_s=duration, prompt_lens=[len(r.prompt_token_ids) for r in results],
               outputs=[r.token_ids for r in results], ttft_s=[r.ttft_s + offset for r in results],
               latency_s=[r.latency_s + offset for r in results],
               token_times_s=[[t + offset for t in r.token_times_s] for r in results],
               graphs_after_warmup=None if count is None else count() - before)


class Transformers:
    """transformers' ``Qwen2VLForConditionalGeneration.generate()``: one request at a time, greedy,
    EOS disabled so that each request produces exactly its ``max_new_tokens``."""

    def __init__(self, checkpoint: Path, dtype: str):
        import torch
        from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(str(checkpoint), local_files_only=True)
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(
            str(checkpoint), dtype=getattr(torch, dtype), local_files_only=True).eval()
        self.model.generation_config.eos_token_id = None
        self.pad = self.processor.tokenizer.pad_token_id

    def inputs(self, req: dict):
        content = [{"type": "image"}] * len(req["images"]) + [{"type": "text", "text": req["prompt"]}]
        text = self.processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
        # the processor also returns mm_token_type_ids, which transformers 5's Qwen2-VL needs
        return self.processor(text=[text], images=req["images"] or None, return_tensors="pt")

    def run(self, reqs: list[dict]) -> Run:
        import torch
        from transformers.generation.streamers import BaseStreamer

        class Clock(BaseStreamer):  # generate() calls put() once with the prompt, then once per new token
            def __init__(self):
                self.times, self.prompt_seen = [], False

            def put(self, value):
                if self.prompt_seen:
                    self.times.append(time.perf_counter() - t0)
                self.prompt_seen = True

            def end(self):
                pass

        prompt_lens, outputs, times = [], [], []
        t0 = time.perf_counter()
        for req in reqs:
            inputs = self.inputs(req)
            clock = Clock()
            with torch.no_grad():
                out = self.model.generate(**inputs, max_new_tokens=req["max_new_tokens"], do_sample=False,
                                          pad_token_id=self.pad, streamer=clock)
            n = inputs["input_ids"].shape[1]
            prompt_lens.append(n)
            outputs.append(out[0, n:].tolist())
            times.append(clock.times)
        duration = time.perf_counter() - t0
        return Run(system="transformers", duration_s=duration, prompt_lens=prompt_lens, outputs=outputs,
                   ttft_s=[t[0] for t in times], latency_s=[t[-1] for t in times], token_times_s=times)


def build_engine(cfg: DictConfig, checkpoint: Path, kind: str, **overrides):
    """An mmzoo engine with ``executors.<kind>`` (plus overrides); returns it and its load time."""
    import mmzoo

    exe = instantiate(OmegaConf.merge(cfg.executors[kind], overrides))
    t0 = time.perf_counter()
    engine = mmzoo.load(checkpoint, model=str(cfg.model), executor=exe,
                        attention=instantiate(cfg.attention), dtype=cfg.dtype)
    return engine, time.perf_counter() - t0


# ---------------------------------------------------------------- roofline

def _best_seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(max(1, int(repeats))):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(mb: int, repeats: int) -> float:
    """Bytes per second of a large tensor copy, best of ``repeats``, counting the bytes read and
    written (STREAM's "copy" convention)."""
    import torch

    src = torch.ones(int(mb) * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / _best_seconds(lambda: dst.copy_(src), repeats)


def read_bandwidth(mb: int, repeats: int) -> float:
    """Bytes per second read by a sum over a large tensor, best of ``repeats``: the traffic a
    decode step's weight reads make (the roofline itself uses :func:`copy_bandwidth`)."""
    import torch

    src = torch.ones(int(mb) * 2**20 // 4, dtype=torch.float32)
    return src.numel() * src.element_size() / _best_seconds(src.sum, repeats)


def decode_weight_bytes(lm, dtype: str, batch: int = 1) -> int:
    """Bytes of LM weights one decode step reads: every decoder layer, the final norm and the LM
    head in full; of the token embedding only the ``batch`` looked-up rows (all of it when tied,
    since the head then reads the whole table)."""
    import torch

    emb = lm.embed_tokens.weight
    n = sum(p.numel() for p in lm.parameters() if p is not emb)  # parameters() lists a tied weight once
    head_reads_emb = any(p is emb for p in lm.lm_head.parameters())  # tied, and not given its own layout
    n += emb.numel() if head_reads_emb else batch * emb.shape[1]
    return n * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def kv_cache_bytes(exe) -> int:
    """Bytes of the KV cache an mmzoo decode step attends over (static shapes: every slot's full row)."""
    c = exe.cache
    return sum(t.numel() * t.element_size() for t in c.k + c.v)


def decode_breakdown(engine, steps: int) -> dict:
    """Where one XLA decode step's time goes: Python (host arrays, transfers, then lazy tracing or,
    with ``replay_steps``, launching the compiled graph), the sync (graph hashing, cache lookup,
    launch: nothing left to do after a replay) and the wait for the result; torch_xla's timers."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from mmzoo.executor.scheduler import Sequence
    from mmzoo.types import Request, Result

    exe = engine.executor
    prepared = engine.prepare(Request(prompt="profile", max_new_tokens=steps + 1, ignore_eos=True))
    seq = Sequence(prepared=prepared, result=Result(id=0, prompt="profile"), index=0, rng=np.random.default_rng(0),
                   slot=0, length=len(prepared.input_ids))

    def timer(name):
        d = met.metric_data(name)
        return (d[0], d[1]) if d else (0, 0)

    names = ("LazyTracing", "ExecuteTime", "TransferToDeviceTime", "TransferFromDeviceTime", "CompileTime")
    exe.decode(exe.decode_inputs({0: seq})).cpu()  # one untimed step
    torch_xla.sync()
    before = {n: timer(n) for n in names}
    trace, sync, wait = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = exe.decode(exe.decode_inputs({0: seq}))
        t1 = time.perf_counter()
        exe.step_done()  # the executor's own sync: none after a replayed step
        t2 = time.perf_counter()
        out.cpu()
        t3 = time.perf_counter()
        trace.append(t1 - t0)
        sync.append(t2 - t1)
        wait.append(t3 - t2)
    after = {n: timer(n) for n in names}
    sizes = met.metric_data("TensorsGraphSize")
    alias = met.metric_data("InputOutputAliasCount")  # buffers updated in place (the KV cache, when donated)
    per_step = {n: (after[n][1] - before[n][1]) / steps / 1e6 for n in names}  # timers accumulate ns
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"steps": steps, "replayed": bool(getattr(exe, "replaying", False)),
            "python_ms": med(trace), "sync_ms": med(sync), "wait_ms": med(wait),
            "step_ms": med([a + b + c for a, b, c in zip(trace, sync, wait)]),
            "xla_timers_ms_per_step": per_step,
            "graphs_compiled": after["CompileTime"][0] - before["CompileTime"][0],
            "graph_nodes": int(sizes[2][-1][1]) if sizes and sizes[2] else None,
            "aliased_buffers": int(alias[2][-1][1]) if alias and alias[2] else 0}


# ---------------------------------------------------------------- printing

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


def _check(system: str, where: str) -> None:
    if system not in SYSTEMS:
        raise MmzooError(f"{where}: unknown system {system!r}; choose from {list(SYSTEMS)}")


# ---------------------------------------------------------------- the benchmark

def run(cfg: DictConfig) -> dict:
    """Run the benchmark described by ``cfg``; print the figures and write the JSON result."""
    import torch

    from mmzoo.executor.xla import ensure_pjrt_device

    systems = list(cfg.systems)
    for s in systems:
        _check(s, "systems")
    for s in cfg.sweep.systems:
        _check(s, "sweep.systems")
        if s == "transformers":
            raise MmzooError("sweep.systems: transformers runs the sweep's batch-1 point whenever it is in "
                             "`systems`; list only mmzoo systems here")
    if not Path(cfg.output).resolve().parent.is_dir():
        raise MmzooError(f"output directory {Path(cfg.output).parent} does not exist")
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
    say(f"checkpoint {checkpoint}; systems {systems}; " + ", ".join(f"{k}={v}" for k, v in env.items()))
    bandwidth = [copy_bandwidth(cfg.roofline.copy_mb, cfg.roofline.repeats)]

    hf = Transformers(checkpoint, cfg.dtype) if "transformers" in systems else None
    from transformers import AutoProcessor

    processor = hf.processor if hf else AutoProcessor.from_pretrained(str(checkpoint), local_files_only=True)
    text = _PromptText(processor.tokenizer, int(cfg.workload.seed))
    reqs = make_workload(cfg.workload, text)
    result: dict = {"config": OmegaConf.to_container(cfg, resolve=True), "environment": env,
                    "checkpoint": str(checkpoint), "systems": {}, "notes": []}

    # -- the workload through every system ----------------------------------------------------
    runs: dict[str, Run] = {}
    warmup: dict = {}
    lm_info: dict = {}
    engines_for_sweep = {}
    for system in systems:
        say(f"{system}: {len(reqs)} requests")
        if system == "transformers":
            runs[system] = hf.run(reqs)
            continue
        kind = system.split("-", 1)[1]
        engine, load_s = build_engine(cfg, checkpoint, kind)
        if kind == "xla":
            graphs = engine.executor.compiled_graphs()
            warmup = {"cold_s": engine.executor.warmup_s, "cold_load_s": load_s, "cold_graphs": graphs}
            if cfg.warm_warmup:
                engine = None
                gc.collect()
                engine, load_s = build_engine(cfg, checkpoint, kind)  # torch_xla's in-process graph cache is warm
                warmup.update(warm_s=engine.executor.warmup_s, warm_load_s=load_s,
                              warm_graphs=engine.executor.compiled_graphs() - graphs)
            if pjrt == "CPU":
                warmup["note"] = ("warm = a second engine in the same process (torch_xla's in-process graph "
                                  "cache); PJRT's CPU client cannot deserialize executables, so the persistent "
                                  "on-disk cache (compile_cache_dir) only works on TPU/GPU")
            elif cfg.executors.xla.compile_cache_dir:
                warmup["note"] = (f"compile_cache_dir={cfg.executors.xla.compile_cache_dir} is on: the cold "
                                  f"warmup reads executables a previous run left there")
        if not lm_info:
            lm = engine.model.lm
            lm_info = {"lm_params": sum(p.numel() for p in lm.parameters()),
                       "all_params": sum(p.numel() for p in engine.model.parameters()),
                       "decode_weight_bytes_b1": decode_weight_bytes(lm, cfg.dtype, 1)}
        runs[system] = run_mmzoo(engine, system, reqs)
        engines_for_sweep[system] = engine

    metrics = {s: r.metrics() for s, r in runs.items()}
    agree = _agreement(runs)
    extra = [("Warmup cold / warm (s)", {"mmzoo-xla": f"{warmup.get('cold_s', 0):.1f}/"
                                                      f"{warmup.get('warm_s', float('nan')):.1f}"})] if warmup else []
    extra += [(f"Outputs identical to {ref} (requests)", {s: f"{n}/{len(reqs)}" for s, n in row.items()})
              for ref, row in agree.items()]
    print_table(f"Serving benchmark: {len(reqs)} requests, all at t=0", metrics, extra)
    if warmup:
        print(f"XLA warmup: cold {warmup['cold_s']:.1f} s ({warmup['cold_graphs']} graphs compiled)"
              + (f", warm {warmup['warm_s']:.1f} s ({warmup['warm_graphs']} graphs compiled)" if "warm_s" in warmup
                 else ""))
        if "note" in warmup:
            print(f"  note: {warmup['note']}")
            result["notes"].append(warmup["note"])
    result.update(systems=metrics, warmup=warmup, agreement=agree, model=lm_info)

    # -- image-size sweep (TTFT), on the engines of the main run ----------------------------------
    image_rows = []
    from mmzoo.fixtures import make_image

    for w, h in (tuple(int(v) for v in s) for s in cfg.sweep.image_sizes):
        rng = np.random.default_rng(int(cfg.workload.seed) + w * 7 + h)
        req = {"prompt": text(int(cfg.sweep.image_prompt_len), rng), "images": [make_image(w, h, seed=w + h)],
               "max_new_tokens": 1, "ignore_eos": True}
        row = {"image": f"{w}x{h}"}
        for system in systems:
            if system not in engines_for_sweep and system != "transformers":
                continue
            if not image_rows:  # an untimed first request per system: one-time costs stay out of the figures
                hf.run([req]) if system == "transformers" else run_mmzoo(engines_for_sweep[system], system, [req])
            trials = [hf.run([req]) if system == "transformers" else run_mmzoo(engines_for_sweep[system], system, [req])
                      for _ in range(int(cfg.sweep.image_repeats))]
            row["prompt_tokens"] = trials[0].prompt_lens[0]
            row[system] = statistics.median(t.ttft_s[0] for t in trials) * 1e3
            if trials[0].graphs_after_warmup:
                row.setdefault("graphs_compiled", {})[system] = sum(t.graphs_after_warmup for t in trials)
        image_rows.append(row)
    main_xla = engines_for_sweep.pop("mmzoo-xla", None)
    kv_bytes_main = kv_cache_bytes(main_xla.executor) if main_xla else None
    reuse = {"mmzoo-xla": main_xla} if main_xla else {}
    reuse_batch = int(cfg.executors.xla.max_batch)
    main_xla = None
    engines_for_sweep.clear()
    gc.collect()

    # -- batch sweep -----------------------------------------------------------------------------
    sweep_rows: list[dict] = []
    profile = None
    kv_b1 = None
    batch1: dict = {}
    batches = sorted(int(b) for b in cfg.sweep.batch_sizes)
    order = sorted(batches, key=lambda b: b != reuse_batch)  # the engine kept from the main run first
    sweep_systems = [s for s in cfg.sweep.systems if s != "transformers"]
    for b in order:
        n = max(b, int(cfg.sweep.min_requests))
        rng = np.random.default_rng(int(cfg.workload.seed) + 1000 + b)
        sreqs = [{"prompt": text(int(cfg.sweep.prompt_len), rng), "images": [],
                  "max_new_tokens": int(cfg.workload.max_new_tokens), "ignore_eos": True} for _ in range(n)]
        engines = {}
        for system in sweep_systems:
            kind = system.split("-", 1)[1]
            if b == reuse_batch and system in reuse:
                engine = reuse.pop(system)
            else:
                over = OmegaConf.to_container(cfg.sweep.xla_overrides, resolve=True) if kind == "xla" else {}
                engine, _ = build_engine(cfg, checkpoint, kind, max_batch=b, **over)
            run_mmzoo(engine, system, [dict(r, max_new_tokens=2) for r in sreqs])  # priming: compiles lazily, untimed
            if b != 1:  # one engine at a time
                say(f"sweep {system} batch {b}: {n} requests")
                sweep_rows.append(_sweep_row(system, b, run_mmzoo(engine, system, sreqs)))
                engine = None
                gc.collect()
                continue
            engines[system] = engine
        if b == 1:
            rows, batch1 = _batch1_rounds(cfg, engines, hf, sreqs, lm_info)
            sweep_rows += rows
            xla1 = engines.get("mmzoo-xla")
            if xla1 is not None:
                kv_b1 = kv_cache_bytes(xla1.executor)
                if int(cfg.sweep.decode_profile_steps) > 0:
                    profile = decode_breakdown(xla1, int(cfg.sweep.decode_profile_steps))
            engines.clear()
            xla1 = None
            gc.collect()
    reuse.clear()
    sweep_rows.sort(key=lambda r: (r["batch"], SYSTEMS.index(r["system"])))

    # -- tensor-parallel sweep (sweep.tp; a process per point: mmzoo/_bench_mesh.py) ---------------
    from mmzoo import _bench_mesh

    tp_rows = _bench_mesh.sweep(cfg, checkpoint, text, say) if cfg.sweep.get("tp") else []
    result["tp_sweep"] = tp_rows

    # -- roofline --------------------------------------------------------------------------------
    bandwidth.append(copy_bandwidth(cfg.roofline.copy_mb, cfg.roofline.repeats))
    bandwidth += [x * 1e9 for r in batch1.get("rounds", []) for x in r.get("copy_bandwidth_GBps", [])]
    bw = max(bandwidth)
    read_bw = read_bandwidth(cfg.roofline.copy_mb, cfg.roofline.repeats)
    roofline: dict = {"copy_bandwidth_GBps": bw / 1e9, "copy_bandwidth_runs_GBps": [x / 1e9 for x in bandwidth],
                      "read_bandwidth_GBps": read_bw / 1e9}
    if lm_info:
        wbytes = lm_info["decode_weight_bytes_b1"]
        roofline.update(weight_bytes=wbytes, min_step_ms=wbytes / bw * 1e3, min_step_ms_at_read_bw=wbytes / read_bw * 1e3,
                        best_fraction_at_read_bw=read_bw / bw)
        for row in sweep_rows:
            if row["batch"] == 1:
                roofline[row["system"]] = {"step_ms": row["median_tpot_ms"],
                                           "fraction": roofline["min_step_ms"] / row["median_tpot_ms"],
                                           "weights_read_GBps": wbytes / row["median_tpot_ms"] / 1e6}
        if kv_b1 is not None:
            roofline["mmzoo_kv_cache_bytes_b1"] = kv_b1
        if batch1 and batch1["rounds"]:
            roofline["paired"] = batch1
    result.update(image_sweep=image_rows, batch_sweep=sweep_rows, roofline=roofline, decode_profile=profile)
    if kv_bytes_main is not None:
        result["model"]["kv_cache_bytes_main"] = kv_bytes_main

    _print_sweeps(image_rows, sweep_rows, systems)
    _bench_mesh.print_sweep(tp_rows)
    _print_roofline(roofline, lm_info, cfg.dtype)
    if profile:
        _print_profile(profile)
    result["targets"] = _targets(cfg.targets, roofline, sweep_rows, metrics)
    print("Targets:")
    for t in result["targets"]:
        print(f"  [{'PASS' if t['pass'] else 'FAIL' if t['pass'] is not None else 'n/a '}] {t['name']}: {t['detail']}")
    result["wall_s"] = time.perf_counter() - started
    env["load_average_at_end"] = os.getloadavg()[0]  # other jobs on a shared machine skew every figure
    write_json(cfg.output, result)
    say(f"wrote {cfg.output} ({result['wall_s']:.0f} s in all)")
    return result


def _batch1_rounds(cfg: DictConfig, engines: dict, hf, sreqs: list[dict], lm_info: dict) -> tuple[list[dict], dict]:
    """The batch-1 point, in ``sweep.batch1_rounds`` rounds: each round runs the requests through
    every system in turn and measures the copy bandwidth just before and just after mmzoo-xla's
    run. This machine's bandwidth and speed drift by tens of percent within minutes (neighbours on
    a shared host), so each round compares figures taken side by side: mmzoo-xla's step against
    the roofline of the bandwidth measured around it, and each mmzoo system against transformers
    in the same round. Returns the sweep rows (every round's requests together) and the rounds."""
    runs: dict[str, list[Run]] = {s: [] for s in [*engines, *(["transformers"] if hf is not None else [])]}
    rounds = []
    wbytes = lm_info.get("decode_weight_bytes_b1")
    for k in range(max(1, int(cfg.sweep.batch1_rounds))):
        say(f"sweep batch 1, round {k + 1}: {len(sreqs)} requests through {', '.join(runs)}")
        rnd: dict = {}
        for system in runs:
            xla = system == "mmzoo-xla"
            if xla:
                before = copy_bandwidth(cfg.roofline.copy_mb, cfg.roofline.repeats)
            r = hf.run(sreqs) if system == "transformers" else run_mmzoo(engines[system], system, sreqs)
            if xla:
                after = copy_bandwidth(cfg.roofline.copy_mb, cfg.roofline.repeats)
                rnd["copy_bandwidth_GBps"] = [before / 1e9, after / 1e9]
            runs[system].append(r)
            rnd[system] = _sweep_row(system, 1, r)
        x, hf_row = rnd.get("mmzoo-xla"), rnd.get("transformers")
        if x and wbytes:
            bw = sum(rnd["copy_bandwidth_GBps"]) / 2 * 1e9
            rnd["min_step_ms"] = wbytes / bw * 1e3
            rnd["fraction"] = rnd["min_step_ms"] / x["median_tpot_ms"]
        if x and hf_row:
            rnd["vs_transformers"] = {f: x[f] / hf_row[f] for f in ("decode_tok_s", "output_throughput")}
        rounds.append(rnd)
    rows = [_sweep_row(system, 1, Run.merge(rs)) for system, rs in runs.items()]
    out: dict = {"rounds": rounds}
    fractions = [r["fraction"] for r in rounds if "fraction" in r]
    if fractions:
        out["fraction_median"], out["fraction_range"] = statistics.median(fractions), [min(fractions), max(fractions)]
    if "mmzoo-xla" in runs and "transformers" in runs:
        for field in ("decode_tok_s", "output_throughput"):
            ratios = [r["vs_transformers"][field] for r in rounds]
            out[f"{field}_vs_transformers_median"] = statistics.median(ratios)
            out[f"{field}_vs_transformers_range"] = [min(ratios), max(ratios)]
    return rows, out


def _sweep_row(system: str, batch: int, r: Run) -> dict:
    m = r.metrics()
    return {"system": system, "batch": batch, "requests": m["completed"], "duration_s": m["duration_s"],
            "output_throughput": m["output_throughput"], "median_tpot_ms": m["median_tpot_ms"],
            "median_itl_ms": m["median_itl_ms"], "decode_tok_s": batch / m["median_itl_ms"] * 1e3,
            "median_ttft_ms": m["median_ttft_ms"], "graphs_compiled": r.graphs_after_warmup}


def _agreement(runs: dict[str, Run]) -> dict:
    """How many requests produced the same token ids as mmzoo-eager (the reference path)."""
    ref = "mmzoo-eager" if "mmzoo-eager" in runs else next(iter(runs), None)
    if ref is None:
        return {}
    return {ref: {s: sum(a == b for a, b in zip(r.outputs, runs[ref].outputs)) for s, r in runs.items() if s != ref}}


def _print_sweeps(image_rows, sweep_rows, systems) -> None:
    if sweep_rows:
        print("Decode batch sweep (text-only, every request in the batch at t=0):")
        print(f"  {'system':<14}{'batch':>6}{'reqs':>6}{'step ms (ITL p50)':>19}{'decode tok/s':>14}"
              f"{'output tok/s':>14}{'TTFT p50 ms':>13}")
        for r in sweep_rows:
            print(f"  {r['system']:<14}{r['batch']:>6}{r['requests']:>6}{r['median_itl_ms']:>19.1f}"
                  f"{r['decode_tok_s']:>14.1f}{r['output_throughput']:>14.1f}{r['median_ttft_ms']:>13.1f}")
    if image_rows:
        shown = [s for s in systems if any(s in row for row in image_rows)]
        print("TTFT vs image size (one image, one request at a time, median ms):")
        print(f"  {'image':<10}{'prompt tok':>11}" + "".join(f"{s:>14}" for s in shown))
        for row in image_rows:
            print(f"  {row['image']:<10}{row.get('prompt_tokens', 0):>11}"
                  + "".join(f"{_fmt('{:.1f}', row.get(s)):>14}" for s in shown))


def _print_roofline(roof: dict, lm_info: dict, dtype: str) -> None:
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


def _print_profile(p: dict) -> None:
    t = p["xla_timers_ms_per_step"]
    python = "Python (inputs, graph replay)" if p["replayed"] else "Python (inputs, lazy tracing)"
    print(f"mmzoo-xla batch-1 decode step, phase by phase (median of {p['steps']}): {p['step_ms']:.2f} ms = "
          f"{python} {p['python_ms']:.2f} + sync {p['sync_ms']:.2f} + wait {p['wait_ms']:.2f}; "
          f"torch_xla timers per step: LazyTracing {t['LazyTracing']:.2f}, ExecuteTime {t['ExecuteTime']:.2f}, "
          f"TransferToDevice {t['TransferToDeviceTime']:.2f}, TransferFromDevice {t['TransferFromDeviceTime']:.2f}; "
          f"graph nodes {p['graph_nodes']}, buffers updated in place {p['aliased_buffers']}, "
          f"graphs compiled {p['graphs_compiled']}")


def _targets(t: DictConfig, roof: dict, sweep_rows: list[dict], metrics: dict) -> list[dict]:
    def row(system, batch):
        return next((r for r in sweep_rows if r["system"] == system and r["batch"] == batch), None)

    out = []
    x, paired = roof.get("mmzoo-xla"), roof.get("paired") or {}
    frac = float(t.batch1_roofline_fraction)
    if "fraction_median" in paired:  # side by side with the bandwidth measured around each run
        lo, hi = paired["fraction_range"]
        value = paired["fraction_median"]
        detail = (f"{value:.1%} (median of {len(paired['rounds'])} rounds, {lo:.1%}-{hi:.1%}, each against the copy "
                  f"bandwidth measured around it; {x['fraction']:.1%} against the run's best copy bandwidth)")
    else:
        value = x and x["fraction"]
        detail = "n/a" if x is None else f"{x['fraction']:.1%} ({x['step_ms']:.2f} ms/step vs {roof['min_step_ms']:.2f} ms)"
    out.append({"name": f"mmzoo-xla batch-1 decode >= {frac:.0%} of the roofline", "value": value, "threshold": frac,
                "pass": None if value is None else value >= frac, "detail": detail})
    hf = row("transformers", 1)
    # batch 1: the decode speed (1 / ITL p50) the issue names, and the output tok/s of the whole
    # requests (prefill included), each the median of the rounds' side-by-side ratios; batch 8:
    # output tok/s against transformers' batch-1 figure
    checks = ((1, "batch1_vs_transformers", "decode_tok_s", "decode tok/s (1 / ITL p50)"),
              (1, "batch1_vs_transformers", "output_throughput", "output tok/s (prefill included)"),
              (8, "batch8_vs_transformers", "output_throughput", "output tok/s"))
    for batch, key, field, what in checks:
        want, mine = float(t[key]), row("mmzoo-xla", batch)
        ratio = mine[field] / hf[field] if mine and hf else None
        detail = "n/a" if ratio is None else f"{ratio:.2f}x ({mine[field]:.1f} vs {hf[field]:.1f} tok/s)"
        if batch == 1 and f"{field}_vs_transformers_median" in paired:
            ratio = paired[f"{field}_vs_transformers_median"]
            lo, hi = paired[f"{field}_vs_transformers_range"]
            detail = (f"{ratio:.2f}x (median of {len(paired['rounds'])} rounds, {lo:.2f}-{hi:.2f}x; all rounds "
                      f"together {mine[field]:.1f} vs {hf[field]:.1f} tok/s)")
        out.append({"name": f"mmzoo-xla batch-{batch} {what} >= {want:g}x transformers' (batch 1)",
                    "value": ratio, "threshold": want, "pass": None if ratio is None else ratio >= want,
                    "detail": detail})
    g = metrics.get("mmzoo-xla", {}).get("graphs_compiled_after_warmup")
    limit = int(t.max_graphs_after_warmup)
    n = metrics.get("mmzoo-xla", {}).get("completed")
    out.append({"name": f"mmzoo-xla graphs compiled after warmup <= {limit} over the {n}-request workload",
                "value": g, "threshold": limit, "pass": None if g is None else g <= limit,
                "detail": "n/a" if g is None else str(g)})
    return out


main = hydra_main(run, "bench")


if __name__ == "__main__":
    main()
