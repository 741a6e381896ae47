"""The subprocess of tests/test_sharding.py: every sharded engine, under torch_xla SPMD.

SPMD is process-wide and must be switched on before the first XLA tensor exists, with
``CPU_NUM_DEVICES`` set before torch_xla starts, so the sharded engines cannot share the pytest
process. Run as ``python tests/_spmd_worker.py CASES.json RESULT.json`` with ``PJRT_DEVICE=CPU
CPU_NUM_DEVICES=4``. For each case it computes the single-device reference with the eager executor
(plain CPU tensors, so SPMD does not touch it; the XLA executor matches it token for token, see
test_executor.py), loads the sharded XLA engine (compile guard ``ignore``: the counts are recorded and asserted by
the tests), runs the requests, and records the tokens, the compile counts and the sharding of every parameter. A failing case records
its traceback and the others still run.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback


def main(cases_path: str, out_path: str) -> None:
    t_start = time.perf_counter()
    import torch_xla
    import torch_xla.runtime as xr

    import mmzoo
    from mmzoo.layers import Attention

    cases = json.loads(open(cases_path).read())
    out = {"devices": xr.global_runtime_device_count(), "cases": {}}
    refs: dict[str, list] = {}
    for case in cases:
        rec: dict = {}
        t0 = time.perf_counter()
        try:
            reqs = case["requests"]
            key = json.dumps([case["checkpoint"], reqs, case["executor"]["max_model_len"]])
            if key not in refs:
                ref = mmzoo.load(case["checkpoint"], executor="eager", attention="sdpa",
                                 max_model_len=case["executor"]["max_model_len"], max_batch=2, progress=False)
                refs[key] = [r.token_ids for r in ref.generate(reqs)]
            rec["reference"] = refs[key]
            options = dict(case["executor"])
            engine = mmzoo.load(case["checkpoint"], executor="xla", attention=case["attention"], mesh=case["mesh"],
                                warmup="needed", progress=False,
                                compile={"on_recompile": "ignore", **options.pop("compile", {})}, **options)
            exe = engine.executor
            engine.warm(reqs)  # the graphs these requests hit, sharded; the run must compile nothing more
            rec["load_s"] = time.perf_counter() - t0
            rec["describe"] = exe.describe()
            before = exe.compiled_graphs()
            results = engine.generate(reqs)
            rec["errors"] = [r.error for r in results if r.error]
            rec["tokens"] = [r.token_ids for r in results]
            rec["graphs_after_warmup"] = [r.graphs_compiled_after_warmup for r in results]
            rec["compiled_during_run"] = exe.compiled_graphs() - before
            spec = torch_xla._XLAC._get_xla_sharding_spec
            rec["specs"] = {name: spec(p) for name, p in engine.model.named_parameters()}
            rec["cache_spec"] = spec(exe.cache.k[0])
            rec["partitioned_backends"] = sorted({type(m.attn_fn).__name__ for m in engine.model.modules()
                                                  if isinstance(m, Attention) and getattr(m.attn_fn, "_spmd", None)})
            del engine, exe, results
        except Exception:
            rec["exception"] = traceback.format_exc()
        rec["seconds"] = time.perf_counter() - t0
        out["cases"][case["name"]] = rec
        gc.collect()
    out["seconds"] = time.perf_counter() - t_start
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
