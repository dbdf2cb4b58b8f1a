"""Context-aware drafter routing: per round, send either the n-gram prompt-lookup continuation
or the model drafter's block (DSpark, or a standalone draft LM), whichever is expected to commit more.

Sources: prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; transformers'
``prompt_lookup_num_tokens``) for the n-gram proposal; the DSpark paper (arXiv 2607.05147) section 3 and
docs/design.md section 1 steps 3-4 for calibrated per-position confidences, prefix survival and the verify-length
scheduler that consumes them.

Pieces (numpy only, no model I/O except through the wrapped drafter):

* :func:`~dspark_runtime.drafting.drafters.ngram_match` -- prompt lookup plus its match quality (matched n-gram length,
  number of earlier occurrences, continuation length, extent).
* :class:`AcceptanceStats` / :class:`NgramConfidence` -- calibrated per-position acceptance estimates learned
  online from a source's own verification results (Beta-smoothed counts), so n-gram proposals get a prefix
  survival ``a_1..a_l`` like DSpark's confidence head gives, and the scheduler consumes it unchanged.
* :func:`route` -- the routing rule for one request and round (pure); :class:`Router` -- the drafter
  (:mod:`dspark_runtime.drafting.drafters` interface, one request or many) that applies it with per-request state.

Losslessness. Whatever proposal is sent, acceptance is the usual greedy match / rejection sampling against
the *distribution the sent tokens were drawn from* (a point mass for n-gram tokens, DSpark's or the LM's
``q`` otherwise). That stays exact as long as the choice of proposal is independent of the target's verdict
for this round (it is: the router decides inside ``propose_batch``, before verification) and, when sampling, of
the model drafter's *sampled tokens* this round: choosing the model block only when its own confidences
(which depend on the sampled tokens through the Markov head) look good would send tokens drawn from ``q``
conditioned on that event, not from ``q``. So when sampling, the router decides *before* drafting, from
the context and past rounds only (n-gram match statistics and each source's learned acceptance); with
greedy decoding (output = target argmax whatever is proposed) it may also look at this round's DSpark
confidences.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from dspark_runtime.drafting.drafters import NgramMatch, Proposal, ngram_match

NGRAM = "ngram"


# ------------------------------------------------------------------------------------ acceptance statistics


class AcceptanceStats:
    """Online calibrated acceptance estimates for a draft source, per bucket and position.

    Estimates the conditional acceptance ``c_{b,k} = P(position k accepted | positions 1..k-1 accepted)`` of
    proposals in bucket ``b`` (e.g. an n-gram match length) from the source's own verification results, and
    the prefix survival ``a_j = prod_{k<=j} c_{b,k}`` -- the same quantity DSpark's calibrated confidence head
    gives (DSpark paper section 3; docs/design.md section 1 step 3), so the scheduler consumes it unchanged.

    Counts: ``hits``, ``tries`` float64 [n_buckets, K] (K grows with the longest proposal seen). A round that
    sent ``l`` tokens of which the first ``n`` were accepted counts one try at positions 1..min(n+1, l) and a
    hit at positions 1..n (positions after the first rejection were not tested).

    Two-level Beta smoothing (a hierarchical Beta-binomial posterior mean)::

        m_b     = (H_b + s0 * mu_b) / (T_b + s0)            H_b, T_b: hits, tries of bucket b, all positions
        c_{b,k} = (hits[b,k] + s1 * m_b) / (tries[b,k] + s1)

    ``mu_b`` is the prior mean of bucket b, ``s0`` its strength in pseudo-trials (``prior_strength``) and
    ``s1`` how strongly a position shrinks to its bucket's mean (``position_strength``).
    """

    def __init__(self, prior_mean=(0.5,), prior_strength: float = 2.0, position_strength: float = 2.0):
        mu = np.asarray(prior_mean, dtype=np.float64).reshape(-1)
        if mu.size == 0 or np.any(mu <= 0) or np.any(mu >= 1):
            raise ValueError(f"prior_mean must hold probabilities in (0, 1), one per bucket, got {prior_mean!r}")
        if prior_strength <= 0 or position_strength <= 0:
            raise ValueError("prior_strength and position_strength must be > 0")
        self.prior_mean = mu
        self.s0, self.s1 = float(prior_strength), float(position_strength)
        self.prior_hits = np.zeros((mu.size, 0))
        self.prior_tries = np.zeros((mu.size, 0))
        self.reset()

    @property
    def n_buckets(self) -> int:
        return self.prior_mean.size

    def reset(self) -> None:
        """Forget every observation of this deployment (back to the prior, fitted counts included)."""
        self.hits = self.prior_hits.copy()
        self.tries = self.prior_tries.copy()

    def set_prior_counts(self, hits, tries, max_strength: float | None = 32.0) -> None:
        """Start from counts measured offline (``dspark-export calibrate`` on the calibration split).

        hits, tries: float [n_buckets, K] (K positions; tries[b, k] = rounds in which position k+1 was tested,
        hits[b, k] = rounds in which it was accepted). Each bucket's counts are scaled down so its position-1
        tries are at most ``max_strength`` pseudo-rounds (None: no scaling), so a request's own verdicts still
        move the estimate within a few dozen rounds. The bucket prior means become the fitted ones. Raises
        ValueError on mis-shaped or inconsistent counts (hits > tries or negative).
        """
        h = np.asarray(hits, dtype=np.float64)
        t = np.asarray(tries, dtype=np.float64)
        if h.ndim != 2 or h.shape != t.shape or h.shape[0] != self.n_buckets:
            raise ValueError(f"prior counts must be [n_buckets={self.n_buckets}, K] arrays of the same shape, "
                             f"got hits {h.shape} and tries {t.shape}")
        if np.any(h < 0) or np.any(h > t + 1e-9):
            raise ValueError("prior counts need 0 <= hits <= tries")
        if max_strength is not None and h.shape[1]:
            scale = np.minimum(1.0, max_strength / np.maximum(t[:, :1], 1e-9))
            h, t = h * scale, t * scale
        tot_h, tot_t = h.sum(axis=1), t.sum(axis=1)
        fitted = np.clip((tot_h + 1.0) / (tot_t + 2.0), 1e-3, 1 - 1e-3)
        self.prior_mean = np.where(tot_t > 0, fitted, self.prior_mean)
        self.prior_hits, self.prior_tries = h, t
        self.reset()

    def _grow(self, k: int) -> None:
        if k > self.hits.shape[1]:
            pad = np.zeros((self.n_buckets, k - self.hits.shape[1]))
            self.hits = np.concatenate([self.hits, pad], axis=1)
            self.tries = np.concatenate([self.tries, pad.copy()], axis=1)

    def update(self, bucket: int, proposed: int, accepted: int) -> None:
        """Record one verified round: ``proposed`` tokens sent from ``bucket``, the first ``accepted`` taken."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted} of {proposed}")
        if proposed == 0:
            return
        tried = min(accepted + 1, proposed)
        self._grow(tried)
        self.tries[bucket, :tried] += 1
        self.hits[bucket, :accepted] += 1

    def bucket_mean(self, bucket: int) -> float:
        """m_b: the bucket's smoothed acceptance over all positions."""
        return float((self.hits[bucket].sum() + self.s0 * self.prior_mean[bucket])
                     / (self.tries[bucket].sum() + self.s0))

    def conditional(self, bucket: int, length: int) -> np.ndarray:
        """c_{b,1..length}: float64 [length], each in (0, 1)."""
        m = self.bucket_mean(bucket)
        h = np.zeros(length)
        t = np.zeros(length)
        k = min(length, self.hits.shape[1])
        h[:k], t[:k] = self.hits[bucket, :k], self.tries[bucket, :k]
        return (h + self.s1 * m) / (t + self.s1)

    def survival(self, bucket: int, length: int) -> np.ndarray:
        """Prefix survival a_1..a_length = cumulative product of :meth:`conditional`: float64 [length],
        non-increasing, in (0, 1)."""
        return np.cumprod(self.conditional(bucket, length))


