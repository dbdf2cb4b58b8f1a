"""benchmarks/drafter_breakeven.py: the acceptance a drafter needs for a speedup, priced by a cost table."""
import json

import pytest

from benchmarks.drafter_breakeven import main


def test_main_reads_the_engine_and_step_profile(tiny_dspark, tmp_path, capsys):
    """End to end on a profiled tiny engine: a --role dspark step_profile JSON of two graphs, the second dearer."""
    import shutil

    from dspark_export.fit.cost_profile import profile_engine

    eng = tmp_path / "eng"
    shutil.copytree(tiny_dspark[0], eng)
    profile_engine(eng, max_tokens=5, context=32, repeats=2, threads=1)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"role": "dspark", "engines": ["a", "b"], "machine": "m",
                                 "rows": [{"past": 32, "q": 1, "ms": [0.5, 50.0]}]}))
    out = tmp_path / "out.json"
    assert main(["--engine", str(eng), "--draft-costs", str(costs), "--context", "32", "--speedups", "1.0",
                 "--survival", "0.9,0.8,0.7,0.6", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    a, b = res["graphs"]
    assert b["round_draft_ms"] - a["round_draft_ms"] == pytest.approx(49.5, abs=0.02)
    assert [g["engine"] for g in res["graphs"]] == ["a", "b"] and "at_survival" in a
    assert a["at_survival"]["speedup"] >= b["at_survival"]["speedup"]
    with pytest.raises(SystemExit, match="no --role dspark row at past 64"):
        main(["--engine", str(eng), "--draft-costs", str(costs), "--context", "64"])
