"""The decoding core without models (dspark_runtime/decoding/loop.py): a toy bigram target and a fake drafter with
calibrated survivals, so the loop's rules are checked exactly — here the scheduled mode's decision to skip the
drafting pass when the cost table says drafts do not pay (issue 21, "never slower than no speculation")."""
import numpy as np
import pytest

from dspark_runtime.decoding.loop import DecodingLoop
from dspark_runtime.decoding.settings import LoopSettings
from dspark_runtime.drafting.base import Proposal
from dspark_runtime.runners.sequence import SequenceRunner
from dspark_runtime.scheduling.draft_skip import SKIP_PROBE_EVERY, SKIP_PROBE_MAX
from tests.fixtures.toy import BigramTarget, StatelessDrafter

TABLE = np.array([[0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.7, 0.1], [0.2, 0.1, 0.1, 0.6], [0.7, 0.1, 0.1, 0.1]])


class GreedyOracle(StatelessDrafter):
    """Drafts the target's own greedy continuation (always accepted) with survival 0.9 per position."""

    name = "oracle"

    def __init__(self):
        self.calls = 0
        self.loop = None  # set by the test: the rounds at which the drafter ran
        self.at = []

    def propose_batch(self, reqs, gammas, only=None):
        self.calls += 1
        self.at.append(self.loop.stats.rounds if self.loop is not None else None)
        out = []
        for r, g in zip(reqs, gammas):
            t, toks = r.out[-1], []
            for _ in range(g):
                t = int(np.argmax(TABLE[t]))
                toks.append(t)
            out.append(Proposal(toks, None, 0.9 ** np.arange(1, g + 1)))
        return out


def _run(t_draft: float, n: int = 60, trace: list | None = None):
    table = {"tokens": [1, 2, 3, 4, 5, 8], "t_verify": [1.0, 1.01, 1.02, 1.03, 1.04, 1.07], "t_draft": t_draft}
    table["seconds"] = [t_draft + t for t in table["t_verify"]]
    drafter = GreedyOracle()
    loop = DecodingLoop(SequenceRunner(BigramTarget(TABLE)), drafter,
                        LoopSettings(mode="scheduled", cost_table=table, max_batch=1))
    loop.round_trace = trace
    drafter.loop = loop
    req = loop.submit([0, 1], max_new_tokens=n, gamma=4)
    loop.run()
    ref = DecodingLoop(SequenceRunner(BigramTarget(TABLE)), None, LoopSettings(max_batch=1))
    alone = ref.submit([0, 1], max_new_tokens=n)
    ref.run()
    return req, loop.stats, drafter, alone.token_ids


def test_scheduled_rounds_skip_the_drafting_pass_when_it_does_not_pay():
    # cheap drafting: (1 + 0.9 + .81 + .73 + .66) / (0.01 + 1.04) ~ 3.9 tok/s against 1 without -> always drafts
    req, st, drafter, ref = _run(t_draft=0.01)
    assert req.token_ids == ref and st.draft_skipped == 0 and drafter.calls == st.rounds
    # dear drafting (10 s a pass): ~4.1 / 11 = 0.37 tok/s against 1 without -> the pass is skipped, except the first
    # round (no survivals yet) and one probe every SKIP_PROBE_EVERY undrafted rounds; output unchanged
    req, st, drafter, ref = _run(t_draft=10.0)
    assert req.token_ids == ref
    assert st.draft_skipped > 0 and drafter.calls + st.draft_skipped == st.rounds
    # the pattern: the first round drafts (no survivals yet), then SKIP_PROBE_EVERY undrafted rounds, a probing pass,
    # twice as many undrafted rounds, ... (the interval capped at SKIP_PROBE_MAX)
    gaps = [b - a - 1 for a, b in zip(drafter.at, drafter.at[1:])]
    assert drafter.at[0] == 0 and len(gaps) >= 1
    assert gaps == [min(SKIP_PROBE_EVERY * 2 ** i, SKIP_PROBE_MAX) for i in range(len(gaps))]
    assert req.stats.draft_length_histogram.get("0", 0) == st.draft_skipped


