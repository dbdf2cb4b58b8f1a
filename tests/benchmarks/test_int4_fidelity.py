"""benchmarks.int4_fidelity: an engine's other graph (DIR::GRAPH, e.g. the prompt graph) is run as a prompt is, and
--reuse runs only the graphs whose logits are not in --work yet (the tiny int4 engine with its prompt graph)."""
import json

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from benchmarks.int4_fidelity import engine_graph, main  # noqa: E402


def test_engine_graph_names_the_graph_and_where_its_logits_go(tmp_path):
    assert engine_graph(str(tmp_path / "e")) == (tmp_path / "e", "target", "e")
    assert engine_graph(f"{tmp_path / 'e'}::target_prompt") == (tmp_path / "e", "target_prompt", "e::target_prompt")


def test_the_prompt_graphs_logits_beside_the_targets_and_reuse_runs_only_what_is_missing(int4_engine, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    seqs = {"a": [3, 17, 42, 5, 9, 11, 60, 2], "b": [7, 7, 1, 30, 8]}
    (work / "ids.json").write_text(json.dumps(seqs))
    out = tmp_path / "f.json"
    args = ["--engines", f"{int4_engine},{int4_engine}::target_prompt", "--work", str(work), "--reuse",
            "--threads", "1", "--json", str(out)]
    assert main(args) == 0
    target, prompt = work / int4_engine.name, work / f"{int4_engine.name}::target_prompt"
    for name, ids in seqs.items():
        t, p = np.load(target / f"{name}.npy"), np.load(prompt / f"{name}.npy")
        assert t.shape == p.shape and t.shape[-2] == len(ids)  # every position's logits
        assert not np.array_equal(t, p)  # other kernels, other numerics ...
        assert np.linalg.norm(p - t) / np.linalg.norm(t) < 0.5  # ... of the same model
    res = json.loads(out.read_text())
    assert set(res["systems"]) == {int4_engine.name, f"{int4_engine.name}::target_prompt"}
    assert set(res["step_weight_bytes"]) == set(res["systems"])
    stamp = (target / "a.npy").stat().st_mtime_ns
    assert main(args) == 0  # everything already there: nothing runs again
    assert (target / "a.npy").stat().st_mtime_ns == stamp
