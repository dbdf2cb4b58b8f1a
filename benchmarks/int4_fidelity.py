"""Fidelity of our 4-bit graphs: teacher-forced logits against llama.cpp's own on the same GGUF, and against our
fp32 graph.

Sequences: the first --n evaluation prompts of each --datasets entry (``--split calibration``: the first --n
calibration-split prompts, code-weighted, as the quantizers and the drafter calibrate on) plus --continuation tokens
of the first engine's greedy output, each run as one prefill call; llama.cpp runs them through ``benchmarks/peers/llamacpp_logits.py``
under the llama-cpp peer venv (``benchmarks/peers/install.sh llama-cpp``). An engine given as ``DIR::GRAPH`` runs its
graph ``GRAPH`` instead of ``target`` (``DIR::target_prompt``: the prompt graph, as it computes a prompt). Per
pair: top-1 agreement, mean relative L2 of the logits, max |Δlogit|, mean total variation of the softmax (what sampling sees); per graph the weight bytes a step reads. One graph in memory at a time (logits
kept in --work). Writes --json.

    python -m benchmarks.int4_fidelity --engines engines/qwen2.5-coder-1.5b-int4,engines/qwen2.5-coder-1.5b-int4rtn \\
        --fp32 engines/qwen2.5-coder-1.5b-fp32 --gguf ~/.cache/dspark/gguf/qwen2.5-coder-1.5b-instruct.gguf \\
        --json results/int4-fidelity-qwen2.5-coder-1.5b.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.compare.systems import default_peer_dir
from benchmarks.evalsets import child_env, load_prompts, machine
from dspark_export.graphs.onnx_io import step_weight_bytes
from dspark_runtime.engine_dir.manifest import load_manifest
from dspark_export.drafter.data import calibration_prompts


def graph_logits(engine: Path, seqs: dict, out: Path, threads: int, graph: str = "target") -> dict:
    """Teacher-forced logits of ``engine``'s graph ``graph`` (a decoder of the target's spec) for each sequence, saved
    as ``out/<name>.npy``. Returns {"load_s", "seconds", "peak_rss_gb"}."""
    import resource

    from dspark_runtime.backends.ort import OrtDecoder
    from dspark_runtime.runners.factory import decoder_runner

    m = load_manifest(engine, verify=False)
    g = m.graphs[graph]
    t0 = time.perf_counter()
    dec = OrtDecoder(engine / g.model_file, g.spec, threads=threads, precision=g.precision)
    runner = decoder_runner(dec.activate())  # one full-sequence call, in the graph's own KV layout
    load_s = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    for name, ids in seqs.items():
        runner.reset()
        np.save(out / f"{name}.npy", np.asarray(runner.step(list(ids)), np.float32))
    dec.deactivate()
    return {"load_s": round(load_s, 1), "seconds": round(time.perf_counter() - t0, 1),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def engine_graph(arg: str) -> tuple:
    """``DIR`` or ``DIR::GRAPH`` -> (engine Path, graph key, the name its logits and results go under)."""
    path, _, graph = arg.partition("::")
    e = Path(path)
    return e, graph or "target", e.name + (f"::{graph}" if graph else "")


def common_prefix(seqs: dict) -> int:
    """Length of the token prefix all sequences share (the chat template's system turn)."""
    vals = list(seqs.values())
    p = 0
    while p < min(map(len, vals)) and all(v[p] == vals[0][p] for v in vals):
        p += 1
    return p


def compare(a_dir: Path, b_dir: Path, names, shared: int = 0) -> dict:
    """Agreement of logits in ``a_dir`` with the reference logits in ``b_dir``. Every position of the first
    sequence counts, of the others only those after the ``shared`` prefix (identical tokens give identical
    logits: counting them once per sequence would weigh the chat template's system turn 8 times)."""
    agree = n = 0
    rel, tv, maxd = [], [], 0.0
    for i, name in enumerate(names):
        a, b = np.load(a_dir / f"{name}.npy"), np.load(b_dir / f"{name}.npy")
        if a.shape != b.shape:
            raise SystemExit(f"error: {name}: logits shapes differ {a.shape} vs {b.shape}")
        a, b = (a, b) if i == 0 else (a[shared:], b[shared:])
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += a.shape[0]
        rel.extend((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).tolist())
        maxd = max(maxd, float(np.abs(a - b).max()))
        tv.extend((0.5 * np.abs(softmax(a) - softmax(b)).sum(-1)).reshape(-1).tolist())
    return {"top1_agreement": agree / n, "rel_l2": float(np.mean(rel)), "max_abs_logit_diff": maxd,
            "total_variation": float(np.mean(tv)), "positions": n}


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, float64."""
    e = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def make_sequences(engine: Path, a) -> dict:
    """{name: prompt ids + the engine's greedy target-only continuation}, also saved as ``--work/ids.json``."""
    from dspark_runtime import Engine

    eng = Engine.load(engine, threads=a.threads)
    if a.split == "calibration":
        prompts = {f"calibration-{i + 1}": p for i, p in enumerate(calibration_prompts(a.n))}
    else:
        prompts = {f"{ds}-{i + 1}": p for ds in a.datasets.split(",") for i, p in enumerate(load_prompts(ds, a.n))}
    seqs = {}
    for name, p in prompts.items():
        ids = eng.encode_prompt(p)
        out = eng.generate(p, max_new_tokens=a.continuation, draft=None)
        seqs[name] = [int(t) for t in ids] + [int(t) for t in out.token_ids]
    (a.work / "ids.json").write_text(json.dumps(seqs))
    return seqs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", required=True,
                    help="comma list of int4 engines (the first makes the continuations); DIR::GRAPH runs the "
                         "engine's graph GRAPH (e.g. target_prompt) instead of its target")
    ap.add_argument("--fp32", type=Path, help="the fp32 engine of the same model")
    ap.add_argument("--gguf", type=Path, help="the GGUF for llama.cpp (skip llama.cpp when not given)")
    ap.add_argument("--peer-python", type=Path,
                    default=default_peer_dir() / "llama-cpp" / "venv" / "bin" / "python")
    ap.add_argument("--split", choices=("evaluation", "calibration"), default="evaluation",
                    help="evaluation: --n prompts of each --datasets entry; calibration: the first --n "
                         "calibration-split prompts")
    ap.add_argument("--datasets", default="humaneval,mbpp,gsm8k,mt-bench")
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dspark-int4-fidelity"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reuse", action="store_true",
                    help="keep the sequences and the logits already in --work; run only the graphs (and llama.cpp) "
                         "whose logits are not there")
    a = ap.parse_args(argv)
    engines = [engine_graph(e) for e in a.engines.split(",") if e]
    a.work.mkdir(parents=True, exist_ok=True)
    if a.reuse:
        seqs = json.loads((a.work / "ids.json").read_text())
        old = json.loads(a.json.read_text()) if a.json and a.json.is_file() else {}
        systems = old.get("systems", {})
    else:
        seqs, systems = make_sequences(engines[0][0], a), {}
    runs = ([(a.fp32, "target", a.fp32.name)] if a.fp32 else []) + engines
    for e, graph, name in runs:
        if a.reuse and (a.work / name).is_dir():
            continue
        print(f"logits of {name} ...", flush=True)
        systems[name] = graph_logits(e, seqs, a.work / name, a.threads, graph)
    if a.gguf and not (a.reuse and (a.work / "llama.cpp").is_dir()):
        if not a.peer_python.is_file():
            raise SystemExit(f"error: {a.peer_python} missing; install the peer: benchmarks/peers/install.sh llama-cpp")
        t0 = time.perf_counter()
        subprocess.run([str(a.peer_python), "-m", "benchmarks.peers.llamacpp_logits", str(a.gguf),
                        str(a.work / "ids.json"), str(a.work / "llama.cpp"), "--threads", str(a.threads)], check=True,
                       env=child_env())
        systems["llama.cpp"] = {"seconds": round(time.perf_counter() - t0, 1),
                                **{k: v for k, v in json.loads((a.work / "llama.cpp" / "index.json").read_text()).items()
                                   if k in ("llama_cpp_python", "n_batch", "gguf_bytes")}}
    pairs = {}
    shared = common_prefix(seqs)
    for _, _, name in engines:
        if a.gguf:
            pairs[f"{name} vs llama.cpp"] = compare(a.work / name, a.work / "llama.cpp", seqs, shared)
        if a.fp32:
            pairs[f"{name} vs {a.fp32.name}"] = compare(a.work / name, a.work / a.fp32.name, seqs, shared)
    if a.fp32 and a.gguf:
        pairs[f"{a.fp32.name} vs llama.cpp"] = compare(a.work / a.fp32.name, a.work / "llama.cpp", seqs, shared)
    for k, v in pairs.items():
        print(f"{k:55s} top-1 {v['top1_agreement']:.2%}  rel L2 {v['rel_l2']:.4f}  max |d| "
              f"{v['max_abs_logit_diff']:.2f}  TV {v['total_variation']:.4f}  ({v['positions']} positions)")
    res = {"machine": machine(), "threads": a.threads, "split": a.split,
           "datasets": a.datasets if a.split == "evaluation" else "calibration split", "n": a.n,
           "continuation": a.continuation, "shared_prefix_counted_once": shared, "sequences": {k: len(v) for k, v in seqs.items()},
           "systems": systems, "pairs": pairs,
           "step_weight_bytes": {name: step_weight_bytes(e / load_manifest(e, verify=False).graphs[graph].model_file)
                                 for e, graph, name in runs},
           "command": shlex.join(["python", "-m", "benchmarks.int4_fidelity", *sys.argv[1:]])}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
