"""The capacity-layout decoder on ONNX Runtime (dspark_runtime.backends.ort_cuda, device_decoder, device_memory) with host
memory standing in for the GPU: the same buffers, IOBindings, bucket re-layouts and strided cache writes a CUDA run
makes, on ONNX Runtime's CPU provider. The GPU itself: scripts/gpu_check.sh (tests skip it here)."""
import shutil

import numpy as np
import pytest

from dspark_runtime.backends.device_decoder import DeviceLayout, new_slot_length
from dspark_runtime.backends.device_memory import HostMemory
from dspark_runtime.errors import DSparkError
from dspark_runtime.backends.trt.profiles import ProfileSettings

PROFILE = ProfileSettings(max_batch=4, decode_q=5, prefill_chunk=16, capacity=128, min_bucket=32)
PROMPTS = [list(range(5, 45)), [7, 8, 9], list(range(100, 123))]  # 40 tokens: 3 chunks of 16; 3; 23


@pytest.fixture(scope="module")
def cuda_engine(tiny_engine_dir, tmp_path_factory):
    """A copy of the tiny fp32 engine with an fp32 device graph of its target (the build-cuda path)."""
    from dspark_export.graphs.device import build_cuda

    d = tmp_path_factory.mktemp("cuda") / "e"
    shutil.copytree(tiny_engine_dir, d)
    build_cuda(d, PROFILE, half=None, isolate=False, log=lambda *a: None)
    return d


def _host_engine(d, **kw):
    """Engine.load with the target placed on cuda and host memory standing in for the GPU."""
    from dspark_runtime import Engine
    from dspark_runtime.backends.ort_cuda import OrtDeviceDecoder

    eng = Engine.load(d, threads=1, placement="target=cuda", **kw)
    dec = eng._backends["target"]
    assert isinstance(dec, OrtDeviceDecoder)
    dec._memory_factory = HostMemory  # the stand-in: CPU provider on host buffers
    return eng


def test_write_copy_geometry_moves_exactly_a_rows_new_positions():
    """The 3-D copy of row 1's first 2 of q=4 new positions into slots 5, 6 at bucket 8, every layer at once, equals
    the same copy done with numpy indexing; nothing else in the cache changes."""
    lay = DeviceLayout(rows=3, kv_heads=2, head_dim=4, layers=2, capacity=16, new_len=new_slot_length(4, 8),
                       itemsize=4)
    assert lay.new_len == 8
    rng = np.random.default_rng(0)
    cache = rng.normal(size=(4, 3 * 2 * 16 * 4)).astype(np.float32)  # 2 x layers slots, each [rows, heads, 16, hd]
    new = rng.normal(size=(4, 3 * 2 * 8 * 4)).astype(np.float32)
    want = cache.copy()
    q, bucket, row, past, n = 4, 8, 1, 5, 2
    for j in range(4):  # slot j as [rows, heads, bucket, hd] (bucket pitch), new as [rows, heads, q, hd]
        c = want[j, :3 * 2 * bucket * 4].reshape(3, 2, bucket, 4)
        s = new[j, :3 * 2 * q * 4].reshape(3, 2, q, 4)
        c[row, :, past:past + n] = s[row, :, :n]
    mem = HostMemory()
    c = lay.write_copy(row, past, n, q, bucket)
    assert c["sslice"] % c["spitch"] == 0 and c["dslice"] % c["dpitch"] == 0 and c["depth"] == 4
    mem.copy_3d(**{**c, "dst": cache.ctypes.data + c["dst"], "src": new.ctypes.data + c["src"]})
    np.testing.assert_array_equal(cache, want)
    # rows 0 and 1 at the same past and n: one copy for both, equal to two
    merged = lay.write_copies([(1, 3, 2), (0, 3, 2), (2, 1, 4)], q, bucket)
    assert [(c["height"], c["dst"]) for c in merged] == [(4, 3 * 16), (2, (2 * 2 * bucket + 1) * 16)]
    two = cache.copy()
    for r in (0, 1):
        c = lay.write_copy(r, 3, 2, q, bucket)
        mem.copy_3d(**{**c, "dst": two.ctypes.data + c["dst"], "src": new.ctypes.data + c["src"]})
    c = merged[0]
    mem.copy_3d(**{**c, "dst": cache.ctypes.data + c["dst"], "src": new.ctypes.data + c["src"]})
    np.testing.assert_array_equal(cache, two)


