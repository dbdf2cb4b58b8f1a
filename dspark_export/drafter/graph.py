"""Export a DSpark drafter checkpoint to the ``dspark_draft`` ONNX graph plus a heads file, and validate it
against torch.

The graph (declared in :func:`dspark_runtime.engine_dir.graphspec.dspark_draft_spec`) appends the projected K/V of
newly committed target features to the drafter's context cache and runs the block forward, returning normed hidden
states and base logits. The Markov and confidence heads are small (r×V_d and d+r) and sequential, so they ship as
``dspark_heads.npz`` and run in numpy (:mod:`dspark_runtime.drafting.dspark`; a DFlash drafter's file holds neither
head, only the draft-vocabulary map where it has one). The anchor's embedding rows are read
from the target graph's own table when it equals the drafter's, else from a copy beside the graph.
"""
from __future__ import annotations

import json
import logging
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dspark_runtime.drafting.dspark import OrtDSparkGraph
from dspark_runtime.drafting.embedding_rows import EmbeddingRows
from dspark_runtime.engine_dir.graphspec import DecoderDims, GraphSpec, dspark_draft_spec
from dspark_runtime.engine_dir.manifest import FileEntry
from dspark_runtime.errors import DSparkError

from dspark_export.drafter.checkpoint import load_checkpoint
from dspark_export.drafter.model import DSparkDraftModel
from dspark_export.graphs.decoder import OPSET, save_graph
from dspark_export.precision.gguf_embedding import read_layout

HEADS_NAME = "dspark_heads.npz"
TRACE_BATCH, TRACE_NEW, TRACE_PAST = 2, 3, 5


class DraftGraphWrapper(nn.Module):
    """forward(features, feature_positions, anchor_embeds, block_positions, attention_mask, *past) ->
    (hidden, base_logits, *present) — see ``dspark_draft_spec``.

    The block is [anchor, mask, ..., mask]: the anchor's embedding row comes in as an input (the runtime reads it
    from the target's own embedding table, :class:`dspark_runtime.drafting.dspark.EmbeddingRows`), the mask token's row is
    a constant of the graph, so the graph holds no [V, d] table (0.93 GB fp32 for Qwen2.5-1.5B)."""

    def __init__(self, model: DSparkDraftModel):
        super().__init__()
        self.model = model
        c = model.config
        with torch.no_grad():  # embed(): Gemma-4's sqrt(d) scale included
            mask_row = model.embed(torch.tensor([[c.mask_token_id]])).float()
        self.register_buffer("mask_embed", mask_row, persistent=False)  # [1, 1, d]

    def forward(self, features, feature_positions, anchor_embeds, block_positions, attention_mask, *past_flat):
        m = self.model
        c = m.config
        new = m.context_kv(features, feature_positions)
        present = [(torch.cat([past_flat[2 * i], k], dim=2), torch.cat([past_flat[2 * i + 1], v], dim=2))
                   for i, (k, v) in enumerate(new)]
        anchor = anchor_embeds
        if c.embed_scale is not None:  # as DSparkDraftModel.embed: the scale in the weights' dtype
            anchor = anchor * torch.tensor(c.embed_scale, dtype=torch.float32).to(m.embed_tokens.weight.dtype).float()
        masks = self.mask_embed.expand(anchor.shape[0], c.block_size - 1, -1)
        x = torch.cat([anchor, masks], dim=1)
        for layer, (k, v) in zip(m.layers, present):
            x = layer(x, block_positions, k, v, attention_mask)
        h = m.norm(x)
        outs = [h, m.base_logits(h)]  # lm_head (+ Gemma-4's final logit soft cap)
        for k, v in present:
            outs += [k, v]
        return tuple(outs)


def draft_dims(model: DSparkDraftModel) -> DecoderDims:
    c = model.config
    return DecoderDims(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                       hidden_size=c.hidden_size, vocab_size=c.out_vocab)


