"""The runtime refuses GPU-only precisions (fp8, fp16) on ONNX Runtime's CPU provider unless asked."""
import json
import shutil

import pytest


def _relabel(src, dst, role, precision):
    shutil.copytree(src, dst)
    mp = dst / "manifest.json"
    m = json.loads(mp.read_text())
    m["graphs"][role]["precision"] = precision
    mp.write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("precision,why", [("fp8", "6-10x slower than the fp32 graph"),
                                           ("fp16", "few fp16 kernels")])
def test_gpu_precision_is_refused_on_the_cpu_provider(tiny_engine_dir, tmp_path, precision, why):
    from dspark_runtime import Engine
    from dspark_runtime.errors import DSparkError

    eng_dir = _relabel(tiny_engine_dir, tmp_path / "e", "target", precision)
    eng = Engine.load(eng_dir, threads=1)  # loading is cheap; the refusal comes on activation
    with pytest.raises(DSparkError) as e:
        eng.generate("def add(a, b):", max_new_tokens=4, draft=None)
    msg = str(e.value)
    assert f"graph target.onnx is {precision}" in msg and why in msg and "allow_slow_precision=True" in msg
    ok = Engine.load(eng_dir, threads=1, allow_slow_precision=True)
    ref = Engine.load(tiny_engine_dir, threads=1)
    assert ok.generate("def add(a, b):", max_new_tokens=6, draft=None).token_ids == \
        ref.generate("def add(a, b):", max_new_tokens=6, draft=None).token_ids


def test_refusal_covers_the_draft_graph_and_the_cli(tiny_engine_dir, tmp_path):
    from dspark_runtime import Engine
    from dspark_runtime.cli import cli
    from dspark_runtime.errors import DSparkError
    from click.testing import CliRunner

    eng_dir = _relabel(tiny_engine_dir, tmp_path / "e", "draft", "fp8")
    eng = Engine.load(eng_dir, threads=1)
    eng.generate("x = 1", max_new_tokens=3, draft=None)  # the fp32 target alone runs
    with pytest.raises(DSparkError, match="graph draft.onnx is fp8"):
        eng.generate("x = 1", max_new_tokens=3, draft="lm")
    r = CliRunner().invoke(cli, ["generate", "--engine", str(eng_dir), "--prompt", "x = 1", "--max-new-tokens", "3",
                                 "--draft", "lm", "--threads", "1", "--no-stream"])
    assert r.exit_code != 0 and "graph draft.onnx is fp8" in str(r.exception)
    r = CliRunner().invoke(cli, ["generate", "--engine", str(eng_dir), "--prompt", "x = 1", "--max-new-tokens", "3",
                                 "--draft", "lm", "--threads", "1", "--no-stream", "--allow-slow-precision"])
    assert r.exit_code == 0, r.output


def test_gpu_provider_first_is_not_refused():
    from dspark_runtime.backends.ort import check_precision_for_providers

    check_precision_for_providers("fp8", ["TensorrtExecutionProvider", "CPUExecutionProvider"])
    check_precision_for_providers("int8", ["CPUExecutionProvider"])
    check_precision_for_providers("fp32", None)
