"""Running one system on a list of requests, and the measurements around the runs.

A system is an mmzoo engine (``mmzoo-xla``, ``mmzoo-eager``: every request at once, continuous
batching), the XLA engine behind ``mmzoo.serve`` with concurrent HTTP clients (``mmzoo-serve``,
:mod:`mmzoo.bench.serving`) or transformers' ``generate()`` (``transformers``: one request at a time, greedy, EOS
off), on the family's own transformers class and processor. Each run is a :class:`Run`, the
per-request times from which :meth:`Run.metrics` derives vLLM's serving figures. Around the runs:
the host's copy and read bandwidth, the bytes of weights a decode step reads (the roofline), the
batch-1 point in rounds side by side with the bandwidth, and one XLA decode step phase by phase.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from mmzoo.bench.workload import Family, say
from mmzoo.errors import MmzooError

SYSTEMS = ("mmzoo-xla", "mmzoo-eager", "mmzoo-serve", "transformers")


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
    def merge(cls, runs: list[Run]) -> Run:
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


def sweep_row(system: str, batch: int, r: Run) -> dict:
    """The sweeps' figures of one run at one decode batch."""
    m = r.metrics()
    return {"system": system, "batch": batch, "requests": m["completed"], "duration_s": m["duration_s"],
            "output_throughput": m["output_throughput"], "median_tpot_ms": m["median_tpot_ms"],
            "median_itl_ms": m["median_itl_ms"], "decode_tok_s": batch / m["median_itl_ms"] * 1e3,
            "median_ttft_ms": m["median_ttft_ms"], "graphs_compiled": r.graphs_after_warmup}


def agreement(runs: dict[str, Run]) -> dict:
    """How many requests produced the same token ids as mmzoo-eager (the reference path)."""
    ref = "mmzoo-eager" if "mmzoo-eager" in runs else next(iter(runs), None)
    if ref is None:
        return {}
    return {ref: {s: sum(a == b for a, b in zip(r.outputs, runs[ref].outputs)) for s, r in runs.items() if s != ref}}


def build_engine(cfg: DictConfig, checkpoint: Path, kind: str, **overrides):
    """An mmzoo engine of ``cfg.family`` with ``executors.<kind>`` (plus overrides); returns it and its load time."""
    from hydra.utils import instantiate

    import mmzoo

    exe = instantiate(OmegaConf.merge(cfg.executors[kind], overrides))
    t0 = time.perf_counter()
    engine = mmzoo.load(checkpoint, model=str(cfg.family), executor=exe,
                        attention=instantiate(cfg.attention), dtype=cfg.dtype)
    return engine, time.perf_counter() - t0


def run_mmzoo(engine, system: str, reqs: list[dict]) -> Run:
    """The requests through mmzoo at once (continuous batching); counts XLA compiles.

    What ``Engine.generate`` does, in two timed parts: the host preparation of every request
    (tokenizing, media preprocessing) and the executor's schedule. The executor's times count from
    its own start, so they are shifted by the preparation time: every time counts from the run's
    start, as transformers' do (which prepares each request just before it runs).
    """
    from mmzoo.executor.loop import generate
    from mmzoo.types import Request

    exe = engine.executor
    count = getattr(exe, "compiled_graphs", None)
    before = count() if count else None
    t0 = time.perf_counter()
    prepared = [engine.prepare(Request(id=i, **r)) for i, r in enumerate(reqs)]
    offset = time.perf_counter() - t0
    results = generate(exe, prepared, decode_text=engine.decode)
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
    """transformers' ``generate()`` on the family's own class (``Qwen2VLForConditionalGeneration``,
    ``LlavaForConditionalGeneration``, ...), its processor and chat template: one request at a
    time, greedy, EOS disabled so that each request produces exactly its ``max_new_tokens``."""

    def __init__(self, checkpoint: Path, dtype: str, fam: Family):
        import torch
        import transformers
        from transformers import AutoProcessor

        self.family = fam
        self.processor = AutoProcessor.from_pretrained(str(checkpoint), local_files_only=True)
        self.model = getattr(transformers, fam.hf_class).from_pretrained(
            str(checkpoint), dtype=getattr(torch, dtype), local_files_only=True).eval()
        self.model.generation_config.eos_token_id = None
        self.pad = self.processor.tokenizer.pad_token_id

    def inputs(self, req: dict):
        items = req.get(self.family.field, [])
        content = [{"type": self.family.media}] * len(items) + [{"type": "text", "text": req["prompt"]}]
        text = self.processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)
        # all the processor returns goes to generate(): transformers 5's Qwen2-VL needs its mm_token_type_ids
        return self.processor(text=[text], **self.family.processor_media(items, self.processor), return_tensors="pt")

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


