"""Repetition, frequency and presence penalties on a verify block's logits, row by row, so speculation stays lossless.

Row ``k`` of a verify block judges the position after the committed tokens and the block's first ``k`` tokens, so its
penalties count exactly that history — what target-only decoding sees at the same position. Each row is computed by
the same float32 operations whatever block it sits in, so a penalized row is bit-identical to target-only decoding's
(given bit-identical raw logits: row padding, :mod:`dspark_runtime.machine.row_invariance`).

Semantics (vLLM's ``apply_penalties``, the OpenAI API's definitions): the repetition penalty ``r`` (Keskar et al. 2019,
CTRL) acts on every token of the prompt or generated so far — a positive logit is divided by ``r``, any other
multiplied; then ``frequency_penalty × count + presence_penalty`` is subtracted from every token generated so far
(``count`` = its occurrences among the generated tokens; the prompt does not count).
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from dspark_runtime.decoding.sampling import SamplingParams


def penalize_rows(
    logits: np.ndarray,  # float32 [rows, vocab]; row k follows generated + block[:k]
    params: SamplingParams,
    prompt_ids: np.ndarray,  # int64 [P]; the prompt's distinct token ids (the repetition penalty's)
    generated: list,  # token ids committed so far (int)
    block: list,  # the verify block's tokens after the anchor (len >= rows - 1)
) -> np.ndarray:  # float32 [rows, vocab]; a new array (the raw logits stay as they are)
    """The logits of each row after the request's penalties (a copy of ``logits`` when none is set).

    Raises ValueError when ``logits`` is not 2-D or ``block`` is shorter than ``rows - 1``."""
    x = np.array(logits, dtype=np.float32, copy=True)
    if x.ndim != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {x.shape}")
    if len(block) < x.shape[0] - 1:
        raise ValueError(f"row k needs the block's first k tokens: {x.shape[0]} rows, {len(block)} block tokens")
    if not params.penalized:
        return x
    counts = Counter(int(t) for t in generated)
    for k in range(x.shape[0]):
        if k:
            counts[int(block[k - 1])] += 1
        _penalize_row(x[k], params, prompt_ids, counts)
    return x


def _penalize_row(row: np.ndarray, params: SamplingParams, prompt_ids: np.ndarray, counts: Counter) -> None:
    """Apply the penalties to one float32 [vocab] row in place, for the generated-token ``counts``."""
    ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
    if params.repetition_penalty != 1:
        rep = np.union1d(prompt_ids, ids)
        v = row[rep]
        r = np.float32(params.repetition_penalty)
        row[rep] = np.where(v > 0, v / r, v * r)
    if (params.frequency_penalty != 0 or params.presence_penalty != 0) and ids.size:
        cnt = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
        pen = (params.frequency_penalty * cnt + params.presence_penalty).astype(np.float32)
        row[ids] -= pen
