"""The precisions an engine's graphs are built in, and :func:`quantize_graph`, which turns one fp32 decoder graph
into any of them with the writer that precision uses.

* ``fp32``: the exported graph as is.
* ``int4``: weight-only ``com.microsoft.MatMulNBits`` for ONNX Runtime CPU (:mod:`dspark_export.precision.nbits`),
  from the GGUF's own blocks or from the float weights (``int4_source``, :func:`resolve_int4_source`).
* ``int8`` / ``int8-trt``: static QDQ (:mod:`dspark_export.precision.qdq`): U8 activations and S8 per-channel
  weights for ONNX Runtime CPU, symmetric S8/S8 for TensorRT; calibrated
  (:mod:`dspark_export.precision.activation_ranges`).
* ``int8-dynamic``: ONNX Runtime's ``quantize_dynamic`` on the MatMul weights (S8 per tensor, no calibration).
* ``fp8``: E4M3 QDQ for TensorRT on compute capability >= 8.9, by NVIDIA ModelOpt (:mod:`dspark_export.precision.fp8`)
  or the streaming QDQ writer; the runtime refuses it on the CPU provider unless asked.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from dspark_runtime.engine_dir.integrity import sha256_file
from dspark_runtime.errors import DSparkError
from dspark_runtime.kernels import kernel_path

from dspark_export.graphs.fusions import fuse_file
from dspark_export.kernels.build import build_kernels
from dspark_export.models.catalog import source_gguf
from dspark_export.precision.activation_ranges import CALIBRATION_NOTE, calibrate_graph
from dspark_export.precision.fp8 import choose_fp8_writer, quantize_fp8
from dspark_export.precision.nbits import GGUF_SOURCES
from dspark_export.precision.nbits_gguf import quantize_nbits_gguf
from dspark_export.precision.nbits_head import resolve_lm_head, screen_lm_head
from dspark_export.precision.nbits_rtn import quantize_nbits_rtn
from dspark_export.precision.qdq import DEFAULT_EXCLUDE, quantize_qdq

PRECISIONS = ("fp32", "int4", "int8", "int8-trt", "int8-dynamic", "fp8")
CALIBRATED = ("int8", "int8-trt", "fp8")  # the precisions whose activation ranges are measured on calibration prompts


def kernels_unsuitable() -> str | None:
    """Why DSpark's kernels (``gguf-kernel``) are not for this machine (they do not build here, or this CPU would run
    their portable path), or None when they are. Builds them (cached) to find out."""
    try:
        lib = build_kernels(log=lambda *a: None)
    except DSparkError as e:
        return str(e).split("\n")[0]
    path = kernel_path(str(lib))
    return None if path == "avx512-vnni" else f"this CPU runs their {path} path (no AVX-512 VNNI)"


def resolve_int4_source(requested: str, role: str, model_dir: Path | None) -> tuple:
    """The int4 weight source for graph ``role`` of the model in ``model_dir``: ``(source, gguf_path, reason)``.

    ``auto``: the target reads the GGUF it was converted from when that file is present: its Q4_K / Q6_K blocks as
    they are, on DSpark's own kernel (``gguf-kernel``; chosen by measurement, docs/precision.md) where the kernels
    build here and this CPU runs their AVX-512 VNNI path, else re-packed into ONNX Runtime's MatMulNBits in fewer
    bytes per step (``gguf-compact``: the Q4_K codes kept, the other block types re-fitted in 4 bits; ``gguf``
    re-packs the weights llama.cpp runs exactly); a draft uses ONNX Runtime's RTN quantizer (a draft's precision never changes the
    output, and the 0.5B's GGUF is mostly 5/8-bit blocks, which re-pack to 8-bit). ``gguf`` / ``gguf-compact``
    require the file; ``rtn``/``hqq`` use the float weights and, where the GGUF is known, keep only the token
    embedding in its blocks (``gguf_path`` is then that file, else None). Raises DSparkError when a GGUF source is
    asked for and no GGUF is known.
    """
    gguf = source_gguf(model_dir) if model_dir is not None else None
    if requested == "auto":
        if role == "target" and gguf is not None:
            why = kernels_unsuitable()
            if why is None:
                return "gguf-kernel", gguf, f"auto: the model was converted from {gguf.name}"
            return "gguf-compact", gguf, f"auto: the model was converted from {gguf.name}; not gguf-kernel: {why}"
        return "rtn", gguf, ("auto: a draft's precision never changes the output" if role != "target"
                             else "auto: no source GGUF recorded for this model (not fetched from a GGUF)")
    if requested in GGUF_SOURCES and gguf is None:
        raise DSparkError(f"--int4-source {requested}: {model_dir} records no GGUF it was converted from (or the "
                          "file is gone); fetch it again with `dspark-export fetch`, or use --int4-source rtn")
    return requested, gguf, "asked for"


def quantize_graph(src: Path, dst: Path, precision: str, *, spec=None, calibration_ids=None, table=None,
                   exclude=None, fp8_writer: str = "auto", int4_source: str = "rtn", gguf=None, lm_head: str = "auto",
                   max_positions: int | None = None, log=print) -> dict:
    """Quantize the fp32 graph ``src`` into ``dst`` (+ ``dst.data``); returns the manifest's
    ``quantization`` record.

    ``int8`` / ``int8-trt``: static QDQ (:func:`dspark_export.precision.qdq.quantize_qdq`), memory-bounded
    (peak ≈ the largest weight plus the graph structure), with activation ranges from ``table`` (a
    :class:`~dspark_export.precision.activation_ranges.CalibrationTable`) or measured here on ``calibration_ids``
    (token-id lists; needs ``spec``, the graph's GraphSpec; peak ≈ the fp32 weights once, in ONNX Runtime).
    ``exclude``: module-name patterns kept fp32 (default :data:`dspark_export.precision.qdq.DEFAULT_EXCLUDE`;
    for fp8 none: every weight MatMul).
    ``fp8``: FP8 E4M3 QDQ by the writer ``fp8_writer`` names (:func:`dspark_export.precision.fp8.choose_fp8_writer`):
    ``"modelopt"`` — NVIDIA ModelOpt in its own environment (:func:`dspark_export.precision.fp8.quantize_fp8`; needs
    ``calibration_ids``; peak ~7.5x the fp32 weights); ``"stream"`` — the memory-bounded QDQ writer as for
    int8 (``table`` or ``calibration_ids``; FP8 weights stored quantized); ``"auto"`` (default) — ModelOpt
    when installed and ~8x the fp32 weights fits in the available memory, else ``"stream"``. The record
    says which (``"writer"``) and why (``"writer_reason"``).
    ``int4``: MatMulNBits weight-only (:mod:`dspark_export.precision.nbits`): ``int4_source`` ``"gguf"`` re-packs the
    blocks of ``gguf``, the GGUF the model was converted from (:mod:`dspark_export.precision.nbits_gguf`; streamed,
    peak ≈ one weight); ``"gguf-compact"`` the same blocks in fewer bytes (its ``encoding="compact"``: 4-bit codes
    kept with the block minimum in 8 bits, other block types but the LM head's fitted in 4 bits); ``"rtn"`` / ``"hqq"``
    run ONNX Runtime's ``MatMulNBitsQuantizer`` on the float weights (peak ≈ 1.3x the fp32 weights; with ``gguf``
    the token embedding reads that file's blocks, :mod:`dspark_export.precision.nbits_rtn`). No calibration
    data. ``lm_head`` (:func:`~dspark_export.precision.nbits_head.resolve_lm_head`): ``"screened"`` rewrites the
    int4 graph's 8-bit LM head into a 2-bit screen plus exact rescoring of the best candidates
    (:func:`~dspark_export.precision.nbits_head.screen_lm_head`; the record's ``"lm_head"``). ``max_positions`` (a
    decoder's ``max_position_embeddings``): the int4 graph's rotary embeddings become ``com.microsoft.RotaryEmbedding``
    with tables of that many positions (:func:`~dspark_export.graphs.fusions.fuse_rotary`; the record's
    ``"rotary_fused"`` counts them) and every layer's cache shape read becomes one
    (:func:`~dspark_export.graphs.fusions.share_shape_reads`, ``"shape_reads_shared"``); None (drafter graphs) leaves
    them as exported.
    ``int8-dynamic``: ONNX Runtime ``quantize_dynamic`` on MatMul weights, signed 8-bit, per tensor.
    Its peak memory is about three times the fp32 weights; raises DSparkError when that cannot fit in this
    machine's RAM.
    Raises DSparkError for an unknown precision or fp8 writer, missing calibration data, a calibration
    table measured on another graph, or a failing quantizer.
    """
    if precision == "int4":
        if int4_source in GGUF_SOURCES:
            if gguf is None:
                raise DSparkError("int4 from the GGUF needs the GGUF path")
            encoding = {"gguf": "exact", "gguf-compact": "compact", "gguf-kernel": "kernel"}[int4_source]
            rep = quantize_nbits_gguf(src, dst, gguf, encoding=encoding, log=log)
        else:
            rep = quantize_nbits_rtn(src, dst, algorithm=int4_source, gguf=gguf, log=log)
        if resolve_lm_head(lm_head, int4_source) == "screened":
            rep["lm_head"] = screen_lm_head(dst, log=log)
        if max_positions:
            done = fuse_file(dst, int(max_positions))
            rep["rotary_fused"], rep["shape_reads_shared"] = done["rotary"], done["shapes"]
            log(f"  {rep['rotary_fused']} rotary embeddings fused (com.microsoft.RotaryEmbedding, {int(max_positions)} "
                f"positions), {rep['shape_reads_shared']} cache shape reads shared")
        return rep
    writer = reason = None
    if precision == "fp8":
        writer, reason = choose_fp8_writer(src, fp8_writer, log=log)
        exclude = () if exclude is None else tuple(exclude)
    if writer == "modelopt":
        if not calibration_ids or spec is None:
            raise DSparkError("fp8 needs calibration prompts (token ids) and the graph spec")
        rep = quantize_fp8(src, dst, spec, calibration_ids, exclude=exclude, log=log)
        rep["calibration"]["prompts"] = CALIBRATION_NOTE + f"; first {len(calibration_ids)}"
        return {**rep, "writer_reason": reason}
    if precision in CALIBRATED:
        exclude = DEFAULT_EXCLUDE if exclude is None else tuple(exclude)
        if table is None:
            if not calibration_ids or spec is None:
                raise DSparkError(f"{precision} needs calibration data: token ids of calibration prompts and the "
                                  "graph spec (or a table from `dspark-export calibrate-quant`)")
            table = calibrate_graph(src, spec, calibration_ids, log=log,  # every weight MatMul: reusable table
                                    prompts_note=CALIBRATION_NOTE + f"; first {len(calibration_ids)}")
        elif table.graph_sha256 and table.graph_sha256 != sha256_file(src):
            raise DSparkError(f"the calibration table was measured on another graph than {src} (sha256 "
                              f"{table.graph_sha256[:12]}...); run `dspark-export calibrate-quant` on this engine")
        rep = quantize_qdq(src, dst, table, precision, exclude=exclude, log=log)
        rep = {**rep, "calibration": table.summary(),
               "calibration_run": {"seconds": table.seconds, "peak_rss_gb": table.peak_rss_gb}}
        if writer is not None:
            rep.update(writer=writer, writer_reason=reason)
        return rep
    if precision != "int8-dynamic":
        raise DSparkError(f"no quantizer for {precision!r}")
    weights = src.with_name(src.name + ".data").stat().st_size
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 3 * weights > 0.9 * total:
        raise DSparkError(f"quantizing {src.name} needs ~{3 * weights / 2**30:.0f} GiB RAM (3x its weights) but this "
                          f"machine has {total / 2**30:.0f} GiB; use the memory-bounded static 'int8' instead, or "
                          "build on a larger machine")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    t0 = time.perf_counter()
    quantize_dynamic(str(src), str(dst), op_types_to_quantize=["MatMul"], per_channel=False,
                     weight_type=QuantType.QInt8, use_external_data_format=True)
    data = dst.with_name(dst.name + ".data")
    if not data.is_file():  # small graphs may be saved inline: normalise to one external file
        import onnx

        m = onnx.load(str(dst))
        onnx.save_model(m, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=0)
    log(f"  quantized {dst.name} ({precision}) in {time.perf_counter() - t0:.1f}s")
    return {"precision": precision, "method": "ONNX Runtime quantize_dynamic (MatMul weights S8 per tensor, "
            "activations quantized at run time; no calibration data)"}
