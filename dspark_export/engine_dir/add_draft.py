"""The DSpark drafter in an engine: export a DSpark checkpoint into an engine directory and record it in the manifest
(``dspark-export build --draft dspark:<checkpoint>`` and ``dspark-export add-draft``).

The drafter graph is exported in its own subprocess by default (``dspark_export.drafter.graph``), validated against
torch, and recorded as graph ``draft`` (the engine's only drafter) or ``dspark`` (beside a draft LM), with its
heads file, block size, mask token, target feature layers and, when the checkpoint folder has them
(``sts.json``, written by ``dspark-export calibrate``), its STS temperatures and the router's priors.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dspark_runtime.drafting.embedding_rows import EmbeddingRows
from dspark_runtime.engine_dir.graphspec import GraphSpec
from dspark_runtime.engine_dir.manifest import FileEntry, GraphEntry, Manifest, load_manifest
from dspark_runtime.engine_dir.speculation import DSparkSection
from dspark_runtime.errors import DSparkError

from dspark_export.engine_dir.commit import commit_manifest
from dspark_export.engine_dir.transaction import engine_transaction
from dspark_export.models.catalog import resolve_model
from dspark_export.paths import repo_root
from dspark_export.precision.quantizers import quantize_graph

DSPARK_PRECISIONS = ("fp32", "int4", "int8-dynamic")  # the drafter graph's weights (weight-only: no calibration)


def dspark_checkpoint(draft: str | None) -> Path | None:
    """The checkpoint folder of a ``dspark:<folder>`` draft spec, or None for other drafts.

    Raises DSparkError when the folder holds no DeepSpec-layout config.json.
    """
    if not draft or not str(draft).startswith("dspark:"):
        return None
    p = Path(str(draft)[len("dspark:"):]).expanduser()
    if not p.is_absolute() and not p.exists():
        p = repo_root() / p
    if not (p / "config.json").is_file():
        raise DSparkError(f"DSpark checkpoint {p} not found (no config.json); train one with "
                          "`dspark-export train-draft` or pass a DeepSpec checkpoint folder")
    return p


def add_dspark_into(manifest: Manifest, out_dir: Path, ckpt: Path, target_dir: Path, model_id: str,
                    isolate: bool, log, role: str = "draft", target_root: Path | None = None,
                    precision: str = "fp32") -> None:
    """Export the DSpark drafter ``ckpt`` into ``out_dir`` and record it in ``manifest`` as graph ``role``
    ("draft" when it is the engine's only drafter, "dspark" when added beside a draft LM). ``target_root``: the
    directory holding the manifest's target graph (default ``out_dir``); the drafter reads the anchor's embedding
    row from the target's own table there when it is a raw external tensor equal to the drafter's.
    ``precision``: the drafter graph's weights, "fp32" or weight-only "int4" (ONNX Runtime's MatMulNBits RTN, as
    the draft LM's) / "int8-dynamic"; a quantized graph is compared with the fp32 one (``validation[precision]``).
    Raises DSparkError for another precision."""
    from dspark_export.drafter.config import load_config  # torch
    from dspark_export.drafter.graph import (EMBED_FILE, HEADS_NAME, compare_draft_graphs, export_dspark,
                                             target_embedding_entry)

    if precision not in DSPARK_PRECISIONS:
        raise DSparkError(f"the DSpark drafter graph can be {', '.join(DSPARK_PRECISIONS)} (weight-only, no "
                          f"calibration), not {precision!r}")
    export_role = role if precision == "fp32" else f"{role}.fp32"
    feats = manifest.graphs["target"].spec.dims.feature_layers
    cfg = load_config(ckpt)
    if list(feats) != list(cfg.target_layer_ids):
        raise DSparkError(f"the target graph outputs features of layers {list(feats)} but the drafter needs "
                          f"{cfg.target_layer_ids}; rebuild the target with those feature layers")
    log(f"[{role}] exporting DSpark drafter {ckpt} -> {role}.onnx")
    target_root = Path(target_root or out_dir)
    target_emb = target_embedding_entry(target_root, manifest.graphs["target"].model_file)
    if isolate:
        result = out_dir / f"{role}.export.json"
        args = json.dumps({"checkpoint": str(ckpt), "target_dir": str(target_dir), "out_dir": str(out_dir),
                           "role": export_role, "target_embedding": target_emb,
                           "target_root": str(target_root)})
        proc = subprocess.run([sys.executable, "-m", "dspark_export.drafter.graph", args, str(result)])
        if proc.returncode != 0 or not result.is_file():
            raise DSparkError(f"exporting the DSpark drafter {ckpt} failed (exit {proc.returncode})")
        res = json.loads(result.read_text())
        result.unlink()
    else:
        res = export_dspark(ckpt, target_dir, out_dir, export_role, target_emb, target_root)
    v = res["validation"]["fp32"]
    log(f"[{role}] graph vs torch: max |dlogits| {v['max_abs_logit_diff']:.2e}, argmax agreement "
        f"{v['argmax_agreement']:.0%}")
    quant = None
    if precision != "fp32":
        src, dst = out_dir / f"{export_role}.onnx", out_dir / f"{role}.onnx"
        log(f"[{role}] fp32 -> {precision}")
        quant = quantize_graph(src, dst, precision, int4_source="rtn", log=log)
        emb_root = out_dir if res["embedding"]["file"] == EMBED_FILE else target_root
        agree = compare_draft_graphs(src, dst, GraphSpec.from_json(res["spec"]),
                                     EmbeddingRows.from_manifest(emb_root, res["embedding"]))
        res["validation"][precision] = {"reference": "fp32 graph", **agree}
        log(f"[{role}] {precision} vs fp32 on random features: argmax agreement {agree['argmax_agreement']:.0%}, "
            f"max |dlogits| {agree['max_abs_logit_diff']:.2f}")
        for f in (src, src.with_name(src.name + ".data")):
            f.unlink(missing_ok=True)
    emb = res["embedding"]
    log(f"[{role}] anchor embedding rows: " + ("the target graph's own table (" + emb["file"] + "), no copy"
                                              if emb["file"] != EMBED_FILE else
                                              f"{EMBED_FILE} (the checkpoint's table differs from the target graph's "
                                              "or the target holds none readable)"))
    files = [FileEntry.of(out_dir, f"{role}.onnx"), FileEntry.of(out_dir, f"{role}.onnx.data"),
             FileEntry.of(out_dir, HEADS_NAME)]
    if emb["file"] == EMBED_FILE:
        files.append(FileEntry.of(out_dir, EMBED_FILE))
    manifest.graphs[role] = GraphEntry(role=role, model_id=str(model_id), format="onnx", precision=precision,
                                       files=files, spec=GraphSpec.from_json(res["spec"]),
                                       validation=res["validation"], model_config=res["config"])
    if quant is not None:
        manifest.graphs[role].quantization = quant
    sts, router = None, None
    sts_file = ckpt / "sts.json"  # written by `dspark-export calibrate`: STS temperatures and the router's priors
    if sts_file.is_file():
        saved = json.loads(sts_file.read_text())
        sts, router = saved.get("temperatures"), saved.get("router")
    sp = manifest.speculation
    if router:
        sp.router = router
    if role == "draft":
        sp.draft_graph, sp.draft_kind, sp.draft_length = "draft", "dspark", int(cfg.block_size)
    sp.dspark = DSparkSection.from_json(  # checked like a manifest read; unknown heads keys kept in .extra
        {"graph": role, "heads_file": HEADS_NAME, **res["heads"], "block_size": cfg.block_size,
         "mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
         "draft_vocab_size": cfg.draft_vocab_size, "sts_temperatures": sts, "embedding": emb})


def add_dspark_draft(engine_dir: Path, ckpt: Path, target: str, isolate: bool = True, log=print,
                     precision: str = "auto") -> Manifest:
    """Add (or replace) the DSpark drafter of a built engine: graph ``dspark`` beside any draft LM, so one
    engine serves ``draft="dspark"``, ``"lm"`` and ``"ngram"``. The target graph is kept and must already
    output the drafter's ``target_layer_ids`` features. Returns the new Manifest.

    A transaction (:func:`dspark_export.engine_dir.transaction.engine_transaction`): the drafter is exported beside the old files
    and replaces them only when the export succeeded. Raises ManifestError for a directory that is not an
    engine, DSparkError when the target's feature layers differ from the drafter's or the export fails; the
    engine directory is then unchanged.
    """
    engine_dir = Path(engine_dir)
    load_manifest(engine_dir, verify=False)  # a clear error for a directory that is not an engine
    with engine_transaction(engine_dir) as txn:
        manifest = load_manifest(engine_dir, verify=False)
        old = manifest.speculation.dspark.graph if manifest.speculation.dspark is not None else None
        role = "draft" if old == "draft" else "dspark"  # the only drafter was a DSpark one: replace it
        manifest.graphs.pop(role, None)
        if precision == "auto":  # as the target: weight-only int4 beside an int4 target, else fp32
            precision = "int4" if manifest.graphs["target"].precision == "int4" else "fp32"
        add_dspark_into(manifest, txn.stage, ckpt, resolve_model(target), f"dspark:{ckpt}", isolate, log, role=role,
                        target_root=engine_dir, precision=precision)
        commit_manifest(txn, manifest)
    return manifest
