"""Static INT8 against fp32 (and other quantized copies) of one decoder graph of an engine: agreement and speed.

Each step in its own process (its peak RSS its own): calibrate the fp32 graph on the calibration split, quantize it
to static int8 with the default exclusions (and any ``--extra`` variants), then score every graph against the fp32
one on held-out prompts (teacher-forced top-1 agreement, max |Δlogits|, relative L2 at prefill and at an 8-token
verify step) and time one q=1 decode step. Writes results/quant-<engine>-<role>.json; quantized graphs go to --work.

    python -m benchmarks.quant_report --engine engines/qwen2.5-coder-1.5b --role draft \\
        --extra int8-dynamic=engines/qwen2.5-coder-1.5b-int8draft/draft.onnx
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.evalsets import RESULTS, child_env


def _child(step: str, a: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.quant_report", "--child", step, json.dumps(a)],
                          capture_output=True, text=True, env=child_env())
    if proc.returncode != 0:
        raise SystemExit(f"{step} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child(step: str, a: dict) -> dict:
    import numpy as np

    from dspark_runtime.engine_dir.manifest import load_manifest
    from dspark_runtime.engine_dir.tokenizer import Tokenizer

    eng = Path(a["engine"])
    m = load_manifest(eng, verify=False)
    g = m.graphs[a["role"]]
    tok = Tokenizer(eng / m.tokenizer["dir"])
    t0 = time.perf_counter()
    out = {}
    if step == "calibrate":
        from dspark_export.precision.activation_ranges import calibrate_graph, calibration_token_ids

        ids = calibration_token_ids(tok, a["prompts"])
        tab = calibrate_graph(eng / g.model_file, g.spec, ids, log=lambda *x: None,
                              prompts_note=f"calibration split, first {len(ids)}")
        tab.save(Path(a["table"]))
        out = tab.summary()
    elif step == "quantize":
        from dspark_export.precision.qdq import quantize_qdq
        from dspark_export.precision.activation_ranges import CalibrationTable

        rep = quantize_qdq(eng / g.model_file, Path(a["dst"]), CalibrationTable.load(Path(a["table"])), "int8",
                            exclude=a["exclude"], log=lambda *x: None)
        out = {k: rep[k] for k in ("quantized", "excluded", "weight_bytes_out", "lm_head_quantized")}
    elif step == "score":
        from dspark_export.fit.compare import eval_prompts
        from dspark_export.precision.quantize import logit_agreement
        from dspark_runtime.backends.ort import OrtDecoder

        prompts = eval_prompts({"humaneval": 4, "mbpp": 2, "gsm8k": 2})
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]))[:200] for _, _, p in prompts]
        ref = OrtDecoder(eng / g.model_file, g.spec)  # activated in turn: one graph in memory at a time
        cand = OrtDecoder(Path(a["graph"]), g.spec) if a["graph"] != "fp32" else ref
        out = logit_agreement(ref, cand, ids, verify_len=8) if cand is not ref else {}
        x = ids[0]
        n = len(x)
        o = cand.step(np.asarray([x]), np.arange(n)[None], np.tril(np.ones((n, n), bool))[None, None],
                      cand.empty_kv(1))
        ts = []
        for _ in range(9):
            s = time.perf_counter()
            cand.step(np.asarray([[x[-1]]]), np.asarray([[n]]), np.ones((1, 1, 1, n + 1), bool), o.kv)
            ts.append(time.perf_counter() - s)
        out["q1_step_ms"] = float(np.median(ts[1:]) * 1e3)
        out["q1_context"] = n
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", help="engine directory (required)")
    ap.add_argument("--role", default="draft", choices=["target", "draft"])
    ap.add_argument("--prompts", type=int, default=16, help="calibration-split prompts")
    ap.add_argument("--work", default="/tmp/dspark-quant-report", help="where the quantized graphs go")
    ap.add_argument("--extra", action="append", default=[], help="NAME=graph.onnx: another graph to score")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=pattern,pattern: an extra int8 variant with these exclusions ('' = none)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], json.loads(a.child[1]))))
        return 0
    if not a.engine:
        ap.error("--engine is required")
    from dspark_export.precision.qdq import DEFAULT_EXCLUDE

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    base = {"engine": a.engine, "role": a.role}
    res = {"engine": a.engine, "role": a.role, "steps": {}}
    table = str(work / f"calib-{a.role}.json")
    print("calibrating ...", flush=True)
    res["steps"]["calibrate"] = _child("calibrate", {**base, "prompts": a.prompts, "table": table})
    graphs = {"fp32": "fp32"}
    variants = {"int8": list(DEFAULT_EXCLUDE)}
    for v in a.variant:
        name, _, pats = v.partition("=")
        variants[name] = [p for p in pats.split(",") if p]
    for name, excl in variants.items():
        print(f"quantizing {name} (exclude {excl}) ...", flush=True)
        dst = str(work / f"{a.role}-{name}.onnx")
        res["steps"][f"quantize {name}"] = _child("quantize", {**base, "table": table, "dst": dst, "exclude": excl})
        graphs[name] = dst
    for e in a.extra:
        name, _, path = e.partition("=")
        graphs[name] = path
    res["graphs"] = {}
    for name, path in graphs.items():
        print(f"scoring {name} ...", flush=True)
        res["graphs"][name] = _child("score", {**base, "graph": path})
    out = Path(a.out or RESULTS / f"quant-{Path(a.engine).name}-{a.role}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"{'graph':14} {'top-1 prefill':>13} {'top-1 verify':>12} {'max|dl| pre':>11} {'relL2 pre':>9} "
          f"{'relL2 ver':>9} {'q=1 ms':>7} {'peak GiB':>8}")
    for name, r in res["graphs"].items():
        p, v = r.get("prefill"), r.get("verify")
        if p:
            print(f"{name:14} {p['top1_agreement']:13.1%} {v['top1_agreement']:12.1%} {p['max_abs_logit_diff']:11.2f} "
                  f"{p['rel_l2']:9.4f} {v['rel_l2']:9.4f} {r['q1_step_ms']:7.1f} {r['peak_rss_gb']:8.2f}")
        else:
            print(f"{name:14} {'(reference)':>13} {'':12} {'':11} {'':9} {'':9} {r['q1_step_ms']:7.1f} "
                  f"{r['peak_rss_gb']:8.2f}")
    for k, s in res["steps"].items():
        print(f"{k}: {s['seconds']:.0f} s, peak RSS {s['peak_rss_gb']:.2f} GiB")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
