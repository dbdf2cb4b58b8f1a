"""Chunked prefill (issue 21): the pure planner (dspark_runtime/scheduling/prefill.py) and the decoding loop feeding a joining
prompt in chunks beside the requests already decoding, on a toy bigram target (no models)."""
import numpy as np
import pytest

from dspark_runtime.decoding.loop import DecodingLoop
from dspark_runtime.decoding.settings import LoopSettings
from dspark_runtime.errors import InputError
from dspark_runtime.scheduling.prefill import (DEFAULT_PREFILL_BUDGET, MIN_PREFILL_BUDGET, PrefillPlan, plan_prefill,
                                    prefill_budget)
from dspark_runtime.runners.sequence import SequenceRunner
from tests.fixtures.toy import BigramBook, BigramTarget

# the int4 Qwen2.5-Coder-1.5B engine's profiled table on the 2-core EPYC (t_verify, monotone fit; flat tail)
QWEN_TABLE = {"tokens": [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20],
              "t_verify": [0.1114] * 6 + [0.1358, 0.1651, 0.1835, 0.1964, 0.3668, 0.3668]}


def packed(lengths):
    return sum(lengths)


def padded(lengths):  # the scatter layout: one row per segment, each padded to the longest
    return len(lengths) * max(lengths) if lengths else 0


# ------------------------------------------------------------------------------------------- the budget


def test_budget_from_the_cost_table():
    # 4 x t(1) = 0.4456 s: every profiled size fits, so the table is extended along its mean slope
    # (0.3668 - 0.1114) / 19 = 0.01344 s/token: 1 + floor(0.3342 / 0.01344) = 1 + 24 = 25 tokens
    assert prefill_budget(QWEN_TABLE, stall=4.0) == 25
    # the default factor 16 (1.7824 s): 1 + floor(1.671 / 0.01344) = 1 + 124 = 125 tokens
    assert prefill_budget(QWEN_TABLE) == 125
    # a factor 2 (0.2228 s) stops inside the table: 12 tokens (0.1964 s), 16 costs 0.3668 s
    assert prefill_budget(QWEN_TABLE, stall=2.0) == 12
    # a whole-round table ("seconds" only) is read the same way; clamps to [MIN_PREFILL_BUDGET, max_chunk]
    # (slope 0.1 / 63 s/token: 1 + floor(0.3 / 0.001587) = 190 at a factor 4; past max_chunk 256 at 16)
    assert prefill_budget({"tokens": [1, 64], "seconds": [0.1, 0.2]}, stall=4.0) == 190
    assert prefill_budget({"tokens": [1, 64], "seconds": [0.1, 0.2]}) == 256
    assert prefill_budget({"tokens": [1, 64], "seconds": [0.1, 0.2]}, max_chunk=128) == 128
    assert prefill_budget({"tokens": [1, 2], "t_verify": [0.1, 1.0]}) == MIN_PREFILL_BUDGET


def test_budget_without_a_usable_table_is_the_default():
    assert prefill_budget(None) == DEFAULT_PREFILL_BUDGET
    assert prefill_budget(None, max_chunk=16) == 16
    assert prefill_budget({"tokens": [1, 8], "t_verify": [0.2, 0.2]}) == DEFAULT_PREFILL_BUDGET  # flat: no slope
    with pytest.raises(InputError, match="stall factor must be a number > 1"):
        prefill_budget(QWEN_TABLE, stall=1.0)
    with pytest.raises(InputError, match="re-run `dspark-export profile`"):
        prefill_budget({"tokens": [1, 2], "t_verify": [0.1]})


# ------------------------------------------------------------------------------------------- the plan


def test_nothing_decoding_feeds_a_whole_chunk():
    assert plan_prefill([300], [], budget=25, max_chunk=256, pass_rows=packed) == PrefillPlan((256,), True)
    assert plan_prefill([44, 300], [], budget=25, max_chunk=256, pass_rows=packed) == PrefillPlan((44, 212), True)


def test_while_others_decode_the_budget_is_shared_oldest_first():
    p = plan_prefill([10, 300, 5], [4, 2, 1], budget=25, max_chunk=256, pass_rows=packed)
    assert p.chunks == (10, 15, 0) and p.tokens == 25
    assert p.merged  # packed rows: one pass computes exactly what two calls would (4+2+1 + 10+15 = 32 rows)


