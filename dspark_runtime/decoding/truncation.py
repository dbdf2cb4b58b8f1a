"""Top-k and top-p truncation of logits rows, the cuts :func:`dspark_runtime.decoding.sampling.process_logits` makes:
exactly the result a full stable sort of the vocabulary gives (bit for bit on the kept tokens' float64 values), from a
candidate set picked by one comparison per row. Pure numpy functions over float rows [R, vocab]; the entry points are
:func:`softmax_rows`, :func:`exp_rows`, :func:`top_k_probs` and :func:`top_p_probs`."""
from __future__ import annotations

import numpy as np

#: first candidate-set size of the top-p search (:func:`_nucleus`; at least doubled until the nucleus is found)
TOP_P_START = 1024

#: the first top-p candidate cut assumes at most this many tokens outside the nucleus, the next ones 16 times
#: as many, the last the whole vocabulary (:func:`_top_p_candidates`)
TOP_P_TAIL = 1024

#: columns per group of the top-k pre-selection (:func:`_top_k_columns`)
_TOP_K_GROUP = 64


def exp_rows(
    rows: np.ndarray,  # float [R, vocab]; logits, -inf allowed, a finite entry per row
    temperature: float,  # > 0
    z_max: np.ndarray,  # float64 [R]; max(rows / temperature) per row
) -> tuple[np.ndarray, np.ndarray]:  # (e float64 [R, vocab] a new array, its row sums float64 [R, 1])
    """``exp(rows / temperature - z_max)`` in float64 and its row sums in numpy's pairwise order: the
    numerators and denominators of the full-sort reference's softmax, bit for bit (the cast to float64
    is exact, and so is a division by a temperature of 1, which is skipped). A row with -inf entries (a grammar's
    mask) takes ``exp`` of its finite entries only and exact zeros elsewhere — the same row, without libm's slow
    path for -inf."""
    e = np.empty(rows.shape, dtype=np.float64)
    if temperature == 1.0:
        np.subtract(rows, z_max[:, None], out=e, dtype=np.float64)
    else:
        np.divide(rows, temperature, out=e, dtype=np.float64)
        e -= z_max[:, None]
    masked = np.isneginf(np.min(rows, axis=-1))  # [R]
    if not masked.any():
        np.exp(e, out=e)
    else:
        for r in range(e.shape[0]):
            if masked[r]:
                keep = np.flatnonzero(e[r] != -np.inf)
                vals = np.exp(e[r, keep])
                e[r] = 0.0
                e[r, keep] = vals
            else:
                np.exp(e[r], out=e[r])
    return e, np.sum(e, axis=-1, keepdims=True)


def softmax_rows(
    rows: np.ndarray,  # float [R, vocab]; logits, -inf allowed, a finite entry per row
    temperature: float,  # > 0
    z_max: np.ndarray,  # float64 [R]; max(rows / temperature) per row
) -> np.ndarray:  # float64 [R, vocab]; exp(z - max) / sum, the sum in numpy's pairwise order
    e, total = exp_rows(rows, temperature, z_max)
    e /= total
    return e


def _rank_keys(
    rows: np.ndarray,  # float [R, vocab]; logits
    temperature: float,  # > 0
) -> np.ndarray:  # float [R, vocab]; ranked like rows / temperature in float64, ties included
    """The array to rank for top-k: the logits themselves when ``x / temperature`` in float64
    keeps their order and their ties exactly (float16/float32 logits and a temperature in
    [1e-250, 1e250]: every quotient of a nonzero float32 is then a normal float64, and two
    float32 values a relative 2**-24 apart cannot round to one float64), else the float64
    scaled logits (float64 input, extreme temperatures)."""
    if rows.dtype in (np.float16, np.float32) and 1e-250 <= temperature <= 1e250:
        return rows
    return rows.astype(np.float64) / temperature


