"""``dspark-export calibrate``: fit the DSpark confidence head's STS temperatures and the router's priors on the
calibration split.

The engine decodes calibration-split prompts (:func:`dspark_export.drafter.data.calibration_prompts`; never
evaluation prompts) greedily with its DSpark drafter at the full block size, recording each round's confidence
logits and accepted drafts. Sequential Temperature Scaling (docs/design.md §1 step 3;
:func:`dspark_runtime.drafting.sts.fit_sts`) picks one temperature per position so the cumulative survival product
matches the measured prefix survival; the same greedy outputs give the router's priors (:func:`fit_router`). The
manifest and ``calibration.json`` are replaced in one transaction (and ``sts.json`` is written beside the checkpoint
when known): an error or Ctrl-C leaves the engine directory as it was.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from dspark_runtime.drafting.learned_acceptance import acceptance_counts, fit_ngram_counts
from dspark_runtime.drafting.router import NGRAM_MAX_LENGTH
from dspark_runtime.drafting.sts import fit_sts, survival_ece_report
from dspark_runtime.scheduling.breakeven import needed_alpha, speedup
from dspark_runtime.engine import Engine
from dspark_runtime.engine_dir.integrity import atomic_write_text
from dspark_runtime.engine_dir.manifest import load_manifest
from dspark_runtime.errors import DSparkError

from dspark_export.drafter.data import CALIB_SPLIT, calibration_prompts
from dspark_export.engine_dir.transaction import engine_transaction


def record_rounds(engine, prompts: list, max_new_tokens: int, log=print, sequences: list | None = None) -> tuple:
    """Decode ``prompts`` with the engine's DSpark drafter; returns (confidence logits [R, γ], or None for a drafter
    without the confidence head (DFlash), accepted [R, γ]).
    When ``sequences`` is a list, (prompt ids + greedy output, prompt length) pairs are appended to it.

    accepted[r, k] = 1 for k < n_r, 0 at k = n_r (the first rejection), and 0 afterwards (ignored by STS,
    which conditions on all earlier positions being accepted). Rounds cut short by the token budget
    (fewer than γ drafts) are dropped.
    """
    gen = engine.batch(draft="dspark", max_batch=1)  # full blocks: the default length of a DSpark drafter
    drafter, gamma = gen.drafter, gen.default_gamma
    drafter.record = []
    rows, accs = [], []
    for i, p in enumerate(prompts):
        ids = engine.encode_prompt(p)
        t0 = time.perf_counter()
        start = len(drafter.record)
        req = gen.submit(ids, max_new_tokens=max_new_tokens)
        gen.run()
        out, stats = req.token_ids, req.stats
        if sequences is not None:
            sequences.append((list(ids) + list(out), len(ids)))
        for conf, sent, n in drafter.record[start:]:
            if sent == gamma:
                rows.append(conf)
                a = np.zeros(gamma)
                a[:n] = 1
                accs.append(a)
        log(f"  [{i + 1}/{len(prompts)}] {len(out)} tokens, tau {stats.accepted_length_mean:.2f}, "
            f"{time.perf_counter() - t0:.0f} s")
    drafter.record = None
    if not rows:
        raise DSparkError("no full draft rounds were recorded; use more prompts or more tokens")
    return (np.stack(rows) if drafter.confident else None), np.stack(accs)


def fit_router(sequences: list, dspark_accepted: np.ndarray, gamma: int, fitted_on: str = "") -> dict:
    """The router's priors, for ``speculation.router`` in the manifest: n-gram lookup's acceptance per match-extent
    bucket and position measured on the greedy outputs ``sequences`` (list of (token ids, prompt length);
    :func:`dspark_runtime.drafting.learned_acceptance.fit_ngram_counts`), and the DSpark drafter's per-position
    acceptance from its recorded rounds (``dspark_accepted`` [R, γ]). Pure function."""
    ngram = fit_ngram_counts([s for s, _ in sequences], [p for _, p in sequences], max(gamma, NGRAM_MAX_LENGTH))
    return {"ngram": ngram, "inner": {"dspark": acceptance_counts(dspark_accepted)}, "fitted_on": fitted_on,
            "sequences": len(sequences), "gamma": int(gamma)}


def drafter_worth(cost_table: dict | None, survival: list) -> dict | None:
    """What measured prefix survivals (``mean true`` per position) are worth on a profiled engine, for one request
    (:mod:`dspark_runtime.scheduling.breakeven`): {"speedup" over target-only, "verify_length" (the best), and
    "breakeven_alpha" (the per-position acceptance at which the drafter pays for itself, or None)}; None without
    survivals or a cost table with t_verify. Pure function."""
    if not survival or not cost_table or "t_verify" not in cost_table:
        return None
    length, x = speedup(cost_table, survival)
    alpha = needed_alpha(cost_table, 1.0, gamma=len(survival))
    return {"speedup": round(x, 4), "verify_length": length,
            "breakeven_alpha": None if alpha is None else round(alpha, 4)}


def calibrate_engine(engine_dir: Path, n_prompts: int = 12, max_new_tokens: int = 128, log=print,
                     save_to_checkpoint: bool = False) -> dict:
    """Fit STS temperatures for the engine's DSpark drafter and the router's priors, and write them to its manifest.
    A drafter without the confidence head (DeepSpec's DFlash) gets the router's priors only (temperatures None).

    Returns {"temperatures", "report" (per position ECE before/after; empty without a confidence head), "rounds",
    "prompts", "worth" (:func:`drafter_worth` of the measured survivals on the engine's cost table, or None),
    "checkpoint_sts" (the ``sts.json`` written, or None)}.
    The manifest and ``<engine_dir>/calibration.json`` change together or not at all. With ``save_to_checkpoint``
    the fit is also written (atomically, after them) as ``sts.json`` in the drafter's checkpoint folder, which
    ``add-draft`` copies into every engine later compiled from it; otherwise that folder is left untouched (an
    engine copy calibrated for a trial does not change the checkpoint other engines are built from). Raises
    DSparkError when the engine has no DSpark drafter, no full draft round was recorded, or the engine directory
    cannot be written (read-only, full disk; it is then unchanged).
    """
    engine_dir = Path(engine_dir)
    eng = Engine.load(engine_dir)
    if eng.dspark_graph is None:
        raise DSparkError(f"{engine_dir} has no DSpark drafter to calibrate")
    eng.dspark_heads().temperatures = None  # record raw (uncalibrated) confidences
    prompts = calibration_prompts(n_prompts)
    log(f"decoding {len(prompts)} calibration-split prompts with the DSpark drafter")
    sequences: list = []
    logits, acc = record_rounds(eng, prompts, max_new_tokens, log, sequences)
    if logits is None:
        log("the DSpark drafter has no confidence head (DFlash): no STS temperatures, the router's priors only")
        temps, report = None, []
    else:
        temps = fit_sts(logits, acc)
        report = survival_ece_report(logits, acc, temps)
    fitted_on = ("calibration split (dspark_export/data/prompts/README.md): " + ", ".join(
        f"{k} lines {a + 1}-{b}" for k, (a, b) in CALIB_SPLIT.items()) + f"; first {len(prompts)}")
    router = fit_router(sequences, acc, gamma=acc.shape[1], fitted_on=fitted_on)
    res = {"temperatures": None if temps is None else [float(t) for t in temps], "report": report,
           "rounds": int(len(acc)),
           "prompts": fitted_on, "max_new_tokens": max_new_tokens, "router": router,
           "sequences": [{"token_ids": list(map(int, q)), "prompt_tokens": int(n)} for q, n in sequences]}
    with engine_transaction(engine_dir) as txn:
        m = load_manifest(engine_dir, verify=False)
        m.speculation.dspark.sts_temperatures = res["temperatures"]
        m.speculation.dspark.calibration = {"rounds": res["rounds"], "ece": [
            {k: r[k] for k in ("position", "ece_before", "ece_after")} for r in report]}
        m.speculation.router = router
        txn.add("calibration.json").write_text(json.dumps(res, indent=2) + "\n")
        txn.commit(m)
    ng = np.asarray(router["ngram"]["hits"]) / np.maximum(np.asarray(router["ngram"]["tries"]), 1)
    log("n-gram lookup acceptance at position 1 by match extent "
        + ", ".join(f"{lo}+: {ng[i, 0]:.2f} ({int(router['ngram']['tries'][i][0])})"
                    for i, lo in enumerate(router["ngram"]["edges"])))
    res["worth"] = drafter_worth(m.speculation.cost_table, acc.mean(axis=0).tolist())  # prefix survival by position
    if res["worth"] is not None:
        w = res["worth"]
        log(f"on this engine's cost table (one request): these survivals make the DSpark drafter alone "
            f"{w['speedup']:.2f}x target-only (verify length {w['verify_length']}); it breaks even at "
            + (f"{w['breakeven_alpha']:.2f} acceptance per position" if w["breakeven_alpha"] is not None
               else "no acceptance (a verified token costs a whole pass here)"))
    else:
        log("no cost table: `dspark-export profile` this engine to see what these survivals are worth on this machine")
    model_id = m.graphs[m.speculation.dspark.graph].model_id
    ck = Path(model_id[len("dspark:"):]) if model_id.startswith("dspark:") else None
    res["checkpoint_sts"] = None
    if ck is None or not ck.is_dir():
        if save_to_checkpoint:
            log(f"the drafter's checkpoint folder ({model_id}) is not on this machine: no sts.json written")
    elif save_to_checkpoint:
        res["checkpoint_sts"] = str(ck / "sts.json")
        atomic_write_text(ck / "sts.json", json.dumps({"temperatures": res["temperatures"],
                                                       "fitted_on": res["prompts"], "rounds": res["rounds"],
                                                       "router": router}, indent=2) + "\n")
        log(f"wrote {ck / 'sts.json'}: engines compiled from {ck} from now on carry this fit")
    else:
        log(f"{ck}/sts.json left as it was (engines compiled from that checkpoint carry its fit, not this one; "
            "--save-to-checkpoint writes this one there)")
    return res
