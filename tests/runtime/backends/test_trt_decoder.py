"""The TensorRT runtime backend: CPU-testable parts here (device KV handles, mask widening, buffer plan,
argument checks, engine wiring); the GPU parts (parity with ONNX Runtime, speculative == target-only,
CUDA-graph replay) run only where a CUDA device is present and skip with the reason elsewhere."""
import numpy as np
import pytest
from tests.fixtures.cuda_gpu import gpu_skip_reason

from dspark_runtime.errors import DSparkError, InputError
from dspark_runtime.engine_dir.graphspec import DecoderDims, causal_lm_spec, dspark_draft_spec
from dspark_runtime.runners.kvcache import KVCache, causal_mask
from dspark_runtime.engine_dir.manifest import FileEntry, TrtEngineEntry
from dspark_runtime.backends.device_decoder import DeviceKV, plan_buffers, widen_mask
from dspark_runtime.backends.trt.decoder import TrtDecoder
from dspark_runtime.backends.trt.dspark_graph import TrtDSparkGraph, dspark_chunk_mask, plan_dspark_chunks
from dspark_runtime.backends.trt.profiles import ProfileSettings, derive_profiles

DIMS = DecoderDims(num_layers=2, num_kv_heads=2, head_dim=16, hidden_size=64, vocab_size=320, feature_layers=(-1, 0))


def _entry(**ps):
    s = ProfileSettings(**{"max_batch": 2, "decode_q": 5, "prefill_chunk": 32, "capacity": 128, "min_bucket": 32, **ps})
    spec = causal_lm_spec(DIMS, "capacity")
    return TrtEngineEntry(graph="target", kv_layout="capacity", onnx="target.capacity.onnx",
                          file=FileEntry("target.capacity.engine", 1, "0" * 64), flavour="tensorrt-rtx",
                          version="1.7.1.116", profiles=derive_profiles(spec, s), profile_settings=s.to_json(),
                          compute_capabilities=["8.6"], precision="fp32", build_seconds=1.0, peak_rss_bytes=1, spec=spec)


def _dspark_entry(**ps):
    s = ProfileSettings(**{"max_batch": 2, "decode_q": 5, "prefill_chunk": 32, "capacity": 128, "min_bucket": 32, **ps})
    spec = dspark_draft_spec(DIMS, feature_size=128, block_size=4)
    return TrtEngineEntry(graph="dspark", kv_layout="growing", onnx="dspark.onnx",
                          file=FileEntry("dspark.engine", 1, "0" * 64), flavour="tensorrt-rtx", version="1.7.1.116",
                          profiles=derive_profiles(spec, s), profile_settings=s.to_json(), compute_capabilities=["8.6"],
                          precision="fp32", build_seconds=1.0, peak_rss_bytes=1, spec=spec)


def _gpu_reason():
    return gpu_skip_reason("the TensorRT runtime path")


def test_device_kv_handles_work_with_the_kv_cache():
    h = DeviceKV((1, 2, 0, 16))
    cache = KVCache([(h, h), (h, h)])
    full = DeviceKV((1, 2, 10, 16))
    cache.update([(full, full), (full, full)])
    assert cache.length == 10 and cache.view()[0][0] is full
    cache.rollback(7)
    assert cache.view()[1][0].shape == (1, 2, 7, 16)  # sliced like an array, still a handle
    assert cache.nbytes() == 0
    with pytest.raises(DSparkError, match=r"only support \[\.\.\., :n, :\] slicing"):
        full[0]


def test_widen_mask_hides_unwritten_and_stale_slots():
    m = causal_mask(3, 4)  # [1, 1, 3, 7]
    w = widen_mask(m, past=4, bucket=8)
    assert w.shape == (1, 1, 3, 11)
    assert w[..., :4].all() and not w[..., 4:8].any()  # slots 4..7: unwritten (or rolled back)
    np.testing.assert_array_equal(w[..., 8:], m[..., 4:])  # the new tokens keep their causal pattern
    out = np.ones((1, 1, 3, 11), dtype=bool)
    assert widen_mask(m, 4, 8, out=out) is out and not out[..., 5].any()
    with pytest.raises(DSparkError, match="do not fit capacity bucket 6"):
        widen_mask(m, 4, 6)
    with pytest.raises(DSparkError, match=r"past \(5\) \+ q \(3\) = 8"):
        widen_mask(m, 5, 16)


