"""Target-only against speculative decoding on one engine, same prompts, modes interleaved per prompt.

Per prompt: tokens/s of both modes, their ratio, tau, acceptance and whether the greedy outputs are identical;
prompts from the evaluation split of humaneval / mt-bench / gsm8k / mbpp. ``--concurrency`` measures the batched
runtime at several concurrency levels instead. Writes results/bench-<engine>.json (results/concurrency-<engine>.json).

    python -m benchmarks.bench --engine engines/qwen2.5-coder-1.5b --humaneval 10 --mt-bench 10
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.evalsets import RESULTS, load_prompts, machine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--humaneval", type=int, default=10)
    ap.add_argument("--mt-bench", type=int, default=10)
    ap.add_argument("--gsm8k", type=int, default=0)
    ap.add_argument("--mbpp", type=int, default=0)
    ap.add_argument("--long", type=int, default=0,
                    help="prompts of benchmarks/data/long-prompts.jsonl (514-988 tokens: time to first token)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-length", default=None, help="gamma for every drafter without its own (an integer >= 1), "
                    "'auto' or 'scheduled' (Algorithm 1; needs `dspark-export profile` on the engine)")
    ap.add_argument("--draft-confidence", type=float, default=None,
                    help="end a draft block after the first draft token below this probability")
    ap.add_argument("--draft", default="lm",
                    help="drafter(s) for the speculative modes, comma-separated: auto (what `dspark generate` "
                         "runs by default), dspark, lm, ngram, router, each "
                         "optionally with its own draft length (dspark:scheduled, lm:3); each runs on every "
                         "prompt next to the same target-only run. none: target-only (NAME/none: another "
                         "engine's target-only against this one's, a before/after of two builds)")
    ap.add_argument("--engine-as", action="append", default=[], metavar="NAME=DIR",
                    help="another engine of the same target (e.g. one holding an older DSpark drafter), loaded beside "
                         "--engine; a --draft entry NAME/dspark:7 runs on it, against --engine's target-only run "
                         "(the outputs must still equal it). Repeatable")
    ap.add_argument("--prompts", action="append", default=[], metavar="[NAME=]PLACE",
                    help="where an engine runs prompt chunks (Engine.load(prompts=...): auto, target, prompt-graph, "
                         "openvino): PLACE for --engine, NAME=PLACE for an --engine-as engine. Repeatable")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--show-text", action="store_true", help="print each speculative completion")
    ap.add_argument("--out", default=None, help="JSON output path (default results/bench-<engine>.json)")
    ap.add_argument("--concurrency", default=None,
                    help="batched mode: comma-separated concurrency levels (e.g. 1,2,4,8); the same prompts run "
                         "through the batched runtime with at most that many requests at once, for each of "
                         "--configs, interleaved; writes results/concurrency-<engine>.json")
    ap.add_argument("--configs", default="none,dspark:1,dspark:2,dspark:3,dspark:5,dspark:7,dspark:t0.2,dspark:scheduled",
                    help="batched mode: drafter:verify-length entries; 'none' = target-only, dspark:N = fixed "
                         "gamma N, dspark:tP = static survival threshold P, dspark:scheduled = Algorithm 1")
    ap.add_argument("--repeats", type=int, default=1, help="batched mode: runs of every (concurrency, config)")
    a = ap.parse_args(argv)
    if a.draft_length not in (None, "auto", "scheduled") and not (a.draft_length.isdigit() and int(a.draft_length) >= 1):
        ap.error(f"--draft-length {a.draft_length!r}: give an integer >= 1, 'auto' or 'scheduled'")
    if a.concurrency:
        return concurrency_main(a)

    from dspark_runtime import DSparkError, Engine
    from dspark_runtime.backends.ort import shared_pool_default
    from dspark_runtime.engine import DEFAULT_THREADS

    places = {}  # engine name ("" = --engine) -> its prompt place
    for p in a.prompts:
        name, sep, place = p.rpartition("=")
        places[name] = place
    try:
        eng = Engine.load(a.engine, threads=a.threads or DEFAULT_THREADS, shared_thread_pool=shared_pool_default(),
                          prompts=places.pop("", "auto"))
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    others = {}
    for spec in a.engine_as:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or "/" in name:
            print(f"error: --engine-as {spec!r}: give NAME=DIR (NAME without '/')", file=sys.stderr)
            return 2
        try:
            others[name] = Engine.load(path, threads=a.threads or DEFAULT_THREADS,
                                       shared_thread_pool=shared_pool_default(), prompts=places.pop(name, "auto"))
        except DSparkError as e:
            print(f"error: --engine-as {spec!r}: {e}", file=sys.stderr)
            return 2
    if places:
        print(f"error: --prompts names engine(s) {sorted(places)} not given with --engine-as", file=sys.stderr)
        return 2
    dl = a.draft_length if a.draft_length in (None, "auto", "scheduled") else int(a.draft_length)
    jobs = [(ds, p) for ds, n in (("humaneval", a.humaneval), ("mt-bench", a.mt_bench), ("gsm8k", a.gsm8k),
                                  ("mbpp", a.mbpp), ("long", a.long)) for p in load_prompts(ds, n)]
    drafters = [d.strip() for d in a.draft.split(",") if d.strip()]
    # an entry may carry its own draft length: "dspark:scheduled", "lm:3"
    # and may name another engine (--engine-as): "v1/dspark:7"
    lengths, engine_of = {}, {}
    for d in drafters:
        where, _, spec = d.rpartition("/")
        name, _, ln = spec.partition(":")
        lengths[d] = (name, dl if not ln else (ln if ln in ("auto", "scheduled") else int(ln)))
        engine_of[d] = others.get(where) if where else eng
    bad = [d for d in drafters if lengths[d][0] not in ("auto", "dspark", "eagle3", "lm", "ngram", "router", "none")]
    if bad or not drafters:
        print(f"error: unknown drafter(s) {bad}; use auto, dspark, eagle3, lm, ngram, router, none", file=sys.stderr)
        return 2
    unknown = [d for d in drafters if engine_of[d] is None]
    if unknown:
        print(f"error: {unknown} name(s) an engine not given with --engine-as NAME=DIR "
              f"(given: {sorted(others) or 'none'})", file=sys.stderr)
        return 2
    rows = []
    print(f"{'#':>3} {'dataset':10} {'drafter':16} {'tok':>4} {'base tok/s':>10} {'spec tok/s':>10} {'ratio':>6} "
          f"{'tau':>5} {'acc':>5} same")
    for i, (ds, prompt) in enumerate(jobs):
        base = eng.generate(prompt, max_new_tokens=a.max_new_tokens, draft=None)
        for drafter in drafters:
            try:
                name = lengths[drafter][0]
                spec = engine_of[drafter].generate(prompt, max_new_tokens=a.max_new_tokens,
                                                   draft=None if name == "none" else name,
                                    draft_length=lengths[drafter][1], draft_confidence=a.draft_confidence)
            except DSparkError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            same = base.token_ids == spec.token_ids
            first_diff = None
            if not same:
                first_diff = next((k for k, (x, y) in enumerate(zip(base.token_ids, spec.token_ids)) if x != y),
                                  min(len(base.token_ids), len(spec.token_ids)))
            r = {"dataset": ds, "prompt_index": i, "drafter": drafter, "prompt_tokens": base.stats.prompt_tokens,
                 "new_tokens": len(spec.token_ids), "target_only_tps": base.stats.tokens_per_second,
                 "speculative_tps": spec.stats.tokens_per_second,
                 "ratio": spec.stats.tokens_per_second / base.stats.tokens_per_second,
                 "tau": spec.stats.accepted_length_mean, "acceptance_rate": spec.stats.acceptance_rate,
                 "accepted_by_position": spec.stats.accepted_by_position,
                 "draft_length_histogram": spec.stats.draft_length_histogram,
                 "proposed": spec.stats.proposed, "accepted": spec.stats.accepted, "rounds": spec.stats.num_rounds,
                 "draft_ms_per_round": spec.stats.draft_ms / max(1, spec.stats.num_rounds),
                 "ttft_ms_target_only": base.stats.ttft_ms, "ttft_ms_speculative": spec.stats.ttft_ms,
                 "identical": same, "first_diff": first_diff, "draft_sources": spec.stats.draft_sources}
            rows.append(r)
            print(f"{i:3d} {ds:10} {drafter:16} {r['new_tokens']:4d} {r['target_only_tps']:10.2f} "
                  f"{r['speculative_tps']:10.2f} {r['ratio']:6.2f} {r['tau']:5.2f} {r['acceptance_rate']:5.0%} "
                  f"{'yes' if same else f'NO@{first_diff}'}")
            if a.show_text:
                print(spec.text)
            sys.stdout.flush()
    if not rows:
        print("no prompts selected")
        return 2

    # aggregate: total tokens / total decode time per mode (not a mean of ratios)
    def agg(rs, key_tps):
        toks = sum(r["new_tokens"] - 1 for r in rs)
        secs = sum((r["new_tokens"] - 1) / r[key_tps] for r in rs if r[key_tps] > 0)
        return toks / secs if secs else float("nan")

    def by_position(rs):
        hits, tries = {}, {}
        for r in rs:  # weight each prompt's per-position rate by its rounds
            for k, v in enumerate(r["accepted_by_position"]):
                hits[k] = hits.get(k, 0.0) + v * r["rounds"]
                tries[k] = tries.get(k, 0) + r["rounds"]
        return [round(hits[k] / tries[k], 3) for k in sorted(tries)]

    base_rows = [r for r in rows if r["drafter"] == drafters[0]]
    per = {}
    for d in drafters:
        rs = [r for r in rows if r["drafter"] == d]
        per[d] = {"speculative_tps": agg(rs, "speculative_tps"),
                  "ratio": agg(rs, "speculative_tps") / agg(base_rows, "target_only_tps"),
                  "tau_mean": statistics.mean(r["tau"] for r in rs),
                  "tau_by_dataset": {ds: statistics.mean(r["tau"] for r in rs if r["dataset"] == ds)
                                     for ds in dict.fromkeys(r["dataset"] for r in rs)},
                  "acceptance_rate_mean": statistics.mean(r["acceptance_rate"] for r in rs),
                  "draft_ms_per_round": statistics.mean(r["draft_ms_per_round"] for r in rs),
                  "accepted_by_position": by_position(rs),
                  "identical": sum(r["identical"] for r in rs), "n": len(rs),
                  "draft_sources": _sum_sources(rs),
                  "ttft_ms_median": statistics.median(r["ttft_ms_speculative"] for r in rs)}
    first = per[drafters[0]]
    summary = {
        "engine": str(a.engine), "engines_as": dict(s.partition("=")[::2] for s in a.engine_as), "machine": machine(), "threads": a.threads or DEFAULT_THREADS,
        "max_new_tokens": a.max_new_tokens, "draft_length": dl or "engine default", "drafter": a.draft,
        "draft_confidence": a.draft_confidence,
        "prompts": {ds: n for ds, n in (("humaneval", a.humaneval), ("mt-bench", a.mt_bench), ("gsm8k", a.gsm8k),
                                         ("mbpp", a.mbpp), ("long", a.long)) if n},
        "prompt_places": {"": eng.prompts, **{k: e.prompts for k, e in others.items()}},
        "ttft_ms_target_only_median": statistics.median(r["ttft_ms_target_only"] for r in base_rows),
        "split": "evaluation (dspark_export/data/prompts/README.md)",
        "target_only_tps": agg(base_rows, "target_only_tps"), "speculative_tps": first["speculative_tps"],
        "ratio": first["ratio"], "tau_mean": first["tau_mean"], "acceptance_rate_mean": first["acceptance_rate_mean"],
        "identical": first["identical"], "n": first["n"], "drafters": per,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"\n{len(base_rows)} prompts, {a.max_new_tokens} new tokens max, greedy, on {summary['machine']}, "
          f"{summary['threads']} threads; target-only {summary['target_only_tps']:.2f} tok/s, median TTFT "
          f"{summary['ttft_ms_target_only_median']:.0f} ms")
    for d, v in per.items():
        print(f"{d:16}: {v['speculative_tps']:.2f} tok/s | ratio {v['ratio']:.2f}x | tau {v['tau_mean']:.2f} "
              f"{ {k: round(t, 2) for k, t in v['tau_by_dataset'].items()} } | acceptance "
              f"{v['acceptance_rate_mean']:.0%} | drafting {v['draft_ms_per_round']:.1f} ms/round | by position "
              f"{v['accepted_by_position']} | identical "
              f"{v['identical']}/{v['n']} | median TTFT {v['ttft_ms_median']:.0f} ms" + (f" | sources {v['draft_sources']}" if v["draft_sources"] else ""))
    out = Path(a.out) if a.out else RESULTS / f"bench-{Path(a.engine).name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _sum_sources(rs) -> dict:
    """Router rows: rounds / proposed / accepted per proposal source, summed over prompts."""
    tot: dict = {}
    for r in rs:
        for src, v in (r.get("draft_sources") or {}).items():
            t = tot.setdefault(src, {"rounds": 0, "proposed": 0, "accepted": 0})
            for k in t:
                t[k] += v.get(k, 0)
    return tot


def _parse_config(c: str):
    """'none' | 'dspark:7' | 'dspark:t0.2' | 'dspark:scheduled' | 'router:scheduled' (also lm, ngram) -> generate_batch kwargs."""
    name, _, ln = c.partition(":")
    if name == "none":
        return {"draft": None}
    if name not in ("dspark", "eagle3", "lm", "ngram", "router"):
        raise ValueError(f"unknown drafter {name!r} in config {c!r}")
    if ln == "scheduled":
        return {"draft": name, "draft_length": "scheduled"}
    if ln.startswith("t"):
        return {"draft": name, "draft_confidence": float(ln[1:])}
    return {"draft": name, "draft_length": int(ln) if ln else None}


def concurrency_main(a) -> int:
    """Aggregate and per-request tokens/s of the batched runtime at several concurrency levels (issue 4)."""
    from dspark_runtime import DSparkError, Engine
    from dspark_runtime.backends.ort import shared_pool_default
    from dspark_runtime.engine import DEFAULT_THREADS

    levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    try:
        kws = {c: _parse_config(c) for c in configs}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        eng = Engine.load(a.engine, threads=a.threads or DEFAULT_THREADS, shared_thread_pool=shared_pool_default())
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = [(ds, p) for ds, n in (("humaneval", a.humaneval), ("mt-bench", a.mt_bench), ("gsm8k", a.gsm8k),
                                     ("mbpp", a.mbpp)) for p in load_prompts(ds, n)]
    texts = [p for _, p in prompts]
    print(f"{len(texts)} prompts, {a.max_new_tokens} new tokens, concurrency {levels}, configs {configs}, "
          f"{a.repeats} repeat(s); {machine()}")
    # reference: each prompt decoded alone, target-only, by the single-request API
    ref = [eng.generate(p, max_new_tokens=a.max_new_tokens, draft=None).token_ids for p in texts]
    rows = []
    print(f"{'conc':>4} {'config':18} {'agg tok/s':>9} {'+prefill':>8} {'req tok/s':>9} {'tau':>5} {'B/round':>7} "
          f"{'wasted':>6} {'same':>5}")
    for rep in range(a.repeats):
        for c in levels:
            order = configs if rep % 2 == 0 else configs[::-1]
            for cfg in order:
                try:
                    res = eng.generate_batch(texts, max_new_tokens=a.max_new_tokens, max_batch=c, **kws[cfg])
                except DSparkError as e:
                    print(f"error: {cfg}: {e}", file=sys.stderr)
                    return 2
                st = eng.last_batch_stats
                same = sum(r.token_ids == x for r, x in zip(res, ref))
                row = {"concurrency": c, "config": cfg, "repeat": rep,
                       "aggregate_tps": st.decode_tokens_per_second, "aggregate_tps_with_prefill": st.tokens_per_second,
                       "per_request_tps": statistics.mean(r.stats.tokens_per_second for r in res),
                       "tau": st.accepted_length_mean, "rounds": st.rounds, "verify_tokens": st.verify_tokens,
                       "verify_tokens_per_round": st.verify_tokens / max(1, st.rounds),
                       "proposed": st.proposed, "accepted": st.accepted, "wasted": st.wasted,
                       "committed": st.committed, "prefill_s": st.prefill_s, "wall_s": st.wall_s,
                       "verify_length_histogram": st.verify_length_histogram,
                       "batch_histogram": st.batch_histogram, "accepted_by_position": st.accepted_by_position,
                       "ttft_ms": [r.stats.ttft_ms for r in res], "identical": same, "n": len(res)}
                rows.append(row)
                print(f"{c:4d} {cfg:18} {row['aggregate_tps']:9.2f} {row['aggregate_tps_with_prefill']:8.2f} "
                      f"{row['per_request_tps']:9.2f} {row['tau']:5.2f} {row['verify_tokens_per_round']:7.1f} "
                      f"{row['wasted']:6d} {same:>2}/{len(res)}")
                sys.stdout.flush()
    summary = {}
    for c in levels:
        summary[str(c)] = {cfg: {k: statistics.mean(r[k] for r in rows if r["concurrency"] == c and r["config"] == cfg)
                                 for k in ("aggregate_tps", "per_request_tps", "tau", "wasted",
                                           "verify_tokens_per_round")}
                           for cfg in configs}
    print("\naggregate decode tokens/s (mean over repeats):")
    print(f"{'config':18} " + " ".join(f"{'c=' + str(c):>8}" for c in levels))
    for cfg in configs:
        print(f"{cfg:18} " + " ".join(f"{summary[str(c)][cfg]['aggregate_tps']:8.2f}" for c in levels))
    out = Path(a.out) if a.out else RESULTS / f"concurrency-{Path(a.engine).name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"engine": str(a.engine), "machine": machine(), "threads": a.threads or DEFAULT_THREADS,
                               "max_new_tokens": a.max_new_tokens, "prompts": [ds for ds, _ in prompts],
                               "concurrency": levels, "configs": configs, "repeats": a.repeats,
                               "cost_table": eng.manifest.speculation.cost_table,
                               "summary": summary, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
                              indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
