"""``dspark-export add-prompt-graph``: give a built int4 engine the integer-GEMM prompt graph of its target
(:mod:`dspark_export.precision.prompt_graph`), graph ``target_prompt`` (role "prompt"), on which the runtime runs
prompt chunks (:attr:`dspark_runtime.runners.scatter.ScatterRunner.prompt_backend`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from dspark_runtime.backends.ort import OrtDecoder
from dspark_runtime.engine_dir.manifest import PROMPT_GRAPH, FileEntry, GraphEntry, load_manifest
from dspark_runtime.engine_dir.tokenizer import Tokenizer
from dspark_runtime.errors import DSparkError
from dspark_runtime.machine.kernel_probe import u8s8_saturates
from dspark_runtime.runners.scatter import ScatterRunner

from dspark_export.engine_dir.transaction import engine_transaction
from dspark_export.precision.activation_ranges import CALIBRATION_NOTE, calibration_token_ids
from dspark_export.precision.prompt_graph import (OUTLIER_MOST, OUTLIER_RATIO, channel_maxima, integer_prompt_graph,
                                                  outlier_channels)

VALIDATION_TOKENS = 64  # one prompt chunk of random ids compared with the target graph's logits
CALIBRATION_PROMPTS = 8  # calibration-split prompts (256 tokens at most) whose activations pick the outlier channels


def compare_prompt_graph(target_path: Path, prompt_path: Path, spec, threads: int = 2, seed: int = 0) -> dict:
    """Logits of one :data:`VALIDATION_TOKENS`-token prompt chunk (random ids from an empty cache) through the target
    graph and the prompt graph: {"reference", "max_abs_logit_diff", "rel_l2", "argmax_agreement"}."""
    ids = np.random.default_rng(seed).integers(0, min(spec.dims.vocab_size, 30000), VALIDATION_TOKENS).tolist()
    out = []
    for path in (target_path, prompt_path):
        runner = ScatterRunner(OrtDecoder(path, spec, threads=threads).activate())
        runner.add(0)
        out.append(runner.step([(0, ids)])[0])
    ref, got = out
    return {"reference": f"the target graph, one {VALIDATION_TOKENS}-token prompt chunk of random ids",
            "max_abs_logit_diff": float(np.abs(got - ref).max()),
            "rel_l2": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
            "argmax_agreement": float(np.mean(got.argmax(-1) == ref.argmax(-1)))}


def add_prompt_graph(engine_dir: Path, weight_bits: int | None = None, keep=(), outlier_ratio: float = OUTLIER_RATIO,
                     log=print):
    """Write the prompt graph of ``engine_dir``'s target (``target_prompt.onnx`` + ``.data``, the tensors it keeps
    unchanged read in place from the target's data file, which its file list names too) and register it as graph
    ``target_prompt``, replacing any previous one, in one transaction. ``weight_bits``: 7 or 8; None: 7 where this
    CPU's u8·s8 kernel saturates, else 8 (:func:`dspark_runtime.machine.kernel_probe.u8s8_saturates`; a graph built
    with 8-bit weights is wrong on a saturating CPU). ``keep``: module-name regexes of projections left on the int4
    kernel. ``outlier_ratio``: input channels whose maximum over :data:`CALIBRATION_PROMPTS` calibration-split
    prompts exceeds this many times the median channel's run apart in fp32 (at most
    :data:`~dspark_export.precision.prompt_graph.OUTLIER_MOST` per activation; 0: none). Returns the new Manifest. Raises DSparkError when the target is
    not an int4 graph of the scatter KV layout."""
    m = load_manifest(engine_dir, verify=False)
    t = m.graphs["target"]
    if t.precision != "int4" or t.spec.kv_layout != "scatter":
        raise DSparkError(f"{engine_dir}: the prompt graph is made from an int4 target of the scatter KV layout; this "
                          f"target is {t.precision}, {t.spec.kv_layout} (rebuild with `dspark-export build` defaults)")
    if weight_bits is None:
        weight_bits = 7 if u8s8_saturates() else 8
    keep = tuple(keep)
    src = Path(engine_dir) / t.model_file
    outliers = None
    if outlier_ratio:
        tok = Tokenizer(Path(engine_dir) / m.tokenizer["dir"])
        maxima = channel_maxima(src, t.spec, calibration_token_ids(tok, CALIBRATION_PROMPTS))
        outliers = {a: outlier_channels(v, outlier_ratio) for a, v in maxima.items()}
    with engine_transaction(engine_dir) as txn:
        name = f"{PROMPT_GRAPH}.onnx"
        for f in t.files[1:]:  # the target's data files, which the prompt graph reads its unchanged tensors from
            txn.link(f.path)
        rep = integer_prompt_graph(src, txn.stage / name, weight_bits=weight_bits, keep=keep, outliers=outliers,
                                   share_source_data=True, log=log)
        kernels = t.spec.kernels if rep["kept_gguf"] else ""  # only kept MatMulGGUF nodes need the target's kernels
        check = compare_prompt_graph(Path(engine_dir) / t.model_file, txn.stage / name, t.spec)
        log(f"[{PROMPT_GRAPH}] vs the target graph on {VALIDATION_TOKENS} prompt positions: argmax agreement "
            f"{check['argmax_agreement']:.0%}, rel L2 {check['rel_l2']:.4f}, max |dlogits| {check['max_abs_logit_diff']:.2f}")
        m.graphs[PROMPT_GRAPH] = GraphEntry(
            role="prompt", model_id=t.model_id, format="onnx", precision="int8",
            files=[FileEntry.of(txn.stage, name), FileEntry.of(txn.stage, name + ".data"),
                   *(f for f in t.files if f.path in rep["shared_files"] or f.path == kernels)],
            spec=dataclasses.replace(t.spec, kernels=kernels),
            validation={"int8": check}, model_config=t.model_config,
            quantization={"method": f"prompt graph of the int4 target: u8*s8 MatMulIntegerToFloat, uint8 "
                                    f"activations per row, the target's weights in {weight_bits}-bit columns; the LM "
                                    f"head and "
                                    f"{', '.join(keep) or 'no other projection'} kept on MatMulNBits",
                          "keep": list(keep),
                          "outliers": {"ratio": outlier_ratio, "most": OUTLIER_MOST,
                                       "prompts": f"{CALIBRATION_NOTE}; first {CALIBRATION_PROMPTS}"},
                          "source_sha256": t.files[0].sha256, **rep})
        txn.commit(m)
    return m
