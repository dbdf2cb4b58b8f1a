"""A screened LM head for int4 graphs (:func:`screen_lm_head`): a 2-bit copy of the head scores the vocabulary,
and only the ``candidates`` best-scored tokens of each position are rescored exactly, in fp32, from the exact 8-bit
head's own codes and scales (gathered per candidate); the exact scores overwrite the screen's at those tokens.

Why: the LM head is the largest single weight a decoding step reads (the 1.5B Qwen's Q6_K head as 8-bit blocks of
16: 306 MB of the exact graph's 1.42 GB), and a step is bound by the bytes it streams. The 2-bit screen reads about
a quarter of that; the rescoring reads ``candidates`` rows of the 8-bit head per position, which a step never streams
whole (read only by ``Gather``). The logits of the top tokens are the exact head's weights times the fp32 hidden
state (no int8 activations, unlike the kernel) whenever the exact top token is among the screen's ``candidates``
(measured: docs/precision.md); the other logits are the screen's.

Every op works per row (``MatMulNBits``, ``TopK``, ``Gather``, a batched fp32 ``MatMul``, ``ScatterElements``), so a
row's logits do not depend on the call it is in: speculative output still equals target-only output.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError

from dspark_export.graphs.onnx_io import ExternalData, node_attributes, read_initializer, rewrite_in_place
from dspark_export.precision.nbits import DEFAULT_ACCURACY_LEVEL, GGUF_SOURCES, NBitsWeight, fit_uint_rows

LM_HEADS = ("auto", "screened", "full")
DEFAULT_CANDIDATES = 256  # tokens rescored exactly per position (chosen by measurement: docs/precision.md)
SCREEN_BITS = 2  # the screen's bits (chosen by measurement: docs/precision.md)
SCREEN_BLOCKS = (128, 64, 32, 16)  # its block along K: the first that divides K (128: measured, docs/precision.md)
_ROW_CHUNK = 8192  # vocabulary rows fitted / compared per step


def resolve_lm_head(requested: str, int4_source: str) -> str:
    """``"screened"`` or ``"full"``: how the int4 graph written from ``int4_source`` reads its LM head. ``auto``:
    screened where the source keeps the head in 8 bits (``gguf``, ``gguf-compact``: the GGUF's Q6_K head), full where
    it is 4-bit already (``rtn``, ``hqq``). Raises DSparkError for a value outside :data:`LM_HEADS`."""
    if requested not in LM_HEADS:
        raise DSparkError(f"lm_head {requested!r} is not supported; choose one of {', '.join(LM_HEADS)}")
    if requested == "auto":
        return "screened" if int4_source in GGUF_SOURCES else "full"
    return requested


def screen_lm_head(path: Path, *, candidates: int = DEFAULT_CANDIDATES, bits: int = SCREEN_BITS,
                   block: int | None = None, log=print) -> dict:
    """Rewrite the int4 graph ``path`` (+ its ``.data``) in place with a screened LM head (module docstring).

    The head is the ``com.microsoft.MatMulNBits`` node writing the graph output ``logits`` (no block-sum
    correction, no bias); the screen is ``bits``-bit (2 or 4) in blocks of ``block`` along K (None: the first of
    :data:`SCREEN_BLOCKS` that divides K). Returns the manifest record: candidates, the screen's form and its relative L2 error,
    the weight bytes a step reads in the head before and after. ``candidates`` above the vocabulary rescore it all.
    Raises DSparkError when the graph has no such head, the head is not 8-bit, or ``candidates`` < 1.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    path = Path(path)
    proto = onnx.load(str(path), load_external_data=False)
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    prod = {o: n for n in g.node for o in n.output}
    head = prod.get("logits")
    if head is None or head.op_type != "MatMulNBits" or head.input[1] not in inits or len(head.input) > 4:
        raise DSparkError(f"{path.name} has no MatMulNBits LM head writing 'logits' (an int4 graph of "
                          "dspark-export is needed) — build the engine without the screened head")
    a = node_attributes(head)
    k, vocab = a["K"], a["N"]
    if candidates < 1:
        raise DSparkError(f"the screened head needs at least one candidate per position, got {candidates}")
    candidates = min(candidates, vocab)
    if block is None:
        block = next((c for c in SCREEN_BLOCKS if k % c == 0), SCREEN_BLOCKS[0])
    if k % block:
        raise DSparkError(f"the LM head's K={k} is not a multiple of the screen block {block}")
    if a["bits"] != 8:
        raise DSparkError(f"the LM head of {path.name} is {a['bits']}-bit already; only an 8-bit head is screened")
    reader = ExternalData(path.parent)
    arrays = {n: read_initializer(inits[n], reader) for n in head.input[1:] if n}
    head_bytes = sum(reader.nbytes(inits[n]) for n in head.input[1:] if n)
    reader.close()
    exact = NBitsWeight.from_node(head, arrays.__getitem__)
    del arrays
    rows = exact.dequantize().T  # [vocab, K]
    hblock, kb = exact.block_size, k // exact.block_size
    codes, scales, zp = exact.packed, exact.scales, exact.zero_points  # 8-bit: packed is the codes [vocab, kb, hblock]
    zp_one = bool((zp == zp.flat[0]).all())
    b = head.name or "lm_head"
    screen = [fit_uint_rows(rows[i:i + _ROW_CHUNK], block, bits=bits) for i in range(0, vocab, _ROW_CHUNK)]
    with rewrite_in_place(path, "screen") as rw:
        drop = {n for n in head.input[1:] if n and all(n not in m.input for m in g.node if m is not head)}
        new_inits = [rw.writer.copy(t, rw.reader) for t in g.initializer if t.name not in drop]
        new_inits += [
            rw.writer.put((s.packed for s in screen), b + "_screen_Q", TensorProto.UINT8,
                          (vocab, k // block, screen[0].packed.shape[2])),
            rw.writer.put((s.scales for s in screen), b + "_screen_scales", TensorProto.FLOAT, (vocab * (k // block),)),
            rw.writer.put([s.packed_zero_points() for s in screen], b + "_screen_zp", TensorProto.UINT8,
                          (sum(s.packed_zero_points().size for s in screen),)),
            # the exact head's 8-bit codes and scales, read per candidate by Gather (never streamed whole)
            rw.writer.put([codes], b + "_rows_Q", TensorProto.UINT8, (vocab, kb, hblock)),
            rw.writer.put([scales], b + "_rows_scales", TensorProto.FLOAT, (vocab, kb))]
        if not zp_one:
            new_inits.append(rw.writer.put([zp], b + "_rows_zp", TensorProto.UINT8, (vocab, kb)))
        consts = {"_candidates": np.array([candidates], np.int64), "_axis_last": np.array([-1], np.int64),
                  "_rows_shape": np.array([0, 0, 0, k], np.int64)}
        if zp_one:
            consts["_rows_zp_f"] = np.array(float(zp.flat[0]), np.float32)
        new_inits += [numpy_helper.from_array(v, b + n) for n, v in consts.items()]
        new_nodes = _screen_nodes(helper, TensorProto, head.input[0], b, k, vocab, bits, block, zp_one,
                                  a.get("accuracy_level", DEFAULT_ACCURACY_LEVEL))
        new_nodes[0].metadata_props.extend(head.metadata_props)
        nodes = [m for n in g.node for m in (new_nodes if n is head else [n])]
        del g.node[:]
        g.node.extend(nodes)
        del g.initializer[:]
        g.initializer.extend(new_inits)
        rw.proto = proto
    screen_bytes = sum(s.packed.nbytes + s.scales.nbytes + s.packed_zero_points().nbytes for s in screen)
    rel = float(np.sqrt(sum(float(((s.dequantize().T - rows[i:i + _ROW_CHUNK]) ** 2).sum())
                            for s, i in zip(screen, range(0, vocab, _ROW_CHUNK)))
                        / max(float((rows.astype(np.float64) ** 2).sum()), 1e-30)))
    rec = {"candidates": candidates, "screen_bits": bits,
           "screen": f"{bits}-bit blocks of {block}, fitted (integer zero points)",
           "screen_rel_l2": round(rel, 6), "head_step_bytes": [head_bytes, screen_bytes]}
    log(f"  screened LM head: {bits}-bit screen ({screen_bytes / 1e6:.0f} MB, rel L2 {rel:.4f}) + exact rescoring of "
        f"{candidates} candidates from its own 8-bit rows "
        f"(head {head_bytes / 1e6:.0f} -> {screen_bytes / 1e6:.0f} MB a step)")
    return rec


def _screen_nodes(helper, TensorProto, x: str, b: str, k: int, vocab: int, bits: int, block: int, zp_one: bool,
                  accuracy_level: int) -> list:
    """The nodes of a screened head over hidden state ``x`` [.., K] writing ``logits`` [.., vocab]; initializer
    names start with ``b`` (see :func:`screen_lm_head`)."""
    mk = helper.make_node
    s_out, idx, zp_f = b + "_screen", b + "_candidate_ids", b + "_rows_zp_f"
    nodes = [
        mk("MatMulNBits", [x, b + "_screen_Q", b + "_screen_scales", b + "_screen_zp"], [s_out],
           name=b + "_screen_MatMulNBits", domain="com.microsoft", K=k, N=vocab, bits=bits, block_size=block,
           accuracy_level=accuracy_level),
        mk("TopK", [s_out, b + "_candidates"], [b + "_screen_top", idx], axis=-1, largest=1, sorted=0,
           name=b + "_TopK"),
        mk("Gather", [b + "_rows_Q", idx], [b + "_cand_q"], axis=0, name=b + "_rows_Gather"),
        mk("Cast", [b + "_cand_q"], [b + "_cand_qf"], to=TensorProto.FLOAT, name=b + "_rows_Cast")]
    if not zp_one:
        nodes += [
            mk("Gather", [b + "_rows_zp", idx], [b + "_cand_zp"], axis=0, name=b + "_zp_Gather"),
            mk("Cast", [b + "_cand_zp"], [b + "_cand_zpf1"], to=TensorProto.FLOAT, name=b + "_zp_Cast"),
            mk("Unsqueeze", [b + "_cand_zpf1", b + "_axis_last"], [zp_f], name=b + "_zp_Unsqueeze")]
    return nodes + [
        mk("Sub", [b + "_cand_qf", zp_f], [b + "_cand_c"], name=b + "_rows_Sub"),
        mk("Gather", [b + "_rows_scales", idx], [b + "_cand_s"], axis=0, name=b + "_scales_Gather"),
        mk("Unsqueeze", [b + "_cand_s", b + "_axis_last"], [b + "_cand_s1"], name=b + "_scales_Unsqueeze"),
        mk("Mul", [b + "_cand_c", b + "_cand_s1"], [b + "_cand_w"], name=b + "_rows_Mul"),
        mk("Reshape", [b + "_cand_w", b + "_rows_shape"], [b + "_cand_rows"], name=b + "_rows_Reshape"),
        mk("Unsqueeze", [x, b + "_axis_last"], [b + "_x_col"], name=b + "_x_Unsqueeze"),
        mk("MatMul", [b + "_cand_rows", b + "_x_col"], [b + "_exact_col"], name=b + "_exact_MatMul"),
        mk("Squeeze", [b + "_exact_col", b + "_axis_last"], [b + "_exact"], name=b + "_exact_Squeeze"),
        mk("ScatterElements", [s_out, idx, b + "_exact"], ["logits"], axis=-1, name=b + "_ScatterElements")]