def test_buffer_plan_sizes():
    p = plan_buffers(_entry(), batch=2, capacity=128)
    assert p.kv == 2 * 2 * 2 * 2 * 128 * 16 * 4  # (k, v) x layers x batch x heads x capacity x head_dim x fp32
    assert p.kv_scratch == p.kv // 4
    assert p.inputs == {"input_ids": 2 * 32 * 8, "position_ids": 2 * 32 * 8, "attention_mask": 2 * 32 * 160}
    assert p.outputs["logits"] == 2 * 32 * 320 * 4 and p.outputs["features"] == 2 * 32 * 128 * 4
    assert p.outputs["new.1.value"] == 2 * 2 * 32 * 16 * 4
    assert p.total == p.kv + p.kv_scratch + sum(p.inputs.values()) + sum(p.outputs.values())
    with pytest.raises(DSparkError, match="batch 3 exceeds the engine's max_batch 2"):
        plan_buffers(_entry(), batch=3, capacity=128)
    with pytest.raises(DSparkError, match="capacity 256 exceeds the engine's 128"):
        plan_buffers(_entry(), batch=1, capacity=256)


def test_trt_decoder_constructs_cheaply_and_checks_arguments(tmp_path):
    dec = TrtDecoder(tmp_path, _entry(), batch=1, capacity=96)  # no TensorRT, no GPU touched
    assert dec.buckets == [32, 64, 96] and dec.decode_q == 5 and dec.context is None
    assert dec.stats == {"captured": 0, "replayed": 0, "uncaptured": 0, "relayouts": 0, "kv_writes": 0,
                         "kv_write_s": 0.0, "kv_write_mode": "3d", "d2h_bytes": 0}
    assert dec.kv_bytes == 2 * 2 * 1 * 2 * 96 * 16 * 4
    assert dec.empty_kv(1)[0][0].shape == (1, 2, 0, 16)
    with pytest.raises(DSparkError, match="activated for batch 1, not 2"):
        dec.empty_kv(2)
    e = _entry()
    e.kv_layout = "growing"
    with pytest.raises(DSparkError, match="TrtDecoder runs capacity-layout graphs"):
        TrtDecoder(tmp_path, e)


def test_engine_backend_choice(tiny_engine_dir):
    from dspark_runtime import Engine

    with pytest.raises(InputError, match="no TensorRT engine for the target"):
        Engine.load(tiny_engine_dir, backend="trt")
    with pytest.raises(InputError, match="unknown backend 'cuda'"):
        Engine.load(tiny_engine_dir, backend="cuda")


def test_engine_wires_trt_backends_and_batches_within_max_batch(tiny_engine_dir, tmp_path, monkeypatch):
    import shutil

    from dspark_runtime import Engine
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    m = load_manifest(d)
    m.trt_engines["target.capacity"] = _entry()  # wiring only: nothing is activated
    eng = Engine(d, m, threads=1, backend="trt")
    assert isinstance(eng._backends["target"], TrtDecoder)
    assert not isinstance(eng._backends["draft"], TrtDecoder)  # no draft engine: the draft stays on ONNX Runtime
    with pytest.raises(InputError, match=r"max_batch 8, but the TensorRT engine of graph 'target' takes at most 2 "
                                         r"rows per call; use max_batch <= 2 or rebuild it with `dspark-export "
                                         r"build-trt .* --max-batch 8`"):
        eng.batch(draft="ngram")
    from dspark_runtime.runners.device import DeviceBatchRunner

    gen = eng.batch(draft="ngram", max_batch=2)  # batched TensorRT: a runner of 2 rows, the engine not yet touched
    assert isinstance(gen.target, DeviceBatchRunner) and gen.target.rows == 2 and gen.max_batch == 2
    assert gen.prefill_budget == 32  # "auto" on TensorRT: whole prefill chunks, the same in any batch
    assert eng._backends["target"].batch == 2 and eng._backends["target"].context is None
    solo = eng.batch(draft=None, max_batch=1)  # generate(): the same runner class at one row
    assert isinstance(solo.target, DeviceBatchRunner) and solo.target.rows == 1 and eng._backends["target"].batch == 1
    assert not gen.target.keep_features and not solo.target.keep_features  # no DSpark drafter reads them


def test_trt_target_features_come_back_for_the_dspark_drafter(tiny_engine_with_dspark, tmp_path):
    import shutil

    from dspark_runtime import Engine
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_with_dspark, d)
    m = load_manifest(d)
    m.trt_engines["target.capacity"] = _entry()  # wiring only: the target's engine is not activated
    eng = Engine(d, m, threads=1, placement="target=trt")
    assert eng.batch(draft="dspark", max_batch=2).target.keep_features
    assert eng.batch(draft="router", max_batch=2).target.keep_features  # the router over the DSpark drafter
    assert not eng.batch(draft="lm", max_batch=2).target.keep_features


