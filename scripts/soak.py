#!/usr/bin/env python
"""Soak and fault test of ``dspark serve`` on loopback (issue 18, "Under load and faults").

Starts ``dspark serve`` as a subprocess on a free 127.0.0.1 port and runs, with bounded counts and client
timeouts (a hung connection shows up as a timeout, which misses the aim):

1. ``soak``: a warm-up, then ``--requests`` requests (completions and chat, streamed and not, greedy and
   seeded sampling, 1..``--max-tokens`` tokens) from ``--concurrency`` clients; the server process's RSS after
   the warm-up, every tenth of the way and at the end (aim: growth < ``--rss-aim-mb``).
2. ``overload``: 2 x capacity (``--max-batch`` + ``--max-queue``, so at least 2 x max-queue) clients at once:
   only 200 and 429 (``queue_full``) answers, never a 5xx, a timeout or a dropped connection.
3. ``disconnect``: streaming clients that hang up after a random number of chunks (zero included) and
   non-streaming clients that give up after a random wait; afterwards nothing is left decoding or queued and
   a normal request still succeeds.
4. ``capacity``: prompts at and over the context limit (``--max-context``): at the limit 200, over it a 400
   ``context_length_exceeded`` whose message names the limit, never a 5xx.
5. ``sigterm``: SIGTERM with streamed and non-streamed requests in flight, some longer than
   ``--shutdown-timeout``: each finishes (200, finish_reason) or ends with a clean error (a 503 body, or an
   SSE error event then ``data: [DONE]``), never a cut connection; the process exits within the timeout
   plus a margin (exit code reported: 0, or -15 when uvicorn re-raises the SIGTERM it handled).
6. ``fault``: on a copy of the engine (the original is never touched), a second server; with requests in
   flight, bytes of the target's weight file are overwritten, then the file is truncated; ``dspark verify``
   runs after each (aim: it fails and names the file) and the server must not crash on the in-flight
   requests (what happens to them and to later requests is reported).

Prints a table of figures, writes them as JSON (``--json``) and exits 1 when an aim is missed.

    python scripts/soak.py --engine /tmp/soak/engine --json scripts/results/soak-smollm2-135m.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "def quicksort(xs):\n    ",
    "Explain in two sentences what a hash table is.",
    "The capital of France is",
    "import numpy as np\nimport numpy as np\nimport numpy as np\n",
    "List three prime numbers greater than 100.",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Translate to French: The weather is nice today.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
    "Once upon a time, in a small village by the sea,",
]
READ_TIMEOUT = 120.0  # no request of the soak legitimately takes longer: beyond it the connection hung


def _timeout(read: float = READ_TIMEOUT) -> httpx.Timeout:
    return httpx.Timeout(connect=10.0, read=read, write=10.0, pool=30.0)


def _pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def free_port() -> int:
    """A free loopback TCP port (bound and released; the server binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, timeout: float, every: float = 0.05) -> bool:
    """Poll ``cond()`` until it is true (True) or ``timeout`` seconds pass (False)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if cond():
            return True
        time.sleep(every)
    return bool(cond())


# ---------------------------------------------------------------------------------------- the server process


# Runs `dspark serve` with a delay added to every decoding round (a test aid: the suite's tiny model decodes
# thousands of tokens/s, and the overload, disconnect and SIGTERM phases need requests that last).
_DELAYED = ("import sys, time\n"
            "from dspark_runtime.decoding import loop as decoding\n"
            "_step = decoding.DecodingLoop.step\n"
            "_delay = float(sys.argv[1])\n"
            "def step(self):\n"
            "    time.sleep(_delay)\n"
            "    return _step(self)\n"
            "decoding.DecodingLoop.step = step\n"
            "from dspark_runtime.cli import main\n"
            "main(sys.argv[2:])\n")


class ServeProcess:
    """``dspark serve`` as a subprocess on a free loopback port; its output goes to ``log_path``.

    Args:
        engine: engine directory.
        max_batch, max_queue, max_context, shutdown_timeout, draft, threads: ``dspark serve`` options.
        step_delay: seconds added to every decoding round (test aid; 0 runs the CLI as is).
    """

    def __init__(self, engine, *, max_batch: int = 8, max_queue: int = 16, max_context: int | None = None,
                 shutdown_timeout: float = 5.0, draft: str = "auto", threads: int | None = None,
                 step_delay: float = 0.0, log_path: str | Path | None = None):
        self.engine = Path(engine)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["serve", "--engine", str(self.engine), "--host", "127.0.0.1", "--port", str(self.port),
                "--max-batch", str(max_batch), "--max-queue", str(max_queue), "--draft", draft,
                "--shutdown-timeout", str(shutdown_timeout), "--log-level", "info"]
        if max_context:
            args += ["--max-context", str(max_context)]
        if threads:
            args += ["--threads", str(threads)]
        self.args = args
        self.cmd = ([sys.executable, "-c", _DELAYED, str(step_delay)] if step_delay else
                    [sys.executable, "-m", "dspark_runtime.cli"]) + args
        self.shutdown_timeout = shutdown_timeout
        self.capacity = max_batch + max_queue
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="dspark-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.model = None
        self.max_context = None

    def start(self, timeout: float = 180.0) -> "ServeProcess":
        """Start the process and wait until /health answers 200. Raises RuntimeError (with the log's tail)
        if it exits or does not come up in ``timeout`` seconds."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))

        def up():
            if self.proc.poll() is not None:
                return True
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        if not wait_for(up, timeout, 0.2) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"`dspark serve` did not come up (exit {self.proc.returncode}):\n{self.log_tail()}")
        m = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]
        self.model, self.max_context = m["id"], m["max_model_len"]
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_mb(self) -> float | None:
        """The server process's resident set (VmRSS), MiB; None once it has exited."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
        except OSError:
            return None
        return None

    def health(self) -> dict | None:
        try:
            r = httpx.get(self.url + "/health", timeout=5)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def metrics(self) -> dict:
        """{(name, frozenset(labels)): value} of /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        r = httpx.get(self.url + "/metrics", timeout=10)
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(r.text) for s in fam.samples}

    def outcome_counts(self) -> dict:
        """{outcome: count} of dspark_requests_total over both endpoints (stop, length, cancelled, ...)."""
        out: dict = {}
        for (n, lab), v in self.metrics().items():
            if n == "dspark_requests_total":
                k = dict(lab)["outcome"]
                out[k] = out.get(k, 0) + int(v)
        return out

    def cancelled_count(self) -> int:
        return self.outcome_counts().get("cancelled", 0)

    def idle(self) -> bool:
        h = self.health()
        return h is not None and h["active"] == 0 and h["queued"] == 0

    def terminate(self, sig=signal.SIGTERM, timeout: float | None = None) -> tuple:
        """Send ``sig``; wait up to ``timeout`` s (default: the shutdown timeout + 30). Returns (exit code or
        None if it had to be killed, seconds to exit)."""
        timeout = self.shutdown_timeout + 30.0 if timeout is None else timeout
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = None
        return code, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if getattr(self, "_log", None):
            self._log.close()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.kill()


