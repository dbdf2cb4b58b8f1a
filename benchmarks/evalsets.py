"""Shared by the benchmarks: the evaluation split of the prompt sets, the results folder, a machine description
and the speculation counters. Standard library only at import (the peer workers import it under their own venvs)."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"  # the default output folder of every benchmark (results/README.md indexes it)
PROMPTS = ROOT / "dspark_export" / "data" / "prompts"  # the package data (dspark_export.paths.prompts_dir)
# Evaluation split (dspark_export/data/prompts/README.md): all of humaneval and mt-bench; gsm8k 1001-1319;
# mbpp 201-257.
EVAL_START = {"humaneval": 0, "mt-bench": 0, "gsm8k": 1000, "mbpp": 200, "aime25": 0, "math500": 400, "long": 0}
EVAL_END = {"humaneval": None, "mt-bench": None, "gsm8k": 1319, "mbpp": 257, "aime25": None, "math500": 500,
            "long": None}
# prompt sets of the benchmarks only, outside the package data: "long", 4 code-review prompts of 514-988 tokens
# (CPython 3.11 modules, the source named in each line) for time to first token on long prompts
BENCH_PROMPTS = {"long": ROOT / "benchmarks" / "data" / "long-prompts.jsonl"}


def machine() -> str:
    """CPU model, cores, RAM and OS of this machine."""
    from dspark_runtime.machine.sysinfo import machine_description

    return machine_description()


def load_prompts(dataset: str, n: int) -> list:
    """First turns of the first ``n`` evaluation-split prompts of ``dataset``."""
    lines = BENCH_PROMPTS.get(dataset, PROMPTS / f"{dataset}.jsonl").read_text().splitlines()
    start, end = EVAL_START[dataset], EVAL_END[dataset] or len(lines)
    return [json.loads(l)["turns"][0] for l in lines[start:min(start + n, end)]]


def round_stats(rounds) -> dict:
    """Speculation stats from per-round (candidates proposed, candidates accepted) pairs: rounds, proposed,
    accepted, tau (tokens committed per round, bonus included), acceptance rate, and per draft position the
    rounds that proposed it (``pos_tries``) and accepted it (``pos_hits``)."""
    rounds = [(int(p), int(a)) for p, a in rounds]
    if not rounds:
        return {"rounds": 0, "proposed": 0, "accepted": 0, "tau": None, "acceptance_rate": None,
                "pos_tries": [], "pos_hits": []}
    proposed = sum(p for p, _ in rounds)
    accepted = sum(a for _, a in rounds)
    m = max(p for p, _ in rounds)
    return {"rounds": len(rounds), "proposed": proposed, "accepted": accepted,
            "tau": (accepted + len(rounds)) / len(rounds),
            "acceptance_rate": accepted / proposed if proposed else None,
            "pos_tries": [sum(p > k for p, _ in rounds) for k in range(m)],
            "pos_hits": [sum(a > k for _, a in rounds) for k in range(m)]}


def loadavg() -> list | None:
    """The 1/5/15-minute load averages (/proc/loadavg), or None where there is none."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def ids_digest(ids) -> str:
    """A short digest (16 hex digits of sha1) of a token-id list: names a prompt's ids in reports."""
    import hashlib

    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


def round_kinds(records) -> dict:
    """Per-round records of the decoding loop (:class:`dspark_runtime.decoding.request.RoundRecord`, or dicts of its fields)
    summarised by kind: "drafted" (the drafting pass ran because it was expected to pay, or nothing was known yet),
    "probe" (it ran as a probe of the skip rule) and "undrafted", each "+prefill" where the round also fed prompt
    chunks; "prefill-only" for rounds with no decoding row. Per kind: rounds, wall_s (sum, seconds), ms_per_round,
    draft_ms_per_round (the drafting pass's part of it), committed, tokens_per_second (committed / wall_s), rows_mean,
    pass_tokens_mean, prompt_tokens;
    "share_of_wall" of the whole trace; and the skip rule's mean expectations over the rounds that weighed them,
    expected_drafted_tps / expected_undrafted_tps (None where no round of the kind did). Kinds with no round are
    left out."""
    out: dict = {}
    for r in records:
        r = r if isinstance(r, dict) else vars(r)
        if not r["rows"]:
            kind = "prefill-only"
        else:
            kind = ("probe" if r["probe"] else "drafted") if r["drafted"] else "undrafted"
            kind += "+prefill" if r["prefilling"] else ""
        k = out.setdefault(kind, {"rounds": 0, "wall_s": 0.0, "draft_s": 0.0, "committed": 0, "rows": 0,
                                  "pass_tokens": 0, "prompt_tokens": 0, "weighed": 0, "exp_d": 0.0, "exp_0": 0.0})
        k["rounds"] += 1
        if r.get("expected_drafted") is not None:
            k["weighed"] += 1
            k["exp_d"] += r["expected_drafted"]
            k["exp_0"] += r["expected_undrafted"]
        k["wall_s"] += r["wall_s"]
        k["draft_s"] += r.get("draft_s", 0.0)
        k["committed"] += r["committed"]
        k["rows"] += r["rows"]
        k["pass_tokens"] += r["pass_tokens"]
        k["prompt_tokens"] += r["prompt_tokens"]
    total = sum(k["wall_s"] for k in out.values())
    for k in out.values():
        n = k["rounds"]
        k["ms_per_round"] = 1e3 * k["wall_s"] / n
        k["draft_ms_per_round"] = 1e3 * k.pop("draft_s") / n
        k["tokens_per_second"] = k["committed"] / k["wall_s"] if k["wall_s"] > 0 else 0.0
        k["rows_mean"] = k.pop("rows") / n
        k["pass_tokens_mean"] = k.pop("pass_tokens") / n
        k["share_of_wall"] = k["wall_s"] / total if total > 0 else 0.0
        w, d, u = k.pop("weighed"), k.pop("exp_d"), k.pop("exp_0")
        k["expected_drafted_tps"] = d / w if w else None
        k["expected_undrafted_tps"] = u / w if w else None
    return dict(sorted(out.items()))


def child_env(**extra) -> dict:
    """This process's environment with the repository root first on PYTHONPATH (and ``extra`` set): a child
    ``python -m benchmarks.<name>`` finds the package whatever its interpreter (a peer's venv) and working folder."""
    import os

    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env