EXTENT_EDGES = (1, 2, 3, 4, 8, 16)
NGRAM_MAX_LENGTH = 16


class NgramConfidence(AcceptanceStats):
    """Calibrated confidences for n-gram proposals: per-(bucket, position) acceptance, fitted offline on the
    calibration split (:func:`fit_ngram_counts`, stored in the manifest by ``dspark-export calibrate``) and
    updated online from the proposals' own verdicts.

    Buckets by the match's ``extent`` (how many context tokens agree with the copied span, see
    :class:`NgramMatch`): ``[edges[i], edges[i+1])``, the last bucket open-ended; default edges
    1, 2, 3, 4-7, 8-15, 16+ (``edges=None``: the first ``len(prior_mean)`` of those). Without fitted counts the prior means (0.3, 0.5, 0.6, 0.7, 0.8, 0.85) are weak
    guesses (2 pseudo-trials) that a few verified rounds dominate.
    """

    def __init__(self, prior_mean=(0.3, 0.5, 0.6, 0.7, 0.8, 0.85), prior_strength: float = 2.0,
                 position_strength: float = 2.0, edges=None):
        super().__init__(prior_mean, prior_strength, position_strength)
        self.edges = tuple(int(e) for e in (EXTENT_EDGES[:self.n_buckets] if edges is None else edges))
        if len(self.edges) != self.n_buckets or self.edges[0] != 1 or list(self.edges) != sorted(set(self.edges)):
            raise ValueError(f"edges must be increasing, start at 1 and give one bucket per prior mean; got "
                             f"{edges!r} for {self.n_buckets} buckets")

    def bucket(self, match: NgramMatch) -> int:
        """Bucket of a (non-empty) match: the last i with edges[i] <= max(extent, ngram)."""
        e = max(match.extent, match.ngram, 1)
        return int(np.searchsorted(self.edges, e, side="right")) - 1

    def to_json(self) -> dict:
        """The fitted prior counts, for the manifest: {"edges", "hits", "tries"} (lists)."""
        return {"edges": list(self.edges), "hits": self.prior_hits.tolist(), "tries": self.prior_tries.tolist()}

    @classmethod
    def from_json(cls, d: dict, max_strength: float | None = 32.0) -> "NgramConfidence":
        """Rebuild from :meth:`to_json` / :func:`fit_ngram_counts` output; ValueError on a malformed entry."""
        try:
            edges = tuple(d["edges"])
            conf = cls(prior_mean=(0.5,) * len(edges), edges=edges)
            conf.set_prior_counts(d["hits"], d["tries"], max_strength)
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed n-gram statistics (need edges, hits, tries): {e}") from None
        return conf

    def estimate(self, match: NgramMatch) -> np.ndarray:
        """Prefix survival of the match's continuation: float64 [match.length]."""
        return self.survival(self.bucket(match), match.length)

    def record(self, match: NgramMatch, proposed: int, accepted: int) -> None:
        """Record a verified n-gram round (``proposed`` may be shorter than the match after scheduling)."""
        self.update(self.bucket(match), proposed, accepted)


