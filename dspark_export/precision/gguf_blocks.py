"""GGUF quantized blocks as integer codes, per-block scales and offsets: :data:`ENCODINGS` (the MatMulNBits form of
each block type), :func:`gguf_block_params` (the scales and offsets as ggml computes them) and
:func:`encode_gguf_rows` (rows re-packed exactly), shared by the int4 graph writer
(:mod:`dspark_export.precision.nbits_gguf`) and the block-coded token embedding
(:mod:`dspark_export.precision.gguf_embedding`).
"""
from __future__ import annotations

import numpy as np

from dspark_runtime.errors import DSparkError

from dspark_export.precision.nbits import NBitsWeight, pack_codes

# GGUF type -> (bits, MatMulNBits block, zero point, affine: has a per-block float offset)
ENCODINGS = {"Q4_K": (4, 32, 0, True), "Q5_K": (8, 32, 0, True), "Q6_K": (8, 16, 32, False),
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

    if qtype not in ENCODINGS:
        raise DSparkError(f"GGUF block type {qtype} has no MatMulNBits encoding here")
    bits, block, zp, affine = ENCODINGS[qtype]
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
    enc = NBitsWeight(bits, block, pack_codes(codes, bits, block), scale.astype(np.float32),
                      np.full((n, k // block), zp, np.uint8), offset.T.copy() if affine else None)
    back = (codes.reshape(n, k // block, block).astype(np.float32) - zp) * scale[..., None] - offset[..., None]
    err = float(np.abs(back - wb).max()) if n else 0.0
    tol = 1e-6 * max(1.0, float(np.abs(wb).max()) if n else 1.0)
    if err > tol:
        raise DSparkError(f"re-packing GGUF {qtype} blocks does not reproduce the weights (max |Δ| {err:.3g}); "
                          "use --int4-source rtn for this model")
    return enc, w
