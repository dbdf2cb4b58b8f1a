#!/usr/bin/env python
"""Load test of the OpenAI-compatible server with the official openai client (issue 7, must-show 1 and 2).

For each server config (default: the engine's drafter, then speculation off), the same prompts go
through the server twice: one client at a time (solo), then ``--clients`` concurrent clients. Every
request streams (chat completions, greedy, ``stream_options.include_usage``); per request the client
measures TTFT (send -> first content chunk) and per-token latency ((last chunk - first chunk) / (tokens - 1)).
Prints aggregate tokens/s, p50/p95 TTFT and per-token latency, τ, and whether every concurrent output
equals its solo output (and the outputs of all configs equal each other: greedy speculative decoding is
exact). ``--transcript`` first prints one non-streaming and one streaming exchange verbatim.

    # in-process: one engine load, the server on loopback, speculation on and off in the same run
    python scripts/serve_bench.py --engine engines/qwen2.5-coder-1.5b --configs dspark,none --transcript
    # against a running `dspark serve` (one config)
    python scripts/serve_bench.py --url http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evalsets import ROOT, load_prompts, machine  # noqa: E402

sys.path.insert(0, str(ROOT))


def _pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def one_request(client, model, prompt, max_tokens):
    """Stream one greedy chat completion; returns text, tokens, ttft_s, tpot_s, the dspark extension."""
    t0 = time.perf_counter()
    parts, t_first, t_last, usage, ext = [], None, None, None, {}
    for c in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
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
    return {"text": "".join(parts), "tokens": n, "ttft_s": t_first - t0,
            "tpot_s": (t_last - t_first) / (n - 1) if n > 1 and t_last else None, "tau": ext.get("tau"),
            "acceptance_rate": ext.get("acceptance_rate")}


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


def bench_server(url, model, prompts, a, label):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    model = model or client.models.list().data[0].id
    if a.transcript:
        transcript(client, model, prompts[0], min(a.max_tokens, 48))
    solo = run_phase(client, model, prompts, a.max_tokens, 1)
    conc = run_phase(client, model, prompts, a.max_tokens, a.clients)
    same = sum(x == y for x, y in zip(solo["texts"], conc["texts"]))
    print(f"[{label}] solo {solo['tokens_per_second']:.2f} tok/s; {a.clients} clients "
          f"{conc['tokens_per_second']:.2f} tok/s; identical to solo {same}/{len(prompts)}", flush=True)
    return {"config": label, "solo": solo, "concurrent": conc, "identical_to_solo": same}


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
    ap.add_argument("--out", default=None, help="JSON output (default scripts/results/serve-<name>.json)")
    a = ap.parse_args(argv)
    prompts = load_prompts("humaneval", a.humaneval) + load_prompts("mt-bench", a.mt_bench)
    runs = []
    if a.url:
        runs.append(bench_server(a.url.rstrip("/"), None, prompts, a, a.url))
        name = "url"
    else:
        from dspark_runtime.engine import DEFAULT_THREADS, Engine
        from dspark_runtime.server import ServerThread, create_app

        eng = Engine.load(a.engine, threads=a.threads or DEFAULT_THREADS)
        name = eng.manifest.name
        for i, c in enumerate(a.configs.split(",")):
            draft, _, dl = c.partition(":")
            dl = None if not dl else (dl if dl == "scheduled" else int(dl))
            app = create_app(eng, draft=None if draft == "none" else draft, draft_length=dl, max_batch=a.max_batch,
                             max_queue=max(64, len(prompts)))
            with ServerThread(app) as srv:
                a_i = argparse.Namespace(**{**vars(a), "transcript": a.transcript and i == 0})
                runs.append(bench_server(srv.url, app.state.model_name, prompts, a_i, c))
    ref = runs[0]["solo"]["texts"]
    across = all(r["solo"]["texts"] == ref and r["concurrent"]["texts"] == ref for r in runs)
    print(f"\n{machine()}; {len(prompts)} prompts, {a.max_tokens} max tokens, greedy, streamed chat completions")
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
    out = Path(a.out) if a.out else ROOT / "scripts" / "results" / f"serve-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "prompts": len(prompts), "max_tokens": a.max_tokens,
                               "identical_across_configs": across, "runs": runs}, indent=2))
    print(f"wrote {out}")
    return 0 if across and all(r["identical_to_solo"] == len(prompts) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
