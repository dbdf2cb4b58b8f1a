"""Context-aware drafter routing: per request and round, send either the n-gram prompt-lookup continuation or a
model drafter's block (DSpark, EAGLE-3, or a standalone draft LM; with several, the one whose learned acceptance
promises most), whichever is expected to commit more (:func:`route`, pure; :class:`Router`, the drafter). Each source's prefix survival comes from its learned acceptance
(:mod:`dspark_runtime.drafting.learned_acceptance`) or DSpark's calibrated confidence head, so the verify-length
scheduler consumes the chosen proposal unchanged. Sources: prompt lookup decoding (Saxena 2023); the DSpark paper
(arXiv 2607.05147) section 3 for calibrated confidences and prefix survival.

Losslessness: the choice is made inside ``propose_batch``, before verification; when sampling it is made before
drafting, from the context and past verdicts only, so the model drafter's sampled tokens never condition which
proposal is sent (sent tokens stay distributed as ``q``). With greedy decoding it may also read this round's DSpark
confidences (the output is the target's argmax whatever is proposed)."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dspark_runtime.drafting.base import Drafter, Proposal
from dspark_runtime.drafting.drafters import NgramMatch, ngram_match
from dspark_runtime.drafting.learned_acceptance import LearnedAcceptance, NgramConfidence
from dspark_runtime.scheduling.cost_table import cost_table_at
from dspark_runtime.scheduling.round_cost import round_cost_table, table_draft_seconds
from dspark_runtime.scheduling.verify_length import schedule_greedy

NGRAM = "ngram"
NGRAM_MAX_LENGTH = 16  # the longest n-gram continuation proposed when scheduled
DRAFT_TIME_WEIGHT = 0.3  # weight of a drafter's newest pass in its measured drafting time (exponential average)


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
        stats = LearnedAcceptance((0.5,))
        stats.set_prior_counts(inner["hits"], inner["tries"], max_strength)
        out["inner_stats"] = stats
    return out


@dataclass
class RouteDecision:
    """What :func:`route` decided before drafting. ``choice``: "ngram", "inner", or None (greedy with a confident
    inner drafter: draft first, then compare with this round's survival in :meth:`Router.propose_batch`).
    ``survival_ngram`` float64 [match length] (empty when the match is not a candidate); ``scores``: {"ngram",
    "inner"} scores so far."""

    choice: str | None
    match: NgramMatch
    survival_ngram: np.ndarray
    scores: dict = field(default_factory=dict)


def expected_score(surv: np.ndarray, cost=None) -> float:
    """A proposal's score: its expected accepted length ``sum_j a_j``, or, with a per-round
    :class:`~dspark_runtime.scheduling.round_cost.CostTable`, the expected tokens/s
    ``(1 + sum_{j<=l} a_j) * SPS(1 + l)`` at the verify length ``l`` the scheduler would pick (paper Algorithm 1 on
    ``surv`` alone). Pure function."""
    if cost is None:
        return float(np.sum(surv))
    if len(surv) == 0:
        return float(cost.sps(1))
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
    inner_stats: LearnedAcceptance
    model_stats: dict = field(default_factory=dict)  # model drafter name -> its LearnedAcceptance (inner's included)
    predicted: float = 0.0  # sum of the inner's survivals over the positions it sent
    realized: int = 0  # tokens of inner blocks the target accepted
    source: str | None = None  # the last round's source
    pending: bool = False  # its verdict not observed yet
    match: NgramMatch = field(default_factory=NgramMatch)
    survival: np.ndarray = field(default_factory=lambda: np.zeros(0))
    scores: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)


class Router(Drafter):
    """The context-aware router: per request and round, the n-gram prompt-lookup continuation or the
    model drafter's block (``inner``: :class:`~dspark_runtime.drafting.dspark.DSparkDrafter` or
    :class:`~dspark_runtime.drafting.drafters.LMDrafter`), by :func:`route`; a
    :class:`~dspark_runtime.drafting.base.Drafter`, so one request and a batch route by the same rule.

    Survivals: n-gram from the request's :class:`NgramConfidence`; the model drafter from its calibrated
    confidence head (DSpark, greedy) times the request's recalibration factor ``rho = (A + k) / (P + k)`` (A:
    tokens the target accepted from its blocks, P: the sum of its survivals over the positions it sent, k:
    ``recalibration_strength``; None = off; each ``a_j`` clipped to 1), else its learned acceptance. One inner
    pass serves every row that needs it and is skipped when none does; rows decided without it get no draws
    from their random generators. The chosen proposal carries its survival, so the loop's verify-length
    scheduler (``draft_length="scheduled"``) cuts it like a DSpark block; with a ``cost_table`` (scheduled mode) the
    scores are expected tokens/s at the round's row count and cached positions, else expected accepted tokens.

    With ``others`` (more model drafters: the EAGLE-3 drafter beside the DSpark one), each round first picks, per
    request, the model drafter whose learned acceptance (its own statistics, prior ``others_stats``) scores best
    (ties: ``inner`` first), then routes between it and the n-gram continuation as above; each model drafter runs one
    pass for the rows that chose it. With a cost table, each model drafter's rounds are priced with its own drafting
    time: the table's profiled pass (one drafter's) scaled by the drafter's measured passes relative to it
    (:meth:`draft_scale`; 1 until its second pass, the first being a warm-up), so a drafter that accepts a little
    more but drafts twice as slowly loses where the time does not pay.

    Args:
        inner: the model drafter (not n-gram lookup).
        confidence, inner_stats: the fitted priors (:func:`router_priors`); every request starts from a copy.
        others: further model drafters (distinct names); others_stats: {name: LearnedAcceptance} priors of them.
        max_ngram, min_ngram: lookup n-gram lengths. min_match, min_support, ngram_bias, skip_ratio, mode: as
            :func:`route`.
        recalibration_strength: k of rho, or None.
        ngram_max_length: the longest n-gram continuation proposed when scheduled (the engine then gives requests
            γ = max(block size, this); the model drafter still drafts at most its block size).
        cost_table: the manifest's cost table dict (scheduled mode: score by expected tokens/s), or None.
        attended_positions: the target runner's ``attended_positions`` (the cost table's context, as the loop reads
            it), or None: the longest request's cached positions.
        clock: seconds, monotonic (the drafting passes are timed with it when there are several model drafters).
    Raises ValueError for an n-gram inner, bad n-gram lengths or an unknown mode.
    """

    name = "router"
    confident = True  # every proposal carries a survival (learned, or the inner's calibrated one)

    def __init__(self, inner: Drafter, *, confidence: NgramConfidence | None = None,
                 inner_stats: LearnedAcceptance | None = None, max_ngram: int = 3, min_ngram: int = 1,
                 min_match: int = 1, min_support: int = 1, mode: str = "auto", ngram_bias: float = 0.0,
                 recalibration_strength: float | None = 2.0, skip_ratio: float | None = 2.0,
                 ngram_max_length: int = NGRAM_MAX_LENGTH, cost_table: dict | None = None,
                 attended_positions: Callable | None = None, others: tuple = (),
                 others_stats: dict | None = None, clock: Callable[[], float] = time.perf_counter):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if mode not in ("auto", "prior"):
            raise ValueError(f"mode must be 'auto' or 'prior', got {mode!r}")
        if inner.name == NGRAM or any(o.name == NGRAM for o in others):
            raise ValueError("the router's inner drafter must be a model drafter, not n-gram lookup")
        if len({m.name for m in (inner, *others)}) != 1 + len(others):
            raise ValueError(f"the router's model drafters need distinct names, got {[m.name for m in (inner, *others)]}")
        if ngram_max_length < 1:
            raise ValueError(f"ngram_max_length must be >= 1, got {ngram_max_length}")
        self.inner = inner
        self.inner_name = inner.name
        self.block_size = inner.block_size
        self.inner_confident = bool(inner.confident)
        self.confidence = confidence if confidence is not None else NgramConfidence()
        self.inner_stats = inner_stats if inner_stats is not None else LearnedAcceptance((0.5,))
        self.models = {m.name: m for m in (inner, *others)}  # inner first
        self.model_priors = {inner.name: self.inner_stats, **{
            o.name: (others_stats or {}).get(o.name) or LearnedAcceptance((0.5,)) for o in others}}
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.rule = dict(min_match=min_match, min_support=min_support, ngram_bias=float(ngram_bias),
                         skip_ratio=skip_ratio, mode=mode)
        self.recalibration_strength = recalibration_strength
        self.ngram_max_length = int(ngram_max_length)
        self.cost_table = cost_table
        self.attended_positions = attended_positions
        self.clock = clock
        self._passes = {name: 0 for name in self.models}  # drafting passes run, per model drafter
        self._draft_scale: dict = {}  # model drafter -> measured pass / profiled pass (after its warm-up pass)
        self._state: dict = {}

    @property
    def reads_target_features(self) -> bool:
        return any(m.reads_target_features for m in self.models.values())

    # -- requests

    def begin(self, req) -> None:
        for m in self.models.values():
            m.begin(req)
        conf = copy.deepcopy(self.confidence)
        conf.reset()
        stats = {name: copy.deepcopy(prior) for name, prior in self.model_priors.items()}
        for st in stats.values():
            st.reset()
        self._state[req.rid] = _RouteState(conf, stats[self.inner_name], model_stats=stats, sources={
            s: {"rounds": 0, "proposed": 0, "accepted": 0} for s in (NGRAM, *self.models)})

    def remove(self, rid) -> None:
        for m in self.models.values():
            m.remove(rid)
        self._state.pop(rid, None)

    def state(self, rid) -> _RouteState:
        """Request ``rid``'s state (last source, survival, scores, match, statistics). KeyError once it left."""
        return self._state[rid]

    def source_stats(self, rid) -> dict:
        """{source: {"rounds", "proposed", "accepted"}} of request ``rid`` ({} once it has left)."""
        st = self._state.get(rid)
        return {k: dict(v) for k, v in st.sources.items()} if st is not None else {}

    def draft_scale(self, name: str) -> float:
        """Model drafter ``name``'s measured drafting pass relative to the cost table's profiled one (1.0 until it
        has been timed; only timed with several model drafters and a cost table)."""
        return self._draft_scale.get(name, 1.0)

    def _timed(self, name: str, seconds: float, rows: int, table) -> None:
        """Fold one pass of ``name`` over ``rows`` requests (``seconds``) into its drafting-time scale, against the
        profiled pass at that many rows of ``table`` (the cost table at the round's context); the first pass of
        each drafter (allocations, caches) is not counted."""
        self._passes[name] += 1
        profiled = table_draft_seconds(table, rows)
        if self._passes[name] < 2 or profiled <= 0:
            return
        ratio = seconds / profiled
        old = self._draft_scale.get(name)
        self._draft_scale[name] = ratio if old is None else (1 - DRAFT_TIME_WEIGHT) * old + DRAFT_TIME_WEIGHT * ratio

    def recalibration(self, rid) -> float:
        """rho = (A + k) / (P + k) of request ``rid`` (1.0 when the recalibration is off)."""
        k, st = self.recalibration_strength, self._state[rid]
        return 1.0 if k is None else (st.realized + k) / (st.predicted + k)

    # -- one round

    def propose_batch(self, reqs: list, gammas: list, only=None) -> list:
        costs, table = {name: None for name in self.models}, None
        if self.cost_table is not None:
            # at the positions the round's pass reads: the target runner's count (as the loop's scheduler), else the
            # longest request's cached positions (its prompt and output but the anchor)
            ctx = (self.attended_positions([r.rid for r in reqs]) if self.attended_positions is not None
                   else max(len(r.prompt) + len(r.out) - 1 for r in reqs))
            table = cost_table_at(self.cost_table, ctx)  # interpolated once; round_cost_table reads it as is
            costs = {name: round_cost_table(table, len(reqs), context=ctx, draft_scale=self.draft_scale(name))
                     for name in self.models}
        plans, need = {}, {name: set() for name in self.models}
        for r, g in zip(reqs, gammas):
            if only is not None and r.rid not in only:
                continue
            st = self._state[r.rid]
            m = ngram_match(np.asarray(r.prompt + r.out, dtype=np.int64), g, self.max_ngram, self.min_ngram)
            model = self._best_model(st, g, costs)
            g_in = min(g, model.block_size) if model.block_size else g
            d = route(m, st.confidence, st.model_stats[model.name].survival(0, g_in), greedy=r.params.greedy,
                      inner_confident=bool(model.confident), cost=costs[model.name], **self.rule)
            plans[r.rid] = (d, model)
            if d.choice != NGRAM:
                need[model.name].add(r.rid)
        drafted = {}
        for name, rids in need.items():
            if rids:
                model = self.models[name]
                caps = [min(g, model.block_size) if model.block_size else g for g in gammas]
                t0 = self.clock()
                props = model.propose_batch(reqs, caps, only=rids)
                if table is not None and len(self.models) > 1:
                    self._timed(name, self.clock() - t0, len(rids), table)
                drafted.update((r.rid, p) for r, p in zip(reqs, props) if r.rid in rids)
        out = []
        for r in reqs:
            d, model = plans.get(r.rid, (None, None))
            if d is None:
                out.append(Proposal([]))
                continue
            st = self._state[r.rid]
            p = drafted.get(r.rid)
            if p is not None:
                if model.confident and p.survival is not None:
                    surv_in = np.asarray(p.survival, dtype=np.float64)
                else:
                    surv_in = st.model_stats[model.name].survival(0, len(p.tokens))
                if d.choice is None:  # greedy: this round's calibrated, recalibrated survival
                    d.scores["inner"] = expected_score(np.minimum(1.0, self.recalibration(r.rid) * surv_in),
                                                       costs[model.name])
                    d.choice = NGRAM if d.scores["ngram"] >= d.scores["inner"] else "inner"
            if d.choice == NGRAM:
                prop = Proposal(list(d.match.tokens), None, np.asarray(d.survival_ngram, dtype=np.float64))
                source = NGRAM
            else:
                prop = Proposal(p.tokens, p.q, surv_in)
                source = model.name
            st.source, st.pending, st.match, st.survival = source, True, d.match, prop.survival
            st.scores = {NGRAM if k == NGRAM else model.name: v for k, v in d.scores.items()}
            st.sources[source]["rounds"] += 1
            out.append(prop)
        return out

    def _best_model(self, st: _RouteState, gamma: int, costs: dict) -> Drafter:
        """The model drafter whose learned acceptance over its first min(γ, block) positions scores best for this
        request (:func:`expected_score` under its own round cost ``costs[name]``, or None: expected accepted tokens;
        ties: the first in ``models``)."""
        if len(self.models) == 1:
            return self.inner
        best, score = None, None
        for name, m in self.models.items():
            sc = expected_score(st.model_stats[name].survival(0, min(gamma, m.block_size) if m.block_size else gamma),
                                costs[name])
            if score is None or sc > score:
                best, score = m, sc
        return best

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
        st.model_stats[src].update(0, sent, accepted)
        model = self.models[src]
        if model.confident:
            st.predicted += float(np.sum(st.survival[:sent]))
            st.realized += int(accepted)
        model.observe(rid, sent, accepted)
