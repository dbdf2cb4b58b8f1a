"""What production clients ask for beyond text, lossless under speculation, on a tiny fp32 engine in the scatter layout
with a draft LM and a DSpark drafter: penalties (greedy output identical with every drafter and without), logprobs
(the target's raw distribution, the same with and without speculation), ``n`` choices sharing one prefill (each
equal to a request of its own seed), a grammar's masks and forced tokens (output obeys it, identical with every
drafter), and the residual rule that keeps a grammar-forbidden sampled draft lossless."""
import numpy as np
import pytest

from dspark_runtime.decoding.acceptance import rejection_accept
from dspark_runtime.decoding.logprobs import token_logprob
from dspark_runtime.decoding.penalties import penalize_rows
from dspark_runtime.decoding.sampling import SamplingParams

PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog. The quick brown fox", "for i in range(10):"]
DRAFTS = [None, "ngram", "lm", "dspark"]


@pytest.fixture(scope="module")
def engine(tiny_scatter_engine_dir):
    from dspark_runtime import Engine

    return Engine.load(tiny_scatter_engine_dir, threads=1)


class CountingGrammar:
    """A grammar over token ids for the loop's tests (the real one is llguidance's, tests/runtime/decoding/
    test_grammar.py): after c tokens, ids in [3, 300) with id % 3 == c % 3 are allowed; positions 3 and 4 force
    ids 30 and 61; after 9 tokens only the end-of-sequence ids."""

    def __init__(self, vocab: int, eos: list):
        self.vocab_size, self.eos, self.seen = vocab, list(eos), []
        self.masks_computed, self.mask_seconds = 0, 0.0

    def _count(self, m: np.ndarray) -> np.ndarray:
        self.masks_computed += 1
        return m

    def _allowed_at(self, c: int) -> np.ndarray:
        m = np.zeros(self.vocab_size, dtype=bool)
        if c >= 9:
            m[self.eos] = True
        elif c in (3, 4):
            m[{3: 30, 4: 61}[c]] = True
        else:
            m[np.arange(3, 300)[np.arange(3, 300) % 3 == c % 3]] = True
        return m

    def allowed(self) -> np.ndarray:
        return self._count(self._allowed_at(len(self.seen)))

    def allows(self, t: int) -> bool:
        return bool(self.allowed()[t])

    def consume(self, tokens: list) -> None:
        for t in tokens:
            assert self.allows(t), f"token {t} not allowed after {self.seen}"
            self.seen.append(int(t))

    def rollback(self, n: int) -> None:
        del self.seen[len(self.seen) - n:]

    def forced(self, limit: int) -> list:
        out, c = [], len(self.seen)
        while len(out) < limit and c in (3, 4):
            out.append({3: 30, 4: 61}[c])
            c += 1
        return out

    @property
    def finished(self) -> bool:
        return len(self.seen) >= 9


def test_penalties_keep_greedy_output_identical_under_speculation(engine):
    kw = dict(max_new_tokens=32, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=8.0)
    changed = 0
    for p in PROMPTS:
        ref = engine.generate(p, draft=None, **kw).token_ids
        changed += ref != engine.generate(p, max_new_tokens=24, draft=None).token_ids
        for d in DRAFTS[1:]:
            assert engine.generate(p, draft=d, draft_length=3, **kw).token_ids == ref, (p, d)
    assert changed, "the penalties changed no output: the test checks nothing"


def test_penalize_rows_counts_each_rows_history():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 10)).astype(np.float32)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    out = penalize_rows(x, p, np.array([1]), [2, 2], [3, 2])
    ref = x.copy()
    for k, hist in enumerate(([2, 2], [2, 2, 3], [2, 2, 3, 2])):
        for t in {1} | set(hist):
            ref[k, t] = ref[k, t] / np.float32(2) if ref[k, t] > 0 else ref[k, t] * np.float32(2)
        for t in set(hist):
            ref[k, t] -= np.float32(0.25 * hist.count(t) + 0.5)
    assert np.array_equal(out, ref)
    assert np.array_equal(penalize_rows(x, SamplingParams(), np.array([1]), [2], [3, 2]), x)


def test_logprobs_are_the_target_distribution_with_and_without_speculation(engine):
    for p in PROMPTS:
        ref = engine.generate(p, max_new_tokens=16, draft=None, logprobs=3)
        assert len(ref.logprobs) == len(ref.token_ids)
        for e, t in zip(ref.logprobs, ref.token_ids):
            assert e.token == t and e.top[0][0] == t and e.top[0][1] == e.logprob  # greedy: the most likely
            assert e.logprob <= 0 and sum(np.exp(lp) for _, lp in e.top) <= 1 + 1e-9
        for d in ("lm", "dspark"):
            got = engine.generate(p, max_new_tokens=16, draft=d, draft_length=3, logprobs=3)
            assert got.token_ids == ref.token_ids
            # the tiny engine is unpadded fp32: a row computed in a block differs from one alone by ~1e-5
            diff = max(abs(a.logprob - b.logprob) for a, b in zip(got.logprobs, ref.logprobs))
            assert diff < 1e-4, (p, d, diff)


def test_token_logprob_is_log_softmax():
    x = np.array([1.0, 3.0, 3.0, -2.0], dtype=np.float32)
    e = token_logprob(x, 3, top=2)
    lse = np.log(np.exp(x.astype(np.float64)).sum())
    assert e.logprob == pytest.approx(-2.0 - lse, abs=1e-12)
    assert [t for t, _ in e.top] == [1, 2]  # ties: the lower id first
    with pytest.raises(ValueError, match="outside the vocabulary"):
        token_logprob(x, 4)


