"""Scale-out on Ray Serve: the app of ``create_app`` in 2 replicas of a tiny engine on a local Ray
cluster on loopback (2 CPUs, 200 MB object store, no dashboard).

- every greedy answer (completions and chat, streamed and not, 8 concurrent clients) equals the engine's own solo
  ``generate`` output, and requests are routed across both replicas: the ``X-DSpark-Replica`` header of each
  answer and each replica's own ``/metrics`` (its requests and generated tokens) agree;
- one replica killed (``ray.kill`` on its actor) mid-load, in the middle of a long stream: Serve starts a new
  replica, which answers; no client gets a garbled or hung answer; a failed attempt (a 5xx, a stream cut before
  ``[DONE]``, a replica's 408 for a request body lost when Serve retried the request) is retried and counted,
  every final answer equals the solo output.

The kill test waits on the state Serve reports (replicas RUNNING, the new replica's answer), bounded only by
deadlines that catch a real hang, so a slow or loaded machine makes it slower, not failing.

The tiny engine is built with the scatter KV layout, so a request's greedy output is bit-identical whatever
shares its verify rounds (docs/serving.md) and the comparison with solo output is exact under any batching.
Settings validation and the CLI's refusals run without Ray; the cluster tests skip when ``ray[serve]`` is not
installed (``pip install -e ".[ray]"``).
"""
import json
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from dspark_runtime.errors import InputError
from dspark_runtime.serving.ray_serve import DEPLOYMENT_NAME, REPLICA_HEADER, RayServeSettings

PROMPTS = ["hello world", "def f(x):\n    return x + 1\n\ndef g(x):", "the the the the the",
           "import numpy as np\nimport numpy as np\n", "1 2 3 4 5 6 7 8 9", "Write a function that sorts a list."]
MAX_TOKENS = 24
LONG_TOKENS = 900  # the long stream cut by the kill: ~0.5 s of decoding for the tiny engine on one thread
APP_KW = dict(draft="lm", draft_length=3, max_batch=4, max_queue=16, threads=1, replica_cpus=1.0)
# Both bound only a real hang, never a slow machine: the tests wait on what Serve reports, and a replica (re)start
# takes seconds on an idle machine but minutes on two loaded cores (a new Ray worker imports, loads and hashes).
HANG_S = 120.0  # a client gives up on a request that sends nothing for this long (counted as hung)
STATE_DEADLINE_S = 300.0  # the most a test waits for the replicas to reach a state
# Serve's controller kills a starting proxy that missed 3 readiness checks of 5 s each and starts another, but
# serve.start has already failed on the first one's death: on two loaded cores a proxy's process can take longer
SLOW_MACHINE_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": str(int(STATE_DEADLINE_S))}


def _ray_serve():
    return pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install -e '.[ray]'): "
                                                   "the Ray Serve tests need a local Ray cluster")


# ---------------------------------------------------------------------------------------- settings (no Ray)


def test_settings_map_to_serve_options_and_bad_ones_are_refused():
    s = RayServeSettings(engine="/e", num_replicas=3, replica_cpus=2, max_batch=4, max_queue=10)
    o = s.deployment_options()
    assert o["num_replicas"] == 3 and "autoscaling_config" not in o
    assert o["ray_actor_options"] == {"num_cpus": 2.0}
    assert o["max_ongoing_requests"] == 14  # the app's own capacity: max_batch + max_queue
    assert s.replica_threads == 2 and RayServeSettings(engine="/e", replica_cpus=0.5).replica_threads == 1
    a = RayServeSettings.from_args({"engine": "/e", "min_replicas": 1, "max_replicas": 4, "max_batch": 6})
    ac = a.deployment_options()["autoscaling_config"]
    assert ac == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 6.0}
    assert "num_replicas" not in a.deployment_options()
    assert s.app_kwargs()["draft"] == "auto"
    assert RayServeSettings(engine="/e", draft="none").app_kwargs()["draft"] is None
    bad = [({"engine": "/e", "replicas": 2}, "unknown setting replicas"),
           ({"num_replicas": 2}, "need engine"),
           ({"engine": "/e", "min_replicas": 1}, "needs both min_replicas and max_replicas"),
           ({"engine": "/e", "min_replicas": 3, "max_replicas": 2}, "max_replicas must be an integer >= 1 and >= "),
           ({"engine": "/e", "num_replicas": 0}, "num_replicas must be an integer >= 1"),
           ({"engine": "/e", "replica_cpus": 0}, "replica_cpus must be a number > 0"),
           ({"engine": "/e", "draft": "medusa"}, "draft must be one of"),
           ({"engine": "/e", "draft_length": "auto"}, "draft_length must be a positive integer or 'scheduled'"),
           ({"engine": "/e", "target_ongoing_requests": 4}, "applies to autoscaling only"),
           ({"engine": ""}, "engine must be the path")]
    for args, msg in bad:
        with pytest.raises(InputError, match=msg):
            RayServeSettings.from_args(args)


