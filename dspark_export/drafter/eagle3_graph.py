"""Export an EAGLE-3 drafter checkpoint (:mod:`dspark_export.drafter.eagle3`: DeepSpec's or SpecForge's layout) to
the ``eagle3_draft`` ONNX graph and validate it against the torch model.

The graph (declared in :func:`dspark_runtime.engine_dir.graphspec.eagle3_draft_spec`) is one draft step of the
drafter's single layer over its own KV cache: query positions whose input state is ``fc(features) + states`` (fused
target features of committed positions, or the drafter's previous output state), with the embedding rows of the
token after each position given as an input (read by the runtime from the target's table when it is the drafter's,
else from a copy beside the graph), and logits at one position per row over the drafter's vocabulary (the target's,
or SpecForge's reduced one, whose target ids are written to ``DRAFT_VOCAB_FILE``). The runtime drafter is
:mod:`dspark_runtime.drafting.eagle3`.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dspark_runtime.drafting.embedding_rows import EmbeddingRows
from dspark_runtime.engine_dir.graphspec import DecoderDims, GraphSpec, eagle3_draft_spec
from dspark_runtime.errors import DSparkError

from dspark_export.drafter.eagle3 import Eagle3DraftModel, load_eagle3_checkpoint
from dspark_export.drafter.eagle3_specforge import checkpoint_holds_embedding
from dspark_export.drafter.graph import embedding_entry, trace_drafter

EMBED_FILE = "eagle3_embed.bin"  # the drafter's own embedding table, where it is not the target graph's
DRAFT_VOCAB_FILE = "eagle3_draft_vocab.npy"  # int64 [V_d]: the target id of each logits column (reduced vocabulary)
TRACE_BATCH, TRACE_Q, TRACE_PAST = 2, 3, 5


class Eagle3GraphWrapper(nn.Module):
    """forward(features, states, embeds, position_ids, attention_mask, logits_at, *past) -> (states_out, logits,
    *present) — see ``eagle3_draft_spec``."""

    def __init__(self, model: Eagle3DraftModel):
        super().__init__()
        self.model = model

    def forward(self, features, states, embeds, position_ids, attention_mask, logits_at, *past_flat):
        m = self.model
        state = m.fc(features) + states
        present = []
        for i, layer in enumerate(m.layers):
            state, k, v = layer.step(embeds, state, position_ids, past_flat[2 * i], past_flat[2 * i + 1],
                                     attention_mask)
            present += [k, v]
        rows = torch.arange(state.shape[0], device=state.device)
        # the head on [b, 1, d] (a MatMul, which int4 quantization covers; a 2-D input exports as Gemm, which it skips)
        return (state, m.logits(state[rows, logits_at][:, None])[:, 0], *present)


def eagle3_dims(model: Eagle3DraftModel) -> DecoderDims:
    c = model.config
    return DecoderDims(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                       hidden_size=c.hidden_size, vocab_size=c.draft_vocab_size or c.vocab_size)


def _example(model: Eagle3DraftModel, batch: int, q: int, past: int, seed: int = 0, fused: bool = True):
    """Random graph inputs: ``fused`` target features (states zero) or fed-back states (features zero)."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(batch, q, c.feature_size, generator=g)
    states = torch.randn(batch, q, c.hidden_size, generator=g)
    if fused:
        states.zero_()
    else:
        feats.zero_()
    embeds = model.embed_tokens.weight.detach()[torch.randint(0, c.vocab_size, (batch, q), generator=g)].float()
    pos = torch.arange(past, past + q).expand(batch, q).contiguous()
    mask = torch.arange(past + q)[None, :] <= past + torch.arange(q)[:, None]
    mask = mask.expand(batch, 1, q, past + q).contiguous()
    at = torch.full((batch,), q - 1, dtype=torch.int64)
    kv = []
    for _ in range(c.num_hidden_layers):
        kv += [torch.randn(batch, c.num_key_value_heads, past, c.head_dim, generator=g) for _ in range(2)]
    return (feats, states, embeds, pos, mask, at, *kv)


def export_eagle3_graph(model: Eagle3DraftModel, out_path: Path) -> GraphSpec:
    """Trace the drafter to ``out_path`` (dynamo, opset 18; weights external when large). Raises DSparkError when
    the export fails."""
    c = model.config
    spec = eagle3_draft_spec(eagle3_dims(model), c.feature_size)
    return trace_drafter(Eagle3GraphWrapper(model), _example(model, TRACE_BATCH, TRACE_Q, TRACE_PAST), spec, out_path,
                         "the EAGLE-3 drafter")


