"""The context-aware router (issue 9): n-gram match quality, online n-gram confidences, the routing
rule, losslessness (greedy identity on tiny engines; sampled distribution on a toy target), DSpark staying in
sync when rounds skip it, and the engine/CLI wiring."""
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from dspark_runtime.decoding.loop import DecodingLoop
from dspark_runtime.decoding.sampling import SamplingParams
from dspark_runtime.decoding.settings import LoopSettings
from dspark_runtime.drafting import router as router_mod
from dspark_runtime.drafting.base import Proposal
from dspark_runtime.drafting.drafters import NgramMatch, match_extent, ngram_lookup, ngram_match
from dspark_runtime.drafting.learned_acceptance import (LearnedAcceptance, NgramConfidence, acceptance_counts,
                                                        fit_ngram_counts)
from dspark_runtime.drafting.router import Router, route, router_priors
from dspark_runtime.runners.sequence import SequenceRunner
from tests.fixtures.toy import BigramTarget, StatelessDrafter

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)
REPEAT = "for i in range(10):\n    print(i * i)\n" * 3


# ------------------------------------------------------------------------------------ pure pieces


def test_ngram_match_reports_quality_and_agrees_with_lookup():
    ctx = np.array([5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7], dtype=np.int64)
    m = ngram_match(ctx, 3, max_ngram=2)
    # (6, 7) occurs at 1 and 6 before the tail: support 2, continuation after the most recent one
    assert (m.tokens, m.ngram, m.support, m.start, m.length) == ([3, 4, 2], 2, 2, 8, 3)
    assert m.extent == 2  # ... 1, 6, 7 | vs ... 2, 6, 7: the agreement stops after 2 tokens
    ctx2 = np.array([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], dtype=np.int64)
    m2 = ngram_match(ctx2, 2, max_ngram=3)
    assert (m2.tokens, m2.ngram, m2.support, m2.start) == ([9, 2], 3, 1, 3)
    assert ngram_match(np.array([1, 2, 3, 4]), 5) == NgramMatch()
    assert ngram_match(np.array([4, 5, 4]), 5).tokens == [5, 4]  # runs into the context's end
    rng = np.random.default_rng(0)
    for _ in range(200):  # the same proposal as the NgramDrafter's lookup
        c = rng.integers(0, 6, size=int(rng.integers(1, 30)))
        g, mx = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        assert ngram_match(c, g, mx).tokens == ngram_lookup(c, g, mx)


def test_match_extent_counts_the_copied_span():
    span = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    ctx = np.array([1] + span + [2, 3] + span[:7], dtype=np.int64)  # copying the span: 7 tokens in
    m = ngram_match(ctx, 4)
    assert m.ngram == 3 and m.tokens == [18, 19, 2, 3] and m.extent == 7
    assert match_extent(ctx, m.start, 3, cap=5) == 5  # capped
    conf = NgramConfidence()
    assert conf.edges == (1, 2, 3, 4, 8, 16) and conf.bucket(m) == 3  # extent 7: the 4-7 bucket
    assert conf.bucket(NgramMatch([1], 1, 1, 0, 1)) == 0 and conf.bucket(NgramMatch([1], 3, 1, 0, 40)) == 5
    rng = np.random.default_rng(1)
    for _ in range(100):  # brute force: the longest agreeing suffix before start
        c = rng.integers(0, 3, size=int(rng.integers(2, 40)))
        mm = ngram_match(c, 3)
        if mm.length:
            e = 0
            while e < min(32, mm.start) and c[len(c) - 1 - e] == c[mm.start - 1 - e]:
                e += 1
            assert mm.extent == e >= mm.ngram


