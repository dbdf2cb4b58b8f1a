"""Batched decoding on a capacity-layout decoder on a GPU: :class:`DeviceBatchRunner` and the pure planning it runs on
(call shapes, bucket choice, capture keys, the engine's inputs). A request owns one row of the decoder's device KV
buffers while it is in the loop (position p in slot p). Every call runs all ``rows`` rows (idle rows get a dummy token
that sees only itself) at one of two query lengths, ``decode_q`` (γ + 1) or the prefill chunk, so the call that
computes a request's tokens has a shape independent of its batch and its verify length, and a row's inputs depend on
its own request alone (:func:`call_inputs`). The capacity bucket (:func:`call_bucket`) still depends on the longest
row in use; ``pin_bucket`` removes that. CUDA graphs are keyed (rows, q, bucket) (:func:`capture_key`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark_runtime.errors import DSparkError
from dspark_runtime.runners.base import BatchRunner
from dspark_runtime.backends.trt.profiles import choose_bucket


@dataclass(frozen=True)
class TrtCall:
    """One engine call of a batched step.

    q: query positions per row (``decode_q`` or ``prefill_chunk``); segments: indices into the step's segment list
    of the segments this call computes (each on its own row)."""

    q: int
    segments: tuple


def plan_calls(lengths: list, decode_q: int, prefill_chunk: int) -> list[TrtCall]:
    """The engine calls of one step over segments of these token counts: the segments of at most ``decode_q`` tokens
    in one call at ``q = decode_q``, the longer ones in one call at ``q = prefill_chunk`` (in that order; a call only
    when it has segments). Pure. Raises DSparkError for an empty segment or one longer than ``prefill_chunk``."""
    for n in lengths:
        if not 1 <= n <= prefill_chunk:
            raise DSparkError(f"a segment of {n} tokens: the TensorRT engine takes 1..{prefill_chunk} per call "
                              "(its prefill chunk); feed longer prompts in chunks (the runner's max_chunk)")
    short = tuple(i for i, n in enumerate(lengths) if n <= decode_q)
    long = tuple(i for i, n in enumerate(lengths) if n > decode_q)
    return [TrtCall(q, segs) for q, segs in ((decode_q, short), (prefill_chunk, long)) if segs]


def pass_rows(lengths: list, rows: int, decode_q: int, prefill_chunk: int) -> int:
    """Query rows one step over segments of these token counts computes on TensorRT, padding and idle rows
    included: ``rows x q`` for each call of :func:`plan_calls` (what the chunked-prefill planner weighs). Pure."""
    if not lengths:
        return 0
    return sum(rows * c.q for c in plan_calls(list(lengths), decode_q, prefill_chunk))


def call_bucket(held: list, needs: list, buckets: list, pin: bool = False) -> int:
    """The capacity bucket of a call: the smallest of ``buckets`` holding every row's cached positions (``held``,
    the lengths of all rows in use, stepped or not: their cache must survive a re-layout) and every stepped row's
    positions after the call (``needs``: past + real new tokens). ``pin``: always the largest bucket (a row's
    attention then never depends on the other rows' lengths). Raises DSparkError when the largest cannot hold
    them (the request outgrew the engine's capacity)."""
    needed = max([0, *held, *needs])
    if pin:
        if needed > buckets[-1]:
            choose_bucket(needed, buckets)  # raises, naming the capacity
        return buckets[-1]
    return choose_bucket(max(needed, 1), buckets)


def capture_key(rows: int, q: int, bucket: int) -> tuple:
    """The CUDA graph key of a call: (rows, q, bucket) — the shape of every input and output of the engine."""
    return (rows, q, bucket)


def call_inputs(rows: int, q: int, bucket: int, segments: list) -> tuple:
    """The engine's inputs for one call. Pure.

    Args:
        rows, q, bucket: the call's shape.
        segments: [(row, past, tokens)]: the row's cached length and its tokens (1..q of them).
    Returns:
        (input_ids int64 [rows, q], position_ids int64 [rows, q], attention_mask bool [rows, 1, q, bucket + q]).
        A segment's row: its tokens then its last token repeated, at positions past, past + 1, ...; its mask shows
        cache slots 0..past-1 to every query and the new positions causally (a padded position sees the real ones;
        no real one sees a padded one). A row without a segment: token 0 at positions 0..q-1, no cache slot visible,
        the new positions causal (no all-hidden query row). Each row's inputs depend only on its own segment.
    Raises DSparkError for a row outside 0..rows-1 or given twice, an empty or too long segment, or a past that
    leaves no room in the bucket.
    """
    ids = np.zeros((rows, q), np.int64)
    pos = np.tile(np.arange(q, dtype=np.int64), (rows, 1))
    mask = np.zeros((rows, 1, q, bucket + q), bool)
    mask[:, 0, :, bucket:] = np.tril(np.ones((q, q), bool))
    seen = set()
    for row, past, toks in segments:
        n = len(toks)
        if not 0 <= row < rows or row in seen:
            raise DSparkError(f"segment row {row} is outside 0..{rows - 1} or given twice")
        if not 1 <= n <= q:
            raise DSparkError(f"row {row}: {n} tokens in a call of q = {q}")
        if past + n > bucket:
            raise DSparkError(f"row {row}: {past} cached + {n} new positions do not fit capacity bucket {bucket}")
        seen.add(row)
        ids[row] = list(toks) + [toks[-1]] * (q - n)
        pos[row] += past
        mask[row, 0, :, :past] = True
    return ids, pos, mask


class DeviceBatchRunner(BatchRunner):
    """The decoding loop's runner on a capacity-layout decoder (a TensorRT engine, or a device graph on ONNX Runtime's
    CUDA provider): several requests, one row each, every call at a fixed shape (see the module docstring). A
    :class:`~dspark_runtime.runners.base.BatchRunner`; ``step`` also takes ``argmax_for`` / ``last_only``
    (``step_hints``: the requests whose logits the host needs only the argmax of / only the last position of).
    Copies back: only each segment's real positions, for a greedy request only the argmax where the engine outputs
    it, for a prompt chunk only its last position's logits, and target features only with ``keep_features``.

    Args:
        decoder: a capacity-layout decoder (:class:`~dspark_runtime.backends.device_decoder.CapacityDecoder`: a
            TensorRT engine or a device graph), set to ``rows`` rows here, activated on first use; it serves one runner
            at a time.
        rows: requests at once (<= the engine's max_batch): every call runs this many rows.
        pin_bucket: run every call at the largest capacity bucket (see :func:`call_bucket`).
        keep_features: copy the target features back (a drafter reads them: the DSpark drafter).
    Raises DSparkError for rows beyond the engine's max_batch.
    """

    row_multiple = 1  # padding is the fixed call shape's, not a probed multiple
    step_hints = True  # step() takes argmax_for / last_only (the decoding loop passes them)
    fixed_call_shapes = True  # a prompt is fed whole prefill chunks: chunked alike in any batch

    def __init__(self, decoder, rows: int = 1, pin_bucket: bool = False, keep_features: bool = True):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise DSparkError(f"rows must be a positive integer, got {rows!r}")
        super().__init__()
        self.decoder = decoder.set_rows(rows)
        self.rows = rows
        self.pin_bucket = pin_bucket
        self.keep_features = keep_features
        self.decode_q = decoder.decode_q
        self.max_chunk = decoder.max_q  # a prompt chunk: the engine's prefill chunk
        self.device_argmax = any(t.name == "argmax" for t in decoder.spec.outputs)
        self._row: dict = {}  # rid -> row
        self.calls: dict = {}  # capture key -> engine calls made at it

    def add(self, rid) -> None:
        """Give request ``rid`` a free row (length 0). Raises DSparkError when it is here already or every row is
        taken (the loop's max_batch must not exceed ``rows``)."""
        if rid in self._row:
            raise DSparkError(f"request {rid!r} is already in the TensorRT runner")
        free = sorted(set(range(self.rows)) - set(self._row.values()))
        if not free:
            raise DSparkError(f"all {self.rows} rows of the TensorRT runner are taken; remove a request first (the "
                              "loop's max_batch must not exceed the runner's rows)")
        self._row[rid] = free[0]
        self._length[rid] = 0

    def remove(self, rid) -> None:
        """Forget request ``rid`` (its row is free for the next ``add``); no-op for an unknown id."""
        self._row.pop(rid, None)
        self._length.pop(rid, None)
        self._feats.pop(rid, None)

    def rollback(self, rid, length: int) -> None:
        """Keep the first ``length`` positions of ``rid`` (O(1): later slots are hidden until overwritten).
        Raises ValueError outside 0..length(rid)."""
        self._check_rollback(rid, length)
        self._length[rid] = length

    def features(self, rid) -> np.ndarray | None:
        """Target features of ``rid``'s cached positions (float32 [length, F]), or None when the engine outputs none
        or they stay on the device (``keep_features`` False)."""
        return super().features(rid) if self.keep_features else None

    def attended_positions(self, rids) -> int:
        """Cache slots a call reads per row (the cost table's context, :mod:`dspark_runtime.scheduling.cost_table`): the capacity
        bucket holding every row in use (:func:`call_bucket`; the largest when pinned), not only ``rids``'."""
        held = list(self._length.values())
        return call_bucket(held, [], self.decoder.buckets, self.pin_bucket)

    def pass_rows(self, lengths: list) -> int:
        """:func:`pass_rows` at this runner's rows and call lengths."""
        return pass_rows(lengths, self.rows, self.decode_q, self.max_chunk)

    def step(self, segments: list, argmax_for=(), last_only=()) -> list:
        """Feed every ``(rid, tokens)`` of ``segments`` after that request's cached positions.

        Returns per segment, in order, float32 [q_r, vocab] logits, or int64 [q_r] argmax ids for a request in
        ``argmax_for`` when the engine has an ``argmax`` output (:attr:`device_argmax`); for a request in
        ``last_only`` only the last position's ([1, vocab] / [1]: a prompt chunk). Raises DSparkError for an
        unknown or repeated request, an empty segment or one longer than ``max_chunk``, or a request outgrowing
        the engine's capacity."""
        if not segments:
            return []
        self._check_segments(segments)
        dec = self.decoder
        if dec.batch != self.rows:
            raise DSparkError(f"the TensorRT decoder was set to {dec.batch} rows by another runner after this one "
                              f"({self.rows} rows) was made; a decoder serves one runner at a time: make a new loop")
        results = [None] * len(segments)
        for call in plan_calls([len(t) for _, t in segments], self.decode_q, self.max_chunk):
            segs = [segments[i] for i in call.segments]
            held = list(self._length.values())
            bucket = call_bucket(held, [self._length[rid] + len(t) for rid, t in segs], dec.buckets, self.pin_bucket)
            dec.use_bucket(bucket, keep=max(held))
            placed = [(self._row[rid], self._length[rid], list(t)) for rid, t in segs]
            ids, pos, mask = call_inputs(self.rows, call.q, bucket, placed)
            ids_only = self.device_argmax and all(rid in argmax_for for rid, _ in segs)
            out = dec.run_rows(ids, pos, mask, [(row, past, len(t)) for row, past, t in placed],
                               [(row, len(t), len(t) - 1 if rid in last_only else 0)
                                for (rid, _), (row, _, t) in zip(segs, placed)], with_logits=not ids_only,
                               with_features=self.keep_features)
            key = capture_key(self.rows, call.q, bucket)
            self.calls[key] = self.calls.get(key, 0) + 1
            for i, (rid, toks) in zip(call.segments, segs):
                row, n0 = self._row[rid], self._length[rid]
                if "features" in out:
                    self._store_features(rid, n0, out["features"][row])
                self._length[rid] = n0 + len(toks)
                res = out["argmax"][row] if self.device_argmax and rid in argmax_for else out["logits"][row]
                results[i] = res[-1:] if rid in last_only else res
        return results

    def prefill(self, rid, tokens: list, chunk: int | None = None) -> np.ndarray:
        """Feed request ``rid``'s tokens in chunks of at most :attr:`max_chunk` (``chunk`` when smaller); returns the
        last position's logits float32 [vocab] (the draft LM's context, :class:`~dspark_runtime.drafting.drafters.LMDrafter`),
        copying back no other position's."""
        chunk = min(chunk or self.max_chunk, self.max_chunk)
        logits = None
        for s in range(0, len(tokens), chunk):
            logits = self.step([(rid, tokens[s:s + chunk])], last_only={rid})[0]
        return logits[-1]
