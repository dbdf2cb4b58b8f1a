"""Running the app of :func:`dspark_runtime.serving.app.create_app` with uvicorn: :func:`serve` (``dspark serve``,
until interrupted) and :class:`ServerThread` (a background thread on a loopback socket: tests, embedding).

Shutdown drains: the moment uvicorn starts shutting down, the app's engine thread stops taking work, and requests
still open after the app's ``shutdown_drain_s`` are cancelled, each ending with its own clean answer (a 503
``cancelled`` body, or an SSE error event then ``[DONE]``) within :data:`~dspark_runtime.serving.app.SHUTDOWN_GRACE_S`
more, before uvicorn's ``timeout_graceful_shutdown`` cancels their handlers.
"""
from __future__ import annotations

import logging
import socket
import sys
import threading
import time

import uvicorn

from dspark_runtime.serving.app import SHUTDOWN_GRACE_S, create_app
from dspark_runtime.serving.worker import EngineWorker


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose shutdown first tells ``engine_worker`` to stop taking work and to cancel,
    ``drain_s`` seconds later, whatever is still running (``engine_worker`` None: a plain uvicorn server).

    uvicorn itself would wait ``timeout_graceful_shutdown`` seconds and then cancel the handlers of open
    requests, which answers a non-streamed request with a bare 500 and cuts a stream mid-body; the engine
    thread's own drain would only start after that (at the lifespan's end), when nothing is left to drain.
    ``timeout_graceful_shutdown`` must leave handlers time after the drain deadline (:data:`SHUTDOWN_GRACE_S`)."""

    def __init__(self, config: uvicorn.Config, engine_worker: EngineWorker | None, drain_s: float):
        super().__init__(config)
        self.engine_worker, self.drain_s = engine_worker, drain_s

    async def shutdown(self, sockets=None):
        if self.engine_worker is not None:
            self.engine_worker.begin_stop(self.drain_s)
        await super().shutdown(sockets=sockets)


def _draining_server(config: uvicorn.Config, app, drain_s: float | None = None) -> DrainingServer:
    """A :class:`DrainingServer` for ``app``: its engine thread (``app.state.worker``, when ``app`` is a
    :func:`create_app` app) drained ``drain_s`` seconds (default: the app's ``shutdown_drain_s``)."""
    worker = getattr(getattr(app, "state", None), "worker", None)  # any ASGI app may be served
    if drain_s is None:
        drain_s = getattr(app.state, "shutdown_drain_s", 0.0) if worker is not None else 0.0
    return DrainingServer(config, worker if isinstance(worker, EngineWorker) else None, drain_s)


class ServerThread:
    """Run an app with uvicorn in a background thread on an already-bound loopback socket (tests,
    embedding). Use as a context manager; ``url`` is ``http://host:port``.

    Args:
        app: the ASGI app (``create_app(...)``).
        host: address to bind; port 0 picks a free port.
        timeout_graceful_shutdown: seconds uvicorn waits for open connections at shutdown (None: no limit).
            Open requests get the app's ``shutdown_drain_s`` to finish, at most this less a grace (the
            smaller of :data:`SHUTDOWN_GRACE_S` and half of it) in which their handlers answer the
            cancellation cleanly.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout_graceful_shutdown: float | None = 10,
                 log_level: str = "warning"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=timeout_graceful_shutdown)
        drain = getattr(getattr(app, "state", None), "shutdown_drain_s", 0.0)
        if timeout_graceful_shutdown is not None:
            t = float(timeout_graceful_shutdown)
            drain = max(0.0, min(drain, t - min(SHUTDOWN_GRACE_S, t / 2)))
        self.server = _draining_server(config, app, drain)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="dspark-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        """Start serving; returns once uvicorn is up. Raises RuntimeError if it does not start in time."""
        self.thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful shutdown (uvicorn closes the listener, the engine thread drains open requests, uvicorn
        waits for them, runs the lifespan exit)."""
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def serve(engine, *, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
          log_level: str = "info", **app_kwargs) -> None:
    """Serve ``engine`` with uvicorn until interrupted (``dspark serve``). ``app_kwargs`` go to :func:`create_app`.

    On SIGINT/SIGTERM uvicorn stops accepting and the engine thread stops taking work; open requests may
    finish for up to ``shutdown_timeout`` s, then the rest are cancelled and each gets a clean answer (a 503
    ``cancelled`` body, or an SSE error event then ``[DONE]``) within :data:`SHUTDOWN_GRACE_S` more; then
    the process exits (uvicorn re-raises the signal it handled: a SIGTERM'd server ends by that signal)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(message)s")
    shutdown_timeout = max(0.0, float(shutdown_timeout))
    app_kwargs.setdefault("shutdown_drain_s", shutdown_timeout)
    app = create_app(engine, **app_kwargs)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=app.state.shutdown_drain_s + SHUTDOWN_GRACE_S)
    server = _draining_server(config, app)
    try:
        server.run()
    except KeyboardInterrupt:  # the SIGINT uvicorn handled, re-raised after the graceful shutdown
        pass
    if not server.started:
        sys.exit(3)  # as uvicorn.run: the server did not start (e.g. the port is taken)
