"""Context-length buckets of the round cost table (issue 21): the pure lookup (dspark_runtime/scheduling/cost_table.py), the
consumers that read it at a round's cached positions (scheduler, prefill budget, the decoding loop on a toy
target), tables profiled before buckets, the manifest check, the profiler's context choice, and a profile of the
tiny engine."""
import json
import shutil

import numpy as np
import pytest

from dspark_runtime.scheduling.cost_table import check_cost_table, cost_table_at, reference_bucket
from dspark_runtime.scheduling.round_cost import round_cost_table
from dspark_runtime.decoding.loop import DecodingLoop
from dspark_runtime.decoding.settings import LoopSettings
from dspark_runtime.errors import InputError, ManifestError
from dspark_runtime.scheduling.prefill import prefill_budget
from dspark_runtime.machine.cost_profile import DEFAULT_CONTEXTS, profile_contexts
from tests.fixtures.toy import BigramBook

# two buckets over the same pass sizes; the top level repeats the reference bucket (here the first)
TABLE = {
    "tokens": [1, 8, 16, 32], "t_verify": [0.1, 0.45, 0.9, 1.8], "t_draft": 0.05, "draft_rows": [1, 4],
    "t_draft_rows": [0.05, 0.08], "seconds": [0.15, 0.5, 0.95, 1.85], "context": 0,
    "buckets": [{"context": 0, "t_verify": [0.1, 0.45, 0.9, 1.8], "t_verify_raw": [0.1, 0.45, 0.9, 1.8],
                 "t_draft": 0.05, "t_draft_rows": [0.05, 0.08]},
                {"context": 40, "t_verify": [0.2, 0.5, 0.7, 1.6], "t_verify_raw": [0.2, 0.5, 0.7, 1.6],
                 "t_draft": 0.09, "t_draft_rows": [0.09, 0.16]}]}
OLD = {"tokens": [1, 8, 16, 32], "t_verify": [0.1, 0.45, 0.9, 1.8], "t_draft": 0.05, "context": 256,
       "seconds": [0.15, 0.5, 0.95, 1.85]}


# ------------------------------------------------------------------------------------------- the lookup


def test_interpolates_between_buckets():
    t = cost_table_at(TABLE, 10)  # a quarter of the way from context 0 to 40
    np.testing.assert_allclose(t["t_verify"], [0.125, 0.4625, 0.85, 1.75])
    assert t["t_draft"] == pytest.approx(0.06)
    np.testing.assert_allclose(t["t_draft_rows"], [0.06, 0.10])
    np.testing.assert_allclose(t["seconds"], [0.185, 0.5225, 0.91, 1.81])
    assert t["context"] == 10.0 and "buckets" not in t and "t_verify_raw" not in t
    assert t["tokens"] == TABLE["tokens"] and t["draft_rows"] == [1, 4]
    assert cost_table_at(t, 30) is t  # resolved: flat in context
    np.testing.assert_allclose(cost_table_at(TABLE, 40)["t_verify"], [0.2, 0.5, 0.7, 1.6])  # on a bucket


def test_below_the_first_bucket_is_flat_and_above_the_last_extrapolates_never_below_it():
    table = dict(TABLE, buckets=[dict(b, context=c) for b, c in zip(TABLE["buckets"], (100, 140))])
    np.testing.assert_allclose(cost_table_at(table, 3)["t_verify"], [0.1, 0.45, 0.9, 1.8])
    # 180 = 140 + one bucket spacing: t(B) moves on by the last segment's change, but an entry that fell
    # between the buckets (B = 16, 32: 0.9 -> 0.7) stays at the last bucket's value instead of falling further
    t = cost_table_at(table, 180)
    np.testing.assert_allclose(t["t_verify"], [0.3, 0.55, 0.7, 1.6])
    assert t["t_draft"] == pytest.approx(0.13)
    one = dict(TABLE, buckets=TABLE["buckets"][1:])
    for c in (0, 40, 5000):  # one bucket: the same costs at every context
        np.testing.assert_allclose(cost_table_at(one, c)["t_verify"], [0.2, 0.5, 0.7, 1.6])


def test_tables_without_buckets_and_no_context_are_returned_as_they_are():
    assert cost_table_at(OLD, 5000) is OLD and cost_table_at(TABLE, None) is TABLE and cost_table_at(None, 3) is None
    np.testing.assert_allclose(round_cost_table(OLD, 1, context=5000).seconds, [0.15, 0.5, 0.95, 1.85])
    assert prefill_budget(OLD, stall=4.0) == prefill_budget(cost_table_at(OLD, 900), stall=4.0) == 8
    check_cost_table(OLD)  # nothing to check
    for bad in (-1, float("nan"), "x"):
        with pytest.raises(ValueError, match="context must be a"):
            cost_table_at(TABLE, bad)


