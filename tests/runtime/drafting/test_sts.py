"""Sequential Temperature Scaling and ECE (dspark_runtime.drafting.sts).

Hand-computed ECE values, exact STS outputs on small inputs, and recovery of known
temperatures from synthetic data where the true acceptance probability at position k is
sigmoid(z_k / T*_k). Every random draw uses a seeded numpy Generator.
"""
from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

from dspark_runtime.drafting.sts import (
    DEFAULT_GRID,
    apply_sts,
    ece,
    fit_sts,
    survival_ece_report,
    survival_labels,
)

T_STAR = np.array([2.0, 0.5, 1.5])


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.fixture(scope="module")
def synthetic():
    """(logits [20000, 3], accepted bool [20000, 3]) with P(accept k | earlier accepted) =
    sigmoid(logits[:, k] / T_STAR[k]). Logit means are non-zero: with zero-mean symmetric
    logits the constant 0.5 predictor would also be calibrated and ECE could not pin T."""
    rng = np.random.default_rng(20260705)
    n = 20000
    logits = rng.normal(loc=[2.0, 1.0, 1.5], scale=2.5, size=(n, 3))
    accepted = rng.random((n, 3)) < sigmoid(logits / T_STAR)
    return logits, accepted


# ------------------------------------------------------------------------------ ece


def test_ece_constant_prediction_equals_rate_gap_exactly():
    labels = np.array([1, 0, 0, 0] * 5)
    assert ece(np.full(20, 0.75), labels) == 0.5  # |0.75 - 0.25|
    assert ece(np.full(20, 0.25), labels) == 0.0
    labels = np.array([True, False] * 50)
    assert ece(np.full(100, 0.3), labels) == pytest.approx(0.2, abs=1e-15)
    for n_bins in (1, 3, 10, 40):
        assert ece(np.full(100, 0.3), labels, n_bins=n_bins) == pytest.approx(0.2, abs=1e-15)


def test_ece_hand_computed_bins():
    # bin [0.1, 0.2): mean p 0.15, rate 0.5 -> 0.35; bin [0.9, 1]: mean p 0.9, rate 1 -> 0.1
    probs = np.array([0.12, 0.18, 0.9, 0.9])
    labels = np.array([0, 1, 1, 1])
    assert ece(probs, labels) == pytest.approx(0.5 * 0.35 + 0.5 * 0.1)
    # with one bin: |mean p - mean y| = |0.525 - 0.75|
    assert ece(probs, labels, n_bins=1) == pytest.approx(0.225)
    # p = 1 goes to the last bin together with 0.95: mean p 0.975, rate 0.5
    assert ece(np.array([1.0, 0.95]), np.array([1, 0])) == pytest.approx(0.475)
    # counts weight the bins: 3 rows at 0.05 (rate 0), 1 row at 0.65 (rate 1)
    probs = np.array([0.05, 0.05, 0.05, 0.65])
    labels = np.array([0, 0, 0, 1])
    assert ece(probs, labels) == pytest.approx(0.75 * 0.05 + 0.25 * 0.35)
    # any shape, flattened
    assert ece(probs.reshape(2, 2), labels.reshape(2, 2)) == pytest.approx(0.75 * 0.05 + 0.25 * 0.35)


def test_ece_of_calibrated_probabilities_is_small():
    rng = np.random.default_rng(1)
    p = rng.random(200_000)
    y = rng.random(200_000) < p
    assert ece(p, y) < 0.01
    # and a systematically overconfident version of the same predictions is not
    assert ece(np.clip(p * 1.3, 0, 1), y) > 0.05


@pytest.mark.parametrize(
    "probs, labels, n_bins, match",
    [
        (np.array([0.5, 0.5]), np.array([1]), 10, "same shape"),
        (np.array([]), np.array([]), 10, "probs is empty"),
        (np.array([1.5]), np.array([1]), 10, "probs must be finite probabilities"),
        (np.array([np.nan]), np.array([1]), 10, "probs must be finite probabilities"),
        (np.array([0.5]), np.array([2]), 10, "labels must be 0/1"),
        (np.array([0.5]), np.array([1]), 0, "n_bins must be a positive integer"),
        (np.array([0.5]), np.array([1]), 2.5, "n_bins must be a positive integer"),
    ],
)
def test_ece_validation(probs, labels, n_bins, match):
    with pytest.raises(ValueError, match=match):
        ece(probs, labels, n_bins=n_bins)