def run_system(system: str, reqs: list[dict], engines: dict, hf: Transformers | None) -> Run:
    """``reqs`` through ``system``: the transformers peer, or the mmzoo engine in ``engines``."""
    return hf.run(reqs) if system == "transformers" else run_mmzoo(engines[system], system, reqs)


# ---------------------------------------------------------------- bandwidth and the roofline

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


def model_sizes(engine, dtype: str) -> dict:
    """The parameter counts of the engine's model and the LM bytes a batch-1 decode step reads."""
    lm = engine.model.lm
    return {"lm_params": sum(p.numel() for p in lm.parameters()),
            "all_params": sum(p.numel() for p in engine.model.parameters()),
            "decode_weight_bytes_b1": decode_weight_bytes(lm, dtype, 1)}


def kv_cache_bytes(exe) -> int:
    """Bytes of the KV cache an mmzoo decode step attends over (static shapes: every slot's full row)."""
    c = exe.cache
    return sum(t.numel() * t.element_size() for t in c.k + c.v)


def batch1_rounds(cfg: DictConfig, engines: dict, hf: Transformers | None, reqs: list[dict],
                  lm_info: dict) -> tuple[list[dict], dict]:
    """The batch-1 point, in ``sweep.batch1_rounds`` rounds: each round runs the requests through
    every system in turn and measures the copy bandwidth just before and just after mmzoo-xla's
    run. A shared host's bandwidth and speed drift by tens of percent within minutes, so each
    round compares figures taken side by side: mmzoo-xla's step against the roofline of the
    bandwidth measured around it, and each mmzoo system against transformers in the same round.
    Returns the sweep rows (every round's requests together) and the rounds."""
    runs: dict[str, list[Run]] = {s: [] for s in [*engines, *(["transformers"] if hf is not None else [])]}
    rounds = []
    wbytes = lm_info.get("decode_weight_bytes_b1")
    for k in range(max(1, int(cfg.sweep.batch1_rounds))):
        say(f"sweep batch 1, round {k + 1}: {len(reqs)} requests through {', '.join(runs)}")
        rnd: dict = {}
        for system in runs:
            xla = system == "mmzoo-xla"
            if xla:
                before = copy_bandwidth(cfg.roofline.copy_mb, cfg.roofline.repeats)
            r = run_system(system, reqs, engines, hf)
            if xla:
                after = copy_bandwidth(cfg.roofline.copy_mb, cfg.roofline.repeats)
                rnd["copy_bandwidth_GBps"] = [before / 1e9, after / 1e9]
            runs[system].append(r)
            rnd[system] = sweep_row(system, 1, r)
        x, hf_row = rnd.get("mmzoo-xla"), rnd.get("transformers")
        if x and wbytes:
            bw = sum(rnd["copy_bandwidth_GBps"]) / 2 * 1e9
            rnd["min_step_ms"] = wbytes / bw * 1e3
            rnd["fraction"] = rnd["min_step_ms"] / x["median_tpot_ms"]
        if x and hf_row:
            rnd["vs_transformers"] = {f: x[f] / hf_row[f] for f in ("decode_tok_s", "output_throughput")}
        rounds.append(rnd)
    rows = [sweep_row(system, 1, Run.merge(rs)) for system, rs in runs.items()]
    return rows, _summarize_rounds(rounds, runs)