def _top_k_select(
    keys: np.ndarray,  # float [R, n]; ranking keys, no NaN
    k: int,  # 1 <= k < n
) -> np.ndarray:  # int64 [R, k]; per row the k largest keys' columns, ties to the lowest, ascending
    n = keys.shape[-1]
    part = np.argpartition(keys, n - k, axis=-1)[:, n - k:]  # [R, k]; ties arbitrary
    kth = np.take_along_axis(keys, part[:, :1], axis=-1)  # [R, 1]; the k-th largest key
    cols = np.sort(part, axis=-1)
    tied = np.flatnonzero(np.count_nonzero(keys >= kth, axis=-1) > k)  # ties straddle the cut
    for r in tied:  # keep everything above the k-th key, then the lowest-column equal ones
        above = np.flatnonzero(keys[r] > kth[r, 0])
        equal = np.flatnonzero(keys[r] == kth[r, 0])[: k - above.size]
        cols[r] = np.sort(np.concatenate([above, equal]))
    return cols


def _top_k_columns(
    keys: np.ndarray,  # float [R, vocab]; ranking keys, no NaN
    k: int,  # 1 <= k < vocab
) -> np.ndarray:  # int64 [R, k]; per row the k largest keys' columns, ties to the lowest, ascending
    """:func:`_top_k_select` on a candidate set per row: the columns split into ``g`` groups (column
    ``j`` in group ``j % g``, the last ``vocab % _TOP_K_GROUP`` columns one group each); ``t``, the
    k-th largest group maximum, is <= the k-th largest key (k groups hold a key >= t), so the keys
    ``>= t`` hold the k largest and every key tied with the k-th. Whole rows are ranked when there
    are too few groups, ``t`` is -inf or the candidates exceed a quarter of the row."""
    R, vocab = keys.shape
    g = vocab // _TOP_K_GROUP
    if 2 * k > g:
        return _top_k_select(keys, k)
    gmax = keys[:, : g * _TOP_K_GROUP].reshape(R, _TOP_K_GROUP, g).max(axis=1)  # [R, g]
    gmax = np.concatenate([gmax, keys[:, g * _TOP_K_GROUP:]], axis=1)  # [R, G]
    t = np.partition(gmax, gmax.shape[1] - k, axis=-1)[:, gmax.shape[1] - k]  # [R]
    cand = [np.flatnonzero(keys[r] >= t[r]) if t[r] > -np.inf else None for r in range(R)]
    whole = [r for r in range(R) if cand[r] is None or 4 * cand[r].size > vocab]
    part = [r for r in range(R) if r not in whole]
    cols = np.empty((R, k), dtype=np.int64)
    if whole:
        cols[whole] = _top_k_select(keys[whole], k)
    if part:
        width = max(cand[r].size for r in part)  # >= k
        ck = np.full((len(part), width), -np.inf, dtype=keys.dtype)  # [P, width]; -inf padding is never kept
        cc = np.zeros((len(part), width), dtype=np.int64)  # [P, width]; ascending columns, then padding
        for i, r in enumerate(part):
            ck[i, : cand[r].size] = keys[r, cand[r]]
            cc[i, : cand[r].size] = cand[r]
        cols[part] = np.take_along_axis(cc, _top_k_select(ck, k), axis=-1) if width > k else cc
    return cols


def top_k_probs(
    rows: np.ndarray,  # float [R, vocab]; logits
    k: int,  # 1 <= k < vocab
    temperature: float,  # > 0
    z_max: np.ndarray,  # float64 [R]; max(rows / temperature)
    top_p: float,  # in (0, 1]; 1 = no top-p
) -> np.ndarray:  # float64 [R, vocab]
    """softmax over the k kept tokens (then top-p among them). The numerators are computed on
    the k kept logits only; the sums run over a dense row with zeros elsewhere, in the pairwise
    order a dense softmax of the masked row uses, so the values are the full-sort ones."""
    cols = _top_k_columns(_rank_keys(rows, temperature), k)  # [R, k] ascending token ids
    rr = np.arange(rows.shape[0])[:, None]  # [R, 1]
    e = np.take_along_axis(rows, cols, axis=-1).astype(np.float64)  # [R, k]
    e /= temperature
    e -= z_max[:, None]  # the top token is kept, so its max is the row's
    np.exp(e, out=e)
    out = np.zeros(rows.shape, dtype=np.float64)
    out[rr, cols] = e
    probs_k = e / np.sum(out, axis=-1, keepdims=True)  # [R, k]
    if top_p >= 1.0:
        out[rr, cols] = probs_k
        return out
    out[rr, cols] = 0.0
    kr, kc = _nucleus(probs_k, top_p)
    return _renormalised(out, kr, cols[kr, kc], probs_k[kr, kc])


