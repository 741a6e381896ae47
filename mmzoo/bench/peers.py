"""A stronger peer: transformers with a static KV cache and ``torch.compile``, beside its eager
``generate()`` and mmzoo's XLA executor with each attention backend, on the same checkpoint and
the same text-only prompts.

transformers documents the compiled route for fast generation: ``generate(...,
cache_implementation="static")`` with the model's ``forward`` compiled by ``torch.compile``
(inductor; on CPU, C++ kernels). It gets its own model instance (a compiled forward must not
see a dynamic cache), is compiled in an untimed first call at each batch size, then timed.

Every system runs each batch size once untimed (compiling), then ``repeats`` timed rounds go
round all the systems, in a new (seeded) order each round (so the machine's drift over the run
falls on each alike, and no system always follows the same one); the
figures are the medians: prefill (time to the first token of a batch), decode tok/s (batch / the median gap
between tokens), and the ratios to the compiled peer. A peer that cannot run says why.
"""

from __future__ import annotations

import statistics
import time
import traceback

import numpy as np
from omegaconf import DictConfig

from mmzoo.bench.workload import say


def _clock(t0_box: list):
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):  # generate() calls put() once with the prompt, then once per new token
        def __init__(self):
            self.times, self.prompt_seen = [], False

        def put(self, value):
            if self.prompt_seen:
                self.times.append(time.perf_counter() - t0_box[0])
            self.prompt_seen = True

        def end(self):
            pass

    return Clock()


class HFPeer:
    """transformers' ``generate()`` on the family's class, eager or compiled (static cache)."""

    def __init__(self, checkpoint, hf_class: str, dtype: str, compiled: bool):
        import torch
        import transformers

        self.model = getattr(transformers, hf_class).from_pretrained(
            str(checkpoint), dtype=getattr(torch, dtype), local_files_only=True).eval()
        self.model.generation_config.eos_token_id = None
        self.compiled = compiled
        if compiled:
            self.model.forward = torch.compile(self.model.forward, dynamic=False)

    def run(self, ids: np.ndarray, new: int) -> list[float]:
        """One batch of prompts ``ids [b, s]``: the time of each new token after the call."""
        import torch

        x = torch.as_tensor(ids)
        kw = {"cache_implementation": "static"} if self.compiled else {}
        box = [0.0]
        clock = _clock(box)
        box[0] = time.perf_counter()
        with torch.no_grad():
            self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                                min_new_tokens=new, do_sample=False, streamer=clock, pad_token_id=0, **kw)
        return clock.times


class MmzooPeer:
    """mmzoo's XLA executor with one attention backend, compiling the graphs these prompts need: a
    batch's prompts are packed into one prefill step (``max_prefill_tokens`` holds them all, as
    vLLM's ``max_num_batched_tokens`` would), with a bucket per batch size."""

    def __init__(self, checkpoint, family: str, dtype: str, attention: str, batches: list[int], max_len: int,
                 prompt_len: int):
        import mmzoo

        self.engine = mmzoo.load(checkpoint, model=family, executor="xla", attention=attention, dtype=dtype,
                                 towers=False, max_batch=max(batches), max_model_len=max_len,
                                 max_prefill_tokens=prompt_len * max(batches),
                                 buckets={"prefill": sorted({prompt_len * b for b in batches})}, warmup="needed",
                                 compile={"on_recompile": "error"}, progress=False)

    def run(self, ids: np.ndarray, new: int) -> list[float]:
        results = self.engine.generate([{"prompt_token_ids": [int(t) for t in row], "max_new_tokens": new,
                                         "ignore_eos": True} for row in ids])
        errors = [r.error for r in results if r.error]
        if errors:
            raise RuntimeError(errors[0])
        # the batch's clock: the k-th token of the batch comes when its last request's k-th does
        return [max(r.token_times_s[k] for r in results) for k in range(new)]