def test_the_scheduler_and_the_prefill_budget_read_the_rounds_context():
    # round cost with 4 rows: t_draft_rows(4) + t_verify(B)
    near = round_cost_table(TABLE, 4, context=0)
    far = round_cost_table(TABLE, 4, context=40)
    np.testing.assert_allclose(near.seconds, [0.18, 0.53, 0.98, 1.88])
    np.testing.assert_allclose(far.seconds, [0.36, 0.66, 0.86, 1.76])
    np.testing.assert_allclose(round_cost_table(TABLE, 4).seconds, near.seconds)  # no context: the top level
    # largest pass <= 4 one-token passes: 8 tokens at context 0 (16 costs 0.9 > 0.4), 16 at 40 (0.7 <= 0.8)
    assert prefill_budget(cost_table_at(TABLE, 0), stall=4.0) == 8
    assert prefill_budget(cost_table_at(TABLE, 40), stall=4.0) == 16


def test_buckets_are_looked_up_by_the_positions_their_passes_read():
    # a scatter engine's buckets: contexts 0 and 40 read 128 and 168 slots; a round reading 148 is halfway
    table = json.loads(json.dumps(TABLE))
    for b, a in zip(table["buckets"], (128, 168)):
        b["attended"] = a
    check_cost_table(table)
    np.testing.assert_allclose(cost_table_at(table, 148)["t_verify"], [0.15, 0.475, 0.8, 1.7])
    np.testing.assert_allclose(cost_table_at(table, 40)["t_verify"], [0.1, 0.45, 0.9, 1.8])  # below 128: the first
    table["buckets"][1]["attended"] = 30
    with pytest.raises(ValueError, match=r"buckets\[1\]\.attended must be the positions the timed passes read, "
                                         r"an int >= its context 40"):
        check_cost_table(table)
    table["buckets"][1]["attended"] = 128
    with pytest.raises(ValueError, match="strictly ascending positions \\('attended'\\), got 128 then 128"):
        check_cost_table(table)
    del table["buckets"][1]["attended"]
    with pytest.raises(ValueError, match="1 of 2 buckets have 'attended'"):
        check_cost_table(table)


def test_reference_bucket_is_the_middle_one():
    assert [reference_bucket(c) for c in ([256], [128, 512], [128, 512, 1024], [1, 2, 3, 4])] == [0, 1, 1, 2]
    with pytest.raises(ValueError, match="no contexts"):
        reference_bucket([])


# ------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("change,msg", [
    (lambda t: t["buckets"][1].update(context=0), "strictly ascending context, got 0 then 0"),
    (lambda t: t["buckets"][0].update(context=-3), r"buckets\[0\]\.context must be a number of cached positions"),
    (lambda t: t["buckets"][1].update(t_verify=[0.2, 0.5]), r"buckets\[1\]\.t_verify must be a list of 4 times"),
    (lambda t: t["buckets"][1].update(t_verify=[0.2, 0.5, 0.0, 1.0]), "must hold positive finite seconds"),
    (lambda t: t["buckets"][0].pop("t_draft"), r"buckets\[0\]\.t_draft must be seconds >= 0"),
    (lambda t: t["buckets"][0].update(t_draft_rows=[0.1]), r"buckets\[0\]\.t_draft_rows must be a list of 2"),
    (lambda t: t.update(buckets=[]), "buckets must be a non-empty list"),
    (lambda t: t.update(tokens=[1, 8, 8, 32]), "tokens must be a non-empty list of ascending positive integers"),
])
def test_malformed_buckets_are_refused_by_name(change, msg):
    t = json.loads(json.dumps(TABLE))
    change(t)
    with pytest.raises(ValueError, match=msg) as e:
        check_cost_table(t)
    assert "re-run `dspark-export profile`" in str(e.value)


def test_the_manifest_reader_and_the_loop_refuse_malformed_buckets():
    from dspark_runtime.engine_dir.speculation import Speculation

    t = json.loads(json.dumps(TABLE))
    assert Speculation.from_json({"cost_table": t}).cost_table == t
    assert Speculation.from_json({"cost_table": OLD}).cost_table == OLD  # profiled before buckets
    t["buckets"][1]["t_verify"] = [0.2]
    with pytest.raises(ManifestError, match=r"m.json: speculation.cost_table.buckets\[1\]\.t_verify must be a list"):
        Speculation.from_json({"cost_table": t}, "m.json")
    with pytest.raises(InputError, match=r"cost_table.buckets\[1\]\.t_verify"):
        DecodingLoop(BigramBook(BIGRAM), None, LoopSettings(cost_table=t, prefill_budget="auto"))


