"""The scatter KV layout (one batch row per request, slot = position): the graph computes what the growing graph
computes, and a request's logits are bit-identical whatever other requests share the call (fp32 and int4) —
the property the packed layout lacks (benchmarks/batch_invariance.py)."""
import numpy as np
import pytest

from dspark_runtime.errors import DSparkError


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """A tiny Qwen2 target exported in the growing and the scatter layout, fp32, plus the scatter graph in int4
    (ONNX Runtime's RTN quantizer: MatMulNBits with int8 activations, where the packed layout's rounding
    differences grow)."""
    from tests.fixtures.tiny_models import make_pair

    from dspark_export.graphs.decoder import decoder_dims, export_decoder, load_hf_model
    from dspark_export.precision.nbits_rtn import quantize_nbits_rtn

    root = tmp_path_factory.mktemp("slots")
    target, _ = make_pair(root)
    model = load_hf_model(target)
    dims = decoder_dims(model.config, (0,))
    out = {"growing": (export_decoder(model, dims, root / "g.onnx"), root / "g.onnx"),
           "scatter": (export_decoder(model, dims, root / "s.onnx", kv_layout="scatter"), root / "s.onnx")}
    quantize_nbits_rtn(root / "s.onnx", root / "s4.onnx", log=lambda *a: None)
    out["scatter-int4"] = (out["scatter"][0], root / "s4.onnx")
    return out


def _backend(graphs, key):
    from dspark_runtime.backends.ort import OrtDecoder

    spec, path = graphs[key]
    return OrtDecoder(path, spec, threads=1).activate()


PROMPT = [5, 17, 42, 99, 7, 3, 11, 200, 31, 8, 64, 2, 77, 150, 9, 1, 4, 19, 23]
STEPS = [[12], [13, 14], [15, 16, 17, 18], [19], [20, 21, 22], [23]]


def test_scatter_graph_computes_what_the_growing_graph_computes(graphs):
    from dspark_runtime.runners.sequence import DecoderRunner
    from dspark_runtime.runners.scatter import ScatterRunner

    grow = DecoderRunner(_backend(graphs, "growing"))
    sr = ScatterRunner(_backend(graphs, "scatter"))
    sr.add(0)
    ref = [grow.prefill(PROMPT)]
    got = [sr.prefill(0, PROMPT)]
    for t in STEPS:
        ref.append(grow.step(t))
        got.append(sr.step([(0, t)])[0])
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=0)
    np.testing.assert_allclose(sr.features(0), grow.features, atol=2e-5, rtol=0)
    # rollback (a rejected draft) then feed other tokens: same as the growing cache
    grow.rollback(grow.length - 3)
    sr.rollback(0, sr.length(0) - 3)
    np.testing.assert_allclose(sr.step([(0, [40, 41])])[0], grow.step([40, 41]), atol=2e-5, rtol=0)


@pytest.mark.parametrize("key", ["scatter", "scatter-int4"])
@pytest.mark.parametrize("row_multiple", [1, 2])
def test_a_requests_logits_do_not_depend_on_its_batch(graphs, key, row_multiple):
    """Request A teacher-forced alone, then with two neighbours of other lengths stepping other token counts,
    in several row orders and slot sizes: every logit bit-identical."""
    from dspark_runtime.machine.row_invariance import probe_row_multiple
    from dspark_runtime.runners.factory import decoder_runner
    from dspark_runtime.runners.scatter import ScatterRunner

    be = _backend(graphs, key)
    if row_multiple == 1:  # no padding: only where this CPU's kernels give every row count the same results
        probe = probe_row_multiple(decoder_runner(be), PROMPT, list(range(30, 70)))
        if probe["row_multiple"] != 1:
            pytest.skip(f"this CPU's {key} kernels are not row-count invariant without padding (probe: "
                        f"{probe['max_abs_difference']}); the runtime pads to the probed row multiple here")
    alone = ScatterRunner(be, row_multiple=row_multiple)
    alone.add("a")
    ref = [alone.prefill("a", PROMPT)]
    ref += [alone.step([("a", t)])[0] for t in STEPS]

    rng = np.random.default_rng(0)
    mixed = ScatterRunner(be, row_multiple=row_multiple)
    for rid, n in (("x", 41), ("y", 3)):  # neighbours first: A gets row 2, then a middle row after x leaves
        mixed.add(rid)
        mixed.prefill(rid, list(rng.integers(1, 300, n)))
    mixed.add("a")
    got = [mixed.step([("y", [7, 8]), ("a", PROMPT), ("x", [9])])[1][-1]]
    for i, t in enumerate(STEPS):
        if i == 2:  # x leaves, z joins (into x's row): rows of the call are no longer contiguous
            mixed.remove("x")
            mixed.add("z")
            mixed.prefill("z", list(rng.integers(1, 300, 150)))  # grows the slots past the first step
        others = [(r, list(rng.integers(1, 300, 1 + (i + j) % 4))) for j, r in enumerate(mixed.requests) if r != "a"]
        segs = others[:1] + [("a", t)] + others[1:]
        got.append(mixed.step(segs)[1])
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(b, a)
    assert mixed.length("a") == alone.length("a") == len(PROMPT) + sum(map(len, STEPS))


