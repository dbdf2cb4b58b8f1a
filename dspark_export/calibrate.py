"""``dspark-export calibrate``: fit the DSpark confidence head's STS temperatures on the calibration split.

The engine decodes calibration prompts (``data/prompts/README.md``: gsm8k 901–1000, math500 351–400,
mbpp 181–200 — never evaluation prompts) greedily with its DSpark drafter at the full block size,
recording every round's confidence logits and how many drafts the target accepted. Sequential
Temperature Scaling (DESIGN.md §1 step 3; :func:`dspark_runtime.calibration.fit_sts`) then picks one
temperature per position so the cumulative survival product matches the measured prefix survival.
The temperatures go into the engine's manifest (and ``sts.json`` beside the checkpoint when known).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from dspark_runtime.calibration import fit_sts, survival_ece_report
from dspark_runtime.errors import DSparkError
from dspark_runtime.generate import generate_tokens
from dspark_runtime.sampling import SamplingParams

from .draft_data import CALIB_SPLIT, split_prompts


def calibration_prompts(n: int) -> list:
    """The first turns of ``n`` calibration-split prompts, code-weighted: mbpp, gsm8k, math500 in turn."""
    groups = split_prompts(CALIB_SPLIT)
    order, out = ["mbpp", "gsm8k", "mbpp", "math500"], []
    idx = {k: 0 for k in groups}
    while len(out) < n and any(idx[k] < len(groups[k]) for k in groups):
        for k in order:
            if len(out) < n and idx[k] < len(groups[k]):
                out.append(groups[k][idx[k]][1])
                idx[k] += 1
    return out


def record_rounds(engine, prompts: list, max_new_tokens: int, log=print) -> tuple:
    """Decode ``prompts`` with the engine's DSpark drafter; returns (logits [R, γ], accepted [R, γ]).

    accepted[r, k] = 1 for k < n_r, 0 at k = n_r (the first rejection), and 0 afterwards (ignored by STS,
    which conditions on all earlier positions being accepted). Rounds cut short by the token budget
    (fewer than γ drafts) are dropped.
    """
    drafter = engine._drafter("dspark")
    gamma = drafter.block_size
    rows, accs = [], []
    for i, p in enumerate(prompts):
        drafter.record = []
        ids = engine.encode_prompt(p)
        t0 = time.perf_counter()
        out, _, stats = generate_tokens(engine.runner("target"), ids, max_new_tokens=max_new_tokens,
                                        params=SamplingParams(), eos_ids=engine.eos_ids, drafter=drafter,
                                        draft_length=gamma)
        for conf, n in drafter.record:
            if len(conf) == gamma:
                rows.append(conf)
                a = np.zeros(gamma)
                a[:n] = 1
                accs.append(a)
        log(f"  [{i + 1}/{len(prompts)}] {len(out)} tokens, tau {stats.accepted_length_mean:.2f}, "
            f"{time.perf_counter() - t0:.0f} s")
    drafter.record = None
    if not rows:
        raise DSparkError("no full draft rounds were recorded; use more prompts or more tokens")
    return np.stack(rows), np.stack(accs)


def calibrate_engine(engine_dir: Path, n_prompts: int = 12, max_new_tokens: int = 128, log=print) -> dict:
    """Fit STS temperatures for the engine's DSpark drafter and write them to its manifest.

    Returns {"temperatures", "report" (per position ECE before/after), "rounds", "prompts"}.
    """
    from dspark_runtime.engine import Engine
    from dspark_runtime.manifest import load_manifest

    engine_dir = Path(engine_dir)
    eng = Engine.load(engine_dir)
    if eng.dspark_graph is None:
        raise DSparkError(f"{engine_dir} has no DSpark drafter to calibrate")
    eng.dspark_heads().temperatures = None  # record raw (uncalibrated) confidences
    prompts = calibration_prompts(n_prompts)
    log(f"decoding {len(prompts)} calibration-split prompts with the DSpark drafter")
    logits, acc = record_rounds(eng, prompts, max_new_tokens, log)
    temps = fit_sts(logits, acc)
    report = survival_ece_report(logits, acc, temps)
    res = {"temperatures": [float(t) for t in temps], "report": report, "rounds": int(len(logits)),
           "prompts": "calibration split (data/prompts/README.md): " + ", ".join(
               f"{k} lines {a + 1}-{b}" for k, (a, b) in CALIB_SPLIT.items()) + f"; first {len(prompts)}",
           "max_new_tokens": max_new_tokens}
    m = load_manifest(engine_dir, verify=False)
    m.speculation["dspark"]["sts_temperatures"] = res["temperatures"]
    m.speculation["dspark"]["calibration"] = {"rounds": res["rounds"], "ece": [
        {k: r[k] for k in ("position", "ece_before", "ece_after")} for r in report]}
    m.write(engine_dir)
    (engine_dir / "calibration.json").write_text(json.dumps(res, indent=2) + "\n")
    model_id = m.graphs[m.speculation["dspark"]["graph"]].model_id
    if model_id.startswith("dspark:"):
        ck = Path(model_id[len("dspark:"):])
        if ck.is_dir():
            (ck / "sts.json").write_text(json.dumps({"temperatures": res["temperatures"],
                                                     "fitted_on": res["prompts"], "rounds": res["rounds"]},
                                                    indent=2) + "\n")
    return res
