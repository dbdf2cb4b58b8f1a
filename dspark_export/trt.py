"""TensorRT engines from the exported ONNX graphs (``dspark-export build-trt``, ``build --engine-format``).

For every ``causal_lm`` graph of an engine directory this writes

* ``<key>.capacity.onnx``: the *capacity* KV-layout variant (docs/design.md section 2), made by graph
  surgery on the exported graph (no re-export, no torch): the growing graph's
  ``present.i = Concat(past.i, new_i)`` stays inside the graph for attention, and ``new_i`` becomes the
  output ``new.i.key/value``. It shares the growing graph's weight file.
* ``<key>.capacity.engine`` (and, with ``kv_layouts`` including "growing", ``<key>.engine``): serialized
  TensorRT engines with two optimisation profiles each (prefill chunks; decode/verify of 1..γ+1 tokens)
  derived from the graph's declared axes (:mod:`dspark_runtime.trt_profiles`).
* with ``half`` ("bf16"/"fp16"): ``<key>.capacity.<half>.onnx`` (+ ``.data``), a 16-bit copy (:func:`to_half`),
  and its engine ``<key>.capacity.<half>.engine``.

and for the ``dspark_draft`` graph (the DSpark drafter) ``<key>.engine`` (``<key>.<half>.engine``): the growing
graph as exported (context K/V in, past + new context K/V out), with the same two profiles over ``new_len``
(committed positions per call) and ``past_len`` (its context so far). Graphs with ONNX Runtime contrib operators
(the int4 ``MatMulNBits`` of CPU engines) are refused with the fp32 graph to use instead (:func:`check_trt_parsable`).

TensorRT for RTX (``tensorrt_rtx_bindings``) builds ahead of time on a machine with no GPU for a list of
target compute capabilities; the engine is specialised on the GPU at load. Enterprise ``tensorrt`` (needed
on Hopper / datacenter Blackwell) is driven by the same code but builds for the GPU it runs on. The network
is strongly typed: precision comes from the graph (fp32, bf16/fp16, QDQ INT8 or FP8). Every parser and
builder result is checked; a failure raises DSparkError with TensorRT's own messages, naming the tensor
and shape where there is one.

Measured facts of TensorRT-RTX 1.7.1 on a CPU-only machine: FP32 GEMMs cannot target Turing (SM 7.5: build an
fp16 graph for it, in its own engine; tested); FP8 graphs cannot target 8.0/8.6 (tested); weight-stripped plans
(``STRIP_PLAN`` + ``REFIT_IDENTICAL``) fail to build without a GPU (CUDA error in Myelin's JIT), so CPU builds
embed the weights and 16-bit graphs are the way to halve build memory.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError
from dspark_runtime.graphspec import (ARGMAX, KV_LAYOUT_CAPACITY, KV_LAYOUT_GROWING, KV_LAYOUTS, GraphSpec,
                                      causal_lm_spec, new_names, past_names, present_names)
from dspark_runtime.manifest import FileEntry, Manifest, TrtEngineEntry, load_manifest
from dspark_runtime.trt_import import FLAVOUR_RTX, import_tensorrt
from dspark_runtime.trt_profiles import ProfileSettings, derive_profiles

ARGMAX_NODE = "capacity_argmax"  # the ArgMax node to_capacity_layout adds (to_half keeps it on the float32 logits)

# Graph kinds build_trt makes engines of: decoders (target, draft LM) and the DSpark drafter.
TRT_GRAPH_KINDS = ("causal_lm", "dspark_draft")

# The AOT set of TensorRT-RTX's default portable engine (Ampere, Ampere RTX, Ada, Blackwell RTX). Turing (7.5)
# must be asked for explicitly and alone, and only for non-fp32 graphs (see the module docstring). FP8 graphs
# compile only for GPUs with FP8 tensor cores (8.9 and later): their default drops 8.0 and 8.6.
DEFAULT_COMPUTE_CAPABILITIES = ("8.0", "8.6", "8.9", "12.0")
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)


def default_compute_capabilities(precision: str) -> tuple:
    """The default AOT targets for a graph of ``precision`` ("fp8" keeps only those with FP8 support)."""
    if precision == "fp8":
        return tuple(c for c in DEFAULT_COMPUTE_CAPABILITIES
                     if parse_compute_capability(c) >= FP8_MIN_COMPUTE_CAPABILITY)
    return DEFAULT_COMPUTE_CAPABILITIES


@dataclass
class TrtBuildSettings:
    """How to build.

    flavour: "auto" | "rtx" | "enterprise" (see :func:`dspark_runtime.trt_import.import_tensorrt`).
    compute_capabilities: target GPUs as "major.minor" strings (TensorRT-RTX only; ignored by enterprise,
        which builds for its current GPU). None: :func:`default_compute_capabilities` of the graph's precision.
    profile: the shapes the engines accept (max batch, γ + 1, prefill chunk, KV capacity).
    kv_layouts: which layouts to build ("capacity": the CUDA-graph path; "growing": same graph as ONNX Runtime).
    graphs: manifest graph keys to build (default: every causal_lm graph).
    builder_optimization_level: TensorRT's 0..5 (None: its default).
    half: None, or "bf16" / "fp16": build from a 16-bit copy of each graph (:func:`to_half`; float32 inputs and
        outputs kept): half the weight memory in the build and the engine. fp16 is the only way to target Turing.
    """

    flavour: str = "auto"
    compute_capabilities: tuple | None = None
    profile: ProfileSettings = field(default_factory=ProfileSettings)
    kv_layouts: tuple = (KV_LAYOUT_CAPACITY,)
    graphs: tuple | None = None
    builder_optimization_level: int | None = None
    half: str | None = None

    def validate(self) -> None:
        """Raise DSparkError naming the bad setting and the fix."""
        self.profile.validate()
        bad = [k for k in self.kv_layouts if k not in KV_LAYOUTS]
        if bad or not self.kv_layouts:
            raise DSparkError(f"KV layouts {list(self.kv_layouts)}: choose from {', '.join(KV_LAYOUTS)}")
        ccs = self.compute_capabilities or ()
        for cc in ccs:
            parse_compute_capability(cc)
        if self.half not in (None, *HALF_TYPES):
            raise DSparkError(f"16-bit type {self.half!r}: choose one of {', '.join(HALF_TYPES)}")
        if self.half == "bf16" and "7.5" in ccs:
            raise DSparkError("Turing (7.5) has no bf16; build with --half fp16 for it")
        if "7.5" in ccs and len(ccs) > 1:
            raise DSparkError("compute capability 7.5 (Turing) must be built alone: TensorRT-RTX makes no portable "
                              "engine that includes Turing; pass --compute-capabilities 7.5 in a separate build")

    def to_json(self) -> dict:
        return {"flavour": self.flavour,
                "compute_capabilities": None if self.compute_capabilities is None else list(self.compute_capabilities),
                "profile": self.profile.to_json(), "kv_layouts": list(self.kv_layouts),
                "graphs": None if self.graphs is None else list(self.graphs),
                "builder_optimization_level": self.builder_optimization_level, "half": self.half}

    @staticmethod
    def from_json(d: dict) -> "TrtBuildSettings":
        ccs = d.get("compute_capabilities")
        return TrtBuildSettings(flavour=d["flavour"], compute_capabilities=None if ccs is None else tuple(ccs),
                                profile=ProfileSettings(**d["profile"]), kv_layouts=tuple(d["kv_layouts"]),
                                graphs=None if d.get("graphs") is None else tuple(d["graphs"]),
                                builder_optimization_level=d.get("builder_optimization_level"),
                                half=d.get("half"))


def parse_compute_capability(cc: str) -> tuple[int, int]:
    """"8.6" -> (8, 6). Raises DSparkError for anything else."""
    try:
        major, minor = (int(x) for x in str(cc).split("."))
        return major, minor
    except ValueError:
        raise DSparkError(f"compute capability {cc!r} is not of the form MAJOR.MINOR (e.g. 8.6)") from None


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


def to_half(src: Path, dst: Path, half: str = "bf16") -> None:
    """Write a 16-bit copy of the float32 decoder graph ``src`` to ``dst`` (+ ``dst.data``).

    half: "bf16" (the float32 range: no overflow in residual streams or RMSNorm; compute capability >= 8.0) or
    "fp16" (the only 16-bit type Turing, 7.5, runs; range +-65504).
    Every float32 weight and computation becomes ``half`` except RoPE (positions x inverse frequencies needs
    float32: fp16 holds integers exactly only up to 2048; its cos/sin are cast after), and the graph's float
    inputs/outputs stay float32 behind Casts, so the runtime's buffers and the manifest's interface are
    unchanged. Weights stream from the source's external data file to ``dst.data`` one tensor at a time (peak
    memory: about the largest tensor, e.g. the embedding). Stale intermediate type annotations are dropped.
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
    new_nodes = []
    for vi in g.input:  # float inputs: cast once at the top
        if vi.type.tensor_type.elem_type == F:
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
                                  "conversion does not know; extend dspark_export.trt.to_half")
        new_nodes.append(n)
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