def _example(model: DSparkDraftModel, batch: int, new: int, past: int, seed: int = 0):
    c = model.config
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(batch, new, c.feature_size, generator=g)
    fpos = torch.arange(past, past + new).expand(batch, new).contiguous()
    anchor = model.embed_tokens.weight.detach()[torch.randint(0, c.vocab_size, (batch, 1), generator=g)].float()
    bpos = torch.arange(past + new, past + new + c.block_size).expand(batch, c.block_size).contiguous()
    mask = torch.ones(batch, 1, c.block_size, past + new + c.block_size, dtype=torch.bool)
    kv = []
    for _ in range(c.num_hidden_layers):
        kv += [torch.randn(batch, c.num_key_value_heads, past, c.head_dim, generator=g) for _ in range(2)]
    return (feats, fpos, anchor, bpos, mask, *kv)


def trace_drafter(wrapper: nn.Module, args: tuple, spec: GraphSpec, out_path: Path, what: str) -> GraphSpec:
    """Trace a drafter graph ``wrapper`` on example ``args`` (its named inputs, then the past K/V tensors) to
    ``out_path`` + ``.data`` (dynamo, opset 18, the dynamic axes ``spec`` declares). Returns ``spec``. Raises
    DSparkError naming ``what`` ("the DSpark drafter") when the export fails."""
    n = len(spec.inputs) - 2 * spec.dims.num_layers  # inputs before the past K/V
    dyn = torch.export.Dim.DYNAMIC
    shapes = [{ax: dyn for ax in t.dynamic_axes()} for t in spec.inputs]
    dynamic_shapes = (*shapes[:n], tuple(shapes[n:]))
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        try:
            prog = torch.onnx.export(wrapper.eval(), args, dynamo=True, input_names=spec.input_names,
                                     output_names=spec.output_names, dynamic_shapes=dynamic_shapes,
                                     opset_version=OPSET, optimize=True, verbose=False)
        except Exception as e:
            raise DSparkError(f"ONNX export of {what} failed: {e}") from e
    save_graph(prog.model_proto, spec, out_path)
    print(f"  exported {out_path.name} in {time.perf_counter() - t0:.1f}s")
    return spec


def export_draft_graph(model: DSparkDraftModel, out_path: Path) -> GraphSpec:
    """Trace the drafter to ``out_path`` (:func:`trace_drafter`)."""
    c = model.config
    spec = dspark_draft_spec(draft_dims(model), c.feature_size, c.block_size)
    return trace_drafter(DraftGraphWrapper(model), _example(model, TRACE_BATCH, TRACE_NEW, TRACE_PAST), spec,
                         out_path, "the DSpark drafter")


