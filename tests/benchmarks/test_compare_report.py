"""benchmarks.compare: the pure parts (divergence, interleaving, speculation counters, aggregation,
markdown) on hand-made rows; no model, no subprocess."""
import pytest

from benchmarks import evalsets
from benchmarks.compare import report, resume, run, systems, workers


def test_first_divergence():
    assert report.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert report.first_divergence([], []) is None
    assert report.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert report.first_divergence([5], [6]) == 0
    assert report.first_divergence([1, 2], [1, 2, 3]) == 2  # proper prefix: the shorter length
    assert report.first_divergence([1, 2, 3], [1, 2]) == 2
    assert report.first_divergence((1, 2), [1, 2]) is None  # tuples and lists compare by value


def test_interleave_and_rotate():
    jobs = run.interleave({"a": ["a0", "a1", "a2"], "b": ["b0"], "c": ["c0", "c1"]})
    assert [t for _, _, t in jobs] == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert jobs[3] == ("a", 1, "a1")
    assert resume.rotate(["x", "y", "z"], 0) == ["x", "y", "z"]
    assert resume.rotate(["x", "y", "z"], 1) == ["y", "z", "x"]
    assert resume.rotate(["x", "y", "z"], 4) == ["y", "z", "x"]
    assert resume.rotate([], 3) == []


def test_position_counts_from_dspark():
    # rounds with verify lengths 3,3,1 (histogram); per-position acceptance fractions of those rounds
    tries, hits = workers.position_counts_from_dspark([2 / 3, 1 / 2, 0.0], {"3": 2, "1": 1})
    assert tries == [3, 2, 2]
    assert hits == [2, 1, 0]
    assert workers.position_counts_from_dspark([], {}) == ([], [])


def test_round_stats():
    st = evalsets.round_stats([(4, 4), (4, 1), (0, 0), (2, 0)])
    assert st["rounds"] == 4 and st["proposed"] == 10 and st["accepted"] == 5
    assert st["tau"] == pytest.approx((5 + 4) / 4)
    assert st["acceptance_rate"] == pytest.approx(0.5)
    assert st["pos_tries"] == [3, 3, 2, 2]
    assert st["pos_hits"] == [2, 1, 1, 1]
    empty = evalsets.round_stats([])
    assert empty["rounds"] == 0 and empty["tau"] is None and empty["acceptance_rate"] is None
    assert evalsets.round_stats([(0, 0)])["acceptance_rate"] is None  # nothing proposed


def _row(system, ds, i, ids, tps, *, ttft=100.0, tau=None, rounds=None, proposed=None, accepted=None,
         tries=None, hits=None, rss=1000.0):
    n = len(ids)
    r = {"system": system, "dataset": ds, "index": i, "key": f"{ds}[{i}]", "token_ids": ids, "new_tokens": n,
         "ttft_ms": ttft, "decode_tokens": n - 1, "decode_s": (n - 1) / tps, "tokens_per_second": tps,
         "peak_rss_mb": rss}
    if rounds is not None:
        r.update(tau=tau, rounds=rounds, proposed=proposed, accepted=accepted, pos_tries=tries, pos_hits=hits)
    return r


@pytest.fixture()
def rows():
    a, b = [1, 2, 3, 4, 5], [7, 7, 7, 7, 7]
    return [
        _row("hf", "humaneval", 0, a, 2.0),
        _row("hf", "gsm8k", 0, b, 4.0),
        _row("dspark-target", "humaneval", 0, a, 4.0),
        _row("dspark-target", "gsm8k", 0, b, 4.0),
        _row("dspark-lm", "humaneval", 0, a, 8.0, tau=2.0, rounds=2, proposed=6, accepted=2,
             tries=[2, 2, 2], hits=[1, 1, 0], rss=3000.0),
        _row("dspark-lm", "gsm8k", 0, [7, 7, 9, 7, 7], 6.0, tau=4.0, rounds=1, proposed=3, accepted=3,
             tries=[1, 1, 1], hits=[1, 1, 1], rss=3500.0),
        {"system": "dspark-ngram", "dataset": "gsm8k", "index": 0, "key": "gsm8k[0]", "error": "worker exited 1: boom"},
    ]


SYSTEMS = ["hf", "dspark-target", "dspark-lm", "dspark-ngram"]


def test_correctness_and_aggregation(rows):
    report.add_correctness(rows, greedy=True)
    lm_gsm = next(r for r in rows if r["system"] == "dspark-lm" and r["dataset"] == "gsm8k")
    assert lm_gsm["vs_hf"] == 2 and lm_gsm["vs_dspark-target"] == 2
    assert all(r["vs_hf"] is None for r in rows if r["system"] == "dspark-target")
    assert "vs_hf" not in rows[-1]  # failed rows are not compared

    summ = report.summarize(rows, SYSTEMS, ["humaneval", "gsm8k"])
    he = summ["by_dataset"]["humaneval"]
    assert he["hf"]["tokens_per_second"] == pytest.approx(2.0)
    assert he["dspark-lm"]["ratio_to_hf"] == pytest.approx(4.0)
    assert he["dspark-lm"]["ratio_to_dspark-target"] == pytest.approx(2.0)
    allb = summ["all"]
    # total tokens / total time, not a mean of rates: hf 8 tokens in 2 + 1 s
    assert allb["hf"]["tokens_per_second"] == pytest.approx(8 / 3)
    assert allb["hf"]["e2e_tokens_per_second"] == pytest.approx(10 / (3 + 0.2))
    lm = allb["dspark-lm"]
    assert lm["tau"] == pytest.approx((2.0 * 2 + 4.0 * 1) / 3)  # weighted by rounds
    assert lm["acceptance_rate"] == pytest.approx(5 / 9)
    assert lm["acceptance_by_position"] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert lm["identical_to_hf"] == 1 and lm["compared_to_hf"] == 2
    assert lm["peak_rss_mb"] == 3500.0
    assert "tau" not in allb["hf"]
    assert allb["dspark-ngram"] == {"n": 0, "errors": 1}