# -- the builder


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


def _logger(trt):
    """A TensorRT logger that keeps error messages (to put them in our DSparkError) and prints warnings."""

    class _Recorder(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.errors.append(msg)
            elif severity == trt.ILogger.Severity.WARNING and "Int64 binding" not in msg:
                print(f"[TensorRT] {msg}", file=sys.stderr)

    return _Recorder()


def build_engine_file(onnx_path: Path, spec: GraphSpec, out_path: Path, settings: TrtBuildSettings) -> dict:
    """Parse ``onnx_path`` (external weights beside it), build a serialized engine for ``spec``'s profiles
    and write it to ``out_path``, in this process.

    Returns ``{"flavour", "version", "profiles", "compute_capabilities", "precision", "build_seconds",
    "peak_rss_bytes"}`` (peak: this process's maximum resident set so far, bytes; see :func:`peak_rss_bytes`).
    Raises DSparkError on any parser/builder failure, naming the node, tensor or shape TensorRT reports.
    """
    settings.validate()
    trt, flavour, version = import_tensorrt(settings.flavour)
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    t0 = time.perf_counter()
    log = _logger(trt)
    builder = trt.Builder(log)
    if builder is None:
        raise DSparkError(f"TensorRT ({flavour}) could not create a builder: {log.errors}")
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, log)
    if not parser.parse_from_file(str(onnx_path)):
        errs = []
        for i in range(parser.num_errors):
            e = parser.get_error(i)
            errs.append(f"node {e.node_name()!r} ({e.node_operator()}): {e.desc()}")
        raise DSparkError(f"TensorRT ({flavour} {version}) could not parse {onnx_path.name}: " + "; ".join(errs) +
                          "; fix the export (dspark_export/export.py) or report the operator")
    net_inputs = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    if list(net_inputs) != spec.input_names:
        raise DSparkError(f"{onnx_path.name}: TensorRT sees inputs {list(net_inputs)} but the manifest declares "
                          f"{spec.input_names}; the graph and manifest are out of step, rebuild the engine")
    config = builder.create_builder_config()
    profiles = derive_profiles(spec, settings.profile)
    for prof in profiles:
        p = builder.create_optimization_profile()
        for name, s in prof["shapes"].items():
            want = tuple(net_inputs[name].shape)
            if len(want) != len(s["min"]) or any(w >= 0 and w != m for w, m in zip(want, s["min"])):
                raise DSparkError(f"profile {prof['name']}: input {name} has shape {want} in the graph but the "
                                  f"profile gives min {s['min']}; the declaration and the graph disagree")
            p.set_shape(name, s["min"], s["opt"], s["max"])
        idx = config.add_optimization_profile(p)
        if idx < 0:
            raise DSparkError(f"TensorRT rejected optimisation profile {prof['name']} "
                              f"({json.dumps(prof['shapes'])}): {log.errors}")
    precision = graph_precision(onnx_path)
    ccs = list(settings.compute_capabilities or default_compute_capabilities(precision))
    if precision == "fp32" and "7.5" in ccs:
        raise DSparkError(f"{onnx_path.name} is fp32 and TensorRT-RTX cannot run fp32 GEMMs on Turing (7.5); "
                          "drop 7.5 from --compute-capabilities or build an fp16 graph for it")
    old = [c for c in ccs if parse_compute_capability(c) < FP8_MIN_COMPUTE_CAPABILITY]
    if precision == "fp8" and old:
        raise DSparkError(f"{onnx_path.name} has FP8 (E4M3) QDQ nodes, which compute capabilities {', '.join(old)} "
                          "cannot run; target 8.9 and later only (e.g. --compute-capabilities 8.9,12.0)")
    if flavour == FLAVOUR_RTX:
        config.num_compute_capabilities = len(ccs)
        for i, cc in enumerate(ccs):
            major, minor = parse_compute_capability(cc)
            member = getattr(trt.ComputeCapability, f"SM{major}{minor}", None)
            if member is None:
                have = [m[2:] for m in trt.ComputeCapability.__members__ if m.startswith("SM")]
                raise DSparkError(f"TensorRT-RTX {version} cannot target compute capability {cc} (it knows SM "
                                  f"{', '.join(have)})")
            config.set_compute_capability(member, i)
    else:
        ccs = ["current"]  # enterprise TensorRT builds for the GPU it runs on
    if settings.builder_optimization_level is not None:
        config.builder_optimization_level = int(settings.builder_optimization_level)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise DSparkError(f"TensorRT ({flavour} {version}) failed to build {onnx_path.name} for compute "
                          f"capabilities {ccs}: {' | '.join(log.errors) or 'no message'}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(out_path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(memoryview(serialized))
    tmp.replace(out_path)
    del serialized, network, parser, builder
    return {"flavour": flavour, "version": version, "profiles": profiles, "compute_capabilities": ccs,
            "precision": precision, "build_seconds": round(time.perf_counter() - t0, 3),
            "peak_rss_bytes": peak_rss_bytes()}


def build_engine_file_isolated(onnx_path: Path, spec: GraphSpec, out_path: Path, settings: TrtBuildSettings) -> dict:
    """:func:`build_engine_file` in a fresh Python process, so ``peak_rss_bytes`` is the build's own peak
    (parser + builder + serialized plan) and the memory is returned to the system afterwards."""
    result = Path(out_path).with_suffix(".build.json")
    args = json.dumps({"onnx": str(onnx_path), "spec": spec.to_json(), "out": str(out_path),
                       "settings": settings.to_json()})
    proc = subprocess.run([sys.executable, "-m", "dspark_export.trt", args, str(result)])
    if proc.returncode != 0 or not result.is_file():
        raise DSparkError(f"building the TensorRT engine {Path(out_path).name} failed (exit {proc.returncode}); "
                          "see the messages above")
    res = json.loads(result.read_text())
    result.unlink()
    return res


def _run(fn, isolate: bool, *args) -> None:
    """``fn(*args)`` (Paths and strings), in a fresh process when ``isolate`` (its memory is returned afterwards)."""
    if not isolate:
        fn(*args)
        return
    code = (f"import json, sys; from pathlib import Path; from dspark_export.trt import {fn.__name__} as f; "
            "f(*[Path(v) if p else v for p, v in json.loads(sys.argv[1])])")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([[isinstance(a, Path), str(a)] for a in args])])
    if proc.returncode != 0:
        raise DSparkError(f"{fn.__name__}({', '.join(map(str, args))}) failed (exit {proc.returncode}); see above")