def test_row_padding_and_refusals(graphs):
    from dspark_runtime.runners.scatter import ScatterRunner

    be = _backend(graphs, "scatter")
    shapes = []
    real = be.step

    def spy(ids, *a, **k):
        shapes.append(ids.shape)
        return real(ids, *a, **k)

    sr = ScatterRunner(be, row_multiple=4, max_slots=64)
    sr.add(1)
    sr.add(2)
    be.step = spy
    try:
        sr.step([(1, [5])])
        sr.step([(1, [6, 7, 8]), (2, [9])])
    finally:
        del be.step
    assert shapes == [(1, 4), (2, 4)]  # batch * Q a multiple of 4
    assert sr.length(1) == 4 and sr.length(2) == 1  # padding never counts
    with pytest.raises(DSparkError, match="appears twice"):
        sr.step([(1, [1]), (1, [2])])
    with pytest.raises(DSparkError, match="context limit"):
        sr.step([(2, list(range(1, 70)))])
    with pytest.raises(DSparkError, match="scatter-layout"):
        ScatterRunner(_backend(graphs, "growing"))


def test_padded_shape_is_the_fewest_rows():
    """Hand cases, and against a brute-force search over a wider range: the fewest rows b' x q' (b' >= b, q' >= q,
    a multiple of m; ties: fewer batch rows), never falling as q grows."""
    from dspark_runtime.runners.scatter import padded_shape

    assert padded_shape(7, 1, 2) == (8, 1)  # one dummy row, not 7 padded positions
    assert padded_shape(1, 1, 2) == (1, 2)  # a tie: no dummy row
    assert padded_shape(3, 3, 2) == (3, 4)
    assert padded_shape(2, 3, 4) == (2, 4)
    assert padded_shape(5, 1, 4) == (8, 1)
    assert padded_shape(5, 3, 1) == (5, 3)
    for m in (1, 2, 3, 4, 8):
        for b in range(1, 10):
            prev = 0
            for q in range(1, 12):
                got = padded_shape(b, q, m)
                brute = min(((bb * qq, bb), (bb, qq)) for bb in range(b, b + 3 * m) for qq in range(q, q + 3 * m)
                            if (bb * qq) % m == 0)
                assert got == brute[1], (b, q, m)
                assert got[0] * got[1] >= prev
                prev = got[0] * got[1]


