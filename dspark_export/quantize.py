"""Static INT8 / FP8 post-training quantization of decoder graphs to QDQ, memory-bounded.

Two steps, each usable on its own:

1. **Calibration** (:func:`calibrate_graph`, ``dspark-export calibrate-quant``): real calibration-split
   prompts (``dspark_export/data/prompts/README.md``: gsm8k 901–1000, math500 351–400, mbpp 181–200 — never evaluation
   prompts) run through the fp32 graph in the shapes the runtime uses: a *prefill* of the prompt (past 0,
   q = prompt length), greedy *decode* steps (q = 1 on the cache) and a *verify* step (the greedy
   continuation fed as one q = ``verify_len`` chunk on the prompt's cache). A calibration set of verify
   steps alone misses the prefill's larger activations. For every activation that feeds a quantized
   MatMul the running min and max over all steps are kept (the MinMax method: ReduceMin/ReduceMax nodes
   added to a weightless copy of the graph, which ONNX Runtime runs over the original external weights,
   so calibration holds one copy of the weights). The result is a :class:`CalibrationTable` (JSON) whose
   ``data_id`` is the sha256 of every token id fed.

2. **Quantization** (:func:`quantize_qdq`): every MatMul whose second input is
   a 2-D float weight initializer (the linear layers and the LM head; never the attention score/value
   MatMuls, whose both inputs are activations, and never the mask arithmetic, which is not a MatMul)
   becomes ``DQ(Q(x)) @ DQ(W_q)`` with per-output-channel symmetric weights (axis 1 of ``W[K, N]``) stored
   already quantized:

   * ``int8``      — for ONNX Runtime on x86: U8 activations (asymmetric, per tensor) with S8 weights,
     which ONNX Runtime fuses into integer MatMuls. Without AVX-VNNI (AVX2 only, as on this machine) the
     U8S8 kernels add pairs of u8·s8 products in saturating int16, so weights use 7 bits (±64,
     ``reduce_range``; ONNX Runtime's documented remedy) unless ``reduce_range=False``.
   * ``int8-trt``  — for TensorRT: symmetric S8 activations and S8 weights (zero points 0), the only
     INT8 Q/DQ TensorRT accepts (as NVIDIA ModelOpt's int8 mode writes).
   * ``fp8``       — for TensorRT on compute capability >= 8.9: FLOAT8E4M3FN weights (scale = column
     max |W| / 448) and FLOAT8E4M3FN activations (symmetric per tensor, scale = max(|lo|, |hi|) / 448, zero
     point 0), the opset raised to 19 (the first with FP8 Q/DQ). The memory-bounded alternative to NVIDIA
     ModelOpt (:mod:`dspark_export.fp8`), which peaks at ~7.5x the fp32 weights.

   The graph is rewritten one initializer at a time while the external data is streamed from the source
   file to the destination file, so peak memory is the graph's structure plus the largest single weight
   (the LM head: 0.54 GB fp32 on Qwen2.5-0.5B, 0.93 GB on the 1.5B), not a multiple of the model.

ONNX Runtime's ``quantize_static`` writes the same QDQ pattern but loads the whole model (and the
calibrator a second augmented copy), ~2–3× the fp32 weights; it is the reference our writer is tested
against on tiny graphs (``tests/test_quantize.py``). The FP8 output is tested against a numpy
fake-quantization with ``ml_dtypes`` (``tests/test_fp8.py``).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError

INT8_PRECISIONS = ("int8", "int8-trt")
QDQ_PRECISIONS = INT8_PRECISIONS + ("fp8",)  # what the streaming writer makes
FP8_MAX = 448.0  # largest finite FLOAT8E4M3FN value (E4M3, "fn": no infinities, one NaN pattern)
FP8_MIN_OPSET = 19  # first default-domain opset whose QuantizeLinear/DequantizeLinear take FLOAT8E4M3FN
# Modules kept in fp32 by default (module-name regular expressions). Measured on the Qwen2.5-Coder-0.5B
# graph (8 calibration-split prompts; 8 held-out prompts, teacher-forced top-1 agreement with fp32 at
# prefill / verify, relative L2 of the prefill logits):
#   everything quantized            75.1% / 98.4%, rel L2 0.27  (down_proj inputs reach -565..+484)
#   LM head kept fp32               75.4% / 96.9%, rel L2 0.26  (the LM head is not the problem)
#   down_proj of 5 outlier layers   87.2% / 98.4%, rel L2 0.14
#   every mlp.down_proj kept fp32   92.5% / 98.4%, rel L2 0.074 (weights 0.97 -> 1.26 GiB)
#   ... and o_proj / q,k,v / gate,up too: 93.0 / 92.1 / 93.7% at prefill, 1.31-1.84 GiB
#   8-bit instead of 7-bit weights   1.1% /  0.0% (U8S8 saturation on AVX2)
DEFAULT_EXCLUDE: tuple = (r"mlp\.down_proj",)
CALIBRATION_METHOD = "minmax"
_ALIGN = 4096  # external data offsets page-aligned (lets ONNX Runtime map them)


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, GiB (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ---------------------------------------------------------------------------------------------- graph
def _module_name(node) -> str:
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
        q = QuantTarget(n.name, _module_name(n), a, w)
        (skipped if any(p.search(q.module) or p.search(q.node) for p in pats) else out).append(q)
    return out, skipped


# ---------------------------------------------------------------------------------------- calibration
@dataclass
class CalibrationTable:
    """Activation ranges for static quantization of one graph.

    ranges: activation tensor name -> [min, max] (float, over all calibration steps);
    data_id: sha256 (hex) of the token ids fed, in order; steps: [{"kind": "prefill"|"decode"|"verify",
    "q": int, "past": int}] per step; prompts: where the prompts came from; graph_sha256: the fp32 graph
    (``.onnx`` file, not the weights) it was measured on.
    """

    ranges: dict
    data_id: str
    steps: list
    prompts: str
    method: str = CALIBRATION_METHOD
    graph_sha256: str = ""
    seconds: float = 0.0
    peak_rss_gb: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def summary(self) -> dict:
        """What the manifest records (no per-tensor ranges)."""
        kinds = {}
        for s in self.steps:
            kinds.setdefault(s["kind"], []).append(s["q"])
        return {"data_id": self.data_id, "method": self.method, "prompts": self.prompts,
                "steps": {k: {"count": len(v), "q_min": min(v), "q_max": max(v)} for k, v in kinds.items()},
                "tensors": len(self.ranges)}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @staticmethod
    def load(path: Path) -> "CalibrationTable":
        """Read a table written by :meth:`save`; DSparkError if missing or malformed."""
        path = Path(path)
        if not path.is_file():
            raise DSparkError(f"calibration table {path} not found; make one with `dspark-export calibrate-quant`")
        try:
            return CalibrationTable(**json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise DSparkError(f"{path} is not a calibration table ({e}); make one with "
                              "`dspark-export calibrate-quant`") from e


def calibration_token_ids(tokenizer, n_prompts: int, max_len: int = 256) -> list:
    """Token ids of ``n_prompts`` calibration-split prompts (chat-templated when the tokenizer has a
    template), each cut to its first ``max_len`` tokens. Returns a list of int lists."""
    from dspark_export.calibrate import calibration_prompts

    if n_prompts < 1:
        raise DSparkError(f"calibration needs at least one prompt, got {n_prompts}")
    out = []
    for p in calibration_prompts(n_prompts):
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}]) if tokenizer.chat_template else p
        out.append(list(tokenizer.encode(text))[:max_len])
    return out


def _session_over_weights(proto, weights_dir: Path, threads: int):
    """An ONNX Runtime CPU session for ``proto`` (loaded without its weights) reading the external
    weights from ``weights_dir`` — the file on disk is not copied."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(weights_dir))
    try:
        return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise DSparkError(f"ONNX Runtime could not load the calibration graph over {weights_dir}: {e}") from e


