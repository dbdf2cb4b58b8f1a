"""The weight accounting of :mod:`dspark_export.graphs.onnx_io`: what a decoding step reads."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dspark_export.graphs.onnx_io import graph_weight_bytes, step_weight_bytes


def _graph(tmp_path, tied: bool):
    """ids -> Gather(E) -> MatMul(W) -> MatMul(E^T or H): an embedding table read by Gather, a weight, a head."""
    e = np.ones((50, 8), np.float32)
    w = np.ones((8, 8), np.float32)
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h0"]), helper.make_node("MatMul", ["h0", "W"], ["h1"])]
    inits = [numpy_helper.from_array(e, "E"), numpy_helper.from_array(w, "W")]
    if tied:  # the head reads the embedding table whole
        nodes += [helper.make_node("Transpose", ["E"], ["Et"]), helper.make_node("MatMul", ["h1", "Et"], ["y"])]
    else:
        nodes.append(helper.make_node("MatMul", ["h1", "H"], ["y"]))
        inits.append(numpy_helper.from_array(np.ones((8, 50), np.float32), "H"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 50])], inits)
    path = tmp_path / ("tied.onnx" if tied else "untied.onnx")
    onnx.save_model(helper.make_model(g), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=0)
    return path


def test_step_weight_bytes_leave_out_tables_read_only_by_gather(tmp_path):
    untied = _graph(tmp_path, tied=False)
    assert graph_weight_bytes(untied) == 4 * (50 * 8 + 8 * 8 + 8 * 50)
    assert step_weight_bytes(untied) == 4 * (8 * 8 + 8 * 50)  # the embedding: one row per token, not counted
    tied = _graph(tmp_path, tied=True)
    assert step_weight_bytes(tied) == graph_weight_bytes(tied) == 4 * (50 * 8 + 8 * 8)  # a head reading it counts


def test_step_weight_bytes_leave_out_rotary_tables(tmp_path):
    """A RotaryEmbedding reads one row of its cos/sin caches per position: the tables are not read whole."""
    cache = np.ones((64, 4), np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("RotaryEmbedding", ["h", "pos", "cos", "sin"], ["y"], domain="com.microsoft")]
    inits = [numpy_helper.from_array(np.ones((8, 8), np.float32), "W"), numpy_helper.from_array(cache, "cos"),
             numpy_helper.from_array(cache, "sin")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, 8]),
                                       helper.make_tensor_value_info("pos", TensorProto.INT64, [1, None])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, 8])], inits)
    path = tmp_path / "rotary.onnx"
    onnx.save_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18),
                                                        helper.make_opsetid("com.microsoft", 1)]),
                    str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=0)
    assert graph_weight_bytes(path) == 4 * (8 * 8 + 2 * 64 * 4)
    assert step_weight_bytes(path) == 4 * 8 * 8