def fit_ngram_counts(sequences, starts, gamma: int, max_ngram: int = 3, min_ngram: int = 1,
                     edges=EXTENT_EDGES) -> dict:
    """Measure n-gram prompt lookup's acceptance on greedy target outputs, offline. Pure function.

    sequences: list of int sequences (prompt + the target's greedy continuation); starts: list[int], the
    prompt length of each. For every output position t (anchor = sequence[t], t from start-1 to the
    second-to-last token) the lookup on ``sequence[:t+1]`` is scored against the tokens that really follow:
    a continuation of l tokens whose first n agree counts one try at positions 1..min(n+1, l) and a hit at
    1..n -- what verification would report, since greedy verification accepts exactly the tokens equal to
    the target's greedy output (docs/design.md section 1). Every position is an anchor (not only round starts),
    which slightly over-represents mid-block anchors; the estimate is per bucket and position, so that
    matters little.

    Returns {"edges": list, "hits": [n_buckets][gamma], "tries": [n_buckets][gamma], "anchors": int,
    "matched": int} (counts as floats).
    """
    nb = len(edges)
    hits = np.zeros((nb, gamma))
    tries = np.zeros((nb, gamma))
    conf = NgramConfidence(prior_mean=(0.5,) * nb, edges=edges)
    anchors = matched = 0
    for seq, st in zip(sequences, starts):
        seq = np.asarray(seq, dtype=np.int64)
        for t in range(max(int(st) - 1, 1), len(seq) - 1):
            anchors += 1
            m = ngram_match(seq[:t + 1], gamma, max_ngram, min_ngram)
            truth = seq[t + 1:t + 1 + m.length]
            ell = len(truth)  # the sequence's end cuts the continuation that can be scored
            if ell == 0:
                continue
            matched += 1
            agree = np.asarray(m.tokens[:ell]) == truth
            n = int(np.argmin(agree)) if not agree.all() else ell
            b = conf.bucket(m)
            tried = min(n + 1, ell)
            tries[b, :tried] += 1
            hits[b, :n] += 1
    return {"edges": list(edges), "hits": hits.tolist(), "tries": tries.tolist(), "anchors": anchors,
            "matched": matched}


