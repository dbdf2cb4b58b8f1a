"""The OpenAI-compatible FastAPI app of ``dspark serve`` over the batched runtime: :func:`create_app`.

One :class:`~dspark_runtime.serving.worker.EngineWorker` thread owns the decoding loop (not thread-safe); handlers
submit and cancel jobs through it, between rounds, and receive each request's committed tokens as events. At most
``max_batch + max_queue`` requests are accepted at once; more get 429. Endpoints: ``POST /v1/completions`` and
``/v1/chat/completions`` (OpenAI wire format; streamed as server-sent events ending with ``data: [DONE]``), ``GET
/v1/models``, ``/health``, ``/metrics`` (Prometheus). Responses carry a ``dspark`` object (τ, acceptance, timings).
Every user error is a 4xx with ``{"error": {"message", "type", "param", "code"}}``. :mod:`~dspark_runtime.serving.wire`
holds the request models and error bodies; :mod:`~dspark_runtime.serving.server` runs the app with uvicorn.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_runtime.decoding.request import streamable_length
from dspark_runtime.errors import DSparkError, InputError
from dspark_runtime.decoding.sampling import SamplingParams
from dspark_runtime.serving.wire import (ERROR_RESPONSES, APIError, ChatCompletionRequest, CompletionRequest,
                                       ErrorResponse, SafeJSONResponse, error_body)
from dspark_runtime.serving.worker import EngineWorker, Job, Outcome, ServerMetrics

log = logging.getLogger("dspark.server")

DEFAULT_MAX_CONTEXT = 4096  # when neither the manifest nor the caller gives one
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (as vLLM): logits / 1e-300 would overflow
SHUTDOWN_GRACE_S = 5.0  # after the drain deadline, how long handlers get to send their "cancelled" answers
API_PATHS = ("/v1/completions", "/v1/chat/completions")


def engine_max_context(engine) -> int | None:
    """The engine's context capacity: the smallest ``max_position_embeddings`` its graphs record, or None."""
    vals = [g.model_config.get("max_position_embeddings") for g in engine.manifest.graphs.values()]
    vals = [int(v) for v in vals if isinstance(v, int) and v > 0]
    return min(vals) if vals else None


def _loc_param(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # drop pydantic's union-branch tags (e.g. 'str', 'list[int]', 'constrained-str', 'function-after[...]')
    parts = [p for p in parts if not (p in ("str", "int", "float", "bool", "none") or "[" in p
                                      or p.startswith(("function-", "constrained-")))]
    return ".".join(parts) or None


def _sse(obj, ascii: bool = False) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=ascii)}\n\n"


def _finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _dspark_ext(stats) -> dict:
    """The ``dspark`` extension object of a response: τ, acceptance and timings of the request."""
    return {"drafter": stats.drafter, "tau": round(stats.accepted_length_mean, 4),
            "acceptance_rate": round(stats.acceptance_rate, 4), "draft_tokens_proposed": stats.proposed,
            "draft_tokens_accepted": stats.accepted, "rounds": stats.num_rounds,
            "accepted_by_position": [round(x, 4) for x in stats.accepted_by_position],
            "ttft_ms": round(stats.ttft_ms, 2), "decode_ms": round(stats.decode_ms, 2),
            "cached_prompt_tokens": stats.cached_tokens,
            "tokens_per_second": round(stats.tokens_per_second, 3),
            "grammar": {"forced_tokens": stats.forced_tokens, "masked_drafts": stats.masked_drafts,
                        "masks": stats.grammar_masks, "mask_ms": round(stats.grammar_mask_ms, 3)}}


