"""Graph and weight I/O shared by the quantizers (QDQ, int4, FP8): which MatMuls carry weights, their module
names, reading initializers from a graph's external data without loading it, writing a rewritten graph's weights
one tensor at a time, and a session over a weightless graph that reads the original weights from disk."""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError
from dspark_runtime.kernels import register_kernels

ALIGN = 4096  # external data offsets page-aligned (lets ONNX Runtime map them)


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, GiB (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def module_name(node) -> str:
    """A readable name for a MatMul node: the torch module it was traced from (``layers.3.mlp.down_proj``,
    ``lm_head``) when the exporter recorded it, else the node name."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = [s for s in json.loads(p.value.replace("'", '"')) if s]
            except ValueError:
                break
            mods = [s for s in scopes if "." in s or s.startswith("model")]
            if mods:
                return re.sub(r"^(model\.)+", "", mods[-1])
    return node.name


@dataclass(frozen=True)
class QuantTarget:
    """One MatMul to quantize: node name, readable module name, activation input, weight initializer."""

    node: str
    module: str
    activation: str
    weight: str


def quant_targets(proto, exclude=()) -> tuple[list, list]:
    """The MatMuls of ``proto`` that take a 2-D float32 weight initializer as input B.

    ``exclude``: regular expressions matched (``re.search``) against the module name
    (e.g. ``"down_proj"``, ``"lm_head"``) or the node name; matches stay fp32.
    Returns (targets, excluded) lists of :class:`QuantTarget`.
    """
    from onnx import TensorProto

    inits = {t.name: t for t in proto.graph.initializer}
    pats = [re.compile(p) for p in exclude]
    out, skipped = [], []
    for n in proto.graph.node:
        if n.op_type != "MatMul" or len(n.input) != 2:
            continue
        a, w = n.input
        t = inits.get(w)
        if t is None or a in inits or len(t.dims) != 2 or t.data_type != TensorProto.FLOAT:
            continue  # activations on both sides (attention), or not a float weight
        q = QuantTarget(n.name, module_name(n), a, w)
        (skipped if any(p.search(q.module) or p.search(q.node) for p in pats) else out).append(q)
    return out, skipped


def session_over_weights(proto, weights_dir: Path, threads: int, kernels: Path | None = None):
    """An ONNX Runtime CPU session for ``proto`` (loaded without its weights) reading the external
    weights from ``weights_dir`` — the file on disk is not copied. ``kernels``: the custom-op library its
    ``ai.dspark`` nodes need (:mod:`dspark_runtime.kernels`), if any."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if kernels is not None:
        register_kernels(so, kernels)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(weights_dir))
    try:
        return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise DSparkError(f"ONNX Runtime could not load the calibration graph over {weights_dir}: {e}") from e


class ExternalData:
    """Reads initializers of a graph loaded with ``load_external_data=False``: inline ``raw_data`` or
    byte ranges of the external files beside the graph, read with plain file reads (a memory map would
    count every page touched in the process's resident memory)."""

    def __init__(self, base: Path):
        self.base = base
        self._files: dict = {}

    @staticmethod
    def info(t) -> dict | None:
        if t.data_location != 1:  # onnx.TensorProto.EXTERNAL
            return None
        return {e.key: e.value for e in t.external_data}

    def _file(self, loc: str):
        if loc not in self._files:
            p = self.base / loc
            if not p.is_file():
                raise DSparkError(f"external weights {p} not found; the graph's .data file must sit beside it")
            self._files[loc] = open(p, "rb")
        return self._files[loc]

    def nbytes(self, t) -> int:
        e = self.info(t)
        return int(e["length"]) if e is not None else len(t.raw_data) or int(np.prod(t.dims)) * 4

    def read(self, t, start: int = 0, length: int | None = None) -> bytes:
        """``length`` bytes of the initializer's data from byte ``start`` (all of it by default)."""
        e = self.info(t)
        if e is None:
            from onnx import numpy_helper

            b = numpy_helper.to_array(t).tobytes()
            return b[start:None if length is None else start + length]
        f = self._file(e["location"])
        total = int(e["length"])
        length = total - start if length is None else min(length, total - start)
        f.seek(int(e.get("offset", 0)) + start)
        b = f.read(length)
        if len(b) != length:
            raise DSparkError(f"external weights {e['location']} are truncated at tensor {t.name!r}; "
                              "re-export the graph")
        return b

    def close(self) -> None:
        for f in self._files.values():
            f.close()


