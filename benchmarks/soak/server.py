"""``dspark serve`` as a subprocess on a free loopback port, and one client request with its outcome."""
from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.evalsets import ROOT, child_env

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
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=child_env(PYTHONUNBUFFERED="1"), cwd=str(ROOT))

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
