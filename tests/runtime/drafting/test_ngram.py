"""n-gram prompt lookup: the pure lookup, and exactness end to end (greedy and sampled)."""
import numpy as np
import pytest

from dspark_runtime.drafting.drafters import ngram_lookup


def test_lookup_prefers_longest_and_most_recent_match():
    ctx = np.array([5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7], dtype=np.int64)
    # last 2 tokens (6, 7) occur at 1 and 6; the most recent earlier one (6) is followed by 3, 4
    assert ngram_lookup(ctx, 3, max_ngram=2) == [3, 4, 2]
    # with 3-grams: (2, 6, 7) never occurred before -> fall back to the 2-gram
    assert ngram_lookup(ctx, 2, max_ngram=3) == [3, 4]
    ctx2 = np.array([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], dtype=np.int64)
    # the 3-gram (1, 2, 3) at 0 wins over the more recent 2-gram (2, 3) at 4
    assert ngram_lookup(ctx2, 2, max_ngram=3) == [9, 2]


def test_lookup_misses_and_truncation():
    assert ngram_lookup(np.array([1, 2, 3, 4], dtype=np.int64), 5) == []
    assert ngram_lookup(np.array([7], dtype=np.int64), 5) == []
    # continuation runs into the end of the context: fewer than gamma tokens
    assert ngram_lookup(np.array([4, 5, 4], dtype=np.int64), 5) == [5, 4]
    assert ngram_lookup(np.array([4, 5, 4], dtype=np.int64), 5, min_ngram=2) == []


@pytest.fixture(scope="module")
def engine(tiny_engine_dir):
    from dspark_runtime import Engine

    return Engine.load(tiny_engine_dir, threads=1)


@pytest.mark.parametrize("gamma", [2, 5])
def test_ngram_speculation_is_exact(engine, gamma):
    prompt = "for i in range(10):\n    print(i * i)\n" * 3
    ref = engine.generate(prompt, max_new_tokens=48, draft=None)
    spec = engine.generate(prompt, max_new_tokens=48, draft="ngram", draft_length=gamma)
    assert spec.token_ids == ref.token_ids
    assert spec.stats.drafter == "ngram" and spec.stats.proposed > 0


def test_ngram_sampled_is_reproducible(engine):
    prompt = "for i in range(10):\n    print(i * i)\n" * 3
    a = engine.generate(prompt, max_new_tokens=32, temperature=1.0, seed=5, draft="ngram")
    b = engine.generate(prompt, max_new_tokens=32, temperature=1.0, seed=5, draft="ngram")
    assert a.token_ids == b.token_ids