# ------------------------------------------------------------------------------------------- the loop

BIGRAM = np.array([[0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.7, 0.1], [0.2, 0.1, 0.1, 0.6], [0.7, 0.1, 0.1, 0.1]])
LONG = [0, 1, 2, 3] * 10  # 40 prompt tokens


def _join_beside(first_prompt):
    """A loop with the auto budget: ``first_prompt`` decodes, then a 40-token prompt joins; returns the joining
    prompt's first chunk and the loop's budget then."""
    book = BigramBook(BIGRAM)
    loop = DecodingLoop(book, None, LoopSettings(max_batch=4, prefill_budget="auto", cost_table=TABLE))
    assert loop.prefill_budget == 8  # the top level (context 0) until a round says otherwise
    a = loop.submit(first_prompt, max_new_tokens=30)
    loop.step()  # a's whole prompt (nothing decoding)
    loop.step()
    b = loop.submit(LONG, max_new_tokens=4)
    loop.step()
    assert book.calls[-1][0] == (a.rid, 1) and book.calls[-1][1][0] == b.rid
    return book.calls[-1][1][1], loop.prefill_budget


def test_the_auto_prefill_budget_follows_the_decoding_requests_context(monkeypatch):
    monkeypatch.setattr("dspark_runtime.scheduling.prefill.PREFILL_STALL", 4.0)  # budgets of 8 and 16 on this table
    # beside a request with 3 cached positions: the table near context 0, 8 tokens a round; beside one with 42
    # (past the last bucket, 40): 16 tokens a round
    assert _join_beside([2, 3]) == (8, 8)
    assert _join_beside(LONG + [1]) == (16, 16)
    # a fixed budget is left alone; a table without buckets gives the same budget at every context
    book = BigramBook(BIGRAM)
    loop = DecodingLoop(book, None, LoopSettings(max_batch=4, prefill_budget=5, cost_table=TABLE))
    a = loop.submit(LONG + [1], max_new_tokens=30)
    loop.step()
    loop.step()
    loop.submit(LONG, max_new_tokens=4)
    loop.step()
    assert book.calls[-1][1][1] == 5 and loop.prefill_budget == 5
    old = DecodingLoop(BigramBook(BIGRAM), None, LoopSettings(prefill_budget="auto", cost_table=OLD))
    assert old.prefill_budget == 8
    no_table = DecodingLoop(BigramBook(BIGRAM), None, LoopSettings(prefill_budget="auto"))
    assert no_table.prefill_budget == 64
    assert a.out


def test_the_loop_reads_the_table_at_the_runners_attended_positions(monkeypatch):
    """The round's context is what the target runner's pass reads (BatchRunner.attended_positions): a runner whose
    calls read 42 positions (a scatter buffer grown by an earlier long request) gets the budget of context 42
    beside a request holding 3."""
    monkeypatch.setattr("dspark_runtime.scheduling.prefill.PREFILL_STALL", 4.0)  # budgets of 8 and 16 on this table

    class WideBook(BigramBook):
        def attended_positions(self, rids):
            return 42

    book = WideBook(BIGRAM)
    loop = DecodingLoop(book, None, LoopSettings(max_batch=4, prefill_budget="auto", cost_table=TABLE))
    a = loop.submit([2, 3], max_new_tokens=30)
    loop.step()
    loop.step()
    loop.submit(LONG, max_new_tokens=4)
    loop.step()
    assert book.length(a.rid) == 4 and book.calls[-1][1][1] == 16 and loop.prefill_budget == 16


