"""Token selection: turn target/draft logits into the distribution a token is drawn from, and draw from it. Pure
functions (numpy only); randomness from an explicit ``numpy.random.Generator``, so a run is reproducible from its
seed. Layout after vLLM's sampler (``vllm/v1/sample/sampler.py``). The transforms run in the usual order (HF
``generate`` and vLLM agree): temperature, then top-k, then top-p. Speculative decoding needs the *same* processed
distribution for the draft (q) and the target (p), so both go through :func:`process_logits`; speculative sampling is
then lossless with respect to the processed target distribution (Leviathan et al. 2023, Theorem 1; Chen et al. 2023,
Theorem 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from dspark_runtime.decoding.truncation import exp_rows, softmax_rows, top_k_probs, top_p_probs
from dspark_runtime.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    temperature: 0 means greedy (argmax, ties to the lowest token id); > 0 divides the logits.
    top_k:       0 disables; k >= 1 keeps the k most probable tokens (ties to the lowest ids).
    top_p:       1.0 disables; p in (0, 1) keeps the smallest set of most probable tokens whose
                 probability mass is >= p (nucleus sampling, Holtzman et al. 2020).
    presence_penalty, frequency_penalty: in [-2, 2], 0 disables (OpenAI's): subtracted from the logit of
                 every token generated so far, once / once per occurrence.
    repetition_penalty: in [0.01, 100], 1 disables (the CTRL paper's, as transformers and vLLM): the logit of every
                 token of the prompt or generated so far is divided by it when positive, multiplied when not.

    top_k and top_p are ignored when greedy; the penalties apply before the argmax too
    (:mod:`dspark_runtime.decoding.penalties`). Call :meth:`validate` before use (the functions in
    this module do).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def penalized(self) -> bool:
        """True when any penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature == 0)."""
        return self.temperature == 0

    def validate(self) -> None:
        """Check the ranges.

        Raises:
            InputError: temperature not a finite number >= 0; top_k not an integer >= 0;
                top_p not a number in (0, 1]; a penalty out of its range. The message names the bad
                value and the range.
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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, Real) or not (-2.0 <= v <= 2.0):
                raise InputError(f"{name} must be a number in [-2, 2] (0 = disabled), got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, Real) or not (0.01 <= r <= 100.0):
            raise InputError(f"repetition_penalty must be a number in [0.01, 100] (1 = disabled), got {r!r}")


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

    The result is the one a full stable sort of the vocabulary gives (the reference kept in
    ``benchmarks/sampling_bench.py``), bit for bit on the kept tokens' float64 values, but the
    cuts rank a candidate set picked by one comparison per row: for top-k the keys at or above
    the k-th largest of the row's group maxima (:func:`~dspark_runtime.decoding.truncation._top_k_columns`; the float32 logits
    themselves where ``logits / temperature`` cannot merge two of them, see :func:`~dspark_runtime.decoding.truncation._rank_keys`),
    ranked by ``np.argpartition``; for top-p the tokens above a probability below which the rest
    of the row cannot hold the nucleus (:func:`~dspark_runtime.decoding.truncation._top_p_candidates`), sorted when few, cut by value
    bins when many (:func:`~dspark_runtime.decoding.truncation._binned_nucleus`); where that cannot be shown, the whole row is
    searched (:func:`~dspark_runtime.decoding.truncation._nucleus`). The normalising sums still run over whole rows in numpy's
    pairwise order, as the full-sort version does (without top-k, over every token's
    exponential), so the probabilities are the same float64 numbers. Cost at a 151,936-token
    vocabulary: ``benchmarks/sampling_bench.py``.

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
    vocab = x.shape[-1]
    rows = x.reshape(-1, vocab)  # [R, vocab] (a view when x is contiguous)
    row_max = np.max(rows, axis=-1)  # [R]; NaN propagates, +inf / -inf show as the maximum
    if np.isnan(row_max).any() or np.isposinf(row_max).any():
        raise ValueError("logits contain NaN or +inf")
    if np.isneginf(row_max).any():
        raise ValueError("a logits row is entirely -inf: no token can be chosen")

    if params.greedy:
        probs = np.zeros(x.shape, dtype=np.float64)
        np.put_along_axis(probs, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return probs
    if rows.shape[0] == 0:
        return np.zeros(x.shape, dtype=np.float64)

    temperature = float(params.temperature)
    # max(logits / T) == fl(max(logits) / T): correctly rounded division is monotone.
    z_max = row_max.astype(np.float64) / temperature  # [R]
    top_k = int(params.top_k)
    top_p = float(params.top_p)
    if 0 < top_k < vocab:
        probs = top_k_probs(rows, top_k, temperature, z_max, top_p)
    elif top_p < 1.0:
        probs = top_p_probs(*exp_rows(rows, temperature, z_max), top_p)
    else:
        probs = softmax_rows(rows, temperature, z_max)
    return probs.reshape(x.shape)


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


def select_token(logits: np.ndarray, params: SamplingParams, rng) -> int:
    """The next token from ``logits`` float [vocab]: the argmax when greedy, else a sample of the processed
    distribution (temperature, top-k, top-p) drawn with ``rng``."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample(process_logits(logits, params), rng)