def calibrate_graph(graph_path: Path, spec, token_lists: list, *, verify_len: int = 8, threads: int = 2,
                    exclude=(), prompts_note: str = "", on_feeds=None, log=print) -> CalibrationTable:
    """Measure the activation ranges of ``graph_path`` (an fp32 ``causal_lm`` graph, growing KV layout).

    Args:
        graph_path: the ``.onnx`` file; its external weights are read in place.
        spec: the graph's :class:`~dspark_runtime.graphspec.GraphSpec`.
        token_lists: prompts as token-id lists (see :func:`calibration_token_ids`); each needs ≥ 2 tokens.
        verify_len: greedy decode steps per prompt (q = 1), then the same tokens as one verify chunk.
        exclude: module-name patterns left fp32 (their inputs are not measured).
        on_feeds: called with each step's input dict (tests replay them through other calibrators).
    Returns a :class:`CalibrationTable`. Raises DSparkError on a bad graph or empty input.
    """
    import onnx
    from onnx import helper

    graph_path = Path(graph_path)
    if not graph_path.is_file():
        raise DSparkError(f"graph {graph_path} not found")
    if not token_lists or any(len(t) < 2 for t in token_lists):
        raise DSparkError("calibration needs prompts of at least 2 tokens each")
    t0 = time.perf_counter()
    proto = onnx.load(str(graph_path), load_external_data=False)
    targets, _ = quant_targets(proto, exclude)
    acts = sorted({q.activation for q in targets})
    if not acts:
        raise DSparkError(f"{graph_path.name} has no MatMul with a weight initializer to calibrate")
    red_outs = []
    for i, a in enumerate(acts):
        for op in ("ReduceMin", "ReduceMax"):
            name = f"__calib_{op}_{i}"
            proto.graph.node.append(helper.make_node(op, [a], [name], keepdims=0, name=name))
            proto.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, []))
            red_outs.append(name)
    sess = _session_over_weights(proto, graph_path.parent, threads)
    del proto
    d = spec.dims
    out_names = spec.output_names
    n_main = len(out_names)
    first_kv = 2 if "features" in out_names else 1
    lo = np.full(len(acts), np.inf)
    hi = np.full(len(acts), -np.inf)
    steps, h = [], hashlib.sha256()

    def run(ids: list, past_kv: list, past: int, kind: str):
        q = len(ids)
        feeds = {"input_ids": np.asarray([ids], np.int64),
                 "position_ids": np.arange(past, past + q, dtype=np.int64)[None],
                 "attention_mask": np.tril(np.ones((q, past + q), bool), k=past)[None, None]}
        for i, (k, v) in enumerate(past_kv):
            feeds[f"past.{i}.key"], feeds[f"past.{i}.value"] = np.ascontiguousarray(k), np.ascontiguousarray(v)
        if on_feeds is not None:
            on_feeds(feeds)
        outs = sess.run(out_names + red_outs, feeds)
        r = np.asarray(outs[n_main:], dtype=np.float64)
        np.minimum(lo, r[0::2], out=lo)
        np.maximum(hi, r[1::2], out=hi)
        steps.append({"kind": kind, "q": q, "past": past})
        h.update(json.dumps([kind, past, [int(t) for t in ids]]).encode())
        kv = [(outs[first_kv + 2 * i], outs[first_kv + 2 * i + 1]) for i in range(d.num_layers)]
        return outs[0][0, -1], kv

    empty = np.zeros((1, d.num_kv_heads, 0, d.head_dim), np.float32)
    for j, ids in enumerate(token_lists):
        last, kv = run(list(ids), [(empty, empty)] * d.num_layers, 0, "prefill")
        prompt_kv, n = kv, len(ids)
        cont = []
        for _ in range(verify_len):  # greedy decode, q = 1
            cont.append(int(np.argmax(last)))
            last, kv = run([cont[-1]], kv, n + len(cont) - 1, "decode")
        # the same continuation as one verify chunk on the prompt's cache
        run(cont, prompt_kv, n, "verify")
        log(f"  calibration prompt {j + 1}/{len(token_lists)}: {n} tokens + {verify_len} decoded + verify "
            f"q={verify_len} ({time.perf_counter() - t0:.0f} s)")
    del sess
    ranges = {a: [float(lo[i]), float(hi[i])] for i, a in enumerate(acts)}
    from dspark_runtime.manifest import sha256_file

    return CalibrationTable(ranges=ranges, data_id=h.hexdigest(), steps=steps, prompts=prompts_note,
                            graph_sha256=sha256_file(graph_path), seconds=round(time.perf_counter() - t0, 1),
                            peak_rss_gb=round(peak_rss_gb(), 2),
                            extra={"verify_len": verify_len, "exclude": list(exclude)})


