"""Tiny QDQ (quantize/dequantize) graphs for the TensorRT build tests, made with the onnx helper API.

ModelOpt (NVIDIA's quantizer) is not installed here, so the INT8 and FP8 graphs are made directly: every
MatMul whose second input is a weight gets ``DequantizeLinear(QuantizeLinear(x))`` on both inputs,
symmetric (zero point 0; what TensorRT requires), per-tensor scales: the weight's max |w| and the
activation's max |x| over one calibration run of ONNX Runtime, divided by the format's largest value
(INT8: 127; FP8 E4M3: 448). That is the pattern ModelOpt's QDQ export produces for GEMMs, enough to prove
TensorRT accepts and builds our graphs in those precisions; it is not a calibrated quantization recipe.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

QMAX = {"int8": 127.0, "fp8": 448.0}


def _activation_amax(src: Path, names: list[str], feeds: dict) -> dict:
    """max |value| of the named intermediate tensors for one ONNX Runtime run on ``feeds``."""
    import onnx
    import onnxruntime as ort

    proto = onnx.load(str(src))
    have = {o.name for o in proto.graph.output}
    for n in names:
        if n not in have:
            proto.graph.output.append(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = sess.run(names, feeds)
    return {n: float(np.abs(v).max()) for n, v in zip(names, outs)}


def make_qdq_graph(src: Path, dst: Path, fmt: str, feeds: dict) -> int:
    """Write a QDQ copy of the fp32 graph ``src`` (external data beside it) to ``dst`` (+ ``dst.data``).

    fmt: "int8" or "fp8" (E4M3; raises the opset to 19, the first with FP8 QuantizeLinear).
    feeds: one calibration input dict for ``src``. Returns the number of quantized MatMuls.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    proto = onnx.load(str(src))
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    mms = [n for n in g.node if n.op_type == "MatMul" and n.input[1] in inits]
    amax = _activation_amax(src, sorted({n.input[0] for n in mms}), feeds)
    zp_type = TensorProto.INT8 if fmt == "int8" else TensorProto.FLOAT8E4M3FN
    new_inits, before = [], {}  # MatMul name -> its Q/DQ nodes, inserted right before it (inputs exist by then)

    def qdq(name: str, peak: float, tag: str, nodes: list) -> str:
        scale = np.float32(max(peak, 1e-6) / QMAX[fmt])
        s_name, z_name = f"{tag}_scale", f"{tag}_zp"
        new_inits.append(numpy_helper.from_array(np.array(scale, dtype=np.float32), s_name))
        new_inits.append(helper.make_tensor(z_name, zp_type, [], [0]))
        nodes.append(helper.make_node("QuantizeLinear", [name, s_name, z_name], [f"{tag}_q"], name=f"{tag}_Q"))
        nodes.append(helper.make_node("DequantizeLinear", [f"{tag}_q", s_name, z_name], [f"{tag}_dq"],
                                      name=f"{tag}_DQ"))
        return f"{tag}_dq"

    for i, n in enumerate(mms):
        nodes = []
        w = numpy_helper.to_array(inits[n.input[1]])
        a = qdq(n.input[0], amax[n.input[0]], f"qdq{i}_act", nodes)
        b = qdq(n.input[1], float(np.abs(w).max()), f"qdq{i}_w", nodes)
        n.input[0], n.input[1] = a, b
        before[n.name] = nodes
    g.initializer.extend(new_inits)
    order = []
    for n in g.node:
        order += before.get(n.name, [])
        order.append(n)
    del g.node[:]
    g.node.extend(order)
    if fmt == "fp8":
        for op in proto.opset_import:
            if op.domain in ("", "ai.onnx"):
                op.version = max(op.version, 19)
    data = dst.name + ".data"
    for p in (dst, dst.with_name(data)):
        if p.exists():
            p.unlink()
    onnx.save_model(proto, str(dst), save_as_external_data=True, all_tensors_to_one_file=True, location=data,
                    size_threshold=1024)
    return len(mms)