def validate_draft_graph(model: DSparkDraftModel, path: Path, tol: float = 1e-3) -> dict:
    """Run the graph with ONNX Runtime and torch on random inputs (two chained calls: a context step with
    no past, then one on top of its cache); returns max |Δ| of logits and hidden states.

    Raises:
        DSparkError: a difference above ``tol`` (relative to the logits' scale) or argmax disagreement.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    wrapper = DraftGraphWrapper(model).eval()
    rep = {"max_abs_logit_diff": 0.0, "max_abs_hidden_diff": 0.0, "argmax_agreement": 1.0}
    c = model.config
    first = _example(model, 1, 6, 0, seed=3)
    with torch.no_grad():
        ref1 = wrapper(*first)
    got1 = sess.run(None, {n: t.numpy() for n, t in zip(names, first)})
    present = [t.numpy() for t in ref1[2:]]
    second = list(_example(model, 1, 2, 6, seed=4))
    second[5:] = [torch.as_tensor(p) for p in present]
    with torch.no_grad():
        ref2 = wrapper(*second)
    got2 = sess.run(None, {n: t.numpy() if isinstance(t, torch.Tensor) else t for n, t in zip(names, second)})
    agree = []
    for ref, got in ((ref1, got1), (ref2, got2)):
        rep["max_abs_hidden_diff"] = max(rep["max_abs_hidden_diff"], float(np.abs(ref[0].numpy() - got[0]).max()))
        rep["max_abs_logit_diff"] = max(rep["max_abs_logit_diff"], float(np.abs(ref[1].numpy() - got[1]).max()))
        agree.append(float((ref[1].numpy().argmax(-1) == got[1].argmax(-1)).mean()))
    rep["argmax_agreement"] = float(np.mean(agree))
    scale = float(np.abs(ref2[1].numpy()).max()) or 1.0
    rep["tolerance"] = tol * max(1.0, scale)
    if rep["max_abs_logit_diff"] > rep["tolerance"] or rep["argmax_agreement"] < 1.0:
        raise DSparkError(f"drafter graph {path} disagrees with torch: {rep}")
    del c
    return rep


def compare_draft_graphs(ref_path: Path, cand_path: Path, spec: GraphSpec, embedding, seed: int = 0) -> dict:
    """A quantized drafter graph ``cand_path`` against its fp32 ``ref_path`` (ONNX Runtime, CPU) on two chained
    calls (12 context positions, then 3 more on the returned cache) with random target features and real anchor
    rows from ``embedding`` (:class:`dspark_runtime.drafting.dspark.EmbeddingRows`): {"max_abs_logit_diff",
    "argmax_agreement", "inputs": "random features"}. Random features make the logits a sanity check of the
    quantized weights, not of acceptance (measure that with ``benchmarks/bench.py``)."""
    rng = np.random.default_rng(seed)
    ref = OrtDSparkGraph(ref_path, spec, embedding=embedding)
    cand = OrtDSparkGraph(cand_path, spec, embedding=embedding)
    fdim = spec.inputs[0].shape[-1]
    g = ref.block_size
    kv_ref, kv_cand, past = ref.empty_kv(1), cand.empty_kv(1), 0
    diffs, agree = [], []
    for new in (12, 3):
        feats = rng.standard_normal((1, new, fdim)).astype(np.float32)
        fpos = np.arange(past, past + new)[None]
        bpos = np.arange(past + new, past + new + g)[None]
        mask = np.ones((1, 1, g, past + new + g), dtype=bool)
        anchor = rng.integers(0, embedding.shape[0], (1, 1))
        h1, l1, kv_ref = ref.run(feats, fpos, anchor, bpos, mask, kv_ref)
        h2, l2, kv_cand = cand.run(feats, fpos, anchor, bpos, mask, kv_cand)
        diffs.append(float(np.abs(l1 - l2).max()))
        agree.append(float((l1.argmax(-1) == l2.argmax(-1)).mean()))
        past += new
    ref.deactivate()
    cand.deactivate()
    return {"max_abs_logit_diff": max(diffs), "argmax_agreement": float(np.mean(agree)), "inputs": "random features"}


def write_heads(model: DSparkDraftModel, path: Path) -> dict:
    """Save the Markov/confidence heads and the draft-vocabulary map as float32/int64 numpy arrays."""
    c = model.config
    arrays = {}
    mh = model.markov_head
    if mh is not None:
        arrays["markov_w1"] = mh.markov_w1.weight.detach().float().numpy()
        arrays["markov_w2"] = mh.markov_w2.weight.detach().float().numpy()
        if c.markov_head_type == "gated":
            arrays["gate_w"] = mh.gate_proj.weight.detach().float().numpy()
            arrays["gate_b"] = mh.gate_proj.bias.detach().float().numpy()
        elif c.markov_head_type == "rnn":
            arrays["joint_w"] = mh.joint_proj.weight.detach().float().numpy()
            arrays["joint_b"] = mh.joint_proj.bias.detach().float().numpy()
    if model.confidence_head is not None:
        arrays["conf_w"] = model.confidence_head.proj.weight.detach().float().numpy()[0]
        arrays["conf_b"] = model.confidence_head.proj.bias.detach().float().numpy()
    if model.draft_vocab_ids is not None:
        arrays["draft_vocab_ids"] = model.draft_vocab_ids.numpy().astype(np.int64)
    np.savez(path, **arrays)
    return {"markov_rank": c.markov_rank, "markov_head_type": c.markov_head_type,
            "confidence_head": model.confidence_head is not None,
            "confidence_head_with_markov": c.confidence_head_with_markov}


def target_frozen_weights(target_dir: Path):
    """The target's embedding and LM head [V, d] read straight from its safetensors (no full model load)."""
    from safetensors import safe_open

    emb = head = None
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            keys = set(s.keys())
            if "model.embed_tokens.weight" in keys:
                emb = s.get_tensor("model.embed_tokens.weight").float()
            if "lm_head.weight" in keys:
                head = s.get_tensor("lm_head.weight").float()
    if emb is None:
        raise DSparkError(f"{target_dir}: no model.embed_tokens.weight in its safetensors")
    return emb, head if head is not None else emb


