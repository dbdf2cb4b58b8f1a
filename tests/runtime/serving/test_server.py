"""`dspark serve` over real HTTP on loopback with the tiny engine: the official openai client as the peer
(streaming and not), greedy outputs equal to decoding each prompt alone, a bounded concurrent load,
429 when full, client disconnects, graceful shutdown, OpenAI-style 4xx bodies, /metrics, and
schemathesis against the server's OpenAPI document (no 5xx)."""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch")  # the tiny engine is exported from torch models
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

PROMPTS = ["hello world", "def f(x):\n    return x + 1\n\ndef g(x):", "the the the the the",
           "import numpy as np\nimport numpy as np\n", "1 2 3 4 5 6 7 8 9", "Write a function that sorts a list."]
MAX_TOKENS = 24
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def engine(tiny_engine_dir):
    from dspark_runtime.engine import Engine

    return Engine.load(tiny_engine_dir, threads=1)


@pytest.fixture(scope="module")
def solo(engine):
    """Target-only greedy results of each prompt decoded alone: chat-templated and raw."""
    return {(p, raw): engine.generate(p, max_new_tokens=MAX_TOKENS, draft=None, raw=raw)
            for p in PROMPTS for raw in (False, True)}


def _start(engine, slow: float = 0.0, graceful: float | None = 10, **kw):
    """A server in a background thread. ``slow``: seconds added to every decoding round (the tiny model
    decodes thousands of tokens/s; the queue, disconnect and shutdown tests need requests that last)."""
    from dspark_runtime.serving.app import create_app
    from dspark_runtime.serving.server import ServerThread

    app = create_app(engine, **kw)
    if slow:
        gen = app.state.worker.gen
        step = gen.step

        def slow_step():
            time.sleep(slow)
            return step()

        gen.step = slow_step
    return app, ServerThread(app, timeout_graceful_shutdown=graceful).start()


