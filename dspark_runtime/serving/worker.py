"""The engine thread of ``dspark serve`` (:mod:`dspark_runtime.serving.app`): :class:`EngineWorker` owns the (not
thread-safe) batched generator, takes submissions and cancellations between rounds and hands each request's tokens
back to the event loop; :class:`ServerMetrics` exports its counters to Prometheus."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from dspark_runtime.errors import DSparkError
from dspark_runtime.decoding.sampling import SamplingParams
from dspark_runtime.serving.wire import APIError

log = logging.getLogger("dspark.server")


# ---------------------------------------------------------------------------------------- the worker


@dataclass
class Outcome:
    """A finished choice: generated ids (EOS included when it ended on EOS), finish reason
    ("eos" | "length" | "stop" | "cancelled"), its :class:`GenerationStats` and its
    :class:`~dspark_runtime.decoding.logprobs.TokenLogprob` per id (None when not asked for)."""

    token_ids: list
    finish_reason: str
    stats: Any
    logprobs: list | None = None


@dataclass
class Job:
    """One HTTP request's work for the engine thread, and the channel its results come back on.

    ``n`` choices (one prefill, :meth:`DecodingLoop.submit_choices`), each with its own grammar (``grammars``: one
    per choice, or None); ``logprobs``: None or the alternatives per token. The engine thread calls :meth:`push`;
    the event loop reads ``events``: ``("tokens", (choice, ids, logprobs or None))``, ``("done", (choice,
    Outcome))``, ``("error", APIError)``."""

    loop: asyncio.AbstractEventLoop
    prompt_ids: list
    max_tokens: int
    params: SamplingParams
    seed: int | None
    stop: list
    n: int = 1
    logprobs: int | None = None
    grammars: list | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    reqs: list = field(default_factory=list)
    closed: bool = False  # the handler saw done/error (or gave up)
    checked: float = field(default_factory=time.monotonic)  # last check that the client is still there

    def push(self, kind: str, payload) -> None:
        """Hand an event to the event loop (thread-safe; dropped once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:
            pass


class EngineWorker:
    """The one thread that owns a :class:`~dspark_runtime.decoding.loop.DecodingLoop`.

    Between rounds it applies queued commands (submit, cancel, stop); while any request is waiting
    or active it runs ``step()``. ``submit`` / ``cancel`` / ``stop`` may be called from any thread.

    Args:
        gen: the :class:`~dspark_runtime.decoding.loop.DecodingLoop` (``Engine.batch(...)``); its ``default_gamma``
            caps each request's draft length.
        max_queue: requests accepted beyond ``gen.max_batch`` (they wait for a slot); more → 429.
    """

    def __init__(self, gen, *, max_queue: int = 64):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.gen = gen
        self.gamma = int(gen.default_gamma)
        self.capacity = gen.max_batch + max_queue
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._inflight = 0
        self._accepting = False
        self._jobs: dict = {}  # rid -> Job, requests inside the generator
        self.thread: threading.Thread | None = None
        self.failed: BaseException | None = None
        self.snapshot: dict = {"stats": gen.stats.to_json(), "waiting": 0, "prefilling": 0, "active": 0, "inflight": 0,
                               "prefix": None}

    # -- any thread

    @property
    def alive(self) -> bool:
        """True while the thread runs and accepts work."""
        return self.thread is not None and self.thread.is_alive() and self._accepting

    @property
    def inflight(self) -> int:
        """Requests accepted and not yet finished (queued + decoding)."""
        return self._inflight

    def start(self) -> None:
        """Start the engine thread."""
        if self.thread is not None:
            return
        self._accepting = True
        self.thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` (its ``n`` choices count as ``n`` requests). Raises APIError 400 when ``n`` exceeds the
        capacity, 429 when the capacity would be exceeded, 503 when stopping."""
        if job.n > self.capacity:
            raise APIError(400, f"n: {job.n} choices exceed this server's capacity of {self.capacity} requests in "
                                f"flight; ask for at most {self.capacity}", param="n", code="too_many_choices")
        with self._lock:
            if not self._accepting or self.thread is None or not self.thread.is_alive():
                raise APIError(503, "the server is shutting down or its engine stopped; retry later",
                               "service_unavailable", code="engine_unavailable")
            if self._inflight + job.n > self.capacity:
                raise APIError(429, f"the server is at capacity ({self.capacity} requests in flight: "
                                    f"{self.gen.max_batch} decoding, the rest queued); retry later",
                               "rate_limit_error", code="queue_full")
            self._inflight += job.n
        self._cmds.put(("submit", job))

    def cancel(self, job: Job) -> None:
        """Cancel ``job`` (its client went away); its slots are freed before the next round."""
        self._cmds.put(("cancel", job))

    def begin_stop(self, drain_s: float = 0.0) -> None:
        """Stop accepting (new submissions get 503) and return at once; in-flight requests may finish for up
        to ``drain_s`` seconds, then the rest are cancelled (their handlers get a "cancelled" outcome and
        answer it) and the thread ends. A later call can only bring the deadline forward."""
        with self._lock:
            self._accepting = False
        if self.thread is not None:
            self._cmds.put(("stop", time.monotonic() + max(0.0, drain_s)))

    def stop(self, drain_s: float = 0.0, join_s: float = 60.0) -> None:
        """:meth:`begin_stop`, then wait up to ``join_s`` seconds for the thread to end."""
        self.begin_stop(drain_s)
        if self.thread is not None:
            self.thread.join(join_s)

    # -- the engine thread

    def _release(self, n: int = 1) -> None:
        with self._lock:
            self._inflight -= n

    def _admit(self, job: Job) -> None:
        sent = [0] * job.n  # ids handed to the event loop per choice (their logprobs follow them)

        def on_tokens(i, ids, job=job):
            if ids:
                req = job.reqs[i]
                lps = None if req.logprobs is None else req.token_logprobs[sent[i]:sent[i] + len(ids)]
                sent[i] += len(ids)
                job.push("tokens", (i, list(ids), lps))

        try:
            reqs = self.gen.submit_choices(job.prompt_ids, job.n, seed=job.seed, grammars=job.grammars,
                                           on_choice_tokens=on_tokens, max_new_tokens=job.max_tokens,
                                           params=job.params, gamma=self.gamma, stop=job.stop or None,
                                           logprobs=job.logprobs)
        except DSparkError as e:
            self._release(job.n)
            job.push("error", APIError(400, str(e)))
            return
        except Exception as e:  # noqa: BLE001 - never leave a client hanging
            log.exception("submit failed")
            self._release(job.n)
            job.push("error", APIError(500, f"internal error: {e}", "server_error"))
            return
        job.reqs = reqs
        for i, req in enumerate(reqs):
            self._jobs[req.rid] = (job, i)

    def _done(self, job: Job, i: int, reason: str | None = None) -> None:
        # the slot is released before the handler hears of it: a client that sends its next request as soon
        # as it has its answer must never find the slot still taken (a spurious 429 at exactly capacity)
        req = job.reqs[i]
        self._jobs.pop(req.rid, None)
        self._release()
        job.push("done", (i, Outcome(list(req.token_ids), reason or req.finish_reason, req.stats, req.kept_logprobs)))

    def _cancel(self, job: Job) -> None:
        for i, req in enumerate(job.reqs):
            if req.rid not in self._jobs:
                continue  # already finished
            try:
                self.gen.cancel(req)
            except Exception:  # noqa: BLE001
                log.exception("cancel failed")
            self._done(job, i, "cancelled")

    def _fail_all(self, err: APIError) -> None:
        failed = {}
        for rid, (job, i) in list(self._jobs.items()):
            try:
                self.gen.cancel(job.reqs[i])
            except Exception:  # noqa: BLE001
                pass
            self._jobs.pop(rid, None)
            self._release()
            failed[id(job)] = job
        for job in failed.values():
            job.push("error", err)

    def _snapshot(self) -> None:
        g = self.gen
        cache = g.prefix_cache
        self.snapshot = {"stats": g.stats.to_json(), "waiting": len(g.waiting), "prefilling": len(g.prefilling),
                         "active": len(g.active), "inflight": self._inflight,
                         "prefix": None if cache is None else cache.stats.to_json()}

    def _run(self) -> None:
        stop_at = None
        try:
            while True:
                cmds = []
                try:
                    if self.gen.busy or stop_at is not None:
                        cmds.append(self._cmds.get_nowait())
                    else:
                        cmds.append(self._cmds.get(timeout=1.0))
                    while True:
                        cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                for kind, arg in cmds:
                    if kind == "submit":
                        self._admit(arg)
                    elif kind == "cancel":
                        self._cancel(arg)
                    elif kind == "stop":
                        stop_at = arg if stop_at is None else min(stop_at, arg)
                if stop_at is not None and (not self.gen.busy or time.monotonic() >= stop_at):
                    for job in {id(j): j for j, _ in self._jobs.values()}.values():
                        self._cancel(job)
                    self._snapshot()
                    return
                if self.gen.busy:
                    try:
                        finished = self.gen.step()
                    except Exception as e:  # noqa: BLE001
                        log.exception("decoding round failed")
                        self._fail_all(APIError(500, f"internal error while decoding: {e}", "server_error"))
                    else:
                        for req in finished:
                            entry = self._jobs.get(req.rid)
                            if entry is not None:
                                self._done(*entry)
                self._snapshot()
        except BaseException as e:  # noqa: BLE001 - the thread must not die silently with clients waiting
            self.failed = e
            log.exception("engine thread stopped")
            with self._lock:
                self._accepting = False
            self._fail_all(APIError(500, f"the engine thread stopped: {e}", "server_error"))
            raise


# ---------------------------------------------------------------------------------------- metrics


class _EngineCollector:
    """Prometheus collector of the engine thread's aggregate batch statistics (read from its snapshot)."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker

    def describe(self):
        return []

    def collect(self):
        snap = self.worker.snapshot
        st = snap["stats"]
        for name, key, doc in (("dspark_rounds", "rounds", "Verify rounds (one packed verifier pass each)."),
                               ("dspark_verify_tokens", "verify_tokens", "Token positions verified (sum of B)."),
                               ("dspark_draft_tokens_proposed", "proposed", "Draft tokens verified."),
                               ("dspark_draft_tokens_accepted", "accepted", "Draft tokens the target accepted."),
                               ("dspark_draft_tokens_wasted", "wasted", "Draft tokens the target rejected."),
                               ("dspark_committed_tokens", "committed", "Tokens committed by rounds."),
                               ("dspark_prefill_tokens", "prefill_tokens", "Prompt tokens prefilled."),
                               ("dspark_prefill_chunks", "prefill_chunks",
                                "Prompt chunks fed (chunked prefill: one per prefilling request and round)."),
                               ("dspark_mixed_rounds", "mixed_rounds",
                                "Verify rounds that also fed prompt tokens (a joining prompt did not stall them)."),
                               ("dspark_target_calls", "target_calls", "Verifier graph calls.")):
            yield CounterMetricFamily(name, doc, value=st.get(key, 0))
        for name, key, doc in (("dspark_constrained_requests", "constrained_requests",
                                "Requests with a response_format grammar."),
                               ("dspark_forced_tokens", "forced_tokens",
                                "Tokens a grammar forced, verified as free drafts."),
                               ("dspark_masked_draft_tokens", "masked_drafts",
                                "Draft tokens a grammar forbade (each ended its block unverified).")):
            yield CounterMetricFamily(name, doc, value=st.get(key, 0))
        yield GaugeMetricFamily("dspark_tau", "Tokens committed per request-round, bonus included (aggregate).",
                                value=st.get("accepted_length_mean", 0.0))
        prop = st.get("proposed", 0)
        yield GaugeMetricFamily("dspark_acceptance_rate", "Accepted / proposed draft tokens (aggregate).",
                                value=st.get("accepted", 0) / prop if prop else 0.0)
        g = GaugeMetricFamily("dspark_acceptance_by_position",
                              "Fraction of request-rounds verifying draft position k that accepted it.",
                              labels=["position"])
        for k, v in enumerate(st.get("accepted_by_position", []) or []):
            g.add_metric([str(k + 1)], v)
        yield g
        yield _histogram("dspark_verify_length", "Draft tokens verified per request-round (l_r).",
                         st.get("verify_length_histogram", {}))
        yield _histogram("dspark_batch_size", "Requests per verify round.", st.get("batch_histogram", {}))
        yield GaugeMetricFamily("dspark_queue_depth", "Requests accepted and waiting for a decoding slot.",
                                value=max(0, snap["inflight"] - snap["active"] - snap.get("prefilling", 0)))
        yield GaugeMetricFamily("dspark_prefilling_requests", "Requests whose prompt is being fed (chunked prefill).",
                                value=snap.get("prefilling", 0))
        yield GaugeMetricFamily("dspark_active_requests", "Requests decoding.", value=snap["active"])
        hits, ttft_hit = st.get("prefix_hit_requests", 0), st.get("ttft_prefix_hit_s", 0.0)
        firsts = CounterMetricFamily("dspark_engine_first_tokens", "Requests that got their first token, by whether "
                                     "they reused prefix-cache positions.", labels=["prefix_cache"])
        firsts.add_metric(["hit"], hits)
        firsts.add_metric(["miss"], st.get("first_tokens", 0) - hits)
        yield firsts
        ttft = CounterMetricFamily("dspark_engine_ttft_seconds", "Sum of submission-to-first-token seconds in the "
                                   "engine, by prefix-cache hit (divide by dspark_engine_first_tokens for the mean).",
                                   labels=["prefix_cache"])
        ttft.add_metric(["hit"], ttft_hit)
        ttft.add_metric(["miss"], st.get("ttft_s", 0.0) - ttft_hit)
        yield ttft
        yield CounterMetricFamily("dspark_prompt_tokens_cached", "Prompt tokens reused from the prefix cache.",
                                  value=st.get("cached_prompt_tokens", 0))
        pc = snap.get("prefix")
        if pc is not None:
            for name, key, doc in (("dspark_prefix_cache_lookups", "lookups", "Requests looked up in the prefix cache."),
                                   ("dspark_prefix_cache_hits", "hits", "Lookups that reused at least one block."),
                                   ("dspark_prefix_cache_lookup_tokens", "lookup_tokens",
                                    "Prompt tokens looked up (each prompt less its last token)."),
                                   ("dspark_prefix_cache_hit_tokens", "hit_tokens", "Prompt tokens reused."),
                                   ("dspark_prefix_cache_evicted_blocks", "evicted_blocks",
                                    "Blocks evicted (least recently used) to stay within the bound.")):
                yield CounterMetricFamily(name, doc, value=pc[key])
            for name, key, doc in (("dspark_prefix_cache_hit_rate", "hit_rate", "Reused / looked-up prompt tokens."),
                                   ("dspark_prefix_cache_bytes", "bytes", "Bytes of cached keys, values and features."),
                                   ("dspark_prefix_cache_max_bytes", "max_bytes", "The prefix cache's memory bound."),
                                   ("dspark_prefix_cache_blocks", "blocks", "Blocks held (per part).")):
                yield GaugeMetricFamily(name, doc, value=pc[key])
        yield GaugeMetricFamily("dspark_capacity", "Most requests accepted at once (max_batch + max_queue).",
                                value=self.worker.capacity)


def _histogram(name: str, doc: str, counts: dict) -> HistogramMetricFamily:
    """A Prometheus histogram from {value: count} of small non-negative integers (one bucket per value)."""
    items = sorted((int(k), int(v)) for k, v in counts.items())
    top = max([k for k, _ in items] + [8])
    buckets, cum = [], 0
    by = dict(items)
    for le in range(top + 1):
        cum += by.get(le, 0)
        buckets.append((str(float(le)), cum))
    buckets.append(("+Inf", cum))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(sum(k * v for k, v in items)))


class ServerMetrics:
    """The server's Prometheus registry: request/token counters and latency histograms (updated by the
    handlers) plus the engine's batch statistics (:class:`_EngineCollector`)."""

    def __init__(self, worker: EngineWorker):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("dspark_requests", "HTTP generation requests by endpoint and outcome "
                                "(stop, length, cancelled, rejected, invalid, error).",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("dspark_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("dspark_generation_tokens", "Tokens generated for finished requests.",
                                         registry=r)
        lat = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("dspark_time_to_first_token_seconds", "Request arrival to its first token.",
                              buckets=lat, registry=r)
        self.tpot = Histogram("dspark_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (tokens - 1).",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                              registry=r)
        self.e2e = Histogram("dspark_e2e_request_latency_seconds", "Request arrival to its last token.",
                             buckets=lat, registry=r)
        self.request_tau = Histogram("dspark_request_tau", "Per request τ: tokens committed per verify round.",
                                     buckets=(1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12), registry=r)
        r.register(_EngineCollector(worker))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
