"""``dspark-export quantize``: a quantized copy of a built fp32 engine without re-exporting (:func:`quantize_engine`),
and the teacher-forced agreement of two decoders that checks it (:func:`logit_agreement`).

Each quantized graph is made by :func:`dspark_export.precision.quantizers.quantize_graph` (static QDQ calibrated by
:mod:`dspark_export.precision.activation_ranges` and written by :mod:`dspark_export.precision.qdq`, int4, fp8 or
int8-dynamic). Invariants: the source engine is never modified (unchanged files are hard-linked into the new
directory); only fp32 growing-layout decoder graphs are quantized; measurements tied to the source's graphs (row
padding, cost table) are dropped, to be profiled again on the new engine.
"""
from __future__ import annotations

import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from dspark_runtime.backends.ort import OrtDecoder
from dspark_runtime.engine_dir.manifest import FileEntry, load_manifest
from dspark_runtime.engine_dir.tokenizer import Tokenizer
from dspark_runtime.errors import DSparkError

from dspark_export.engine_dir.build import VALIDATION_TEXT, Recipe
from dspark_export.engine_dir.commit import build_machine, tool_versions, write_manifest
from dspark_export.models.catalog import resolve_model
from dspark_export.precision.activation_ranges import calibration_token_ids
from dspark_export.precision.fp8 import check_fp8_writer
from dspark_export.precision.quantizers import CALIBRATED, PRECISIONS, quantize_graph, resolve_int4_source

# ------------------------------------------------------------------------------------------ agreement
def logit_agreement(ref, cand, token_lists: list, verify_len: int = 8) -> dict:
    """Teacher-forced agreement of two decoders (e.g. an fp32 graph and its int8 copy) on prompts.

    ``ref``/``cand``: :class:`~dspark_runtime.backends.ort.OrtDecoder` of the same graph interface. They are
    run one after the other — the reference over every prompt, then its session is released
    (``deactivate``), then the candidate — so only one graph's weights are in memory at a time; the
    reference's logits are kept (prompt length × vocabulary × 4 bytes per prompt).
    Per prompt: both prefill the prompt (past 0, every position compared), then both verify the same
    chunk — the reference's greedy continuation of ``verify_len`` tokens — on their own caches.
    Returns {"prefill"|"verify": {"top1_agreement": fraction of positions whose argmax is equal,
    "max_abs_logit_diff", "rel_l2": mean over positions of ||l_c - l_r||_2 / ||l_r||_2, "positions"}}.
    """

    def run(dec, ids, cont=None):
        n = len(ids)
        x = np.asarray([ids], np.int64)
        pre = dec.step(x, np.arange(n, dtype=np.int64)[None], np.tril(np.ones((n, n), bool))[None, None],
                       dec.empty_kv(1))
        if cont is None:  # the reference's greedy continuation, q = 1 steps
            cont, last, kv = [], pre.logits[0, -1], pre.kv
            for _ in range(verify_len):
                cont.append(int(np.argmax(last)))
                m1 = np.ones((1, 1, 1, n + len(cont)), bool)
                o = dec.step(np.asarray([[cont[-1]]]), np.asarray([[n + len(cont) - 1]]), m1, kv)
                last, kv = o.logits[0, -1], o.kv
        v = len(cont)
        ver = dec.step(np.asarray([cont], np.int64), np.arange(n, n + v, dtype=np.int64)[None],
                       np.tril(np.ones((v, n + v), bool), k=n)[None, None], pre.kv)
        return pre.logits[0], ver.logits[0], cont

    ref.activate()
    recorded = [run(ref, ids) for ids in token_lists]
    if cand is not ref:
        ref.deactivate()
    cand.activate()
    acc = {k: {"agree": 0, "n": 0, "maxd": 0.0, "rel": 0.0} for k in ("prefill", "verify")}
    for ids, (r_pre, r_ver, cont) in zip(token_lists, recorded):
        c_pre, c_ver, _ = run(cand, ids, cont)
        for kind, a, b in (("prefill", r_pre, c_pre), ("verify", r_ver, c_ver)):
            s = acc[kind]
            s["agree"] += int((a.argmax(-1) == b.argmax(-1)).sum())
            s["n"] += a.shape[0]
            s["maxd"] = max(s["maxd"], float(np.abs(a - b).max()))
            s["rel"] += float((np.linalg.norm(b - a, axis=-1) / np.linalg.norm(a, axis=-1)).sum())
    return {k: {"top1_agreement": s["agree"] / s["n"], "max_abs_logit_diff": s["maxd"], "rel_l2": s["rel"] / s["n"],
                "positions": s["n"]} for k, s in acc.items()}


