"""What speculation is worth on a profiled engine: one request's expected speedup over target-only decoding for given
prefix survivals (:func:`speedup`), and the acceptance a drafter needs for a given speedup (:func:`needed_alpha`).
Pure numpy over a manifest ``cost_table``.

The model: one request, the verify length chosen per round as Algorithm 1 does for one request
(:func:`~dspark_runtime.scheduling.verify_length.expected_throughput` over
:func:`~dspark_runtime.scheduling.round_cost.round_cost_table`): a round costs the drafting pass plus the target's pass
over 1 + l tokens and commits 1 + a_1 + ... + a_l tokens in expectation; target-only decoding costs one pass over one
token per token. :func:`needed_alpha` takes geometric survivals a_j = α^j (α: the acceptance of each draft given
the ones before it).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from dspark_runtime.scheduling.cost_table import cost_table_at
from dspark_runtime.scheduling.round_cost import round_cost_table, table_draft_seconds
from dspark_runtime.scheduling.verify_length import expected_throughput


def drafting_seconds(table: Mapping[str, Any], context: float | None) -> float:
    """The profiled drafting pass of one request (seconds) at ``context`` cached positions."""
    return table_draft_seconds(cost_table_at(table, context), 1)


def speedup(table: Mapping[str, Any], survival: Sequence[float], context: float | None = None,
            t_draft_s: float | None = None) -> tuple[int, float]:
    """(best verify length l >= 1, expected tokens/s at l over target-only tokens/s) for one request with prefix
    survivals ``survival`` [γ] (non-increasing, in [0, 1]) on the cost table ``table`` (with ``t_verify``) at
    ``context`` cached positions; the drafting pass is the profiled one, or ``t_draft_s`` seconds (another drafter's).

    Raises:
        ValueError: ``table`` has no ``t_verify`` (profile the engine), or ``survival`` is empty or invalid.
    """
    at = cost_table_at(table, context)
    if not at or "t_verify" not in at:
        raise ValueError("the cost table has no t_verify: run `dspark-export profile ENGINE` first")
    a = np.asarray(survival, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"survival must be a non-empty 1-D list of prefix survivals, got shape {a.shape}")
    profiled = table_draft_seconds(at, 1)
    scale = 1.0 if t_draft_s is None else t_draft_s / max(profiled, 1e-12)
    cost = round_cost_table(table, rows=1, context=context, draft_scale=scale)
    rates = [expected_throughput([a], [l], cost) for l in range(1, a.size + 1)]
    best = int(np.argmax(rates))
    return best + 1, rates[best] * at["t_verify"][0]


def needed_alpha(table: Mapping[str, Any], target: float, context: float | None = None,
                 t_draft_s: float | None = None, gamma: int = 7) -> float | None:
    """The least per-position acceptance α (survivals α^j, j = 1..``gamma``) at which :func:`speedup` reaches
    ``target`` × target-only; None when even α = 1 does not. Bisection to 1e-4.

    Raises:
        ValueError: as :func:`speedup`.
    """
    def gain(alpha: float) -> float:
        return speedup(table, alpha ** np.arange(1, gamma + 1), context, t_draft_s)[1]

    if gain(1.0) < target:
        return None
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gain(mid) < target else (lo, mid)
    return hi


def tau_fixed(alpha: float, gamma: int = 7) -> float:
    """Expected accepted length τ (bonus token included) of a full block of ``gamma`` drafts at survivals α^j."""
    return float(1.0 + sum(alpha ** j for j in range(1, gamma + 1)))
