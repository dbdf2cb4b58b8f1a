"""Verification of a draft block: how many draft tokens the target accepts, and the token it contributes after them.
One request at a time, pure numpy; randomness from an explicit ``numpy.random.Generator``. Modelled on vLLM's
rejection sampler (``vllm/v1/sample/rejection_sampler.py``).

For ``l`` draft tokens after the anchor the verifier runs ``[anchor, x_1, .., x_l]`` and gets ``l + 1`` rows: row
``k`` judges ``draft_tokens[k]`` for ``k < l`` and row ``l`` gives the bonus token when every draft is accepted. Both
functions return ``(num_accepted, next_token)``: the caller commits ``draft_tokens[:num_accepted]`` then
``next_token`` (at least one new token per verify step).
"""
from __future__ import annotations

import numpy as np

from dspark_runtime.decoding.sampling import sample


def greedy_accept(
    draft_tokens: np.ndarray,  # int [l]; l >= 0
    target_logits: np.ndarray,  # float [l + 1, vocab] target logits at the anchor and each draft, or int [l + 1] argmax
) -> tuple[int, int]:  # (num_accepted in [0, l], next_token in [0, vocab))
    """Greedy verification: accept drafts while they equal the target's argmax.

    ``target_logits`` may also be the argmax itself, int [l + 1] (a runner that takes it on the device,
    :class:`~dspark_runtime.runners.device.DeviceBatchRunner`); the draft tokens' vocabulary range is then not checked.

    ``num_accepted`` is the length of the longest prefix with
    ``draft_tokens[k] == argmax(target_logits[k])``; ``next_token`` is
    ``argmax(target_logits[num_accepted])``: the target's correction at the first mismatch, or
    the bonus token (row ``l``) when all ``l`` drafts are accepted. Argmax ties go to the lowest
    token id (``np.argmax``). The committed tokens equal what greedy decoding with the target
    alone would produce (Leviathan et al. 2023, section 2.3, the temperature-0 case).

    Raises:
        ValueError: shapes are not ``[l]`` / ``[l + 1, vocab]``, draft_tokens is not an integer
            array, or a draft token is outside ``[0, vocab)``.
    """
    draft = _check_draft_tokens(draft_tokens)
    logits = np.asarray(target_logits)
    l = draft.shape[0]
    if logits.ndim == 1 and np.issubdtype(logits.dtype, np.integer) and logits.shape[0] == l + 1:
        target = logits  # the argmax, taken on the device
    elif logits.ndim != 2 or logits.shape[0] != l + 1 or logits.shape[1] < 1:
        raise ValueError(
            f"target_logits must have shape [l + 1, vocab] = [{l + 1}, vocab] (or be int argmax ids [{l + 1}]), "
            f"got {logits.shape}"
        )
    else:
        _check_token_range(draft, logits.shape[1])
        target = np.argmax(logits, axis=-1)  # int64 [l + 1]
    mismatch = np.flatnonzero(draft != target[:l])
    num_accepted = int(mismatch[0]) if mismatch.size else l
    return num_accepted, int(target[num_accepted])