# ------------------------------------------------------------------------------ labels / apply


def test_survival_labels():
    accepted = np.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 0]])
    valid, survival = survival_labels(accepted)
    assert valid.tolist() == [
        [True, True, True, False],
        [True, False, False, False],
        [True, True, True, True],
        [True, True, False, False],
    ]
    assert survival.tolist() == [
        [True, True, False, False],
        [False, False, False, False],
        [True, True, True, True],
        [True, False, False, False],
    ]
    with pytest.raises(ValueError, match="accepted must have shape"):
        survival_labels(np.array([1, 0]))
    with pytest.raises(ValueError, match="accepted must hold only 0/1"):
        survival_labels(np.array([[1, 2]]))


def test_apply_sts_hand_values():
    ln3 = math.log(3.0)
    # sigmoid(0) = 0.5, sigmoid(ln 3) = 0.75
    out = apply_sts(np.array([[0.0, ln3]]), np.array([1.0, 1.0]))
    np.testing.assert_allclose(out, [[0.5, 0.375]], rtol=1e-14)
    # temperatures divide: 2 ln3 / 2 = ln3, (ln3 / 2) / 0.5 = ln3
    out = apply_sts(np.array([[2 * ln3, ln3 / 2]]), np.array([2.0, 0.5]))
    np.testing.assert_allclose(out, [[0.75, 0.5625]], rtol=1e-14)
    assert out.dtype == np.float64
    # leading batch dimensions are kept; float32 input is fine
    x = np.zeros((2, 3, 2), dtype=np.float32)
    np.testing.assert_allclose(apply_sts(x, np.array([1.0, 3.0])), np.full((2, 3, 2), 0.5) * [1, 0.5])


