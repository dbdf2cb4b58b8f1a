"""Load test of the OpenAI-compatible server with the official openai client: solo, then concurrent clients.

Per server config (default: the engine's drafter, then speculation off) the same prompts stream once one at a time
and once from ``--clients`` clients: aggregate tokens/s, p50/p95 TTFT and per-token latency, tau, and whether every
concurrent output equals its solo output. ``--workload shared-prefix`` measures the prefix cache instead.
Writes results/serve-<engine>.json (``--round-trace``: the rounds beside it, ``.rounds.json``).

    python -m benchmarks.serve_bench --engine engines/qwen2.5-coder-1.5b --configs dspark,none --transcript
    python -m benchmarks.serve_bench --url http://127.0.0.1:8000        # a running `dspark serve`
    python -m benchmarks.serve_bench --engine engines/qwen2.5-coder-1.5b --workload shared-prefix --prefix-cache-mb 0,512
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from benchmarks.evalsets import RESULTS, load_prompts, loadavg, machine, round_kinds
from dspark_runtime.decoding.stats import RoundRecord


def _pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


SYSTEM = ("You are a senior Python engineer reviewing and writing code for a team. Follow these rules in every "
          "answer. Write idiomatic Python 3.10 with type hints on every function. Prefer the standard library; do not "
          "invent APIs or import third-party packages unless asked. Name variables and functions clearly, keep "
          "functions short, and handle edge cases such as empty inputs, negative numbers and None explicitly. Add a "
          "docstring that states what the function returns and which errors it raises. When a question is "
          "ambiguous, state the assumption you make in one sentence before the code. Keep explanations brief: at "
          "most three sentences after the code. Never print debugging output, never use global state, and never "
          "catch an exception only to ignore it. Format code in a single fenced block.")
FOLLOW_UP = "Now write two short pytest tests for it."


def one_request(client, model, prompt, max_tokens):
    """Stream one greedy chat completion (``prompt``: a user message, or a list of chat messages); returns text,
    tokens, ttft_s, tpot_s, the dspark extension and the prompt tokens reused from the prefix cache."""
    t0 = time.perf_counter()
    parts, t_first, t_last, usage, ext = [], None, None, None, {}
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    for c in client.chat.completions.create(model=model, messages=msgs,
                                            max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True}):
        if c.choices and c.choices[0].delta.content:
            now = time.perf_counter()
            t_first = t_first or now
            t_last = now
            parts.append(c.choices[0].delta.content)
        if c.choices and c.choices[0].finish_reason:
            ext = (c.model_extra or {}).get("dspark", {})
        if c.usage:
            usage = c.usage
    n = usage.completion_tokens if usage else 0
    t_first = t_first or time.perf_counter()
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"text": "".join(parts), "tokens": n, "ttft_s": t_first - t0,
            "tpot_s": (t_last - t_first) / (n - 1) if n > 1 and t_last else None, "tau": ext.get("tau"),
            "acceptance_rate": ext.get("acceptance_rate"), "prompt_tokens": usage.prompt_tokens if usage else 0,
            "cached_tokens": (getattr(details, "cached_tokens", 0) or 0) if details else 0}


def one_conversation(client, model, question, max_tokens):
    """Two turns sharing :data:`SYSTEM`: ``question``, then :data:`FOLLOW_UP` with the first answer in the history.
    Returns the two turns' :func:`one_request` results."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    first = one_request(client, model, msgs, max_tokens)
    msgs += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": FOLLOW_UP}]
    return [first, one_request(client, model, msgs, max_tokens)]