# ---------------------------------------------------------------------------------------- one request


def request(client: httpx.Client, url: str, body: dict, *, chat: bool = False, disconnect_after: int | None = None
            ) -> dict:
    """One request; returns {status, outcome, latency_s, chunks, error, text}. ``outcome``: "completed" (a 200
    with a finish_reason; streamed: then ``[DONE]``), "error_body" (a non-200 with an OpenAI-style error
    body), "error_event" (a stream that ended with an error event and ``[DONE]``: a clean error),
    "disconnected" (the client hung up after ``disconnect_after`` chunks, as asked), "timeout" (no answer
    in the client's timeout: a hung connection), "connection_error" (the server cut the connection),
    "truncated_stream" (a stream that ended without ``[DONE]`` or without a finish_reason), "bad_body"."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    out = {"status": None, "outcome": None, "latency_s": None, "chunks": 0, "error": None, "text": None,
           "stream": bool(body.get("stream"))}
    t0 = time.perf_counter()
    try:
        if not body.get("stream"):
            r = client.post(url + path, json=body)
            out["status"] = r.status_code
            try:
                j = r.json()
            except ValueError:
                j = None
            if r.status_code == 200 and j and j.get("choices") and j["choices"][0].get("finish_reason"):
                out["outcome"] = "completed"
                c = j["choices"][0]
                out["text"] = c["message"]["content"] if chat else c["text"]
            elif r.status_code != 200 and isinstance(j, dict) and isinstance(j.get("error"), dict) \
                    and j["error"].get("message"):
                out["outcome"], out["error"] = "error_body", j["error"]
            else:
                out["outcome"] = "bad_body"
                out["error"] = r.text[:300]
        else:
            with client.stream("POST", url + path, json=body) as r:
                out["status"] = r.status_code
                if r.status_code != 200:
                    r.read()
                    try:
                        j = r.json()
                    except ValueError:
                        j = None
                    ok = isinstance(j, dict) and isinstance(j.get("error"), dict) and j["error"].get("message")
                    out["outcome"] = "error_body" if ok else "bad_body"
                    out["error"] = j["error"] if ok else r.text[:300]
                else:
                    finish, err, done, parts = None, None, False, []
                    if disconnect_after == 0:
                        out["outcome"] = "disconnected"
                        return out
                    for line in r.iter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            err = obj["error"]
                            continue
                        out["chunks"] += 1
                        if obj.get("choices"):
                            c = obj["choices"][0]
                            parts.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
                            finish = finish or c.get("finish_reason")
                        if disconnect_after is not None and out["chunks"] >= disconnect_after and not finish:
                            out["outcome"] = "disconnected"
                            return out
                    out["text"] = "".join(parts)
                    if done and err is not None:
                        out["outcome"], out["error"] = "error_event", err
                    elif done and finish:
                        out["outcome"] = "completed"
                    else:
                        out["outcome"] = "truncated_stream"
                        out["error"] = err
    except httpx.TimeoutException as e:
        out["outcome"], out["error"] = "timeout", type(e).__name__
    except httpx.HTTPError as e:
        out["outcome"], out["error"] = "connection_error", f"{type(e).__name__}: {e}"
    finally:
        out["latency_s"] = time.perf_counter() - t0
    return out


def mixed_body(rng: random.Random, model: str, max_tokens: int, i: int) -> tuple:
    """(body, chat) of the ``i``-th request of the soak: endpoint, streaming, sampling and length vary."""
    chat = i % 2 == 0
    prompt = PROMPTS[rng.randrange(len(PROMPTS))]
    body = {"model": model, "max_tokens": rng.randint(1, max_tokens), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(2 ** 31))
    if body["stream"] and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body, chat


def _counts(results, key) -> dict:
    c: dict = {}
    for r in results:
        k = str(r[key])
        c[k] = c.get(k, 0) + 1
    return dict(sorted(c.items()))


# ---------------------------------------------------------------------------------------- the phases


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
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
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


# ---------------------------------------------------------------------------------------- aims and report


def clean_exit(code) -> bool:
    """0, or killed by the SIGTERM it was sent (uvicorn re-raises a handled signal after a graceful shutdown)."""
    return code in (0, -signal.SIGTERM)


def aims(res: dict, rss_aim_mb: float) -> list:
    """[(aim, met, figure)] of a run's results."""
    a = []
    p = res.get("phases", {})
    if "soak" in p:
        s = p["soak"]
        a.append(("soak: every request completed (200)", s["completed"] == s["requests"] and not s["warmup_bad"],
                  f"{s['completed']}/{s['requests']}"))
        a.append((f"soak: RSS growth after warm-up < {rss_aim_mb:g} MB", s["rss_growth_mb"] < rss_aim_mb,
                  f"{s['rss_growth_mb']:+.1f} MiB"))
        if s.get("repeat"):
            a.append(("soak control: identical requests do not grow RSS (< 5 MB)",
                      s["rss_repeat_growth_mb"] < 5 and not s["repeat_bad"],
                      f"{s['rss_repeat_growth_mb']:+.1f} MiB over {s['repeat']}"))
    if "overload" in p:
        o = p["overload"]
        a.append(("overload: only 200/429, no 5xx, no hung connection", o["only_200_429"], str(o["status"])))
        a.append(("overload: the excess was shed (some 429)", o["rejected"] > 0, f"{o['rejected']} x 429"))
        a.append(("overload: server idle afterwards", o["idle_after"], str(o["idle_after"])))
    if "disconnect" in p:
        d = p["disconnect"]
        a.append(("disconnect: each request cancelled or finished, nothing left decoding or queued",
                  d["idle_after"] and d["all_accounted"] and not d["problems"],
                  f"{d['disconnects']} disconnects, {d['server_cancelled']} cancelled"))
        a.append(("disconnect: next request succeeds", d["next_request_outcome"] == "completed",
                  str(d["next_request_status"])))
    if "capacity" in p:
        c = p["capacity"]
        a.append(("capacity: 200 at the limit, 400 naming it over the limit, no 5xx", c["all_ok"] and not c["any_5xx"],
                  f"{sum(x['ok'] for x in c['cases'])}/{len(c['cases'])} cases"))
    if "sigterm" in p:
        t = p["sigterm"]
        a.append(("sigterm: every request was in flight at the signal", t["all_inflight_at_signal"],
                  str(t["health_polls"][-1:])))
        a.append(("sigterm: each in-flight request finished or ended with a clean error", t["unclean"] == 0,
                  f"{t['completed']} finished, {t['clean_errors']} clean errors, {t['unclean']} unclean"))
        a.append(("sigterm: the process exited in time, cleanly", t["exit_code"] is not None
                  and clean_exit(t["exit_code"]), f"exit {t['exit_code']} after {t['exit_s']} s"))
    if "fault" in p:
        f = p["fault"]
        for st in f.get("steps", []):
            a.append((f"fault ({st['damage']}): dspark verify reports it, naming the file",
                      st["verify_failed"] and st["verify_names_file"], f"exit {st['verify']['exit_code']}"))
            a.append((f"fault ({st['damage']}): server survives its in-flight requests",
                      st["server_alive"] and set(st["inflight_outcome"]) <= {"completed", "error_body", "error_event"},
                      str(st["inflight_outcome"])))
        if "error" in f:
            a.append(("fault: phase ran", False, f["error"]))
    for name, ph in p.items():
        if isinstance(ph, dict) and "exception" in ph:
            a.append((f"{name}: phase ran", False, ph["exception"]))
    return a


