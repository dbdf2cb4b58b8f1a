"""Fusions of an exported decoder graph for ONNX Runtime, no torch: each rewrites a pattern of many small nodes the
exporter writes into one ONNX Runtime contrib operator, so a decoding step runs fewer kernels. The CUDA device graph
takes both (docs/gpu.md "Where the step goes"); the int4 CPU graphs the rotary one (docs/precision.md "The rotary
embeddings fused").

:func:`fuse_rotary`: the rotary position embedding of every query and key (HF's ``x * cos + rotate_half(x) * sin`` on
the heads: Mul, Slice, Slice, Neg, Concat, Mul, Add — seven kernels each) as one ``com.microsoft.RotaryEmbedding``
applied to the projection's output [batch, q_len, heads * head_dim] before its head reshape, reading cos/sin tables
precomputed from the graph's own inverse frequencies (float64, then the graph's float type).

:func:`merge_sibling_matmuls`: the projections that read one activation (Q/K/V; gate/up) as one MatMul (+ one bias
Add) and a Split.

:func:`share_shape_reads`: every layer's ``Shape`` of its own cache input (the cache length its mask slice and
reshapes need) reads one input of the same declared shape instead, so ONNX Runtime's common-subexpression elimination
keeps one copy of those shape computations rather than one per layer (exact: no value changes).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError

from dspark_export.graphs.onnx_io import default_opset

MS_DOMAIN = "com.microsoft"


def _graph_maps(g):
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    return producer, consumers


def _inverse_frequencies(g) -> np.ndarray:
    """The graph's RoPE inverse frequencies: the initializer named ``*rotary_emb.inv_freq`` (float32 [head_dim / 2]).
    Raises DSparkError when there is none (an export this code does not know)."""
    from onnx import numpy_helper

    for t in g.initializer:
        if t.name.endswith("rotary_emb.inv_freq"):
            return numpy_helper.to_array(t).astype(np.float64)
    raise DSparkError("the graph has no rotary_emb.inv_freq initializer; RoPE fusion needs the HF export's")


def fuse_rotary(model, max_positions: int) -> int:
    """Rewrite every HF rotary embedding of ``model`` (an ``onnx.ModelProto``, changed in place; external weights
    untouched) as ``com.microsoft.RotaryEmbedding`` with cos/sin tables for positions 0..``max_positions``-1.
    Returns how many were fused (2 per layer: query and key). A match must be exactly the exporter's pattern
    (Add(Mul(X, cos), Mul(Concat(Neg(Slice(X)), Slice(X)), sin)) with X = Transpose[0, 2, 1, 3](Reshape(P))); anything
    else is left as it is, and a graph without a ``position_ids`` input (the op reads the table at those positions) is
    returned untouched (0). Positions at or past ``max_positions`` are refused by the op at run time."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    if "position_ids" not in {i.name for i in g.input}:
        return 0
    producer, consumers = _graph_maps(g)
    found = []
    for neg in [n for n in g.node if n.op_type == "Neg"]:
        second = producer.get(neg.input[0])
        cat = consumers.get(neg.output[0], [])
        if second is None or second.op_type != "Slice" or len(cat) != 1 or cat[0].op_type != "Concat":
            continue
        cat = cat[0]
        if list(cat.input)[:1] != [neg.output[0]] or len(cat.input) != 2:
            continue
        first = producer.get(cat.input[1])
        if first is None or first.op_type != "Slice" or first.input[0] != second.input[0]:
            continue
        x = second.input[0]
        mul_sin = consumers.get(cat.output[0], [])
        if len(mul_sin) != 1 or mul_sin[0].op_type != "Mul":
            continue
        mul_sin = mul_sin[0]
        add = consumers.get(mul_sin.output[0], [])
        if len(add) != 1 or add[0].op_type != "Add":
            continue
        add = add[0]
        other = add.input[1] if add.input[0] == mul_sin.output[0] else add.input[0]
        mul_cos = producer.get(other)
        if mul_cos is None or mul_cos.op_type != "Mul" or x not in mul_cos.input:
            continue
        tr = producer.get(x)
        perm = next((list(a.ints) for a in tr.attribute if a.name == "perm"), None) if tr is not None else None
        if tr is None or tr.op_type != "Transpose" or perm != [0, 2, 1, 3]:
            continue
        rs = producer.get(tr.input[0])
        if rs is None or rs.op_type != "Reshape":
            continue
        found.append((rs, tr, add, {id(n) for n in (mul_cos, first, second, neg, cat, mul_sin, add)}))
    if not found:
        return 0
    types = {vi.name: vi.type.tensor_type.elem_type for vi in (*g.value_info, *g.input, *g.output)}
    elem = _float_type(model, found[0][0].input[0], types)
    np_type = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    inv = _inverse_frequencies(g)
    freqs = np.outer(np.arange(max_positions, dtype=np.float64), inv)
    cos_name, sin_name = "rotary_cos_cache", "rotary_sin_cache"
    g.initializer.extend([numpy_helper.from_array(np.cos(freqs).astype(np_type), cos_name),
                          numpy_helper.from_array(np.sin(freqs).astype(np_type), sin_name)])
    dead = set()
    for i, (rs, tr, add, nodes) in enumerate(found):
        proj = rs.input[0]
        rot = f"{proj}.rotary"
        node = helper.make_node("RotaryEmbedding", [proj, "position_ids", cos_name, sin_name], [rot],
                                name=f"rotary_embedding_{i}", domain=MS_DOMAIN, interleaved=0)
        g.node.insert(list(g.node).index(rs), node)
        rs.input[0] = rot
        if all(id(c) in nodes for c in consumers.get(tr.output[0], [])):
            tr.output[0] = add.output[0]  # the rotated heads keep their name (a graph output's, e.g. new.L.key)
        else:
            if add.output[0] in {o.name for o in g.output}:
                raise DSparkError(f"RoPE output {add.output[0]} is a graph output and its unrotated heads are read "
                                  "elsewhere; cannot fuse")
            for c in consumers.get(add.output[0], []):  # the rotated heads are now the Transpose's output
                c.input[:] = [tr.output[0] if v == add.output[0] else v for v in c.input]
        dead |= nodes
    keep = [n for n in g.node if id(n) not in dead]
    del g.node[:]
    g.node.extend(keep)
    _prune(g)
    if not any(op.domain == MS_DOMAIN for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return len(found)


def _float_type(model, name: str, known: dict) -> int:
    """The element type of tensor ``name``: from the graph's type annotations, else by shape inference."""
    import onnx

    if name in known:
        return known[name]
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    for vi in inferred.graph.value_info:
        if vi.name == name:
            return vi.type.tensor_type.elem_type
    # a 16-bit copy's projections follow its weights: the first float initializer's type
    return next((t.data_type for t in model.graph.initializer if t.data_type in (1, 10, 16)), 1)


def _prune(g) -> None:
    """Drop nodes whose outputs nothing reads (the pattern's leftovers: the cos/sin unsqueezes), then the in-graph
    initializers nothing reads (the pattern's slice bounds, the inverse frequencies); external ones stay in their
    file untouched."""
    from onnx import TensorProto

    outputs = {o.name for o in g.output}
    while True:
        used = {i for n in g.node for i in n.input} | outputs
        keep = [n for n in g.node if any(o in used for o in n.output)]
        if len(keep) == len(g.node):
            break
        del g.node[:]
        g.node.extend(keep)
    unread = [t for t in g.initializer if t.name not in used and t.data_location != TensorProto.EXTERNAL]
    for t in unread:
        g.initializer.remove(t)


def share_shape_reads(model) -> int:
    """Point every ``Shape`` node that reads a graph input at the first graph input of the same declared type (element
    type and dims, every dim a fixed size or a named one: ONNX gives equal names equal sizes), e.g. each layer's
    ``Shape(past.L.value)`` at ``past.0.key``; ONNX Runtime's common-subexpression elimination then merges the
    now-identical shape computations that follow (Shape, Concat, the mask's Slice: ~4 nodes a layer). ``model`` is
    changed in place; values are unchanged. Returns how many Shape nodes were re-pointed."""
    first: dict = {}  # declared type -> the first input of it
    alias: dict = {}
    for i in model.graph.input:
        t = i.type.tensor_type
        dims = tuple(d.dim_param or d.dim_value for d in t.shape.dim) if t.HasField("shape") else None
        if dims is None or any(d in ("", 0) for d in dims):  # an undeclared dim: sizes not known to be equal
            continue
        alias[i.name] = first.setdefault((t.elem_type, dims), i.name)
    n = 0
    for node in model.graph.node:
        if node.op_type == "Shape" and alias.get(node.input[0], node.input[0]) != node.input[0]:
            node.input[0] = alias[node.input[0]]
            n += 1
    return n


def fuse_file(path: Path, max_positions: int, merge: bool = False) -> dict:
    """:func:`fuse_rotary`, :func:`share_shape_reads` and, with ``merge`` (the graph owns its weight file),
    :func:`merge_sibling_matmuls` on the graph file ``path`` (rewritten in place). Returns how many of each were done:
    {"rotary", "shapes", "merged"}."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    done = {"rotary": fuse_rotary(model, max_positions), "shapes": share_shape_reads(model),
            "merged": merge_sibling_matmuls(model, path.parent) if merge else 0}
    if any(done.values()):
        onnx.save_model(model, str(path))
    return done


def merge_sibling_matmuls(model, weights_dir: Path) -> int:
    """Merge the MatMuls that read one activation with constant weights [K, N_i] (a layer's Q/K/V projections; its
    gate and up projections) into one MatMul over the concatenated weights [K, sum N_i], their bias Adds (when every
    one has one) into one Add, then a Split: two or three GEMM launches become one, and small-N GEMMs (K/V) join a
    larger one. ``model`` is changed in place; its external weights are rewritten into a fresh file at the same
    location under ``weights_dir`` (the merged tensors added, the replaced ones dropped). Returns how many groups were
    merged. Only groups whose weights all live in one external data file are merged."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producer, consumers = _graph_maps(g)
    groups: dict = {}
    for n in g.node:
        w = inits.get(n.input[1]) if n.op_type == "MatMul" and len(n.input) == 2 else None
        if w is not None and len(w.dims) == 2 and w.data_location == TensorProto.EXTERNAL:
            groups.setdefault(n.input[0], []).append(n)
    groups = {k: v for k, v in groups.items() if len(v) > 1
              and len({(inits[n.input[1]].dims[0], inits[n.input[1]].data_type) for n in v}) == 1}
    if not groups:
        return 0
    files = {next(e.value for e in inits[n.input[1]].external_data if e.key == "location")
             for v in groups.values() for n in v}
    if len(files) != 1:
        return 0
    location = files.pop()
    src_path = Path(weights_dir) / location

    def read(t) -> bytes:
        ext = {e.key: e.value for e in t.external_data}
        with open(src_path, "rb") as f:
            f.seek(int(ext.get("offset", 0)))
            return f.read(int(ext["length"]))

    np16 = {TensorProto.FLOAT16: np.uint16, TensorProto.BFLOAT16: np.uint16, TensorProto.FLOAT: np.float32}
    new_tensors, dead, opset = {}, set(), default_opset(model)
    merged_groups = 0
    for gi, (x, mms) in enumerate(groups.items()):
        ws = [inits[n.input[1]] for n in mms]
        dt = np16.get(ws[0].data_type)
        if dt is None:
            continue
        k = ws[0].dims[0]
        widths = [int(w.dims[1]) for w in ws]
        merged = np.concatenate([np.frombuffer(read(w), dt).reshape(k, -1) for w in ws], axis=1)
        wname = f"merged_{gi}.weight"
        new_tensors[wname] = (merged, ws[0].data_type)
        adds = [consumers.get(n.output[0], []) for n in mms]
        bias = None
        if all(len(a) == 1 and a[0].op_type == "Add" for a in adds):
            adds = [a[0] for a in adds]
            bnames = [a.input[1] if a.input[0] == n.output[0] else a.input[0] for a, n in zip(adds, mms)]
            bts = [inits.get(b) for b in bnames]
            if all(b is not None and list(b.dims) == [w] for b, w in zip(bts, widths)):
                vals = [np.frombuffer(read(b), dt) if b.data_location == TensorProto.EXTERNAL
                        else numpy_helper.to_array(b).view(dt) if dt == np.uint16 else numpy_helper.to_array(b)
                        for b in bts]
                bias = f"merged_{gi}.bias"
                new_tensors[bias] = (np.concatenate(vals), bts[0].data_type)
        outs = [a.output[0] for a in adds] if bias else [n.output[0] for n in mms]
        mm_out = f"merged_{gi}.matmul"
        nodes = [helper.make_node("MatMul", [x, wname], [mm_out], name=f"merged_matmul_{gi}")]
        split_in = mm_out
        if bias:
            nodes.append(helper.make_node("Add", [mm_out, bias], [f"merged_{gi}.add"], name=f"merged_add_{gi}"))
            split_in = f"merged_{gi}.add"
            dead |= {id(a) for a in adds}
        sizes = f"merged_{gi}.split"
        g.initializer.append(numpy_helper.from_array(np.array(widths, np.int64), sizes))
        if opset >= 13:
            nodes.append(helper.make_node("Split", [split_in, sizes], outs, name=f"merged_split_{gi}", axis=-1))
        else:
            nodes.append(helper.make_node("Split", [split_in], outs, name=f"merged_split_{gi}", axis=-1,
                                          split=widths))
        at = list(g.node).index(mms[0])
        for j, node in enumerate(nodes):
            g.node.insert(at + j, node)
        dead |= {id(n) for n in mms}
        merged_groups += 1
    keep = [n for n in g.node if id(n) not in dead]
    del g.node[:]
    g.node.extend(keep)
    _rewrite_weights(model, src_path, new_tensors)
    return merged_groups


def _rewrite_weights(model, path: Path, new_tensors: dict) -> None:
    """Write ``path`` afresh with the external initializers ``model`` still reads (copied from the old file) plus
    ``new_tensors`` ({name: (array, onnx data type)}, added as initializers), one tensor at a time; initializers
    nothing reads any more are dropped."""
    from onnx import TensorProto

    g = model.graph
    used = {i for n in g.node for i in n.input}
    keep = [t for t in g.initializer if t.name in used]
    for name, (arr, data_type) in new_tensors.items():
        t = TensorProto(name=name, data_type=data_type)
        t.dims.extend(arr.shape)
        keep.append(t)
    tmp = path.with_name(path.name + ".tmp")
    with open(path, "rb") as src, open(tmp, "wb") as out:
        for t in keep:
            if t.name in new_tensors:
                raw = new_tensors[t.name][0].tobytes()
            elif t.data_location == TensorProto.EXTERNAL:
                ext = {e.key: e.value for e in t.external_data}
                src.seek(int(ext.get("offset", 0)))
                raw = src.read(int(ext["length"]))
            else:
                continue
            offset = out.tell()
            out.write(raw)
            del t.external_data[:]
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", path.name), ("offset", str(offset)), ("length", str(len(raw)))):
                t.external_data.add(key=k, value=v)
    del g.initializer[:]
    g.initializer.extend(keep)
    tmp.replace(path)