def _top_p_candidates(
    e_row: np.ndarray,  # float64 [vocab]; exp(z - max) of one row
    total: np.float64,  # its sum (pairwise)
    top_p: float,  # in (0, 1)
    margin: float,  # 2 * vocab * eps: bounds the difference of two summation orders of the row's probabilities
) -> tuple[np.ndarray, np.ndarray] | None:  # (cols int64 [n] ascending, probs float64 [n]) or None
    """The tokens of one row with probability ``e / total`` above ``b = fl(c / total)``, when they
    provably hold the nucleus; else None. ``c = total * (1 - top_p) / (2 t)`` for ``t`` =
    :data:`TOP_P_TAIL`, 16 times that, ..., then ``t = vocab`` (at most ``vocab`` tokens of
    probability <= b hold at most about ``(1 - top_p) / 2``, so the last cut fails only for
    ``top_p`` within about ``2 margin`` of 1). They are picked as ``e > c``; division is monotone,
    so every other token has probability <= b and these are the row's first ranks. Their mass
    (unsorted) must reach ``top_p + margin``: then the sorted running sum reaches ``top_p``
    inside them."""
    vocab = e_row.size
    tail = min(TOP_P_TAIL, vocab)
    while True:
        cut = total * ((1.0 - top_p) / (2 * tail))
        cols = np.flatnonzero(e_row > cut)
        probs = e_row[cols] / total  # the reference's division
        if probs.size and probs.min() <= cut / total:  # rounded down to b: not among the first ranks
            above = probs > cut / total
            cols, probs = cols[above], probs[above]
        if np.sum(probs) >= top_p + margin:
            return cols, probs
        if tail == vocab:
            return None
        tail = min(16 * tail, vocab)


def _binned_nucleus(
    probs: np.ndarray,  # float64 [n]; positive, the first ranks of a row (mass >= top_p), ascending token ids
    top_p: float,  # in (0, 1)
    margin: float,  # > twice the rounding of any summation order of these probabilities
) -> np.ndarray | None:  # int64 [N] ascending positions of the nucleus in probs; None when undecided
    """:func:`_nucleus` of one row without sorting it: the values fall into bins ordered like them (the
    top bits of the float64 pattern, 32 per octave), the bin where the mass reaches ``top_p`` is
    sorted, and the running sums are the mass of the bins above plus that bin's running sum. These
    differ from the descending sequential sums by less than ``margin / 2``, so the cut is the
    reference's when the last kept rank's preceding sum is < ``top_p - margin`` and the next's is
    ``>= top_p + margin``; else None (a running sum within ``margin`` of ``top_p``)."""
    key = probs.view(np.int64) >> 47  # non-negative floats order like their bit patterns
    low = int(key.min())
    through = np.cumsum(np.bincount(key - low, weights=probs)[::-1])  # mass down to each bin, top bin first
    j = int(np.searchsorted(through, top_p))  # the bin where the mass reaches top_p
    if j == through.size:
        return None
    mass_above = through[j - 1] if j else 0.0
    b = through.size - 1 - j + low  # its key
    in_bin = np.flatnonzero(key == b)
    w = np.sort(probs[in_bin])[::-1]
    pre = mass_above + np.cumsum(w)  # preceding mass of the next rank
    n_in = 1 + int(np.count_nonzero(pre[:-1] < top_p))
    before_last = pre[n_in - 2] if n_in > 1 else mass_above
    if not (before_last < top_p - margin and pre[n_in - 1] >= top_p + margin):
        return None
    bound = w[n_in - 1]  # the last kept value: above it all, of the equal ones the lowest ids
    keep = key > b
    greater = in_bin[probs[in_bin] > bound]
    keep[greater] = True
    keep[in_bin[probs[in_bin] == bound][: n_in - greater.size]] = True
    return np.flatnonzero(keep)


