"""The real-size stage: Qwen2-VL at the published sizes (random weights), a fresh process per row.

The tiny checkpoints of the other stages say nothing about what a user meets with a real model:
the load time of gigabytes of weights, the XLA compile time of 28 layers at width 1536, the
memory, and whether bf16 at real width stays close. For each preset
(:data:`mmzoo.fixtures.real_size.PRESETS`: the checkpoint is built once under the mmzoo cache by
:func:`~mmzoo.fixtures.real_size.real_size_qwen2_vl`, stored in ``checkpoint_dtype``), each run
dtype and each system, one fresh process (:mod:`mmzoo.bench._real_size_worker`) loads the model
and measures: load s (the libraries imported before), XLA compile s (``mmzoo-xla``:
``Engine.warm``), the first answer (from the start of the load to the end of a first, cold image
request: what a mapped checkpoint defers to its first use counts here), the time to the
first token of one image request (warm), decode tok/s of that request (batch 1) and of ``batch`` text
requests at once, and its own peak RSS. Then, per preset, one more process per entry of
``logits.runs`` saves the image request's prompt logits, and the parent compares them:
transformers bf16 against transformers fp32 (what bf16 costs transformers itself) and each mmzoo
bf16 run against transformers bf16 (and fp32).

Before each process, the memory it needs is estimated (the weights in the run dtype, plus
``memory.margin`` and ``memory.overhead_gb``) against ``MemAvailable``; a row that does not fit
says ``does not fit: needs N GB`` and nothing runs. A process that runs is watched: past its
``timeout_s``, or once its anonymous memory passes ``MemAvailable`` at its launch less
``memory.reserve_gb`` (before the kernel's OOM killer picks a process, perhaps another user's),
it is killed and its row says so. A failed row never stops the stage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from mmzoo.bench.workload import say
from mmzoo.errors import MmzooError

SYSTEMS = ("transformers", "mmzoo-xla", "mmzoo-xla-layers", "mmzoo-eager")  # -layers: executor.compile.layer_graphs=true
BYTES = {"float32": 4, "bfloat16": 2}
GB = 1e9


# ---------------------------------------------------------------- memory

def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def memory_available() -> int:
    """Bytes the kernel says a new process can take without swapping (``MemAvailable``)."""
    return _meminfo()["MemAvailable"]


def memory_plan(params: int, dtype: str, memory: DictConfig | dict, available: int | None = None) -> dict:
    """Whether a run of ``params`` parameters in ``dtype`` fits: ``{weights_gb, needs_gb,
    available_gb, fits, note}``; ``needs`` is the weights in ``dtype`` times ``1 + margin``, plus
    ``overhead_gb`` (the libraries, activations, the KV cache)."""
    if dtype not in BYTES:
        raise MmzooError(f"real_size.dtypes: {dtype!r} is not one of {sorted(BYTES)}")
    weights = params * BYTES[dtype]
    needs = weights * (1 + float(memory["margin"])) + float(memory["overhead_gb"]) * GB
    available = memory_available() if available is None else available
    fits = needs <= available
    count = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.1f} M"
    margin, overhead = 1 + float(memory["margin"]), float(memory["overhead_gb"])
    note = "" if fits else (f"does not fit: needs {needs / GB:.1f} GB ({count} params x {BYTES[dtype]} B x "
                            f"{margin:.2f} + {overhead:g} GB), {available / GB:.1f} GB available")
    return {"weights_gb": weights / GB, "needs_gb": needs / GB, "available_gb": available / GB, "fits": fits,
            "note": note}


def _anon_bytes(pid: int) -> int | None:
    """A process's anonymous resident memory (RssAnon + RssShmem): what the kernel cannot drop."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return sum(int(fields.get(k, "0 kB").split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))


# ---------------------------------------------------------------- one fresh process

