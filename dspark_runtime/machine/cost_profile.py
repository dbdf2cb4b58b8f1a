"""Profiling the round cost of an engine on the machine at hand: the cost table of the verify-length
scheduler (docs/design.md section 1 step 4; DSpark paper section 4, SPS(B) = 1 / (t_draft + t_verify(B))).

Lives in the runtime because the table belongs to the deployment machine: ``Engine.profile()`` and
``dspark generate --profile-on-load`` re-measure it at load; ``dspark-export profile`` stores it in the
manifest.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from dspark_runtime.decoding.sampling import SamplingParams
from dspark_runtime.errors import InputError
from dspark_runtime.runners.scatter import SLOT_STEP, ScatterSequence
from dspark_runtime.scheduling.cost_table import reference_bucket


PROFILE_POINTS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 64)
DEFAULT_CONTEXTS = (128, 512, 1024)  # `dspark-export profile`'s context buckets (those the engine's context holds)
MIN_CONTEXT = 8  # the DSpark drafting pass reads 8 new feature positions after context - 8 cached ones


def profile_contexts(context, *, limit: int | None = None, extra: int = 0, explicit: bool = True,
                     slot_step: int | None = None) -> list:
    """The sorted context buckets to profile: ``context`` (an int, or a sequence of ints: cached positions) checked
    against the engine's context ``limit`` (``max_position_embeddings``; None: unchecked) with ``extra`` more
    positions per pass (the largest verify pass or drafted block). With ``explicit`` False (a default list) the
    buckets that do not fit are dropped instead, keeping at least the smallest. ``slot_step``: the target's KV
    buffer grows in steps of this many slots and every pass reads all of them (the scatter layout), so two
    contexts in one step would time the same pass. Pure function.

    Raises:
        InputError: a context is not an integer >= :data:`MIN_CONTEXT`, appears twice, shares a ``slot_step``
            with another, or (explicit) does not fit ``limit``; naming it and the fix.
    """
    values = [context] if isinstance(context, int) else list(context)
    if not values:
        raise InputError("no context given: profile at least one cached-position count (e.g. --context 128,512,1024)")
    for c in values:
        if not isinstance(c, int) or isinstance(c, bool) or c < MIN_CONTEXT:
            raise InputError(f"profile contexts must be integers >= {MIN_CONTEXT} (cached positions), got {c!r}")
    if len(set(values)) != len(values):
        raise InputError(f"profile contexts must differ from each other, got {values}")
    values.sort()
    if slot_step:
        width = {}
        for c in values:
            w = -(-(c + 1) // slot_step) * slot_step
            if w in width:
                raise InputError(f"contexts {width[w]} and {c} both read {w} slots: this engine's scatter KV layout "
                                 f"grows its buffer in steps of {slot_step} positions and every pass reads all of "
                                 f"them; choose contexts in different steps (e.g. 128,512,1024)")
            width[w] = c
    if limit is not None:
        fits = [c for c in values if c + extra <= limit]
        if explicit and len(fits) < len(values):
            bad = [c for c in values if c not in fits]
            raise InputError(f"context {bad[0]} + {extra} positions per pass is beyond the engine's context "
                             f"({limit} positions, max_position_embeddings): profile contexts up to {limit - extra}")
        if not explicit:
            values = fits or values[:1]
            if values[0] + extra > limit:
                raise InputError(f"even context {values[0]} + {extra} positions per pass is beyond the engine's "
                                 f"context ({limit}); pass smaller contexts")
    return values


def engine_contexts(engine, context=None, *, max_tokens: int = 8, drafter: str | None = None) -> list:
    """:func:`profile_contexts` for ``engine``: ``context`` (None: :data:`DEFAULT_CONTEXTS`, dropping those beyond
    the engine's context) against the target's ``max_position_embeddings``, with room for the largest verify pass
    (``max_tokens``) and drafted block (of ``drafter``, default the engine's kind). Raises InputError as
    :func:`profile_contexts`."""
    kind = drafter or engine.draft_kind
    block = (engine.manifest.speculation.dspark.block_size if kind == "dspark" else engine.default_draft_length) or 0
    limit = engine.manifest.graphs["target"].model_config.get("max_position_embeddings")
    scatter = engine.manifest.graphs["target"].spec.kv_layout == "scatter" and engine.placement.get("target") != "trt"
    return profile_contexts(DEFAULT_CONTEXTS if context is None else context, limit=limit,
                            extra=max(max_tokens, block + 1), explicit=context is not None,
                            slot_step=SLOT_STEP if scatter else None)


def profile_runtime(engine, *, max_tokens: int = 8, context=256, repeats: int = 5,
                    drafter: str | None = None, draft_rows=(1,)) -> dict:
    """Measure t_verify(B) for B in :data:`PROFILE_POINTS` up to ``max_tokens`` (the batched runtime verifies
    B = sum_r (1 + l_r) tokens of several requests in one packed pass: profile up to max_batch * (γ + 1)) and
    t_draft of the engine's drafter (for the DSpark drafter also at each row count of ``draft_rows``: one graph
    call drafts a block for every request), at each context bucket of ``context``: an int or a sequence of ints,
    cached positions (:func:`profile_contexts`; None: :data:`DEFAULT_CONTEXTS`, those the engine's context holds).
    The target's cache grows from one bucket to the next (ascending), so each prompt position is prefilled once.

    Returns the JSON-safe cost table (:mod:`dspark_runtime.scheduling.cost_table` describes the form): ``buckets`` (one
    ``{"context", "attended", "t_verify", "t_verify_raw", "t_draft", "t_draft_rows"}`` per context, ascending;
    ``attended``: the positions the timed passes read, the runner's
    :meth:`~dspark_runtime.runners.sequence.BatchRunner.attended_positions` — on the scatter layout the slot buffer, which
    a fresh runner grows bucket by bucket — what the runtime looks the table up by) and, at the top
    level, the reference bucket's (:func:`~dspark_runtime.scheduling.cost_table.reference_bucket`: the middle one) ``context``,
    ``t_verify``, ``t_verify_raw``, ``t_draft``, ``t_draft_rows`` and ``seconds[i]`` = t_draft + t_verify(tokens[i])
    (wall seconds of a one-request round), plus "tokens", "draft_rows", "drafter", "repeats", "date". t_verify is
    the monotone fit (:func:`monotone`) of the raw medians in B at each context.

    Raises:
        InputError: bad contexts, or one that does not fit the engine's context (:func:`profile_contexts`).
    """
    target = _fresh(engine.runner("target"))
    rng = np.random.default_rng(0)
    vocab = engine.manifest.graphs["target"].spec.dims.vocab_size
    hi = min(vocab, 30000)
    kind = drafter or engine.draft_kind
    contexts = engine_contexts(engine, context, max_tokens=max_tokens, drafter=kind)
    prompt = rng.integers(0, hi, size=contexts[-1]).tolist()
    points = [b for b in PROFILE_POINTS if b <= max_tokens]
    rows = sorted(set(int(x) for x in draft_rows)) if kind == "dspark" else []
    lm = _fresh(engine.runner(engine.lm_graph)) if kind == "lm" else None
    target.reset()
    if lm is not None:
        lm.reset()
    buckets = []
    for ctx in contexts:  # ascending: each bucket's cache extends the previous one's
        target.prefill(prompt[target.length:ctx])
        timed = [_time_verify(target, rng.integers(0, hi, size=b).tolist(), ctx, repeats) for b in points]
        raw, attended = [t for t, _ in timed], max(a for _, a in timed)
        t_draft, t_rows = 0.0, []
        if kind == "dspark":  # one row: the graph call over 8 new positions plus the heads, as in steady-state decoding
            t_draft = _time_dspark_rows(engine, 1, ctx, repeats, rng)
            t_rows = monotone([_time_dspark_rows(engine, r, ctx, repeats, rng) for r in rows])
        elif kind == "lm":  # the draft LM's own draft length: its round drafts that many tokens, one step each
            lm.prefill(prompt[lm.length:ctx])
            t_draft = _time_lm_draft(lm, engine.default_draft_length, repeats, rng, hi)
        buckets.append({"context": ctx, "attended": attended, "t_verify": monotone(raw), "t_verify_raw": raw,
                        "t_draft": t_draft, "t_draft_rows": t_rows})
    target.reset()
    if lm is not None:
        lm.reset()
    ref = buckets[reference_bucket(contexts)]
    return {"tokens": points, "seconds": [ref["t_draft"] + t for t in ref["t_verify"]],
            "t_draft": ref["t_draft"], "t_verify": ref["t_verify"], "t_verify_raw": ref["t_verify_raw"],
            "draft_rows": rows, "t_draft_rows": ref["t_draft_rows"], "drafter": kind, "context": ref["context"],
            "buckets": buckets, "repeats": repeats, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def _fresh(runner):
    """A new one-sequence runner over ``runner``'s graph when ``runner`` keeps a slot buffer that never shrinks (the
    scatter layout's :class:`~dspark_runtime.runners.scatter.ScatterSequence`, possibly grown by earlier, longer sequences), so
    each context bucket reads its own width; ``runner`` itself otherwise."""
    if isinstance(runner, ScatterSequence):
        fresh = ScatterSequence(runner.backend, row_multiple=runner.row_multiple)
        fresh.head_skips_padding = runner.head_skips_padding
        fresh.prompt_backend = runner.prompt_backend
        return fresh
    return runner


def _time_verify(target, toks: list, context: int, repeats: int) -> tuple:
    """(median seconds of one verifier step of ``target`` (a
    :class:`~dspark_runtime.runners.base.SequenceDecoder`) over ``toks`` after ``context`` cached positions, the
    positions the step read: its ``attended_positions()``). The first of ``repeats + 1`` runs is a warm-up; each run
    is rolled back."""
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        target.step(toks)
        dt = time.perf_counter() - t0
        target.rollback(context)
        if r:
            times.append(dt)
    return statistics.median(times), target.attended_positions()


def monotone(values) -> list:
    """The least-squares non-decreasing fit of ``values`` (pool-adjacent-violators isotonic regression).

    Verifying more tokens does the same work plus more, so a measured t_verify(B) that falls with B is timing
    noise (another process, frequency changes); left in, it makes the scheduler treat the extra tokens as free.
    The raw medians are kept beside the fit (``t_verify_raw``)."""
    blocks = []  # [mean, weight]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2 = blocks.pop()
            m1, w1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return [m for m, w in blocks for _ in range(w)]


def _time_dspark_rows(engine, rows: int, context: int, repeats: int, rng) -> float:
    """Median seconds of one batched DSpark drafting pass for ``rows`` requests in steady state: each row adds
    8 new target-feature positions to a context of ``context - 8`` and drafts a full block (graph call plus
    the numpy heads of every row)."""
    graph = engine.graph_backend(engine.dspark_graph)
    heads = engine.dspark_heads()
    dims = graph.spec.dims
    g = graph.block_size
    fdim = graph.spec.inputs[0].shape[-1]
    past = context - 8
    kv = [(np.zeros((rows, dims.num_kv_heads, past, dims.head_dim), np.float32),) * 2 for _ in range(dims.num_layers)]
    feats = rng.standard_normal((rows, 8, fdim)).astype(np.float32)
    fpos = np.tile(np.arange(past, context, dtype=np.int64), (rows, 1))
    bpos = np.tile(np.arange(context, context + g, dtype=np.int64), (rows, 1))
    anchors = np.full((rows, 1), 1, dtype=np.int64)
    mask = np.ones((rows, 1, g, context + g), dtype=bool)
    times = []
    params = SamplingParams()
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        hidden, base, _ = graph.run(feats, fpos, anchors, bpos, mask, kv)
        for i in range(rows):
            heads.draft(base[i], hidden[i], 1, g, params, rng)
        dt = time.perf_counter() - t0
        if r:
            times.append(dt)
    return statistics.median(times)


def _time_lm_draft(runner, gamma: int, repeats: int, rng, hi: int) -> float:
    """Median seconds of one draft-LM round for one request: ``gamma`` one-token steps after the positions
    ``runner`` (the draft LM's one-sequence runner) holds; rolled back after each run."""
    n0 = runner.length
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(gamma):
            runner.step([int(rng.integers(0, hi))])
        dt = time.perf_counter() - t0
        runner.rollback(n0)
        if r:
            times.append(dt)
    return statistics.median(times)