def acceptance_counts(accepted: np.ndarray) -> dict:
    """Per-position hit/try counts of a model drafter from recorded rounds. Pure function.

    accepted: float/int [R, gamma], 1 where the round's position k was accepted (0 at the first rejection and
    after it). Position k is tried in the rounds whose positions 1..k-1 were all accepted. Returns
    {"hits": [[gamma]], "tries": [[gamma]]} (one bucket), the format of :meth:`AcceptanceStats.set_prior_counts`.
    """
    a = np.asarray(accepted, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"accepted must be [rounds, gamma], got shape {a.shape}")
    alive = np.cumprod(np.concatenate([np.ones((a.shape[0], 1)), a[:, :-1]], axis=1), axis=1)
    return {"hits": [(alive * a).sum(axis=0).tolist()], "tries": [alive.sum(axis=0).tolist()]}


def router_priors(entry: dict | None, inner_name: str, max_strength: float | None = 32.0) -> dict:
    """Keyword arguments for :class:`Router` from the manifest's ``speculation.router`` entry
    (written by ``dspark-export calibrate``): ``confidence`` (:class:`NgramConfidence` with the fitted
    n-gram counts) and ``inner_stats`` (the model drafter's measured per-position acceptance), each only
    when present. Raises ValueError on a malformed entry."""
    if not entry:
        return {}
    out = {}
    if entry.get("ngram"):
        out["confidence"] = NgramConfidence.from_json(entry["ngram"], max_strength)
    inner = (entry.get("inner") or {}).get(inner_name)
    if inner:
        stats = AcceptanceStats((0.5,))
        stats.set_prior_counts(inner["hits"], inner["tries"], max_strength)
        out["inner_stats"] = stats
    return out


# -------------------------------------------------------------------------------------------------- router


@dataclass
class RouteDecision:
    """What :func:`route` decided before drafting. ``choice``: "ngram", "inner", or None (greedy with a
    confident inner drafter: draft first, then compare with :func:`compare_drafted`). ``survival_ngram`` float64
    [match length] (empty when the match is not a candidate); ``scores``: {"ngram", "inner"} scores so far."""

    choice: str | None
    match: NgramMatch
    survival_ngram: np.ndarray
    scores: dict = field(default_factory=dict)


