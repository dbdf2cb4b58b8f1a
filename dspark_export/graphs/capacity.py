"""ONNX graph rewrites for TensorRT engines and device graphs (:mod:`dspark_export.engine_dir.trt_build`,
:mod:`dspark_export.graphs.device`), no torch: the capacity KV-layout variant of an exported ``causal_lm`` graph
(:func:`to_capacity_layout`), its 16-bit copy (:func:`to_half`), the precision a strongly typed TensorRT network takes
from a graph (:func:`graph_precision`), and running a rewrite in a fresh process (:func:`run_rewrite`).
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np

from dspark_runtime.engine_dir.graphspec import (ARGMAX, KV_LAYOUT_CAPACITY, KV_LAYOUT_GROWING, GraphSpec, causal_lm_spec,
                                      new_names, past_names, present_names)
from dspark_runtime.errors import DSparkError

ARGMAX_NODE = "capacity_argmax"  # the ArgMax node to_capacity_layout adds (to_half keeps it on the float32 logits)


def run_rewrite(fn, isolate: bool, *args) -> None:
    """``fn(*args)`` (a module-level function of this package; arguments Paths and strings), in a fresh Python
    process when ``isolate``, so the memory the rewrite held is returned to the system afterwards. Raises
    DSparkError when the process fails (its messages are on stderr)."""
    if not isolate:
        fn(*args)
        return
    code = (f"import json, sys; from pathlib import Path; from {fn.__module__} import {fn.__name__} as f; "
            "f(*[Path(v) if p else v for p, v in json.loads(sys.argv[1])])")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([[isinstance(a, Path), str(a)] for a in args])])
    if proc.returncode != 0:
        raise DSparkError(f"{fn.__name__}({', '.join(map(str, args))}) failed (exit {proc.returncode}); see above")

# -- capacity layout by graph surgery


def to_capacity_layout(src: Path, dst: Path, spec: GraphSpec) -> GraphSpec:
    """Write the capacity-layout variant of the growing ``causal_lm`` graph ``src`` to ``dst`` (same folder:
    it references ``src``'s external weight file). Returns its GraphSpec.

    The graph math is unchanged: attention still reads ``Concat(past.i, new_i)``; with ``past.i`` the
    capacity-sized buffer and the mask hiding unwritten slots it computes what the growing graph computes
    on the written prefix. One output is added: ``argmax`` (ArgMax of the logits over the vocabulary, int64
    [batch, q_len]), which the batched runtime copies back for greedy requests instead of the logits. Raises DSparkError when ``src`` is not a growing causal_lm graph whose present
    outputs are that Concat (an export this code does not know).
    """
    import onnx
    from onnx import helper

    src, dst = Path(src), Path(dst)
    if spec.kind != "causal_lm" or spec.kv_layout != KV_LAYOUT_GROWING:
        raise DSparkError(f"{src.name}: only growing causal_lm graphs have a capacity variant (got "
                          f"{spec.kind}/{spec.kv_layout})")
    if src.parent.resolve() != dst.parent.resolve():
        raise DSparkError(f"{dst} must be in the folder of {src}: it shares its external weight file")
    proto = onnx.load(str(src), load_external_data=False)
    g = proto.graph
    producer = {o: n for n in g.node for o in n.output}
    cap_spec = causal_lm_spec(spec.dims, KV_LAYOUT_CAPACITY)
    decl = {t.name: t for t in (*cap_spec.inputs, *cap_spec.outputs)}
    renames = {}
    for (pk, pv), (ok, ov), (nk, nv) in zip(past_names(spec.dims.num_layers), present_names(spec.dims.num_layers),
                                              new_names(spec.dims.num_layers)):
        for past, present, new in ((pk, ok, nk), (pv, ov, nv)):
            n = producer.get(present)
            if n is None or n.op_type != "Concat" or len(n.input) != 2 or n.input[0] != past:
                got = "nothing" if n is None else f"{n.op_type}({', '.join(n.input)})"
                raise DSparkError(f"{src.name}: output {present} is produced by {got}, not Concat({past}, new); "
                                  "re-export the graph with this version of dspark-export")
            renames[present] = (new, n.input[1])
    outputs = []
    for vi in g.output:
        if vi.name in renames:
            new, inner = renames[vi.name]
            g.node.append(helper.make_node("Identity", [inner], [new], name=f"capacity_{new}"))
            vi = helper.make_tensor_value_info(new, onnx.TensorProto.FLOAT, list(decl[new].shape))
        outputs.append(vi)
    # the argmax of the logits on the device (a greedy request copies ids back, not logits); ties: lowest index
    g.node.append(helper.make_node("ArgMax", ["logits"], [ARGMAX], name=ARGMAX_NODE, axis=-1, keepdims=0,
                                   select_last_index=0))
    outputs.append(helper.make_tensor_value_info(ARGMAX, onnx.TensorProto.INT64, list(decl[ARGMAX].shape)))
    del g.output[:]
    g.output.extend(outputs)
    for vi in g.input:  # name the cache axes as the capacity declaration does
        want = decl[vi.name].shape
        for d, w in zip(vi.type.tensor_type.shape.dim, want):
            if isinstance(w, str):
                d.ClearField("dim_value")
                d.dim_param = w
    if [o.name for o in g.output] != cap_spec.output_names or [i.name for i in g.input] != cap_spec.input_names:
        raise DSparkError(f"{src.name}: capacity variant's inputs/outputs do not match the declaration")
    onnx.save_model(proto, str(dst))
    return cap_spec


HALF_TYPES = ("fp16", "bf16")


def to_half(src: Path, dst: Path, half: str = "bf16", half_io: str = "") -> None:
    """Write a 16-bit copy of the float32 decoder graph ``src`` to ``dst`` (+ ``dst.data``).

    half: "bf16" (the float32 range: no overflow in residual streams or RMSNorm; compute capability >= 8.0) or
    "fp16" (the only 16-bit type Turing, 7.5, runs; range +-65504).
    Every float32 weight and computation becomes ``half`` except RoPE (positions x inverse frequencies needs
    float32: fp16 holds integers exactly only up to 2048; its cos/sin are cast after), and the graph's float
    inputs/outputs stay float32 behind Casts, so the runtime's buffers and the manifest's interface are
    unchanged — except the inputs and outputs whose names start with one of the comma-separated prefixes
    ``half_io`` (e.g. "past.,new.": a device graph's K/V cache), which become ``half`` themselves (no Casts).
    Weights stream from the source's external data file to ``dst.data`` one tensor at a time (peak memory: about
    the largest tensor, e.g. the embedding). Stale intermediate type annotations are dropped.
    Raises DSparkError for another ``half`` or an operator with a float type attribute this code does not know.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if half not in HALF_TYPES:
        raise DSparkError(f"16-bit type {half!r}: choose one of {', '.join(HALF_TYPES)}")
    H = TensorProto.FLOAT16 if half == "fp16" else TensorProto.BFLOAT16
    F = TensorProto.FLOAT
    model = onnx.load(str(src), load_external_data=False)
    g = model.graph
    users: dict = {}
    for n in g.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    rope = _rope_nodes(g, users)
    rope_out = {o for n in g.node if n.name in rope for o in n.output}

    def half_bytes(a: np.ndarray) -> bytes:
        """float32 values -> ``half`` bytes, 4M elements at a time (small transient memory)."""
        a = a.reshape(-1)
        out = np.empty(a.size, dtype=np.uint16)
        step = 1 << 22
        for i in range(0, a.size, step):
            c = a[i:i + step]
            if half == "fp16":  # float32 min (the mask fill) -> fp16 lowest; softmax still zeroes it
                out[i:i + step] = np.clip(c, -65504.0, 65504.0).astype(np.float16).view(np.uint16)
            else:  # bf16: round to nearest even
                u = c.view(np.uint32)
                out[i:i + step] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return out.tobytes()

    def to_half_tensor(t: onnx.TensorProto) -> None:  # an inline tensor, converted in place
        a = np.frombuffer(t.raw_data, dtype="<f4") if t.raw_data else numpy_helper.to_array(t).astype(np.float32)
        del t.float_data[:]
        t.raw_data = half_bytes(a)
        t.data_type = H

    dst = Path(dst)
    data = dst.name + ".data"
    for p in (dst, dst.with_name(data)):
        if p.exists():
            p.unlink()
    # Stream the weights: read one tensor from the source data file, convert it, append it to the new data
    # file, keep only its offset: peak memory is about one tensor (the embedding), not the model.
    with open(dst.with_name(data), "wb") as out:
        for t in g.initializer:
            convert = t.data_type == F and not all(u.name in rope for u in users.get(t.name, []))
            if t.data_location != TensorProto.EXTERNAL:
                if convert:
                    to_half_tensor(t)
                continue
            ext = {e.key: e.value for e in t.external_data}
            with open(Path(src).parent / ext["location"], "rb") as f:
                f.seek(int(ext.get("offset", 0)))
                if convert:
                    raw = half_bytes(np.fromfile(f, dtype="<f4", count=int(ext["length"]) // 4))
                    t.data_type = H
                else:
                    raw = f.read(int(ext["length"]))
            offset = out.tell()
            out.write(raw)
            del raw, t.external_data[:]
            for k, v in (("location", data), ("offset", str(offset)), ("length", str(out.tell() - offset))):
                t.external_data.add(key=k, value=v)
    io_prefixes = tuple(p for p in half_io.split(",") if p)
    new_nodes = []
    for vi in g.input:  # float inputs: cast once at the top (or declared 16-bit: half_io)
        if vi.type.tensor_type.elem_type == F and vi.name.startswith(io_prefixes):
            vi.type.tensor_type.elem_type = H
        elif vi.type.tensor_type.elem_type == F:
            c = f"{vi.name}.{half}"
            new_nodes.append(helper.make_node("Cast", [vi.name], [c], to=H, name=f"cast_in_{vi.name}"))
            for u in users.get(vi.name, []):
                u.input[:] = [c if x == vi.name else x for x in u.input]
    for n in g.node:
        if n.name in rope:
            new_nodes.append(n)
            continue
        for j, x in enumerate(n.input):  # RoPE's float32 results enter the 16-bit graph through a Cast
            if x in rope_out:
                c = f"{x}.{half}"
                if not any(m.output[0] == c for m in new_nodes):
                    new_nodes.append(helper.make_node("Cast", [x], [c], to=H, name=f"cast_{x}"))
                n.input[j] = c
        for a in n.attribute:
            if a.name == "to" and n.op_type == "Cast" and a.i == F:
                a.i = H
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == F:
                to_half_tensor(a.t)
            elif a.name in ("dtype", "to") and a.type == onnx.AttributeProto.INT and a.i == F:
                raise DSparkError(f"{src.name}: node {n.name} ({n.op_type}) has a float32 type attribute the 16-bit "
                                  "conversion does not know; extend dspark_export.graphs.capacity.to_half")
        new_nodes.append(n)
    for vi in g.output:  # 16-bit outputs (half_io): written by their producer as they are
        if vi.type.tensor_type.elem_type == F and vi.name.startswith(io_prefixes):
            vi.type.tensor_type.elem_type = H
    outputs = {vi.name for vi in g.output if vi.type.tensor_type.elem_type == F}
    for n in new_nodes:  # float outputs: computed in 16 bits, cast back to float32 at the end
        for j, o in enumerate(n.output):
            if o in outputs and not n.name.startswith("cast_"):
                n.output[j] = f"{o}.{half}"
                for u in users.get(o, []):
                    if u.name != ARGMAX_NODE:  # the argmax reads the float32 logits (exact: a widening cast)
                        u.input[:] = [f"{o}.{half}" if x == o else x for x in u.input]
    for o in sorted(outputs):
        new_nodes.append(helper.make_node("Cast", [f"{o}.{half}"], [o], to=F, name=f"cast_out_{o}"))
    del g.node[:]
    g.node.extend(new_nodes)
    del g.value_info[:]
    onnx.save_model(model, str(dst))  # the graph only: its weights are in dst.data already
    print(f"  {Path(dst).name}: {half} copy of {Path(src).name}, peak RSS {peak_rss_bytes() / 2**30:.2f} GiB", flush=True)


def _rope_nodes(g, users: dict) -> set:
    """Names of the nodes that compute rotary-embedding angles and their cos/sin, which :func:`to_half` keeps in
    float32: the nodes transformers' exporter scopes under ``rotary_emb`` (decoder graphs), and every node reached
    from an integer position input (``position_ids``; the DSpark drafter's ``feature_positions`` and
    ``block_positions``, whose RoPE is a function, not a module) up to and including the Cos/Sin that end it."""
    rope = {n.name for n in g.node
            if any(p.key == "pkg.torch.onnx.name_scopes" and "rotary_emb" in p.value for p in n.metadata_props)}
    frontier = [vi.name for vi in g.input if vi.name == "position_ids" or vi.name.endswith("_positions")]
    seen = set(frontier)
    while frontier:
        for n in users.get(frontier.pop(), []):
            if n.name in rope and n.op_type in ("Cos", "Sin"):
                continue
            rope.add(n.name)
            if n.op_type in ("Cos", "Sin"):
                continue  # the angles end here: what multiplies q/k by cos/sin is 16-bit
            for o in n.output:
                if o not in seen:
                    seen.add(o)
                    frontier.append(o)
    return rope


def graph_precision(onnx_path: Path) -> str:
    """The precision a strongly typed TensorRT network takes from the graph: "fp8" (FP8 E4M3 QDQ), "int8"
    (INT8 QDQ), "fp16" / "bf16" (16-bit weights) or "fp32"."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    g = proto.graph
    qdq = [n for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    inits = {t.name: t.data_type for t in g.initializer}
    T = onnx.TensorProto
    if qdq:
        zp_types = {inits.get(n.input[2]) for n in qdq if len(n.input) > 2}
        zp_types |= {a.i for n in qdq for a in n.attribute if a.name == "output_dtype"}
        if zp_types & {T.FLOAT8E4M3FN, T.FLOAT8E4M3FNUZ}:
            return "fp8"
        return "int8"
    types = [t.data_type for t in g.initializer]
    for t, name in ((T.FLOAT16, "fp16"), (T.BFLOAT16, "bf16")):
        if types and types.count(t) > types.count(T.FLOAT):
            return name
    return "fp32"


def peak_rss_bytes() -> int:
    """This process's peak resident set (bytes): ``VmHWM`` of /proc/self/status on Linux (it starts afresh at
    exec, unlike ``getrusage``'s ru_maxrss, which a child inherits from the parent that forked it), else
    ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
