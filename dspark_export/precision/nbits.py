"""4-bit (and 8-bit) weight-only graphs for ONNX Runtime's CPU provider: every weight MatMul becomes
``com.microsoft.MatMulNBits`` (block-wise integer weights, one float scale per block).

This module owns the MatMulNBits weight form (:class:`NBitsWeight`), the nodes that compute ``x @ W`` with it
(:func:`nbits_nodes`, including the block-sum correction for affine blocks); the float-weight writer (ONNX
Runtime's ``MatMulNBitsQuantizer``: ``rtn`` or ``hqq``) is :mod:`dspark_export.precision.nbits_rtn`, the writer faithful
to a GGUF's own blocks :mod:`dspark_export.precision.nbits_gguf`. Both writers then merge the MatMulNBits nodes that
read the same activation, bit-identically (:mod:`dspark_export.precision.nbits_fuse`).

``accuracy_level`` (4 by default) quantizes the activations to int8 per block inside the kernel, as llama.cpp's
CPU kernels do; 8-bit weights need it on the CPU provider. Background and measurements: docs/precision.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError

from dspark_export.graphs.onnx_io import node_attributes

INT4_SOURCES = ("auto", "gguf", "gguf-compact", "gguf-kernel", "rtn", "hqq")
GGUF_SOURCES = ("gguf", "gguf-compact", "gguf-kernel")  # int4 sources read from the GGUF the model was converted from
DEFAULT_ACCURACY_LEVEL = 4
DEFAULT_BLOCK_SIZE = 32  # the rtn/hqq block; gguf blocks follow the file (16 or 32)
# fit_uint_rows: step between the divisors of a block's range it tries, per bit width (4-bit: llama.cpp's 0.1)
STRETCH = {2: 0.15, 4: 0.1}
# block sums per scale of an 8-bit block-sum correction (affine8_rows): one scale for a 1,536-wide input's 48 sums
# (K padded to 64): a faster kernel call than blocks of 16 (measured: docs/precision.md, "What a step is made of")
CORRECTION_BLOCK = 64


@dataclass
class NBitsWeight:
    """One weight ``W [K, N]`` in MatMulNBits form (``N`` output channels, blocks along ``K``).

    bits: 2, 4 or 8. block_size: 16 to 128. packed: uint8 ``[N, K/block, block·bits/8]`` (:func:`pack_codes`:
    8/bits values per byte, the lowest index in the lowest bits). scales: float32 ``[N, K/block]``. zero_points: uint8
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

    @staticmethod
    def from_node(node, array, correction: np.ndarray | None = None) -> "NBitsWeight":
        """The weight a ``com.microsoft.MatMulNBits`` node holds. ``array``: initializer name -> its numpy array;
        ``correction``: the node's block-sum correction float32 ``[K/block, N]``, or None. Absent zero points are the
        kernel's default 2^(bits-1). A ``K`` that is not a multiple of the block (an 8-bit correction over block sums,
        :func:`affine8_rows`) keeps its last, zero-padded block: the weight then has ``ceil(K/block)·block`` rows."""
        a = node_attributes(node)
        n, k, bits, block = a["N"], a["K"], a["bits"], a["block_size"]
        kb = -(-k // block)
        if len(node.input) > 3 and node.input[3]:
            zp = unpack_codes(array(node.input[3]).reshape(n, -1), bits)[:, :kb]  # each column padded to bytes
        else:
            zp = np.full((n, kb), 2 ** (bits - 1), np.uint8)
        return NBitsWeight(bits, block, array(node.input[1]).reshape(n, kb, block * bits // 8),
                           array(node.input[2]).reshape(n, kb).astype(np.float32), zp, correction)

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        return self.packed.shape[1] * self.block_size

    def codes(self) -> np.ndarray:
        """The integer codes, uint8 ``[N, K]``."""
        return unpack_codes(self.packed.reshape(self.n, -1), self.bits)

    def packed_zero_points(self) -> np.ndarray:
        """Zero points as MatMulNBits takes them, packed as the codes are (8-bit: one byte per block; 4-bit: two
        per byte; 2-bit: four), each column padded to whole bytes: uint8 ``[N·ceil(K/block · bits/8)]``."""
        z = self.zero_points
        per = 8 // self.bits
        pad = -z.shape[1] % per
        if pad:
            z = np.concatenate([z, np.zeros((z.shape[0], pad), np.uint8)], axis=1)
        return _pack(z, self.bits).reshape(-1)

    def dequantize(self) -> np.ndarray:
        """The represented weight, float32 ``[K, N]`` (tests and the faithfulness check)."""
        q = self.codes().reshape(self.n, -1, self.block_size).astype(np.float32)
        w = (q - self.zero_points[..., None].astype(np.float32)) * self.scales[..., None]
        if self.correction is not None:
            w = w - self.correction.T[..., None]
        return w.reshape(self.n, self.k).T


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 ``[N, M]`` (M a multiple of 8/bits) -> ``[N, M·bits/8]``: value ``i`` of each byte in bits
    ``bits·i`` upward (MatMulNBits' order: the lowest index in the lowest bits)."""
    per = 8 // bits
    out = np.zeros((codes.shape[0], codes.shape[1] // per), np.uint8)
    for i in range(per):
        out |= (codes[:, i::per] << (bits * i)).astype(np.uint8)
    return out


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of the packing in :func:`pack_codes`: uint8 ``[N, B]`` -> codes uint8 ``[N, B·8/bits]``."""
    per, mask = 8 // bits, (1 << bits) - 1
    q = np.empty((packed.shape[0], packed.shape[1] * per), np.uint8)
    for i in range(per):
        q[:, i::per] = (packed >> (bits * i)) & mask
    return q


def pack_codes(codes: np.ndarray, bits: int, block: int) -> np.ndarray:
    """uint8 codes ``[N, K]`` -> MatMulNBits ``B [N, K/block, block·bits/8]`` (bits 2, 4 or 8)."""
    n, k = codes.shape
    return np.ascontiguousarray(_pack(codes, bits).reshape(n, k // block, block * bits // 8))


def rtn8_rows(w: np.ndarray, block: int = 32) -> NBitsWeight:
    """Symmetric 8-bit round-to-nearest per ``block`` along K of float32 rows ``w [N, K]`` (the fallback for
    GGUF block types without an exact encoding): scale = max |w| / 127 per block, zero point 128."""
    n, k = w.shape
    wb = w.reshape(n, k // block, block)
    s = np.abs(wb).max(axis=-1) / 127.0
    s = np.where(s > 0, s, 1.0).astype(np.float32)
    q = (np.clip(np.rint(wb / s[..., None]), -127, 127) + 128).astype(np.uint8).reshape(n, k)
    return NBitsWeight(8, block, pack_codes(q, 8, block), s, np.full((n, k // block), 128, np.uint8))


def fit_uint_rows(w: np.ndarray, block: int = 32, *, bits: int = 4, start_scales: np.ndarray | None = None,
                  steps: int = 20) -> NBitsWeight:
    """Asymmetric ``bits``-bit blocks (2 or 4) fitted to float32 rows ``w [N, K]``: per block a float scale and an
    integer zero point (the form MatMulNBits runs in its integer path), chosen by least squares.

    Candidates per block: the min/max grid stretched by ``steps`` factors around its ``2^bits − 1`` levels (as
    llama.cpp's ``make_qkx2_quants``), plus ``start_scales`` float32 ``[N, K/block]`` when given (a GGUF sub-block
    scale: its grid then holds every value up to one constant offset); each with the zero point that puts the
    block's minimum on the grid, codes by rounding, and the scale refitted by least squares for those codes. The
    candidate with the least squared error wins. Blocks whose range excludes 0 are widened to include it (the
    grid always holds 0). Returns an :class:`NBitsWeight` (``bits``, ``block``, no correction).
    """
    if bits not in (2, 4):
        raise DSparkError(f"fitted blocks are 2- or 4-bit, got {bits}")
    top = float(2 ** bits - 1)
    n, k = w.shape
    wb = w.reshape(n, k // block, block).astype(np.float32, copy=False)
    lo = np.minimum(wb.min(axis=-1), 0.0)
    hi = np.maximum(wb.max(axis=-1), 0.0)
    span = np.where(hi > lo, hi - lo, 1.0)
    cands = [span / (top + STRETCH[bits] * (i - steps // 2)) for i in range(steps + 1)]
    if start_scales is not None:
        cands.append(np.where(start_scales > 0, start_scales, span / top).astype(np.float32))
    best_err = best_s = best_z = best_q = None
    for s in cands:
        s = s.astype(np.float32)
        z = np.clip(np.rint(-lo / s), 0, top)
        q = np.clip(np.rint(wb / s[..., None]) + z[..., None], 0, top)
        c = q - z[..., None]
        den = (c * c).sum(axis=-1)
        s2 = np.where(den > 0, (wb * c).sum(axis=-1) / np.where(den > 0, den, 1.0), s).astype(np.float32)
        s2 = np.where(s2 > 0, s2, s)
        err = ((c * s2[..., None] - wb) ** 2).sum(axis=-1)
        if best_err is None:
            best_err, best_s, best_z, best_q = err, s2, z, q
            continue
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s2, best_s)
        best_z = np.where(better, z, best_z)
        best_q = np.where(better[..., None], q, best_q)
    codes = best_q.astype(np.uint8).reshape(n, k)
    return NBitsWeight(bits, block, pack_codes(codes, bits, block), best_s.astype(np.float32),
                       best_z.astype(np.uint8))


def affine8_rows(c: np.ndarray, block: int = CORRECTION_BLOCK) -> NBitsWeight:
    """8-bit affine round-to-nearest per ``block`` along K of float32 rows ``c [N, K]`` (a block-sum correction
    stored for MatMulNBits): per block scale = range / 255 over [min(c, 0), max(c, 0)] and the integer zero point
    that puts 0 on the grid; K is padded with zeros to whole blocks (MatMulNBits reads only its ``K``)."""
    n, k = c.shape
    kp = -(-k // block) * block
    c = np.pad(c.astype(np.float32), ((0, 0), (0, kp - k)))
    cb = c.reshape(n, kp // block, block)
    lo, hi = np.minimum(cb.min(axis=-1), 0.0), np.maximum(cb.max(axis=-1), 0.0)
    s = np.where(hi > lo, (hi - lo) / 255.0, 1.0).astype(np.float32)
    z = np.clip(np.rint(-lo / s), 0, 255)
    q = np.clip(np.rint(cb / s[..., None]) + z[..., None], 0, 255).astype(np.uint8).reshape(n, kp)
    return NBitsWeight(8, block, pack_codes(q, 8, block), s, z.astype(np.uint8))


@dataclass(frozen=True)
class NBitsMeta:
    """What :func:`nbits_nodes` needs of an encoded weight: bits, block size, ``K`` x ``N``, whether it has a
    block-sum correction, and how that is stored: ``correction_bits`` 32 (an fp32 ``MatMul`` weight ``_corr``) or 8
    (an 8-bit MatMulNBits over the block sums, blocks of :data:`CORRECTION_BLOCK`: ``_corr_Q/_scales/_zp``)."""

    bits: int
    block_size: int
    k: int
    n: int
    correction: bool
    correction_bits: int = 32


def nbits_nodes(helper, node_name: str, x: str, y: str, wname: str, enc: NBitsMeta, accuracy_level: int,
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
    if enc.correction_bits == 8:
        nodes.append(helper.make_node("MatMulNBits", [blocksums[key], wname + "_corr_Q", wname + "_corr_scales",
                                                      wname + "_corr_zp"], [corr], name=corr + "_MatMulNBits",
                                      domain="com.microsoft", K=enc.k // enc.block_size, N=enc.n, bits=8,
                                      block_size=CORRECTION_BLOCK, accuracy_level=accuracy_level))
    else:
        nodes.append(helper.make_node("MatMul", [blocksums[key], wname + "_corr"], [corr], name=corr + "_MatMul"))
    nodes.append(helper.make_node("Sub", [out, corr], [y], name=node_name + "_Sub"))


def add_ms_opset(proto, helper) -> None:
    """Add the ``com.microsoft`` opset (MatMulNBits' domain) to ``proto`` when it has none."""
    if not any(op.domain == "com.microsoft" for op in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def check_nbits_graph(dst: Path) -> None:
    """Run the ONNX checker on the written graph ``dst``; raises DSparkError naming the failure."""
    import onnx

    try:
        onnx.checker.check_model(str(dst))
    except Exception as e:
        raise DSparkError(f"the int4 graph {dst} fails the ONNX checker: {e}") from e