class ExternalWriter:
    """Writes the initializers of a rewritten graph ``dst`` into one external file ``<dst name>.data`` beside it
    (replacing ``dst`` and that file if present), one tensor at a time, offsets page-aligned. Use as a context
    manager; ``bytes_out`` counts the tensor bytes written."""

    def __init__(self, dst: Path):
        self.dst = Path(dst)
        self.data_name = self.dst.name + ".data"
        self.bytes_out = 0
        self._f = None

    def __enter__(self):
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        for p in (self.dst, self.dst.with_name(self.data_name)):
            if p.exists():
                p.unlink()
        self._f = open(self.dst.with_name(self.data_name), "wb")
        return self

    def __exit__(self, *exc):
        self._f.close()

    def put(self, arrays, name: str, dtype: int, dims):
        """Append ``arrays`` (an iterable of numpy arrays, written in order as raw bytes) as external tensor
        ``name`` of ONNX type ``dtype`` and shape ``dims``; returns its TensorProto."""
        from onnx import TensorProto

        f = self._f
        f.write(b"\0" * ((-f.tell()) % ALIGN))
        off = f.tell()
        for arr in arrays:
            f.write(np.ascontiguousarray(arr).tobytes())
        length = f.tell() - off
        self.bytes_out += length
        t = TensorProto(name=name, data_type=dtype, dims=[int(d) for d in dims])
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.data_name), ("offset", str(off)), ("length", str(length))):
            e = t.external_data.add()
            e.key, e.value = k, v
        return t

    def copy(self, t, reader: "ExternalData"):
        """Initializer ``t`` unchanged: small inline tensors as they are, external ones streamed across."""
        if reader.info(t) is None:
            return t
        size = reader.nbytes(t)
        return self.put((np.frombuffer(reader.read(t, i, 64 << 20), np.uint8) for i in range(0, size, 64 << 20)),
                        t.name, t.data_type, t.dims)


def default_opset(proto, missing: int = 17) -> int:
    """The version of the default ONNX domain ``proto`` imports (``missing`` when it imports none)."""
    return next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), missing)


def node_attributes(node) -> dict:
    """An ONNX node's attributes as {name: Python value}."""
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def set_live_nodes(graph, nodes: list) -> None:
    """Set ``graph``'s nodes to ``nodes`` minus those whose outputs nothing reads (neither another kept node nor a
    graph output), repeated until none is left to drop; the order of the rest is kept."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in nodes for i in n.input} | outputs
        live = [n for n in nodes if any(o in read for o in n.output)]
        if len(live) == len(nodes):
            break
        nodes = live
    del graph.node[:]
    graph.node.extend(nodes)


def read_initializer(t, reader: ExternalData) -> np.ndarray:
    """Initializer ``t`` (of a graph loaded without its weights) as a numpy array of its shape and dtype."""
    from onnx import helper

    dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
    return np.frombuffer(reader.read(t), dtype).reshape([int(d) for d in t.dims])


@dataclass
class GraphRewrite:
    """What :func:`rewrite_in_place` hands its caller: ``reader`` over the old weights, ``writer`` for the new
    ``.data``; set ``proto`` to the rewritten graph (its initializers written through ``writer``) to commit it."""

    reader: ExternalData
    writer: ExternalWriter
    proto: object = None


@contextmanager
def rewrite_in_place(path: Path, tag: str):
    """Rewrite the ONNX graph ``path`` and its ``<name>.data`` in place, atomically per file: the new weights go to a
    private folder beside ``path`` (``.<tag>-<pid>-<name>``); when the block ends with ``GraphRewrite.proto`` set,
    the graph is saved there and both files replace the old ones; on an error or with ``proto`` unset the old
    files stay as they were. The folder is removed whatever happens."""
    import onnx

    path = Path(path)
    tmp = path.parent / f".{tag}-{os.getpid()}-{path.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    rw = GraphRewrite(ExternalData(path.parent), ExternalWriter(tmp / path.name))
    try:
        with rw.writer:
            yield rw
        rw.reader.close()
        if rw.proto is not None:
            onnx.save_model(rw.proto, str(tmp / path.name))
            os.replace(tmp / (path.name + ".data"), path.parent / (path.name + ".data"))
            os.replace(tmp / path.name, path)
    finally:
        rw.reader.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _initializer_bytes(path: Path, counted) -> int:
    """Bytes of the initializers of the ``.onnx`` graph ``path`` that ``counted(proto)`` names (a set of names, None:
    all), from the graph's structure only (the weights are not loaded). Raises DSparkError when the graph is
    missing."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise DSparkError(f"graph {path} not found")
    proto = onnx.load(str(path), load_external_data=False)
    names = counted(proto)
    reader = ExternalData(path.parent)  # nbytes reads only the tensors' metadata, no file is opened
    return sum(reader.nbytes(t) for t in proto.graph.initializer if names is None or t.name in names)


def graph_weight_bytes(path: Path) -> int:
    """Bytes of all initializers of the ``.onnx`` graph ``path`` (external data lengths plus inline tensors).
    Raises DSparkError when the graph is missing."""
    return _initializer_bytes(path, lambda proto: None)


def step_weight_bytes(path: Path) -> int:
    """Bytes of the initializers one decoding step reads whole: every initializer except tables only indexed by
    position or token — the data of a ``Gather`` (the token embedding, the screened head's rows: a step reads one row
    per token or candidate) and the cos/sin caches of a ``RotaryEmbedding`` (one row per position). Raises DSparkError
    when the graph is missing."""
    indexed_inputs = {"Gather": (0,), "RotaryEmbedding": (2, 3)}

    def read_whole(proto) -> set:
        indexed, other = set(), set()
        for n in proto.graph.node:
            rows = indexed_inputs.get(n.op_type, ())
            for k, i in enumerate(n.input):
                (indexed if k in rows else other).add(i)
        return {t.name for t in proto.graph.initializer if not (t.name in indexed and t.name not in other)}

    return _initializer_bytes(path, read_whole)
