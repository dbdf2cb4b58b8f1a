"""The streaming QDQ writer (:func:`quantize_qdq`): every MatMul whose second input is a 2-D float weight
initializer (the linear layers and the LM head; never the attention MatMuls or the mask arithmetic) becomes
``DQ(Q(x)) @ DQ(W_q)`` with per-output-channel symmetric weights stored already quantized, from the activation
ranges of a :class:`~dspark_export.precision.activation_ranges.CalibrationTable`.

* ``int8`` (ONNX Runtime CPU): U8 activations (asymmetric, per tensor) × S8 weights, 7-bit (±64, ``reduce_range``:
  without AVX-VNNI ONNX Runtime's U8S8 kernels add pairs of products in saturating int16) unless
  ``reduce_range=False``.
* ``int8-trt`` (TensorRT): symmetric S8 activations and S8 weights, the only INT8 Q/DQ TensorRT accepts.
* ``fp8`` (TensorRT, compute capability >= 8.9): FLOAT8E4M3FN weights and activations (scale = max |·| / 448), opset 19.

The graph is rewritten one initializer at a time while the external data streams from file to file: peak memory is
the graph structure plus the largest weight. tests/export/precision/test_quantize.py checks it against ONNX Runtime's
``quantize_static``, tests/export/precision/test_fp8.py against a numpy fake-quantization.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from dspark_export.graphs.onnx_io import ExternalData, ExternalWriter, peak_rss_gb, quant_targets
from dspark_export.precision.activation_ranges import CALIBRATION_METHOD, CalibrationTable
from dspark_runtime.errors import DSparkError

INT8_PRECISIONS = ("int8", "int8-trt")
QDQ_PRECISIONS = INT8_PRECISIONS + ("fp8",)  # what the streaming writer makes
FP8_MAX = 448.0  # largest finite FLOAT8E4M3FN value (E4M3, "fn": no infinities, one NaN pattern)
FP8_MIN_OPSET = 19  # first default-domain opset whose QuantizeLinear/DequantizeLinear take FLOAT8E4M3FN
# Modules kept in fp32 by default (module-name regular expressions): the inputs of mlp.down_proj carry Qwen2's
# massive activations, which a per-tensor U8 scale cannot resolve (docs/precision.md, "Which MatMuls stay fp32").
DEFAULT_EXCLUDE: tuple = (r"mlp\.down_proj",)


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """``x`` (float32, already divided by its scale) as FLOAT8E4M3FN: saturated to ±448, then rounded to the
    nearest E4M3 value, ties to even (``ml_dtypes`` cast; what ONNX's QuantizeLinear does with
    ``saturate=1``). ``ml_dtypes`` alone would turn values beyond ±448 into NaN, hence the clip first.
    Returns an array of dtype ``ml_dtypes.float8_e4m3fn`` (1 byte per element), same shape."""
    import ml_dtypes

    return np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def activation_qparams(lo: float, hi: float, signed: bool = True, fp8: bool = False) -> tuple:
    """Per-tensor activation scale and zero point for range [lo, hi] (widened to include 0).

    fp8 (TensorRT, E4M3): symmetric, scale = max(|lo|, |hi|) / 448, zero point FLOAT8E4M3FN 0 (``signed``
        is implied).
    signed (TensorRT): symmetric S8, zero point 0, scale = max(|lo|, |hi|) / 127.
    unsigned (ONNX Runtime): asymmetric U8, scale = (hi - lo) / 255, zero point = round(-lo / scale).
    A range of only zeros gets scale 1. Returns (scale float32 scalar, zero point scalar of dtype
    uint8 / int8 / ``ml_dtypes.float8_e4m3fn``).
    """
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if fp8:
        import ml_dtypes

        return np.float32(max(abs(lo), abs(hi)) / FP8_MAX or 1.0), ml_dtypes.float8_e4m3fn(0)
    if signed:
        s = max(abs(lo), abs(hi)) / 127.0 or 1.0
        return np.float32(s), np.int8(0)
    s = (hi - lo) / 255.0 or 1.0
    return np.float32(s), np.uint8(np.clip(round(-lo / s), 0, 255))


def quantize_weight_chunks(read_rows, k: int, n: int, qmax: float, chunk_bytes: int = 32 << 20, fp8: bool = False):
    """Symmetric per-column (axis 1) quantization of a weight W [k, n] float32, in row chunks.

    ``read_rows(a, b)`` returns W[a:b] as float32. Two passes: column max |W| (scale = max / qmax; an
    all-zero column gets scale 1), then the quantized rows: int8 ``clip(rint(W / scale), -qmax, qmax)``, or
    with ``fp8`` FLOAT8E4M3FN :func:`to_e4m3` ``(W / scale)`` (qmax should then be 448).
    Yields ``("scale", float32 [n])`` first, then ``("rows", int8 or float8_e4m3fn [b - a, n])`` chunks.
    Peak extra memory: a few chunks of ~``chunk_bytes`` of rows, not the whole weight.
    """
    chunk_rows = max(1, chunk_bytes // (4 * n))
    amax = np.zeros(n, np.float32)
    for a in range(0, k, chunk_rows):
        np.maximum(amax, np.abs(read_rows(a, min(k, a + chunk_rows))).max(axis=0), out=amax)
    scale = np.where(amax > 0, amax / np.float32(qmax), 1.0).astype(np.float32)
    yield "scale", scale
    for a in range(0, k, chunk_rows):
        w = read_rows(a, min(k, a + chunk_rows))
        if fp8:
            yield "rows", to_e4m3(w / scale)
        else:
            yield "rows", np.clip(np.rint(w / scale), -qmax, qmax).astype(np.int8)


def quantize_qdq(src: Path, dst: Path, table: CalibrationTable, precision: str = "int8", *,
                 reduce_range: bool | None = None, exclude=(), log=print) -> dict:
    """Write the QDQ-quantized copy of graph ``src`` to ``dst`` (+ ``dst.data``), streaming the weights.

    For every target MatMul ``x[..., K] @ W[K, N]`` (see :func:`quant_targets`) the graph gets
    ``QuantizeLinear(x)`` (one per activation tensor, scalar scale and zero point) -> one
    ``DequantizeLinear`` per consuming MatMul, and the weight stored quantized as ``<W>_quantized`` [K, N]
    with ``<W>_scale`` (float32 [N]) and ``<W>_zero_point`` ([N], zeros) feeding ``DequantizeLinear(axis=1)``.

    * ``int8`` / ``int8-trt``: INT8 weights, UINT8 (asymmetric) / INT8 (symmetric) activations.
    * ``fp8``: FLOAT8E4M3FN weights (scale = column max |W| / 448, ``W / scale`` saturated to ±448 and
      rounded to nearest even), FLOAT8E4M3FN activations (scale = max(|lo|, |hi|) / 448 from ``table``,
      scalar FP8 zero point 0), the default-domain opset raised to 19 when lower (FP8 Q/DQ needs it; the
      IR version to at least 9). NVIDIA ModelOpt (:mod:`dspark_export.precision.fp8`) writes the same activation
      pattern but keeps the weights fp32 behind their own QuantizeLinear -> DequantizeLinear (TensorRT folds
      them at build time), so its file is as large as the fp32 one; here the weights are stored already in
      FP8 (1 byte per weight, a quarter of the fp32 file) behind a DequantizeLinear only — the same
      structure as ``int8-trt``. ModelOpt also shares one activation DequantizeLinear between the MatMuls
      reading the same tensor; here each MatMul gets its own (as ONNX Runtime's quantizer writes).

    Args:
        src: fp32 ``.onnx`` graph (external weights beside it; never modified).
        dst: output ``.onnx``; its weights go to ``<dst name>.data`` beside it (replaced if present).
        table: activation ranges from :func:`calibrate_graph` on ``src``.
        precision: one of :data:`QDQ_PRECISIONS`: ``"int8"`` (U8 activations / S8 weights, ONNX Runtime),
            ``"int8-trt"`` (S8/S8 symmetric, TensorRT) or ``"fp8"`` (E4M3/E4M3 symmetric, TensorRT on
            compute capability >= 8.9).
        reduce_range: 7-bit weights (±64; 2·255·64 < 2¹⁵). Default: True for ``int8`` (AVX2 saturation,
            see module doc), False for ``int8-trt``; not applicable to ``fp8``.
        exclude: module-name regular expressions left fp32 (see :func:`quant_targets`).
    Peak memory: the graph's structure plus a few 32 MB row chunks of one weight.
    Returns a report dict: precision, method, activation / weight formats, quantized count, excluded
    module names, weight bytes before and after, opset before and after, checks (ONNX checker, Q/DQ node
    counts, FP8 initializers), seconds, peak RSS (GiB). Raises DSparkError for an unknown precision,
    ``reduce_range`` with ``fp8``, a missing activation range (calibrated with other exclusions or on
    another graph), unreadable weights, or an output that fails the ONNX checker.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if precision not in QDQ_PRECISIONS:
        raise DSparkError(f"the QDQ writer makes {', '.join(QDQ_PRECISIONS)}, not {precision!r}")
    fp8 = precision == "fp8"
    if fp8:
        if reduce_range:
            raise DSparkError("reduce_range (7-bit weights) applies to int8 only, not fp8")
        import ml_dtypes

        reduce_range, signed, qmax = False, True, FP8_MAX
        w_type, w_zero = TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn
    else:
        signed = precision == "int8-trt"
        if reduce_range is None:
            reduce_range = not signed
        qmax = 64 if reduce_range else 127  # ONNX Runtime's reduce_range for S8: [-64, 64]
        w_type, w_zero = TensorProto.INT8, np.int8
    src, dst = Path(src), Path(dst)
    t0 = time.perf_counter()
    proto = onnx.load(str(src), load_external_data=False)
    targets, skipped = quant_targets(proto, exclude)
    missing = sorted({q.activation for q in targets} - set(table.ranges))
    if missing:
        raise DSparkError(f"the calibration table has no range for {len(missing)} MatMul input(s) of {src.name} "
                          f"(e.g. {missing[0]!r}); calibrate this graph with the same exclusions "
                          "(`dspark-export calibrate-quant`)")
    by_weight = {}
    for q in targets:
        by_weight.setdefault(q.weight, []).append(q)
    target_nodes = {q.node for q in targets}
    # a weight also read by a node left in fp32 (a shared or partly excluded weight) keeps its fp32 copy
    shared = {i for n in proto.graph.node if n.name not in target_nodes for i in n.input if i in by_weight}
    reader = ExternalData(src.parent)
    bytes_in = 0
    new_inits = []
    writer = ExternalWriter(dst)
    with writer:
        for t in proto.graph.initializer:
            bytes_in += reader.nbytes(t)
            if t.name in by_weight:
                k, n = t.dims

                def rows(a, b, t=t, n=n):
                    return np.frombuffer(reader.read(t, a * n * 4, (b - a) * n * 4), np.float32).reshape(b - a, n)

                chunks = quantize_weight_chunks(rows, k, n, qmax, fp8=fp8)
                _, scale = next(chunks)
                new_inits.append(writer.put((c for _, c in chunks), t.name + "_quantized", w_type, (k, n)))
                new_inits.append(numpy_helper.from_array(scale, t.name + "_scale"))
                new_inits.append(numpy_helper.from_array(np.zeros(n, w_zero), t.name + "_zero_point"))
                if t.name in shared:
                    new_inits.append(writer.copy(t, reader))
            else:
                new_inits.append(writer.copy(t, reader))
    bytes_out = writer.bytes_out
    reader.close()
    # activation Q (one per tensor) and DQ (one per consumer), weight DQ, in topological order
    act_q, nodes = {}, []
    by_node = {q.node: q for q in targets}
    for node in proto.graph.node:
        q = by_node.get(node.name)
        if q is not None:
            if q.activation not in act_q:
                s, zp = activation_qparams(*table.ranges[q.activation], signed=signed, fp8=fp8)
                base = f"{q.activation}_act"
                new_inits.append(numpy_helper.from_array(np.array(s, np.float32), base + "_scale"))
                new_inits.append(numpy_helper.from_array(np.array(zp), base + "_zero_point"))
                nodes.append(helper.make_node("QuantizeLinear", [q.activation, base + "_scale", base + "_zero_point"],
                                              [base + "_q"], name=base + "_QuantizeLinear"))
                act_q[q.activation] = base
            base = act_q[q.activation]
            a_dq = f"{node.name}_input_dq"
            nodes.append(helper.make_node("DequantizeLinear", [base + "_q", base + "_scale", base + "_zero_point"],
                                          [a_dq], name=a_dq))
            w_dq = f"{node.name}_weight_dq"
            nodes.append(helper.make_node("DequantizeLinear", [q.weight + "_quantized", q.weight + "_scale",
                                                               q.weight + "_zero_point"], [w_dq], name=w_dq, axis=1))
            del node.input[:]
            node.input.extend([a_dq, w_dq])
        nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(new_inits)
    opset = {op.domain or "ai.onnx": op.version for op in proto.opset_import}
    opset_in = opset.get("ai.onnx")
    if fp8:
        for op in proto.opset_import:
            if op.domain in ("", "ai.onnx") and op.version < FP8_MIN_OPSET:
                # 18 -> 19 only widens existing operators' types (FP8) / adds optional attributes
                op.version = FP8_MIN_OPSET
        proto.ir_version = max(proto.ir_version, 9)  # IR 9 introduced the FP8 element types
    opset_out = {op.domain or "ai.onnx": op.version for op in proto.opset_import}.get("ai.onnx")
    onnx.save_model(proto, str(dst))
    try:
        onnx.checker.check_model(str(dst))
    except Exception as e:
        raise DSparkError(f"the quantized graph {dst} fails the ONNX checker: {e}") from e
    ops = [n.op_type for n in nodes]
    checks = {"checker": "passed", "quantize_linear": ops.count("QuantizeLinear"),
              "dequantize_linear": ops.count("DequantizeLinear"),
              "fp8_tensors": sum(t.data_type == TensorProto.FLOAT8E4M3FN for t in new_inits)}
    if fp8:
        acts = "FLOAT8E4M3FN symmetric per tensor (scale = max(|lo|, |hi|) / 448, zero point 0)"
        wts = ("FLOAT8E4M3FN symmetric per channel (axis 1, scale = column max |W| / 448), stored quantized "
               "(1 byte per weight) behind DequantizeLinear")
    else:
        acts = "int8 symmetric per tensor" if signed else "uint8 asymmetric per tensor"
        wts = f"int8 symmetric per channel (axis 1), {'7-bit (reduce_range)' if reduce_range else '8-bit'}"
    rep = {"precision": precision, "method": f"static QDQ, {CALIBRATION_METHOD} activation ranges",
           "activations": acts, "weights": wts, "opset": {"from": opset_in, "to": opset_out}, "checks": checks,
           **({} if signed else {"reduce_range": bool(reduce_range)}),
           "quantized": len(targets), "excluded": sorted({q.module for q in skipped}),
           "excluded_patterns": list(exclude),
           "lm_head_quantized": any(q.module == "lm_head" for q in targets),
           "weight_bytes_in": bytes_in, "weight_bytes_out": bytes_out,
           "seconds": round(time.perf_counter() - t0, 1), "peak_rss_gb": round(peak_rss_gb(), 2)}
    if fp8:
        rep["requires"] = "TensorRT on compute capability >= 8.9 (ONNX Runtime CPU runs it 6-10x slower than fp32)"
    log(f"  quantized {len(targets)} MatMuls of {src.name} -> {dst.name} ({precision}); weights "
        f"{bytes_in / 2**30:.2f} -> {bytes_out / 2**30:.2f} GiB in {rep['seconds']:.0f} s, "
        f"peak RSS {rep['peak_rss_gb']:.2f} GiB"
        + (f"; opset {opset_in} -> {opset_out}" if opset_in != opset_out else ""))
    return rep