# --------------------------------------------------------------------------------------- quantization
def to_e4m3(x: np.ndarray) -> np.ndarray:
    """``x`` (float32, already divided by its scale) as FLOAT8E4M3FN: saturated to ±448, then rounded to the
    nearest E4M3 value, ties to even (``ml_dtypes`` cast; what ONNX's QuantizeLinear does with
    ``saturate=1``). ``ml_dtypes`` alone would turn values beyond ±448 into NaN, hence the clip first.
    Returns an array of dtype ``ml_dtypes.float8_e4m3fn`` (1 byte per element), same shape."""
    import ml_dtypes

    return np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def activation_qparams(lo: float, hi: float, signed: bool = True, fp8: bool = False) -> tuple:
    """Per-tensor activation scale and zero point for range [lo, hi] (widened to include 0).

    fp8 (TensorRT, E4M3): symmetric, scale = max(|lo|, |hi|) / 448, zero point FLOAT8E4M3FN 0 (``signed``
        is implied).
    signed (TensorRT): symmetric S8, zero point 0, scale = max(|lo|, |hi|) / 127.
    unsigned (ONNX Runtime): asymmetric U8, scale = (hi - lo) / 255, zero point = round(-lo / scale).
    A range of only zeros gets scale 1. Returns (scale float32 scalar, zero point scalar of dtype
    uint8 / int8 / ``ml_dtypes.float8_e4m3fn``).
    """
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if fp8:
        import ml_dtypes

        return np.float32(max(abs(lo), abs(hi)) / FP8_MAX or 1.0), ml_dtypes.float8_e4m3fn(0)
    if signed:
        s = max(abs(lo), abs(hi)) / 127.0 or 1.0
        return np.float32(s), np.int8(0)
    s = (hi - lo) / 255.0 or 1.0
    return np.float32(s), np.uint8(np.clip(round(-lo / s), 0, 255))


