"""Batched TensorRT decoding (dspark_runtime.runners.device), CPU-side: the pure planning (call shapes, bucket choice,
capture keys, the engine's inputs) and DeviceBatchRunner's bookkeeping driven by the decoding loop, with the
capacity-layout graph on ONNX Runtime CPU standing in for the TensorRT engine (the device code itself,
TrtDecoder.run_rows, needs a GPU: scripts/gpu_check.sh trt check 5)."""
import shutil

import numpy as np
import pytest
from tests.fixtures.cuda_gpu import gpu_skip_reason

from dspark_runtime.errors import DSparkError
from dspark_runtime.runners.device import (DeviceBatchRunner, call_bucket, call_inputs, capture_key, pass_rows, plan_calls)
from dspark_runtime.backends.trt.profiles import choose_bucket

BUCKETS = [16, 32, 64, 128]


def test_plan_calls_splits_by_the_two_fixed_query_lengths():
    calls = plan_calls([1, 5, 16, 3, 9], decode_q=5, prefill_chunk=16)
    assert [(c.q, c.segments) for c in calls] == [(5, (0, 1, 3)), (16, (2, 4))]
    assert [(c.q, c.segments) for c in plan_calls([2, 4], 5, 16)] == [(5, (0, 1))]  # decode only: one call
    assert [(c.q, c.segments) for c in plan_calls([12], 5, 16)] == [(16, (0,))]  # a prompt chunk alone
    with pytest.raises(DSparkError, match="a segment of 17 tokens: the TensorRT engine takes 1..16 per call"):
        plan_calls([3, 17], 5, 16)
    with pytest.raises(DSparkError, match="a segment of 0 tokens"):
        plan_calls([0], 5, 16)


def test_pass_rows_counts_the_fixed_shapes():
    assert pass_rows([1], rows=4, decode_q=5, prefill_chunk=16) == 20  # one token still costs 4 rows x q 5
    assert pass_rows([5, 2, 1], 4, 5, 16) == 20
    assert pass_rows([5, 16], 4, 5, 16) == 20 + 64  # a decode call and a prefill call
    assert pass_rows([], 4, 5, 16) == 0


def test_call_bucket_holds_every_row_and_can_be_pinned():
    assert call_bucket(held=[3, 20], needs=[8], buckets=BUCKETS) == 32  # an idle row's 20 positions must survive
    assert call_bucket([3], [8], BUCKETS) == 16
    assert call_bucket([0], [16], BUCKETS) == 16 and call_bucket([0], [17], BUCKETS) == 32
    assert call_bucket([3], [8], BUCKETS, pin=True) == 128  # pinned: never depends on the other rows
    with pytest.raises(DSparkError, match="needs 130 KV positions but the engine's capacity is 128"):
        call_bucket([125], [130], BUCKETS, pin=True)
    with pytest.raises(DSparkError, match="needs 129 KV positions"):
        call_bucket([129], [1], BUCKETS)


def test_capture_keys_stay_few_with_fixed_shapes():
    """A long decode of 3 rows with verify lengths 1..5: every decode call has key (3, 5, bucket), so the runner
    captures one CUDA graph per bucket, whatever the rows' lengths and verify lengths."""
    rng = np.random.default_rng(0)
    lengths, keys = [0, 40, 90], set()
    for _ in range(60):
        segs = [int(x) for x in rng.integers(1, 6, size=3)]
        for c in plan_calls(segs, 5, 16):
            needs = [n + s for n, s in zip(lengths, segs)]
            keys.add(capture_key(3, c.q, call_bucket(lengths, needs, BUCKETS)))
        lengths = [min(n + s, 120) - 3 for n, s in zip(lengths, segs)]  # some accepted, some rolled back
    assert all(k[0] == 3 and k[1] == 5 for k in keys) and len(keys) <= len(BUCKETS)


def test_call_inputs_values():
    ids, pos, mask = call_inputs(rows=3, q=4, bucket=8, segments=[(2, 5, [7, 8]), (0, 0, [4, 5, 6, 9])])
    np.testing.assert_array_equal(ids, [[4, 5, 6, 9], [0, 0, 0, 0], [7, 8, 8, 8]])  # row 2 padded with its last
    np.testing.assert_array_equal(pos, [[0, 1, 2, 3], [0, 1, 2, 3], [5, 6, 7, 8]])
    assert mask.shape == (3, 1, 4, 12) and mask.dtype == bool
    assert mask[2, 0, :, :5].all() and not mask[2, 0, :, 5:8].any()  # its 5 cached slots, the rest hidden
    tril = np.tril(np.ones((4, 4), dtype=bool))
    for r in range(3):
        np.testing.assert_array_equal(mask[r, 0, :, 8:], tril)  # new positions causal: no real one sees a pad
    assert not mask[1, 0, :, :8].any()  # the idle row sees no cache slot (and itself: no all-hidden query)
    with pytest.raises(DSparkError, match="segment row 3 is outside 0..2"):
        call_inputs(3, 4, 8, [(3, 0, [1])])
    with pytest.raises(DSparkError, match="row 0: 5 tokens in a call of q = 4"):
        call_inputs(3, 4, 8, [(0, 0, [1] * 5)])
    with pytest.raises(DSparkError, match="row 1: 7 cached \\+ 2 new positions do not fit capacity bucket 8"):
        call_inputs(3, 4, 8, [(1, 7, [1, 2])])


