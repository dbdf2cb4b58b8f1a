"""The manifest's round cost table as stored: its validation (:func:`check_cost_table`) and its context buckets
(:func:`cost_table_at`: the table at a round's cached positions, interpolated). Pure Python, no numpy, so reading
and checking a manifest stays cheap; the cost of one round from it is :mod:`dspark_runtime.scheduling.round_cost`.

The manifest's ``speculation.cost_table`` (``dspark-export profile``) times a verifier pass of ``B`` tokens
(``tokens``, ``t_verify``) and the drafting pass (``t_draft``, ``draft_rows`` / ``t_draft_rows``) at several context
lengths, one bucket each; its top-level lists repeat the reference bucket, so a reader that knows nothing of buckets
sees a complete one-context table. Every consumer (the scheduler, the skip rule, the router, the prefill budget)
reads the table resolved at the round's attended positions (the runner's ``attended_positions``).
"""
from __future__ import annotations

import bisect
import math
from typing import Any, Mapping

__all__ = ["BUCKET_KEYS", "check_cost_table", "cost_table_at", "reference_bucket"]

# per-bucket timings (seconds); "context" is the bucket's cached-position count
BUCKET_KEYS = ("t_verify", "t_verify_raw", "t_draft", "t_draft_rows")
_FIX = "re-run `dspark-export profile` on the engine"


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _times(name: str, v, n: int, positive: bool) -> None:
    """Raise ValueError unless ``v`` is a list of ``n`` finite numbers (> 0 when ``positive``, else >= 0)."""
    if not isinstance(v, (list, tuple)) or len(v) != n:
        got = f"{len(v)} values" if isinstance(v, (list, tuple)) else repr(v)
        raise ValueError(f"cost_table.{name} must be a list of {n} times in seconds (one per entry of the table's "
                         f"sizes), got {got}; {_FIX}")
    for x in v:
        if not _is_number(x) or x < 0 or (positive and x == 0):
            raise ValueError(f"cost_table.{name} must hold {'positive' if positive else 'non-negative'} finite "
                             f"seconds, got {x!r}; {_FIX}")


def check_cost_table(table: Mapping[str, Any]) -> None:
    """Validate the context buckets of a manifest ``cost_table`` dict. Tables without ``buckets`` pass unchecked
    (their ``tokens`` / ``seconds`` are checked where used, by :class:`CostTable`).

    The form: ``{"tokens": [1, ..., 64], "t_verify": [...], "t_draft": s, "t_draft_rows": [...], "seconds": [...],
    "context": 512, "buckets": [{"context": 128, "attended": 256, "t_verify": [...], "t_verify_raw": [...],
    "t_draft": s, "t_draft_rows": [...]}, ...]}``: the top level repeats the reference bucket; a bucket's
    ``attended`` (where profiled) is the positions its timed passes read (the scatter layout reads its whole slot
    buffer), and buckets are looked up by it, else by ``context``. A table without ``buckets`` is one bucket.

    A table with buckets needs ``tokens`` (positive ints, strictly ascending) and ``buckets``: a non-empty list of
    objects with ``context`` (cached positions, int >= 0, strictly ascending across buckets), ``t_verify`` (one
    positive time per entry of ``tokens``), ``t_draft`` (seconds >= 0) and, when the table has ``draft_rows``,
    ``t_draft_rows`` (one time >= 0 per entry); ``t_verify_raw``, when present, like ``t_verify``; ``attended``
    in every bucket or none (int >= context, strictly ascending).

    Raises:
        ValueError: naming the entry (``cost_table.buckets[1].t_verify``), what it must be, and the fix.
    """
    if not isinstance(table, Mapping):
        raise ValueError(f"cost_table must be an object, got {type(table).__name__}; {_FIX}")
    buckets = table.get("buckets")
    if buckets is None:
        return
    tokens = table.get("tokens")
    if (not isinstance(tokens, (list, tuple)) or not tokens
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tokens)
            or any(b <= a for a, b in zip(tokens, tokens[1:]))):
        raise ValueError(f"cost_table.tokens must be a non-empty list of ascending positive integers (verify pass "
                         f"sizes), got {tokens!r}; {_FIX}")
    if not isinstance(buckets, (list, tuple)) or not buckets:
        raise ValueError(f"cost_table.buckets must be a non-empty list of per-context timings, got {buckets!r}; "
                         f"{_FIX}")
    rows = table.get("draft_rows") or []
    prev = prev_read = None
    with_read = sum(isinstance(b, Mapping) and "attended" in b for b in buckets)
    if with_read not in (0, len(buckets)):
        raise ValueError(f"cost_table.buckets: {with_read} of {len(buckets)} buckets have 'attended'; every bucket "
                         f"needs it or none; {_FIX}")
    for i, b in enumerate(buckets):
        where = f"buckets[{i}]"
        if not isinstance(b, Mapping):
            raise ValueError(f"cost_table.{where} must be an object {{\"context\", \"t_verify\", \"t_draft\", ...}}, "
                             f"got {b!r}; {_FIX}")
        c = b.get("context")
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            raise ValueError(f"cost_table.{where}.context must be a number of cached positions (int >= 0), "
                             f"got {c!r}; {_FIX}")
        if prev is not None and c <= prev:
            raise ValueError(f"cost_table.buckets must be in strictly ascending context, got {prev} then {c}; {_FIX}")
        prev = c
        if with_read:
            a = b["attended"]
            if not isinstance(a, int) or isinstance(a, bool) or a < c:
                raise ValueError(f"cost_table.{where}.attended must be the positions the timed passes read, an int "
                                 f">= its context {c}, got {a!r}; {_FIX}")
            if prev_read is not None and a <= prev_read:
                raise ValueError(f"cost_table.buckets must read strictly ascending positions ('attended'), got "
                                 f"{prev_read} then {a}; {_FIX}")
            prev_read = a
        _times(f"{where}.t_verify", b.get("t_verify"), len(tokens), positive=True)
        if "t_verify_raw" in b:
            _times(f"{where}.t_verify_raw", b["t_verify_raw"], len(tokens), positive=True)
        if not _is_number(b.get("t_draft")) or b["t_draft"] < 0:
            raise ValueError(f"cost_table.{where}.t_draft must be seconds >= 0, got {b.get('t_draft')!r}; {_FIX}")
        if rows:
            _times(f"{where}.t_draft_rows", b.get("t_draft_rows"), len(rows), positive=False)


