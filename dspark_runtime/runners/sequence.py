"""Runners: a decoder graph plus the KV cache of the requests it decodes — what the decoding loop
(:mod:`dspark_runtime.decoding.loop`) steps, rolls back and reads target features from.

* :class:`BatchRunner` — the interface of every runner the loop drives (``add``/``remove`` a request,
  ``step(segments)`` one graph call for several requests, ``rollback``, ``length``, ``features``, ``prefill``),
  with the bookkeeping they share.
* :class:`DecoderRunner` — one sequence over a growing/capacity-layout graph (its own KV cache; probes, the
  profiler and the feature extraction of drafter training use it directly).
* :class:`SequenceRunner` — a :class:`BatchRunner` holding exactly one request over a one-sequence runner: the loop's
  runner for a request decoded alone on the growing layout (its KV cache is cut at every rollback, so speculative
  greedy output is bit-identical to target-only).
* :class:`~dspark_runtime.runners.packed.PackedRunner` (growing layout, several requests packed into one row),
  :class:`~dspark_runtime.runners.scatter.ScatterRunner` (scatter layout, one batch row per request) and
  :class:`~dspark_runtime.runners.device.DeviceBatchRunner` (a TensorRT engine, one row per request, fixed call shapes)
  live in their modules.

:func:`batch_runner` picks one for a graph and a request count; :func:`decoder_runner` the one-sequence runner.
"""
from __future__ import annotations

import numpy as np

from dspark_runtime.backends.ort import OrtDecoder
from dspark_runtime.errors import DSparkError
from dspark_runtime.runners.kvcache import KVCache, causal_mask

PREFILL_CHUNK = 256  # prompt tokens per prefill step (its logits are [tokens, vocab] float32)


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