def test_engine_sizes_the_dspark_drafter_engine_for_its_rows(tiny_engine_with_dspark, tmp_path):
    """The DSpark drafter's TensorRT engine gets the engine's max_batch rows; a batch above them is refused up front
    even when only the drafter runs on TensorRT (it would fail mid-run otherwise)."""
    import shutil

    from dspark_runtime import Engine
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_with_dspark, d)
    m = load_manifest(d)
    m.trt_engines["dspark"] = _dspark_entry()  # max_batch 2; wiring only
    eng = Engine(d, m, threads=1, placement="dspark=trt")
    g = eng._backends["dspark"]
    assert isinstance(g, TrtDSparkGraph) and g.batch == 2 and g.plan.kv == 2 * 2 * 2 * 2 * 128 * 16 * 4
    with pytest.raises(InputError, match="max_batch 3, but the TensorRT engine of graph 'dspark' takes at most 2 rows"):
        eng.batch(draft=None, max_batch=3)


def test_trt_decoder_set_rows_replans_its_buffers(tmp_path):
    dec = TrtDecoder(tmp_path, _entry(), capacity=96)  # not activated: re-planned only
    one = dec.plan
    assert dec.set_rows(2) is dec and dec.batch == 2 and dec.plan.kv == 2 * one.kv
    assert dec.plan.inputs["attention_mask"] == 2 * one.inputs["attention_mask"]
    assert dec.plan.outputs["argmax"] == 2 * 32 * 8 and dec.empty_kv(2)[0][0].shape == (2, 2, 0, 16)
    with pytest.raises(DSparkError, match="batch 3 exceeds the engine's max_batch 2; rebuild with --max-batch"):
        dec.set_rows(3)
    assert dec.batch == 2  # a refused change leaves the decoder as it was


@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_trt_backend_on_gpu_matches_onnx_runtime(tiny_engine_dir, tmp_path):
    """GPU only: logits parity with ONNX Runtime over prefill, decode and a rollback; speculative greedy ==
    target-only greedy on TensorRT; CUDA graphs captured and replayed."""
    import shutil

    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt
    from dspark_runtime import Engine
    from dspark_runtime.runners.sequence import DecoderRunner

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    build_trt(d, TrtBuildSettings(profile=ProfileSettings(max_batch=1, decode_q=5, prefill_chunk=32, capacity=128,
                                                          min_bucket=32)), isolate=False, log=print)
    ort_eng, trt_eng = Engine.load(d, threads=1), Engine.load(d, backend="trt")
    a, b = ort_eng.runner("target"), trt_eng.runner("target")
    assert isinstance(b, DecoderRunner) and isinstance(b.backend, TrtDecoder)
    ids = list(range(5, 45))
    np.testing.assert_allclose(b.prefill(ids, chunk=32), a.prefill(ids, chunk=32), atol=1e-3)
    for step in range(12):  # decode and verify steps, with rollbacks, crossing the 64-slot bucket
        toks = [(7 * step + i) % 300 + 3 for i in range(1 + step % 5)]
        np.testing.assert_allclose(b.step(toks), a.step(toks), atol=1e-3)
        keep = a.length - (step % 3)
        a.rollback(keep)
        b.rollback(keep)
    assert b.backend.stats["captured"] > 0 and b.backend.stats["replayed"] > 0
    assert b.backend.stats["relayouts"] >= 1
    ref = trt_eng.generate("def add(a, b):", max_new_tokens=24, draft=None)
    spec = trt_eng.generate("def add(a, b):", max_new_tokens=24, draft="lm", draft_length=4)
    assert spec.token_ids == ref.token_ids
    assert ref.token_ids == ort_eng.generate("def add(a, b):", max_new_tokens=24, draft=None).token_ids


# -- the DSpark drafter on its TensorRT engine: planning (CPU), chunking checked on ONNX Runtime, GPU parity