def test_padded_rows_keep_long_chunks_out_of_the_verify_pass():
    # scatter: a 25-token chunk beside three verify blocks (longest 4) would compute 4 x 25 = 100 rows in one pass,
    # against 3 x 4 + 25 = 37 in two calls
    p = plan_prefill([300], [4, 2, 1], budget=25, max_chunk=256, pass_rows=padded)
    assert p.chunks == (25,) and not p.merged
    # a prompt tail as long as the blocks rides in the pass: 4 x 4 = 16 rows, as 3 x 4 + 4 in two calls
    assert plan_prefill([4], [4, 4, 4], budget=25, max_chunk=256, pass_rows=padded) == PrefillPlan((4,), True)
    assert not plan_prefill([3], [4, 2, 1], budget=25, max_chunk=256, pass_rows=padded).merged  # 16 > 12 + 3
    # several prompts in a padded call: each later one gets the longest chunk whose rows stay within one chunk of
    # the allowance (2 x 12 = 24 <= 25)
    assert plan_prefill([12, 300], [4], budget=25, max_chunk=256, pass_rows=padded).chunks == (12, 12)


def test_plan_refuses_bad_input():
    with pytest.raises(InputError, match="budget and chunk must be >= 1"):
        plan_prefill([5], [], budget=0, max_chunk=256, pass_rows=packed)
    with pytest.raises(InputError, match="remaining prompt tokens must be >= 0"):
        plan_prefill([-1], [], budget=5, max_chunk=256, pass_rows=packed)


# ------------------------------------------------------------------------------------------- the loop

TABLE = np.array([[0.1, 0.6, 0.2, 0.1], [0.1, 0.1, 0.7, 0.1], [0.2, 0.1, 0.1, 0.6], [0.7, 0.1, 0.1, 0.1]])
LONG = [0, 1, 2, 3] * 10  # 40 prompt tokens


def _alone(prompt, n):
    loop = DecodingLoop(SequenceRunner(BigramTarget(TABLE)), None, LoopSettings(max_batch=1))
    req = loop.submit(prompt, max_new_tokens=n)
    loop.run()
    return req.token_ids


def test_a_joining_prompt_is_fed_in_chunks_while_others_keep_decoding():
    book = BigramBook(TABLE)
    loop = DecodingLoop(book, None, LoopSettings(max_batch=4, prefill_budget=8))
    a = loop.submit([2, 3], max_new_tokens=30)
    loop.step()  # a's prompt (2 tokens, nothing decoding: one chunk) -> its first token
    loop.step()
    assert loop.active == [a] and len(a.out) == 2
    b = loop.submit(LONG, max_new_tokens=10)
    committed = []
    while not b.out:
        before = len(a.out)
        loop.step()
        committed.append(len(a.out) - before)
    # 40 prompt tokens at 8 per round: 5 rounds, each ONE verifier call carrying a's verify block and b's chunk,
    # and a committed a token in every one of them
    assert committed == [1] * 5
    assert book.calls[-5:] == [[(a.rid, 1), (b.rid, 8)]] * 5
    st = loop.stats
    assert st.mixed_rounds == 5 and st.prefill_chunks == 6 and st.prefill_tokens == 42
    assert st.target_calls == len(book.calls) == st.rounds + 1  # + the round that fed a's prompt alone
    loop.run()
    assert a.token_ids == _alone([2, 3], 30) and b.token_ids == _alone(LONG, 10)  # exact
    assert b.stats.ttft_ms > 0 and b.stats.prompt_tokens == 40


def test_a_request_cancelled_mid_prompt_frees_its_row():
    book = BigramBook(TABLE)
    loop = DecodingLoop(book, None, LoopSettings(max_batch=2, prefill_budget=8))
    a = loop.submit([2, 3], max_new_tokens=30)
    loop.step()
    b = loop.submit(LONG, max_new_tokens=10)
    loop.step()
    assert loop.prefilling == [b] and book.length(b.rid) == 8
    loop.cancel(b)
    assert b.finish_reason == "cancelled" and not loop.prefilling and b.rid not in book
    loop.run()
    assert a.token_ids == _alone([2, 3], 30)


def test_loop_refuses_a_bad_budget():
    with pytest.raises(InputError, match="prefill_budget must be a positive integer"):
        DecodingLoop(BigramBook(TABLE), None, LoopSettings(prefill_budget=0))
