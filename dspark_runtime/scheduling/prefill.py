"""Chunked prefill: which prompt tokens of joining requests ride in a decoding round (pure logic, no models). A
joining request's prompt is fed a chunk per round beside the verify blocks of the requests already decoding, so no
round stalls for a whole prompt. :func:`prefill_budget`: prompt tokens per round while others decode, from the
profiled cost table (the largest pass costing at most :data:`PREFILL_STALL` one-token passes); with no request
decoding a round feeds up to the runner's ``max_chunk``. :func:`plan_prefill`: each prompt's chunk (first come,
first served) and whether the chunks ride in the verify pass or in a second call, whichever computes fewer rows
(the runner's ``pass_rows``: on the scatter layout a long chunk beside short verify blocks pads every row).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from dspark_runtime.errors import InputError

DEFAULT_PREFILL_BUDGET = 64  # prompt tokens per round while others decode, when the engine has no cost table
PREFILL_STALL = 16.0  # auto budget: a pass carrying prompt tokens may cost this many one-token passes
MIN_PREFILL_BUDGET = 8  # the auto budget never goes below this (a prompt must progress every round)


def prefill_budget(cost_table: Mapping | None, *, stall: float | None = None, max_chunk: int = 256) -> int:
    """Prompt tokens per round while other requests decode, from an engine's cost table.

    Args:
        cost_table: the manifest's ``speculation.cost_table`` dict (``tokens``: tokens in a pass, ascending ints;
            ``t_verify``: seconds of the verifier pass at each, or only ``seconds``: whole-round seconds), or None.
        stall: how many one-token passes a pass carrying prompt tokens may cost (> 1; None: :data:`PREFILL_STALL`).
        max_chunk: the most prompt tokens a call takes (the runner's ``max_chunk``).
    Returns:
        int in [MIN_PREFILL_BUDGET, max_chunk] (max_chunk when it is smaller): the largest pass size ``B`` with
        ``t(B) <= stall * t(tokens[0])``; past the last profiled size ``t`` is extended along the table's mean
        slope ``(t_last - t_first) / (B_last - B_first)`` (a flat tail, which the profiler's monotone fit
        produces from noise, would otherwise make every size look free). :data:`DEFAULT_PREFILL_BUDGET` (capped
        at ``max_chunk``) without a table or with a one-point or flat table.
    Raises InputError for ``stall <= 1`` or a table whose lists are missing or of different lengths.
    """
    stall = PREFILL_STALL if stall is None else stall
    if not (isinstance(stall, (int, float)) and stall > 1):
        raise InputError(f"the prefill stall factor must be a number > 1, got {stall!r}")
    if not cost_table:
        return min(DEFAULT_PREFILL_BUDGET, max_chunk)
    tokens = cost_table.get("tokens")
    times = cost_table.get("t_verify") or cost_table.get("seconds")
    if not tokens or not times or len(tokens) != len(times):
        raise InputError("the cost table needs 'tokens' and 't_verify' (or 'seconds') lists of the same length; "
                         "re-run `dspark-export profile` on the engine")
    limit = stall * float(times[0])
    fits = [int(b) for b, t in zip(tokens, times) if float(t) <= limit]
    best = max(fits) if fits else int(tokens[0])
    if best == int(tokens[-1]) and len(tokens) > 1:  # the whole table fits: extend it along its mean slope
        slope = (float(times[-1]) - float(times[0])) / (int(tokens[-1]) - int(tokens[0]))
        if slope <= 0:
            return min(DEFAULT_PREFILL_BUDGET, max_chunk)
        best = int(tokens[0]) + int(math.floor((limit - float(times[0])) / slope))
    return min(max_chunk, max(MIN_PREFILL_BUDGET, best))


@dataclass(frozen=True)
class PrefillPlan:
    """One round's prompt work.

    chunks: prompt tokens fed this round to each prefilling request, in the order given (FIFO), ints >= 0 (0: it
        waits this round); merged: the chunks ride in the verify pass (True) or go in a second call after it.
    """

    chunks: tuple
    merged: bool

    @property
    def tokens(self) -> int:
        """Prompt tokens fed this round."""
        return sum(self.chunks)


def plan_prefill(remaining: Sequence[int], decode_lengths: Sequence[int], *, budget: int, max_chunk: int,
                 pass_rows: Callable[[list], int]) -> PrefillPlan:
    """Plan one round's prompt chunks. Pure function.

    Args:
        remaining: prompt tokens still to feed per prefilling request, oldest first (ints >= 0).
        decode_lengths: tokens of each decoding request's verify block this round (``1 + l_r``; empty when no
            request decodes).
        budget: prompt tokens per round while requests decode (:func:`prefill_budget`); ignored when none decodes.
        max_chunk: the most prompt tokens one call may carry (the runner's ``max_chunk``).
        pass_rows: rows a graph call over segments of the given lengths computes (``BatchRunner.pass_rows``),
            non-decreasing in each length.
    Returns:
        :class:`PrefillPlan`. The prompt call's rows stay within those of one chunk of the allowance
        (``budget`` while requests decode, else ``max_chunk``): oldest prompt first, each later one gets the
        longest chunk that still fits (none when even one token does not).
    Raises InputError for a budget or max_chunk below 1 or a negative remaining count.
    """
    if budget < 1 or max_chunk < 1:
        raise InputError(f"the prefill budget and chunk must be >= 1 token, got budget={budget!r}, "
                         f"max_chunk={max_chunk!r}")
    if any(m < 0 for m in remaining):
        raise InputError(f"remaining prompt tokens must be >= 0, got {list(remaining)}")
    allowance = min(budget, max_chunk) if decode_lengths else max_chunk
    cap = pass_rows([allowance])
    chunks, chosen = [], []
    for m in remaining:
        c = _longest_fit(chosen, min(m, allowance), cap, pass_rows) if m else 0
        chunks.append(c)
        if c:
            chosen.append(c)
    merged = True
    if decode_lengths and chosen:
        dec = list(decode_lengths)
        merged = pass_rows(dec + chosen) <= pass_rows(dec) + pass_rows(chosen)
    return PrefillPlan(tuple(chunks), merged)


def _longest_fit(chosen: list, most: int, cap: int, pass_rows: Callable[[list], int]) -> int:
    """The largest c in [1, most] with pass_rows(chosen + [c]) <= cap, or 0 (binary search: rows grow with c)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pass_rows(chosen + [mid]) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo
