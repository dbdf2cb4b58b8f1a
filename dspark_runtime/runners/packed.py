"""Packed KV cache for several requests in one growing-layout decoder graph: all requests' tokens run as **one packed
row** with a block-diagonal causal mask, so a round verifying ``1 + l_r`` tokens per request costs
``B = sum_r (1 + l_r)`` positions (the cost table's and the paper's Algorithm 1's verify batch size), not
``R * (1 + max_r l_r)``. Every cached slot records its owner (request id, -1 when free) and its position in that
request; query i sees key j iff they share an owner and ``pos[j] <= pos[i]``. Keys are stored after RoPE, so a slot's
place in the array is irrelevant. Rolling back frees slots (no copy); :meth:`PackedRunner.compact` gathers the live
slots to the front when free ones exceed a quarter of the array.
"""
from __future__ import annotations

import numpy as np

from dspark_runtime.backends.ort import OrtDecoder
from dspark_runtime.errors import DSparkError
from dspark_runtime.runners.base import BatchRunner


class PackedRunner(BatchRunner):
    """Several requests' views of one ``causal_lm`` graph, packed into a single row.

    Requests are identified by any hashable id. ``add(rid)`` registers one (length 0), ``step(segments)``
    feeds each listed request's new tokens in one graph call, ``rollback``/``remove`` free slots. Not
    ``batch_invariant``: ONNX Runtime's CPU kernels round a request's packed keys differently with its neighbours.

    Args:
        backend: an activated (or lazily activating) :class:`OrtDecoder` of a ``causal_lm`` graph.
        compact_ratio: compact when free slots exceed this fraction of the array (and 64 slots).
        row_multiple: every call is padded to a multiple of this many rows, as the single-request runner
            (:class:`~dspark_runtime.runners.sequence.DecoderRunner`) pads its calls: the probed row padding
            (:mod:`dspark_runtime.machine.row_invariance`) under which the verifier's results do not depend on the call's row
            count. A padding row repeats the call's last token one position on and sees only itself; its slot is
            dropped after the call (the backend copies the trimmed arrays on the next call, as it does for the
            single runner); it never reaches a request's logits, features or length.
    """

    batch_invariant = False

    def __init__(self, backend: OrtDecoder, compact_ratio: float = 0.25, row_multiple: int = 1):
        if int(row_multiple) < 1:
            raise DSparkError(f"row_multiple must be a positive integer (1 = no padding), got {row_multiple!r}")
        super().__init__()
        self.backend = backend
        self.compact_ratio = compact_ratio
        self.row_multiple = int(row_multiple)
        self._kv = backend.empty_kv(1)
        self._owner = np.zeros(0, dtype=np.int64)  # request index per slot, -1 = free
        self._pos = np.zeros(0, dtype=np.int64)  # position in its request's sequence
        self._index: dict = {}  # rid -> small int used in _owner
        self._next = 0

    # -- requests

    def add(self, rid) -> None:
        """Register request ``rid`` with an empty sequence. Raises DSparkError if it is already here."""
        if rid in self._index:
            raise DSparkError(f"request {rid!r} is already in the packed cache")
        self._index[rid] = self._next
        self._next += 1
        self._length[rid] = 0

    def remove(self, rid) -> None:
        """Forget request ``rid`` and free its slots (no-op for an unknown id)."""
        i = self._index.pop(rid, None)
        if i is None:
            return
        self._owner[self._owner == i] = -1
        self._length.pop(rid, None)
        self._feats.pop(rid, None)

    def rollback(self, rid, length: int) -> None:
        """Keep the first ``length`` positions of ``rid``; frees the slots past them.

        Raises ValueError if ``length`` is negative or beyond the request's cached positions."""
        self._check_rollback(rid, length)
        if length < self._length[rid]:
            self._owner[(self._owner == self._index[rid]) & (self._pos >= length)] = -1
        self._length[rid] = length

    @property
    def slots(self) -> int:
        """Slots in the K/V arrays (live + free)."""
        return int(self._owner.size)

    def attended_positions(self, rids) -> int:
        """Positions a call reads: every slot of the shared row (all requests' cached positions, and free slots
        until the next compaction), at least the longest request's cached length."""
        return max(self.slots, super().attended_positions(rids))

    @property
    def live_slots(self) -> int:
        return int((self._owner >= 0).sum())

    def compact(self, force: bool = False) -> None:
        """Gather the live slots to the front of the arrays (one copy) when free slots exceed
        ``compact_ratio`` of the array and 64 slots, or always with ``force``."""
        free = self.slots - self.live_slots
        if not free or (not force and (free < 64 or free < self.compact_ratio * self.slots)):
            return
        keep = np.flatnonzero(self._owner >= 0)
        self._kv = [(np.ascontiguousarray(k[:, :, keep]), np.ascontiguousarray(v[:, :, keep])) for k, v in self._kv]
        self._owner = self._owner[keep]
        self._pos = self._pos[keep]

    def nbytes(self) -> int:
        """Bytes held by the K/V arrays."""
        return int(sum(k.nbytes + v.nbytes for k, v in self._kv))

    # -- the graph call

    def step(self, segments: list) -> list:
        """Feed every ``(rid, tokens)`` of ``segments`` after that request's cached positions, in one
        graph call.

        Args:
            segments: list of (rid, list[int] of q_r >= 1 tokens); each rid at most once.
        Returns:
            list of float32 [q_r, vocab] logits, in the order of ``segments``.
        Raises DSparkError for an unknown or repeated request id or an empty segment.
        """
        if not segments:
            return []
        self._check_segments(segments)
        ids, pos, own = [], [], []
        for rid, toks in segments:
            n0, q = self._length[rid], len(toks)
            ids.append(np.asarray(toks, dtype=np.int64))
            pos.append(np.arange(n0, n0 + q, dtype=np.int64))
            own.append(np.full(q, self._index[rid], dtype=np.int64))
        pad = (-sum(len(t) for _, t in segments)) % self.row_multiple
        if pad:  # padding rows: the last token again, one position on each, owned by no request
            ids.append(np.full(pad, ids[-1][-1], dtype=np.int64))
            pos.append(pos[-1][-1] + 1 + np.arange(pad, dtype=np.int64))
            own.append(np.full(pad, -1, dtype=np.int64))
        ids, pos, own = np.concatenate(ids), np.concatenate(pos), np.concatenate(own)
        self.compact()
        key_own = np.concatenate([self._owner, own])
        key_pos = np.concatenate([self._pos, pos])
        mask = (key_own[None, :] == own[:, None]) & (key_pos[None, :] <= pos[:, None]) & (own[:, None] >= 0)
        if pad:  # a padding row sees only its own key (free slots are never visible)
            n = own.size
            mask[n - pad:, key_own.size - pad:] = np.eye(pad, dtype=bool)
        out = self.backend.step(ids[None], pos[None], mask[None, None], self._kv)
        self._kv = out.kv
        self._owner, self._pos = key_own, key_pos
        if pad:  # drop the padding slots (the last ones), as the single runner drops its padding positions
            self._kv = [(k[:, :, :-pad], v[:, :, :-pad]) for k, v in self._kv]
            self._owner, self._pos = key_own[:-pad], key_pos[:-pad]
        results, off = [], 0
        for rid, toks in segments:
            q = len(toks)
            n0 = self._length[rid]
            if out.features is not None:
                self._store_features(rid, n0, out.features[0, off:off + q])
            results.append(out.logits[0, off:off + q])
            self._length[rid] = n0 + q
            off += q
        return results
