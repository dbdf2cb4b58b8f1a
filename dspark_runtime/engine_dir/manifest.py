"""The engine manifest (``engines/<name>/manifest.json``): the only way the runtime loads an
engine directory. Pure data + file checks; no engine I/O.

Schema version 1::

    {
      "schema_version": 1,
      "name": "qwen2.5-coder-1.5b",
      "created": "2026-11-30T16:00:00Z",
      "tool_versions": {"dspark": "0.1.0", "torch": "...", "onnx": "...", ...},
      "tokenizer": {"dir": "tokenizer", "files": [FileEntry...], "eos_token_ids": [...],
                    "chat_template": "tokenizer/chat_template.jinja" | null, "bos_token": str | null},
      "graphs": {
        "target": {"role": "target", "model_id": "...", "format": "onnx", "precision": "fp32",
                   "files": [FileEntry...], "spec": GraphSpec, "validation": {...},
                   "model_config": {...},
                   "quantization": {...}},                # only for quantized graphs (int8, int8-trt, fp8)
        "draft": {... same, "role": "draft"}          # optional
      },
      "speculation": Speculation,
      "trt_engines": {                                  # optional (dspark-export build-trt)
        "target.capacity": TrtEngineEntry, ...
      },
      "build_machine": {"model": ..., "vendor": ..., "flags": [...], "cores": N}  # optional
    }

A FileEntry is ``{"path": relative path, "size": bytes, "sha256": hex}``. ``Speculation`` (the dataclass
:class:`Speculation`; every key optional, an absent key and null read the same)::

    {"draft_graph": str,                  # the draft LM's graph key (or the only drafter's)
     "draft_kind": "dspark" | "lm",       # the kind of draft_graph
     "draft_length": int > 0,             # default draft tokens per round
     "dspark": {                          # DSparkSection: the DSpark drafter (build --draft dspark:..., add-draft)
       "graph": str, "heads_file": str, "block_size": int > 0, "mask_token_id": int >= 0,
       "target_layer_ids": [int, ...],    # these five required
       "markov_rank": int >= 0, "markov_head_type": str, "confidence_head": bool,
       "confidence_head_with_markov": bool, "draft_vocab_size": int > 0 | null,
       "sts_temperatures": [float > 0, ...] | null,  # calibrate
       "calibration": {...}},             # calibrate: {"rounds", "ece": [...]}
     "router": {...},                     # calibrate / add-draft: the router's priors (router.router_priors)
     "cost_table": {...},                 # profile: round costs per context bucket (profile.profile_runtime, cost_table.py); quantize drops it
     "row_invariance": {...}}             # profile: the row padding probe (invariance); quantize drops it

Other keys of ``speculation`` and of ``dspark`` are kept and written back unchanged (``extra``), so a manifest
of a newer tool round-trips; a typed key of the wrong type or value is refused with a ManifestError naming it.

``trt_engines`` was added without a version bump: manifests without it load unchanged, and runtimes that
predate it ignore it.
``build_machine`` (the CPU the graphs were written and validated on,
:func:`dspark_runtime.machine.sysinfo.cpu_features`) likewise: written only when known, optional on read.

The manifest is written atomically (:func:`atomic_write_text`: a temporary file beside it, fsync, rename,
fsync of the directory), so a reader sees the old manifest or the new one, never half of one.

Trusted hashes: loading checks every listed file's sha256, which is ~9 GB of reading for a 1.5B fp32 engine.
A file hashed once (at build, at load, by ``dspark verify``) is recorded in the user's cache
(:func:`trusted_records_path`: ``$DSPARK_CACHE/verified/``, default ``~/.cache/dspark``), keyed by its absolute
path, size and mtime (ns) together with the sha256 it had; later loads skip hashing a file whose path, size,
mtime and manifest sha256 all match its record. Nothing is written into the engine directory, so a read-only
one (a mounted image, a container layer) is hashed once, not on every load. A replaced or modified file
changes size or mtime and is hashed again; ``rehash=True`` (``dspark verify``, ``pack``) hashes everything.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from dspark_runtime.errors import ManifestError
from dspark_runtime.engine_dir.graphspec import KV_LAYOUTS, GraphSpec
from dspark_runtime.engine_dir.speculation import Speculation

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
# The sidecar of trusted hashes that earlier versions wrote into the engine directory. No longer read or
# written (records live in the user's cache, see trusted_records_path); a committed change of the engine
# directory (dspark_export.engine_dir.transaction) deletes a stale one.
VERIFIED_NAME = ".dspark-verified.json"
TRUSTED_DIR = "verified"  # under cache_root(): one JSON file of trusted-hash records per engine directory


def cache_root() -> Path:
    """Root of the DSpark cache: ``$DSPARK_CACHE`` when set, else ``~/.cache/dspark``."""
    env = os.environ.get("DSPARK_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark"


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text`` so that readers (and a crash) see the old or the new
    content, never a mix: write a temporary file in the same directory, fsync it, ``os.replace`` it over
    ``path``, fsync the directory.

    Raises OSError (e.g. ENOSPC, EROFS) when the temporary file cannot be written or renamed; ``path`` is
    then unchanged and the temporary file removed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(d: Path) -> None:
    """fsync directory ``d`` (makes renames in it durable); a filesystem that cannot is ignored."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path, on_progress=None, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks; ``on_progress(nbytes)`` after each chunk."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
            if on_progress is not None:
                on_progress(len(b))
    return h.hexdigest()


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
    """Parsed ``manifest.json``. Use :func:`load_manifest` to read and check one.

    ``speculation`` is a :class:`Speculation` (typed; ``m.speculation.cost_table``, ``m.speculation.dspark``)."""

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
        files = list(self.tokenizer.get("files", []))
        for g in self.graphs.values():
            files += g.files
        for e in self.trt_engines.values():
            files += [e.file, *e.extra_files]
        for e in self.device_graphs.values():
            files += e.files
        return files

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
    runnable = {("causal_lm", "growing"), ("causal_lm", "scatter"), ("dspark_draft", "growing")}
    for key, g in m.graphs.items():
        if (g.spec.kind, g.spec.kv_layout) not in runnable:
            raise ManifestError(f"{where}: graph {key!r} is {g.spec.kind}/{g.spec.kv_layout}; this runtime runs "
                                "causal_lm graphs with the growing or scatter KV layout and dspark_draft graphs with "
                                "the growing one; rebuild the engine")
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


