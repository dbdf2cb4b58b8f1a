"""``dspark-export profile``: the cost table of a round on this machine, for the verify-length scheduler.

A speculative round costs the drafting pass (fixed: the DSpark block is drafted in full) plus one
verifier step over B = 1 + ℓ tokens, so SPS(B) = 1 / (t_draft + t_verify(B)) rounds per second
(DESIGN.md §1 step 4). ``profile_engine`` measures both on the engine at hand, after a warm-up, as
the median of ``repeats`` runs, at a given context length (the verifier's cost grows with the KV
cache), and stores the table in the manifest (``speculation.cost_table``). The table belongs to the
deployment machine: re-profile there (``dspark generate --profile-on-load`` does it at load).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np


def profile_runtime(engine, *, max_tokens: int = 8, context: int = 256, repeats: int = 5,
                    drafter: str | None = None) -> dict:
    """Measure t_verify(B) for B = 1..max_tokens at ``context`` cached positions and t_draft of the
    engine's drafter; returns the JSON-safe cost table {"tokens", "seconds", "t_draft", "t_verify", ...}.

    ``seconds[i]`` = t_draft + t_verify(tokens[i]), wall seconds of one whole round.
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
    for b in range(1, max_tokens + 1):
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
    if kind in ("dspark", "lm"):
        d = engine._drafter(kind)
        ctx = prompt + [int(rng.integers(0, hi))]
        times = []
        gamma = getattr(d, "block_size", max_tokens)
        for r in range(repeats + 1):
            d.begin(prompt)
            if kind == "dspark":
                d._ctx = context - 8  # only the last few positions are new, as in steady-state decoding
                d._kv = _full_ctx(d, context - 8)
            t0 = time.perf_counter()
            d.propose(ctx, gamma, SamplingParams(), rng)
            dt = time.perf_counter() - t0
            if r:
                times.append(dt)
        t_draft = statistics.median(times)
    target.reset()
    return {"tokens": list(range(1, max_tokens + 1)), "seconds": [t_draft + t for t in t_verify],
            "t_draft": t_draft, "t_verify": t_verify, "drafter": kind, "context": context, "repeats": repeats,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def _full_ctx(d, n: int) -> list:
    """A draft context cache of n positions (values irrelevant for timing)."""
    dims = d.graph.spec.dims
    z = np.zeros((1, dims.num_kv_heads, n, dims.head_dim), dtype=np.float32)
    return [(z, z) for _ in range(dims.num_layers)]


def profile_engine(engine_dir: Path, *, max_tokens: int = 8, context: int = 256, repeats: int = 5,
                   threads: int | None = None, write: bool = True) -> dict:
    """Profile ``engine_dir`` and (``write``) store the table as ``speculation.cost_table`` in its manifest."""
    from dspark_runtime.engine import DEFAULT_THREADS, Engine
    from dspark_runtime.manifest import load_manifest

    from dspark_runtime.sysinfo import machine_description

    eng = Engine.load(engine_dir, threads=threads or DEFAULT_THREADS)
    table = profile_runtime(eng, max_tokens=max_tokens, context=context, repeats=repeats)
    table["machine"] = machine_description()
    table["threads"] = threads or DEFAULT_THREADS
    if write:
        m = load_manifest(engine_dir, verify=False)
        m.speculation["cost_table"] = table
        m.write(Path(engine_dir))
    return table
