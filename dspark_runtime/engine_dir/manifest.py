"""The engine manifest (``<engine>/manifest.json``), the only way the runtime loads an engine directory: its schema
(:class:`Manifest` and its entries :class:`GraphEntry`, :class:`TrtEngineEntry`, :class:`DeviceGraphEntry`,
:class:`FileEntry`; the ``speculation`` section is :mod:`~dspark_runtime.engine_dir.speculation`'s),
:func:`parse_manifest` and :func:`load_manifest`. Pure data and file checks; no engine I/O.

Schema version :data:`SCHEMA_VERSION`; another version is refused, naming the fix. The optional sections
(``trt_engines``, ``device_graphs``, ``build_machine``) were added without a version bump: manifests without them
load unchanged and runtimes that predate them ignore them. The manifest is written atomically and its files are
checked by size and sha256 (:mod:`~dspark_runtime.engine_dir.integrity`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dspark_runtime.engine_dir.graphspec import KV_LAYOUTS, GraphSpec
from dspark_runtime.engine_dir.integrity import (VERIFIED_NAME, atomic_write_text, cache_root,  # noqa: F401 (re-exported)
                                                 fsync_dir, record_verified, sha256_file, verify_files)
from dspark_runtime.engine_dir.speculation import Speculation
from dspark_runtime.errors import ManifestError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
PROMPT_GRAPH = "target_prompt"  # the graph key (role "prompt") of the target's prompt graph, where an engine has one


@dataclass
class FileEntry:
    """A file of the engine directory with its size (bytes) and sha256."""

    path: str
    size: int
    sha256: str

    @staticmethod
    def of(root: Path, rel: str) -> "FileEntry":
        p = root / rel
        return FileEntry(rel, p.stat().st_size, sha256_file(p))

    def to_json(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


@dataclass
class GraphEntry:
    """One graph of the engine: its files, interface, precision and validation figures."""

    role: str
    model_id: str
    format: str
    precision: str
    files: list
    spec: GraphSpec
    validation: dict = field(default_factory=dict)
    model_config: dict = field(default_factory=dict)
    # quantized graphs: how (method, settings, modules left in fp32) and on what calibration data
    # ({"calibration": {"data_id": sha256 of the token ids fed, "method", "prompts", "steps"}, ...})
    quantization: dict = field(default_factory=dict)

    @property
    def model_file(self) -> str:
        return self.files[0].path

    def to_json(self) -> dict:
        return {
            "role": self.role, "model_id": self.model_id, "format": self.format,
            "precision": self.precision, "files": [f.to_json() for f in self.files],
            "spec": self.spec.to_json(), "validation": self.validation, "model_config": self.model_config,
            **({"quantization": self.quantization} if self.quantization else {}),
        }

    @staticmethod
    def from_json(d: dict) -> "GraphEntry":
        return GraphEntry(
            role=d["role"], model_id=d["model_id"], format=d["format"], precision=d["precision"],
            files=[FileEntry(**f) for f in d["files"]], spec=GraphSpec.from_json(d["spec"]),
            validation=d.get("validation", {}), model_config=d.get("model_config", {}),
            quantization=d.get("quantization", {}),
        )


@dataclass
class TrtEngineEntry:
    """One serialized TensorRT engine built from a graph of the manifest.

    graph:        key of the source graph in ``Manifest.graphs`` ("target", "draft", ...).
    kv_layout:    "growing" or "capacity" (the layout of ``spec``; docs/design.md section 2).
    onnx:         the ONNX file it was built from (relative path; for the capacity layout a graph that
                  shares the growing graph's weight file).
    file:         the engine (FileEntry: path, bytes, sha256).
    extra_files:  other files the engine entry owns (the capacity-layout ONNX), FileEntry list.
    flavour:      "tensorrt-rtx" or "tensorrt"; version: its version string.
    profiles:     ``[{"name", "shapes": {input: {"min", "opt", "max"}}}]`` in the engine's profile order.
    profile_settings: the ProfileSettings they were derived from (max_batch, decode_q, ...).
    compute_capabilities: target GPUs, e.g. ["8.0", "8.6"]; ["current"] for an enterprise build.
    precision:    "fp32" / "fp16" / "int8" / "fp8" (from the graph: the network is strongly typed).
    build_seconds, peak_rss_bytes: the build's wall time (s) and peak resident memory (bytes).
    spec:         the GraphSpec of ``onnx``.
    """

    graph: str
    kv_layout: str
    onnx: str
    file: FileEntry
    flavour: str
    version: str
    profiles: list
    profile_settings: dict
    compute_capabilities: list
    precision: str
    build_seconds: float
    peak_rss_bytes: int
    spec: GraphSpec
    extra_files: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "graph": self.graph, "kv_layout": self.kv_layout, "onnx": self.onnx, "file": self.file.to_json(),
            "extra_files": [f.to_json() for f in self.extra_files], "flavour": self.flavour,
            "version": self.version, "profiles": self.profiles, "profile_settings": self.profile_settings,
            "compute_capabilities": self.compute_capabilities, "precision": self.precision,
            "build_seconds": self.build_seconds, "peak_rss_bytes": self.peak_rss_bytes,
            "spec": self.spec.to_json(),
        }

    @staticmethod
    def from_json(d: dict) -> "TrtEngineEntry":
        return TrtEngineEntry(
            graph=d["graph"], kv_layout=d["kv_layout"], onnx=d["onnx"], file=FileEntry(**d["file"]),
            extra_files=[FileEntry(**f) for f in d.get("extra_files", [])], flavour=d["flavour"],
            version=d["version"], profiles=list(d["profiles"]), profile_settings=dict(d["profile_settings"]),
            compute_capabilities=list(d["compute_capabilities"]), precision=d["precision"],
            build_seconds=float(d["build_seconds"]), peak_rss_bytes=int(d["peak_rss_bytes"]),
            spec=GraphSpec.from_json(d["spec"]))


@dataclass
class DeviceGraphEntry:
    """A graph of the manifest re-laid out for a GPU runtime without an engine build: ONNX Runtime's CUDA provider on
    device-resident buffers (:class:`dspark_runtime.backends.ort_cuda.OrtDeviceDecoder`; ``dspark-export build-cuda``).

    graph:            key of the source graph in ``Manifest.graphs`` ("target", "draft").
    kv_layout:        "capacity" (fixed-size cache buffers in, new keys/values out; docs/design.md section 2).
    onnx:             the ONNX file to run (relative path).
    files:            the files the entry owns (the capacity-layout graph; a 16-bit copy and its weights), FileEntry
                      list; a capacity graph of the source's precision shares the source's weight file.
    precision:        "fp32" / "fp16" / "bf16" (the graph's arithmetic; inputs and outputs are float32 either way).
    profile_settings: what the buffers are sized for: max_batch, decode_q, prefill_chunk, capacity, min_bucket
                      (:class:`dspark_runtime.backends.trt.profiles.ProfileSettings`).
    spec:             the GraphSpec of ``onnx``.
    """

    graph: str
    kv_layout: str
    onnx: str
    files: list
    precision: str
    profile_settings: dict
    spec: GraphSpec

    def to_json(self) -> dict:
        return {"graph": self.graph, "kv_layout": self.kv_layout, "onnx": self.onnx,
                "files": [f.to_json() for f in self.files], "precision": self.precision,
                "profile_settings": self.profile_settings, "spec": self.spec.to_json()}

    @staticmethod
    def from_json(d: dict) -> "DeviceGraphEntry":
        return DeviceGraphEntry(graph=d["graph"], kv_layout=d["kv_layout"], onnx=d["onnx"],
                                files=[FileEntry(**f) for f in d["files"]], precision=d["precision"],
                                profile_settings=dict(d["profile_settings"]), spec=GraphSpec.from_json(d["spec"]))


@dataclass
class Manifest:
    """Parsed ``manifest.json``. Use :func:`load_manifest` to read and check one; :meth:`write` writes it::

        {"schema_version": 1, "name": "qwen2.5-coder-1.5b", "created": "<UTC time, ISO 8601>",
         "tool_versions": {"dspark": "0.1.0", "torch": "...", "onnx": "...", ...},
         "tokenizer": {"dir": "tokenizer", "files": [FileEntry, ...], "eos_token_ids": [...],
                       "chat_template": "tokenizer/chat_template.jinja" | null, "bos_token": str | null},
         "graphs": {"target": GraphEntry, "draft": GraphEntry, ...},  # "target" required; the rest optional
         "speculation": Speculation,
         "trt_engines": {"target.capacity": TrtEngineEntry, ...},     # optional: dspark-export build-trt
         "device_graphs": {"target": DeviceGraphEntry, ...},          # optional: dspark-export build-cuda
         "build_machine": {"model", "vendor", "flags", "cores"}}      # optional: sysinfo.cpu_features()

    A FileEntry is ``{"path": relative path, "size": bytes, "sha256": hex}``; a GraphEntry ``{"role", "model_id",
    "format": "onnx", "precision", "files", "spec": GraphSpec, "validation", "model_config"}`` plus
    ``"quantization"`` for quantized graphs. ``speculation`` is a :class:`Speculation` (typed;
    ``m.speculation.cost_table``, ``m.speculation.dspark``); its unknown keys are written back unchanged."""

    name: str
    graphs: dict
    tokenizer: dict
    speculation: Speculation = field(default_factory=Speculation)
    tool_versions: dict = field(default_factory=dict)
    created: str = ""
    schema_version: int = SCHEMA_VERSION
    trt_engines: dict = field(default_factory=dict)  # key -> TrtEngineEntry
    build_machine: dict = field(default_factory=dict)  # sysinfo.cpu_features() of the building machine
    device_graphs: dict = field(default_factory=dict)  # key -> DeviceGraphEntry (dspark-export build-cuda)

    def all_files(self) -> list:
        """Every FileEntry the engine lists, each path once (a prompt graph lists the target's data file it reads)."""
        files = list(self.tokenizer.get("files", []))
        for g in self.graphs.values():
            files += g.files
        for e in self.trt_engines.values():
            files += [e.file, *e.extra_files]
        for e in self.device_graphs.values():
            files += e.files
        return list({f.path: f for f in files}.values())

    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version, "name": self.name, "created": self.created,
            "tool_versions": self.tool_versions,
            "tokenizer": {**self.tokenizer, "files": [f.to_json() for f in self.tokenizer.get("files", [])]},
            "graphs": {k: g.to_json() for k, g in self.graphs.items()},
            "speculation": self.speculation.to_json(),
            **({"trt_engines": {k: e.to_json() for k, e in self.trt_engines.items()}} if self.trt_engines else {}),
            **({"build_machine": self.build_machine} if self.build_machine else {}),
            **({"device_graphs": {k: e.to_json() for k, e in self.device_graphs.items()}}
               if self.device_graphs else {}),
        }

    def text(self) -> str:
        """The manifest as written to ``manifest.json`` (indented JSON, trailing newline)."""
        return json.dumps(self.to_json(), indent=2) + "\n"

    def write(self, engine_dir: Path) -> Path:
        """Write ``<engine_dir>/manifest.json`` atomically (:func:`atomic_write_text`); returns its path.

        Raises OSError when it cannot be written (the old manifest is then unchanged). Commands that change
        other files of an engine directory too go through :func:`dspark_export.engine_dir.transaction.engine_transaction`,
        which calls this as its commit point.
        """
        p = Path(engine_dir) / MANIFEST_NAME
        atomic_write_text(p, self.text())
        return p


def parse_manifest(d: dict, where: str = "manifest") -> Manifest:
    """Build a Manifest from its JSON dict; raise ManifestError on a wrong version or shape (a speculation
    entry of the wrong type: :meth:`Speculation.from_json`)."""
    if not isinstance(d, dict) or "schema_version" not in d:
        raise ManifestError(f"{where} has no schema_version: it is not a DSpark manifest")
    v = d["schema_version"]
    if v != SCHEMA_VERSION:
        raise ManifestError(
            f"{where} has schema_version {v!r} but this runtime reads version {SCHEMA_VERSION}; "
            "rebuild the engine with the matching `dspark-export build`, or install the matching dspark"
        )
    try:
        graphs = {k: GraphEntry.from_json(g) for k, g in d["graphs"].items()}
        tok = dict(d["tokenizer"])
        tok["files"] = [FileEntry(**f) for f in tok.get("files", [])]
        speculation = Speculation.from_json(d.get("speculation"), where)
        m = Manifest(name=d["name"], graphs=graphs, tokenizer=tok, speculation=speculation,
                     tool_versions=d.get("tool_versions", {}), created=d.get("created", ""), schema_version=v,
                     trt_engines={k: TrtEngineEntry.from_json(e) for k, e in d.get("trt_engines", {}).items()},
                     build_machine=dict(d.get("build_machine") or {}),
                     device_graphs={k: DeviceGraphEntry.from_json(e) for k, e in d.get("device_graphs", {}).items()})
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{where} is malformed ({type(e).__name__}: {e}); rebuild the engine") from e
    if "target" not in m.graphs:
        raise ManifestError(f"{where} declares no 'target' graph; rebuild the engine")
    runnable = {("causal_lm", "growing"), ("causal_lm", "scatter"), ("dspark_draft", "growing"),
                ("eagle3_draft", "growing")}
    for key, g in m.graphs.items():
        if (g.spec.kind, g.spec.kv_layout) not in runnable:
            raise ManifestError(f"{where}: graph {key!r} is {g.spec.kind}/{g.spec.kv_layout}; this runtime runs "
                                "causal_lm graphs with the growing or scatter KV layout and dspark_draft / "
                                "eagle3_draft graphs with the growing one; rebuild the engine")
    for key, e in m.trt_engines.items():
        if e.graph not in m.graphs:
            raise ManifestError(f"{where}: TensorRT engine {key!r} was built from graph {e.graph!r}, which the "
                                "manifest does not declare; rebuild it with `dspark-export build-trt`")
        if e.kv_layout not in KV_LAYOUTS or e.spec.kv_layout != e.kv_layout:
            raise ManifestError(f"{where}: TensorRT engine {key!r} has KV layout {e.kv_layout!r} (spec: "
                                f"{e.spec.kv_layout!r}); expected one of {KV_LAYOUTS}; rebuild it")
    for key, e in m.device_graphs.items():
        if e.graph not in m.graphs or e.kv_layout != "capacity" or e.spec.kv_layout != "capacity":
            raise ManifestError(f"{where}: device graph {key!r} (of graph {e.graph!r}, {e.kv_layout} layout) is not "
                                "a capacity-layout copy of a declared graph; rebuild it with `dspark-export build-cuda`")
    return m


def load_manifest(engine_dir: str | Path, verify: bool = True, rehash: bool = False) -> Manifest:
    """Read and check ``<engine_dir>/manifest.json``.

    Raises ManifestError when the directory or manifest is missing, unreadable, of another schema
    version, or when a listed file is missing or corrupted (``verify``).
    """
    engine_dir = Path(engine_dir)
    if engine_dir.is_file() and engine_dir.suffix == ".json":
        raise ManifestError(f"{engine_dir} is a file (a build recipe?), not an engine directory; build it with "
                            f"`dspark-export build {engine_dir}` and pass the directory it writes")
    if not engine_dir.is_dir():
        raise ManifestError(f"engine directory {engine_dir} does not exist; build one with "
                            "`dspark-export build` or pass the path of an engine directory (the CLI's --engine)")
    mp = engine_dir / MANIFEST_NAME
    if not mp.is_file():
        raise ManifestError(f"{engine_dir} has no {MANIFEST_NAME}: not a DSpark engine directory; "
                            "build one with `dspark-export build`")
    try:
        d = json.loads(mp.read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"{mp} is not valid JSON ({e}); rebuild the engine") from e
    m = parse_manifest(d, str(mp))
    if verify:
        verify_files(engine_dir, m, rehash=rehash)
    return m
