"""The fusions of dspark_export/graphs/fusions.py on the tiny target's exported graph: every query and key rotation
becomes one com.microsoft.RotaryEmbedding, the graph computes what it did, positions past the table are refused, and a
graph it does not know is left alone; the layers' cache shape reads become one read, bit-identical, and ONNX Runtime
then runs fewer nodes."""
import shutil

import numpy as np
import pytest

pytest.importorskip("onnx")


def _copy_graph(src, dst_dir):
    for p in (src, src.with_name(src.name + ".data")):
        shutil.copy(p, dst_dir / p.name)
    return dst_dir / src.name


def _fused(tiny_graph, tmp_path, max_positions):
    import onnx

    from dspark_export.graphs.fusions import fuse_rotary

    path, spec, _ = tiny_graph
    dst = _copy_graph(path, tmp_path)
    model = onnx.load(str(dst), load_external_data=False)
    n = fuse_rotary(model, max_positions)
    onnx.save_model(model, str(dst))
    return dst, n, model


def test_rotary_fusion_computes_what_the_exported_pattern_did(tiny_graph, tmp_path):
    import onnx

    from dspark_export.graphs.fusions import fuse_file
    from dspark_export.precision.quantize import logit_agreement
    from dspark_runtime.backends.ort import OrtDecoder

    path, spec, token_lists = tiny_graph
    dst = _copy_graph(path, tmp_path)
    layers = spec.dims.num_layers
    done = fuse_file(dst, 64)
    assert done["rotary"] == 2 * layers and done["merged"] == 0 and done["shapes"] > 0  # each layer's query and key
    ops = [node.op_type for node in onnx.load(str(dst), load_external_data=False).graph.node]
    assert ops.count("RotaryEmbedding") == 2 * layers and not {"Neg", "Sin", "Cos"} & set(ops)
    assert fuse_file(dst, 64) == {"rotary": 0, "shapes": 0, "merged": 0}  # nothing left to fuse
    got = logit_agreement(OrtDecoder(path, spec, threads=1), OrtDecoder(dst, spec, threads=1), token_lists)
    for kind in ("prefill", "verify"):  # the tables are float64 math rounded once: the same logits to rounding
        assert got[kind]["top1_agreement"] == 1.0 and got[kind]["max_abs_logit_diff"] < 1e-4, got


def test_positions_past_the_table_are_refused_and_unknown_graphs_left_alone(tiny_graph, tmp_path):
    import onnx

    from dspark_export.graphs.fusions import fuse_rotary
    from dspark_runtime.backends.ort import OrtDecoder

    path, spec, _ = tiny_graph
    dst, n, _ = _fused(tiny_graph, tmp_path, 8)
    assert n > 0
    dec = OrtDecoder(dst, spec, threads=1)
    ids = np.arange(3, 15, dtype=np.int64)[None]  # 12 positions, the table holds 8
    with pytest.raises(Exception, match="RotaryEmbedding"):
        dec.step(ids, np.arange(12, dtype=np.int64)[None], np.tril(np.ones((12, 12), bool))[None, None],
                 dec.empty_kv(1))
    model = onnx.load(str(path), load_external_data=False)
    for i in model.graph.input:  # without a position_ids input there is nothing to index the tables with
        if i.name == "position_ids":
            i.name = "positions"
    assert fuse_rotary(model, 64) == 0 and not any(node.op_type == "RotaryEmbedding" for node in model.graph.node)


def _optimized_node_count(path, tmp_path) -> int:
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / f"optimized-{path.stem}.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return len(onnx.load(so.optimized_model_filepath, load_external_data=False).graph.node)


def test_shared_shape_reads_are_bit_identical_and_run_fewer_nodes(tiny_graph, tmp_path):
    import onnx

    from dspark_export.graphs.fusions import share_shape_reads
    from dspark_runtime.backends.ort import OrtDecoder

    path, spec, token_lists = tiny_graph
    dst = _copy_graph(path, tmp_path)
    model = onnx.load(str(dst), load_external_data=False)
    reads = [n.input[0] for n in model.graph.node if n.op_type == "Shape" and n.input[0].startswith("past.")]
    n = share_shape_reads(model)
    onnx.save_model(model, str(dst))
    assert n == sum(name != "past.0.key" for name in reads) > 0
    assert {node.input[0] for node in model.graph.node if node.op_type == "Shape" and node.input[0].startswith(
        "past.")} == {"past.0.key"}
    assert share_shape_reads(model) == 0
    assert _optimized_node_count(dst, tmp_path) < _optimized_node_count(path, tmp_path)
    a, b = OrtDecoder(path, spec, threads=1), OrtDecoder(dst, spec, threads=1)
    ids = np.array([token_lists[0][:6]], np.int64)
    pos = np.arange(6, dtype=np.int64)[None]
    mask = np.tril(np.ones((6, 6), bool))[None, None]
    first = [a.step(ids, pos, mask, a.empty_kv(1)), b.step(ids, pos, mask, b.empty_kv(1))]
    assert np.array_equal(first[0].logits, first[1].logits)
    nxt = np.array([token_lists[0][6:9]], np.int64)  # a verify-like call over the cache the first call left
    pos2 = np.arange(6, 9, dtype=np.int64)[None]
    mask2 = np.tril(np.ones((3, 9), bool), k=6)[None, None]
    got = [d.step(nxt, pos2, mask2, out.kv) for d, out in zip((a, b), first)]
    assert np.array_equal(got[0].logits, got[1].logits)
