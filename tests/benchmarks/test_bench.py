"""benchmarks.bench: drafters of a second engine of the same target (--engine-as) run beside --engine's, against one
target-only run, and every output is checked against it."""
import json

import pytest

from benchmarks import bench as bench_module


@pytest.fixture(scope="module")
def bench():
    return bench_module


def test_engine_as_runs_another_engines_drafter_beside_this_one(bench, tiny_dspark, tiny_engine_with_dspark, tmp_path):
    out = tmp_path / "b.json"
    rc = bench.main(["--engine", str(tiny_dspark[0]), "--engine-as", f"old={tiny_engine_with_dspark}",
                     "--draft", "dspark:3,old/dspark:3", "--humaneval", "2", "--mt-bench", "0",
                     "--max-new-tokens", "12", "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    s = rep["summary"]
    assert s["engines_as"] == {"old": str(tiny_engine_with_dspark)}
    assert set(s["drafters"]) == {"dspark:3", "old/dspark:3"}
    for d in s["drafters"].values():
        assert d["n"] == 2 and d["identical"] == 2  # both drafters reproduce the one target-only output
    rows = {(r["prompt_index"], r["drafter"]): r for r in rep["rows"]}
    # the trained drafter and the untrained one are different drafters: their rounds differ somewhere
    assert any(rows[(i, "dspark:3")]["accepted"] != rows[(i, "old/dspark:3")]["accepted"]
               or rows[(i, "dspark:3")]["rounds"] != rows[(i, "old/dspark:3")]["rounds"] for i in (0, 1))


@pytest.mark.parametrize("args, message", [
    (["--engine-as", "old"], "give NAME=DIR"),
    (["--draft", "new/dspark:3"], "not given with --engine-as"),
    (["--prompts", "other=target"], "--prompts names engine(s) ['other']"),
])
def test_engine_as_refusals_name_the_fix(bench, tiny_dspark, tmp_path, capsys, args, message):
    rc = bench.main(["--engine", str(tiny_dspark[0]), "--humaneval", "1", "--mt-bench", "0", "--max-new-tokens", "4",
                     "--out", str(tmp_path / "b.json"), "--draft", "dspark:3", *args])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_none_runs_another_engines_target_only_as_a_before_after(bench, tiny_dspark, tiny_engine_with_dspark,
                                                                 tmp_path):
    out = tmp_path / "ab.json"
    rc = bench.main(["--engine", str(tiny_dspark[0]), "--engine-as", f"old={tiny_engine_with_dspark}",
                     "--draft", "old/none", "--humaneval", "2", "--mt-bench", "0", "--max-new-tokens", "12",
                     "--out", str(out)])
    assert rc == 0
    rep = json.loads(out.read_text())
    d = rep["summary"]["drafters"]["old/none"]
    assert d["n"] == 2 and d["identical"] == 2  # the same target graph: the same output
    for r in rep["rows"]:
        assert r["proposed"] == 0 and r["accepted"] == 0 and r["speculative_tps"] > 0  # nothing drafted


def test_prompts_sets_each_engines_prompt_place_and_long_reads_the_long_prompts(bench, int4_engine, tmp_path):
    """--prompts PLACE / NAME=PLACE reach Engine.load and the summary; --long runs the long-prompt set (a prompt of
    the tiny engine's 512 positions at most would not hold them: one prompt, cut by the engine's context limit, is
    enough to see the set read); the prompt graph's target-only output is reported against the target's."""
    from benchmarks.evalsets import load_prompts

    long = load_prompts("long", 4)
    assert len(long) == 4 and all(p.startswith("Review the following Python module") for p in long)
    out = tmp_path / "p.json"
    rc = bench.main(["--engine", str(int4_engine), "--prompts", "target", "--engine-as", f"pg={int4_engine}",
                     "--prompts", "pg=prompt-graph", "--draft", "pg/none", "--humaneval", "2", "--mt-bench", "0",
                     "--max-new-tokens", "8", "--out", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert s["prompt_places"] == {"": "target", "pg": "prompt-graph"}
    assert s["ttft_ms_target_only_median"] > 0 and s["drafters"]["pg/none"]["ttft_ms_median"] > 0
