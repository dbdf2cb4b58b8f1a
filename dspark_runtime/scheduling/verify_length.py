"""Verify-length scheduling: how many draft tokens each request sends to the target this round.

Pure numpy, no torch, no model I/O. Source: the DSpark paper ("DSpark: Confidence-Scheduled
Speculative Decoding with Semi-Autoregressive Generation", DeepSeek-AI and Peking University,
2026, arXiv 2607.05147), Algorithm 1 (greedy verify-length scheduling); see also
``docs/design.md`` section 1, step 4.

Notation (1-based positions, as in the paper). A round serves ``R`` requests. For request ``r``
the drafter proposes ``gamma_r`` tokens ``x_{r,1} .. x_{r,gamma_r}`` and the calibrated
confidence head gives the *prefix survival* ``a_{r,j} = prod_{i<=j} c_{r,i}``: the estimated
probability that draft tokens ``1..j`` are all accepted. ``a_{r,j}`` is non-increasing in ``j``
and lies in ``[0, 1]``. In code, request ``r``'s survivals are a 1-D float array
``survival[r]`` of length ``gamma_r`` whose entry ``[j - 1]`` is ``a_{r,j}``.

The scheduler picks a verify length ``l_r`` in ``[0, gamma_r]`` per request. The target then
verifies ``1 + l_r`` tokens for request ``r`` (its anchor plus ``l_r`` drafts), so the verify
batch holds ``B = sum_r (1 + l_r)`` tokens, and the expected number of tokens committed this
round is ``tau_hat = sum_r (1 + sum_{j <= l_r} a_{r,j})`` (the anchor's row always yields one
token: the correction or the bonus). The objective is the expected throughput in tokens per
second::

    Theta = tau_hat * SPS(B),     SPS(B) = 1 / (t_draft + t_verify(B))   [rounds / second]

where ``SPS`` comes from a :class:`CostTable` profiled once per engine and machine.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

__all__ = [
    "CostTable",
    "expected_throughput",
    "round_cost_table",
    "schedule_fixed",
    "schedule_global",
    "schedule_greedy",
    "schedule_threshold",
    "schedule_threshold_deepspec",
]


# ------------------------------------------------------------------------------- cost table


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
    buckets interpolated by :func:`dspark_runtime.scheduling.cost_table.cost_table_at`; None or a table without buckets:
    the stored reference costs). Tables without the split use their stored ``seconds``. Pure function.

    Raises:
        ValueError: a malformed table or ``context`` (see :class:`CostTable` and ``cost_table_at``).
    """
    from dspark_runtime.scheduling.cost_table import cost_table_at

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


# ------------------------------------------------------------------------------- validation


def _check_survival(survival: Sequence[np.ndarray]) -> list[np.ndarray]:
    """float64 copies of the per-request survival arrays; raises ValueError when invalid."""
    if isinstance(survival, np.ndarray) and survival.ndim != 2:
        raise ValueError(
            f"survival must be a list of 1-D arrays (one per request) or a 2-D array "
            f"[requests, gamma], got an array of shape {survival.shape}"
        )
    try:
        rows = list(survival)
    except TypeError as exc:
        raise ValueError("survival must be a list of 1-D arrays, one per request") from exc
    if not rows:
        raise ValueError("survival is empty: schedule at least one request")
    out = []
    for r, row in enumerate(rows):
        a = np.asarray(row, dtype=np.float64)
        if a.ndim != 1:
            raise ValueError(f"survival[{r}] must be 1-D [gamma], got shape {a.shape}")
        if not np.all(np.isfinite(a)) or np.any(a < 0) or np.any(a > 1):
            raise ValueError(f"survival[{r}] must hold probabilities in [0, 1], got {a.tolist()}")
        if np.any(np.diff(a) > 0):
            raise ValueError(
                f"survival[{r}] must be non-increasing (cumulative products of confidences), "
                f"got {a.tolist()}: pass a_j = prod_{{i<=j}} c_i, e.g. calibration.apply_sts"
            )
        out.append(a)
    return out


def _caps(arrays: list[np.ndarray], max_len: int | Sequence[int] | None) -> list[int]:
    """Per-request cap on the verify length: min(gamma_r, max_len[_r])."""
    n = len(arrays)
    if max_len is None:
        limits = [a.shape[0] for a in arrays]
    elif isinstance(max_len, (int, np.integer)) and not isinstance(max_len, bool):
        limits = [int(max_len)] * n
    else:
        limits = list(max_len)
        if len(limits) != n:
            raise ValueError(
                f"max_len must be an int or one int per request ({n}), got {len(limits)} values"
            )
    caps = []
    for r, (a, m) in enumerate(zip(arrays, limits)):
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
            raise ValueError(f"max_len must hold non-negative integers, got {m!r} for request {r}")
        caps.append(min(int(m), a.shape[0]))
    return caps


