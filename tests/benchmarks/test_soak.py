"""A short version of benchmarks.soak (issue 18, "Under load and faults") on the suite's tiny engine: `dspark
serve` as a subprocess on loopback (a delay added to each decoding round so that requests last), mixed
requests with the RSS of the server process, 2 x capacity clients at once (only 200/429), clients hanging
up mid-stream, prompts at and over the context limit, SIGTERM with requests in flight (each finishes or
ends with a clean error, the process exits), and a corrupted then truncated engine file under a running
server (`dspark verify` reports it, the server survives its in-flight requests)."""
import json
import signal
import threading

import pytest

pytest.importorskip("torch")  # the tiny engine is exported from torch models
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.runtime.serving.test_server import _start, _wait  # noqa: E402 - the in-process server helpers of tests/runtime/serving/test_server.py

from benchmarks import soak  # noqa: E402

CLEAN = {"completed", "error_body", "error_event"}


@pytest.fixture(scope="module")
def served(tiny_engine_dir, tmp_path_factory):
    """`dspark serve` of the tiny engine: 2 decoding + 2 queued (capacity 4), context 256, 10 ms per round."""
    srv = soak.ServeProcess(tiny_engine_dir, max_batch=2, max_queue=2, max_context=256, threads=1,
                            step_delay=0.01, log_path=tmp_path_factory.mktemp("serve") / "serve.log").start()
    yield srv
    srv.kill()


def _no_tracebacks(srv):
    assert "Traceback" not in srv.log_text(), srv.log_tail(40)


def test_soak_mixed_requests_and_rss(served):
    r = soak.phase_soak(served, requests=60, warmup=10, concurrency=4, max_tokens=16, repeat=20,
                        log=lambda *a: None)
    assert r["status"] == {"200": 60} and r["outcome"] == {"completed": 60} and r["warmup_bad"] == 0
    assert r["completed"] == 60 and r["idle_after"]
    assert 0 < r["p50_latency_s"] <= r["p95_latency_s"] <= r["max_latency_s"] < soak.READ_TIMEOUT
    assert r["rss_warm_mb"] > 50 and len(r["rss_series_mb"]) == 11  # after the warm-up, then each tenth
    assert abs(r["rss_growth_mb"]) < 50, r["rss_series_mb"]
    assert r["repeat"] == 20 and r["repeat_bad"] == 0 and abs(r["rss_repeat_growth_mb"]) < 5
    a = dict((n, ok) for n, ok, _ in soak.aims({"phases": {"soak": r}}, 50))
    assert all(a.values()), a


def test_overload_answers_only_200_or_429(served):
    r = soak.phase_overload(served, max_tokens=48, log=lambda *a: None)
    assert r["clients"] == 2 * served.capacity == 8
    assert set(r["status"]) == {"200", "429"}, r  # never a 5xx, a timeout or a dropped connection
    assert r["only_200_429"] and r["rejected"] >= 1 and r["accepted"] >= served.capacity
    assert r["accepted"] + r["rejected"] == 8 and r["idle_after"] and not r["problems"]
    assert r["max_latency_s"] < soak.READ_TIMEOUT


def test_clients_that_hang_up_mid_stream_are_cancelled(served):
    r = soak.phase_disconnect(served, n=12, concurrency=3, max_tokens=200, seed=3, log=lambda *a: None,
                              prompts=["hello world", "the the the the", "1 2 3 4 5"])
    # every client hangs up unless it was refused (429: the slots of earlier hang-ups are freed at the next round,
    # which a busy machine delays) or its whole answer was already in the socket's buffers
    assert r["disconnects"] >= (12 - r["status"].get("429", 0)) // 2 and r["disconnects"] >= 4, r
    assert not r["problems"], r
    assert set(r["status"]) <= {"200", "429", "None"}, r["status"]  # None: gave up before the headers
    srv_out = r["server_outcomes"]
    accepted = 12 - r["status"].get("429", 0)
    assert r["all_accounted"] and sum(srv_out.get(k, 0) for k in ("cancelled", "stop", "length")) == accepted
    assert srv_out.get("rejected", 0) == r["status"].get("429", 0)
    # a hang-up is cancelled unless its answer was already complete on the server (the tiny model can write a
    # whole answer into the socket's buffers before the client has read its first chunks)
    assert r["disconnects"] // 2 <= r["server_cancelled"] <= r["disconnects"], r
    assert r["idle_after"] and r["next_request_status"] == 200 and r["next_request_outcome"] == "completed"
    assert served.health()["active"] == 0 and served.health()["queued"] == 0


