"""Token selection: turn target/draft logits into the distribution a token is drawn from, and
draw from it.

Everything here is a pure function of its arguments (numpy only, no torch). Randomness comes
from an explicit ``numpy.random.Generator`` passed by the caller, never from numpy's global
state, so a run is reproducible from its seed and the functions are unit-testable without a
model. The layout follows vLLM's sampler (``vllm/v1/sample/sampler.py`` and
``vllm/v1/sample/rejection_sampler.py``): every array argument carries a shape/dtype comment.

The order of the transforms is the usual one (HF ``generate`` and vLLM agree):
temperature, then top-k, then top-p, each on the result of the previous one.

Speculative decoding (``dspark_runtime.acceptance``) needs the *same* processed distribution
for the draft (q) and the target (p) that plain sampling would use, so both go through
:func:`process_logits`; speculative sampling is then lossless with respect to the processed
target distribution (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Theorem 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling", Theorem 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from dspark_runtime.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    temperature: 0 means greedy (argmax, ties to the lowest token id); > 0 divides the logits.
    top_k:       0 disables; k >= 1 keeps the k most probable tokens (ties to the lowest ids).
    top_p:       1.0 disables; p in (0, 1) keeps the smallest set of most probable tokens whose
                 probability mass is >= p (nucleus sampling, Holtzman et al. 2020).

    top_k and top_p are ignored when greedy. Call :meth:`validate` before use (the functions in
    this module do).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature == 0)."""
        return self.temperature == 0

    def validate(self) -> None:
        """Check the ranges.

        Raises:
            InputError: temperature not a finite number >= 0; top_k not an integer >= 0;
                top_p not a number in (0, 1]. The message names the bad value and the range.
        """
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, Real) or not math.isfinite(t) or t < 0:
            raise InputError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}"
            )
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, Integral) or k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0 = disabled), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, Real) or not (0.0 < p <= 1.0):
            raise InputError(f"top_p must be a number in (0, 1] (1 = disabled), got {p!r}")


