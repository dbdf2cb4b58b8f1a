"""TensorRT: profile derivation, the capacity KV layout, manifest entries, and real TensorRT-RTX engine
builds for the tiny graphs (fp32, INT8 QDQ, FP8 QDQ) — ahead of time, no GPU needed.

The build tests skip only when the TensorRT-RTX wheel is not installed (`pip install -e '.[trt]'`); CI
installs it, so every run proves TensorRT still accepts our graphs. Each build is reported in the pytest
summary (conftest.py) as the CI log of engines built.
"""
import json
import shutil

import numpy as np
import pytest

from dspark_runtime.errors import DSparkError, ManifestError
from dspark_runtime.engine_dir.graphspec import DecoderDims, causal_lm_spec, dspark_draft_spec
from dspark_runtime.backends.trt.loader import tensorrt_available
from dspark_runtime.backends.trt.profiles import (ProfileSettings, capacity_buckets, choose_bucket, derive_profiles,
                                         kv_buffer_bytes, pick_profile)

DIMS = DecoderDims(num_layers=2, num_kv_heads=2, head_dim=16, hidden_size=64, vocab_size=320, feature_layers=(-1, 0))
SMALL = ProfileSettings(max_batch=2, decode_q=5, prefill_chunk=32, capacity=128, min_bucket=32)
needs_rtx = pytest.mark.skipif(not tensorrt_available("rtx"),
                               reason="TensorRT-RTX wheel not installed (pip install -e '.[trt]')")


# -- pure: profiles, buckets, sizes


def test_profiles_growing_layout_from_declared_axes():
    prof = derive_profiles(causal_lm_spec(DIMS), SMALL)
    assert [p["name"] for p in prof] == ["prefill", "decode"]
    pre, dec = (p["shapes"] for p in prof)
    assert list(pre) == causal_lm_spec(DIMS).input_names
    assert pre["input_ids"] == {"min": [1, 1], "opt": [1, 32], "max": [2, 32]}
    assert dec["input_ids"] == {"min": [1, 1], "opt": [2, 5], "max": [2, 5]}
    # past 0..capacity; the mask's total_len = past_len + q_len, summed per min/opt/max
    assert pre["past.1.value"] == {"min": [1, 2, 0, 16], "opt": [1, 2, 64, 16], "max": [2, 2, 128, 16]}
    assert pre["attention_mask"] == {"min": [1, 1, 1, 1], "opt": [1, 1, 32, 96], "max": [2, 1, 32, 160]}
    assert dec["attention_mask"]["max"] == [2, 1, 5, 133]


def test_profiles_capacity_layout_and_dspark_draft():
    cap = derive_profiles(causal_lm_spec(DIMS, "capacity"), SMALL)[1]["shapes"]
    assert cap["past.0.key"] == {"min": [1, 2, 32, 16], "opt": [2, 2, 128, 16], "max": [2, 2, 128, 16]}
    assert cap["attention_mask"] == {"min": [1, 1, 1, 33], "opt": [2, 1, 5, 133], "max": [2, 1, 5, 133]}
    d = derive_profiles(dspark_draft_spec(DIMS, feature_size=128, block_size=4), SMALL)[0]["shapes"]
    # mask_len = past_len + new_len + block
    assert d["attention_mask"] == {"min": [1, 1, 4, 5], "opt": [1, 1, 4, 100], "max": [2, 1, 4, 164]}
    assert d["anchor_embeds"] == {"min": [1, 1, 64], "opt": [1, 1, 64], "max": [2, 1, 64]}


def test_derived_axes_come_from_the_one_declaration():
    from dspark_runtime.engine_dir.graphspec import BLOCK, graph_constants, resolve_axes, tensor_shape

    ds = dspark_draft_spec(DIMS, feature_size=128, block_size=4)
    assert graph_constants(ds) == {BLOCK: 4} and graph_constants(causal_lm_spec(DIMS)) == {}
    # ints (buffer sizes) and (min, opt, max) tuples (profiles), summed element-wise
    got = resolve_axes(ds, {"batch": 1, "past_len": 100, "new_len": 6})
    assert (got["ctx_len"], got["mask_len"]) == (106, 110)
    got = resolve_axes(ds, {"past_len": (0, 64, 128), "new_len": (1, 32, 32)})
    assert got["ctx_len"] == (1, 96, 160) and got["mask_len"] == (5, 100, 164)
    assert "total_len" not in got  # no q_len given: left out, not guessed
    shapes = {t.name: tensor_shape(t, resolve_axes(ds, {"batch": 2, "past_len": 10, "new_len": 3}))
              for t in (*ds.inputs, *ds.outputs)}
    assert shapes["attention_mask"] == (2, 1, 4, 17) and shapes["present.1.value"] == (2, 2, 13, 16)
    assert shapes["base_logits"] == (2, 4, 320) and shapes["anchor_embeds"] == (2, 1, 64)
    with pytest.raises(KeyError, match="tensor features has axis 'new_len'"):
        tensor_shape(ds.inputs[0], {"batch": 1})


