"""Fewer, larger MatMulNBits (:func:`fuse_shared_inputs`): the weight MatMuls of an int4 graph that read the same
activation (a layer's q/k/v, its gate/up) become one ``com.microsoft.MatMulNBits`` over the weights concatenated
along the output channels, then one ``Split``; a decoding step then pays the per-node cost once per group.

Merged: nodes with the same activation input, ``K``, ``bits``, ``block_size``, ``accuracy_level``, zero-point presence
and type, correction (none, an fp32 ``MatMul`` or an 8-bit ``MatMulNBits`` over the shared block sums,
:mod:`dspark_export.precision.nbits`; merged along the output channels like the weights) and bias presence; nodes
with ``g_idx`` or ``bias`` inputs already are left alone. Invariant: the merged graph computes bit for bit what the
unmerged one did (each output column is the same dot product over the same blocks; a bias goes into the kernel only
where there is no correction, else one ``Add`` after the ``Sub`` keeps the rounding order; tests/export/precision/test_nbits.py checks
it). The rewrite streams: weights are read per group and copied in chunks into a new ``.data`` file.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError

from dspark_export.graphs.onnx_io import node_attributes, read_initializer, rewrite_in_place


@dataclass
class _Member:
    node: object            # the MatMulNBits NodeProto
    n: int                  # its output channels
    final: str              # the tensor carrying x @ W (+ bias): what the Split writes
    removed: list = field(default_factory=list)  # nodes replaced by the merged ones (correction, bias Add)
    corr_weight: str | None = None  # an fp32 correction's weight ([K/block, N], a MatMul over the block sums)
    corr_node: object = None        # an 8-bit correction (a MatMulNBits over the block sums, gguf-compact)
    bias: str | None = None


def _toposort(nodes: list, available: set) -> list:
    """``nodes`` in an order where every input is produced before use (Kahn; the given order breaks ties)."""
    produced_by = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    deps = [{produced_by[x] for x in n.input if x and x in produced_by and x not in available} for n in nodes]
    users = defaultdict(list)
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    import heapq

    ready = [i for i, ds in enumerate(deps) if not ds]
    heapq.heapify(ready)
    left = [len(ds) for ds in deps]
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(nodes[i])
        for u in users[i]:
            left[u] -= 1
            if left[u] == 0:
                heapq.heappush(ready, u)
    if len(out) != len(nodes):
        raise DSparkError("merging MatMulNBits nodes left a cycle in the graph (a bug); rebuild without it")
    return out


def fuse_shared_inputs(path: Path, log=print) -> dict:
    """Merge the MatMulNBits nodes of graph ``path`` (with its ``<name>.data`` beside it) that read the same
    activation, in place (see the module doc).

    Returns ``{"groups": number of merged groups, "matmul_nbits_nodes": [before, after], "nodes": [before,
    after]}``; a graph with nothing to merge is left untouched. Raises DSparkError on a malformed graph.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    path = Path(path)
    proto = onnx.load(str(path), load_external_data=False)
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    consumers, producer = defaultdict(list), {}
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)
        for o in n.output:
            producer[o] = n
    outputs = {o.name for o in g.output}
    before = (sum(n.op_type == "MatMulNBits" for n in g.node), len(g.node))

    groups = defaultdict(list)
    for n in g.node:
        if n.op_type != "MatMulNBits" or n.domain != "com.microsoft" or len(n.input) > 4:
            continue
        if any(i and i not in inits for i in n.input[1:]):
            continue
        a = node_attributes(n)
        m = _Member(n, int(a["N"]), n.output[0])
        cons = consumers[m.final]
        if m.final not in outputs and len(cons) == 1 and cons[0].op_type == "Sub" and cons[0].input[0] == m.final:
            sub = cons[0]
            cm = producer.get(sub.input[1])
            if cm is not None and cm.op_type == "MatMul" and cm.input[1] in inits and len(consumers[cm.output[0]]) == 1:
                m.removed += [cm, sub]
                m.corr_weight, m.final = cm.input[1], sub.output[0]
            elif (cm is not None and cm.op_type == "MatMulNBits" and len(cm.input) <= 4
                  and len(consumers[cm.output[0]]) == 1 and all(i in inits for i in cm.input[1:] if i)):
                m.removed += [cm, sub]
                m.corr_node, m.final = cm, sub.output[0]
        cons = consumers[m.final]
        if m.final not in outputs and len(cons) == 1 and cons[0].op_type == "Add":
            add = cons[0]
            other = add.input[1] if add.input[0] == m.final else add.input[0]
            t = inits.get(other)
            if t is not None and list(t.dims) == [m.n] and t.data_type == TensorProto.FLOAT:
                m.removed.append(add)
                m.bias, m.final = other, add.output[0]
        zp = n.input[3] if len(n.input) > 3 and n.input[3] else None
        corr = None
        if m.corr_weight:
            corr = ("fp32", m.removed[0].input[0])
        elif m.corr_node is not None:
            c = node_attributes(m.corr_node)
            corr = ("nbits", m.corr_node.input[0], c["K"], c["bits"], c["block_size"], c.get("accuracy_level", 0),
                    len(m.corr_node.input) > 3 and bool(m.corr_node.input[3]))
        key = (n.input[0], a["K"], a["bits"], a["block_size"], a.get("accuracy_level", 0),
               None if zp is None else (inits[zp].data_type, len(inits[zp].dims)),
               len(inits[n.input[2]].dims), corr, m.bias is not None)
        groups[key].append(m)
    corrections = {id(m.corr_node) for ms in groups.values() for m in ms if m.corr_node is not None}
    groups = {k: [m for m in ms if id(m.node) not in corrections] for k, ms in groups.items()}  # merged with weights
    merged = [ms for ms in groups.values() if len(ms) > 1]
    if not merged:
        return {"groups": 0, "matmul_nbits_nodes": [before[0]] * 2, "nodes": [before[1]] * 2}

    # which initializers each merged group concatenates, and on which axis
    plan = {}   # new tensor name -> ([member tensor names], concatenation axis)
    skip = set()  # the members' tensors (dropped below unless something else reads them)
    new_nodes, gone = [], set()
    for gi, ms in enumerate(merged):
        first = ms[0].node
        base = f"{first.name}_fused{len(ms)}"
        ins = list(first.input)
        cat = {1: base + "_Q", 2: base + "_scales", 3: base + "_zp"}
        for slot, name in cat.items():
            if slot < len(ins) and ins[slot]:
                plan[name] = ([m.node.input[slot] for m in ms], 0)
        fused_in = [ins[0], cat[1], cat[2], cat[3] if len(ins) > 3 and ins[3] else ""]
        if ms[0].bias:
            plan[base + "_bias"] = ([m.bias for m in ms], 0)
            if not (ms[0].corr_weight or ms[0].corr_node):  # no correction: the kernel adds the bias (bit-identical)
                fused_in += ["", base + "_bias"]
        a = node_attributes(first)
        a["N"] = sum(m.n for m in ms)
        y = base + "_out"
        mm = helper.make_node("MatMulNBits", fused_in, [y], name=base, domain="com.microsoft", **a)
        mm.metadata_props.extend(first.metadata_props)
        prop = mm.metadata_props.add()
        prop.key, prop.value = "dspark.fused", ",".join(m.node.name for m in ms)
        new_nodes.append(mm)
        if ms[0].corr_weight or ms[0].corr_node:
            blocksum = ms[0].removed[0].input[0]
            if ms[0].corr_weight:
                plan[base + "_corr"] = ([m.corr_weight for m in ms], 1)
                new_nodes.append(helper.make_node("MatMul", [blocksum, base + "_corr"], [base + "_correction"],
                                                  name=base + "_correction_MatMul"))
            else:  # the 8-bit corrections concatenated along N like the weights
                c0 = ms[0].corr_node
                cins = [blocksum]
                for slot, suffix in ((1, "_corr_Q"), (2, "_corr_scales"), (3, "_corr_zp")):
                    if slot < len(c0.input) and c0.input[slot]:
                        plan[base + suffix] = ([m.corr_node.input[slot] for m in ms], 0)
                        cins.append(base + suffix)
                ca = node_attributes(c0)
                ca["N"] = sum(m.n for m in ms)
                new_nodes.append(helper.make_node("MatMulNBits", cins, [base + "_correction"], domain="com.microsoft",
                                                  name=base + "_correction_MatMulNBits", **ca))
            new_nodes.append(helper.make_node("Sub", [y, base + "_correction"], [base + "_sub"], name=base + "_Sub"))
            y = base + "_sub"
            if ms[0].bias:  # after the correction, as before: (x·W − c) + b rounds exactly like the separate nodes
                new_nodes.append(helper.make_node("Add", [y, base + "_bias"], [base + "_biased"], name=base + "_Add"))
                y = base + "_biased"
        split = base + "_split_sizes"
        proto.graph.initializer.append(numpy_helper.from_array(np.array([m.n for m in ms], np.int64), split))
        new_nodes.append(helper.make_node("Split", [y, split], [m.final for m in ms], axis=-1, name=base + "_Split"))
        for m in ms:
            gone.add(id(m.node))
            gone.update(id(r) for r in m.removed)

    # a member's tensor is dropped only when nothing else reads it (exporters share equal constants, e.g. zero biases)
    skip = {t for parts, _ in plan.values() for t in parts}
    skip = {t for t in skip if all(id(c) in gone for c in consumers[t]) and t not in outputs}
    nodes = [n for n in g.node if id(n) not in gone] + new_nodes
    avail = {i.name for i in g.input} | set(inits) | {t.name for t in proto.graph.initializer}
    nodes = _toposort(nodes, avail)

    with rewrite_in_place(path, "fuse") as rw:
        new_inits = [rw.writer.copy(t, rw.reader) for t in list(proto.graph.initializer) if t.name not in skip]
        for name, (parts, axis) in plan.items():
            out = np.concatenate([read_initializer(inits[p], rw.reader) for p in parts], axis=axis)
            new_inits.append(rw.writer.put([out], name, inits[parts[0]].data_type, out.shape))
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(new_inits)
        rw.proto = proto
    after = (sum(n.op_type == "MatMulNBits" for n in nodes), len(nodes))
    log(f"  merged {sum(len(ms) for ms in merged)} MatMulNBits reading a shared input into {len(merged)}: "
        f"{before[0]} -> {after[0]} MatMulNBits, {before[1]} -> {after[1]} nodes")
    return {"groups": len(merged), "matmul_nbits_nodes": [before[0], after[0]], "nodes": [before[1], after[1]]}
