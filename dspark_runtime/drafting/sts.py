"""Sequential Temperature Scaling (STS) of the confidence head, and calibration error. Pure numpy. Source: the DSpark
paper (arXiv 2607.05147), Sequential Temperature Scaling; docs/design.md section 1 step 3; ECE binning as the public
DeepSpec evaluator (``deepspec/eval/dspark/confidence_head.py``: equal-width bins, count-weighted).

Layout: ``logits`` float ``[N, gamma]`` (pre-sigmoid confidence scores of ``N`` held-out blocks), ``accepted`` 0/1
``[N, gamma]`` (token ``k`` accepted given all earlier ones; meaningful only before the first rejection), survival
label ``prod_{i <= k} accepted[n, i]``. The scheduler consumes ``a_k = prod_{i <= k} sigmoid(logit_i / T_i)``, so the
temperatures are fitted for the cumulative product: for ``k = 0 .. gamma - 1`` in turn, with earlier ones fixed,
grid-search the ``T_k`` that minimises the ECE of ``a_k`` against the survival label.
"""
from __future__ import annotations

import numpy as np

__all__ = [
    "DEFAULT_GRID",
    "apply_sts",
    "ece",
    "fit_sts",
    "survival_ece_report",
    "survival_labels",
]

#: Default temperature grid of :func:`fit_sts`: 200 log-spaced values in [0.05, 20].
DEFAULT_GRID = np.geomspace(0.05, 20.0, 200)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Numerically stable logistic function (no overflow warnings), float64."""
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))


def _check_n_bins(n_bins: int) -> int:
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
    return int(n_bins)


def _check_logits(logits: np.ndarray, ndim: int | None = 2) -> np.ndarray:
    x = np.asarray(logits)
    if x.dtype == object or not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"logits must be a float array, got dtype {x.dtype}")
    x = x.astype(np.float64)
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"logits must have shape [N, gamma], got shape {x.shape}")
    if x.ndim < 1 or x.shape[-1] < 1 or x.size == 0:
        raise ValueError(f"logits must have at least one row and one position, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("logits must be finite (found NaN or inf)")
    return x


def _check_accepted(accepted: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    y = np.asarray(accepted)
    if y.shape != shape:
        raise ValueError(f"accepted must have the shape of logits {shape}, got {y.shape}")
    if y.dtype == object or not (
        y.dtype == np.bool_ or np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)
    ):
        raise ValueError(f"accepted must be a bool or 0/1 array, got dtype {y.dtype}")
    if y.dtype != np.bool_ and not np.all((y == 0) | (y == 1)):
        raise ValueError("accepted must hold only 0/1 (or True/False) values")
    return y.astype(bool)


def _check_temps(temps: np.ndarray, gamma: int) -> np.ndarray:
    t = np.asarray(temps, dtype=np.float64)
    if t.shape != (gamma,):
        raise ValueError(f"temps must have shape [gamma] = [{gamma}], got {t.shape}")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"temps must be positive finite temperatures, got {t.tolist()}")
    return t


# ------------------------------------------------------------------------------- metrics


def ece(
    probs: np.ndarray,  # float [M] (any shape), predicted probabilities in [0, 1]
    labels: np.ndarray,  # bool / 0-1 [M] (same shape), observed outcomes (or rates in [0, 1])
    n_bins: int = 10,
) -> float:  # expected calibration error, in probability units, in [0, 1]
    """Expected calibration error with equal-width bins, weighted by count.

    Bins split ``[0, 1]`` into ``n_bins`` equal intervals; a prediction ``p`` goes to bin
    ``min(floor(p * n_bins), n_bins - 1)`` (so ``p = 1`` lands in the last bin). Then
    ``ECE = sum_b (n_b / M) * |mean(p in b) - mean(label in b)|``, empty bins contributing 0.
    A constant prediction ``p`` therefore has ECE ``|p - mean(labels)|`` exactly.

    Raises:
        ValueError: shapes differ, the arrays are empty, ``probs`` is not finite or outside
            ``[0, 1]``, ``labels`` outside ``[0, 1]``, or ``n_bins`` is not a positive int.
    """
    nb = _check_n_bins(n_bins)
    p = np.asarray(probs, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    if p.shape != y.shape:
        raise ValueError(f"probs and labels must have the same shape, got {p.shape} and {y.shape}")
    if p.size == 0:
        raise ValueError("probs is empty: ECE needs at least one prediction")
    if not np.all(np.isfinite(p)) or np.any(p < 0) or np.any(p > 1):
        raise ValueError("probs must be finite probabilities in [0, 1]")
    if not np.all(np.isfinite(y)) or np.any(y < 0) or np.any(y > 1):
        raise ValueError("labels must be 0/1 outcomes (or rates in [0, 1])")
    p = p.ravel()
    y = y.ravel()
    idx = np.minimum((p * nb).astype(np.int64), nb - 1)
    sum_p = np.bincount(idx, weights=p, minlength=nb)
    sum_y = np.bincount(idx, weights=y, minlength=nb)
    # sum_b (n_b / M) * |sum_p/n_b - sum_y/n_b| = sum_b |sum_p - sum_y| / M
    return float(np.abs(sum_p - sum_y).sum() / p.size)


def survival_labels(
    accepted: np.ndarray,  # bool / 0-1 [N, gamma]
) -> tuple[np.ndarray, np.ndarray]:  # (valid bool [N, gamma], survival bool [N, gamma])
    """Masks derived from per-position acceptance.

    ``valid[n, k] = all(accepted[n, :k])`` (position ``k`` was actually judged: every earlier
    token was accepted; ``valid[:, 0]`` is all True) and
    ``survival[n, k] = all(accepted[n, :k + 1])`` (the first ``k + 1`` drafts were all
    accepted). Entries of ``accepted`` where ``valid`` is False do not affect either output's
    meaning: ``survival`` is already False there.

    Raises:
        ValueError: ``accepted`` is not 2-D with at least one column, or not 0/1 valued.
    """
    y = np.asarray(accepted)
    if y.ndim != 2 or y.shape[1] < 1:
        raise ValueError(f"accepted must have shape [N, gamma], got shape {y.shape}")
    y = _check_accepted(y, y.shape)
    survival = np.logical_and.accumulate(y, axis=1)
    valid = np.ones_like(survival)
    valid[:, 1:] = survival[:, :-1]
    return valid, survival


# ------------------------------------------------------------------------------- STS


def apply_sts(
    logits: np.ndarray,  # float [..., gamma]; confidence-head pre-sigmoid scores
    temps: np.ndarray,  # float [gamma]; positive temperatures from fit_sts
) -> np.ndarray:  # float64 [..., gamma]; prefix survival a_k = prod_{i<=k} sigmoid(logit_i / T_i)
    """Calibrated prefix survival: cumulative product of ``sigmoid(logits / temps)``.

    The result is non-increasing along the last axis and lies in ``[0, 1]``: the ``survival``
    input of :mod:`dspark_runtime.scheduling.verify_length`.

    Raises:
        ValueError: ``logits`` is not a non-empty finite float array, or ``temps`` does not have
            shape ``[gamma]`` with positive finite values.
    """
    x = _check_logits(logits, ndim=None)
    t = _check_temps(temps, x.shape[-1])
    return np.cumprod(_sigmoid(x / t), axis=-1)


def fit_sts(
    logits: np.ndarray,  # float [N, gamma]
    accepted: np.ndarray,  # bool / 0-1 [N, gamma]
    grid: np.ndarray = DEFAULT_GRID,  # float [G]; candidate temperatures, positive
    n_bins: int = 10,
) -> np.ndarray:  # float64 [gamma]; temperatures T_0 .. T_{gamma-1}
    """Fit per-position temperatures by Sequential Temperature Scaling.

    For ``k = 0 .. gamma - 1`` in turn, with ``T_0 .. T_{k-1}`` already fixed, pick from
    ``grid`` the ``T_k`` minimising ``ece(a_k, survival[:, k], n_bins)`` where
    ``a_k = prod_{i <= k} sigmoid(logits[:, i] / T_i)`` over all ``N`` rows and
    ``survival[:, k]`` = 1 iff drafts ``0..k`` were all accepted (see :func:`survival_labels`).
    Ties go to the first grid value in the given order.

    Raises:
        ValueError: ``logits`` is not a finite ``[N, gamma]`` array with ``N, gamma >= 1``;
            ``accepted`` has another shape or is not 0/1; ``grid`` is not a non-empty 1-D array
            of positive finite values; ``n_bins`` is not a positive int.
    """
    x = _check_logits(logits)
    y = _check_accepted(accepted, x.shape)
    nb = _check_n_bins(n_bins)
    g = np.asarray(grid, dtype=np.float64)
    if g.ndim != 1 or g.size == 0 or not np.all(np.isfinite(g)) or np.any(g <= 0):
        raise ValueError("grid must be a non-empty 1-D array of positive finite temperatures")
    _, survival = survival_labels(y)
    n, gamma = x.shape
    temps = np.empty(gamma, dtype=np.float64)
    prev = np.ones(n, dtype=np.float64)  # prod_{i<k} sigmoid(logit_i / T_i)
    for k in range(gamma):
        label = survival[:, k]
        errors = [ece(prev * _sigmoid(x[:, k] / t), label, nb) for t in g]
        temps[k] = g[int(np.argmin(errors))]
        prev = prev * _sigmoid(x[:, k] / temps[k])
    return temps


def survival_ece_report(
    logits: np.ndarray,  # float [N, gamma]
    accepted: np.ndarray,  # bool / 0-1 [N, gamma]
    temps: np.ndarray | None = None,  # float [gamma]; None: fit_sts(logits, accepted)
    n_bins: int = 10,
) -> list[dict]:  # one dict per position
    """Per-position calibration of the prefix survival, before and after STS.

    Returns one dict per draft position with keys:

    - ``position``: 1-based draft position ``j`` (the paper's ``a_j``; array column ``j - 1``);
    - ``ece_before``: ECE of the uncalibrated cumulative product ``prod_{i<=j} sigmoid(logit_i)``;
    - ``ece_after``: ECE of :func:`apply_sts` with ``temps``;
    - ``mean_pred``: mean calibrated survival ``a_j`` over the ``N`` rows;
    - ``mean_true``: empirical survival rate (fraction of rows whose drafts ``1..j`` were all
      accepted);
    - ``n``: number of rows (``N``; survival labels are defined for every row).

    All values are plain Python ``int`` / ``float`` (JSON-safe).

    Raises:
        ValueError: as :func:`fit_sts`, or ``temps`` has the wrong shape or non-positive values.
    """
    x = _check_logits(logits)
    y = _check_accepted(accepted, x.shape)
    t = fit_sts(x, y, n_bins=n_bins) if temps is None else _check_temps(temps, x.shape[1])
    _, survival = survival_labels(y)
    before = np.cumprod(_sigmoid(x), axis=1)
    after = apply_sts(x, t)
    report = []
    for k in range(x.shape[1]):
        label = survival[:, k]
        report.append(
            {
                "position": k + 1,
                "ece_before": ece(before[:, k], label, n_bins),
                "ece_after": ece(after[:, k], label, n_bins),
                "mean_pred": float(after[:, k].mean()),
                "mean_true": float(label.mean()),
                "n": int(x.shape[0]),
            }
        )
    return report