def quantize_weight_chunks(read_rows, k: int, n: int, qmax: float, chunk_bytes: int = 32 << 20, fp8: bool = False):
    """Symmetric per-column (axis 1) quantization of a weight W [k, n] float32, in row chunks.

    ``read_rows(a, b)`` returns W[a:b] as float32. Two passes: column max |W| (scale = max / qmax; an
    all-zero column gets scale 1), then the quantized rows: int8 ``clip(rint(W / scale), -qmax, qmax)``, or
    with ``fp8`` FLOAT8E4M3FN :func:`to_e4m3` ``(W / scale)`` (qmax should then be 448).
    Yields ``("scale", float32 [n])`` first, then ``("rows", int8 or float8_e4m3fn [b - a, n])`` chunks.
    Peak extra memory: a few chunks of ~``chunk_bytes`` of rows, not the whole weight.
    """
    chunk_rows = max(1, chunk_bytes // (4 * n))
    amax = np.zeros(n, np.float32)
    for a in range(0, k, chunk_rows):
        np.maximum(amax, np.abs(read_rows(a, min(k, a + chunk_rows))).max(axis=0), out=amax)
    scale = np.where(amax > 0, amax / np.float32(qmax), 1.0).astype(np.float32)
    yield "scale", scale
    for a in range(0, k, chunk_rows):
        w = read_rows(a, min(k, a + chunk_rows))
        if fp8:
            yield "rows", to_e4m3(w / scale)
        else:
            yield "rows", np.clip(np.rint(w / scale), -qmax, qmax).astype(np.int8)


class _ExternalData:
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


class _ExternalWriter:
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
        f.write(b"\0" * ((-f.tell()) % _ALIGN))
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

    def copy(self, t, reader: "_ExternalData"):
        """Initializer ``t`` unchanged: small inline tensors as they are, external ones streamed across."""
        if reader.info(t) is None:
            return t
        size = reader.nbytes(t)
        return self.put((np.frombuffer(reader.read(t, i, 64 << 20), np.uint8) for i in range(0, size, 64 << 20)),
                        t.name, t.data_type, t.dims)


def graph_weight_bytes(path: Path) -> int:
    """Bytes of all initializers of the ``.onnx`` graph ``path`` (external data lengths plus inline
    tensors), read from the graph's structure only (the weights are not loaded). Raises DSparkError when
    the graph is missing."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise DSparkError(f"graph {path} not found")
    proto = onnx.load(str(path), load_external_data=False)
    reader = _ExternalData(path.parent)  # nbytes reads only the tensors' metadata, no file is opened
    return sum(reader.nbytes(t) for t in proto.graph.initializer)


def quantize_qdq(src: Path, dst: Path, table: CalibrationTable, precision: str = "int8", *,
                 reduce_range: bool | None = None, exclude=(), log=print) -> dict:
    """Write the QDQ-quantized copy of graph ``src`` to ``dst`` (+ ``dst.data``), streaming the weights.

    For every target MatMul ``x[..., K] @ W[K, N]`` (see :func:`quant_targets`) the graph gets
    ``QuantizeLinear(x)`` (one per activation tensor, scalar scale and zero point) -> one
    ``DequantizeLinear`` per consuming MatMul, and the weight stored quantized as ``<W>_quantized`` [K, N]
    with ``<W>_scale`` (float32 [N]) and ``<W>_zero_point`` ([N], zeros) feeding ``DequantizeLinear(axis=1)``.

    * ``int8`` / ``int8-trt``: INT8 weights, UINT8 (asymmetric) / INT8 (symmetric) activations.
    * ``fp8``: FLOAT8E4M3FN weights (scale = column max |W| / 448, ``W / scale`` saturated to ±448 and
      rounded to nearest even), FLOAT8E4M3FN activations (scale = max(|lo|, |hi|) / 448 from ``table``,
      scalar FP8 zero point 0), the default-domain opset raised to 19 when lower (FP8 Q/DQ needs it; the
      IR version to at least 9). NVIDIA ModelOpt (:mod:`dspark_export.fp8`) writes the same activation
      pattern but keeps the weights fp32 behind their own QuantizeLinear -> DequantizeLinear (TensorRT folds
      them at build time), so its file is as large as the fp32 one; here the weights are stored already in
      FP8 (1 byte per weight, a quarter of the fp32 file) behind a DequantizeLinear only — the same
      structure as ``int8-trt``. ModelOpt also shares one activation DequantizeLinear between the MatMuls
      reading the same tensor; here each MatMul gets its own (as ONNX Runtime's quantizer writes).

    Args:
        src: fp32 ``.onnx`` graph (external weights beside it; never modified).
        dst: output ``.onnx``; its weights go to ``<dst name>.data`` beside it (replaced if present).
        table: activation ranges from :func:`calibrate_graph` on ``src``.
        precision: one of :data:`QDQ_PRECISIONS`: ``"int8"`` (U8 activations / S8 weights, ONNX Runtime),
            ``"int8-trt"`` (S8/S8 symmetric, TensorRT) or ``"fp8"`` (E4M3/E4M3 symmetric, TensorRT on
            compute capability >= 8.9).
        reduce_range: 7-bit weights (±64; 2·255·64 < 2¹⁵). Default: True for ``int8`` (AVX2 saturation,
            see module doc), False for ``int8-trt``; not applicable to ``fp8``.
        exclude: module-name regular expressions left fp32 (see :func:`quant_targets`).
    Peak memory: the graph's structure plus a few 32 MB row chunks of one weight.
    Returns a report dict: precision, method, activation / weight formats, quantized count, excluded
    module names, weight bytes before and after, opset before and after, checks (ONNX checker, Q/DQ node
    counts, FP8 initializers), seconds, peak RSS (GiB). Raises DSparkError for an unknown precision,
    ``reduce_range`` with ``fp8``, a missing activation range (calibrated with other exclusions or on
    another graph), unreadable weights, or an output that fails the ONNX checker.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if precision not in QDQ_PRECISIONS:
        raise DSparkError(f"the QDQ writer makes {', '.join(QDQ_PRECISIONS)}, not {precision!r}")
    fp8 = precision == "fp8"
    if fp8:
        if reduce_range:
            raise DSparkError("reduce_range (7-bit weights) applies to int8 only, not fp8")
        import ml_dtypes

        reduce_range, signed, qmax = False, True, FP8_MAX
        w_type, w_zero = TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn
    else:
        signed = precision == "int8-trt"
        if reduce_range is None:
            reduce_range = not signed
        qmax = 64 if reduce_range else 127  # ONNX Runtime's reduce_range for S8: [-64, 64]
        w_type, w_zero = TensorProto.INT8, np.int8
    src, dst = Path(src), Path(dst)
    t0 = time.perf_counter()
    proto = onnx.load(str(src), load_external_data=False)
    targets, skipped = quant_targets(proto, exclude)
    missing = sorted({q.activation for q in targets} - set(table.ranges))
    if missing:
        raise DSparkError(f"the calibration table has no range for {len(missing)} MatMul input(s) of {src.name} "
                          f"(e.g. {missing[0]!r}); calibrate this graph with the same exclusions "
                          "(`dspark-export calibrate-quant`)")
    by_weight = {}
    for q in targets:
        by_weight.setdefault(q.weight, []).append(q)
    target_nodes = {q.node for q in targets}
    # a weight also read by a node left in fp32 (a shared or partly excluded weight) keeps its fp32 copy
    shared = {i for n in proto.graph.node if n.name not in target_nodes for i in n.input if i in by_weight}
    reader = _ExternalData(src.parent)
    bytes_in = 0
    new_inits = []
    writer = _ExternalWriter(dst)
    with writer:
        for t in proto.graph.initializer:
            bytes_in += reader.nbytes(t)
            if t.name in by_weight:
                k, n = t.dims

                def rows(a, b, t=t, n=n):
                    return np.frombuffer(reader.read(t, a * n * 4, (b - a) * n * 4), np.float32).reshape(b - a, n)

                chunks = quantize_weight_chunks(rows, k, n, qmax, fp8=fp8)
                _, scale = next(chunks)
                new_inits.append(writer.put((c for _, c in chunks), t.name + "_quantized", w_type, (k, n)))
                new_inits.append(numpy_helper.from_array(scale, t.name + "_scale"))
                new_inits.append(numpy_helper.from_array(np.zeros(n, w_zero), t.name + "_zero_point"))
                if t.name in shared:
                    new_inits.append(writer.copy(t, reader))
            else:
                new_inits.append(writer.copy(t, reader))
    bytes_out = writer.bytes_out
    reader.close()
    # activation Q (one per tensor) and DQ (one per consumer), weight DQ, in topological order
    act_q, nodes = {}, []
    by_node = {q.node: q for q in targets}
    for node in proto.graph.node:
        q = by_node.get(node.name)
        if q is not None:
            if q.activation not in act_q:
                s, zp = activation_qparams(*table.ranges[q.activation], signed=signed, fp8=fp8)
                base = f"{q.activation}_act"
                new_inits.append(numpy_helper.from_array(np.array(s, np.float32), base + "_scale"))
                new_inits.append(numpy_helper.from_array(np.array(zp), base + "_zero_point"))
                nodes.append(helper.make_node("QuantizeLinear", [q.activation, base + "_scale", base + "_zero_point"],
                                              [base + "_q"], name=base + "_QuantizeLinear"))
                act_q[q.activation] = base
            base = act_q[q.activation]
            a_dq = f"{node.name}_input_dq"
            nodes.append(helper.make_node("DequantizeLinear", [base + "_q", base + "_scale", base + "_zero_point"],
                                          [a_dq], name=a_dq))
            w_dq = f"{node.name}_weight_dq"
            nodes.append(helper.make_node("DequantizeLinear", [q.weight + "_quantized", q.weight + "_scale",
                                                               q.weight + "_zero_point"], [w_dq], name=w_dq, axis=1))
            del node.input[:]
            node.input.extend([a_dq, w_dq])
        nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(new_inits)
    opset = {op.domain or "ai.onnx": op.version for op in proto.opset_import}
    opset_in = opset.get("ai.onnx")
    if fp8:
        for op in proto.opset_import:
            if op.domain in ("", "ai.onnx") and op.version < FP8_MIN_OPSET:
                # 18 -> 19 only widens existing operators' types (FP8) / adds optional attributes
                op.version = FP8_MIN_OPSET
        proto.ir_version = max(proto.ir_version, 9)  # IR 9 introduced the FP8 element types
    opset_out = {op.domain or "ai.onnx": op.version for op in proto.opset_import}.get("ai.onnx")
    onnx.save_model(proto, str(dst))
    try:
        onnx.checker.check_model(str(dst))
    except Exception as e:
        raise DSparkError(f"the quantized graph {dst} fails the ONNX checker: {e}") from e
    ops = [n.op_type for n in nodes]
    checks = {"checker": "passed", "quantize_linear": ops.count("QuantizeLinear"),
              "dequantize_linear": ops.count("DequantizeLinear"),
              "fp8_tensors": sum(t.data_type == TensorProto.FLOAT8E4M3FN for t in new_inits)}
    if fp8:
        acts = "FLOAT8E4M3FN symmetric per tensor (scale = max(|lo|, |hi|) / 448, zero point 0)"
        wts = ("FLOAT8E4M3FN symmetric per channel (axis 1, scale = column max |W| / 448), stored quantized "
               "(1 byte per weight) behind DequantizeLinear")
    else:
        acts = "int8 symmetric per tensor" if signed else "uint8 asymmetric per tensor"
        wts = f"int8 symmetric per channel (axis 1), {'7-bit (reduce_range)' if reduce_range else '8-bit'}"
    rep = {"precision": precision, "method": f"static QDQ, {CALIBRATION_METHOD} activation ranges",
           "activations": acts, "weights": wts, "opset": {"from": opset_in, "to": opset_out}, "checks": checks,
           **({} if signed else {"reduce_range": bool(reduce_range)}),
           "quantized": len(targets), "excluded": sorted({q.module for q in skipped}),
           "excluded_patterns": list(exclude),
           "lm_head_quantized": any(q.module == "lm_head" for q in targets),
           "weight_bytes_in": bytes_in, "weight_bytes_out": bytes_out,
           "seconds": round(time.perf_counter() - t0, 1), "peak_rss_gb": round(peak_rss_gb(), 2)}
    if fp8:
        rep["requires"] = "TensorRT on compute capability >= 8.9 (ONNX Runtime CPU runs it 6-10x slower than fp32)"
    log(f"  quantized {len(targets)} MatMuls of {src.name} -> {dst.name} ({precision}); weights "
        f"{bytes_in / 2**30:.2f} -> {bytes_out / 2**30:.2f} GiB in {rep['seconds']:.0f} s, "
        f"peak RSS {rep['peak_rss_gb']:.2f} GiB"
        + (f"; opset {opset_in} -> {opset_out}" if opset_in != opset_out else ""))
    return rep


# ------------------------------------------------------------------------------------------ agreement
def logit_agreement(ref, cand, token_lists: list, verify_len: int = 8) -> dict:
    """Teacher-forced agreement of two decoders (e.g. an fp32 graph and its int8 copy) on prompts.

    ``ref``/``cand``: :class:`~dspark_runtime.backend.OrtDecoder` of the same graph interface. They are
    run one after the other — the reference over every prompt, then its session is released
    (``deactivate``), then the candidate — so only one graph's weights are in memory at a time; the
    reference's logits are kept (prompt length × vocabulary × 4 bytes per prompt).
    Per prompt: both prefill the prompt (past 0, every position compared), then both verify the same
    chunk — the reference's greedy continuation of ``verify_len`` tokens — on their own caches.
    Returns {"prefill"|"verify": {"top1_agreement": fraction of positions whose argmax is equal,
    "max_abs_logit_diff", "rel_l2": mean over positions of ||l_c - l_r||_2 / ||l_r||_2, "positions"}}.
    """

    def run(dec, ids, cont=None):
        n = len(ids)
        x = np.asarray([ids], np.int64)
        pre = dec.step(x, np.arange(n, dtype=np.int64)[None], np.tril(np.ones((n, n), bool))[None, None],
                       dec.empty_kv(1))
        if cont is None:  # the reference's greedy continuation, q = 1 steps
            cont, last, kv = [], pre.logits[0, -1], pre.kv
            for _ in range(verify_len):
                cont.append(int(np.argmax(last)))
                m1 = np.ones((1, 1, 1, n + len(cont)), bool)
                o = dec.step(np.asarray([[cont[-1]]]), np.asarray([[n + len(cont) - 1]]), m1, kv)
                last, kv = o.logits[0, -1], o.kv
        v = len(cont)
        ver = dec.step(np.asarray([cont], np.int64), np.arange(n, n + v, dtype=np.int64)[None],
                       np.tril(np.ones((v, n + v), bool), k=n)[None, None], pre.kv)
        return pre.logits[0], ver.logits[0], cont

    ref.activate()
    recorded = [run(ref, ids) for ids in token_lists]
    if cand is not ref:
        ref.deactivate()
    cand.activate()
    acc = {k: {"agree": 0, "n": 0, "maxd": 0.0, "rel": 0.0} for k in ("prefill", "verify")}
    for ids, (r_pre, r_ver, cont) in zip(token_lists, recorded):
        c_pre, c_ver, _ = run(cand, ids, cont)
        for kind, a, b in (("prefill", r_pre, c_pre), ("verify", r_ver, c_ver)):
            s = acc[kind]
            s["agree"] += int((a.argmax(-1) == b.argmax(-1)).sum())
            s["n"] += a.shape[0]
            s["maxd"] = max(s["maxd"], float(np.abs(a - b).max()))
            s["rel"] += float((np.linalg.norm(b - a, axis=-1) / np.linalg.norm(a, axis=-1)).sum())
    return {k: {"top1_agreement": s["agree"] / s["n"], "max_abs_logit_diff": s["maxd"], "rel_l2": s["rel"] / s["n"],
                "positions": s["n"]} for k, s in acc.items()}


# ------------------------------------------------------------------------------------------- engines
def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (same file system; no extra disk), else copy it."""
    import shutil

    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def quantize_engine(src_dir: Path, out_dir: Path, precision: str, *, calibration_prompts: int = 16,
                    tables: dict | None = None, exclude=None, fp8_writer: str = "auto", int4_source: str = "auto",
                    log=print):
    """Write ``out_dir``: a copy of the built engine ``src_dir`` whose graphs have the precisions of
    ``precision`` (as ``dspark-export build --precision``: one for all, or ``target=int8,draft=int8``).

    Graphs kept as they are, the tokenizer and other files are hard-linked (copied across file systems);
    the source engine is never modified. Each quantized graph is calibrated on the calibration split
    (or takes ``tables[role]``, a :class:`CalibrationTable` from ``calibrate-quant``), quantized
    one weight at a time, and checked against its fp32 graph on the validation prompt
    (``validation[precision]``: top-1 agreement, max |Δlogits|, relative L2 at prefill and verify).
    ``fp8_writer``: ``"auto"`` | ``"modelopt"`` | ``"stream"`` for fp8 graphs (see
    :func:`dspark_export.build.quantize_graph`; the record's ``"writer"`` says which one ran).
    ``int4_source``: ``"auto"`` | ``"gguf"`` | ``"rtn"`` | ``"hqq"`` for int4 graphs, one for all or per graph
    (``"target=gguf,draft=rtn"``; see :func:`dspark_export.build.resolve_int4_source`: the GGUF is found from the
    graph's fetched model).
    Returns the new Manifest. Raises DSparkError when ``out_dir`` is ``src_dir`` or a non-empty
    directory, when a graph to quantize is not fp32 or not a decoder (``causal_lm``), for a bad spec
    or an unknown fp8 writer.
    """
    from dspark_export.build import CALIBRATED, PRECISIONS, VALIDATION_TEXT, Recipe, \
        _build_machine, _tool_versions, _write_manifest, quantize_graph
    from dspark_runtime.backend import OrtDecoder
    from dspark_runtime.manifest import FileEntry, load_manifest
    from dspark_export.fp8 import check_fp8_writer
    from dspark_runtime.tokenizer import Tokenizer

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    recipe = Recipe(name="-", target="-", precision=precision, calibration_prompts=calibration_prompts,
                    int4_source=int4_source)
    recipe.validate()
    check_fp8_writer(fp8_writer)
    if out_dir.resolve() == src_dir.resolve():
        raise DSparkError("write the quantized engine to a new directory (-o NEW_DIR); the source engine is kept")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise DSparkError(f"{out_dir} exists and is not empty; pick a new directory or remove it")
    m = load_manifest(src_dir)
    plan = {}
    for role in ("target", "draft"):
        want = recipe.precision_for(role)
        g = m.graphs.get(role)
        if g is None or want == g.precision:
            continue
        if want not in PRECISIONS or want == "fp32":
            raise DSparkError(f"cannot turn the {g.precision} {role} graph into {want}; start from an fp32 engine")
        if g.precision != "fp32" or g.spec.kind != "causal_lm":
            raise DSparkError(f"the {role} graph is {g.precision} {g.spec.kind}; only fp32 decoder graphs "
                              "(causal_lm) can be quantized: start from an fp32 engine")
        if g.spec.kv_layout != "growing":
            raise DSparkError(f"the {role} graph has the {g.spec.kv_layout} KV layout; `dspark-export quantize` "
                              "calibrates and compares growing-layout graphs: build the quantized engine directly "
                              "(`dspark-export build --precision int4`), or start from an engine built with "
                              "`--kv-layout growing`")
        plan[role] = want
    if not plan:
        raise DSparkError(f"nothing to do: {src_dir} already has precision {precision!r} for every graph it holds")
    for key in ("row_invariance", "cost_table"):  # measured on the source's graphs: re-profile the new engine
        if m.speculation.pop(key, None) is not None:
            log(f"  dropped speculation.{key} (measured on the source engine's graphs); run `dspark-export profile "
                f"{out_dir}` on the deployment machine")
    tok = Tokenizer(src_dir / m.tokenizer["dir"])
    calib_ids = None
    if any(p == "fp8" or (p in CALIBRATED and not (tables or {}).get(r)) for r, p in plan.items()):
        calib_ids = calibration_token_ids(tok, calibration_prompts)
    val_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": VALIDATION_TEXT}])
                         if tok.chat_template else VALIDATION_TEXT)
    out_dir.mkdir(parents=True, exist_ok=True)
    quantized_files = {f"{r}.onnx" for r in plan} | {f"{r}.onnx.data" for r in plan}
    for f in m.all_files():
        if f.path not in quantized_files:
            _link_or_copy(src_dir / f.path, out_dir / f.path)
    for extra in ("calibration.json",):
        if (src_dir / extra).is_file():
            _link_or_copy(src_dir / extra, out_dir / extra)
    for role, prec in plan.items():
        g = m.graphs[role]
        src = src_dir / g.model_file
        dst = out_dir / f"{role}.onnx"
        log(f"[{role}] {g.precision} -> {prec}: {src} -> {dst}")
        source, gguf = "rtn", None
        if prec == "int4":
            from dspark_export.build import resolve_int4_source, resolve_model

            try:
                mdir = resolve_model(g.model_id)
            except DSparkError:
                mdir = None  # a model that is not fetched here: float weights only
            source, gguf, why = resolve_int4_source(recipe.int4_source_for(role), role, mdir)
            log(f"[{role}] int4 weights from {source} ({why})")
        q = quantize_graph(src, dst, prec, spec=g.spec, calibration_ids=calib_ids,
                           table=(tables or {}).get(role), exclude=exclude, fp8_writer=fp8_writer,
                           int4_source=source, gguf=gguf, log=log)
        cand = OrtDecoder(dst, g.spec)
        agree = logit_agreement(OrtDecoder(src, g.spec), cand, [val_ids], verify_len=5)  # one graph at a time
        cand.deactivate()
        log(f"[{role}] {prec} vs fp32 on the validation prompt: top-1 agreement prefill "
            f"{agree['prefill']['top1_agreement']:.0%} / verify {agree['verify']['top1_agreement']:.0%}, "
            f"max |dlogits| {agree['prefill']['max_abs_logit_diff']:.2f} / {agree['verify']['max_abs_logit_diff']:.2f}")
        g.precision = prec
        g.files = [FileEntry.of(out_dir, f"{role}.onnx"), FileEntry.of(out_dir, f"{role}.onnx.data")]
        g.validation = {**g.validation, prec: {"reference": "fp32 graph", **agree}}
        g.quantization = {**q, "source": {"engine": str(src_dir), "graph_sha256": next(
            f.sha256 for f in m.all_files() if f.path == g.model_file)}}
    m.name = out_dir.name  # a new engine: named after its directory, as `build` names it
    m.tool_versions = _tool_versions()
    m.build_machine = _build_machine()  # the graphs and their validation figures are this machine's
    from datetime import datetime, timezone

    m.created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    _write_manifest(m, out_dir)
    log(f"wrote {out_dir}")
    return m
