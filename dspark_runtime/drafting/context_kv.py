"""A drafter's context K/V for many requests (:class:`ContextKV`): one row per request, padded to the longest, with a
validity mask. The DSpark and EAGLE-3 drafters keep the K/V of committed positions here (never rolled back: only
committed positions enter it)."""
from __future__ import annotations

import numpy as np

from dspark_runtime.errors import DSparkError


def anchor_position(req, target, cached: int, who: str) -> int:
    """The position of request ``req``'s anchor (its prompt and committed tokens, less one): the positions the
    target runner ``target`` must hold for it, and at or past the ``cached`` positions of the drafter ``who``
    ("DSpark drafter"). Raises DSparkError naming the three counts when they are out of sync."""
    p = len(req.prompt) + len(req.out) - 1
    if target.length(req.rid) != p or cached > p:
        raise DSparkError(f"{who} out of sync for request {req.rid}: target holds {target.length(req.rid)} positions, "
                          f"anchor at {p}, drafter context {cached}")
    return p


class ContextKV:
    """Per drafter layer keys and values float32 [R, kv_heads, S, head_dim] and ``valid`` bool [R, S]: row r's
    slots that hold an entry of request ``rows[r]`` (the others are padding, masked out of attention). Rows join
    empty and leave between rounds; :meth:`compact` gathers the padding away once it exceeds a quarter of S.

    Args:
        empty: the backend's ``empty_kv(0)`` (per layer (key, value) with zero rows and zero slots).
    """

    def __init__(self, empty: list):
        self.kv = list(empty)
        self.valid = np.zeros((0, 0), dtype=bool)
        self.rows: list = []

    def add(self, rid) -> None:
        """Request ``rid`` joins as a last row with no valid slot."""
        self.rows.append(rid)
        self.kv = [(np.concatenate([k, _zero_row(k)]), np.concatenate([v, _zero_row(v)])) for k, v in self.kv]
        self.valid = np.concatenate([self.valid, np.zeros((1, self.valid.shape[1]), dtype=bool)])

    def remove(self, rid) -> None:
        """Request ``rid`` leaves (no-op for an unknown id)."""
        if rid not in self.rows:
            return
        i = self.rows.index(rid)
        self.rows.pop(i)
        self.kv = [(np.delete(k, i, axis=0), np.delete(v, i, axis=0)) for k, v in self.kv]
        self.valid = np.delete(self.valid, i, axis=0)

    def gather(self, idx) -> tuple:
        """(K/V per layer, validity) of rows ``idx`` (copies; every row: the arrays themselves)."""
        if len(idx) == len(self.rows) and list(idx) == list(range(len(self.rows))):
            return self.kv, self.valid
        idx = np.asarray(idx, dtype=np.int64)
        return [(k[idx], v[idx]) for k, v in self.kv], self.valid[idx]

    def write(self, idx, kv: list, valid: np.ndarray) -> None:
        """Rows ``idx`` now hold ``kv`` [len(idx), kvh, S', hd] with validity ``valid`` [len(idx), S'] (S' >= S: their
        old slots first, new ones after); the other rows keep theirs, padded with invalid slots."""
        if len(idx) == len(self.rows) and list(idx) == list(range(len(self.rows))):
            self.kv, self.valid = list(kv), valid
            return
        idx = np.asarray(idx, dtype=np.int64)
        width = max(self.valid.shape[1], valid.shape[1])
        new_kv = []
        for (k, v), (nk, nv) in zip(self.kv, kv):
            k2 = np.zeros(k.shape[:2] + (width,) + k.shape[3:], dtype=k.dtype)
            v2 = np.zeros_like(k2)
            k2[:, :, : k.shape[2]], v2[:, :, : v.shape[2]] = k, v
            k2[idx, :, : nk.shape[2]], v2[idx, :, : nv.shape[2]] = nk, nv
            new_kv.append((k2, v2))
        vd = np.zeros((len(self.rows), width), dtype=bool)
        vd[:, : self.valid.shape[1]] = self.valid
        vd[idx] = False
        vd[idx, : valid.shape[1]] = valid
        self.kv, self.valid = new_kv, vd

    def compact(self) -> None:
        """Gather every row's valid slots to its front when the padding exceeds max(64, S/4) slots."""
        S = self.valid.shape[1]
        counts = self.valid.sum(axis=1)
        keep = int(counts.max()) if counts.size else 0
        if S - keep < max(64, S // 4):
            return
        new_kv = []
        for k, v in self.kv:
            nk = np.zeros(k.shape[:2] + (keep,) + k.shape[3:], dtype=k.dtype)
            nv = np.zeros_like(nk)
            for r in range(len(self.rows)):
                idx = np.flatnonzero(self.valid[r])
                nk[r, :, : idx.size] = k[r][:, idx]
                nv[r, :, : idx.size] = v[r][:, idx]
            new_kv.append((nk, nv))
        self.kv = new_kv
        self.valid = np.arange(keep)[None, :] < counts[:, None]


def _zero_row(a: np.ndarray) -> np.ndarray:
    return np.zeros((1,) + a.shape[1:], dtype=a.dtype)
