"""Token selection and draft acceptance: hand-built cases plus a statistical losslessness test.

No models: every distribution is written out here. All randomness is seeded, so the suite is
deterministic.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from dspark_runtime.decoding.acceptance import greedy_accept, rejection_accept
from dspark_runtime.errors import InputError
from dspark_runtime.decoding.sampling import SamplingParams, process_logits, sample


def onehot(index: int, vocab: int) -> np.ndarray:
    row = np.zeros(vocab)
    row[index] = 1.0
    return row


def logits_with_argmax(argmaxes: list[int], vocab: int) -> np.ndarray:
    """float32 [len(argmaxes), vocab] whose row k has its unique maximum at argmaxes[k]."""
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(len(argmaxes), vocab)).astype(np.float32)
    for k, a in enumerate(argmaxes):
        logits[k, a] = logits[k].max() + 1.0
    return logits


# ---------------------------------------------------------------------------- greedy_accept


def test_greedy_all_accepted_takes_bonus():
    logits = logits_with_argmax([3, 1, 4, 2], vocab=6)
    assert greedy_accept(np.array([3, 1, 4]), logits) == (3, 2)


def test_greedy_first_rejected():
    logits = logits_with_argmax([3, 1, 4, 2], vocab=6)
    assert greedy_accept(np.array([0, 1, 4]), logits) == (0, 3)


def test_greedy_middle_rejected():
    logits = logits_with_argmax([3, 1, 4, 2], vocab=6)
    # Only the first mismatch counts: the draft at position 2 matches but comes after it.
    assert greedy_accept(np.array([3, 5, 4]), logits) == (1, 1)


def test_greedy_empty_draft_gives_bonus_only():
    logits = logits_with_argmax([5], vocab=6)
    n, nxt = greedy_accept(np.zeros(0, dtype=np.int64), logits)
    assert (n, nxt) == (0, 5)
    assert isinstance(n, int) and isinstance(nxt, int)


def test_greedy_ties_go_to_lowest_id():
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=np.float32)
    assert greedy_accept(np.array([1]), logits) == (1, 0)  # 1 is the tie-broken argmax
    assert greedy_accept(np.array([2]), logits) == (0, 1)  # 2 ties with 1 but loses


def test_greedy_rejects_bad_shapes_and_tokens():
    logits = logits_with_argmax([0, 0], vocab=4)
    with pytest.raises(ValueError, match="l \\+ 1"):
        greedy_accept(np.array([0, 0]), logits)
    with pytest.raises(ValueError, match="\\[0, 4\\)"):
        greedy_accept(np.array([4]), logits)
    with pytest.raises(ValueError, match="integer"):
        greedy_accept(np.array([0.0]), logits)


# ---------------------------------------------------------------------------- SamplingParams


def test_params_defaults_are_greedy_and_valid():
    params = SamplingParams()
    params.validate()
    assert params.greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"temperature": -0.5}, r"temperature must be a finite number >= 0.*-0\.5"),
        ({"temperature": float("nan")}, r"temperature.*nan"),
        ({"temperature": float("inf")}, r"temperature.*inf"),
        ({"top_k": -1}, r"top_k must be an integer >= 0.*-1"),
        ({"top_k": 2.5}, r"top_k must be an integer >= 0.*2\.5"),
        ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\].*0\.0"),
        ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\].*1\.5"),
        ({"top_p": -0.1}, r"top_p must be a number in \(0, 1\].*-0\.1"),
    ],
)
def test_params_validate_names_value_and_range(kwargs, needle):
    params = SamplingParams(**kwargs)
    with pytest.raises(InputError, match=needle):
        params.validate()
    with pytest.raises(InputError, match=needle):  # process_logits validates too
        process_logits(np.zeros(3, dtype=np.float32), params)


# ---------------------------------------------------------------------------- process_logits


def test_temperature_scaling_matches_hand_computation():
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    probs = process_logits(logits, SamplingParams(temperature=0.5))
    e = [math.exp(2.0), math.exp(4.0), math.exp(6.0)]  # logits / 0.5
    expected = np.array(e) / sum(e)
    np.testing.assert_allclose(probs, expected, rtol=1e-12)
    assert probs.dtype == np.float64

    probs_hot = process_logits(logits, SamplingParams(temperature=2.0))
    e = [math.exp(0.5), math.exp(1.0), math.exp(1.5)]
    np.testing.assert_allclose(probs_hot, np.array(e) / sum(e), rtol=1e-12)


def test_softmax_is_stable_for_huge_logits_and_masks_neg_inf():
    logits = np.array([1e30, 1e30 - 1e24, -np.inf, 0.0], dtype=np.float32)
    probs = process_logits(logits, SamplingParams(temperature=1e-3))
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(probs, [1.0, 0.0, 0.0, 0.0])


def test_top_k_keeps_exactly_k_with_ties_to_lowest_id():
    logits = np.array([1.0, 3.0, 3.0, 2.0, 3.0], dtype=np.float32)
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.flatnonzero(probs).tolist() == [1, 2]
    np.testing.assert_allclose(probs[[1, 2]], [0.5, 0.5])

    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=4))
    assert np.flatnonzero(probs).tolist() == [1, 2, 3, 4]
    e = np.exp([3.0, 3.0, 2.0, 3.0])
    np.testing.assert_allclose(probs[[1, 2, 3, 4]], e / e.sum(), rtol=1e-12)

    # top_k >= vocab is a no-op.
    full = process_logits(logits, SamplingParams(temperature=1.0))
    np.testing.assert_array_equal(process_logits(logits, SamplingParams(1.0, top_k=5)), full)
    np.testing.assert_array_equal(process_logits(logits, SamplingParams(1.0, top_k=50)), full)


def test_top_k_exactly_k_on_random_rows():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 3, 50)).astype(np.float32)
    probs = process_logits(logits, SamplingParams(temperature=0.8, top_k=7))
    assert (np.count_nonzero(probs, axis=-1) == 7).all()
    np.testing.assert_allclose(probs.sum(-1), 1.0)
    # The kept tokens are the 7 largest logits.
    kept_min = np.where(probs > 0, logits, np.inf).min(-1)
    dropped_max = np.where(probs == 0, logits, -np.inf).max(-1)
    assert (kept_min > dropped_max).all()


def test_top_p_exact_boundary_with_dyadic_probabilities():
    logits = np.zeros(4, dtype=np.float32)  # uniform: probabilities exactly 0.25
    def kept(top_p):
        probs = process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
        return np.flatnonzero(probs).tolist()

    assert kept(0.25) == [0]  # the top token alone reaches 0.25 exactly
    assert kept(0.5) == [0, 1]  # mass exactly 0.5: boundary is inclusive, ties to lowest id
    assert kept(np.nextafter(0.5, 1.0)) == [0, 1, 2]  # a hair over needs a third token
    assert kept(np.nextafter(0.5, 0.0)) == [0, 1]
    assert kept(0.75) == [0, 1, 2]
    assert kept(1.0) == [0, 1, 2, 3]
    assert kept(1e-9) == [0]  # the top token is always kept
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    np.testing.assert_array_equal(probs, [0.5, 0.5, 0.0, 0.0])


def test_top_p_boundary_on_computed_mass():
    logits = np.array([0.5, 2.0, -1.0, 1.0, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0)
    full = process_logits(logits, params)
    order = np.argsort(-full, kind="stable")
    assert order.tolist() == [1, 3, 0, 4, 2]
    mass2 = full[1] + full[3]  # mass of the two most probable tokens, as computed
    at = process_logits(logits, SamplingParams(temperature=1.0, top_p=float(mass2)))
    assert np.flatnonzero(at).tolist() == [1, 3]
    np.testing.assert_allclose(at[[1, 3]], full[[1, 3]] / mass2, rtol=1e-12)
    over = process_logits(logits, SamplingParams(1.0, top_p=float(np.nextafter(mass2, 1))))
    assert np.flatnonzero(over).tolist() == [0, 1, 3]
    # top_p below the top token's mass keeps just the top token (a point mass).
    tiny = process_logits(logits, SamplingParams(1.0, top_p=float(full[1]) / 2))
    np.testing.assert_array_equal(tiny, onehot(1, 5))


def test_top_k_then_top_p_renormalises_between():
    # After top_k=2 the survivors are 0.5/0.5; top_p=0.5 then keeps exactly one of them.
    # (Without the renormalisation after top-k, 0.5 of the full mass would need more tokens.)
    logits = np.array([2.0, 2.0, 1.9, 1.9], dtype=np.float32)
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    np.testing.assert_array_equal(probs, [1.0, 0.0, 0.0, 0.0])


def test_greedy_process_logits_is_one_hot_argmax_and_ignores_top_k_p():
    logits = np.array([[0.1, 5.0, 5.0, -1.0], [-np.inf, -2.0, -3.0, -np.inf]], dtype=np.float32)
    for params in (SamplingParams(), SamplingParams(temperature=0.0, top_k=1, top_p=0.1)):
        probs = process_logits(logits, params)
        np.testing.assert_array_equal(probs, [onehot(1, 4), onehot(1, 4)])


def test_process_logits_batched_equals_per_row():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 3, 11)).astype(np.float32)
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.8)
    batched = process_logits(logits, params)
    for i in range(2):
        for j in range(3):
            np.testing.assert_array_equal(batched[i, j], process_logits(logits[i, j], params))


def test_process_logits_rejects_bad_logits():
    params = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="NaN"):
        process_logits(np.array([0.0, np.nan], dtype=np.float32), params)
    with pytest.raises(ValueError, match="entirely -inf"):
        process_logits(np.array([[0.0, 1.0], [-np.inf, -np.inf]], dtype=np.float32), params)
    with pytest.raises(ValueError, match="vocab"):
        process_logits(np.zeros((2, 0), dtype=np.float32), params)
    with pytest.raises(ValueError, match="floating"):
        process_logits(np.array([1, 2, 3]), params)


# ---------------------------------------------------------------------------- sample


def test_sample_point_mass_and_zero_probability_tokens():
    rng = np.random.default_rng(0)
    assert all(sample(onehot(3, 6), rng) == 3 for _ in range(100))
    probs = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    draws = sample(np.broadcast_to(probs, (10_000, 5)), rng)
    assert draws.shape == (10_000,) and draws.dtype == np.int64
    assert set(np.unique(draws).tolist()) == {1, 3}


class _FixedUniform:
    """A stand-in generator whose random() always returns one value."""

    def __init__(self, value: float):
        self.value = value

    def random(self, size=None):
        return np.full(size, self.value) if size is not None else self.value


def test_sample_clamps_rounding_at_the_top_to_a_positive_token():
    probs = np.array([0.1, 0.2, 0.3, 0.4, 0.0, 0.0])
    assert sample(probs, _FixedUniform(np.nextafter(1.0, 0.0))) == 3
    # Even u == total (which rounding can produce) stays in range and off zero-mass tokens.
    assert sample(probs, _FixedUniform(1.0)) == 3
    assert sample(probs, _FixedUniform(0.0)) == 0
    assert sample(np.array([0.0, 0.0, 1.0]), _FixedUniform(0.0)) == 2
    # Unnormalised rows are fine: u is scaled by the row's total.
    assert sample(np.array([2.0, 2.0]), _FixedUniform(0.49)) == 0
    assert sample(np.array([2.0, 2.0]), _FixedUniform(0.5)) == 1


def test_sample_rejects_invalid_probs():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="sums to 0"):
        sample(np.zeros(3), rng)
    with pytest.raises(ValueError, match="non-negative"):
        sample(np.array([0.5, -0.1, 0.6]), rng)


def test_sample_frequencies_match_probs():
    rng = np.random.default_rng(11)
    probs = np.array([0.05, 0.4, 0.25, 0.0, 0.3])
    draws = sample(np.broadcast_to(probs, (40_000, 5)), rng)
    observed = np.bincount(draws, minlength=5)
    assert observed[3] == 0
    support = probs > 0
    _, pvalue = chisquare(observed[support], 40_000 * probs[support])
    assert pvalue > 1e-3


# ---------------------------------------------------------------------------- rejection_accept


def test_rejection_q_equals_p_always_accepts_all():
    rng_rows = np.random.default_rng(5)
    p = rng_rows.dirichlet(np.ones(8), size=4)  # [l + 1 = 4, vocab = 8]
    q = p[:3].copy()
    for seed in range(300):
        rng = np.random.default_rng(seed)
        draft = sample(q, rng)
        n, nxt = rejection_accept(draft, q, p, rng)
        assert n == 3
        assert 0 <= nxt < 8


def test_rejection_zero_target_mass_always_rejects_and_uses_residual():
    # p(0) == 0 while the draft proposed 0: never accepted. Residual max(p - q, 0) = [0, 0, .5]
    # is a point mass on token 2, so the correction is always 2.
    p = np.array([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    q = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    for seed in range(300):
        assert rejection_accept(np.array([0, 1]), q, p, np.random.default_rng(seed)) == (0, 2)


def test_rejection_residual_distribution_after_rejection():
    # Rejection at position 0 happens with probability 1 (p(1) = 0); the correction must follow
    # norm(max(p - q, 0)) = norm([0.3, 0, 0.1, 0.2]) = [1/2, 0, 1/6, 1/3].
    p = np.array([[0.4, 0.0, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25]])
    q = np.array([[0.1, 0.6, 0.2, 0.1]])
    rng = np.random.default_rng(9)
    results = [rejection_accept(np.array([1]), q, p, rng) for _ in range(6000)]
    assert {n for n, _ in results} == {0}
    observed = np.bincount([t for _, t in results], minlength=4)
    assert observed[1] == 0
    _, pvalue = chisquare(observed[[0, 2, 3]], 6000 * np.array([1 / 2, 1 / 6, 1 / 3]))
    assert pvalue > 1e-3


def test_rejection_zero_draft_probability_is_rejected_not_nan():
    # The drafter claims q(2) == 0 yet proposed 2: undefined ratio, defined as a rejection.
    p = np.array([[0.2, 0.2, 0.6], [0.3, 0.3, 0.4]])
    q = np.array([[0.5, 0.5, 0.0]])
    for seed in range(200):
        n, nxt = rejection_accept(np.array([2]), q, p, np.random.default_rng(seed))
        assert n == 0
        assert nxt == 2  # residual max(p - q, 0) = [0, 0, 0.6]
    # If p == q as well, the residual is empty and the correction comes from p.
    p_same = np.array([[0.5, 0.5, 0.0], [0.3, 0.3, 0.4]])
    for seed in range(200):
        n, nxt = rejection_accept(np.array([2]), q, p_same, np.random.default_rng(seed))
        assert n == 0 and nxt in (0, 1)


def test_rejection_point_mass_draft():
    # Deterministic drafter (n-gram): q = one-hot(1). Accept with probability p(1) = 0.5;
    # on rejection the correction is p without token 1, renormalised: [0.4, 0, 0.6].
    p = np.array([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8]])
    q = onehot(1, 3)[None, :]
    rng = np.random.default_rng(21)
    results = [rejection_accept(np.array([1]), q, p, rng) for _ in range(8000)]
    accepted = np.array([n for n, _ in results])
    assert set(accepted.tolist()) <= {0, 1}
    assert abs(accepted.mean() - 0.5) < 0.03  # sd = 0.0056
    corrections = np.bincount([t for n, t in results if n == 0], minlength=3)
    assert corrections[1] == 0
    frac0 = corrections[0] / corrections.sum()
    assert abs(frac0 - 0.4) < 0.04  # sd = 0.0077
    bonus = np.bincount([t for n, t in results if n == 1], minlength=3)
    assert bonus[2] > bonus[0] and bonus[2] > bonus[1]  # bonus drawn from p[1]


def test_rejection_one_hot_p_and_q_equals_greedy():
    rng = np.random.default_rng(2)
    for _ in range(200):
        l = int(rng.integers(0, 5))
        logits = rng.normal(size=(l + 1, 6)).astype(np.float32)
        target = np.argmax(logits, axis=-1)
        # Drafts mostly agree with the target so that long prefixes are accepted too.
        draft = np.where(rng.random(l) < 0.7, target[:l], rng.integers(0, 6, size=l))
        greedy = SamplingParams()
        p = process_logits(logits, greedy)
        q = np.eye(6)[draft]  # [l, 6] one-hot rows
        assert rejection_accept(draft, q, p, rng) == greedy_accept(draft, logits)


def test_rejection_empty_draft_samples_bonus_from_p0():
    p = np.array([[0.0, 0.0, 1.0, 0.0]])
    n, nxt = rejection_accept(np.zeros(0, np.int64), np.zeros((0, 4)), p, np.random.default_rng(0))
    assert (n, nxt) == (0, 2)
    assert isinstance(n, int) and isinstance(nxt, int)


def test_rejection_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    p = np.full((3, 4), 0.25)
    q = np.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_accept(np.array([0, 1]), q, p[:2], rng)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_accept(np.array([0, 1]), q[:1], p, rng)
    with pytest.raises(ValueError, match="\\[0, 4\\)"):
        rejection_accept(np.array([0, -1]), q, p, rng)


# ---------------------------------------------------------------------------- losslessness
#
# A toy "language model" over 5 tokens whose next-token distribution depends on the previous
# token: the target is the transition matrix P, the drafter the different matrix Q. Speculative
# sampling with gamma = 3 must produce the first two tokens with exactly the target's joint law
# P[x0, a] * P[a, b], whatever Q is. Q's rows cover the awkward cases: Q proposes a token P
# forbids (row 1), Q never proposes a token P allows (row 2), Q == P (row 3), point mass (row 4).

VOCAB, GAMMA, ANCHOR = 5, 3, 0
P = np.array(
    [
        [0.30, 0.25, 0.20, 0.15, 0.10],
        [0.10, 0.40, 0.00, 0.30, 0.20],
        [0.05, 0.15, 0.50, 0.20, 0.10],
        [0.25, 0.25, 0.25, 0.00, 0.25],
        [0.40, 0.05, 0.05, 0.10, 0.40],
    ]
)
Q = np.array(
    [
        [0.10, 0.10, 0.30, 0.40, 0.10],
        [0.20, 0.20, 0.40, 0.10, 0.10],
        [0.00, 0.30, 0.20, 0.30, 0.20],
        [0.25, 0.25, 0.25, 0.00, 0.25],
        [1.00, 0.00, 0.00, 0.00, 0.00],
    ]
)
TRIALS = 30_000


def _simulate_first_two(accept, trials: int, seed: int) -> np.ndarray:
    """Run speculative decoding from ANCHOR until two tokens are committed, `trials` times.

    Drafting is vectorised over trials; verification calls `accept` per trial. Returns the
    int64 [VOCAB, VOCAB] counts of (token1, token2).
    """
    rng = np.random.default_rng(seed)
    out = np.full((trials, 2), -1, dtype=np.int64)
    n_out = np.zeros(trials, dtype=np.int64)
    ctx = np.full(trials, ANCHOR, dtype=np.int64)
    active = np.arange(trials)
    while active.size:
        drafts = np.empty((active.size, GAMMA), dtype=np.int64)
        prev = ctx[active]
        for j in range(GAMMA):
            drafts[:, j] = sample(Q[prev], rng)
            prev = drafts[:, j]
        for i, t in enumerate(active):
            d = drafts[i]
            prefix = np.concatenate([[ctx[t]], d])  # [anchor, x_1, .., x_gamma]
            n, nxt = accept(d, Q[prefix[:-1]], P[prefix], rng)
            for tok in [*d[:n].tolist(), nxt]:
                if n_out[t] < 2:
                    out[t, n_out[t]] = tok
                    n_out[t] += 1
            ctx[t] = nxt
        active = active[n_out[active] < 2]
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    np.add.at(counts, (out[:, 0], out[:, 1]), 1)
    return counts


def _target_joint_test(counts: np.ndarray) -> float:
    """Chi-square p-value of the (token1, token2) counts against P[ANCHOR, a] * P[a, b].

    Cells the target forbids must be empty (else p-value 0); they are left out of the test.
    """
    expected = P[ANCHOR][:, None] * P  # [VOCAB, VOCAB]
    support = expected > 0
    if counts[~support].any():
        return 0.0
    n = counts.sum()
    assert (n * expected[support]).min() >= 5  # chi-square approximation is valid
    return chisquare(counts[support], n * expected[support])[1]


def test_speculative_sampling_is_lossless():
    counts = _simulate_first_two(rejection_accept, TRIALS, seed=2024)
    assert counts.sum() == TRIALS
    assert _target_joint_test(counts) > 1e-3


def _always_accept(draft_tokens, draft_probs, target_probs, rng):
    return len(draft_tokens), int(sample(target_probs[-1], rng))


def _resample_from_target(draft_tokens, draft_probs, target_probs, rng):
    """The classic bug: after a rejection, draw from p instead of norm(max(p - q, 0))."""
    for k, x in enumerate(draft_tokens):
        q_x, p_x = draft_probs[k, x], target_probs[k, x]
        if not (q_x > 0 and rng.random() < p_x / q_x):
            return k, int(sample(target_probs[k], rng))
    return len(draft_tokens), int(sample(target_probs[-1], rng))


@pytest.mark.parametrize("wrong", [_always_accept, _resample_from_target])
def test_losslessness_test_has_power(wrong):
    counts = _simulate_first_two(wrong, TRIALS, seed=2024)
    assert _target_joint_test(counts) < 1e-6


# ---------------------------------------------------------------------------- chi-square


def _chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution for an integer df (closed forms)."""
    if df % 2 == 0:  # exp(-x/2) * sum_{i < df/2} (x/2)^i / i!
        term = total = 1.0
        for i in range(1, df // 2):
            term *= (x / 2) / i
            total += term
        return math.exp(-x / 2) * total
    # erfc(sqrt(x/2)) + sqrt(2x/pi) exp(-x/2) * sum_{i=1}^{(df-1)/2} x^(i-1) / (2i-1)!!
    total, term = 0.0, 1.0
    for i in range(1, (df - 1) // 2 + 1):
        if i > 1:
            term *= x / (2 * i - 1)
        total += term
    return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2) * total


def chisquare(observed, expected) -> tuple[float, float]:
    """Pearson's chi-square goodness of fit: (statistic, p-value) with df = cells - 1.

    scipy.stats.chisquare when scipy is installed (it is not a project dependency); otherwise
    the same statistic with the closed-form survival function above.
    """
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    try:
        from scipy.stats import chisquare as scipy_chisquare
    except ImportError:
        stat = float(((observed - expected) ** 2 / expected).sum())
        return stat, _chi2_sf(stat, observed.size - 1)
    result = scipy_chisquare(observed, expected)
    return float(result.statistic), float(result.pvalue)


def test_fallback_chi2_sf_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 21, 22):
        for x in (0.3, 1.0, 5.0, 20.0, 60.0):
            assert _chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9, abs=1e-300)