def _omits_frozen(checkpoint: Path) -> bool:
    """Whether the checkpoint's safetensors lack the frozen embedding or LM head (names read, no tensor)."""
    from safetensors import safe_open

    names = set()
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            names |= set(s.keys())
    return not {"embed_tokens.weight", "lm_head.weight"} <= names


EMBED_FILE = "dspark_embed.bin"  # the drafter's own embedding table, where it is not the target graph's


def target_embedding_entry(engine_dir: Path, model_file: str) -> dict | None:
    """Where the target graph ``engine_dir/model_file`` keeps its token embedding table in its external data: the
    ``speculation.dspark.embedding`` entry {"file" (relative to ``engine_dir``), "offset", "dtype", "shape"} of a
    raw float table read by a ``Gather`` of ``input_ids``, or, for a table in the GGUF's blocks
    (:mod:`dspark_export.precision.gguf_embedding`), dtype "blocks" with the layout under "blocks"; None when the
    table is inline in the .onnx file or held otherwise (the drafter then gets a file of its own,
    :func:`export_dspark`). Reads no weights."""
    import onnx

    path = Path(engine_dir) / model_file
    proto = onnx.load(str(path), load_external_data=False)
    g = proto.graph
    inits = {t.name: t for t in g.initializer}

    def external(name: str, size: int | None = None) -> tuple | None:  # (file relative to engine_dir, offset)
        t = inits.get(name)
        if t is None or t.data_location != onnx.TensorProto.EXTERNAL:
            return None
        ext = {e.key: e.value for e in t.external_data}
        if "location" not in ext or (size is not None and int(ext.get("length", -1)) not in (-1, size)):
            return None
        return (Path(model_file).parent / ext["location"]).as_posix(), int(ext.get("offset", 0))

    layout = read_layout(proto)
    if layout is not None:
        codes, scales = inits.get(layout["codes"]), external(layout["scales"])
        where = external(layout["codes"])
        offsets = external(layout["offsets"]) if layout["offsets"] else None
        if codes is None or where is None or scales is None or (layout["offsets"] and offsets is None) or \
                len({where[0], scales[0], *([offsets[0]] if offsets else [])}) != 1:
            return None
        vocab, hidden = int(codes.dims[0]), int(codes.dims[1]) * (2 if layout["bits"] == 4 else 1)
        return {"file": where[0], "offset": where[1], "dtype": "blocks", "shape": [vocab, hidden],
                "blocks": {"bits": layout["bits"], "size": layout["size"], "zero_point": layout["zero_point"],
                           "scales_offset": scales[1], "offsets_offset": offsets[1] if offsets else None}}
    dtypes = {onnx.TensorProto.FLOAT: ("float32", 4), onnx.TensorProto.FLOAT16: ("float16", 2)}
    for node in g.node:
        if node.op_type != "Gather" or len(node.input) != 2 or node.input[1] != "input_ids":
            continue
        t = inits.get(node.input[0])
        if t is None or t.data_type not in dtypes or len(t.dims) != 2:
            return None
        name, size = dtypes[t.data_type]
        where = external(node.input[0], t.dims[0] * t.dims[1] * size)
        if where is None:
            return None
        return {"file": where[0], "offset": where[1], "dtype": name, "shape": [int(x) for x in t.dims]}
    return None