def _admission_order(arrays: list[np.ndarray], caps: list[int]) -> Iterator[tuple[int, int, float]]:
    """Yield ``(r, j, a_{r,j})`` (``j`` 1-based) in Algorithm 1's order.

    All ``(r, j)`` with ``j <= caps[r]``, by ``a`` descending, ties by lower ``j`` then lower
    ``r``. Implemented as a merge of the per-request frontiers (a heap keyed
    ``(-a, j, r)``): a position is only offered once every earlier position of its request has
    been offered, which enforces prefix admission by construction. For non-increasing
    survivals this is exactly the global sort, because within a request the key is strictly
    increasing in ``j``.
    """
    heap = [(-float(a[0]), 1, r) for r, a in enumerate(arrays) if caps[r] >= 1]
    heapq.heapify(heap)
    while heap:
        neg_a, j, r = heapq.heappop(heap)
        yield r, j, -neg_a
        if j < caps[r]:
            heapq.heappush(heap, (-float(arrays[r][j]), j + 1, r))


# ------------------------------------------------------------------------------- schedulers


def _pass_size(pass_tokens: Callable[[list[int]], int] | None, lengths: list[int]) -> int:
    """Tokens the verifier pass computes for verify lengths ``lengths``: ``B = sum_r (1 + l_r)``, or
    ``pass_tokens([1 + l_r ...])`` (the runner's own count, padding included) when given."""
    if pass_tokens is None:
        return sum(1 + int(x) for x in lengths)
    return int(pass_tokens([1 + int(x) for x in lengths]))


def schedule_greedy(
    survival: Sequence[np.ndarray],  # R arrays, float [gamma_r]; a_{r,1..gamma_r}, non-increasing
    cost: CostTable,
    max_len: int | Sequence[int] | None = None,  # optional cap on l_r (int, or one per request)
    pass_tokens: Callable[[list[int]], int] | None = None,  # verify tokens per request -> tokens computed
) -> list[int]:  # l_r in [0, min(gamma_r, max_len_r)], one per request
    """Greedy verify-length scheduling: the DSpark paper's Algorithm 1.

    Start with every request verifying only its anchor: ``B = R``, ``tau_hat = R``,
    ``Theta = R * SPS(R)``. Visit all candidate positions ``(r, j)`` by ``a_{r,j}`` descending
    (ties: lower ``j`` first, then lower ``r``); a position is admitted only after all earlier
    positions of its request (automatic for non-increasing survival, enforced anyway). Admitting
    ``(r, j)`` sets ``tau_hat += a_{r,j}``, ``B += 1`` and the new
    ``Theta = tau_hat * SPS(B)``. Stop at the FIRST admission that does not strictly raise
    ``Theta`` (that position is not admitted) and return ``l_r`` = number of admitted positions
    of request ``r``.

    Why stop at the first drop (non-anticipation, hence lossless sampling): the confidence
    ``c_{r,j}`` depends on the draft token ``x_{r,j-1}`` (the Markov-head input), so
    ``a_{r,j}`` is a function of ``x_{r,1} .. x_{r,j-1}`` only. Whether position ``j`` is
    admitted depends only on entries visited before it (other requests' entries and this
    request's ``a_{r,1..j}``), never on ``a_{r,j+1..}``. So the decision to send ``x_{r,j}`` for
    verification is made from ``x_{r,1..j-1}`` alone: the verify length is a stopping time of
    the draft sequence, and speculative rejection sampling stays exact (the committed tokens
    follow the target distribution). In particular, for one request the sorted order is the
    position order, so ``min(l, j)`` is a function of ``a_1 .. a_j`` alone. Continuing past a
    drop to find a later, higher ``Theta`` (:func:`schedule_global`) would make the decision
    about ``x_j`` depend on ``a_{j+1..}``, i.e. on ``x_j`` itself.

    Args:
        survival: one 1-D float array per request (or a 2-D array ``[R, gamma]``) of prefix
            survivals in ``[0, 1]``, non-increasing; lengths may differ between requests.
        cost: the round-time table giving ``SPS(B)``.
        max_len: optional cap on each ``l_r`` (e.g. tokens left before ``max_new_tokens``).
        pass_tokens: what the verifier pass really computes for per-request verify token counts
            ``[1 + l_r ...]`` (the runner's ``pass_rows``: the scatter layout pads every request's
            row to the longest, ``R x max_r(1 + l_r)``); ``SPS`` is read there instead of at
            ``B``. Then a position whose admission leaves that count unchanged costs nothing, so
            after the stop every request also takes the positions that still fit in the padded
            pass (in position order, each with ``a > 0``). Non-anticipation holds: the padded
            length is fixed by positions visited before the stop, and request ``r``'s later
            positions are never visited before its earlier ones.

    Returns:
        list of ``R`` ints ``l_r``.

    Raises:
        ValueError: ``survival`` is empty, a row is not 1-D, outside ``[0, 1]``, not finite or
            increasing somewhere; ``max_len`` is negative or has the wrong length.
    """
    arrays = _check_survival(survival)
    caps = _caps(arrays, max_len)
    n = len(arrays)
    lengths = [0] * n
    tau = float(n)
    batch = _pass_size(pass_tokens, lengths)
    theta = tau * cost.sps(batch)
    for r, j, a in _admission_order(arrays, caps):
        if j != lengths[r] + 1:  # prefix rule; unreachable with the frontier order, kept as a guard
            continue
        lengths[r] = j
        new_batch = _pass_size(pass_tokens, lengths)
        new_theta = (tau + a) * cost.sps(new_batch)
        if not new_theta > theta:
            lengths[r] = j - 1
            break
        tau += a
        batch = new_batch
        theta = new_theta
    if pass_tokens is not None:  # the positions the padded pass computes anyway
        for r, a in enumerate(arrays):
            while lengths[r] < caps[r] and a[lengths[r]] > 0:
                lengths[r] += 1
                if _pass_size(pass_tokens, lengths) != batch:
                    lengths[r] -= 1
                    break
    return lengths


