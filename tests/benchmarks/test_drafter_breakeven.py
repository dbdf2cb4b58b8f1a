"""benchmarks/drafter_breakeven.py: the acceptance a drafter needs for a speedup, priced by a cost table."""
import json

import numpy as np
import pytest

from benchmarks.drafter_breakeven import main, needed_alpha, speedup, tau_fixed


def table(t_verify, t_draft):
    """A manifest cost table (one context) with t_verify[B - 1] for B = 1..len."""
    tokens = list(range(1, len(t_verify) + 1))
    return {"tokens": tokens, "t_verify": list(t_verify), "t_draft": t_draft,
            "seconds": [t_draft + t for t in t_verify]}


def test_a_flat_verify_cost_pays_the_whole_block():
    """Verifying 8 tokens costs what 1 does and drafting is free: the speedup is the expected accepted length."""
    t = table([0.03] * 8, 1e-9)
    l, x = speedup(t, 1e-9, 0.5 ** np.arange(1, 8), context=0)
    assert l == 7 and x == pytest.approx(1 + sum(0.5 ** j for j in range(1, 8)), rel=1e-6)
    # 1.6x needs sum_j alpha^j = 0.6 over 7 positions: alpha ~ 0.376
    alpha = needed_alpha(t, 1e-9, 1.6, context=0)
    assert sum(alpha ** j for j in range(1, 8)) == pytest.approx(0.6, abs=1e-3)


def test_a_compute_bound_verifier_never_pays():
    """Verifying B tokens costs B passes: even alpha = 1 only breaks even, so any gain is unreachable."""
    t = table([0.03 * b for b in range(1, 9)], 0.002)
    assert needed_alpha(t, 0.002, 1.01, context=0) is None
    assert speedup(t, 0.002, np.ones(7), context=0)[1] < 1.0


def test_a_dearer_drafting_pass_needs_more_acceptance():
    t = table([0.033, 0.043, 0.057, 0.072, 0.083, 0.096, 0.107, 0.120], 0.006)
    cheap, dear = (needed_alpha(t, td, 1.3, context=0) for td in (0.006, 0.012))
    assert 0 < cheap < dear < 1
    assert tau_fixed(1.0) == 8.0 and tau_fixed(0.0) == 1.0


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
