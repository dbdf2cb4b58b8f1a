"""4-bit weight-only graphs for ONNX Runtime's CPU provider: every weight MatMul becomes
``com.microsoft.MatMulNBits`` (block-wise integer weights, one float scale per block).

Two weight sources (``int4_source``):

* ``gguf`` — **faithful to the GGUF the model came from.** The GGUF's own quantized blocks are re-packed
  into MatMulNBits blocks, so the graph computes with exactly the weights llama.cpp runs:

  ================  ==============================  ==========================================================
  GGUF block type   GGUF dequantization             MatMulNBits encoding (exact to float rounding)
  ================  ==============================  ==========================================================
  Q4_K              32-wide sub-blocks, d·sc·q−dmin·m  bits 4, block 32, scale d·sc, zero point 0, minus a
                    (q 0..15, affine)                  block-min correction (below)
  Q5_K              same, q 0..31                      bits 8, block 32, zero point 0, correction
  Q6_K              16-wide, d·sc·(q−32), q 0..63      bits 8, block 16, scale d·sc, zero point 32
  Q8_0              32-wide, d·q, q −128..127           bits 8, block 32, zero point 128
  Q5_0 / Q4_0       32-wide, d·(q−16) / d·(q−8)         bits 8 / 4, block 32, zero point 16 / 8
  Q5_1 / Q4_1       32-wide, d·q + m                    bits 8 / 4, block 32, zero point 0, correction
  ================  ==============================  ==========================================================

  The affine types (K-quants' sub-block minimum, Q4_1/Q5_1's ``m``) have a *float* offset per block. MatMulNBits
  accepts float zero points, but ONNX Runtime 1.32's CPU kernel then leaves its integer path (measured on a
  1536×8960 weight: 32–40 ms per call against 0.14 ms with uint8 zero points, and 8-bit weights with float zero
  points are refused outright). So the offset is applied outside the kernel, exactly:
  ``x · W = MatMulNBits(x; q, s, zp=0) − blocksum(x) · C`` with ``blocksum(x)[b] = Σ_{k in block b} x_k``
  (``[.., K/32]``) and ``C[b, n] = dmin·m`` of that block (fp32 ``[K/32, N]``: one float per 32 weights).
  Every re-packed tensor is checked against the graph's own fp32 weight (the Hugging Face folder was made by
  dequantizing the same GGUF): the encoded weight must equal it (max |Δ| is recorded; a mismatch refuses the
  build, naming the tensor). Block types without an exact encoding here (Q2_K, Q3_K, IQ*) are re-quantized
  from the float weight to 8 bits per 32 (symmetric RTN), named in the report with their error; F32/F16/BF16
  weights stay fp32 MatMuls.
* ``rtn`` — **from float weights** (any Hugging Face checkpoint): ONNX Runtime's own
  ``onnxruntime.quantization.matmul_nbits_quantizer`` (round-to-nearest, symmetric, 4 bits, block 32 by default;
  ``hqq`` uses its HQQ config). It holds the whole graph in memory (9.3 GB peak for the 1.5B target, measured).

``accuracy_level`` (MatMulNBits attribute; 4 by default): 4 quantizes the activations to int8 per block inside
the kernel (what llama.cpp does too: its K-quant dot products take Q8_K activations); 0/1 keep fp32 activations.
8-bit weights need 4 on the CPU provider (0 takes a ~100× slower path, measured).

Output: the graph with MatMulNBits nodes and its weights in one external ``.data`` file, written one tensor at a
time (peak memory ≈ the graph structure plus one dequantized weight in row chunks). Both writers then merge the
MatMulNBits nodes that read the same activation (q/k/v, gate/up) into one each, bit-identically
(:mod:`dspark_export.precision.nbits_fuse`).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_export.precision.nbits_fuse import fuse_shared_inputs
from dspark_runtime.errors import DSparkError

INT4_SOURCES = ("auto", "gguf", "rtn", "hqq")
DEFAULT_ACCURACY_LEVEL = 4
DEFAULT_BLOCK_SIZE = 32  # the rtn/hqq block; gguf blocks follow the file (16 or 32)
_ROW_CHUNK = 4096  # output channels re-packed per step (LM head: 4096 × 1536 floats = 24 MB)


# ------------------------------------------------------------------------------------------ encoding
@dataclass
class NBitsWeight:
    """One weight ``W [K, N]`` in MatMulNBits form (``N`` output channels, blocks along ``K``).

    bits: 4 or 8. block_size: 16 or 32. packed: uint8 ``[N, K/block, block·bits/8]`` (4-bit: two values per
    byte, the even index in the low nibble). scales: float32 ``[N, K/block]``. zero_points: uint8
    ``[N, K/block]`` unpacked (see :meth:`packed_zero_points`). correction: float32 ``[K/block, N]`` or None:
    the per-block offset subtracted as ``blocksum(x) @ correction``.
    Represented weight: ``W[k, n] = scales[n, b] · (q[n, k] − zero_points[n, b]) − correction[b, n]``, b = k // block.
    """

    bits: int
    block_size: int
    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    correction: np.ndarray | None = None

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        return self.packed.shape[1] * self.block_size

    def codes(self) -> np.ndarray:
        """The integer codes, uint8 ``[N, K]``."""
        if self.bits == 8:
            return self.packed.reshape(self.n, self.k)
        p = self.packed.reshape(self.n, -1)
        q = np.empty((self.n, p.shape[1] * 2), np.uint8)
        q[:, 0::2], q[:, 1::2] = p & 0x0F, p >> 4
        return q

    def packed_zero_points(self) -> np.ndarray:
        """Zero points as MatMulNBits takes them: 8-bit one byte per block ``[N·K/block]``; 4-bit two per byte,
        low nibble first, each column padded to whole bytes ``[N·ceil(K/block / 2)]``."""
        z = self.zero_points
        if self.bits == 8:
            return z.reshape(-1)
        kb = z.shape[1]
        if kb % 2:
            z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], axis=1)
        return (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8).reshape(-1)

    def dequantize(self) -> np.ndarray:
        """The represented weight, float32 ``[K, N]`` (tests and the faithfulness check)."""
        q = self.codes().reshape(self.n, -1, self.block_size).astype(np.float32)
        w = (q - self.zero_points[..., None].astype(np.float32)) * self.scales[..., None]
        if self.correction is not None:
            w = w - self.correction.T[..., None]
        return w.reshape(self.n, self.k).T


def _pack(codes: np.ndarray, bits: int, block: int) -> np.ndarray:
    """uint8 codes ``[N, K]`` -> MatMulNBits ``B [N, K/block, block·bits/8]``."""
    n, k = codes.shape
    if bits == 8:
        return np.ascontiguousarray(codes.reshape(n, k // block, block))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).reshape(n, k // block, block // 2)


# GGUF type -> (bits, MatMulNBits block, zero point, affine: has a per-block float offset)
_ENCODINGS = {"Q4_K": (4, 32, 0, True), "Q5_K": (8, 32, 0, True), "Q6_K": (8, 16, 32, False),
              "Q8_0": (8, 32, 128, False), "Q5_0": (8, 32, 16, False), "Q4_0": (4, 32, 8, False),
              "Q5_1": (8, 32, 0, True), "Q4_1": (4, 32, 0, True)}
FLOAT_TYPES = ("F32", "F16", "BF16")


def gguf_block_params(blocks: np.ndarray, qtype: str) -> tuple:
    """Per sub-block scale and offset of GGUF blocks, as ggml computes them (float32).

    blocks: uint8 ``[n_blocks, type_size]``, one GGUF block per row. Returns ``(scale, offset)``, each float32
    ``[n_blocks, sub-blocks per block]``, such that each value is ``scale · q_signed − offset`` with the type's
    own integer ``q_signed`` (Q4_K: ``d·sc`` and ``dmin·m``; Q6_K: ``d·sc`` (sc signed), offset 0; Q8_0/Q5_0/Q4_0:
    ``d``, 0; Q4_1/Q5_1: ``d`` and ``−m``). Raises DSparkError for a type without an encoding here.
    """
    from gguf import quants

    f16 = lambda a: np.ascontiguousarray(a).view(np.float16).astype(np.float32)  # noqa: E731
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = f16(blocks[:, 0:2]), f16(blocks[:, 2:4])
        sc, m = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        sc, m = sc.reshape(len(blocks), -1), m.reshape(len(blocks), -1)
        return d * sc.astype(np.float32), dmin * m.astype(np.float32)
    if qtype == "Q6_K":
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        return f16(blocks[:, 208:210]) * sc, np.zeros_like(sc)
    if qtype in ("Q8_0", "Q5_0", "Q4_0"):
        d = f16(blocks[:, 0:2])
        return d, np.zeros_like(d)
    if qtype in ("Q4_1", "Q5_1"):
        return f16(blocks[:, 0:2]), -f16(blocks[:, 2:4])
    raise DSparkError(f"GGUF block type {qtype} has no MatMulNBits encoding here")


def encode_gguf_rows(rows: np.ndarray, qtype: str, k: int) -> tuple:
    """Re-pack GGUF rows (output channels) into MatMulNBits blocks, exactly.

    rows: uint8 ``[N, bytes per row]`` as ``gguf.GGUFReader`` gives a quantized tensor of ``k`` input features.
    The integer codes are recovered from gguf-py's own dequantization (``gguf.quants.dequantize``, the values the
    Hugging Face conversion stored) and the block parameters (:func:`gguf_block_params`):
    ``q = rint((w + offset) / scale) + zero point`` (a zero scale gives the zero point).
    Returns ``(NBitsWeight, w)`` with ``w`` the GGUF's dequantized weight float32 ``[N, k]``. Raises DSparkError
    when a value is not reproduced to float rounding (a corrupt block or a layout this code does not know).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    if qtype not in _ENCODINGS:
        raise DSparkError(f"GGUF block type {qtype} has no MatMulNBits encoding here")
    bits, block, zp, affine = _ENCODINGS[qtype]
    gtype = GGMLQuantizationType[qtype]
    qk, tsize = GGML_QUANT_SIZES[gtype]
    n = rows.shape[0]
    w = quants.dequantize(np.ascontiguousarray(rows), gtype).reshape(n, k).astype(np.float32, copy=False)
    scale, offset = gguf_block_params(rows.reshape(n * (k // qk), tsize), qtype)
    scale, offset = scale.reshape(n, k // block), offset.reshape(n, k // block)
    if not (np.isfinite(scale).all() and np.isfinite(offset).all()):
        raise DSparkError(f"GGUF {qtype} blocks hold non-finite scales (a corrupt file); fetch the model again")
    wb = w.reshape(n, k // block, block)
    safe = np.where(scale != 0, scale, 1.0).astype(np.float32)
    q = np.rint((wb + offset[..., None]) / safe[..., None])
    q = np.where(scale[..., None] != 0, q, 0) + zp
    hi = (1 << bits) - 1
    if q.min() < 0 or q.max() > hi:
        raise DSparkError(f"GGUF {qtype} codes out of range ({q.min():.0f}..{q.max():.0f}); unknown block layout")
    codes = q.astype(np.uint8).reshape(n, k)
    enc = NBitsWeight(bits, block, _pack(codes, bits, block), scale.astype(np.float32),
                      np.full((n, k // block), zp, np.uint8), offset.T.copy() if affine else None)
    back = (codes.reshape(n, k // block, block).astype(np.float32) - zp) * scale[..., None] - offset[..., None]
    err = float(np.abs(back - wb).max()) if n else 0.0
    tol = 1e-6 * max(1.0, float(np.abs(wb).max()) if n else 1.0)
    if err > tol:
        raise DSparkError(f"re-packing GGUF {qtype} blocks does not reproduce the weights (max |Δ| {err:.3g}); "
                          "use --int4-source rtn for this model")
    return enc, w


def rtn8_rows(w: np.ndarray, block: int = 32) -> NBitsWeight:
    """Symmetric 8-bit round-to-nearest per ``block`` along K of float32 rows ``w [N, K]`` (the fallback for
    GGUF block types without an exact encoding): scale = max |w| / 127 per block, zero point 128."""
    n, k = w.shape
    wb = w.reshape(n, k // block, block)
    s = np.abs(wb).max(axis=-1) / 127.0
    s = np.where(s > 0, s, 1.0).astype(np.float32)
    q = (np.clip(np.rint(wb / s[..., None]), -127, 127) + 128).astype(np.uint8).reshape(n, k)
    return NBitsWeight(8, block, _pack(q, 8, block), s, np.full((n, k // block), 128, np.uint8))


# ------------------------------------------------------------------------------- GGUF <-> graph names
_GGUF_NAMES = [
    (r"layers\.(\d+)\.self_attn\.q_proj", "blk.{}.attn_q.weight"),
    (r"layers\.(\d+)\.self_attn\.k_proj", "blk.{}.attn_k.weight"),
    (r"layers\.(\d+)\.self_attn\.v_proj", "blk.{}.attn_v.weight"),
    (r"layers\.(\d+)\.self_attn\.o_proj", "blk.{}.attn_output.weight"),
    (r"layers\.(\d+)\.mlp\.gate_proj", "blk.{}.ffn_gate.weight"),
    (r"layers\.(\d+)\.mlp\.up_proj", "blk.{}.ffn_up.weight"),
    (r"layers\.(\d+)\.mlp\.down_proj", "blk.{}.ffn_down.weight"),
]


def gguf_tensor_name(module: str, gguf_names) -> str | None:
    """The GGUF tensor holding the weight of graph module ``module`` (``layers.3.mlp.down_proj`` ->
    ``blk.3.ffn_down.weight``; ``lm_head`` -> ``output.weight``, or ``token_embd.weight`` when the file ties the
    LM head to the embedding). ``gguf_names``: the names in the file. None when there is no such tensor."""
    if re.search(r"(^|\.)lm_head$", module):
        for cand in ("output.weight", "token_embd.weight"):
            if cand in gguf_names:
                return cand
        return None
    for pat, fmt in _GGUF_NAMES:
        m = re.search(r"(^|\.)" + pat + "$", module)
        if m:
            name = fmt.format(m.group(2))
            return name if name in gguf_names else None
    return None


# ------------------------------------------------------------------------------------- graph writers
@dataclass(frozen=True)
class _Meta:
    """What the graph rewrite needs of an encoded weight."""

    bits: int
    block_size: int
    k: int
    n: int
    correction: bool


def _nbits_nodes(helper, node_name: str, x: str, y: str, wname: str, enc: _Meta, accuracy_level: int,
                 blocksums: dict, nodes: list, metadata=()) -> None:
    """Append the MatMulNBits node (and the correction) computing ``y = x @ W`` to ``nodes``.
    ``blocksums``: activation -> its block-sum tensor, shared by the MatMuls that read the same input.
    ``metadata``: the replaced MatMul's ``metadata_props`` (the torch module it was traced from), kept."""
    ins = [x, wname + "_Q", wname + "_scales", wname + "_zp"]
    out = y if not enc.correction else node_name + "_nbits"
    mm = helper.make_node("MatMulNBits", ins, [out], name=node_name + "_MatMulNBits", domain="com.microsoft",
                          K=enc.k, N=enc.n, bits=enc.bits, block_size=enc.block_size, accuracy_level=accuracy_level)
    mm.metadata_props.extend(metadata)
    nodes.append(mm)
    if not enc.correction:
        return
    key = (x, enc.block_size)
    if key not in blocksums:
        base = f"{x}_blocksum{enc.block_size}"
        nodes.append(helper.make_node("Reshape", [x, f"__nbits_shape_{enc.k}_{enc.block_size}"], [base + "_r"],
                                      name=base + "_Reshape"))
        nodes.append(helper.make_node("ReduceSum", [base + "_r", "__nbits_axis_last"], [base], keepdims=0,
                                      name=base + "_ReduceSum"))
        blocksums[key] = base
    corr = node_name + "_correction"
    nodes.append(helper.make_node("MatMul", [blocksums[key], wname + "_corr"], [corr], name=corr + "_MatMul"))
    nodes.append(helper.make_node("Sub", [out, corr], [y], name=node_name + "_Sub"))


def quantize_nbits_gguf(src: Path, dst: Path, gguf_path: Path, *, accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                        log=print) -> dict:
    """Write ``dst`` (+ ``dst.data``): graph ``src`` with every weight MatMul that has a GGUF tensor as
    MatMulNBits over the GGUF's own blocks (see the module doc for the encodings). Streams one tensor at a time.

    Args:
        src: fp32 ``.onnx`` graph exported from the Hugging Face folder converted from ``gguf_path`` (never
            modified; its external weights are read to check each re-packed tensor).
        gguf_path: the GGUF file.
        accuracy_level: MatMulNBits ``accuracy_level`` (4: int8 activations, as llama.cpp's CPU kernels).
    Returns the manifest's quantization record: precision, source, accuracy level, per-GGUF-type counts and
    encodings, the fallback and fp32 tensors by name, max |Δ| of the encoded weights against the fp32 graph,
    weight bytes before and after, seconds, peak RSS (GiB). Raises DSparkError when the GGUF is missing, a graph
    weight's GGUF tensor has another shape, or the re-packed weight differs from the graph's fp32 weight.
    """
    import gguf
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from dspark_export.graphs.onnx_io import ExternalData, ExternalWriter, peak_rss_gb, quant_targets

    src, dst, gguf_path = Path(src), Path(dst), Path(gguf_path)
    if not gguf_path.is_file():
        raise DSparkError(f"GGUF {gguf_path} not found; fetch the model again (`dspark-export fetch`) or use "
                          "--int4-source rtn")
    t0 = time.perf_counter()
    reader_g = gguf.GGUFReader(str(gguf_path))
    gtensors = {t.name: t for t in reader_g.tensors}
    proto = onnx.load(str(src), load_external_data=False)
    targets, _ = quant_targets(proto, ())
    plan = {}  # weight initializer -> (gguf tensor name, [targets])
    unmatched = []
    for q in targets:
        gname = gguf_tensor_name(q.module, gtensors)
        if gname is None:
            unmatched.append(q.module)
            continue
        plan.setdefault(q.weight, (gname, []))[1].append(q)
    if not plan:
        raise DSparkError(f"no MatMul of {src.name} maps to a tensor of {gguf_path.name}; is this the GGUF the "
                          "model was converted from? Use --int4-source rtn otherwise")
    target_nodes = {q.node for _, qs in plan.values() for q in qs}
    shared = {i for n in proto.graph.node if n.name not in target_nodes for i in n.input if i in plan}
    reader = ExternalData(src.parent)
    counts, fallback, kept_fp32, max_err = {}, {}, [], 0.0
    encoded = {}  # weight -> _Meta
    bytes_in = sum(reader.nbytes(t) for t in proto.graph.initializer)
    writer = ExternalWriter(dst)
    new_inits = []
    with writer:
        for t in proto.graph.initializer:
            if t.name not in plan:
                new_inits.append(writer.copy(t, reader))
                continue
            gname, qs = plan[t.name]
            gt = gtensors[gname]
            k, n = (int(d) for d in t.dims)
            qtype = gt.tensor_type.name
            if tuple(int(d) for d in gt.shape) != (k, n):
                raise DSparkError(f"GGUF tensor {gname} has shape {list(gt.shape)} but {qs[0].module} in {src.name} "
                                  f"is [{k}, {n}]; the GGUF is not the one the model was converted from")
            counts[qtype] = counts.get(qtype, 0) + 1
            if qtype in FLOAT_TYPES:
                kept_fp32.append(qs[0].module)
                new_inits.append(writer.copy(t, reader))
                continue
            full = np.frombuffer(reader.read(t), np.float32).reshape(k, n)  # the graph's fp32 W [K, N]
            parts, d_max = [], 0.0
            for a in range(0, n, _ROW_CHUNK):  # output channels a:b = GGUF rows a:b
                b = min(n, a + _ROW_CHUNK)
                ref = np.ascontiguousarray(full[:, a:b].T)
                rows = np.asarray(gt.data[a:b])
                if qtype in _ENCODINGS:  # the encoding reproduces the GGUF's values (checked inside)
                    enc, w = encode_gguf_rows(rows, qtype, k)
                    d = float(np.abs(w - ref).max())
                else:
                    from gguf import GGMLQuantizationType, quants

                    w = quants.dequantize(rows, GGMLQuantizationType[qtype]).reshape(b - a, k)
                    enc = rtn8_rows(w.astype(np.float32))
                    d = float(np.abs(enc.dequantize().T - ref).max())
                if qtype in _ENCODINGS and d > 1e-5 * max(1.0, float(np.abs(ref).max())):
                    raise DSparkError(f"the re-packed {gname} ({qtype}) differs from the graph's weight of "
                                      f"{qs[0].module} by {d:.3g}; the GGUF is not the one the model was "
                                      "converted from (use --int4-source rtn)")
                d_max = max(d_max, d)
                parts.append(enc)
            del full
            if qtype not in _ENCODINGS:
                fallback.setdefault(qtype, []).append({"module": qs[0].module, "max_abs_weight_diff": d_max})
            max_err = max(max_err, d_max)
            e0 = parts[0]
            new_inits.append(writer.put((p.packed for p in parts), t.name + "_Q", TensorProto.UINT8,
                                        (n, k // e0.block_size, e0.packed.shape[2])))
            new_inits.append(writer.put((p.scales for p in parts), t.name + "_scales", TensorProto.FLOAT,
                                        (n * (k // e0.block_size),)))
            zps = [p.packed_zero_points() for p in parts]
            new_inits.append(writer.put(zps, t.name + "_zp", TensorProto.UINT8, (sum(z.size for z in zps),)))
            if e0.correction is not None:
                corr = np.concatenate([p.correction for p in parts], axis=1)
                new_inits.append(writer.put([corr], t.name + "_corr", TensorProto.FLOAT, corr.shape))
            if t.name in shared:
                new_inits.append(writer.copy(t, reader))
            encoded[t.name] = _Meta(e0.bits, e0.block_size, k, n, e0.correction is not None)
            log(f"  {qs[0].module:28s} <- {gname:26s} {qtype:5s} -> {e0.bits}-bit block {e0.block_size}"
                + (" + min correction" if e0.correction is not None else "") + f"  (max |dW| {d_max:.1e})")
    reader.close()
    nodes, blocksums = [], {}
    by_node = {q.node: (w, q) for w, (_, qs) in plan.items() for q in qs}
    fp32_weights = {w for w, (g, _) in plan.items() if gtensors[g].tensor_type.name in FLOAT_TYPES}
    need_shapes = set()
    for node in proto.graph.node:
        hit = by_node.get(node.name)
        if hit is None or hit[0] in fp32_weights:
            nodes.append(node)
            continue
        wname, q = hit
        meta = encoded[wname]
        _nbits_nodes(helper, node.name, q.activation, node.output[0], wname, meta, accuracy_level, blocksums, nodes,
                     node.metadata_props)
        if meta.correction:
            need_shapes.add((meta.k, meta.block_size))
    for k, blk in sorted(need_shapes):
        new_inits.append(numpy_helper.from_array(np.array([0, 0, k // blk, blk], np.int64),
                                                 f"__nbits_shape_{k}_{blk}"))
    if need_shapes:
        new_inits.append(numpy_helper.from_array(np.array([-1], np.int64), "__nbits_axis_last"))
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(new_inits)
    _add_ms_opset(proto, helper)
    onnx.save_model(proto, str(dst))
    merged = fuse_shared_inputs(dst, log=log)
    _check(dst)
    by_type = {qt: {"tensors": c, "encoding": _describe(qt)} for qt, c in sorted(counts.items())}
    rep = {"precision": "int4", "int4_source": "gguf", "gguf": gguf_path.name, "accuracy_level": accuracy_level,
           "method": "GGUF blocks re-packed into com.microsoft.MatMulNBits (exact; affine block offsets as a "
                     "block-sum correction)",
           "gguf_types": by_type, "fallback_rtn8": fallback, "kept_fp32": kept_fp32, "unmatched": unmatched,
           "max_abs_weight_diff_vs_fp32_graph": max_err, "matmul_nbits": len(target_nodes) - len(kept_fp32),
           "merged_shared_inputs": merged,
           "weight_bytes_in": bytes_in, "weight_bytes_out": writer.bytes_out,
           "seconds": round(time.perf_counter() - t0, 1), "peak_rss_gb": round(peak_rss_gb(), 2)}
    log(f"  {rep['matmul_nbits']} MatMulNBits from {gguf_path.name} ({', '.join(f'{c} {t}' for t, c in counts.items())})"
        f"; weights {bytes_in / 2**30:.2f} -> {writer.bytes_out / 2**30:.2f} GiB in {rep['seconds']:.0f} s, "
        f"peak RSS {rep['peak_rss_gb']:.2f} GiB")
    return rep


def _describe(qtype: str) -> str:
    if qtype in FLOAT_TYPES:
        return "kept fp32 MatMul"
    if qtype not in _ENCODINGS:
        return "no exact encoding: 8-bit symmetric RTN per 32 from the float weight"
    bits, block, zp, affine = _ENCODINGS[qtype]
    return f"bits {bits}, block {block}, zero point {zp}" + (", block-min correction" if affine else "")


def _add_ms_opset(proto, helper) -> None:
    if not any(op.domain == "com.microsoft" for op in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def _check(dst: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(dst))
    except Exception as e:
        raise DSparkError(f"the int4 graph {dst} fails the ONNX checker: {e}") from e


def quantize_nbits_rtn(src: Path, dst: Path, *, algorithm: str = "rtn", bits: int = 4,
                       block_size: int = DEFAULT_BLOCK_SIZE, accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                       log=print) -> dict:
    """Write ``dst`` (+ ``dst.data``): graph ``src`` with every weight MatMul quantized from its float weights by
    ONNX Runtime's ``MatMulNBitsQuantizer`` (``algorithm`` ``"rtn"``: its default symmetric round-to-nearest
    config; ``"hqq"``: its HQQ config, asymmetric). Holds the whole graph in memory (≈ 1.3× the fp32 weights).
    Returns the quantization record. Raises DSparkError when the quantizer fails."""
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    from dspark_export.graphs.onnx_io import peak_rss_gb

    src, dst = Path(src), Path(dst)
    t0 = time.perf_counter()
    if algorithm == "rtn":
        cfg = mnq.DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level,
                                               bits=bits)
    elif algorithm == "hqq":
        cfg = mnq.HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits)
    else:
        raise DSparkError(f"no float-weight int4 algorithm {algorithm!r}; choose rtn or hqq")
    try:
        q = mnq.MatMulNBitsQuantizer(onnx.load(str(src)), bits=bits, block_size=block_size, is_symmetric=True,
                                     accuracy_level=accuracy_level, algo_config=cfg)
        q.process()
        for p in (dst, dst.with_name(dst.name + ".data")):
            if p.exists():
                p.unlink()
        onnx.save_model(q.model.model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dst.name + ".data", size_threshold=1024)
    except DSparkError:
        raise
    except Exception as e:
        raise DSparkError(f"ONNX Runtime's MatMulNBitsQuantizer failed on {src.name}: {e}") from e
    del q
    proto = onnx.load(str(dst), load_external_data=False)
    n = sum(nd.op_type == "MatMulNBits" for nd in proto.graph.node)
    if algorithm == "hqq":  # HQQ writes no accuracy_level: set it so the integer kernels are used
        for nd in proto.graph.node:
            if nd.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in nd.attribute):
                nd.attribute.append(onnx.helper.make_attribute("accuracy_level", accuracy_level))
        onnx.save_model(proto, str(dst))
    merged = fuse_shared_inputs(dst, log=log)
    _check(dst)
    from dspark_export.graphs.onnx_io import graph_weight_bytes

    rep = {"precision": "int4", "int4_source": algorithm, "bits": bits, "block_size": block_size,
           "accuracy_level": accuracy_level,
           "method": f"ONNX Runtime MatMulNBitsQuantizer ({'symmetric RTN' if algorithm == 'rtn' else 'HQQ'}, "
                     f"{bits}-bit, block {block_size}) from the float weights",
           "matmul_nbits": n, "merged_shared_inputs": merged, "weight_bytes_in": graph_weight_bytes(src),
           "weight_bytes_out": graph_weight_bytes(dst),
           "seconds": round(time.perf_counter() - t0, 1), "peak_rss_gb": round(peak_rss_gb(), 2)}
    log(f"  {n} MatMulNBits ({rep['method']}); weights {rep['weight_bytes_in'] / 2**30:.2f} -> "
        f"{rep['weight_bytes_out'] / 2**30:.2f} GiB in {rep['seconds']:.0f} s, peak RSS {rep['peak_rss_gb']:.2f} GiB")
    return rep