def validate_eagle3_graph(model: Eagle3DraftModel, path: Path, tol: float = 1e-3) -> dict:
    """Run the graph with ONNX Runtime and the torch wrapper on random inputs, three chained calls as a round runs
    them (6 fused positions with no past, 2 more fused, then a fed-back state on a batch of two); returns max |Δ| of
    logits and states and the argmax agreement.

    Raises:
        DSparkError: a logits difference above ``tol`` (relative to the logits' scale) or an argmax disagreement.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    wrapper = Eagle3GraphWrapper(model).eval()
    rep = {"max_abs_logit_diff": 0.0, "max_abs_state_diff": 0.0, "argmax_agreement": 1.0}
    agree, scale, present = [], 1.0, None
    for q, past, fused, seed in ((6, 0, True, 3), (2, 6, True, 4), (1, 8, False, 5)):
        args = list(_example(model, 2 if not fused else 1, q, past, seed=seed, fused=fused))
        if present is not None:
            b = args[0].shape[0]
            args[6:] = [torch.as_tensor(p).expand(b, *p.shape[1:]).contiguous() for p in present]
        with torch.no_grad():
            ref = wrapper(*args)
        got = sess.run(None, {n: t.numpy() for n, t in zip(names, args)})
        rep["max_abs_state_diff"] = max(rep["max_abs_state_diff"], float(np.abs(ref[0].numpy() - got[0]).max()))
        rep["max_abs_logit_diff"] = max(rep["max_abs_logit_diff"], float(np.abs(ref[1].numpy() - got[1]).max()))
        agree.append(float((ref[1].numpy().argmax(-1) == got[1].argmax(-1)).mean()))
        scale = max(scale, float(np.abs(ref[1].numpy()).max()))
        present = [p.numpy() for p in ref[2:]]
    rep["argmax_agreement"] = float(np.mean(agree))
    rep["tolerance"] = tol * scale
    if rep["max_abs_logit_diff"] > rep["tolerance"] or rep["argmax_agreement"] < 1.0:
        raise DSparkError(f"EAGLE-3 drafter graph {path} disagrees with torch: {rep}")
    return rep


def export_eagle3(checkpoint: Path, out_dir: Path, role: str = "eagle3", target_embedding: dict | None = None,
                  target_root: Path | None = None, target_num_layers: int | None = None) -> dict:
    """Checkpoint -> ``{role}.onnx`` (+ .data) in ``out_dir``; returns the manifest parts {"spec", "validation",
    "config" (the checkpoint's config.json), "embedding", "draft_vocab" (``DRAFT_VOCAB_FILE`` written for a reduced
    draft vocabulary, else None)}. ``target_embedding``: the target graph's table
    (:func:`dspark_export.drafter.graph.target_embedding_entry`, relative to ``target_root``, default ``out_dir``);
    the token rows are read from it when it equals the drafter's ``embed_tokens`` or the checkpoint holds none
    (SpecForge's), else from ``EMBED_FILE``. ``target_num_layers``: the target's decoder layers (SpecForge's default
    fused layers). Raises DraftConfigError for a checkpoint the loader refuses, DSparkError when export or
    validation fails."""
    root = Path(target_root or out_dir)
    embed = None
    if target_embedding is not None and not checkpoint_holds_embedding(checkpoint):
        embed = torch.from_numpy(EmbeddingRows.from_manifest(root, target_embedding).table())
    model = load_eagle3_checkpoint(checkpoint, target_num_layers=target_num_layers, target_embed=embed).eval()
    path = Path(out_dir) / f"{role}.onnx"
    spec = export_eagle3_graph(model, path)
    val = validate_eagle3_graph(model, path)
    embedding = embedding_entry(model.embed_tokens.weight.detach().float().numpy(), Path(out_dir), target_embedding,
                                root, file_name=EMBED_FILE)
    vocab = None
    if model.draft_vocab_ids is not None:
        vocab = DRAFT_VOCAB_FILE
        np.save(Path(out_dir) / vocab, model.draft_vocab_ids.numpy().astype("<i8"), allow_pickle=False)
    return {"spec": spec.to_json(), "validation": {"fp32": val}, "config": model.config.source,
            "embedding": embedding, "draft_vocab": vocab}


if __name__ == "__main__":  # subprocess worker: python -m dspark_export.drafter.eagle3_graph ARGS_JSON RESULT_PATH
    import sys

    from dspark_export.drafter.config import DraftConfigError

    a = json.loads(sys.argv[1])
    try:
        r = export_eagle3(Path(a["checkpoint"]), Path(a["out_dir"]), a.get("role", "eagle3"),
                          a.get("target_embedding"), a.get("target_root"), a.get("target_num_layers"))
    except (DSparkError, DraftConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    Path(sys.argv[2]).write_text(json.dumps(r))
