"""The one-sequence runners: :class:`DecoderRunner` (one sequence over a growing/capacity-layout graph, its own KV
cache; probes, the profiler and feature extraction use it directly) and :class:`SequenceRunner` (a
:class:`~dspark_runtime.runners.base.BatchRunner` holding exactly one request over a one-sequence runner: the loop's
runner for a request decoded alone, its cache cut at every rollback, so speculative greedy output is bit-identical to
target-only).
"""
from __future__ import annotations

import numpy as np

from dspark_runtime.backends.ort import OrtDecoder
from dspark_runtime.errors import DSparkError
from dspark_runtime.runners.base import PREFILL_CHUNK, BatchRunner, SequenceDecoder, store_features
from dspark_runtime.runners.kvcache import KVCache, causal_mask


class DecoderRunner(SequenceDecoder):
    """One sequence's view of a decoder graph: the backend plus its KV cache.

    ``step(tokens)`` feeds tokens after the cached ones and returns logits float32 [q, vocab].

    ``row_multiple`` (int >= 1): every graph call is padded to a multiple of this many rows (the extra
    rows repeat the last token after the real ones; their logits and KV entries are dropped), which makes
    the verifier's results independent of the call's row count where the kernels are not
    (:mod:`dspark_runtime.machine.row_invariance`). 1 = no padding.
    """

    def __init__(self, backend: OrtDecoder, row_multiple: int = 1):
        self.backend = backend
        self.row_multiple = row_multiple
        self.cache = KVCache(backend.empty_kv(1))
        self._feats = None  # float32 [capacity, m * hidden]: target features by position (DSpark context)

    @property
    def features(self) -> np.ndarray | None:
        """Target features of the cached positions, float32 [length, m * hidden] (a view), or None when
        the graph outputs none. Rolled back with the KV cache (same length pointer)."""
        return None if self._feats is None else self._feats[: self.cache.length]

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def step(self, tokens) -> np.ndarray:
        """Feed ``tokens`` (list of int, q >= 1) at positions length..length+q-1; returns [q, vocab].
        The call is padded to a multiple of ``row_multiple`` rows (padding never reaches the cache length,
        the logits or the features)."""
        q, past = len(tokens), self.cache.length
        fed = list(tokens) + [tokens[-1]] * ((-q) % self.row_multiple)
        n = len(fed)
        ids = np.asarray(fed, dtype=np.int64)[None]
        pos = np.arange(past, past + n, dtype=np.int64)[None]
        out = self.backend.step(ids, pos, causal_mask(n, past), self.cache.view())
        self.cache.update(out.kv, past + q)
        if out.features is not None:
            self._feats = store_features(self._feats, past, out.features[0, :q])
        return out.logits[0, :q]

    def chunk_limit(self, chunk: int = PREFILL_CHUNK) -> int:
        """The tokens one call may carry when asked for ``chunk``: at most the backend's ``max_q`` where it has one
        (a TensorRT engine's prefill profile), rounded down to a multiple of ``row_multiple`` (a padded chunk must
        still fit ``max_q``)."""
        chunk = min(chunk, getattr(self.backend, "max_q", chunk))
        if chunk > self.row_multiple:
            chunk -= chunk % self.row_multiple
        return chunk

    @property
    def max_chunk(self) -> int:
        """The prompt tokens one call carries (:meth:`chunk_limit` of :data:`PREFILL_CHUNK`)."""
        return self.chunk_limit()

    def prefill(self, tokens, chunk: int = PREFILL_CHUNK) -> np.ndarray:
        """Feed a prompt in chunks of ``chunk`` tokens (:meth:`chunk_limit`); returns the last position's logits
        [vocab]."""
        chunk = self.chunk_limit(chunk)
        logits = None
        for s in range(0, len(tokens), chunk):
            logits = self.step(tokens[s:s + chunk])
        return logits[-1]

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)


