"""Weights kept as the GGUF's own Q4_K / Q6_K blocks for DSpark's ``ai.dspark.MatMulGGUF`` kernel
(:mod:`dspark_runtime.kernels`; ``int4_source`` ``gguf-kernel``): the graph-side half.

A weight MatMul ``x·W`` (W ``[K, N]``) becomes ``MatMulGGUF(x, W_gguf)`` with ``W_gguf`` the tensor's bytes as the
GGUF stores them (N rows of K/256 blocks; :func:`matmul_gguf_node`), checked against the graph's fp32 weight first
(:func:`check_blocks`). :func:`fuse_gguf_shared_inputs` then merges the nodes that read one activation (a layer's
q/k/v, its gate/up) into one node over the concatenated rows, whatever their block types, followed by a ``Split``:
each output element is the same dot product as before, so the merge is bit-identical. :func:`place_kernels` puts
the compiled library (:mod:`dspark_export.kernels.build`) beside the graph.
"""
from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError
from dspark_runtime.kernels import DOMAIN, GGML_TYPES, LIBRARY_NAME, OP_MATMUL_GGUF  # noqa: F401 (re-exported)

from dspark_export.graphs.onnx_io import node_attributes, read_initializer, rewrite_in_place
from dspark_export.kernels.build import build_kernels

BLOCKS_SUFFIX = "_gguf"  # the initializer holding a weight's GGUF blocks: <weight name>_gguf
_ROW_CHUNK = 4096        # rows dequantized per step by the check


def check_blocks(gt, qtype: str, full: np.ndarray, gname: str, module: str) -> float:
    """Max |Δ| between GGUF tensor ``gt``'s dequantized rows and the graph's fp32 weight ``full`` ``[K, N]`` (the
    tensor the blocks replace). Raises DSparkError when they differ: the GGUF is not the one the model was converted
    from."""
    from gguf import GGMLQuantizationType, quants

    k, n = full.shape
    worst = 0.0
    for a in range(0, n, _ROW_CHUNK):
        b = min(n, a + _ROW_CHUNK)
        w = quants.dequantize(np.asarray(gt.data[a:b]), GGMLQuantizationType[qtype]).reshape(b - a, k)
        ref = full[:, a:b].T
        d = float(np.abs(w - ref).max())
        if d > 1e-5 * max(1.0, float(np.abs(ref).max())):
            raise DSparkError(f"the GGUF's {gname} ({qtype}) differs from the graph's weight of {module} by {d:.3g}; "
                              "the GGUF is not the one the model was converted from (use --int4-source rtn)")
        worst = max(worst, d)
    return worst


def matmul_gguf_node(helper, name: str, x: str, blocks: str, y: str, k: int, n: int, ggml_type: int):
    """``y = MatMulGGUF(x, blocks)``: one weight of ``n`` rows of GGML type ``ggml_type``."""
    return helper.make_node(OP_MATMUL_GGUF, [x, blocks], [y], name=name, domain=DOMAIN, K=k, N=n,
                            segment_rows=[n], segment_types=[ggml_type])


def add_kernels_opset(proto, helper) -> None:
    """Declare the ``ai.dspark`` domain (version 1) in ``proto`` when it is not yet."""
    if not any(o.domain == DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def gguf_weight(node, array) -> np.ndarray:
    """The float32 weight ``[K, N]`` a MatMulGGUF ``node`` computes with: its segments' blocks dequantized.
    ``array(name)``: an initializer of the graph as a numpy array."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    a = node_attributes(node)
    k, blocks, rows, at = a["K"], array(node.input[1]).reshape(-1), [], 0
    names = {v: n for n, v in GGML_TYPES.items()}
    for n_rows, t in zip(a["segment_rows"], a["segment_types"]):
        qtype = GGMLQuantizationType[names[t]]
        size = n_rows * (k // 256) * GGML_QUANT_SIZES[qtype][1]
        rows.append(quants.dequantize(blocks[at:at + size].reshape(n_rows, -1), qtype).reshape(n_rows, k))
        at += size
    return np.concatenate(rows).T.astype(np.float32)


def place_kernels(folder: Path, log=print) -> Path:
    """Copy the compiled library (built or taken from the cache) into ``folder`` as :data:`LIBRARY_NAME`."""
    dst = Path(folder) / LIBRARY_NAME
    shutil.copy2(build_kernels(log=log), dst)
    return dst


def fuse_gguf_shared_inputs(path: Path, log=print) -> dict:
    """Merge the MatMulGGUF nodes of graph ``path`` that read the same activation, in place: one node at the first
    member's place (every member reads an activation available there) over the members' blocks concatenated, its
    segments the members' in order, then a ``Split`` writing the members' outputs. Returns ``{"groups": merged
    groups, "nodes": [before, after]}``; a graph with nothing to merge is left untouched."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    path = Path(path)
    proto = onnx.load(str(path), load_external_data=False)
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    groups = defaultdict(list)
    for node in g.node:
        if node.op_type == OP_MATMUL_GGUF and node.domain == DOMAIN and node.input[1] in inits:
            groups[(node.input[0], node_attributes(node)["K"])].append(node)
    merged = [ms for ms in groups.values() if len(ms) > 1]
    before = len(g.node)
    if not merged:
        return {"groups": 0, "nodes": [before, before]}
    users = defaultdict(int)
    for node in g.node:
        for i in node.input:
            users[i] += 1
    first_of, gone = {}, set()
    plan = {}  # new initializer -> member initializers
    for ms in merged:
        base = f"{ms[0].name}_fused{len(ms)}"
        attrs = [node_attributes(m) for m in ms]
        rows = [r for a in attrs for r in a["segment_rows"]]
        types = [t for a in attrs for t in a["segment_types"]]
        plan[base + BLOCKS_SUFFIX] = [m.input[1] for m in ms]
        y = base + "_out"
        fused = helper.make_node(OP_MATMUL_GGUF, [ms[0].input[0], base + BLOCKS_SUFFIX], [y], name=base,
                                 domain=DOMAIN, K=attrs[0]["K"], N=sum(rows), segment_rows=rows, segment_types=types)
        prop = fused.metadata_props.add()
        prop.key, prop.value = "dspark.fused", ",".join(m.name for m in ms)
        sizes = base + "_split_sizes"
        g.initializer.append(numpy_helper.from_array(np.array([a["N"] for a in attrs], np.int64), sizes))
        split = helper.make_node("Split", [y, sizes], [m.output[0] for m in ms], axis=-1, name=base + "_Split")
        first_of[id(ms[0])] = [fused, split]
        gone.update(id(m) for m in ms)
    nodes = []
    for node in g.node:
        if id(node) in first_of:
            nodes += first_of[id(node)]
        elif id(node) not in gone:
            nodes.append(node)
    dropped = {t for parts in plan.values() for t in parts if users[t] == 1}
    with rewrite_in_place(path, "fuse-gguf") as rw:
        new_inits = [rw.writer.copy(t, rw.reader) for t in list(g.initializer) if t.name not in dropped]
        for name, parts in plan.items():
            new_inits.append(rw.writer.put((read_initializer(inits[p], rw.reader).reshape(-1) for p in parts), name,
                                           TensorProto.UINT8, (sum(int(inits[p].dims[0]) for p in parts),)))
        del g.node[:]
        g.node.extend(nodes)
        del g.initializer[:]
        g.initializer.extend(new_inits)
        rw.proto = proto
    log(f"  merged {sum(len(ms) for ms in merged)} MatMulGGUF reading a shared input into {len(merged)}: "
        f"{before} -> {len(nodes)} nodes")
    return {"groups": len(merged), "nodes": [before, len(nodes)]}
