"""FP8 (E4M3) QDQ graphs: the streaming writer (dspark_export.precision.qdq.quantize_qdq, checked against a numpy
fake-quantization with ml_dtypes), the writer choice, and NVIDIA ModelOpt in its own environment (skipped
when it is not installed)."""
import onnx
import pytest

pytest.importorskip("torch")
from dspark_export.precision.fp8 import SETUP_HINT, modelopt_python  # noqa: E402

needs_modelopt = pytest.mark.skipif(modelopt_python() is None,
                                    reason=f"NVIDIA ModelOpt environment not found; create it with: {SETUP_HINT}")


def _refused_on_cpu_then_lossless(engine_dir):
    """An fp8 engine: refused on the CPU provider with the reason, and (allowed) speculative greedy output
    equal to its own target-only output. Returns the speculative result."""
    from dspark_runtime import Engine
    from dspark_runtime.errors import DSparkError

    eng = Engine.load(engine_dir, threads=1)
    with pytest.raises(DSparkError, match="graph target.onnx is fp8.*compute capability >= 8.9.*6-10x slower"):
        eng.generate("def add(a, b):", max_new_tokens=4, draft=None)
    eng = Engine.load(engine_dir, threads=1, allow_slow_precision=True)
    ref = eng.generate("def add(a, b):", max_new_tokens=16, draft=None)
    spec = eng.generate("def add(a, b):", max_new_tokens=16, draft="lm", draft_length=3)
    assert spec.token_ids == ref.token_ids  # lossless relative to the fp8 target
    return spec


@needs_modelopt
def test_fp8_engine_passes_checks_and_is_refused_on_cpu_unless_asked(tiny_engine_dir, tmp_path, monkeypatch):
    import numpy as np

    from dspark_export.precision.quantize import quantize_engine

    import os

    # a second hard link to the source's weights, as `dspark-export quantize` makes between engines (onnx refuses
    # to load external data with several links; ModelOpt must get a private copy)
    os.link(tiny_engine_dir / "target.onnx.data", tmp_path / "shared-weights.data")
    monkeypatch.chdir(tmp_path)  # a relative output directory, as `-o engines/x` gives (the worker runs elsewhere)
    m = quantize_engine(tiny_engine_dir, "f8", "target=fp8,draft=fp8", calibration_prompts=2, fp8_writer="modelopt",
                        log=lambda *a: None)
    for role in ("target", "draft"):
        g = m.graphs[role]
        q = g.quantization
        assert g.precision == "fp8" and q["quantized"] == 15 and q["lm_head_quantized"]
        assert q["writer"] == "modelopt" and "asked for" in q["writer_reason"]
        assert q["checks"]["checker"] == "passed" and q["checks"]["fp8_tensors"] >= 15
        assert any("Opset: 19" in line for line in q["checks"]["polygraphy"])
        assert len(q["calibration"]["data_id"]) == 64 and "calibration split" in q["calibration"]["prompts"]
        v = g.validation["fp8"]
        assert 0.0 < v["prefill"]["rel_l2"] < 0.3 and v["prefill"]["top1_agreement"] >= 0.8
    proto = onnx.load(str(tmp_path / "f8" / "target.onnx"), load_external_data=False)
    fp8_zp = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN]
    assert fp8_zp and {e.value for t in proto.graph.initializer for e in t.external_data
                       if e.key == "location"} <= {"target.onnx.data"}
    assert np.isfinite(_refused_on_cpu_then_lossless(tmp_path / "f8").stats.accepted_length_mean)


