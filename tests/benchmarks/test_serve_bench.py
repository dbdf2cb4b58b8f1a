"""benchmarks.serve_bench --round-trace: the decoding loop's per-round records of the concurrent phase, summarised by
kind (benchmarks/evalsets.py round_kinds), on the tiny engine served in-process; and the summary itself on known rounds."""
import json

import pytest

from benchmarks import evalsets as evalsets_module
from benchmarks import serve_bench
from dspark_runtime.decoding.stats import RoundRecord


@pytest.fixture(scope="module")
def evalsets():
    return evalsets_module


def _rec(rows, drafted=False, probe=False, prefilling=0, wall=0.1, committed=1, expected=(None, None), draft=0.0):
    return RoundRecord(rows=rows, prefilling=prefilling, prompt_tokens=8 * prefilling, verify_tokens=rows,
                       pass_tokens=rows, drafted=drafted, probe=probe, wall_s=wall, committed=committed,
                       draft_s=draft, expected_drafted=expected[0], expected_undrafted=expected[1])


def test_round_kinds_groups_and_sums(evalsets):
    k = evalsets.round_kinds([_rec(0, prefilling=1, wall=0.2, committed=0),
                              _rec(2, drafted=True, committed=5, draft=0.04),
                              _rec(2, drafted=True, probe=True, committed=3, wall=0.3),
                              _rec(4, prefilling=2, wall=0.2, committed=4), _rec(4, wall=0.2, committed=4)])
    assert list(k) == ["drafted", "prefill-only", "probe", "undrafted", "undrafted+prefill"]
    assert k["drafted"]["committed"] == 5 and k["probe"]["ms_per_round"] == pytest.approx(300)
    assert k["drafted"]["draft_ms_per_round"] == pytest.approx(40) and k["undrafted"]["draft_ms_per_round"] == 0
    assert k["undrafted+prefill"]["prompt_tokens"] == 16 and k["undrafted"]["tokens_per_second"] == pytest.approx(20)
    assert sum(x["share_of_wall"] for x in k.values()) == pytest.approx(1.0)
    assert k["prefill-only"]["share_of_wall"] == pytest.approx(0.2 / 1.0)
    assert k["drafted"]["expected_drafted_tps"] is None
    k = evalsets.round_kinds([_rec(4, expected=(10.0, 20.0)), _rec(4, expected=(14.0, 18.0)), _rec(4)])
    assert k["undrafted"]["expected_drafted_tps"] == pytest.approx(12.0)  # the two rounds that weighed them
    assert k["undrafted"]["expected_undrafted_tps"] == pytest.approx(19.0)
    assert evalsets.round_kinds([]) == {}


def test_serve_bench_round_trace_on_the_tiny_engine(tiny_engine_with_dspark, tmp_path, capsys):
    sb = serve_bench
    out = tmp_path / "serve.json"
    rc = sb.main(["--engine", str(tiny_engine_with_dspark), "--configs", "dspark,none", "--humaneval", "2",
                  "--mt-bench", "1", "--max-tokens", "6", "--clients", "3", "--max-batch", "3", "--round-trace",
                  "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0 and r["identical_across_configs"]
    for run in r["runs"]:
        kinds = run["round_kinds"]
        assert kinds and set(kinds) <= {"drafted", "probe", "undrafted", "prefill-only", "drafted+prefill",
                                        "probe+prefill", "undrafted+prefill"}
        # every completion token of the concurrent phase was committed by one of its rounds, but each request's
        # first, which its prompt's last chunk gives
        conc = run["concurrent"]
        assert sum(k["committed"] for k in kinds.values()) + conc["requests"] >= conc["tokens"] > 0
        drafted = sum(v["rounds"] for kind, v in kinds.items() if not kind.startswith(("undrafted", "prefill")))
        assert (drafted > 0) == (run["config"] == "dspark")
        # the drafting pass's time is inside the rounds that ran it, and only there
        assert all((0 < v["draft_ms_per_round"] < v["ms_per_round"]) == (not kind.startswith(("undrafted", "prefill")))
                   for kind, v in kinds.items())
        # the raw records beside it, one column per RoundRecord field: the concurrent ones are what round_kinds
        # summarised; the skip rule's ratio is recorded exactly where it weighed the round
        raw = json.loads((tmp_path / "serve.rounds.json").read_text())[run["config"]]
        cols = raw["concurrent"]
        assert len(cols["wall_s"]) == sum(v["rounds"] for v in kinds.values())
        assert sum(cols["committed"]) == sum(v["committed"] for v in kinds.values())
        assert sum(cols["drafted"]) == drafted and len(raw["solo"]["rows"]) > 0
        assert [x is None for x in cols["ratio"]] == [x is None for x in cols["expected_drafted"]]
        if run["config"] == "none":
            assert all(x is None for x in cols["ratio"])
    assert "rounds of the concurrent phase by kind" in capsys.readouterr().out