def rejection_accept(
    draft_tokens: np.ndarray,  # int [l]; l >= 0; draft_tokens[k] was sampled from draft_probs[k]
    draft_probs: np.ndarray,  # float [l, vocab]; processed draft distributions q (rows sum to 1)
    target_probs: np.ndarray,  # float [l + 1, vocab]; processed target distributions p
    rng: np.random.Generator,  # one rng.random() per draft examined, plus one for next_token
    final_q: np.ndarray | None = None,  # float [vocab]; see below
) -> tuple[int, int]:  # (num_accepted in [0, l], next_token in [0, vocab))
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).

    For ``k = 0 .. l-1`` with ``x = draft_tokens[k]``, ``p = target_probs[k]``,
    ``q = draft_probs[k]``: draw ``u ~ U[0, 1)`` and accept ``x`` iff ``q(x) > 0`` and
    ``u < p(x) / q(x)`` (probability ``min(1, p(x) / q(x))``). At the first rejection stop and
    draw ``next_token`` from the residual ``norm(max(p - q, 0))``; if that residual has no mass
    (only possible when ``p == q`` up to rounding, or after the ``q(x) == 0`` case below) draw
    from ``p`` instead. If all ``l`` drafts are accepted, draw the bonus ``next_token`` from
    ``target_probs[l]``. ``l == 0`` just draws from ``target_probs[0]``.

    ``final_q``: the distribution a draft token ``l`` was drawn from that was cut from the block unverified because
    ``target_probs[l]`` gives it probability 0 (a grammar forbids it). That token is rejected with certainty, so when
    all ``l`` drafts are accepted the next token comes from the residual ``norm(max(p_l - final_q, 0))``, exactly as
    if it had been verified — drawing from ``p_l`` instead would not be lossless.

    When every ``draft_tokens[k]`` is really distributed as ``draft_probs[k]`` (given the
    prefix), the committed tokens are distributed exactly as sampling from ``target_probs``
    one token at a time (Leviathan et al. 2023, Theorem 1; Chen et al. 2023, Theorem 1). Any q
    works, including a point mass (a deterministic drafter such as n-gram lookup: q = one-hot
    of the proposed token, acceptance probability ``p(x)``), and one-hot p and q (greedy
    params) reduce to :func:`greedy_accept`'s argmax matching.

    ``q(x) == 0``: a token the draft distribution could not have produced (so it cannot occur
    when the contract above holds). ``p(x) / q(x)`` is undefined there, so such a token is
    always **rejected** (never NaN, as in vLLM) and ``next_token`` comes from the residual.
    A token with ``p(x) == 0`` is never accepted, and never drawn as ``next_token``.

    Raises:
        ValueError: shapes are not ``[l]`` / ``[l, vocab]`` / ``[l + 1, vocab]``, draft_tokens
            is not an integer array, a draft token is outside ``[0, vocab)``, or a probability
            row is invalid for :func:`dspark_runtime.decoding.sampling.sample` (negative, non-finite,
            zero sum).
    """
    draft = _check_draft_tokens(draft_tokens)
    q = np.asarray(draft_probs)
    p = np.asarray(target_probs)
    l = draft.shape[0]
    if p.ndim != 2 or p.shape[0] != l + 1 or p.shape[1] < 1:
        raise ValueError(
            f"target_probs must have shape [l + 1, vocab] = [{l + 1}, vocab], got {p.shape}"
        )
    vocab = p.shape[1]
    if q.shape != (l, vocab):
        raise ValueError(
            f"draft_probs must have shape [l, vocab] = [{l}, {vocab}], got {q.shape}"
        )
    _check_token_range(draft, vocab)

    for k in range(l):
        x = int(draft[k])
        p_x = float(p[k, x])
        q_x = float(q[k, x])
        u = rng.random()
        if q_x > 0.0 and u < p_x / q_x:
            continue
        residual = np.maximum(p[k].astype(np.float64) - q[k].astype(np.float64), 0.0)
        if not residual.sum() > 0.0:
            residual = p[k]
        return k, int(sample(residual, rng))
    if final_q is not None:
        if np.shape(final_q) != (vocab,):
            raise ValueError(f"final_q must have shape [vocab] = [{vocab}], got {np.shape(final_q)}")
        residual = np.maximum(p[l].astype(np.float64) - np.asarray(final_q, dtype=np.float64), 0.0)
        return l, int(sample(residual if residual.sum() > 0.0 else p[l], rng))
    return l, int(sample(p[l], rng))


def _check_draft_tokens(
    draft_tokens: np.ndarray,  # int [l]
) -> np.ndarray:  # int [l]
    draft = np.asarray(draft_tokens)
    if draft.ndim != 1:
        raise ValueError(f"draft_tokens must have shape [l], got {draft.shape}")
    if draft.size and not np.issubdtype(draft.dtype, np.integer):
        raise ValueError(f"draft_tokens must be an integer array, got dtype {draft.dtype}")
    return draft.astype(np.int64, copy=False)


def _check_token_range(
    draft: np.ndarray,  # int64 [l]
    vocab: int,
) -> None:
    if draft.size and (draft.min() < 0 or draft.max() >= vocab):
        raise ValueError(f"draft_tokens must lie in [0, {vocab}), got {draft.tolist()}")