def launch(spec: dict, workdir: Path, name: str, *, timeout_s: float, reserve_gb: float) -> dict:
    """Run the worker on ``spec`` in a fresh process; its result dict, or ``{"error": ...}`` when it
    failed, was killed by memory or ran past ``timeout_s``. Adds ``wall_s`` and
    ``peak_anon_gb`` (its anonymous memory, sampled every 0.2 s)."""
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    limit = memory_available() - reserve_gb * GB
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mmzoo.bench._real_size_worker", str(spec_path),
                                 str(out_path)], cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    killed, peak = None, 0
    while proc.poll() is None:
        anon = _anon_bytes(proc.pid) or 0
        peak = max(peak, anon)
        if anon > limit:
            killed = (f"killed: its memory reached {anon / GB:.1f} GB, past the watchdog's {limit / GB:.1f} GB "
                      f"(MemAvailable at launch less memory.reserve_gb={reserve_gb:g})")
        elif time.perf_counter() - t0 > timeout_s:
            killed = f"killed: still running after timeout_s={timeout_s:g}"
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: it and nothing else
            proc.wait()
            break
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    result = json.loads(out_path.read_text()) if out_path.is_file() else {}
    if killed:
        result = {"error": killed}
    elif proc.returncode and "error" not in result:
        if proc.returncode == -signal.SIGKILL:
            how = "killed by SIGKILL (the kernel's OOM killer?)"
        elif proc.returncode < 0:
            how = f"killed by signal {-proc.returncode}"
        else:
            tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:]
            how = f"exited with status {proc.returncode}: {tail[0][:300] if tail else '?'}"
        result = {"error": how}
    result.update(wall_s=wall, peak_anon_gb=peak / GB)
    if "error" in result:  # the process's last words (its folder goes when the stage ends)
        result["log_tail"] = log_path.read_text(errors="replace").splitlines()[-20:]
    return result


# ---------------------------------------------------------------- the checkpoint and the prompts

def _params(checkpoint: Path) -> int:
    """Parameters stored in a checkpoint's safetensors files (a tied head is stored once), from their headers."""
    from safetensors import safe_open

    n = 0
    for f in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as h:
            n += sum(int(np.prod(h.get_slice(k).get_shape())) for k in h.keys())
    return n


def _prompts(rs: DictConfig, checkpoint: Path, image_path: Path) -> dict:
    """The image request's text (``prompt_text``) and its whole prompt's token count (chat
    template and image tokens included), and the batch's texts (``batch_prompt_tokens`` each, cut
    from the tokenizer's own corpus)."""
    from transformers import AutoProcessor
    from transformers.image_utils import load_image

    from mmzoo.bench.workload import PromptText

    processor = AutoProcessor.from_pretrained(str(checkpoint), local_files_only=True)
    text = str(rs.prompt_text)
    content = [{"type": "image"}, {"type": "text", "text": text}]
    rendered = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    image = load_image(str(image_path))  # as a transformers user reads the file (mmzoo reads a path the same way)
    n = int(processor(text=[rendered], images=[image], return_tensors="np")["input_ids"].shape[1])
    source, rng = PromptText(processor.tokenizer, int(rs.seed)), np.random.default_rng(int(rs.seed))
    batch = [source(int(rs.batch_prompt_tokens), rng) for _ in range(int(rs.batch))]
    return {"prompt": text, "prompt_tokens": n, "batch_prompts": batch}


# ---------------------------------------------------------------- the logits

def compare_logits(run: np.ndarray, ref: np.ndarray) -> dict:
    """``run`` against ``ref`` (``[n, vocab]`` float32, the prompt's positions): the max abs
    difference and top-1 agreement at the last position (the first generated token's logits) and
    over every position, and the reference's median top-1/top-2 gap (how close the calls are)."""
    if run.shape != ref.shape:
        raise MmzooError(f"logits of shape {run.shape} and {ref.shape}: not the same prompt")
    diff = np.abs(run - ref).max(axis=1)  # [n]
    top = run.argmax(axis=1) == ref.argmax(axis=1)  # [n]
    two = np.sort(np.partition(ref, -2, axis=1)[:, -2:], axis=1)  # [n, 2]: second, first
    return {"last_max_abs_diff": float(diff[-1]), "last_top1_same": bool(top[-1]),
            "all_max_abs_diff": float(diff.max()), "all_top1_agreement": float(top.mean()), "positions": len(top),
            "ref_top_gap_median": float(np.median(two[:, 1] - two[:, 0])), "ref_logit_std": float(ref.std())}


def logits_stage(preset: str, rs: DictConfig, base: dict, params: int, workdir: Path) -> dict:
    """The ``logits.runs`` of one preset, each a fresh process, and their comparisons."""
    runs, arrays = {}, {}
    for entry in rs.logits.runs:
        system, _, dtype = str(entry).partition(":")
        key = f"{system} {dtype}"
        plan = memory_plan(params, dtype, rs.memory)
        if not plan["fits"]:
            runs[key] = {"error": plan["note"], **plan}
            say(f"real size {preset}: logits {key}: {plan['note']}")
            continue
        say(f"real size {preset}: logits {key}")
        path = workdir / f"{preset}-{system}-{dtype}.logits.npy"
        runs[key] = launch({**base, "mode": "logits", "system": system, "dtype": dtype, "logits_path": str(path)},
                           workdir, f"{preset}-logits-{system}-{dtype}", timeout_s=float(rs.logits.timeout_s),
                           reserve_gb=float(rs.memory.reserve_gb))
        if "error" not in runs[key]:
            arrays[key] = path
    ids = {k: r.get("prompt_ids") for k, r in runs.items() if "error" not in r}
    if len({json.dumps(v) for v in ids.values()}) > 1:
        raise MmzooError(f"real size {preset}: the systems tokenized the image request differently "
                         f"({ {k: len(v) for k, v in ids.items()} } tokens): the logits are not comparable")
    pairs = [(a, b) for a in arrays for b in ("transformers bfloat16", "transformers float32")
             if b in arrays and a != b and a.endswith("bfloat16")]
    comparisons = []
    for a, b in pairs:
        comparisons.append({"run": a, "reference": b, **compare_logits(np.load(arrays[a], mmap_mode="r"),
                                                                        np.load(arrays[b], mmap_mode="r"))})
    for path in arrays.values():
        path.unlink(missing_ok=True)  # a real-size [n, vocab] float32 array is ~130 MB
    for r in runs.values():
        r.pop("prompt_ids", None)
        r.pop("logits_path", None)
    return {"runs": runs, "comparisons": comparisons}