def expected_score(surv: np.ndarray, cost=None) -> float:
    """A proposal's score: its expected accepted length ``sum_j a_j``, or, with a per-round
    :class:`~dspark_runtime.scheduling.verify_length.CostTable`, the expected tokens/s ``(1 + sum_{j<=l} a_j) * SPS(1 + l)`` at the
    verify length ``l`` the scheduler would pick (paper Algorithm 1 on ``surv`` alone). Pure function."""
    if cost is None:
        return float(np.sum(surv))
    if len(surv) == 0:
        return float(cost.sps(1))
    from dspark_runtime.scheduling.verify_length import schedule_greedy

    ell = schedule_greedy([surv], cost)[0]
    return float((1.0 + np.sum(surv[:ell])) * cost.sps(1 + ell))


def route(match: NgramMatch, confidence: NgramConfidence, inner_prior: np.ndarray, *, greedy: bool,
          inner_confident: bool, cost=None, min_match: int = 1, min_support: int = 1, ngram_bias: float = 0.0,
          skip_ratio: float | None = 2.0, mode: str = "auto") -> RouteDecision:
    """The routing rule for one request and round, before drafting (pure function):

    1. The n-gram continuation is a candidate when it is non-empty, its matched length >= ``min_match`` and its
       support >= ``min_support``; otherwise the model drafter ("inner") is sent.
    2. Its prefix survival ``a^ng`` = ``confidence.estimate(match)``; score (:func:`expected_score`) plus
       ``ngram_bias``. The model drafter's prior score is that of ``inner_prior`` (its learned per-position
       acceptance, float64 [min(γ, block)]).
    3. Greedy, ``mode == "auto"`` and a confident inner (a DSpark confidence head): draft first and compare with
       this round's calibrated survival (choice None) -- unless the match is *strong*: its expected accepted
       length is >= ``skip_ratio`` x the inner's prior one (in tokens, not the cost-aware scores, whose common
       bonus-token term keeps their ratio near 1), then the n-gram proposal is sent without the drafting pass.
    4. Otherwise (sampling, a draft LM, ``mode == "prior"``) decide now from the priors: the model drafter's
       sampled tokens never influence the choice, which keeps sampling exact (module docstring).
    """
    usable = match.length > 0 and match.ngram >= min_match and match.support >= min_support
    if not usable:
        return RouteDecision("inner", match, np.zeros(0))
    surv_ng = confidence.estimate(match)
    scores = {"ngram": expected_score(surv_ng, cost) + ngram_bias, "inner": expected_score(inner_prior, cost)}
    strong = skip_ratio is not None and float(np.sum(surv_ng)) + ngram_bias >= skip_ratio * float(np.sum(inner_prior))
    if mode == "auto" and greedy and inner_confident and not strong:
        return RouteDecision(None, match, surv_ng, scores)
    return RouteDecision("ngram" if scores["ngram"] >= scores["inner"] else "inner", match, surv_ng, scores)


@dataclass
class _RouteState:
    """One request's router state: its statistics (copies of the fitted priors, updated by its own verdicts),
    the recalibration counts and the last round's choice."""

    confidence: NgramConfidence
    inner_stats: AcceptanceStats
    predicted: float = 0.0  # sum of the inner's survivals over the positions it sent
    realized: int = 0  # tokens of inner blocks the target accepted
    source: str | None = None  # the last round's source
    pending: bool = False  # its verdict not observed yet
    match: NgramMatch = field(default_factory=NgramMatch)
    survival: np.ndarray = field(default_factory=lambda: np.zeros(0))
    scores: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)