def test_dspark_draft_decode_profile_is_one_round():
    pre, dec = (p["shapes"] for p in derive_profiles(dspark_draft_spec(DIMS, feature_size=128, block_size=4), SMALL))
    assert list(dec) == dspark_draft_spec(DIMS, 128, 4).input_names
    # a round commits at most gamma + 1 = decode_q positions; a prompt's features come in prefill chunks
    assert dec["features"] == {"min": [1, 1, 128], "opt": [2, 5, 128], "max": [2, 5, 128]}
    assert pre["features"]["max"] == [2, 32, 128] and pre["feature_positions"]["max"] == [2, 32]
    assert dec["past.0.key"] == {"min": [1, 2, 0, 16], "opt": [2, 2, 64, 16], "max": [2, 2, 128, 16]}
    assert dec["attention_mask"] == {"min": [1, 1, 4, 5], "opt": [2, 1, 4, 73], "max": [2, 1, 4, 137]}
    assert dec["block_positions"] == {"min": [1, 4], "opt": [2, 4], "max": [2, 4]}


def test_profile_settings_errors_name_the_fix():
    with pytest.raises(DSparkError, match="prefill_chunk .* must be >= decode_q"):
        ProfileSettings(decode_q=9, prefill_chunk=8).validate()
    with pytest.raises(DSparkError, match="max_batch must be a positive integer"):
        ProfileSettings(max_batch=0).validate()
    with pytest.raises(DSparkError, match="capacity .* must be >= prefill_chunk"):
        ProfileSettings(capacity=100, prefill_chunk=256).validate()


def test_bucket_choice_and_profile_pick():
    assert capacity_buckets(1000, 256) == [256, 512, 1000]
    assert capacity_buckets(512, 512) == [512]
    b = capacity_buckets(4096, 256)
    assert b == [256, 512, 1024, 2048, 4096]
    assert [choose_bucket(n, b) for n in (1, 256, 257, 4096)] == [256, 256, 512, 4096]
    with pytest.raises(DSparkError, match="needs 4097 KV positions but the engine's capacity is 4096"):
        choose_bucket(4097, b)
    prof = derive_profiles(causal_lm_spec(DIMS, "capacity"), SMALL)
    # a verify step fits both profiles: decode wins; a 20-token chunk only fits prefill
    assert pick_profile(prof, {"input_ids": (1, 5), "past.0.key": (1, 2, 64, 16)}) == 1
    assert pick_profile(prof, {"input_ids": (1, 20), "past.0.key": (1, 2, 64, 16)}) == 0
    with pytest.raises(DSparkError, match=r"input_ids \(3, 5\)"):
        pick_profile(prof, {"input_ids": (3, 5)})


def test_kv_buffer_bytes():
    # Qwen2.5-1.5B: 28 layers, 2 KV heads, head_dim 128; batch 1, 4096 positions, fp32 -> 224 MiB
    assert kv_buffer_bytes(28, 2, 128, 1, 4096) == 2 * 28 * 2 * 4096 * 128 * 4 == 234881024


# -- the capacity layout: same logits as the growing graph on ONNX Runtime


def test_capacity_graph_matches_growing_graph(tiny_engine_dir, tmp_path):
    from dspark_export.graphs.capacity import to_capacity_layout
    from dspark_runtime.backends.ort import OrtDecoder
    from dspark_runtime.runners.kvcache import causal_mask
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    g = load_manifest(d).graphs["target"]
    cap_spec = to_capacity_layout(d / "target.onnx", d / "target.capacity.onnx", g.spec)
    assert cap_spec.kv_layout == "capacity" and cap_spec.output_names[-2:] == ["new.1.value", "argmax"]
    grow = OrtDecoder(d / "target.onnx", g.spec, threads=1)
    import onnxruntime as ort

    cap = ort.InferenceSession(str(d / "target.capacity.onnx"), providers=["CPUExecutionProvider"])
    ids = np.arange(5, 25, dtype=np.int64)[None]
    out = grow.step(ids[:, :12], np.arange(12)[None], causal_mask(12, 0), grow.empty_kv(1))
    ref = grow.step(ids[:, 12:], np.arange(12, 20)[None], causal_mask(8, 12), out.kv)
    # capacity 32: the first 12 slots written, the rest garbage the mask must hide
    C, dims = 32, g.spec.dims
    feeds = {"input_ids": ids[:, 12:], "position_ids": np.arange(12, 20)[None]}
    mask = np.zeros((1, 1, 8, C + 8), dtype=bool)
    mask[..., :12] = True
    mask[..., C:] = causal_mask(8, 0)[..., :]
    feeds["attention_mask"] = mask
    rng = np.random.default_rng(0)
    for i, (k, v) in enumerate(out.kv):
        for name, arr in ((f"past.{i}.key", k), (f"past.{i}.value", v)):
            buf = rng.normal(size=(1, dims.num_kv_heads, C, dims.head_dim)).astype(np.float32) * 100
            buf[:, :, :12] = arr
            feeds[name] = buf
    res = dict(zip(cap_spec.output_names, cap.run(cap_spec.output_names, feeds)))
    assert np.abs(res["logits"] - ref.logits).max() < 1e-4
    assert np.abs(res["features"] - ref.features).max() < 1e-4
    # the device-side argmax output: what greedy decoding copies back instead of the logits
    assert res["argmax"].dtype == np.int64 and res["argmax"].shape == (1, 8)
    np.testing.assert_array_equal(res["argmax"], res["logits"].argmax(-1))
    for i, (k, v) in enumerate(ref.kv):  # the new entries are the growing graph's present tail
        assert res[f"new.{i}.key"].shape == (1, dims.num_kv_heads, 8, dims.head_dim)
        assert np.abs(res[f"new.{i}.key"] - k[:, :, 12:]).max() < 1e-5
        assert np.abs(res[f"new.{i}.value"] - v[:, :, 12:]).max() < 1e-5


