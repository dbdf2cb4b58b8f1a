"""process_logits with partial selection against the full-sort reference (benchmarks/sampling_bench.py), on random
logits with ties, -inf entries, k >= vocab, p = 1.0 and tiny p; the top-p candidate search at every stage
(first candidate set, doubling, full-sort fallback, zero-mass tail); bit for bit, the candidate cuts (top-k
group maxima, top-p probability cuts at every tier, the binned search and its exact fallback, the whole-row
fallback) on LM-head-like and adversarial rows; speculative sampling through the processed distributions; and
no full-vocabulary sort on the hot path."""
from __future__ import annotations

import numpy as np
import pytest

from dspark_runtime.decoding import truncation
from dspark_runtime.decoding.acceptance import rejection_accept
from dspark_runtime.decoding.sampling import SamplingParams, process_logits, sample
from benchmarks.sampling_bench import lm_head_logits, reference_process_logits as reference
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
    """A small TOP_P_START: more than 2 * start candidates send a row to the binned search, fewer to the
    candidate sort; the doubling itself is pinned by the whole-row fallback test."""
    monkeypatch.setattr(truncation, "TOP_P_START", start)
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
    monkeypatch.setattr(truncation, "TOP_P_START", 4)
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


# The candidate cuts (top-k: group maxima, truncation._top_k_columns; top-p: probability cuts,
# truncation._top_p_candidates) against the reference, bit for bit, on the cases that decide them.

def assert_bit_exact(new: np.ndarray, ref: np.ndarray) -> None:
    assert new.dtype == np.float64 and new.shape == ref.shape
    np.testing.assert_array_equal(new, ref)  # every float64 bit, zeros included


def _spy(monkeypatch, name: str) -> list:
    """Record the width (last axis) of every call of truncation.<name>."""
    widths, real = [], getattr(truncation, name)

    def spy(values, *args):
        widths.append(np.shape(values)[-1])
        return real(values, *args)

    monkeypatch.setattr(truncation, name, spy)
    return widths


def test_verify_block_of_lm_head_logits_is_bit_exact_and_takes_the_candidate_paths(monkeypatch):
    """8 rows x 151,936 spread like a real LM head's (the benchmark's generator): top-p ranks candidate
    sets of at most 2 * TOP_P_START tokens, top-k ranks far less than the row, and every kept float64
    equals the full-sort reference's."""
    vocab = 151_936
    x = lm_head_logits(8, vocab, seed=3)
    nucleus_widths, select_widths = _spy(monkeypatch, "_nucleus"), _spy(monkeypatch, "_top_k_select")
    for params in (SamplingParams(1.0, top_p=0.9), SamplingParams(0.7, top_p=0.99),
                   SamplingParams(1.0, top_k=50, top_p=0.9), SamplingParams(1.0, top_k=50),
                   SamplingParams(1.3)):
        assert_bit_exact(process_logits(x, params), reference(x, params))
    assert nucleus_widths and max(nucleus_widths) <= 2 * truncation.TOP_P_START
    assert select_widths and max(select_widths) < vocab // 100


@pytest.mark.parametrize("kind", ["normal", "ties", "neginf", "flat", "spiky"])
@pytest.mark.parametrize("tail", [1, 64, 10**9])
def test_top_p_cuts_at_every_tier_are_bit_exact(monkeypatch, kind, tail):
    """TOP_P_TAIL 1 and 64: the first cuts keep only tokens above (1 - top_p) / 2 (/ 128) and often fail,
    so later ones (16 times the tail each, the last the vocabulary) decide; 10**9: a single cut. Tiny
    top_p, top_p near 1 and, for integer logits, ties at the cut."""
    monkeypatch.setattr(truncation, "TOP_P_TAIL", tail)
    x = _logits(kind, rows=4, vocab=6000, seed=tail % 97)
    for temperature in (1.0, 0.6):
        for top_p in (5e-324, 1e-12, 0.3, 0.9, 0.999, 1 - 1e-9):
            params = SamplingParams(temperature, top_p=top_p)
            assert_bit_exact(process_logits(x, params), reference(x, params))


@pytest.mark.parametrize("start", [1024, 16])
def test_top_p_whole_row_fallback_when_the_cut_cannot_be_shown(monkeypatch, start):
    """top_p within the rounding margin of 1 (and a row mostly -inf): no candidate cut can show the
    nucleus inside it, so the whole divided row is searched (with start 16, by the doubling search);
    still the reference's bits."""
    monkeypatch.setattr(truncation, "TOP_P_START", start)
    widths = _spy(monkeypatch, "_nucleus")
    x = np.concatenate([_logits("normal", rows=2, vocab=3000, seed=4), _logits("neginf", rows=2, vocab=3000, seed=4)])
    for top_p in (1 - 1e-13, float(np.nextafter(1.0, 0.0))):
        widths.clear()
        params = SamplingParams(1.0, top_p=top_p)
        assert_bit_exact(process_logits(x, params), reference(x, params))
        assert 3000 in widths  # the whole-row fallback ran
    widths.clear()
    params = SamplingParams(1.0, top_p=0.9)
    assert_bit_exact(process_logits(x, params), reference(x, params))
    assert 3000 not in widths  # ...and only there


