"""``dspark-export compare``: how far a candidate engine (e.g. int8) is from its reference (e.g. fp32) on held-out
prompts.

For each evaluation-split prompt (:data:`EVAL_SPLIT`; never calibration or training prompts) and each engine:
target-only greedy decoding, speculative greedy decoding with the same drafter kind (τ, and whether the output
equals the engine's own target-only output), and the target's logits teacher-forced on the reference's greedy
continuation, so both are scored at the same positions. Reported per prompt and overall: top-1 agreement, relative
L2 of the logits, greedy token agreement (identical prefix and position-wise), τ and per-token latency of each.
By default one engine is loaded at a time (the reference's logits wait on disk); ``interleave`` loads both and
alternates them per prompt (fairer timing, both engines' memory).
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from dspark_runtime.engine import DEFAULT_THREADS, Engine
from dspark_runtime.engine_dir.manifest import load_manifest
from dspark_runtime.engine_dir.tokenizer import Tokenizer
from dspark_runtime.errors import DSparkError

from dspark_export.paths import prompt_file

DEFAULT_SETS = {"humaneval": 4, "mbpp": 4, "gsm8k": 2, "mt-bench": 2}
# Evaluation split (dspark_export/data/prompts/README.md), 0-based start and end of each file.
EVAL_SPLIT = {"humaneval": (0, None), "mt-bench": (0, None), "gsm8k": (1000, 1319), "mbpp": (200, 257),
              "aime25": (0, None), "math500": (400, 500)}


def eval_prompts(counts: dict) -> list:
    """[(dataset, 1-based line, first turn)] for the first ``counts[dataset]`` evaluation-split prompts."""
    out = []
    for ds, n in counts.items():
        if ds not in EVAL_SPLIT:
            raise DSparkError(f"unknown prompt set {ds!r}; choose from {', '.join(EVAL_SPLIT)}")
        lines = prompt_file(ds).read_text().splitlines()
        a, b = EVAL_SPLIT[ds]
        b = len(lines) if b is None else b
        out += [(ds, i + 1, json.loads(lines[i])["turns"][0]) for i in range(a, min(a + n, b))]
    if not out:
        raise DSparkError("no prompts selected; ask for at least one (e.g. --humaneval 4)")
    return out


def teacher_forced_logits(runner, prompt: list, continuation: list, chunk: int = 256) -> np.ndarray:
    """Logits float32 [len(continuation), vocab] of the target predicting each continuation token:
    one pass over ``prompt + continuation[:-1]`` in chunks, on a fresh cache."""
    runner.reset()
    ids = list(prompt) + list(continuation[:-1])
    n0 = len(prompt) - 1
    out = []
    for s in range(0, len(ids), chunk):
        lg = runner.step(ids[s:s + chunk])
        lo = max(n0 - s, 0)
        if lo < lg.shape[0]:
            out.append(np.array(lg[lo:], dtype=np.float32))
    runner.reset()
    return np.concatenate(out)[: len(continuation)]


def _run_engine(eng, prompt: str, max_new_tokens: int, draft: str | None, draft_length) -> dict:
    """Target-only and speculative greedy runs of one prompt on one engine."""
    base = eng.generate(prompt, max_new_tokens=max_new_tokens, draft=None)
    rec = {"tokens": base.token_ids, "tps": base.stats.tokens_per_second}
    if draft:
        spec = eng.generate(prompt, max_new_tokens=max_new_tokens, draft=draft, draft_length=draft_length)
        rec.update(spec_tokens=spec.token_ids, spec_tps=spec.stats.tokens_per_second,
                   tau=spec.stats.accepted_length_mean, acceptance=spec.stats.acceptance_rate,
                   lossless=spec.token_ids == base.token_ids)
    return rec


def prefix_agreement(ref: list, cand: list) -> tuple:
    """(identical-prefix length / len(ref), position-wise matches / len(ref)) of two token lists."""
    if not ref:
        return 1.0, 1.0
    k = 0
    while k < min(len(ref), len(cand)) and ref[k] == cand[k]:
        k += 1
    same = sum(a == b for a, b in zip(ref, cand))
    return k / len(ref), same / len(ref)


def compare_engines(ref_dir: Path, cand_dir: Path, *, counts: dict | None = None, max_new_tokens: int = 128,
                    draft: str | None = "lm", draft_length=None, threads: int | None = None,
                    interleave: bool = False, log=print) -> dict:
    """Score engine ``cand_dir`` against ``ref_dir`` (see the module doc). Returns the report dict:
    {"reference", "candidate", "prompts": [per prompt], "summary": {...}, "settings"}.

    Metrics: top-1 agreement (teacher-forced argmax equal), relative L2 (‖l_c − l_r‖₂ / ‖l_r‖₂ per position,
    averaged), greedy token agreement of the target-only outputs (:func:`prefix_agreement`: the identical prefix as a
    fraction of the reference's length, strict, and the position-wise match fraction), τ (tokens committed per verify
    round, bonus included) and ms per token of each engine with their ratios. Without ``interleave`` the
    reference's logits wait on disk (``max_new_tokens × vocab × 4`` bytes per prompt), so the peak memory is the
    larger engine's.

    ``draft``: the drafter both engines speculate with ("lm", "dspark", "ngram"; None = no speculative runs).
    Raises DSparkError when the engines do not share a tokenizer vocabulary or lack the drafter.
    """
    import gc

    counts = dict(DEFAULT_SETS if counts is None else counts)
    prompts = eval_prompts(counts)
    threads = threads or DEFAULT_THREADS
    engines = {"reference": Path(ref_dir), "candidate": Path(cand_dir)}
    loaded = {}

    def get(which):
        if which not in loaded:
            if not interleave:
                loaded.clear()  # one engine in memory at a time
                gc.collect()
            loaded[which] = Engine.load(engines[which], threads=threads)
        return loaded[which]

    manifests = {k: load_manifest(p, verify=False) for k, p in engines.items()}
    precisions = {k: {r: g.precision for r, g in m.graphs.items()} for k, m in manifests.items()}
    toks = {k: Tokenizer(engines[k] / m.tokenizer["dir"]) for k, m in manifests.items()}
    probe = "def f(x):\n    return x  # 数"
    if toks["reference"].encode(probe) != toks["candidate"].encode(probe) or \
            toks["reference"]._tok.get_vocab() != toks["candidate"]._tok.get_vocab():
        raise DSparkError(f"{cand_dir} and {ref_dir} tokenize differently; compare engines of the same model")
    ids = None
    runs = {"reference": [None] * len(prompts), "candidate": [None] * len(prompts)}
    tf_top1, tf_rel = [None] * len(prompts), [None] * len(prompts)
    with tempfile.TemporaryDirectory(prefix="dspark-compare-") as tmp:
        order = ([(i, w) for i in range(len(prompts)) for w in ("reference", "candidate")] if interleave else
                 [(i, w) for w in ("reference", "candidate") for i in range(len(prompts))])
        for i, which in order:
            eng = None
            eng = get(which)
            if ids is None:
                ids = [eng.encode_prompt(p) for _, _, p in prompts]
            t0 = time.perf_counter()
            rec = _run_engine(eng, prompts[i][2], max_new_tokens, draft, draft_length)
            ref_tokens = rec["tokens"] if which == "reference" else runs["reference"][i]["tokens"]
            lg = teacher_forced_logits(eng.runner("target"), ids[i], ref_tokens)
            if which == "reference":
                np.save(Path(tmp) / f"{i}.npy", lg)
            else:
                r = np.load(Path(tmp) / f"{i}.npy")
                tf_top1[i] = float((r.argmax(-1) == lg.argmax(-1)).mean())
                tf_rel[i] = float((np.linalg.norm(lg - r, axis=-1) / np.linalg.norm(r, axis=-1)).mean())
            runs[which][i] = rec
            log(f"  [{which}] {prompts[i][0]}:{prompts[i][1]} {len(rec['tokens'])} tokens, "
                f"{rec['tps']:.2f} tok/s" + (f", spec {rec['spec_tps']:.2f} tok/s tau {rec['tau']:.2f}"
                                             if draft else "") + f" ({time.perf_counter() - t0:.0f} s)")
        eng = None
        loaded.clear()
    rows = []
    for i, (ds, line, _) in enumerate(prompts):
        r, c = runs["reference"][i], runs["candidate"][i]
        strict, pos = prefix_agreement(r["tokens"], c["tokens"])
        row = {"dataset": ds, "line": line, "top1_agreement": tf_top1[i], "rel_l2": tf_rel[i],
               "greedy_prefix_agreement": strict, "greedy_positionwise_agreement": pos,
               "ref_ms_per_token": 1e3 / r["tps"], "cand_ms_per_token": 1e3 / c["tps"]}
        if draft:
            row.update(ref_tau=r["tau"], cand_tau=c["tau"], ref_spec_ms_per_token=1e3 / r["spec_tps"],
                       cand_spec_ms_per_token=1e3 / c["spec_tps"], ref_lossless=r["lossless"],
                       cand_lossless=c["lossless"])
        rows.append(row)

    def mean(k):
        return float(np.mean([x[k] for x in rows]))

    summary = {k: mean(k) for k in ("top1_agreement", "rel_l2", "greedy_prefix_agreement",
                                    "greedy_positionwise_agreement", "ref_ms_per_token", "cand_ms_per_token")}
    summary["identical_greedy_outputs"] = sum(x["greedy_prefix_agreement"] == 1.0 for x in rows)
    summary["target_only_speedup"] = summary["ref_ms_per_token"] / summary["cand_ms_per_token"]
    if draft:
        for k in ("ref_tau", "cand_tau", "ref_spec_ms_per_token", "cand_spec_ms_per_token"):
            summary[k] = mean(k)
        summary["speculative_speedup"] = summary["ref_spec_ms_per_token"] / summary["cand_spec_ms_per_token"]
        summary["ref_lossless"] = sum(x["ref_lossless"] for x in rows)
        summary["cand_lossless"] = sum(x["cand_lossless"] for x in rows)
    summary["prompts"] = len(rows)
    return {"reference": {"dir": str(engines["reference"]), "precision": precisions["reference"]},
            "candidate": {"dir": str(engines["candidate"]), "precision": precisions["candidate"]},
            "settings": {"prompts": counts, "split": "evaluation (dspark_export/data/prompts/README.md)",
                         "max_new_tokens": max_new_tokens, "draft": draft, "draft_length": draft_length,
                         "threads": threads, "interleave": interleave, "greedy": True},
            "prompts": rows, "summary": summary}


def format_report(rep: dict) -> str:
    """The report as a printed table (per prompt, then the summary)."""
    s, spec = rep["summary"], rep["settings"]["draft"]
    lines = [f"reference {rep['reference']['dir']} {rep['reference']['precision']}",
             f"candidate {rep['candidate']['dir']} {rep['candidate']['precision']}",
             f"{'prompt':14} {'top-1':>6} {'rel L2':>7} {'greedy prefix':>13} {'pos':>5} {'ms/tok ref':>10} "
             f"{'ms/tok cand':>11}" + (f" {'tau ref':>7} {'tau cand':>8} {'spec ms ref':>11} {'spec ms cand':>12} "
                                        f"lossless" if spec else "")]
    for x in rep["prompts"]:
        line = (f"{x['dataset'] + ':' + str(x['line']):14} {x['top1_agreement']:6.1%} {x['rel_l2']:7.4f} "
                f"{x['greedy_prefix_agreement']:13.1%} {x['greedy_positionwise_agreement']:5.0%} "
                f"{x['ref_ms_per_token']:10.1f} {x['cand_ms_per_token']:11.1f}")
        if spec:
            line += (f" {x['ref_tau']:7.2f} {x['cand_tau']:8.2f} {x['ref_spec_ms_per_token']:11.1f} "
                     f"{x['cand_spec_ms_per_token']:12.1f} {'yes' if x['ref_lossless'] and x['cand_lossless'] else 'NO'}")
        lines.append(line)
    lines.append(f"summary over {s['prompts']} prompts: top-1 agreement {s['top1_agreement']:.1%}, rel L2 "
                 f"{s['rel_l2']:.4f}, greedy token agreement {s['greedy_prefix_agreement']:.1%} (prefix) / "
                 f"{s['greedy_positionwise_agreement']:.1%} (position-wise), identical outputs "
                 f"{s['identical_greedy_outputs']}/{s['prompts']}; target-only {s['ref_ms_per_token']:.1f} -> "
                 f"{s['cand_ms_per_token']:.1f} ms/token ({s['target_only_speedup']:.2f}x)")
    if spec:
        lines.append(f"speculative ({spec}): tau {s['ref_tau']:.2f} -> {s['cand_tau']:.2f}; "
                     f"{s['ref_spec_ms_per_token']:.1f} -> {s['cand_spec_ms_per_token']:.1f} ms/token "
                     f"({s['speculative_speedup']:.2f}x); speculative == own target-only: reference "
                     f"{s['ref_lossless']}/{s['prompts']}, candidate {s['cand_lossless']}/{s['prompts']}")
    return "\n".join(lines)