def test_the_round_trace_records_each_round_and_marks_the_probes():
    trace = []
    req, st, drafter, ref = _run(t_draft=10.0, trace=trace)
    assert req.token_ids == ref
    # the first round feeds the prompt alone (no decoding rows); every later one verifies the request's block
    assert trace[0].rows == 0 and trace[0].prompt_tokens == 2 and trace[0].prefilling == 1
    rounds = trace[1:]
    assert len(rounds) == st.rounds and all(r.rows == 1 and r.prefilling == 0 for r in rounds)
    assert sum(r.committed for r in trace) == st.committed
    assert sum(r.verify_tokens for r in trace) == st.verify_tokens
    assert sum(r.prompt_tokens for r in trace) == st.prefill_tokens
    assert [i for i, r in enumerate(rounds) if r.drafted] == drafter.at
    # the first drafted round drafts because nothing is known yet, not as a probe; every later one is a probe
    assert [r.probe for r in rounds if r.drafted] == [False] + [True] * (len(drafter.at) - 1)
    assert all(r.wall_s >= 0 for r in trace) and all(r.pass_tokens == r.verify_tokens for r in rounds)
    assert all((0 < r.draft_s < r.wall_s) == r.drafted for r in rounds)  # the drafting pass, inside its round
    # the rule's two expectations: none for the prompt round and the first (nothing known yet); afterwards every
    # round weighed them, and each undrafted round and each probe is one where drafting was expected to lose
    assert trace[0].expected_drafted is None and rounds[0].expected_drafted is None
    weighed = rounds[1:]
    assert weighed and all(r.expected_drafted is not None and r.expected_undrafted > 0 for r in weighed)
    assert all(r.expected_drafted < r.expected_undrafted for r in weighed if not r.drafted or r.probe)
    assert DecodingLoop(SequenceRunner(BigramTarget(TABLE)), None).round_trace is None  # off by default


def test_fixed_mode_without_a_cost_table_always_drafts():
    drafter = GreedyOracle()
    loop = DecodingLoop(SequenceRunner(BigramTarget(TABLE)), drafter, LoopSettings(mode="fixed", max_batch=1))
    loop.submit([0, 1], max_new_tokens=20, gamma=3)
    loop.run()
    assert loop.stats.draft_skipped == 0 and drafter.calls == loop.stats.rounds


def test_a_prior_lets_the_first_round_skip_too():
    """With prior survivals (the engine's fitted drafter acceptance) a request that has not drafted yet need not
    draft to be judged: under the dear table the first pass is the probe after SKIP_PROBE_EVERY rounds."""
    table = {"tokens": [1, 2, 4, 8], "t_verify": [1.0, 1.01, 1.03, 1.07], "t_draft": 10.0}
    table["seconds"] = [10.0 + t for t in table["t_verify"]]
    drafter = GreedyOracle()
    loop = DecodingLoop(SequenceRunner(BigramTarget(TABLE)), drafter,
                        LoopSettings(mode="scheduled", cost_table=table, max_batch=1,
                                     skip_prior=np.array([0.5, 0.25, 0.125, 0.06])))
    drafter.loop = loop
    req = loop.submit([0, 1], max_new_tokens=20, gamma=4)
    loop.run()
    assert drafter.at and drafter.at[0] == SKIP_PROBE_EVERY
    assert req.token_ids == _run(t_draft=10.0, n=20)[3]


class SlowOracle(GreedyOracle):
    """The oracle's always-accepted drafts, at ``delay`` seconds a drafting pass, without survivals (like the draft
    LM or n-gram lookup: the fixed mode judges them by their observed verdicts)."""

    def __init__(self, delay: float, wrong: bool = False):
        super().__init__()
        self.delay, self.wrong = delay, wrong

    def propose_batch(self, reqs, gammas, only=None):
        import time

        time.sleep(self.delay)
        props = super().propose_batch(reqs, gammas, only)
        if self.wrong:  # every drafted token rejected (the target's argmax never equals argmax + 1 here)
            return [Proposal([(t + 1) % 4 for t in p.tokens]) for p in props]
        return [Proposal(p.tokens) for p in props]


def _fixed(drafter, t_verify, n=40):
    table = {"tokens": [1, 2, 4, 8], "t_verify": list(t_verify), "t_draft": 0.0}
    table["seconds"] = list(t_verify)
    loop = DecodingLoop(SequenceRunner(BigramTarget(TABLE)), drafter,
                        LoopSettings(mode="fixed", cost_table=table, max_batch=1, draft_skip=True))
    drafter.loop = loop
    req = loop.submit([0, 1], max_new_tokens=n, gamma=3)
    loop.run()
    return req, loop


