"""benchmarks.prompt_kernels: the three weight-MatMul paths of a prompt chunk, timed and checked."""
import json

from benchmarks import prompt_kernels


def test_prompt_kernels_times_three_paths_and_the_integer_gemm_is_row_invariant(tmp_path):
    out = tmp_path / "k.json"
    assert prompt_kernels.main(["--k", "256", "--n", "384", "--m", "1,8", "--repeats", "1", "--threads", "1",
                                "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    paths = rep["paths"]
    assert len(paths) == 3 and rep["weight_bits_integer"] in (7, 8)
    for r in paths.values():
        assert set(r["ms"]) == {"1", "8"} and all(v > 0 for v in r["gflops"].values())
    fp32 = paths["fp32 MatMul"]
    integer = next(r for name, r in paths.items() if name.startswith("MatMulInteger"))
    nbits = next(r for name, r in paths.items() if name.startswith("MatMulNBits"))
    assert fp32["rel_l2"] < 1e-5
    # per-row activation scales and exact int32 accumulation: a row's result never depends on its call
    assert integer["row_max_abs_difference"] == 0.0
    assert 0 < integer["rel_l2"] < 0.05 and 0.01 < nbits["rel_l2"] < 0.2  # 7-8-bit columns vs 4-bit blocks
