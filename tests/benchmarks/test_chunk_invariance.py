"""benchmarks.chunk_invariance on the tiny fp32 engine: the measuring functions themselves (a sequence
compared with itself has no difference; fp32 verify blocks differ from one-token steps by rounding only;
an injected difference is found at the right position and layer)."""
import numpy as np
import pytest

from benchmarks import chunk_invariance


@pytest.fixture(scope="module")
def ci():
    return chunk_invariance


def test_teacher_force_and_compare(ci, tiny_engine_dir):
    from dspark_runtime import Engine

    eng = Engine.load(tiny_engine_dir, threads=1)
    prompt = eng.encode_prompt("def add(a, b):")
    cont = list(eng.generate("def add(a, b):", max_new_tokens=12, draft=None).token_ids)
    assert len(cont) == 12
    runner = eng.runner("target")
    l1, kv1 = ci.teacher_force(runner, prompt, cont, 1)
    assert l1.shape[0] == len(cont)
    assert np.array_equal(l1[:-1].argmax(-1), np.asarray(cont[1:]))  # q1 reproduces greedy generate()
    same = ci.compare(l1, kv1, l1.copy(), [(k.copy(), v.copy()) for k, v in kv1], len(prompt))
    assert same["first_logit_diff_position"] is None and same["argmax_flips"] == []
    assert same["first_layer_with_kv_diff"] is None and max(same["max_abs_kv_diff_per_layer"]) == 0.0

    l4, kv4 = ci.teacher_force(runner, prompt, cont, 4)
    r = ci.compare(l1, kv1, l4, kv4, len(prompt))
    assert r["max_abs_logit_diff"] < 1e-3  # fp32: rounding at most
    assert r["argmax_flips"] == []

    # an injected change in layer 1's keys at generated position 5 and in the logits at position 7
    kv_bad = [(k.copy(), v.copy()) for k, v in kv1]
    kv_bad[1][0][..., len(prompt) + 5, :] += 0.5
    l_bad = l1.copy()
    l_bad[7, cont[8]] -= 1e3  # position 7 predicted cont[8]; now another token wins
    r = ci.compare(l1, kv1, l_bad, kv_bad, len(prompt))
    assert r["first_logit_diff_position"] == 7 and r["positions_with_logit_diff"] == 1
    assert [f["position"] for f in r["argmax_flips"]] == [7]
    assert r["first_layer_with_kv_diff"] == 1 and r["its_first_kv_diff_position"] == 5
    assert r["max_abs_kv_diff_per_layer"][1] == pytest.approx(0.5)
    assert r["max_abs_kv_diff_per_layer"][0] == 0.0
