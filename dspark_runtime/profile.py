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


PROFILE_POINTS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 64)


def profile_runtime(engine, *, max_tokens: int = 8, context: int = 256, repeats: int = 5,
                    drafter: str | None = None, draft_rows=(1,)) -> dict:
    """Measure t_verify(B) at ``context`` cached positions for B in :data:`PROFILE_POINTS` up to
    ``max_tokens`` (the batched runtime verifies B = sum_r (1 + l_r) tokens of several requests in one packed
    pass: profile up to max_batch * (γ + 1)), and t_draft of the engine's drafter; for the DSpark drafter
    also t_draft at each row count of ``draft_rows`` (one graph call drafts a block for every request).
    Returns the JSON-safe cost table {"tokens", "seconds", "t_draft", "t_verify", "draft_rows",
    "t_draft_rows", ...}; ``seconds[i]`` = t_draft + t_verify(tokens[i]), wall seconds of a one-request round.
    """
    from dspark_runtime.sampling import SamplingParams

    target = engine.runner("target")
    rng = np.random.default_rng(0)
    vocab = engine.manifest.graphs["target"].spec.dims.vocab_size
    hi = min(vocab, 30000)
    prompt = rng.integers(0, hi, size=context).tolist()
    target.reset()
    target.prefill(prompt)
    t_verify = []
    points = [b for b in PROFILE_POINTS if b <= max_tokens]
    for b in points:
        toks = rng.integers(0, hi, size=b).tolist()
        times = []
        for r in range(repeats + 1):  # the first run is a warm-up
            t0 = time.perf_counter()
            target.step(toks)
            dt = time.perf_counter() - t0
            target.rollback(context)
            if r:
                times.append(dt)
        t_verify.append(statistics.median(times))
    kind = drafter or engine.draft_kind
    t_draft = 0.0
    if kind == "dspark":  # one row: the graph call over 8 new positions plus the heads, as in steady-state decoding
        t_draft = _time_dspark_rows(engine, 1, context, repeats, rng)
    elif kind == "lm":  # the draft LM's own draft length: its round drafts that many tokens, one step each
        t_draft = _time_lm_draft(engine, prompt, engine.default_draft_length, repeats, rng, hi)
    rows, t_rows = [], []
    if kind == "dspark":
        for r in sorted(set(int(x) for x in draft_rows)):
            rows.append(r)
            t_rows.append(_time_dspark_rows(engine, r, context, repeats, rng))
    target.reset()
    raw, t_verify = t_verify, monotone(t_verify)
    return {"tokens": points, "seconds": [t_draft + t for t in t_verify],
            "t_draft": t_draft, "t_verify": t_verify, "t_verify_raw": raw, "draft_rows": rows,
            "t_draft_rows": monotone(t_rows),
            "drafter": kind, "context": context, "repeats": repeats, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


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
    from dspark_runtime.sampling import SamplingParams

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


def _time_lm_draft(engine, prompt: list, gamma: int, repeats: int, rng, hi: int) -> float:
    """Median seconds of one draft-LM round for one request: ``gamma`` one-token steps after a cached ``prompt``."""
    runner = engine.runner(engine.lm_graph)
    runner.reset()
    runner.prefill(prompt)
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
    runner.reset()
    return statistics.median(times)
