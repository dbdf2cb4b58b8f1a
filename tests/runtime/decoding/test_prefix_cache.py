"""Prefix KV cache across requests (issue 21): the block keys and LRU bookkeeping without models
(dspark_runtime/decoding/prefix_cache.py), then a tiny scatter-layout engine with a draft LM and a DSpark drafter: a
shared-system-prompt, multi-turn workload gives token-for-token the same output with the cache on (also under a
bound small enough to evict) as with it off, and the cache is really hit (target and draft blocks)."""
import numpy as np
import pytest

from dspark_runtime.errors import InputError
from dspark_runtime.decoding.prefix_cache import PrefixCache, block_hashes, concat_blocks, payload_bytes


def _payload(start, end, nbytes=100):
    """A fake block payload naming its positions, and its size."""
    return (start, end), nbytes


# ------------------------------------------------------------------------------------------- keys


def test_block_keys_name_the_whole_prefix():
    a = list(range(40))
    ka = block_hashes(a, 16)
    assert len(ka) == 2 and all(isinstance(k, bytes) and len(k) == 16 for k in ka)  # 40 tokens: 2 full blocks
    assert block_hashes(a + [7, 8], 16) == ka  # a partial block has no key
    b = [99] + a[1:]  # the first token differs: every key differs, not only the first block's
    kb = block_hashes(b, 16)
    assert kb[0] != ka[0] and kb[1] != ka[1]
    c = a[:16] + [5] * 24  # same first block, different second
    assert block_hashes(c, 16)[0] == ka[0] and block_hashes(c, 16)[1] != ka[1]
    with pytest.raises(InputError, match="block size must be >= 1"):
        block_hashes(a, 0)


# ------------------------------------------------------------------------------------------- bookkeeping


def test_lookup_returns_the_longest_run_of_leading_blocks_of_a_part():
    cache = PrefixCache(10_000, block=4)
    seq = list(range(10))  # 2 full blocks
    calls = []
    stored = cache.insert(seq, "target", lambda s, e: (calls.append((s, e)), _payload(s, e))[1])
    assert stored == 2 and calls == [(0, 4), (4, 8)]
    assert cache.insert(seq, "target", lambda s, e: pytest.fail("already stored")) == 0
    assert cache.lookup(seq[:9], "target") == [(0, 4), (4, 8)]
    assert cache.lookup(seq[:7], "target") == [(0, 4)]  # only full blocks of the looked-up tokens
    assert cache.lookup([0, 1, 2, 3, 9, 9, 9, 9], "target") == [(0, 4)]  # diverges in block 2
    assert cache.lookup(seq, "draft") == []  # another part: not stored
    st = cache.stats
    assert (st.lookups, st.hits, st.lookup_tokens, st.hit_tokens) == (4, 3, 34, 16)
    assert st.hit_rate == pytest.approx(16 / 34) and st.blocks == 2 and st.bytes == 200
    cache.lookup(seq, "target", count=False)
    assert st.lookups == 4  # a drafter's own lookup of the same prompt is not counted twice


def test_eviction_is_lru_under_the_bound_and_takes_a_chain_tail_first():
    cache = PrefixCache(450, block=2)
    a, b = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    cache.insert(a, "target", _payload)  # 3 blocks, 300 bytes
    cache.insert(b, "target", _payload)  # 2 more: 500 > 450 -> evict the least recent: a's last block
    assert cache.stats.bytes == 400 and cache.stats.evicted_blocks == 1
    assert cache.lookup(a, "target") == [(0, 2), (2, 4)]  # a's head survives, reachable
    cache.insert([11, 12], "target", _payload)  # 500 again: b is now least recent -> its tail goes first
    assert cache.lookup(b, "target") == [(0, 2)] and cache.lookup(a, "target") == [(0, 2), (2, 4)]
    assert cache.stats.bytes <= 450 and len(cache) == 4
    big = PrefixCache(50, block=2)
    assert big.insert([1, 2, 3, 4], "target", _payload) == 0 and len(big) == 0  # a block over the bound: not kept


def test_bad_settings_are_refused_by_name():
    with pytest.raises(InputError, match="memory bound must be a positive number of bytes"):
        PrefixCache(0)
    with pytest.raises(InputError, match="block size must be a positive number of tokens"):
        PrefixCache(100, block=0)
    with pytest.raises(InputError, match="unknown prefix cache part 'dspark'"):
        PrefixCache(100).lookup([1, 2], "dspark")


def test_block_payloads_join_along_positions():
    rng = np.random.default_rng(0)
    blocks = [([(rng.random((2, 4, 3), dtype=np.float32), rng.random((2, 4, 3), dtype=np.float32))],
               rng.random((4, 5), dtype=np.float32)) for _ in range(3)]
    kv, feats = concat_blocks(blocks)
    assert kv[0][0].shape == (2, 12, 3) and feats.shape == (12, 5)
    np.testing.assert_array_equal(kv[0][1][:, 4:8], blocks[1][0][0][1])
    np.testing.assert_array_equal(feats[8:], blocks[2][1])
    assert payload_bytes(blocks[0]) == 2 * 2 * 4 * 3 * 4 + 4 * 5 * 4


# ------------------------------------------------------------------------------------------- on an engine

SYSTEM = ("You are a careful Python assistant. Answer with short, correct code and one sentence of explanation. "
          "Prefer the standard library, name things clearly and never invent APIs.")
USERS = ["Write a function that adds two numbers.", "Reverse a string.", "Sort a list of numbers."]