def test_half_capacity_graph_argmax_reads_the_float32_logits(tiny_engine_dir, tmp_path):
    """to_half keeps the capacity graph's ArgMax on the float32 logits (a widening cast: the same argmax), so the
    int64 ``argmax`` output equals the argmax of the 16-bit graph's own logits output (fp16 on ONNX Runtime)."""
    import onnx
    import onnxruntime as ort

    from dspark_export.graphs.capacity import ARGMAX_NODE, to_capacity_layout, to_half
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    g = load_manifest(d).graphs["target"]
    spec = to_capacity_layout(d / "target.onnx", d / "target.capacity.onnx", g.spec)
    to_half(d / "target.capacity.onnx", d / "target.capacity.fp16.onnx", "fp16")
    node = next(n for n in onnx.load(str(d / "target.capacity.fp16.onnx"), load_external_data=False).graph.node
                if n.name == ARGMAX_NODE)
    assert list(node.input) == ["logits"]
    sess = ort.InferenceSession(str(d / "target.capacity.fp16.onnx"), providers=["CPUExecutionProvider"])
    C, q, dims = 32, 6, spec.dims
    rng = np.random.default_rng(1)
    feeds = {"input_ids": rng.integers(3, 300, size=(2, q)), "position_ids": np.tile(np.arange(q), (2, 1))}
    mask = np.zeros((2, 1, q, C + q), dtype=bool)
    mask[..., C:] = np.tril(np.ones((q, q), dtype=bool))
    feeds["attention_mask"] = mask
    for k, v in [(f"past.{i}.key", f"past.{i}.value") for i in range(dims.num_layers)]:
        feeds[k] = feeds[v] = np.zeros((2, dims.num_kv_heads, C, dims.head_dim), np.float32)
    logits, argmax = sess.run(["logits", "argmax"], feeds)
    assert argmax.shape == (2, q) and argmax.dtype == np.int64
    np.testing.assert_array_equal(argmax, logits.argmax(-1))


def test_capacity_layout_refuses_unknown_graphs(tiny_engine_dir, tmp_path):
    from dspark_export.graphs.capacity import to_capacity_layout

    spec = causal_lm_spec(DIMS, "capacity")
    with pytest.raises(DSparkError, match="only growing causal_lm graphs"):
        to_capacity_layout(tiny_engine_dir / "target.onnx", tiny_engine_dir / "x.onnx", spec)
    with pytest.raises(DSparkError, match="must be in the folder of"):
        to_capacity_layout(tiny_engine_dir / "target.onnx", tmp_path / "x.onnx", causal_lm_spec(DIMS))


# -- manifest: old manifests load; engine entries round-trip and are checked


def _entry_json(graph="target"):
    return {"graph": graph, "kv_layout": "capacity", "onnx": "target.capacity.onnx",
            "file": {"path": "target.capacity.engine", "size": 3, "sha256": "0" * 64}, "extra_files": [],
            "flavour": "tensorrt-rtx", "version": "1.7.1.116", "profiles": [], "profile_settings": {},
            "compute_capabilities": ["8.6"], "precision": "fp32", "build_seconds": 1.5, "peak_rss_bytes": 10,
            "spec": causal_lm_spec(DIMS, "capacity").to_json()}


