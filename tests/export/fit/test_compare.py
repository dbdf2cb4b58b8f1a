"""dspark-export compare: agreement of a quantized engine with its fp32 reference (tiny engines)."""
import json

import pytest

pytest.importorskip("torch")


def test_prefix_agreement_counts_the_identical_prefix_and_positions():
    from dspark_export.fit.compare import prefix_agreement

    assert prefix_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, 1.0)
    assert prefix_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == (0.25, 0.75)
    assert prefix_agreement([1, 2, 3, 4], [1, 2]) == (0.5, 0.5)


def test_teacher_forced_logits_match_step_by_step_decoding(tiny_engine_dir):
    import numpy as np

    from dspark_export.fit.compare import teacher_forced_logits
    from dspark_runtime import Engine

    eng = Engine.load(tiny_engine_dir, threads=1)
    r = eng.runner("target")
    prompt = eng.encode_prompt("def add(a, b):")
    out = eng.generate("def add(a, b):", max_new_tokens=12, draft=None).token_ids
    lg = teacher_forced_logits(r, prompt, out, chunk=5)  # chunk boundaries inside prompt and continuation
    assert lg.shape == (len(out), r.backend.spec.dims.vocab_size)
    assert list(lg.argmax(-1)) == out  # greedy tokens are the argmax of their own teacher-forced logits
    r.reset()
    last = r.prefill(prompt)
    np.testing.assert_allclose(lg[0], last, atol=1e-4)


def test_compare_fp32_with_itself_and_with_int8(tiny_engine_dir, tmp_path):
    from click.testing import CliRunner

    from dspark_export.fit.compare import compare_engines, format_report
    from dspark_export.cli import cli
    from dspark_export.precision.quantize import quantize_engine

    counts = {"humaneval": 1, "mbpp": 1}
    same = compare_engines(tiny_engine_dir, tiny_engine_dir, counts=counts, max_new_tokens=16, draft="lm",
                           log=lambda *a: None)
    s = same["summary"]
    assert s["top1_agreement"] == 1.0 and s["rel_l2"] < 1e-5 and s["greedy_prefix_agreement"] == 1.0
    assert s["identical_greedy_outputs"] == 2 and s["ref_tau"] == s["cand_tau"] > 1.0
    assert [p["dataset"] for p in same["prompts"]] == ["humaneval", "mbpp"]
    assert same["prompts"][1]["line"] == 201  # the evaluation split of mbpp starts at line 201

    quantize_engine(tiny_engine_dir, tmp_path / "q", "target=int8,draft=int8", calibration_prompts=2,
                    log=lambda *a: None)
    r = CliRunner().invoke(cli, ["compare", str(tiny_engine_dir), str(tmp_path / "q"), "--humaneval", "1",
                                 "--mbpp", "1", "--gsm8k", "0", "--mt-bench", "0", "--max-new-tokens", "16",
                                 "--json", str(tmp_path / "c.json")])
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "c.json").read_text())
    s = rep["summary"]
    assert rep["candidate"]["precision"] == {"target": "int8", "draft": "int8"}
    assert 0.0 < s["rel_l2"] < 0.5 and 0.5 <= s["top1_agreement"] <= 1.0
    assert s["ref_lossless"] == s["cand_lossless"] == 2  # speculative == own target-only in both engines
    assert "greedy token agreement" in r.output and format_report(rep).splitlines()[0].startswith("reference")


def test_compare_refuses_engines_of_different_models(tiny_engine_dir, tmp_path):
    import shutil

    from dspark_export.fit.compare import compare_engines
    from dspark_runtime.errors import DSparkError
    from tests.fixtures.tiny_models import make_tokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_engine_dir, other)
    make_tokenizer(tmp_path / "tok", vocab_size=300)
    shutil.copy(tmp_path / "tok" / "tokenizer.json", other / "tokenizer" / "tokenizer.json")
    with pytest.raises(DSparkError, match="tokenize differently"):
        compare_engines(tiny_engine_dir, other, counts={"humaneval": 1}, max_new_tokens=4, log=lambda *a: None)
