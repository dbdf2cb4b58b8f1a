"""Where an engine's prompt chunks should run on this CPU (``Engine.load(prompts=...)``): the target graph on ONNX
Runtime's CPU provider, the engine's integer-GEMM prompt graph (``dspark-export add-prompt-graph``), the target graph
on ONNX Runtime's OpenVINO provider (Intel CPUs, ``pip install 'dspark[openvino]'``).

Per place: the time of one prompt chunk from an empty cache at each --q (best of --repeats, places interleaved, the
runtime's calls: a ScatterRunner with the engine's row padding, the LM head on the last position), and the fidelity of
the prompt's positions — logits of every position of --fidelity calibration-split prompts (never the evaluation
prompts) against the target graph's on the CPU provider: relative L2 and top-1 agreement. A place this machine or
engine cannot run is reported as skipped, with why. Prints a table; ``--json PATH`` writes every number.

    python -m benchmarks.prompt_places --engine engines/qwen2.5-coder-1.5b --prompt-graph-engine engines/pg8
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from dspark_runtime.machine.sysinfo import machine_description


def _backends(engine: Path, prompt_graph_engine: Path | None, threads: int) -> tuple:
    """(the target's CPU backend, row multiple, {place: prompt backend or None for the target}, {place: why skipped},
    the tokenizer)."""
    from dspark_runtime import DSparkError, Engine

    eng = Engine.load(engine, threads=threads, prompts="target")
    target = eng.graph_backend("target")
    places, skipped = {"target": None}, {}
    for place, path in (("prompt-graph", prompt_graph_engine or engine), ("openvino", engine)):
        try:
            other = Engine.load(path, threads=threads, prompts=place)
            places[place] = other.runner("target").prompt_backend  # made and checked as the runtime does
        except DSparkError as e:
            skipped[place] = str(e)
    return target, eng.row_multiple, places, skipped, eng.tokenizer


def _prompt(target, row_multiple: int, backend, ids: list, all_logits: bool = False):
    """Feed ``ids`` from an empty cache as one prompt chunk (the runtime's call: on ``backend``, the target's where
    None; the last position's logits), or with ``all_logits`` as one call of ``backend`` computing every position's
    logits (for the fidelity comparison)."""
    from dspark_runtime.runners.scatter import ScatterRunner

    if all_logits:
        r = ScatterRunner(backend or target, row_multiple=row_multiple)
        r.add(0)
        return r.step([(0, ids)])[0]
    r = ScatterRunner(target, row_multiple=row_multiple)
    r.prompt_backend = backend
    r.add(0)
    return r.step([(0, ids)], last_only={0})[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, type=Path, help="an int4 engine (CPU target, scatter KV layout)")
    ap.add_argument("--prompt-graph-engine", type=Path, default=None,
                    help="the engine whose prompt graph to time (default --engine's, where it has one)")
    ap.add_argument("--q", default="64,128,256,512,1024", help="prompt chunk sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fidelity", type=int, default=8, help="calibration-split prompts compared (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    from dspark_export.precision.activation_ranges import CALIBRATION_NOTE, calibration_token_ids

    target, rm, places, skipped, tok = _backends(a.engine, a.prompt_graph_engine, a.threads)
    for place, why in skipped.items():
        print(f"{place}: skipped ({why})")
    prompts = calibration_token_ids(tok, a.fidelity, 512) if a.fidelity else []
    fidelity = {p: [] for p in places if p != "target"}
    for ids in prompts:
        ref = _prompt(target, rm, None, ids, all_logits=True)
        for p in fidelity:
            got = _prompt(target, rm, places[p], ids, all_logits=True)
            fidelity[p].append({"tokens": len(ids), "rel_l2": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
                                "top1": float(np.mean(got.argmax(-1) == ref.argmax(-1)))})
    qs = [int(x) for x in a.q.split(",")]
    vocab = target.spec.dims.vocab_size
    long = [int(i) for i in np.random.default_rng(0).integers(vocab // 30, vocab // 5, max(qs))]
    best = {p: {q: float("inf") for q in qs} for p in places}
    for p, be in places.items():  # warm-up: OpenVINO compiles on its first call
        _prompt(target, rm, be, long[:qs[0]])
    for _ in range(a.repeats):
        for q in qs:
            for p, be in places.items():
                t = time.perf_counter()
                _prompt(target, rm, be, long[:q])
                best[p][q] = min(best[p][q], time.perf_counter() - t)
    print(f"prompt chunk from an empty cache, best of {a.repeats}; {machine_description()}, {a.threads} threads")
    print(f"{'q':>5s} " + " ".join(f"{p:>24s}" for p in places))
    for q in qs:
        print(f"{q:5d} " + " ".join(f"{best[p][q] * 1e3:9.0f} ms {q / best[p][q]:6.0f} tok/s" for p in places))
    for p, rows in fidelity.items():
        if rows:
            print(f"{p}: prompt positions vs the target graph over {len(rows)} prompts ({sum(r['tokens'] for r in rows)} "
                  f"positions): rel L2 {np.mean([r['rel_l2'] for r in rows]):.4f} (max "
                  f"{max(r['rel_l2'] for r in rows):.4f}), top-1 {np.mean([r['top1'] for r in rows]):.2%}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "engine": str(a.engine), "prompt_graph_engine": str(a.prompt_graph_engine or a.engine),
            "machine": machine_description(), "threads": a.threads, "repeats": a.repeats, "skipped": skipped,
            "chunk_ms": {p: {str(q): round(v * 1e3, 1) for q, v in d.items()} for p, d in best.items()},
            "fidelity_prompts": CALIBRATION_NOTE, "fidelity": fidelity}, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