def test_prompts_at_and_over_the_context_limit(served):
    r = soak.phase_capacity(served, log=lambda *a: None)
    assert r["max_context"] == 256 and not r["any_5xx"]
    by = {c["case"]: c for c in r["cases"]}
    assert by["prompt ctx-1 + 1 token (at the limit)"]["status"] == 200
    assert by["prompt 1 + max_tokens ctx-1 (at the limit)"]["status"] == 200
    over = [c for c in r["cases"] if c["want"] == 400]
    assert len(over) == 7 and all(c["status"] == 400 for c in over), r["cases"]
    for c in over:
        assert "maximum context length is 256 tokens" in c["message"], c
    assert "you requested 257 tokens (255 in the prompt, 2 to generate)" in \
        by["prompt ctx-1 + 2 tokens (1 over)"]["message"]
    assert by["chat over the limit"]["param"] == "messages" and by["max_tokens 10^9"]["param"] == "max_tokens"
    assert r["all_ok"]
    _no_tracebacks(served)


def test_sigterm_with_requests_in_flight_ends_each_cleanly(tiny_engine_dir, tmp_path):
    """Regression (issue 18): requests longer than --shutdown-timeout got a bare 500 (non-streamed) or a cut
    stream (streamed) when uvicorn's graceful timeout cancelled their handlers. Now the engine thread is told
    to drain as soon as shutdown starts, cancels what is left at the timeout, and each handler answers it: a
    503 body or an SSE error event then [DONE]; short requests finish."""
    srv = soak.ServeProcess(tiny_engine_dir, max_batch=4, max_queue=4, shutdown_timeout=1.5, threads=1,
                            step_delay=0.05, log_path=tmp_path / "serve.log").start()
    try:
        r = soak.phase_sigterm(srv, n=6, max_tokens=600, short_tokens=30, log=lambda *a: None)
    finally:
        srv.kill()
    assert r["all_inflight_at_signal"], r
    assert r["unclean"] == 0, r["problems"]
    assert r["completed"] >= 3 and r["clean_errors"] >= 2, r["outcome"]  # the short ones finish
    assert set(r["status"]) <= {"200", "503"}, r["status"]
    codes = {e["code"] for e in r["error_examples"]}
    assert codes == {"cancelled"} and all("shutting down" in e["message"] for e in r["error_examples"])
    assert r["late_request"]["outcome"] == "connection_error" and "refused" in r["late_request"]["error"]
    assert r["exit_code"] in (0, -signal.SIGTERM) and r["exit_s"] < 10, r
    assert "Traceback" not in srv.log_text(), srv.log_tail(40)


def test_in_process_shutdown_timeout_gives_a_clean_stream_end(tiny_engine_dir):
    """Regression (issue 18), ServerThread: a stream longer than the graceful timeout ends with an SSE error
    event and [DONE] (it was cut without either)."""
    from dspark_runtime.engine import Engine

    engine = Engine.load(tiny_engine_dir, threads=1)
    app, srv = _start(engine, slow=0.02, graceful=1.0, draft=None, max_batch=2, shutdown_drain_s=0.0)
    worker = app.state.worker
    lines, started = [], threading.Event()
    out = {}

    def stream():
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=httpx.Timeout(30.0),
                              json={"prompt": "hello world", "max_tokens": 900, "temperature": 0,
                                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line[5:].strip())
                        started.set()
            out["end"] = "closed"
        except httpx.HTTPError as e:
            out["end"] = type(e).__name__

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(20)
    srv.stop()
    t.join(30)
    assert out["end"] == "closed" and lines[-1] == "[DONE]", (out, lines[-3:])
    err = json.loads(lines[-2]).get("error")
    assert err, lines[-3:]
    assert err["code"] == "cancelled" and err["type"] == "service_unavailable"
    assert _wait(lambda: not worker.thread.is_alive()) and worker.gen.target.requests == []


def test_corrupted_then_truncated_engine_under_a_running_server(tiny_engine_dir, tmp_path):
    r = soak.phase_fault(tiny_engine_dir, workdir=str(tmp_path), n=3, max_tokens=48,
                         server_kw=dict(max_batch=2, max_queue=4, threads=1, step_delay=0.01), log=lambda *a: None)
    assert r["verify_before"]["exit_code"] == 0 and "files OK" in r["verify_before"]["output"]
    assert [s["damage"] for s in r["steps"]] == ["overwrite", "truncate"], r
    for s in r["steps"]:
        assert s["verify_failed"] and s["verify_names_file"], s["verify"]
        assert "error:" in s["verify"]["output"] and "Traceback" not in s["verify"]["output"], s["verify"]
        assert s["server_alive"] and set(s["inflight_outcome"]) <= CLEAN, s
        assert s["next_request"]["status"] == 200, s
    assert r["exit_code"] in (0, -signal.SIGTERM)
    assert not list(tmp_path.iterdir())  # the copy is gone
    assert (tiny_engine_dir / "manifest.json").is_file()
    a = soak.aims({"phases": {"fault": r}}, 50)
    assert all(ok for _, ok, _ in a), a
