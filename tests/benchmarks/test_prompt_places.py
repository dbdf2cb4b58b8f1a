"""benchmarks.prompt_places: prompt-chunk time and prompt-position fidelity per prompt place on a real (tiny) int4
engine with a prompt graph; OpenVINO timed where the machine offers it, else reported as skipped with why."""
import json
import subprocess
import sys


def test_prompt_places_times_each_place_and_compares_its_logits(int4_engine, tmp_path):
    from benchmarks.evalsets import ROOT, child_env

    out = tmp_path / "pp.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.prompt_places", "--engine", str(int4_engine), "--q", "8,24",
                        "--repeats", "1", "--fidelity", "2", "--threads", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=str(ROOT), env=child_env())
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    places = set(rep["chunk_ms"])
    assert {"target", "prompt-graph"} <= places and places | set(rep["skipped"]) == {"target", "prompt-graph",
                                                                                      "openvino"}
    assert all(v > 0 for d in rep["chunk_ms"].values() for v in d.values()) and set(rep["chunk_ms"]["target"]) == \
        {"8", "24"}
    pg = rep["fidelity"]["prompt-graph"]
    assert len(pg) == 2 and all(0 < f["rel_l2"] < 1 and 0 <= f["top1"] <= 1 for f in pg)  # other numerics, close