def test_fp8_modelopt_asked_for_without_modelopt_names_the_setup(tiny_engine_dir, tmp_path, monkeypatch):
    from dspark_export.precision.quantize import quantize_engine
    from dspark_runtime.errors import DSparkError

    monkeypatch.setenv("DSPARK_MODELOPT_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(DSparkError, match="nvidia-modelopt"):
        quantize_engine(tiny_engine_dir, tmp_path / "f8", "draft=fp8", calibration_prompts=1, fp8_writer="modelopt",
                        log=lambda *a: None)


# ------------------------------------------------------------------------------------- streaming writer
def _quiet(*a):
    pass


def _fake_quant(x, scale):
    """numpy + ml_dtypes reference: x / scale saturated to ±448, rounded to E4M3 (nearest even), times scale."""
    import ml_dtypes
    import numpy as np

    q = np.clip(np.asarray(x, np.float32) / np.float32(scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, q.astype(np.float32) * np.float32(scale)


def test_streamed_fp8_graph_matches_a_numpy_fake_quantization(tiny_graph, tmp_path):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from dspark_export.graphs.onnx_io import quant_targets, session_over_weights
    from dspark_export.precision.qdq import quantize_qdq
    from dspark_export.precision.activation_ranges import calibrate_graph

    path, spec, ids = tiny_graph
    feeds = []
    tab = calibrate_graph(path, spec, ids, verify_len=4, on_feeds=feeds.append, log=_quiet)
    dst = tmp_path / "f8.onnx"
    rep = quantize_qdq(path, dst, tab, "fp8", log=_quiet)
    src_proto = onnx.load(str(path), load_external_data=False)
    targets, _ = quant_targets(src_proto)
    acts = sorted({t.activation for t in targets})
    assert rep["quantized"] == 15 and rep["lm_head_quantized"] and rep["excluded"] == []
    assert rep["opset"] == {"from": 18, "to": 19} and "FLOAT8E4M3FN" in rep["weights"]

    # structure: checker with the external data, opset 19, one Q per activation, one DQ per MatMul input
    onnx.checker.check_model(str(dst))
    proto = onnx.load(str(dst), load_external_data=False)
    assert {(o.domain, o.version) for o in proto.opset_import} == {("", 19)} and proto.ir_version >= 9
    ops = [n.op_type for n in proto.graph.node]
    assert len(acts) == 9  # per layer: q/k/v input, o_proj input, gate/up input, down input; + the LM head's
    assert ops.count("QuantizeLinear") == 9 and ops.count("DequantizeLinear") == 2 * 15
    assert rep["checks"] == {"checker": "passed", "quantize_linear": 9, "dequantize_linear": 30, "fp8_tensors": 39}
    inits = {t.name: t for t in proto.graph.initializer}
    for t in targets:
        w = inits[t.weight + "_quantized"]
        assert w.data_type == TensorProto.FLOAT8E4M3FN and w.data_location == TensorProto.EXTERNAL
        length = int({e.key: e.value for e in w.external_data}["length"])
        assert length == w.dims[0] * w.dims[1]  # one byte per weight
        zp, sc = inits[t.weight + "_zero_point"], inits[t.weight + "_scale"]
        assert zp.data_type == TensorProto.FLOAT8E4M3FN and list(zp.dims) == [w.dims[1]] == list(sc.dims)
        assert sc.data_type == TensorProto.FLOAT and t.weight not in inits  # no fp32 copy left
    for a in acts:
        zp, sc = inits[f"{a}_act_zero_point"], inits[f"{a}_act_scale"]
        assert zp.data_type == TensorProto.FLOAT8E4M3FN and list(zp.dims) == [] == list(sc.dims)
        assert float(numpy_helper.to_array(zp).astype(np.float32)) == 0.0
    dq_w = [n for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.name.endswith("_weight_dq")]
    assert len(dq_w) == 15 and all(a.name == "axis" and a.i == 1 for n in dq_w for a in n.attribute)
    assert rep["weight_bytes_out"] < 0.5 * rep["weight_bytes_in"]

    # the FP8 weights are bit-exact the numpy/ml_dtypes quantization of the fp32 weights
    full_src = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    full_dst = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(dst)).graph.initializer}
    w_ref = {}
    for t in targets:
        w = full_src[t.weight]
        amax = np.abs(w).max(axis=0)
        scale = np.where(amax > 0, amax / np.float32(448), 1).astype(np.float32)
        q, w_ref[t.weight] = _fake_quant(w, scale)
        np.testing.assert_array_equal(full_dst[t.weight + "_quantized"].view(np.uint8), q.view(np.uint8))
        np.testing.assert_array_equal(full_dst[t.weight + "_scale"], scale)

    # ONNX Runtime CPU runs it; every quantized MatMul (the LM head's output is the logits) equals
    # fake-quant(activation) @ fake-quant(weight) in numpy, on the activation ONNX Runtime computed
    outs = [t.node for t in targets]
    mm_out = {n.name: n.output[0] for n in proto.graph.node if n.name in outs}
    assert mm_out[next(t.node for t in targets if t.module == "lm_head")] == "logits"
    extra = sorted(set(acts) | set(mm_out.values()) - {"logits"})
    for name in extra:
        proto.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    sess = session_over_weights(proto, tmp_path, threads=1)
    names = ["logits"] + extra
    for feed in (feeds[0], feeds[5]):  # a prefill (q=24) and a verify step (q=4) on a cache
        got = dict(zip(names, sess.run(names, feed)))
        for t in targets:
            lo, hi = tab.ranges[t.activation]
            _, a_fq = _fake_quant(got[t.activation], max(abs(lo), abs(hi)) / 448)
            ref = a_fq @ w_ref[t.weight]
            y = got[mm_out[t.node]]
            np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max(), err_msg=t.module)

    # and stays close to the fp32 graph
    from dspark_runtime.backends.ort import OrtDecoder
    from dspark_runtime.runners.kvcache import causal_mask

    x = list(map(int, np.random.default_rng(7).integers(3, 300, 20)))
    logits = {}
    for g in (path, dst):
        dec = OrtDecoder(g, spec, threads=1).activate()
        out = dec.step(np.asarray([x]), np.arange(len(x))[None], causal_mask(len(x), 0), dec.empty_kv(1))
        logits[g] = out.logits[0]
    ref, f8 = logits[path], logits[dst]
    assert 0 < np.abs(f8 - ref).max()  # it is quantized
    assert (f8.argmax(-1) == ref.argmax(-1)).mean() >= 0.8
    assert np.linalg.norm(f8 - ref) / np.linalg.norm(ref) < 0.1