def test_fixed_mode_skips_a_drafter_whose_measured_pass_does_not_pay():
    """Fixed verify lengths, any drafter: the loop times the drafting pass itself and judges by the requests'
    observed verdicts. A 30 ms pass against a 1 ms verifier does not pay even with every draft accepted: after the
    first round (no verdict yet) and the second (the first timing) the pass runs only as probes; output unchanged."""
    ref = DecodingLoop(SequenceRunner(BigramTarget(TABLE)), None, LoopSettings(max_batch=1))
    alone = ref.submit([0, 1], max_new_tokens=40)
    ref.run()
    req, loop = _fixed(SlowOracle(0.03), [0.001, 0.0011, 0.0012, 0.0014])
    gaps = [b - a - 1 for a, b in zip(loop.drafter.at, loop.drafter.at[1:])]
    assert req.token_ids == alone.token_ids and loop.stats.draft_skipped > 0
    assert loop.drafter.at[:2] == [0, 1] and gaps[1:] == [min(8 * 2 ** i, 64) for i in range(len(gaps) - 1)]
    assert loop.skip.draft_time(1) >= 0.03
    # a cheap pass (no delay) with accepted drafts pays (4 tokens a round for about one verifier pass): never skipped
    req, loop = _fixed(SlowOracle(0.0), [0.05, 0.051, 0.052, 0.054])
    assert req.token_ids == alone.token_ids and loop.stats.draft_skipped == 0
    # a cheap pass whose drafts are always rejected gains nothing and makes the pass longer: skipped after the
    # verdicts are in
    req, loop = _fixed(SlowOracle(0.0, wrong=True), [0.05, 0.06, 0.07, 0.09])
    assert req.token_ids == alone.token_ids and loop.stats.draft_skipped > 0
    assert np.allclose(req.last_survival, 0.0)
    # opt-in with fixed lengths: without draft_skip the loop drafts every round, whatever it costs
    loop = DecodingLoop(SequenceRunner(BigramTarget(TABLE)), SlowOracle(0.03),
                        LoopSettings(mode="fixed", max_batch=1,
                                     cost_table={"tokens": [1, 2, 4, 8], "t_verify": [0.001, 0.0011, 0.0012, 0.0014]}))
    loop.drafter.loop = loop
    loop.submit([0, 1], max_new_tokens=12, gamma=3)
    loop.run()
    assert loop.stats.draft_skipped == 0 and loop.drafter.calls == loop.stats.rounds


def test_observed_survival_and_measured_draft_time():
    from dspark_runtime.scheduling.draft_skip import DraftSkipRule, observed_survival

    a = observed_survival(None, 3, 1)
    assert a.tolist() == [1.0, 0.0, 0.0]
    b = observed_survival(a, 4, 4, alpha=0.5)  # grows to 4 positions; position 4 starts at its first verdict (1),
    assert b.tolist() == [1.0, 0.5, 0.5, 0.5]  # capped by position 3: survivals never increase with the position
    assert observed_survival(b, 2, 0, alpha=0.5).tolist() == [0.5, 0.25, 0.25, 0.25]
    import pytest

    with pytest.raises(ValueError, match="accepted must be in"):
        observed_survival(None, 2, 3)
    rule = DraftSkipRule(observed=True)
    assert rule.draft_time(4) is None
    rule.record_draft_time(1, 0.010)
    rule.record_draft_time(4, 0.040)
    assert rule.draft_time(2) == pytest.approx(0.020) and rule.draft_time(8) == pytest.approx(0.040)
    rule.record_draft_time(1, 0.020)  # moving average, newest weight 0.3
    assert rule.draft_time(1) == pytest.approx(0.013)



def test_measured_round_times_correct_the_tables_prediction():
    """The table times passes, the loop pays rounds: every steady round's time less its drafting pass, over the
    table's t_verify, is averaged into one ratio k that prices the verifier on both sides of the comparison; the
    drafting pass is priced at its measured time where the row count was measured, else at the table's times k.
    Here drafting pays by the table (1 + 0.6 + 0.36 tokens for 1.0 + 0.1 s against 1 token for 1.0 s); rounds at
    twice the table's verifier time keep it paying (1.96 / 2.2 > 1 / 2.0) until a drafting pass is measured at 2 s
    (1.96 / 4.0 < 1 / 2.0); one wild round is clamped."""
    import pytest

    from dspark_runtime.scheduling.draft_skip import ROUND_RATIO_BOUNDS, DraftSkipRule

    table = {"tokens": [1, 2, 3, 4], "t_verify": [1.0, 1.0, 1.0, 1.0], "t_draft": 0.1, "seconds": [1.1] * 4}
    surv = [np.array([0.6, 0.36])]
    rule = DraftSkipRule(observed=False)
    assert rule.ratio() == 1.0 and rule.draft_pass(table, 1) == pytest.approx(0.1) and rule.pays(surv, [2], table)
    rule.record_round(table, 3, 2.2, draft_seconds=0.2)  # a drafted round: (2.2 - 0.2) / t_verify(3) = 2
    assert rule.ratio() == pytest.approx(2.0) and rule.draft_pass(table, 1) == pytest.approx(0.2)
    assert rule.pays(surv, [2], table) and rule.last_expected == pytest.approx((1.96 / 2.2, 0.5))
    rule.record_draft_time(1, 2.0)  # the pass measured at one row: its own time, not the table's
    assert rule.draft_pass(table, 1) == pytest.approx(2.0) and not rule.pays(surv, [2], table)
    assert rule.last_expected == pytest.approx((1.96 / 4.0, 0.5))
    rule.record_round(table, 1, 1000.0)  # one stalled (undrafted) round is clamped, then averaged in
    assert rule.ratio() == pytest.approx(0.8 * 2.0 + 0.2 * ROUND_RATIO_BOUNDS[1])
    rule.record_round(table, 1, 0.5, draft_seconds=0.5)  # nothing left for the verifier: not a measurement
    rule.record_round({"tokens": [1], "seconds": [1.0]}, 1, 1.0)  # no t_verify: nothing to compare with
    assert rule.ratio() == pytest.approx(0.8 * 2.0 + 0.2 * ROUND_RATIO_BOUNDS[1])
    # outside the measured row counts the table's pass at that many rows, times k
    rows_table = dict(table, draft_rows=[1, 4], t_draft_rows=[0.1, 0.4])
    assert rule.draft_pass(rows_table, 4) == pytest.approx(rule.ratio() * 0.4)
    assert rule.draft_pass(rows_table, 1) == pytest.approx(2.0)
    # observed mode: the measured pass only (the table times the DSpark drafter), clamped beyond the measured rows
    obs = DraftSkipRule(observed=True)
    assert obs.draft_pass(table, 2) is None and obs.pays([np.array([0.9])], [1], table)
    obs.record_draft_time(2, 0.5)
    assert obs.draft_pass(table, 2) == pytest.approx(0.5) and obs.draft_pass(table, 8) == pytest.approx(0.5)