@pytest.fixture(scope="module")
def server(engine):
    """The main server: draft LM, γ = 3, up to 4 requests per round, 16 more queued."""
    app, srv = _start(engine, draft="lm", draft_length=3, max_batch=4, max_queue=16)
    srv.app = app
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _wait(cond, timeout=10.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _metrics(url) -> dict:
    """{(name, frozenset(labels)): value} of the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


# ---------------------------------------------------------------------------------------- the openai client


def test_completions_with_the_openai_client(client, engine, solo, server):
    name = server.app.state.model_name
    assert [m.id for m in client.models.list().data] == [name]
    for p in PROMPTS[:3]:
        ref = solo[(p, True)]
        r = client.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
        assert r.usage.prompt_tokens == len(engine.encode_prompt(p, raw=True))
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        ext = r.model_extra["dspark"]
        assert ext["drafter"] == "lm" and ext["tau"] >= 1.0 and 0.0 <= ext["acceptance_rate"] <= 1.0
        # streamed: the pieces add up to the same text; usage comes in a last chunk without choices
        chunks = list(client.completions.create(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finals) == 1 and finals[0].choices[0].finish_reason == r.choices[0].finish_reason
        assert finals[0].model_extra["dspark"]["tau"] >= 1.0
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    # a prompt of token ids
    ids = engine.encode_prompt(PROMPTS[0], raw=True)
    r = client.completions.create(model=name, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == solo[(PROMPTS[0], True)].text


def test_chat_completions_with_the_openai_client(client, solo, server):
    name = server.app.state.model_name
    for p in PROMPTS[3:]:
        ref = solo[(p, False)]
        msgs = [{"role": "user", "content": p}]
        r = client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref.text
        assert r.usage.completion_tokens == len(ref.token_ids)
        stream = client.chat.completions.create(model=name, messages=msgs, max_completion_tokens=MAX_TOKENS,
                                                temperature=0, stream=True)
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_strings_and_seeded_sampling(client, engine, server):
    name = server.app.state.model_name
    ref = engine.generate(PROMPTS[1], max_new_tokens=MAX_TOKENS, draft=None)
    stop = ref.text[6:9]
    assert stop and ref.text.find(stop) > 0
    want = ref.text[:ref.text.find(stop)]
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    r = client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX_TOKENS, temperature=0, stop=stop)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=name, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                                 stop=[stop, "\x00never"], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    # sampling with a seed is reproducible through the server and equals the library's
    kw = dict(model=name, prompt=PROMPTS[2], max_tokens=16, temperature=0.9, top_p=0.95, seed=11)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    lib = engine.generate_batch([PROMPTS[2]], max_new_tokens=16, temperature=0.9, top_p=0.95, seed=11, raw=True,
                                draft="lm", draft_length=3)[0].text
    assert a == b == lib


def test_concurrent_load_equals_solo(client, solo, server):
    """8 concurrent clients, 16 requests (completions and chat, streamed and not), through a batch of 4:
    every greedy output equals its prompt decoded alone."""
    name = server.app.state.model_name
    assert server.app.state.worker.gen.draft_skip  # the server skips drafting passes that do not pay
    before = dict(server.app.state.worker.gen.stats.batch_histogram)

    def one(i):
        p = PROMPTS[i % len(PROMPTS)]
        chat, stream = i % 2 == 0, i % 4 < 2
        if chat:
            kw = dict(model=name, messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, temperature=0)
            if stream:
                return p, False, "".join(c.choices[0].delta.content or ""
                                         for c in client.chat.completions.create(stream=True, **kw))
            return p, False, client.chat.completions.create(**kw).choices[0].message.content
        kw = dict(model=name, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        if stream:
            return p, True, "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        return p, True, client.completions.create(**kw).choices[0].text

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(16)))
    for p, raw, text in results:
        assert text == solo[(p, raw)].text, (p, raw)
    after = server.app.state.worker.gen.stats.batch_histogram
    shared = sum(v - before.get(k, 0) for k, v in after.items() if int(k) > 1)
    assert shared > 0  # requests really shared verify rounds


# ---------------------------------------------------------------------------------------- bad input


def test_bad_input_gets_openai_style_4xx(server, client):
    url = server.url
    name = server.app.state.model_name
    ctx = server.app.state.max_context

    def post(path, body, raw=False):
        kw = dict(content=body, headers={"content-type": "application/json"}) if raw else dict(json=body)
        return httpx.post(url + path, timeout=TIMEOUT, **kw)

    def err(r, status, param=None, code=None):
        assert r.status_code == status, r.text
        e = r.json()["error"]
        assert set(e) == {"message", "type", "param", "code"} and e["message"]
        if param is not None:
            assert e["param"] == param, e
        if code is not None:
            assert e["code"] == code, e
        return e

    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    err(post("/v1/chat/completions", b'{"messages": [', raw=True), 400, code="json_invalid")
    err(post("/v1/completions", b"", raw=True), 400)
    err(post("/v1/completions", b"[1, 2]", raw=True), 400)
    assert "unrecognized" in err(post("/v1/chat/completions", {**chat, "frobnicate": 1}), 400, "frobnicate")["message"]
    err(post("/v1/chat/completions", {**chat, "temperature": 5}), 400, "temperature")
    err(post("/v1/chat/completions", {**chat, "top_p": 0}), 400, "top_p")
    err(post("/v1/chat/completions", {**chat, "max_tokens": 0}), 400, "max_tokens")
    err(post("/v1/chat/completions", {**chat, "n": 17}), 400, "n")
    assert "at most 8 stop strings" in err(post("/v1/chat/completions", {**chat, "stop": ["x"] * 100}), 400,
                                           "stop")["message"]
    err(post("/v1/chat/completions", {**chat, "top_logprobs": 21, "logprobs": True}), 400, "top_logprobs")
    err(post("/v1/chat/completions", {**chat, "presence_penalty": 3}), 400, "presence_penalty")
    err(post("/v1/chat/completions", {**chat, "response_format": {"type": "xml"}}), 400)
    err(post("/v1/chat/completions", {**chat, "logit_bias": {"1": 5}}), 400, "logit_bias")
    err(post("/v1/chat/completions", {**chat, "stop": [""]}), 400)
    err(post("/v1/chat/completions", {**chat, "messages": []}), 400, "messages")
    err(post("/v1/chat/completions", {**chat, "messages": [{"role": "tool", "content": "x"}]}), 400)
    err(post("/v1/chat/completions", {**chat, "model": "gpt-4"}), 404, "model", "model_not_found")
    err(post("/v1/completions", {"prompt": "   ", "max_tokens": 4}), 400)
    err(post("/v1/completions", {"prompt": [1, 10 ** 6], "max_tokens": 4}), 400, "prompt", "invalid_token_id")
    err(post("/v1/completions", {"prompt": "x " * (ctx + 10), "max_tokens": 4}), 400, "prompt",
        "context_length_exceeded")
    err(post("/v1/completions", {"prompt": "hello", "max_tokens": ctx}), 400, "max_tokens", "context_length_exceeded")
    err(post("/v1/completions", {"prompt": "hello", "max_tokens": 4, "stream": True, "temperature": -1}), 400,
        "temperature")
    # lone surrogates (valid JSON escapes, not encodable text) in a prompt, a message and a field name
    err(post("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', raw=True), 400, "prompt")
    err(post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', raw=True), 400,
        "messages")
    err(post("/v1/completions", b'{"prompt": "a", "\\ud800": 1}', raw=True), 400)
    # a vanishing temperature decodes greedily instead of overflowing the logits
    r = post("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 1e-300})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == \
        client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    err(httpx.get(url + "/v1/nothing", timeout=TIMEOUT), 404)
    err(httpx.get(url + "/v1/completions", timeout=TIMEOUT), 405)
    # the openai client sees typed errors
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=chat["messages"], max_tokens=4, n=17)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=name, prompt="x " * (ctx + 10), max_tokens=4)
    # still serving
    assert httpx.get(url + "/health", timeout=TIMEOUT).json()["status"] == "ok"


# ---------------------------------------------------------------------------------------- load shedding


def test_full_queue_answers_429_and_disconnects_free_slots(engine, solo):
    """max_batch 1, max_queue 1: a long streamed request decodes, a second waits, a third gets 429. The
    streaming client disconnects: its request is cancelled and its slot freed, so the waiting request is
    admitted and completes with the solo output."""
    app, srv = _start(engine, slow=0.01, draft=None, max_batch=1, max_queue=1)
    worker = app.state.worker
    try:
        long_body = {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as c1:
            with c1.stream("POST", srv.url + "/v1/completions", json=long_body) as r1:
                assert r1.status_code == 200
                lines = r1.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                assert json.loads(first[5:])["choices"][0]["finish_reason"] is None
                assert _wait(lambda: worker.snapshot["active"] == 1)
                # a waiting (non-streamed) request
                ex = ThreadPoolExecutor(1)
                fut = ex.submit(httpx.post, srv.url + "/v1/completions", timeout=TIMEOUT,
                                json={"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0})
                assert _wait(lambda: worker.inflight == 2)
                r3 = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=TIMEOUT)
                assert r3.status_code == 429, r3.text
                assert r3.json()["error"]["type"] == "rate_limit_error"
                assert r3.json()["error"]["code"] == "queue_full"
                oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    oc.completions.create(model=app.state.model_name, prompt="x", max_tokens=4)
                assert not fut.done()
            # r1 closed mid-stream: the long request is cancelled, the waiting one runs
        r2 = fut.result(timeout=30)
        ex.shutdown()
        assert r2.status_code == 200 and r2.json()["choices"][0]["text"] == solo[(PROMPTS[1], True)].text
        assert _wait(lambda: worker.inflight == 0 and worker.snapshot["active"] == 0)
        assert worker.gen.target.requests == [] and worker.gen.stats.committed < 900
        m = _metrics(srv.url)
        ep = "/v1/completions"
        assert m[("dspark_requests_total", frozenset({("endpoint", ep), ("outcome", "cancelled")}))] == 1
        assert m[("dspark_requests_total", frozenset({("endpoint", ep), ("outcome", "rejected")}))] == 2
        assert m[("dspark_queue_depth", frozenset())] == 0
    finally:
        srv.stop()
    assert not worker.thread.is_alive()


def test_non_streaming_client_that_gives_up_is_cancelled(engine):
    app, srv = _start(engine, slow=0.01, draft=None, max_batch=1)
    worker = app.state.worker
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0},
                       timeout=httpx.Timeout(30.0, read=1.0))
        assert _wait(lambda: worker.inflight == 0 and worker.snapshot["active"] == 0)
        assert worker.gen.target.requests == [] and worker.gen.stats.committed < 800
        m = _metrics(srv.url)
        assert m[("dspark_requests_total", frozenset({("endpoint", "/v1/completions"), ("outcome", "cancelled")}))] == 1
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------- shutdown


def test_graceful_shutdown_finishes_in_flight_requests(engine, solo):
    app, srv = _start(engine, slow=0.02, draft=None, max_batch=2)
    worker = app.state.worker
    got, started = {}, threading.Event()

    def stream():
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        parts = []
        for c in oc.completions.create(model=app.state.model_name, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True):
            parts.append(c.choices[0].text)
            started.set()
        got["text"] = "".join(parts)

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(20)
    srv.stop()  # uvicorn stops accepting, waits for the open stream, then the engine thread stops
    t.join(30)
    assert got["text"] == solo[(PROMPTS[2], True)].text
    assert not worker.thread.is_alive() and not srv.thread.is_alive()
    assert worker.gen.target.requests == []


def test_shutdown_timeout_cancels_long_requests(engine):
    app, srv = _start(engine, slow=0.02, graceful=0.5, draft=None, max_batch=2, shutdown_drain_s=0.0)
    worker = app.state.worker
    outcome, started = {}, threading.Event()

    def stream():
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", timeout=TIMEOUT,
                              json={"prompt": PROMPTS[0], "max_tokens": 900, "stream": True}) as r:
                for line in r.iter_lines():
                    started.set()
            outcome["end"] = "closed"
        except httpx.HTTPError as e:  # the server cut the stream
            outcome["end"] = type(e).__name__

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(20)
    t0 = time.monotonic()
    srv.stop()
    t.join(30)
    assert not t.is_alive() and "end" in outcome
    assert time.monotonic() - t0 < 10
    assert not worker.thread.is_alive() and worker.gen.target.requests == []


# ---------------------------------------------------------------------------------------- metrics, health


def test_health_models_and_metrics(server, client):
    name = server.app.state.model_name
    client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    h = httpx.get(server.url + "/health", timeout=TIMEOUT).json()
    assert h["status"] == "ok" and h["capacity"] == 20
    models = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == server.app.state.max_context
    m = _metrics(server.url)
    names = {k[0] for k in m}
    for n in ("dspark_requests_total", "dspark_prompt_tokens_total", "dspark_generation_tokens_total",
              "dspark_rounds_total", "dspark_verify_tokens_total", "dspark_draft_tokens_proposed_total",
              "dspark_draft_tokens_accepted_total", "dspark_tau", "dspark_acceptance_rate",
              "dspark_acceptance_by_position", "dspark_verify_length_bucket", "dspark_batch_size_bucket",
              "dspark_queue_depth", "dspark_active_requests", "dspark_time_to_first_token_seconds_bucket",
              "dspark_time_per_output_token_seconds_bucket", "dspark_e2e_request_latency_seconds_count",
              "dspark_request_tau_count", "dspark_prefill_chunks_total", "dspark_mixed_rounds_total",
              "dspark_target_calls_total", "dspark_prefilling_requests"):
        assert n in names, n
    one = lambda n, **lab: m[(n, frozenset(lab.items()))]  # noqa: E731
    assert one("dspark_requests_total", endpoint="/v1/completions", outcome="length") > 0
    assert one("dspark_generation_tokens_total") > 0 and one("dspark_rounds_total") > 0
    assert one("dspark_prefill_chunks_total") > 0 and one("dspark_target_calls_total") >= one("dspark_rounds_total")
    assert one("dspark_draft_tokens_accepted_total") > 0 and 1.0 < one("dspark_tau") <= 4.0
    assert 0.0 < one("dspark_acceptance_by_position", position="1") <= 1.0
    assert one("dspark_time_to_first_token_seconds_count") > 0
    assert one("dspark_time_per_output_token_seconds_count") > 0
    assert one("dspark_verify_length_count") == sum(v for k, v in m.items() if k[0] == "dspark_batch_size_sum")
    assert one("dspark_requests_total", endpoint="/v1/chat/completions", outcome="invalid") > 0


# ---------------------------------------------------------------------------------------- schemathesis


def test_openapi_fuzz_never_5xx(engine):
    """schemathesis generates requests from the server's OpenAPI document, valid ones (every operation) and
    invalid ones (the POST bodies): no 5xx, and every 4xx has an OpenAI-style error body. The server has a
    256-token context, so valid generation requests decode quickly."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    app, srv = _start(engine, draft="lm", draft_length=3, max_batch=4, max_queue=64, max_context=256,
                      default_max_tokens=8)
    seen = {"cases": 0, "status": {}}
    try:
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        for mode, sch, n in ((GenerationMode.POSITIVE, schema, 60),
                             (GenerationMode.NEGATIVE, schema.include(method="POST"), 60)):
            @given(case=sch.as_strategy(generation_mode=mode))
            @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            def fuzz(case):
                r = case.call(timeout=30)
                seen["cases"] += 1
                seen["status"][r.status_code] = seen["status"].get(r.status_code, 0) + 1
                assert r.status_code < 500, (case.method, case.path, case.body, r.text[:500])
                if r.status_code >= 400:
                    e = r.json()["error"]
                    assert isinstance(e["message"], str) and e["type"], r.text

            fuzz()
    finally:
        srv.stop()
    print(f"\nschemathesis: {seen['cases']} cases, status codes {dict(sorted(seen['status'].items()))}")
    assert seen["cases"] >= 40 and any(400 <= s < 500 for s in seen["status"]) and 200 in seen["status"]


