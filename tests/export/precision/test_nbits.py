"""int4 (MatMulNBits) graphs: the GGUF re-pack is exact, the kernel computes x @ W with it, engines built
with it decode speculatively exactly as target-only, and the float-weight path uses ONNX Runtime's quantizer."""
import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants  # noqa: E402

from dspark_export.precision.nbits import (CORRECTION_BLOCK, NBitsMeta, NBitsWeight, affine8_rows,  # noqa: E402
                                           nbits_nodes)
from dspark_export.precision.gguf_blocks import ENCODINGS, encode_gguf_rows  # noqa: E402
from dspark_export.precision.nbits_gguf import gguf_tensor_name  # noqa: E402
from dspark_runtime.errors import DSparkError  # noqa: E402

ALL_TYPES = sorted(ENCODINGS)


def random_rows(qtype: str, n: int, k: int, rng, lo: float = 0.001, hi: float = 0.01) -> np.ndarray:
    """Random but valid GGUF rows of ``qtype`` (uint8 [n, bytes per row]): random bytes with f16 scales in
    [lo, hi]."""
    qk, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    b = rng.integers(0, 256, (n * (k // qk), size), dtype=np.uint8)

    def f16(off):
        b[:, off:off + 2] = (rng.random(len(b)) * (hi - lo) + lo).astype(np.float16).view(np.uint8).reshape(-1, 2)

    f16(208 if qtype == "Q6_K" else 0)
    if qtype in ("Q4_K", "Q5_K", "Q4_1", "Q5_1"):
        f16(2)
    return b.reshape(n, -1)


def nbits_session(enc: NBitsWeight, accuracy_level: int, correction_bits: int = 32):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n = enc.k, enc.n
    inits = [numpy_helper.from_array(enc.packed, "W_Q"), numpy_helper.from_array(enc.scales.reshape(-1), "W_scales"),
             numpy_helper.from_array(enc.packed_zero_points(), "W_zp")]
    if enc.correction is not None and correction_bits == 8:
        c8 = affine8_rows(enc.correction.T.copy())
        inits += [numpy_helper.from_array(c8.packed, "W_corr_Q"), numpy_helper.from_array(c8.scales.reshape(-1), "W_corr_scales"),
                  numpy_helper.from_array(c8.packed_zero_points(), "W_corr_zp")]
    elif enc.correction is not None:
        inits += [numpy_helper.from_array(enc.correction, "W_corr")]
    if enc.correction is not None:
        inits += [
                  numpy_helper.from_array(np.array([0, 0, k // enc.block_size, enc.block_size], np.int64),
                                          f"__nbits_shape_{k}_{enc.block_size}"),
                  numpy_helper.from_array(np.array([-1], np.int64), "__nbits_axis_last")]
    nodes = []
    nbits_nodes(helper, "mm", "x", "y", "W", NBitsMeta(enc.bits, enc.block_size, k, n, enc.correction is not None,
                                                      correction_bits), accuracy_level, {}, nodes)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_gguf_blocks_repack_exactly_and_the_kernel_computes_x_at_w(qtype):
    rng = np.random.default_rng(ALL_TYPES.index(qtype))
    n, k = 40, 512
    rows = random_rows(qtype, n, k, rng)
    enc, w = encode_gguf_rows(rows, qtype, k)
    ref = quants.dequantize(rows, GGMLQuantizationType[qtype]).reshape(n, k)
    np.testing.assert_array_equal(w, ref)
    assert np.abs(enc.dequantize().T - ref).max() <= 1e-7 * np.abs(ref).max()  # exact to float rounding
    bits, block, zp, affine = ENCODINGS[qtype]
    assert (enc.bits, enc.block_size, enc.correction is not None) == (bits, block, affine)
    assert enc.packed.shape == (n, k // block, block * bits // 8)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    y = nbits_session(enc, 0).run(None, {"x": x})[0]
    r = x @ ref.T
    assert np.abs(y - r).max() <= 2e-5 * np.abs(r).max()  # fp32 activations: float rounding only
    y4 = nbits_session(enc, 4).run(None, {"x": x})[0]
    err4 = np.abs(y4 - r).max() / np.abs(r).max()
    assert 1e-5 < err4 < 0.03  # int8 activations per block: visibly rounded, still close


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_0"])
def test_4bit_fit_of_gguf_values_beats_min_max_rounding_and_the_kernel_computes_it(qtype):
    from dspark_export.precision.nbits import fit_uint_rows

    rng = np.random.default_rng(7)
    n, k = 24, 512
    enc, w = encode_gguf_rows(random_rows(qtype, n, k, rng), qtype, k)
    start = enc.scales if (enc.bits, enc.block_size) == (4, 32) else None
    fit = fit_uint_rows(w, 32, start_scales=start)
    assert (fit.bits, fit.block_size, fit.correction) == (4, 32, None)
    assert fit.zero_points.max() <= 15 and fit.codes().max() <= 15
    err = ((fit.dequantize().T - w) ** 2).reshape(n, k // 32, 32).sum(-1)
    wb = w.reshape(n, k // 32, 32)  # plain min/max rounding: scale = range / 15, nearest integer zero point
    lo, hi = np.minimum(wb.min(-1), 0), np.maximum(wb.max(-1), 0)
    s = (hi - lo) / 15
    z = np.clip(np.rint(-lo / s), 0, 15)
    mm = ((np.clip(np.rint(wb / s[..., None]) + z[..., None], 0, 15) - z[..., None]) * s[..., None] - wb) ** 2
    assert (err <= mm.sum(-1) * (1 + 1e-5)).all() and err.sum() < 0.9 * mm.sum()
    if qtype == "Q4_0":  # d·(q − 8) is already a 4-bit grid with an integer zero point: fitted exactly
        assert np.abs(fit.dequantize().T - w).max() <= 1e-6 * np.abs(w).max()
    if qtype == "Q4_K":  # seeded with the sub-block scale, no block is worse than keeping the codes and
        # rounding the float minimum to an integer zero point (at most half a step per weight), where that
        # zero point is in range
        a, m = enc.scales, enc.correction.T
        ok = (m >= 0) & (m <= 15 * a) & (a > 0)
        assert ok.sum() > 20 and (err[ok] <= 32 * (a[ok] / 2) ** 2 * (1 + 1e-5)).all()
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    y = nbits_session(fit, 0).run(None, {"x": x})[0]
    r = x @ fit.dequantize()
    assert np.abs(y - r).max() <= 2e-5 * np.abs(r).max()


@pytest.mark.parametrize("block", [32, 64])
def test_2bit_fit_packs_as_the_kernel_reads_it(block):
    """2-bit blocks (the screened LM head's screen): four codes per byte, the packing round-trips and ONNX Runtime's
    MatMulNBits computes x @ W of the represented weight; the fit beats plain min/max rounding."""
    from dspark_export.precision.nbits import fit_uint_rows, pack_codes, unpack_codes

    rng = np.random.default_rng(11)
    n, k = 24, 320  # 320 / 64 = 5 blocks: zero points padded to whole bytes per column
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    fit = fit_uint_rows(w, block, bits=2)
    assert (fit.bits, fit.block_size) == (2, block) and fit.packed.shape == (n, k // block, block // 4)
    codes = fit.codes()
    assert codes.max() <= 3 and fit.zero_points.max() <= 3 and len(np.unique(codes)) == 4
    assert np.array_equal(unpack_codes(pack_codes(codes, 2, block).reshape(n, -1), 2), codes)
    assert fit.packed_zero_points().size == n * -(-(k // block) // 4)
    rel = np.linalg.norm(fit.dequantize().T - w) / np.linalg.norm(w)
    wb = w.reshape(n, k // block, block)
    lo, hi = np.minimum(wb.min(-1), 0), np.maximum(wb.max(-1), 0)
    s = (hi - lo) / 3
    z = np.clip(np.rint(-lo / s), 0, 3)
    mm = (np.clip(np.rint(wb / s[..., None]) + z[..., None], 0, 3) - z[..., None]) * s[..., None]
    assert rel < 0.9 * np.linalg.norm(mm.reshape(n, k) - w) / np.linalg.norm(w)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    r = x @ fit.dequantize()
    for level in (0, 4):  # fp32 activations, and int8 ones (the graphs' accuracy level)
        y = nbits_session(fit, level).run(None, {"x": x})[0]
        assert np.abs(y - r).max() <= (2e-5 if level == 0 else 0.03) * np.abs(r).max()


def test_q4k_min_correction_in_8_bits_computes_x_at_w_within_its_rounding():
    """gguf-compact keeps Q4_K's codes and stores the float block minimum as an 8-bit MatMulNBits over the block sums
    (K/32 inputs, not a multiple of its blocks of CORRECTION_BLOCK here): the kernel computes x·W with that rounded minimum."""
    rng = np.random.default_rng(3)
    n, k = 40, 3072  # 96 block sums: one full block of 64 and a partial one
    assert CORRECTION_BLOCK == 64
    enc, w = encode_gguf_rows(random_rows("Q4_K", n, k, rng), "Q4_K", k)
    c8 = affine8_rows(enc.correction.T.copy())
    assert c8.packed.shape == (n, 2, 64)
    c_back = c8.dequantize()[:k // 32]
    rel = np.abs(c_back - enc.correction).max() / np.abs(enc.correction).max()
    assert 0 < rel <= 1 / 255
    # read back from its node (K = 96 block sums: the last block of 64 zero-padded), as the prompt graph reads it
    from onnx import helper

    node = helper.make_node("MatMulNBits", ["s", "c_Q", "c_scales", "c_zp"], ["y"], domain="com.microsoft", K=k // 32,
                            N=n, bits=8, block_size=CORRECTION_BLOCK)
    arrays = {"c_Q": c8.packed, "c_scales": c8.scales.reshape(-1), "c_zp": c8.packed_zero_points()}
    read = NBitsWeight.from_node(node, arrays.__getitem__).dequantize()
    assert read.shape == (128, n) and np.array_equal(read[:k // 32], c_back) and not read[k // 32:].any()
    w8 = NBitsWeight(4, 32, enc.packed, enc.scales, enc.zero_points, c_back).dequantize()
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    y = nbits_session(enc, 4, correction_bits=8).run(None, {"x": x})[0]
    r, r_exact = x @ w8, x @ w.T
    y32 = nbits_session(enc, 4).run(None, {"x": x})[0]
    # int8 activations for both parts: as close to x·W as the fp32 correction's graph is, within a small margin
    assert np.abs(y - r_exact).max() <= 1.5 * np.abs(y32 - r_exact).max() + 1e-3 * np.abs(r_exact).max()
    assert np.abs(y - r).max() < 0.03 * np.abs(r).max()


def test_zero_points_pack_two_per_byte_with_odd_block_counts():
    z = np.array([[1, 2, 3], [15, 0, 7]], np.uint8)
    enc = NBitsWeight(4, 32, np.zeros((2, 3, 16), np.uint8), np.ones((2, 3), np.float32), z)
    np.testing.assert_array_equal(enc.packed_zero_points(), [1 | 2 << 4, 3, 15, 7])
    enc8 = NBitsWeight(8, 32, np.zeros((2, 3, 32), np.uint8), np.ones((2, 3), np.float32), z)
    np.testing.assert_array_equal(enc8.packed_zero_points(), z.reshape(-1))


def test_corrupt_blocks_and_unknown_types_are_refused():
    rng = np.random.default_rng(0)
    with pytest.raises(DSparkError, match="no MatMulNBits encoding"):
        encode_gguf_rows(np.zeros((2, 110), np.uint8), "Q3_K", 256)
    rows = random_rows("Q8_0", 4, 64, rng)
    rows[:, 0:2] = np.array([np.inf], np.float16).view(np.uint8)  # an infinite block scale
    with pytest.raises(DSparkError):
        encode_gguf_rows(rows, "Q8_0", 64)


def test_gguf_tensor_names():
    names = {"blk.3.ffn_down.weight", "blk.0.attn_q.weight", "token_embd.weight"}
    assert gguf_tensor_name("layers.3.mlp.down_proj", names) == "blk.3.ffn_down.weight"
    assert gguf_tensor_name("model.layers.0.self_attn.q_proj", names) == "blk.0.attn_q.weight"
    assert gguf_tensor_name("lm_head", names) == "token_embd.weight"  # tied in the file
    assert gguf_tensor_name("lm_head", names | {"output.weight"}) == "output.weight"
    assert gguf_tensor_name("layers.1.mlp.up_proj", names) is None


# ------------------------------------------------------------------------------ a tiny model from a GGUF
GGUF_TYPES = {"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
              "ffn_up": "Q4_1", "ffn_down": "Q5_K", "output": "Q6_K"}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory, monkeypatch_module):
    """A tiny Qwen2 (hidden 256, MLP 512: K-quant blocks need K % 256 == 0) whose weights are the dequantized
    blocks of a GGUF written beside it, as `dspark-export fetch` leaves a converted model: the folder's
    dspark_source.json names the GGUF in $DSPARK_CACHE/gguf/."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.fixtures.tiny_models import make_tokenizer

    cache = tmp_path_factory.mktemp("cache")
    monkeypatch_module.setenv("DSPARK_CACHE", str(cache))
    root = cache / "models" / "tiny-gguf"
    vocab = make_tokenizer(root)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2,
                                         bos_token_id=None, tie_word_embeddings=False)).eval()
    rng = np.random.default_rng(1)
    (cache / "gguf").mkdir()
    w = gguf.GGUFWriter(str(cache / "gguf" / "tiny-gguf.gguf"), "qwen2")
    sd = model.state_dict()

    def put(gname, hf_name, qtype):
        t = sd[hf_name]
        n, k = t.shape
        # weights of a few 0.01 (K-quant sub-block scales multiply d by up to 63)
        rows = random_rows(qtype, n, k, rng, 2e-5, 2e-4) if qtype.endswith("_K") else \
            random_rows(qtype, n, k, rng, 1e-3, 4e-3)
        deq = quants.dequantize(rows, GGMLQuantizationType[qtype]).reshape(n, k)
        with torch.no_grad():
            t.copy_(torch.from_numpy(deq))
        w.add_tensor(gname, rows, raw_shape=rows.shape, raw_dtype=GGMLQuantizationType[qtype])

    for i in range(2):
        for g, h in HF_NAMES.items():
            put(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight", GGUF_TYPES[g])
    put("output.weight", "lm_head.weight", GGUF_TYPES["output"])
    put("token_embd.weight", "model.embed_tokens.weight", "Q4_K")  # as Qwen2.5's Q4_K_M GGUFs hold it
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.load_state_dict(sd)
    model.save_pretrained(root)
    size = (cache / "gguf" / "tiny-gguf.gguf").stat().st_size
    (root / "dspark_source.json").write_text(json.dumps({"name": "tiny-gguf", "gguf_size": size}))
    return root, cache / "gguf" / "tiny-gguf.gguf"


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_int4_graph_from_the_gguf_matches_the_fp32_graph(gguf_model, tmp_path):
    from dspark_export.graphs.decoder import decoder_dims, export_decoder, load_hf_model
    from dspark_export.precision.nbits_gguf import quantize_nbits_gguf
    from dspark_runtime.backends.ort import OrtDecoder

    folder, gpath = gguf_model
    model = load_hf_model(folder)
    spec = export_decoder(model, decoder_dims(model.config, (-1, 0)), tmp_path / "g.onnx")
    rep = quantize_nbits_gguf(tmp_path / "g.onnx", tmp_path / "q.onnx", gpath, accuracy_level=0, log=lambda *a: None)
    assert rep["matmul_nbits"] == 15 and rep["unmatched"] == [] and rep["kept_fp32"] == []
    assert rep["gguf_types"]["Q4_K"]["tensors"] == 4 and rep["gguf_types"]["Q6_K"]["tensors"] == 3
    assert rep["max_abs_weight_diff_vs_fp32_graph"] < 1e-6
    assert rep["weight_bytes_out"] < rep["weight_bytes_in"]
    assert rep["embedding"]["gguf_type"] == "Q4_K"  # the table in the GGUF's blocks, not fp32
    # gate (Q4_K) and up (Q4_1) are both 4-bit blocks of 32 with a correction: merged in each of the 2 layers
    assert rep["merged_shared_inputs"]["groups"] == 2 and rep["merged_shared_inputs"]["matmul_nbits_nodes"] == [15, 13]
    # the float-weight writer keeps the same table in the same blocks when told the GGUF (a draft's graph)
    from dspark_export.precision.nbits_rtn import quantize_nbits_rtn

    rtn = quantize_nbits_rtn(tmp_path / "g.onnx", tmp_path / "r.onnx", gguf=gpath, log=lambda *a: None)
    assert rtn["embedding"]["gguf_type"] == "Q4_K" and rtn["int4_source"] == "rtn"
    assert quantize_nbits_rtn(tmp_path / "g.onnx", tmp_path / "r0.onnx", log=lambda *a: None)["embedding"] == "fp32 table"
    assert rtn["weight_bytes_out"] < quantize_nbits_rtn(tmp_path / "g.onnx", tmp_path / "r0.onnx",
                                                        log=lambda *a: None)["weight_bytes_out"]
    ids = np.array([[5, 17, 42, 99, 7, 3]], np.int64)
    outs = []
    for p in (tmp_path / "g.onnx", tmp_path / "q.onnx", tmp_path / "r.onnx"):
        dec = OrtDecoder(p, spec)
        dec.activate()
        n = ids.shape[1]
        outs.append(dec.step(ids, np.arange(n)[None], np.tril(np.ones((n, n), bool))[None, None],
                             dec.empty_kv(1)).logits)
        outs.append(dec.step(ids, np.arange(n)[None], np.tril(np.ones((n, n), bool))[None, None],
                             dec.empty_kv(1)).features[..., :model.config.hidden_size])  # layer -1: the embedding
    ref, got, ref_embedded, got_embedded = outs[0], outs[2], outs[1], outs[3]
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()  # same weights, fp32 activations
    np.testing.assert_array_equal(got_embedded, ref_embedded)  # the blocks decoded bit for bit
    np.testing.assert_array_equal(outs[5], ref_embedded)  # in the rtn graph too
    # the drafters' entry for the target's table reads the same rows
    from dspark_export.drafter.graph import target_embedding_entry
    from dspark_runtime.drafting.embedding_rows import EmbeddingRows

    entry = target_embedding_entry(tmp_path, "q.onnx")
    assert entry["dtype"] == "blocks" and entry["blocks"]["bits"] == 4 and entry["file"] == "q.onnx.data"
    table = EmbeddingRows.from_manifest(tmp_path, entry)
    np.testing.assert_array_equal(table.rows(ids), ref_embedded)
    fp32 = EmbeddingRows.from_manifest(tmp_path, target_embedding_entry(tmp_path, "g.onnx"))
    np.testing.assert_array_equal(table.table(), fp32.table())
    # a GGUF whose weights differ from the graph's is refused, naming the tensor
    w = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "qwen2")
    w.add_tensor("blk.0.attn_q.weight", random_rows("Q8_0", 256, 256, np.random.default_rng(9)),
                 raw_shape=(256, 272), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(DSparkError, match="blk.0.attn_q.weight"):
        quantize_nbits_gguf(tmp_path / "g.onnx", tmp_path / "bad.onnx", tmp_path / "other.gguf", log=lambda *a: None)


def test_int4_engine_auto_source_and_speculative_equals_target_only(gguf_model, tmp_path):
    """Must-show in small: an int4 engine (target re-packed from its GGUF, draft by ONNX Runtime's RTN quantizer)
    records its sources, and speculative greedy output equals int4 target-only output."""
    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_runtime import Engine

    folder, _ = gguf_model
    m = build_engine(Recipe(name="q4", target=str(folder), draft=str(folder), precision="int4", draft_length=4),
                     tmp_path / "q4", isolate=False, log=lambda *a: None)
    t, d = m.graphs["target"], m.graphs["draft"]
    assert t.precision == d.precision == "int4"
    from dspark_export.precision.quantizers import kernels_unsuitable, resolve_int4_source

    # auto: the GGUF's blocks on DSpark's kernels where they build and run their vector path here, else gguf-compact
    auto = "gguf-kernel" if kernels_unsuitable() is None else "gguf-compact"
    assert t.quantization["int4_source"] == auto and t.quantization["accuracy_level"] == 4
    # lm_head auto: the GGUF's 8-bit (Q6_K) head is screened; the draft's RTN head is 4-bit already
    assert t.quantization["lm_head"]["candidates"] == 256 and "lm_head" not in d.quantization
    assert t.spec.kv_layout == d.spec.kv_layout == "scatter"  # kv_layout auto: int4 engines are batch-exact
    assert d.quantization["int4_source"] == "rtn" and d.quantization["matmul_nbits"] == 15
    assert set(t.validation) == {"fp32", "int4"}
    import onnx

    for role, graph in (("target", t), ("draft", d)):  # int4 decoders: every rotary embedding one contrib op, one
        nodes = onnx.load(str(tmp_path / "q4" / f"{role}.onnx"), load_external_data=False).graph.node  # cache read
        ops = [n.op_type for n in nodes]
        assert "MatMulNBits" in ops and "Neg" not in ops
        assert ops.count("RotaryEmbedding") == graph.quantization["rotary_fused"] == 2 * graph.spec.dims.num_layers
        assert graph.quantization["shape_reads_shared"] > 0
        assert {n.input[0] for n in nodes if n.op_type == "Shape" and n.input[0].startswith("past.")} == {"past.0.key"}
    from dspark_export.drafter.graph import target_embedding_entry

    # the target's token embedding stays in the GGUF's blocks through every later pass (head, fusions)
    assert t.quantization["embedding"]["gguf_type"] == d.quantization["embedding"]["gguf_type"] == "Q4_K"
    table = [t.spec.dims.vocab_size, t.spec.dims.hidden_size]
    for role in ("target", "draft"):  # no fp32 [vocab, hidden] table left in either graph
        proto = onnx.load(str(tmp_path / "q4" / f"{role}.onnx"), load_external_data=False)
        assert not [i.name for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT
                    and list(i.dims) == table]
    assert target_embedding_entry(tmp_path / "q4", "target.onnx")["dtype"] == "blocks"
    eng = Engine.load(tmp_path / "q4", threads=1)
    for prompt in ("def add(a, b):", "Write a function that sorts a list of numbers."):
        ref = eng.generate(prompt, max_new_tokens=32, draft=None)
        for draft, g in (("lm", 4), ("ngram", 3)):
            out = eng.generate(prompt, max_new_tokens=32, draft=draft, draft_length=g)
            assert out.token_ids == ref.token_ids
    from click.testing import CliRunner

    from dspark_runtime.cli import cli

    info = CliRunner().invoke(cli, ["info", "--engine", str(tmp_path / "q4")])
    assert info.exit_code == 0, info.output
    assert "int4 weights: GGUF blocks of tiny-gguf.gguf " in info.output and "4 Q4_K" in info.output
    assert (("6 MatMulGGUF on DSpark's kernels" in info.output and "compact: 8 tensors in fewer bits" in info.output)
            if auto == "gguf-kernel" else "compact: 14 tensors in fewer bits" in info.output)
    assert "MatMulNBitsQuantizer (symmetric RTN, 4-bit, block 32)" in info.output
    assert info.output.count("LM head screened in 2 bits, the best 256 rescored exactly") == 1  # the target only
    assert info.output.count("KV layout scatter") == 2  # target and draft
    assert info.output.count("K/V written in place") == 2  # built with the slot outputs
    # gguf asked for where the model has no GGUF: a clear error
    with pytest.raises(DSparkError, match="--int4-source rtn"):
        resolve_int4_source("gguf", "target", tmp_path)
    assert resolve_int4_source("auto", "draft", folder)[0] == "rtn"
    assert resolve_int4_source("auto", "target", folder)[0] == auto


def test_gguf_compact_engine_reads_fewer_bytes_and_stays_exact_to_itself(gguf_model, tmp_path):
    """``--int4-source gguf-compact``: 4-bit blocks of 32 keep their codes with the block minimum as an 8-bit block-sum
    correction, every other block type but the LM head's is fitted in 4 bits (fewer bytes than the exact re-pack),
    and speculative output equals its own target-only output."""
    import onnx

    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_runtime import Engine

    folder, _ = gguf_model
    built = {}
    for src in ("gguf", "gguf-compact"):
        built[src] = build_engine(Recipe(name=src, target=str(folder), draft=str(folder), precision="int4",
                                         int4_source=f"target={src},draft=rtn", draft_length=4),
                                  tmp_path / src, isolate=False, log=lambda *a: None)
    q = built["gguf-compact"].graphs["target"].quantization
    assert q["int4_source"] == "gguf-compact"
    how = {m.split(".")[-1]: r["encoding"] for m, r in q["approximated"].items()}
    assert how == {"q_proj": "8-bit min correction", "gate_proj": "8-bit min correction",
                   "up_proj": "8-bit min correction", "k_proj": "4-bit fit", "v_proj": "4-bit fit",
                   "o_proj": "4-bit fit", "down_proj": "4-bit fit"}  # the LM head (Q6_K) stays exact
    assert len(q["approximated"]) == 14 and all(0 < r["rel_l2"] < 0.2 for r in q["approximated"].values())
    kept = [r["rel_l2"] for r in q["approximated"].values() if r["encoding"] == "8-bit min correction"]
    assert max(kept) < 0.02  # the codes are the GGUF's: only the minimum is rounded, to 8 bits
    assert q["weight_bytes_out"] < built["gguf"].graphs["target"].quantization["weight_bytes_out"]
    nodes = onnx.load(str(tmp_path / "gguf-compact" / "target.onnx"), load_external_data=False).graph.node
    nb = [n for n in nodes if n.op_type == "MatMulNBits"]
    shapes = {tuple(a.i for a in n.attribute if a.name in ("bits", "block_size")) for n in nb}
    assert shapes == {(4, 32), (8, CORRECTION_BLOCK), (2, 128)}  # the weights, the min corrections, the LM head's screen
    assert all(n.input[3] for n in nb) and not [n for n in nodes if n.op_type == "MatMul" and "_corr" in n.input[1]]
    from click.testing import CliRunner

    from dspark_runtime.cli import cli

    info = CliRunner().invoke(cli, ["info", "--engine", str(tmp_path / "gguf-compact")])
    assert info.exit_code == 0 and "compact: 14 tensors in fewer bits" in info.output  # 7 per layer, the head exact
    # the prompt graph replaces every MatMulNBits but the screen (an 8-bit correction with its weight where it
    # follows it directly, on its own where merged ones are split apart); the 8-bit corrections' padded K included
    from dspark_export.engine_dir.add_prompt_graph import add_prompt_graph

    pq = add_prompt_graph(tmp_path / "gguf-compact", log=lambda *a: None).graphs["target_prompt"].quantization
    assert pq["kept"] == 1 and 0 < pq["replaced"] < len(nb) - 1
    for prompts in ("prompt-graph", "target"):
        fitted = Engine.load(tmp_path / "gguf-compact", threads=1, prompts=prompts)
        for prompt in ("def add(a, b):", "Write a function that sorts a list of numbers."):
            ref = fitted.generate(prompt, max_new_tokens=24, draft=None)
            assert fitted.generate(prompt, max_new_tokens=24, draft="lm", draft_length=4).token_ids == ref.token_ids


def test_gguf_kernel_engine_keeps_the_k_quant_blocks_and_speculative_equals_target_only(gguf_model, tmp_path):
    """``--int4-source gguf-kernel``: the Q4_K / Q6_K tensors stay the GGUF's own blocks, run by DSpark's MatMulGGUF
    (a layer's q (Q4_K) and k (Q6_K) merged into one node of two segments), the other types as gguf-compact writes
    them, the LM head exact; the library ships in the engine, listed and checksummed; the logits track the exact
    re-pack's; speculative output equals target-only."""
    import onnx

    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_runtime import Engine
    from dspark_runtime.backends.ort import OrtDecoder
    from dspark_runtime.engine_dir.manifest import load_manifest
    from dspark_runtime.kernels import LIBRARY_NAME
    from dspark_runtime.runners.scatter import ScatterRunner

    folder, _ = gguf_model
    for src in ("gguf", "gguf-compact", "gguf-kernel"):
        build_engine(Recipe(name=src, target=str(folder), draft=str(folder), precision="int4",
                            int4_source=f"target={src},draft=rtn", draft_length=4),
                     tmp_path / src, isolate=False, log=lambda *a: None)
    m = load_manifest(tmp_path / "gguf-kernel")
    g = m.graphs["target"]
    q = g.quantization
    assert q["int4_source"] == "gguf-kernel" and q["kernels"] == LIBRARY_NAME
    assert q["matmul_gguf"] == 6 and q["merged_gguf_inputs"] == {"groups": 2, "nodes": q["merged_gguf_inputs"]["nodes"]}
    how = {mod.split(".")[-1]: r["encoding"] for mod, r in q["approximated"].items()}
    assert how == {"up_proj": "8-bit min correction", "v_proj": "4-bit fit", "o_proj": "4-bit fit",
                   "down_proj": "4-bit fit"}
    assert g.spec.kernels == LIBRARY_NAME and LIBRARY_NAME in [f.path for f in g.files]
    assert m.graphs["draft"].spec.kernels == ""
    nodes = onnx.load(str(tmp_path / "gguf-kernel" / "target.onnx"), load_external_data=False).graph.node
    segs = sorted(tuple(a.ints) for n in nodes if n.op_type == "MatMulGGUF" for a in n.attribute
                  if a.name == "segment_types")
    assert segs == [(12,), (12,), (12, 14), (12, 14)]  # per layer: gate; q with k
    logits = []
    for src in ("gguf", "gguf-compact", "gguf-kernel"):
        runner = ScatterRunner(OrtDecoder(tmp_path / src / "target.onnx",
                                          load_manifest(tmp_path / src).graphs["target"].spec).activate())
        runner.add(0)
        logits.append(np.asarray(runner.step([(0, [5, 17, 42, 99, 7, 3])])[0]))
    # the other types are approximated as gguf-compact does; keeping k_proj's Q6_K blocks instead of fitting them
    # in 4 bits brings the logits closer to the exact re-pack's (llama.cpp's weights)
    assert np.linalg.norm(logits[2] - logits[0]) < np.linalg.norm(logits[1] - logits[0])
    # the prompt graph replaces the MatMulGGUF too (their weights dequantized from the blocks) and needs no kernels
    from dspark_export.engine_dir.add_prompt_graph import add_prompt_graph

    pg = add_prompt_graph(tmp_path / "gguf-kernel", log=lambda *a: None).graphs["target_prompt"]
    assert pg.quantization["kept"] == 1 and pg.quantization["kept_gguf"] == 0 and pg.spec.kernels == ""
    assert pg.validation["int8"]["rel_l2"] < 0.1  # 8-bit columns of the same weights (wrong ones: ~1)
    for prompts in ("prompt-graph", "target"):
        fitted = Engine.load(tmp_path / "gguf-kernel", threads=1, prompts=prompts)
        for prompt in ("def add(a, b):", "Write a function that sorts a list of numbers."):
            ref = fitted.generate(prompt, max_new_tokens=24, draft=None)
            assert fitted.generate(prompt, max_new_tokens=24, draft="lm", draft_length=4).token_ids == ref.token_ids


# ------------------------------------------------------------------------- merging MatMulNBits (nbits_fuse)
@pytest.mark.parametrize("correction_bits", [32, 8])
def test_merging_matmulnbits_that_share_an_input_is_bit_identical(tmp_path, correction_bits):
    """q/k/v-like projections (4-bit with the block-min correction — fp32, or 8-bit as gguf-compact writes it —, each
    + bias), one 8-bit projection of the same input (another encoding: not merged), and gate/up-like projections
    without correction (bias into the kernel): the merged graph computes exactly what the separate nodes did, with
    fewer nodes."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from dspark_export.precision.nbits_fuse import fuse_shared_inputs

    rng = np.random.default_rng(3)
    k = 512
    nodes, inits, outs, blocksums = [], [], [], {}

    def proj(name, x, y, qtype, n, bias):
        enc, _ = encode_gguf_rows(random_rows(qtype, n, k, rng), qtype, k)
        inits.extend([numpy_helper.from_array(enc.packed, name + "_Q"),
                      numpy_helper.from_array(enc.scales.reshape(-1), name + "_scales"),
                      numpy_helper.from_array(enc.packed_zero_points(), name + "_zp")])
        if enc.correction is not None and correction_bits == 8:
            c8 = affine8_rows(enc.correction.T.copy())
            inits.extend([numpy_helper.from_array(c8.packed, name + "_corr_Q"),
                          numpy_helper.from_array(c8.scales.reshape(-1), name + "_corr_scales"),
                          numpy_helper.from_array(c8.packed_zero_points(), name + "_corr_zp")])
        elif enc.correction is not None:
            inits.append(numpy_helper.from_array(enc.correction, name + "_corr"))
        out = y + "_pre" if bias else y
        nbits_nodes(helper, name, x, out, name, NBitsMeta(enc.bits, enc.block_size, k, n, enc.correction is not None,
                                                          correction_bits), 4, blocksums, nodes)
        if bias:
            inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), name + "_b"))
            nodes.append(helper.make_node("Add", [out, name + "_b"], [y]))
        outs.append(y)

    for name, n in (("q", 256), ("k", 64), ("v", 64)):
        proj(name, "x", name + "_y", "Q4_K", n, True)
    proj("v8", "x", "v8_y", "Q6_K", 64, False)
    nodes.append(helper.make_node("Mul", ["q_y", "q_y"], ["h"]))
    nodes.append(helper.make_node("Concat", ["h", "h"], ["h2"], axis=-1))
    k = 512
    for name in ("gate", "up"):
        proj(name, "h2", name + "_y", "Q4_0", 128, True)
    inits += [numpy_helper.from_array(np.array([0, 0, 512 // 32, 32], np.int64), "__nbits_shape_512_32"),
              numpy_helper.from_array(np.array([-1], np.int64), "__nbits_axis_last")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, 512])],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "g.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="g.onnx.data", size_threshold=1024)

    def run(x):
        s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return s.run(outs, {"x": x})

    xs = [rng.standard_normal((1, m, 512)).astype(np.float32) for m in (1, 2, 5)]
    before = [run(x) for x in xs]
    rep = fuse_shared_inputs(path, log=lambda *a: None)
    # 8-bit: the three corrections are MatMulNBits too, merged into one like their weights
    assert rep["groups"] == 2 and rep["matmul_nbits_nodes"] == ([6, 3] if correction_bits == 32 else [9, 4])
    after = [run(x) for x in xs]
    for b, a in zip(before, after):
        for yb, ya in zip(b, a):
            np.testing.assert_array_equal(ya, yb)
    ops = [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]
    assert ops.count("Sub") == 1 and ops.count("Split") == 2 and ops.count("Add") == 1  # q/k/v's bias after the Sub
    assert fuse_shared_inputs(path, log=lambda *a: None)["groups"] == 0  # nothing left to merge
