"""The round cost table: what a decoding round costs by the tokens its verifier pass computes (:class:`CostTable`, and
:func:`round_cost_table` for a round of R requests) and by the cached positions it attends over (context buckets,
:func:`cost_table_at`, validated by :func:`check_cost_table`). Pure Python and numpy, no models.

The manifest's ``speculation.cost_table`` (``dspark-export profile``) times a verifier pass of ``B`` tokens
(``tokens``, ``t_verify``) and the drafting pass (``t_draft``, ``draft_rows`` / ``t_draft_rows``) at several context
lengths, one bucket each; its top-level lists repeat the reference bucket, so a reader that knows nothing of buckets
sees a complete one-context table. Every consumer (the scheduler, the skip rule, the router, the prefill budget)
reads the table resolved at the round's attended positions (the runner's ``attended_positions``).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["BUCKET_KEYS", "CostTable", "check_cost_table", "cost_table_at", "reference_bucket", "round_cost_table",
           "table_draft_seconds"]

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


@dataclass(frozen=True)
class CostTable:
    """Measured wall time of one whole decoding round as a function of verify batch size.

    Attributes:
        tokens: verify batch sizes ``B`` (number of tokens the target verifies in one round,
            summed over requests), positive ints, strictly ascending; profiling starts at 1.
        seconds: wall-clock seconds of one whole round at the matching ``B``: drafting (fixed
            per round, the block is always drafted in full) plus verifying ``B`` tokens, i.e.
            ``t_draft + t_verify(B)``. Positive, finite floats, same length as ``tokens``.

    Stored as tuples (the dataclass is frozen and hashable); lists are accepted and converted.
    JSON form for the manifest: ``{"tokens": [...], "seconds": [...]}`` (see :meth:`to_dict`).

    Raises:
        ValueError: the table is empty, the lengths differ, a token count is not a positive
            integer or the counts are not strictly ascending, or a time is not a positive
            finite number. The message names the field and the fix.
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        try:
            tokens_in = list(self.tokens)
            seconds_in = list(self.seconds)
        except TypeError as exc:
            raise ValueError(
                "cost table 'tokens' and 'seconds' must be sequences of numbers "
                f"(got {type(self.tokens).__name__}, {type(self.seconds).__name__})"
            ) from exc
        if not tokens_in:
            raise ValueError(
                "cost table 'tokens' is empty: profile at least one verify batch size (B = 1)"
            )
        if len(tokens_in) != len(seconds_in):
            raise ValueError(
                f"cost table 'tokens' has {len(tokens_in)} entries but 'seconds' has "
                f"{len(seconds_in)}: give one round time per verify batch size"
            )
        tokens: list[int] = []
        for t in tokens_in:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer, float, np.floating)):
                raise ValueError(f"cost table 'tokens' must hold integers, got {t!r}")
            if not float(t).is_integer() or t < 1:
                raise ValueError(
                    f"cost table 'tokens' must hold positive integers (verify batch sizes), "
                    f"got {t!r}"
                )
            tokens.append(int(t))
        for prev, cur in zip(tokens, tokens[1:]):
            if cur <= prev:
                raise ValueError(
                    f"cost table 'tokens' must be strictly ascending, got {prev} then {cur}: "
                    "sort the measurements by batch size and merge duplicates"
                )
        seconds: list[float] = []
        for s in seconds_in:
            if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer, float, np.floating)):
                raise ValueError(f"cost table 'seconds' must hold numbers, got {s!r}")
            if not math.isfinite(float(s)) or s <= 0:
                raise ValueError(
                    f"cost table 'seconds' must be positive finite round times in seconds, "
                    f"got {s!r}: re-profile the engine"
                )
            seconds.append(float(s))
        object.__setattr__(self, "tokens", tuple(tokens))
        object.__setattr__(self, "seconds", tuple(seconds))

    # -- queries

    def round_seconds(self, batch_tokens: float) -> float:
        """Estimated wall seconds of one round that verifies ``batch_tokens`` tokens.

        Piecewise-linear interpolation between the measured points; flat (the first point's
        time) below the first point; above the last point, linear extrapolation along the last
        two points, but never below the last measured time (a falling last segment, i.e.
        measurement noise, extrapolates flat). A one-point table is flat everywhere.

        Args:
            batch_tokens: verify batch size ``B`` (tokens), a finite number ``>= 1``.

        Returns:
            seconds (float, > 0).

        Raises:
            ValueError: ``batch_tokens`` is not a finite number ``>= 1``.
        """
        b = _check_batch(batch_tokens)
        t, s = self.tokens, self.seconds
        if b <= t[0]:
            return s[0]
        if b >= t[-1]:
            if len(t) == 1:
                return s[-1]
            slope = (s[-1] - s[-2]) / (t[-1] - t[-2])
            return max(s[-1], s[-1] + slope * (b - t[-1]))
        return float(np.interp(b, t, s))

    def sps(self, batch_tokens: float) -> float:
        """Rounds per second at verify batch size ``B``: ``1 / round_seconds(B)``.

        Raises:
            ValueError: as :meth:`round_seconds`.
        """
        return 1.0 / self.round_seconds(batch_tokens)

    # -- manifest form

    def to_dict(self) -> dict[str, list]:
        """JSON-safe form ``{"tokens": [int, ...], "seconds": [float, ...]}``."""
        return {"tokens": [int(t) for t in self.tokens], "seconds": [float(s) for s in self.seconds]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CostTable":
        """Build from the manifest form written by :meth:`to_dict` (extra keys are ignored).

        Raises:
            ValueError: ``data`` is not a mapping, lacks ``tokens`` or ``seconds``, or the
                values fail the checks of the constructor.
        """
        if not isinstance(data, Mapping):
            raise ValueError(
                f"cost table must be an object {{'tokens': [...], 'seconds': [...]}}, "
                f"got {type(data).__name__}"
            )
        for key in ("tokens", "seconds"):
            if key not in data:
                raise ValueError(
                    f"cost table is missing '{key}': expected {{'tokens': [...], 'seconds': [...]}}"
                )
            if isinstance(data[key], (str, bytes)) or not isinstance(data[key], Sequence):
                raise ValueError(f"cost table '{key}' must be a list, got {type(data[key]).__name__}")
        return cls(tokens=tuple(data["tokens"]), seconds=tuple(data["seconds"]))


def round_cost_table(table: Mapping[str, Any], rows: int, context: float | None = None) -> CostTable:
    """The per-round :class:`CostTable` for ``rows`` requests from a manifest ``cost_table`` dict: t_draft at that
    many rows (``draft_rows``/``t_draft_rows`` when profiled, else the single-row ``t_draft``) plus the
    verifier's t_verify(B), at ``context`` cached positions (the round's longest request; the table's context
    buckets interpolated by :func:`cost_table_at`; None or a table without buckets:
    the stored reference costs). Tables without the split use their stored ``seconds``. Pure function.

    Raises:
        ValueError: a malformed table or ``context`` (see :class:`CostTable` and ``cost_table_at``).
    """
    table = cost_table_at(table, context)
    if "t_verify" not in table:
        return CostTable.from_dict(table)
    t_draft = table_draft_seconds(table, rows)
    return CostTable(tuple(table["tokens"]), tuple(t_draft + t for t in table["t_verify"]))


def table_draft_seconds(table: Mapping[str, Any], rows: int) -> float:
    """The profiled drafting pass over ``rows`` requests, seconds, from a cost table at one context: ``t_draft_rows``
    interpolated over ``draft_rows`` (clamped at the ends) when profiled, else the single-row ``t_draft`` (0 without
    one). Pure function."""
    if table.get("draft_rows") and table.get("t_draft_rows"):
        return float(np.interp(rows, table["draft_rows"], table["t_draft_rows"]))
    return float(table.get("t_draft", 0.0))


def _check_batch(batch_tokens: float) -> float:
    try:
        b = float(batch_tokens)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"batch_tokens must be a number >= 1, got {batch_tokens!r}") from exc
    if not math.isfinite(b) or b < 1:
        raise ValueError(f"batch_tokens must be a finite number >= 1, got {batch_tokens!r}")
    return b