def test_the_runtime_and_this_module_import_without_ray():
    """Ray is imported only inside the functions of dspark_runtime.serving.ray_serve: importing it (and the CLI, the
    server) loads no ``ray`` module."""
    import subprocess
    import sys

    code = ("import sys; import dspark_runtime, dspark_runtime.cli, dspark_runtime.serving.app, "
            "dspark_runtime.serving.ray_serve; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_without_ray_the_deployment_names_the_extra(monkeypatch):
    import sys

    from dspark_runtime.serving.ray_serve import app_builder, build_app

    monkeypatch.setitem(sys.modules, "ray", None)  # `from ray import serve` raises ImportError, as without the extra
    with pytest.raises(InputError, match=r"pip install 'dspark\[ray\]'"):
        build_app(RayServeSettings(engine="/e"))
    with pytest.raises(InputError, match="Ray Serve is not installed"):
        app_builder({"engine": "/e", "num_replicas": 2})


@pytest.mark.parametrize("argv,msg", [
    (["--replicas", "2"], "--replicas applies only with --ray"),
    (["--ray", "--autoscale", "1-3"], "--autoscale takes MIN:MAX"),
    (["--ray", "--autoscale", "3:1"], "needs 0 <= MIN <= MAX"),
    (["--ray", "--replicas", "2", "--autoscale", "1:2"], "exclude each other"),
    (["--ray", "--target-ongoing-requests", "4"], "add --autoscale"),
    (["--ray", "--draft-length", "auto"], "--draft-length auto is not available")])
def test_dspark_serve_ray_option_errors(argv, msg, tmp_path, capsys):
    """`dspark serve --ray` option mistakes are one-line errors (exit 2) that name the option, before Ray starts."""
    from dspark_runtime.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--engine", str(tmp_path)] + argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "Traceback" not in err, err


def test_dspark_serve_ray_refuses_a_missing_engine_before_starting_ray(tmp_path, capsys):
    from dspark_runtime.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--ray", "--engine", str(tmp_path / "nope"), "--replicas", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "does not exist" in err, err


# `dspark serve` options that are not a replica setting of the same name: where each one goes instead
SERVE_ONLY = {"engine_dir": "engine", "host": "run(host=)", "port": "run(port=)", "use_ray": "--ray itself",
              "replicas": "num_replicas", "autoscale": "min_replicas/max_replicas", "ray_address": "run(address=)",
              "log_level": "uvicorn's log level: Serve's proxy logs the requests",
              "backend": "placement (--backend trt is --placement trt)"}


def test_every_dspark_serve_option_reaches_the_replicas():
    """Each `dspark serve` option is a RayServeSettings field of the same name or listed in SERVE_ONLY with where it
    goes: an option added to `dspark serve` without its Ray plumbing fails here (add the field, pass it in
    cli._serve_ray and use it in app_kwargs/engine_kwargs)."""
    import dataclasses

    from dspark_runtime.cli import serve

    fields = {f.name for f in dataclasses.fields(RayServeSettings)}
    missing = [p.name for p in serve.params if p.name not in fields and p.name not in SERVE_ONLY]
    assert missing == [], f"dspark serve options not passed to Ray Serve replicas: {missing}"


def test_dspark_serve_ray_passes_prefill_budget_and_prefix_cache_to_the_settings(tmp_path, monkeypatch):
    """`dspark serve --ray --prefill-budget 12 --prefix-cache-mb 3 ...` reaches ray_serve.run as settings, and those
    settings become the replica's Engine.load and create_app arguments (no cluster: run and the engine are stubs)."""
    from prometheus_client import CollectorRegistry

    import dspark_runtime.engine
    import dspark_runtime.serving.ray_serve as rs
    import dspark_runtime.serving.app
    from dspark_runtime.cli import main

    got = {}
    monkeypatch.setattr(rs, "run", lambda settings, **kw: got.update(settings=settings, run=kw))
    (tmp_path / "manifest.json").write_text("{}")
    monkeypatch.setattr("dspark_runtime.cli.load_manifest", lambda *a, **k: None)
    main(["serve", "--ray", "--engine", str(tmp_path), "--prefill-budget", "12", "--prefix-cache-mb", "3",
          "--max-batch", "5", "--max-queue", "7", "--draft", "ngram", "--draft-length", "4", "--threads", "2",
          "--max-context", "512", "--default-max-tokens", "9", "--model-name", "m", "--shutdown-timeout", "4",
          "--placement", "cpu", "--prompts", "target", "--replicas", "2", "--replica-cpus", "2", "--port", "8123"])
    s = got["settings"]
    assert (s.prefill_budget, s.prefix_cache_mb, s.max_batch, s.max_queue, s.draft, s.draft_length, s.threads) == \
        (12, 3.0, 5, 7, "ngram", 4, 2)
    assert (s.max_context, s.default_max_tokens, s.model_name, s.shutdown_timeout, s.placement, s.prompts) == \
        (512, 9, "m", 4.0, "cpu", "target")
    assert (s.num_replicas, s.replica_cpus, got["run"]["port"]) == (2, 2.0, 8123)
    main(["serve", "--ray", "--engine", str(tmp_path), "--backend", "trt"])
    assert got["settings"].placement == "trt"

    loads, apps = [], []

    class FakeApp:
        def __init__(self):
            self.state = type("S", (), {})()
            self.state.metrics = type("M", (), {"registry": CollectorRegistry()})()

        def add_middleware(self, *a, **k):
            pass

    monkeypatch.setattr(dspark_runtime.engine.Engine, "load",
                        classmethod(lambda cls, path, **kw: loads.append((path, kw)) or "ENGINE"))
    monkeypatch.setattr(dspark_runtime.serving.app, "create_app", lambda eng, **kw: apps.append((eng, kw)) or FakeApp())
    app = rs.replica_app(s, replica="r-1")
    assert app.state.replica_id == "r-1"
    path, kw = loads[0]
    assert path == s.engine and kw["prefix_cache_mb"] == 3.0 and kw["threads"] == 2 and kw["placement"] == "cpu"
    assert kw["prompts"] == "target"
    assert "shared_thread_pool" in kw
    eng, akw = apps[0]
    assert eng == "ENGINE" and akw["prefill_budget"] == 12 and akw["max_batch"] == 5 and akw["max_queue"] == 7
    assert akw["draft"] == "ngram" and akw["draft_length"] == 4 and akw["max_context"] == 512
    assert akw["default_max_tokens"] == 9 and akw["model_name"] == "m" and akw["shutdown_drain_s"] == 4.0
    for args, msg in [({"engine": "/e", "prefill_budget": 0}, "prefill_budget must be a positive integer"),
                      ({"engine": "/e", "prefill_budget": "lots"}, "prefill_budget must be a positive integer"),
                      ({"engine": "/e", "prefix_cache_mb": -1}, "prefix_cache_mb must be a number of MiB >= 0")]:
        with pytest.raises(InputError, match=msg):
            RayServeSettings.from_args(args)


def test_the_shipped_serve_config_is_valid_and_builds_the_deployment():
    """docs/ray-serve.yaml passes Serve's own config schema, and its args build the deployment it documents
    (the builder Serve imports from import_path; nothing is loaded until replicas start)."""
    _ray_serve()
    import importlib
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    cfg = yaml.safe_load((Path(__file__).resolve().parents[3] / "docs" / "ray-serve.yaml").read_text())
    app_cfg = ServeDeploySchema.model_validate(cfg).applications[0]
    module, _, fn = app_cfg.import_path.partition(":")
    app = getattr(importlib.import_module(module), fn)(app_cfg.args)
    d = app._bound_deployment  # Serve's Application holds its ingress deployment here
    assert d.name == DEPLOYMENT_NAME and d.num_replicas == app_cfg.args["num_replicas"] == 2
    assert d.ray_actor_options["num_cpus"] == 2.0 and d.max_ongoing_requests == 8 + 64
    with pytest.raises(InputError, match="unknown setting replicas"):
        getattr(importlib.import_module(module), fn)({**app_cfg.args, "replicas": 3})


def test_a_replica_answers_408_when_a_request_body_never_arrives():
    """Each replica's middleware reads a request's body before the app: a body that comes is replayed to the app
    unchanged, and one that stops coming (Serve's router retried the request here after the replica it chose first
    pulled the body from the proxy and died) gets a 408 with the replica header instead of hanging; no Ray needed."""
    import asyncio

    from dspark_runtime.serving.ray_serve import ReplicaHeaderMiddleware

    async def echo(scope, receive, send):
        body, more = b"", True
        while more:
            m = await receive()
            body, more = body + m.get("body", b""), m.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    def call(messages, timeout_s):
        sent = []

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.sleep(3600)  # nothing more will come

        async def send(message):
            sent.append(message)

        mw = ReplicaHeaderMiddleware(echo, replica="r-1", body_timeout_s=timeout_s)
        asyncio.run(asyncio.wait_for(mw({"type": "http"}, receive, send), 30))
        return sent

    header = (REPLICA_HEADER.lower().encode(), b"r-1")
    ok = call([{"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.request", "body": b"c"}], 5)
    assert ok[0]["status"] == 200 and header in ok[0]["headers"] and ok[1]["body"] == b"abc"
    for messages in ([], [{"type": "http.request", "body": b"ab", "more_body": True}]):  # none, or cut mid-body
        lost = call(messages, 0.05)
        assert lost[0]["status"] == 408 and header in lost[0]["headers"]
        assert json.loads(lost[1]["body"])["error"]["code"] == "request_timeout"


# ---------------------------------------------------------------------------------------- the cluster


@pytest.fixture(scope="module")
def scatter_engine_dir(tiny_pair, tmp_path_factory):
    """The tiny pair built with the scatter KV layout (batch-invariant greedy output); only the Ray tests use it,
    so without Ray they skip before it is built."""
    _ray_serve()
    from dspark_export.engine_dir.build import Recipe, build_engine

    tdir, ddir = tiny_pair
    out = tmp_path_factory.mktemp("ray-engines") / "tiny-scatter"
    build_engine(Recipe(name="tiny-scatter", target=str(tdir), draft=str(ddir), target_feature_layers=[-1, 0],
                        draft_length=4, kv_layout="scatter"), out, isolate=False, log=lambda *a: None)
    return out


@pytest.fixture(scope="module")
def solo(scatter_engine_dir):
    """Each prompt decoded alone, target-only greedy, by the engine's own ``generate``: raw and chat-templated,
    plus the long request of the kill test."""
    from dspark_runtime.engine import Engine

    eng = Engine.load(scatter_engine_dir, threads=1)
    out = {(p, raw): eng.generate(p, max_new_tokens=MAX_TOKENS, draft=None, raw=raw)
           for p in PROMPTS for raw in (False, True)}
    out["long"] = eng.generate(PROMPTS[0], max_new_tokens=LONG_TOKENS, draft=None, raw=True)
    return out


@pytest.fixture(scope="module")
def cluster(scatter_engine_dir):
    """A local Ray cluster on loopback with Serve's proxy on a free port and 2 replicas of the engine."""
    serve = _ray_serve()
    import ray

    from dspark_runtime.serving.ray_serve import APP_NAME, build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in SLOW_MACHINE_ENV.items():  # read by Serve's controller, which inherits this environment
            mp.setenv(k, v)
        ray.init(num_cpus=2, object_store_memory=200 * 2 ** 20, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    try:
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
        except TimeoutError:  # serve.start waits 60 s for the proxy; it goes on starting, and is waited for below
            pass
        settings = RayServeSettings(engine=str(scatter_engine_dir), num_replicas=2, health_check_period_s=1.0,
                                    **APP_KW)
        serve.run(build_app(settings), name=APP_NAME, route_prefix="/")
        _wait_until("Serve's proxy answering /health", lambda: _health_ok(url))
        yield {"url": url, "serve": serve, "ray": ray, "app": APP_NAME}
    finally:
        serve.shutdown()
        ray.shutdown()


def _health_ok(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def test_dspark_serve_ray_cli(scatter_engine_dir, solo, tmp_path):
    """`dspark serve --ray` as a process: it starts a Ray cluster of its own, serves the engine from one replica
    (the same answers as solo decoding, the replica header), and on SIGINT deletes the app, stops that cluster
    and exits 0. Runs before the module's cluster starts."""
    import os
    import signal
    import subprocess
    import sys

    httpx = pytest.importorskip("httpx")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {**os.environ, **SLOW_MACHINE_ENV,
           "RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION": "0.01"}  # a ~240 MB object store here
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dspark_runtime.cli", "serve", "--ray", "--engine",
                                 str(scatter_engine_dir), "--replicas", "1", "--threads", "1", "--max-batch", "2",
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        t_end = time.monotonic() + 120
        while time.monotonic() < t_end and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert proc.poll() is None, log.read_text()[-3000:]
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                      "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == solo[(PROMPTS[0], True)].text
        assert r.headers[REPLICA_HEADER]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
        text = log.read_text()
        assert f"serving on {url}/v1 (Ray Serve" in text and "stopping: replicas drain" in text
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _replica_states(cluster) -> dict:
    return dict(cluster["serve"].status().applications[cluster["app"]].deployments[DEPLOYMENT_NAME].replica_states)


def _running_replicas(cluster) -> set | None:
    """The ids of the deployment's replicas once Serve reports every one of them RUNNING, else None. The ids are
    the names of the live replica actors (Ray lists a named actor until it is dead), the same ids as the
    ``X-DSpark-Replica`` header."""
    from ray.util import list_named_actors

    prefix = f"SERVE_REPLICA::{cluster['app']}#{DEPLOYMENT_NAME}#"
    ids = {a["name"][len(prefix):] for a in list_named_actors(all_namespaces=True)
           if a["namespace"] == "serve" and a["name"].startswith(prefix)}
    return ids if ids and _replica_states(cluster) == {"RUNNING": len(ids)} else None


def _wait_until(what: str, cond, deadline_s: float = STATE_DEADLINE_S):
    """Poll ``cond()`` until it returns something true and return that; fail naming ``what`` after ``deadline_s``."""
    t_end = time.monotonic() + deadline_s
    while not (value := cond()):
        assert time.monotonic() < t_end, f"{what}: not after {deadline_s:g} s"
        time.sleep(0.2)
    return value


class Attempt(Exception):
    """A failed attempt the client may retry: why (a status code, a cut stream, a connection error)."""


def _ask(httpx, url: str, i: int, prompt=None, max_tokens: int = MAX_TOKENS, stream=None, chat=None,
         on_start=None) -> dict:
    """One request, checked at the wire level: {text, tokens, replica, kind}. Raises Attempt for anything short of
    a complete answer: a non-200 status, a body that is not the JSON object of a completion, a stream without a
    final chunk carrying finish_reason and usage followed by ``data: [DONE]``. ``on_start(replica)`` runs once the
    response headers of a stream are in (the kill test kills that replica)."""
    prompt = PROMPTS[i % len(PROMPTS)] if prompt is None else prompt
    chat = i % 4 >= 2 if chat is None else chat
    stream = i % 2 == 1 if stream is None else stream
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    timeout = httpx.Timeout(HANG_S)
    try:
        if not stream:
            r = httpx.post(url + path, json=body, timeout=timeout)
            if r.status_code != 200:
                raise Attempt(f"status {r.status_code}")
            j = r.json()
            c = j["choices"][0]
            text = c["message"]["content"] if chat else c["text"]
            if c["finish_reason"] not in ("length", "stop"):
                raise Attempt("no finish_reason")
            return {"text": text, "tokens": j["usage"]["completion_tokens"], "replica": r.headers[REPLICA_HEADER],
                    "kind": (prompt, not chat)}
        with httpx.stream("POST", url + path, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                raise Attempt(f"status {r.status_code}")
            replica = r.headers[REPLICA_HEADER]
            if on_start:
                on_start(replica)
            parts, finish, usage, done = [], None, None, False
            for line in r.iter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    raise Attempt(f"not an SSE data line: {line[:60]!r}")
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                o = json.loads(data)
                if "error" in o:
                    raise Attempt(f"SSE error {o['error'].get('code')}")
                if o.get("usage"):
                    usage = o["usage"]
                for c in o.get("choices", []):
                    parts.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text", ""))
                    finish = c.get("finish_reason") or finish
            if not done or finish is None or usage is None:
                raise Attempt("stream ended before [DONE]")
            return {"text": "".join(parts), "tokens": usage["completion_tokens"], "replica": replica,
                    "kind": (prompt, not chat)}
    except (httpx.TransportError, json.JSONDecodeError, KeyError) as e:
        if isinstance(e, httpx.TimeoutException):
            raise  # a hung answer is not retried: the test fails on it
        raise Attempt(type(e).__name__) from e


def _metrics_of_each_replica(httpx, url: str, want: int, timeout: float = 40.0) -> dict:
    """{replica id: {sample name + labels: value}} from GET /metrics through Serve's proxy, until ``want``
    different replicas have answered (each GET lands on one replica). GETs go in bursts of 4 at once: Serve's
    router picks the replica with the shorter queue as its cache knows it, and a cached length can stay stale for
    up to 10 s (RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S), which can send every lone GET of an idle deployment to
    the same replica; a burst puts GETs in flight, so the next one goes to the other replica."""
    from prometheus_client.parser import text_string_to_metric_families

    def one(_):
        r = httpx.get(url + "/metrics", timeout=10)
        assert r.status_code == 200
        samples = {(s.name, frozenset(s.labels.items())): s.value
                   for fam in text_string_to_metric_families(r.text) for s in fam.samples}
        info = [dict(k[1]) for k in samples if k[0] == "dspark_replica_info"]
        assert len(info) == 1 and info[0]["replica"] == r.headers[REPLICA_HEADER]  # /metrics of that one replica
        assert info[0]["deployment"] == DEPLOYMENT_NAME
        return info[0]["replica"], samples

    seen = {}
    t_end = time.monotonic() + timeout
    with ThreadPoolExecutor(4) as ex:
        while len(seen) < want and time.monotonic() < t_end:
            seen.update(ex.map(one, range(4)))
            time.sleep(0.2)
    return seen


def test_two_replicas_answer_exactly_and_share_the_load(cluster, solo):
    """16 requests from 8 concurrent clients: every answer equals the solo output; both replicas served, and each
    replica's own /metrics counts exactly the requests and tokens its header claims; the app's routes came through
    unchanged (/v1/models, /health, 4xx bodies)."""
    httpx = pytest.importorskip("httpx")
    url = cluster["url"]
    assert _replica_states(cluster) == {"RUNNING": 2}
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda i: _ask(httpx, url, i), range(16)))
    for g in got:
        ref = solo[g["kind"]]
        assert g["text"] == ref.text and g["tokens"] == len(ref.token_ids), g
    by_replica = Counter(g["replica"] for g in got)
    assert len(by_replica) == 2, by_replica  # routed across both replicas
    per = _metrics_of_each_replica(httpx, url, want=2)
    assert set(per) == set(by_replica)
    for rep, samples in per.items():
        n = sum(v for (name, labels), v in samples.items() if name == "dspark_requests_total"
                and dict(labels)["outcome"] in ("length", "stop"))
        toks = samples[("dspark_generation_tokens_total", frozenset())]
        assert n == by_replica[rep], (rep, n, by_replica)
        assert toks == sum(g["tokens"] for g in got if g["replica"] == rep)
        assert samples[("dspark_capacity", frozenset())] == APP_KW["max_batch"] + APP_KW["max_queue"]
    # the same app: its other routes and its OpenAI-style error bodies, through the proxy
    models = httpx.get(url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny-scatter"]
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and REPLICA_HEADER in r.headers


def test_a_replica_killed_mid_load_is_replaced_and_no_answer_is_garbled_or_hung(cluster, solo):
    """6 clients keep sending requests; after 12 answers, a long stream starts and its replica is killed with
    ``ray.kill`` once the stream's headers are in. The test then waits on Serve's own state, not on a clock: until
    the killed replica is gone and a new one is RUNNING beside the survivor, then until the new one has answered
    (the load goes on meanwhile). Every attempt that failed (a 5xx, a connection error, a stream cut before
    ``[DONE]``, a 408 for a body lost in Serve's retry) is retried (at most 5 times) and counted; no attempt hangs
    (``HANG_S`` without a byte) and every final answer equals the solo output."""
    httpx = pytest.importorskip("httpx")
    ray = cluster["ray"]
    url = cluster["url"]
    before = _wait_until("both replicas RUNNING", lambda: (r := _running_replicas(cluster)) and len(r) == 2 and r)
    lock = threading.Lock()
    results, retries, hung = [], Counter(), []
    state = {"next": 0, "stop": False, "killed_at": None}

    def ask_with_retries(i, **kw):
        for attempt in range(6):
            try:
                t = time.monotonic()
                out = _ask(httpx, url, i, **kw)
                out["t"], out["attempts"] = t, attempt + 1
                return out
            except Attempt as e:
                with lock:
                    retries[str(e)] += 1
                time.sleep(min(0.2 * 2 ** attempt, 2.0))
            except httpx.TimeoutException as e:
                with lock:
                    hung.append((i, repr(e)))
                return None
        raise AssertionError(f"request {i} failed 6 times: {retries}")

    def client():
        while True:
            with lock:
                if state["stop"]:
                    return
                i = state["next"]
                state["next"] += 1
            out = ask_with_retries(i)
            with lock:
                results.append(out)

    def kill(replica):
        if state["killed_at"] is None:
            state["victim"] = replica
            ray.kill(ray.get_actor(f"SERVE_REPLICA::{cluster['app']}#{DEPLOYMENT_NAME}#{replica}",
                                   namespace="serve"), no_restart=True)
            state["killed_at"] = time.monotonic()

    def answered_by(replicas):
        with lock:
            return len(results) >= 40 and {r["replica"] for r in results if r} & replicas

    with ThreadPoolExecutor(6) as ex:
        futures = [ex.submit(client) for _ in range(6)]
        try:
            _wait_until("12 answers before the kill", lambda: len(results) >= 12 or hung)
            long = ask_with_retries(-1, prompt=PROMPTS[0], max_tokens=LONG_TOKENS, stream=True, chat=False,
                                    on_start=kill)
            victim = state["victim"]
            after = _wait_until(f"Serve replacing the killed replica {victim}",
                                lambda: (r := _running_replicas(cluster)) and len(r) == 2 and victim not in r and r)
            replaced_s = time.monotonic() - state["killed_at"]
            new = after - before
            assert len(new) == 1 and before - {victim} <= after, (before, victim, after)
            # keep the load on until the new replica has answered (and 40 answers in all)
            _wait_until(f"an answer from the new replica {new}", lambda: answered_by(new) or hung)
            answered_s = time.monotonic() - state["killed_at"]
        finally:
            with lock:
                state["stop"] = True
            for f in futures:
                f.result()
    assert not hung, hung
    assert long["text"] == solo["long"].text and long["tokens"] == len(solo["long"].token_ids)
    assert long["replica"] != victim
    for r in results:
        ref = solo[r["kind"]]
        assert r["text"] == ref.text and r["tokens"] == len(ref.token_ids), r
    served = Counter(r["replica"] for r in results)
    assert set(served) <= before | new and new <= set(served), served  # the replacement served
    assert _running_replicas(cluster) == after  # and nothing else was restarted meanwhile
    assert long["attempts"] >= 2  # the long stream was cut by the kill: its first attempt failed
    print(f"\nreplica kill: {len(results) + 1} answers all correct, {sum(retries.values())} retried attempts "
          f"{dict(retries)}, 0 hung; killed {victim}, replaced by {sorted(new)} RUNNING after {replaced_s:.1f} s, "
          f"answering after {answered_s:.1f} s; answers by replica {dict(served)}")


def test_dspark_serve_refuses_a_port_in_use_before_loading_the_engine(tmp_path, capsys):
    """A port another server holds is a one-line error naming --port, before the engine loads (here the engine
    directory does not even exist: the port is checked first)."""
    import socket

    from dspark_runtime.cli import main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            main(["serve", "--engine", str(tmp_path / "nope"), "--port", str(port)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err, err
    assert "Traceback" not in err