def run(cfg: DictConfig, checkpoint, hf_class: str) -> list[dict]:
    """A row per (system, batch): prefill ms, decode tok/s, the ratios to the compiled peer."""
    pc = cfg.peers
    new, plen, repeats = int(pc.max_new_tokens), int(pc.prompt_len), int(pc.repeats)
    rng = np.random.default_rng(int(cfg.workload.seed))
    batches = [int(b) for b in pc.batch_sizes]
    prompts = {b: rng.integers(3, 300, size=(b, plen)) for b in batches}
    max_len = int(2 ** np.ceil(np.log2(plen + new + 1)))
    makers = {"transformers": lambda: HFPeer(checkpoint, hf_class, cfg.dtype, compiled=False),
              "transformers-compiled": lambda: HFPeer(checkpoint, hf_class, cfg.dtype, compiled=True)}
    for attn in pc.attention:
        makers[f"mmzoo-xla ({attn})"] = (lambda a=attn: MmzooPeer(checkpoint, str(cfg.family), cfg.dtype, a,
                                                                  batches, max_len, plen))
    # every system is built and compiled first; then the timed runs go round the systems in turn
    # (round r: every system, every batch size), so a drift of the machine's speed over the minutes
    # of the run falls on all of them alike
    peers, errors, first = {}, {}, {}
    for system, make in makers.items():
        say(f"peers: {system}")
        try:
            t0 = time.perf_counter()
            peers[system] = make()
            setup_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - the peer cannot run this family: say so, with the error
            errors.update({(system, b): _short(e) for b in batches})
            continue
        for b in batches:
            try:
                t0 = time.perf_counter()
                peers[system].run(prompts[b], new)  # untimed: compiles (torch.compile / XLA) at this batch
                first[system, b] = time.perf_counter() - t0 + (setup_s if b == batches[0] else 0)
            except Exception as e:  # noqa: BLE001
                errors[system, b] = _short(e)
    runs = {key: [] for key in first if key not in errors}
    systems = list(dict.fromkeys(system for system, _ in runs))
    shuffle = np.random.default_rng(0)
    for r in range(repeats):
        say(f"peers: timed round {r + 1}/{repeats}")
        # the systems in a new order each round (seeded), so none always runs right after the same
        # one: a system's worker threads can still be spinning when the next one starts
        order = [systems[i] for i in shuffle.permutation(len(systems))]
        for system, b in [(system, b) for system in order for b in batches]:
            if (system, b) not in runs:
                continue
            try:
                runs[system, b].append(peers[system].run(prompts[b], new))
            except Exception as e:  # noqa: BLE001
                errors[system, b] = _short(e)
                del runs[system, b]
    rows = []
    for system in makers:
        for b in batches:
            if (system, b) in errors:
                rows.append({"system": system, "batch": b, "error": errors[system, b]})
                continue
            times = runs[system, b]
            prefill = statistics.median(t[0] for t in times) * 1e3
            itl = statistics.median(g for t in times for g in np.diff(t)) * 1e3
            rows.append({"system": system, "batch": b, "prefill_ms": prefill, "itl_ms": itl,
                         "decode_tok_s": b / itl * 1e3, "first_call_s": first[system, b]})
    del peers
    for r in rows:
        ref = next((x for x in rows if x["system"] == "transformers-compiled" and x["batch"] == r["batch"]
                    and "error" not in x), None)
        if ref and "error" not in r:
            r["decode_vs_compiled"] = r["decode_tok_s"] / ref["decode_tok_s"]
            r["prefill_vs_compiled"] = ref["prefill_ms"] / r["prefill_ms"]
    return rows


def _short(e: Exception) -> str:
    line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    return line[:300] + (f" ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})" if frame else "")


def print_rows(rows: list[dict], prompt_len: int, new: int) -> None:
    if not rows:
        return
    print(f"Peers (text-only: {prompt_len}-token prompts, {new} new tokens; medians; ratios: the compiled peer = 1):")
    print(f"  {'system':<24}{'batch':>6}{'prefill ms':>12}{'decode tok/s':>14}{'decode x':>10}{'prefill x':>11}"
          f"{'first call s':>14}")
    for r in rows:
        if "error" in r:
            print(f"  {r['system']:<24}{r['batch']:>6}  cannot run: {r['error']}")
            continue
        print(f"  {r['system']:<24}{r['batch']:>6}{r['prefill_ms']:>12.1f}{r['decode_tok_s']:>14.1f}"
              f"{r.get('decode_vs_compiled', float('nan')):>10.2f}{r.get('prefill_vs_compiled', float('nan')):>11.2f}"
              f"{r['first_call_s']:>14.1f}")