def schedule_global(
    survival: Sequence[np.ndarray],  # R arrays, float [gamma_r]; non-increasing
    cost: CostTable,
    max_len: int | Sequence[int] | None = None,
) -> list[int]:  # l_r maximising Theta over all prefix-length choices
    """Global verify-length search: maximise ``Theta`` over every choice of ``(l_1 .. l_R)``.

    Walks the same admission order as :func:`schedule_greedy` to the end and returns the prefix
    of that order with the highest ``Theta`` (ties: the shorter prefix, i.e. fewer tokens).
    For one request this is a plain scan over ``l = 0 .. gamma``. For several requests it is
    still the exact optimum: for a fixed batch ``B`` the best ``tau_hat`` takes the ``B - R``
    largest survivals subject to the prefix rule, and with non-increasing survivals the first
    ``B - R`` entries of the order are exactly such a set; maximising over ``B`` then covers
    every choice.

    This is the search of the paper's asynchronous production variant. Trade-off: it can find
    a higher ``Theta`` than the greedy rule (e.g. across a step in the cost table, where one
    more token is expensive but many more are worth it), but its decision about ``x_j``
    depends on survivals at later positions, which depend on ``x_j`` itself. That breaks the
    non-anticipation argument of :func:`schedule_greedy`, so use it only with greedy decoding
    (acceptance is deterministic and the output equals the target's argmax whatever ``l`` is)
    or with confidences from two steps earlier (fixed before the current draft exists).

    Args / Raises: as :func:`schedule_greedy`.
    """
    arrays = _check_survival(survival)
    caps = _caps(arrays, max_len)
    n = len(arrays)
    tau = float(n)
    batch = n
    best_theta = tau * cost.sps(batch)
    best_k = 0
    order = list(_admission_order(arrays, caps))
    for k, (_, _, a) in enumerate(order, start=1):
        tau += a
        batch += 1
        theta = tau * cost.sps(batch)
        if theta > best_theta:
            best_theta, best_k = theta, k
    lengths = [0] * n
    for r, j, _ in order[:best_k]:
        lengths[r] = j
    return lengths


def schedule_fixed(n_requests: int, gamma: int) -> list[int]:
    """Baseline: every request verifies the same ``gamma`` draft tokens (``l_r = gamma``).

    Raises:
        ValueError: ``n_requests`` or ``gamma`` is not a non-negative integer.
    """
    for name, value in (("n_requests", n_requests), ("gamma", gamma)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return [int(gamma)] * int(n_requests)


def _check_threshold(threshold) -> float:
    """``threshold`` as a float in [0, 1]; raises ValueError naming it otherwise."""
    try:
        thr = float(threshold)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}") from exc
    if not 0.0 <= thr <= 1.0:
        raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
    return thr


