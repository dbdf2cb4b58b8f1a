"""The batched runtime on tiny models: packed KV cache parity, and batched greedy output of every
request equal to decoding it alone, target-only — with requests joining and leaving between rounds."""
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")

PROMPTS = ["hello world", "def f(x):\n    return x + 1\n\ndef g(x):", "the the the the the", "a b c d e f g",
           "import numpy as np\nimport numpy as np\n", "1 2 3 4 5 6 7 8 9"]


@pytest.fixture(scope="module")
def lm_engine(tiny_engine_dir):
    from dspark_runtime.engine import Engine

    return Engine.load(tiny_engine_dir, threads=1)


@pytest.fixture(scope="module")
def ds_engine(tiny_dspark, tmp_path_factory):
    """The tiny DSpark engine, profiled (cost table with a per-row draft time) so 'scheduled' works."""
    from dspark_export.fit.cost_profile import profile_engine
    from dspark_runtime.engine import Engine

    d = tmp_path_factory.mktemp("batch") / "eng"
    shutil.copytree(tiny_dspark[0], d)
    profile_engine(d, max_tokens=12, context=32, repeats=1, threads=1, draft_rows=(1, 2, 4))
    return Engine.load(d, threads=1)


@pytest.fixture(scope="module")
def solo(lm_engine):
    """Target-only greedy tokens of each prompt, decoded alone (the reference)."""
    return {p: lm_engine.generate(p, max_new_tokens=24, draft=None).token_ids for p in PROMPTS}


def test_packed_step_matches_single_sequences(lm_engine):
    """Two requests packed in one row give the logits each gets alone, also after a rollback, a removal
    and a compaction."""
    from dspark_runtime.runners.sequence import DecoderRunner
    from dspark_runtime.runners.packed import PackedRunner

    be = lm_engine._backends["target"].activate()
    a, b = [5, 6, 7, 8, 9, 10], [20, 21, 22]
    pr = PackedRunner(be, compact_ratio=0.0)
    pr.add("a")
    pr.add("b")
    la, lb = pr.step([("a", a), ("b", b)])
    ra, rb = DecoderRunner(be), DecoderRunner(be)
    np.testing.assert_allclose(la, ra.step(a), atol=1e-4)
    np.testing.assert_allclose(lb, rb.step(b), atol=1e-4)
    # b verifies 3 tokens, keeps 1; a steps on
    pr.step([("b", [30, 31, 32])])
    rb.step([30, 31, 32])
    pr.rollback("b", 4)
    rb.rollback(4)
    la, lb = pr.step([("a", [11]), ("b", [40, 41])])
    np.testing.assert_allclose(la, ra.step([11]), atol=1e-4)
    np.testing.assert_allclose(lb, rb.step([40, 41]), atol=1e-4)
    assert pr.length("a") == 7 and pr.length("b") == 6
    assert pr.slots == 6 + 3 + 3 + 3 and pr.live_slots == 13  # two rolled-back slots are free
    pr.remove("a")
    pr.add("c")
    pr.compact(force=True)
    assert pr.slots == pr.live_slots == 6
    lb, lc = pr.step([("b", [50]), ("c", a)])
    np.testing.assert_allclose(lb, rb.step([50]), atol=1e-4)
    np.testing.assert_allclose(lc, DecoderRunner(be).step(a), atol=1e-4)
    with pytest.raises(ValueError, match="cannot roll"):
        pr.rollback("b", 99)