# ---------------------------------------------------------------- the stage

def check_config(rs: DictConfig) -> None:
    """Refuse unknown presets, dtypes and systems before anything is built."""
    from mmzoo.fixtures.real_size import PRESETS

    for p in rs.presets:
        if p not in PRESETS:
            raise MmzooError(f"real_size.presets: unknown preset {p!r}; choose from {sorted(PRESETS)}")
    for d in rs.dtypes:
        if d not in BYTES:
            raise MmzooError(f"real_size.dtypes: {d!r} is not one of {sorted(BYTES)}")
    for s in rs.systems:
        if s not in SYSTEMS:
            raise MmzooError(f"real_size.systems: unknown system {s!r}; choose from {list(SYSTEMS)}")
    for entry in rs.logits.runs:
        system, _, dtype = str(entry).partition(":")
        if system not in SYSTEMS or dtype not in BYTES:
            raise MmzooError(f"real_size.logits.runs: {entry!r} is not SYSTEM:DTYPE with a system of {list(SYSTEMS)} "
                             f"and a dtype of {sorted(BYTES)}")


def run(cfg: DictConfig, on_progress=None) -> dict:
    """Every (preset, dtype, system) row and every preset's logits comparison, printed as they
    come; ``on_progress(result)`` is called with the result so far after each row (the caller
    writes it, so a long run interrupted keeps its finished rows)."""
    from mmzoo.fixtures import make_image
    from mmzoo.fixtures.real_size import checkpoint_bytes, real_size_qwen2_vl

    rs = cfg.real_size
    check_config(rs)
    result: dict = {"rows": [], "logits": {}, "presets": {}}
    print_header()
    with tempfile.TemporaryDirectory(prefix="mmzoo-real-size-") as tmp:
        workdir = Path(tmp)
        image_path = workdir / "image.png"
        w, h = (int(v) for v in rs.image)
        make_image(w, h, seed=int(rs.seed)).save(image_path)
        for preset in rs.presets:
            try:
                checkpoint = real_size_qwen2_vl(preset, dtype=str(rs.checkpoint_dtype), seed=int(rs.seed))
                params = _params(checkpoint)
                prompts = _prompts(rs, checkpoint, image_path)
            except Exception as e:  # noqa: BLE001 - a preset that cannot be built: its rows say why
                err = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                say(f"real size {preset}: {err}")
                for dtype in rs.dtypes:
                    for system in rs.systems:
                        row = {"preset": preset, "dtype": dtype, "system": system, "error": err}
                        result["rows"].append(row)
                        print_row(row, result["rows"])
                continue
            result["presets"][preset] = {"checkpoint": str(checkpoint), "params": params,
                                         "checkpoint_bytes": checkpoint_bytes(checkpoint),
                                         "prompt_tokens": prompts["prompt_tokens"], "image": [w, h]}
            base = {"checkpoint": str(checkpoint), "image": str(image_path), **prompts,
                    "max_model_len": int(rs.max_model_len), "batch": int(rs.batch),
                    "max_new_tokens": int(rs.max_new_tokens), "threads": cfg.get("threads")}
            for dtype in rs.dtypes:
                for system in rs.systems:
                    row = {"preset": preset, "dtype": dtype, "system": system}
                    plan = memory_plan(params, dtype, rs.memory)
                    row.update({k: plan[k] for k in ("weights_gb", "needs_gb", "available_gb")})
                    if not plan["fits"]:
                        row["does_not_fit"] = plan["note"]
                    else:
                        say(f"real size {preset} {dtype} {system}: a fresh process")
                        row.update(launch({**base, "mode": "bench", "system": system, "dtype": dtype}, workdir,
                                          f"{preset}-{dtype}-{system}", timeout_s=float(rs.timeout_s),
                                          reserve_gb=float(rs.memory.reserve_gb)))
                    result["rows"].append(row)
                    print_row(row, result["rows"])
                    if on_progress:
                        on_progress(result)
            if rs.logits.runs:
                try:
                    result["logits"][preset] = logits_stage(preset, rs, base, params, workdir)
                except MmzooError as e:
                    result["logits"][preset] = {"error": str(e)}
                print_logits(preset, result["logits"][preset], prompts["prompt_tokens"])
                if on_progress:
                    on_progress(result)
    return result


