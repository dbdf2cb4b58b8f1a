"""Scale-out on Ray Serve: the app of :func:`~dspark_runtime.serving.app.create_app` in N replicas of one deployment.

Owns :class:`RayServeSettings` (each replica's engine and app settings, the deployment's scaling), the deployment
(:func:`build_app`; :func:`app_builder` for ``serve run`` configs) and ``dspark serve --ray`` (:func:`run`).
Invariants: each replica loads its own Engine and builds the unchanged app inside itself (same routes, wire
format, errors; its own batching and ``/metrics``), adding only the ``X-DSpark-Replica`` header,
``dspark_replica_info`` and a 408 for a request body that stops arriving (:class:`ReplicaHeaderMiddleware`); Serve
sends a replica at most ``max_ongoing_requests`` (default ``max_batch + max_queue``, the app's capacity);
``check_health`` fails once the engine thread has stopped, so Serve replaces the replica.
Ray and the app's FastAPI stack are imported only inside functions: this module, and the CLI importing it, work
without the ``ray`` extra, and a function that needs Ray raises InputError naming the extra.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import dspark_runtime  # dspark_runtime.Engine is imported on first use (PEP 562): `dspark --help` stays cheap
from dspark_runtime.backends.prompt_place import PROMPT_PLACES
from dspark_runtime.errors import InputError
from dspark_runtime.machine.sysinfo import shared_pool_default

DEPLOYMENT_NAME = "DSparkServer"
APP_NAME = "dspark"
REPLICA_HEADER = "X-DSpark-Replica"
BODY_TIMEOUT_S = 30.0  # a replica answers 408 when the next part of a request's body takes longer than this
DRAFTS = ("auto", "router", "dspark", "eagle3", "lm", "ngram", "none")


def _need_ray():
    """``ray.serve``; raises InputError naming the extra when Ray Serve is not installed."""
    try:
        from ray import serve
    except ImportError as e:
        raise InputError(f"Ray Serve is not installed: pip install 'dspark[ray]' (ray[serve]) ({e})") from None
    return serve


@dataclass(frozen=True)
class RayServeSettings:
    """Everything a replica needs to build its engine and app, and the deployment's scaling settings.

    App (as ``dspark serve``'s options; :func:`~dspark_runtime.serving.app.create_app`): ``draft`` (auto, router,
    dspark, lm, ngram, none), ``draft_length`` (an integer or "scheduled"), ``draft_confidence``, ``max_batch``,
    ``max_queue``, ``max_context``, ``default_max_tokens``, ``model_name``, ``shutdown_timeout`` (seconds open
    requests may finish when a replica stops), ``prefill_budget`` (prompt tokens fed per round while others decode,
    an integer >= 1 or "auto"), ``prefix_cache_mb`` (each replica's prefix KV cache bound in MiB, 0 = off).
    Engine (:meth:`engine_kwargs`, as ``dspark serve`` loads it): ``threads`` (ONNX Runtime intra-op threads per
    replica; default: ``replica_cpus`` rounded, at least 1), ``placement``, ``prompts`` (where prompt chunks run:
    auto, target, prompt-graph, openvino), ``prefix_cache_mb``.

    Deployment: ``num_replicas`` (fixed count), or ``min_replicas`` and ``max_replicas`` together (autoscaling,
    with ``target_ongoing_requests`` in flight per replica as the target, default ``max_batch``; min 0 scales to
    zero and the first request waits for an engine load); ``replica_cpus`` (Ray CPUs reserved per replica: what
    the scheduler packs onto nodes); ``max_ongoing_requests`` (most requests Serve sends one replica; default
    ``max_batch + max_queue``); ``health_check_period_s``.

    ``engine`` is read on the replica's node: an absolute path there (a shared filesystem, a path baked into
    the image, or a tarball copied to every node).
    """

    engine: str
    draft: str = "auto"
    draft_length: int | str | None = None
    draft_confidence: float | None = None
    max_batch: int = 8
    max_queue: int = 64
    max_context: int | None = None
    default_max_tokens: int = 256
    model_name: str | None = None
    shutdown_timeout: float = 30.0
    threads: int | None = None
    placement: str | None = None
    prompts: str = "auto"
    prefill_budget: int | str = "auto"
    prefix_cache_mb: float = 0.0
    num_replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    replica_cpus: float = 1.0
    max_ongoing_requests: int | None = None
    health_check_period_s: float = 10.0

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise InputError(msg)

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        need(isinstance(self.engine, str) and self.engine.strip() != "",
             f"engine must be the path of an engine directory or tarball, got {self.engine!r}")
        need(self.draft in DRAFTS, f"draft must be one of {', '.join(DRAFTS)}, got {self.draft!r}")
        need(self.draft_length is None or (is_int(self.draft_length) and self.draft_length >= 1)
             or self.draft_length == "scheduled",
             f"draft_length must be a positive integer or 'scheduled' when serving, got {self.draft_length!r}")
        need(self.draft_confidence is None or is_num(self.draft_confidence),
             f"draft_confidence must be a number, got {self.draft_confidence!r}")
        for name, low in (("max_batch", 1), ("max_queue", 0), ("default_max_tokens", 1), ("num_replicas", 1)):
            v = getattr(self, name)
            need(is_int(v) and v >= low, f"{name} must be an integer >= {low}, got {v!r}")
        for name, low in (("max_context", 2), ("threads", 1), ("max_ongoing_requests", 1)):
            v = getattr(self, name)
            need(v is None or (is_int(v) and v >= low), f"{name} must be an integer >= {low}, got {v!r}")
        need(self.prompts in PROMPT_PLACES, f"prompts must be one of {', '.join(PROMPT_PLACES)}, got {self.prompts!r}")
        need(self.prefill_budget == "auto" or (is_int(self.prefill_budget) and self.prefill_budget >= 1),
             f"prefill_budget must be a positive integer (prompt tokens per round) or 'auto', got "
             f"{self.prefill_budget!r}")
        need(is_num(self.prefix_cache_mb) and self.prefix_cache_mb >= 0,
             f"prefix_cache_mb must be a number of MiB >= 0 (0 = no prefix cache), got {self.prefix_cache_mb!r}")
        need(is_num(self.shutdown_timeout) and self.shutdown_timeout >= 0,
             f"shutdown_timeout must be a number of seconds >= 0, got {self.shutdown_timeout!r}")
        need(is_num(self.replica_cpus) and self.replica_cpus > 0,
             f"replica_cpus must be a number > 0 (Ray CPUs reserved per replica), got {self.replica_cpus!r}")
        need(is_num(self.health_check_period_s) and self.health_check_period_s > 0,
             f"health_check_period_s must be a number > 0, got {self.health_check_period_s!r}")
        auto = (self.min_replicas, self.max_replicas)
        need((auto[0] is None) == (auto[1] is None),
             f"autoscaling needs both min_replicas and max_replicas, got min_replicas={auto[0]!r}, "
             f"max_replicas={auto[1]!r}; give both (e.g. 1 and 4) or neither (num_replicas alone)")
        if auto[0] is not None:
            need(is_int(auto[0]) and auto[0] >= 0, f"min_replicas must be an integer >= 0, got {auto[0]!r}")
            need(is_int(auto[1]) and auto[1] >= max(1, auto[0]),
                 f"max_replicas must be an integer >= 1 and >= min_replicas ({auto[0]}), got {auto[1]!r}")
        need(self.target_ongoing_requests is None or (is_num(self.target_ongoing_requests)
                                                      and self.target_ongoing_requests > 0),
             f"target_ongoing_requests must be a number > 0, got {self.target_ongoing_requests!r}")
        need(self.target_ongoing_requests is None or auto[0] is not None,
             "target_ongoing_requests applies to autoscaling only: give min_replicas and max_replicas too")

    @classmethod
    def from_args(cls, args: dict) -> "RayServeSettings":
        """Settings from a Serve config's ``args`` mapping (:func:`app_builder`). Raises InputError for a
        mapping that is not one, an unknown key (naming the known ones), a missing ``engine`` or a bad value."""
        if not isinstance(args, dict):
            raise InputError(f"the application's args must be a mapping of settings, got {type(args).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise InputError(f"unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in the "
                             f"application's args; known: {', '.join(known)}")
        if "engine" not in args:
            raise InputError("the application's args need engine: the path of the engine directory (or tarball) "
                             "on the replicas' nodes")
        return cls(**args)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    @property
    def replica_threads(self) -> int:
        """ONNX Runtime intra-op threads of each replica's engine."""
        return self.threads if self.threads is not None else max(1, int(round(self.replica_cpus)))

    def app_kwargs(self) -> dict:
        """Keyword arguments of :func:`~dspark_runtime.serving.app.create_app`."""
        return dict(draft=None if self.draft == "none" else self.draft, draft_length=self.draft_length,
                    draft_confidence=self.draft_confidence, max_batch=self.max_batch, max_queue=self.max_queue,
                    max_context=self.max_context, default_max_tokens=self.default_max_tokens,
                    model_name=self.model_name, shutdown_drain_s=float(self.shutdown_timeout),
                    prefill_budget=self.prefill_budget)

    def engine_kwargs(self) -> dict:
        """Keyword arguments of :meth:`~dspark_runtime.engine.Engine.load` besides the path, as ``dspark serve``
        loads its engine: ``threads`` (:attr:`replica_threads`), ``placement``, ``prompts``, ``prefix_cache_mb``, and
        ``shared_thread_pool`` (:func:`~dspark_runtime.machine.sysinfo.shared_pool_default`, read on the replica's
        node)."""
        return dict(threads=self.replica_threads, shared_thread_pool=shared_pool_default(), placement=self.placement,
                    prompts=self.prompts, prefix_cache_mb=float(self.prefix_cache_mb))

    def deployment_options(self) -> dict:
        """Keyword arguments of ``serve.deployment`` / ``Deployment.options``."""
        from dspark_runtime.serving.app import SHUTDOWN_GRACE_S

        opts = dict(max_ongoing_requests=self.max_ongoing_requests or self.max_batch + self.max_queue,
                    ray_actor_options={"num_cpus": float(self.replica_cpus)},
                    health_check_period_s=float(self.health_check_period_s),
                    graceful_shutdown_timeout_s=float(self.shutdown_timeout) + SHUTDOWN_GRACE_S)
        if self.autoscaling:
            opts["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "initial_replicas": max(1, self.min_replicas),
                "target_ongoing_requests": float(self.target_ongoing_requests or self.max_batch)}
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


