"""The token embedding of a graph built from a GGUF, kept in the GGUF's own blocks instead of float32.

The exported graph embeds tokens by ``Gather(table, input_ids)`` over the fp32 table the Hugging Face conversion
dequantized from the GGUF's ``token_embd.weight`` (0.93 GB for Qwen2.5-1.5B, whose GGUF holds it as Q4_K: 0.13 GB).
:func:`encode_embedding` recovers the blocks' codes, scales and offsets (:func:`~dspark_export.precision.gguf_blocks.
encode_gguf_rows`) and keeps them only when decoding them reproduces every value of the table bit for bit;
:func:`embedding_nodes` decodes the gathered rows in the graph as
:func:`~dspark_runtime.drafting.embedding_rows.decode_blocks` does, ``(code − zero point) · scale − offset`` in float32,
the order of operations gguf-py's dequantization uses, so the graph's logits do not change. The layout (the
runtime's :class:`~dspark_runtime.drafting.embedding_rows.EmbeddingRows` reads the same tensors for a drafter's
anchor rows) is recorded in the model's metadata under :data:`LAYOUT_KEY`.
"""
from __future__ import annotations

import json

import numpy as np

from dspark_runtime.drafting.embedding_rows import decode_blocks
from dspark_runtime.errors import DSparkError

from dspark_export.graphs.onnx_io import default_opset
from dspark_export.precision.gguf_blocks import ENCODINGS, encode_gguf_rows

LAYOUT_KEY = "dspark.embedding_blocks"  # model metadata: {"bits", "size", "zero_point", "codes", "scales", "offsets"}
GGUF_NAME = "token_embd.weight"
_PREFIX = "embed_tokens_blocks"
_ROWS = 8192  # table rows encoded per step (8192 × 1536 floats: 50 MB)


def embedding_gather(graph):
    """The ``Gather(table, input_ids)`` node embedding the graph's tokens, where ``table`` is an fp32 [vocab, hidden]
    initializer nothing else reads; None otherwise."""
    from onnx import TensorProto

    inits = {t.name: t for t in graph.initializer}
    readers: dict = {}
    for n in graph.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    for n in graph.node:
        if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] == "input_ids" and n.input[0] in inits:
            t = inits[n.input[0]]
            if t.data_type == TensorProto.FLOAT and len(t.dims) == 2 and readers[n.input[0]] == 1:
                return n
            return None
    return None


def encode_embedding(table_rows, gguf_tensor, vocab: int, hidden: int) -> dict | None:
    """The GGUF tensor ``gguf_tensor`` (``token_embd.weight``) as blocks, if they reproduce the table bit for bit.

    ``table_rows(a, b)``: the graph's fp32 table rows a..b-1, float32 [b - a, hidden]. Returns {"bits", "size",
    "zero_point", "codes" uint8, "scales" float32, "offsets" float32 or None, "gguf_type"}; None when the tensor's
    type has no block encoding here, its shape differs, or a decoded value differs from the table's (the table did
    not come from this GGUF)."""
    qtype = gguf_tensor.tensor_type.name
    if qtype not in ENCODINGS or tuple(int(d) for d in gguf_tensor.shape) != (hidden, vocab):
        return None
    bits, size, zp, affine = ENCODINGS[qtype]
    if hidden % size or (bits == 4 and hidden % 2):
        return None
    codes, scales, offsets = [], [], []
    for a in range(0, vocab, _ROWS):
        b = min(vocab, a + _ROWS)
        try:
            enc, _ = encode_gguf_rows(np.asarray(gguf_tensor.data[a:b]), qtype, hidden)
        except DSparkError:  # blocks this code cannot re-pack: the table stays float
            return None
        c = enc.packed.reshape(b - a, -1)  # MatMulNBits packs the lowest index in the lowest bits, block after block
        s = enc.scales.reshape(b - a, -1)
        o = enc.correction.T.copy() if affine else None
        if not np.array_equal(decode_blocks(c, s, o, bits, size, zp), table_rows(a, b)):
            return None
        codes.append(c)
        scales.append(s)
        offsets.append(o)
    return {"bits": bits, "size": size, "zero_point": zp, "gguf_type": qtype, "codes": np.concatenate(codes),
            "scales": np.concatenate(scales), "offsets": np.concatenate(offsets) if affine else None}