def process_logits(
    logits: np.ndarray,  # float [..., vocab]; float32 from the graphs; -inf allowed (masked)
    params: SamplingParams,
) -> np.ndarray:  # float64 [..., vocab]; each row sums to 1
    """Turn logits into the probabilities the next token is drawn from.

    Non-greedy: ``softmax(logits / temperature)`` computed in float64 with the row maximum
    subtracted (no overflow), then top-k, then top-p, renormalising after each cut:

    * top-k keeps exactly ``min(top_k, vocab)`` tokens: the k largest logits, ties broken
      towards the lowest token id (the same order as ``np.argmax``);
    * top-p keeps, in descending-probability order (ties to the lowest id), every token whose
      preceding mass is ``< top_p``: the smallest prefix with mass ``>= top_p``. The most
      probable token is always kept. The comparison is exact on the float64 probabilities
      computed here (no tolerance).

    Greedy (``temperature == 0``): a one-hot row (point mass, 1.0 at ``np.argmax`` of the raw
    logits, ties to the lowest id, 0.0 elsewhere); top-k/top-p are ignored. A point mass
    is a valid distribution, so greedy goes through :func:`sample` and
    ``acceptance.rejection_accept`` unchanged and reduces to exact argmax matching.

    Raises:
        InputError: from ``params.validate()``.
        ValueError: logits are not a floating array with ndim >= 1 and vocab >= 1, contain NaN
            or +inf, or a row is entirely -inf (no token possible).
    """
    params.validate()
    x = np.asarray(logits)
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., vocab] with vocab >= 1, got {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"logits must be a floating array, got dtype {x.dtype}")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("logits contain NaN or +inf")
    if np.isneginf(x).all(axis=-1).any():
        raise ValueError("a logits row is entirely -inf: no token can be chosen")

    if params.greedy:
        probs = np.zeros(x.shape, dtype=np.float64)
        np.put_along_axis(probs, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return probs

    z = x.astype(np.float64) / float(params.temperature)
    vocab = z.shape[-1]
    if 0 < params.top_k < vocab:
        z = _mask_top_k(z, int(params.top_k))
    probs = _softmax(z)
    if params.top_p < 1.0:
        probs = _mask_top_p(probs, float(params.top_p))
    return probs


def sample(
    probs: np.ndarray,  # float [..., vocab]; non-negative, each row with positive finite sum
    rng: np.random.Generator,  # consumes one rng.random() draw per row
) -> int | np.ndarray:  # int for a 1-D probs; int64 [...] otherwise
    """Draw one token per row by inverse CDF.

    With ``c = cumsum(row)`` and ``u = rng.random() * c[-1]`` (so rows need not be exactly
    normalised), the token is the first ``i`` with ``u < c[i]``. A token with probability 0
    is never chosen (its CDF step is empty). If float rounding makes ``u`` reach ``c[-1]``,
    the result is clamped to the last token with positive probability, never out of range.

    Raises:
        ValueError: probs has ndim < 1 or vocab < 1, contains a negative/NaN/inf entry, or a
            row sums to 0.
    """
    p = np.asarray(probs)
    if p.ndim < 1 or p.shape[-1] < 1:
        raise ValueError(f"probs must have shape [..., vocab] with vocab >= 1, got {p.shape}")
    if not (np.isfinite(p) & (p >= 0)).all():
        raise ValueError("probs must be finite and non-negative")
    cdf = np.cumsum(p, axis=-1, dtype=np.float64)  # [..., vocab]
    total = cdf[..., -1]  # [...]
    if (total <= 0).any():
        raise ValueError("a probs row sums to 0: nothing to sample")
    u = rng.random(size=total.shape) * total  # [...] in [0, total] (== total only by rounding)
    idx = np.count_nonzero(cdf <= u[..., None], axis=-1)  # [...] first i with u < cdf[i]
    vocab = p.shape[-1]
    if (idx >= vocab).any():  # only when u rounded up to the total; cdf[idx] > cdf[idx-1] else
        last_positive = vocab - 1 - np.argmax(p[..., ::-1] > 0, axis=-1)  # [...]
        idx = np.minimum(idx, last_positive)
    idx = idx.astype(np.int64, copy=False)
    if p.ndim == 1:
        return int(idx)
    return idx


def _softmax(
    z: np.ndarray,  # float64 [..., vocab]; -inf allowed, at least one finite per row
) -> np.ndarray:  # float64 [..., vocab]
    e = np.exp(z - np.max(z, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def _descending_order(
    v: np.ndarray,  # float64 [..., vocab]
) -> np.ndarray:  # int64 [..., vocab]; descending by value, ties to the lowest index
    # A stable sort of the negated values keeps equal values in index order.
    return np.argsort(-v, axis=-1, kind="stable")


def _mask_top_k(
    z: np.ndarray,  # float64 [..., vocab]; scaled logits
    k: int,  # 1 <= k < vocab
) -> np.ndarray:  # float64 [..., vocab]; all but exactly k entries per row set to -inf
    order = _descending_order(z)
    keep = np.zeros(z.shape, dtype=bool)
    np.put_along_axis(keep, order[..., :k], True, axis=-1)
    return np.where(keep, z, -np.inf)


def _mask_top_p(
    probs: np.ndarray,  # float64 [..., vocab]; rows sum to 1
    top_p: float,  # in (0, 1)
) -> np.ndarray:  # float64 [..., vocab]; nucleus kept, renormalised
    order = _descending_order(probs)
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    before = np.cumsum(sorted_probs, axis=-1)  # mass up to and including rank j
    before = np.concatenate([np.zeros_like(before[..., :1]), before[..., :-1]], axis=-1)
    keep_sorted = before < top_p  # rank 0 always kept (0 < top_p)
    keep = np.zeros(probs.shape, dtype=bool)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    kept = np.where(keep, probs, 0.0)
    return kept / np.sum(kept, axis=-1, keepdims=True)