def test_manifest_with_and_without_trt_engines(tiny_engine_dir):
    from dspark_runtime.engine_dir.manifest import parse_manifest

    d = json.loads((tiny_engine_dir / "manifest.json").read_text())
    assert "trt_engines" not in d  # an ONNX-only build writes the schema it always wrote
    m = parse_manifest(d)
    assert m.trt_engines == {} and "trt_engines" not in m.to_json()
    d["trt_engines"] = {"target.capacity": _entry_json()}
    m = parse_manifest(d)
    e = m.trt_engines["target.capacity"]
    assert e.spec.kv_layout == "capacity" and e.compute_capabilities == ["8.6"]
    assert "target.capacity.engine" in [f.path for f in m.all_files()]
    assert parse_manifest(m.to_json()).to_json() == m.to_json()
    d["trt_engines"] = {"x": _entry_json(graph="verifier")}
    with pytest.raises(ManifestError, match="built from graph 'verifier'"):
        parse_manifest(d)
    bad = _entry_json()
    bad["kv_layout"] = "paged"
    d["trt_engines"] = {"x": bad}
    with pytest.raises(ManifestError, match="KV layout 'paged'"):
        parse_manifest(d)


# -- real TensorRT-RTX builds (CPU only, ahead of time)


@pytest.fixture(scope="module")
def trt_engine_dir(tiny_engine_dir, tmp_path_factory):
    """A copy of the tiny engine with TensorRT-RTX engines for its target (capacity + growing layouts)."""
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt

    d = tmp_path_factory.mktemp("trt") / "tiny"
    shutil.copytree(tiny_engine_dir, d)
    build_trt(d, TrtBuildSettings(profile=SMALL, kv_layouts=("capacity", "growing"), graphs=("target",)),
              isolate=False, log=lambda *a: None)
    return d


@needs_rtx
def test_trt_rtx_builds_fp32_engines_and_records_them(trt_engine_dir, trt_build_log):
    from dspark_runtime.engine_dir.manifest import load_manifest

    m = load_manifest(trt_engine_dir, rehash=True)  # every engine file re-hashed against the manifest
    assert set(m.trt_engines) == {"target.capacity", "target"}
    for key, e in m.trt_engines.items():
        trt_build_log.append((f"tiny {key}", e))
        assert e.flavour == "tensorrt-rtx" and e.version.startswith("1.7.1")
        assert e.precision == "fp32" and e.compute_capabilities == ["8.0", "8.6", "8.9", "12.0"]
        assert e.file.size > 100_000 and 0 < e.build_seconds < 120 and e.peak_rss_bytes > 50 * 2**20
        assert [p["name"] for p in e.profiles] == ["prefill", "decode"]
        assert e.profiles[1]["shapes"]["input_ids"]["max"] == [2, 5]
        assert e.profile_settings == SMALL.to_json()
    cap = m.trt_engines["target.capacity"]
    assert cap.onnx == "target.capacity.onnx" and [f.path for f in cap.extra_files] == ["target.capacity.onnx"]
    assert cap.profiles[0]["shapes"]["past.0.key"]["min"] == [1, 2, 32, 16]
    assert m.tool_versions["tensorrt-rtx"] == cap.version
    # a corrupted engine is refused at load like any other file
    p = trt_engine_dir / "target.engine"
    raw = bytearray(p.read_bytes())
    raw[-1] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match="target.engine is corrupted"):
        load_manifest(trt_engine_dir, rehash=True)
    raw[-1] ^= 0xFF
    p.write_bytes(bytes(raw))


def _calibration_feeds(spec):
    from dspark_runtime.runners.kvcache import causal_mask

    d = spec.dims
    feeds = {"input_ids": np.arange(3, 11, dtype=np.int64)[None], "position_ids": np.arange(8, dtype=np.int64)[None],
             "attention_mask": causal_mask(8, 0)}
    for i in range(d.num_layers):
        z = np.zeros((1, d.num_kv_heads, 0, d.head_dim), np.float32)
        feeds[f"past.{i}.key"] = feeds[f"past.{i}.value"] = z
    return feeds


@needs_rtx
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_trt_rtx_builds_qdq_engines(fmt, tiny_engine_dir, tmp_path, trt_build_log):
    from tests.fixtures.qdq_graphs import make_qdq_graph

    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_engine_file
    from dspark_runtime.engine_dir.manifest import load_manifest

    spec = load_manifest(tiny_engine_dir).graphs["target"].spec
    src = tmp_path / "target.onnx"
    for f in ("target.onnx", "target.onnx.data"):
        shutil.copy(tiny_engine_dir / f, tmp_path / f)
    n = make_qdq_graph(src, tmp_path / f"target.{fmt}.onnx", fmt, _calibration_feeds(spec))
    assert n == 15  # 2 layers x (q, k, v, o, gate, up, down) + LM head
    r = build_engine_file(tmp_path / f"target.{fmt}.onnx", spec, tmp_path / f"{fmt}.engine",
                          TrtBuildSettings(profile=SMALL))
    trt_build_log.append((f"tiny target {fmt} QDQ", r))
    assert r["precision"] == fmt and (tmp_path / f"{fmt}.engine").stat().st_size > 100_000
    # FP8 defaults to the GPUs that have FP8 tensor cores; INT8 keeps the portable set
    assert r["compute_capabilities"] == (["8.9", "12.0"] if fmt == "fp8" else ["8.0", "8.6", "8.9", "12.0"])
    if fmt == "fp8":
        with pytest.raises(DSparkError, match="compute capabilities 8.6 cannot run"):
            build_engine_file(tmp_path / "target.fp8.onnx", spec, tmp_path / "x.engine",
                              TrtBuildSettings(profile=SMALL, compute_capabilities=("8.6", "8.9")))