def reference_bucket(contexts) -> int:
    """Index of the bucket whose costs the table's top-level lists repeat: the middle one (``len // 2``: 512 of
    128, 512, 1024). Raises ValueError for an empty list."""
    n = len(contexts)
    if not n:
        raise ValueError("no contexts: profile at least one context length")
    return n // 2


def cost_table_at(table: Mapping[str, Any] | None, context: float | None) -> Mapping[str, Any] | None:
    """The cost table at ``context`` cached positions, in the one-context form every consumer reads.

    Args:
        table: a manifest ``cost_table`` dict (with or without ``buckets``) or None.
        context: cached positions the round's pass reads (its runner's ``attended_positions``), a finite
            number >= 0, compared with each bucket's ``attended`` (else its ``context``); None: the table as
            stored (its reference bucket).
    Returns:
        ``table`` itself when it is None, has no ``buckets`` or ``context`` is None; otherwise a new dict: the
        table's other keys plus ``t_verify``, ``t_draft``, ``t_draft_rows`` (when profiled) and ``seconds`` =
        ``t_draft + t_verify`` interpolated in context (linear between neighbouring buckets, the first bucket's
        below it, extrapolated along the last two above the last, never below it: attention work grows linearly
        with the positions read) and
        ``context``; without ``buckets`` / ``t_verify_raw`` (the result is flat in context).
    Raises:
        ValueError: ``context`` is not a finite number >= 0, or the buckets' lists disagree in length with each
            other or with ``tokens`` (:func:`check_cost_table`, which the manifest reader runs, names every other
            malformed entry).
    """
    if table is None or context is None or not table.get("buckets"):
        return table
    try:
        c = float(context)
    except (TypeError, ValueError):
        raise ValueError(f"context must be a number of cached positions, got {context!r}") from None
    if not math.isfinite(c) or c < 0:
        raise ValueError(f"context must be a finite number of cached positions >= 0, got {context!r}")
    buckets = table["buckets"]
    ctxs = [b.get("attended", b["context"]) for b in buckets]
    if len(buckets) == 1 or c <= ctxs[0]:
        lo = hi = 0
        w, extrapolate = 0.0, False
    elif c >= ctxs[-1]:
        lo, hi = len(buckets) - 2, len(buckets) - 1
        w, extrapolate = (c - ctxs[lo]) / (ctxs[hi] - ctxs[lo]), True
    else:
        hi = bisect.bisect_right(ctxs, c)
        lo = hi - 1
        w, extrapolate = (c - ctxs[lo]) / (ctxs[hi] - ctxs[lo]), False

    def mix(key: str, fallback=None):
        a, b = buckets[lo].get(key, fallback), buckets[hi].get(key, fallback)
        if a is None or b is None:
            return None
        if isinstance(a, (list, tuple)):
            if len(a) != len(b):
                raise ValueError(f"cost_table.buckets disagree on the length of {key} ({len(a)} and {len(b)}); {_FIX}")
            return [_mix1(x, y, w, extrapolate) for x, y in zip(a, b)]
        return _mix1(a, b, w, extrapolate)

    out = {k: v for k, v in table.items() if k not in ("buckets", "t_verify_raw")}
    t_verify = mix("t_verify")
    if t_verify is None or len(t_verify) != len(table.get("tokens") or ()):
        raise ValueError(f"cost_table.buckets need one t_verify per entry of tokens; {_FIX}")
    t_draft = mix("t_draft", table.get("t_draft", 0.0))
    out["t_verify"] = t_verify
    out["t_draft"] = t_draft
    rows = mix("t_draft_rows", table.get("t_draft_rows"))
    if rows is not None:
        out["t_draft_rows"] = rows
    out["seconds"] = [t_draft + t for t in t_verify]
    out["context"] = c
    return out


def _mix1(a: float, b: float, w: float, extrapolate: bool) -> float:
    """``a + w (b - a)``; when extrapolating past ``b``, never below ``b`` (a cost that fell with context is noise)."""
    v = float(a) + w * (float(b) - float(a))
    return max(v, float(b)) if extrapolate else v
