"""benchmarks.feature_paths: the engine graph's teacher-forced features and logits against the same model's Hugging
Face weights in torch — fp32 agrees with the tiny fp32 engine to float rounding, bf16 is measurably further off."""
import gzip
import json

import numpy as np
import pytest

pytest.importorskip("torch")

from benchmarks.feature_paths import load_sequences, main  # noqa: E402


def test_torch_fp32_features_match_the_fp32_engine_and_bf16_is_further(tiny_engine_dir, tiny_pair, tmp_path):
    rng = np.random.default_rng(0)
    answers = tmp_path / "answers.jsonl.gz"
    with gzip.open(answers, "wt") as f:
        for n in (40, 12, 30, 25):  # the 12-token one is below --min-len
            f.write(json.dumps({"key": f"k{n}", "ids": [int(t) for t in rng.integers(3, 300, n)]}) + "\n")
    assert [len(s) for s in load_sequences(answers, 5, 20, 40)] == [40, 30, 25]
    out = tmp_path / "paths.json"
    assert main(["--engine", str(tiny_engine_dir), "--target", str(tiny_pair[0]), "--answers", str(answers),
                 "--n", "2", "--min-len", "20", "--max-len", "40", "--layers=-1,0", "--draft-vocab", "256",
                 "--dtypes", "float32,bfloat16", "--threads", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["tokens"] == 70 and got["sequences"] == 2
    engine, fp32, bf16 = got["rows"]
    assert engine["tokens_per_s"] > 0 and "features_rel_l2" not in engine
    assert fp32["features_rel_l2"] < 1e-3 and fp32["top1_agreement"] >= 0.95  # the engine's features: fp16 shards
    assert bf16["features_rel_l2"] > 10 * fp32["features_rel_l2"]


def test_no_sequence_of_the_asked_lengths_is_refused(tiny_engine_dir, tiny_pair, tmp_path, capsys):
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"ids": [5, 6, 7]}) + "\n")
    assert main(["--engine", str(tiny_engine_dir), "--target", str(tiny_pair[0]), "--answers", str(answers)]) == 2
    assert "no answer of 300..700 tokens" in capsys.readouterr().err