def test_fp8_saturates_guards_zero_columns_and_keeps_activation_matmuls_fp32(tmp_path):
    """A hand-made graph: x @ W (W with an all-zero column; x beyond the calibrated range saturates at ±448),
    the same W read by a MatMul left fp32, and an activation x activation MatMul that is never quantized."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from dspark_export.precision.qdq import quantize_qdq
    from dspark_export.precision.activation_ranges import CalibrationTable
    from dspark_runtime.errors import DSparkError

    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    w[:, 2] = 0.0
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y1"], name="mm_quant"),
             helper.make_node("MatMul", ["x", "W"], ["y2"], name="mm_keep"),
             helper.make_node("Transpose", ["x"], ["xt"], name="tr"),
             helper.make_node("MatMul", ["x", "xt"], ["y3"], name="mm_scores")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [4, 8]),
                           helper.make_tensor_value_info("y2", TensorProto.FLOAT, [4, 8]),
                           helper.make_tensor_value_info("y3", TensorProto.FLOAT, [4, 4])],
                          [numpy_helper.from_array(w, "W")])
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(tmp_path / "s.onnx"),
                    save_as_external_data=True, location="s.onnx.data", size_threshold=0)
    table = CalibrationTable(ranges={"x": [-2.0, 1.5]}, data_id="0" * 64, steps=[], prompts="hand-made")
    rep = quantize_qdq(tmp_path / "s.onnx", tmp_path / "q.onnx", table, "fp8", exclude=["mm_keep"], log=_quiet)
    assert rep["quantized"] == 1 and rep["excluded"] == ["mm_keep"]
    x = (rng.standard_normal((4, 16)) * 2).astype(np.float32)
    x[0, 0], x[1, 1] = 5.0, -7.0  # beyond the calibrated range [-2, 2]: saturate to ±448 * scale = ±2
    y1, y2, y3 = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    amax = np.abs(w).max(axis=0)
    w_scale = np.where(amax > 0, amax / 448, 1).astype(np.float32)
    assert w_scale[2] == 1.0
    _, x_fq = _fake_quant(x, 2.0 / 448)
    assert x_fq[0, 0] == 2.0 and x_fq[1, 1] == -2.0  # saturated, not NaN
    ref = x_fq @ _fake_quant(w, w_scale)[1]
    np.testing.assert_allclose(y1, ref, rtol=1e-5, atol=1e-5)
    assert np.all(y1[:, 2] == 0)
    np.testing.assert_allclose(y2, x @ w, rtol=1e-5, atol=1e-5)  # the excluded MatMul reads the fp32 weight
    np.testing.assert_allclose(y3, x @ x.T, rtol=1e-5, atol=1e-5)  # activation x activation: untouched
    with pytest.raises(DSparkError, match="reduce_range.*int8 only"):
        quantize_qdq(tmp_path / "s.onnx", tmp_path / "r.onnx", table, "fp8", reduce_range=True, log=_quiet)


def test_auto_picks_stream_without_modelopt_or_memory_and_rejects_unknown_writers(tiny_graph, monkeypatch, tmp_path):
    from dspark_export.precision import fp8
    from dspark_export.precision.quantizers import quantize_graph
    from dspark_export.graphs.onnx_io import graph_weight_bytes
    from dspark_runtime.errors import DSparkError

    path = tiny_graph[0]
    logged = []
    monkeypatch.setattr(fp8, "modelopt_python", lambda: None)
    assert fp8.choose_fp8_writer(path, "auto", log=logged.append) == ("stream", "NVIDIA ModelOpt is not installed")
    assert logged == ["  fp8 writer: stream (NVIDIA ModelOpt is not installed)"]
    monkeypatch.setattr(fp8, "modelopt_python", lambda: tmp_path / "python")
    need = 8 * graph_weight_bytes(path)
    ext = (path.parent / "g.onnx.data").stat().st_size  # external weights, plus a few small inline tensors
    assert ext <= graph_weight_bytes(path) < 1.01 * ext
    monkeypatch.setattr(fp8, "available_memory_bytes", lambda: need - 1)
    writer, why = fp8.choose_fp8_writer(path, "auto", log=_quiet)
    assert writer == "stream" and "more than" in why and "8x the fp32 weights" in why
    monkeypatch.setattr(fp8, "available_memory_bytes", lambda: None)
    assert fp8.choose_fp8_writer(path, "auto", log=_quiet)[0] == "stream"
    monkeypatch.setattr(fp8, "available_memory_bytes", lambda: need)
    writer, why = fp8.choose_fp8_writer(path, "auto", log=_quiet)
    assert writer == "modelopt" and "fits" in why
    assert fp8.choose_fp8_writer(path, "stream", log=_quiet)[0] == "stream"  # explicit choices are kept
    monkeypatch.setattr(fp8, "available_memory_bytes", lambda: 0)
    assert fp8.choose_fp8_writer(path, "modelopt", log=_quiet)[0] == "modelopt"
    for bad in ("ModelOpt", "streaming", ""):
        with pytest.raises(DSparkError, match=r"fp8 writer .* is unknown; choose one of auto, modelopt, stream"):
            quantize_graph(path, tmp_path / "x.onnx", "fp8", fp8_writer=bad, log=_quiet)
    assert not (tmp_path / "x.onnx").exists()


def test_available_memory_is_read():
    from dspark_export.precision.fp8 import available_memory_bytes

    m = available_memory_bytes()
    assert m is None or m > 2**20


def test_streamed_fp8_engine_records_the_writer_and_is_refused_on_cpu_unless_asked(tiny_engine_dir, tmp_path,
                                                                                    monkeypatch):
    """`dspark-export quantize --precision fp8` with ModelOpt unavailable: auto -> the streaming writer."""
    import json

    from click.testing import CliRunner

    from dspark_export.precision import fp8
    from dspark_export.cli import cli
    from dspark_runtime.engine_dir.manifest import load_manifest

    monkeypatch.setattr(fp8, "modelopt_python", lambda: None)
    r = CliRunner().invoke(cli, ["quantize", str(tiny_engine_dir), "-o", str(tmp_path / "f8"), "--precision",
                                 "target=fp8,draft=fp8", "--calibration-prompts", "2"])
    assert r.exit_code == 0, r.output
    assert "fp8 writer: stream (NVIDIA ModelOpt is not installed)" in r.output
    m = load_manifest(tmp_path / "f8")
    for role in ("target", "draft"):
        g = m.graphs[role]
        q = g.quantization
        assert g.precision == "fp8" and q["writer"] == "stream" and q["quantized"] == 15  # fp8: nothing excluded
        assert q["opset"]["to"] == 19 and q["checks"]["fp8_tensors"] == 39
        assert len(q["calibration"]["data_id"]) == 64 and "calibration split" in q["calibration"]["prompts"]
        v = g.validation["fp8"]
        assert 0.0 < v["prefill"]["rel_l2"] < 0.1 and v["prefill"]["top1_agreement"] >= 0.8
    saved = json.loads((tmp_path / "f8" / "manifest.json").read_text())
    assert saved["graphs"]["draft"]["quantization"]["writer"] == "stream"
    _refused_on_cpu_then_lossless(tmp_path / "f8")
    # explicit writer on the CLI; an unknown one is refused by the option
    r = CliRunner().invoke(cli, ["quantize", str(tiny_engine_dir), "-o", str(tmp_path / "bad"), "--precision", "fp8",
                                 "--fp8-writer", "fast"])
    assert r.exit_code == 2 and "'fast' is not one of 'auto', 'modelopt', 'stream'" in r.output
    assert not (tmp_path / "bad").exists()


def test_build_with_fp8_stream_writer(tiny_pair, tmp_path):
    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_runtime.errors import DSparkError

    tdir, ddir = tiny_pair
    with pytest.raises(DSparkError, match="fp8 writer 'quick' is unknown"):
        build_engine(Recipe(name="x", target=str(tdir), precision="fp8"), tmp_path / "x", isolate=False,
                     log=_quiet, fp8_writer="quick")
    assert not (tmp_path / "x").exists()  # refused before any work
    m = build_engine(Recipe(name="f8", target=str(tdir), draft=str(ddir), precision="draft=fp8",
                            calibration_prompts=2, draft_length=3), tmp_path / "f8", isolate=False, log=_quiet,
                     fp8_writer="stream")
    q = m.graphs["draft"].quantization
    assert m.graphs["draft"].precision == "fp8" and q["writer"] == "stream" and q["quantized"] == 15
    assert m.graphs["target"].precision == "fp32" and set(m.graphs["draft"].validation) == {"fp32", "fp8"}
