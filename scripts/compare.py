#!/usr/bin/env python
"""Head-to-head comparison on one target: Hugging Face transformers (plain, assisted, prompt lookup)
versus the DSpark runtime (target-only, draft LM, n-gram lookup), and the peers users would pick
instead (llama.cpp: llama-cpp-python plain and prompt lookup, its llama-speculative binary with the
0.5B draft; ONNX Runtime GenAI: int4 plain and n-gram speculation), same held-out prompts, same
max_new_tokens, greedy and/or sampled (``--temperature 0,1.0``: every system at each temperature, as
its own variant ``name@T1``, all interleaved in one run; the peers run greedy only).

Peers: each in its own venv under --peer-dir (``scripts/peers/install.sh llama-cpp|ort-genai`` and
``scripts/peers/install.sh ort-genai-model <target>``), never a project dependency; a selected peer
system that is not installed is refused before anything runs, with the command that installs it. Its
worker (scripts/peers/worker.py) runs under the peer's python and is fed the preflight's prompt token
ids (llama-speculative, which only takes text, gets the chat-template text and its tokenization is
checked equal to those ids). The llama.cpp peers run the Q4_K_M GGUF the models were fetched as,
ort-genai its builder's int4 graph: other weights than the fp32 systems, so greedy outputs can part
from ``hf``/``dspark-target`` at near-ties (reported); a peer's speculative variant is compared with
its own target-only system (``= own baseline``).

Resume: every finished (prompt, system) row is appended to --out-dir/progress.jsonl as it finishes;
``--resume`` with the same settings skips the pairs already done (each chunk still runs its remaining
systems in the rotated order) and refuses other settings, naming them.

Prompts: the first N of the evaluation split (dspark_export/data/prompts/README.md) of each --datasets entry,
first turn, each system's own rendering of the model's chat template (HF:
``tokenizer.apply_chat_template(add_generation_prompt=True)``; DSpark: ``Engine.encode_prompt``).
A preflight step checks that both give identical prompt token ids (it stops if the first prompt
differs, and reports any other prompt that does).

Process / memory design: every (chunk, system) pair runs in a fresh worker subprocess that loads
its model(s) once, warms up, processes the chunk's prompts and exits; workers run strictly ONE AT
A TIME (an fp32 1.5B target is ~7 GB in torch, target + draft ~10 GB in ONNX Runtime), so the peak
memory of the whole run is that of the biggest single system, and each worker's peak RSS
(getrusage ru_maxrss) is that system's alone. Interleaving: the prompt list alternates datasets and
is cut into chunks of --chunk prompts; for chunk c the systems run in the order rotated by c, so
slow machine drift hits every system and dataset about equally. A worker's model load and warm-up
are timed separately and never enter tokens/s.

Metrics (per system, per prompt): new tokens; TTFT (request start -> first committed token);
decode tokens/s = tokens committed after the first commit / time after it (prefill excluded, as
``GenerationStats.tokens_per_second``); tau (tokens committed per verify round) and acceptance rate
(accepted / proposed draft tokens) where the system speculates; acceptance by draft position; peak
RSS of the worker; model load time; bytes of the model files the system loads ("model GB"). HF times come from a timestamping streamer in the same ``generate`` call (no
second run). Greedy outputs are compared token for token with ``hf`` and with ``dspark-target``;
any divergence is reported with its first differing position.

    python scripts/compare.py --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --engine engines/qwen2.5-coder-1.5b --datasets humaneval,mbpp,gsm8k,mt-bench --n 3 \\
        --max-new-tokens 128 --systems hf,hf-assisted,hf-pld,dspark-target,dspark-lm,dspark-ngram
    # + the peers (after scripts/peers/install.sh all):
    #   --systems ...,llama-cpp,llama-cpp-pld,llama-speculative,ort-genai,ort-genai-ngram

Writes --out-dir (default scripts/results/compare/): compare.json (raw rows, summary, machine,
settings, command line), REPORT.md and PNG plots. ``--report-only`` rebuilds REPORT.md and the plots
from an existing compare.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark_runtime.engine import DEFAULT_THREADS  # noqa: E402  (affinity and cgroup quota, at most 8)
from evalsets import EVAL_START, ROOT, ids_digest, load_prompts, loadavg, machine, round_stats  # noqa: E402
WARMUP_PROMPT = "Write a one-line Python function that adds two numbers."


# --------------------------------------------------------------------------------------------
# systems (the extension point)


@dataclass(frozen=True)
class System:
    """One compared system.

    backend: "hf" (transformers ``generate`` on the --target folder) or "dspark" (``Engine`` on
    --engine). options, per backend:
      hf:     assistant (bool: --draft as ``assistant_model``), prompt_lookup_num_tokens (int),
              generate_kwargs (dict, passed to ``generate`` as is).
      dspark: draft (None | "lm" | "ngram" | any name ``Engine.generate(draft=)`` accepts),
              draft_length (int | "auto" | "scheduled"), engine (a directory overriding --engine).
    """

    name: str
    backend: str
    options: dict = field(default_factory=dict)
    description: str = ""
    # the peer (scripts/peers/install.sh NAME) whose own venv runs this system's worker; None: the project's
    peer: str | None = None
    # a peer's own target-only system (same weights): greedy, it must reproduce its tokens; compared as
    # ``vs_baseline`` besides the REFERENCES (the project's systems have those as their baselines)
    baseline: str | None = None


SYSTEMS = {s.name: s for s in [
    System("hf", "hf", {}, "transformers generate, fp32 torch CPU, plain decoding"),
    System("hf-assisted", "hf", {"assistant": True},
           "transformers assisted generation, --draft as assistant_model, transformers' default schedule"),
    System("hf-pld", "hf", {"prompt_lookup_num_tokens": 10},
           "transformers prompt lookup decoding (prompt_lookup_num_tokens=10, max_matching_ngram_size default 2)"),
    System("dspark-target", "dspark", {"draft": None}, "DSpark runtime, target only"),
    # our default configuration: whatever `--draft auto` picks on --engine (Engine.auto_draft), its default length
    System("dspark-auto", "dspark", {"draft": "auto"}, "DSpark runtime, --draft auto (the engine's default "
           "drafter and draft length)"),
    # the fp32 graph of the same weights: the reference every other system's greedy agreement is measured against
    System("dspark-fp32", "dspark", {"draft": None, "engine": "engines/qwen2.5-coder-1.5b-fp32"},
           "DSpark runtime, fp32 target only (engines/qwen2.5-coder-1.5b-fp32: `dspark-export build "
           "engines/qwen2.5-coder-1.5b.json --precision fp32 --name qwen2.5-coder-1.5b-fp32`)"),
    System("dspark-lm", "dspark", {"draft": "lm", "draft_length": 3}, "DSpark runtime, draft LM, gamma 3"),
    System("dspark-ngram", "dspark", {"draft": "ngram", "draft_length": 4},
           "DSpark runtime, n-gram prompt lookup, gamma 4"),
    System("dspark-lm-int8", "dspark", {"draft": "lm", "draft_length": 3,
                                        "engine": "engines/qwen2.5-coder-1.5b-int8draft"},
           "DSpark runtime, dynamic-INT8 draft LM (fp32 target), gamma 3"),
    # the DSpark block drafter compiled beside the 0.5B draft (dspark-export add-draft; scripts/quickstart.sh)
    System("dspark-drafter", "dspark", {"draft": "dspark", "draft_length": 7},
           "DSpark runtime, DSpark drafter trained on this CPU, block 7"),
    # per round n-gram lookup or the DSpark block, verify length by Algorithm 1 (needs `dspark-export calibrate`
    # and `dspark-export profile` on the engine: router priors and the cost table)
    System("dspark-router", "dspark", {"draft": "router", "draft_length": "scheduled"},
           "DSpark runtime, router (n-gram lookup or DSpark drafter per round), scheduled verify length"),
    # ---- peers: what users would pick instead, each in its own venv (scripts/peers/install.sh), fed the
    # preflight's prompt token ids; they run the Q4 GGUF the models were fetched as (llama.cpp) or an int4
    # graph of ONNX Runtime GenAI's model builder: other weights than the fp32 systems, so greedy outputs
    # differ from hf/dspark-target at near-ties (reported, not hidden); each is compared with its own
    # target-only decoding as its baseline.
    System("llama-cpp", "llama-cpp", {}, "llama.cpp (llama-cpp-python), Q4_K_M GGUF of the target, greedy, "
           "logits_all=False", peer="llama-cpp"),
    System("llama-cpp-pld", "llama-cpp", {"prompt_lookup": 10},
           "llama-cpp-python with LlamaPromptLookupDecoding(num_pred_tokens=10, max_ngram_size 2) as draft_model "
           "(the library then keeps logits for every position)", peer="llama-cpp", baseline="llama-cpp"),
    System("llama-speculative", "llama-speculative", {},
           "llama.cpp's llama-speculative binary: Q4_K_M 1.5B target, -md the 0.5B GGUF draft, --temp 0, its "
           "default draft length (3), one process per prompt (prompt as chat-template text, its tokenization "
           "checked equal to the preflight ids)", peer="llama-cpp", baseline="llama-cpp"),
    System("ort-genai", "ort-genai", {}, "ONNX Runtime GenAI, int4 graph of its model builder (-p int4 -e cpu), "
           "greedy (do_sample False)", peer="ort-genai"),
    System("ort-genai-ngram", "ort-genai", {"speculative": {"ngram_size": 3, "max_draft_tokens": 4}},
           "ONNX Runtime GenAI n-gram speculative decoding (set_speculative_options ngram_size 3, "
           "max_draft_tokens 4: its documented starting point), same int4 graph", peer="ort-genai",
           baseline="ort-genai"),
]}
PEER_INSTALL = {"llama-cpp": "scripts/peers/install.sh llama-cpp",
                "ort-genai": "scripts/peers/install.sh ort-genai"}
REFERENCES = ("hf", "dspark-target", "dspark-fp32")  # greedy outputs are compared with these


def variant_name(system: str, temperature: float) -> str:
    """The key of one (system, temperature) pair: the system's name when greedy, else
    ``name@T<temperature>`` (e.g. ``hf-assisted@T1``)."""
    return system if temperature == 0 else f"{system}@T{temperature:g}"


def split_variant(name: str) -> tuple:
    """Inverse of :func:`variant_name`: ``"dspark-lm@T1"`` -> ``("dspark-lm", 1.0)``."""
    base, sep, t = name.partition("@T")
    return (base, float(t)) if sep else (name, 0.0)


def reference_for(variant: str, ref: str) -> str:
    """The reference a variant's ratios use: the same reference system at the same temperature."""
    return variant_name(ref, split_variant(variant)[1])