def _summarize_rounds(rounds: list[dict], runs: dict) -> dict:
    out: dict = {"rounds": rounds}
    fractions = [r["fraction"] for r in rounds if "fraction" in r]
    if fractions:
        out["fraction_median"], out["fraction_range"] = statistics.median(fractions), [min(fractions), max(fractions)]
    if "mmzoo-xla" in runs and "transformers" in runs:
        for name in ("decode_tok_s", "output_throughput"):
            ratios = [r["vs_transformers"][name] for r in rounds]
            out[f"{name}_vs_transformers_median"] = statistics.median(ratios)
            out[f"{name}_vs_transformers_range"] = [min(ratios), max(ratios)]
    return out


def roofline(cfg: DictConfig, bandwidth: list[float], lm_info: dict, sweep_rows: list[dict],
             kv_bytes_b1: int | None, batch1: dict) -> dict:
    """The decode roofline: the LM weight bytes a batch-1 step reads over the best copy bandwidth
    of the run (``bandwidth``: bytes/s measured along it), against each system's batch-1 step."""
    bandwidth = [*bandwidth, copy_bandwidth(cfg.roofline.copy_mb, cfg.roofline.repeats)]
    bandwidth += [x * 1e9 for r in batch1.get("rounds", []) for x in r.get("copy_bandwidth_GBps", [])]
    bw = max(bandwidth)
    read_bw = read_bandwidth(cfg.roofline.copy_mb, cfg.roofline.repeats)
    roof: dict = {"copy_bandwidth_GBps": bw / 1e9, "copy_bandwidth_runs_GBps": [x / 1e9 for x in bandwidth],
                  "read_bandwidth_GBps": read_bw / 1e9}
    if not lm_info:
        return roof
    wbytes = lm_info["decode_weight_bytes_b1"]
    roof.update(weight_bytes=wbytes, min_step_ms=wbytes / bw * 1e3, min_step_ms_at_read_bw=wbytes / read_bw * 1e3,
                best_fraction_at_read_bw=read_bw / bw)
    for row in sweep_rows:
        if row["batch"] == 1:
            step = row["median_tpot_ms"]
            roof[row["system"]] = {"step_ms": step, "fraction": roof["min_step_ms"] / step,
                                   "weights_read_GBps": wbytes / step / 1e6}
    if kv_bytes_b1 is not None:
        roof["mmzoo_kv_cache_bytes_b1"] = kv_bytes_b1
    if batch1 and batch1["rounds"]:
        roof["paired"] = batch1
    return roof


# ---------------------------------------------------------------- one decode step, phase by phase

def decode_breakdown(engine, steps: int) -> dict:
    """Where one XLA decode step's time goes: Python (host arrays, transfers, then lazy tracing or,
    with ``replay_steps``, launching the compiled graph), the sync (graph hashing, cache lookup,
    launch: nothing left to do after a replay) and the wait for the result; torch_xla's timers."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from mmzoo.executor.loop import decode_inputs
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
    cut, sync = exe._step_done, []

    def timed_cut():  # the step's own graph cut, timed apart from the Python before it
        t = time.perf_counter()
        cut()
        sync.append(time.perf_counter() - t)

    exe.decode(decode_inputs(exe.buckets, {0: seq})).tokens.cpu()  # one untimed step
    torch_xla.sync()
    before = {n: timer(n) for n in names}
    trace, wait = [], []
    exe._step_done = timed_cut
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            out = exe.decode(decode_inputs(exe.buckets, {0: seq}))
            t1 = time.perf_counter()
            out.tokens.cpu()
            t2 = time.perf_counter()
            trace.append(t1 - t0 - sync[-1])
            wait.append(t2 - t1)
    finally:
        del exe._step_done
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