def test_build_cuda_records_a_device_graph_and_refuses_cpu_engines(cuda_engine, tmp_path):
    from dspark_export.graphs.device import build_cuda
    from dspark_runtime.engine_dir.manifest import load_manifest

    e = load_manifest(cuda_engine).device_graphs["target"]
    assert (e.graph, e.kv_layout, e.onnx, e.precision) == ("target", "capacity", "target.capacity.onnx", "fp32")
    assert e.profile_settings == PROFILE.to_json() and [f.path for f in e.files] == ["target.capacity.onnx"]
    assert "argmax" in e.spec.output_names and e.spec.kv_layout == "capacity"
    import onnx

    g = onnx.load(str(cuda_engine / e.onnx), load_external_data=False).graph
    layers = e.spec.dims.num_layers
    assert [n.op_type for n in g.node].count("RotaryEmbedding") == 2 * layers  # query and key of every layer
    assert not any(n.op_type == "Neg" for n in g.node)  # the exported rotate_half is gone
    with pytest.raises(DSparkError, match="has no graph 'drafter'"):
        build_cuda(cuda_engine, PROFILE, graphs=("drafter",), isolate=False)
    with pytest.raises(DSparkError, match="max_batch must be a positive integer|max_batch"):
        build_cuda(cuda_engine, ProfileSettings(max_batch=0), isolate=False)
    m = load_manifest(cuda_engine)
    d = tmp_path / "int4"
    shutil.copytree(cuda_engine, d)
    m.graphs["target"].precision = "int4"
    m.write(d)
    with pytest.raises(DSparkError, match="device graphs are made from fp32 causal_lm graphs with the growing"):
        build_cuda(d, PROFILE, isolate=False)


def test_device_decoder_matches_the_growing_graph(cuda_engine):
    """One sequence through DecoderRunner: a 40-token prompt in chunks of 16 (buckets 32 -> 64 re-laid out), then
    verify steps with rollbacks: the same logits as the growing graph on ONNX Runtime CPU."""
    from dspark_runtime import Engine
    from dspark_runtime.runners.sequence import DecoderRunner

    ref = Engine.load(cuda_engine, threads=1).runner("target")
    dev = _host_engine(cuda_engine).runner("target")
    assert isinstance(dev, DecoderRunner) and dev.backend.max_q == 16
    a, b = ref.prefill(PROMPTS[0], chunk=16), dev.prefill(PROMPTS[0], chunk=16)
    np.testing.assert_allclose(b, a, atol=1e-4)
    for toks, keep in (([3, 4, 5, 6], 42), ([9, 9], 44), ([1, 2, 3, 4, 5], 40), ([7], 41)):
        la, lb = ref.step(toks), dev.step(toks)
        np.testing.assert_allclose(lb, la, atol=1e-4)
        assert (lb.argmax(-1) == la.argmax(-1)).all()
        ref.rollback(keep)
        dev.rollback(keep)
    np.testing.assert_allclose(dev.features, ref.features, atol=1e-4)
    st = dev.backend.stats
    assert st["relayouts"] >= 1 and st["kv_write_mode"] == "3d" and st["uncaptured"] > 0 and st["captured"] == 0