def check_trt_parsable(onnx_path: Path, key: str, kind: str) -> None:
    """Raise DSparkError when the graph ``onnx_path`` (manifest graph ``key`` of ``kind``) holds ONNX Runtime
    contrib operators (domain ``com.microsoft``, e.g. the int4 ``MatMulNBits``): TensorRT-RTX 1.7.1 parses
    MatMulNBits only through a plugin it does not ship (measured: "failed to load MatMulNBits plugin", and fp32
    activations are refused before that), so such graphs get no engine. The message names the fp32 graph to
    build from instead."""
    import onnx

    g = onnx.load(str(onnx_path), load_external_data=False).graph
    contrib = sorted({n.op_type for n in g.node if n.domain == "com.microsoft"})
    if not contrib:
        return
    if kind == "dspark_draft":
        fix = ("re-add the drafter in fp32 (`dspark-export add-draft ENGINE CHECKPOINT --target TARGET --precision "
               "fp32`) and build from that, with --half bf16/fp16 for a 16-bit engine")
    else:
        fix = ("build an fp32 engine (`dspark-export build MODEL --precision fp32 --kv-layout growing`) and build "
               "from that, with --half bf16/fp16 or an INT8/FP8 QDQ graph for lower precision")
    raise DSparkError(f"graph {key!r} ({onnx_path.name}) uses ONNX Runtime operators {', '.join(contrib)} "
                      f"(com.microsoft), which TensorRT does not build; {fix}")