def test_fit_ngram_counts_hand_computed():
    # prompt [5, 6, 7, 5], output [6, 7, 9]: anchors at index 3 (5 -> lookup proposes 6, 7, 5), 4 (6 -> 7, 5, 6)
    # and 5 (7 -> 5, 6, 7); truth after each: [6, 7, 9], [7, 9], [9]
    seq, start = [5, 6, 7, 5, 6, 7, 9], 4
    got = fit_ngram_counts([seq], [start], gamma=3)
    assert got["anchors"] == 3 and got["matched"] == 3
    hits, tries = np.asarray(got["hits"]), np.asarray(got["tries"])
    # anchor 3: 1-gram (5), extent 1 (6 != 7 before it... [.., 7, 5] vs [5]: start 1, one token) -> bucket 0;
    #   proposes [6, 7, 5] vs [6, 7, 9]: 2 accepted, 3 tried
    # anchor 4: 2-gram (5, 6), extent 2 -> bucket 1: proposes [7, 5] (then the context ends) vs [7, 9]: 1 hit, 2 tried
    # anchor 5: 3-gram (5, 6, 7), extent 3 -> bucket 2: proposes [5] vs [9]: 0 hits, 1 tried
    np.testing.assert_array_equal(tries[:3], [[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    np.testing.assert_array_equal(hits[:3], [[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert tries[3:].sum() == 0


def test_prior_counts_scale_and_round_trip():
    acc = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    c = acceptance_counts(acc)
    assert c == {"hits": [[3, 2, 1]], "tries": [[4, 3, 2]]}
    stats = LearnedAcceptance((0.5,))
    stats.set_prior_counts(np.asarray(c["hits"]) * 100, np.asarray(c["tries"]) * 100, max_strength=8)
    np.testing.assert_allclose(stats.prior_tries, [[8, 6, 4]])  # scaled to 8 pseudo-rounds at position 1
    assert stats.prior_mean[0] == pytest.approx((12 + 1) / (18 + 2))
    before = stats.survival(0, 3)
    stats.update(0, 3, 0)
    assert stats.survival(0, 3)[0] < before[0]
    stats.reset()  # back to the fitted prior, not to zero
    np.testing.assert_allclose(stats.survival(0, 3), before)
    with pytest.raises(ValueError, match="hits <= tries"):
        stats.set_prior_counts([[2, 0, 0]], [[1, 0, 0]])
    with pytest.raises(ValueError, match="same shape"):
        stats.set_prior_counts([[1, 0]], [[1, 0, 0]])
    fit = fit_ngram_counts([[5, 6, 7, 5, 6, 7, 9]], [4], gamma=3)
    conf = NgramConfidence.from_json(fit, max_strength=None)
    np.testing.assert_allclose(conf.prior_tries, np.asarray(fit["tries"]))
    np.testing.assert_allclose(NgramConfidence.from_json(conf.to_json(), None).prior_hits, conf.prior_hits)
    kw = router_priors({"ngram": fit, "inner": {"dspark": c}}, "dspark")
    assert isinstance(kw["confidence"], NgramConfidence) and kw["inner_stats"].prior_tries[0, 0] == 4
    assert router_priors({"ngram": fit}, "lm").keys() == {"confidence"} and router_priors(None, "dspark") == {}
    with pytest.raises(ValueError, match="malformed"):
        router_priors({"ngram": {"edges": [1, 2]}}, "dspark")


def test_acceptance_stats_hand_computed():
    conf = NgramConfidence(prior_mean=(0.3, 0.5, 0.65), prior_strength=2.0, position_strength=2.0)
    long_match = NgramMatch([1, 2, 3, 4], ngram=5, support=1, start=0)  # n >= 3: last bucket
    assert conf.bucket(long_match) == 2 and conf.bucket(NgramMatch([1], 1, 1, 0)) == 0
    np.testing.assert_allclose(conf.estimate(long_match), np.cumprod([0.65] * 4))
    # 4 sent, first 2 accepted: positions 1, 2 hit, position 3 tried and missed, position 4 untested
    conf.record(long_match, proposed=4, accepted=2)
    m = (2 + 2 * 0.65) / (3 + 2)  # bucket mean 0.66
    assert conf.bucket_mean(2) == pytest.approx(0.66)
    c = [(1 + 2 * m) / 3, (1 + 2 * m) / 3, (0 + 2 * m) / 3, m]  # 0.7733, 0.7733, 0.44, 0.66
    np.testing.assert_allclose(conf.conditional(2, 4), c)
    np.testing.assert_allclose(conf.estimate(long_match), np.cumprod(c))
    assert c[0] > 0.65 > c[2]  # accepted positions up, the rejected one down
    # other buckets untouched
    np.testing.assert_allclose(conf.survival(0, 2), [0.3, 0.09])
    # a rejection at position 1 lowers everything of that bucket
    before = conf.estimate(long_match)
    conf.record(long_match, proposed=3, accepted=0)
    assert np.all(conf.estimate(long_match) < before)
    # a fully accepted block raises everything
    before = conf.estimate(long_match)
    conf.record(long_match, proposed=4, accepted=4)
    assert np.all(conf.estimate(long_match) > before)
    s = conf.estimate(long_match)
    assert np.all(np.diff(s) <= 0) and np.all((s > 0) & (s < 1))
    conf.reset()
    np.testing.assert_allclose(conf.estimate(long_match), np.cumprod([0.65] * 4))
    with pytest.raises(ValueError):
        conf.update(0, proposed=2, accepted=3)
    with pytest.raises(ValueError):
        LearnedAcceptance(prior_mean=(1.0,))


# ------------------------------------------------------------------------- routing rule, fake drafters


class FakeDSpark(StatelessDrafter):
    """A DSpark-like inner drafter (the drafters interface): proposes a block from a fixed distribution Q, with a
    survival that depends on its first sampled token (as DSpark's Markov-head confidences do)."""

    name = "dspark"
    confident = True

    def __init__(self, vocab=4, block_size=3, good_token=0, high=0.9, low=0.1, q=None, first=0.5):
        self.block_size, self.first = block_size, first
        self.q = np.full(vocab, 1.0 / vocab) if q is None else np.asarray(q, dtype=np.float64)
        self.good, self.high, self.low = good_token, high, low
        self.calls, self.observed = 0, []

    def propose_batch(self, reqs, gammas, only=None):
        self.calls += 1
        out = []
        for r, gamma in zip(reqs, gammas):
            if only is not None and r.rid not in only:
                out.append(Proposal([]))
                continue
            n = min(gamma, self.block_size)
            if r.params.greedy:
                toks = [int(np.argmax(self.q))] * n
            else:
                toks = [int(r.rng.choice(len(self.q), p=self.q)) for _ in range(n)]
            c = self.high if toks[0] == self.good else self.low
            surv = np.cumprod([self.first] + [c] * (n - 1))  # a_1 from the anchor, a_2.. from x_1
            out.append(Proposal(toks, None if r.params.greedy else np.tile(self.q, (n, 1)), surv))
        return out

    def observe(self, rid, sent, accepted):
        self.observed.append(accepted)


def _req(context, params=GREEDY, rng=None, rid=0):
    """A request whose committed context is ``context`` (its last token the anchor)."""
    return SimpleNamespace(rid=rid, prompt=list(context), out=[], params=params, rng=rng)


def _propose(router, req, gamma):
    """One round of ``router`` for ``req`` alone: (tokens, q)."""
    p = router.propose_batch([req], [gamma])[0]
    return p.tokens, p.q


def _begun(router, req):
    router.begin(req)
    return req


def test_routing_rule_prefers_the_larger_expected_length():
    inner = FakeDSpark(high=0.9, block_size=3)  # greedy: tokens 0 -> survival [0.5, 0.45, 0.405], sum 1.355
    weak = Router(inner, confidence=NgramConfidence(prior_mean=(0.2, 0.2, 0.2)))
    ctx = [7, 8, 9, 7, 8, 9, 7, 8]  # 3-gram (9, 7, 8) matched: continuation [9, 7, 8]
    req = _begun(weak, _req(ctx))
    toks, q = _propose(weak, req, 3)
    st = weak.state(0)
    assert st.source == "dspark" and toks == [0, 0, 0] and q is None
    assert st.scores["ngram"] == pytest.approx(0.2 + 0.04 + 0.008)
    assert st.scores["dspark"] == pytest.approx(1.355)
    weak.observe(0, 3, 1)
    assert inner.observed == [1] and weak.source_stats(0)["dspark"] == {"rounds": 1, "proposed": 3, "accepted": 1}
    # online recalibration of DSpark's confidences: rho = (accepted + 2) / (predicted + 2) = 3 / 3.355
    assert weak.recalibration(0) == pytest.approx(3 / 3.355)
    _propose(weak, req, 3)
    assert weak.state(0).scores["dspark"] == pytest.approx(3 / 3.355 * 1.355)
    off = Router(FakeDSpark(), recalibration_strength=None)
    off.begin(_req(ctx))
    assert off.recalibration(0) == 1.0

    strong = Router(FakeDSpark(high=0.9, block_size=3), confidence=NgramConfidence(prior_mean=(0.9,) * 3))
    req = _begun(strong, _req(ctx))
    toks, q = _propose(strong, req, 3)
    st = strong.state(0)
    assert st.source == "ngram" and toks == [9, 7, 8] and q is None
    np.testing.assert_allclose(st.survival, [0.9, 0.81, 0.729])
    strong.observe(0, 3, 0)  # n-gram statistics learn, the inner is not told
    assert strong.inner.observed == [] and st.confidence.tries[2, 0] == 1 and st.confidence.hits.sum() == 0
    # a miss (no earlier occurrence of the last token) always goes to the inner drafter
    req.prompt = [1, 2, 3]
    _propose(strong, req, 3)
    assert st.source == "dspark" and {k: v["rounds"] for k, v in strong.source_stats(0).items()} == {
        "ngram": 1, "dspark": 1}
    # min_match: a 1-gram match is not a candidate with min_match=2
    r = Router(FakeDSpark(), confidence=NgramConfidence(prior_mean=(0.99,) * 3), min_match=2)
    req = _begun(r, _req([5, 1, 2, 5]))
    _propose(r, req, 3)
    assert r.state(0).match.ngram == 1 and r.state(0).source == "dspark"


def test_route_is_a_pure_rule():
    """The rule alone: a miss goes to the inner drafter; greedy with a confident inner drafts first; sampling,
    a draft LM or mode='prior' decide from the priors; a strong match skips the drafting pass."""
    conf = NgramConfidence(prior_mean=(0.5, 0.5, 0.5))
    m = ngram_match(np.array([7, 8, 9, 7, 8, 9, 7, 8]), 3)
    prior = np.array([0.5, 0.25, 0.125])  # sum 0.875; the match's 0.875 too
    assert route(NgramMatch(), conf, prior, greedy=True, inner_confident=True).choice == "inner"
    assert route(m, conf, prior, greedy=True, inner_confident=True).choice is None
    assert route(m, conf, prior, greedy=False, inner_confident=True).choice == "ngram"  # tie goes to the free one
    assert route(m, conf, prior, greedy=True, inner_confident=False, ngram_bias=-0.1).choice == "inner"
    assert route(m, conf, prior, greedy=True, inner_confident=True, mode="prior").choice == "ngram"
    strong = route(m, NgramConfidence(prior_mean=(0.9,) * 3), prior, greedy=True, inner_confident=True)
    assert strong.choice == "ngram" and strong.scores["ngram"] == pytest.approx(0.9 + 0.81 + 0.729)


def test_routing_depends_on_context_and_past_rounds_only():
    """Same state and context: same choice, every time; while sampling, the choice never depends on the
    inner drafter's sampled tokens (it is made before drafting), and not on the coming verdict."""
    ctx = [7, 8, 9, 7, 8, 9, 7, 8]
    conf = NgramConfidence(prior_mean=(0.45, 0.45, 0.45))  # n-gram sum 0.45+0.2+0.09 = 0.74
    router = Router(FakeDSpark(high=0.9, low=0.1, block_size=3), confidence=conf)
    req = _begun(router, _req(ctx))
    # greedy: the block is drafted first; the choice is a function of the context
    picks = set()
    for _ in range(5):
        _propose(router, req, 3)
        picks.add(router.state(0).source)
    assert picks == {"dspark"}  # 1.355 > 0.74
    # sampling: the inner's learned prior (0.5 per position: sum 0.875) decides, before drafting, so the
    # sampled first token (which moves the inner's own survival between 0.55 and 1.355) cannot matter
    choices = set()
    req.params = SAMPLED
    for seed in range(30):
        req.rng = np.random.default_rng(seed)
        _propose(router, req, 3)
        choices.add(router.state(0).source)
    assert choices == {"dspark"} and router.state(0).scores["dspark"] == pytest.approx(0.5 + 0.25 + 0.125)
    # past verdicts move the next choice: three rejected dspark rounds lower its learned estimate below the
    # n-gram's; after that the n-gram proposal is chosen without running the inner drafter at all
    for _ in range(3):
        req.rng = np.random.default_rng(0)
        _propose(router, req, 3)
        router.observe(0, 3, 0)
    calls = router.inner.calls
    req.rng = np.random.default_rng(1)
    toks, q = _propose(router, req, 3)
    assert router.state(0).source == "ngram" and toks == [9, 7, 8] and q is None
    assert router.inner.calls == calls


def test_requests_route_independently_in_one_batch():
    """Two requests in one round: each gets its own state and choice; one inner pass serves the row that needs it."""
    router = Router(FakeDSpark(high=0.9, block_size=3), confidence=NgramConfidence(prior_mean=(0.9,) * 3))
    a = _begun(router, _req([7, 8, 9, 7, 8, 9, 7, 8], rid=0))  # a strong match: n-gram, no drafting
    b = _begun(router, _req([1, 2, 3], rid=1))  # a miss: the inner drafter
    pa, pb = router.propose_batch([a, b], [3, 3])
    assert pa.tokens == [9, 7, 8] and pb.tokens == [0, 0, 0] and router.inner.calls == 1
    assert router.state(0).source == "ngram" and router.state(1).source == "dspark"
    router.remove(0)
    assert router.source_stats(0) == {} and router.source_stats(1)["dspark"]["rounds"] == 1


# ------------------------------------------------------------------ lossless sampling on a toy target


def _second_token_tv(lossy: bool, monkeypatch, runs=2000):
    """Total variation between the empirical distribution of the second generated token (the first one
    decided by rejection sampling) and the exact one, on a bigram toy target. ``lossy``: the rule the router
    avoids -- compare with this round's sampled block, also when sampling."""
    table = [[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.05, 0.45, 0.45, 0.05]]
    # the first token x0 follows 3: x0 = 0 makes a 3-gram match (2, 3, 0), any other x0 only a 1-gram match
    prompt = [3, 0, 1, 2, 3, 0, 1, 2, 3]
    if lossy:
        exact_rule = router_mod.route
        monkeypatch.setattr(router_mod, "route", lambda *a, greedy, **kw: exact_rule(*a, greedy=True, **kw))
    counts = Counter()
    for seed in range(runs):
        # scores: n-gram 0.95+0.9 = 1.85 (3-gram) or 0.7+0.49 = 1.19 (1-gram, 0.7 when the continuation has one
        # token); the inner's learned prior 0.8+0.64 = 1.44, so the router sends the n-gram block after x0 = 0
        # and the model block otherwise (a choice by context). The inner's own survival sums to 1.71 when its
        # sampled x_1 == 0, else 0.99: deciding on it (the lossy variant) sends the model block after a 1-gram
        # match only when x_1 == 0, i.e. tokens not distributed as its q.
        router = Router(FakeDSpark(q=[0.5, 0.1, 0.2, 0.2], high=0.9, low=0.1, block_size=2, first=0.9),
                        confidence=NgramConfidence(prior_mean=(0.7, 0.7, 0.95)), inner_stats=LearnedAcceptance((0.8,)))
        sources, propose = [], router.propose_batch
        router.propose_batch = lambda *a, **k: (propose(*a, **k), sources.append(router.state(0).source))[0]
        loop = DecodingLoop(SequenceRunner(BigramTarget(table)), router)
        req = loop.submit(prompt, max_new_tokens=3, params=SAMPLED, gamma=2, seed=seed)
        loop.run()
        counts[req.token_ids[1]] += 1
        if not lossy:
            assert sources[0] == ("ngram" if req.token_ids[0] == 0 else "dspark")
    t = np.asarray(table)
    exact = t[prompt[-1]] @ t  # P(second token) = sum_x0 P(x0 | last prompt token) T[x0]
    emp = np.array([counts[k] for k in range(4)]) / runs
    return 0.5 * np.abs(emp - exact).sum()


def test_sampled_router_is_lossless_and_the_check_has_power(monkeypatch):
    assert _second_token_tv(False, monkeypatch) < 0.05
    assert _second_token_tv(True, monkeypatch) > 0.1  # deciding after sampling the block biases the output


# --------------------------------------------------------------------------------- tiny engines


@pytest.fixture(scope="module")
def dspark_engine(tiny_dspark):
    from dspark_runtime.engine import Engine

    return Engine.load(tiny_dspark[0], threads=1)


@pytest.fixture(scope="module")
def lm_engine(tiny_engine_dir):
    from dspark_runtime.engine import Engine

    return Engine.load(tiny_engine_dir, threads=1)


@pytest.mark.parametrize("prompt", ["hello world", "def f(x):\n    return", REPEAT])
@pytest.mark.parametrize("gamma", [1, 2, None])
def test_router_greedy_equals_target_only(dspark_engine, prompt, gamma):
    ref = dspark_engine.generate(prompt, max_new_tokens=40, draft="none")
    got = dspark_engine.generate(prompt, max_new_tokens=40, draft="router", draft_length=gamma)
    assert got.token_ids == ref.token_ids
    assert got.stats.drafter == "router"
    src = got.stats.draft_sources
    assert src["ngram"]["rounds"] + src["dspark"]["rounds"] == got.stats.num_rounds
    assert src["ngram"]["accepted"] + src["dspark"]["accepted"] == got.stats.accepted


def _run(engine, make_router, prompt, params=GREEDY, max_new_tokens=48, gamma=4, seed=None, cost_table=None):
    """Decode ``prompt`` alone with the router ``make_router(inner DSpark drafter)`` on the engine's target;
    returns (token ids, stats, router)."""
    from dspark_runtime.runners.factory import batch_runner

    target = batch_runner(engine.graph_backend("target"), row_multiple=engine.row_multiple, max_requests=1)
    router = make_router(engine.drafter("dspark", target))
    mode = "fixed"
    if cost_table is not None:
        router.cost_table, mode = cost_table, "scheduled"
    loop = DecodingLoop(target, router, LoopSettings(mode=mode, cost_table=cost_table, max_batch=1),
                        eos_ids=engine.eos_ids, decode=engine.tokenizer.decode)
    req = loop.submit(engine.encode_prompt(prompt), max_new_tokens=max_new_tokens, params=params, gamma=gamma,
                      seed=seed)
    loop.run()
    return req.token_ids, req.stats, router


def test_router_uses_both_sources_and_auto_is_the_router(dspark_engine):
    ref = dspark_engine.generate(REPEAT, max_new_tokens=48, draft="none")
    got = dspark_engine.generate(REPEAT, max_new_tokens=48)  # draft="auto"
    assert got.stats.drafter == "router" and got.token_ids == ref.token_ids
    src = got.stats.draft_sources
    assert src["ngram"]["rounds"] > 0 and src["dspark"]["rounds"] > 0, src
    assert got.stats.accepted > 0
    # the build copied the checkpoint's calibrated router priors (sts.json, see conftest) into the manifest,
    # and the engine's router starts from them
    r = dspark_engine.batch(draft="router").drafter
    assert r.confidence.edges == (1, 2, 3) and r.confidence.prior_tries[2, 1] == 9
    m = (4 + 2 * (4 + 1) / (14 + 2)) / (14 + 2)  # bucket mean: counts + s0 x fitted prior mean (5/16)
    np.testing.assert_allclose(r.inner_stats.survival(0, 1), [(3 + 2 * m) / (10 + 2)])


def test_scheduled_router_sends_ngram_continuations_longer_than_a_block(dspark_engine, monkeypatch):
    """Scheduled, the engine lets the router propose up to ngram_max_length (16) tokens: n-gram continuations
    longer than the DSpark block (4) are verified whenever the context holds one, and output stays exact."""
    seen = []
    propose = Router.propose_batch

    def spy(self, reqs, gammas, only=None):
        seen.append(gammas[0])
        props = propose(self, reqs, gammas, only)
        st = self.state(reqs[0].rid)
        if st.source == "ngram":  # the whole continuation the context offers is sent (tokens are free)
            assert len(props[0].tokens) == min(gammas[0], st.match.length) == st.match.length
        return props

    monkeypatch.setattr(Router, "propose_batch", spy)
    spec = dspark_engine.manifest.speculation
    saved = (spec.cost_table, spec.router)
    spec.cost_table = {"tokens": [1, 32], "seconds": [1.0, 1.0]}  # verify tokens free: keep every draft
    # priors that make every n-gram match the router's choice, whatever the (time-budgeted) tiny drafter learned
    sure = [[999.0] * 16] * 3
    spec.router = {"ngram": {"edges": [1, 2, 3], "hits": sure, "tries": [[1000.0] * 16] * 3},
                   "inner": {"dspark": {"hits": [[1.0, 0, 0, 0]], "tries": [[100.0, 1, 0, 0]]}}}
    try:
        ref = dspark_engine.generate(REPEAT, max_new_tokens=48, draft="none")
        got = dspark_engine.generate(REPEAT, max_new_tokens=48, draft="router", draft_length="scheduled")
    finally:
        spec.cost_table, spec.router = saved
    assert got.token_ids == ref.token_ids
    assert seen[0] == 16 and got.stats.draft_sources["ngram"]["rounds"] > 0, (seen, got.stats.draft_sources)


def test_skipped_dspark_rounds_stay_in_sync(dspark_engine):
    """mode='prior' skips the DSpark pass on n-gram rounds; its next call ingests every feature committed
    since, and drafts exactly what a fresh DSpark drafter (whole context at once) drafts."""
    from dspark_runtime.drafting.dspark import DSparkDrafter

    checks = {"calls": 0, "after_skip": 0}

    def make_router(inner):
        real = inner.propose_batch

        def checked(reqs, gammas, only=None):
            (r,), (gamma,) = reqs, gammas
            skipped = len(r.prompt) + len(r.out) - 1 - inner._ctx[r.rid]
            fresh = DSparkDrafter(inner.graph, inner.heads, inner.target)
            fresh.begin(r)
            want = fresh.propose_batch(reqs, gammas)[0]
            got = real(reqs, gammas, only)
            assert got[0].tokens == want.tokens
            np.testing.assert_allclose(got[0].survival, want.survival, atol=1e-4)
            checks["calls"] += 1
            checks["after_skip"] += checks["calls"] > 1 and skipped > 1 + gamma  # more than one round's tokens
            return got

        inner.propose_batch = checked
        return Router(inner, mode="prior", confidence=NgramConfidence(prior_mean=(0.5, 0.7, 0.9)))

    ref = dspark_engine.generate(REPEAT, max_new_tokens=48, draft="none")
    out, stats, router = _run(dspark_engine, make_router, REPEAT)
    assert out == ref.token_ids
    assert stats.draft_sources["ngram"]["rounds"] > 0 and checks["after_skip"] > 0, (stats.draft_sources, checks)


def test_router_sampling_is_seeded(dspark_engine):
    a = dspark_engine.generate(REPEAT, max_new_tokens=30, temperature=1.0, seed=7, draft="router")
    b = dspark_engine.generate(REPEAT, max_new_tokens=30, temperature=1.0, seed=7, draft="router")
    c = dspark_engine.generate(REPEAT, max_new_tokens=30, temperature=1.0, seed=8, draft="router")
    assert a.token_ids == b.token_ids and a.stats.draft_sources == b.stats.draft_sources
    assert a.token_ids != c.token_ids
    assert sum(v["rounds"] for v in a.stats.draft_sources.values()) == a.stats.num_rounds


def test_router_scheduled_cuts_blocks_and_stays_exact(dspark_engine):
    from dspark_runtime.errors import InputError

    with pytest.raises(InputError, match="no cost table"):  # the router is accepted; the table is missing
        dspark_engine.generate("hi", max_new_tokens=4, draft="router", draft_length="scheduled")
    dear = {"tokens": [1, 2, 3, 4, 5], "seconds": [1.0, 1.4, 1.8, 2.2, 2.6]}  # tokens are dear
    ref = dspark_engine.generate(REPEAT, max_new_tokens=40, draft="none")
    out, stats, _ = _run(dspark_engine, Router, REPEAT, max_new_tokens=40, cost_table=dear)
    assert out == ref.token_ids
    lengths = {int(k) for k in stats.draft_length_histogram}
    assert min(lengths) < 4, stats.draft_length_histogram  # the scheduler shortened some blocks


def test_router_over_a_draft_lm(lm_engine):
    """An engine with a draft LM: 'auto' stays the LM; 'router' composes the LM with n-gram lookup."""
    ref = lm_engine.generate(REPEAT, max_new_tokens=48, draft=None)
    assert lm_engine.generate("hi", max_new_tokens=4).stats.drafter == "lm"
    for gamma in (2, 4):
        got = lm_engine.generate(REPEAT, max_new_tokens=48, draft="router", draft_length=gamma)
        assert got.token_ids == ref.token_ids and got.stats.drafter == "router"
        assert set(got.stats.draft_sources) == {"ngram", "lm"}
    a = lm_engine.generate(REPEAT, max_new_tokens=24, temperature=1.0, seed=3, draft="router")
    b = lm_engine.generate(REPEAT, max_new_tokens=24, temperature=1.0, seed=3, draft="router")
    assert a.token_ids == b.token_ids
    together = lm_engine.generate_batch([REPEAT, "hello world"], max_new_tokens=48, draft="router", draft_length=4)
    assert together[0].token_ids == ref.token_ids  # the batched router over a draft LM is the same router


def test_cli_draft_router(tiny_dspark):
    from click.testing import CliRunner

    from dspark_runtime.cli import cli

    r = CliRunner().invoke(cli, ["generate", "--engine", str(tiny_dspark[0]), "--prompt", REPEAT,
                                 "--max-new-tokens", "16", "--draft", "router", "--threads", "1", "--no-stream"])
    assert r.exit_code == 0, r.output
    assert "speculative (router draft)" in r.output and "rounds ngram" in r.output


def test_strong_ngram_match_skips_the_drafting_pass():
    """Greedy, mode auto: a match scoring at least skip_ratio x the model drafter's prior score is sent without
    running the model drafter; skip_ratio=None always drafts and compares; a weak match still drafts."""
    ctx = [7, 8, 9, 7, 8, 9, 7, 8]
    strong = NgramConfidence(prior_mean=(0.9,) * 3)  # score 0.9 + 0.81 + 0.729 = 2.439
    r = Router(FakeDSpark(block_size=3), confidence=strong)  # inner prior [0.5, .25, .125] -> 0.875
    toks, _ = _propose(r, _begun(r, _req(ctx)), 3)
    assert toks == [9, 7, 8] and r.inner.calls == 0 and r.state(0).scores["dspark"] == pytest.approx(0.875)
    r = Router(FakeDSpark(block_size=3), confidence=NgramConfidence(prior_mean=(0.9,) * 3), skip_ratio=None)
    _propose(r, _begun(r, _req(ctx)), 3)
    assert r.inner.calls == 1 and r.state(0).source == "ngram"
    r = Router(FakeDSpark(block_size=3), confidence=NgramConfidence(prior_mean=(0.5,) * 3))  # 0.875 < 1.75
    _propose(r, _begun(r, _req(ctx)), 3)
    assert r.inner.calls == 1
    # with a cost table the rule still compares expected accepted tokens, not the cost-aware scores (whose
    # common bonus-token term would keep their ratio near 1): the strong match skips, the weak one drafts
    for conf, calls in ((strong, 0), (NgramConfidence(prior_mean=(0.5,) * 3), 1)):
        r = Router(FakeDSpark(block_size=3), confidence=conf)
        r.cost_table = {"tokens": [1, 2, 3, 4], "seconds": [1.0, 1.1, 1.2, 1.3]}
        _propose(r, _begun(r, _req(ctx)), 3)
        assert r.inner.calls == calls


class _ClockedDrafter(FakeDSpark):
    """A FakeDSpark whose every pass advances a shared fake clock by ``seconds``."""

    def __init__(self, name, clock, seconds, **kw):
        super().__init__(**kw)
        self.name, self.clock, self.seconds = name, clock, seconds

    def propose_batch(self, reqs, gammas, only=None):
        self.clock[0] += self.seconds
        return super().propose_batch(reqs, gammas, only)


def test_model_drafters_are_priced_with_their_own_measured_drafting_time():
    """Two model drafters: "eagle3" accepts a little more (learned 0.55 vs 0.5 per position) but its passes take 5x
    the profiled drafting time. Unmeasured, it wins on acceptance; after its warm-up pass and one timed pass its
    rounds are priced at 5x the drafting time and the router sends the faster "dspark" instead. Without a cost
    table nothing is timed and acceptance alone decides."""
    clock = [0.0]
    table = {"tokens": [1, 2, 3, 4], "t_verify": [0.020, 0.022, 0.024, 0.026], "t_draft": 0.010}
    fast = _ClockedDrafter("dspark", clock, 0.010, block_size=3)
    slow = _ClockedDrafter("eagle3", clock, 0.050, block_size=3)
    router = Router(fast, others=(slow,), inner_stats=LearnedAcceptance((0.5,)),
                    others_stats={"eagle3": LearnedAcceptance((0.55,))}, cost_table=table, mode="prior",
                    confidence=NgramConfidence(prior_mean=(0.01,)), clock=lambda: clock[0])
    req = _begun(router, _req([1, 2, 3]))  # no n-gram match: a model drafter every round
    picks = []
    for _ in range(4):
        _propose(router, req, 3)
        picks.append(router.state(0).source)
    assert picks == ["eagle3", "eagle3", "dspark", "dspark"]
    assert router.draft_scale("eagle3") == pytest.approx(5.0) and router.draft_scale("dspark") == pytest.approx(1.0)
    # the exponential average follows a drafter whose passes get cheaper
    slow.seconds = 0.010
    router._timed("eagle3", 0.010, 1, table)
    assert router.draft_scale("eagle3") == pytest.approx(0.7 * 5.0 + 0.3 * 1.0)
    untimed = Router(fast, others=(slow,), inner_stats=LearnedAcceptance((0.5,)),
                     others_stats={"eagle3": LearnedAcceptance((0.55,))}, mode="prior",
                     confidence=NgramConfidence(prior_mean=(0.01,)), clock=lambda: clock[0])
    req = _begun(untimed, _req([1, 2, 3]))
    for _ in range(3):
        _propose(untimed, req, 3)
        assert untimed.state(0).source == "eagle3"
    assert untimed.draft_scale("eagle3") == 1.0
