"""``dspark-export build``: export the target (verifier) and draft graphs, validate them against torch, quantize
them to the recipe's precisions, copy the tokenizer and write ``<engine_dir>/manifest.json``.

A :class:`Recipe` (a packaged ``dspark_export/recipes/*.json`` or a file of one's own) names the models (fetched
names or Hugging Face folders) and settings. Each graph is exported in its own subprocess by default, so only one
model is in memory at a time. Over an existing engine directory the build is a transaction
(:func:`dspark_export.engine_dir.transaction.engine_transaction`): the old engine is replaced only when everything
succeeded; on any error, Ctrl-C included, the directory is left as it was.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dspark_runtime.engine_dir.graphspec import KV_LAYOUT_GROWING, KV_LAYOUT_SCATTER, GraphSpec
from dspark_runtime.engine_dir.manifest import SCHEMA_VERSION, FileEntry, GraphEntry, Manifest
from dspark_runtime.engine_dir.speculation import Speculation
from dspark_runtime.engine_dir.tokenizer import Tokenizer
from dspark_runtime.errors import DSparkError

from dspark_export.engine_dir.add_draft import DSPARK_PRECISIONS, add_dspark_into, dspark_checkpoint
from dspark_export.engine_dir.commit import build_machine, commit_manifest, tool_versions
from dspark_export.engine_dir.transaction import engine_transaction
from dspark_export.models.catalog import resolve_model
from dspark_export.precision.activation_ranges import calibration_token_ids
from dspark_export.precision.fp8 import check_fp8_writer
from dspark_export.precision.nbits import INT4_SOURCES
from dspark_export.precision.nbits_head import LM_HEADS
from dspark_export.precision.quantizers import CALIBRATED, PRECISIONS, quantize_graph, resolve_int4_source

SCATTER_PRECISIONS = ("fp32", "int4", "int8-dynamic")  # precisions a scatter-layout graph is built in
AUTO_SCATTER_PRECISIONS = ("int4", "int8-dynamic")  # kv_layout "auto" picks scatter when every graph is one of these
ROLES = ("target", "draft")
VALIDATION_TEXT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


@dataclass
class Recipe:
    """What to build. ``target``/``draft``: fetched model names or HF folders."""

    name: str
    target: str
    draft: str | None = None
    precision: str = "fp32"  # one for all graphs, or per graph: "target=fp32,draft=int8-dynamic"
    target_feature_layers: list = field(default_factory=list)
    draft_length: int = 5
    calibration_prompts: int = 16  # calibration-split prompts for static quantization (int8, int8-trt)
    # int4 weights: "auto" | "gguf" | "rtn" | "hqq", one for all graphs or per graph ("target=gguf,draft=rtn")
    int4_source: str = "auto"
    # KV layout of the decoder graphs: "auto" | "growing" | "scatter" (one batch row per request: a request's output
    # does not depend on its batch; ONNX Runtime fp32 / int4 / int8-dynamic only, see dspark_runtime.engine_dir.graphspec).
    # auto (resolved by validate()): scatter when every graph is int4 or int8-dynamic — the CPU deployment, which
    # nothing is built from afterwards — growing otherwise (fp32 engines are what `quantize` and `build-trt` start
    # from, and static int8 / int8-trt / fp8 calibrate and run growing graphs)
    kv_layout: str = "auto"
    # int4 graphs' LM head: "auto" | "screened" | "full" (dspark_export.precision.nbits_head.resolve_lm_head)
    lm_head: str = "auto"

    @staticmethod
    def from_file(path: str | Path) -> "Recipe":
        path = Path(path)
        if not path.is_file():
            raise DSparkError(f"recipe {path} not found; `dspark-export list-recipes` shows the packaged ones (dspark_export/recipes/*.json)")
        try:
            d = json.loads(path.read_text())
            return Recipe(**d)
        except (ValueError, TypeError) as e:
            raise DSparkError(f"recipe {path} is invalid ({e}); fields: name, target, draft, precision, "
                              "target_feature_layers, draft_length, calibration_prompts, int4_source, "
                              "kv_layout, lm_head") from e

    def precision_for(self, role: str) -> str:
        """The precision of graph ``role`` ("target" or "draft"); raises DSparkError on a bad spec."""
        choice = per_role(self.precision, role, "fp32", "precision", "target=int8,draft=fp32")
        if choice not in PRECISIONS:
            raise DSparkError(f"precision {choice!r} is not supported; choose one of {', '.join(PRECISIONS)}")
        return choice

    def int4_source_for(self, role: str) -> str:
        """The int4 weight source of graph ``role``: auto | gguf | rtn | hqq (see :func:`resolve_int4_source`)."""
        choice = per_role(self.int4_source, role, "auto", "int4_source", "target=gguf,draft=rtn")
        if choice not in INT4_SOURCES:
            raise DSparkError(f"int4 source {choice!r} is not supported; choose one of {', '.join(INT4_SOURCES)}")
        return choice

    def validate(self) -> None:
        """Check every field; resolves ``kv_layout`` "auto" to the layout the precisions allow. Raises DSparkError."""
        if self.kv_layout not in ("auto", KV_LAYOUT_GROWING, KV_LAYOUT_SCATTER):
            raise DSparkError(f"kv_layout {self.kv_layout!r} is not supported; choose auto, growing or scatter")
        if self.kv_layout == "auto":
            ok = all(self.precision_for(r) in AUTO_SCATTER_PRECISIONS for r in ROLES)
            self.kv_layout = KV_LAYOUT_SCATTER if ok else KV_LAYOUT_GROWING
        for role in ROLES:
            p = self.precision_for(role)
            self.int4_source_for(role)
            if self.kv_layout == KV_LAYOUT_SCATTER and p not in SCATTER_PRECISIONS:
                raise DSparkError(f"the {role} graph is {p}, which needs the growing KV layout (its calibration and "
                                  "TensorRT paths run growing graphs); use kv_layout growing, or precision "
                                  f"{' / '.join(SCATTER_PRECISIONS)} with scatter")
        if self.lm_head not in LM_HEADS:
            raise DSparkError(f"lm_head {self.lm_head!r} is not supported; choose one of {', '.join(LM_HEADS)}")
        if not isinstance(self.draft_length, int) or self.draft_length < 1:
            raise DSparkError(f"draft_length must be a positive integer, got {self.draft_length!r}")
        if not isinstance(self.calibration_prompts, int) or self.calibration_prompts < 1:
            raise DSparkError(f"calibration_prompts must be a positive integer, got {self.calibration_prompts!r}")


def per_role(spec, role: str, default: str, what: str, example: str) -> str:
    """The value for graph ``role`` of a setting written once for all graphs (``"int8"``) or per graph
    (``"target=int8,draft=fp32"``; roles not named get ``default``). Raises DSparkError on a malformed spec."""
    spec = str(spec).strip()
    if "=" not in spec:
        return spec
    per = {}
    for item in spec.split(","):
        k, sep, v = item.partition("=")
        if not sep or k.strip() not in ROLES:
            raise DSparkError(f"{what} {spec!r}: write one value, or role=value pairs such as {example!r}")
        per[k.strip()] = v.strip()
    return per.get(role, default)


def export_graph(model_dir: Path, out_path: Path, feature_layers, validation_ids, precision: str = "fp32",
                 calibration_ids=None, fp8_writer: str = "auto", int4_source: str = "rtn", gguf=None,
                 kv_layout: str = KV_LAYOUT_GROWING, lm_head: str = "auto") -> dict:
    """Export + validate one decoder graph in this process. Returns {"spec", "validation", "config",
    "quantization"}.

    The torch reference is computed first and the model freed before ONNX Runtime loads the
    graph, so only one copy of the weights is in memory at a time. ``calibration_ids``: token-id lists
    of calibration-split prompts, needed for ``int8``/``int8-trt``/``fp8``. ``fp8_writer``: see
    :func:`quantize_graph`.
    """
    import gc

    from dspark_export.graphs.decoder import decoder_dims, export_decoder, load_hf_model, torch_reference, validate_decoder

    model = load_hf_model(model_dir)
    dims = decoder_dims(model.config, feature_layers)
    ref = torch_reference(model, dims, validation_ids)
    spec = export_decoder(model, dims, out_path, kv_layout=kv_layout)
    cfg = model.config.to_dict()
    del model
    gc.collect()
    # validation: {precision: report}, always with the fp32 graph's strict check
    quantization = {}
    if precision == "fp32":
        validation = {"fp32": validate_decoder(ref, dims, out_path, kv_layout=kv_layout).to_json()}
    else:
        fp32_path = out_path.with_name(out_path.stem + ".fp32.onnx")
        _move_graph(out_path, fp32_path)
        validation = {"fp32": validate_decoder(ref, dims, fp32_path, kv_layout=kv_layout).to_json()}
        quantization = quantize_graph(fp32_path, out_path, precision, spec=spec, calibration_ids=calibration_ids,
                                      fp8_writer=fp8_writer, int4_source=int4_source, gguf=gguf, lm_head=lm_head,
                                      max_positions=cfg.get("max_position_embeddings"))
        for p in (fp32_path, fp32_path.with_name(fp32_path.name + ".data")):
            p.unlink()
        if quantization.get("kernels"):  # its MatMulGGUF nodes run on DSpark's kernels, placed beside it
            spec = dataclasses.replace(spec, kernels=quantization["kernels"])
        # quantized graphs are not expected to match torch exactly: record the agreement
        validation[precision] = validate_decoder(ref, dims, out_path, strict=False, kv_layout=kv_layout,
                                                 kernels=spec.kernels).to_json()
    keep = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "rope_theta", "rope_parameters", "max_position_embeddings",
            "tie_word_embeddings", "torch_dtype", "dtype")
    return {"spec": spec.to_json(), "validation": validation, "config": {k: cfg[k] for k in keep if k in cfg},
            "quantization": quantization}


def _move_graph(src: Path, dst: Path) -> None:
    """Rename an ONNX graph and its external-data file, updating the graph's data reference."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    new_loc = dst.name + ".data"
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = new_loc
    (src.with_name(src.name + ".data")).rename(dst.with_name(new_loc))
    onnx.save_model(model, str(dst))
    src.unlink()


