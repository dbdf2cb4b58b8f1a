"""The integer-GEMM prompt graph (dspark_export/precision/prompt_graph.py, `dspark-export add-prompt-graph`) and the
runtime running prompt chunks on it (ScatterRunner.prompt_backend): what it computes, that a prompt's positions are
computed alike whatever the chunking and batch, and that speculative output still equals target-only output."""
import json
import shutil

import numpy as np
import pytest

from dspark_runtime.errors import DSparkError


def _nbits_graph(tmp_path, w, x_dim: int):
    """One projection ``y = x @ W`` as the int4 writers emit it (MatMulNBits + block-sum correction), ``w`` an
    NBitsWeight; saved as tmp_path/p.onnx with external data."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from dspark_export.precision.nbits import NBitsMeta, add_ms_opset, nbits_nodes

    meta = NBitsMeta(w.bits, w.block_size, w.k, w.n, correction=True)
    nodes = []
    nbits_nodes(helper, "proj", "x", "y", "W", meta, 4, {}, nodes)
    inits = [numpy_helper.from_array(w.packed, "W_Q"), numpy_helper.from_array(w.scales.reshape(-1), "W_scales"),
             numpy_helper.from_array(w.packed_zero_points(), "W_zp"), numpy_helper.from_array(w.correction, "W_corr"),
             numpy_helper.from_array(np.array([0, 0, w.k // w.block_size, w.block_size], np.int64),
                                     f"__nbits_shape_{w.k}_{w.block_size}"),
             numpy_helper.from_array(np.array([-1], np.int64), "__nbits_axis_last")]
    g = helper.make_graph(nodes, "p", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "q", x_dim])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "q", w.n])], inits)
    proto = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    add_ms_opset(proto, helper)
    path = tmp_path / "p.onnx"
    onnx.save_model(proto, str(path), save_as_external_data=True, location="p.onnx.data", size_threshold=256)
    return path


@pytest.mark.parametrize("bits", [7, 8])
def test_a_projection_computes_the_per_row_integer_product_of_the_represented_weight(tmp_path, bits):
    """MatMulNBits with a block-sum correction becomes MatMulInteger over the weight it represents (correction
    folded in), re-quantized per column: the output is, bit for bit, the integer product numpy computes."""
    import onnx
    import onnxruntime as ort

    from dspark_export.precision.nbits import NBitsWeight, pack_codes
    from dspark_export.precision.prompt_graph import column_int8, integer_prompt_graph

    rng = np.random.default_rng(0)
    k, n, blk = 64, 48, 32
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    w = NBitsWeight(4, blk, pack_codes(codes, 4, blk), rng.uniform(0.01, 0.05, (n, k // blk)).astype(np.float32),
                    np.zeros((n, k // blk), np.uint8), rng.uniform(0, 0.2, (k // blk, n)).astype(np.float32))
    src = _nbits_graph(tmp_path, w, k)
    rep = integer_prompt_graph(src, tmp_path / "prompt.onnx", weight_bits=bits, log=lambda *a: None)
    assert rep["replaced"] == 1 and rep["kept"] == 0 and rep["integer_weight_bytes"] == k * n
    ops = [nd.op_type for nd in onnx.load(str(tmp_path / "prompt.onnx"), load_external_data=False).graph.node]
    assert "MatMulIntegerToFloat" in ops and "MatMulNBits" not in ops
    assert "ReduceSum" not in ops  # the correction folded
    x = rng.standard_normal((1, 5, k)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "prompt.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    wq, ws = column_int8(w.dequantize(), bits)
    s = np.maximum(np.abs(x).max(-1, keepdims=True) / np.float32(127), np.float32(1e-30))
    xq = np.rint(x / s).astype(np.int64)  # (round(x / s) + 128) - 128
    want = ((xq @ wq.astype(np.int64)).astype(np.float32) * ws) * s
    from dspark_runtime.machine.kernel_probe import u8s8_saturates

    if bits == 8 and u8s8_saturates():  # AVX2 without VNNI clips u8·s8 pair sums: why `auto` picks 7 bits here
        assert not np.array_equal(got, want)
        return
    np.testing.assert_array_equal(got, want)
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < (0.03 if bits == 7 else 0.015)
    with pytest.raises(DSparkError, match="7 or 8"):
        integer_prompt_graph(src, tmp_path / "bad.onnx", weight_bits=4)


def test_outlier_channels_run_apart_in_fp32(tmp_path):
    """Channels named in ``outliers`` leave the integer product (zeroed there, their weight rows out of the column
    scales) and are multiplied in fp32: the output is the integer product of the rest plus the fp32 product of
    those channels; a huge activation in an outlier channel no longer coarsens the others' quantization."""
    import onnxruntime as ort

    from dspark_export.precision.nbits import NBitsWeight, pack_codes
    from dspark_export.precision.prompt_graph import column_int8, integer_prompt_graph, outlier_channels

    rng = np.random.default_rng(1)
    k, n, blk = 64, 40, 32
    w = NBitsWeight(4, blk, pack_codes(rng.integers(0, 16, (n, k)).astype(np.uint8), 4, blk),
                    rng.uniform(0.01, 0.05, (n, k // blk)).astype(np.float32), np.full((n, k // blk), 8, np.uint8),
                    rng.uniform(0, 0.2, (k // blk, n)).astype(np.float32))
    src = _nbits_graph(tmp_path, w, k)
    x = rng.standard_normal((1, 6, k)).astype(np.float32)
    x[..., 5] *= 300.0  # an outlier channel
    maxima = np.abs(x).max(axis=(0, 1))
    apart = outlier_channels(maxima, ratio=3.0, most=4)
    assert 5 in apart and len(apart) <= 4
    rel = {}
    for name, outl in (("apart", {"x": apart}), ("plain", None)):
        rep = integer_prompt_graph(src, tmp_path / f"{name}.onnx", weight_bits=7, outliers=outl, log=lambda *a: None)
        assert rep["outlier_channels"] == (len(apart) if outl else 0)
        got = ort.InferenceSession(str(tmp_path / f"{name}.onnx"), providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0]
        full = w.dequantize()
        rel[name] = np.linalg.norm(got - x @ full) / np.linalg.norm(x @ full)
        if outl:
            rest = full.copy()
            rest[apart] = 0.0
            wq, ws = column_int8(rest, 7)
            xin = x.copy()
            xin[..., apart] = 0.0
            s = np.maximum(np.abs(xin).max(-1, keepdims=True) / np.float32(127), np.float32(1e-30))
            want = ((np.rint(xin / s).astype(np.int64) @ wq.astype(np.int64)).astype(np.float32) * ws) * s
            want = want + x[..., apart] @ full[apart]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert rel["apart"] < rel["plain"] / 3
    m = np.array([1.0, 1.2, 0.9, 50.0, 1.1, 30.0, 4.0])
    assert outlier_channels(m, ratio=3.0, most=8).tolist() == [3, 5, 6]
    assert outlier_channels(m, ratio=3.0, most=2).tolist() == [3, 5]  # the largest kept


def test_add_prompt_graph_registers_it(int4_engine, capsys):
    from dspark_runtime.cli import main
    from dspark_runtime.engine_dir.manifest import PROMPT_GRAPH, load_manifest

    m = load_manifest(int4_engine)  # every file checked
    g, t = m.graphs[PROMPT_GRAPH], m.graphs["target"]
    assert g.role == "prompt" and g.precision == "int8" and g.spec == t.spec
    assert g.quantization["source_sha256"] == t.files[0].sha256 and g.quantization["weight_bits"] in (7, 8)
    q = g.quantization
    assert q["kept"] == 1 and q["keep"] == [] and q["outliers"]["ratio"] == 3.0  # the LM head stays MatMulNBits
    assert q["outlier_channels"] > 0
    # the tensors it keeps unchanged (embedding, LM head, norms) are read from the target's data file, not copied
    data = t.files[1]
    assert q["shared_files"] == [data.path] and data in g.files and q["shared_bytes"] > 0
    assert [f.path for f in m.all_files()].count(data.path) == 1
    own = (int4_engine / f"{PROMPT_GRAPH}.onnx.data").stat().st_size
    assert own < q["integer_weight_bytes"] + q["shared_bytes"]  # nothing shared was written twice
    try:
        main(["info", "--engine", str(int4_engine)])
    except SystemExit as e:
        assert e.code in (0, None)
    out = capsys.readouterr().out
    assert "prompt chunks run on this graph" in out and f"(+ {data.path} of target)" in out
    v = g.validation["int8"]
    assert 0.5 <= v["argmax_agreement"] <= 1 and 0 < v["rel_l2"] < 0.5


def test_a_prompt_graph_reads_shared_tensors_only_beside_its_target(int4_engine, tmp_path):
    """Written away from the target's data file, a prompt graph that would read it in place is refused; beside a
    copy of it, it computes bit for bit what the same prompt graph with its own copy of those tensors computes."""
    from dspark_export.precision.prompt_graph import integer_prompt_graph
    from dspark_runtime.backends.ort import OrtDecoder
    from dspark_runtime.engine_dir.manifest import load_manifest
    from dspark_runtime.runners.scatter import ScatterRunner

    spec = load_manifest(int4_engine, verify=False).graphs["target"].spec
    src = int4_engine / "target.onnx"
    with pytest.raises(DSparkError, match="does not hold"):
        integer_prompt_graph(src, tmp_path / "p.onnx", weight_bits=7, share_source_data=True, log=lambda *a: None)
    shutil.copy(int4_engine / "target.onnx.data", tmp_path)
    shared = integer_prompt_graph(src, tmp_path / "p.onnx", weight_bits=7, share_source_data=True, log=lambda *a: None)
    own = integer_prompt_graph(src, tmp_path / "own.onnx", weight_bits=7, log=lambda *a: None)
    assert shared["shared_files"] == ["target.onnx.data"] and own["shared_files"] == [] and shared["shared_bytes"] > 0
    size = {name: (tmp_path / f"{name}.onnx.data").stat().st_size for name in ("p", "own")}
    assert size["p"] + shared["shared_bytes"] <= size["own"]
    ids = np.random.default_rng(0).integers(0, spec.dims.vocab_size, 9).tolist()
    logits = []
    for path in (tmp_path / "p.onnx", tmp_path / "own.onnx"):
        runner = ScatterRunner(OrtDecoder(path, spec, threads=1).activate())
        runner.add(0)
        logits.append(runner.step([(0, ids)])[0])
    assert np.isfinite(logits[0]).all() and np.array_equal(logits[0], logits[1])


def test_prompt_chunks_run_on_the_prompt_graph_alike_whatever_the_chunking(int4_engine):
    """Every call of prompt chunks runs on the prompt graph, a call mixing them with decoding is split, and a
    prompt's logits, features and cache are bit-identical whether it is fed whole or in chunks of 1, 3 or 7, alone or
    beside another request."""
    from dspark_runtime import Engine
    from dspark_runtime.runners.scatter import ScatterRunner

    eng = Engine.load(int4_engine, row_multiple=2)
    target = eng.graph_backend("target")
    prompt_be = eng._backends["target_prompt"].activate()
    calls = []
    for name, be in (("target", target), ("prompt", prompt_be)):
        real = be.step
        be.step = (lambda real, name: lambda ids, *a, **k: calls.append((name, ids.shape)) or real(ids, *a, **k))(
            real, name)
    try:
        rng = np.random.default_rng(3)
        prompt = list(map(int, rng.integers(3, 300, 21)))
        results = {}
        for chunk in (21, 1, 3, 7):
            r = ScatterRunner(target, row_multiple=2)
            r.prompt_backend = prompt_be
            r.add("a")
            r.add("b")
            r.step([("b", [5, 6, 7])], last_only={"b"})
            calls.clear()
            for s in range(0, 21, chunk):
                last = r.step([("a", prompt[s:s + chunk]), ("b", [9])], last_only={"a"})[0]
            assert [c[0] for c in calls] == ["prompt", "target"] * -(-21 // chunk)  # each mixed call split in two
            kv, feats = r.export_kv("a", 0, 21)
            results[chunk] = (last, feats, kv)
    finally:
        del target.step, prompt_be.step
    ref = results[21]
    for chunk, (last, feats, kv) in results.items():
        np.testing.assert_array_equal(last, ref[0])
        np.testing.assert_array_equal(feats, ref[1])
        for (k0, v0), (k1, v1) in zip(ref[2], kv):
            np.testing.assert_array_equal(k1, k0)
            np.testing.assert_array_equal(v1, v0)
    other = ScatterRunner(target, row_multiple=2)
    other.add("a")
    assert not np.array_equal(other.step([("a", prompt)], last_only={"a"})[0], ref[0])  # the target graph differs


@pytest.mark.parametrize("draft", ["lm", "ngram"])
def test_speculative_output_equals_target_only_with_the_prompt_graph(int4_engine, draft):
    from dspark_runtime import Engine

    eng = Engine.load(int4_engine, row_multiple=2)
    assert eng.prompts == "prompt-graph" and eng.runner("target").prompt_backend is not None
    prompt = "Write a function that sorts a list of numbers. " * 3
    ref = eng.generate(prompt, max_new_tokens=32, draft=None)
    assert eng.generate(prompt, max_new_tokens=32, draft=draft, draft_length=3).token_ids == ref.token_ids
    batch = eng.generate_batch([prompt, "Name three colours."], max_new_tokens=32, draft=draft)
    assert batch[0].token_ids == ref.token_ids  # served beside another request == solo
    off = Engine.load(int4_engine, row_multiple=2, prompts="target")
    assert off.prompts == "target" and off.runner("target").prompt_backend is None
    assert len(off.generate(prompt, max_new_tokens=32, draft=None).token_ids) == 32


def test_the_prefix_cache_keeps_prompt_positions_only_with_a_prompt_graph(int4_engine):
    """With prompts on their own graph, a finished request stores its prompt's blocks only (decoded positions hold
    the target graph's entries, which a later prompt would not compute); a second request with the same prompt then
    gets the output the first got."""
    from dspark_runtime import Engine

    eng = Engine.load(int4_engine, row_multiple=2, prefix_cache_mb=64)
    block = eng.prefix_cache.block
    prompt = "count the apples and the pears in the basket " * 8
    n_prompt = len(eng.encode_prompt(prompt, raw=True))
    first = eng.generate(prompt, raw=True, max_new_tokens=3 * block, draft=None)
    assert len(first.token_ids) > block + 1
    held = len(eng.prefix_cache)
    assert held == n_prompt // block >= 2  # the prompt's full blocks, none of the decoded ones
    again = eng.generate(prompt, raw=True, max_new_tokens=3 * block, draft=None)
    assert again.token_ids == first.token_ids  # its prompt fed from the cached blocks (never the last token)
    assert again.stats.cached_tokens == (n_prompt - 1) // block * block
    plain = Engine.load(int4_engine, row_multiple=2, prefix_cache_mb=64, prompts="target")
    plain.generate(prompt, raw=True, max_new_tokens=3 * block, draft=None)
    assert len(plain.prefix_cache) > held  # decoded positions are stored too without a prompt graph


def test_the_prompt_graph_needs_an_int4_scatter_target(tiny_scatter_engine_dir, tmp_path):
    from dspark_export.engine_dir.add_prompt_graph import add_prompt_graph

    d = tmp_path / "e"
    shutil.copytree(tiny_scatter_engine_dir, d)
    before = json.loads((d / "manifest.json").read_text())
    with pytest.raises(DSparkError, match="int4 target of the scatter KV layout"):
        add_prompt_graph(d, log=lambda *a: None)
    assert json.loads((d / "manifest.json").read_text()) == before
