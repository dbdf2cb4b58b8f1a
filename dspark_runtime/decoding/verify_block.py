"""One request's verify block under its penalties and grammar: what it verifies after the anchor (:func:`build_block`:
the drafter's tokens up to the first one its grammar forbids, then the tokens the grammar forces), the rows its
tokens are chosen from (:func:`processed_rows`: penalties, then the grammar's masks), the verdict
(:func:`accept_block`: greedy match or rejection sampling), and the grammar moved to the committed text
(:func:`advance_grammar`). Pure per-request functions the decoding loop (:mod:`dspark_runtime.decoding.loop`) calls;
numpy only. Losslessness: every row is processed as target-only decoding processes the same position, and a
forbidden sampled draft leaves its residual (:func:`~dspark_runtime.decoding.acceptance.rejection_accept`,
``final_q``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark_runtime.decoding.acceptance import greedy_accept, rejection_accept
from dspark_runtime.decoding.grammar import masked_rows
from dspark_runtime.decoding.penalties import penalize_rows
from dspark_runtime.decoding.request import Request
from dspark_runtime.decoding.sampling import process_logits
from dspark_runtime.drafting.base import Proposal


@dataclass
class Block:
    """What one request verifies in a round, after the anchor: ``tokens`` (the drafter's first ``drafted`` ones,
    then any its grammar forces); ``q`` float [len(tokens), vocab] the distributions they were drawn from, or None
    for point masses; ``final_q`` the distribution of a draft the grammar forbade, cut from the block (the residual
    it leaves is what row ``len(tokens)`` samples), or None; ``masks`` bool [vocab] per row (len(tokens) + 1) of
    the grammar, or None."""

    tokens: list
    drafted: int
    q: np.ndarray | None = None
    final_q: np.ndarray | None = None
    masks: list | None = None
    masked: int = 0  # drafts the grammar forbade (0 or 1: the block ends at the first)



def build_block(req: Request, prop: Proposal, ell: int, cap: int, eos_ids) -> Block:
    """What ``req`` verifies this round: its first ``ell`` drafted tokens; with a grammar, only up to the first
    one it forbids (no target position spent on it), then the tokens it forces (never an end-of-sequence id in
    ``eos_ids``), up to ``cap`` in all. The grammar is left advanced through the block (:func:`advance_grammar` moves
    it back to what is accepted)."""
    toks = list(prop.tokens[:ell])
    g = req.grammar
    if g is None:
        return Block(toks, ell, None if prop.q is None else prop.q[:ell])
    masks, block, final_q, masked = [], [], None, 0
    for j, t in enumerate(toks):
        masks.append(g.allowed())
        if not masks[-1][t]:
            final_q = None if prop.q is None else prop.q[j]
            masked = 1
            break
        g.consume([t])
        block.append(t)
    else:
        masks.append(g.allowed())
    drafted = len(block)
    for f in g.forced(cap - drafted) if cap > drafted else []:
        if f in eos_ids:
            break
        g.consume([f])
        block.append(f)
        masks.append(g.allowed())
    if len(block) > drafted:
        final_q = None  # the forced token took the forbidden draft's place
    q = None
    if prop.q is not None and not req.params.greedy:
        q = np.zeros((len(block), prop.q.shape[-1]), dtype=prop.q.dtype)
        q[:drafted] = prop.q[:drafted]
        q[np.arange(drafted, len(block)), block[drafted:]] = 1.0
    req.stats.masked_drafts += masked
    return Block(block, drafted, q, final_q, masks, masked)


def processed_rows(req: Request, logits: np.ndarray, block: list, masks: list | None) -> np.ndarray:
    """``req``'s raw ``logits`` rows (float32 [rows, vocab], row k after ``block[:k]``) with its penalties and
    grammar masks applied: what its tokens are chosen from (a copy, or the raw rows themselves when neither
    applies; the raw rows are never changed: logprobs read them)."""
    if not req.params.penalized and masks is None:
        return logits
    x = penalize_rows(logits, req.params, req.prompt_set, req.out, block)  # a copy
    return masked_rows(x, masks, inplace=True) if masks else x


def accept_block(req: Request, blk: Block, logits: np.ndarray) -> tuple:
    """(accepted tokens n, the correction or bonus token) for ``req``'s verify block against the verifier's
    ``logits`` after its penalties and grammar: greedy match, or rejection sampling with its own RNG (point
    masses where the proposal has no ``q``; the residual of a forbidden draft's ``final_q``)."""
    d = np.asarray(blk.tokens, dtype=np.int64)
    if req.argmax_only:
        return greedy_accept(d, logits)
    x = processed_rows(req, logits, blk.tokens, blk.masks)
    if req.params.greedy:
        return greedy_accept(d, x)
    pr = process_logits(x, req.params)
    q = blk.q
    if q is None:
        q = np.zeros((len(d), pr.shape[-1]), dtype=pr.dtype)
        q[np.arange(len(d)), d] = 1.0
    return rejection_accept(d, q, pr, req.rng, final_q=blk.final_q)


def advance_grammar(req: Request, committed: list, eos_ids, verified: int = 0, accepted: int = 0) -> None:
    """Move ``req``'s grammar (if any) to the committed text: undo the block's tokens past the ``accepted`` of
    ``verified``, then consume the newest committed token (an end-of-sequence id ends the request instead)."""
    g = req.grammar
    if g is None:
        return
    if verified > accepted:
        g.rollback(verified - accepted)
    if committed and committed[-1] not in eos_ids:
        g.consume([committed[-1]])