def test_a_rows_inputs_do_not_depend_on_the_other_rows():
    alone = call_inputs(4, 5, 32, [(1, 11, [3, 4])])
    shared = call_inputs(4, 5, 32, [(0, 20, [9, 9, 9, 9, 9]), (1, 11, [3, 4]), (3, 2, [5])])
    for a, b in zip(alone, shared):
        np.testing.assert_array_equal(a[1], b[1])


# -- DeviceBatchRunner driven by the decoding loop, ONNX Runtime standing in for the device


class OrtDevice:
    """The part of :class:`~dspark_runtime.backends.trt.decoder.TrtDecoder` a DeviceBatchRunner uses (``set_rows``, ``use_bucket``,
    ``run_rows``, ``batch``, ``buckets``, ``decode_q``, ``max_q``, ``spec``), with the capacity-layout graph on ONNX
    Runtime CPU for the engine and host arrays for the device KV buffers: a bucket change keeps only the first
    ``keep`` positions of every row and fills the rest with garbage, which the masks must hide."""

    def __init__(self, onnx_path, spec, decode_q=5, max_q=16, buckets=BUCKETS):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        self.sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
        self.spec, self.decode_q, self.max_q, self.buckets = spec, decode_q, max_q, list(buckets)
        self.batch, self._bucket, self.shapes = 0, buckets[0], []
        self.stats = {"stand-in": "onnxruntime", "kv_writes": 0, "kv_write_s": 0.0, "d2h_bytes": 0}  # as TrtDecoder's
        self._rng = np.random.default_rng(7)
        self.set_rows(1)

    def _garbage(self, rows, bucket):
        d = self.spec.dims
        shape = (rows, d.num_kv_heads, bucket, d.head_dim)
        return [[(self._rng.normal(size=shape) * 50).astype(np.float32) for _ in range(2)]
                for _ in range(d.num_layers)]

    def set_rows(self, batch):
        if batch != self.batch:
            self.batch, self.kv = batch, self._garbage(batch, self._bucket)
        return self

    def use_bucket(self, needed, keep=None):
        bucket = choose_bucket(needed, self.buckets)
        if bucket != self._bucket:
            keep = min(keep, bucket, self._bucket)
            new = self._garbage(self.batch, bucket)
            for (nk, nv), (k, v) in zip(new, self.kv):
                nk[:, :, :keep], nv[:, :, :keep] = k[:, :, :keep], v[:, :, :keep]
            self.kv, self._bucket = new, bucket
        return bucket

    def run_rows(self, ids, pos, mask, writes, reads, with_logits=True, with_features=True):
        assert ids.shape[0] == self.batch and mask.shape[-1] == self._bucket + ids.shape[1]
        feeds = {"input_ids": ids, "position_ids": pos, "attention_mask": mask}
        for i, (k, v) in enumerate(self.kv):
            feeds[f"past.{i}.key"], feeds[f"past.{i}.value"] = k, v
        names = [t.name for t in self.spec.outputs]
        out = dict(zip(names, self.sess.run(names, feeds)))
        self.shapes.append((ids.shape[0], ids.shape[1], self._bucket))
        self.stats["kv_writes"] += 2 * len(self.kv) * len(writes)
        for row, past, n in writes:
            for i, (k, v) in enumerate(self.kv):
                k[row, :, past:past + n] = out[f"new.{i}.key"][row, :, :n]
                v[row, :, past:past + n] = out[f"new.{i}.value"][row, :, :n]
        back = ["argmax"] + (["logits"] if with_logits else []) + (["features"] if with_features else [])
        res = {name: {row: out[name][row, (first if name == "logits" else 0):n].copy() for row, n, first in reads}
               for name in back if name in out}
        self.stats["d2h_bytes"] += sum(a.nbytes for rows in res.values() for a in rows.values())
        return res