@needs_rtx
def test_trt_build_errors_are_clear(tiny_engine_dir, tmp_path):
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_engine_file
    from dspark_runtime.engine_dir.manifest import load_manifest

    spec = load_manifest(tiny_engine_dir).graphs["target"].spec
    with pytest.raises(DSparkError, match="cannot run fp32 GEMMs on Turing"):
        build_engine_file(tiny_engine_dir / "target.onnx", spec, tmp_path / "t.engine",
                          TrtBuildSettings(profile=SMALL, compute_capabilities=("7.5",)))
    with pytest.raises(DSparkError, match="7.5 \\(Turing\\) must be built alone"):
        TrtBuildSettings(compute_capabilities=("7.5", "8.6")).validate()
    (tmp_path / "broken.onnx").write_bytes(b"not a graph")
    with pytest.raises(DSparkError, match="could not parse broken.onnx"):
        build_engine_file(tmp_path / "broken.onnx", spec, tmp_path / "b.engine", TrtBuildSettings(profile=SMALL))
    other = causal_lm_spec(DIMS, "capacity")  # the graph has the growing layout's inputs under the same names
    wrong = type(other)(other.kind, other.kv_layout, other.inputs[:2], other.outputs, other.dims)
    with pytest.raises(DSparkError, match="the manifest declares"):
        build_engine_file(tiny_engine_dir / "target.onnx", wrong, tmp_path / "w.engine", TrtBuildSettings(profile=SMALL))


@needs_rtx
def test_build_trt_cli_isolated(tiny_engine_dir, tmp_path, trt_build_log):
    """`dspark-export build-trt` on an engine dir: one subprocess per engine, peak RSS measured there."""
    from click.testing import CliRunner

    from dspark_export.cli import cli
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    res = CliRunner().invoke(cli, ["build-trt", str(d), "--graphs", "draft", "--max-batch", "1", "--prefill-chunk",
                                   "16", "--capacity", "64", "--min-bucket", "16"])
    assert res.exit_code == 0, res.output
    e = load_manifest(d).trt_engines["draft.capacity"]
    trt_build_log.append(("tiny draft.capacity (CLI, own process)", e))
    assert e.profile_settings["decode_q"] == 5  # the manifest's draft_length 4, plus the anchor
    assert 50 * 2**20 < e.peak_rss_bytes < 700 * 2**20  # the build's own process, not pytest's (~0.9 GiB)
    assert "peak RSS" in res.output and "draft.capacity" in res.output
    from dspark_runtime.cli import cli as runtime_cli

    info = CliRunner().invoke(runtime_cli, ["info", "--engine", str(d)])
    assert "TensorRT engine draft.capacity: draft.capacity.engine" in info.output
    assert "fp32, capacity KV layout, compute capabilities 8.0, 8.6, 8.9, 12.0, profiles prefill, decode" in info.output
    res = CliRunner().invoke(cli, ["build-trt", str(d), "--graphs", "verifier"])
    assert res.exit_code != 0 and "has no graph 'verifier'" in str(res.exception)