def embedding_entry(table: np.ndarray, out_dir: Path, target_entry: dict | None, target_root: Path,
                    file_name: str = EMBED_FILE) -> dict:
    """A drafter's ``embedding`` entry (``speculation.dspark`` / ``speculation.eagle3``) for its embedding table
    ``table`` float32 [V, d]: the target graph's table (``target_entry``, relative to ``target_root``) when it equals
    ``table`` bit for bit (drafters hold frozen copies of it), else ``table`` written to ``out_dir/file_name`` (raw
    float32)."""
    if target_entry is not None:
        t = EmbeddingRows.from_manifest(target_root, target_entry)
        if t.shape == table.shape and np.array_equal(t.table(), table):
            return dict(target_entry)
    np.ascontiguousarray(table, dtype="<f4").tofile(Path(out_dir) / file_name)
    return {"file": file_name, "offset": 0, "dtype": "float32", "shape": list(table.shape)}


def relocate_embedding(src_dir: Path, out_dir: Path, manifest, log=print):
    """After ``dspark-export quantize`` rewrote the target graph into ``out_dir``: point the DSpark drafter's
    embedding entry at the new target's table (where it is the same table) or at a copy of the old one, so no
    entry is left pointing at an offset of a file that changed. Adds the copy to the drafter graph's files."""
    ds = manifest.speculation.dspark
    old = EmbeddingRows.from_manifest(src_dir, ds.embedding).table()
    new_entry = target_embedding_entry(out_dir, manifest.graphs["target"].model_file)
    ds.embedding = embedding_entry(old, out_dir, new_entry, out_dir)
    if ds.embedding["file"] == EMBED_FILE:
        g = manifest.graphs[ds.graph]
        g.files = [f for f in g.files if f.path != EMBED_FILE] + [FileEntry.of(out_dir, EMBED_FILE)]
    log(f"[{ds.graph}] DSpark anchor embedding rows now read from {ds.embedding['file']}")


def export_dspark(checkpoint: Path, target_dir: Path, out_dir: Path, role: str = "draft",
                  target_embedding: dict | None = None, target_root: Path | None = None) -> dict:
    """Checkpoint -> ``{role}.onnx`` (+ .data) and ``dspark_heads.npz`` in ``out_dir``; returns manifest parts.

    Returns {"spec", "validation", "config" (the DeepSpec config dict), "heads", "embedding"}. The target's
    embedding and LM head are read only when the checkpoint omits its frozen copies (DeepSpec's checkpoints hold
    them). ``target_embedding``: the target graph's table (:func:`target_embedding_entry`, relative to
    ``target_root``, default ``out_dir``); the anchor's rows are read from it when it equals the drafter's table,
    else from a file of the drafter's own (``"embedding"`` of the result says which).
    """
    emb = head = None
    if _omits_frozen(Path(checkpoint)):
        emb, head = target_frozen_weights(target_dir)
    model = load_checkpoint(checkpoint, target_embed=emb, target_lm_head=head).eval()
    del emb, head
    path = Path(out_dir) / f"{role}.onnx"
    spec = export_draft_graph(model, path)
    val = validate_draft_graph(model, path)
    heads = write_heads(model, Path(out_dir) / HEADS_NAME)
    embedding = embedding_entry(model.embed_tokens.weight.detach().float().numpy(), Path(out_dir), target_embedding,
                                Path(target_root or out_dir))
    return {"spec": spec.to_json(), "validation": {"fp32": val}, "config": model.config.to_dict(), "heads": heads,
            "embedding": embedding}


if __name__ == "__main__":  # subprocess worker: python -m dspark_export.drafter.graph ARGS_JSON RESULT_PATH
    import sys

    a = json.loads(sys.argv[1])
    try:
        r = export_dspark(Path(a["checkpoint"]), Path(a["target_dir"]), Path(a["out_dir"]), a.get("role", "draft"),
                          a.get("target_embedding"), a.get("target_root"))
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    Path(sys.argv[2]).write_text(json.dumps(r))