@pytest.fixture(scope="module")
def capacity_graph(tiny_engine_dir, tmp_path_factory):
    from dspark_export.graphs.capacity import to_capacity_layout
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path_factory.mktemp("trt-batch") / "e"
    shutil.copytree(tiny_engine_dir, d)
    g = load_manifest(d).graphs["target"]
    return d, to_capacity_layout(d / "target.onnx", d / "target.capacity.onnx", g.spec)


PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 123))]  # 40 tokens: 3 chunks of 16; 3; 23


def _loop(runner, drafter=None, rows=3):
    from dspark_runtime.decoding.loop import DecodingLoop
    from dspark_runtime.decoding.settings import LoopSettings

    return DecodingLoop(runner, drafter, LoopSettings(max_batch=rows, prefill_budget=runner.max_chunk))


def _run(loop, prompts, n=24):
    reqs = [loop.submit(p, max_new_tokens=n) for p in prompts]
    loop.run()
    return [r.token_ids for r in reqs]


def test_batched_greedy_output_is_independent_of_the_batch(capacity_graph, tiny_engine_dir):
    """Three requests decoded together (a 40-token prompt chunked 16/16/8 beside decoding rows, buckets crossed,
    rollbacks) give each request the tokens it gets alone in the same runner, and the ONNX Runtime engine's
    target-only greedy tokens; with the n-gram drafter too. Every call has 3 rows at q 5 or 16."""
    from dspark_runtime import Engine
    from dspark_runtime.drafting.drafters import NgramDrafter

    d, spec = capacity_graph
    eng = Engine.load(tiny_engine_dir, threads=1)
    ref = [_run(eng.batch(draft=None, max_batch=1), [p])[0] for p in PROMPTS]
    dev = OrtDevice(d / "target.capacity.onnx", spec)
    runner = DeviceBatchRunner(dev, rows=3)
    assert runner.device_argmax and runner.max_chunk == 16 and runner.pass_rows([1, 16]) == 3 * 5 + 3 * 16
    batched = _run(_loop(runner), PROMPTS)
    assert batched == ref
    assert {s[:2] for s in dev.shapes} == {(3, 5), (3, 16)} and {s[2] for s in dev.shapes} >= {16, 32, 64}
    # greedy on an engine with the argmax output: ids and features come back, never a row of logits (8 bytes an id,
    # 128 floats a feature row, 320 floats a logits row in the tiny model)
    fed = sum(len(p) for p in PROMPTS) + sum(len(t) for t in batched)
    assert dev.stats["d2h_bytes"] < fed * (8 + 128 * 4) + 320 * 4
    assert set(runner.calls) == {capture_key(*s) for s in dev.shapes}
    solo = [_run(_loop(DeviceBatchRunner(dev, rows=3)), [p])[0] for p in PROMPTS]
    assert solo == batched
    assert _run(_loop(DeviceBatchRunner(dev, rows=3), NgramDrafter()), PROMPTS) == ref
    assert _run(_loop(DeviceBatchRunner(dev.set_rows(1), rows=1), NgramDrafter(), rows=1), PROMPTS[:1]) == ref[:1]


def test_pinned_bucket_gives_bitwise_equal_logits_in_any_batch(capacity_graph):
    """With every call at the largest bucket a request's logits are bit for bit those it gets alone, at another row,
    beside rows of other lengths (on ONNX Runtime here; the GPU check measures TensorRT)."""
    d, spec = capacity_graph
    feeds = [list(range(5, 21)), [30, 31, 32, 33, 34], [9], [40, 41]]

    def logits_of_x(others: bool):
        r = DeviceBatchRunner(OrtDevice(d / "target.capacity.onnx", spec), rows=3, pin_bucket=True)
        if others:
            r.add("y")
            r.step([("y", list(range(50, 66)))])
            r.step([("y", list(range(66, 82)))])
        r.add("x")
        out = []
        for i, toks in enumerate(feeds):
            segs = [("x", toks)] + ([("y", [3 + i] * (1 + i % 3))] if others else [])
            out.append(r.step(segs)[0])
        return r, out

    alone, a = logits_of_x(False)
    shared, b = logits_of_x(True)
    assert alone._row["x"] == 0 and shared._row["x"] == 1
    for x, y in zip(a, b):
        assert x.dtype == np.float32 and np.array_equal(x, y)


