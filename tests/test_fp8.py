"""FP8 (E4M3) QDQ graphs via NVIDIA ModelOpt in its own environment (skipped when it is not installed)."""
import onnx
import pytest

pytest.importorskip("torch")
from dspark_export.fp8 import SETUP_HINT, modelopt_python  # noqa: E402

needs_modelopt = pytest.mark.skipif(modelopt_python() is None,
                                    reason=f"NVIDIA ModelOpt environment not found; create it with: {SETUP_HINT}")


@needs_modelopt
def test_fp8_engine_passes_checks_and_is_refused_on_cpu_unless_asked(tiny_engine_dir, tmp_path, monkeypatch):
    import numpy as np

    from dspark_export.quantize import quantize_engine
    from dspark_runtime import Engine
    from dspark_runtime.errors import DSparkError

    import os

    # a second hard link to the source's weights, as `dspark-export quantize` makes between engines (onnx refuses
    # to load external data with several links; ModelOpt must get a private copy)
    os.link(tiny_engine_dir / "target.onnx.data", tmp_path / "shared-weights.data")
    monkeypatch.chdir(tmp_path)  # a relative output directory, as `-o engines/x` gives (the worker runs elsewhere)
    m = quantize_engine(tiny_engine_dir, "f8", "target=fp8,draft=fp8", calibration_prompts=2, log=lambda *a: None)
    for role in ("target", "draft"):
        g = m.graphs[role]
        q = g.quantization
        assert g.precision == "fp8" and q["quantized"] == 15 and q["lm_head_quantized"]
        assert q["checks"]["checker"] == "passed" and q["checks"]["fp8_tensors"] >= 15
        assert any("Opset: 19" in line for line in q["checks"]["polygraphy"])
        assert len(q["calibration"]["data_id"]) == 64 and "calibration split" in q["calibration"]["prompts"]
        v = g.validation["fp8"]
        assert 0.0 < v["prefill"]["rel_l2"] < 0.3 and v["prefill"]["top1_agreement"] >= 0.8
    proto = onnx.load(str(tmp_path / "f8" / "target.onnx"), load_external_data=False)
    fp8_zp = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN]
    assert fp8_zp and {e.value for t in proto.graph.initializer for e in t.external_data
                       if e.key == "location"} <= {"target.onnx.data"}
    eng = Engine.load(tmp_path / "f8", threads=1)
    with pytest.raises(DSparkError, match="fp8.*compute capability >= 8.9.*6-10x slower"):
        eng.generate("def add(a, b):", max_new_tokens=4, draft=None)
    eng = Engine.load(tmp_path / "f8", threads=1, allow_slow_precision=True)
    ref = eng.generate("def add(a, b):", max_new_tokens=16, draft=None)
    spec = eng.generate("def add(a, b):", max_new_tokens=16, draft="lm", draft_length=3)
    assert spec.token_ids == ref.token_ids  # lossless relative to the fp8 target
    assert np.isfinite(spec.stats.accepted_length_mean)


def test_fp8_without_modelopt_names_the_setup(tiny_engine_dir, tmp_path, monkeypatch):
    from dspark_export.quantize import quantize_engine
    from dspark_runtime.errors import DSparkError

    monkeypatch.setenv("DSPARK_MODELOPT_PYTHON", str(tmp_path / "nowhere" / "python"))
    with pytest.raises(DSparkError, match="nvidia-modelopt"):
        quantize_engine(tiny_engine_dir, tmp_path / "f8", "draft=fp8", calibration_prompts=1, log=lambda *a: None)