def test_the_router_scores_at_the_positions_the_loop_reads(monkeypatch):
    """The router's round cost (scheduled mode) reads the table at its ``attended_positions`` (Engine.batch gives it
    the target runner's, as the loop's scheduler reads it), else at the longest request's cached positions."""
    import dspark_runtime.drafting.router as sched
    from dspark_runtime.drafting.learned_acceptance import LearnedAcceptance, NgramConfidence
    from dspark_runtime.drafting.router import Router
    from dspark_runtime.runners.sequence import SequenceRunner
    from tests.runtime.drafting.test_router import FakeDSpark
    from tests.fixtures.toy import BigramTarget

    seen, real = [], sched.round_cost_table
    monkeypatch.setattr(sched, "round_cost_table", lambda t, rows, context=None, **kw: seen.append(context)
                        or real(t, rows, context, **kw))
    router = Router(FakeDSpark(q=[0.5, 0.1, 0.2, 0.2], high=0.9, low=0.1, block_size=2, first=0.9),
                    confidence=NgramConfidence(prior_mean=(0.7, 0.7, 0.95)), inner_stats=LearnedAcceptance((0.8,)),
                    cost_table=TABLE)
    loop = DecodingLoop(SequenceRunner(BigramTarget(BIGRAM)), router)
    loop.submit([3, 0, 1, 2, 3, 0, 1, 2, 3], max_new_tokens=20, gamma=2)
    loop.step()  # the prompt
    loop.step()
    assert seen == [9]  # 9 prompt positions + 1 output token - the anchor
    router.attended_positions = lambda rids: 300
    loop.step()
    assert seen[-1] == 300


def test_attended_positions_of_the_scatter_layout_is_its_slot_buffer():
    from types import SimpleNamespace

    from dspark_runtime.runners.sequence import SequenceRunner
    from dspark_runtime.runners.scatter import SLOT_STEP, ScatterRunner, ScatterSequence

    spec = SimpleNamespace(kind="causal_lm", kv_layout="scatter",
                           dims=SimpleNamespace(num_kv_heads=1, head_dim=2, num_layers=1))
    backend = SimpleNamespace(spec=spec)
    runner = ScatterRunner(backend)
    runner.add("a")
    runner.add("b")
    kv = [(np.zeros((1, 130, 2), np.float32), np.zeros((1, 130, 2), np.float32))]
    runner.import_kv("a", kv, None)  # 130 positions: the buffers grow to 2 x 128 slots
    assert runner.slots == 2 * SLOT_STEP and runner.length("a") == 130 and runner.length("b") == 0
    assert runner.attended_positions(["b"]) == 256 == runner.attended_positions(["a", "b"])  # every row reads all
    runner.rollback("a", 3)
    assert runner.attended_positions(["a"]) == 256  # the buffer never shrinks
    book = BigramBook(BIGRAM)
    book.add("x")
    book.step([("x", [1, 2, 3])])
    assert book.attended_positions(["x"]) == 3 and book.attended_positions([]) == 0  # the default: the longest
    seq = SequenceRunner(ScatterSequence(backend))
    seq.add("s")
    seq.runner.import_kv(kv, None)
    assert seq.attended_positions(["s"]) == 256


# ------------------------------------------------------------------------------------------- the profiler


def test_profile_contexts():
    assert profile_contexts(256) == [256] and profile_contexts([512, 128]) == [128, 512]
    assert profile_contexts(DEFAULT_CONTEXTS, limit=1024, extra=8, explicit=False) == [128, 512]  # 1024 dropped
    with pytest.raises(InputError, match="context 1024 \\+ 8 positions per pass is beyond the engine's context "
                                         "\\(1024 positions, max_position_embeddings\\): profile contexts up to 1016"):
        profile_contexts([128, 1024], limit=1024, extra=8)
    with pytest.raises(InputError, match="even context 128 \\+ 8"):
        profile_contexts(DEFAULT_CONTEXTS, limit=100, extra=8, explicit=False)
    assert profile_contexts([128, 512, 1024], slot_step=128) == [128, 512, 1024]
    with pytest.raises(InputError, match="contexts 130 and 200 both read 256 slots: this engine's scatter KV layout "
                                         "grows its buffer in steps of 128 positions"):
        profile_contexts([200, 130], slot_step=128)
    for bad, msg in (([4], "integers >= 8"), ([128, 128], "differ from each other"), ([], "no context given"),
                     ([True], "integers >= 8")):
        with pytest.raises(InputError, match=msg):
            profile_contexts(bad)


