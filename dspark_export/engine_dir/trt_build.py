"""TensorRT engines from the exported ONNX graphs (``dspark-export build-trt``, ``build --engine-format``).

For every ``causal_lm`` graph: its capacity KV-layout variant
(:func:`dspark_export.graphs.device.derive_capacity_graph`) and, with ``half``, a 16-bit copy, each built into an
engine with two optimisation profiles (prefill chunks; decode/verify of 1..γ+1 tokens,
:mod:`dspark_runtime.backends.trt.profiles`); with ``kv_layouts`` including "growing" also the growing graph's
engine. The ``dspark_draft`` and ``eagle3_draft`` graphs get the growing graph's engine (the runtime runs the
DSpark drafter's on TensorRT; the EAGLE-3 drafter's is built ahead of time and runs on ONNX Runtime so far).
Graphs with ONNX Runtime contrib operators (the int4 ``MatMulNBits``) are refused, naming the fp32 graph to use
instead. TensorRT for RTX builds ahead of time
without a GPU for a list of compute capabilities; enterprise ``tensorrt`` builds for the GPU it runs on. Every parser
and builder result is checked (DSparkError with TensorRT's own messages); all files are recorded in one transaction.
Limits of the builders: docs/tensorrt.md.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dspark_runtime.backends.trt.loader import FLAVOUR_RTX, import_tensorrt
from dspark_runtime.backends.trt.profiles import ProfileSettings, derive_profiles
from dspark_runtime.engine_dir.graphspec import KV_LAYOUT_CAPACITY, KV_LAYOUT_GROWING, KV_LAYOUTS, GraphSpec
from dspark_runtime.engine_dir.manifest import FileEntry, Manifest, TrtEngineEntry, load_manifest
from dspark_runtime.errors import DSparkError

from dspark_export.engine_dir.commit import commit_manifest
from dspark_export.engine_dir.transaction import engine_transaction
from dspark_export.graphs.capacity import HALF_TYPES, graph_precision, peak_rss_bytes, run_rewrite, to_half
from dspark_export.graphs.device import derive_capacity_graph

# Graph kinds build_trt makes engines of: decoders (target, draft LM), the DSpark and the EAGLE-3 drafter.
TRT_GRAPH_KINDS = ("causal_lm", "dspark_draft", "eagle3_draft")

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

    flavour: "auto" | "rtx" | "enterprise" (see :func:`dspark_runtime.backends.trt.loader.import_tensorrt`).
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


# -- the builder


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
                          "; fix the export (dspark_export/graphs/decoder.py) or report the operator")
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
    proc = subprocess.run([sys.executable, "-m", "dspark_export.engine_dir.trt_build", args, str(result)])
    if proc.returncode != 0 or not result.is_file():
        raise DSparkError(f"building the TensorRT engine {Path(out_path).name} failed (exit {proc.returncode}); "
                          "see the messages above")
    res = json.loads(result.read_text())
    result.unlink()
    return res


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
    if kind in ("dspark_draft", "eagle3_draft"):
        target = " --target TARGET" if kind == "dspark_draft" else ""  # an EAGLE-3 checkpoint holds its own head
        fix = (f"re-add the drafter in fp32 (`dspark-export add-draft ENGINE CHECKPOINT{target} --precision fp32`) "
               "and build from that, with --half bf16/fp16 for a 16-bit engine")
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
    context K/V inputs and outputs as declared in :func:`dspark_runtime.engine_dir.graphspec.dspark_draft_spec`). With
    ``settings.half`` the entry and file names get ``.bf16`` / ``.fp16``. Profiles come from
    :func:`dspark_runtime.backends.trt.profiles.derive_profiles` for every kind.

    A transaction (:func:`dspark_export.engine_dir.transaction.engine_transaction`): the capacity-layout and 16-bit graphs and the
    engines are written beside the old files and recorded only when every engine was built; on any failure
    (Ctrl-C and a full disk included) the directory is left as it was.
    Raises DSparkError for an unknown graph key, a graph kind without a TensorRT path, a graph with ONNX Runtime
    contrib operators (int4 MatMulNBits; :func:`check_trt_parsable`), or a failed build.
    """
    settings.validate()
    engine_dir = Path(engine_dir)
    manifest = load_manifest(engine_dir)
    keys = settings.graphs or tuple(k for k, g in manifest.graphs.items() if g.spec.kind in TRT_GRAPH_KINDS)
    if not keys:
        raise DSparkError(f"{engine_dir} has no causal_lm, dspark_draft or eagle3_draft graph to build a TensorRT "
                          "engine for")
    for key in keys:
        if key not in manifest.graphs:
            raise DSparkError(f"{engine_dir} has no graph {key!r} (graphs: {', '.join(manifest.graphs)})")
        if manifest.graphs[key].spec.kind not in TRT_GRAPH_KINDS:
            raise DSparkError(f"graph {key!r} is a {manifest.graphs[key].spec.kind} graph; TensorRT engines are "
                              f"built for {', '.join(TRT_GRAPH_KINDS)} graphs only")
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
            # the DSpark drafter's context cache grows by committed positions only and lives on the host
            # (dspark_runtime.backends.trt.dspark_graph.TrtDSparkGraph): its engine is the growing graph's, whatever kv_layouts says
            layouts = settings.kv_layouts if g.spec.kind == "causal_lm" else (KV_LAYOUT_GROWING,)
            for layout in layouts:
                h = settings.half
                if layout == KV_LAYOUT_CAPACITY:
                    onnx_rel, spec, extra = derive_capacity_graph(st, key, g.model_file, g.spec, h,
                                                                  lambda fn, *a: run_rewrite(fn, isolate, *a), log)
                    entry_key, eng_rel = f"{key}.capacity", f"{key}.capacity.engine"
                else:
                    onnx_rel, spec, entry_key, eng_rel, extra = g.model_file, g.spec, key, f"{key}.engine", []
                    if h:
                        half_rel = onnx_rel.removesuffix(".onnx") + f".{h}.onnx"
                        log(f"[{entry_key}] converting {onnx_rel} to {h} -> {half_rel}")
                        run_rewrite(to_half, isolate, st / onnx_rel, st / half_rel, h)
                        onnx_rel = half_rel
                        extra = [FileEntry.of(st, half_rel), FileEntry.of(st, half_rel + ".data")]
                if h:
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
        commit_manifest(txn, manifest)
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