def test_top_p_ties_straddling_the_cut_keep_the_lowest_ids():
    """A leader and 400 tokens tied at the next value, spread over the row: the cut falls inside the tie,
    so the kept tied tokens are the lowest ids (the stable sort's order); bit-exact."""
    rng = np.random.default_rng(8)
    vocab = 50_000
    x = (rng.standard_normal((3, vocab)) * 2.0).astype(np.float32)
    tied = np.sort(rng.choice(vocab, 400, replace=False))
    x[:, tied] = 12.0
    x[:, tied[200]] = 14.0  # the leader, in the middle of the tied ids
    x[2, tied[:3]] = -np.inf
    for top_p in (0.05, 0.3, 0.5, 0.8):
        params = SamplingParams(1.0, top_p=top_p)
        probs = process_logits(x, params)
        assert_bit_exact(probs, reference(x, params))
        kept = np.flatnonzero(probs[0] > 0)
        kept_tied = np.setdiff1d(kept, [tied[200]])
        assert np.array_equal(kept_tied, np.setdiff1d(tied, [tied[200]])[: kept_tied.size])
        assert 1 < kept.size < 400


def test_top_k_group_preselection_matches_reference_bit_for_bit(monkeypatch):
    """k well below the number of groups (the pre-selection runs): ties at the k-th key, -inf, a row
    with fewer finite keys than k (the k-th group maximum is -inf: whole row), a constant row (every
    key a candidate: whole row), float16 / float64 logits, and top-p after top-k."""
    select_widths = _spy(monkeypatch, "_top_k_select")
    vocab = 20_000  # 312 groups of 64 and a tail of 32 single columns
    x = np.concatenate([_logits(kind, rows=2, vocab=vocab, seed=21) for kind in ("normal", "ties", "neginf", "spiky")])
    few = np.full((1, vocab), -np.inf, dtype=np.float32)
    few[0, [5, 700, 19_990]] = [1.0, 2.0, 2.0]  # 3 finite keys, two in the tail columns
    const = np.full((1, vocab), 0.5, dtype=np.float32)
    x = np.concatenate([x, few, const])
    for k in (1, 7, 50, 150):
        for top_p in (1.0, 0.9, 1e-12):
            params = SamplingParams(0.8, top_k=k, top_p=top_p)
            assert_bit_exact(process_logits(x, params), reference(x, params))
    assert min(select_widths) < vocab // 4 and vocab in select_widths  # candidate sets and the whole-row rows
    for dtype in (np.float16, np.float64):
        xd = _logits("ties", rows=3, vocab=vocab, seed=5).astype(dtype)
        for params in (SamplingParams(1.0, top_k=40), SamplingParams(0.9, top_k=40, top_p=0.7)):
            assert_bit_exact(process_logits(xd, params), reference(xd, params))


def test_binned_nucleus_on_wide_candidate_sets_is_bit_exact(monkeypatch):
    """Nuclei of thousands of tokens (N(0, 3^2) logits at temperature 1, 2 x 151,936) and, with a small
    TOP_P_START, every kind of row: the candidates are cut by value bins, not sorted."""
    results = []
    real = truncation._binned_nucleus

    def spy(probs, *args):
        results.append(real(probs, *args))
        return results[-1]

    monkeypatch.setattr(truncation, "_binned_nucleus", spy)
    x = _logits("normal", rows=2, vocab=151_936, seed=12)
    params = SamplingParams(1.0, top_p=0.9)
    probs = process_logits(x, params)
    assert_bit_exact(probs, reference(x, params))
    assert len(results) == 2 and all(r is not None and r.size > 1000 for r in results)
    assert (np.count_nonzero(probs, axis=-1) > 1000).all()
    monkeypatch.setattr(truncation, "TOP_P_START", 4)
    results.clear()
    for kind in ("normal", "ties", "neginf", "flat", "spiky"):
        x = _logits(kind, rows=3, vocab=4000, seed=13)
        for temperature in (1.0, 0.5):
            for top_p in (1e-12, 0.2, 0.5, 0.9, 0.999):
                params = SamplingParams(temperature, top_p=top_p)
                assert_bit_exact(process_logits(x, params), reference(x, params))
    assert sum(r is not None for r in results) > 50


def test_binned_nucleus_defers_a_running_sum_at_top_p_to_the_exact_search(monkeypatch):
    """Eight equal tokens (probability 1/8 exactly) at top_p 0.5: the fourth one's running sum is exactly
    top_p, inside the rounding margin, so the bins cannot decide and the exact search keeps four."""
    monkeypatch.setattr(truncation, "TOP_P_START", 2)
    widths = _spy(monkeypatch, "_nucleus")
    x = np.full((1, 1000), -np.inf, dtype=np.float32)
    x[0, [3, 50, 51, 400, 401, 700, 998, 999]] = 2.5
    params = SamplingParams(1.0, top_p=0.5)
    probs = process_logits(x, params)
    assert_bit_exact(probs, reference(x, params))
    np.testing.assert_array_equal(np.flatnonzero(probs[0]), [3, 50, 51, 400])
    assert widths == [8]  # the binned search returned None; the candidates were searched exactly