class Router:
    """The context-aware router: per request and round, the n-gram prompt-lookup continuation or the
    model drafter's block (``inner``: :class:`~dspark_runtime.drafting.dspark.DSparkDrafter` or
    :class:`~dspark_runtime.drafting.drafters.LMDrafter`), by :func:`route`; a drafter of the
    :mod:`dspark_runtime.drafting.drafters` interface, so one request and a batch route by the same rule.

    Survivals: n-gram from the request's :class:`NgramConfidence`; the model drafter from its calibrated
    confidence head (DSpark, greedy) times the request's recalibration factor ``rho = (A + k) / (P + k)`` (A:
    tokens the target accepted from its blocks, P: the sum of its survivals over the positions it sent, k:
    ``recalibration_strength``; None = off; each ``a_j`` clipped to 1), else its learned acceptance. One inner
    pass serves every row that needs it and is skipped when none does; rows decided without it get no draws
    from their random generators. The chosen proposal carries its survival, so the loop's verify-length
    scheduler (``draft_length="scheduled"``) cuts it like a DSpark block; with ``cost_table`` set (the manifest's
    table, scheduled mode) the scores are expected tokens/s at the round's row count and cached positions (those
    ``attended_positions`` says when set: ``Engine.batch`` sets the target runner's, as the loop reads the table),
    else expected accepted tokens.

    Args:
        inner: the model drafter (not n-gram lookup).
        confidence, inner_stats: the fitted priors (:func:`router_priors`); every request starts from a copy.
        max_ngram, min_ngram: lookup n-gram lengths. min_match, min_support, ngram_bias, skip_ratio, mode: as
            :func:`route`.
        recalibration_strength: k of rho, or None.
        ngram_max_length: the longest n-gram continuation proposed when scheduled (the engine then gives requests
            γ = max(block size, this); the model drafter still drafts at most its block size).
    Raises ValueError for an n-gram inner, bad n-gram lengths or an unknown mode.
    """

    name = "router"

    def __init__(self, inner, *, confidence: NgramConfidence | None = None, inner_stats: AcceptanceStats | None = None,
                 max_ngram: int = 3, min_ngram: int = 1, min_match: int = 1, min_support: int = 1,
                 mode: str = "auto", ngram_bias: float = 0.0, recalibration_strength: float | None = 2.0,
                 skip_ratio: float | None = 2.0, ngram_max_length: int = NGRAM_MAX_LENGTH):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if mode not in ("auto", "prior"):
            raise ValueError(f"mode must be 'auto' or 'prior', got {mode!r}")
        if getattr(inner, "name", None) == NGRAM:
            raise ValueError("the router's inner drafter must be a model drafter, not n-gram lookup")
        if ngram_max_length < 1:
            raise ValueError(f"ngram_max_length must be >= 1, got {ngram_max_length}")
        self.inner = inner
        self.inner_name = getattr(inner, "name", "inner")
        self.block_size = getattr(inner, "block_size", None)
        self.inner_confident = bool(getattr(inner, "confident", False))
        self.confidence = confidence if confidence is not None else NgramConfidence()
        self.inner_stats = inner_stats if inner_stats is not None else AcceptanceStats((0.5,))
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.rule = dict(min_match=min_match, min_support=min_support, ngram_bias=float(ngram_bias),
                         skip_ratio=skip_ratio, mode=mode)
        self.recalibration_strength = recalibration_strength
        self.ngram_max_length = int(ngram_max_length)
        self.cost_table: dict | None = None
        self.attended_positions = None  # the target runner's (BatchRunner.attended_positions): the cost table's context
        self._state: dict = {}

    # -- requests

    def begin(self, req) -> None:
        self.inner.begin(req)
        conf, inner_stats = copy.deepcopy(self.confidence), copy.deepcopy(self.inner_stats)
        conf.reset()
        inner_stats.reset()
        self._state[req.rid] = _RouteState(conf, inner_stats, sources={
            s: {"rounds": 0, "proposed": 0, "accepted": 0} for s in (NGRAM, self.inner_name)})

    def remove(self, rid) -> None:
        self.inner.remove(rid)
        self._state.pop(rid, None)

    def state(self, rid) -> _RouteState:
        """Request ``rid``'s state (last source, survival, scores, match, statistics). KeyError once it left."""
        return self._state[rid]

    def source_stats(self, rid) -> dict:
        """{source: {"rounds", "proposed", "accepted"}} of request ``rid`` ({} once it has left)."""
        st = self._state.get(rid)
        return {k: dict(v) for k, v in st.sources.items()} if st is not None else {}

    def recalibration(self, rid) -> float:
        """rho = (A + k) / (P + k) of request ``rid`` (1.0 when the recalibration is off)."""
        k, st = self.recalibration_strength, self._state[rid]
        return 1.0 if k is None else (st.realized + k) / (st.predicted + k)

    # -- one round

    def propose_batch(self, reqs: list, gammas: list, only=None) -> list:
        cost = None
        if self.cost_table is not None:
            from dspark_runtime.scheduling.verify_length import round_cost_table

            # at the positions the round's pass reads: the target runner's count (as the loop's scheduler), else the
            # longest request's cached positions (its prompt and output but the anchor)
            ctx = (self.attended_positions([r.rid for r in reqs]) if self.attended_positions is not None
                   else max(len(r.prompt) + len(r.out) - 1 for r in reqs))
            cost = round_cost_table(self.cost_table, len(reqs), context=ctx)
        plans, need = {}, set()
        for r, g in zip(reqs, gammas):
            if only is not None and r.rid not in only:
                continue
            st = self._state[r.rid]
            m = ngram_match(np.asarray(r.prompt + r.out, dtype=np.int64), g, self.max_ngram, self.min_ngram)
            g_in = min(g, self.block_size) if self.block_size else g
            d = route(m, st.confidence, st.inner_stats.survival(0, g_in), greedy=r.params.greedy,
                      inner_confident=self.inner_confident, cost=cost, **self.rule)
            plans[r.rid] = d
            if d.choice != NGRAM:
                need.add(r.rid)
        drafted = {}
        if need:
            caps = [min(g, self.block_size) if self.block_size else g for g in gammas]
            drafted = {r.rid: p for r, p in zip(reqs, self.inner.propose_batch(reqs, caps, only=need))
                       if r.rid in need}
        out = []
        for r in reqs:
            d = plans.get(r.rid)
            if d is None:
                out.append(Proposal([]))
                continue
            st = self._state[r.rid]
            p = drafted.get(r.rid)
            if p is not None:
                if self.inner_confident and p.survival is not None:
                    surv_in = np.asarray(p.survival, dtype=np.float64)
                else:
                    surv_in = st.inner_stats.survival(0, len(p.tokens))
                if d.choice is None:  # greedy: this round's calibrated, recalibrated survival
                    d.scores["inner"] = expected_score(np.minimum(1.0, self.recalibration(r.rid) * surv_in), cost)
                    d.choice = NGRAM if d.scores["ngram"] >= d.scores["inner"] else "inner"
            if d.choice == NGRAM:
                prop = Proposal(list(d.match.tokens), None, np.asarray(d.survival_ngram, dtype=np.float64))
                source = NGRAM
            else:
                prop = Proposal(p.tokens, p.q, surv_in)
                source = self.inner_name
            st.source, st.pending, st.match, st.survival = source, True, d.match, prop.survival
            st.scores = {NGRAM if k == NGRAM else self.inner_name: v for k, v in d.scores.items()}
            st.sources[source]["rounds"] += 1
            out.append(prop)
        return out

    def observe(self, rid, sent: int, accepted: int) -> None:
        """The target accepted ``accepted`` of the ``sent`` tokens verified for ``rid``: update the statistics of
        the source that was sent (and forward to the inner drafter when its block was sent)."""
        st = self._state.get(rid)
        if st is None or not st.pending:
            return
        src, st.pending = st.source, False
        st.sources[src]["proposed"] += int(sent)
        st.sources[src]["accepted"] += int(accepted)
        if src == NGRAM:
            st.confidence.record(st.match, sent, accepted)
            return
        st.inner_stats.update(0, sent, accepted)
        if self.inner_confident:
            st.predicted += float(np.sum(st.survival[:sent]))
            st.realized += int(accepted)
        obs = getattr(self.inner, "observe", None)
        if obs is not None:
            obs(rid, sent, accepted)