class SequenceRunner(BatchRunner):
    """A :class:`~dspark_runtime.runners.base.BatchRunner` over a one-sequence runner (a
    :class:`~dspark_runtime.runners.base.SequenceDecoder`: :class:`DecoderRunner`, or the scatter layout's
    :class:`~dspark_runtime.runners.scatter.ScatterSequence`): it holds at most one request at a time, and each call is
    that runner's own call (its row padding, its prefill chunking by a TensorRT engine's ``max_q``); its capabilities
    are that runner's.

    Args:
        runner: the one-sequence runner (reset when a request is added).
    Raises DSparkError when a second request is added while one is held.
    """

    def __init__(self, runner):
        super().__init__()
        self.runner = runner
        self._rid = None

    @property
    def row_multiple(self) -> int:
        return self.runner.row_multiple

    @property
    def max_chunk(self) -> int:
        """The prompt tokens one call carries: the one-sequence runner's own limit (a TensorRT engine's ``max_q``)."""
        return self.runner.max_chunk

    def add(self, rid) -> None:
        """Hold request ``rid`` (empty cache). Raises DSparkError when another request is held."""
        if self._rid is not None:
            raise DSparkError(f"this runner decodes one request at a time and holds request {self._rid!r}; "
                              "remove it first (or use a batched runner: max_batch > 1)")
        self.runner.reset()
        self._rid = rid
        self._length[rid] = 0

    def remove(self, rid) -> None:
        """Forget request ``rid`` (no-op for another id)."""
        if rid == self._rid:
            self._rid = None
            self._length.pop(rid, None)

    def features(self, rid) -> np.ndarray | None:
        if rid != self._rid:
            raise KeyError(rid)
        return self.runner.features

    def attended_positions(self, rids) -> int:
        """Cached positions the held request's next call reads: the one-sequence runner's own count (the scatter
        layout's slot buffer, else its cached length)."""
        return max(super().attended_positions(rids), self.runner.attended_positions())

    def rollback(self, rid, length: int) -> None:
        """Keep the first ``length`` positions. Raises ValueError beyond the cached positions."""
        self._check_rollback(rid, length)
        self.runner.rollback(length)
        self._length[rid] = length

    @property
    def step_hints(self) -> bool:
        """Whether ``step`` takes the loop's ``last_only`` (the one-sequence runner's ``step(tokens, last_only)``)."""
        return self.runner.step_hints

    def step(self, segments: list, argmax_for=(), last_only=()) -> list:
        """One ``(rid, tokens)`` segment (the held request); returns [float32 [q, vocab] logits] ([1, vocab] when
        ``rid`` is in ``last_only`` and the runner takes it; ``argmax_for`` is ignored)."""
        self._check_segments(segments)
        if len(segments) != 1:
            raise DSparkError(f"this runner decodes one request at a time; got {len(segments)} segments")
        rid, toks = segments[0]
        out = self.runner.step(list(toks), last_only=True) if rid in last_only and self.step_hints \
            else self.runner.step(list(toks))
        self._length[rid] = self.runner.length
        return [out]

    def export_kv(self, rid, start: int, end: int) -> tuple:
        """The held request's positions start..end-1 as the runner exports them (scatter layout:
        :meth:`~dspark_runtime.runners.scatter.ScatterSequence.export_kv`). Raises DSparkError for a runner that
        cannot."""
        return self.runner.export_kv(start, end)

    def import_kv(self, rid, kv: list, features) -> None:
        """Fill the held (empty) request's first positions from cached arrays (:meth:`export_kv`'s form)."""
        self.runner.import_kv(kv, features)
        self._length[rid] = self.runner.length

    @property
    def can_import_kv(self) -> bool:
        return self.runner.can_import_kv

    @property
    def prompts_apart(self) -> bool:
        return self.runner.prompts_apart

    def prefill(self, rid, tokens: list, chunk: int = PREFILL_CHUNK) -> np.ndarray:
        """The held request's prompt through the runner's own chunked prefill; the last position's logits [vocab]."""
        self._check_segments([(rid, tokens)])
        logits = self.runner.prefill(list(tokens), chunk)
        self._length[rid] = self.runner.length
        return logits