def test_engine_format_trt_fails_before_export_without_tensorrt(tiny_pair, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from dspark_export.cli import cli

    monkeypatch.setenv("DSPARK_TRT_FLAVOUR", "enterprise")  # enterprise tensorrt is not installed here
    pytest.importorskip("tensorrt_rtx_bindings")
    if tensorrt_available("enterprise"):
        pytest.skip("enterprise tensorrt is installed here")
    res = CliRunner().invoke(cli, ["build", "--target", str(tiny_pair[0]), "--out", str(tmp_path / "e"),
                                   "--engine-format", "trt", "--in-process"])
    assert res.exit_code != 0 and "TensorRT (enterprise) is not importable" in str(res.exception)
    assert not (tmp_path / "e").exists()  # nothing exported


def test_half_graphs_match_fp32_on_onnx_runtime(tiny_engine_dir, tmp_path):
    """to_half("fp16"): same logits as fp32 within fp16 rounding, at positions beyond 2048 too (RoPE stays fp32);
    float32 interface kept. (ONNX Runtime has no CPU kernels for bf16, so bf16 is checked by the TensorRT build.)"""
    import onnx
    import onnxruntime as ort

    from dspark_export.graphs.capacity import graph_precision, to_half

    for f in ("target.onnx", "target.onnx.data"):
        shutil.copy(tiny_engine_dir / f, tmp_path / f)
    to_half(tmp_path / "target.onnx", tmp_path / "t16.onnx", "fp16")
    to_half(tmp_path / "target.onnx", tmp_path / "tb16.onnx", "bf16")
    assert graph_precision(tmp_path / "t16.onnx") == "fp16" and graph_precision(tmp_path / "tb16.onnx") == "bf16"
    assert (tmp_path / "t16.onnx.data").stat().st_size < 0.55 * (tmp_path / "target.onnx.data").stat().st_size
    g = onnx.load(str(tmp_path / "tb16.onnx"), load_external_data=False).graph
    assert {i.type.tensor_type.elem_type for i in g.input if i.name.startswith("past.")} == {onnx.TensorProto.FLOAT}
    assert {o.type.tensor_type.elem_type for o in g.output} == {onnx.TensorProto.FLOAT}
    from onnx import numpy_helper

    a32 = {t.name: t for t in onnx.load(str(tmp_path / "target.onnx")).graph.initializer}
    b16 = {t.name: t for t in onnx.load(str(tmp_path / "tb16.onnx")).graph.initializer}
    name = "model.model.embed_tokens.weight"
    x = numpy_helper.to_array(a32[name])
    y = (np.frombuffer(b16[name].raw_data, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(x.shape)
    assert b16[name].data_type == onnx.TensorProto.BFLOAT16
    assert (np.abs(x - y) <= np.abs(x) * 2.0**-8).all() and np.abs(x - y).max() > 0  # bf16 rounding, nothing worse
    feeds = _calibration_feeds(causal_lm_spec(DIMS))
    feeds["position_ids"] = feeds["position_ids"] + 3000
    names = ["logits", "present.1.key"]
    a = ort.InferenceSession(str(tmp_path / "target.onnx"), providers=["CPUExecutionProvider"]).run(names, feeds)
    b = ort.InferenceSession(str(tmp_path / "t16.onnx"), providers=["CPUExecutionProvider"]).run(names, feeds)
    assert b[0].dtype == np.float32
    assert np.abs(a[0] - b[0]).max() < 1e-2 * np.abs(a[0]).max()  # fp16 rounding, not drifted rotations
    assert (a[0].argmax(-1) == b[0].argmax(-1)).all()
    assert np.abs(a[1] - b[1]).max() < 5e-3  # the keys after RoPE at positions 3000+
    with pytest.raises(DSparkError, match="choose one of fp16, bf16"):
        to_half(tmp_path / "target.onnx", tmp_path / "x.onnx", "fp8")


@needs_rtx
@pytest.mark.parametrize("half,ccs", [("fp16", ("7.5",)), ("bf16", None)])
def test_trt_rtx_half_engines(half, ccs, tiny_engine_dir, tmp_path, trt_build_log):
    """--half: a 16-bit copy of the capacity graph; fp16 is what Turing (7.5) runs, bf16 the portable set."""
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_dir, d)
    build_trt(d, TrtBuildSettings(profile=SMALL, graphs=("target",), half=half, compute_capabilities=ccs),
              isolate=False, log=lambda *a: None)
    e = load_manifest(d, rehash=True).trt_engines[f"target.capacity.{half}"]
    trt_build_log.append((f"tiny target.capacity {half}", e))
    assert e.precision == half and e.onnx == f"target.capacity.{half}.onnx"
    assert e.compute_capabilities == (["7.5"] if half == "fp16" else ["8.0", "8.6", "8.9", "12.0"])
    assert [f.path for f in e.extra_files] == ["target.capacity.onnx", f"target.capacity.{half}.onnx",
                                              f"target.capacity.{half}.onnx.data"]
    with pytest.raises(DSparkError, match="Turing \\(7.5\\) has no bf16"):
        TrtBuildSettings(half="bf16", compute_capabilities=("7.5",)).validate()


@needs_rtx
def test_trt_rtx_builds_the_streamed_fp8_graph(tiny_engine_dir, tmp_path, trt_build_log):
    """The streaming writer stores FP8 weights behind DequantizeLinear (not ModelOpt's fp32 + Q + DQ):
    TensorRT-RTX parses and builds that graph for the FP8 GPUs."""
    from dspark_export.precision.qdq import quantize_qdq
    from dspark_export.precision.activation_ranges import calibrate_graph
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_engine_file
    from dspark_runtime.engine_dir.manifest import load_manifest

    spec = load_manifest(tiny_engine_dir).graphs["target"].spec
    src = tiny_engine_dir / "target.onnx"
    table = calibrate_graph(src, spec, [list(range(3, 40)), list(range(50, 90))], threads=1)
    rep = quantize_qdq(src, tmp_path / "target.fp8s.onnx", table, "fp8", exclude=(), log=lambda *a: None)
    assert rep["checks"]["fp8_tensors"] >= 15 and rep["opset"]["to"] == 19
    r = build_engine_file(tmp_path / "target.fp8s.onnx", spec, tmp_path / "fp8s.engine",
                          TrtBuildSettings(profile=SMALL))
    trt_build_log.append(("tiny target fp8 QDQ (streaming writer)", r))
    assert r["precision"] == "fp8" and (tmp_path / "fp8s.engine").stat().st_size > 100_000
    assert r["compute_capabilities"] == ["8.9", "12.0"]


# -- the DSpark drafter graph: engines beside the target's and the draft LM's


@pytest.fixture(scope="module")
def trt_all_graphs_dir(tiny_engine_with_dspark, tmp_path_factory):
    """The tiny engine with target, draft LM and DSpark drafter graphs, and `build-trt`'s default engines of all
    three (the drafter's from the growing graph, the decoders' capacity layout)."""
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt

    d = tmp_path_factory.mktemp("trt-all") / "tiny"
    shutil.copytree(tiny_engine_with_dspark, d)
    build_trt(d, TrtBuildSettings(profile=SMALL), isolate=False, log=lambda *a: None)
    return d


@needs_rtx
def test_trt_rtx_builds_target_draft_and_dspark_drafter(trt_all_graphs_dir, trt_build_log):
    from dspark_runtime.engine import Engine
    from dspark_runtime.engine_dir.manifest import load_manifest
    from dspark_runtime.backends.trt.decoder import TrtDecoder
    from dspark_runtime.backends.trt.dspark_graph import TrtDSparkGraph

    m = load_manifest(trt_all_graphs_dir, rehash=True)
    assert set(m.trt_engines) == {"target.capacity", "draft.capacity", "dspark"}
    for key in ("target.capacity", "draft.capacity", "dspark"):
        trt_build_log.append((f"tiny {key}", m.trt_engines[key]))
    e = m.trt_engines["dspark"]
    spec = m.graphs["dspark"].spec
    assert e.graph == "dspark" and e.kv_layout == "growing" and e.onnx == "dspark.onnx" and e.extra_files == []
    assert e.file.path == "dspark.engine" and e.file.size > 100_000 and e.precision == "fp32"
    assert e.spec == spec and spec.kind == "dspark_draft" and e.profiles == derive_profiles(spec, SMALL)
    # the block is 4, the features two 64-wide layers; mask_len = past + new + block
    assert e.profiles[1]["shapes"]["attention_mask"]["max"] == [2, 1, 4, 128 + 5 + 4]
    assert e.profiles[0]["shapes"]["features"]["max"] == [2, 32, 128]
    assert e.profiles[0]["shapes"]["past.0.key"]["max"] == [2, 2, 128, 16]
    assert 0 < e.build_seconds < 120 and e.peak_rss_bytes > 50 * 2**20
    # the runtime runs it: dspark=trt accepted, the anchor rows wired in as on ONNX Runtime (nothing activated)
    eng = Engine.load(trt_all_graphs_dir, threads=1, placement="dspark=trt")
    assert eng.placement == {"target": "cpu", "draft": "cpu", "dspark": "trt"}
    g = eng._backends["dspark"]
    assert isinstance(g, TrtDSparkGraph) and g.embedding is not None and g.block_size == 4 and g.context is None
    eng = Engine.load(trt_all_graphs_dir, threads=1, backend="trt")
    assert [type(eng._backends[k]) for k in ("target", "draft", "dspark")] == [TrtDecoder, TrtDecoder, TrtDSparkGraph]


@needs_rtx
@pytest.mark.parametrize("half", ["bf16", "fp16"])
def test_trt_rtx_half_dspark_drafter_engines(half, tiny_engine_with_dspark, tmp_path, trt_build_log):
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tmp_path / "e"
    shutil.copytree(tiny_engine_with_dspark, d)
    build_trt(d, TrtBuildSettings(profile=SMALL, graphs=("dspark",), half=half), isolate=False, log=lambda *a: None)
    m = load_manifest(d, rehash=True)
    assert set(m.trt_engines) == {f"dspark.{half}"}
    e = m.trt_engines[f"dspark.{half}"]
    trt_build_log.append((f"tiny dspark.{half}", e))
    assert e.precision == half and e.kv_layout == "growing" and e.onnx == f"dspark.{half}.onnx"
    assert [f.path for f in e.extra_files] == [f"dspark.{half}.onnx", f"dspark.{half}.onnx.data"]


def test_half_dspark_drafter_matches_fp32_on_onnx_runtime(tiny_engine_with_dspark, tmp_path):
    """to_half keeps the drafter's RoPE (a function of feature_positions / block_positions, not a rotary_emb module)
    in float32: the fp16 graph's context keys at positions 3000+ match the fp32 graph's within fp16 rounding."""
    import onnx
    import onnxruntime as ort

    from dspark_export.graphs.capacity import to_half
    from dspark_runtime.drafting.embedding_rows import EmbeddingRows
    from dspark_runtime.engine_dir.manifest import load_manifest

    d = tiny_engine_with_dspark
    m = load_manifest(d)
    spec = m.graphs["dspark"].spec
    for f in ("dspark.onnx", "dspark.onnx.data"):
        shutil.copy(d / f, tmp_path / f)
    to_half(tmp_path / "dspark.onnx", tmp_path / "d16.onnx", "fp16")
    g = onnx.load(str(tmp_path / "d16.onnx"), load_external_data=False).graph
    cos = [n for n in g.node if n.op_type in ("Cos", "Sin")]
    assert len(cos) == 4 and all(n.input[0].split(".")[-1] != "fp16" for n in cos)  # angles computed in float32
    rng = np.random.default_rng(0)
    P, N, G, dims = 3000, 6, 4, spec.dims
    feeds = {"features": rng.normal(size=(1, N, spec.inputs[0].shape[-1])).astype(np.float32),
             "feature_positions": np.arange(P, P + N)[None], "block_positions": np.arange(P + N, P + N + G)[None],
             "anchor_embeds": EmbeddingRows.from_manifest(d, m.speculation.dspark.embedding).rows(np.array([[7]])),
             "attention_mask": np.ones((1, 1, G, 5 + N + G), bool)}
    for i in range(dims.num_layers):
        for kv in ("key", "value"):
            feeds[f"past.{i}.{kv}"] = rng.normal(size=(1, dims.num_kv_heads, 5, dims.head_dim)).astype(np.float32)
    names = ["base_logits", "present.0.key"]
    a = ort.InferenceSession(str(tmp_path / "dspark.onnx"), providers=["CPUExecutionProvider"]).run(names, feeds)
    b = ort.InferenceSession(str(tmp_path / "d16.onnx"), providers=["CPUExecutionProvider"]).run(names, feeds)
    assert np.abs(a[0] - b[0]).max() < 2e-3 * np.abs(a[0]).max() and (a[0].argmax(-1) == b[0].argmax(-1)).all()
    assert np.abs(a[1] - b[1]).max() < 5e-3  # rotated context keys at positions 3000..3005


def test_int4_graphs_are_refused_with_the_fp32_route(tmp_path):
    """MatMulNBits (ONNX Runtime's int4, domain com.microsoft) does not build on TensorRT-RTX 1.7.1 (its parser
    asks for a plugin it does not ship): build_trt refuses such graphs up front and names the fp32 graph to use."""
    import onnx
    from onnx import TensorProto, helper

    from dspark_export.engine_dir.trt_build import check_trt_parsable

    node = helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain="com.microsoft", K=64, N=64, bits=4,
                            block_size=32)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]),
              str(tmp_path / "q.onnx"))
    with pytest.raises(DSparkError, match=r"graph 'dspark' \(q.onnx\) uses ONNX Runtime operators MatMulNBits .*"
                                          r"add-draft ENGINE CHECKPOINT --target TARGET --precision fp32"):
        check_trt_parsable(tmp_path / "q.onnx", "dspark", "dspark_draft")
    with pytest.raises(DSparkError, match="build an fp32 engine"):
        check_trt_parsable(tmp_path / "q.onnx", "target", "causal_lm")


