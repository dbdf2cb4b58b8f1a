"""Context-aware drafter routing (issue 9): per round, send either the n-gram prompt-lookup continuation
or the model drafter's block (DSpark, or a standalone draft LM), whichever is expected to commit more.

Sources: prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; transformers'
``prompt_lookup_num_tokens``) for the n-gram proposal; the DSpark paper (arXiv 2607.05147) section 3 and
docs/design.md section 1 steps 3-4 for calibrated per-position confidences, prefix survival and the verify-length
scheduler that consumes them.

Pieces (numpy only, no model I/O except through the wrapped drafter):

* :func:`ngram_match` -- the lookup of :func:`~dspark_runtime.generate.ngram_lookup` plus its match quality
  (matched n-gram length, number of earlier occurrences, continuation length).
* :class:`AcceptanceStats` / :class:`NgramConfidence` -- calibrated per-position acceptance estimates learned
  online from a source's own verification results (Beta-smoothed counts), so n-gram proposals get a prefix
  survival ``a_1..a_l`` like DSpark's confidence head gives, and the scheduler consumes it unchanged.
* :class:`RouterDrafter` -- the ``generate.Drafter`` that composes the two.

Losslessness. Whatever proposal is sent, acceptance is the usual greedy match / rejection sampling against
the *distribution the sent tokens were drawn from* (a point mass for n-gram tokens, DSpark's or the LM's
``q`` otherwise). That stays exact as long as the choice of proposal is independent of the target's verdict
for this round (it is: the router decides inside ``propose``, before verification) and, when sampling, of
the model drafter's *sampled tokens* this round: choosing the model block only when its own confidences
(which depend on the sampled tokens through the Markov head) look good would send tokens drawn from ``q``
conditioned on that event, not from ``q``. So when sampling, the router decides *before* drafting, from
the context and past rounds only (n-gram match statistics and each source's learned acceptance); with
greedy decoding (output = target argmax whatever is proposed) it may also look at this round's DSpark
confidences.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from dspark_runtime.sampling import SamplingParams

NGRAM = "ngram"


# ------------------------------------------------------------------------------------------- n-gram match


@dataclass(frozen=True)
class NgramMatch:
    """One prompt-lookup result.

    tokens: the proposed continuation, list[int] of length <= gamma (empty on a miss).
    ngram: length n of the matched suffix (0 on a miss).
    support: number of earlier occurrences of that n-gram in the context (0 on a miss); the continuation
        follows the most recent one.
    start: context index of the first continuation token (-1 on a miss).
    extent: how many tokens the context's suffix and the text before ``start`` agree on, counting back from
        the anchor (>= ngram; capped at ``MAX_EXTENT``; 0 on a miss). A long extent means the output is
        copying a span of the context (a signature, a docstring, a repeated line), where the continuation
        is accepted far more often than after a coincidental 1-3 token match.
    """

    tokens: list = field(default_factory=list)
    ngram: int = 0
    support: int = 0
    start: int = -1
    extent: int = 0

    @property
    def length(self) -> int:
        """Continuation length (number of proposed tokens)."""
        return len(self.tokens)


def ngram_match(context: np.ndarray, gamma: int, max_ngram: int = 3, min_ngram: int = 1) -> NgramMatch:
    """Prompt lookup with its match quality. Pure function.

    context: int64 [L], every committed token (the last one is the anchor). Tries n = max_ngram down to
    min_ngram: the context's last n tokens are searched among the earlier windows; the longest n with a hit
    wins, and the continuation (up to ``gamma`` tokens) follows its most recent earlier occurrence -- the
    same proposal as :func:`~dspark_runtime.generate.ngram_lookup`. Returns an :class:`NgramMatch`.
    """
    context = np.asarray(context, dtype=np.int64)
    L = len(context)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        if n <= 0:
            break
        tail = context[L - n:]
        windows = np.lib.stride_tricks.sliding_window_view(context[:L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the most recent match
            return NgramMatch(context[start:start + gamma].tolist(), n, int(hits.size), start,
                              match_extent(context, start, n))
    return NgramMatch()


MAX_EXTENT = 32


def match_extent(context: np.ndarray, start: int, n: int, cap: int = MAX_EXTENT) -> int:
    """Length of the agreement between the context's suffix and the tokens before ``start``, counted back
    from the anchor: the largest e <= cap (and e <= start) with context[L-e:] == context[start-e:start].
    ``n`` tokens are known to agree already. Pure function; int."""
    L = len(context)
    e = min(cap, start)
    if e <= n:
        return min(n, e)
    a = context[L - e:][::-1]
    b = context[start - e:start][::-1]
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else e


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
    """Keyword arguments for :class:`RouterDrafter` from the manifest's ``speculation["router"]`` entry
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


