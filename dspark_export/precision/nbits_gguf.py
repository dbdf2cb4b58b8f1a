"""int4 graphs faithful to the GGUF a model was converted from: the GGUF's own quantized blocks re-packed into
``com.microsoft.MatMulNBits`` blocks (:mod:`dspark_export.precision.nbits`), so the graph computes with exactly the
weights llama.cpp runs (``int4_source`` ``gguf``).

Encodings (:data:`~dspark_export.precision.gguf_blocks.ENCODINGS`, exact to float rounding): Q4_K -> 4-bit blocks of 32 with the sub-block scale, Q5_K ->
8-bit blocks of 32, Q6_K -> 8-bit blocks of 16 (zero point 32), Q8_0 / Q5_0 / Q4_0 -> blocks of 32 with zero point
128 / 16 / 8, Q4_1 / Q5_1 -> blocks of 32. Affine types (the K-quants' sub-block minimum, Q4_1/Q5_1's ``m``) carry
a float offset per block, applied outside the kernel as ``x·W = MatMulNBits(x; q, s, zp=0) − blocksum(x)·C``.
Every re-packed tensor must equal the graph's own fp32 weight or the build is refused, naming the tensor; block
types without an exact encoding become 8-bit RTN from the float weight; F32/F16/BF16 weights stay fp32 MatMuls.
The ``kernel`` encoding (``int4_source`` ``gguf-kernel``) keeps the Q4_K / Q6_K tensors as the GGUF's own blocks for
DSpark's ``ai.dspark.MatMulGGUF`` (:mod:`dspark_export.precision.gguf_kernel`) and treats every other one as
``compact`` does. The ``compact`` encoding (``int4_source`` ``gguf-compact``) reads fewer bytes per step: 4-bit blocks keep their codes
with the block minimum in 8 bits, every other block type (Q6_K, Q5_K, Q8_0, ...) is re-fitted in 4 bits, the LM head
stays exact. Both keep the token embedding in the GGUF's own blocks where they reproduce the table bit for bit
(:mod:`dspark_export.precision.gguf_embedding`).
The writer streams one tensor at a time (peak: the graph structure plus one dequantized weight in row chunks).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError

from dspark_export.graphs.onnx_io import ExternalData, ExternalWriter, default_opset, peak_rss_gb, quant_targets
from dspark_export.precision.gguf_blocks import ENCODINGS, FLOAT_TYPES, encode_gguf_rows
from dspark_export.precision.nbits import (DEFAULT_ACCURACY_LEVEL, NBitsMeta, NBitsWeight, add_ms_opset,
                                           affine8_rows, check_nbits_graph, fit_uint_rows, nbits_nodes, rtn8_rows)
from dspark_export.precision.nbits_fuse import fuse_shared_inputs
from dspark_export.precision.gguf_kernel import (BLOCKS_SUFFIX, GGML_TYPES, LIBRARY_NAME, add_kernels_opset, check_blocks,
                                                 fuse_gguf_shared_inputs, matmul_gguf_node, place_kernels)
from dspark_export.precision.gguf_embedding import (GGUF_NAME, describe, embedding_gather, embedding_initializers,
                                                    embedding_nodes, encode_embedding, kept_in_blocks,
                                                    record_layout)

# the compact encoding keeps these modules exact: the LM head's error goes straight into the logits (measured:
# docs/precision.md)
COMPACT_KEEP_EXACT = (r"(^|\.)lm_head$",)
_ROW_CHUNK = 4096  # output channels re-packed per step (LM head: 4096 × 1536 floats = 24 MB)

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


def quantize_nbits_gguf(src: Path, dst: Path, gguf_path: Path, *, accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                        encoding: str = "exact", keep_exact=COMPACT_KEEP_EXACT, log=print) -> dict:
    """Write ``dst`` (+ ``dst.data``): graph ``src`` with every weight MatMul that has a GGUF tensor as
    MatMulNBits over the GGUF's own blocks (see the module docstring for the encodings). Streams one tensor at a time.

    Args:
        src: fp32 ``.onnx`` graph exported from the Hugging Face folder converted from ``gguf_path`` (never
            modified; its external weights are read to check each re-packed tensor).
        gguf_path: the GGUF file.
        accuracy_level: MatMulNBits ``accuracy_level`` (4: int8 activations, as llama.cpp's CPU kernels).
        encoding: ``"exact"`` (:data:`ENCODINGS`) or ``"compact"``: 4-bit blocks of 32 keep their codes and
            scales with the float block minimum as an 8-bit block-sum correction
            (:func:`~dspark_export.precision.nbits.affine8_rows`); every other block type is fitted as 4-bit blocks
            of 32 with integer zero points (:func:`~dspark_export.precision.nbits.fit_uint_rows`); modules matching
            a ``keep_exact`` regular expression (default: the LM head) stay exact. ``"kernel"``: as ``"compact"``,
            but Q4_K / Q6_K tensors stay the GGUF's blocks, computed by MatMulGGUF (the library placed beside ``dst``).
    Returns the manifest's quantization record: precision, source, accuracy level, per-GGUF-type counts and
    encodings, the fallback and fp32 tensors by name, max |Δ| of the encoded weights against the fp32 graph,
    weight bytes before and after, seconds, peak RSS (GiB). Raises DSparkError when the GGUF is missing, a graph
    weight's GGUF tensor has another shape, or the re-packed weight differs from the graph's fp32 weight.
    """
    import gguf
    import onnx
    from onnx import TensorProto, helper, numpy_helper

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
    if encoding not in ("exact", "compact", "kernel"):
        raise DSparkError(f"no GGUF int4 encoding {encoding!r}; choose exact, compact or kernel")
    counts, fallback, kept_fp32, max_err, approximated = {}, {}, [], 0.0, {}
    encoded = {}  # weight -> NBitsMeta
    in_blocks = {}  # weight -> (K, N, GGML type id): kept as the GGUF's blocks for MatMulGGUF (encoding "kernel")
    bytes_in = sum(reader.nbytes(t) for t in proto.graph.initializer)
    writer = ExternalWriter(dst)
    new_inits = []
    gather = embedding_gather(proto.graph)
    embed = None  # the token embedding in the GGUF's blocks: (layout, hidden, GGUF type)
    with writer:
        for t in proto.graph.initializer:
            if gather is not None and t.name == gather.input[0] and GGUF_NAME in gtensors:
                embed = _embedding_blocks(t, reader, gtensors[GGUF_NAME], writer, new_inits, log)
                if embed is not None:
                    continue
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
            parts, corr8, d_max, sq_err, sq_ref = [], [], 0.0, 0.0, 0.0
            compact = encoding != "exact" and not any(re.search(pat, qs[0].module) for pat in keep_exact)
            if compact and encoding == "kernel" and qtype in GGML_TYPES:
                max_err = max(max_err, check_blocks(gt, qtype, full, gname, qs[0].module))
                del full
                new_inits.append(writer.put([np.asarray(gt.data).reshape(-1)], t.name + BLOCKS_SUFFIX,
                                            TensorProto.UINT8, (int(gt.n_bytes),)))
                if t.name in shared:
                    new_inits.append(writer.copy(t, reader))
                in_blocks[t.name] = (k, n, GGML_TYPES[qtype])
                log(f"  {qs[0].module:28s} <- {gname:26s} {qtype:5s} -> its own blocks (MatMulGGUF)")
                continue
            how = None  # compact: "8-bit min correction" (4-bit codes kept) or "4-bit fit"
            for a in range(0, n, _ROW_CHUNK):  # output channels a:b = GGUF rows a:b
                b = min(n, a + _ROW_CHUNK)
                ref = np.ascontiguousarray(full[:, a:b].T)
                rows = np.asarray(gt.data[a:b])
                if qtype in ENCODINGS:  # the encoding reproduces the GGUF's values (checked inside)
                    enc, w = encode_gguf_rows(rows, qtype, k)
                    d = float(np.abs(w - ref).max())
                    if d > 1e-5 * max(1.0, float(np.abs(ref).max())):
                        raise DSparkError(f"the re-packed {gname} ({qtype}) differs from the graph's weight of "
                                          f"{qs[0].module} by {d:.3g}; the GGUF is not the one the model was "
                                          "converted from (use --int4-source rtn)")
                else:
                    from gguf import GGMLQuantizationType, quants

                    w = quants.dequantize(rows, GGMLQuantizationType[qtype]).reshape(b - a, k).astype(np.float32)
                    enc = rtn8_rows(w)
                if compact and qtype in ENCODINGS and (enc.bits, enc.block_size) == (4, 32):
                    if enc.correction is not None:  # codes and scales kept; the float block minimum in 8 bits
                        how = "8-bit min correction"
                        c8 = affine8_rows(enc.correction.T.copy())
                        corr8.append(c8)
                        enc = NBitsWeight(enc.bits, enc.block_size, enc.packed, enc.scales, enc.zero_points,
                                          c8.dequantize()[:k // enc.block_size])
                elif compact:  # 4-bit blocks of 32 fitted to the GGUF's values
                    how = "4-bit fit"
                    enc = fit_uint_rows(w, 32)
                if how is not None or qtype not in ENCODINGS:
                    dq = enc.dequantize().T
                    d = float(np.abs(dq - ref).max())
                    sq_err += float(((dq - ref) ** 2).sum())
                    sq_ref += float((ref ** 2).sum())
                d_max = max(d_max, d)
                parts.append(enc)
            del full
            if how is not None:
                approximated[qs[0].module] = {"gguf_type": qtype, "encoding": how,
                                              "rel_l2": round((sq_err / max(sq_ref, 1e-30)) ** 0.5, 6)}
            elif qtype not in ENCODINGS:
                fallback.setdefault(qtype, []).append({"module": qs[0].module, "max_abs_weight_diff": d_max})
            if how is None:
                max_err = max(max_err, d_max)
            e0 = parts[0]
            new_inits.append(writer.put((p.packed for p in parts), t.name + "_Q", TensorProto.UINT8,
                                        (n, k // e0.block_size, e0.packed.shape[2])))
            new_inits.append(writer.put((p.scales for p in parts), t.name + "_scales", TensorProto.FLOAT,
                                        (n * (k // e0.block_size),)))
            zps = [p.packed_zero_points() for p in parts]
            new_inits.append(writer.put(zps, t.name + "_zp", TensorProto.UINT8, (sum(z.size for z in zps),)))
            if corr8:
                c0 = corr8[0]
                new_inits.append(writer.put((c.packed for c in corr8), t.name + "_corr_Q", TensorProto.UINT8,
                                            (n,) + c0.packed.shape[1:]))
                new_inits.append(writer.put((c.scales for c in corr8), t.name + "_corr_scales", TensorProto.FLOAT,
                                            (n * c0.scales.shape[1],)))
                zc = [c.packed_zero_points() for c in corr8]
                new_inits.append(writer.put(zc, t.name + "_corr_zp", TensorProto.UINT8, (sum(z.size for z in zc),)))
            elif e0.correction is not None:
                corr = np.concatenate([p.correction for p in parts], axis=1)
                new_inits.append(writer.put([corr], t.name + "_corr", TensorProto.FLOAT, corr.shape))
            if t.name in shared:
                new_inits.append(writer.copy(t, reader))
            encoded[t.name] = NBitsMeta(e0.bits, e0.block_size, k, n, e0.correction is not None, 8 if corr8 else 32)
            log(f"  {qs[0].module:28s} <- {gname:26s} {qtype:5s} -> {e0.bits}-bit block {e0.block_size}"
                + (" + min correction" if e0.correction is not None else "") + (f" ({how})" if how else "")
                + f"  (max |dW| {d_max:.1e}"
                + (f", rel L2 {approximated[qs[0].module]['rel_l2']:.4f})" if how else ")"))
    reader.close()
    nodes, blocksums = [], {}
    by_node = {q.node: (w, q) for w, (_, qs) in plan.items() for q in qs}
    fp32_weights = {w for w, (g, _) in plan.items() if gtensors[g].tensor_type.name in FLOAT_TYPES}
    need_shapes = set()
    opset = default_opset(proto)
    for node in proto.graph.node:
        if embed is not None and node.op_type == "Gather" and node.output[0] == gather.output[0]:
            decode, consts = embedding_nodes(node, embed[0], embed[1], opset)
            nodes += decode
            new_inits += consts
            continue
        hit = by_node.get(node.name)
        if hit is None or hit[0] in fp32_weights:
            nodes.append(node)
            continue
        wname, q = hit
        if wname in in_blocks:
            nodes.append(matmul_gguf_node(helper, node.name, q.activation, wname + BLOCKS_SUFFIX, node.output[0],
                                          *in_blocks[wname]))
            continue
        meta = encoded[wname]
        nbits_nodes(helper, node.name, q.activation, node.output[0], wname, meta, accuracy_level, blocksums, nodes,
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
    add_ms_opset(proto, helper)
    if in_blocks:
        add_kernels_opset(proto, helper)
    if embed is not None:
        record_layout(proto, embed[0])
    onnx.save_model(proto, str(dst))
    merged = fuse_shared_inputs(dst, log=log)
    if in_blocks:
        merged_blocks = fuse_gguf_shared_inputs(dst, log=log)
        place_kernels(dst.parent, log=log)
    check_nbits_graph(dst)
    by_type = {qt: {"tensors": c, "encoding": _describe(qt)} for qt, c in sorted(counts.items())}
    method = {
        "exact": "GGUF blocks re-packed into com.microsoft.MatMulNBits (exact; affine block offsets as a block-sum "
                 "correction)",
        "compact": "GGUF blocks in 4 bits: 4-bit blocks of 32 re-packed with their block minimum as an 8-bit block-sum "
                   "correction, other types fitted as 4-bit blocks of 32 with integer zero points",
        "kernel": "Q4_K / Q6_K tensors kept as the GGUF's own blocks for DSpark's ai.dspark.MatMulGGUF kernel (exact "
                  "weights, int8 activations per 256 as llama.cpp); other types as gguf-compact",
    }[encoding] + (f"; exact: {', '.join(keep_exact)}" if keep_exact and encoding != "exact" else "")
    source = {"exact": "gguf", "compact": "gguf-compact", "kernel": "gguf-kernel"}[encoding]
    rep = {"precision": "int4", "int4_source": source, "gguf": gguf_path.name,
           "accuracy_level": accuracy_level, "method": method, "approximated": approximated,
           "gguf_types": by_type, "fallback_rtn8": fallback, "kept_fp32": kept_fp32, "unmatched": unmatched,
           "max_abs_weight_diff_vs_fp32_graph": max_err, "matmul_nbits": len(target_nodes) - len(kept_fp32)
           - sum(len(qs) for w, (_, qs) in plan.items() if w in in_blocks),
           "merged_shared_inputs": merged,
           **({"kernels": LIBRARY_NAME, "matmul_gguf": len(in_blocks), "merged_gguf_inputs": merged_blocks}
              if in_blocks else {}),
           "embedding": describe(embed[0], embed[2]) if embed is not None else "fp32 table",
           "weight_bytes_in": bytes_in, "weight_bytes_out": writer.bytes_out,
           "seconds": round(time.perf_counter() - t0, 1), "peak_rss_gb": round(peak_rss_gb(), 2)}
    log(f"  {rep['matmul_nbits']} MatMulNBits" + (f" and {len(in_blocks)} MatMulGGUF" if in_blocks else "")
        + f" from {gguf_path.name} ({', '.join(f'{c} {t}' for t, c in counts.items())})"
        f"; weights {bytes_in / 2**30:.2f} -> {writer.bytes_out / 2**30:.2f} GiB in {rep['seconds']:.0f} s, "
        f"peak RSS {rep['peak_rss_gb']:.2f} GiB")
    return rep


def _embedding_blocks(t, reader, gguf_tensor, writer, new_inits: list, log) -> tuple | None:
    """The fp32 embedding table ``t`` written as the GGUF tensor's blocks
    (:func:`~dspark_export.precision.gguf_embedding.encode_embedding`) when they reproduce it bit for bit: appends
    their initializers to ``new_inits`` and returns (layout, hidden, GGUF type); None (nothing written) otherwise."""
    vocab, hidden = (int(d) for d in t.dims)
    row = hidden * 4

    def rows(a: int, b: int) -> np.ndarray:
        return np.frombuffer(reader.read(t, a * row, (b - a) * row), np.float32).reshape(b - a, hidden)

    enc = encode_embedding(rows, gguf_tensor, vocab, hidden)
    if enc is None:
        log(f"  token embedding: kept fp32 ({gguf_tensor.tensor_type.name} blocks do not reproduce the table)")
        return None
    inits, layout = embedding_initializers(writer, enc)
    new_inits += inits
    log(kept_in_blocks(enc, vocab * row))
    return layout, hidden, enc["gguf_type"]


def _describe(qtype: str) -> str:
    if qtype in FLOAT_TYPES:
        return "kept fp32 MatMul"
    if qtype not in ENCODINGS:
        return "no exact encoding: 8-bit symmetric RTN per 32 from the float weight"
    bits, block, zp, affine = ENCODINGS[qtype]
    return f"bits {bits}, block {block}, zero point {zp}" + (", block-min correction" if affine else "")