def test_dspark_buffer_plan_sizes():
    p = plan_buffers(_dspark_entry(), batch=1, capacity=128)
    # context upload buffers: (k, v) x 2 layers x batch 1 x 2 heads x 128 positions x head_dim 16 x fp32
    assert p.kv == 2 * 2 * 1 * 2 * 128 * 16 * 4 and p.kv_scratch == 0
    assert p.inputs == {"features": 32 * 128 * 4, "feature_positions": 32 * 8, "anchor_embeds": 64 * 4,
                        "block_positions": 4 * 8, "attention_mask": 4 * (128 + 32 + 4)}  # mask_len = ctx + block
    assert p.outputs["hidden"] == 4 * 64 * 4 and p.outputs["base_logits"] == 4 * 320 * 4
    assert p.outputs["present.1.key"] == 2 * (128 + 32) * 16 * 4  # ctx_len = capacity + a prefill chunk
    with pytest.raises(DSparkError, match="batch 3 exceeds the engine's max_batch 2"):
        plan_buffers(_dspark_entry(), batch=3, capacity=128)


def test_dspark_chunk_plan():
    assert plan_dspark_chunks(past=0, n_new=70, max_new=32, capacity=128) == [(0, 32), (32, 64), (64, 70)]
    assert plan_dspark_chunks(past=50, n_new=5, max_new=32, capacity=128) == [(0, 5)]
    assert plan_dspark_chunks(past=0, n_new=0, max_new=32, capacity=128) == [(0, 0)]  # a one-token prompt
    with pytest.raises(DSparkError, match="needs 130 positions but its TensorRT engine takes 128; rebuild it with a "
                                          "larger --capacity"):
        plan_dspark_chunks(past=100, n_new=30, max_new=32, capacity=128)


def test_dspark_chunk_mask():
    m = np.zeros((1, 1, 4, 3 + 5 + 4), dtype=bool)
    m[..., :3] = [True, False, True]  # a padded context slot stays hidden
    m[..., 3:8] = True
    m[..., 8:] = np.tril(np.ones((4, 4), dtype=bool))
    c = dspark_chunk_mask(m, past=3, n_new=5, start=0, end=2)
    assert c.shape == (1, 1, 4, 3 + 2 + 4)
    np.testing.assert_array_equal(c[..., :5], m[..., :5])
    np.testing.assert_array_equal(c[..., 5:], m[..., 8:])  # the block's own columns follow the chunk
    pad = dspark_chunk_mask(m[..., [0, 1, 2, 8, 9, 10, 11]], past=3, n_new=0, start=0, end=0)
    assert pad.shape == (1, 1, 4, 8) and not pad[..., 3].any()  # the padding column is hidden
    with pytest.raises(DSparkError, match=r"past \(3\) \+ new \(4\) \+ block \(4\) = 11"):
        dspark_chunk_mask(m, past=3, n_new=4, start=0, end=2)


def test_trt_dspark_graph_constructs_cheaply_and_checks_its_entry(tmp_path):
    g = TrtDSparkGraph(tmp_path, _dspark_entry())  # no TensorRT, no GPU touched
    assert g.block_size == 4 and g.embeds_anchor and g.max_new == 32 and g.capacity == 128 and g.context is None
    assert g.empty_kv(1)[1][0].shape == (1, 2, 0, 16) and g.plan.kv == 2 * 2 * 2 * 128 * 16 * 4
    with pytest.raises(DSparkError, match="runs dspark_draft engines of the growing layout; target.capacity.engine is "
                                          "a causal_lm engine of the capacity layout"):
        TrtDSparkGraph(tmp_path, _entry())
    with pytest.raises(DSparkError, match="batch 4 exceeds"):
        TrtDSparkGraph(tmp_path, _dspark_entry(), batch=4)