@pytest.mark.parametrize("key", ["scatter", "scatter-int4"])
def test_an_odd_batch_gets_a_dummy_row_and_the_same_logits(graphs, key):
    """Three requests of one token each at row multiple 2: the call computes 4 rows of 1 (a dummy row), not 3 of 2,
    in contiguous rows (a view) and in scattered rows (a gathered copy); every request's logits and cache are
    bit-identical to what it gets stepped with a neighbour (an even call of 2 x 1 rows)."""
    from dspark_runtime.runners.scatter import ScatterRunner

    be = _backend(graphs, key)
    shapes = []
    real = be.step

    def spy(ids, *a, **k):
        shapes.append(ids.shape)
        return real(ids, *a, **k)

    rng = np.random.default_rng(1)
    prompts = {rid: list(rng.integers(1, 300, n)) for rid, n in (("a", 9), ("b", 4), ("c", 13), ("d", 6))}
    ref = ScatterRunner(be, row_multiple=2)
    for rid in "abc":
        ref.add(rid)
        ref.prefill(rid, prompts[rid])
    toks = [[int(t)] for t in rng.integers(1, 300, 4)]
    want = {}
    for i, rid in enumerate("abc"):
        other = "abc"[(i + 1) % 3]
        n = ref.length(other)
        want[rid] = ref.step([(rid, toks[i]), (other, [toks[3][0]])])[0]
        ref.rollback(other, n)
    for scattered in (False, True):
        sr = ScatterRunner(be, row_multiple=2)
        for rid in ("a", "d", "b", "c") if scattered else "abc":
            sr.add(rid)
            sr.prefill(rid, prompts[rid])
        if scattered:
            sr.remove("d")  # rows 0, 2, 3 of 4: not contiguous
        shapes.clear()
        be.step = spy
        try:
            got = sr.step([(rid, toks[i]) for i, rid in enumerate("abc")])
        finally:
            del be.step
        assert shapes == [(4, 1)]
        for i, rid in enumerate("abc"):
            np.testing.assert_array_equal(got[i], want[rid])
            assert sr.length(rid) == len(prompts[rid]) + 1
            np.testing.assert_array_equal(sr.features(rid), ref.features(rid)[: sr.length(rid)])
    # the dummy row of a view may be another request's row (here d's, not in the call): it is read, never written
    sr = ScatterRunner(be, row_multiple=2)
    for rid in "abcd":
        sr.add(rid)
        sr.prefill(rid, prompts[rid])
    before = sr.export_kv("d", 0, sr.length("d"))
    got = sr.step([(rid, toks[i]) for i, rid in enumerate("abc")])
    after = sr.export_kv("d", 0, sr.length("d"))
    for (k0, v0), (k1, v1) in zip(before[0], after[0]):
        np.testing.assert_array_equal(k1, k0)
        np.testing.assert_array_equal(v1, v0)
    for i, rid in enumerate("abc"):
        np.testing.assert_array_equal(got[i], want[rid])


@pytest.mark.parametrize("key", ["scatter", "scatter-int4"])
def test_prompt_chunks_compute_only_their_last_positions_logits(graphs, key):
    """Segments all in ``last_only`` (prompt chunks): the graph's LM head runs from the shortest segment's last
    position on (``logits_from``), each segment gets [1, vocab] bit-identical to the last row of the full logits, and
    the cache and features are those of the full call. A call with a segment outside ``last_only`` computes every
    position, as before."""
    from dspark_runtime.runners.scatter import ScatterRunner

    be = _backend(graphs, key)
    assert be.takes_logits_from
    seen = []
    real = be.step

    def spy(*a, **k):
        seen.append(k.get("logits_from", 0))
        return real(*a, **k)

    rng = np.random.default_rng(2)
    chunks = {"a": list(rng.integers(1, 300, 7)), "b": list(rng.integers(1, 300, 4))}
    full, last = ScatterRunner(be, row_multiple=2), ScatterRunner(be, row_multiple=2)
    for sr in (full, last):
        for rid in "ab":
            sr.add(rid)
            sr.prefill(rid, list(range(10, 10 + len(rid) * 3)))
    want = full.step(list(chunks.items()))
    be.step = spy
    try:
        got = last.step(list(chunks.items()), last_only={"a", "b"})
        mixed = last.step([("a", [5]), ("b", [6])], last_only={"a"})
    finally:
        del be.step
    assert seen == [3, 0]  # the shorter chunk's last position (4 - 1); then every position
    for w, g in zip(want, got):
        assert g.shape == (1, w.shape[-1])
        np.testing.assert_array_equal(g[0], w[-1])
    assert [m.shape[0] for m in mixed] == [1, 1]
    for rid in "ab":
        assert last.length(rid) == full.length(rid) + 1
        np.testing.assert_array_equal(last.features(rid)[: full.length(rid)], full.features(rid))


