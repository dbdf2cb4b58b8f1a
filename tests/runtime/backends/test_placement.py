"""Per-graph placement (dspark_runtime.backends.placement): parsing, the refusals and their fixes, and an Engine that
records where its graphs run."""
import pytest

from dspark_runtime.errors import InputError
from dspark_runtime.backends.placement import PROVIDERS, format_placement, parse_placement

GRAPHS = {"target": "causal_lm", "draft": "causal_lm", "dspark": "dspark_draft"}


def test_key_value_placement_and_defaults():
    got = parse_placement("target=trt, draft=cuda,dspark=cpu", GRAPHS, trt_graphs={"target"})
    assert got == {"target": "trt", "draft": "cuda", "dspark": "cpu"}
    assert parse_placement("draft=trt-ep", GRAPHS) == {"target": "cpu", "draft": "trt-ep", "dspark": "cpu"}
    assert parse_placement(None, GRAPHS) == parse_placement("", GRAPHS) == {k: "cpu" for k in GRAPHS}
    assert parse_placement({"target": "cuda"}, GRAPHS)["target"] == "cuda"
    assert format_placement(got) == "target=trt,draft=cuda,dspark=cpu"
    assert parse_placement(format_placement(got), GRAPHS, {"target"}) == got


def test_dspark_drafter_on_its_tensorrt_engine():
    """dspark=trt where the engine has the drafter's TensorRT engine (build-trt builds it beside the decoders')."""
    assert parse_placement("dspark=trt", GRAPHS, {"target", "dspark"}) == {"target": "cpu", "draft": "cpu",
                                                                          "dspark": "trt"}
    got = parse_placement("target=trt,draft=cuda,dspark=trt", GRAPHS, {"target", "dspark"})
    assert got == {"target": "trt", "draft": "cuda", "dspark": "trt"}
    assert parse_placement("trt", GRAPHS, {"target", "dspark"}) == {"target": "trt", "draft": "cpu", "dspark": "trt"}


def test_one_place_for_all_and_trt_like_the_backend():
    assert parse_placement("cuda", GRAPHS) == {k: "cuda" for k in GRAPHS}
    # 'trt' alone: every graph with a TensorRT engine on it, the rest on the CPU (as --backend trt)
    assert parse_placement("trt", GRAPHS, {"target", "draft"}) == {"target": "trt", "draft": "trt", "dspark": "cpu"}
    with pytest.raises(InputError, match="needs the target's TensorRT engine.*build-trt"):
        parse_placement("trt", GRAPHS, {"draft"})


@pytest.mark.parametrize("spec,msg", [
    ("target=gpu", r"unknown place 'gpu' for graph 'target'; choose one of \['cpu', 'cuda', 'trt-ep', 'trt'\]"),
    ("verifier=cpu", r"names graph 'verifier', but this engine's graphs are \['draft', 'dspark', 'target'\]"),
    ("target=cpu,target=cuda", "gives graph 'target' twice"),
    ("target", "unknown place 'target' for every graph"),
    ("target=,draft=cpu", "entry 'target=' is not key=place"),
    ("dspark=trt", r"graph 'dspark' has no TensorRT engine in this engine directory; build one with `dspark-export "
                   r"build-trt ENGINE --graphs dspark` from an fp32 drafter graph .*MatMulNBits"),
    ("draft=trt", "graph 'draft' has no TensorRT engine in this engine directory; build one"),
])
def test_refusals_name_the_problem_and_the_fix(spec, msg):
    with pytest.raises(InputError, match=msg):
        parse_placement(spec, GRAPHS, trt_graphs={"target"})


def test_onnx_runtime_places_fall_back_to_the_cpu_provider():
    assert PROVIDERS["cpu"] == ["CPUExecutionProvider"]
    assert PROVIDERS["cuda"][-1] == PROVIDERS["trt-ep"][-1] == "CPUExecutionProvider"
    assert PROVIDERS["trt-ep"][0] == "TensorrtExecutionProvider"


def test_engine_records_placement_and_refuses_what_it_cannot_run(tiny_engine_dir):
    import onnxruntime as ort

    from dspark_runtime.errors import DSparkError
    from dspark_runtime.engine import Engine

    eng = Engine.load(tiny_engine_dir, threads=1, placement="target=cpu")
    assert eng.placement == {k: "cpu" for k in eng.manifest.graphs}
    res = eng.generate("hello", max_new_tokens=4, draft=None)
    assert res.stats.placement == format_placement(eng.placement)
    with pytest.raises(InputError, match="no TensorRT engine for the target"):
        Engine.load(tiny_engine_dir, threads=1, backend="trt")
    with pytest.raises(InputError, match="either backend='trt' or a placement"):
        Engine.load(tiny_engine_dir, threads=1, backend="trt", placement="cpu")
    with pytest.raises(InputError, match="has no TensorRT engine in this engine directory"):
        Engine.load(tiny_engine_dir, threads=1, placement="target=trt")
    if "CUDAExecutionProvider" not in ort.get_available_providers():  # the CPU package: a clear refusal at first use
        eng = Engine.load(tiny_engine_dir, threads=1, placement="target=cuda")
        with pytest.raises(DSparkError, match=r"has no CUDA execution provider .* install the GPU package"):
            eng.generate("hello", max_new_tokens=2, draft=None)
