"""Static INT8 QDQ quantization (dspark_export.precision.quantize) on tiny exported graphs and engines."""
import json

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")


def _run(path, spec, ids):
    from dspark_runtime.backends.ort import OrtDecoder
    from dspark_runtime.runners.kvcache import causal_mask

    dec = OrtDecoder(path, spec, threads=1).activate()
    n = len(ids)
    return dec.step(np.asarray([ids]), np.arange(n)[None], causal_mask(n, 0), dec.empty_kv(1)).logits[0]


def test_weight_quantization_streams_in_chunks_and_matches_the_formula():
    from dspark_export.precision.qdq import quantize_weight_chunks

    w = np.random.default_rng(1).standard_normal((37, 11)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero column must not divide by zero
    parts = list(quantize_weight_chunks(lambda a, b: w[a:b], 37, 11, 127, chunk_bytes=5 * 11 * 4))
    assert parts[0][0] == "scale" and len(parts) == 1 + 8  # 37 rows in chunks of 5
    scale = parts[0][1]
    q = np.concatenate([c for _, c in parts[1:]])
    np.testing.assert_allclose(scale[[0, 5]], np.abs(w).max(axis=0)[[0, 5]] / 127)
    assert scale[3] == 1.0 and q.dtype == np.int8 and np.abs(q).max() == 127
    assert np.abs(q * scale - w).max() <= scale.max() / 2 + 1e-6  # round-to-nearest error bound


def test_activation_qparams():
    from dspark_export.precision.qdq import activation_qparams

    s, zp = activation_qparams(-1.0, 3.0, signed=False)
    assert zp.dtype == np.uint8 and zp == 64 and s == pytest.approx(4 / 255)
    s, zp = activation_qparams(0.5, 2.0, signed=False)  # range widened to include 0
    assert zp == 0 and s == pytest.approx(2 / 255)
    s, zp = activation_qparams(-4.0, 1.0, signed=True)
    assert zp.dtype == np.int8 and zp == 0 and s == pytest.approx(4 / 127)


def test_calibration_covers_prefill_decode_and_verify(tiny_graph):
    from dspark_export.graphs.onnx_io import quant_targets
    from dspark_export.precision.activation_ranges import calibrate_graph

    path, spec, ids = tiny_graph
    tab = calibrate_graph(path, spec, ids, verify_len=4, log=lambda *a: None)
    kinds = [(s["kind"], s["q"]) for s in tab.steps]
    assert kinds[:6] == [("prefill", 24)] + [("decode", 1)] * 4 + [("verify", 4)]
    assert len(tab.steps) == 3 * 6 and len(tab.data_id) == 64
    targets, _ = quant_targets(onnx.load(str(path), load_external_data=False))
    assert {t.module for t in targets} >= {"lm_head", "layers.0.mlp.down_proj", "layers.1.self_attn.q_proj"}
    assert len(targets) == 2 * 7 + 1  # q,k,v,o,gate,up,down per layer + the LM head; no attention MatMul
    assert set(tab.ranges) == {t.activation for t in targets}
    assert all(lo < 0 < hi for lo, hi in tab.ranges.values())
    # the same tokens give the same id; other tokens another
    again = calibrate_graph(path, spec, ids, verify_len=4, log=lambda *a: None)
    other = calibrate_graph(path, spec, ids[:2], verify_len=4, log=lambda *a: None)
    assert again.data_id == tab.data_id != other.data_id
    assert again.ranges == tab.ranges


def test_int8_qdq_matches_onnxruntime_quantize_static(tiny_graph, tmp_path):
    """Our streaming writer against ONNX Runtime's own quantize_static on the same calibration feeds."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    from dspark_export.graphs.onnx_io import quant_targets
    from dspark_export.precision.qdq import quantize_qdq
    from dspark_export.precision.activation_ranges import calibrate_graph

    path, spec, ids = tiny_graph
    nodes = [t.node for t in quant_targets(onnx.load(str(path), load_external_data=False))[0]]
    feeds = []
    tab = calibrate_graph(path, spec, ids, verify_len=4, on_feeds=feeds.append, log=lambda *a: None)
    rep = quantize_qdq(path, tmp_path / "ours.onnx", tab, "int8", log=lambda *a: None)
    assert rep["quantized"] == 15 and rep["lm_head_quantized"] and rep["excluded"] == []

    class Replay(CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    quantize_static(str(path), str(tmp_path / "ort.onnx"), Replay(), quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=["MatMul"], nodes_to_quantize=nodes, per_channel=True, reduce_range=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    extra_options={"MatMulConstBOnly": True, "WeightSymmetric": True,
                                   "OpTypesToExcludeOutputQuantization": ["MatMul"]})
    x = list(map(int, np.random.default_rng(5).integers(3, 300, 30)))
    ref, ours, ort_q = (_run(p, spec, x) for p in (path, tmp_path / "ours.onnx", tmp_path / "ort.onnx"))
    q_err = np.abs(ours - ref).max()
    assert q_err > 1e-3  # it is quantized
    assert np.abs(ours - ort_q).max() < 0.02 * q_err  # and equals ONNX Runtime's quantizer up to float rounding
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    proto = onnx.load(str(tmp_path / "ours.onnx"), load_external_data=False)
    inits = {t.name: t for t in proto.graph.initializer}
    qw = [t for n, t in inits.items() if n.endswith("_quantized")]
    assert len(qw) == 15 and all(t.data_type == onnx.TensorProto.INT8 for t in qw)
    zps = [t for n, t in inits.items() if n.endswith("_act_zero_point")]
    assert zps and all(t.data_type == onnx.TensorProto.UINT8 for t in zps)
    dq_w = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.name.endswith("_weight_dq")]
    assert all(a.name == "axis" and a.i == 1 for n in dq_w for a in n.attribute)  # per output channel


def test_int8_trt_is_symmetric_s8(tiny_graph, tmp_path):
    from dspark_export.precision.qdq import quantize_qdq
    from dspark_export.precision.activation_ranges import calibrate_graph

    path, spec, ids = tiny_graph
    tab = calibrate_graph(path, spec, ids, verify_len=4, log=lambda *a: None)
    rep = quantize_qdq(path, tmp_path / "trt.onnx", tab, "int8-trt", log=lambda *a: None)
    assert "8-bit" in rep["weights"] and "int8 symmetric" in rep["activations"]
    proto = onnx.load(str(tmp_path / "trt.onnx"), load_external_data=False)
    zps = [t for t in proto.graph.initializer if t.name.endswith("zero_point")]
    assert zps and all(t.data_type == onnx.TensorProto.INT8 and not any(onnx.numpy_helper.to_array(t).ravel())
                       for t in zps)
    logits, ref = _run(tmp_path / "trt.onnx", spec, ids[0]), _run(path, spec, ids[0])
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.8


def test_exclusions_stay_fp32_and_missing_ranges_are_an_error(tiny_graph, tmp_path):
    from dspark_export.precision.qdq import quantize_qdq
    from dspark_export.precision.activation_ranges import calibrate_graph, CalibrationTable
    from dspark_runtime.errors import DSparkError

    path, spec, ids = tiny_graph
    tab = calibrate_graph(path, spec, ids, verify_len=2, exclude=["down_proj"], log=lambda *a: None)
    rep = quantize_qdq(path, tmp_path / "x.onnx", tab, "int8", exclude=["down_proj"], log=lambda *a: None)
    assert rep["quantized"] == 13 and rep["excluded"] == ["layers.0.mlp.down_proj", "layers.1.mlp.down_proj"]
    with pytest.raises(DSparkError, match="no range for 2 MatMul input"):
        quantize_qdq(path, tmp_path / "y.onnx", tab, "int8", log=lambda *a: None)
    with pytest.raises(DSparkError, match="not 'int4'"):
        quantize_qdq(path, tmp_path / "y.onnx", tab, "int4", log=lambda *a: None)
    tab.save(tmp_path / "t.json")
    assert CalibrationTable.load(tmp_path / "t.json").ranges == tab.ranges
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DSparkError, match="not a calibration table"):
        CalibrationTable.load(tmp_path / "bad.json")


def test_int8_engine_build_records_calibration_and_stays_lossless(tiny_pair, tmp_path):
    """Must-show 3 in small: speculative greedy output with an INT8 target equals INT8 target-only output."""
    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_runtime import Engine

    tdir, ddir = tiny_pair
    m = build_engine(Recipe(name="q8", target=str(tdir), draft=str(ddir), precision="int8", calibration_prompts=3,
                            draft_length=4), tmp_path / "q8", isolate=False, log=lambda *a: None)
    for role in ("target", "draft"):
        g = m.graphs[role]
        assert g.precision == "int8" and set(g.validation) == {"fp32", "int8"}
        q = g.quantization
        assert q["lm_head_quantized"] and q["quantized"] == 13  # all but the 2 mlp.down_proj (DEFAULT_EXCLUDE)
        assert q["excluded"] == ["layers.0.mlp.down_proj", "layers.1.mlp.down_proj"]
        assert len(q["calibration"]["data_id"]) == 64 and q["calibration"]["method"] == "minmax"
        assert set(q["calibration"]["steps"]) == {"prefill", "decode", "verify"}
        assert "calibration split" in q["calibration"]["prompts"]
    saved = json.loads((tmp_path / "q8" / "manifest.json").read_text())
    assert saved["graphs"]["target"]["quantization"]["calibration"]["data_id"] == \
        m.graphs["target"].quantization["calibration"]["data_id"]
    eng = Engine.load(tmp_path / "q8", threads=1)
    for prompt in ("def add(a, b):", "Write a function that sorts a list of numbers."):
        ref = eng.generate(prompt, max_new_tokens=40, draft=None)
        spec = eng.generate(prompt, max_new_tokens=40, draft="lm", draft_length=4)
        assert spec.token_ids == ref.token_ids and spec.stats.accepted > 0


def test_quantize_existing_engine_and_reuse_a_calibration_table(tiny_engine_dir, tmp_path):
    from dspark_export.cli import cli
    from dspark_runtime import Engine
    from dspark_runtime.engine_dir.manifest import load_manifest
    from click.testing import CliRunner

    before = (tiny_engine_dir / "manifest.json").read_text()
    r = CliRunner().invoke(cli, ["calibrate-quant", str(tiny_engine_dir), "--role", "target", "-o",
                                 str(tmp_path / "t.json"), "--prompts", "2", "--verify-len", "3"])
    assert r.exit_code == 0, r.output
    table = json.loads((tmp_path / "t.json").read_text())
    r = CliRunner().invoke(cli, ["quantize", str(tiny_engine_dir), "-o", str(tmp_path / "q"), "--precision",
                                 "target=int8,draft=int8", "--calibration", f"target={tmp_path / 't.json'}",
                                 "--calibration-prompts", "2"])
    assert r.exit_code == 0, r.output
    assert (tiny_engine_dir / "manifest.json").read_text() == before  # the source engine is untouched
    m = load_manifest(tmp_path / "q")  # verifies every file's sha256
    assert m.graphs["target"].quantization["calibration"]["data_id"] == table["data_id"]
    assert m.graphs["draft"].quantization["calibration"]["data_id"] != table["data_id"]  # its own graph
    v = m.graphs["target"].validation["int8"]
    assert v["reference"] == "fp32 graph" and 0 < v["prefill"]["rel_l2"] < 0.5
    eng = Engine.load(tmp_path / "q", threads=1)
    ref = eng.generate("for i in range(10):", max_new_tokens=24, draft=None)
    assert eng.generate("for i in range(10):", max_new_tokens=24, draft="lm").token_ids == ref.token_ids
    # errors name the fix
    r = CliRunner().invoke(cli, ["quantize", str(tmp_path / "q"), "-o", str(tmp_path / "q2"), "--precision",
                                 "target=int8-trt"])
    assert r.exit_code != 0 and "start from an fp32 engine" in str(r.exception)
    r = CliRunner().invoke(cli, ["quantize", str(tiny_engine_dir), "-o", str(tmp_path / "q"), "--precision", "int8"])
    assert r.exit_code != 0 and "not empty" in str(r.exception)


def test_a_weight_shared_with_an_excluded_matmul_keeps_its_fp32_copy(tmp_path):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from dspark_export.precision.qdq import quantize_qdq
    from dspark_export.precision.activation_ranges import CalibrationTable

    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y1"], name="mm_quant"),
                           helper.make_node("MatMul", ["x", "W"], ["y2"], name="mm_keep")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 8]) for n in ("y1", "y2")],
                          [numpy_helper.from_array(w, "W")])
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(tmp_path / "s.onnx"),
                    save_as_external_data=True, location="s.onnx.data", size_threshold=0)
    table = CalibrationTable(ranges={"x": [-3.0, 3.0]}, data_id="0" * 64, steps=[], prompts="hand-made")
    rep = quantize_qdq(tmp_path / "s.onnx", tmp_path / "q.onnx", table, "int8", exclude=["mm_keep"],
                        log=lambda *a: None)
    assert rep["quantized"] == 1 and rep["excluded"] == ["mm_keep"]
    x = np.clip(rng.standard_normal((4, 16)), -3, 3).astype(np.float32)
    y1, y2 = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(y2, x @ w, rtol=1e-5, atol=1e-5)  # the excluded MatMul reads the fp32 weight
    assert 0 < np.abs(y1 - x @ w).max() < 0.1 * np.abs(x @ w).max()  # the other one is quantized
