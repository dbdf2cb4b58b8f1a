"""The runner interfaces: :class:`BatchRunner`, what the decoding loop drives (a decoder graph plus the KV cache of the
requests it decodes), and :class:`SequenceDecoder`, one sequence over a decoder graph. Each declares its capabilities
with defaults, so callers read them instead of probing. Implementations: :mod:`dspark_runtime.runners.sequence`,
:mod:`~dspark_runtime.runners.packed`, :mod:`~dspark_runtime.runners.scatter`, :mod:`~dspark_runtime.runners.device`;
:mod:`dspark_runtime.runners.factory` picks one for a graph.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from dspark_runtime.errors import DSparkError

PREFILL_CHUNK = 256  # prompt tokens per prefill step (its logits are [tokens, vocab] float32)

_NO_KV_IO = ("cannot export or import cached positions (the prefix cache needs the scatter KV layout); rebuild the "
             "engine with --kv-layout scatter")


def store_features(buf: np.ndarray | None, start: int, f: np.ndarray) -> np.ndarray:
    """Write target features ``f`` (float32 [q, F]) at positions start..start+q-1 of the per-position buffer ``buf``
    (float32 [capacity, F] or None), grown by doubling (at least 1,024 rows) when it is too short; returns the buffer
    (the same one, or its grown copy holding positions 0..start-1)."""
    end = start + f.shape[0]
    if buf is None or buf.shape[0] < end:
        grown = np.empty((max(1024, 2 * end), f.shape[-1]), dtype=np.float32)
        if buf is not None:
            grown[:start] = buf[:start]
        buf = grown
    buf[start:end] = f
    return buf


class BatchRunner(ABC):
    """Several requests over one decoder graph: ``add``/``remove`` a request, ``step(segments)`` one graph call for
    several of them, ``rollback``. Keeps per request its cached length and its target features by position (float32
    [capacity, F], grown by doubling); subclasses set ``self._length`` / ``self._feats`` entries in ``add`` and
    ``step`` and free their own KV slots in ``remove`` / ``rollback``.

    Capabilities (class attributes; subclasses override):
        row_multiple: every call's rows are padded to a multiple of this.
        max_chunk: the most tokens one segment of a call may carry.
        step_hints: ``step`` takes ``argmax_for`` / ``last_only`` (compute or copy back only what the caller reads).
        keep_features: target features come back to the host (``features``).
        can_import_kv: ``export_kv`` / ``import_kv`` of cached positions work (the prefix cache).
        fixed_call_shapes: every call runs at a fixed shape, so a prompt is best fed whole ``max_chunk`` chunks.
        batch_invariant: a request's logits do not depend on the requests sharing its calls.
        can_skip_padding_head: ``head_skips_padding`` may be set (the graph takes ``logits_to``).
        takes_prompt_graph: ``prompt_backend`` may be set (prompt chunks on a prompt graph: the scatter runners).
        prompts_apart: prompt chunks run on another graph than decoding (a prompt graph), so a prompt's cached
            positions differ from what decoding the same tokens caches (the prefix cache keeps prompt positions only).

    Settings: ``row_multiple`` (above); ``head_skips_padding``: the LM head runs on a padded call's real query
    positions only (where the row probe found the head row-count invariant,
    :mod:`dspark_runtime.machine.row_invariance`).
    """

    row_multiple = 1
    head_skips_padding = False
    can_skip_padding_head = False
    takes_prompt_graph = False
    prompts_apart = False
    max_chunk = PREFILL_CHUNK
    step_hints = False
    keep_features = True
    can_import_kv = False
    fixed_call_shapes = False
    batch_invariant = True

    def __init__(self):
        self._length: dict = {}  # rid -> committed cached positions
        self._feats: dict = {}  # rid -> float32 [capacity, F] target features by position

    # -- what a runner implements

    @abstractmethod
    def add(self, rid) -> None:
        """Register request ``rid`` with an empty cache."""

    @abstractmethod
    def remove(self, rid) -> None:
        """Forget request ``rid`` and free its cache (no-op for an unknown id)."""

    @abstractmethod
    def rollback(self, rid, length: int) -> None:
        """Keep the first ``length`` cached positions of ``rid``. Raises ValueError beyond them."""

    @abstractmethod
    def step(self, segments: list) -> list:
        """Feed every ``(rid, tokens)`` of ``segments`` after that request's cached positions, in one call; returns
        float32 [q_r, vocab] logits per segment, in order (a runner with ``step_hints`` also takes ``argmax_for`` and
        ``last_only``)."""

    # -- queries

    def __contains__(self, rid) -> bool:
        return rid in self._length

    @property
    def requests(self) -> list:
        """The registered request ids, in the order they were added."""
        return list(self._length)

    def length(self, rid) -> int:
        """Cached positions of request ``rid``."""
        return self._length[rid]

    def pass_rows(self, lengths: list) -> int:
        """Query rows one ``step`` over segments of these token counts computes, padding included: here the
        segments packed end to end, padded to a multiple of ``row_multiple`` (the scatter layout computes
        ``segments x longest``). What the chunked-prefill planner and the scheduler weigh."""
        n = sum(lengths)
        return n + (-n) % self.row_multiple

    def attended_positions(self, rids) -> int:
        """Cached positions a ``step`` over requests ``rids`` reads per row: what its cost grows with besides its
        tokens (the cost table's context buckets, :mod:`dspark_runtime.scheduling.cost_table`). Here the longest
        request's cached length (0 for none); layouts that read whole slot arrays say so."""
        return max((self._length[r] for r in rids), default=0)

    def features(self, rid) -> np.ndarray | None:
        """Target features of ``rid``'s cached positions, float32 [length, F] (a view), or None when the graph
        outputs none. Rolled back with the cache."""
        f = self._feats.get(rid)
        return None if f is None else f[: self._length[rid]]

    def export_kv(self, rid, start: int, end: int) -> tuple:
        """Request ``rid``'s cached positions start..end-1 (the prefix cache's payload). Raises DSparkError unless
        ``can_import_kv``."""
        raise DSparkError(f"{type(self).__name__} {_NO_KV_IO}")

    def import_kv(self, rid, kv: list, features) -> None:
        """Fill an empty request's first positions from :meth:`export_kv`'s arrays. Raises DSparkError unless
        ``can_import_kv``."""
        raise DSparkError(f"{type(self).__name__} {_NO_KV_IO}")

    def prefill(self, rid, tokens: list, chunk: int = PREFILL_CHUNK) -> np.ndarray:
        """Feed request ``rid``'s prompt in chunks; returns the last position's logits float32 [vocab] (a runner with
        ``step_hints`` computes no other position's)."""
        logits = None
        kw = {"last_only": {rid}} if self.step_hints else {}
        for s in range(0, len(tokens), chunk):
            logits = self.step([(rid, tokens[s:s + chunk])], **kw)[0]
        return logits[-1]

    # -- for subclasses

    def _check_segments(self, segments: list) -> None:
        """Raise DSparkError for a segment of an unknown or repeated request id, or an empty one."""
        seen = set()
        for rid, toks in segments:
            if rid not in self._length:
                raise DSparkError(f"request {rid!r} is not in the cache; add() it first")
            if rid in seen:
                raise DSparkError(f"request {rid!r} appears twice in one step")
            if not len(toks):
                raise DSparkError(f"request {rid!r}: empty segment (feed at least one token)")
            seen.add(rid)

    def _check_rollback(self, rid, length: int) -> None:
        if not 0 <= length <= self._length[rid]:
            raise ValueError(f"cannot roll request {rid!r} back to {length}: it holds {self._length[rid]} positions")

    def _store_features(self, rid, start: int, f: np.ndarray) -> None:
        self._feats[rid] = store_features(self._feats.get(rid), start, f)


class SequenceDecoder(ABC):
    """One sequence over a decoder graph: ``step(tokens)`` feeds tokens after the cached ones and returns logits
    float32 [q, vocab]; ``rollback``, ``reset``, ``prefill``; ``length`` and ``features`` (float32 [length, F] or
    None). Capabilities and settings as :class:`BatchRunner`'s (``step_hints``: ``step`` takes ``last_only``)."""

    row_multiple = 1
    head_skips_padding = False
    can_skip_padding_head = False
    takes_prompt_graph = False
    prompts_apart = False
    max_chunk = PREFILL_CHUNK
    step_hints = False
    can_import_kv = False

    @property
    @abstractmethod
    def length(self) -> int:
        """Cached positions."""

    @property
    def features(self) -> np.ndarray | None:
        return None

    @abstractmethod
    def reset(self) -> None:
        """Forget every cached position."""

    @abstractmethod
    def step(self, tokens) -> np.ndarray:
        """Feed ``tokens`` (q >= 1) after the cached ones; logits float32 [q, vocab]."""

    @abstractmethod
    def prefill(self, tokens, chunk: int = PREFILL_CHUNK) -> np.ndarray:
        """Feed a prompt in chunks; the last position's logits [vocab]."""

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""

    def attended_positions(self) -> int:
        """Cached positions the next call reads (the cost table's context): here the cached length."""
        return self.length

    def export_kv(self, start: int, end: int) -> tuple:
        """Cached positions start..end-1 (the prefix cache's payload). Raises DSparkError unless ``can_import_kv``."""
        raise DSparkError(f"{type(self).__name__} {_NO_KV_IO}")

    def import_kv(self, kv: list, features) -> None:
        """Fill the (empty) sequence from :meth:`export_kv`'s arrays. Raises DSparkError unless ``can_import_kv``."""
        raise DSparkError(f"{type(self).__name__} {_NO_KV_IO}")