@pytest.fixture(scope="module")
def engine_dir(tiny_pair, tmp_path_factory):
    """The tiny pair in the scatter KV layout (fp32) with target features, plus an untrained DSpark drafter."""
    from tests.fixtures.tiny_models import add_tiny_dspark

    from dspark_export.engine_dir.build import Recipe, build_engine

    out = tmp_path_factory.mktemp("prefix") / "e"
    build_engine(Recipe(name="e", target=str(tiny_pair[0]), draft=str(tiny_pair[1]), kv_layout="scatter",
                        target_feature_layers=[-1, 0], draft_length=3), out, isolate=False, log=lambda *a: None)
    add_tiny_dspark(out, tiny_pair[0])
    return out


def _workload(eng, draft, n=12):
    """First turns of 3 users sharing the system prompt (batched), then each user's second turn (the first
    answer in its history, one at a time). Returns every output's token ids and the batched call's stats."""
    first = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}] for u in USERS]
    r1 = eng.generate_batch(first, max_new_tokens=n, draft=draft, draft_length=3, max_batch=2)
    stats = eng.last_batch_stats
    outs = [r.token_ids for r in r1]
    for msgs, r in zip(first, r1):
        turn2 = msgs + [{"role": "assistant", "content": r.text}, {"role": "user", "content": "Now add a test."}]
        outs.append(eng.generate(turn2, max_new_tokens=n, draft=draft, draft_length=3).token_ids)
    return outs, stats


@pytest.mark.parametrize("draft", [None, "lm", "dspark"])
def test_output_is_identical_with_and_without_the_cache(engine_dir, draft):
    from dspark_runtime import Engine

    off = Engine.load(engine_dir, threads=1)
    assert off.manifest.graphs["target"].spec.kv_layout == "scatter" and off.prefix_cache is None
    ref, _ = _workload(off, draft)
    assert [len(t) for t in ref] == [12] * 6
    on = Engine.load(engine_dir, threads=1, prefix_cache_mb=64)
    got, stats = _workload(on, draft)
    assert got == ref
    st = on.prefix_cache.stats
    assert st.hits >= 4 and st.hit_tokens >= 4 * 16 and 0 < st.hit_rate < 1 and st.evicted_blocks == 0
    assert stats.cached_prompt_tokens > 0 and stats.prefix_hit_requests > 0  # the batch shared the system prompt
    assert stats.first_tokens == 3 and stats.ttft_s >= stats.ttft_prefix_hit_s > 0
    parts = {part for _, part in on.prefix_cache._entries}
    assert parts == ({"target", "draft"} if draft == "lm" else {"target"})
    # a bound far below the workload: blocks are evicted, the output stays the same
    small = Engine.load(engine_dir, threads=1, prefix_cache_mb=0.02)
    assert _workload(small, draft)[0] == ref
    sst = small.prefix_cache.stats
    assert sst.evicted_blocks > 0 and sst.bytes <= sst.max_bytes == int(0.02 * 2 ** 20)


def test_the_cache_needs_the_scatter_layout(tiny_engine_dir):
    from dspark_runtime import Engine

    eng = Engine.load(tiny_engine_dir, threads=1)
    assert eng.manifest.graphs["target"].spec.kv_layout == "growing"
    with pytest.raises(InputError, match="--kv-layout scatter"):
        eng.enable_prefix_cache(16)
    with pytest.raises(InputError, match="prefix_cache_mb must be a number of MiB >= 0"):
        eng.enable_prefix_cache(-1)
    eng.enable_prefix_cache(0)
    assert eng.prefix_cache is None


def test_server_reports_hits_and_answers_as_without_the_cache(engine_dir):
    """`dspark serve --prefix-cache-mb`: chat requests sharing the system prompt, one after another, answer what the
    engine without a cache answers; /metrics and the usage object show the reuse."""
    import httpx

    from dspark_runtime import Engine
    from dspark_runtime.serving.app import create_app
    from dspark_runtime.serving.server import ServerThread
    from tests.runtime.serving.test_server import _metrics

    ref = Engine.load(engine_dir, threads=1)
    eng = Engine.load(engine_dir, threads=1, prefix_cache_mb=16)
    app = create_app(eng, draft="lm", draft_length=3, max_batch=2)
    srv = ServerThread(app, timeout_graceful_shutdown=10).start()
    try:
        cached = []
        for u in USERS:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}]
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                           json={"messages": msgs, "max_tokens": 10, "temperature": 0}).json()
            want = ref.generate(msgs, max_new_tokens=10, draft=None).text
            assert r["choices"][0]["message"]["content"] == want
            cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[0] == 0 and cached[1] >= 16 and cached[1] % 16 == 0  # whole blocks of the system prompt
        m = _metrics(srv.url)
        one = lambda n, **lab: m[(n, frozenset(lab.items()))]  # noqa: E731
        assert one("dspark_prefix_cache_hit_tokens_total") == sum(cached) == one("dspark_prompt_tokens_cached_total")
        assert one("dspark_prefix_cache_lookups_total") == 3 and one("dspark_prefix_cache_hits_total") == 2
        assert 0 < one("dspark_prefix_cache_hit_rate") < 1 and one("dspark_prefix_cache_bytes") > 0
        assert one("dspark_prefix_cache_max_bytes") == 16 * 2 ** 20
        assert one("dspark_engine_first_tokens_total", prefix_cache="hit") == 2
        assert one("dspark_engine_first_tokens_total", prefix_cache="miss") == 1
        assert one("dspark_engine_ttft_seconds_total", prefix_cache="hit") > 0
    finally:
        srv.stop()
