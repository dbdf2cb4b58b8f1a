"""Does a request's output depend on the other requests in its batch? (batch-composition invariance)

Teacher-forces one request (random ids: a prompt, then steps of 1-5 tokens) through an engine's target graph in
the single-request runner (the reference) and in the engine's batched runner with other requests beside it
(``packed-alone``, ``masked-front``, ``longer-neighbour``, ``neighbours``); reports max |logit difference| per
layout. ``--kernels`` adds the kernel rule behind it: at which offsets in a longer masked row ONNX Runtime's Softmax
and MatMul give bit-identical results. Writes --json. Findings: docs/results.md.

    python -m benchmarks.batch_invariance --engine engines/qwen2.5-coder-1.5b-int4 --kernels
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

STEPS = (1, 2, 4, 1, 3, 1, 1, 5, 2, 1)
LAYOUTS = ("packed-alone", "masked-front", "longer-neighbour", "neighbours")


def engine_probe(engine_dir: Path, threads: int, seed: int = 0) -> dict:
    """Max |logit difference| against the single runner, per layout (see the module docstring)."""
    from dspark_runtime.engine import Engine
    from dspark_runtime.runners.factory import decoder_runner
    from dspark_runtime.runners.packed import PackedRunner
    from dspark_runtime.runners.factory import batch_runner

    eng = Engine.load(engine_dir, threads=threads)
    be = eng.graph_backend("target")
    rng = np.random.default_rng(seed)
    vocab = be.spec.dims.vocab_size
    prompt, other1, other2 = (list(rng.integers(3, vocab, n)) for n in (37, 23, 51))
    steps = [list(rng.integers(3, vocab, q)) for q in STEPS]
    rm = eng.row_multiple

    single = decoder_runner(be, row_multiple=rm)
    ref = [single.step(prompt)] + [single.step(s) for s in steps]

    def packed(layout: str) -> list:
        pr = batch_runner(be, row_multiple=rm)  # the batched runtime's runner for this graph's KV layout
        if isinstance(pr, PackedRunner):
            pr.compact_ratio = 0.0
        for rid in ("b", "a", "c"):
            pr.add(rid)
        if layout == "masked-front":
            pr.step([("b", other1)])
            pr.remove("b")
        if layout == "longer-neighbour":
            pr.step([("b", other2 + other1)])
        if layout == "neighbours":
            pr.step([("b", other1), ("c", other2)])
        out = [pr.step([("a", prompt)])[0]]  # packed-alone: no other request ever
        for i, s in enumerate(steps):
            if layout == "longer-neighbour":
                out.append(pr.step([("a", s), ("b", [5, 6])])[0])
            elif layout == "neighbours":
                out.append(pr.step([("c", [7] * (i % 3 + 1)), ("a", s), ("b", [9])])[1])
            else:
                out.append(pr.step([("a", s)])[0])
        return out

    res = {"engine": str(engine_dir), "precision": eng.manifest.graphs["target"].precision, "row_multiple": rm,
           "kv_layout": be.spec.kv_layout, "batch_runner": type(batch_runner(be)).__name__}
    for layout in LAYOUTS:
        got = packed(layout)
        res[layout] = max(float(np.abs(a - b).max()) for a, b in zip(ref, got))
    return res


def kernel_probe(threads: int, trials: int = 8, max_offset: int = 33, seed: int = 1) -> dict:
    """Offsets (0..max_offset-1) at which ONNX Runtime's Softmax and MatMul give bit-identical results for a block
    of n entries inside a longer row of masked entries (random trailing length), for n in 37, 300, 1000."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def session(node, ins, out):
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in ins],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["a", "b"])])
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        return ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
                                    .SerializeToString(), so)

    sm = session(helper.make_node("Softmax", ["x"], ["y"], axis=-1), [("x", ["a", "b"])], "y")
    mm = session(helper.make_node("MatMul", ["p", "v"], ["y"]), [("p", ["m", "k"]), ("v", ["k", "n"])], "y")
    rng = np.random.default_rng(seed)
    low = np.finfo(np.float32).min
    out = {}
    for n in (37, 300, 1000):
        bad_sm, bad_mm = set(), set()
        for _ in range(trials):
            x = rng.standard_normal(n).astype(np.float32) * 3
            p = sm.run(None, {"x": x[None]})[0][0]
            v = rng.standard_normal((n, 128)).astype(np.float32)
            pv = mm.run(None, {"p": p[None], "v": v})[0][0]
            for o in range(max_offset):
                L = o + n + int(rng.integers(0, 40))
                xx = np.full(L, low, np.float32)
                xx[o:o + n] = x
                if not np.array_equal(sm.run(None, {"x": xx[None]})[0][0][o:o + n], p):
                    bad_sm.add(o)
                pp, vv = np.zeros(L, np.float32), np.zeros((L, 128), np.float32)
                pp[o:o + n], vv[o:o + n] = p, v
                if not np.array_equal(mm.run(None, {"p": pp[None], "v": vv})[0][0], pv):
                    bad_mm.add(o)
        out[str(n)] = {"softmax_identical_offsets": [o for o in range(max_offset) if o not in bad_sm],
                       "matmul_identical_offsets": [o for o in range(max_offset) if o not in bad_mm]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, action="append", default=[], help="engine directory (repeatable)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", action="store_true", help="also probe the Softmax / MatMul offset rule")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    from dspark_runtime.machine.sysinfo import machine_description

    report = {"machine": machine_description(), "threads": a.threads, "engines": []}
    print(f"machine: {report['machine']}, {a.threads} threads")
    for e in a.engine:
        r = engine_probe(e, a.threads)
        report["engines"].append(r)
        print(f"{e.name:32s} {r['precision']:6s} row padding {r['row_multiple']}: max |dlogit| vs single runner  "
              + "  ".join(f"{k} {r[k]:.1e}" for k in LAYOUTS))
    if a.kernels:
        report["kernels"] = kernel_probe(a.threads)
        for n, r in report["kernels"].items():
            print(f"block of {n:>4s}: Softmax identical at offsets {r['softmax_identical_offsets']}; "
                  f"MatMul at {r['matmul_identical_offsets']}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