@pytest.mark.parametrize("key", ["scatter", "scatter-int4"])
def test_the_head_skips_padding_positions_with_the_same_cache(graphs, key):
    """``head_skips_padding``: a call padded to a longer Q runs the LM head on its real positions only
    (``logits_to`` = the longest segment), alone and in a batch padded along Q; a call padded with dummy batch rows or
    not padded passes no ``logits_to``. The cache and features are bit-identical to the head on every position, the
    logits equal up to the head's own row-count rounding (the row probe keeps the setting only where they are
    bit-identical too)."""
    from dspark_runtime.runners.scatter import ScatterRunner

    be = _backend(graphs, key)
    assert be.takes_logits_to
    seen = []
    real = be.step

    def spy(*a, **k):
        seen.append((a[0].shape, k.get("logits_to")))
        return real(*a, **k)

    every, real_rows = ScatterRunner(be, row_multiple=2), ScatterRunner(be, row_multiple=2)
    real_rows.head_skips_padding = True
    calls = [[("a", [12])], [("a", [13, 14])], [("a", [15, 16, 17])],  # alone: Q 1 -> 2, 2, 3 -> 4
             [("a", [18]), ("b", [19, 20, 21]), ("c", [22, 23])],          # 3 rows of Q 3 -> 3 x 4
             [("a", [24]), ("b", [25]), ("c", [26])]]                      # 3 rows of Q 1 -> a dummy 4th row
    want, got = [], []
    for sr in (every, real_rows):
        for rid in "abc":
            sr.add(rid)
            sr.prefill(rid, PROMPT[: 5 + len(sr.requests)])
    be.step = spy
    try:
        for segs in calls:
            want.append(every.step(segs))
            n = len(seen)
            got.append(real_rows.step(segs))
            assert len(seen) == n + 1
    finally:
        del be.step
    assert [s for s in seen[1::2]] == [((1, 2), 1), ((1, 2), None), ((1, 4), 3), ((3, 4), 3), ((4, 1), None)]
    assert all(t is None for _, t in seen[0::2])  # the default runs the head on every position
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            assert a.shape == b.shape
            np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
    for rid in "abc":
        assert every.length(rid) == real_rows.length(rid)
        np.testing.assert_array_equal(real_rows.features(rid), every.features(rid))
        for (k0, v0), (k1, v1) in zip(every.export_kv(rid, 0, every.length(rid))[0],
                                      real_rows.export_kv(rid, 0, real_rows.length(rid))[0]):
            np.testing.assert_array_equal(k1, k0)
            np.testing.assert_array_equal(v1, v0)


def test_a_graph_without_logits_to_cannot_skip_the_padding_head(graphs):
    from dataclasses import replace

    from dspark_runtime.backends.ort import OrtDecoder
    from dspark_runtime.engine_dir.graphspec import LOGITS_TO
    from dspark_runtime.runners.scatter import ScatterRunner, ScatterSequence

    spec, path = graphs["scatter"]
    older = replace(spec, inputs=tuple(t for t in spec.inputs if t.name != LOGITS_TO))  # as exported before it
    be = OrtDecoder(path, older, threads=1)
    assert be.takes_logits_from and not be.takes_logits_to
    sr = ScatterRunner(be, row_multiple=2)
    assert not sr.can_skip_padding_head and not ScatterSequence(be).can_skip_padding_head
    sr.head_skips_padding = False
    with pytest.raises(DSparkError, match="rebuild the engine"):
        sr.head_skips_padding = True
    ids = np.array([[5, 6]], np.int64)
    with pytest.raises(DSparkError, match="logits_to=None"):
        be.step(ids, np.array([[0, 1]], np.int64), np.ones((1, 1, 2, 2), bool), be.empty_kv(1), logits_to=1)


