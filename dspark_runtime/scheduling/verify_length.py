"""Verify-length scheduling: how many draft tokens each request sends to the target this round. Pure numpy. Source:
the DSpark paper (arXiv 2607.05147), Algorithm 1 (greedy verify-length scheduling); docs/design.md section 1 step 4.

Notation (1-based, as in the paper): request ``r`` of ``R`` has prefix survivals ``a_{r,j} = prod_{i<=j} c_{r,i}``
(the probability that drafts ``1..j`` are all accepted; non-increasing, in ``[0, 1]``), in code a 1-D float array
``survival[r]`` whose entry ``[j - 1]`` is ``a_{r,j}``. Verify lengths ``l_r`` give a pass of ``B = sum_r (1 + l_r)``
tokens and ``tau_hat = sum_r (1 + sum_{j <= l_r} a_{r,j})`` expected committed tokens; the objective is the expected
throughput ``Theta = tau_hat * SPS(B)``, ``SPS(B) = 1 / (t_draft + t_verify(B))`` from the profiled
:class:`~dspark_runtime.scheduling.round_cost.CostTable`.
"""
from __future__ import annotations

import heapq
from typing import Callable, Iterator, Sequence

import numpy as np

from dspark_runtime.scheduling.round_cost import CostTable

__all__ = [
    "expected_throughput",
    "schedule_fixed",
    "schedule_global",
    "schedule_greedy",
    "schedule_threshold",
    "schedule_threshold_deepspec",
]


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