def _tensors(enc: dict) -> tuple:
    """({initializer name: array} of :func:`encode_embedding`'s blocks, the layout recorded under :data:`LAYOUT_KEY`)."""
    names = {"codes": f"{_PREFIX}_codes", "scales": f"{_PREFIX}_scales",
             "offsets": f"{_PREFIX}_offsets" if enc["offsets"] is not None else None}
    arrays = {names[k]: enc[k] for k in ("codes", "scales", "offsets") if names[k]}
    return arrays, {"bits": enc["bits"], "size": enc["size"], "zero_point": enc["zero_point"], **names}


def embedding_initializers(writer, enc: dict) -> tuple:
    """Write the blocks of :func:`encode_embedding` through ``writer`` (an ExternalWriter). Returns (the
    TensorProtos, the layout recorded under :data:`LAYOUT_KEY`)."""
    from onnx import helper

    arrays, layout = _tensors(enc)
    return [writer.put([a], name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for name, a in arrays.items()], layout


def kept_in_blocks(enc: dict, table_bytes: int) -> str:
    """The build log's line for a table kept in the blocks of :func:`encode_embedding` instead of ``table_bytes``."""
    blocks = sum(a.nbytes for a in _tensors(enc)[0].values())
    return (f"  token embedding <- {GGUF_NAME} {enc['gguf_type']}: {enc['bits']}-bit codes in blocks of {enc['size']}, "
            f"{blocks / 2**20:.0f} MiB instead of {table_bytes / 2**20:.0f} (bit for bit)")


def describe(enc_or_layout: dict, gguf_type: str) -> dict:
    """The quantization record's ``embedding`` entry for a table kept in blocks."""
    return {"gguf_type": gguf_type, "encoding": f"{enc_or_layout['bits']}-bit codes, blocks of "
                                                f"{enc_or_layout['size']} (the GGUF's own; decoded bit for bit)"}


def embed_in_blocks(proto, gguf_path, log=print) -> dict | str:
    """Rewrite ``proto`` (a decoder graph loaded with its weights, in memory) so its token embedding reads the blocks
    of ``gguf_path``'s ``token_embd.weight`` instead of its fp32 table, where they reproduce the table bit for bit
    (:func:`encode_embedding`). For graphs whose other weights do not come from the GGUF (a draft quantized from its
    float weights). Returns the quantization record's ``embedding`` entry: :func:`describe`'s dict, or the string
    "fp32 table" when the table stays (no such Gather, no such tensor, or blocks that do not reproduce it)."""
    from gguf import GGUFReader
    from onnx import numpy_helper

    gather = embedding_gather(proto.graph)
    if gather is None:
        return "fp32 table"
    tensor = next((t for t in GGUFReader(str(gguf_path)).tensors if t.name == GGUF_NAME), None)
    inits = {t.name: t for t in proto.graph.initializer}
    table = numpy_helper.to_array(inits[gather.input[0]])
    vocab, hidden = table.shape
    enc = encode_embedding(lambda a, b: table[a:b], tensor, vocab, hidden) if tensor is not None else None
    if enc is None:
        log(f"  token embedding: kept fp32 ({GGUF_NAME} of {gguf_path.name} does not reproduce the table)")
        return "fp32 table"
    arrays, layout = _tensors(enc)
    opset = default_opset(proto)
    decode, consts = embedding_nodes(gather, layout, hidden, opset)
    nodes = list(proto.graph.node)
    at = nodes.index(gather)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes[:at] + decode + nodes[at + 1:])
    keep = [t for t in proto.graph.initializer if t.name != gather.input[0]]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep + [numpy_helper.from_array(a, n) for n, a in arrays.items()] + consts)
    record_layout(proto, layout)
    log(kept_in_blocks(enc, table.nbytes))
    return describe(enc, enc["gguf_type"])