# ------------------------------------------------------------------------------------------- engines
def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (same file system; no extra disk), else copy it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst.unlink()
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def quantize_engine(src_dir: Path, out_dir: Path, precision: str, *, calibration_prompts: int = 16,
                    tables: dict | None = None, exclude=None, fp8_writer: str = "auto", int4_source: str = "auto",
                    lm_head: str = "auto", log=print):
    """Write ``out_dir``: a copy of the built engine ``src_dir`` whose graphs have the precisions of
    ``precision`` (as ``dspark-export build --precision``: one for all, or ``target=int8,draft=int8``).

    Graphs kept as they are, the tokenizer and other files are hard-linked (copied across file systems);
    the source engine is never modified. Each quantized graph is calibrated on the calibration split
    (or takes ``tables[role]``, a :class:`CalibrationTable` from ``calibrate-quant``), quantized
    one weight at a time, and checked against its fp32 graph on the validation prompt
    (``validation[precision]``: top-1 agreement, max |Δlogits|, relative L2 at prefill and verify).
    ``fp8_writer``: ``"auto"`` | ``"modelopt"`` | ``"stream"`` for fp8 graphs (see
    :func:`dspark_export.precision.quantizers.quantize_graph`; the record's ``"writer"`` says which one ran).
    ``int4_source``: ``"auto"`` | ``"gguf"`` | ``"rtn"`` | ``"hqq"`` for int4 graphs, one for all or per graph
    (``"target=gguf,draft=rtn"``; see :func:`dspark_export.precision.quantizers.resolve_int4_source`: the GGUF is
    found from the graph's fetched model). ``lm_head``: ``"auto"`` | ``"screened"`` | ``"full"`` for int4 graphs
    (:func:`dspark_export.precision.nbits_head.resolve_lm_head`).
    Returns the new Manifest. Raises DSparkError when ``out_dir`` is ``src_dir`` or a non-empty
    directory, when a graph to quantize is not fp32 or not a decoder (``causal_lm``), for a bad spec
    or an unknown fp8 writer.
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    recipe = Recipe(name="-", target="-", precision=precision, calibration_prompts=calibration_prompts,
                    int4_source=int4_source, lm_head=lm_head)
    recipe.validate()
    check_fp8_writer(fp8_writer)
    if out_dir.resolve() == src_dir.resolve():
        raise DSparkError("write the quantized engine to a new directory (-o NEW_DIR); the source engine is kept")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise DSparkError(f"{out_dir} exists and is not empty; pick a new directory or remove it")
    m = load_manifest(src_dir)
    plan = {}
    for role in ("target", "draft"):
        want = recipe.precision_for(role)
        g = m.graphs.get(role)
        if g is None or want == g.precision:
            continue
        if want not in PRECISIONS or want == "fp32":
            raise DSparkError(f"cannot turn the {g.precision} {role} graph into {want}; start from an fp32 engine")
        if g.precision != "fp32" or g.spec.kind != "causal_lm":
            raise DSparkError(f"the {role} graph is {g.precision} {g.spec.kind}; only fp32 decoder graphs "
                              "(causal_lm) can be quantized: start from an fp32 engine")
        if g.spec.kv_layout != "growing":
            raise DSparkError(f"the {role} graph has the {g.spec.kv_layout} KV layout; `dspark-export quantize` "
                              "calibrates and compares growing-layout graphs: build the quantized engine directly "
                              "(`dspark-export build --precision int4`), or start from an engine built with "
                              "`--kv-layout growing`")
        plan[role] = want
    if not plan:
        raise DSparkError(f"nothing to do: {src_dir} already has precision {precision!r} for every graph it holds")
    for key in ("row_invariance", "cost_table"):  # measured on the source's graphs: re-profile the new engine
        if getattr(m.speculation, key) is not None:
            setattr(m.speculation, key, None)
            log(f"  dropped speculation.{key} (measured on the source engine's graphs); run `dspark-export profile "
                f"{out_dir}` on the deployment machine")
    tok = Tokenizer(src_dir / m.tokenizer["dir"])
    calib_ids = None
    if any(p == "fp8" or (p in CALIBRATED and not (tables or {}).get(r)) for r, p in plan.items()):
        calib_ids = calibration_token_ids(tok, calibration_prompts)
    val_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": VALIDATION_TEXT}])
                         if tok.chat_template else VALIDATION_TEXT)
    out_dir.mkdir(parents=True, exist_ok=True)
    quantized_files = {f"{r}.onnx" for r in plan} | {f"{r}.onnx.data" for r in plan}
    for f in m.all_files():
        if f.path not in quantized_files:
            _link_or_copy(src_dir / f.path, out_dir / f.path)
    for extra in ("calibration.json",):
        if (src_dir / extra).is_file():
            _link_or_copy(src_dir / extra, out_dir / extra)
    for role, prec in plan.items():
        g = m.graphs[role]
        src = src_dir / g.model_file
        dst = out_dir / f"{role}.onnx"
        log(f"[{role}] {g.precision} -> {prec}: {src} -> {dst}")
        source, gguf = "rtn", None
        if prec == "int4":
            try:
                mdir = resolve_model(g.model_id)
            except DSparkError:
                mdir = None  # a model that is not fetched here: float weights only
            source, gguf, why = resolve_int4_source(recipe.int4_source_for(role), role, mdir)
            log(f"[{role}] int4 weights from {source} ({why})")
        q = quantize_graph(src, dst, prec, spec=g.spec, calibration_ids=calib_ids,
                           table=(tables or {}).get(role), exclude=exclude, fp8_writer=fp8_writer,
                           int4_source=source, gguf=gguf, lm_head=recipe.lm_head,
                           max_positions=g.model_config.get("max_position_embeddings"), log=log)
        cand = OrtDecoder(dst, g.spec)
        agree = logit_agreement(OrtDecoder(src, g.spec), cand, [val_ids], verify_len=5)  # one graph at a time
        cand.deactivate()
        log(f"[{role}] {prec} vs fp32 on the validation prompt: top-1 agreement prefill "
            f"{agree['prefill']['top1_agreement']:.0%} / verify {agree['verify']['top1_agreement']:.0%}, "
            f"max |dlogits| {agree['prefill']['max_abs_logit_diff']:.2f} / {agree['verify']['max_abs_logit_diff']:.2f}")
        g.precision = prec
        g.files = [FileEntry.of(out_dir, f"{role}.onnx"), FileEntry.of(out_dir, f"{role}.onnx.data")]
        g.validation = {**g.validation, prec: {"reference": "fp32 graph", **agree}}
        g.quantization = {**q, "source": {"engine": str(src_dir), "graph_sha256": next(
            f.sha256 for f in m.all_files() if f.path == g.model_file)}}
    ds = m.speculation.dspark
    if ds is not None and ds.embedding is not None and ds.embedding["file"] in quantized_files:
        from dspark_export.drafter.graph import relocate_embedding

        relocate_embedding(src_dir, out_dir, m, log)
    m.name = out_dir.name  # a new engine: named after its directory, as `build` names it
    m.tool_versions = tool_versions()
    m.build_machine = build_machine()  # the graphs and their validation figures are this machine's
    m.created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    write_manifest(m, out_dir)
    log(f"wrote {out_dir}")
    return m