def test_greedy_speculative_equals_target_only_and_a_batch_equals_each_alone(cuda_engine):
    """On the device decoder (a DeviceBatchRunner over it): greedy with the draft LM == target-only == the CPU engine's
    target-only tokens; three prompts decoded together == each alone; the argmax output comes back, not logits."""
    from dspark_runtime import Engine
    from dspark_runtime.runners.device import DeviceBatchRunner

    texts = ["def quicksort(xs): return the list sorted, shortest code first", "hi", "a b c d e f g h i j k"]
    cpu = Engine.load(cuda_engine, threads=1)
    ref = [cpu.generate(t, max_new_tokens=24, draft=None, raw=True).token_ids for t in texts]
    eng = _host_engine(cuda_engine)
    assert eng.backend == "cuda"
    plain = [eng.generate(t, max_new_tokens=24, draft=None, raw=True).token_ids for t in texts]
    spec = [eng.generate(t, max_new_tokens=24, draft="lm", draft_length=4, raw=True) for t in texts]
    assert plain == ref and [r.token_ids for r in spec] == ref
    assert spec[0].stats.placement == "target=cuda,draft=cpu" and sum(r.stats.accepted_length_mean for r in spec) > 3
    batch = eng.generate_batch(texts, max_new_tokens=24, draft="lm", max_batch=3, raw=True)
    assert [r.token_ids for r in batch] == ref
    ref = [cpu.batch(draft=None, max_batch=1) for _ in PROMPTS]
    solo = [loop.submit(p, max_new_tokens=8) for loop, p in zip(ref, PROMPTS)]
    for loop in ref:
        loop.run()
    ref = [r.token_ids for r in solo]
    loop = eng.batch(draft=None, max_batch=3)
    assert isinstance(loop.target, DeviceBatchRunner) and loop.target.device_argmax
    dec = eng._backends["target"]
    vocab = eng.manifest.graphs["target"].spec.dims.vocab_size
    before = dec.stats["d2h_bytes"]
    reqs = [loop.submit(p, max_new_tokens=8) for p in PROMPTS]
    loop.run()
    assert [r.token_ids for r in reqs] == ref
    # copied back: per fed position an id (8 B) and for each prompt chunk its last logits row; never q rows of logits
    fed = sum(len(p) for p in PROMPTS) + 3 * 8
    assert dec.stats["d2h_bytes"] - before <= fed * 8 + 6 * vocab * 4


def test_rows_above_the_device_graphs_max_batch_are_refused(cuda_engine):
    from dspark_runtime.errors import InputError

    eng = _host_engine(cuda_engine)
    with pytest.raises(InputError, match=r"max_batch 8, but the device graph of graph 'target' takes at most 4 rows "
                                         r"per call; use max_batch <= 4 or rebuild it with `dspark-export build-cuda"):
        eng.batch(draft=None, max_batch=8)


def test_cuda_placement_names_the_gpu_install_on_the_cpu_package(cuda_engine):
    """With the CPU onnxruntime, the device decoder refuses before taking any device memory, naming the install."""
    import onnxruntime as ort

    from dspark_runtime import Engine

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    eng = Engine.load(cuda_engine, threads=1, placement="target=cuda")
    with pytest.raises(DSparkError, match=r"has no CUDA execution provider .* install the GPU package in its place: "
                                          r"pip uninstall -y onnxruntime onnxruntime-gpu && pip install "
                                          r"onnxruntime-gpu==1.31.1"):
        eng.generate("hello", max_new_tokens=2, draft=None)


def test_an_fp16_device_graph_keeps_its_cache_in_fp16(tiny_engine_dir, tmp_path):
    """build-cuda's default fp16: the cache inputs and new-K/V outputs are float16 (no casts at the interface; half
    the cache bytes), the decoder sizes its buffers by that dtype, and greedy speculative == target-only on it."""
    import onnx

    from dspark_export.graphs.device import build_cuda
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    build_cuda(d, PROFILE, isolate=False, log=lambda *a: None)
    e = load_manifest(d).device_graphs["target"]
    assert e.precision == "fp16" and e.onnx == "target.capacity.fp16.onnx"
    kinds = {t.name.split(".")[0]: t.dtype for t in (*e.spec.inputs, *e.spec.outputs)}
    assert kinds["past"] == kinds["new"] == "float16" and kinds["logits"] == "float32"
    g = onnx.load(str(d / e.onnx), load_external_data=False).graph
    assert not any(n.op_type == "Cast" and n.input[0].startswith("past.") for n in g.node)
    eng = _host_engine(d)
    dec = eng._backends["target"]
    text = "def quicksort(xs): return the list sorted"
    plain = eng.generate(text, max_new_tokens=16, draft=None, raw=True).token_ids
    spec = eng.generate(text, max_new_tokens=16, draft="lm", draft_length=4, raw=True).token_ids
    assert spec == plain and len(plain) == 16
    assert dec.layout.itemsize == 2
    assert dec.kv_bytes == 2 * 2 * 2 * 1 * 128 * 16 * 2  # layers x (k, v) x kv heads x rows x capacity x head_dim x 2 B