# ---------------------------------------------------------------- printing

_COLUMNS = [("preset", "{}", 13), ("dtype", "{}", 9), ("system", "{}", 12), ("weights GB", "{:.2f}", 10),
            ("load s", "{:.1f}", 7), ("compile s", "{:.1f}", 9), ("first answer s", "{:.1f}", 14), ("TTFT ms", "{:.0f}", 8),
            ("decode b1 tok/s", "{:.2f}", 15), ("decode b8 tok/s", "{:.2f}", 15), ("peak RSS GB", "{:.2f}", 11)]
_KEYS = ["preset", "dtype", "system", "weights_gb", "load_s", "compile_s", "first_answer_s", "ttft_ms", "decode_b1_tok_s",
         "decode_batch_tok_s", "peak_rss_gb"]


def print_header() -> None:
    print("Real-size Qwen2-VL (random weights; a fresh process per row; TTFT and decode b1: one image request, "
          "decode b8: text requests at once, EOS ignored):")
    print("| " + " | ".join(f"{name:>{w}}" for name, _, w in _COLUMNS) + " | notes |")
    print("|" + "|".join("-" * (w + 2) for _, _, w in _COLUMNS) + "|-------|", flush=True)


def _agreement(row: dict, rows: list[dict]) -> str | None:
    """How many of the image request's tokens match transformers' in the same dtype (the common prefix)."""
    ref = next((r for r in rows if r["preset"] == row["preset"] and r["dtype"] == row["dtype"]
                and r["system"] == "transformers" and "tokens" in r), None)
    if ref is None or row["system"] == "transformers" or "tokens" not in row:
        return None
    same = next((i for i, (a, b) in enumerate(zip(row["tokens"], ref["tokens"])) if a != b),
                min(len(row["tokens"]), len(ref["tokens"])))
    return f"first {same}/{len(ref['tokens'])} tokens as transformers'"


def print_row(row: dict, rows: list[dict]) -> None:
    cells = []
    for (_, fmt, w), key in zip(_COLUMNS, _KEYS):
        v = row.get(key)
        cells.append(f"{'-' if v is None else fmt.format(v):>{w}}")
    notes = row.get("does_not_fit") or (f"error: {row['error']}" if "error" in row else "")
    if not notes:
        parts = [f"prompt {row['prompt_tokens']} tok", f"b{row['batch']} TTFT {row['batch_ttft_ms']:.0f} ms"]
        if "warmup_s" in row:
            parts.append(f"warm {row['warmup_s']:.0f} s ({row['graphs_compiled']} graphs)")
        if row.get("graphs_after_warmup"):
            parts.append(f"{row['graphs_after_warmup']} graphs compiled after warmup")
        agree = _agreement(row, rows)
        if agree:
            parts.append(agree)
        notes = "; ".join(parts)
    print("| " + " | ".join(cells) + f" | {notes} |", flush=True)


def print_logits(preset: str, res: dict, prompt_tokens: int) -> None:
    print(f"Real-size logits agreement, {preset} (the image request's {prompt_tokens} prompt positions; "
          f"last = the first generated token's logits):")
    if "error" in res:
        print(f"  error: {res['error']}")
        return
    for key, r in res["runs"].items():
        if "error" in r:
            print(f"  {key}: {r['error']}")
    if not res["comparisons"]:
        print("  no pair of runs to compare")
        return
    print(f"| {'run':<22} | {'reference':<22} | max abs diff (last) | top-1 same (last) | max abs diff (all) | "
          f"top-1 agreement (all) | ref top-1/top-2 gap (median) |")
    print(f"|{'-' * 24}|{'-' * 24}|{'-' * 21}|{'-' * 19}|{'-' * 20}|{'-' * 23}|{'-' * 31}|")
    for c in res["comparisons"]:
        print(f"| {c['run']:<22} | {c['reference']:<22} | {c['last_max_abs_diff']:>19.4f} | "
              f"{'yes' if c['last_top1_same'] else 'no':>17} | {c['all_max_abs_diff']:>18.4f} | "
              f"{c['all_top1_agreement']:>21.1%} | {c['ref_top_gap_median']:>29.4f} |")
    sys.stdout.flush()
