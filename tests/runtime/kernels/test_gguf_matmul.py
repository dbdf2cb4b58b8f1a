"""DSpark's MatMulGGUF kernel (dspark_runtime/kernels/gguf_matmul.cc, built by dspark_export.kernels.build): it computes
x @ W over a GGUF's own Q4_K / Q6_K blocks exactly as llama.cpp's scheme defines (int8 activations per 256), each
row independently of the others (row-invariant: what exact speculative decoding needs), on both code paths, and
refuses a malformed node naming the problem."""
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, quants  # noqa: E402

from dspark_runtime.kernels import DOMAIN, GGML_TYPES, OP_MATMUL_GGUF, kernel_path  # noqa: E402
from tests.export.precision.test_nbits import random_rows  # noqa: E402


@pytest.fixture(scope="module")
def library():
    from dspark_export.kernels.build import build_kernels

    return build_kernels(log=lambda *a: None)


def session(library, parts: list, k: int, threads: int = 2):
    """A one-node graph: MatMulGGUF over ``parts`` [(GGUF type name, uint8 rows [n, bytes])] concatenated."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rows = [int(r.shape[0]) for _, r in parts]
    w = np.concatenate([r.reshape(-1) for _, r in parts])
    node = helper.make_node(OP_MATMUL_GGUF, ["x", "w"], ["y"], domain=DOMAIN, K=k, N=sum(rows), segment_rows=rows,
                            segment_types=[GGML_TYPES[t] for t, _ in parts])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", sum(rows)])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def dequantized(parts: list, k: int) -> np.ndarray:
    return np.concatenate([quants.dequantize(r, GGMLQuantizationType[t]).reshape(len(r), k) for t, r in parts])


def q8_rows(x: np.ndarray) -> np.ndarray:
    """x as the kernel sees it: int8 per 256 values with the scale amax / 127, round to nearest even (float64)."""
    b = x.reshape(len(x), -1, 256)
    amax = np.abs(b).max(-1, keepdims=True)
    q = np.rint(b * (np.float32(127) / amax))
    return (q * (amax / np.float32(127))).reshape(x.shape).astype(np.float64)


def parts_of(rng, k: int) -> list:
    # a q/k/v-like node: a Q4_K and a Q6_K weight of one input, as a layer of Qwen2.5's Q4_K_M GGUF has them
    return [("Q4_K", random_rows("Q4_K", 48, k, rng, 2e-5, 2e-4)), ("Q6_K", random_rows("Q6_K", 40, k, rng, 1e-4, 1e-3)),
            ("Q4_K", random_rows("Q4_K", 8, k, rng, 2e-5, 2e-4))]


@pytest.mark.parametrize("k", [256, 1536])
def test_matmul_gguf_computes_x_at_w_with_int8_activations(library, k):
    rng = np.random.default_rng(k)
    parts = parts_of(rng, k)
    w = dequantized(parts, k)
    x = rng.standard_normal((5, k)).astype(np.float32)
    y = session(library, parts, k).run(None, {"x": x})[0]
    assert y.shape == (5, w.shape[0]) and y.dtype == np.float32
    exact = q8_rows(x) @ w.T.astype(np.float64)  # the same activations: equal up to fp32 summation
    assert np.abs(y - exact).max() <= 1e-5 * np.abs(exact).max()
    ref = x.astype(np.float64) @ w.T  # against float activations: the int8 rounding only
    assert np.linalg.norm(y - ref) <= 0.02 * np.linalg.norm(ref)


def test_matmul_gguf_rows_are_computed_independently_of_the_call(library):
    """A row's result is the same bit for bit whether it is computed alone, in any batch, or with other threads."""
    rng = np.random.default_rng(5)
    k = 512
    parts = parts_of(rng, k)
    x = rng.standard_normal((19, k)).astype(np.float32) * rng.uniform(0.1, 10, (19, 1)).astype(np.float32)
    two, one = session(library, parts, k), session(library, parts, k, threads=1)
    full = two.run(None, {"x": x})[0]
    for a, b in [(0, 1), (3, 5), (2, 11), (0, 19), (7, 16)]:
        np.testing.assert_array_equal(two.run(None, {"x": x[a:b]})[0], full[a:b])
    np.testing.assert_array_equal(one.run(None, {"x": x})[0], full)
    x3 = x[:12].reshape(3, 4, k)  # leading dimensions are rows too
    np.testing.assert_array_equal(two.run(None, {"x": x3.reshape(12, k)})[0], full[:12])