def embedding_nodes(gather, layout: dict, hidden: int, opset: int) -> tuple:
    """The nodes and constant initializers that replace ``gather`` (same output): the tokens' codes, scales and
    offsets gathered and decoded in the float32 operations of
    :func:`~dspark_runtime.drafting.embedding_rows.decode_blocks`."""
    from onnx import TensorProto, helper, numpy_helper

    ids, out, p, mk = gather.input[1], gather.output[0], _PREFIX, helper.make_node
    bits, size, zp = layout["bits"], layout["size"], layout["zero_point"]
    consts = {f"{p}_c16": np.array(16, np.float32), f"{p}_c1_16": np.array(0.0625, np.float32),
              f"{p}_zp": np.array(zp, np.float32), f"{p}_axis_last": np.array([-1], np.int64),
              f"{p}_block_shape": np.array([0, 0, hidden // size, size], np.int64),
              f"{p}_row_shape": np.array([0, 0, hidden], np.int64)}

    def unsqueeze(x, y):
        return (mk("Unsqueeze", [x, f"{p}_axis_last"], [y], name=y) if opset >= 13
                else mk("Unsqueeze", [x], [y], axes=[-1], name=y))

    nodes = [mk("Gather", [layout["codes"], ids], [f"{p}_c"], axis=0, name=f"{p}_c"),
             mk("Cast", [f"{p}_c"], [f"{p}_cf"], to=TensorProto.FLOAT, name=f"{p}_cf")]
    q = f"{p}_cf"
    if bits == 4:  # a byte's high nibble floor(b / 16), its low one b − 16·high: exact in float32
        nodes += [mk("Mul", [q, f"{p}_c1_16"], [f"{p}_t"], name=f"{p}_t"),
                  mk("Floor", [f"{p}_t"], [f"{p}_hi"], name=f"{p}_hi"),
                  mk("Mul", [f"{p}_hi", f"{p}_c16"], [f"{p}_hi16"], name=f"{p}_hi16"),
                  mk("Sub", [q, f"{p}_hi16"], [f"{p}_lo"], name=f"{p}_lo"),
                  unsqueeze(f"{p}_lo", f"{p}_lo1"), unsqueeze(f"{p}_hi", f"{p}_hi1"),
                  mk("Concat", [f"{p}_lo1", f"{p}_hi1"], [f"{p}_pairs"], axis=-1, name=f"{p}_pairs")]
        q = f"{p}_pairs"
    nodes.append(mk("Reshape", [q, f"{p}_block_shape"], [f"{p}_q"], name=f"{p}_q"))
    q = f"{p}_q"
    if zp:
        nodes.append(mk("Sub", [q, f"{p}_zp"], [f"{p}_qz"], name=f"{p}_qz"))
        q = f"{p}_qz"
    nodes += [mk("Gather", [layout["scales"], ids], [f"{p}_s"], axis=0, name=f"{p}_s"), unsqueeze(f"{p}_s", f"{p}_s1"),
              mk("Mul", [q, f"{p}_s1"], [f"{p}_w"], name=f"{p}_w")]
    w = f"{p}_w"
    if layout["offsets"]:
        nodes += [mk("Gather", [layout["offsets"], ids], [f"{p}_o"], axis=0, name=f"{p}_o"),
                  unsqueeze(f"{p}_o", f"{p}_o1"), mk("Sub", [w, f"{p}_o1"], [f"{p}_wo"], name=f"{p}_wo")]
        w = f"{p}_wo"
    nodes.append(mk("Reshape", [w, f"{p}_row_shape"], [out], name=f"{p}_rows"))
    return nodes, [numpy_helper.from_array(v, k) for k, v in consts.items()]


def record_layout(proto, layout: dict) -> None:
    """Record ``layout`` in ``proto``'s metadata under :data:`LAYOUT_KEY` (replacing a previous record)."""
    props = [p for p in proto.metadata_props if p.key != LAYOUT_KEY]
    del proto.metadata_props[:]
    proto.metadata_props.extend(props)
    entry = proto.metadata_props.add()
    entry.key, entry.value = LAYOUT_KEY, json.dumps(layout)


def read_layout(proto) -> dict | None:
    """The layout :func:`record_layout` stored in ``proto``, or None (a graph whose table is float)."""
    for p in proto.metadata_props:
        if p.key == LAYOUT_KEY:
            return json.loads(p.value)
    return None
