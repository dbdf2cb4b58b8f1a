"""KV-cache manager for the *growing* layout with O(1) rollback.

The graph returns past+new keys/values for every layer; the cache keeps those arrays and a
length pointer. Rolling back rejected draft positions only moves the pointer; the stale tail is
cut off (one contiguous copy, if any) the next time the cache is fed to the graph.
"""
from __future__ import annotations

import numpy as np


class KVCache:
    """Per-layer (key, value) arrays, float32 [batch, kv_heads, capacity_used, head_dim], plus the
    number of valid positions ``length``.

    Args:
        empty: per-layer (key, value) arrays with 0 positions (from the backend's ``empty_kv``).
    """

    def __init__(self, empty: list):
        self._kv = empty
        self._empty = empty
        self.length = 0

    def view(self) -> list:
        """The valid part, per layer (key, value) [batch, kv_heads, length, head_dim].

        No copy when nothing was rolled back since the last update; otherwise a slice view (the
        backend makes it contiguous when feeding it).
        """
        if self._kv[0][0].shape[-2] == self.length:
            return self._kv
        n = self.length
        return [(k[..., :n, :], v[..., :n, :]) for k, v in self._kv]

    def update(self, present: list, new_length: int | None = None) -> None:
        """Adopt the graph's present KV (past + new positions) as the cache."""
        self._kv = present
        self.length = present[0][0].shape[-2] if new_length is None else new_length

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` positions (O(1): moves the length pointer).

        Raises ValueError if ``length`` is negative or beyond the valid positions.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} positions")
        self.length = length

    def reset(self) -> None:
        """Forget everything (length 0)."""
        self._kv = self._empty
        self.length = 0

    def nbytes(self) -> int:
        """Bytes held by the cache arrays (including a rolled-back tail not yet cut off)."""
        return int(sum(k.nbytes + v.nbytes for k, v in self._kv))


def causal_mask(q_len: int, past_len: int) -> np.ndarray:
    """Boolean attention mask [1, 1, q_len, past_len + q_len] for one sequence: query i (at
    absolute position past_len + i) sees keys 0..past_len + i."""
    return np.tril(np.ones((q_len, past_len + q_len), dtype=bool), k=past_len)[None, None]
