"""benchmarks.head_screen: the LM head's exact rows and input are read from an int4 engine, the hidden-state copy of
the graph reproduces the engine's logits through those rows, and each screen form is scored (the tiny int4 engine:
a 4-bit RTN head, read whole)."""
import json

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from benchmarks.head_screen import exact_head, hidden_engine, main  # noqa: E402
from benchmarks.int4_fidelity import graph_logits  # noqa: E402
from dspark_runtime.engine_dir.manifest import load_manifest  # noqa: E402


def test_hidden_states_times_the_exact_rows_are_the_engines_logits(int4_engine, tmp_path):
    graph = int4_engine / load_manifest(int4_engine, verify=False).graphs["target"].model_file
    hidden, w = exact_head(graph)
    vocab, k = w.shape
    seqs = {"a": [3, 17, 42, 5, 9, 11], "b": [7, 7, 1, 30]}
    graph_logits(int4_engine, seqs, tmp_path / "logits", 1)
    (tmp_path / "copy").mkdir()
    eng = hidden_engine(int4_engine, hidden, k, tmp_path / "copy")
    graph_logits(eng, seqs, tmp_path / "hidden", 1)
    for name in seqs:
        h = np.load(tmp_path / "hidden" / f"{name}.npy").reshape(-1, k)
        ref = np.load(tmp_path / "logits" / f"{name}.npy").reshape(-1, vocab)
        got = h @ w.T  # fp32 activations; the kernel quantizes them to int8 per block
        assert h.shape[0] == len(seqs[name])
        assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8
    assert (int4_engine / "target.onnx").stat().st_size != (eng / "target.onnx").stat().st_size  # a copy was changed


def test_screens_are_scored_on_the_engines_own_sequences(int4_engine, tmp_path):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps({"a": [3, 17, 42, 5, 9, 11, 60, 2], "b": [7, 7, 1, 30, 8]}))
    out = tmp_path / "screen.json"
    assert main(["--engine", str(int4_engine), "--ids", str(ids), "--screens", "4:32,2:32", "--candidates", "1,8,512",
                 "--tv-stride", "1", "--rows", "1,2", "--repeats", "2", "--threads", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["positions"] == 13 == res["tv_positions"]
    four, two = res["screens"]["4:32"], res["screens"]["2:32"]
    assert two["bytes"] < four["bytes"] and four["rel_l2"] < two["rel_l2"] < 1
    for s in (four, two):
        within = [s["top1_within"][c] for c in ("1", "8", "512")]
        assert within == sorted(within) and within[-1] == 1.0  # more candidates never miss more
        tv = [s["total_variation"][c] for c in ("1", "8", "512")]
        assert tv[0] > 1e-4 and tv[2] < 1e-6  # every token rescored (512 > the vocabulary): the exact distribution
        assert set(s["kernel_ms"]) == {"1", "2"} and all(v > 0 for v in s["kernel_ms"].values())