@pytest.mark.parametrize("draft", [None, "dspark"])
def test_n_choices_share_one_prefill_and_match_their_seeds(engine, draft):
    ids = engine.encode_prompt(PROMPTS[1])
    params = SamplingParams(temperature=1.0, top_p=0.9)
    gen = engine.batch(draft=draft, draft_length=3, max_batch=2)  # 3 choices, 2 slots: one waits in the queue
    choices = gen.submit_choices(ids, 3, seed=11, params=params, max_new_tokens=12)
    gen.run()
    assert gen.stats.prefill_tokens == len(ids)  # one prefill for the three
    alone = []
    for i in range(3):
        g1 = engine.batch(draft=draft, draft_length=3, max_batch=1)
        r = g1.submit(ids, seed=11 + i, params=params, max_new_tokens=12)
        g1.run()
        alone.append(r.token_ids)
    assert [c.token_ids for c in choices] == alone
    assert len({tuple(a) for a in alone}) > 1  # the seeds differ


def test_grammar_masks_and_forced_tokens_keep_output_identical(engine):
    vocab = engine.manifest.graphs["target"].spec.dims.vocab_size
    outs = {}
    for d in DRAFTS:
        gen = engine.batch(draft=d, draft_length=3, max_batch=4)
        reqs = [gen.submit(engine.encode_prompt(p), max_new_tokens=20, gamma=3,
                           grammar=CountingGrammar(vocab, engine.eos_ids)) for p in PROMPTS]
        drafted_at = []  # (request, tokens committed) of every drafted-for request, each pass
        if gen.drafter is not None:
            propose = gen.drafter.propose_batch

            def spy(rs, gammas, only=None, propose=propose):
                drafted_at.extend((r.rid, len(r.out)) for r in rs if only is None or r.rid in only)
                return propose(rs, gammas, only=only)

            gen.drafter.propose_batch = spy
        gen.run()
        # where the grammar forces the next token (after 3 and 4 tokens) the drafter is not asked
        assert not any(n in (3, 4) for _, n in drafted_at) and (d is None or drafted_at)
        outs[d] = [r.token_ids for r in reqs]
        assert all(r.stats.grammar_masks >= len(r.token_ids) for r in reqs)
        for r in reqs:
            check = CountingGrammar(vocab, engine.eos_ids)
            body = [t for t in r.token_ids if t not in engine.eos_ids]
            check.consume(body)  # every token allowed where it was generated
            assert r.token_ids[3:5] == [30, 61] and r.finish_reason == "eos" and len(body) == 9
        assert gen.stats.constrained_requests == len(PROMPTS)
        assert gen.stats.forced_tokens == 2 * len(PROMPTS)  # positions 3 and 4, verified as free drafts
        if d in ("lm", "dspark"):
            assert gen.stats.masked_drafts > 0  # the drafters propose tokens the grammar forbids
    for d in DRAFTS[1:]:
        assert outs[d] == outs[None], d


def test_a_forbidden_sampled_draft_leaves_its_residual():
    """p = (.5, .5, 0) at the position, the draft q = (.5, 0, .5) and token 2 forbidden: cutting the block at a drawn 2
    and sampling the residual of q keeps the committed token distributed as p (sampling p itself would give token 0
    three times in four)."""
    p = np.array([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    q = np.array([0.5, 0.0, 0.5])
    rng = np.random.default_rng(0)
    counts = np.zeros(3)
    n = 20000
    for _ in range(n):
        x = int(rng.choice(3, p=q))
        if x == 2:  # forbidden: cut, nothing verified, the residual at row 0
            k, t = rejection_accept(np.zeros(0, np.int64), np.zeros((0, 3)), p[:1], rng, final_q=q)
        else:
            k, t = rejection_accept(np.array([x]), q[None], p, rng)
            t = x if k == 1 else t
        counts[t] += 1
    assert abs(counts[0] / n - 0.5) < 0.015 and counts[2] == 0


def test_the_draft_skip_rule_leaves_seeded_sampled_rounds_alone(engine):
    """The skip rule reads measured times, so skipping would make a seeded sampled request's tokens depend on the
    machine's load: rounds with one always draft; other rounds follow the rule (here forced to skip)."""
    saved = engine.manifest.speculation.cost_table
    engine.profile(context=64, repeats=1)  # a cost table, so the rule is consulted
    ids = engine.encode_prompt(PROMPTS[0])
    params = SamplingParams(temperature=1.0)
    runs = []
    try:
        for seed in (5, None):
            gen = engine.batch(draft="lm", draft_length=3, max_batch=2, draft_skip=True)
            gen.skip.pays = lambda *a, **k: False  # the rule says drafting never pays
            r = gen.submit(ids, seed=seed, params=params, max_new_tokens=12)
            gen.run()
            runs.append((r.stats.proposed, gen.stats.draft_skipped))
    finally:
        engine.manifest.speculation.cost_table = saved
    assert runs[0][0] > 0 and runs[0][1] == 0  # seeded: drafted every round
    assert runs[1][0] == 0 and runs[1][1] > 0  # unseeded: skipped


def test_masked_rows_is_boolean_masking_bit_for_bit():
    from dspark_runtime.decoding.grammar import masked_rows

    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 1000)).astype(np.float32)
    x[0, 5] = -np.inf
    x[1, 7] = -0.0
    masks = [rng.random(1000) < f for f in (0.5, 0.999, 0.01)]
    ref = x.copy()
    for k, m in enumerate(masks):
        ref[k][~m] = -np.inf
    out = masked_rows(x, masks)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)) and not np.shares_memory(out, x)
    y = x.copy()
    assert masked_rows(y, masks, inplace=True) is y and np.array_equal(y.view(np.uint32), ref.view(np.uint32))
    with pytest.raises(ValueError, match="bool rows"):
        masked_rows(x, masks[:2])
