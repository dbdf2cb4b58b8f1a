"""Probes of ONNX Runtime's CPU kernels on this machine, for choices that depend on which kernel runs
rather than on what the CPU is assumed to be.

:func:`u8s8_saturates`: whether the u8·s8 integer GEMM (``MatMulInteger`` / ``MatMulIntegerToFloat`` /
``QLinearMatMul`` of INT8 graphs with uint8 activations and int8 weights) saturates. MLAS's AVX2 kernel
multiplies with VPMADDUBSW, which adds each pair of u8·s8 products into an int16 with saturation:
255·127 + 255·127 = 64770 > 32767, so large activations times large weights are clipped. The VNNI kernels
(VPDPBUSD: AVX-VNNI, AVX-512 VNNI), AMX and the ARM dot-product kernels accumulate in int32 and are
exact. ONNX Runtime's documented remedy for the saturating path is 7-bit weights (``reduce_range``:
2·255·64 < 2¹⁵).
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from dspark_runtime.backends.ort import session_options

#: the probe's shape: M rows of A = 255 times a [K, N] weight of 127 (several rows and columns so the
#: blocked GEMM kernel runs, not a 1-row special case)
PROBE_M, PROBE_K, PROBE_N = 4, 64, 16


#: the probe graph, ``MatMulInteger(A: uint8 [M, K], B = 127: int8 [K, N]) -> Y: int32 [M, N]`` with B a constant
#: as in quantized graphs (ONNX Runtime pre-packs it); shipped serialized so the runtime needs no ``onnx``
#: (tests/runtime/machine/test_cpu_features.py checks it with onnx)
PROBE_GRAPH = Path(__file__).with_name("u8s8_probe.onnx")


def _u8s8_session():
    import onnxruntime as ort

    so = session_options(1)
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(PROBE_GRAPH), so, providers=["CPUExecutionProvider"])
    return sess, np.full((PROBE_K, PROBE_N), 127, np.int8)


def u8s8_product() -> tuple:
    """Run the probe: (ONNX Runtime's int32 result, the exact int32 product), both [M, N], of
    ``MatMulInteger(A = 255 [M, K] uint8, B = 127 [K, N] int8)`` without zero points on the CPU provider."""
    sess, b = _u8s8_session()
    a = np.full((PROBE_M, PROBE_K), 255, np.uint8)
    got = sess.run(None, {"A": a})[0]
    return np.asarray(got, np.int64), a.astype(np.int64) @ b.astype(np.int64)


@functools.lru_cache(maxsize=1)
def u8s8_saturates() -> bool:
    """True when ONNX Runtime's CPU u8·s8 GEMM on this machine saturates int16 pair sums (the AVX2
    VPMADDUBSW path: the probe's 255·127·64 = 2072640 comes out as 32·32767 = 1048544), False when it
    computes the exact int32 product (VNNI, AMX, ARM dot product). Measured once per process."""
    got, exact = u8s8_product()
    return not np.array_equal(got, exact)