class RouterDrafter:
    """Drafter (``generate.Drafter`` protocol) that routes each round between n-gram prompt lookup and a
    model drafter (``inner``: a :class:`~dspark_runtime.dspark.DSparkDrafter` or
    :class:`~dspark_runtime.generate.LMDrafter`). Issue 9.

    Rule, per round (``context`` = every committed token, the last one the anchor):

    1. ``match = ngram_match(context, gamma)``. The n-gram proposal is a candidate when it is non-empty, its
       matched length is >= ``min_match`` and its support >= ``min_support``. Its prefix survival
       ``a^ng`` (float64 [match.length]) comes from :class:`NgramConfidence` (bucket = match length).
    2. Score each candidate by its expected accepted length ``sum_j a_j`` -- or, when a cost table is set
       (``draft_length="scheduled"``), by the expected throughput ``(1 + sum_{j<=l} a_j) * SPS(1 + l)`` at the
       verify length ``l`` the scheduler would pick.
    3. The model drafter's survival: with greedy decoding and a DSpark inner that has a confidence head
       (``mode="auto"``), this round's calibrated ``inner.last_survival`` (the block is drafted first), times
       an online recalibration factor ``rho = (A + k) / (P + k)`` (A: tokens the target accepted from DSpark
       blocks so far this request, P: the sum of DSpark's survivals over the positions it sent, k:
       ``recalibration_strength``; rho -> 1 when the STS calibration holds; each ``a_j`` is clipped to 1);
       otherwise (sampling, a draft LM, ``mode="prior"``) its learned acceptance ``inner_stats`` -- decided
       before drafting, so the model drafter runs only when chosen and its sampled tokens never influence the
       choice (see the module docstring: that keeps sampling exact).
    4. Send the n-gram continuation if ``score_ngram + ngram_bias >= score_inner``, else the model block.
       With a cost table, cut the chosen proposal to the scheduler's verify length (paper Algorithm 1 on its
       survival). N-gram tokens are point masses (``q = None``); the model block keeps its ``q``.

    ``observe(n)`` records the verdict with the source that was sent: n-gram statistics, or the inner's
    statistics (and the inner's own ``observe``). A skipped model drafter stays in sync: DSpark ingests all
    target features committed since its last call, the draft LM re-feeds the committed tokens it lacks.

    Attributes for metrics and the scheduler: ``last_source`` ("ngram" or the inner's name),
    ``last_survival`` (float64 [l], the chosen proposal's prefix survival before any scheduling cut),
    ``last_scores`` ({source: score}), ``last_match`` (:class:`NgramMatch`), ``source_counts``
    ({source: rounds}) and ``source_stats`` ({source: {rounds, proposed, accepted}}).

    Args:
        inner: the model drafter.
        max_ngram, min_ngram: lookup n-gram lengths (as :class:`~dspark_runtime.generate.NgramDrafter`).
        min_match: smallest matched length that makes the n-gram proposal a candidate.
        min_support: smallest number of earlier occurrences of the matched n-gram.
        confidence: n-gram acceptance statistics (default :class:`NgramConfidence`).
        inner_stats: the model drafter's learned acceptance (default: one bucket, prior mean 0.5).
        mode: "auto" (use this round's DSpark confidences when greedy) or "prior" (always decide before drafting).
        ngram_bias: added to the n-gram score (> 0 favours the free n-gram proposal).
        recalibration_strength: k of the DSpark recalibration factor rho (pseudo-tokens of prior belief that
            the confidences are calibrated); None turns the recalibration off (rho = 1).
        skip_ratio: with ``mode="auto"`` (greedy), do not run the model drafter at all when the n-gram
            proposal's expected accepted length (sum of its survivals, plus ``ngram_bias``) is at least
            ``skip_ratio`` times the model drafter's from its learned acceptance (fitted on the calibration
            split when the manifest has it): a strong match is sent without paying the drafting pass (measured on the 1.5B: the DSpark
            pass every round cost about 15% of n-gram-only rounds' time). None = always draft and compare.
        persist: keep learned statistics across requests (``begin``); default False, so a request's output
            with a given seed does not depend on earlier requests.
        ngram_max_length: the longest n-gram continuation proposed when the verify length is scheduled (the
            generation loop then passes gamma = max(block size, this)); the model drafter still drafts at most
            its block size. An n-gram proposal costs nothing to make, so in a copying span (long match extent,
            survival near 1) the scheduler may verify more than a DSpark block. With a fixed gamma the n-gram
            proposal is at most gamma tokens.
    """

    name = "router"

    def __init__(self, inner, *, max_ngram: int = 3, min_ngram: int = 1, min_match: int = 1,
                 min_support: int = 1, confidence: NgramConfidence | None = None,
                 inner_stats: AcceptanceStats | None = None, mode: str = "auto", ngram_bias: float = 0.0,
                 recalibration_strength: float | None = 2.0, persist: bool = False, skip_ratio: float | None = 2.0,
                 ngram_max_length: int = NGRAM_MAX_LENGTH):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if mode not in ("auto", "prior"):
            raise ValueError(f"mode must be 'auto' or 'prior', got {mode!r}")
        self.inner = inner
        self.inner_name = getattr(inner, "name", "inner")
        if self.inner_name == NGRAM:
            raise ValueError("the router's inner drafter must be a model drafter, not n-gram lookup")
        self.block_size = getattr(inner, "block_size", None)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.min_match, self.min_support = min_match, min_support
        self.confidence = confidence if confidence is not None else NgramConfidence()
        self.inner_stats = inner_stats if inner_stats is not None else AcceptanceStats((0.5,))
        self.mode, self.ngram_bias, self.persist = mode, float(ngram_bias), persist
        self.recalibration_strength = recalibration_strength
        self.skip_ratio = skip_ratio
        if ngram_max_length < 1:
            raise ValueError(f"ngram_max_length must be >= 1, got {ngram_max_length}")
        self.ngram_max_length = int(ngram_max_length)
        self._inner_predicted = 0.0  # sum of DSpark's survivals over the positions it sent (this request)
        self._inner_realized = 0  # tokens of DSpark blocks the target accepted (this request)
        heads = getattr(inner, "heads", None)
        # DSpark with a confidence head: this round's calibrated survival is available after drafting
        self.inner_confident = hasattr(inner, "last_survival") and getattr(heads, "conf_w", None) is not None
        self.cost = None  # a scheduler.CostTable: cut the chosen proposal to the scheduled verify length
        self._reset_round_state()
        self._reset_counts()

    # -- state

    def _reset_round_state(self) -> None:
        self.last_source: str | None = None
        self.last_survival = np.zeros(0)
        self.last_scores: dict = {}
        self.last_match = NgramMatch()
        self._sent = 0
        self._pending = False

    def _reset_counts(self) -> None:
        self._rounds: Counter = Counter()
        self._proposed: Counter = Counter()
        self._accepted: Counter = Counter()

    @property
    def source_counts(self) -> dict:
        """{"ngram": rounds, <inner name>: rounds} for the current request."""
        return {s: int(self._rounds[s]) for s in (NGRAM, self.inner_name)}

    @property
    def source_stats(self) -> dict:
        """{source: {"rounds", "proposed", "accepted"}} for the current request."""
        return {s: {"rounds": int(self._rounds[s]), "proposed": int(self._proposed[s]),
                    "accepted": int(self._accepted[s])} for s in (NGRAM, self.inner_name)}

    def begin(self, prompt: list) -> None:
        self.inner.begin(prompt)
        self._reset_round_state()
        self._reset_counts()
        if not self.persist:
            self.confidence.reset()
            self.inner_stats.reset()
            self._inner_predicted, self._inner_realized = 0.0, 0

    # -- one round

    def _score(self, surv: np.ndarray) -> float:
        """Expected accepted length sum(a), or with a cost table the expected tokens/s at the scheduled length."""
        if self.cost is None:
            return float(np.sum(surv))
        if len(surv) == 0:
            return float(self.cost.sps(1))
        from dspark_runtime.scheduler import schedule_greedy

        ell = schedule_greedy([surv], self.cost)[0]
        return float((1.0 + np.sum(surv[:ell])) * self.cost.sps(1 + ell))

    @property
    def recalibration(self) -> float:
        """rho = (A + k) / (P + k): realized over predicted accepted DSpark tokens, smoothed (1.0 when off)."""
        k = self.recalibration_strength
        if k is None:
            return 1.0
        return (self._inner_realized + k) / (self._inner_predicted + k)

    def _compare_now(self, params: SamplingParams) -> bool:
        """Draft the model block before deciding? Only when greedy (see the module docstring)."""
        return self.mode == "auto" and params.greedy and self.inner_confident

    def _inner_survival(self, n_tokens: int) -> np.ndarray:
        if self.inner_confident:
            return np.asarray(self.inner.last_survival[:n_tokens], dtype=np.float64)
        return self.inner_stats.survival(0, n_tokens)

    def propose(self, context: list, gamma: int, params: SamplingParams, rng) -> tuple:
        """Returns (tokens list[int] of length l <= gamma, q float [l, vocab] or None): the chosen source's
        proposal (n-gram: point masses, q None; model drafter: its q, None when greedy)."""
        match = ngram_match(np.asarray(context, dtype=np.int64), gamma, self.max_ngram, self.min_ngram)
        usable = match.length > 0 and match.ngram >= self.min_match and match.support >= self.min_support
        scores: dict = {}
        drafted = None
        use_ngram = False
        if usable:
            surv_ng = self.confidence.estimate(match)
            scores[NGRAM] = self._score(surv_ng) + self.ngram_bias
            g = min(gamma, self.block_size) if self.block_size else gamma
            prior_surv = self.inner_stats.survival(0, g)
            prior_inner = self._score(prior_surv)
            # skip rule in expected accepted tokens (cost-free units: the cost-aware scores both include the
            # bonus token's rate, which would make a ratio of them near 1 whatever the drafts are worth)
            strong = (self.skip_ratio is not None
                      and float(np.sum(surv_ng)) + self.ngram_bias >= self.skip_ratio * float(np.sum(prior_surv)))
            if self._compare_now(params) and not strong:
                drafted = self.inner.propose(context, gamma, params, rng)
                surv_in = self._inner_survival(len(drafted[0]))
                scores[self.inner_name] = self._score(np.minimum(1.0, self.recalibration * surv_in))
            else:
                scores[self.inner_name] = prior_inner
            use_ngram = scores[NGRAM] >= scores[self.inner_name]
        if use_ngram:
            source, tokens, q, surv = NGRAM, list(match.tokens), None, surv_ng
        else:
            if drafted is None:
                drafted = self.inner.propose(context, gamma, params, rng)
            tokens, q = drafted
            source, surv = self.inner_name, self._inner_survival(len(tokens))
        if self.cost is not None and tokens:
            from dspark_runtime.scheduler import schedule_greedy

            ell = schedule_greedy([surv[:len(tokens)]], self.cost)[0]
            tokens = tokens[:ell]
            q = None if q is None or ell == 0 else q[:ell]
            if source != NGRAM and hasattr(self.inner, "last_conf_logits"):
                self.inner.last_conf_logits = self.inner.last_conf_logits[:ell]  # calibration records
        self.last_source, self.last_survival, self.last_scores, self.last_match = source, surv, scores, match
        self._sent, self._pending = len(tokens), True
        self._rounds[source] += 1
        return tokens, q

    def observe(self, n_accepted: int) -> None:
        """The target accepted the first ``n_accepted`` of this round's tokens: update the statistics of the
        source that was sent (and forward to the inner drafter when its block was sent)."""
        if not self._pending:
            return
        self._pending = False
        n, src = int(n_accepted), self.last_source
        self._proposed[src] += self._sent
        self._accepted[src] += n
        if src == NGRAM:
            self.confidence.record(self.last_match, self._sent, n)
        else:
            self.inner_stats.update(0, self._sent, n)
            if self.inner_confident:
                self._inner_predicted += float(np.sum(self.last_survival[:self._sent]))
                self._inner_realized += n
            obs = getattr(self.inner, "observe", None)
            if obs is not None:
                obs(n)