def test_packed_calls_are_row_padded_like_single_calls(lm_engine):
    """With the probed row padding (here forced to 2), every packed call has an even row count, as the single
    runner's calls; padding rows leave no trace: the logits are bit-identical to the padded single runner's, the
    requests' lengths count real tokens only and the padding slots are dropped."""
    from dspark_runtime.runners.sequence import DecoderRunner
    from dspark_runtime.runners.packed import PackedRunner

    be = lm_engine._backends["target"].activate()
    rows = []
    real_step = be.step

    def spy(ids, *a, **k):
        rows.append(ids.shape[1])
        return real_step(ids, *a, **k)

    pr = PackedRunner(be, compact_ratio=0.0, row_multiple=2)
    pr.add("a")
    single = DecoderRunner(be, row_multiple=2)
    be.step = spy
    try:
        la = pr.step([("a", [5, 6, 7])])[0]
        lb = pr.step([("a", [8])])[0]
        pr.add("b")
        lc, _ = pr.step([("a", [9]), ("b", [20, 21])])
    finally:
        del be.step
    assert rows == [4, 2, 4]
    assert np.array_equal(la, single.step([5, 6, 7])) and np.array_equal(lb, single.step([8]))
    assert np.array_equal(lc, single.step([9]))
    assert pr.length("a") == 5 and pr.length("b") == 2
    assert pr.slots == pr.live_slots == 7  # the padding slots were dropped
    with pytest.raises(Exception, match="row_multiple"):
        PackedRunner(be, row_multiple=0)


@pytest.mark.parametrize("draft,gamma", [(None, None), ("ngram", 4), ("lm", 3), ("lm", 1)])
def test_batched_greedy_equals_solo_target_only(lm_engine, solo, draft, gamma):
    """6 prompts through a batch of at most 4: requests join as others finish; each output equals the prompt
    decoded alone, target-only."""
    res = lm_engine.generate_batch(PROMPTS, max_new_tokens=24, draft=draft, draft_length=gamma, max_batch=4)
    for p, r in zip(PROMPTS, res):
        assert r.token_ids == solo[p], p
        assert r.finish_reason in ("length", "eos")
    st = lm_engine.last_batch_stats
    assert st.batch_histogram.get("4", 0) > 0  # the batch was really shared
    assert st.wasted == st.proposed - st.accepted
    assert st.verify_tokens == sum((1 + int(k)) * v for k, v in st.verify_length_histogram.items())
    if draft == "lm":
        assert st.accepted > 0


def test_batched_dspark_fixed_threshold_and_scheduled_are_exact(ds_engine):
    ref = {p: ds_engine.generate(p, max_new_tokens=24, draft=None).token_ids for p in PROMPTS}
    for kw in (dict(draft_length=4), dict(draft_length=2), dict(draft_confidence=0.3), dict(draft_length="scheduled")):
        res = ds_engine.generate_batch(PROMPTS, max_new_tokens=24, draft="dspark", max_batch=4, **kw)
        assert [r.token_ids for r in res] == [ref[p] for p in PROMPTS], kw
        st = ds_engine.last_batch_stats
        # scheduled: the profiled tiny table may say the (weak, time-budgeted) drafter does not pay, and the rounds
        # then skip its pass (test_scheduled_batches_skip_a_drafting_pass_that_does_not_pay)
        assert st.accepted > 0 or (kw.get("draft_length") == "scheduled" and st.draft_skipped > 0), (kw, st)
        assert max(int(k) for k in st.verify_length_histogram) <= (2 if kw.get("draft_length") == 2 else 4)


def test_batched_dspark_drafts_what_the_single_drafter_drafts(ds_engine):
    """The batched DSpark rows (padded context, masked) propose the tokens the single-request drafter proposes:
    same τ and same per-request verify histogram at fixed γ."""
    solo = [ds_engine.generate(p, max_new_tokens=24, draft="dspark", draft_length=4) for p in PROMPTS[:4]]
    res = ds_engine.generate_batch(PROMPTS[:4], max_new_tokens=24, draft="dspark", draft_length=4, max_batch=4)
    for s, r in zip(solo, res):
        assert r.stats.num_rounds == s.stats.num_rounds
        assert r.stats.accepted == s.stats.accepted
        assert r.stats.accepted_by_position == s.stats.accepted_by_position