def _export_graph_isolated(model_dir: Path, out_path: Path, feature_layers, validation_ids,
                           precision: str = "fp32", calibration_ids=None, fp8_writer: str = "auto",
                           int4_source: str = "rtn", gguf=None, kv_layout: str = KV_LAYOUT_GROWING,
                           lm_head: str = "auto") -> dict:
    """Run :func:`export_graph` in a fresh Python process (bounds peak memory to one model)."""
    args = json.dumps({"model_dir": str(model_dir), "out_path": str(out_path),
                       "feature_layers": list(feature_layers), "validation_ids": list(validation_ids),
                       "precision": precision, "calibration_ids": calibration_ids, "fp8_writer": fp8_writer,
                       "int4_source": int4_source, "gguf": None if gguf is None else str(gguf),
                       "kv_layout": kv_layout, "lm_head": lm_head})
    result_path = out_path.with_suffix(".export.json")
    proc = subprocess.run([sys.executable, "-m", "dspark_export.engine_dir.build", args, str(result_path)])
    if proc.returncode != 0 or not result_path.is_file():
        raise DSparkError(f"exporting {model_dir} failed (exit {proc.returncode}); see the messages above")
    res = json.loads(result_path.read_text())
    result_path.unlink()
    return res


def _copy_tokenizer(model_dir: Path, out_dir: Path) -> dict:
    tok_dir = out_dir / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        if (model_dir / f).is_file():
            shutil.copy2(model_dir / f, tok_dir / f)
    if not (tok_dir / "tokenizer.json").is_file():
        raise DSparkError(f"{model_dir} has no tokenizer.json; the runtime needs a fast tokenizer")
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text()) if (tok_dir / "tokenizer_config.json").is_file() else {}
    if not (tok_dir / "chat_template.jinja").is_file() and isinstance(cfg.get("chat_template"), str):
        (tok_dir / "chat_template.jinja").write_text(cfg["chat_template"])
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = []
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        eos += e if isinstance(e, list) else ([e] if e is not None else [])
    if isinstance(cfg.get("eos_token"), str) and tok.token_to_id(cfg["eos_token"]) is not None:
        eos.append(tok.token_to_id(cfg["eos_token"]))
    eos = sorted(set(int(i) for i in eos))
    if not eos:
        raise DSparkError(f"{model_dir}: no EOS token id in generation_config.json or tokenizer_config.json")
    files = sorted(p.name for p in tok_dir.iterdir() if p.is_file())
    return {"dir": "tokenizer", "files": [FileEntry.of(out_dir, f"tokenizer/{f}") for f in files],
            "eos_token_ids": eos,
            "chat_template": "tokenizer/chat_template.jinja" if (tok_dir / "chat_template.jinja").is_file() else None}


