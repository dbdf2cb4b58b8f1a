"""Prefix KV cache across requests: block-hashed reuse of cached prompt positions, LRU-evicted under a memory bound
(pure bookkeeping: the cached arrays are opaque payloads the runners export and import). The decoding loop stores a
finished request's positions in blocks of :data:`BLOCK_TOKENS` tokens, and a joining request starts from the longest
run of its prompt's leading blocks found here. Block ``i`` is keyed by a chained hash of block ``i - 1``'s key and its
own token ids (:func:`block_hashes`: a key names the whole prefix). A block holds one payload per part, ``"target"``
(the verifier's K/V and features) and ``"draft"`` (a draft LM's K/V), looked up and evicted on its own; a lookup or
insert touches a chain from its last block to its first, so eviction removes a chain's tail before its head.
Exactness: reused positions hold the bytes the runner computed, which on the scatter layout do not depend on chunking
or batch, so greedy output is the same with and without the cache.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from dspark_runtime.errors import InputError

BLOCK_TOKENS = 16  # tokens per cached block
PARTS = ("target", "draft")


def block_hashes(tokens: Sequence[int], block: int = BLOCK_TOKENS) -> list:
    """Chained keys of the full blocks of ``tokens`` (ints): key ``i`` = BLAKE2b-128(key ``i - 1`` || int64 bytes of
    tokens[i*block:(i+1)*block]) as bytes (16 each); ``len(tokens) // block`` of them. Pure function.
    Raises InputError for ``block < 1``."""
    if block < 1:
        raise InputError(f"the prefix cache's block size must be >= 1 token, got {block!r}")
    ids = np.asarray(tokens, dtype=np.int64)
    keys, prev = [], b""
    for i in range(len(ids) // block):
        prev = hashlib.blake2b(prev + ids[i * block:(i + 1) * block].tobytes(), digest_size=16).digest()
        keys.append(prev)
    return keys


@dataclass
class PrefixCacheStats:
    """Counters of a :class:`PrefixCache` (tokens are prompt tokens; bytes are payload bytes).

    lookups: requests looked up; hits: lookups that reused at least one block; lookup_tokens: tokens offered to
    lookups (what could have been reused: each prompt less its last token); hit_tokens: tokens reused;
    inserted_blocks / evicted_blocks: block parts stored / evicted; blocks, bytes: held now; max_bytes: the bound.
    hit_rate: hit_tokens / lookup_tokens (0 before any lookup).
    """

    lookups: int = 0
    hits: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    blocks: int = 0
    bytes: int = 0
    max_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def to_json(self) -> dict:
        return dict(self.__dict__, hit_rate=self.hit_rate)


class PrefixCache:
    """Blocks of cached positions by prefix key and part, LRU-evicted under a byte bound.

    Args:
        max_bytes: bound on the payloads' bytes (int >= 1); a payload larger than it is not stored.
        block: tokens per block (:data:`BLOCK_TOKENS`).
    Raises InputError for a bound or block size below 1.
    """

    def __init__(self, max_bytes: int, block: int = BLOCK_TOKENS):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise InputError(f"the prefix cache's memory bound must be a positive number of bytes, got {max_bytes!r}")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise InputError(f"the prefix cache's block size must be a positive number of tokens, got {block!r}")
        self.block, self.max_bytes = block, max_bytes
        self._entries: OrderedDict = OrderedDict()  # (key, part) -> (payload, nbytes), least recent first
        self.stats = PrefixCacheStats(max_bytes=max_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _check_part(part: str) -> None:
        if part not in PARTS:
            raise InputError(f"unknown prefix cache part {part!r}; use one of {list(PARTS)}")

    def lookup(self, tokens: Sequence[int], part: str, *, count: bool = True) -> list:
        """Payloads of the longest run of leading blocks of ``tokens`` that hold ``part``, first block first (each
        covers :attr:`block` positions: the run covers ``len(result) * block`` leading tokens), touched as recently
        used. ``count``: add to the hit counters (the loop's target lookup; a drafter's own lookup of the same
        prompt does not count twice). Raises InputError for an unknown part."""
        self._check_part(part)
        run = []
        for key in block_hashes(tokens, self.block):
            entry = self._entries.get((key, part))
            if entry is None:
                break
            run.append((key, entry[0]))
        for key, _ in reversed(run):  # tail first: a head ends up more recent than the blocks after it
            self._entries.move_to_end((key, part))
        if count:
            st = self.stats
            st.lookups += 1
            st.lookup_tokens += len(tokens)
            st.hit_tokens += len(run) * self.block
            st.hits += bool(run)
        return [payload for _, payload in run]

    def insert(self, tokens: Sequence[int], part: str, export: Callable[[int, int], tuple]) -> int:
        """Store ``part`` for every full block of ``tokens`` (the ids of a request's cached positions 0..n-1) that
        does not hold it yet; ``export(start, end)`` returns ``(payload, nbytes)`` for positions start..end-1 and is
        called only for those blocks. Touches the chain as :meth:`lookup` does, then evicts least recently used
        blocks until the bytes are within the bound. Returns the blocks stored. Raises InputError for an unknown part."""
        self._check_part(part)
        keys = block_hashes(tokens, self.block)
        stored = 0
        for i, key in enumerate(keys):
            if (key, part) in self._entries:
                continue
            payload, nbytes = export(i * self.block, (i + 1) * self.block)
            if nbytes > self.max_bytes:
                break  # it could never be held; the blocks after it would be unreachable
            self._entries[(key, part)] = (payload, int(nbytes))
            self.stats.bytes += int(nbytes)
            self.stats.inserted_blocks += 1
            stored += 1
        for key in reversed(keys):
            if (key, part) in self._entries:
                self._entries.move_to_end((key, part))
        self._evict()
        return stored

    def _evict(self) -> None:
        st = self.stats
        while st.bytes > self.max_bytes and self._entries:
            _, (_, nbytes) = self._entries.popitem(last=False)
            st.bytes -= nbytes
            st.evicted_blocks += 1
        st.blocks = len(self._entries)

    def clear(self) -> None:
        """Drop every block (the counters stay)."""
        self._entries.clear()
        self.stats.bytes = 0
        self.stats.blocks = 0


def concat_blocks(blocks: list) -> tuple:
    """Join block payloads ``(kv, features)`` — kv: per layer (key, value) float32 [kv_heads, block, head_dim];
    features: float32 [block, F] or None — along the position axis: ``(kv [kv_heads, n, head_dim] per layer,
    features [n, F] or None)``. Pure function; raises ValueError for an empty list."""
    if not blocks:
        raise ValueError("no blocks to join")
    kv = [(np.concatenate([b[0][i][0] for b in blocks], axis=1), np.concatenate([b[0][i][1] for b in blocks], axis=1))
          for i in range(len(blocks[0][0]))]
    feats = None if blocks[0][1] is None else np.concatenate([b[1] for b in blocks], axis=0)
    return kv, feats


def payload_bytes(payload: tuple) -> int:
    """Bytes of a block payload ``(kv, features)``."""
    kv, feats = payload
    return int(sum(k.nbytes + v.nbytes for k, v in kv) + (0 if feats is None else feats.nbytes))