def test_a_long_prompt_joining_the_dspark_rows_gets_its_own_call_and_drafts_as_alone(ds_engine, monkeypatch):
    """A request whose prompt (about 200 tokens, fed in chunks) joins while three others decode brings its whole
    prompt's features to the drafter: that round's pass splits into calls (:func:`dspark.context_groups`) so the
    decoding rows are not padded to the prompt, and every request still drafts what it drafts alone."""
    from dspark_runtime.drafting.dspark import OrtDSparkGraph

    prompts = PROMPTS[:3] + [" ".join(f"w{i}" for i in range(120))]
    solo = [ds_engine.generate(p, max_new_tokens=24, draft="dspark", draft_length=4) for p in prompts]
    calls, real = [], OrtDSparkGraph.run

    def spy(self, features, *a, **kw):
        calls.append(features.shape[:2])
        return real(self, features, *a, **kw)

    monkeypatch.setattr(OrtDSparkGraph, "run", spy)
    res = ds_engine.generate_batch(prompts, max_new_tokens=24, draft="dspark", draft_length=4, max_batch=4,
                                   prefill_budget=16)
    long_calls = [c for c in calls if c[1] > 50]
    assert long_calls and all(rows == 1 for rows, _ in long_calls), calls  # the prompt's catch-up ran alone
    for s, r in zip(solo, res):
        assert r.token_ids == s.token_ids
        assert (r.stats.num_rounds, r.stats.accepted) == (s.stats.num_rounds, s.stats.accepted)
        assert r.stats.accepted_by_position == s.stats.accepted_by_position


def test_batched_router_is_exact_uses_both_sources_and_matches_the_single_router(ds_engine):
    """The router in the batched runtime: greedy outputs equal solo target-only at fixed γ and scheduled (with
    n-gram blocks past the DSpark block size); both sources are used; a request routes as it would alone
    (same rounds and sources as the single-request router at fixed γ); 'auto' is the router."""
    prompts = PROMPTS + ["for i in range(3):\n    print(i)\nfor i in range(3):\n    print(i)\n"]
    ref = {p: ds_engine.generate(p, max_new_tokens=24, draft=None).token_ids for p in prompts}
    spec = ds_engine.manifest.speculation
    saved = (spec.cost_table, spec.router)
    for kw in (dict(draft_length=4), dict(draft_length="scheduled")):
        if kw["draft_length"] == "scheduled":  # verify tokens free: the scheduler keeps every draft; and priors
            spec.cost_table = {"tokens": [1, 128], "seconds": [1.0, 1.0]}  # that make n-gram matches win
            spec.router = {"ngram": {"edges": [1, 2, 3], "hits": [[999.0] * 16] * 3,
                                     "tries": [[1000.0] * 16] * 3},
                           "inner": {"dspark": {"hits": [[1.0, 0, 0, 0]], "tries": [[100.0, 1, 0, 0]]}}}
        try:
            res = ds_engine.generate_batch(prompts, max_new_tokens=24, draft="router", max_batch=4, **kw)
        finally:
            spec.cost_table, spec.router = saved
        assert [r.token_ids for r in res] == [ref[p] for p in prompts], kw
        rounds = {s: sum(r.stats.draft_sources[s]["rounds"] for r in res) for s in ("ngram", "dspark")}
        assert rounds["ngram"] > 0 and (rounds["dspark"] > 0 or kw["draft_length"] == "scheduled"), (kw, rounds)
        st = ds_engine.last_batch_stats
        assert st.accepted > 0
        if kw["draft_length"] == "scheduled":  # n-gram blocks may run past the DSpark block (4)
            assert ds_engine.batch(draft="router", draft_length="scheduled").default_gamma == 16
            assert max(int(k) for k in st.verify_length_histogram) <= 16
    batched = ds_engine.generate_batch(prompts[:4], max_new_tokens=24, draft="router", draft_length=4, max_batch=4)
    for p, r in zip(prompts[:4], batched):
        alone = ds_engine.generate(p, max_new_tokens=24, draft="router", draft_length=4)
        assert r.stats.num_rounds == alone.stats.num_rounds, p
        assert r.stats.draft_sources == alone.stats.draft_sources, p
    assert ds_engine.batch().drafter.name == "router"  # auto