def test_no_identity_check_when_sampling(rows):
    report.add_correctness(rows, greedy=False)
    assert not any("vs_hf" in r for r in rows)


def test_markdown_tables(rows):
    report.add_correctness(rows, greedy=True)
    summ = report.summarize(rows, SYSTEMS, ["humaneval", "gsm8k"])
    md = report.table(summ["all"], SYSTEMS, with_memory=True, loads={"hf": 12.34}, sizes={"hf": 7_108_390_424})
    lines = md.splitlines()
    assert lines[0].startswith("| system | n |") and "peak RSS GB" in lines[0] and "model GB" in lines[0]
    assert len(lines) == 2 + len(SYSTEMS)
    assert all(l.count("|") == lines[0].count("|") for l in lines)
    hf = next(l for l in lines if l.startswith("| hf |"))
    assert "2.67" in hf and "1.00×" in hf and "12.3" in hf and "2/2" in hf
    assert hf.endswith("| 12.3 | 7.11 |")  # load s, model GB (7.1e9 bytes)
    lm = next(l for l in lines if l.startswith("| dspark-lm |"))
    assert "56%" in lm and "1/2" in lm and "3.42" in lm  # 3500 MB -> 3.42 GB
    assert next(l for l in lines if l.startswith("| dspark-ngram |")).startswith("| dspark-ngram | 0 |")

    result = {"settings": {"systems": SYSTEMS, "datasets": ["humaneval", "gsm8k"], "target_name": "tgt",
                           "draft_name": "drf", "engine": "engines/x", "n": 1, "max_new_tokens": 5,
                           "temperature": 0.0, "seed": 0, "chunk": 4, "threads": 2},
              "summary": summ, "rows": rows, "workers": [{"system": "hf", "load_s": 3.0}],
              "prompt_check": {"n": 2, "all_identical": True, "mismatched": []}}
    rep = report.render_report(result, plots=["tokens_per_second.png"])
    assert rep.startswith("# DSpark vs transformers on tgt")
    assert "## humaneval" in rep and "## gsm8k" in rep and "## All prompts" in rep
    # divergence with its first differing position (no own-baseline comparison for the project's systems)
    assert "| gsm8k[0] | dspark-lm | 2 | 2 | – | 5 |" in rep
    assert "dspark-ngram gsm8k[0]: worker exited 1: boom" in rep
    assert "![tokens_per_second.png](tokens_per_second.png)" in rep
    assert "identical ids for all 2 prompts" in rep


def test_temperature_variants(rows):
    assert systems.variant_name("hf", 0.0) == "hf"
    assert systems.variant_name("dspark-lm", 1.0) == "dspark-lm@T1"
    assert systems.variant_name("hf", 0.7) == "hf@T0.7"
    assert systems.split_variant("dspark-lm@T1") == ("dspark-lm", 1.0)
    assert systems.split_variant("hf-assisted") == ("hf-assisted", 0.0)
    assert systems.reference_for("dspark-lm@T1", "hf") == "hf@T1"
    assert systems.reference_for("dspark-lm", "hf") == "hf"
    # sampled variants: different tokens than greedy hf, never compared token for token; their ratios
    # are to hf at the same temperature (hf@T1 at 1 tok/s here), not to greedy hf (2 tok/s on humaneval)
    rows += [_row("hf@T1", "humaneval", 0, [9, 9, 9], 1.0),
             _row("dspark-lm@T1", "humaneval", 0, [8, 8, 8], 3.0, tau=1.5, rounds=2, proposed=4, accepted=1,
                  tries=[2, 2], hits=[1, 0])]
    report.add_correctness(rows)
    assert not any(k.startswith("vs_") for r in rows if "@T" in r["system"] for k in r)
    assert next(r for r in rows if r["system"] == "dspark-lm" and r["dataset"] == "gsm8k")["vs_hf"] == 2
    variants = SYSTEMS + ["hf@T1", "dspark-lm@T1"]
    he = report.summarize(rows, variants, ["humaneval", "gsm8k"])["by_dataset"]["humaneval"]
    assert he["dspark-lm@T1"]["ratio_to_hf"] == pytest.approx(3.0)
    assert "ratio_to_dspark-target" not in he["dspark-lm@T1"]  # no dspark-target@T1 in this run
    assert he["dspark-lm"]["ratio_to_hf"] == pytest.approx(4.0)
    assert "identical_to_hf" not in he["dspark-lm@T1"]


def test_a_dspark_systems_model_bytes_count_the_prompt_graph_it_loads(int4_engine):
    """model GB: the prompt graph's files count where prompt chunks run on it (the engine's default), not with
    --prompts target; the target's data file it reads in place counts once."""
    from benchmarks.compare.workers import _engine_bytes
    from dspark_runtime import Engine
    from dspark_runtime.engine_dir.manifest import PROMPT_GRAPH

    m = Engine.load(int4_engine).manifest
    target = sum(f.size for f in m.graphs["target"].files)
    prompt = sum(f.size for f in m.graphs[PROMPT_GRAPH].files if f not in m.graphs["target"].files)
    assert 0 < prompt < sum(f.size for f in m.graphs[PROMPT_GRAPH].files)
    assert _engine_bytes(Engine.load(int4_engine, prompts="target"), None) == target
    assert _engine_bytes(Engine.load(int4_engine), None) == target + prompt