def test_chunked_drafter_calls_equal_one_call_on_onnx_runtime(tiny_engine_with_dspark):
    """What TrtDSparkGraph does with a context longer than its prefill chunk, run on ONNX Runtime: the chunked calls
    (each chunk's present the next one's past, the last one's block) give the one call's block outputs and context."""
    from dspark_runtime.drafting.dspark import OrtDSparkGraph
    from dspark_runtime.drafting.embedding_rows import EmbeddingRows
    from dspark_runtime.engine_dir.manifest import load_manifest

    m = load_manifest(tiny_engine_with_dspark)
    spec = m.graphs["dspark"].spec
    g = OrtDSparkGraph(tiny_engine_with_dspark / "dspark.onnx", spec, threads=1,
                       embedding=EmbeddingRows.from_manifest(tiny_engine_with_dspark, m.speculation.dspark.embedding))
    rng = np.random.default_rng(0)
    past, n, G = 6, 23, g.block_size
    kv = [tuple(rng.normal(size=(1, 2, past, 16)).astype(np.float32) for _ in range(2)) for _ in range(2)]
    feats = rng.normal(size=(1, n, spec.inputs[0].shape[-1])).astype(np.float32)
    fpos = np.arange(past, past + n)[None]
    bpos = np.arange(past + n, past + n + G)[None]
    mask = np.ones((1, 1, G, past + n + G), dtype=bool)
    mask[..., 2] = False  # a padding slot of the past
    anchor = np.array([[11]])
    h_ref, b_ref, kv_ref = g.run(feats, fpos, anchor, bpos, mask, kv)
    cur = kv
    chunks = plan_dspark_chunks(past, n, max_new=8, capacity=128)
    assert chunks == [(0, 8), (8, 16), (16, 23)]
    for s, e in chunks:
        h, b, cur = g.run(feats[:, s:e], fpos[:, s:e], anchor, bpos, dspark_chunk_mask(mask, past, n, s, e), cur)
    assert np.abs(h - h_ref).max() < 1e-5 and np.abs(b - b_ref).max() < 1e-4
    for (k, v), (kr, vr) in zip(cur, kv_ref):
        assert k.shape == kr.shape == (1, 2, past + n, 16)
        assert np.abs(k - kr).max() < 1e-5 and np.abs(v - vr).max() < 1e-5


@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_dspark_drafter_on_gpu_matches_onnx_runtime(tiny_engine_with_dspark, tmp_path):
    """GPU only: the DSpark drafter's TensorRT engine against its ONNX graph (block outputs and context over a long
    first call, chunked, then rounds), and speculative greedy with dspark=trt == target-only greedy."""
    import shutil

    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt
    from dspark_runtime import Engine
    from dspark_runtime.drafting.dspark import DSparkDrafter

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_with_dspark, d)
    build_trt(d, TrtBuildSettings(graphs=("dspark",), profile=ProfileSettings(
        max_batch=1, decode_q=5, prefill_chunk=16, capacity=128, min_bucket=32)), isolate=False, log=print)
    ort_eng, trt_eng = Engine.load(d, threads=1), Engine.load(d, threads=1, placement="dspark=trt")
    ga, gb = ort_eng._backends["dspark"].activate(), trt_eng._backends["dspark"].activate()
    rng = np.random.default_rng(0)
    kva, kvb, past = ga.empty_kv(1), gb.empty_kv(1), 0
    for n in (40, 3, 5, 1):  # 40 > the 16-position chunk: three engine runs
        feats = rng.normal(size=(1, n, ga.spec.inputs[0].shape[-1])).astype(np.float32)
        args = (feats, np.arange(past, past + n)[None], np.array([[9]]), np.arange(past + n, past + n + 4)[None],
                np.ones((1, 1, 4, past + n + 4), dtype=bool))
        ha, ba, kva = ga.run(*args, kva)
        hb, bb, kvb = gb.run(*args, kvb)
        past += n
        assert np.abs(ha - hb).max() < 1e-3 and np.abs(ba - bb).max() < 1e-2
        assert (ba.argmax(-1) == bb.argmax(-1)).all()
        assert max(np.abs(a - b).max() for pa, pb in zip(kva, kvb) for a, b in zip(pa, pb)) < 1e-3
    assert gb.stats["resident"] == 3 and gb.stats["engine_runs"] == 6
    ref = trt_eng.generate("def add(a, b):", max_new_tokens=24, draft=None)
    spec = trt_eng.generate("def add(a, b):", max_new_tokens=24, draft="dspark", draft_length=4)
    assert spec.token_ids == ref.token_ids and spec.stats.placement == "target=cpu,draft=cpu,dspark=trt"
    assert isinstance(trt_eng.drafter("dspark", trt_eng.runner("target")), DSparkDrafter)


@pytest.mark.parametrize("extra,msg", [
    ([], "placement 'trt' needs the target's TensorRT engine; build it with `dspark-export build-trt ENGINE`"),
    (["--placement", "cpu"], r"give either --backend trt or --placement \(--placement trt is the same\), not both"),
])
def test_serve_backend_trt_refusals(extra, msg, tiny_engine_dir, capsys):
    """`dspark serve --backend trt` is `--placement trt`: refused by name where the engine has no TensorRT target
    engine, or beside --placement (before any server or GPU is touched)."""
    import re

    from dspark_runtime.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--engine", str(tiny_engine_dir), "--backend", "trt", "--threads", "1", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(msg, err) and "Traceback" not in err, err