class ReplicaHeaderMiddleware:
    """Pure ASGI middleware of each replica's app: adds ``X-DSpark-Replica: <replica id>`` to every HTTP response
    (streamed ones too; it only touches ``http.response.start``, so response bodies pass through unbuffered), and
    reads each request's body before the app does, answering 408 when the next part of it does not arrive within
    ``body_timeout_s``. Serve's router retries a request on another replica when the one it chose died before
    accepting it, but that one may already have pulled the body from the proxy: the second replica would then wait
    for a body that never comes, until the client gives up."""

    def __init__(self, app, replica: str, body_timeout_s: float = BODY_TIMEOUT_S):
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode(), replica.encode())
        self.body_timeout_s = float(body_timeout_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + [self.header]
            await send(message)

        head = []  # the request's messages up to its last body part (or a disconnect), replayed to the app
        while not head or (head[-1]["type"] == "http.request" and head[-1].get("more_body", False)):
            try:
                head.append(await asyncio.wait_for(receive(), self.body_timeout_s))
            except asyncio.TimeoutError:
                body = json.dumps({"error": {
                    "message": f"the request body did not arrive within {self.body_timeout_s:g} s; retry the request",
                    "type": "timeout_error", "param": None, "code": "request_timeout"}}).encode()
                await send_with_header({"type": "http.response.start", "status": 408, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")]})
                await send_with_header({"type": "http.response.body", "body": body})
                return

        async def replay():
            return head.pop(0) if head else await receive()

        await self.app(scope, replay, send_with_header)


def replica_app(settings: RayServeSettings, replica: str | None = None, deployment: str = DEPLOYMENT_NAME):
    """Load the engine and build this replica's app: :func:`~dspark_runtime.serving.app.create_app`'s app plus the
    ``X-DSpark-Replica`` header and ``dspark_replica_info`` in its ``/metrics``. Runs inside the replica
    (Serve calls it through the ingress builder); ``replica`` defaults to Serve's replica id of the calling
    replica. Raises ManifestError for an engine directory that is missing or corrupted on this node, InputError
    for settings the engine refuses (a drafter it lacks, a placement it cannot run)."""
    from prometheus_client import Gauge

    from dspark_runtime.serving.app import create_app  # FastAPI: loaded only where a replica builds its app

    if replica is None:
        ctx = _need_ray().get_replica_context()
        replica, deployment = ctx.replica_tag, ctx.deployment
    engine = dspark_runtime.Engine.load(settings.engine, **settings.engine_kwargs())
    app = create_app(engine, **settings.app_kwargs())
    app.add_middleware(ReplicaHeaderMiddleware, replica=replica)
    info = Gauge("dspark_replica_info", "The Ray Serve replica behind this /metrics (always 1).",
                 ["replica", "deployment", "node", "pid"], registry=app.state.metrics.registry)
    info.labels(replica, deployment, socket.gethostname(), str(os.getpid())).set(1)
    app.state.replica_id = replica
    return app


def build_app(settings: RayServeSettings):
    """The Serve application (``Deployment.bind()``): one deployment, :data:`DEPLOYMENT_NAME`, whose replicas
    each run :func:`replica_app`. Nothing is loaded here; replicas load the engine when Serve starts them.
    Raises InputError when Ray Serve is not installed."""
    serve = _need_ray()
    if not isinstance(settings, RayServeSettings):
        raise InputError(f"build_app takes RayServeSettings, got {type(settings).__name__}")

    def build_asgi_app():  # evaluated in each replica (a closure: Serve pickles it with the settings)
        return replica_app(settings)

    class DSparkServer:
        """One replica: its own engine, engine thread and app (Serve's FastAPI ingress)."""

        def check_health(self):
            """Serve's health check: raises once this replica's engine thread has stopped (Serve replaces it)."""
            worker = self.app.state.worker
            if not worker.alive:
                raise RuntimeError("the replica's engine thread is not running")

    ingress = serve.ingress(build_asgi_app)(DSparkServer)
    deployment = serve.deployment(ingress, name=DEPLOYMENT_NAME, **settings.deployment_options())
    return deployment.bind()


def app_builder(args: dict):
    """Application builder for Serve config files (``import_path: dspark_runtime.serving.ray_serve:app_builder``):
    ``args`` are :class:`RayServeSettings` fields. Raises InputError for unknown or bad settings (see
    :meth:`RayServeSettings.from_args`) or when Ray Serve is not installed."""
    return build_app(RayServeSettings.from_args(dict(args or {})))


def run(settings: RayServeSettings, *, address: str | None = None, host: str = "127.0.0.1", port: int = 8000,
        log=print) -> None:
    """``dspark serve --ray``: connect to Ray (``address`` None: start a new local Ray cluster on this machine,
    owned by this call and stopped at its end; "auto", ``HOST:6379`` or ``ray://HOST:10001``: join a running
    one), start Serve's HTTP proxy on ``host:port``, deploy :func:`build_app` as the application
    :data:`APP_NAME` at route ``/``, and block until SIGINT/SIGTERM; then delete the application (replicas
    drain their open requests for ``settings.shutdown_timeout`` s) and disconnect (a joined cluster keeps
    running, with Serve). Raises InputError without Ray Serve or when no Ray cluster answers at ``address``;
    ``serve.run``'s RuntimeError when the replicas fail to start (the replica logs, under
    /tmp/ray/session_latest/logs/serve/, say why)."""
    serve = _need_ray()
    import ray

    if settings.engine and Path(settings.engine).exists():
        settings = dataclasses.replace(settings, engine=str(Path(settings.engine).resolve()))
    try:
        if address is None:
            ray.init(address="local", include_dashboard=False, log_to_driver=True)
        else:
            ray.init(address=address, log_to_driver=True)
    except ConnectionError as e:
        raise InputError(f"no Ray cluster answers at --ray-address {address}: {str(e).rstrip('.')}; start one "
                         f"with `ray start --head` (then 'auto' joins it), or drop --ray-address to start a local "
                         f"one") from None
    stop = {"now": False}

    def _stop(signum, frame):
        stop["now"] = True

    old = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": host, "port": port})
        scale = (f"autoscaling {settings.min_replicas}..{settings.max_replicas} replicas" if settings.autoscaling
                 else f"{settings.num_replicas} replica{'s' if settings.num_replicas > 1 else ''}")
        log(f"deploying {settings.engine} on Ray Serve: {scale}, {settings.replica_cpus:g} CPU and "
            f"{settings.replica_threads} thread(s) per replica")
        serve.run(build_app(settings), name=APP_NAME, route_prefix="/")
        log(f"serving on http://{host}:{port}/v1 (Ray Serve; Ctrl-C stops)")
        while not stop["now"]:
            time.sleep(0.5)
        log("stopping: replicas drain their open requests")
        serve.delete(APP_NAME)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if address is None:
            serve.shutdown()
        ray.shutdown()
