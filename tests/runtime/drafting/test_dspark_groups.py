"""The DSpark drafter's call partition (dspark_runtime.drafting.dspark.context_groups): pure logic, no models."""

import pytest

from dspark_runtime.drafting.dspark import context_groups


def _cost(groups, counts, block, overhead):
    return sum(len(g) * (max(counts[i] for i in g) + block) + overhead for g in groups)


def test_even_rows_share_one_call_and_a_joining_prompt_gets_its_own():
    assert context_groups([1, 1, 2, 1], block=7, overhead=32) == [[2, 0, 1, 3]]
    # 8 decoding rows beside a 300-token prompt: one call would compute 9 x 307 = 2,763 positions, two 307 + 8 x 9
    groups = context_groups([1, 1, 300, 2, 1, 1, 1, 1, 1], block=7, overhead=32)
    assert groups == [[2], [3, 0, 1, 4, 5, 6, 7, 8]]
    assert _cost(groups, [1, 1, 300, 2, 1, 1, 1, 1, 1], 7, 32) == 307 + 32 + 8 * 9 + 32
    # splitting does not pay when the prompt is short next to the call overhead
    assert context_groups([1, 20, 1], block=7, overhead=64) == [[1, 0, 2]]
    assert context_groups([], block=7) == [] and context_groups([5], block=7) == [[0]]


@pytest.mark.parametrize("seed", range(40))
def test_the_partition_is_the_cheapest_of_all_partitions(seed):
    import random

    rng = random.Random(seed)
    counts = [rng.choice([0, 1, 2, 8, 64, 300]) for _ in range(rng.randint(1, 6))]
    block, overhead = rng.choice([1, 7]), rng.choice([0, 16, 64])
    groups = context_groups(counts, block=block, overhead=overhead)
    assert sorted(i for g in groups for i in g) == list(range(len(counts)))

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for p in partitions(rest):
            yield [[first]] + p
            for k in range(len(p)):
                yield p[:k] + [[first] + p[k]] + p[k + 1:]

    best = min(_cost(p, counts, block, overhead) for p in partitions(list(range(len(counts)))))
    assert _cost(groups, counts, block, overhead) == best


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match=">= 0"):
        context_groups([1, -1], block=7)
