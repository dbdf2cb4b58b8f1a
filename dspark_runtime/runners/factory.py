"""Which runner drives a decoder graph: :func:`batch_runner` (the decoding loop's, by KV layout and request count) and
:func:`decoder_runner` (one sequence)."""
from __future__ import annotations

from dspark_runtime.errors import DSparkError
from dspark_runtime.runners.base import BatchRunner, SequenceDecoder
from dspark_runtime.runners.device import DeviceBatchRunner
from dspark_runtime.runners.packed import PackedRunner
from dspark_runtime.runners.scatter import ScatterRunner, ScatterSequence
from dspark_runtime.runners.sequence import DecoderRunner, SequenceRunner


def decoder_runner(backend, row_multiple: int = 1) -> SequenceDecoder:
    """The one-sequence runner for ``backend``'s ``causal_lm`` graph: a :class:`DecoderRunner` for the growing and
    capacity KV layouts, a :class:`~dspark_runtime.runners.scatter.ScatterSequence` for the scatter layout."""
    if backend.spec.kv_layout == "scatter":
        return ScatterSequence(backend, row_multiple=row_multiple)
    return DecoderRunner(backend, row_multiple=row_multiple)


def batch_runner(backend, row_multiple: int = 1, max_requests: int = 8, keep_features: bool = True) -> BatchRunner:
    """The runner the decoding loop drives for ``backend``'s ``causal_lm`` graph and at most ``max_requests``
    requests at once:

    * scatter KV layout: a :class:`~dspark_runtime.runners.scatter.ScatterRunner` (one batch row per request: a
      request's logits do not depend on its batch, and one request alone runs the calls it runs in a batch);
    * the capacity layout (a TensorRT engine or a device graph): a
      :class:`~dspark_runtime.runners.device.DeviceBatchRunner` of ``max_requests`` rows (every call at a fixed
      shape), copying target features back only with ``keep_features``;
    * growing layout with one request: a :class:`SequenceRunner` over a :class:`DecoderRunner` (bit-exact row
      padding, the cache cut at every rollback);
    * growing layout, several requests: a :class:`~dspark_runtime.runners.packed.PackedRunner` (one packed row; its
      rounding can depend on the batch: ``batch_invariant`` False).
    Raises DSparkError for a row multiple on the capacity layout (its calls have fixed shapes).
    """
    layout = backend.spec.kv_layout
    if layout == "scatter":
        return ScatterRunner(backend, row_multiple=row_multiple)
    if layout == "capacity":
        if row_multiple != 1:
            raise DSparkError("the TensorRT runner pads every call to a fixed shape itself; row_multiple must be 1")
        return DeviceBatchRunner(backend, rows=max_requests, keep_features=keep_features)
    if max_requests <= 1:
        return SequenceRunner(DecoderRunner(backend, row_multiple=row_multiple))
    return PackedRunner(backend, row_multiple=row_multiple)