def build_trt(engine_dir: Path, settings: TrtBuildSettings, isolate: bool = True, log=print) -> Manifest:
    """Build TensorRT engines for the graphs of the built ``engine_dir`` and record them in its manifest
    (``trt_engines``; replaces earlier entries of the same key). Returns the updated Manifest.

    Graphs: ``settings.graphs`` or every ``causal_lm`` (target, draft LM) and ``dspark_draft`` (DSpark drafter)
    graph. A causal_lm graph gets an engine per ``settings.kv_layouts`` (entry ``<key>.capacity`` and/or
    ``<key>``); the DSpark drafter always the growing layout's (entry ``<key>``, file ``<key>.engine``; its
    context K/V inputs and outputs as declared in :func:`dspark_runtime.graphspec.dspark_draft_spec`). With
    ``settings.half`` the entry and file names get ``.bf16`` / ``.fp16``. Profiles come from
    :func:`dspark_runtime.trt_profiles.derive_profiles` for every kind.

    A transaction (:func:`dspark_export.txn.engine_transaction`): the capacity-layout and 16-bit graphs and the
    engines are written beside the old files and recorded only when every engine was built; on any failure
    (Ctrl-C and a full disk included) the directory is left as it was.
    Raises DSparkError for an unknown graph key, a graph kind without a TensorRT path, a graph with ONNX Runtime
    contrib operators (int4 MatMulNBits; :func:`check_trt_parsable`), or a failed build.
    """
    from dspark_export.build import _commit
    from dspark_export.txn import engine_transaction

    settings.validate()
    engine_dir = Path(engine_dir)
    manifest = load_manifest(engine_dir)
    keys = settings.graphs or tuple(k for k, g in manifest.graphs.items() if g.spec.kind in TRT_GRAPH_KINDS)
    if not keys:
        raise DSparkError(f"{engine_dir} has no causal_lm or dspark_draft graph to build a TensorRT engine for")
    for key in keys:
        if key not in manifest.graphs:
            raise DSparkError(f"{engine_dir} has no graph {key!r} (graphs: {', '.join(manifest.graphs)})")
        if manifest.graphs[key].spec.kind not in TRT_GRAPH_KINDS:
            raise DSparkError(f"graph {key!r} is a {manifest.graphs[key].spec.kind} graph; TensorRT engines are "
                              f"built for {' and '.join(TRT_GRAPH_KINDS)} graphs only")
        if manifest.graphs[key].spec.kv_layout != KV_LAYOUT_GROWING:
            raise DSparkError(f"graph {key!r} has the {manifest.graphs[key].spec.kv_layout} KV layout; TensorRT "
                              "engines are built from growing-layout graphs: build the engine with "
                              "`--kv-layout growing` (recipe field kv_layout) for TensorRT")
        check_trt_parsable(engine_dir / manifest.graphs[key].model_file, key, manifest.graphs[key].spec.kind)
    build = build_engine_file_isolated if isolate else build_engine_file
    with engine_transaction(engine_dir) as txn:
        st = txn.stage  # new files go here; the graphs they are made from are linked in beside them
        for key in keys:
            g = manifest.graphs[key]
            for f in g.files:
                txn.link(f.path)
            src = st / g.model_file
            # the DSpark drafter's context cache grows by committed positions only and lives on the host
            # (dspark_runtime.trt_dspark.TrtDSparkGraph): its engine is the growing graph's, whatever kv_layouts says
            layouts = settings.kv_layouts if g.spec.kind == "causal_lm" else (KV_LAYOUT_GROWING,)
            for layout in layouts:
                extra = []
                if layout == KV_LAYOUT_CAPACITY:
                    onnx_rel = f"{key}.capacity.onnx"
                    spec = to_capacity_layout(src, st / onnx_rel, g.spec)
                    extra = [FileEntry.of(st, onnx_rel)]
                    entry_key, eng_rel = f"{key}.capacity", f"{key}.capacity.engine"
                else:
                    onnx_rel, spec, entry_key, eng_rel = g.model_file, g.spec, key, f"{key}.engine"
                if settings.half:
                    h = settings.half
                    half_rel = onnx_rel.removesuffix(".onnx") + f".{h}.onnx"
                    log(f"[{entry_key}] converting {onnx_rel} to {h} -> {half_rel}")
                    _run(to_half, isolate, st / onnx_rel, st / half_rel, h)
                    onnx_rel = half_rel
                    extra += [FileEntry.of(st, half_rel), FileEntry.of(st, half_rel + ".data")]
                    entry_key, eng_rel = entry_key + f".{h}", eng_rel.removesuffix(".engine") + f".{h}.engine"
                log(f"[{entry_key}] building TensorRT engine {eng_rel} ({layout} KV layout) from {onnx_rel}")
                r = build(st / onnx_rel, spec, st / eng_rel, settings)
                f = FileEntry.of(st, eng_rel)
                manifest.trt_engines[entry_key] = TrtEngineEntry(
                    graph=key, kv_layout=layout, onnx=onnx_rel, file=f, extra_files=extra, flavour=r["flavour"],
                    version=r["version"], profiles=r["profiles"], profile_settings=settings.profile.to_json(),
                    compute_capabilities=r["compute_capabilities"], precision=r["precision"],
                    build_seconds=r["build_seconds"], peak_rss_bytes=r["peak_rss_bytes"], spec=spec)
                log(f"[{entry_key}] {r['flavour']} {r['version']}, {r['precision']}, compute capabilities "
                    f"{', '.join(r['compute_capabilities'])}: {f.size / 1e6:.1f} MB in {r['build_seconds']:.1f} s, "
                    f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB")
        manifest.tool_versions[r["flavour"]] = r["version"]
        _commit(txn, manifest)
    return manifest


if __name__ == "__main__":  # worker for build_engine_file_isolated
    a = json.loads(sys.argv[1])
    try:
        res = build_engine_file(Path(a["onnx"]), GraphSpec.from_json(a["spec"]), Path(a["out"]),
                                TrtBuildSettings.from_json(a["settings"]))
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    Path(sys.argv[2]).write_text(json.dumps(res))