def create_app(engine, *, draft: str | None = "auto", draft_length: int | str | None = None,
               draft_confidence: float | None = None, max_batch: int = 8, max_queue: int = 64,
               max_context: int | None = None, default_max_tokens: int = 256, model_name: str | None = None,
               shutdown_drain_s: float = 5.0, prefill_budget: int | str = "auto") -> FastAPI:
    """The FastAPI app serving ``engine`` (a loaded :class:`~dspark_runtime.engine.Engine`).

    Args:
        draft, draft_length, draft_confidence, max_batch, prefill_budget: as :meth:`Engine.batch` ("auto":
            :meth:`Engine.auto_draft` — the router over a calibrated DSpark drafter with scheduled verify lengths
            where the engine has a cost table, else its draft LM, else the router over an uncalibrated DSpark
            drafter, else n-gram lookup; None/"none": target-only).
        max_queue: requests accepted beyond ``max_batch`` (waiting for a slot); more are answered 429.
        max_context: prompt + max_tokens limit; default: the manifest's ``max_position_embeddings``
            (else 4096); a larger value than that raises InputError.
        default_max_tokens: max_tokens when a request gives none (capped by the context left).
        model_name: the id served in /v1/models and responses (default: the manifest's name).
        shutdown_drain_s: at shutdown, how long in-flight requests may still finish before they are cancelled.

    The engine thread starts and stops with the app's lifespan (uvicorn runs it). ``app.state.worker``
    is the :class:`EngineWorker`, ``app.state.metrics`` the :class:`ServerMetrics`.
    Raises InputError (from :meth:`Engine.batch`) for a drafter the engine lacks or bad arguments.
    """
    gen = engine.batch(draft=draft, draft_length=draft_length, draft_confidence=draft_confidence,
                       max_batch=max_batch, prefill_budget=prefill_budget, draft_skip=True)
    worker = EngineWorker(gen, max_queue=max_queue)
    metrics = ServerMetrics(worker)
    model_ctx = engine_max_context(engine)
    if max_context is not None and model_ctx is not None and int(max_context) > model_ctx:
        raise InputError(f"max_context {max_context} is beyond what the engine's model was trained for "
                         f"(max_position_embeddings {model_ctx}): positions past it give unreliable output; pass "
                         f"--max-context {model_ctx} or less")
    ctx = int(max_context or model_ctx or DEFAULT_MAX_CONTEXT)
    name = model_name or engine.manifest.name
    vocab = engine.manifest.graphs["target"].spec.dims.vocab_size
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        log.info("engine thread started: %s, max_batch %d, capacity %d, max context %d",
                 "target-only" if gen.drafter is None else gen.drafter.name, gen.max_batch, worker.capacity, ctx)
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop, shutdown_drain_s)
            log.info("engine thread stopped")

    app = FastAPI(title="DSpark", version="0.1.0", lifespan=lifespan, default_response_class=SafeJSONResponse,
                  description="OpenAI-compatible completions over DSpark speculative decoding.")
    app.state.worker, app.state.metrics, app.state.max_context, app.state.model_name = worker, metrics, ctx, name
    app.state.shutdown_drain_s = shutdown_drain_s

    def _count_invalid(request: Request, outcome: str = "invalid") -> None:
        if request.url.path in API_PATHS:
            metrics.requests.labels(request.url.path, outcome).inc()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        _count_invalid(request)
        errs = exc.errors()
        e = errs[0] if errs else {"msg": "invalid request", "loc": (), "type": "invalid"}
        if e.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}"
            return SafeJSONResponse(error_body(msg, code="json_invalid"), status_code=400)
        param = _loc_param(e.get("loc", ()))
        msg = e.get("msg", "invalid value").removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = f"unrecognized request argument: {param} (this server does not support it; remove it)"
        elif tuple(e.get("loc", ())) == ("body",):
            msg = "the request body must be a JSON object (Content-Type: application/json)"
        elif param:
            msg = f"{param}: {msg}"
        if len(errs) > 1:
            msg += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
        return SafeJSONResponse(error_body(msg, param=param, code=e.get("type")), status_code=400)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        _count_invalid(request, "rejected" if exc.status in (429, 503) else "invalid")
        return SafeJSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(DSparkError)
    async def _dspark_error(request: Request, exc: DSparkError):
        _count_invalid(request)
        return SafeJSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return SafeJSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        _count_invalid(request, "error")
        return SafeJSONResponse(error_body(f"internal error: {exc}", "server_error"), status_code=500)

    # -- helpers

    def _check_model(body) -> None:
        if body.model is not None and body.model != name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {name!r}",
                           "not_found_error", "model", "model_not_found")

    def _max_tokens(body, n_prompt: int, prompt_param: str) -> int:
        room = ctx - n_prompt
        if room < 1:
            raise APIError(400, f"this model's maximum context length is {ctx} tokens; the prompt has "
                                f"{n_prompt} tokens, which leaves no room to generate. Shorten the prompt.",
                           param=prompt_param, code="context_length_exceeded")
        asked = body.requested_max_tokens
        if asked is None:
            return min(default_max_tokens, room)
        if n_prompt + asked > ctx:
            raise APIError(400, f"this model's maximum context length is {ctx} tokens; you requested "
                                f"{n_prompt + asked} tokens ({n_prompt} in the prompt, {asked} to generate). "
                                f"Reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return asked

    def _grammars(body) -> list | None:
        """One grammar per choice for the request's ``response_format`` (None: unconstrained); 400 naming the field
        for an invalid schema or a server without the grammar extra."""
        fmt = None if body.response_format is None else body.response_format.as_dict()
        if fmt is None:
            return None
        try:
            return [engine.compile_grammar(fmt) for _ in range(body.n)]
        except InputError as e:
            raise APIError(400, str(e), param="response_format", code="invalid_response_format") from None

    def _job(request: Request, body, ids: list, prompt_param: str) -> Job:
        _check_model(body)
        max_tokens = _max_tokens(body, len(ids), prompt_param)
        temperature = 0.0 if body.temperature < GREEDY_BELOW else float(body.temperature)
        params = SamplingParams(temperature=temperature, top_k=int(body.top_k), top_p=float(body.top_p),
                                presence_penalty=float(body.presence_penalty),
                                frequency_penalty=float(body.frequency_penalty),
                                repetition_penalty=float(body.repetition_penalty))
        params.validate()
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        seed = None if body.seed is None else body.seed % 2 ** 64
        return Job(asyncio.get_running_loop(), ids, max_tokens, params, seed, stop, n=body.n,
                   logprobs=body.top_logprobs_asked, grammars=_grammars(body))

    def _encode(prompt, raw: bool, param: str) -> list:
        try:
            return engine.encode_prompt(prompt, raw=raw)
        except DSparkError:
            raise
        except Exception as e:  # noqa: BLE001 - text the tokenizer or the chat template cannot take
            raise APIError(400, f"the {param} could not be tokenized: {type(e).__name__}", param=param) from None

    def _usage(n_prompt: int, n_gen: int, stats) -> dict:
        """OpenAI usage (``n_gen``: over all choices; the prompt counts once, as it is prefilled once);
        ``prompt_tokens_details.cached_tokens``: prompt tokens reused from the prefix cache."""
        return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
                "prompt_tokens_details": {"cached_tokens": int(stats.cached_tokens)}}

    def _logprobs(entries: list | None, chat: bool, offset: int = 0) -> dict | None:
        """The OpenAI ``logprobs`` object of a choice (or a streamed piece of one) from its
        :class:`~dspark_runtime.decoding.logprobs.TokenLogprob` entries; ``offset``: the text offset of the first
        token (completions' ``text_offset``)."""
        if entries is None:
            return None
        tok = engine.tokenizer

        def piece(t: int) -> tuple:
            b = tok.token_bytes(t)
            return b.decode("utf-8", errors="replace"), list(b)

        if chat:
            content = []
            for e in entries:
                text, b = piece(e.token)
                content.append({"token": text, "logprob": e.logprob, "bytes": b,
                                "top_logprobs": [{"token": piece(t)[0], "logprob": lp, "bytes": piece(t)[1]}
                                                 for t, lp in e.top]})
            return {"content": content, "refusal": None}
        tokens, offsets = [], []
        for e in entries:
            tokens.append(piece(e.token)[0])
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{piece(t)[0]: lp for t, lp in e.top} for e in entries], "text_offset": offsets}

    def _record(endpoint: str, job: Job, out: Outcome, t0: float, t_first: float | None, first: bool = True) -> None:
        """Count a finished choice (``first``: the request's first choice to finish, which counts the request)."""
        if first:
            metrics.requests.labels(endpoint, out.finish_reason if out.finish_reason != "eos" else "stop").inc()
        if out.finish_reason == "cancelled":
            return
        now = time.perf_counter()
        if first:
            metrics.prompt_tokens.inc(len(job.prompt_ids))
        metrics.generation_tokens.inc(len(out.token_ids))
        if t_first is not None:
            metrics.ttft.observe(t_first - t0)
            if len(out.token_ids) > 1:
                metrics.tpot.observe((now - t_first) / (len(out.token_ids) - 1))
        metrics.e2e.observe(now - t0)
        if out.stats.num_rounds:
            metrics.request_tau.observe(out.stats.accepted_length_mean)

    async def _next_event(job: Job, request: Request | None):
        """The job's next event; for non-streaming requests, also checks (at most every 0.5 s, whether
        events arrive or not) that the client is still there (a streaming response is cancelled by
        Starlette when its client disconnects)."""
        if request is None:
            return await job.events.get()
        while True:
            now = time.monotonic()
            if now - job.checked >= 0.5:
                job.checked = now
                if await request.is_disconnected():
                    return ("disconnected", None)
            try:
                return await asyncio.wait_for(job.events.get(), 0.5)
            except asyncio.TimeoutError:
                pass

    async def _run(request: Request, body, ids: list, chat: bool, prompt_param: str):
        endpoint = request.url.path
        t0 = time.perf_counter()
        job = _job(request, body, ids, prompt_param)
        worker.submit(job)  # 429 / 503 raise here, before any response is started
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        obj = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(endpoint, job, rid, chat, include_usage, t0),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        outs: dict = {}
        t_first = None
        try:
            while len(outs) < job.n:
                kind, payload = await _next_event(job, request)
                if kind == "tokens":
                    t_first = t_first or time.perf_counter()
                elif kind == "error":
                    job.closed = True
                    metrics.requests.labels(endpoint, "error").inc()
                    return SafeJSONResponse(payload.body(), status_code=payload.status)
                elif kind == "done":
                    i, out = payload
                    _record(endpoint, job, out, t0, t_first, first=not outs)
                    outs[i] = out
                    if out.finish_reason == "cancelled":
                        job.closed = True
                        return SafeJSONResponse(error_body("the request was cancelled (the server is shutting down)",
                                                           "service_unavailable", code="cancelled"), status_code=503)
                elif kind == "disconnected":
                    return Response(status_code=499)
            job.closed = True
        finally:  # the client went away (or the handler was cancelled at shutdown)
            if not job.closed:
                job.closed = True
                worker.cancel(job)
                metrics.requests.labels(endpoint, "cancelled").inc()
        choices = []
        for i in range(job.n):
            out = outs[i]
            text = engine.completion_text(out.token_ids, out.finish_reason, job.stop)
            fr = _finish_reason(out.finish_reason)
            lps = _logprobs(out.logprobs, chat)
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lps,
                            "finish_reason": fr} if chat else
                           {"index": i, "text": text, "logprobs": lps, "finish_reason": fr})
        first = outs[0]
        return {"id": rid, "object": obj, "created": int(time.time()), "model": name, "choices": choices,
                "usage": _usage(len(job.prompt_ids), sum(len(o.token_ids) for o in outs.values()), first.stats),
                "dspark": _dspark_ext(first.stats)}

    async def _stream(endpoint: str, job: Job, rid: str, chat: bool, include_usage: bool, t0: float):
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(i: int, delta: str | None, finish=None, role=False, extra=None, lps=None) -> str:
            if chat:
                d = {}
                if role:
                    d["role"] = "assistant"
                if delta is not None:
                    d["content"] = delta
                c = {"index": i, "delta": d, "logprobs": lps, "finish_reason": finish}
            else:
                c = {"index": i, "text": delta or "", "logprobs": lps, "finish_reason": finish}
            o = {"id": rid, "object": obj, "created": created, "model": name, "choices": [c]}
            if extra:
                o.update(extra)
            return _sse(o)

        ids = [[] for _ in range(job.n)]
        sent = [""] * job.n
        offset = [0] * job.n  # completions' text_offset of the next token
        outs: dict = {}
        t_first = None
        try:
            if chat:
                for i in range(job.n):
                    yield chunk(i, "", role=True)
            while len(outs) < job.n:
                kind, payload = await _next_event(job, None)
                if kind == "tokens":
                    t_first = t_first or time.perf_counter()
                    i, new, entries = payload
                    ids[i] += new
                    text = engine.tokenizer.decode(ids[i])
                    text = text[:streamable_length(text, job.stop)]
                    delta = None
                    if len(text) > len(sent[i]) and text.startswith(sent[i]) and not text.endswith("\ufffd"):
                        delta = text[len(sent[i]):]
                        sent[i] = text
                    lps = _logprobs(entries, chat, offset[i])
                    if lps is not None and not chat:
                        offset[i] = lps["text_offset"][-1] + len(lps["tokens"][-1])
                    if delta is not None or lps is not None:
                        yield chunk(i, delta if delta is not None else ("" if lps is not None else None), lps=lps)
                elif kind == "error":
                    job.closed = True
                    metrics.requests.labels(endpoint, "error").inc()
                    yield _sse(payload.body(), ascii=True)
                    break
                elif kind == "done":
                    i, out = payload
                    _record(endpoint, job, out, t0, t_first, first=not outs)
                    outs[i] = out
                    text = engine.completion_text(out.token_ids, out.finish_reason, job.stop)
                    tail = text[len(sent[i]):] if text.startswith(sent[i]) else ""
                    if tail:
                        yield chunk(i, tail)
                    if out.finish_reason == "cancelled":
                        job.closed = True
                        yield _sse(error_body("the request was cancelled (the server is shutting down)",
                                              "service_unavailable", code="cancelled"))
                        break
                    yield chunk(i, None if chat else "", finish=_finish_reason(out.finish_reason),
                                extra={"dspark": _dspark_ext(out.stats)})
            else:
                job.closed = True
                if include_usage:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": name, "choices": [],
                                "usage": _usage(len(job.prompt_ids), sum(len(o.token_ids) for o in outs.values()),
                                                outs[0].stats)})
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the task is cancelled) or the server is stopping
            if not job.closed:
                job.closed = True
                worker.cancel(job)
                metrics.requests.labels(endpoint, "cancelled").inc()

    # -- routes

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        """Text completion of a raw prompt (OpenAI ``/v1/completions``)."""
        if isinstance(body.prompt, str):
            ids = _encode(body.prompt, True, "prompt")
        else:
            bad = [t for t in body.prompt if t >= vocab]
            if bad:
                raise APIError(400, f"prompt token id {bad[0]} is out of range (vocabulary of {vocab})",
                               param="prompt", code="invalid_token_id")
            ids = list(body.prompt)
        return await _run(request, body, ids, chat=False, prompt_param="prompt")

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """Chat completion (OpenAI ``/v1/chat/completions``), rendered with the engine's chat template."""
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true (the alternatives are listed beside each token's "
                                "log-probability); set logprobs to true or drop top_logprobs", param="top_logprobs")
        msgs = []
        for m in body.messages:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
            msgs.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        ids = _encode(msgs, False, "messages")
        return await _run(request, body, ids, chat=True, prompt_param="messages")

    @app.get("/v1/models")
    async def models():
        """The served model (OpenAI ``/v1/models``)."""
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "dspark", "max_model_len": ctx}]}

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health():
        """200 while the engine thread runs and accepts work, else 503."""
        snap = worker.snapshot
        if not worker.alive:
            return SafeJSONResponse(error_body("the engine is not running", "service_unavailable"), status_code=503)
        return {"status": "ok", "model": name, "active": snap["active"],
                "queued": max(0, snap["inflight"] - snap["active"]), "capacity": worker.capacity}

    @app.get("/metrics")
    async def prometheus_metrics():
        """Prometheus text exposition of the server and engine metrics."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
