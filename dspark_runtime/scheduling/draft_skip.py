"""Whether a round's drafting pass pays: our rule that keeps speculation from being slower than none. With R decoding
requests, prefix survivals ``a_r`` and verify lengths ``l_r``, a round that drafts is expected to commit
``Theta_d = sum_r (1 + sum_{j<=l_r} a_{r,j}) / (t_draft(R) + k t_verify(B))`` tokens per second and one that
verifies anchors only ``Theta_0 = R / (k t_verify(R))`` (``B``: the tokens the runner's pass computes, its
``pass_rows``; ``k``: the measured / profiled verifier-round ratio); when ``Theta_0 >= Theta_d`` the round skips the
drafting pass. The output is the same either way. Survivals are calibrated ones (scheduled mode) or the requests'
observed verdicts (fixed lengths, :func:`observed_survival`); ``t_draft`` is measured by the loop (else the
profiled table's, scheduled mode); skipped rounds are probed (drafted) at doubling intervals to refresh the estimates.
Pure logic: :class:`DraftSkipRule` holds the state, the decoding loop reports to it and asks it.
"""
from __future__ import annotations

import numpy as np

from dspark_runtime.scheduling.round_cost import CostTable, table_draft_seconds
from dspark_runtime.scheduling.verify_length import expected_throughput, schedule_greedy

SKIP_PROBE_EVERY = 8  # after this many rounds without drafting, draft once to refresh the estimates
SKIP_PROBE_MAX = 64  # ... and the interval doubles, up to this, while each probe confirms that drafting does not pay
SURVIVAL_EMA = 0.3  # weight of the newest verdict in an observed survival estimate
DRAFT_TIME_EMA = 0.3  # weight of the newest timing in the measured drafting-pass seconds
ROUND_RATIO_EMA = 0.2  # weight of the newest steady round in k, the measured / profiled verifier-round ratio
ROUND_RATIO_BOUNDS = (0.25, 4.0)  # a ratio is clamped to this range (one stalled round cannot flip the rule)


def observed_survival(prev: np.ndarray | None, drafted: int, accepted: int, alpha: float = SURVIVAL_EMA) -> np.ndarray:
    """Update a request's observed prefix survivals with one round's verdict.

    Args:
        prev: float64 [g] the estimate so far, or None (the first verdict is taken as it is).
        drafted: tokens verified this round (l >= 0); accepted: how many of them were accepted (0..drafted).
        alpha: weight of this verdict (exponential moving average).
    Returns a new float64 array of length max(g, drafted): position j (1-based) moves towards 1 if accepted >= j,
    else towards 0, for j <= drafted; positions beyond ``drafted`` keep their estimate; then made non-increasing
    (a prefix of j+1 tokens cannot survive more often than its first j), as the scheduler requires.
    Raises ValueError when ``accepted`` is outside 0..drafted.
    """
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted must be in [0, drafted={drafted}], got {accepted}")
    verdict = (np.arange(1, drafted + 1) <= accepted).astype(np.float64)
    if prev is None:
        return verdict
    out = np.array(prev, dtype=np.float64)
    if drafted > len(out):
        out = np.concatenate([out, verdict[len(out):]])
    out[:drafted] = (1 - alpha) * out[:drafted] + alpha * verdict
    return np.minimum.accumulate(out)


def verify_table(table: dict, scale: float = 1.0, extra: float = 0.0):
    """The verify-only round costs of a cost table at one context (``tokens``, ``t_verify`` seconds) as a
    :class:`~dspark_runtime.scheduling.round_cost.CostTable` of ``scale * (extra + t_verify(B))`` seconds per round
    (``extra``: a measured drafting pass, seconds; ``scale``: a measured / predicted round-time ratio)."""
    return CostTable(tuple(table["tokens"]), tuple(scale * (extra + t) for t in table["t_verify"]))


