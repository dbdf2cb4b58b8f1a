"""The screened LM head (dspark_export.precision.nbits_head): a 2- or 4-bit screen plus exact rescoring of the best
candidates gives the exact head's top token and logits, row for row whatever the call, and reads fewer bytes."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from dspark_export.engine_dir.build import Recipe  # noqa: E402
from dspark_export.graphs.onnx_io import step_weight_bytes  # noqa: E402
from dspark_export.precision.nbits import NBitsMeta, NBitsWeight, add_ms_opset, nbits_nodes, pack_codes  # noqa: E402
from dspark_export.precision.nbits_head import resolve_lm_head, screen_lm_head  # noqa: E402
from dspark_runtime.errors import DSparkError  # noqa: E402

K, V = 64, 600


def head_graph(path, bits: int = 8, seed: int = 0) -> np.ndarray:
    """A graph ``logits = hidden @ W`` with W an 8-bit (Q6_K-like: blocks of 16, zero point 32) or 4-bit MatMulNBits
    head; returns W as rows float32 [V, K]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    block = 16 if bits == 8 else 32
    zp = 32 if bits == 8 else 8
    codes = rng.integers(0, 64 if bits == 8 else 16, (V, K), dtype=np.uint8)
    scales = (rng.random((V, K // block), dtype=np.float32) * 0.02 + 0.005).astype(np.float32)
    enc = NBitsWeight(bits, block, pack_codes(codes, bits, block), scales, np.full((V, K // block), zp, np.uint8))
    nodes: list = []
    nbits_nodes(helper, "lm_head", "hidden", "logits", "W", NBitsMeta(bits, block, K, V, False), 4, {}, nodes)
    inits = [numpy_helper.from_array(enc.packed, "W_Q"), numpy_helper.from_array(enc.scales.reshape(-1), "W_scales"),
             numpy_helper.from_array(enc.packed_zero_points(), "W_zp")]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["b", "q", K])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "q", V])], inits)
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    add_ms_opset(proto, helper)
    onnx.save_model(proto, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    return enc.dequantize().T


def run(path, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"hidden": x})[0]


# a random head (uniform codes) is harder to screen than a trained one: the 2-bit screen rescores more candidates
@pytest.mark.parametrize("bits,block,cands,max_rel,max_bytes", [(2, 64, 96, 0.45, 0.45), (4, 32, 16, 0.2, 0.7)])
def test_screened_head_keeps_the_exact_top_tokens_row_for_row_and_reads_fewer_bytes(tmp_path, bits, block, cands,
                                                                                   max_rel, max_bytes):
    w = head_graph(tmp_path / "h.onnx")
    before = step_weight_bytes(tmp_path / "h.onnx")
    x = np.random.default_rng(1).standard_normal((2, 5, K)).astype(np.float32)
    full = run(tmp_path / "h.onnx", x)
    rec = screen_lm_head(tmp_path / "h.onnx", candidates=cands, bits=bits, block=block, log=lambda *a: None)
    got = run(tmp_path / "h.onnx", x)
    assert rec["candidates"] == cands and rec["screen_bits"] == bits and 0 < rec["screen_rel_l2"] < max_rel
    assert rec["head_step_bytes"][1] < rec["head_step_bytes"][0]
    # the 8-bit rows are read by Gather only: a step streams the screen (2-bit: about a quarter of the 8-bit head)
    assert step_weight_bytes(tmp_path / "h.onnx") < max_bytes * before
    exact = x @ w.T  # the head's weights times the fp32 hidden state
    assert (got.argmax(-1) == exact.argmax(-1)).all()
    assert (got.argmax(-1) == full.argmax(-1)).all()
    top = np.argsort(-exact, axis=-1)[..., :4]  # the exact head's best tokens carry exact logits
    np.testing.assert_allclose(np.take_along_axis(got, top, -1), np.take_along_axis(exact, top, -1), rtol=1e-5,
                               atol=1e-5)
    rest = np.ones_like(got, bool)
    np.put_along_axis(rest, np.argsort(-got, axis=-1)[..., :cands], False, -1)
    assert np.abs(got - exact)[rest].max() > 1e-4  # the others are the screen's approximations
    # a row's logits do not depend on its call: one row alone, the same row among others
    for b, q in ((0, 0), (1, 3)):
        alone = run(tmp_path / "h.onnx", x[b:b + 1, q:q + 1])
        assert np.array_equal(alone[0, 0], got[b, q])
    nodes = onnx.load(str(tmp_path / "h.onnx"), load_external_data=False).graph.node
    ops = [n.op_type for n in nodes]
    assert ops.count("MatMulNBits") == 1 and "TopK" in ops and "ScatterElements" in ops
    screen = next(n for n in nodes if n.op_type == "MatMulNBits")
    assert {a.name: a.i for a in screen.attribute if a.name in ("bits", "block_size")} == {"bits": bits,
                                                                                           "block_size": block}


def test_head_weight_from_its_node_and_resolution_and_refusals(tmp_path):
    w = head_graph(tmp_path / "h.onnx", seed=3)
    proto = onnx.load(str(tmp_path / "h.onnx"))
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert np.array_equal(NBitsWeight.from_node(proto.graph.node[0], arrays.__getitem__).dequantize().T, w)
    assert resolve_lm_head("auto", "gguf") == resolve_lm_head("auto", "gguf-compact") == "screened"
    assert resolve_lm_head("auto", "rtn") == "full" and resolve_lm_head("full", "gguf") == "full"
    with pytest.raises(DSparkError, match="choose one of auto, screened, full"):
        resolve_lm_head("fast", "gguf")
    with pytest.raises(DSparkError, match="lm_head 'fast' is not supported"):  # a recipe file's field, checked early
        Recipe(name="x", target="y", lm_head="fast").validate()
    with pytest.raises(DSparkError, match="at least one candidate"):
        screen_lm_head(tmp_path / "h.onnx", candidates=0, log=lambda *a: None)
    head_graph(tmp_path / "h4.onnx", bits=4)
    with pytest.raises(DSparkError, match="4-bit already"):
        screen_lm_head(tmp_path / "h4.onnx", log=lambda *a: None)
    with pytest.raises(DSparkError, match="K=64 is not a multiple of the screen block 128"):
        screen_lm_head(tmp_path / "h.onnx", block=128, log=lambda *a: None)
    # more candidates than tokens: every token is rescored, the logits are the exact head's; the default block is
    # the largest of SCREEN_BLOCKS that divides K
    rec = screen_lm_head(tmp_path / "h.onnx", candidates=10 * V, log=lambda *a: None)
    assert rec["screen"].startswith("2-bit blocks of 64,") and rec["candidates"] == V
    x = np.random.default_rng(2).standard_normal((1, 3, K)).astype(np.float32)
    np.testing.assert_allclose(run(tmp_path / "h.onnx", x), x @ w.T, rtol=1e-5, atol=1e-5)