def run_conversations(client, model, questions, max_tokens, clients):
    """The shared-prefix workload: one 2-turn conversation per question, ``clients`` at once. TTFT per turn, the
    fraction of prompt tokens reused (usage.prompt_tokens_details.cached_tokens), aggregate tokens/s."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        convs = list(ex.map(lambda q: one_conversation(client, model, q, max_tokens), questions))
    wall = time.perf_counter() - t0
    res = [t for c in convs for t in c]
    out = {"clients": clients, "requests": len(res), "tokens": sum(r["tokens"] for r in res), "wall_s": wall,
           "tokens_per_second": sum(r["tokens"] for r in res) / wall,
           "cached_fraction": sum(r["cached_tokens"] for r in res) / max(1, sum(r["prompt_tokens"] for r in res)),
           "texts": [r["text"] for r in res]}
    for k, name in ((0, "turn1"), (1, "turn2")):
        ttft = [c[k]["ttft_s"] for c in convs]
        out[f"{name}_ttft_p50_s"], out[f"{name}_ttft_p95_s"] = _pct(ttft, 0.5), _pct(ttft, 0.95)
    ttft = [r["ttft_s"] for r in res]
    out["ttft_p50_s"], out["ttft_p95_s"] = _pct(ttft, 0.5), _pct(ttft, 0.95)
    return out


def run_phase(client, model, prompts, max_tokens, clients):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        res = list(ex.map(lambda p: one_request(client, model, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in res)
    ttft = [r["ttft_s"] for r in res]
    tpot = [r["tpot_s"] for r in res if r["tpot_s"] is not None]
    taus = [r["tau"] for r in res if r["tau"]]
    return {"clients": clients, "requests": len(res), "tokens": toks, "wall_s": wall, "tokens_per_second": toks / wall,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
            "tpot_p50_s": _pct(tpot, 0.5), "tpot_p95_s": _pct(tpot, 0.95),
            "tau_mean": statistics.fmean(taus) if taus else None, "texts": [r["text"] for r in res]}


def transcript(client, model, prompt, max_tokens):
    print("=== non-streaming: client.chat.completions.create(...)")
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0)
    print(json.dumps(r.model_dump(), indent=2, ensure_ascii=False))
    print("=== streaming: client.completions.create(..., stream=True)")
    for c in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True}):
        print(json.dumps(c.model_dump(exclude_none=True), ensure_ascii=False))
    print("=== done", flush=True)


def bench_server(url, model, prompts, a, label, gen=None):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    model = model or client.models.list().data[0].id
    if a.transcript:
        transcript(client, model, prompts[0], min(a.max_tokens, 48))
    solo = run_phase(client, model, prompts, a.max_tokens, 1)
    solo_rounds = None
    if gen is not None and gen.round_trace is not None:
        solo_rounds = list(gen.round_trace)
        gen.round_trace = []  # the concurrent phase's rounds only
    conc = run_phase(client, model, prompts, a.max_tokens, a.clients)
    same = sum(x == y for x, y in zip(solo["texts"], conc["texts"]))
    print(f"[{label}] solo {solo['tokens_per_second']:.2f} tok/s; {a.clients} clients "
          f"{conc['tokens_per_second']:.2f} tok/s; identical to solo {same}/{len(prompts)}", flush=True)
    out = {"config": label, "solo": solo, "concurrent": conc, "identical_to_solo": same}
    if gen is not None and gen.round_trace is not None:
        out["round_kinds"] = round_kinds(list(gen.round_trace))
        print_round_kinds(label, out["round_kinds"])
        out["solo_round_kinds"] = round_kinds(solo_rounds)
        # every round's record, for fitting round costs offline: one list per RoundRecord field (written to
        # <out>.rounds.json by main, keyed by config)
        out["rounds"] = {"solo": round_columns(solo_rounds), "concurrent": round_columns(gen.round_trace)}
    return out


def round_columns(records) -> dict:
    """RoundRecords as columns ({field: [value per round]}), floats rounded to 4 decimals (seconds: 0.1 ms)."""
    cols: dict = {f: [] for f in RoundRecord.__dataclass_fields__}
    for r in records:
        for f, v in asdict(r).items():
            cols[f].append(round(v, 4) if isinstance(v, float) else v)
    return cols


def print_round_kinds(label, kinds):
    """The concurrent phase's rounds by kind (``--round-trace``): a markdown table."""
    print(f"[{label}] rounds of the concurrent phase by kind")
    print("| kind | rounds | ms a round | of it drafting | rows | pass tokens | prompt tokens | committed | tok/s "
          "| share of wall | skip rule expected tok/s, drafting / anchors only |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind, k in kinds.items():
        d, u = k.get("expected_drafted_tps"), k.get("expected_undrafted_tps")
        expected = "-" if d is None else f"{d:.1f} / {u:.1f}"
        print(f"| {kind} | {k['rounds']} | {k['ms_per_round']:.0f} | {k['draft_ms_per_round']:.0f} "
              f"| {k['rows_mean']:.1f} | {k['pass_tokens_mean']:.1f} "
              f"| {k['prompt_tokens']} | {k['committed']} | {k['tokens_per_second']:.1f} | {k['share_of_wall']:.1%} "
              f"| {expected} |")


def bench_prefix(url, model, questions, a, label):
    """The shared-prefix workload against one server."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    model = model or client.models.list().data[0].id
    r = run_conversations(client, model, questions, a.max_tokens, a.clients)
    print(f"[{label}] {r['tokens_per_second']:.2f} tok/s; TTFT p50/p95 turn 1 {r['turn1_ttft_p50_s']:.2f} / "
          f"{r['turn1_ttft_p95_s']:.2f} s, turn 2 {r['turn2_ttft_p50_s']:.2f} / {r['turn2_ttft_p95_s']:.2f} s; "
          f"prompt tokens reused {r['cached_fraction']:.1%}", flush=True)
    return {"config": label, "conversations": r}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--engine", help="load this engine and serve it in-process on loopback")
    g.add_argument("--url", help="a running `dspark serve` (e.g. http://127.0.0.1:8000)")
    ap.add_argument("--configs", default="auto,none",
                    help="with --engine: comma-separated drafter[:draft_length] per server run; 'none' = "
                         "speculation off (e.g. dspark,dspark:scheduled,lm:3,none)")
    ap.add_argument("--humaneval", type=int, default=8)
    ap.add_argument("--mt-bench", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--transcript", action="store_true", help="print one openai exchange, streaming and not")
    ap.add_argument("--prefill-budget", default="auto", help="with --engine: prompt tokens per round while others "
                    "decode (chunked prefill), or 'auto'")
    ap.add_argument("--prefix-cache-mb", default="0", help="with --engine: comma-separated prefix cache bounds in "
                    "MiB, one server run each per config (0 = off)")
    ap.add_argument("--workload", choices=["prompts", "shared-prefix"], default="prompts",
                    help="prompts: solo then --clients concurrent single-turn requests; shared-prefix: --clients "
                         "2-turn conversations at once sharing a long system prompt (the --humaneval questions)")
    ap.add_argument("--round-trace", action="store_true", help="with --engine and the prompts workload: keep the "
                    "decoding loop's per-round records (DecodingLoop.round_trace) of the concurrent phase and report "
                    "them by kind: drafted / probe / undrafted, with or without prompt chunks")
    ap.add_argument("--out", default=None, help="JSON output (default results/serve-<name>.json)")
    a = ap.parse_args(argv)
    prompts = load_prompts("humaneval", a.humaneval) + load_prompts("mt-bench", a.mt_bench)
    if a.workload == "shared-prefix":
        prompts = load_prompts("humaneval", a.humaneval)
    bench = bench_prefix if a.workload == "shared-prefix" else bench_server
    budget = a.prefill_budget if a.prefill_budget == "auto" else int(a.prefill_budget)
    runs = []
    load_before = loadavg()
    if a.url:
        runs.append(bench(a.url.rstrip("/"), None, prompts, a, a.url))
        name = "url"
    else:
        from dspark_runtime.engine import DEFAULT_THREADS, Engine
        from dspark_runtime.serving.app import create_app
        from dspark_runtime.serving.server import ServerThread

        eng = Engine.load(a.engine, threads=a.threads or DEFAULT_THREADS)
        name = eng.manifest.name
        for i, (c, mb) in enumerate((c, float(mb)) for c in a.configs.split(",")
                                    for mb in a.prefix_cache_mb.split(",")):
            draft, _, dl = c.partition(":")
            dl = None if not dl else (dl if dl == "scheduled" else int(dl))
            eng.enable_prefix_cache(mb)  # a fresh cache for every run
            app = create_app(eng, draft=None if draft == "none" else draft, draft_length=dl, max_batch=a.max_batch,
                             max_queue=max(64, len(prompts)), prefill_budget=budget)
            with ServerThread(app) as srv:
                a_i = argparse.Namespace(**{**vars(a), "transcript": a.transcript and i == 0})
                label = c if mb == 0 else f"{c} prefix-cache {mb:g} MiB"
                if a.round_trace:
                    app.state.worker.gen.round_trace = []
                extra = {"gen": app.state.worker.gen} if bench is bench_server else {}
                runs.append(bench(srv.url, app.state.model_name, prompts, a_i, label, **extra))
                runs[-1]["prefill_budget"] = app.state.worker.gen.prefill_budget
                if eng.prefix_cache is not None:
                    runs[-1]["prefix_cache"] = eng.prefix_cache.stats.to_json()
    if a.workload == "shared-prefix":
        ref = runs[0]["conversations"]["texts"]
        across = all(r["conversations"]["texts"] == ref for r in runs)
        print(f"\n{machine()}; load average before/after {load_before} / {loadavg()}; {len(prompts)} conversations "
              f"of 2 turns, {a.clients} at once, {a.max_tokens} max tokens, greedy, streamed")
        print("| config | tok/s | TTFT p50 / p95 turn 1 (s) | TTFT p50 / p95 turn 2 (s) | prompt tokens reused |")
        print("|---|---|---|---|---|")
        for r in runs:
            x = r["conversations"]
            print(f"| {r['config']} | {x['tokens_per_second']:.2f} | {x['turn1_ttft_p50_s']:.2f} / "
                  f"{x['turn1_ttft_p95_s']:.2f} | {x['turn2_ttft_p50_s']:.2f} / {x['turn2_ttft_p95_s']:.2f} | "
                  f"{x['cached_fraction']:.1%} |")
        print(f"outputs identical across all runs: {across}")
        out = Path(a.out) if a.out else RESULTS / f"serve-prefix-{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"machine": machine(), "loadavg_before": load_before, "loadavg_after": loadavg(),
                                   "conversations": len(prompts), "max_tokens": a.max_tokens,
                                   "identical_across_runs": across, "runs": runs}, indent=2))
        print(f"wrote {out}")
        return 0 if across else 1
    ref = runs[0]["solo"]["texts"]
    across = all(r["solo"]["texts"] == ref and r["concurrent"]["texts"] == ref for r in runs)
    print(f"\n{machine()}; load average before/after {load_before} / {loadavg()}; {len(prompts)} prompts, "
          f"{a.max_tokens} max tokens, greedy, streamed chat completions")
    print("| config | clients | tok/s | TTFT p50 / p95 (s) | per-token p50 / p95 (ms) | τ | identical to solo |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        for ph in ("solo", "concurrent"):
            x = r[ph]
            tau = f"{x['tau_mean']:.2f}" if x["tau_mean"] else "-"
            ident = f"{r['identical_to_solo']}/{len(prompts)}" if ph == "concurrent" else "(reference)"
            print(f"| {r['config']} | {x['clients']} | {x['tokens_per_second']:.2f} | {x['ttft_p50_s']:.2f} / "
                  f"{x['ttft_p95_s']:.2f} | {x['tpot_p50_s'] * 1e3:.0f} / {x['tpot_p95_s'] * 1e3:.0f} | {tau} "
                  f"| {ident} |")
    print(f"outputs identical across all configs and phases: {across}")
    out = Path(a.out) if a.out else RESULTS / f"serve-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rounds = {r["config"]: r.pop("rounds") for r in runs if "rounds" in r}
    out.write_text(json.dumps({"machine": machine(), "loadavg_before": load_before, "loadavg_after": loadavg(),
                               "prompts": len(prompts), "max_tokens": a.max_tokens,
                               "identical_across_configs": across, "runs": runs}, indent=2))
    print(f"wrote {out}")
    if rounds:  # --round-trace: every round's record, compact, beside it
        side = out.with_name(out.stem + ".rounds.json")
        side.write_text(json.dumps(rounds, separators=(",", ":")))
        print(f"wrote {side}")
    return 0 if across and all(r["identical_to_solo"] == len(prompts) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