def top_p_probs(
    e: np.ndarray,  # float64 [R, vocab]; exp(z - max) per row (from _exp_rows); overwritten by the result
    total: np.ndarray,  # float64 [R, 1]; its row sums (pairwise)
    top_p: float,  # in (0, 1)
) -> np.ndarray:  # float64 [R, vocab]; the nucleus of e / total, renormalised, in e's buffer
    """Top-p of the softmax ``e / total`` without dividing or sorting whole rows, on each row's
    candidates (:func:`_top_p_candidates`): rows with at most ``2 * TOP_P_START`` of them together
    by :func:`_nucleus`, the others by :func:`_binned_nucleus` (:func:`_nucleus` where it cannot
    decide); the whole divided row by :func:`_nucleus` where the candidates cannot be shown to hold
    the nucleus."""
    R, vocab = e.shape
    margin = 2 * vocab * np.finfo(np.float64).eps
    found = [(r, _top_p_candidates(e[r], total[r, 0], top_p, margin)) for r in range(R)]
    whole = [r for r, c in found if c is None]
    found = [(r, c) for r, c in found if c is not None]
    narrow = [(r, c) for r, c in found if c[0].size <= 2 * TOP_P_START]
    kept_rows, kept_cols, kept_vals = [], [], []
    if narrow:
        width = max(c.size for _, (c, _) in narrow)
        cv = np.zeros((len(narrow), width))  # [N, width]; zero padding is never kept
        cc = np.zeros((len(narrow), width), dtype=np.int64)  # [N, width]; ascending token ids, then padding
        for n, (_, (c, v)) in enumerate(narrow):
            cv[n, : v.size] = v
            cc[n, : c.size] = c
        i, j = _nucleus(cv, top_p)
        kept_rows.append(np.array([r for r, _ in narrow], dtype=np.int64)[i])
        kept_cols.append(cc[i, j])
        kept_vals.append(cv[i, j])
    for r, (c, v) in found:
        if c.size <= 2 * TOP_P_START:
            continue
        j = _binned_nucleus(v, top_p, margin)
        if j is None:
            j = _nucleus(v[None], top_p)[1]
        kept_rows.append(np.full(j.size, r, dtype=np.int64))
        kept_cols.append(c[j])
        kept_vals.append(v[j])
    if whole:
        dense = e[whole] / total[whole]  # [W, vocab]
        i, j = _nucleus(dense, top_p)
        kept_rows.append(np.array(whole, dtype=np.int64)[i])
        kept_cols.append(j)
        kept_vals.append(dense[i, j])
    e.fill(0.0)
    return _renormalised(e, np.concatenate(kept_rows), np.concatenate(kept_cols), np.concatenate(kept_vals))


def _renormalised(
    out: np.ndarray,  # float64 [R, vocab], contiguous; zeros, filled here
    rows: np.ndarray,  # int64 [N]; row of each kept entry
    cols: np.ndarray,  # int64 [N]; token id of each kept entry
    vals: np.ndarray,  # float64 [N]; its probability before renormalising
) -> np.ndarray:  # out with out[rows, cols] = vals / (the dense row sum of the kept values)
    flat = out.reshape(-1)  # a view: out is contiguous
    at = rows * out.shape[-1] + cols  # [N] flat positions
    flat[at] = vals
    total = np.sum(out, axis=-1)  # [R]; pairwise over the dense row, as the full-sort version
    flat[at] = vals / total[rows]
    return out