def test_the_ratio_cannot_go_stale_while_the_rule_drafts():
    """A ratio kept per kind of round went stale on the side the rule stopped running: a few slow undrafted rounds
    (here k = 3 from one) kept it drafting for good (1.3 tokens for 0.4 + 3 s beats 1 for 3 s). With one ratio the
    drafted rounds themselves, at the table's verifier time, bring k down until skipping wins (break-even k =
    0.4 / 0.3 = 1.33)."""
    from dspark_runtime.scheduling.draft_skip import DraftSkipRule

    table = {"tokens": [1, 2], "t_verify": [1.0, 1.0]}
    surv = [np.array([0.3])]
    rule = DraftSkipRule(observed=False)
    rule.record_draft_time(1, 0.4)
    rule.record_round(table, 1, 3.0)  # slow undrafted rounds
    drafted = 0
    while rule.pays(surv, [1], table) and drafted < 50:
        rule.drafted()
        rule.record_round(table, 2, 1.4, draft_seconds=0.4)  # drafted rounds at the table's verifier time
        drafted += 1
    assert 1 <= drafted < 50 and rule.ratio() < 0.4 / 0.3
    assert rule.last_expected[0] < rule.last_expected[1]


def test_the_loop_feeds_steady_rounds_to_the_ratios():
    """Every steady round (no prompt chunk, no admission) is timed into the ratio, and its drafting pass into the
    measured pass times; the toy's rounds take microseconds against a table of seconds, so the ratio sits at the
    lower clamp and the decisions (drafting pays, by the table and by the measured pass) are unchanged: the output
    stays the target's."""
    from dspark_runtime.scheduling.draft_skip import ROUND_RATIO_BOUNDS

    req, st, drafter, ref = _run(t_draft=0.01)
    assert req.token_ids == ref and st.draft_skipped == 0
    loop = drafter.loop
    assert loop.skip.ratio() == pytest.approx(ROUND_RATIO_BOUNDS[0])
    assert set(loop.skip.draft_seconds) == {1} and 0 < loop.skip.draft_seconds[1] < 0.01


def test_the_skip_rule_costs_the_padded_pass():
    """The scatter layout pads every request's row to the longest (ScatterRunner.pass_rows): one request's 3-token block
    beside three anchors makes a 4 x 4 pass, not 7 tokens. With t_verify(B) = 1 + 0.1 B: summed, drafting pays
    (4 + 2.7 tokens for 1.7 s = 3.94 tok/s against 4 for 1.4 s = 2.86); padded it does not (6.7 for 2.6 s = 2.58)."""
    from dspark_runtime.scheduling.draft_skip import DraftSkipRule

    table = {"tokens": [1, 64], "t_verify": [1.1, 7.4]}
    rule = DraftSkipRule(observed=True)
    rule.prior = np.zeros(0)  # the other three requests: nothing known to draft
    rule.record_draft_time(4, 0.0)
    surv = [np.array([0.9, 0.9, 0.9]), None, None, None]
    assert rule.pays(surv, [3] * 4, table)
    assert rule.pays(surv, [3] * 4, table, pass_tokens=sum)
    assert not rule.pays(surv, [3] * 4, table, pass_tokens=lambda q: len(q) * max(q))
