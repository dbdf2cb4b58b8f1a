"""The EAGLE-3 drafter in an engine: export an EAGLE-3 checkpoint (DeepSpec's or SpecForge's layout) into a built
engine directory and record it in the manifest (``dspark-export add-draft`` with an EAGLE-3 checkpoint).

The graph is exported in its own subprocess by default (``dspark_export.drafter.eagle3_graph``), validated against
torch, optionally quantized (weight-only, as the DSpark drafter's), and recorded as graph ``eagle3`` beside the
engine's other drafters, with ``speculation.eagle3`` (its target layers, ``ttt_length``, where its token
embedding rows are read: the checkpoint's table, or the target graph's where they are equal or the checkpoint holds
none, and a reduced draft vocabulary's target ids). The target graph is kept: it must already output the drafter's
layers (any superset), of the drafter's fused width, over the drafter's vocabulary.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from dspark_runtime.drafting.embedding_rows import EmbeddingRows
from dspark_runtime.drafting.eagle3 import DraftVocab, OrtEagle3Graph, feature_columns
from dspark_runtime.engine_dir.graphspec import GraphSpec
from dspark_runtime.engine_dir.manifest import FileEntry, GraphEntry, Manifest, load_manifest
from dspark_runtime.engine_dir.speculation import Eagle3Section
from dspark_runtime.errors import DSparkError

from dspark_export.engine_dir.add_draft import DSPARK_PRECISIONS
from dspark_export.engine_dir.commit import commit_manifest
from dspark_export.engine_dir.transaction import engine_transaction
from dspark_export.precision.quantizers import quantize_graph

ROLE = "eagle3"
# config.json architectures of EAGLE-3 drafters (DeepSpec's, SpecForge / vLLM's; refused ones get the EAGLE-3 loader's
# message rather than the DSpark loader's)
EAGLE3_ARCHITECTURES = ("Qwen3Eagle3Model", "Gemma4Eagle3Model", "LlamaForCausalLMEagle3", "Eagle3Speculator")


def is_eagle3_checkpoint(ckpt: Path) -> bool:
    """Whether the checkpoint folder's config.json names an EAGLE-3 architecture (DSpark/DFlash otherwise)."""
    f = Path(ckpt) / "config.json"
    try:
        arch = json.loads(f.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(a in EAGLE3_ARCHITECTURES for a in arch)


def compare_eagle3_graphs(ref_path: Path, cand_path: Path, spec: GraphSpec, embedding: EmbeddingRows,
                          seed: int = 0, vocab: DraftVocab | None = None) -> dict:
    """A quantized drafter graph against its fp32 one (ONNX Runtime, CPU) on a round as the runtime runs it:
    12 fused positions of random target features, then 3 fed-back draft steps (the argmax fed back as its target id
    through ``vocab``): {"max_abs_logit_diff", "argmax_agreement", "inputs": "random features"} (a sanity check of
    the quantized weights, not of acceptance)."""
    rng = np.random.default_rng(seed)
    ref, cand = OrtEagle3Graph(ref_path, spec, embedding=embedding), OrtEagle3Graph(cand_path, spec,
                                                                                   embedding=embedding)
    fdim, d = spec.inputs[0].shape[-1], spec.dims.hidden_size
    n = 12
    feats = rng.standard_normal((1, n, fdim)).astype(np.float32)
    toks = rng.integers(0, embedding.shape[0], (1, n))
    mask = np.tril(np.ones((n, n), dtype=bool))[None, None]
    args = (feats, np.zeros((1, n, d), np.float32), toks, np.arange(n)[None], mask, np.array([n - 1]))
    outs = [g.run(*args, g.empty_kv(1)) for g in (ref, cand)]
    diffs, agree = [], []
    states = [o[0][:, -1:] for o in outs]
    kvs = [o[2] for o in outs]
    logits = [o[1] for o in outs]
    for k in range(3):
        diffs.append(float(np.abs(logits[0] - logits[1]).max()))
        agree.append(float((logits[0].argmax(-1) == logits[1].argmax(-1)).mean()))
        best = int(logits[0].argmax())
        tok = np.array([[best if vocab is None else vocab.to_target(best)]])
        step = []
        for g, st, kv in zip((ref, cand), states, kvs):
            m = np.ones((1, 1, 1, n + k + 1), dtype=bool)
            step.append(g.run(np.zeros((1, 1, fdim), np.float32), st, tok, np.array([[n + k]]), m,
                              np.array([0]), kv))
        states, logits, kvs = [s[0] for s in step], [s[1] for s in step], [s[2] for s in step]
    ref.deactivate()
    cand.deactivate()
    return {"max_abs_logit_diff": max(diffs), "argmax_agreement": float(np.mean(agree)), "inputs": "random features"}


def add_eagle3_draft(engine_dir: Path, ckpt: Path, isolate: bool = True, log=print, precision: str = "auto") -> Manifest:
    """Add (or replace) the EAGLE-3 drafter of a built engine: graph ``eagle3`` beside any other drafter, so one engine
    serves ``draft="eagle3"`` as well as its others. ``precision``: "auto" (int4 beside an int4 target, else fp32),
    "fp32", "int4" or "int8-dynamic" (weight-only). A transaction: the engine directory is unchanged on failure.

    Raises:
        ManifestError: a directory that is not an engine.
        DSparkError: the target outputs features of other layers than the drafter's (the message names them and
            the fix), of another width or over another vocabulary, a precision not in DSPARK_PRECISIONS, a failed
            export.
        DraftConfigError: a checkpoint the EAGLE-3 loader refuses (in-process export; the subprocess prints it).
    """
    from dspark_export.drafter.eagle3 import load_eagle3_config  # torch
    from dspark_export.drafter.eagle3_graph import EMBED_FILE, export_eagle3
    from dspark_export.drafter.graph import target_embedding_entry

    engine_dir, ckpt = Path(engine_dir), Path(ckpt)
    dims = load_manifest(engine_dir, verify=False).graphs["target"].spec.dims  # a clear error for a non-engine
    cfg = load_eagle3_config(ckpt, target_num_layers=dims.num_layers)
    with engine_transaction(engine_dir) as txn:
        m = load_manifest(engine_dir, verify=False)
        dims = m.graphs["target"].spec.dims
        feature_columns(dims.feature_layers, cfg.target_layer_ids, dims.hidden_size)  # refuses missing layers
        width = cfg.feature_size // len(cfg.target_layer_ids)
        if width != dims.hidden_size or cfg.vocab_size != dims.vocab_size:
            raise DSparkError(f"the EAGLE-3 drafter {ckpt} fuses target states {width} wide over a vocabulary of "
                              f"{cfg.vocab_size}, but the engine's target has hidden size {dims.hidden_size} and "
                              f"vocabulary {dims.vocab_size}: it was trained for another target; add it to an engine "
                              "of its own target")
        if precision == "auto":
            precision = "int4" if m.graphs["target"].precision == "int4" else "fp32"
        if precision not in DSPARK_PRECISIONS:
            raise DSparkError(f"the EAGLE-3 drafter graph can be {', '.join(DSPARK_PRECISIONS)} (weight-only, no "
                              f"calibration), not {precision!r}")
        m.graphs.pop(ROLE, None)
        out = txn.stage
        export_role = ROLE if precision == "fp32" else f"{ROLE}.fp32"
        target_emb = target_embedding_entry(engine_dir, m.graphs["target"].model_file)
        log(f"[{ROLE}] exporting EAGLE-3 drafter {ckpt} -> {ROLE}.onnx")
        if isolate:
            result = out / f"{ROLE}.export.json"
            args = json.dumps({"checkpoint": str(ckpt), "out_dir": str(out), "role": export_role,
                               "target_embedding": target_emb, "target_root": str(engine_dir),
                               "target_num_layers": dims.num_layers})
            proc = subprocess.run([sys.executable, "-m", "dspark_export.drafter.eagle3_graph", args, str(result)])
            if proc.returncode != 0 or not result.is_file():
                raise DSparkError(f"exporting the EAGLE-3 drafter {ckpt} failed (exit {proc.returncode})")
            res = json.loads(result.read_text())
            result.unlink()
        else:
            res = export_eagle3(ckpt, out, export_role, target_emb, engine_dir, dims.num_layers)
        v = res["validation"]["fp32"]
        log(f"[{ROLE}] graph vs torch: max |dlogits| {v['max_abs_logit_diff']:.2e}, argmax agreement "
            f"{v['argmax_agreement']:.0%}")
        emb, vocab_file = res["embedding"], res.get("draft_vocab")
        spec = GraphSpec.from_json(res["spec"])
        vocab = None if vocab_file is None else DraftVocab(np.load(out / vocab_file), dims.vocab_size, vocab_file)
        quant = None
        if precision != "fp32":
            src, dst = out / f"{export_role}.onnx", out / f"{ROLE}.onnx"
            log(f"[{ROLE}] fp32 -> {precision}")
            quant = quantize_graph(src, dst, precision, int4_source="rtn", log=log)
            rows = EmbeddingRows.from_manifest(out if emb["file"] == EMBED_FILE else engine_dir, emb)
            agree = compare_eagle3_graphs(src, dst, spec, rows, vocab=vocab)
            res["validation"][precision] = {"reference": "fp32 graph", **agree}
            log(f"[{ROLE}] {precision} vs fp32 on random features: argmax agreement "
                f"{agree['argmax_agreement']:.0%}, max |dlogits| {agree['max_abs_logit_diff']:.2f}")
            for f in (src, src.with_name(src.name + ".data")):
                f.unlink(missing_ok=True)
        log(f"[{ROLE}] token embedding rows: " + (f"the target graph's own table ({emb['file']}), no copy"
                                                 if emb["file"] != EMBED_FILE else
                                                 f"{EMBED_FILE} (the checkpoint's table differs from the target "
                                                 "graph's, or the target holds none readable)"))
        files = [FileEntry.of(out, f"{ROLE}.onnx"), FileEntry.of(out, f"{ROLE}.onnx.data")]
        if emb["file"] == EMBED_FILE:
            files.append(FileEntry.of(out, EMBED_FILE))
        if vocab_file is not None:
            files.append(FileEntry.of(out, vocab_file))
            log(f"[{ROLE}] draft vocabulary: {len(vocab.ids)} of the target's {dims.vocab_size} tokens ({vocab_file})")
        m.graphs[ROLE] = GraphEntry(role=ROLE, model_id=f"eagle3:{ckpt}", format="onnx", precision=precision,
                                    files=files, spec=spec, validation=res["validation"], model_config=res["config"])
        if quant is not None:
            m.graphs[ROLE].quantization = quant
        section = {"graph": ROLE, "target_layer_ids": list(cfg.target_layer_ids), "ttt_length": cfg.ttt_length,
                   "embedding": emb}
        if vocab_file is not None:
            section["draft_vocab_file"] = vocab_file
        m.speculation.eagle3 = Eagle3Section.from_json(section)
        commit_manifest(txn, m)
    return m