def _nucleus(
    vals: np.ndarray,  # float64 [R, n]; non-negative; columns in ascending token-id order
    top_p: float,  # in (0, 1)
) -> tuple[np.ndarray, np.ndarray]:  # (rows int64 [N], cols int64 [N]) of the kept entries
    """The top-p set of each row: in descending value order, ties to the lowest column, every
    entry whose preceding mass (the running float64 sum in that order) is < top_p.

    The running sums need the values in descending order only, not which of two equal values
    comes first (swapping equal terms leaves every partial sum as it is), so a plain value sort
    gives the full stable sort's sums; the cut is then a value ``b`` (the last kept rank's):
    everything above ``b`` is kept and, of the entries equal to ``b``, the lowest columns.

    Only a candidate set is sorted: the ``m`` largest by ``np.argpartition``, ``t`` the m-th
    largest value. Every entry above ``t`` is a candidate, so the candidates above ``t`` are the
    row's first ranks. The row is decided when their mass reaches ``top_p`` (the next rank is out
    whatever it is) or when ``t == 0`` (nothing outside has mass); otherwise ``m`` doubles for
    the undecided rows (a cheap unsorted sum tells which cannot be decided yet; when none can,
    ``m`` grows by at least ``(top_p - mass above t) / t``, the fewest entries of value <= t that
    could make up the rest), and once ``2 * m > n`` they are sorted whole."""
    n = vals.shape[-1]
    kept_rows, kept_cols = [], []
    pending = np.arange(vals.shape[0])  # [P] rows not decided yet
    m = min(TOP_P_START, n)
    while pending.size:
        v = vals if pending.size == vals.shape[0] else vals[pending]  # [P, n]
        if 2 * m > n:  # sort whole rows
            cand = None
            cv = v
            done = np.ones(pending.size, dtype=bool)
        else:
            part = np.argpartition(v, n - m, axis=-1)  # [P, n]; the m largest at the end
            kth = np.take_along_axis(v, part[:, n - m:n - m + 1], axis=-1)  # [P, 1]
            cand = part[:, n - m:]  # [P, m] columns, in no order
            cv = np.take_along_axis(v, cand, axis=-1)  # [P, m]
            above_mass = np.sum(np.where(cv > kth, cv, 0.0), axis=-1)  # [P], any order
            # Rounding of the two summation orders differs by far less than 1e-6.
            maybe = (above_mass >= top_p - 1e-6) | (kth[:, 0] == 0.0)
            if not maybe.any():  # every entry outside is <= t: at least (top_p - mass) / t more needed
                short = (top_p - above_mass) / kth[:, 0]
                m = max(2 * m, m + int(min(float(np.max(short)), float(n))))
                continue
            cv, cand, kth = cv[maybe], cand[maybe], kth[maybe]
            done = np.zeros(pending.size, dtype=bool)
            done[np.flatnonzero(maybe)] = True  # refined below
        sv = np.sort(cv, axis=-1)[:, ::-1]  # [D, w] descending
        csum = np.cumsum(sv, axis=-1)  # running mass up to and including each rank
        n_keep = 1 + np.count_nonzero(csum[:, :-1] < top_p, axis=-1)  # [D]; rank 0 always kept
        rr = np.arange(sv.shape[0])
        if cand is not None:
            above = np.count_nonzero(cv > kth, axis=-1)  # [D] candidates strictly above t
            decided = ((above > 0) & (csum[rr, np.maximum(above, 1) - 1] >= top_p)) | (kth[:, 0] == 0.0)
            done[np.flatnonzero(done)[~decided]] = False
            cv, cand, n_keep, sv, rr = cv[decided], cand[decided], n_keep[decided], sv[decided], rr[:decided.sum()]
        bound = sv[rr, n_keep - 1][:, None]  # [D, 1] the last kept value
        keep = cv > bound  # [D, w]; all of them are candidates (bound > t, or bound == t == 0)
        need = n_keep - np.count_nonzero(keep, axis=-1)  # [D] entries equal to bound to keep
        positive = bound[:, 0] > 0.0  # a zero bound: the equal entries add nothing, leave them
        for d in np.flatnonzero(positive & (need > 0)):
            equal = np.flatnonzero(cv[d] == bound[d, 0])  # positions in cv
            if cand is not None:  # the lowest token ids among the tied candidates
                equal = equal[np.argsort(cand[d, equal], kind="stable")]
            keep[d, equal[: need[d]]] = True
        i, j = np.nonzero(keep)
        kept_rows.append(pending[done][i])
        kept_cols.append(j if cand is None else cand[i, j])
        pending = pending[~done]
        m *= 2
    return np.concatenate(kept_rows), np.concatenate(kept_cols)
