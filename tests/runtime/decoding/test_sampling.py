"""process_logits with partial selection against the full-sort reference (benchmarks/sampling_bench.py), on random
logits with ties, -inf entries, k >= vocab, p = 1.0 and tiny p; the top-p candidate search at every stage
(first candidate set, doubling, full-sort fallback, zero-mass tail); speculative sampling through the
processed distributions; and no full-vocabulary sort on the hot path."""
from __future__ import annotations

import numpy as np
import pytest

from dspark_runtime.decoding import sampling
from dspark_runtime.decoding.acceptance import rejection_accept
from dspark_runtime.decoding.sampling import SamplingParams, process_logits, sample
from benchmarks.sampling_bench import reference_process_logits as reference
from tests.runtime.decoding.test_acceptance import chisquare


def _logits(kind: str, rows: int, vocab: int, seed: int) -> np.ndarray:
    """float32 [rows, vocab] of one kind: normal, ties (integers: ties at every cut), neginf (70% masked,
    token 0 finite), flat (near-uniform: the nucleus is most of the row), spiky (a few tokens far ahead)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, vocab)) * 3
    if kind == "ties":
        x = np.round(x)
    elif kind == "neginf":
        x[rng.random(x.shape) < 0.7] = -np.inf
        x[:, 0] = 0.0
    elif kind == "flat":
        x *= 0.01
    elif kind == "spiky":
        x[:, rng.choice(vocab, size=min(5, vocab), replace=False)] += 15.0
    return x.astype(np.float32)


def assert_same_distribution(new: np.ndarray, ref: np.ndarray) -> None:
    """Same kept tokens exactly; the same probabilities to float64 rounding (they are bit-identical where
    numpy's exp and pairwise sums are deterministic, as on every machine tried)."""
    assert new.dtype == np.float64 and new.shape == ref.shape
    np.testing.assert_array_equal(new > 0, ref > 0)
    np.testing.assert_allclose(new, ref, rtol=1e-13, atol=1e-300)
    np.testing.assert_allclose(new.sum(-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("vocab", [7, 300, 5000])
@pytest.mark.parametrize("kind", ["normal", "ties", "neginf", "flat", "spiky"])
def test_matches_full_sort_reference(vocab, kind):
    x = _logits(kind, rows=4, vocab=vocab, seed=vocab)
    for temperature in (0.5, 1.3):
        for top_k in (0, 1, 3, 50, vocab - 1, vocab, vocab + 7):
            for top_p in (1.0, 0.9, 0.5, 1e-12):
                params = SamplingParams(temperature, top_k, top_p)
                assert_same_distribution(process_logits(x, params), reference(x, params))


@pytest.mark.parametrize("start", [1, 2, 16])
def test_top_p_candidate_doubling_matches_reference(monkeypatch, start):
    """A small first candidate set forces the doubling (and, for flat rows, the full-sort fallback)."""
    monkeypatch.setattr(sampling, "TOP_P_START", start)
    for kind in ("normal", "ties", "neginf", "flat"):
        x = _logits(kind, rows=5, vocab=400, seed=start)
        for top_p in (0.3, 0.9, 0.999999):
            for top_k in (0, 120):
                params = SamplingParams(1.0, top_k, top_p)
                assert_same_distribution(process_logits(x, params), reference(x, params))


def test_hand_values_ties_at_the_cuts():
    # top-k 3 over [2, 5, 5, 1, 5, 5]: the four 5s tie, the three lowest ids win.
    x = np.array([2.0, 5.0, 5.0, 1.0, 5.0, 5.0], dtype=np.float32)
    np.testing.assert_array_equal(process_logits(x, SamplingParams(1.0, top_k=3)), [0, 1 / 3, 1 / 3, 0, 1 / 3, 0])
    # top-p 0.5 on the same row: the 5s are 4 x 0.2458..; two of them reach 0.4917 < 0.5, a third is kept.
    probs = process_logits(x, SamplingParams(1.0, top_p=0.5))
    np.testing.assert_allclose(probs, [0, 1 / 3, 1 / 3, 0, 1 / 3, 0], rtol=1e-15)
    # tiny p: the top token alone, the lowest id among the tied maxima.
    np.testing.assert_array_equal(process_logits(x, SamplingParams(1.0, top_p=1e-12)), [0, 1, 0, 0, 0, 0])


def test_top_k_beyond_the_finite_entries_keeps_them_all():
    """k larger than the number of finite logits: every finite token, -inf ones get 0 (the tie among -inf
    at the cut does not matter)."""
    rng = np.random.default_rng(5)
    x = np.full((3, 4000), -np.inf, dtype=np.float32)
    for r in range(3):
        x[r, rng.choice(4000, 10, replace=False)] = rng.standard_normal(10)
    params = SamplingParams(0.8, top_k=50)
    probs = process_logits(x, params)
    assert (np.count_nonzero(probs, axis=-1) == 10).all()
    np.testing.assert_allclose(probs, process_logits(x, SamplingParams(0.8)), rtol=1e-14)
    assert_same_distribution(probs, reference(x, params))
    # top-p over a mostly -inf row: the candidate search stops at a zero-mass m-th value.
    params = SamplingParams(0.8, top_p=0.999999)
    assert_same_distribution(process_logits(x, params), reference(x, params))


def test_k_at_least_vocab_and_p_one_are_plain_softmax():
    x = _logits("normal", rows=3, vocab=1000, seed=9)
    plain = process_logits(x, SamplingParams(0.7))
    z = x.astype(np.float64) / 0.7
    e = np.exp(z - z.max(-1, keepdims=True))
    np.testing.assert_allclose(plain, e / e.sum(-1, keepdims=True), rtol=1e-13)
    for params in (SamplingParams(0.7, top_k=1000), SamplingParams(0.7, top_k=5000, top_p=1.0)):
        np.testing.assert_array_equal(process_logits(x, params), plain)


def test_other_dtypes_and_extreme_temperatures_match_reference():
    """float16 and float64 logits; temperatures where float64 division would merge float32 logits (then
    the cut ranks the scaled values, as the reference does)."""
    base = _logits("ties", rows=3, vocab=600, seed=11)
    for x in (base.astype(np.float16), base.astype(np.float64) + 1e-9 * np.arange(600)):
        for params in (SamplingParams(0.9, top_k=40), SamplingParams(0.9, top_p=0.8),
                       SamplingParams(0.9, top_k=40, top_p=0.8)):
            assert_same_distribution(process_logits(x, params), reference(x, params))
    for temperature in (1e-3, 1e255):
        for params in (SamplingParams(temperature, top_k=40), SamplingParams(temperature, top_k=40, top_p=0.5),
                       SamplingParams(temperature, top_p=0.5)):
            assert_same_distribution(process_logits(base, params), reference(base, params))


def test_batched_rows_equal_single_rows_whatever_the_search_depth(monkeypatch):
    """Rows decided at different candidate sizes in one call give what each gives alone."""
    monkeypatch.setattr(sampling, "TOP_P_START", 4)
    x = np.concatenate([_logits(k, rows=2, vocab=800, seed=3) for k in ("spiky", "normal", "flat", "neginf")])
    x = x.reshape(2, 4, 800)
    params = SamplingParams(1.0, top_p=0.95)
    batched = process_logits(x, params)
    for i in range(2):
        for j in range(4):
            np.testing.assert_array_equal(batched[i, j], process_logits(x[i, j], params))
    assert_same_distribution(batched, reference(x, params))


def test_no_full_vocabulary_sort(monkeypatch):
    """top-k, top-p and both on a 50,000-token row never argsort (or sort) a whole row: the cost is the
    partial selection (the old code sorted every row twice)."""
    vocab = 50_000
    x = _logits("spiky", rows=2, vocab=vocab, seed=1)
    sizes = []
    real_argsort, real_sort = np.argsort, np.sort

    def argsort(a, *args, **kw):
        sizes.append(np.shape(a)[-1])
        return real_argsort(a, *args, **kw)

    def sort(a, *args, **kw):
        sizes.append(np.shape(a)[-1])
        return real_sort(a, *args, **kw)

    monkeypatch.setattr(np, "argsort", argsort)
    monkeypatch.setattr(np, "sort", sort)
    for params in (SamplingParams(1.0, top_k=50), SamplingParams(1.0, top_p=0.9),
                   SamplingParams(1.0, top_k=50, top_p=0.9)):
        process_logits(x, params)
    assert sizes and max(sizes) < vocab // 10


def test_speculative_sampling_through_processed_distributions_is_lossless():
    """Draft and target distributions from process_logits (top-k / top-p on a 3,000-token vocabulary, the
    partial-selection path): one speculative step's committed token follows the processed target p."""
    vocab, trials = 3000, 10_000
    rng = np.random.default_rng(42)
    target_logits = rng.standard_normal(vocab).astype(np.float32)
    hot = rng.choice(vocab, 12, replace=False)
    target_logits[hot] += np.linspace(8.0, 11.0, 12, dtype=np.float32)
    draft_logits = target_logits + rng.standard_normal(vocab).astype(np.float32)
    p = process_logits(target_logits, SamplingParams(1.0, top_p=0.9))
    q = process_logits(draft_logits, SamplingParams(1.2, top_k=8))
    assert 3 <= np.count_nonzero(p) < 100 and np.count_nonzero(q) == 8
    draws = sample(np.broadcast_to(q, (trials, vocab)), rng)  # [trials] draft tokens from q
    pp = np.stack([p, p])  # the target at the draft position and the bonus position
    committed = np.empty(trials, dtype=np.int64)
    for t, d in enumerate(draws):
        n, nxt = rejection_accept(np.array([d]), q[None], pp, rng)
        committed[t] = d if n == 1 else nxt
    counts = np.bincount(committed, minlength=vocab)
    assert counts[p == 0].sum() == 0  # never a token the processed target excludes
    support = np.flatnonzero(p)
    assert (p[support] * trials).min() >= 5  # chi-square approximation valid on every cell
    assert chisquare(counts[support], p[support] * trials)[1] > 1e-3
