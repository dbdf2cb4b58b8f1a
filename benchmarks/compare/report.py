"""Correctness, aggregation and REPORT.md of a comparison run (pure functions of its rows).

Per system: decode tokens/s as total decode tokens / total decode time (prefill excluded), end-to-end tokens/s,
median TTFT, tau (tokens committed per verify round, weighted by rounds), acceptance (accepted / proposed) and by
draft position, peak RSS; ratios to ``hf`` and ``dspark-target`` at the same temperature. Greedy outputs are compared
token for token with ``hf``, ``dspark-target`` and ``dspark-fp32`` (and a peer's own baseline), first divergence kept.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.compare.systems import REFERENCES, SYSTEMS, reference_for, split_variant


def first_divergence(a, b) -> int | None:
    """None when the token lists are identical, else the first index where they differ (the
    shorter length when one is a proper prefix of the other)."""
    a, b = list(a), list(b)
    if a == b:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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
                    "int4 quantization of the fp32 checkpoint; openvino-genai: optimum-intel's int4 export, run "
                    "with OpenVINO's CPU defaults such as a u8 KV cache), so their greedy outputs part from the fp32 "
                    "systems at near-ties; a peer's speculative variant is expected to match its own baseline (same "
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
            "- peers (benchmarks/peers/): each runs under its own venv and is fed the preflight's prompt token ids. "
            "llama-speculative reports its own encode (prefill, both models) and decode times: TTFT = encode time "
            "(its first token is sampled from the prompt's logits), decode tok/s = (tokens produced - 1) / decode "
            "time; it finishes its last round past the token limit, so its output is cut to the limit for the "
            "identity check. ort-genai-ngram tau counts n-gram lookup misses as rounds that proposed nothing. "
            "openvino-genai-pld/-draft: a round is one streamer write after the first; proposed = the positions "
            "OpenVINO verifies per round (num_assistant_tokens, capped near the token limit; a prompt-lookup miss is "
            "padded to it and counts as proposed, not accepted); OpenVINO's own counters are in the rows' ov_stats.",
            f"- hf-assisted schedule as resolved: {json.dumps(st.get('hf_assisted_config', {}))}"]
    return "\n".join(out) + "\n"
