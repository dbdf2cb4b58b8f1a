"""Log-probabilities of committed tokens, as the OpenAI API reports them (``logprobs`` / ``top_logprobs``).

Reported from the target's *raw* distribution — ``log_softmax`` of the verifier's logits before temperature,
penalties and grammar masks, as vLLM reports by default — at each committed position. A position's value depends only
on its own logits row, computed the same way in float64 whatever verify block the row came from, so speculative
decoding reports what target-only decoding reports wherever their raw logits are bit-identical (row padding,
:mod:`dspark_runtime.machine.row_invariance`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # the OpenAI API's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token: its id, its log-probability (natural log, float) and the ``top`` most likely tokens at
    its position as (id, logprob) pairs, most likely first (ties to the lower id); ``top`` is empty when none were
    asked for."""

    token: int
    logprob: float
    top: tuple = ()


def token_logprob(
    logits: np.ndarray,  # float [vocab]; the raw logits row of the token's position
    token: int,
    top: int = 0,  # 0..MAX_TOP_LOGPROBS most likely alternatives to report
) -> TokenLogprob:
    """``token``'s log-probability under ``softmax(logits)`` (float64, max-subtracted) and the ``top`` best.

    Raises ValueError for a 0-d / non-1-D row, a token outside the vocabulary or ``top`` outside
    [0, :data:`MAX_TOP_LOGPROBS`]."""
    x = np.asarray(logits)
    if x.ndim != 1 or x.size < 1:
        raise ValueError(f"logits must be one row [vocab], got shape {x.shape}")
    if not 0 <= int(token) < x.size:
        raise ValueError(f"token {token} is outside the vocabulary [0, {x.size})")
    if not 0 <= int(top) <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    z = x.astype(np.float64)
    m = float(np.max(z))
    lse = m + float(np.log(np.sum(np.exp(z - m))))
    best = ()
    if top:
        part = np.argpartition(-z, top - 1)[:top] if top < z.size else np.arange(z.size)
        order = part[np.lexsort((part, -z[part]))]  # by value descending, ties to the lower id
        best = tuple((int(i), float(z[i] - lse)) for i in order[:top])
    return TokenLogprob(int(token), float(z[int(token)] - lse), best)