def schedule_threshold(
    survival: Sequence[np.ndarray],  # R arrays, float [gamma_r]; non-increasing
    threshold: float,  # in [0, 1]
) -> list[int]:  # l_r = number of leading positions with a_{r,j} >= threshold
    """Baseline: a static confidence threshold, independent of cost and batch (our rule, "survival").

    ``l_r`` is the number of leading positions ``j`` with ``a_{r,j} >= threshold`` (the scan
    stops at the first position below it, so the rule is non-anticipating too). The cut is on
    the calibrated *running product* a_{r,j}; DeepSpec's rule cuts on each position's own
    confidence instead (:func:`schedule_threshold_deepspec`), so the same threshold gives
    different lengths.

    Raises:
        ValueError: ``threshold`` is not in ``[0, 1]``, or ``survival`` is invalid (see
            :func:`schedule_greedy`).
    """
    thr = _check_threshold(threshold)
    arrays = _check_survival(survival)
    lengths = []
    for a in arrays:
        below = np.flatnonzero(a < thr)
        lengths.append(int(below[0]) if below.size else int(a.shape[0]))
    return lengths


def schedule_threshold_deepspec(
    confidence: Sequence[np.ndarray],  # R arrays, float [gamma_r]: each position's own c_{r,j}
    threshold: float,  # in [0, 1]
) -> list[int]:  # l_r = index of the first position with c_{r,j} < threshold (gamma_r if none)
    """DeepSpec's static threshold (``deepspec/eval/dspark/draft_ops.py``, ``_confident_prefix_length``).

    ``l_r`` is the number of leading positions before the first ``j`` whose *own* confidence
    ``c_{r,j} = sigmoid(z_{r,j})`` (raw, not a running product, no calibration) is below
    ``threshold``; ``threshold <= 0`` keeps every position. Compare :func:`schedule_threshold`.

    Raises:
        ValueError: ``threshold`` is not in ``[0, 1]``, or a confidence row is not 1-D
            probabilities in ``[0, 1]``.
    """
    thr = _check_threshold(threshold)
    rows = list(confidence)
    if not rows:
        raise ValueError("confidence is empty: schedule at least one request")
    lengths = []
    for r, row in enumerate(rows):
        c = np.asarray(row, dtype=np.float64)
        if c.ndim != 1 or not np.all(np.isfinite(c)) or np.any(c < 0) or np.any(c > 1):
            raise ValueError(f"confidence[{r}] must be 1-D probabilities in [0, 1], got {c.tolist()}")
        below = np.flatnonzero(c < thr) if thr > 0.0 else np.zeros(0, dtype=np.int64)
        lengths.append(int(below[0]) if below.size else int(c.shape[0]))
    return lengths


def expected_throughput(
    survival: Sequence[np.ndarray],  # R arrays, float [gamma_r]
    lengths: Sequence[int],  # l_r in [0, gamma_r]
    cost: CostTable,
    pass_tokens: Callable[[list[int]], int] | None = None,
) -> float:  # Theta in expected committed tokens per second
    """Expected throughput ``Theta = tau_hat * SPS(B)`` of a given schedule.

    ``tau_hat = sum_r (1 + sum_{j <= l_r} a_{r,j})`` expected tokens per round,
    ``B = sum_r (1 + l_r)`` verify tokens, or ``pass_tokens([1 + l_r ...])`` when given (as
    :func:`schedule_greedy`); the result is in tokens per second.

    Raises:
        ValueError: ``survival`` is invalid, ``lengths`` has the wrong length, or some ``l_r``
            is not an integer in ``[0, gamma_r]``.
    """
    arrays = _check_survival(survival)
    lens = list(lengths)
    if len(lens) != len(arrays):
        raise ValueError(f"lengths must hold one value per request ({len(arrays)}), got {len(lens)}")
    tau = 0.0
    for r, (a, l) in enumerate(zip(arrays, lens)):
        if isinstance(l, bool) or not isinstance(l, (int, np.integer)) or not 0 <= l <= a.shape[0]:
            raise ValueError(f"lengths[{r}] must be an integer in [0, {a.shape[0]}], got {l!r}")
        tau += 1.0 + float(a[: int(l)].sum())
    return tau * cost.sps(_pass_size(pass_tokens, lens))