def test_argmax_for_greedy_requests_and_refusals(capacity_graph):
    d, spec = capacity_graph
    r = DeviceBatchRunner(OrtDevice(d / "target.capacity.onnx", spec), rows=2)
    r.add("a")
    r.add("b")
    full = r.step([("a", [5, 6, 7]), ("b", [8])])
    r.rollback("a", 0)
    r.rollback("b", 0)
    ids = r.step([("a", [5, 6, 7]), ("b", [8])], argmax_for={"a"})
    assert ids[0].dtype == np.int64 and ids[0].shape == (3,)
    np.testing.assert_array_equal(ids[0], full[0].argmax(-1))  # the engine's argmax output
    assert ids[1].shape == (1, spec.dims.vocab_size)  # b is not greedy: its logits
    assert r.features("a").shape == (3, spec.outputs[1].shape[-1]) and r.length("b") == 1
    r.rollback("a", 0)
    r.rollback("b", 0)
    tail = r.step([("a", [5, 6, 7]), ("b", [8])], argmax_for={"b"}, last_only={"a", "b"})  # prompt chunks
    np.testing.assert_array_equal(tail[0], full[0][-1:])  # only the last position's logits came back
    assert tail[1].dtype == np.int64 and tail[1].shape == (1,) and tail[1][0] == full[1][-1].argmax()
    assert r.features("a").shape[0] == 3  # the features of every position still come back (the DSpark context)
    r.rollback("a", 0)
    np.testing.assert_array_equal(r.prefill("a", [5, 6, 7]), full[0][-1])
    r.keep_features = False  # no DSpark drafter: the features stay on the device
    r.rollback("b", 0)
    np.testing.assert_array_equal(r.step([("b", [8])])[0], full[1])
    assert r.features("b") is None and r.features("a") is None
    assert r.attended_positions(["b"]) == 16  # b holds 1 position, a 3: both fit the smallest bucket
    r.step([("a", list(range(20, 36)))])
    assert r.attended_positions(["b"]) == 32  # a's 19 positions set the bucket b's next call reads
    r.pin_bucket = True
    assert r.attended_positions(["b"]) == 128
    r.pin_bucket = False
    with pytest.raises(DSparkError, match="all 2 rows of the TensorRT runner are taken"):
        r.add("c")
    with pytest.raises(DSparkError, match="a segment of 17 tokens"):
        r.step([("a", [1] * 17)])
    with pytest.raises(ValueError, match="cannot roll request 'a' back to 20: it holds 19 positions"):
        r.rollback("a", 20)
    r.remove("a")
    r.add("c")  # a freed row is reused
    assert r._row["c"] == 0
    with pytest.raises(DSparkError, match="rows must be a positive integer"):
        DeviceBatchRunner(r.decoder, rows=0)
    DeviceBatchRunner(r.decoder, rows=1)  # takes the decoder over
    with pytest.raises(DSparkError, match="set to 1 rows by another runner after this one \\(2 rows\\)"):
        r.step([("c", [1])])


def _gpu_reason():
    return gpu_skip_reason("batched TensorRT decoding")


@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_batched_trt_on_gpu_matches_alone_and_onnx_runtime(tiny_engine_dir, tmp_path):
    """GPU only: 3 prompts decoded together on the TensorRT engine (3 rows) == each alone in a 3-row runner ==
    ONNX Runtime CPU's target-only greedy; the engine's argmax output used; decode calls captured and replayed."""
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt
    from dspark_runtime import Engine
    from dspark_runtime.backends.trt.profiles import ProfileSettings

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    build_trt(d, TrtBuildSettings(graphs=("target",), profile=ProfileSettings(
        max_batch=3, decode_q=5, prefill_chunk=16, capacity=128, min_bucket=32)), isolate=False, log=print)
    prompts = ["def add(a, b):", "Write a haiku about rain falling on a quiet street.", "def fib(n):"]
    ort_eng, trt_eng = Engine.load(d, threads=1), Engine.load(d, threads=1, placement="target=trt")
    ref = [ort_eng.generate(p, max_new_tokens=24, draft=None).token_ids for p in prompts]
    gen = trt_eng.batch(draft=None, max_batch=3)
    reqs = [gen.submit(trt_eng.encode_prompt(p), max_new_tokens=24) for p in prompts]
    gen.run()
    assert gen.target.device_argmax and [r.token_ids for r in reqs] == ref
    assert gen.target.decoder.stats["captured"] > 0 and gen.target.decoder.stats["replayed"] > 0
    assert all(k[0] == 3 and k[1] in (5, 16) for k in gen.target.calls)
    for p, want in zip(prompts, ref):
        alone = trt_eng.batch(draft=None, max_batch=3)
        r = alone.submit(trt_eng.encode_prompt(p), max_new_tokens=24)
        alone.run()
        assert r.token_ids == want
    res = trt_eng.generate_batch(prompts, max_new_tokens=24, draft="ngram", max_batch=3)
    assert [r.token_ids for r in res] == ref