# --------------------------------------------------------------------------------------------
# pure helpers (unit-tested in tests/test_compare_report.py)


def first_divergence(a, b) -> int | None:
    """None when the token lists are identical, else the first index where they differ (the
    shorter length when one is a proper prefix of the other)."""
    a, b = list(a), list(b)
    if a == b:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def interleave(per_dataset: dict) -> list:
    """Round-robin over datasets: [(dataset, index_in_split, text), ...] alternating datasets."""
    out, k = [], 0
    while any(k < len(v) for v in per_dataset.values()):
        for ds, prompts in per_dataset.items():
            if k < len(prompts):
                out.append((ds, k, prompts[k]))
        k += 1
    return out


def rotate(seq: list, c: int) -> list:
    """``seq`` rotated left by c (the system order of chunk c)."""
    if not seq:
        return []
    c %= len(seq)
    return list(seq[c:]) + list(seq[:c])


def position_counts_from_dspark(accepted_by_position, draft_length_histogram) -> tuple:
    """(tries, hits) per draft position from DSpark stats: a round with verify length ell tried
    positions 0..ell-1, so tries[k] = rounds with ell > k; hits[k] = fraction[k] * tries[k]."""
    hist = {int(k): int(v) for k, v in (draft_length_histogram or {}).items()}
    n = len(accepted_by_position or [])
    tries = [sum(v for ell, v in hist.items() if ell > k) for k in range(n)]
    hits = [int(round(f * t)) for f, t in zip(accepted_by_position, tries)]
    return tries, hits


def add_correctness(rows: list, greedy: bool = True) -> None:
    """Set ``vs_<ref>`` on every greedy row: None (identical), the first differing position, or
    absent when the reference has no row for that prompt. Only meaningful greedy: sampled variants
    (``name@T...``) get nothing, and ``greedy=False`` (an old single-temperature sampled run)
    checks nothing."""
    if not greedy:
        return
    ref = {(r["system"], r["key"]): r["token_ids"] for r in rows if r.get("token_ids") is not None}
    for r in rows:
        if r.get("token_ids") is None or split_variant(r["system"])[1] != 0:
            continue
        for name in REFERENCES:
            other = ref.get((name, r["key"]))
            if other is not None:
                r[f"vs_{name}"] = first_divergence(r["token_ids"], other)
        sysdef = SYSTEMS.get(r["system"])
        if sysdef is not None and sysdef.baseline:
            other = ref.get((sysdef.baseline, r["key"]))
            if other is not None:
                r["vs_baseline"] = first_divergence(r["token_ids"], other)


def _sum(rows, k):
    return sum(r[k] for r in rows if r.get(k) is not None)


def aggregate(rows: list) -> dict:
    """Summary of one system's rows (one dataset or all): tokens/s as total decode tokens / total
    decode time (not a mean of rates); tau weighted by rounds; acceptance as accepted / proposed."""
    ok = [r for r in rows if not r.get("error")]
    out = {"n": len(ok), "errors": len(rows) - len(ok)}
    if not ok:
        return out
    dt, ds = _sum(ok, "decode_tokens"), _sum(ok, "decode_s")
    out["new_tokens_mean"] = statistics.mean(r["new_tokens"] for r in ok)
    out["tokens_per_second"] = dt / ds if ds > 0 and dt > 0 else None
    total_s = sum(r["ttft_ms"] / 1e3 + r["decode_s"] for r in ok)
    out["e2e_tokens_per_second"] = sum(r["new_tokens"] for r in ok) / total_s if total_s > 0 else None
    out["ttft_ms_median"] = statistics.median(r["ttft_ms"] for r in ok)
    spec = [r for r in ok if r.get("rounds")]
    if spec:
        rounds = _sum(spec, "rounds")
        out["tau"] = sum(r["tau"] * r["rounds"] for r in spec) / rounds
        prop = _sum(spec, "proposed")
        out["acceptance_rate"] = _sum(spec, "accepted") / prop if prop else None
        m = max(len(r.get("pos_tries") or []) for r in spec)
        tries = [sum((r.get("pos_tries") or [])[k] for r in spec if k < len(r.get("pos_tries") or [])) for k in range(m)]
        hits = [sum((r.get("pos_hits") or [])[k] for r in spec if k < len(r.get("pos_hits") or [])) for k in range(m)]
        out["acceptance_by_position"] = [h / t if t else None for h, t in zip(hits, tries)]
        out["position_tries"] = tries
    for name in REFERENCES + ("baseline",):
        cmp = [r for r in ok if f"vs_{name}" in r]
        if cmp:
            out[f"identical_to_{name}"] = sum(r[f"vs_{name}"] is None for r in cmp)
            out[f"compared_to_{name}"] = len(cmp)
    rss = [r["peak_rss_mb"] for r in ok if r.get("peak_rss_mb") is not None]
    if rss:
        out["peak_rss_mb"] = max(rss)
    return out


def summarize(rows: list, systems: list, datasets: list) -> dict:
    """{"by_dataset": {ds: {system: agg}}, "all": {system: agg}} with ratios to hf and
    dspark-target (same dataset, same temperature: ``hf@T1`` for ``dspark-lm@T1``) added as
    ``ratio_to_<ref>``."""
    def block(sel):
        res = {s: aggregate([r for r in sel if r["system"] == s]) for s in systems}
        for s, a in res.items():
            for ref in REFERENCES:
                for key, name in (("tokens_per_second", "ratio"), ("e2e_tokens_per_second", "e2e_ratio")):
                    base = res.get(reference_for(s, ref), {}).get(key)
                    if base and a.get(key):
                        a[f"{name}_to_{ref}"] = a[key] / base
        return res

    return {"by_dataset": {ds: block([r for r in rows if r["dataset"] == ds]) for ds in datasets},
            "all": block(rows)}


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def _la(v):
    return "?" if not v else "/".join(f"{x:.2f}" for x in v)


def _ident(a, ref):
    if f"compared_to_{ref}" not in a:
        return "–"
    return f"{a[f'identical_to_{ref}']}/{a[f'compared_to_{ref}']}"