def test_batched_router_seeded_sampling_does_not_depend_on_the_batch(ds_engine):
    kw = dict(max_new_tokens=20, temperature=1.0, draft="router", draft_length=4)
    alone = ds_engine.generate_batch([PROMPTS[4]], seed=3, **kw)[0].token_ids
    batch = ds_engine.generate_batch([PROMPTS[4], PROMPTS[0], PROMPTS[2]], seed=3, **kw)[0].token_ids
    assert alone == batch


def test_seeded_sampling_does_not_depend_on_the_batch(lm_engine):
    """Per-request RNG: a seeded sampled request gives the same tokens alone and in a batch, and the same as
    the single-request API with that seed."""
    kw = dict(max_new_tokens=20, temperature=1.0, draft="lm", draft_length=3)
    alone = lm_engine.generate_batch([PROMPTS[1]], seed=7, **kw)[0].token_ids
    batch = lm_engine.generate_batch([PROMPTS[1], PROMPTS[0], PROMPTS[2]], seed=7, **kw)[0].token_ids
    single = lm_engine.generate(PROMPTS[1], seed=7, **kw).token_ids
    assert alone == batch == single
    other = lm_engine.generate_batch([PROMPTS[1]], seed=8, **kw)[0].token_ids
    assert other != alone


def test_cancel_frees_the_slot_and_others_continue(lm_engine, solo):
    gen = lm_engine.batch(draft="ngram", draft_length=3, max_batch=2)
    ids = [lm_engine.encode_prompt(p) for p in PROMPTS[:3]]
    reqs = [gen.submit(x, max_new_tokens=24, gamma=3) for x in ids]
    gen.step()
    gen.step()
    gen.cancel(reqs[0])
    assert reqs[0].finish_reason == "cancelled" and reqs[0].rid not in gen.target
    gen.run()
    assert reqs[1].token_ids == solo[PROMPTS[1]] and reqs[2].token_ids == solo[PROMPTS[2]]
    assert gen.target.requests == []


def test_batch_bad_arguments(lm_engine, ds_engine):
    from dspark_runtime.errors import InputError

    with pytest.raises(InputError, match="non-empty list"):
        lm_engine.generate_batch([])
    with pytest.raises(InputError, match="max_batch"):
        lm_engine.batch(max_batch=0)
    with pytest.raises(InputError, match="draft_length"):
        lm_engine.batch(draft_length=0)
    with pytest.raises(InputError, match="needs the DSpark drafter"):
        lm_engine.batch(draft="lm", draft_length="scheduled")
    with pytest.raises(InputError, match="no DSpark drafter"):
        lm_engine.batch(draft="dspark")
    with pytest.raises(InputError, match="prompt is empty"):
        lm_engine.generate_batch(["hi", "  "])


def test_round_cost_table_adds_the_batched_draft_time():
    from dspark_runtime.scheduling.round_cost import round_cost_table

    table = {"tokens": [1, 8, 16], "seconds": [1.1, 1.5, 2.1], "t_draft": 0.1, "t_verify": [1.0, 1.4, 2.0],
             "draft_rows": [1, 2, 4], "t_draft_rows": [0.1, 0.2, 0.4]}
    c = round_cost_table(table, 3)  # t_draft(3) = 0.3 interpolated between 2 and 4 rows
    assert c.tokens == (1, 8, 16)
    np.testing.assert_allclose(c.seconds, (1.3, 1.7, 2.3))
    np.testing.assert_allclose(round_cost_table(table, 1).seconds, table["seconds"])
    legacy = {"tokens": [1, 2], "seconds": [1.0, 1.2]}  # an older manifest without the split
    assert round_cost_table(legacy, 4).seconds == (1.0, 1.2)