def _check_same_vocab(target_dir: Path, draft_dir: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    a = HFTokenizer.from_file(str(target_dir / "tokenizer.json")).get_vocab()
    b = HFTokenizer.from_file(str(draft_dir / "tokenizer.json")).get_vocab()
    if a != b:
        raise DSparkError(f"the draft {draft_dir} and the target {target_dir} have different vocabularies; "
                          "a draft LM must share the target's tokenizer")


def build_engine(recipe: Recipe, out_dir: Path, isolate: bool = True, log=print,
                 fp8_writer: str = "auto") -> Manifest:
    """Build ``out_dir`` from ``recipe``: graphs, tokenizer, manifest. Returns the Manifest.

    ``isolate``: export each graph in its own process (default; keeps one model in memory).
    ``fp8_writer``: ``"auto"`` | ``"modelopt"`` | ``"stream"`` for fp8 graphs (see :func:`quantize_graph`).
    Over an existing engine directory this is a transaction (:func:`dspark_export.engine_dir.transaction.engine_transaction`):
    the new engine is written beside the old one, which it replaces only once complete (the old engine's files
    that the new manifest does not list are then deleted; other files are kept). A new directory is removed
    again when the build fails.
    Raises DSparkError on any failure (missing model, unknown fp8 writer, export or validation failure, a full
    disk); the directory is then as it was.
    """
    recipe.validate()
    check_fp8_writer(fp8_writer)
    out_dir = Path(out_dir)
    target_dir = resolve_model(recipe.target)
    dspark_ckpt = dspark_checkpoint(recipe.draft)
    draft_dir = resolve_model(recipe.draft) if recipe.draft and dspark_ckpt is None else None
    if draft_dir is not None:
        _check_same_vocab(target_dir, draft_dir)
    if dspark_ckpt is not None:
        from dspark_export.drafter.config import load_config  # torch: only for a DSpark drafter

        ids = load_config(dspark_ckpt).target_layer_ids
        if recipe.target_feature_layers and list(recipe.target_feature_layers) != list(ids):
            raise DSparkError(f"target_feature_layers {recipe.target_feature_layers} differ from the DSpark "
                              f"drafter's target_layer_ids {ids}; drop the field or make them equal")
        recipe.target_feature_layers = list(ids)
    t0 = time.perf_counter()
    with engine_transaction(out_dir) as txn:  # an existing engine stays as it was unless this succeeds
        manifest = _build_into(txn.stage, out_dir, recipe, target_dir, draft_dir, dspark_ckpt, isolate, log,
                               fp8_writer)
        commit_manifest(txn, manifest)
    log(f"built {out_dir} in {time.perf_counter() - t0:.0f}s")
    return manifest


def _build_into(stage: Path, out_dir: Path, recipe: Recipe, target_dir: Path, draft_dir, dspark_ckpt, isolate: bool,
                log, fp8_writer: str) -> Manifest:
    """Write every file of the engine ``recipe`` describes into ``stage`` (an empty folder; the files move to
    ``out_dir`` at commit) and return its Manifest."""
    tokenizer = _copy_tokenizer(target_dir, stage)
    tok = Tokenizer(stage / "tokenizer")
    val_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": VALIDATION_TEXT}])
                         if tok.chat_template else VALIDATION_TEXT)
    calib_ids = None
    if any(recipe.precision_for(r) in CALIBRATED for r in ROLES):
        calib_ids = calibration_token_ids(tok, recipe.calibration_prompts)
    graphs = {}
    jobs = [("target", target_dir, recipe.target_feature_layers)]
    if draft_dir is not None:
        jobs.append(("draft", draft_dir, []))
    for role, mdir, feats in jobs:
        log(f"[{role}] exporting {mdir} -> {out_dir / (role + '.onnx')}")
        fn = _export_graph_isolated if isolate else export_graph
        precision = recipe.precision_for(role)
        source, gguf = "rtn", None
        if precision == "int4":
            source, gguf, why = resolve_int4_source(recipe.int4_source_for(role), role, mdir)
            log(f"[{role}] int4 weights from {source} ({why})")
        res = fn(mdir, stage / f"{role}.onnx", feats, val_ids, precision,
                 calib_ids if precision in CALIBRATED else None, fp8_writer, source, gguf, recipe.kv_layout,
                 recipe.lm_head)
        for prec, v in res["validation"].items():
            log(f"[{role}] {prec} graph vs torch: max |dlogits| prefill {v['prefill_max_abs_logit_diff']:.2e}, "
                f"verify {v['verify_max_abs_logit_diff']:.2e}; argmax agreement "
                f"{v['prefill_argmax_agreement']:.0%} / {v['verify_argmax_agreement']:.0%}")
        log(f"[{role}] hashing files")
        spec = GraphSpec.from_json(res["spec"])
        files = [FileEntry.of(stage, f"{role}.onnx"), FileEntry.of(stage, f"{role}.onnx.data")]
        if spec.kernels:
            files.append(FileEntry.of(stage, spec.kernels))
        graphs[role] = GraphEntry(role=role, model_id=str(recipe.target if role == "target" else recipe.draft),
                                  format="onnx", precision=precision, files=files,
                                  spec=spec, validation=res["validation"],
                                  model_config=res["config"], quantization=res.get("quantization", {}))
    manifest = Manifest(
        name=recipe.name, graphs=graphs, tokenizer=tokenizer,
        speculation=Speculation(draft_graph="draft" if draft_dir else None, draft_length=recipe.draft_length),
        tool_versions=tool_versions(), created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        schema_version=SCHEMA_VERSION, build_machine=build_machine())
    if dspark_ckpt is not None:
        prec = recipe.precision_for("draft")
        if prec not in DSPARK_PRECISIONS:
            log(f"[draft] a DSpark drafter graph is weight-only quantized ({', '.join(DSPARK_PRECISIONS)}); "
                f"{prec} -> fp32")
            prec = "fp32"
        add_dspark_into(manifest, stage, dspark_ckpt, target_dir, recipe.draft, isolate, log, precision=prec)
    return manifest


if __name__ == "__main__":  # worker for _export_graph_isolated
    a = json.loads(sys.argv[1])
    try:
        r = export_graph(Path(a["model_dir"]), Path(a["out_path"]), a["feature_layers"], a["validation_ids"],
                         a.get("precision", "fp32"), a.get("calibration_ids"), a.get("fp8_writer", "auto"),
                         a.get("int4_source", "rtn"), a.get("gguf"), a.get("kv_layout", KV_LAYOUT_GROWING),
                         a.get("lm_head", "auto"))
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    Path(sys.argv[2]).write_text(json.dumps(r))