def test_a_graph_without_logits_from_refuses_it(graphs):
    from dspark_runtime.errors import DSparkError

    be = _backend(graphs, "growing")
    assert not be.takes_logits_from
    ids = np.array([[5, 6]], np.int64)
    with pytest.raises(DSparkError, match="logits_from=0"):
        be.step(ids, np.array([[0, 1]], np.int64), np.ones((1, 1, 2, 2), bool), be.empty_kv(1), logits_from=1)


@pytest.mark.parametrize("key", ["scatter", "scatter-int4"])
def test_slot_outputs_write_the_cache_in_place_with_the_same_results(graphs, key):
    """A scatter graph with slot outputs writes the new entries into the runner's buffers itself (ScatterElements
    bound to the past inputs' memory): the same logits, features and cache, bit for bit, as the same graph run
    without them (the runner writing the new entries back), over batched steps with dummy rows, a request outside
    the call beside them, rollbacks and a non-contiguous call; in place whenever the call's rows are a view."""
    from dataclasses import replace

    from dspark_runtime.backends.ort import OrtDecoder
    from dspark_runtime.engine_dir.graphspec import slot_names
    from dspark_runtime.runners.scatter import ScatterRunner

    spec, path = graphs[key]
    slots = {n for pair in slot_names(spec.dims.num_layers) for n in pair}
    assert slots <= set(spec.output_names)
    copying = OrtDecoder(path, replace(spec, outputs=tuple(t for t in spec.outputs if t.name not in slots)),
                         threads=1).activate()
    in_place = OrtDecoder(path, spec, threads=1).activate()
    assert in_place.writes_kv_in_place and not copying.writes_kv_in_place
    calls = []  # (rows x query rows, the call's K/V were views of the runner's buffers, the graph wrote them)
    real = in_place.step

    def spy(ids, pos, mask, kv, **k):
        out = real(ids, pos, mask, kv, **k)
        calls.append((ids.shape, np.shares_memory(kv[0][0], sr._kv[0][0]), out.kv_written))
        return out

    in_place.step = spy
    runs = []
    for be in (copying, in_place):
        r = np.random.default_rng(4)
        sr = ScatterRunner(be, row_multiple=2)
        logits = []
        for rid, n in (("a", 9), ("b", 4), ("c", 13), ("d", 6)):
            sr.add(rid)
            logits.append(sr.prefill(rid, [int(t) for t in r.integers(1, 300, n)]))
        plan = [("abc", 1), ("abcd", 3), ("ab", 2), ("d", 1), ("bcd", 1)]
        for i, (rids, q) in enumerate(plan):
            segs = [(rid, [int(t) for t in r.integers(1, 300, q + (j % 2 if i else 0))]) for j, rid in enumerate(rids)]
            logits += sr.step(segs)
            if i == 1:
                for rid in "ac":
                    sr.rollback(rid, sr.length(rid) - 2)
            if i == 2:
                sr.remove("a")  # rows of b, c, d stay; a new request takes a's row: "bcd" + "e" not contiguous
                sr.add("e")
                logits.append(sr.prefill("e", [int(t) for t in r.integers(1, 300, 5)]))
                logits += sr.step([("e", [7]), ("c", [8, 9])])
        caches = {rid: sr.export_kv(rid, 0, sr.length(rid)) for rid in sr.requests}
        runs.append((logits, caches, {rid: np.array(sr.features(rid)) for rid in sr.requests}))
    in_place.step = real
    (l0, c0, f0), (l1, c1, f1) = runs
    for a, b in zip(l0, l1):
        np.testing.assert_array_equal(b, a)
    assert c0.keys() == c1.keys()
    for rid in c0:
        for (k0, v0), (k1, v1) in zip(c0[rid][0], c1[rid][0]):
            np.testing.assert_array_equal(k1, k0)
            np.testing.assert_array_equal(v1, v0)
        np.testing.assert_array_equal(f1[rid], f0[rid])
    assert calls[4] == ((4, 1), False, True)  # "abc" + a dummy row: d's row beside them, so a gathered copy
    assert ((4, 4), True, True) in calls  # "abcd": a view of the buffers, written in place