@pytest.mark.parametrize("path", ["avx2", "portable"])
def test_the_other_paths_agree_with_this_cpus(library, tmp_path, path):
    """$DSPARK_KERNEL_PATH=avx2 / portable (what a CPU without AVX-512 VNNI, or without AVX2, runs): the same integer
    sums, fp32 sums in another order, so equal to ~1e-6 relative; the path a process uses is reported."""
    from dspark_runtime.machine.sysinfo import cpu_features

    if path == "avx2" and not {"avx2", "fma", "f16c"} <= set(cpu_features()["flags"]):
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    rng = np.random.default_rng(8)
    k = 768
    parts = parts_of(rng, k)
    x = rng.standard_normal((3, k)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    for i, (t, r) in enumerate(parts):
        np.save(tmp_path / f"p{i}_{t}.npy", r)
    code = (
        "import sys, numpy as np, pathlib\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from tests.runtime.kernels.test_gguf_matmul import session\n"
        "from dspark_runtime.kernels import kernel_path\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "parts = [(p.stem.split('_', 1)[1], np.load(p)) for p in sorted(d.glob('p*.npy'))]\n"
        f"y = session(sys.argv[3], parts, {k}).run(None, {{'x': np.load(d / 'x.npy')}})[0]\n"
        "np.save(d / 'y.npy', y)\n"
        "print(kernel_path(sys.argv[3]))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), root, str(library)], capture_output=True, text=True,
                         env={**os.environ, "DSPARK_KERNEL_PATH": path}, check=True)
    assert out.stdout.strip() == path
    got = np.load(tmp_path / "y.npy")
    want = session(library, parts, k).run(None, {"x": x})[0]
    assert kernel_path(str(library)) in ("avx512-vnni", "avx2", "portable")
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_malformed_node_is_refused_naming_the_problem(library):
    from onnx import TensorProto, helper, numpy_helper
    import onnxruntime as ort

    def build(**attrs):
        node = helper.make_node(OP_MATMUL_GGUF, ["x", "w"], ["y"], domain=DOMAIN, name="proj", **attrs)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", "k"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", 4])],
                              [numpy_helper.from_array(np.zeros(4 * 144, np.uint8), "w")])
        so = ort.SessionOptions()
        so.register_custom_ops_library(str(library))
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])

    with pytest.raises(Exception, match="segment_rows sum to 3, not N"):
        build(K=256, N=4, segment_rows=[3], segment_types=[12])
    with pytest.raises(Exception, match="not Q4_K .12. or Q6_K .14."):
        build(K=256, N=4, segment_rows=[4], segment_types=[8])
    with pytest.raises(Exception, match="K must be a positive multiple of 256"):
        build(K=100, N=4, segment_rows=[4], segment_types=[12])
    s = build(K=256, N=4, segment_rows=[4], segment_types=[12])
    with pytest.raises(Exception, match="last dimension must be K = 256"):
        s.run(None, {"x": np.zeros((1, 255), np.float32)})


def test_loading_an_engine_on_its_portable_path_warns(monkeypatch, tmp_path):
    """An engine whose graph runs on the kernels warns when this CPU would take their portable path (an engine built
    on an AVX-512 VNNI machine, shipped to one without it), and says how to rebuild."""
    import warnings
    from types import SimpleNamespace

    from dspark_runtime.machine import load_checks
    from dspark_runtime.machine.sysinfo import OtherCpuWarning

    (tmp_path / "libdspark_kernels.so").write_bytes(b"")
    manifest = SimpleNamespace(graphs={"target": SimpleNamespace(spec=SimpleNamespace(kernels="libdspark_kernels.so")),
                                       "draft": SimpleNamespace(spec=SimpleNamespace(kernels=""))})
    monkeypatch.setattr(load_checks, "kernel_path", lambda lib: "portable")
    with pytest.warns(OtherCpuWarning, match="portable path.*--int4-source gguf-compact"):
        load_checks.check_kernels(manifest, tmp_path)
    monkeypatch.setattr(load_checks, "kernel_path", lambda lib: "avx512-vnni")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_checks.check_kernels(manifest, tmp_path)
