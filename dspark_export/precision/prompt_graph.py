"""The integer-GEMM prompt graph of an int4 target: the same graph with every weight ``MatMulNBits`` (and its block-sum
correction) but the LM head's, and every ``ai.dspark.MatMulGGUF`` (``gguf-kernel`` targets), replaced by ``MatMulInteger`` on uint8 activations quantized per row and the weight
the int4 graph represents re-quantized per output column to signed 7- or 8-bit integers, rescaled to float.

Why (docs/precision.md, "Prompt chunks on an integer GEMM"): prompt chunks are compute-bound, and ONNX Runtime's
u8·s8 GEMM runs them ~2x faster than ``MatMulNBits`` on an AVX2 CPU (more with VNNI/AMX), while its int32 accumulation
is exact, so a row's result does not depend on the rows it is computed with (prompt chunks of any size, alone or
batched, agree bit for bit). The runtime runs prompt chunks on it and every other call on the target graph
(:mod:`dspark_runtime.runners.scatter`), in every decoding mode alike, so speculative output still equals target-only.

Per row ``x`` of a projection's input: ``s = max|x| / 127``, ``xu = round(x / s) + 128`` (uint8, ``QuantizeLinear``
per row; the zero point 128 a scalar as the GEMM takes it), ``y = ((xu − 128)·Wq · ws) · s`` with ``Wq`` int8
``[K, N]`` and ``ws`` float32 ``[N]`` (``max|W[:, n]| / (2^(bits−1) − 1)``): ``MatMulIntegerToFloat`` (the u8·s8 GEMM with the
column scales applied as it writes), then the row scale. ``weight_bits`` 7 where this CPU's u8·s8 kernel saturates
(:func:`dspark_runtime.machine.kernel_probe.u8s8_saturates`), else 8.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np

from dspark_runtime.engine_dir.graphspec import LOGITS_FROM, LOGITS_TO
from dspark_runtime.errors import DSparkError

from dspark_export.graphs.onnx_io import (ExternalData, ExternalWriter, default_opset, module_name, node_attributes,
                                          peak_rss_gb, session_over_weights, set_live_nodes)
from dspark_export.precision.gguf_kernel import OP_MATMUL_GGUF, gguf_weight
from dspark_export.precision.nbits import NBitsWeight

_NBITS = "MatMulNBits"
_WEIGHT_OPS = (_NBITS, OP_MATMUL_GGUF)  # the weight MatMuls a prompt graph replaces
# input channels whose calibration maximum exceeds OUTLIER_RATIO x the median channel's run apart in fp32 (at most
# OUTLIER_MOST per activation), so one scale per row covers the rest (LLM.int8()'s decomposition, made static so a
# row's result still does not depend on its call); measured choice: docs/precision.md
OUTLIER_RATIO, OUTLIER_MOST = 3.0, 512


def column_int8(w: np.ndarray, bits: int) -> tuple:
    """``w`` float32 [K, N] as signed ``bits``-bit integers per output column: (int8 [K, N], float32 scales [N])."""
    top = 2 ** (bits - 1) - 1
    scale = (np.maximum(np.abs(w).max(axis=0), 1e-30) / top).astype(np.float32)
    q = np.clip(np.rint(w / scale), -top, top).astype(np.int8)
    return q, scale


def _lm_head(graph):
    prod = {o: n for n in graph.node for o in n.output}
    node = prod.get("logits")
    while node is not None and node.op_type not in ("MatMul", "Gemm", _NBITS):
        node = prod.get(node.input[0]) if node.input else None
    return node


def channel_maxima(graph_path: Path, spec, token_lists: list, threads: int = 2) -> dict:
    """max |x| per input channel of every weight MatMulNBits / MatMulGGUF input of the scatter-layout int4 graph ``graph_path``,
    over prompt chunks of ``token_lists`` (each fed whole from an empty cache: calibration-split prompts,
    :func:`~dspark_export.precision.activation_ranges.calibration_token_ids`). Returns {activation: float32 [K]}.
    The graph's weights are read in place (a weightless copy with the reductions added)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    proto = onnx.load(str(graph_path), load_external_data=False)
    inits = {t.name for t in proto.graph.initializer}
    acts = sorted({n.input[0] for n in proto.graph.node if n.op_type in _WEIGHT_OPS and n.input[1] in inits})
    opset = default_opset(proto)
    proto.graph.initializer.append(numpy_helper.from_array(np.array([0, 1], np.int64), "__cm_axes"))
    outs = []
    for i, a in enumerate(acts):  # the decoder's activations are [batch, q, K]: reduce the first two axes
        mk = helper.make_node
        red = (mk("ReduceMax", [f"__cm_abs_{i}", "__cm_axes"], [f"__cm_{i}"], keepdims=0) if opset >= 18
               else mk("ReduceMax", [f"__cm_abs_{i}"], [f"__cm_{i}"], axes=[0, 1], keepdims=0))
        proto.graph.node.extend([mk("Abs", [a], [f"__cm_abs_{i}"]), red])
        proto.graph.output.append(helper.make_tensor_value_info(f"__cm_{i}", TensorProto.FLOAT, None))
        outs.append(f"__cm_{i}")
    sess = session_over_weights(proto, Path(graph_path).parent, threads,
                                kernels=Path(graph_path).parent / spec.kernels if spec.kernels else None)
    d = spec.dims
    best = [None] * len(acts)
    names = {t.name for t in sess.get_inputs()}
    for ids in token_lists:
        q = len(ids)
        slots = -(-q // 128) * 128
        feeds = {"input_ids": np.asarray([ids], np.int64), "position_ids": np.arange(q, dtype=np.int64)[None],
                 "attention_mask": np.tril(np.ones((q, slots), bool))[None, None]}
        if LOGITS_FROM in names:
            feeds[LOGITS_FROM] = np.array([q - 1], np.int64)
        if LOGITS_TO in names:
            feeds[LOGITS_TO] = np.array([q], np.int64)
        for i in range(d.num_layers):
            for kv in ("key", "value"):
                feeds[f"past.{i}.{kv}"] = np.zeros((1, d.num_kv_heads, slots, d.head_dim), np.float32)
        for j, m in enumerate(sess.run(outs, feeds)):
            best[j] = m if best[j] is None else np.maximum(best[j], m)
    return dict(zip(acts, best))


def outlier_channels(maxima: np.ndarray, ratio: float = OUTLIER_RATIO, most: int = OUTLIER_MOST) -> np.ndarray:
    """The input channels computed apart in fp32: those whose calibration maximum exceeds ``ratio`` times the median
    channel's, at most ``most`` (the largest first), sorted: int64 [n]."""
    idx = np.flatnonzero(maxima > ratio * np.median(maxima))
    if len(idx) > most:
        idx = idx[np.argsort(maxima[idx])[::-1][:most]]
    return np.sort(idx).astype(np.int64)


def _check_shared(source_file: Path, beside_dst: Path) -> None:
    """Raise DSparkError unless ``beside_dst`` is the file ``source_file`` or a copy of it (same size; a prompt graph
    reads it in place)."""
    same = beside_dst.is_file() and source_file.is_file() and (
        os.path.samefile(source_file, beside_dst) or beside_dst.stat().st_size == source_file.stat().st_size)
    if not same:
        raise DSparkError(f"the prompt graph would read {source_file.name} in place, but {beside_dst.parent} does not "
                          f"hold {source_file} (write the prompt graph beside its target, or link the file there)")


def integer_prompt_graph(src: Path, dst: Path, *, weight_bits: int, keep=(), outliers=None,
                         share_source_data: bool = False, log=print) -> dict:
    """Write ``dst`` (+ ``dst.data``): the prompt graph of the int4 graph ``src`` (module docstring), streaming one
    weight at a time; the LM head and the projections whose module name matches a regex of ``keep`` stay
    MatMulNBits. ``outliers``: {activation: int64 input channels} (:func:`outlier_channels`) computed apart, in fp32
    with the represented weight's rows (the integer path sees those channels as 0 and its column scales leave
    their rows out). ``share_source_data``: the initializers kept unchanged (the embedding, the LM head, norms) stay
    where they are, in ``src``'s external data files, which ``dst``'s folder must hold (the same files: an engine
    directory, or a stage linking them), instead of being copied into ``dst.data``. Returns {"replaced": weight
    nodes replaced, "kept": those kept, "kept_gguf": the MatMulGGUF among them (the prompt graph then needs the kernels), "outlier_channels": total, "weight_bits", "integer_weight_bytes",
    "shared_files": the source data files read in place, "shared_bytes", "seconds", "peak_rss_gb"}. Raises
    DSparkError when ``src`` has no MatMulNBits to replace, ``weight_bits`` is not 7 or 8, or ``share_source_data``
    and ``dst``'s folder lacks a data file of ``src``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if weight_bits not in (7, 8):
        raise DSparkError(f"weight_bits must be 7 or 8, got {weight_bits!r}")
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    proto = onnx.load(str(src), load_external_data=False)
    g = proto.graph
    reader = ExternalData(src.parent)
    inits = {t.name: t for t in g.initializer}

    def array(name: str) -> np.ndarray:
        t = inits[name]
        return np.frombuffer(reader.read(t), helper.tensor_dtype_to_np_dtype(t.data_type)).reshape(tuple(t.dims))

    head = _lm_head(g)
    prod = {o: n for n in g.node for o in n.output}
    cons: dict = {}
    for n in g.node:
        for i in n.input:
            cons.setdefault(i, []).append(n)
    # 8-bit block-sum corrections (gguf-compact) are MatMulNBits too: replaced with the weight they correct (in graphs
    # whose merged corrections are read through a Split, built before nbits_fuse merged them with their weights, on
    # their own like a weight over the block sums)
    corrections = {id(prod[n.input[1]]) for n in g.node if n.op_type == "Sub" and n.input[1] in prod
                   and prod[n.input[1]].op_type == _NBITS and n.input[0] in prod and prod[n.input[0]].op_type == _NBITS}
    opset = default_opset(proto)
    consts = [numpy_helper.from_array(v, k) for k, v in (
        ("__prompt_c127", np.array(127, np.float32)), ("__prompt_c1", np.array(1, np.float32)),
        ("__prompt_tiny", np.array(1e-30, np.float32)), ("__prompt_z128", np.array(128, np.uint8)),
        ("__prompt_axis_last", np.array([-1], np.int64)))]
    quantized: dict = {}  # activation -> (uint8 tensor, per-row scale)
    rows_shape: set = set()  # the widths K of the activations flattened to rows ([-1, K] shape constants)
    replace: dict = {}  # id(node) -> the nodes at its place
    drop: set = set()
    new_inits, replaced, kept, kept_gguf, nbytes, n_apart = [], 0, 0, 0, 0, 0
    with ExternalWriter(dst) as writer:
        for node in list(g.node):
            if node.op_type not in _WEIGHT_OPS or node.input[1] not in inits or id(node) in corrections:
                continue
            if node is head or any(re.search(k, module_name(node)) for k in keep):
                kept += 1
                kept_gguf += node.op_type == OP_MATMUL_GGUF
                continue
            out, corr, y = node.output[0], None, node.output[0]
            subs = [c for c in cons.get(out, []) if c.op_type == "Sub" and c.input[0] == out]
            if subs and len(cons[out]) == 1:
                cnode = prod.get(subs[0].input[1])
                if cnode is not None and cnode.op_type == "MatMul" and cnode.input[1] in inits:
                    corr = array(cnode.input[1]).astype(np.float32)
                elif cnode is not None and cnode.op_type == _NBITS and cnode.input[1] in inits:
                    corr = NBitsWeight.from_node(cnode, array).dequantize()[:node_attributes(cnode)["K"]]
                if corr is not None:
                    y = subs[0].output[0]
                    drop.update({id(subs[0]), id(cnode)})
            if node.op_type == OP_MATMUL_GGUF:
                w = gguf_weight(node, array)
            else:
                w = NBitsWeight.from_node(node, array, corr).dequantize()[:node_attributes(node)["K"]]  # K padded
            x, nodes, mk = node.input[0], [], helper.make_node
            apart = np.asarray((outliers or {}).get(x, ()), np.int64)
            name = node.name or out
            if len(apart):
                new_inits.append(writer.put([w[apart]], f"{name}_prompt_Wout", TensorProto.FLOAT, w[apart].shape))
                w = w.copy()
                w[apart] = 0.0
            wq, ws = column_int8(w, weight_bits)
            new_inits += [writer.put([wq], f"{name}_prompt_Wq", TensorProto.INT8, wq.shape),
                          writer.put([ws], f"{name}_prompt_ws", TensorProto.FLOAT, ws.shape)]
            nbytes += wq.nbytes
            if x not in quantized:
                b = f"{x}_prompt"
                xin = x
                if len(apart):  # the outlier channels: gathered for the fp32 product, zeroed for the integer one
                    mask = np.ones(w.shape[0], np.float32)
                    mask[apart] = 0.0
                    new_inits += [writer.put([mask], b + "_mask", TensorProto.FLOAT, mask.shape),
                                  numpy_helper.from_array(apart, b + "_apart")]
                    nodes += [mk("Mul", [x, b + "_mask"], [b + "_in"], name=b + "_in"),
                              mk("Gather", [x, b + "_apart"], [b + "_out"], axis=-1, name=b + "_out")]
                    xin = b + "_in"
                    n_apart += len(apart)
                reduce = (mk("ReduceMax", [b + "_abs", "__prompt_axis_last"], [b + "_max"], keepdims=1,
                             name=b + "_max") if opset >= 18
                          else mk("ReduceMax", [b + "_abs"], [b + "_max"], axes=[-1], keepdims=1, name=b + "_max"))
                # one scale per row; the rows flattened for QuantizeLinear's per-axis form (axis 0), then reshaped
                # back (x / s rounded half to even, + 128, saturated: what Div, Round, Add and Cast computed)
                nodes += [mk("Abs", [xin], [b + "_abs"], name=b + "_abs"), reduce,
                          mk("Div", [b + "_max", "__prompt_c127"], [b + "_s0"], name=b + "_s0"),
                          mk("Max", [b + "_s0", "__prompt_tiny"], [b + "_scale"], name=b + "_scale"),
                          mk("Reshape", [b + "_scale", "__prompt_axis_last"], [b + "_s1"], name=b + "_s1"),
                          mk("Shape", [b + "_s1"], [b + "_rows"], name=b + "_rows"),
                          mk("Expand", ["__prompt_z128", b + "_rows"], [b + "_zp"], name=b + "_zp"),
                          mk("Reshape", [xin, "__prompt_rows_" + str(w.shape[0])], [b + "_x2"], name=b + "_x2"),
                          mk("QuantizeLinear", [b + "_x2", b + "_s1", b + "_zp"], [b + "_u8rows"], axis=0,
                             name=b + "_quantize"),
                          mk("Shape", [xin], [b + "_shape"], name=b + "_shape"),
                          mk("Reshape", [b + "_u8rows", b + "_shape"], [b + "_u8"], name=b + "_u8")]
                rows_shape.add(w.shape[0])
                quantized[x] = (b + "_u8", b + "_scale")
            xu, s = quantized[x]
            y_int = f"{name}_prompt_int" if len(apart) else y
            nodes += [mk("MatMulIntegerToFloat", [xu, f"{name}_prompt_Wq", "__prompt_c1", f"{name}_prompt_ws",
                                                  "__prompt_z128"], [f"{name}_prompt_cols"],
                         domain="com.microsoft", name=f"{name}_prompt_gemm"),
                      mk("Mul", [f"{name}_prompt_cols", s], [y_int], name=f"{name}_prompt_rows")]
            if len(apart):
                nodes += [mk("MatMul", [f"{x}_prompt_out", f"{name}_prompt_Wout"], [f"{name}_prompt_fp32"],
                             name=f"{name}_prompt_fp32"),
                          mk("Add", [y_int, f"{name}_prompt_fp32"], [y], name=f"{name}_prompt_sum")]
            replace[id(node)] = nodes
            replaced += 1
        if not replaced:
            raise DSparkError(f"{src} has no weight MatMulNBits to replace (is it an int4 graph?)")
        body = []
        for node in g.node:
            if id(node) not in drop:
                body.extend(replace.get(id(node), [node]))
        set_live_nodes(g, body)  # drops the block sums of replaced corrections
        read = {i for n in g.node for i in n.input}
        kept_inits, shared, shared_bytes = [], set(), 0
        for t in g.initializer:
            if t.name not in read:
                continue
            loc = (reader.info(t) or {}).get("location")
            if share_source_data and loc is not None:
                _check_shared(src.parent / loc, dst.parent / loc)
                shared.add(loc)
                shared_bytes += reader.nbytes(t)
                kept_inits.append(t)  # its external_data entries already name the shared file and its offset
            else:
                kept_inits.append(writer.copy(t, reader))
        consts += [numpy_helper.from_array(np.array([-1, k], np.int64), f"__prompt_rows_{k}") for k in rows_shape]
    reader.close()
    del g.initializer[:]
    g.initializer.extend(kept_inits + [t for t in consts + new_inits if t.name in read])
    live = {o for n in g.node for o in n.output}
    vis = [vi for vi in g.value_info if vi.name in live]
    del g.value_info[:]
    g.value_info.extend(vis)
    onnx.save_model(proto, str(dst))
    rep = {"replaced": replaced, "kept": kept, "kept_gguf": kept_gguf, "outlier_channels": n_apart, "weight_bits": weight_bits,
           "integer_weight_bytes": nbytes, "shared_files": sorted(shared), "shared_bytes": shared_bytes,
           "seconds": round(time.perf_counter() - t0, 1), "peak_rss_gb": round(peak_rss_gb(), 2)}
    log(f"  prompt graph: {replaced} weight MatMuls -> MatMulIntegerToFloat (u8 x s{weight_bits}), {kept} kept, "
        f"{n_apart} outlier input channels in fp32; "
        + (f"{shared_bytes / 2 ** 30:.2f} GiB read in place from {', '.join(sorted(shared))}; " if shared else "")
        + f"{nbytes / 2 ** 30:.2f} GiB of integer weights in {rep['seconds']:.0f} s, peak RSS {rep['peak_rss_gb']:.2f} GiB")
    return rep


