"""1 against N replicas of the same engine on Ray Serve, on this machine's cores.

Starts a local Ray cluster and, per replica count in ``--replicas``, deploys
:func:`dspark_runtime.serving.ray_serve.build_app` with the cores split evenly between the replicas, then streams
the same prompts from ``--clients`` clients through Serve's proxy: aggregate tokens/s, p50/p95 TTFT and per-token
latency, the requests each replica answered, and whether every output equals the first configuration's.
Writes results/ray-serve-<engine>.json.

    python -m benchmarks.ray_serve_bench --engine engines/qwen2.5-coder-1.5b --replicas 1,2 --clients 8 \\
        --humaneval 4 --mt-bench 4 --max-tokens 48
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.evalsets import RESULTS, load_prompts, machine
from benchmarks.serve_bench import _pct


def one_request(url: str, prompt: str, max_tokens: int) -> dict:
    """Stream one greedy chat completion: text, tokens, ttft_s, tpot_s, the replica that answered."""
    import httpx

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    parts, t_first, t_last, usage, done = [], None, None, None, False
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(3600.0)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {r.read()[:300]!r}")
        replica = r.headers.get("x-dspark-replica")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            o = json.loads(line[6:])
            for c in o.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    t_first = t_first or now
                    t_last = now
                    parts.append(piece)
            usage = o.get("usage") or usage
    if not done or usage is None:
        raise RuntimeError("the stream ended before [DONE]")
    n = usage["completion_tokens"]
    t_first = t_first or time.perf_counter()
    return {"text": "".join(parts), "tokens": n, "ttft_s": t_first - t0,
            "tpot_s": (t_last - t_first) / (n - 1) if n > 1 and t_last else None, "replica": replica}


def run_phase(url: str, prompts: list, max_tokens: int, clients: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        res = list(ex.map(lambda p: one_request(url, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in res)
    ttft = [r["ttft_s"] for r in res]
    tpot = [r["tpot_s"] for r in res if r["tpot_s"] is not None]
    return {"clients": clients, "requests": len(res), "tokens": toks, "wall_s": wall, "tokens_per_second": toks / wall,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p95_s": _pct(ttft, 0.95),
            "tpot_p50_s": _pct(tpot, 0.5), "tpot_p95_s": _pct(tpot, 0.95),
            "by_replica": dict(Counter(r["replica"] for r in res)), "texts": [r["text"] for r in res]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--replicas", default="1,2", help="comma-separated replica counts, run in this order")
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs of the Ray cluster, split evenly")
    ap.add_argument("--draft", default="auto", help="as `dspark serve --draft` (none = target-only)")
    ap.add_argument("--draft-length", default=None)
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--mt-bench", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--out", default=None, help="JSON output (default results/ray-serve-<name>.json)")
    a = ap.parse_args(argv)

    import ray
    from ray import serve

    from dspark_runtime.engine_dir.manifest import load_manifest
    from dspark_runtime.serving.ray_serve import APP_NAME, DEPLOYMENT_NAME, RayServeSettings, build_app

    engine = str(Path(a.engine).resolve())
    name = load_manifest(engine, verify=False).name
    prompts = load_prompts("humaneval", a.humaneval) + load_prompts("mt-bench", a.mt_bench)
    dl = None if a.draft_length is None else (a.draft_length if a.draft_length == "scheduled" else int(a.draft_length))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=a.cpus, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    runs = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for R in (int(x) for x in a.replicas.split(",")):
            settings = RayServeSettings(engine=engine, num_replicas=R, replica_cpus=a.cpus / R,
                                        threads=max(1, a.cpus // R), draft=a.draft, draft_length=dl,
                                        max_batch=a.max_batch, max_queue=max(64, len(prompts)))
            t0 = time.perf_counter()
            serve.run(build_app(settings), name=APP_NAME, route_prefix="/")
            deploy_s = time.perf_counter() - t0
            warm = Counter()
            while len(warm) < R:  # every replica has answered once: its sessions are warm
                warm[one_request(url, prompts[0], 4)["replica"]] += 1
            ph = run_phase(url, prompts, a.max_tokens, a.clients)
            ph.update(replicas=R, cpus_per_replica=a.cpus / R, threads_per_replica=settings.replica_threads,
                      deploy_s=deploy_s)
            runs.append(ph)
            print(f"[{R} replica(s)] {ph['tokens_per_second']:.2f} tok/s, by replica {ph['by_replica']}, "
                  f"deployed in {deploy_s:.1f} s", flush=True)
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    ref = runs[0]["texts"]
    print(f"\n{machine()}; Ray Serve, {a.cpus} CPUs; {name}, draft {a.draft}; {len(prompts)} prompts, "
          f"{a.max_tokens} max tokens, {a.clients} clients, greedy streamed chat completions")
    print("| replicas | CPUs / threads per replica | tok/s | TTFT p50 / p95 (s) | per-token p50 / p95 (ms) "
          "| requests per replica | identical to the first |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        same = sum(x == y for x, y in zip(ref, r["texts"]))
        r["identical_to_first"] = same
        print(f"| {r['replicas']} | {r['cpus_per_replica']:g} / {r['threads_per_replica']} | "
              f"{r['tokens_per_second']:.2f} | {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | "
              f"{r['tpot_p50_s'] * 1e3:.0f} / {r['tpot_p95_s'] * 1e3:.0f} | "
              f"{' + '.join(str(v) for v in sorted(r['by_replica'].values(), reverse=True))} | {same}/{len(prompts)} |")
    out = Path(a.out) if a.out else RESULTS / f"ray-serve-{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "engine": name, "deployment": DEPLOYMENT_NAME, "cpus": a.cpus,
                               "draft": a.draft, "prompts": len(prompts), "max_tokens": a.max_tokens,
                               "clients": a.clients, "runs": runs}, indent=2))
    print(f"wrote {out}")
    return 0 if all(r["identical_to_first"] == len(prompts) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