def trusted_records_path(engine_dir: Path) -> Path:
    """The cache file of trusted-hash records for ``engine_dir``:
    ``<cache_root()>/verified/<sha256 of the directory's real path, 32 hex digits>.json``."""
    key = hashlib.sha256(os.path.realpath(engine_dir).encode()).hexdigest()[:32]
    return cache_root() / TRUSTED_DIR / f"{key}.json"


def _file_key(p: Path) -> str:
    return os.path.realpath(p)


def _read_records(engine_dir: Path) -> dict:
    """{absolute file path: [size, mtime_ns, sha256]} recorded for ``engine_dir`` ({} when none/unreadable)."""
    try:
        d = json.loads(trusted_records_path(engine_dir).read_text())
        files = d.get("files", {}) if isinstance(d, dict) else {}
        return {k: v for k, v in files.items() if isinstance(v, list) and len(v) == 3}
    except (OSError, ValueError):
        return {}


def _write_records(engine_dir: Path, records: dict) -> None:
    """Store ``records`` for ``engine_dir`` (atomically) and drop the record files of engine directories that
    no longer exist. Best effort: an unwritable cache only means hashing again next time."""
    p = trusted_records_path(engine_dir)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, json.dumps({"engine_dir": os.path.realpath(engine_dir), "files": records}))
    except OSError:
        return
    try:
        for other in p.parent.glob("*.json"):
            if other == p:
                continue
            try:
                d = json.loads(other.read_text())
                gone = not Path(d["engine_dir"]).is_dir()
            except (OSError, ValueError, KeyError, TypeError):
                gone = True
            if gone:
                other.unlink(missing_ok=True)
    except OSError:
        pass


def record_verified(engine_dir: Path, files) -> None:
    """Record the files ``files`` (FileEntry list, paths relative to ``engine_dir``) as hashed just now with
    their manifest sha256, at their current size and mtime, so the next load need not hash them again.

    Call it only for files whose content was hashed (or written and hashed) by the caller. Files that are
    missing or whose size differs from the entry are skipped. Never raises for an unwritable cache.
    """
    engine_dir = Path(engine_dir)
    records = _read_records(engine_dir)
    for f in files:
        p = engine_dir / f.path
        try:
            st = p.stat()
        except OSError:
            continue
        if st.st_size == f.size:
            records[_file_key(p)] = [st.st_size, st.st_mtime_ns, f.sha256]
    _write_records(engine_dir, records)


def verify_files(engine_dir: Path, manifest: Manifest, rehash: bool = False, record: bool = True) -> None:
    """Check every file the manifest lists: present, right size and right sha256.

    A file recorded in the user's cache (:func:`trusted_records_path`) with its current absolute path, size,
    mtime and the manifest's sha256 is trusted without hashing, unless ``rehash``. Files hashed here are
    recorded (``record``; best effort, nothing is written into ``engine_dir``). Raises ManifestError naming
    the file and the fix.
    """
    engine_dir = Path(engine_dir)
    seen = _read_records(engine_dir)
    records = dict(seen)
    changed = False
    try:
        keys = set()
        for f in manifest.all_files():
            p = engine_dir / f.path
            if not p.is_file():
                raise ManifestError(f"{p} is missing (listed in the manifest); rebuild or re-unpack the engine")
            st = p.stat()
            if st.st_size != f.size:
                raise ManifestError(f"{p} has {st.st_size} bytes but the manifest says {f.size}: the file is "
                                    "truncated or corrupted; rebuild or re-unpack the engine")
            key = _file_key(p)
            keys.add(key)
            rec = [st.st_size, st.st_mtime_ns, f.sha256]
            if not rehash and seen.get(key) == rec:
                continue
            digest = sha256_file(p)
            if digest != f.sha256:
                changed |= records.pop(key, None) is not None
                raise ManifestError(f"{p} is corrupted: sha256 {digest[:16]}… does not match the manifest's "
                                    f"{f.sha256[:16]}…; rebuild or re-unpack the engine")
            changed |= records.get(key) != rec
            records[key] = rec
        stale = set(records) - keys  # files the manifest no longer lists
        for k in stale:
            del records[k]
        changed |= bool(stale)
    finally:
        if record and changed:  # also when a file failed: keep what was checked before it
            _write_records(engine_dir, records)


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
