"""The float-weight int4 writer: every weight MatMul of a graph quantized by ONNX Runtime's ``MatMulNBitsQuantizer``
(``rtn``: symmetric round-to-nearest; ``hqq``: HQQ, asymmetric) into ``com.microsoft.MatMulNBits``, then the nodes that
read one activation merged (:mod:`dspark_export.precision.nbits_fuse`). A model converted from a GGUF keeps its token
embedding in that file's blocks (:mod:`dspark_export.precision.gguf_embedding`). The weight form and the GGUF writer:
:mod:`dspark_export.precision.nbits`, :mod:`dspark_export.precision.nbits_gguf`.
"""
from __future__ import annotations

import time
from pathlib import Path

from dspark_runtime.errors import DSparkError

from dspark_export.graphs.onnx_io import graph_weight_bytes, peak_rss_gb
from dspark_export.precision.gguf_embedding import embed_in_blocks
from dspark_export.precision.nbits import DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, check_nbits_graph
from dspark_export.precision.nbits_fuse import fuse_shared_inputs


def quantize_nbits_rtn(src: Path, dst: Path, *, algorithm: str = "rtn", bits: int = 4,
                       block_size: int = DEFAULT_BLOCK_SIZE, accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                       gguf: Path | None = None, log=print) -> dict:
    """Write ``dst`` (+ ``dst.data``): graph ``src`` with every weight MatMul quantized from its float weights by
    ONNX Runtime's ``MatMulNBitsQuantizer`` (``algorithm`` ``"rtn"``: its default symmetric round-to-nearest
    config; ``"hqq"``: its HQQ config, asymmetric). ``gguf``: the GGUF the model was converted from, if any: the
    token embedding then reads that file's blocks where they reproduce the fp32 table bit for bit
    (:func:`~dspark_export.precision.gguf_embedding.embed_in_blocks`; the record's ``"embedding"``). Holds the whole
    graph in memory (≈ 1.3× the fp32 weights). Returns the quantization record. Raises DSparkError when the
    quantizer fails."""
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    src, dst = Path(src), Path(dst)
    t0 = time.perf_counter()
    if algorithm == "rtn":
        cfg = mnq.DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level,
                                               bits=bits)
    elif algorithm == "hqq":
        cfg = mnq.HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits)
    else:
        raise DSparkError(f"no float-weight int4 algorithm {algorithm!r}; choose rtn or hqq")
    try:
        model = onnx.load(str(src))
        embedding = embed_in_blocks(model, Path(gguf), log=log) if gguf is not None else "fp32 table"
        traced = {nd.name: list(nd.metadata_props) for nd in model.graph.node if nd.op_type == "MatMul"}
        q = mnq.MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=True,
                                     accuracy_level=accuracy_level, algo_config=cfg)
        q.process()
        for nd in q.model.model.graph.node:  # keep the torch module each node was traced from (it names it `<MatMul>_Q4`)
            meta = traced.get(nd.name.rsplit("_Q", 1)[0]) if nd.op_type == "MatMulNBits" else None
            if meta and not nd.metadata_props:
                nd.metadata_props.extend(meta)
        for p in (dst, dst.with_name(dst.name + ".data")):
            if p.exists():
                p.unlink()
        onnx.save_model(q.model.model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dst.name + ".data", size_threshold=1024)
    except DSparkError:
        raise
    except Exception as e:
        raise DSparkError(f"ONNX Runtime's MatMulNBitsQuantizer failed on {src.name}: {e}") from e
    del q
    proto = onnx.load(str(dst), load_external_data=False)
    n = sum(nd.op_type == "MatMulNBits" for nd in proto.graph.node)
    if algorithm == "hqq":  # HQQ writes no accuracy_level: set it so the integer kernels are used
        for nd in proto.graph.node:
            if nd.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in nd.attribute):
                nd.attribute.append(onnx.helper.make_attribute("accuracy_level", accuracy_level))
        onnx.save_model(proto, str(dst))
    merged = fuse_shared_inputs(dst, log=log)
    check_nbits_graph(dst)
    rep = {"precision": "int4", "int4_source": algorithm, "bits": bits, "block_size": block_size,
           "accuracy_level": accuracy_level,
           "method": f"ONNX Runtime MatMulNBitsQuantizer ({'symmetric RTN' if algorithm == 'rtn' else 'HQQ'}, "
                     f"{bits}-bit, block {block_size}) from the float weights",
           "matmul_nbits": n, "merged_shared_inputs": merged, "embedding": embedding,
           "weight_bytes_in": graph_weight_bytes(src),
           "weight_bytes_out": graph_weight_bytes(dst),
           "seconds": round(time.perf_counter() - t0, 1), "peak_rss_gb": round(peak_rss_gb(), 2)}
    log(f"  {n} MatMulNBits ({rep['method']}); weights {rep['weight_bytes_in'] / 2**30:.2f} -> "
        f"{rep['weight_bytes_out'] / 2**30:.2f} GiB in {rep['seconds']:.0f} s, peak RSS {rep['peak_rss_gb']:.2f} GiB")
    return rep