class BatchRunner:
    """What every several-requests runner keeps per request: its cached length and its target features by position
    (float32 [capacity, F], grown by doubling), with the queries, the rollback check and the chunked prefill on top of
    the subclass's ``step(segments)``. Subclasses set ``self._length`` / ``self._feats`` entries in ``add`` and
    ``step`` and free their own KV slots in ``remove`` / ``rollback``."""

    row_multiple = 1  # every call's rows are padded to a multiple of this (subclasses set theirs)
    max_chunk = PREFILL_CHUNK  # the most tokens one segment of a call may carry
    can_import_kv = False  # export_kv / import_kv of cached positions (the prefix cache): the scatter layout

    def __init__(self):
        self._length: dict = {}  # rid -> committed cached positions
        self._feats: dict = {}  # rid -> float32 [capacity, F] target features by position

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
        segments packed end to end, padded to a multiple of ``row_multiple`` (the packed layout; the scatter
        layout's :class:`~dspark_runtime.runners.scatter.ScatterRunner` computes ``segments x longest``). What the chunked
        prefill planner (:func:`dspark_runtime.scheduling.prefill.plan_prefill`) weighs."""
        n = sum(lengths)
        return n + (-n) % self.row_multiple

    def attended_positions(self, rids) -> int:
        """Cached positions a ``step`` over requests ``rids`` reads per row: what its cost grows with besides its
        tokens (the cost table's context buckets, :mod:`dspark_runtime.scheduling.cost_table`). Here the longest request's
        cached length (0 for none); the packed and scatter layouts read their whole slot arrays and say so."""
        return max((self._length[r] for r in rids), default=0)

    def features(self, rid) -> np.ndarray | None:
        """Target features of ``rid``'s cached positions, float32 [length, F] (a view), or None when the graph
        outputs none. Rolled back with the cache."""
        f = self._feats.get(rid)
        return None if f is None else f[: self._length[rid]]

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

    def prefill(self, rid, tokens: list, chunk: int = PREFILL_CHUNK) -> np.ndarray:
        """Feed request ``rid``'s prompt in chunks; returns the last position's logits float32 [vocab] (a runner with
        ``step_hints`` computes no other position's)."""
        logits = None
        kw = {"last_only": {rid}} if getattr(self, "step_hints", False) else {}
        for s in range(0, len(tokens), chunk):
            logits = self.step([(rid, tokens[s:s + chunk])], **kw)[0]
        return logits[-1]


class DecoderRunner:
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
    """A :class:`BatchRunner` over a one-sequence runner (:class:`DecoderRunner`, or the scatter layout's
    :class:`~dspark_runtime.runners.scatter.ScatterSequence`): it holds at most one request at a time, and each call is that
    runner's own call (its row padding, its prefill chunking by a TensorRT engine's ``max_q``).

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
        return getattr(self.runner, "max_chunk", PREFILL_CHUNK)

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
        """Cached positions the held request's next call reads: the one-sequence runner's own count where it
        keeps one (the scatter layout's slot buffer), else its cached length."""
        own = getattr(self.runner, "attended_positions", None)
        return max(super().attended_positions(rids), own() if callable(own) else 0)

    def rollback(self, rid, length: int) -> None:
        """Keep the first ``length`` positions. Raises ValueError beyond the cached positions."""
        self._check_rollback(rid, length)
        self.runner.rollback(length)
        self._length[rid] = length

    @property
    def step_hints(self) -> bool:
        """Whether ``step`` takes the loop's ``last_only`` (the one-sequence runner's ``step(tokens, last_only)``)."""
        return bool(getattr(self.runner, "step_hints", False))

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
        :meth:`~dspark_runtime.runners.scatter.ScatterSequence.export_kv`). Raises DSparkError for a runner that cannot."""
        return self._kv_io("export_kv")(start, end)

    def import_kv(self, rid, kv: list, features) -> None:
        """Fill the held (empty) request's first positions from cached arrays (:meth:`export_kv`'s form)."""
        self._kv_io("import_kv")(kv, features)
        self._length[rid] = self.runner.length

    @property
    def can_import_kv(self) -> bool:
        return hasattr(self.runner, "import_kv")

    def _kv_io(self, name: str):
        fn = getattr(self.runner, name, None)
        if fn is None:
            raise DSparkError(f"{type(self.runner).__name__} cannot export or import cached positions (the prefix "
                              "cache needs the scatter KV layout); rebuild the engine with --kv-layout scatter")
        return fn

    def prefill(self, rid, tokens: list, chunk: int = PREFILL_CHUNK) -> np.ndarray:
        """The held request's prompt through the runner's own chunked prefill; the last position's logits [vocab]."""
        self._check_segments([(rid, tokens)])
        logits = self.runner.prefill(list(tokens), chunk)
        self._length[rid] = self.runner.length
        return logits


def decoder_runner(backend, row_multiple: int = 1):
    """The one-sequence runner for ``backend``'s ``causal_lm`` graph: a :class:`DecoderRunner` for the growing and
    capacity KV layouts, a :class:`~dspark_runtime.runners.scatter.ScatterSequence` (same interface) for the scatter layout."""
    spec = getattr(backend, "spec", None)
    if spec is not None and spec.kv_layout == "scatter":
        from dspark_runtime.runners.scatter import ScatterSequence

        return ScatterSequence(backend, row_multiple=row_multiple)
    return DecoderRunner(backend, row_multiple=row_multiple)


def batch_runner(backend, row_multiple: int = 1, max_requests: int = 8):
    """The runner the decoding loop drives for ``backend``'s ``causal_lm`` graph and at most ``max_requests``
    requests at once:

    * scatter KV layout: a :class:`~dspark_runtime.runners.scatter.ScatterRunner` (one batch row per request: a request's
      logits do not depend on its batch, and one request alone runs the calls it runs in a batch);
    * the capacity layout (a TensorRT engine): a :class:`~dspark_runtime.runners.device.DeviceBatchRunner` of
      ``max_requests`` rows (every call at a fixed shape: a request's output does not depend on its batch);
    * growing layout with one request: a :class:`SequenceRunner` over a :class:`DecoderRunner` (bit-exact row
      padding, the cache cut at every rollback);
    * growing layout, several requests: a :class:`~dspark_runtime.runners.packed.PackedRunner` (one packed row; see
      ``scripts/batch_invariance.py`` for how its rounding depends on the batch).
    """
    layout = getattr(getattr(backend, "spec", None), "kv_layout", "growing")
    if layout == "scatter":
        from dspark_runtime.runners.scatter import ScatterRunner

        return ScatterRunner(backend, row_multiple=row_multiple)
    if layout == "capacity":  # TensorRT
        if row_multiple != 1:
            raise DSparkError("the TensorRT runner pads every call to a fixed shape itself; row_multiple must be 1")
        from dspark_runtime.runners.device import DeviceBatchRunner

        return DeviceBatchRunner(backend, rows=max_requests)
    if max_requests <= 1:
        return SequenceRunner(DecoderRunner(backend, row_multiple=row_multiple))
    from dspark_runtime.runners.packed import PackedRunner

    return PackedRunner(backend, row_multiple=row_multiple)