def table(res: dict, rss_aim_mb: float) -> str:
    p = res.get("phases", {})
    rows = []
    fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
    if "soak" in p:
        s = p["soak"]
        rows += [("requests (after warm-up)", f"{s['requests']} (+{s['warmup']} warm-up), {s['concurrency']} clients"),
                 ("status counts", str(s["status"])),
                 ("throughput", f"{s['requests_per_s']} req/s over {s['wall_s']} s"),
                 ("latency p50 / p95 / max", f"{fmt(s['p50_latency_s'])} / {fmt(s['p95_latency_s'])} / "
                                            f"{fmt(s['max_latency_s'])} s"),
                 ("RSS after warm-up", f"{s['rss_warm_mb']:.1f} MiB"),
                 ("RSS after the soak", f"{s['rss_end_mb']:.1f} MiB ({s['rss_growth_mb']:+.1f} MiB; second half "
                                        f"{s['rss_growth_second_half_mb']:+.1f} MiB)"),
                 ("RSS, identical requests (control)", f"{s['rss_repeat_growth_mb']:+.1f} MiB over {s['repeat']} "
                                                       f"requests one at a time")]
    if "rss_end_mb" in res:
        rows.append(("RSS at the end (before SIGTERM)", f"{res['rss_end_mb']:.1f} MiB ({res['rss_growth_mb']:+.1f} "
                                                        f"MiB since warm-up)"))
    if res.get("rss_after_phase_mb"):
        rows.append(("RSS after each phase", ", ".join(f"{k} {v:.0f}" for k, v in res["rss_after_phase_mb"].items())
                     + " MiB"))
    if "overload" in p:
        o = p["overload"]
        rows.append(("overload (clients / capacity)", f"{o['clients']} / {o['capacity']}: {o['status']}"))
    if "disconnect" in p:
        d = p["disconnect"]
        rows.append(("disconnects (server cancelled)", f"{d['disconnects']} of {d['clients']} clients "
                                                       f"({d['server_cancelled']}); server outcomes "
                                                       f"{d['server_outcomes']}; next request "
                                                       f"{d['next_request_status']}"))
    if "capacity" in p:
        c = p["capacity"]
        rows.append(("capacity cases ok", f"{sum(x['ok'] for x in c['cases'])}/{len(c['cases'])} at max context "
                                          f"{c['max_context']}"))
    if "sigterm" in p:
        t = p["sigterm"]
        rows += [("SIGTERM outcome", f"{t['inflight']} in flight: {t['completed']} finished, {t['clean_errors']} "
                                     f"clean errors, {t['unclean']} unclean"),
                 ("exit code (time)", f"{t['exit_code']} ({t['exit_s']} s, bound {t['bound_s']:g} s)")]
    if "fault" in p:
        for st in p["fault"].get("steps", []):
            rows.append((f"fault: {st['damage']} {p['fault']['file']}",
                         f"in flight {st['inflight_outcome']}; alive {st['server_alive']}; verify exit "
                         f"{st['verify']['exit_code']}"))
    w = max(len(r[0]) for r in rows) if rows else 0
    lines = [f"{k:<{w}}  {v}" for k, v in rows]
    lines.append("")
    for name, ok, fig in aims(res, rss_aim_mb):
        lines.append(f"[{'ok' if ok else 'MISSED'}] {name}: {fig}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True, help="engine directory")
    ap.add_argument("--requests", type=int, default=1000, help="soak requests after the warm-up")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=100, help="identical requests of the RSS control")
    ap.add_argument("--concurrency", type=int, default=8, help="soak clients")
    ap.add_argument("--max-tokens", type=int, default=24, help="soak requests ask 1..this many tokens")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=1024,
                    help="the server's context limit for the capacity phase (0: the engine's own)")
    ap.add_argument("--shutdown-timeout", type=float, default=5.0)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--overload-tokens", type=int, default=64)
    ap.add_argument("--disconnects", type=int, default=40)
    ap.add_argument("--sigterm-requests", type=int, default=8)
    ap.add_argument("--sigterm-tokens", type=int, default=512, help="length of the long in-flight requests")
    ap.add_argument("--step-delay", type=float, default=0.0,
                    help="test aid: seconds added to every decoding round (tiny engines)")
    ap.add_argument("--rss-aim-mb", type=float, default=50.0)
    ap.add_argument("--phases", default="soak,overload,disconnect,capacity,sigterm,fault")
    ap.add_argument("--workdir", default=None, help="where the fault phase copies the engine (default: $TMPDIR)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)

    from dspark_runtime.machine.sysinfo import machine_description

    engine = Path(args.engine)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    kw = dict(max_batch=args.max_batch, max_queue=args.max_queue, max_context=args.max_context or None,
              shutdown_timeout=args.shutdown_timeout, draft=args.draft, threads=args.threads,
              step_delay=args.step_delay)
    res = {"machine": machine_description(), "engine": str(engine), "config": vars(args), "phases": {}}
    print(f"machine: {res['machine']}\nengine: {engine}")
    t_start = time.monotonic()
    main_phases = [p for p in phases if p != "fault"]
    if main_phases:
        srv = ServeProcess(engine, **kw).start()
        res["server_cmd"] = "dspark " + " ".join(srv.args)
        res["max_context"] = srv.max_context
        print(f"server pid {srv.proc.pid} on {srv.url}: capacity {srv.capacity}, max context {srv.max_context}")
        try:
            for ph in main_phases:
                print(f"[{ph}]")
                try:
                    if ph == "soak":
                        r = phase_soak(srv, requests=args.requests, warmup=args.warmup, concurrency=args.concurrency,
                                       max_tokens=args.max_tokens, seed=args.seed, repeat=args.repeat)
                    elif ph == "overload":
                        r = phase_overload(srv, max_tokens=args.overload_tokens)
                    elif ph == "disconnect":
                        r = phase_disconnect(srv, n=args.disconnects, concurrency=args.concurrency,
                                             seed=args.seed + 1)
                    elif ph == "capacity":
                        r = phase_capacity(srv)
                    elif ph == "sigterm":
                        if "soak" in res["phases"]:
                            rss = srv.rss_mb()
                            res["rss_end_mb"] = rss
                            res["rss_growth_mb"] = rss - res["phases"]["soak"]["rss_warm_mb"]
                        r = phase_sigterm(srv, n=args.sigterm_requests, max_tokens=args.sigterm_tokens)
                    else:
                        raise SystemExit(f"unknown phase {ph!r}")
                except Exception as e:  # noqa: BLE001 - report the phase as missed, run the rest
                    r = {"exception": f"{type(e).__name__}: {e}"}
                    print(f"  phase failed: {r['exception']}")
                res["phases"][ph] = r
                if ph != "sigterm" and srv.alive:
                    res.setdefault("rss_after_phase_mb", {})[ph] = round(srv.rss_mb(), 1)
                if not srv.alive and ph != "sigterm":
                    res["phases"][ph]["exception"] = (f"the server exited (code {srv.proc.returncode}):\n"
                                                      f"{srv.log_tail()}")
                    break
        finally:
            res["server_log_tail"] = srv.log_tail(12)
            srv.kill()
    if "fault" in phases:
        print("[fault]")
        try:
            res["phases"]["fault"] = phase_fault(engine, workdir=args.workdir, server_kw=kw)
        except Exception as e:  # noqa: BLE001
            res["phases"]["fault"] = {"exception": f"{type(e).__name__}: {e}"}
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    a = aims(res, args.rss_aim_mb)
    res["aims"] = [{"aim": n, "met": ok, "figure": f} for n, ok, f in a]
    print()
    print(table(res, args.rss_aim_mb))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"\nwrote {args.json}")
    return 0 if all(ok for _, ok, _ in a) else 1


if __name__ == "__main__":
    sys.exit(main())
