"""The cost of one decoding round: :class:`CostTable` (measured wall time by the tokens a verifier pass computes) and
:func:`round_cost_table` (that table for a round of R requests at a context, from the manifest's cost table:
t_draft at R rows + t_verify(B)). Pure Python and numpy, no models."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from dspark_runtime.scheduling.cost_table import cost_table_at

__all__ = ["CostTable", "round_cost_table", "table_draft_seconds"]


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


def round_cost_table(table: Mapping[str, Any], rows: int, context: float | None = None,
                     draft_scale: float = 1.0) -> CostTable:
    """The per-round :class:`CostTable` for ``rows`` requests from a manifest ``cost_table`` dict: t_draft at that
    many rows (``draft_rows``/``t_draft_rows`` when profiled, else the single-row ``t_draft``) times
    ``draft_scale`` (another drafter's pass relative to the profiled one, >= 0) plus the verifier's t_verify(B), at
    ``context`` cached positions (the round's longest request; the table's context buckets interpolated by
    :func:`cost_table_at`; None or a table without buckets: the stored reference costs). Tables without the split
    use their stored ``seconds``. Pure function.

    Raises:
        ValueError: a malformed table or ``context`` (see :class:`CostTable` and ``cost_table_at``).
    """
    table = cost_table_at(table, context)
    if "t_verify" not in table:
        return CostTable.from_dict(table)
    t_draft = draft_scale * table_draft_seconds(table, rows)
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