def test_apply_sts_extreme_logits_are_stable_and_monotone():
    x = np.array([[1000.0, -1000.0, 5.0], [-1e6, 1e6, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = apply_sts(x, np.array([0.05, 0.05, 20.0]))
    assert np.all(np.isfinite(out)) and np.all((out >= 0) & (out <= 1))
    assert out[0, 0] == 1.0 and out[0, 1] == 0.0 and out[1, 0] == 0.0
    assert np.all(np.diff(out, axis=-1) <= 0)


def test_apply_sts_validation():
    with pytest.raises(ValueError, match=r"temps must have shape \[gamma\] = \[2\]"):
        apply_sts(np.zeros((3, 2)), np.ones(3))
    with pytest.raises(ValueError, match="temps must be positive"):
        apply_sts(np.zeros((3, 2)), np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="logits must be finite"):
        apply_sts(np.array([[np.nan, 0.0]]), np.ones(2))
    with pytest.raises(ValueError, match="logits must be a float array"):
        apply_sts(np.array([["a", "b"]]), np.ones(2))


# ------------------------------------------------------------------------------ fit_sts


def test_fit_sts_recovers_known_temperatures(synthetic):
    logits, accepted = synthetic
    temps = fit_sts(logits, accepted)
    assert temps.shape == (3,) and temps.dtype == np.float64
    assert set(temps.tolist()) <= set(DEFAULT_GRID.tolist())
    np.testing.assert_allclose(temps, T_STAR, rtol=0.15)


def test_survival_ece_report_improves_every_position(synthetic):
    logits, accepted = synthetic
    temps = fit_sts(logits, accepted)
    report = survival_ece_report(logits, accepted, temps)
    assert [r["position"] for r in report] == [1, 2, 3]
    _, survival = survival_labels(accepted)
    calibrated = apply_sts(logits, temps)
    for k, row in enumerate(report):
        assert row["n"] == 20000
        assert row["ece_after"] < row["ece_before"]
        assert row["ece_after"] < 0.02
        assert row["mean_true"] == pytest.approx(survival[:, k].mean())
        assert row["mean_pred"] == pytest.approx(calibrated[:, k].mean())
        assert abs(row["mean_pred"] - row["mean_true"]) < 0.02
    # the raw head is overconfident at position 1 (T* = 2 halves its logits): a large ECE
    assert report[0]["ece_before"] > 0.05
    json.dumps(report)  # plain Python numbers
    # temps=None fits them itself
    assert survival_ece_report(logits, accepted) == report


def test_fit_sts_ignores_entries_after_first_rejection(synthetic):
    logits, accepted = synthetic
    valid, _ = survival_labels(accepted)
    rng = np.random.default_rng(5)
    scrambled = np.where(valid, accepted, rng.random(accepted.shape) < 0.5)
    assert not np.array_equal(scrambled, accepted)
    np.testing.assert_array_equal(fit_sts(logits, scrambled), fit_sts(logits, accepted))


def test_fit_sts_on_calibrated_data_stays_near_one():
    rng = np.random.default_rng(11)
    logits = rng.normal(loc=1.0, scale=2.0, size=(20000, 2))
    accepted = rng.random((20000, 2)) < sigmoid(logits)
    np.testing.assert_allclose(fit_sts(logits, accepted), [1.0, 1.0], rtol=0.15)


def test_fit_sts_exact_small_case():
    # 4 rows, all logits ln 3 (sigmoid 0.75). Position 0 accepted 3/4 -> T = 1 is exact
    # (a_0 = 0.75, ECE 0); position 1: rows 0 and 1 survive -> rate 0.5, and
    # a_1 = 0.75 * sigmoid(ln3 / T) = 0.5 needs sigmoid = 2/3, i.e. logit ln 2, T = ln3 / ln2.
    ln3, ln2 = math.log(3.0), math.log(2.0)
    logits = np.full((4, 2), ln3)
    accepted = np.array([[1, 1], [1, 1], [1, 0], [0, 1]])
    grid = np.array([0.5, 1.0, ln3 / ln2, 3.0])
    temps = fit_sts(logits, accepted, grid=grid)
    np.testing.assert_allclose(temps, [1.0, ln3 / ln2])
    report = survival_ece_report(logits, accepted, temps)
    assert report[0]["ece_after"] == pytest.approx(0.0, abs=1e-15)
    assert report[1]["ece_after"] == pytest.approx(0.0, abs=1e-15)
    assert report[1]["ece_before"] == pytest.approx(0.5625 - 0.5)
    assert report[1]["mean_true"] == 0.5


def test_survival_ece_report_hand_values():
    logits = np.zeros((4, 2))
    accepted = np.array([[1, 1], [1, 0], [0, 1], [0, 0]])
    report = survival_ece_report(logits, accepted, np.ones(2))
    assert report == [
        {"position": 1, "ece_before": 0.0, "ece_after": 0.0, "mean_pred": 0.5, "mean_true": 0.5, "n": 4},
        {"position": 2, "ece_before": 0.0, "ece_after": 0.0, "mean_pred": 0.25, "mean_true": 0.25, "n": 4},
    ]


@pytest.mark.parametrize(
    "logits, accepted, grid, match",
    [
        (np.zeros(4), np.zeros(4), DEFAULT_GRID, r"logits must have shape \[N, gamma\]"),
        (np.zeros((0, 3)), np.zeros((0, 3)), DEFAULT_GRID, "logits must have at least one row"),
        (np.full((2, 2), np.inf), np.zeros((2, 2)), DEFAULT_GRID, "logits must be finite"),
        (np.zeros((2, 2)), np.zeros((2, 3)), DEFAULT_GRID, "accepted must have the shape of logits"),
        (np.zeros((2, 2)), np.full((2, 2), 0.5), DEFAULT_GRID, "accepted must hold only 0/1"),
        (np.zeros((2, 2)), np.zeros((2, 2)), np.array([1.0, -1.0]), "grid must be"),
        (np.zeros((2, 2)), np.zeros((2, 2)), np.array([]), "grid must be"),
        (np.zeros((2, 2)), np.zeros((2, 2)), np.ones((2, 2)), "grid must be"),
    ],
)
def test_fit_sts_validation(logits, accepted, grid, match):
    with pytest.raises(ValueError, match=match):
        fit_sts(logits, accepted, grid=grid)


def test_report_validation():
    with pytest.raises(ValueError, match="temps must have shape"):
        survival_ece_report(np.zeros((2, 2)), np.zeros((2, 2)), temps=np.ones(3))
    with pytest.raises(ValueError, match="n_bins"):
        survival_ece_report(np.zeros((2, 2)), np.zeros((2, 2)), temps=np.ones(2), n_bins=0)