def test_profile_of_the_tiny_engine_stores_buckets_the_runtime_reads(tiny_engine_dir, tmp_path):
    from dspark_export.fit.cost_profile import profile_engine
    from dspark_runtime import Engine

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    with pytest.raises(InputError, match="context 1020 \\+ 5 positions per pass"):  # before anything is measured
        profile_engine(d, max_tokens=4, context=(16, 1020), repeats=1, threads=1, probe_rows=False)
    t = profile_engine(d, max_tokens=4, context=(48, 16, 96), repeats=1, threads=1, probe_rows=False)
    stored = json.loads((d / "manifest.json").read_text())["speculation"]["cost_table"]
    assert stored["context"] == 48 == t["context"]  # the middle bucket is the reference
    assert [b["context"] for b in stored["buckets"]] == [16, 48, 96]
    assert [b["attended"] for b in stored["buckets"]] == [16, 48, 96]  # the growing layout reads what it caches
    assert stored["tokens"] == [1, 2, 3, 4] and stored["drafter"] == "lm"
    for b in stored["buckets"]:
        assert len(b["t_verify"]) == 4 and all(x > 0 for x in b["t_verify"]) and b["t_draft"] > 0
        assert b["t_verify"] == sorted(b["t_verify"])  # the monotone fit in B
    ref = stored["buckets"][1]
    assert stored["t_verify"] == ref["t_verify"] and stored["t_draft"] == ref["t_draft"]
    assert stored["seconds"] == pytest.approx([ref["t_draft"] + x for x in ref["t_verify"]])
    eng = Engine.load(d, threads=1)
    assert eng.manifest.speculation.cost_table == stored
    mid = cost_table_at(stored, 32)  # halfway between the buckets at 16 and 48
    np.testing.assert_allclose(mid["t_verify"], [(a + b) / 2 for a, b in zip(stored["buckets"][0]["t_verify"],
                                                                         ref["t_verify"])])
    gen = eng.batch(draft="lm", draft_length=2, max_batch=1)  # the auto budget reads the bucketed table
    assert gen.cost_table is eng.manifest.speculation.cost_table and gen.mode == "fixed"
    assert gen.prefill_budget == prefill_budget(stored, max_chunk=gen.target.max_chunk)
    r = gen.submit(eng.encode_prompt("hello world"), max_new_tokens=4)
    gen.run()
    assert 1 <= len(r.token_ids) <= 4 and r.finish_reason in ("length", "stop")


def test_dspark_export_profile_cli_prints_and_stores_the_buckets(tiny_engine_dir, tmp_path, capsys):
    from dspark_export.cli import main as export_main
    from dspark_runtime.cli import main as dspark_main

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    for bad, msg in (("12,x", "expected cached-position counts separated by commas"),
                     ("4", "profile contexts must be integers >= 8"),
                     ("16,2000", "context 2000 + 8 positions per pass is beyond the engine's context")):
        with pytest.raises(SystemExit) as e:
            export_main(["profile", str(d), "--context", bad, "--no-row-probe", "--threads", "1"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and "Traceback" not in err, err
    export_main(["profile", str(d), "--context", "32,16", "--max-tokens", "2", "--repeats", "1", "--threads", "1",
                 "--no-row-probe"])
    out = capsys.readouterr().out
    assert "contexts 16 / 32 cached positions (reference 32: the manifest's top-level lists)" in out, out
    assert "drafter lm: t_draft " in out and out.count(" / ") >= 4, out
    b2 = next(ln for ln in out.splitlines() if ln.strip().startswith("B= 2"))
    assert "t_verify" in b2 and "round at 32" in b2, out
    dspark_main(["info", "--engine", str(d)])
    info = capsys.readouterr().out
    assert "cost table: verify B = 1..2 tokens at 16, 32 cached positions" in info, info


def test_profile_of_a_scatter_engine_records_the_slots_each_bucket_reads(tiny_pair, tmp_path):
    """The scatter layout reads its whole slot buffer (steps of 128) in every pass: each bucket is timed on a fresh
    buffer and records the width it read, even after the engine's own runner has grown to a long sequence."""
    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_runtime import Engine

    tdir, ddir = tiny_pair
    d = tmp_path / "scatter"
    build_engine(Recipe(name="tiny-scatter", target=str(tdir), draft=str(ddir), target_feature_layers=[-1, 0],
                        draft_length=4, kv_layout="scatter"), d, isolate=False, log=lambda *a: None)
    eng = Engine.load(d, threads=1)
    runner = eng.runner("target")
    runner.prefill(list(range(3, 303)))  # 300 positions: this runner's buffer now holds 384 slots
    assert runner.attended_positions() == 384
    with pytest.raises(InputError, match="contexts 16 and 100 both read 128 slots"):
        eng.profile(context=(16, 100), max_tokens=4, repeats=1)
    t = eng.profile(context=(16, 200), max_tokens=4, repeats=1)
    assert [(b["context"], b["attended"]) for b in t["buckets"]] == [(16, 128), (200, 256)]
    assert eng.manifest.speculation.cost_table is t and t["context"] == 200  # in use from now on