def table(block: dict, systems: list, with_memory: bool = False, loads: dict | None = None,
          sizes: dict | None = None) -> str:
    """A markdown table of one summary block ({system: agg}); ``with_memory`` adds peak RSS, the
    median load time (``loads``, seconds) and the bytes of the model files loaded (``sizes``)."""
    head = ["system", "n", "new tok (mean)", "decode tok/s", "× hf", "× dspark-target", "e2e tok/s", "e2e × hf",
            "tau", "acceptance", "TTFT ms (median)", "= hf", "= dspark-target", "= dspark-fp32", "= own baseline"]
    if with_memory:
        head += ["peak RSS GB", "load s (median)", "model GB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    for s in systems:
        a = block.get(s, {})
        if not a.get("n"):
            lines.append("| " + " | ".join([s, "0"] + ["–"] * (len(head) - 2)) + " |")
            continue
        cells = [s, str(a["n"]) + (f" ({a['errors']} failed)" if a.get("errors") else ""),
                 _f(a.get("new_tokens_mean"), "{:.1f}"), _f(a.get("tokens_per_second")),
                 _f(a.get("ratio_to_hf"), "{:.2f}×"), _f(a.get("ratio_to_dspark-target"), "{:.2f}×"),
                 _f(a.get("e2e_tokens_per_second")), _f(a.get("e2e_ratio_to_hf"), "{:.2f}×"),
                 _f(a.get("tau")), _f(a.get("acceptance_rate"), "{:.0%}"), _f(a.get("ttft_ms_median"), "{:.0f}"),
                 _ident(a, "hf"), _ident(a, "dspark-target"), _ident(a, "dspark-fp32"), _ident(a, "baseline")]
        if with_memory:
            load, size = (loads or {}).get(s), (sizes or {}).get(s)
            cells += [_f(a.get("peak_rss_mb") / 1024 if a.get("peak_rss_mb") else None), _f(load, "{:.1f}"),
                      _f(size / 1e9 if size else None)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def worker_loads(result: dict) -> dict:
    """{system: median model-load seconds over its workers}."""
    loads = {}
    for s in result["settings"]["systems"]:
        v = [w["load_s"] for w in result.get("workers", []) if w.get("system") == s and w.get("load_s") is not None]
        if v:
            loads[s] = statistics.median(v)
    return loads


def worker_sizes(result: dict) -> dict:
    """{system: bytes of the model files its workers loaded} (the largest figure reported)."""
    sizes = {}
    for w in result.get("workers", []):
        if w.get("model_bytes"):
            sizes[w["system"]] = max(sizes.get(w["system"], 0), int(w["model_bytes"]))
    return sizes


def render_report(result: dict, plots: list | None = None) -> str:
    """REPORT.md text from a compare.json object (settings, summary, rows, workers)."""
    st, summ, rows = result["settings"], result["summary"], result["rows"]
    systems, datasets = st["systems"], st["datasets"]
    loads = worker_loads(result)
    temps = st.get("temperatures", [st.get("temperature", 0.0)])
    mode = ", ".join("greedy" if t == 0 else f"temperature {t:g} (variants `name@T{t:g}`, top-k/top-p off, seed "
                     f"{st['seed']} + prompt number; ratios are to `hf@T{t:g}` / `dspark-target@T{t:g}`)"
                     for t in temps)
    out = [f"# DSpark vs transformers on {st['target_name']}", "",
           f"Run {result.get('date', '?')} on {result.get('machine', '?')}; {st['threads']} threads "
           f"(torch.set_num_threads / ORT intra-op); load average at start {_la(result.get('loadavg_start'))}, "
           f"at end {_la(result.get('loadavg_end'))}; {_f(result.get('wall_s'), '{:.0f}')} s in all.", "",
           f"- target: `{st['target_name']}`, draft: `{st['draft_name']}`"
           + (f", engine: `{st['engine']}`" if st.get("engine") else "")
           + (f"; peers from `{st['peer_models']['peer_dir']}` (target GGUF `{Path(st['peer_models']['target_gguf']).name}`"
              f", draft GGUF `{Path(st['peer_models']['draft_gguf']).name}`, llama.cpp n_ctx {st.get('peer_n_ctx')})"
              if st.get("peer_models") else ""),
           f"- prompts: first {st['n']} of the evaluation split of each of {', '.join(datasets)} "
           f"(dspark_export/data/prompts/README.md), first turn, chat template; {len({r['key'] for r in rows})} prompts",
           f"- {st['max_new_tokens']} new tokens max, {mode}; one worker process per (chunk of {st['chunk']} "
           "prompts, system), one at a time, system order rotated per chunk",
           f"- transformers {st.get('versions', {}).get('transformers', '?')}, torch "
           f"{st.get('versions', {}).get('torch', '?')} (fp32, eager, attention "
           f"`{st.get('hf_attn_implementation', '?')}`), onnxruntime {st.get('versions', {}).get('onnxruntime', '?')}",
           f"- command: `{result.get('command', '')}`", ""]
    pc = result.get("prompt_check", {})
    if pc:
        if pc.get("hf_only"):
            out.append(f"Prompt token ids: from the HF chat template for all {pc['n']} prompts (no DSpark system in "
                       "this run to cross-check them); every peer is fed these ids.")
        elif pc.get("all_identical"):
            out.append(f"Prompt token ids: HF chat template and DSpark give identical ids for all "
                       f"{pc['n']} prompts.")
        else:
            out.append(f"**Prompt token ids differ** between HF and DSpark for: {', '.join(pc.get('mismatched', []))}.")
        out.append("")
    desc = st.get("descriptions", {})
    if desc:
        out += ["Systems:", ""] + [f"- `{v}`: {desc.get(split_variant(v)[0], '?')}" for v in systems] + [""]
    if st.get("peer_versions"):
        out += ["Peers: " + "; ".join(f"{k} {v}" for k, v in sorted(st["peer_versions"].items())), ""]
    out += ["## All prompts", "", table(summ["all"], systems, with_memory=True, loads=loads,
                                        sizes=worker_sizes(result)), ""]
    for ds in datasets:
        out += [f"## {ds}", "", table(summ["by_dataset"].get(ds, {}), systems), ""]
    divs = [r for r in rows if any(r.get(f"vs_{ref}") is not None for ref in REFERENCES + ("baseline",))]
    out += ["## Output identity", ""]
    greedy_variants = [v for v in systems if split_variant(v)[1] == 0]
    if not greedy_variants:
        out.append("Sampled run: outputs are not expected to match; no identity check.")
    elif not divs:
        out.append("Every greedy system's output is token-for-token identical to `hf` and `dspark-target` (and to "
                   "its own baseline, for the peers) on every prompt compared."
                   + (" Sampled variants are not compared token for token (different random streams)."
                      if len(greedy_variants) < len(systems) else ""))
    else:
        def cell(r, k):
            return _f(r.get(k), "{}", "same") if k in r else "–"

        out.append("| prompt | system | first diff vs hf | first diff vs dspark-target | first diff vs own baseline "
                   "| new tokens |")
        out.append("|---|---|---:|---:|---:|---:|")
        for r in divs:
            out.append(f"| {r['key']} | {r['system']} | {cell(r, 'vs_hf')} | {cell(r, 'vs_dspark-target')} | "
                       f"{cell(r, 'vs_baseline')} | {r['new_tokens']} |")
        if any(SYSTEMS.get(r["system"]) and SYSTEMS[r["system"]].peer for r in divs):
            out += ["", "The peers run other weights (llama.cpp: the Q4_K_M GGUF itself; ort-genai: its builder's "
                    "int4 quantization of the fp32 checkpoint), so their greedy outputs part from the fp32 systems "
                    "at near-ties; a peer's speculative variant is expected to match its own baseline (same "
                    "weights), up to the batch-size dependence of its kernels."]
    ws = [w for w in result.get("workers", []) if w.get("cpu_s") is not None and w.get("wall_s")]
    if ws:
        thr = st.get("threads") or 1
        low = [w for w in ws if w["cpu_s"] / (w["wall_s"] * thr) < 0.6]
        out += ["", "## Workers", "",
                f"CPU use = CPU seconds of the worker (its children included) / (wall seconds x {thr} threads), load "
                "and warm-up included: near 0.8-1.0 on an idle machine; much lower means other processes took the "
                "cores, and llama.cpp's spinning thread pool in particular then slows down many times over.", "",
                "| system | chunk | wall s | CPU use | load avg (1 min) at end | error |", "|---|---:|---:|---:|---:|---|"]
        for w in ws:
            la = w.get("loadavg") or [None]
            out.append(f"| {w['system']} | {w.get('chunk', '?')} | {w['wall_s']:.0f} | "
                       f"{w['cpu_s'] / (w['wall_s'] * thr):.0%} | {_f(la[0])} | {w.get('error') or ''} |")
        if low:
            out += ["", f"**{len(low)} of {len(ws)} workers ran with under 60% CPU use** "
                    f"({', '.join(sorted({w['system'] for w in low}))}): their figures are not comparable; re-run them "
                    "on an idle machine."]
    errs = [r for r in rows if r.get("error")]
    if errs:
        out += ["", "## Failures", ""] + [f"- {r['system']} {r['key']}: {r['error']}" for r in errs]
    if result.get("notes"):  # the analysis written after the run (--report-only --notes FILE)
        out += ["", result["notes"].strip()]
    if plots:
        out += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    out += ["", "## How to read it", "",
            "- decode tok/s: tokens committed after the first one / wall time after the first commit, summed over "
            "prompts (total tokens / total time). DSpark: `stats.tokens_per_second`. HF: a streamer timestamps "
            "every commit inside the same `generate` call. HF assisted fuses prefill with the first verify round, "
            "so its first commit may hold several tokens; those are excluded from its decode count.",
            "- e2e tok/s: all new tokens / (TTFT + decode time), summed over prompts: the rate a user sees for "
            "the whole request, prefill included; immune to where a system puts its first commit.",
            "- TTFT: request start (tokenized prompt in hand) -> first committed token. HF: from the `generate` "
            "call (its setup included); DSpark: `stats.ttft_ms` (prefill + first token).",
            "- tau: tokens committed per target verify round, bonus included, weighted by rounds (DSpark: prefill "
            "not a round; HF assisted/PLD: the prefill+first-verify call is a round). acceptance: accepted / "
            "proposed draft tokens; rounds where the n-gram lookup found nothing propose 0 and count as rounds.",
            "- HF tau/acceptance are recorded by wrapping the candidate generator's `update_candidate_strategy`, "
            "which transformers calls once per round with the number of candidates and matches.",
            "- peak RSS: max `ru_maxrss` of the system's worker processes (model load included; mmapped weights "
            "count; llama-speculative: its binary's processes). load s: model load + session creation per worker, "
            "excluded from every rate (llama-speculative: per prompt, the process's wall time minus its encode "
            "and decode time). model GB: bytes of the model files the system loads (graphs + weights, GGUF files).",
            "- peers (scripts/peers/): each runs under its own venv and is fed the preflight's prompt token ids. "
            "llama-speculative reports its own encode (prefill, both models) and decode times: TTFT = encode time "
            "(its first token is sampled from the prompt's logits), decode tok/s = (tokens produced - 1) / decode "
            "time; it finishes its last round past the token limit, so its output is cut to the limit for the "
            "identity check. ort-genai-ngram tau counts n-gram lookup misses as rounds that proposed nothing.",
            f"- hf-assisted schedule as resolved: {json.dumps(st.get('hf_assisted_config', {}))}"]
    return "\n".join(out) + "\n"


def make_plots(result: dict, out_dir: Path) -> list:
    """PNG plots (matplotlib Agg); returns the file names written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []
    st, summ, rows = result["settings"], result["summary"], result["rows"]
    systems, datasets = st["systems"], st["datasets"]
    names = []
    # 1. tokens/s per system per dataset (decode, and end to end)
    fig, axes = plt.subplots(2, 1, figsize=(max(10.0, 0.9 * len(datasets + ["all"]) * len(systems) / 3), 7),
                             sharey=True)
    w = 0.8 / max(1, len(systems))
    bases = list(dict.fromkeys(split_variant(v)[0] for v in systems))
    colors = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    groups = datasets + ["all"]
    for ax, key, title in zip(axes, ("tokens_per_second", "e2e_tokens_per_second"), ("decode", "end to end")):
        for i, s in enumerate(systems):
            vals = [(summ["by_dataset"].get(g, {}) if g != "all" else summ["all"]).get(s, {}).get(key) or 0
                    for g in groups]
            base, temp = split_variant(s)  # one colour per system; sampled variants hatched
            ax.bar([j + (i - (len(systems) - 1) / 2) * w for j in range(len(groups))], vals, w, label=s,
                   color=colors[bases.index(base) % len(colors)], hatch="///" if temp else None,
                   edgecolor="white" if temp else None, linewidth=0)
        ax.set_xticks(range(len(groups)), groups, fontsize=8)
        ax.set_title(f"{title} tokens/s", fontsize=10)
    axes[0].set_ylabel("tokens/s")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{st['target_name']}, {st['max_new_tokens']} new tokens max", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_dir / "tokens_per_second.png", dpi=90)
    plt.close(fig)
    names.append("tokens_per_second.png")
    # 2. acceptance by draft position
    have = [s for s in systems if summ["all"].get(s, {}).get("acceptance_by_position")]
    if have:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        for s in have:
            acc = summ["all"][s]["acceptance_by_position"]
            base, temp = split_variant(s)
            ax.plot(range(1, len(acc) + 1), [a if a is not None else float("nan") for a in acc], marker="o", label=s,
                    color=colors[bases.index(base) % len(colors)], linestyle="--" if temp else "-")
        ax.set_xlabel("draft position")
        ax.set_ylabel("fraction of rounds accepted")
        ax.set_ylim(0, 1)
        ax.set_title("acceptance by draft position (all prompts)", fontsize=10)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "acceptance_by_position.png", dpi=90)
        plt.close(fig)
        names.append("acceptance_by_position.png")
    # 3. tau distribution over prompts
    taus = {s: [r["tau"] for r in rows if r["system"] == s and r.get("tau") is not None] for s in systems}
    taus = {s: v for s, v in taus.items() if v}
    if taus:
        fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(taus)), 4.2))
        ax.boxplot(list(taus.values()), showmeans=True)
        ax.set_xticks(range(1, len(taus) + 1), list(taus), fontsize=8, rotation=30, ha="right")
        ax.set_ylabel("tau per prompt")
        ax.set_title("tau (tokens per verify round) across prompts", fontsize=10)
        fig.tight_layout()
        fig.savefig(out_dir / "tau_distribution.png", dpi=90)
        plt.close(fig)
        names.append("tau_distribution.png")
    return names


# --------------------------------------------------------------------------------------------
# peers: their venvs and files (scripts/peers/install.sh), refused up front when missing


PEER_WORKER = Path(__file__).resolve().parent / "peers" / "worker.py"


def default_peer_dir() -> Path:
    """``$DSPARK_PEER_DIR``, else ``${DSPARK_CACHE:-~/.cache/dspark}/peers`` (where install.sh puts them)."""
    if os.environ.get("DSPARK_PEER_DIR"):
        return Path(os.environ["DSPARK_PEER_DIR"]).expanduser()
    from dspark_runtime.engine_dir.manifest import cache_root

    return cache_root() / "peers"


def peer_python(peer_dir, peer: str) -> Path:
    return Path(peer_dir) / peer / "venv" / "bin" / "python"


def peer_files(peer_dir, target_name: str) -> dict:
    """The files the peer systems load besides the GGUFs: the llama-speculative binary, the ort-genai model."""
    d = Path(peer_dir)
    return {"llama_speculative": d / "llama-cpp" / "bin" / "llama-speculative",
            "ort_model": d / "ort-genai" / "models" / f"{target_name}-int4"}


def install_command(cmd: str, peer_dir) -> str:
    """``cmd`` with the DSPARK_PEER_DIR that makes install.sh write into ``peer_dir`` when it is not the default."""
    if Path(peer_dir).expanduser().resolve() != default_peer_dir().resolve():
        return f"DSPARK_PEER_DIR={shlex.quote(str(peer_dir))} {cmd}"
    return cmd


def peer_requirements(system: str, peer_dir, target_name: str, draft_name: str, target_gguf, draft_gguf) -> list:
    """[(path that must exist, command that makes it)] for one system ([] for the project's systems)."""
    sd = SYSTEMS[split_variant(system)[0]]
    if sd.peer is None:
        return []
    files = peer_files(peer_dir, target_name)
    need = [(peer_python(peer_dir, sd.peer), install_command(PEER_INSTALL[sd.peer], peer_dir))]
    if sd.backend in ("llama-cpp", "llama-speculative"):
        need.append((Path(target_gguf), f"dspark-export fetch {target_name}"))
    if sd.backend == "llama-speculative":
        need += [(files["llama_speculative"], install_command(PEER_INSTALL["llama-cpp"], peer_dir)),
                 (Path(draft_gguf), f"dspark-export fetch {draft_name}")]
    if sd.backend == "ort-genai":
        need.append((files["ort_model"] / "genai_config.json",
                     install_command(f"scripts/peers/install.sh ort-genai-model {target_name}", peer_dir)))
    return need


def check_peers(systems: list, peer_dir, target_name: str, draft_name: str, target_gguf, draft_gguf) -> list:
    """One message per system whose peer (venv, binary, model) is missing, with the command that installs it."""
    msgs = []
    for s in systems:
        miss = [(p, cmd) for p, cmd in peer_requirements(s, peer_dir, target_name, draft_name, target_gguf, draft_gguf)
                if not Path(p).exists()]
        if miss:
            msgs.append(f"system {s} needs its peer ({SYSTEMS[split_variant(s)[0]].peer}): "
                        + "; ".join(f"{p} is missing, run `{cmd}`" for p, cmd in miss))
    return msgs


def gguf_for(model_dir: Path, override: str | None = None) -> Path:
    """The GGUF a fetched model was converted from (``<cache>/gguf/<name>.gguf``), or ``override``."""
    if override:
        return Path(override).expanduser().resolve()
    try:
        sys.path.insert(0, str(ROOT))
        from dspark_export.models.fetch import gguf_path

        return gguf_path(model_dir.name)
    except Exception:  # not a known model name: the cache layout by folder name
        return default_peer_dir().parent / "gguf" / f"{model_dir.name}.gguf"


def peer_context(n_prompt_max: int, max_new_tokens: int) -> int:
    """KV context of the llama.cpp peers: the longest prompt + the new tokens + a margin (llama-speculative
    finishes its last round past -n), rounded up to 256, at least 2048; one value for the whole run."""
    need = n_prompt_max + max_new_tokens + 64
    return max(2048, -(-need // 256) * 256)


# --------------------------------------------------------------------------------------------
# resume: every finished (prompt, system) row is appended to <out-dir>/progress.jsonl as it finishes


PROGRESS = "progress.jsonl"
# the settings a resumed run must share with the interrupted one
FINGERPRINT_KEYS = ("target", "draft_name", "engine", "datasets", "n", "max_new_tokens", "temperatures", "seed",
                    "chunk", "threads", "systems", "system_options", "peer_models")


def fingerprint(settings: dict, prompts: list) -> dict:
    """What must match for --resume: the settings above and the prompts themselves (keys and texts)."""
    fp = {k: settings.get(k) for k in FINGERPRINT_KEYS}
    fp["prompts"] = hashlib.sha1(json.dumps([[p["key"], p["text"]] for p in prompts]).encode()).hexdigest()
    return json.loads(json.dumps(fp))  # tuples -> lists, as read back from JSON


def fingerprint_mismatch(saved: dict, current: dict) -> list:
    """The keys whose values differ (sorted)."""
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))


def read_progress(path: Path) -> dict:
    """{"fingerprint", "rows" (the last row of each (system, key), errors included), "workers" (tag -> meta)}
    from a progress file; a torn last line (killed mid-write) is ignored."""
    fp, rows, workers = None, {}, {}
    for line in Path(path).read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "fingerprint" in obj:
            fp = obj["fingerprint"]
        elif "row" in obj:
            r = obj["row"]
            rows[(r["system"], r["key"])] = {**r, "_tag": obj.get("tag")}
        elif "worker" in obj:
            workers[obj.get("tag")] = obj["worker"]
    return {"fingerprint": fp, "rows": rows, "workers": workers}


def done_rows(progress: dict) -> list:
    """The finished rows (no error) of a progress file, their peak RSS set from their worker when it finished."""
    out = []
    for r in progress["rows"].values():
        if r.get("error"):
            continue
        r = dict(r)
        w = progress["workers"].get(r.pop("_tag", None))
        if w and w.get("peak_rss_mb") is not None:
            r["peak_rss_mb"] = w["peak_rss_mb"]
        out.append(r)
    return out


def schedule(chunks: list, systems: list, done: set) -> list:
    """[(chunk number, system, prompts of that chunk not yet done by that system)], in run order: for chunk c
    the systems rotated by c, as a fresh run; (chunk, system) pairs with nothing left are dropped."""
    plan = []
    for c, chunk in enumerate(chunks):
        for s in rotate(systems, c):
            todo = [p for p in chunk if (s, p["key"]) not in done]
            if todo:
                plan.append((c, s, todo))
    return plan


def open_progress(out_dir: Path, fp: dict, resume: bool) -> tuple:
    """(path, finished rows, worker metas) of the run's progress file. ``resume``: the file's fingerprint must
    equal ``fp`` (SystemExit naming the differing settings otherwise); a missing file starts afresh. Without
    ``resume`` an existing file is moved aside (progress.<time>.jsonl) and a new one started."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PROGRESS
    if resume and path.is_file():
        prog = read_progress(path)
        if prog["fingerprint"] is None:
            raise SystemExit(f"error: {path} has no settings line; cannot resume from it (move it away to start afresh)")
        bad = fingerprint_mismatch(prog["fingerprint"], fp)
        if bad:
            detail = "; ".join(f"{k}: was {json.dumps(prog['fingerprint'].get(k))[:120]}, now "
                               f"{json.dumps(fp.get(k))[:120]}" for k in bad)
            raise SystemExit(f"error: --resume with other settings than the run in {path}: {detail}. Re-run with the "
                             "same settings, or drop --resume to start a new run (the old progress file is kept aside)")
        rows = done_rows(prog)
        return path, rows, [w for w in prog["workers"].values()]
    if resume:
        print(f"--resume: no {path}; starting a new run", file=sys.stderr)
    elif path.is_file():
        aside = out_dir / f"progress.{time.strftime('%Y%m%d-%H%M%S', time.localtime(path.stat().st_mtime))}.jsonl"
        path.rename(aside)
        print(f"moved the previous run's {path.name} to {aside.name} (use --resume to continue a run)", file=sys.stderr)
    with open(path, "w") as f:
        f.write(json.dumps({"fingerprint": fp}) + "\n")
    return path, [], []


def append_progress(path: Path, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------
# workers (run in their own process: ``compare.py --worker job.json``)


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


class _TimingStreamer:
    """transformers streamer that timestamps every commit; the first put() is the prompt."""

    def __init__(self):
        self.prompt_seen = False
        self.commits = []  # (perf_counter, tokens)

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.commits.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


def _hf_worker(job: dict, emit) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(job["threads"])
    opts = job["options"]
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(job["target"])
    model = AutoModelForCausalLM.from_pretrained(job["target"], dtype=torch.float32).eval()
    assistant = None
    if opts.get("assistant"):
        assistant = AutoModelForCausalLM.from_pretrained(job["draft"], dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0

    rounds: list = []
    orig = model._get_candidate_generator

    def recording_generator(*a, **k):  # one per generate call; record (proposed, accepted) per round
        cg = orig(*a, **k)
        upd = cg.update_candidate_strategy

        def update(input_ids, scores, num_matches):
            rounds.append((int(scores.shape[1]) - 1, int(num_matches)))
            return upd(input_ids, scores, num_matches)

        cg.update_candidate_strategy = update
        return cg

    model._get_candidate_generator = recording_generator
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else tok.pad_token_id

    def encode(text):
        return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False))

    def run(ids, max_new, seed):
        kw = dict(max_new_tokens=max_new, pad_token_id=pad)
        if job["temperature"] > 0:
            kw.update(do_sample=True, temperature=job["temperature"], top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kw.update(do_sample=False)
        if assistant is not None:
            kw["assistant_model"] = assistant
        if opts.get("prompt_lookup_num_tokens"):
            kw["prompt_lookup_num_tokens"] = opts["prompt_lookup_num_tokens"]
        kw.update(opts.get("generate_kwargs", {}))
        x = torch.tensor([ids], dtype=torch.long)
        streamer = _TimingStreamer()
        rounds.clear()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), streamer=streamer, **kw)
        t_end = time.perf_counter()
        return out[0, len(ids):].tolist(), t, t_end, streamer.commits, list(rounds)

    t1 = time.perf_counter()
    run(encode(WARMUP_PROMPT), 8, 0)
    warmup_s = time.perf_counter() - t1
    folders = [Path(job["target"])] + ([Path(job["draft"])] if assistant is not None else [])
    meta = {"load_s": load_s, "warmup_s": warmup_s,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "model_bytes": sum(f.stat().st_size for d in folders for f in d.glob("*.safetensors"))}
    if assistant is not None:  # the schedule transformers resolves for the assistant (its defaults)
        ag = assistant.generation_config
        d = ag._get_default_generation_params()
        meta["hf_assisted_config"] = {k: getattr(ag, k, None) if getattr(ag, k, None) is not None else d.get(k)
                                      for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                                "assistant_confidence_threshold")}
        try:
            import sklearn  # noqa: F401  (transformers adapts the confidence threshold only with it)

            meta["hf_assisted_config"]["threshold_adaptation"] = True
        except ImportError:
            meta["hf_assisted_config"]["threshold_adaptation"] = False
    for p in job["prompts"]:
        ids = encode(p["text"])
        new, t, t_end, commits, rnds = run(ids, job["max_new_tokens"], p["seed"])
        row = {"prompt_tokens": len(ids), "prompt_digest": ids_digest(ids), "token_ids": new,
               "new_tokens": len(new)}
        if commits:
            t_first, n_first = commits[0]
            row["ttft_ms"] = (t_first - t) * 1e3
            row["decode_tokens"] = len(new) - n_first
            row["decode_s"] = t_end - t_first
        else:
            row.update(ttft_ms=(t_end - t) * 1e3, decode_tokens=0, decode_s=0.0)
        ok = row["decode_tokens"] > 0 and row["decode_s"] > 0
        row["tokens_per_second"] = row["decode_tokens"] / row["decode_s"] if ok else None
        if opts.get("assistant") or opts.get("prompt_lookup_num_tokens"):
            row.update(round_stats(rnds))
        emit(p, row)
    return meta


def _dspark_worker(job: dict, emit) -> dict:
    sys.path.insert(0, str(ROOT))
    from dspark_runtime import Engine

    opts = job["options"]
    t0 = time.perf_counter()
    from dspark_runtime.backends.ort import shared_pool_default

    eng = Engine.load(opts.get("engine") or job["engine"], threads=job["threads"],
                      shared_thread_pool=shared_pool_default())
    draft = opts.get("draft")
    eng.batch(draft=draft, max_batch=1)  # activates the target and draft sessions, so their creation is load time
    load_s = time.perf_counter() - t0
    kw = dict(temperature=job["temperature"], draft=draft, draft_length=opts.get("draft_length"))
    t1 = time.perf_counter()
    eng.generate(WARMUP_PROMPT, max_new_tokens=8, seed=0, **kw)
    warmup_s = time.perf_counter() - t1
    for p in job["prompts"]:
        ids = eng.encode_prompt(p["text"])
        r = eng.generate(p["text"], max_new_tokens=job["max_new_tokens"], seed=p["seed"], **kw)
        s = r.stats
        row = {"prompt_tokens": len(ids), "prompt_digest": ids_digest(ids), "token_ids": list(r.token_ids),
               "new_tokens": len(r.token_ids), "ttft_ms": s.ttft_ms, "decode_tokens": max(0, len(r.token_ids) - 1),
               "decode_s": s.decode_ms / 1e3, "tokens_per_second": s.tokens_per_second if len(r.token_ids) > 1 else None}
        if draft is not None:
            tries, hits = position_counts_from_dspark(s.accepted_by_position, s.draft_length_histogram)
            row.update(rounds=s.num_rounds, proposed=s.proposed, accepted=s.accepted, tau=s.accepted_length_mean,
                       acceptance_rate=s.acceptance_rate if s.proposed else None, pos_tries=tries, pos_hits=hits)
        emit(p, row)
    return {"load_s": load_s, "warmup_s": warmup_s, "model_bytes": _engine_bytes(eng, draft)}


def _engine_bytes(eng, draft) -> int | None:
    """Bytes of the engine files a DSpark system loads: the target graph, the draft LM or DSpark drafter
    graph its draft uses, and the drafter's heads file."""
    try:
        keys = set(eng.graphs_used(draft))
        total = sum(f.size for k in keys for f in eng.manifest.graphs[k].files)
        ds = eng.manifest.speculation.dspark
        heads = ds.heads_file if ds is not None and eng.dspark_graph in keys else None
        if heads and (eng.dir / heads).is_file():
            total += (eng.dir / heads).stat().st_size
        return total
    except Exception:  # an engine layout this helper does not know: no figure rather than a wrong one
        return None


def _tokenize_worker(job: dict, emit) -> dict:
    """Preflight: prompt ids from the HF tokenizer's chat template and from the DSpark engine (when a DSpark
    system runs; ``job["engine"]`` None otherwise), and the rendered chat-template text (llama-speculative)."""
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(job["target"])
    eng = None
    if job.get("engine"):
        from dspark_runtime import Engine

        eng = Engine.load(job["engine"], threads=1)
    for p in job["prompts"]:
        msgs = [{"role": "user", "content": p["text"]}]
        hf = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ds = eng.encode_prompt(p["text"]) if eng is not None else hf
        row = {"hf_ids": hf, "dspark_ids": ds, "first_diff": first_divergence(hf, ds), "rendered": rendered}
        emit(p, row)
    versions = {}
    for mod in ("transformers", "torch", "onnxruntime", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    manifest = {k: getattr(g, "model_id", None) for k, g in eng.manifest.graphs.items()} if eng is not None else {}
    return {"versions": versions, "engine_models": manifest}


def worker_main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    out = open(job["out"], "w")

    def emit(p, row):
        row = {"system": job["system"], "dataset": p["dataset"], "index": p["index"], "key": p["key"], **row}
        out.write(json.dumps(row) + "\n")
        out.flush()
        if job.get("progress"):  # the run's resume file: this (prompt, system) is done
            append_progress(Path(job["progress"]), {"row": {**row, "peak_rss_mb": _peak_rss_mb()}, "tag": job.get("tag")})
        if job["backend"] != "tokenize":
            tps = row.get("tokens_per_second")
            tau = row.get("tau")
            print(f"  {job['system']:14} {p['key']:14} {row['new_tokens']:4d} tok  "
                  f"{tps if tps is not None else float('nan'):7.2f} tok/s  ttft {row['ttft_ms']:7.0f} ms"
                  + (f"  tau {tau:.2f}" if tau is not None else ""), flush=True)

    fn = {"hf": _hf_worker, "dspark": _dspark_worker, "tokenize": _tokenize_worker}[job["backend"]]
    meta = fn(job, emit)
    meta["peak_rss_mb"] = _peak_rss_mb()
    meta["loadavg"] = loadavg()  # ~threads when the worker had the machine to itself
    meta["cpu_s"] = _cpu_s()
    out.write(json.dumps({"meta": meta}) + "\n")
    out.close()
    return 0


def run_worker(job: dict, tmp: Path, tag: str) -> tuple:
    """Run one worker subprocess to completion; returns (rows, meta, error or None). A peer system's worker
    is scripts/peers/worker.py under the peer's own python (``job["python"]``)."""
    jp = tmp / f"{tag}.json"
    job["out"] = str(tmp / f"{tag}.out.jsonl")
    job["tag"] = tag
    jp.write_text(json.dumps(job))
    argv = ([job["python"], str(PEER_WORKER), str(jp)] if job.get("python")
            else [sys.executable, str(Path(__file__).resolve()), "--worker", str(jp)])
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    t = time.perf_counter()
    err_log = tmp / f"{tag}.stderr.txt"  # library warnings; its tail is shown when the worker fails
    with open(err_log, "w") as ef:
        proc = subprocess.run(argv, env=env, stdout=sys.stderr, stderr=ef)
    rows, meta = [], {}
    if Path(job["out"]).is_file():
        for line in Path(job["out"]).read_text().splitlines():
            obj = json.loads(line)
            if "meta" in obj:
                meta = obj["meta"]
            else:
                rows.append(obj)
    meta["wall_s"] = time.perf_counter() - t
    err = None
    if proc.returncode != 0:
        tail = err_log.read_text(errors="replace").strip().splitlines()[-15:]
        err = f"worker exited {proc.returncode}: " + (tail[-1] if tail else "")
        print("\n".join(tail), file=sys.stderr)
    return rows, meta, err


# --------------------------------------------------------------------------------------------
# driver


def resolve_model(arg: str) -> Path:
    p = Path(arg)
    if p.is_dir():
        return p.resolve()
    sys.path.insert(0, str(ROOT))
    from dspark_export.models.fetch import model_path

    try:
        q = model_path(arg)
    except Exception as e:  # FetchError: unknown name
        raise SystemExit(f"error: {arg!r} is neither a folder nor a known model name ({e})")
    if not q.is_dir():
        raise SystemExit(f"error: model {arg!r} is not fetched ({q} missing); run `dspark-export fetch {arg}`")
    return q


def write_outputs(result: dict, out_dir: Path, final: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    head = {k: v for k, v in result.items() if k != "rows"}
    text = json.dumps(head, indent=1)[:-2] + ',\n "rows": [\n' + ",\n".join(
        "  " + json.dumps(r, separators=(",", ":")) for r in rows) + "\n ]\n}\n"
    (out_dir / "compare.json").write_text(text)
    if final:
        plots = make_plots(result, out_dir)
        (out_dir / "REPORT.md").write_text(render_report(result, plots))


def peer_job_fields(system: str, settings: dict, peer_dir: Path) -> dict:
    """What a peer system's worker job needs besides the common fields: its python and its files."""
    sd = SYSTEMS[split_variant(system)[0]]
    if sd.peer is None:
        return {}
    pm = settings["peer_models"]
    return {"python": str(peer_python(peer_dir, sd.peer)), "target_gguf": pm["target_gguf"],
            "draft_gguf": pm["draft_gguf"], "llama_speculative": pm["llama_speculative"],
            "ort_model": pm["ort_model"], "n_ctx": settings["peer_n_ctx"]}


def run_schedule(plan: list, chunks: list, result: dict, make_job, run, progress: Path, out_dir: Path,
                 t_start: float) -> None:
    """Run every (chunk, system, prompts) of ``plan`` (see :func:`schedule`), one worker at a time, appending
    rows and worker records to ``result`` and the worker record to the progress file. ``make_job(system,
    prompts)`` builds the job; ``run(job, tag)`` runs it and returns (rows, meta, error)."""
    settings = result["settings"]
    for c, s, todo in plan:
        print(f"[chunk {c + 1}/{len(chunks)}] {s}: {len(todo)} prompts "
              f"({time.perf_counter() - t_start:.0f} s elapsed)", file=sys.stderr, flush=True)
        tag = f"c{c}-{s}"
        rows, meta, err = run(make_job(s, todo), tag)
        for r in rows:
            r["peak_rss_mb"] = meta.get("peak_rss_mb", r.get("peak_rss_mb"))
        done = {r["key"] for r in rows}
        rows += [{"system": s, "dataset": p["dataset"], "index": p["index"], "key": p["key"], "error": err
                  or "no result"} for p in todo if p["key"] not in done]
        result["rows"] += rows
        worker = {"system": s, "chunk": c, "tag": tag, **meta, "error": err}
        result["workers"].append(worker)
        append_progress(progress, {"worker": worker, "tag": tag})
        if "hf_assisted_config" in meta:
            settings["hf_assisted_config"] = meta["hf_assisted_config"]
        if meta.get("attn_implementation"):
            settings["hf_attn_implementation"] = meta["attn_implementation"]
        if meta.get("versions") and SYSTEMS[split_variant(s)[0]].peer:
            for k, v in meta["versions"].items():
                settings.setdefault("peer_versions", {})[k] = v if isinstance(v, str) else " ".join(map(str, v))
        if result.get("sessions"):
            result["sessions"][-1]["wall_s"] = time.perf_counter() - t_start
        write_outputs(result, out_dir, final=False)  # partial results survive a crash


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="fetched model name or HF folder")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                    help="fetched model name or HF folder (hf-assisted; its GGUF: llama-speculative's -md)")
    ap.add_argument("--engine", default="engines/qwen2.5-coder-1.5b", help="DSpark engine directory of the same target")
    ap.add_argument("--datasets", default="humaneval,mbpp,gsm8k,mt-bench")
    ap.add_argument("--n", type=int, default=3, help="prompts per dataset (first N of its evaluation split)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--systems", default=",".join(s for s in SYSTEMS if SYSTEMS[s].peer is None),
                    help=f"comma list of: {', '.join(SYSTEMS)} (default: the project's and transformers' systems; "
                         "the peers need scripts/peers/install.sh)")
    ap.add_argument("--temperature", default="0", help="comma list; 0 = greedy (default); '0,1.0' runs every "
                    "system greedy and at temperature 1.0 (variant name@T1) interleaved in one run")
    ap.add_argument("--sampled-systems", default=None, help="comma list: the systems to run at the non-zero "
                    "temperatures (default: all of --systems but the peers, which run greedy only)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed base (prompt number added)")
    ap.add_argument("--chunk", type=int, default=4, help="prompts per worker process (interleaving granularity)")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    ap.add_argument("--lm-draft-length", type=int, default=None, help="override dspark-lm gamma (3)")
    ap.add_argument("--ngram-draft-length", type=int, default=None, help="override dspark-ngram gamma (4)")
    ap.add_argument("--pld-tokens", type=int, default=None, help="override hf-pld prompt_lookup_num_tokens (10)")
    ap.add_argument("--peer-dir", default=None, help="where scripts/peers/install.sh put the peers (default "
                    "$DSPARK_PEER_DIR or ${DSPARK_CACHE:-~/.cache/dspark}/peers)")
    ap.add_argument("--target-gguf", default=None, help="the llama.cpp peers' target GGUF (default: the GGUF "
                    "--target was fetched as, <cache>/gguf/<name>.gguf)")
    ap.add_argument("--draft-gguf", default=None, help="llama-speculative's draft GGUF (default: --draft's)")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out-dir (its progress.jsonl): "
                    "pairs (prompt, system) already done are skipped; the settings must be the same")
    ap.add_argument("--out-dir", default=str(ROOT / "scripts" / "results" / "compare"))
    ap.add_argument("--report-only", action="store_true", help="rebuild REPORT.md + plots from --out-dir/compare.json")
    ap.add_argument("--notes", default=None, help="with --report-only: a markdown file (the analysis of the run) "
                    "stored in compare.json and placed in REPORT.md after the tables")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker_main(a.worker)
    out_dir = Path(a.out_dir)
    if a.report_only:
        result = json.loads((out_dir / "compare.json").read_text())
        if a.notes:
            result["notes"] = Path(a.notes).read_text()
        st = result["settings"]
        add_correctness(result["rows"], greedy="temperatures" in st or st.get("temperature", 0) == 0)
        result["summary"] = summarize(result["rows"], st["systems"], st["datasets"])
        write_outputs(result, out_dir, final=True)
        print(f"wrote {out_dir / 'REPORT.md'}")
        return 0

    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        ap.error(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    try:
        temps = [float(t) for t in a.temperature.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--temperature {a.temperature!r}: give numbers, e.g. 0 or 0,1.0")
    if not temps or any(t < 0 for t in temps) or len(set(temps)) != len(temps):
        ap.error(f"--temperature {a.temperature!r}: give distinct temperatures >= 0, e.g. 0 or 0,1.0")
    sampled = ([s.strip() for s in a.sampled_systems.split(",") if s.strip()] if a.sampled_systems
               else [s for s in systems if not SYSTEMS[s].peer])  # the peers run greedy only
    bad = [s for s in sampled if s not in systems]
    if bad:
        ap.error(f"--sampled-systems {bad} are not in --systems")
    peer_sampled = [s for s in sampled if SYSTEMS[s].peer] if any(t > 0 for t in temps) else []
    if peer_sampled:
        ap.error(f"the peers {peer_sampled} run greedy only; leave them out of --sampled-systems")
    variants = [variant_name(s, t) for t in temps for s in (systems if t == 0 else sampled)]
    datasets = [d.strip() for d in a.datasets.split(",") if d.strip()]
    bad = [d for d in datasets if d not in EVAL_START]
    if bad:
        ap.error(f"unknown dataset(s) {bad}; choose from {', '.join(EVAL_START)}")
    if a.n < 1 or a.max_new_tokens < 1 or a.chunk < 1:
        ap.error("--n, --max-new-tokens and --chunk must be >= 1")
    target = resolve_model(a.target)
    draft = resolve_model(a.draft) if "hf-assisted" in systems else None
    draft_name = draft.name if draft else Path(a.draft).name
    base_systems, systems = systems, variants
    uses_dspark = any(SYSTEMS[s].backend == "dspark" for s in base_systems)
    engine = Path(a.engine).resolve()
    if uses_dspark and not (engine / "manifest.json").is_file():
        raise SystemExit(f"error: {engine} is not an engine directory (no manifest.json); build it first")
    # the peers: refused up front, with the command that installs what is missing
    peer_dir = Path(a.peer_dir).expanduser() if a.peer_dir else default_peer_dir()
    uses_peers = [s for s in base_systems if SYSTEMS[s].peer]
    peer_models = None
    if uses_peers:
        target_gguf = gguf_for(target, a.target_gguf)
        draft_gguf = gguf_for(draft if draft else Path(a.draft), a.draft_gguf)
        msgs = check_peers(uses_peers, peer_dir, target.name, draft_name, target_gguf, draft_gguf)
        if msgs:
            raise SystemExit("error: peer systems not installed (peer dir " + str(peer_dir) + "):\n  "
                             + "\n  ".join(msgs))
        files = peer_files(peer_dir, target.name)
        peer_models = {"peer_dir": str(peer_dir.resolve()), "target_gguf": str(target_gguf),
                       "draft_gguf": str(draft_gguf), "llama_speculative": str(files["llama_speculative"]),
                       "ort_model": str(files["ort_model"])}
    specs = {s: dict(SYSTEMS[s].options) for s in base_systems}
    if a.lm_draft_length and "dspark-lm" in specs:
        specs["dspark-lm"]["draft_length"] = a.lm_draft_length
    if a.ngram_draft_length and "dspark-ngram" in specs:
        specs["dspark-ngram"]["draft_length"] = a.ngram_draft_length
    if a.pld_tokens and "hf-pld" in specs:
        specs["hf-pld"]["prompt_lookup_num_tokens"] = a.pld_tokens

    jobs = interleave({ds: load_prompts(ds, a.n) for ds in datasets})
    prompts = [{"dataset": ds, "index": i, "key": f"{ds}[{i}]", "text": text, "seed": a.seed + k}
               for k, (ds, i, text) in enumerate(jobs)]
    settings = {"target": str(target), "target_name": target.name, "draft": str(draft) if draft else None,
                "draft_name": draft_name, "engine": str(a.engine) if uses_dspark else None,
                "datasets": datasets, "n": a.n, "max_new_tokens": a.max_new_tokens, "temperatures": temps,
                "seed": a.seed, "chunk": a.chunk, "threads": a.threads, "systems": systems,
                "system_options": specs, "split": "evaluation (dspark_export/data/prompts/README.md)",
                "descriptions": {s: SYSTEMS[s].description for s in base_systems}, "peer_models": peer_models}
    command = (shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None
               else shlex.join(["compare.py", *argv]))
    result = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
              "settings": settings, "loadavg_start": loadavg(), "summary": {}, "rows": [], "workers": []}
    la = result["loadavg_start"]
    if la and la[0] > 0.5:
        print(f"WARNING: load average {la[0]:.2f} at start: other processes compete for the CPU. torch's OpenMP "
              "threads slow down badly under contention (HF numbers become meaningless); run on an idle machine.",
              file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="dspark-compare-"))
    base = {"target": str(target), "draft": str(draft) if draft else None, "engine": str(engine),
            "max_new_tokens": a.max_new_tokens, "temperature": 0.0, "threads": a.threads}

    # preflight: identical prompt ids from both chat-template implementations; the peers get these ids
    print(f"{len(prompts)} prompts x {len(systems)} systems; preflight: prompt token ids"
          + (" (HF vs DSpark)" if uses_dspark else " (HF chat template)"), file=sys.stderr)
    rows, meta, err = run_worker({**base, "engine": str(engine) if uses_dspark else None, "system": "tokenize",
                                  "backend": "tokenize", "options": {}, "prompts": prompts}, tmp, "tokenize")
    if err:
        raise SystemExit(f"error: preflight failed: {err}")
    settings["versions"] = meta.get("versions", {})
    settings["engine_models"] = meta.get("engine_models", {})
    mism = [r["key"] for r in rows if r["first_diff"] is not None]
    result["prompt_check"] = {"n": len(rows), "all_identical": not mism, "mismatched": mism,
                              **({} if uses_dspark else {"hf_only": True})}
    if rows and rows[0]["first_diff"] is not None:
        r0 = rows[0]
        result["prompt_check"]["first_prompt"] = {"hf_ids": r0["hf_ids"], "dspark_ids": r0["dspark_ids"]}
        write_outputs(result, out_dir, final=False)
        raise SystemExit(f"error: HF and DSpark chat templates give different prompt ids for {r0['key']} "
                         f"(first difference at {r0['first_diff']}); see {out_dir / 'compare.json'}")
    if mism:
        print(f"WARNING: prompt token ids differ for {mism}", file=sys.stderr)
    em = settings["engine_models"].get("target")
    if em and em != target.name:
        print(f"WARNING: engine target is {em!r}, HF target is {target.name!r}", file=sys.stderr)
    by_key = {r["key"]: r for r in rows}
    for p in prompts:  # the ids every peer is fed (HF chat template; = DSpark's where both were made)
        p["ids"], p["rendered"] = by_key[p["key"]]["hf_ids"], by_key[p["key"]]["rendered"]
    if uses_peers:
        settings["peer_n_ctx"] = peer_context(max(len(p["ids"]) for p in prompts), a.max_new_tokens)

    # resume: the pairs already done are kept; every chunk still runs its remaining systems in rotated order
    fp = fingerprint(settings, prompts)
    progress, old_rows, old_workers = open_progress(out_dir, fp, a.resume)
    result["rows"], result["workers"] = list(old_rows), list(old_workers)
    done = {(r["system"], r["key"]) for r in old_rows}
    chunks = [prompts[i:i + a.chunk] for i in range(0, len(prompts), a.chunk)]
    plan = schedule(chunks, systems, done)
    if a.resume:
        print(f"--resume: {len(done)} of {len(prompts) * len(systems)} (prompt, system) pairs already done; "
              f"{sum(len(t) for _, _, t in plan)} to run", file=sys.stderr)
    prev = out_dir / "compare.json"
    result["sessions"] = (json.loads(prev.read_text()).get("sessions", []) if a.resume and prev.is_file() else [])
    prior_wall = sum(x.get("wall_s") or 0 for x in result["sessions"])
    result["sessions"].append({"date": result["date"], "wall_s": 0.0, "resumed": a.resume,
                               "pairs_run": sum(len(t) for _, _, t in plan)})

    def make_job(s, todo):
        name, temp = split_variant(s)
        return {**base, "system": s, "backend": SYSTEMS[name].backend, "options": specs[name], "temperature": temp,
                "prompts": todo, "progress": str(progress), **peer_job_fields(s, settings, peer_dir)}

    def _terminate(signum, frame):  # SIGTERM as Ctrl-C: subprocess.run then kills the running worker
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    t_start = time.perf_counter()
    run_schedule(plan, chunks, result, make_job, lambda job, tag: run_worker(job, tmp, tag), progress, out_dir,
                 t_start)
    session_wall = time.perf_counter() - t_start
    result["sessions"][-1]["wall_s"] = session_wall
    result["wall_s"] = prior_wall + session_wall

    add_correctness(result["rows"])
    result["summary"] = summarize(result["rows"], systems, datasets)
    result["loadavg_end"] = loadavg()
    write_outputs(result, out_dir, final=True)
    print(table(result["summary"]["all"], systems, with_memory=True, loads=worker_loads(result),
                sizes=worker_sizes(result)))
    print(f"\nwrote {out_dir / 'compare.json'} and {out_dir / 'REPORT.md'} ({session_wall:.0f} s this session)")
    errors = sum(1 for r in result["rows"] if r.get("error"))
    if errors:
        print(f"{errors} prompt runs failed; worker logs kept in {tmp}; `--resume` re-runs them", file=sys.stderr)
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