@needs_rtx
def test_trt_rtx_builds_the_eagle3_drafter_ahead_of_time(tiny_scatter_engine_dir, tiny_pair, tmp_path,
                                                        trt_build_log):
    """The EAGLE-3 drafter's fp32 graph gets a growing-layout TensorRT-RTX engine with both profiles; its int4 graph
    is refused, naming the fp32 re-add."""
    from dspark_export.engine_dir.add_eagle3 import add_eagle3_draft
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt
    from dspark_runtime.engine_dir.manifest import load_manifest
    from tests.fixtures.tiny_models import make_tiny_eagle3

    ckpt = make_tiny_eagle3(tmp_path / "ckpt", tiny_pair[0])
    d = tmp_path / "e"
    shutil.copytree(tiny_scatter_engine_dir, d)
    add_eagle3_draft(d, ckpt, isolate=False, log=lambda *a: None, precision="fp32")
    build_trt(d, TrtBuildSettings(profile=SMALL, graphs=("eagle3",)), isolate=False, log=lambda *a: None)
    m = load_manifest(d, rehash=True)
    e = m.trt_engines["eagle3"]
    trt_build_log.append(("tiny eagle3", e))
    assert set(m.trt_engines) == {"eagle3"} and e.kv_layout == "growing" and e.precision == "fp32"
    assert [p["name"] for p in e.profiles] == ["prefill", "decode"]
    assert e.profiles[1]["shapes"]["states"]["max"] == [2, 5, 64] and e.profiles[1]["shapes"]["logits_at"]["max"] == [2]
    q = tmp_path / "q"
    shutil.copytree(tiny_scatter_engine_dir, q)
    add_eagle3_draft(q, ckpt, isolate=False, log=lambda *a: None, precision="int4")
    with pytest.raises(DSparkError, match=r"graph 'eagle3' .*MatMulNBits.*re-add the drafter in fp32"):
        build_trt(q, TrtBuildSettings(profile=SMALL, graphs=("eagle3",)), isolate=False, log=lambda *a: None)