def test_profile_records_batched_draft_times(ds_engine):
    t = ds_engine.manifest.speculation.cost_table
    assert t["draft_rows"] == [1, 2, 4] and len(t["t_draft_rows"]) == 3 and min(t["t_draft_rows"]) > 0
    assert t["tokens"] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]


def test_profile_on_load_cli_replaces_the_table_in_memory(ds_engine):
    """`dspark generate --profile-on-load` measures a fresh table and decodes with it; the manifest is untouched."""
    import json

    from click.testing import CliRunner

    from dspark_runtime.cli import cli

    before = (ds_engine.dir / "manifest.json").read_text()
    r = CliRunner().invoke(cli, ["generate", "--engine", str(ds_engine.dir), "--prompt", "hello world",
                                 "--max-new-tokens", "8", "--draft", "dspark", "--draft-length", "scheduled",
                                 "--threads", "1", "--profile-on-load", "--json"])
    assert r.exit_code == 0, r.output
    assert "profiled on load" in r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["stats"]["new_tokens"] == 8
    assert (ds_engine.dir / "manifest.json").read_text() == before


def test_monotone_fit_of_the_verify_times():
    from dspark_runtime.machine.cost_profile import monotone

    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert monotone([3.0, 1.0, 2.0]) == [2.0, 2.0, 2.0]  # pooled: (3 + 1 + 2) / 3
    np.testing.assert_allclose(monotone([249, 269, 259, 282]), [249, 264, 264, 282])
    assert monotone([]) == []


def test_packed_batches_warn_once_and_alone_does_not(lm_engine):
    """A growing-layout target packs a batch into one row, whose rounding depends on the neighbours: batch() with
    max_batch > 1 says so once (naming the fix); a request alone (generate, max_batch=1) is exact and says nothing."""
    import warnings

    from dspark_runtime.engine import Engine

    eng = Engine.load(lm_engine.dir, threads=1)
    assert eng.manifest.graphs["target"].spec.kv_layout == "growing"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        eng.generate("hi", max_new_tokens=2, draft=None)
        assert not [w for w in seen if "growing KV layout" in str(w.message)]
        eng.batch(draft=None, max_batch=4)
        eng.batch(draft=None, max_batch=4)
    hits = [w for w in seen if "growing KV layout" in str(w.message)]
    assert len(hits) == 1 and "--kv-layout scatter" in str(hits[0].message)


def test_scheduled_batches_skip_a_drafting_pass_that_does_not_pay(ds_engine):
    """Scheduled mode on the tiny DSpark engine with a cost table where the drafting pass costs 100x a verify pass:
    after each request's first drafted round the loop verifies anchors only (probing every SKIP_PROBE_EVERY rounds);
    outputs stay those of target-only decoding, and a cheap pass is never skipped."""
    ref = [ds_engine.generate(p, max_new_tokens=24, draft=None).token_ids for p in PROMPTS[:3]]
    spec = ds_engine.manifest.speculation
    saved = spec.cost_table
    pts = [1, 2, 4, 8, 16, 32]
    for t_draft, skips in ((100.0, True), (1e-6, False)):
        t_verify = [1.0 + 0.001 * b for b in pts]
        spec.cost_table = {"tokens": pts, "t_verify": t_verify, "t_draft": t_draft,
                           "seconds": [t_draft + t for t in t_verify]}
        try:
            res = ds_engine.generate_batch(PROMPTS[:3], max_new_tokens=24, draft="dspark", draft_length="scheduled",
                                           max_batch=3)
        finally:
            spec.cost_table = saved
        assert [r.token_ids for r in res] == ref
        assert (ds_engine.last_batch_stats.draft_skipped > 0) == skips, ds_engine.last_batch_stats
