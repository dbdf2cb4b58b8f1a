"""Which weight-MatMul kernel a prompt chunk could run on this CPU: ONNX Runtime's fp32 ``MatMul``, the
``MatMulNBits`` the int4 graphs run (4-bit blocks of 32, accuracy level 4: int8 activations per block), and an
integer GEMM (``MatMulInteger``, uint8 activations quantized per row around 128, int8 weights per column, rescaled to
float), at one projection's shape (default the 1.5B target's MLP, 1,536 x 8,960).

Per path and row count M: median ms and GFLOP/s (2 M K N per call), the relative L2 error against the fp32 product,
and the largest difference of a row computed in calls of 1, 2, 3, 5, 17 rows against the same row in one call of the
largest M (0.0: row-count invariant, so prompt chunks of any size and batch give the same results). The integer GEMM
uses 7-bit weights where this CPU's u8·s8 kernel saturates (:func:`dspark_runtime.machine.kernel_probe.u8s8_saturates`:
AVX2 without VNNI), 8-bit ones otherwise. Random Gaussian weights and activations: the errors are those of the
encodings on such data, not of a model's logits. Prints a table; ``--json PATH`` writes every number.

    python -m benchmarks.prompt_kernels
    python -m benchmarks.prompt_kernels --json results/prompt-kernels-qwen2.5-coder-1.5b-mlp.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from dspark_runtime.machine.sysinfo import machine_description

INVARIANCE_CALLS = (1, 2, 3, 5, 17)  # call sizes whose rows are compared with one call of the largest M


def _model(nodes: list, inits: list, k: int, n: int, opset: int = 17):
    from onnx import TensorProto, helper

    g = helper.make_graph(nodes, "prompt_kernel", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])


def fp32_model(w: np.ndarray):
    """y = x @ w, float32 [K, N] weights."""
    from onnx import helper, numpy_helper

    return _model([helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(w, "w")], *w.shape)


def nbits_model(w: np.ndarray, block: int = 32, accuracy_level: int = 4):
    """``w`` as ONNX Runtime's MatMulNBitsQuantizer writes it: 4-bit asymmetric blocks of ``block`` along K."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(fp32_model(w), block_size=block, is_symmetric=False, accuracy_level=accuracy_level)
    q.process()
    return q.model.model


def integer_model(w: np.ndarray, weight_bits: int):
    """y ≈ x @ w through ``MatMulInteger``: each row of x quantized symmetrically to round(x / s) + 128 (uint8, s =
    max |row| / 127, the zero point 128 a scalar as MatMulInteger needs), ``w`` per column to signed
    ``weight_bits``-bit integers; the int32 product rescaled by s and the column scale. Integer accumulation is exact,
    so a row's result does not depend on the other rows of its call."""
    from onnx import TensorProto, helper, numpy_helper

    top = 2 ** (weight_bits - 1) - 1
    scale = np.maximum(np.abs(w).max(axis=0), 1e-12) / top
    wq = np.clip(np.round(w / scale), -top, top).astype(np.int8)
    n = helper.make_node
    nodes = [n("Abs", ["x"], ["ax"]), n("ReduceMax", ["ax"], ["mx"], axes=[1], keepdims=1),
             n("Div", ["mx", "c127"], ["s0"]), n("Max", ["s0", "tiny"], ["s"]),
             n("Div", ["x", "s"], ["xs"]), n("Round", ["xs"], ["xr"]), n("Add", ["xr", "c128"], ["xo"]),
             n("Cast", ["xo"], ["xu"], to=TensorProto.UINT8),
             n("MatMulInteger", ["xu", "wq", "z128"], ["acc"]), n("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             n("Mul", ["accf", "s"], ["ys"]), n("Mul", ["ys", "ws"], ["y"])]
    inits = [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(scale.astype(np.float32), "ws"),
             numpy_helper.from_array(np.array(127, np.float32), "c127"),
             numpy_helper.from_array(np.array(128, np.float32), "c128"),
             numpy_helper.from_array(np.array(1e-12, np.float32), "tiny"),
             numpy_helper.from_array(np.array(128, np.uint8), "z128")]
    return _model(nodes, inits, *w.shape)


def measure(model, x: np.ndarray, ms: list, threads: int, repeats: int, ref: np.ndarray) -> dict:
    """Time ``model`` at each row count of ``ms`` (rows of ``x``); its error against ``ref`` (= x @ w, all rows)
    and its row-count invariance. Returns {"ms": {M: median ms}, "gflops": {M: ...}, "rel_l2": float,
    "row_max_abs_difference": float}."""
    import onnxruntime as ort

    from dspark_runtime.backends.ort import session_options

    sess = ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                providers=["CPUExecutionProvider"])
    k, n = x.shape[1], ref.shape[1]
    out = {"ms": {}, "gflops": {}}
    for m in ms:
        feed = {"x": x[:m]}
        sess.run(None, feed)  # warm-up (pre-packing, allocations)
        walls = []
        for _ in range(repeats):
            t = time.perf_counter()
            sess.run(None, feed)
            walls.append(time.perf_counter() - t)
        med = statistics.median(walls)
        out["ms"][m] = round(med * 1e3, 3)
        out["gflops"][m] = round(2 * m * k * n / med / 1e9, 1)
    whole = sess.run(None, {"x": x})[0]
    out["rel_l2"] = float(np.linalg.norm(whole - ref) / np.linalg.norm(ref))
    worst = 0.0
    for size in INVARIANCE_CALLS:
        for s in range(0, min(len(x), 3 * size), size):
            part = sess.run(None, {"x": x[s:s + size]})[0]
            worst = max(worst, float(np.abs(part - whole[s:s + size]).max()))
    out["row_max_abs_difference"] = worst
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=1536)
    ap.add_argument("--n", type=int, default=8960)
    ap.add_argument("--m", default="1,2,64,256", help="row counts to time, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    try:
        ms = sorted({int(v) for v in a.m.split(",") if v.strip()})
        assert ms and ms[0] >= 1
    except (ValueError, AssertionError):
        ap.error(f"--m must be positive row counts separated by commas, got {a.m!r}")
    from dspark_runtime.machine.kernel_probe import u8s8_saturates

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((a.k, a.n)) / np.sqrt(a.k)).astype(np.float32)
    x = rng.standard_normal((max(ms + [3 * max(INVARIANCE_CALLS)]), a.k)).astype(np.float32)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    bits = 7 if u8s8_saturates() else 8
    paths = {"fp32 MatMul": fp32_model(w), "MatMulNBits 4-bit/32, level 4": nbits_model(w),
             f"MatMulInteger u8 x s{bits} per row": integer_model(w, bits)}
    res = {name: measure(model, x, ms, a.threads, a.repeats, ref) for name, model in paths.items()}
    print(f"{a.k} x {a.n} weights; {machine_description()}, {a.threads} threads; u8s8 kernel "
          f"{'saturates: 7-bit weights' if bits == 7 else 'exact: 8-bit weights'}")
    print(f"{'path':36s} " + " ".join(f"{f'M={m} ms':>10s} {'GFLOP/s':>8s}" for m in ms) + "  rel L2  row diff")
    for name, r in res.items():
        print(f"{name:36s} " + " ".join(f"{r['ms'][m]:10.2f} {r['gflops'][m]:8.0f}" for m in ms)
              + f"  {r['rel_l2']:.4f}  {r['row_max_abs_difference']:.3g}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"k": a.k, "n": a.n, "threads": a.threads, "repeats": a.repeats,
                                      "weight_bits_integer": bits, "machine": machine_description(),
                                      "paths": res}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