class DraftSkipRule:
    """The loop's drafting decision and what it learns from (see the module docstring for the rule and source).

    ``prior``: float64 [γ] survivals assumed for a request that has not drafted yet (the drafter's acceptance fitted
    on the calibration split, the loop's ``skip_prior``); in observed mode the loop-wide average of every verdict so
    far stands in when there is none. ``draft_seconds``: {R: seconds} measured drafting-pass times (observed mode).
    """

    def __init__(self, observed: bool, prior: np.ndarray | None = None):
        self.observed = observed
        self.undrafted = 0  # consecutive rounds without a drafting pass
        self.probe_every = SKIP_PROBE_EVERY  # undrafted rounds before the next probing pass
        self.probing = False  # this round's pass is a probe (drafting was not expected to pay)
        self.prior = None if prior is None else np.asarray(prior, dtype=np.float64)
        self.loop_survival: np.ndarray | None = None  # observed mode: every request's verdicts together
        self.draft_seconds: dict = {}
        self.verify_ratio: float | None = None  # k: measured (round - drafting pass) / t_verify, None: not measured
        self.last_expected: tuple | None = None  # the last pays()'s (Theta_d, Theta_0), tok/s; None: not weighed

    # --- what the loop reports -----------------------------------------------------------------------------
    def drafted(self) -> None:
        """A round ran the drafting pass: a probe doubles the next probe's interval, and the undrafted run ends."""
        if self.probing:
            self.probe_every = min(2 * self.probe_every, SKIP_PROBE_MAX)
        self.undrafted = 0

    def skipped(self) -> None:
        """A round verified anchors only."""
        self.undrafted += 1

    def record_verdict(self, prev: np.ndarray | None, drafted: int, accepted: int) -> np.ndarray:
        """One request's verdict (observed mode): returns its new survival estimate and updates the loop-wide one.
        A request's first verdict moves the prior (else the loop-wide estimate) rather than replacing it, so one
        unlucky first round does not mark a request as not worth drafting for."""
        if not drafted:
            return prev
        if prev is None:
            prev = self.prior if self.prior is not None else self.loop_survival
        self.loop_survival = observed_survival(self.loop_survival, drafted, accepted)
        return observed_survival(prev, drafted, accepted)

    def record_draft_time(self, rows: int, seconds: float) -> None:
        """The measured wall time of a drafting pass over ``rows`` requests (steady state: call it only when every
        request had drafted in the previous round too, so no prompt catch-up of the draft model is counted)."""
        old = self.draft_seconds.get(rows)
        self.draft_seconds[rows] = seconds if old is None else (1 - DRAFT_TIME_EMA) * old + DRAFT_TIME_EMA * seconds

    def record_round(self, table: dict, tokens: int, seconds: float, draft_seconds: float = 0.0) -> None:
        """The measured wall time of one steady round (no prompt chunk, no admission, no draft-model catch-up):
        ``tokens`` the verifier pass computed (R + the drafted tokens verified, plus the runner's padding: its
        ``pass_rows``), ``seconds`` the whole round, ``draft_seconds`` its drafting pass (0: it did not draft).
        Updates the ratio ``k`` = (seconds - draft_seconds) / the table's ``t_verify(tokens)`` (moving average,
        clamped to :data:`ROUND_RATIO_BOUNDS`); nothing without ``t_verify``."""
        if "t_verify" not in table:
            return
        pred = verify_table(table).round_seconds(tokens)
        rest = seconds - draft_seconds
        if not pred > 0 or not rest > 0:
            return
        r = float(np.clip(rest / pred, *ROUND_RATIO_BOUNDS))
        old = self.verify_ratio
        self.verify_ratio = r if old is None else (1 - ROUND_RATIO_EMA) * old + ROUND_RATIO_EMA * r

    def ratio(self) -> float:
        """``k``, the measured / profiled verifier-round ratio; 1.0 before any steady round is measured."""
        return 1.0 if self.verify_ratio is None else self.verify_ratio

    def draft_pass(self, table: dict, rows: int) -> float | None:
        """Seconds of the drafting pass over ``rows`` requests as the rule prices it: the measured pass
        (:meth:`draft_time`) where ``rows`` lies within the measured row counts; outside them observed mode
        interpolates the measured ones too (clamped; None before any measurement: the table times the DSpark
        drafter only), scheduled mode takes the profiled table's pass times ``k``
        (:func:`dspark_runtime.scheduling.cost_table.table_draft_seconds`)."""
        if self.observed or (self.draft_seconds and min(self.draft_seconds) <= rows <= max(self.draft_seconds)):
            return self.draft_time(rows)
        return self.ratio() * table_draft_seconds(table, rows)

    def draft_time(self, rows: int) -> float | None:
        """Estimated drafting-pass seconds at ``rows`` requests from the measured row counts (interpolated, clamped
        at the ends); None before any measurement."""
        if not self.draft_seconds:
            return None
        ks = sorted(self.draft_seconds)
        return float(np.interp(rows, ks, [self.draft_seconds[k] for k in ks]))

    # --- the decision ----------------------------------------------------------------------------------------
    def pays(self, survivals: list, caps: list, table: dict, pass_tokens=None) -> bool:
        """Whether this round should draft.

        Args:
            survivals: per decoding request its survival estimate (float64 [g_r]) or None (not drafted yet:
                ``prior``, else in observed mode the loop-wide estimate, else it counts as gaining nothing).
            caps: per request its draft-length cap this round (the estimates are cut to it).
            table: the cost table at this round's context (``t_verify`` at ``tokens``; scheduled mode also its
                ``t_draft``/``t_draft_rows``, :func:`dspark_runtime.scheduling.round_cost.round_cost_table`).
            pass_tokens: the target runner's ``pass_rows`` (verify tokens per request -> tokens the pass computes,
                padding included), or None for their sum; both sides are costed there
                (:func:`dspark_runtime.scheduling.verify_length.schedule_greedy`).
        Verify lengths if the round drafts: Algorithm 1 (scheduled), or each estimate's length within the cap
        (observed: a fixed-length drafter verifies what it drafted; unobserved positions count as no gain). Both
        sides price the verifier at ``k t_verify`` (:meth:`ratio`), the drafting side adds :meth:`draft_pass`.
        Returns True to draft (also: no profiled ``t_verify``, nothing known yet, or a probe is due). Leaves the two
        expected throughputs it compared in ``last_expected`` ((Theta_d, Theta_0) tok/s), None where it did not
        weigh them.
        """
        self.probing = False
        self.last_expected = None
        if "t_verify" not in table:
            return True
        prior = self.prior if self.prior is not None else (self.loop_survival if self.observed else None)
        if prior is None and all(s is None for s in survivals):
            return True  # nothing known yet: draft and learn
        rows = len(survivals)
        k = self.ratio()
        t_draft = self.draft_pass(table, rows)
        if t_draft is None:
            return True  # observed mode: the drafting pass has not been timed yet
        cost = verify_table(table, scale=k, extra=t_draft / k)
        base = np.zeros(0) if prior is None else np.asarray(prior, dtype=np.float64)
        survs = [(base if s is None else np.asarray(s, dtype=np.float64))[:c] for s, c in zip(survivals, caps)]
        if self.observed:
            lens = [len(a) for a in survs]
        else:
            lens = schedule_greedy(survs, cost, max_len=[len(a) for a in survs], pass_tokens=pass_tokens)
        verify_only = verify_table(table, scale=k)
        theta_d = expected_throughput(survs, lens, cost, pass_tokens)
        theta_0 = expected_throughput(survs, [0] * rows, verify_only, pass_tokens)
        self.last_expected = (float(theta_d), float(theta_0))
        if theta_d > theta_0:
            self.probe_every = SKIP_PROBE_EVERY
            return True
        if self.undrafted >= self.probe_every:
            self.probing = True
            return True
        return False
