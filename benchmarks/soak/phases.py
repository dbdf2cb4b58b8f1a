"""The phases of the soak: mixed load with the server's RSS, overload, client disconnects, the context limit,
SIGTERM with requests in flight, and a damaged engine file under a running server (on a copy of the engine)."""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import httpx

from benchmarks.evalsets import ROOT, child_env
from benchmarks.soak.server import (PROMPTS, READ_TIMEOUT, ServeProcess, _counts, _pct, _timeout, mixed_body,
                                    request, wait_for)


def phase_soak(srv: ServeProcess, *, requests: int, warmup: int, concurrency: int, max_tokens: int,
               seed: int = 0, repeat: int = 100, log=print) -> dict:
    """Warm-up, then ``requests`` mixed requests from ``concurrency`` clients; RSS after the warm-up, at
    each tenth and at the end. Then a control: ``repeat`` identical requests one after the other (the same
    shapes every time), whose RSS growth is what a per-request leak would show on its own — the mixed
    load's growth also holds the buffers that grow to the largest shapes seen so far."""
    rng = random.Random(seed)
    bodies = [mixed_body(rng, srv.model, max_tokens, i) for i in range(warmup + requests)]
    with httpx.Client(timeout=_timeout(), limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        def run(k):
            body, chat = bodies[k]
            return request(client, srv.url, body, chat=chat)

        with ThreadPoolExecutor(concurrency) as ex:
            warm = list(ex.map(run, range(warmup)))
            # and the largest shapes the soak will see (ONNX Runtime's buffers grow to them once): a burst of
            # `concurrency` requests of the longest prompt, each asking max_tokens
            longest = max(PROMPTS, key=len)
            burst = [({"model": srv.model, "prompt": longest, "max_tokens": max_tokens, "temperature": 0,
                       "stream": k % 2 == 1, "stop": ["\x00never"]}, False) for k in range(concurrency)]
            warm += list(ex.map(lambda b: request(client, srv.url, b[0], chat=b[1]), burst))
        wait_for(srv.idle, 30)
        rss_warm = srv.rss_mb()
        log(f"  warm-up: {warmup} + {concurrency} requests, RSS {rss_warm:.1f} MiB")
        results, series = [], [(0, rss_warm)]
        t0 = time.perf_counter()
        step = max(1, requests // 10)
        with ThreadPoolExecutor(concurrency) as ex:
            futs = [ex.submit(run, k) for k in range(warmup, warmup + requests)]
            for f in as_completed(futs):
                results.append(f.result())
                if len(results) % step == 0:
                    series.append((len(results), srv.rss_mb()))
                    log(f"  {len(results)}/{requests} requests, RSS {series[-1][1]:.1f} MiB")
        wall = time.perf_counter() - t0
        wait_for(srv.idle, 30)
        rss_end = srv.rss_mb()
        same = {"model": srv.model, "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0}
        request(client, srv.url, same)
        rss_r0 = srv.rss_mb()
        rep = [request(client, srv.url, same) for _ in range(repeat)]
        rss_r1 = srv.rss_mb()
    log(f"  control: {repeat} identical requests one at a time, RSS {rss_r0:.1f} -> {rss_r1:.1f} MiB")
    ok = [r for r in results if r["outcome"] == "completed"]
    lat = [r["latency_s"] for r in ok]
    return {"warmup": len(warm), "requests": requests, "concurrency": concurrency, "max_tokens": max_tokens,
            "warmup_bad": sum(r["outcome"] != "completed" for r in warm),
            "status": _counts(results, "status"), "outcome": _counts(results, "outcome"),
            "completed": len(ok), "wall_s": round(wall, 2), "requests_per_s": round(len(results) / wall, 3),
            "p50_latency_s": _pct(lat, 0.5), "p95_latency_s": _pct(lat, 0.95), "max_latency_s": max(lat, default=None),
            "rss_warm_mb": rss_warm, "rss_end_mb": rss_end, "rss_growth_mb": rss_end - rss_warm,
            # a leak grows as fast in the second half as in the first; caches and allocator arenas that grow to
            # the largest shapes seen level off
            "rss_growth_second_half_mb": rss_end - min(series, key=lambda x: abs(x[0] - requests / 2))[1],
            "rss_series_mb": series, "idle_after": srv.idle(),
            "repeat": repeat, "repeat_bad": sum(r["outcome"] != "completed" for r in rep),
            "rss_repeat_start_mb": rss_r0, "rss_repeat_growth_mb": rss_r1 - rss_r0,
            "problems": [r for r in results if r["outcome"] != "completed"][:10]}


def phase_overload(srv: ServeProcess, *, clients: int | None = None, max_tokens: int = 64, log=print) -> dict:
    """``clients`` (default 2 x capacity) requests released at once, each on its own connection."""
    clients = clients or 2 * srv.capacity
    barrier = threading.Barrier(clients)

    def one(i):
        body = {"model": srv.model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                "temperature": 0, "stream": i % 2 == 1}
        with httpx.Client(timeout=_timeout()) as c:
            try:
                c.get(srv.url + "/health")  # open the connection before the barrier
            except httpx.HTTPError:
                pass
            barrier.wait(30)
            return request(c, srv.url, body)

    with ThreadPoolExecutor(clients) as ex:
        results = list(ex.map(one, range(clients)))
    idle = wait_for(srv.idle, 60)
    status = _counts(results, "status")
    rejected = [r for r in results if r["status"] == 429]
    fine = all((r["status"] == 200 and r["outcome"] == "completed") or
               (r["status"] == 429 and r["outcome"] == "error_body" and r["error"].get("code") == "queue_full")
               for r in results)
    log(f"  overload: {clients} clients at once against capacity {srv.capacity}: status {status}")
    return {"clients": clients, "capacity": srv.capacity, "status": status, "outcome": _counts(results, "outcome"),
            "only_200_429": fine, "rejected": len(rejected), "accepted": sum(r["status"] == 200 for r in results),
            "max_latency_s": max(r["latency_s"] for r in results), "idle_after": idle,
            "problems": [r for r in results if r["status"] not in (200, 429) or
                         r["outcome"] not in ("completed", "error_body")][:10]}


def phase_disconnect(srv: ServeProcess, *, n: int = 40, concurrency: int = 8, max_tokens: int = 64, seed: int = 1,
                     prompts: list | None = None, log=print) -> dict:
    """``n`` clients that go away: most streaming, hanging up after 0..4 chunks; the rest non-streaming,
    giving up after a random 0.05..0.5 s. Then: nothing decoding or queued, and a normal request succeeds.
    A 429 is no problem here: a hang-up frees its slot only once the server notices it (a non-streamed
    request's client is checked every 0.5 s), so clients that come straight back can find the server full."""
    rng = random.Random(seed)
    prompts = prompts or PROMPTS
    before = srv.outcome_counts()
    plan = []
    for i in range(n):
        body = {"model": srv.model, "prompt": prompts[rng.randrange(len(prompts))], "max_tokens": max_tokens,
                "temperature": 0 if rng.random() < 0.5 else 0.8}
        if rng.random() < 0.75:
            plan.append((dict(body, stream=True), rng.randint(0, 4), None))
        else:
            plan.append((body, None, rng.uniform(0.05, 0.5)))

    def one(p):
        body, after, give_up = p
        with httpx.Client(timeout=_timeout(give_up or READ_TIMEOUT)) as c:
            r = request(c, srv.url, body, disconnect_after=after)
        if give_up and r["outcome"] == "timeout":
            r["outcome"] = "disconnected"  # the client gave up, as planned
        return r

    with ThreadPoolExecutor(concurrency) as ex:
        results = list(ex.map(one, plan))
    drained = wait_for(srv.idle, 60)
    disconnects = sum(r["outcome"] == "disconnected" for r in results)
    rejected = sum(r["status"] == 429 for r in results)

    def server_side():
        now = srv.outcome_counts()
        return {k: now.get(k, 0) - before.get(k, 0) for k in now if now.get(k, 0) != before.get(k, 0)}

    # every accepted request ended on the server: cancelled, or finished (it was done before the hang-up
    # was noticed: the tiny model can write a whole answer into the socket's buffers first)
    ended = lambda d: d.get("cancelled", 0) + d.get("stop", 0) + d.get("length", 0)  # noqa: E731
    accounted = wait_for(lambda: ended(server_side()) == n - rejected, 10)
    srv_out = server_side()
    cancelled = srv_out.get("cancelled", 0)
    with httpx.Client(timeout=_timeout()) as c:
        after = request(c, srv.url, {"model": srv.model, "prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0})
    log(f"  disconnect: {disconnects} of {n} clients went away mid-request; server cancelled {cancelled}, "
        f"outcomes {srv_out}; idle after: {drained}; next request: {after['status']}")
    return {"clients": n, "disconnects": disconnects, "outcome": _counts(results, "outcome"),
            "status": _counts(results, "status"), "server_cancelled": cancelled, "server_outcomes": srv_out,
            "all_accounted": accounted, "idle_after": drained,
            "next_request_status": after["status"], "next_request_outcome": after["outcome"],
            "rejected": sum(r["status"] == 429 for r in results),
            "problems": [r for r in results if r["outcome"] not in ("disconnected", "completed")
                         and not (r["status"] == 429 and (r["error"] or {}).get("code") == "queue_full")][:10]}


def phase_capacity(srv: ServeProcess, *, token_id: int | None = None, log=print) -> dict:
    """Prompts (token ids, so their length is exact) at and over the context limit, plus a text prompt and
    a streamed request over it."""
    ctx = srv.max_context
    tid = 100 if token_id is None else token_id  # an ordinary token (special tokens come first in a vocabulary)
    cases = [
        ("prompt ctx-1 + 1 token (at the limit)", {"prompt": [tid] * (ctx - 1), "max_tokens": 1}, 200),
        ("prompt 1 + max_tokens ctx-1 (at the limit)", {"prompt": [tid], "max_tokens": ctx - 1,
                                                        "stop": ["\x00never"]}, 200),
        ("prompt ctx-1 + 2 tokens (1 over)", {"prompt": [tid] * (ctx - 1), "max_tokens": 2}, 400),
        ("prompt ctx tokens, no max_tokens", {"prompt": [tid] * ctx}, 400),
        ("prompt ctx+100 tokens", {"prompt": [tid] * (ctx + 100), "max_tokens": 1}, 400),
        ("max_tokens 10^9", {"prompt": [tid] * 4, "max_tokens": 10 ** 9}, 400),
        ("streamed, prompt ctx+1", {"prompt": [tid] * (ctx + 1), "max_tokens": 1, "stream": True}, 400),
        ("text prompt over the limit", {"prompt": "x " * (ctx + 50), "max_tokens": 1}, 400),
        ("chat over the limit", {"messages": [{"role": "user", "content": "y " * (ctx + 50)}], "max_tokens": 1}, 400),
    ]
    rows = []
    with httpx.Client(timeout=_timeout(600.0)) as c:
        for name, body, want in cases:
            body = dict(body, model=srv.model, temperature=0)
            r = request(c, srv.url, body, chat="messages" in body)
            e = r["error"] if isinstance(r["error"], dict) else {}
            ok = r["status"] == want and (
                r["outcome"] == "completed" if want == 200 else
                r["outcome"] == "error_body" and e.get("code") == "context_length_exceeded"
                and str(ctx) in e.get("message", ""))
            rows.append({"case": name, "want": want, "status": r["status"], "outcome": r["outcome"], "ok": ok,
                         "message": e.get("message"), "param": e.get("param"), "latency_s": round(r["latency_s"], 2)})
            log(f"  capacity: {name}: {r['status']} {'ok' if ok else 'MISSED'}"
                + (f" ({e.get('message')})" if e and not ok else ""))
    return {"max_context": ctx, "cases": rows, "all_ok": all(x["ok"] for x in rows),
            "any_5xx": any((x["status"] or 0) >= 500 for x in rows), "example_message": next(
                (x["message"] for x in rows if x["message"]), None)}


def phase_sigterm(srv: ServeProcess, *, n: int = 8, max_tokens: int = 512, short_tokens: int = 64,
                  log=print) -> dict:
    """SIGTERM with ``n`` requests in flight (half streamed): half short (they should finish), half long
    (beyond the shutdown timeout: they should end with a clean error). Then a request after the signal."""
    results: list = [None] * n
    started = [threading.Event() for _ in range(n)]

    def one(i):
        body = {"model": srv.model, "prompt": PROMPTS[i % len(PROMPTS)], "temperature": 0,
                "max_tokens": short_tokens if i % 4 < 2 else max_tokens, "stream": i % 2 == 1,
                "stop": ["\x00never"]}
        with httpx.Client(timeout=_timeout(srv.shutdown_timeout + 60)) as c:
            started[i].set()
            results[i] = request(c, srv.url, body)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for e in started:
        e.wait(10)

    polls: list = []  # (s, active, queued) each time /health changed: how the requests came in
    t_poll = time.monotonic()

    def all_in():
        h = srv.health()
        v = None if h is None else (h["active"], h["queued"])
        if not polls or polls[-1][1:] != (v or (None, None)):
            polls.append((round(time.monotonic() - t_poll, 2),) + (v or (None, None)))
        return v is not None and sum(v) >= n

    inflight = wait_for(all_in, 30, 0.01)  # the signal goes as soon as every request is in
    h = srv.health() or {}
    rss = srv.rss_mb()
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with httpx.Client(timeout=_timeout(30)) as c:
        late = request(c, srv.url, {"model": srv.model, "prompt": "late", "max_tokens": 4})
    try:
        code = srv.proc.wait(srv.shutdown_timeout + 30)
    except subprocess.TimeoutExpired:
        srv.kill()
        code = None
    exit_s = time.monotonic() - t0
    for t in threads:
        t.join(60)
    hung = sum(t.is_alive() for t in threads)
    results = [r or {"outcome": "timeout", "status": None} for r in results]
    clean = {"completed", "error_body", "error_event"}
    outcomes = _counts(results, "outcome")
    log(f"  sigterm: {n} in flight ({h.get('active')} decoding, {h.get('queued')} queued): {outcomes}; "
        f"exit code {code} after {exit_s:.1f} s; request after the signal: {late['outcome']} {late['status'] or ''}")
    errors = [r.get("error") for r in results if r["outcome"] in ("error_body", "error_event")]
    return {"inflight": n, "all_inflight_at_signal": inflight, "health_polls": polls[:40], "outcome": outcomes,
            "status": _counts(results, "status"), "completed": sum(r["outcome"] == "completed" for r in results),
            "clean_errors": len(errors), "unclean": sum(r["outcome"] not in clean for r in results) + hung,
            "error_examples": errors[:2], "late_request": {"status": late["status"], "outcome": late["outcome"],
                                                            "error": late["error"]},
            "exit_code": code, "exit_s": round(exit_s, 2), "bound_s": srv.shutdown_timeout + 30,
            "rss_at_signal_mb": rss, "shutdown_timeout_s": srv.shutdown_timeout,
            "problems": [r for r in results if r["outcome"] not in clean][:10]}


def _weights_file(engine: Path) -> Path:
    """The engine's largest file (the target's external weights on a real engine)."""
    files = [p for p in engine.rglob("*") if p.is_file() and p.name != "manifest.json"]
    target = [p for p in files if p.name.startswith("target")]
    return max(target or files, key=lambda p: p.stat().st_size)


def _verify(engine: Path) -> dict:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "dspark_runtime.cli", "verify", "--engine", str(engine)],
                       capture_output=True, text=True, timeout=600, cwd=str(ROOT),
                       env=child_env())
    return {"exit_code": p.returncode, "output": (p.stdout + p.stderr).strip()[-600:],
            "seconds": round(time.monotonic() - t0, 2)}


def phase_fault(engine: Path, *, workdir: str | None = None, n: int = 4, max_tokens: int = 48,
                server_kw: dict | None = None, log=print) -> dict:
    """On a copy of ``engine``: a server; with ``n`` requests in flight, overwrite 64 KiB in the middle of the
    target's weights, ``dspark verify``, requests; then truncate that file to half, ``dspark verify``,
    requests. Reports each step; the copy is removed."""
    tmp = Path(tempfile.mkdtemp(prefix="dspark-soak-fault-", dir=workdir))
    copy = tmp / "engine"
    out: dict = {"steps": []}
    srv = None
    try:
        shutil.copytree(engine, copy)
        before = _verify(copy)
        out["verify_before"] = before
        victim = _weights_file(copy)
        out["file"] = victim.name
        out["file_bytes"] = victim.stat().st_size
        srv = ServeProcess(copy, log_path=tmp / "serve.log", **(server_kw or {})).start()
        probe = {"model": srv.model, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        with httpx.Client(timeout=_timeout()) as c:
            ref = request(c, srv.url, probe)
        out["reference_text"] = ref.get("text")

        def damage(kind):
            if kind == "overwrite":
                size = victim.stat().st_size
                with open(victim, "r+b") as f:
                    f.seek(size // 2)
                    f.write(os.urandom(64 * 1024))
                    f.flush()
                    os.fsync(f.fileno())
            else:
                with open(victim, "r+b") as f:
                    f.truncate(victim.stat().st_size // 2)

        for kind in ("overwrite", "truncate"):
            results: list = [None] * n

            def one(i):
                body = {"model": srv.model, "prompt": PROMPTS[(i + 1) % len(PROMPTS)], "max_tokens": max_tokens,
                        "temperature": 0, "stream": i % 2 == 0}
                with httpx.Client(timeout=_timeout()) as c:
                    results[i] = request(c, srv.url, body)

            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
            for t in threads:
                t.start()
            wait_for(lambda: ((srv.health() or {}).get("active") or 0) > 0, 10, 0.02)
            damage(kind)
            for t in threads:
                t.join(READ_TIMEOUT + 10)
            results = [r or {"outcome": "timeout", "status": None} for r in results]
            alive = srv.alive
            after = None
            if alive:
                with httpx.Client(timeout=_timeout()) as c:
                    after = request(c, srv.url, probe)
            v = _verify(copy)
            step = {"damage": kind, "inflight_outcome": _counts(results, "outcome"),
                    "inflight_status": _counts(results, "status"), "server_alive": alive and srv.alive,
                    "exit_code": None if srv.alive else srv.proc.returncode,
                    "next_request": None if after is None else {"status": after["status"], "outcome": after["outcome"],
                                                                "same_text": after.get("text") == ref.get("text")},
                    "verify": v, "verify_failed": v["exit_code"] != 0,
                    "verify_names_file": victim.name in v["output"]}
            out["steps"].append(step)
            log(f"  fault ({kind} {victim.name}): in flight {step['inflight_outcome']}; server alive "
                f"{step['server_alive']}; next request {step['next_request']}; dspark verify exit {v['exit_code']}: "
                f"{v['output'].splitlines()[-1] if v['output'] else ''}")
            if not srv.alive:
                break
        if srv.alive:
            code, secs = srv.terminate()
            out["exit_code"], out["exit_s"] = code, round(secs, 2)
        else:
            out["exit_code"], out["exit_s"] = srv.proc.returncode, None
        out["server_log_tail"] = srv.log_tail(8)
    finally:
        if srv is not None:
            srv.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return out
