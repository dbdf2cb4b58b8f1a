"""A request's greedy output does not depend on which other requests share its rounds (the one-core issue):
the same 8 prompts decoded alone, all 8 together, and in three fixed groupings with staggered joins (prompts that
join mid-decode fed 5 tokens a round beside the decoding requests: chunked prefill, issue 21) give identical tokens,
on tiny fp32 and int4 engines in the scatter KV layout (one batch row per request) and a tiny static-int8 engine in
the growing layout (its integer attention matmuls are exact in the packed row)."""
import pytest

PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "Write a function that sorts",
           "print(i * i)", "jumps over the lazy dog", "return a + b", "Write a list of numbers."]
GROUPINGS = [  # (prompt indices submitted together, rounds to run before the next group joins)
    [([0, 1, 2], 3), ([3, 4], 2), ([5, 6, 7], 0)],
    [([7], 1), ([6, 5, 4, 3], 4), ([2, 1, 0], 0)],
    [([1, 3, 5, 7], 2), ([0, 2, 4, 6], 0)],
]


@pytest.fixture(scope="module", params=[("fp32", "scatter"), ("int4", "scatter"), ("int8", "growing")],
                ids=["fp32-scatter", "int4-scatter", "int8-growing"])
def engine(request, tmp_path_factory):
    from tests.fixtures.tiny_models import make_pair

    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_runtime import Engine

    precision, layout = request.param
    root = tmp_path_factory.mktemp(f"exact-{precision}")
    target, draft = make_pair(root)
    build_engine(Recipe(name="e", target=str(target), draft=str(draft), precision=precision, kv_layout=layout,
                        draft_length=3, calibration_prompts=2), root / "e", isolate=False, log=lambda *a: None)
    eng = Engine.load(root / "e", threads=1)
    assert eng.manifest.graphs["target"].spec.kv_layout == layout
    return eng


@pytest.mark.parametrize("draft", [None, "lm", "ngram"])
def test_greedy_output_does_not_depend_on_the_batch(engine, draft):
    n = 20
    alone = [engine.generate(p, max_new_tokens=n, draft=None).token_ids for p in PROMPTS]
    if draft is not None:  # speculative == target-only, alone
        for p, ref in zip(PROMPTS, alone):
            assert engine.generate(p, max_new_tokens=n, draft=draft, draft_length=3).token_ids == ref
    together = engine.generate_batch(PROMPTS, max_new_tokens=n, draft=draft, draft_length=3, max_batch=8)
    assert [r.token_ids for r in together] == alone
    ids = [engine.encode_prompt(p) for p in PROMPTS]
    for grouping in GROUPINGS:  # staggered joins, prompts fed 5 tokens a round beside the decoding requests
        gen = engine.batch(draft=draft, draft_length=3, max_batch=8, prefill_budget=5)
        reqs = {}
        for members, rounds in grouping:
            for i in members:
                reqs[i] = gen.submit(ids[i], max_new_tokens=n, gamma=3)
            for _ in range(rounds):
                gen.step()
        gen.run()
        got = [reqs[i].token_ids for i in range(len(PROMPTS))]
        assert got == alone, f"grouping {grouping}: prompts {[i for i in range(8) if got[i] != alone[i]]} differ"
        assert gen.stats.mixed_rounds > 0 and gen.stats.prefill_chunks > len(PROMPTS)  # the chunked path ran


def test_scatter_is_refused_for_precisions_that_need_the_growing_layout():
    from dspark_export.engine_dir.build import Recipe
    from dspark_runtime.errors import DSparkError

    with pytest.raises(DSparkError, match="needs the growing KV layout"):
        Recipe(name="x", target="t", precision="int8", kv_layout="scatter").validate()
    with pytest.raises(DSparkError, match="kv_layout"):
        Recipe(name="x", target="t", kv_layout="capacity").validate()
    Recipe(name="x", target="t", precision="target=int4,draft=fp32", kv_layout="scatter").validate()  # accepted
    for precision, layout in (("int4", "scatter"), ("int8-dynamic", "scatter"), ("fp32", "growing"),
                              ("target=int4,draft=fp32", "growing"), ("int8", "growing")):
        r = Recipe(name="x", target="t", precision=precision)  # kv_layout "auto"
        r.validate()
        assert r.kv_layout == layout, precision