# ---------------------------------------------------------------------------------------- the CLI


def test_dspark_serve_cli(tiny_engine_dir, engine, solo, capsys):
    """`dspark serve` as a process: serves the openai client, exits 0 on SIGINT; a drafter the engine lacks
    is a one-line error (exit 2)."""
    import signal
    import socket
    import subprocess
    import sys

    from dspark_runtime.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dspark_runtime.cli", "serve", "--engine", str(tiny_engine_dir),
                             "--port", str(port), "--threads", "1", "--max-batch", "2", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None

        assert _wait(up, 60) and proc.poll() is None
        oc = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        r = oc.completions.create(model=engine.manifest.name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == solo[(PROMPTS[0], True)].text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(SystemExit) as e:
        main(["serve", "--engine", str(tiny_engine_dir), "--draft", "dspark", "--threads", "1"])
    assert e.value.code == 2 and "no DSpark drafter" in capsys.readouterr().err


def test_max_context_beyond_the_model_is_refused(engine):
    """--max-context larger than the model's max_position_embeddings is refused, naming both (positions the model
    never saw give unreliable output); at the limit it is accepted."""
    from dspark_runtime.errors import InputError
    from dspark_runtime.serving.app import create_app, engine_max_context

    limit = engine_max_context(engine)
    assert limit == 1024  # tests/fixtures/tiny_models.py
    with pytest.raises(InputError, match="max_position_embeddings 1024.*--max-context 1024"):
        create_app(engine, max_context=limit + 1)
    assert create_app(engine, max_context=limit).state.max_context == limit
