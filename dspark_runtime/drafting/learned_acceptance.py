"""Acceptance rates learned from verification verdicts: :class:`LearnedAcceptance` (per bucket and position,
Beta-smoothed) and :class:`NgramConfidence` (n-gram proposals bucketed by match extent), fitted offline on the
calibration split (:func:`fit_ngram_counts`, :func:`acceptance_counts`) and updated online by the router
(:mod:`dspark_runtime.drafting.router`). They give a source the prefix survival ``a_1..a_l`` that DSpark's calibrated
confidence head gives (DSpark paper, section 3), so the verify-length scheduler consumes it unchanged. Numpy only.
"""
from __future__ import annotations

import numpy as np

from dspark_runtime.drafting.drafters import NgramMatch, ngram_match

EXTENT_EDGES = (1, 2, 3, 4, 8, 16)


class LearnedAcceptance:
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






class NgramConfidence(LearnedAcceptance):
    """Calibrated confidences for n-gram proposals: per-(bucket, position) acceptance, fitted offline on the
    calibration split (:func:`fit_ngram_counts`, stored in the manifest by ``dspark-export calibrate``) and
    updated online from the proposals' own verdicts.

    Buckets by the match's ``extent`` (how many context tokens agree with the copied span, see
    :class:`NgramMatch`): ``[edges[i], edges[i+1])``, the last bucket open-ended; default edges
    1, 2, 3, 4-7, 8-15, 16+ (``edges=None``: the first ``len(prior_mean)`` of those). Without fitted counts the prior
    means (0.3, 0.5, 0.6, 0.7, 0.8, 0.85) are weak guesses (2 pseudo-trials) that a few verified rounds dominate.
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
    {"hits": [[gamma]], "tries": [[gamma]]} (one bucket), the format of :meth:`LearnedAcceptance.set_prior_counts`.
    """
    a = np.asarray(accepted, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"accepted must be [rounds, gamma], got shape {a.shape}")
    alive = np.cumprod(np.concatenate([np.ones((a.shape[0], 1)), a[:, :-1]], axis=1), axis=1)
    return {"hits": [(alive * a).sum(axis=0).tolist()], "tries": [alive.sum(axis=0).tolist()]}
