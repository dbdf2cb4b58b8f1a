"""Native TensorRT backend for ``causal_lm`` engines with the *capacity* KV layout (docs/design.md section 2).

Same interface as :class:`dspark_runtime.backend.OrtDecoder` (construct cheaply, ``activate()`` allocates,
``empty_kv`` / ``step`` / ``deactivate``), so :class:`~dspark_runtime.runners.DecoderRunner`, the drafters
and the generation loop run on it unchanged. No torch: cuda-python (``cuda.bindings.runtime``) for device
memory, pinned host buffers, one stream and CUDA graphs; TensorRT or TensorRT-RTX through the import shim.

How a step runs:

* The KV cache lives on the device in static buffers sized at activation: per layer, keys and values of
  ``batch x kv_heads x capacity x head_dim`` float32. The engine reads a *capacity bucket* of it (the
  smallest of ``min_bucket, 2 min_bucket, ..., capacity`` that holds the cached + new positions, so short
  sequences do not pay attention over the whole capacity), laid out contiguously as
  ``[batch, kv_heads, bucket, head_dim]``; moving to another bucket re-lays the written prefix out once
  (one device-to-device 2-D copy per layer through a scratch buffer).
* Inputs are written into pinned host buffers and copied asynchronously; :meth:`TrtDecoder.step` widens the
  growing layout's mask (``[batch, 1, q, past + q]``) to ``[batch, 1, q, bucket + q]`` with unwritten slots
  hidden; :meth:`TrtDecoder.run_rows` takes that mask as built by its caller (the batched runner: every row at its
  own length). The engine outputs the new keys/values only; the runtime copies each row's real ones into the cache
  buffers at that row's positions (2-D copies on the same stream), and only the real positions' outputs back (the
  ``argmax`` output instead of the logits where the caller needs no more).
* Tensor addresses are set once (buffers never move); input shapes and the optimisation profile are set
  only when (batch, q, bucket) changes.
* Decode/verify steps (``q <= decode_q``) are captured as a CUDA graph per (batch, q, bucket) after
  ``warmup`` uncaptured runs of that shape, and replayed from then on. Prefill chunks run uncaptured.

Two callers: :meth:`TrtDecoder.step` (the ``OrtDecoder`` interface; the ``kv`` objects it hands back are
:class:`DeviceKV` handles, shape only, so it serves one sequence at a time, as a :class:`DecoderRunner` uses it) and
:meth:`TrtDecoder.run_rows` with :meth:`TrtDecoder.use_bucket` / :meth:`TrtDecoder.set_rows`, the device side of
the decoding loop's batched runner (:class:`dspark_runtime.trt_batch.TrtBatchRunner`: a row per request). One
caller at a time per decoder.

Not verified on a GPU yet (none was available where it was written); ``scripts/gpu_check_trt.sh`` is the
prepared check. The CPU-testable parts (buckets, mask widening, buffer plan) are tested in tests/test_trt_backend.py,
the batched planning in tests/test_trt_batch.py.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_runtime.backend import StepOutput
from dspark_runtime.errors import DSparkError
from dspark_runtime.graphspec import (BATCH, CAPACITY, KV_LAYOUT_CAPACITY, NEW_LEN, PAST_LEN, Q_LEN, new_names,
                                      past_names, resolve_axes, tensor_shape)
from dspark_runtime.manifest import TrtEngineEntry
from dspark_runtime.trt_import import import_tensorrt
from dspark_runtime.trt_profiles import PROFILE_DECODE, capacity_buckets, choose_bucket, pick_profile

_NP = {"int64": np.int64, "float32": np.float32, "bool": np.bool_}


class DeviceKV:
    """A handle to KV positions held on the device: ``shape`` [batch, kv_heads, length, head_dim] and
    slicing along the length axis (what :class:`~dspark_runtime.kvcache.KVCache` does on rollback)."""

    __slots__ = ("shape",)

    def __init__(self, shape: tuple):
        self.shape = tuple(shape)

    def __getitem__(self, idx) -> "DeviceKV":
        # KVCache slices k[..., :n, :]; anything else is a misuse of a device handle
        if (isinstance(idx, tuple) and len(idx) == 3 and idx[0] is Ellipsis and isinstance(idx[1], slice)
                and idx[1].start in (None, 0) and idx[1].step in (None, 1) and idx[2] == slice(None)):
            n = self.shape[2] if idx[1].stop is None else min(int(idx[1].stop), self.shape[2])
            return DeviceKV((*self.shape[:2], n, self.shape[3]))
        raise DSparkError(f"device KV handles only support [..., :n, :] slicing, not {idx!r}")

    @property
    def nbytes(self) -> int:
        return 0  # device memory, accounted by the backend (TrtDecoder.kv_bytes)


def widen_mask(mask: np.ndarray, past: int, bucket: int, out: np.ndarray | None = None) -> np.ndarray:
    """The growing layout's mask ``[batch, 1, q, past + q]`` as the capacity layout's ``[batch, 1, q, bucket + q]``:
    slots ``0..past-1`` as given, ``past..bucket-1`` (not yet written, or stale after a rollback) hidden,
    the q new positions as given. Writes into ``out`` when given (a pinned buffer view)."""
    b, one, q, total = mask.shape
    if total != past + q:
        raise DSparkError(f"attention_mask has {total} key positions but past ({past}) + q ({q}) = {past + q}")
    if past + q > bucket:
        raise DSparkError(f"{past + q} positions do not fit capacity bucket {bucket}")
    if out is None:
        out = np.empty((b, one, q, bucket + q), dtype=bool)
    out[..., :past] = mask[..., :past]
    out[..., past:bucket] = False
    out[..., bucket:] = mask[..., past:]
    return out


@dataclass(frozen=True)
class BufferPlan:
    """Device/pinned byte sizes for one engine at (batch, capacity, max q). All sizes in bytes."""

    kv: int            # all layers' key + value cache buffers
    kv_scratch: int    # one layer's buffer, for re-layout between buckets
    inputs: dict       # input name -> bytes (ids, positions, mask at the largest shapes)
    outputs: dict      # output name -> bytes (logits, features, new K/V at the largest q)

    @property
    def total(self) -> int:
        return self.kv + self.kv_scratch + sum(self.inputs.values()) + sum(self.outputs.values())


def plan_buffers(entry: TrtEngineEntry, batch: int, capacity: int) -> BufferPlan:
    """Sizes of every static buffer the backend allocates for ``entry`` at ``batch`` sequences and ``capacity``
    cached positions, from the engine's declared tensors (:func:`dspark_runtime.graphspec.resolve_axes`): the
    largest ``q_len`` / ``new_len`` is the engine's prefill chunk, the cache axis (``capacity``, ``past_len``) is
    ``capacity``, derived axes follow (``kv_len``; the DSpark drafter's ``ctx_len`` and ``mask_len``).
    ``kv`` is the bytes of the ``past.*`` inputs (the capacity decoder's cache buffers, the DSpark drafter's
    context upload buffers), ``kv_scratch`` one layer's buffer for the capacity layout's bucket re-layout (0 for
    other layouts). Raises DSparkError when ``batch`` or ``capacity`` exceeds what the engine's profiles accept."""
    ps = entry.profile_settings
    if batch > ps["max_batch"]:
        raise DSparkError(f"batch {batch} exceeds the engine's max_batch {ps['max_batch']}; rebuild with --max-batch")
    if capacity > ps["capacity"]:
        raise DSparkError(f"capacity {capacity} exceeds the engine's {ps['capacity']}; rebuild with --capacity")
    d = entry.spec.dims
    q = int(ps["prefill_chunk"])
    sizes = resolve_axes(entry.spec, {BATCH: batch, Q_LEN: q, NEW_LEN: q, CAPACITY: capacity, PAST_LEN: capacity})

    def nbytes(t):
        return int(np.prod(tensor_shape(t, sizes))) * np.dtype(_NP[t.dtype]).itemsize
    kv = sum(nbytes(t) for t in entry.spec.inputs if t.name.startswith("past."))
    inputs = {t.name: nbytes(t) for t in entry.spec.inputs if not t.name.startswith("past.")}
    outputs = {t.name: nbytes(t) for t in entry.spec.outputs}
    scratch = kv // (2 * d.num_layers) if entry.kv_layout == KV_LAYOUT_CAPACITY else 0
    return BufferPlan(kv=kv, kv_scratch=scratch, inputs=inputs, outputs=outputs)


def _open_engine(path: Path, entry: TrtEngineEntry) -> tuple:
    """Deserialize the engine file ``path`` of ``entry`` and create its execution context: (trt module, logger,
    runtime, engine, context). On TensorRT-RTX kernels are specialised for a shape on its first run (EAGER, not
    lazily in the background), so a CUDA graph captured after warm-up holds the specialised kernels, and
    TensorRT-RTX's own whole-graph capture stays off (the backends capture themselves, or not at all). Raises
    DSparkError when TensorRT is missing, its version differs from the build's, or the engine does not load on
    this GPU."""
    trt, flavour, version = import_tensorrt(entry.flavour)
    if version != entry.version:
        raise DSparkError(f"{path.name} was built with {entry.flavour} {entry.version} but {flavour} {version} is "
                          "installed; install that version or rebuild the engine")
    logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise DSparkError(f"TensorRT could not load {path} on this GPU (compute capabilities it was built for: "
                          f"{', '.join(entry.compute_capabilities)}); rebuild it for this GPU")
    if hasattr(engine, "create_runtime_config"):  # TensorRT-RTX
        rc = engine.create_runtime_config()
        rc.dynamic_shapes_kernel_specialization_strategy = trt.DynamicShapesKernelSpecializationStrategy.EAGER
        rc.cuda_graph_strategy = trt.CudaGraphStrategy.DISABLED
        context = engine.create_execution_context(runtime_config=rc)
    else:
        context = engine.create_execution_context()
    if context is None:
        raise DSparkError(f"TensorRT could not create an execution context for {path}")
    return trt, logger, runtime, engine, context


def _cuda():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as e:
        raise DSparkError(f"the TensorRT backend needs cuda-python ({e}); pip install -e '.[trt]'") from e
    return cudart


def _bind_buffers(context, device_only: dict, pinned: dict) -> tuple:
    """Device buffers for every tensor of ``device_only`` and ``pinned`` ({tensor name: bytes}), a pinned host
    mirror for each tensor of ``pinned``, and every device address bound to its tensor in the TensorRT execution
    ``context`` once (addresses never change). Returns (dev {name: device pointer}, host {name: (pinned pointer,
    ctypes byte view)}). Raises DSparkError naming the tensor whose allocation or binding failed."""
    cudart = _cuda()
    dev, host = {}, {}
    for name, nbytes in {**device_only, **pinned}.items():
        dev[name] = _check(cudart.cudaMalloc(nbytes), f"cudaMalloc({name})")
    for name, nbytes in pinned.items():
        ptr = _check(cudart.cudaHostAlloc(nbytes, cudart.cudaHostAllocDefault), f"cudaHostAlloc({name})")
        host[name] = (ptr, (ctypes.c_byte * nbytes).from_address(ptr))
    for name, ptr in dev.items():
        if not context.set_tensor_address(name, int(ptr)):
            raise DSparkError(f"TensorRT refused the address of tensor {name}")
    return dev, host


def _set_input_shapes(context, entry, stream, shapes: dict, current: int | None) -> int:
    """Select the optimisation profile of ``entry`` that admits ``shapes`` ({input name: shape};
    :func:`~dspark_runtime.trt_profiles.pick_profile`), switching ``context`` to it on ``stream`` when it is not
    ``current``, and set every input shape. Returns the profile index. Raises DSparkError naming the profile or the
    tensor and shape TensorRT refused."""
    prof = pick_profile(entry.profiles, shapes)
    if prof != current and not context.set_optimization_profile_async(prof, stream):
        raise DSparkError(f"TensorRT refused optimisation profile {prof} ({entry.profiles[prof]['name']})")
    for name, shp in shapes.items():
        if not context.set_input_shape(name, shp):
            raise DSparkError(f"TensorRT refused input shape {shp} for tensor {name} (profile "
                              f"{entry.profiles[prof]['name']})")
    return prof


def _free_buffers(dev: dict, host: dict, stream=None) -> None:
    """Free what :func:`_bind_buffers` allocated, then destroy ``stream`` when one is given."""
    cudart = _cuda()
    for ptr in dev.values():
        cudart.cudaFree(ptr)
    for ptr, _ in host.values():
        cudart.cudaFreeHost(ptr)
    if stream is not None:
        cudart.cudaStreamDestroy(stream)


def _check(res, what: str):
    """Unpack a cuda-python result tuple; raise DSparkError naming the call on an error."""
    cudart = _cuda()
    err, *rest = res if isinstance(res, tuple) else (res,)
    if err != cudart.cudaError_t.cudaSuccess:
        _, msg = cudart.cudaGetErrorString(err)
        raise DSparkError(f"CUDA {what} failed: {err.name} ({msg.decode() if isinstance(msg, bytes) else msg})")
    return rest[0] if len(rest) == 1 else (rest or None)


class TrtDecoder:
    """Runs a capacity-layout ``causal_lm`` TensorRT engine (see the module docstring).

    Args:
        engine_dir: the engine directory.
        entry: its manifest entry (``Manifest.trt_engines[...]``, ``kv_layout == "capacity"``).
        batch: rows per call (<= the engine's max_batch; DecoderRunner uses 1, a TrtBatchRunner sets its own with
            :meth:`set_rows`).
        capacity: KV positions to allocate (default: the engine's capacity).
        cuda_graphs: capture and replay decode steps.
        warmup: uncaptured runs of a (batch, q, bucket) shape before it is captured (TensorRT-RTX specialises
            kernels on first runs; capture after that).
    Raises DSparkError for an engine of another layout or settings beyond the engine's profiles.
    """

    def __init__(self, engine_dir: str | Path, entry: TrtEngineEntry, batch: int = 1, capacity: int | None = None,
                 cuda_graphs: bool = True, warmup: int = 2):
        if entry.kv_layout != KV_LAYOUT_CAPACITY:
            raise DSparkError(f"TrtDecoder runs capacity-layout engines; {entry.file.path} is {entry.kv_layout}")
        self.path = Path(engine_dir) / entry.file.path
        self.entry = entry
        self.spec = entry.spec
        self.batch = batch
        self.capacity = capacity or int(entry.profile_settings["capacity"])
        self.plan = plan_buffers(entry, batch, self.capacity)  # validates batch / capacity
        self.buckets = [b for b in capacity_buckets(int(entry.profile_settings["capacity"]),
                                                    int(entry.profile_settings["min_bucket"])) if b < self.capacity]
        self.buckets.append(self.capacity)
        self.decode_q = int(entry.profile_settings["decode_q"])
        self.cuda_graphs = cuda_graphs
        self.warmup = warmup
        self.context = None
        # engine runs by kind, bucket re-layouts, the per-row K/V write copies (count and host seconds spent issuing
        # them) and the bytes copied back to the host: what scripts/gpu_check_trt.sh prints
        self.stats = {"captured": 0, "replayed": 0, "uncaptured": 0, "relayouts": 0, "kv_writes": 0, "kv_write_s": 0.0,
                      "d2h_bytes": 0}

    # -- lifecycle

    def activate(self) -> "TrtDecoder":
        """Deserialize the engine and allocate every buffer (device KV, pinned host I/O, stream). Idempotent.
        Raises DSparkError when TensorRT or CUDA is missing or the engine does not load on this GPU."""
        if self.context is not None:
            return self
        cudart = _cuda()
        self._trt, self._logger, self._runtime, self.engine, self.context = _open_engine(self.path, self.entry)
        self._stream = _check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking), "cudaStreamCreate")
        self._alloc()
        return self

    def _alloc(self) -> None:
        """Allocate the buffers of ``self.plan`` (batch rows) and reset the shape, bucket and graph state."""
        cudart = _cuda()
        layer_bytes = self.plan.kv_scratch
        self._scratch = _check(cudart.cudaMalloc(layer_bytes), "cudaMalloc(scratch)")
        self._dev, self._host = _bind_buffers(
            self.context, {n: layer_bytes for pair in past_names(self.spec.dims.num_layers) for n in pair},
            {**self.plan.inputs, **self.plan.outputs})
        self._shape_key = None
        self._profile = None
        self._bucket = self.buckets[0]
        self._length = 0  # positions written on the device (the longest row's)
        self._seen: dict = {}
        self._graphs: dict = {}

    def _release(self) -> None:
        """Free the graphs and buffers of :meth:`_alloc` (the engine, context and stream stay)."""
        cudart = _cuda()
        for g in self._graphs.values():
            cudart.cudaGraphExecDestroy(g)
        cudart.cudaFree(self._scratch)
        _free_buffers(self._dev, self._host)
        self._graphs, self._dev, self._host = {}, {}, {}

    def set_rows(self, batch: int) -> "TrtDecoder":
        """Serve ``batch`` rows per call from now on (a batched runner's ``rows``): the buffers are re-planned and,
        when activated, re-allocated for it (the engine and its context stay loaded; every cached position and
        captured graph is dropped, so only one runner uses this decoder at a time). No-op when already at
        ``batch``. Raises DSparkError beyond the engine's max_batch."""
        if batch == self.batch:
            return self
        plan = plan_buffers(self.entry, batch, self.capacity)  # validates before anything is freed
        if self.context is not None:
            _cuda().cudaStreamSynchronize(self._stream)
            self._release()
        self.batch, self.plan = batch, plan
        if self.context is not None:
            self._alloc()
        return self

    def deactivate(self) -> None:
        """Free the graphs, buffers and stream."""
        if self.context is None:
            return
        self._release()
        _cuda().cudaStreamDestroy(self._stream)
        self.context = self.engine = self._runtime = None

    @property
    def max_q(self) -> int:
        """Most tokens one step accepts (the engine's prefill chunk); DecoderRunner.prefill chunks by it."""
        return int(self.entry.profile_settings["prefill_chunk"])

    @property
    def kv_bytes(self) -> int:
        """Device bytes of the KV cache buffers."""
        return self.plan.kv

    def empty_kv(self, batch: int) -> list:
        """A past of length 0 (device handles): per layer (key, value) of shape [batch, kv_heads, 0, head_dim]."""
        if batch != self.batch:
            raise DSparkError(f"this TensorRT backend was activated for batch {self.batch}, not {batch}")
        d = self.spec.dims
        h = DeviceKV((batch, d.num_kv_heads, 0, d.head_dim))
        return [(h, h) for _ in range(d.num_layers)]

    # -- host views

    def _view(self, name: str, shape: tuple, dtype) -> np.ndarray:
        buf = self._host[name][1]
        n = int(np.prod(shape))
        return np.frombuffer(buf, dtype=dtype, count=n).reshape(shape)

    # -- one step

    def _relayout(self, old: int, new: int, length: int) -> None:
        """Move the first ``length`` positions of every layer from bucket pitch ``old`` to ``new``."""
        cudart = _cuda()
        d = self.spec.dims
        rows = self.batch * d.num_kv_heads
        row_bytes = d.head_dim * 4
        for name in (n for pair in past_names(d.num_layers) for n in pair):
            buf = self._dev[name]
            _check(cudart.cudaMemcpy2DAsync(self._scratch, length * row_bytes, buf, old * row_bytes,
                                            length * row_bytes, rows, cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                            self._stream), "cudaMemcpy2DAsync(relayout out)")
            _check(cudart.cudaMemcpy2DAsync(buf, new * row_bytes, self._scratch, length * row_bytes,
                                            length * row_bytes, rows, cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                            self._stream), "cudaMemcpy2DAsync(relayout in)")
        self.stats["relayouts"] += 1

    def _set_shapes(self, b: int, q: int, bucket: int) -> None:
        key = (b, q, bucket)
        if key == self._shape_key:
            return
        d = self.spec.dims
        shapes = {"input_ids": (b, q), "position_ids": (b, q), "attention_mask": (b, 1, q, bucket + q)}
        for k, v in past_names(d.num_layers):
            shapes[k] = shapes[v] = (b, d.num_kv_heads, bucket, d.head_dim)
        self._profile = _set_input_shapes(self.context, self.entry, self._stream, shapes, self._profile)
        self._shape_key = key

    def _execute(self, key: tuple, capturable: bool) -> None:
        cudart = _cuda()
        if key in self._graphs:
            _check(cudart.cudaGraphLaunch(self._graphs[key], self._stream), "cudaGraphLaunch")
            self.stats["replayed"] += 1
            return
        seen = self._seen.get(key, 0)
        self._seen[key] = seen + 1
        if capturable and self.cuda_graphs and seen >= self.warmup:
            _check(cudart.cudaStreamBeginCapture(self._stream,
                                                 cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
                   "cudaStreamBeginCapture")
            ok = self.context.execute_async_v3(int(self._stream))
            graph = _check(cudart.cudaStreamEndCapture(self._stream), "cudaStreamEndCapture")
            if not ok:
                raise DSparkError(f"TensorRT execute_async_v3 failed while capturing shape {key}")
            self._graphs[key] = _check(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
            cudart.cudaGraphDestroy(graph)
            self.stats["captured"] += 1
            _check(cudart.cudaGraphLaunch(self._graphs[key], self._stream), "cudaGraphLaunch")
            return
        if not self.context.execute_async_v3(int(self._stream)):
            raise DSparkError(f"TensorRT execute_async_v3 failed for shape (batch, q, bucket) = {key}")
        self.stats["uncaptured"] += 1

    def use_bucket(self, needed: int, keep: int | None = None) -> int:
        """Make the cache buffers' pitch the smallest bucket holding ``needed`` positions (the longest row's cached
        plus new ones), re-laying out the first ``keep`` positions of every row (default: all the device holds) when
        it changes. Returns the bucket. Raises DSparkError beyond the capacity."""
        if self.context is None:
            self.activate()
        bucket = choose_bucket(needed, self.buckets)
        if bucket != self._bucket:
            keep = min(self._length if keep is None else keep, bucket, self._bucket)
            if keep:
                self._relayout(self._bucket, bucket, keep)
            self._bucket = bucket
        return bucket

    def run_rows(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
                 writes: list, reads: list, with_logits: bool = True, with_features: bool = True) -> dict:
        """One engine call over all ``batch`` rows at the current bucket (:meth:`use_bucket` first).

        input_ids, position_ids: int64 [batch, q]; attention_mask: bool [batch, 1, q, bucket + q] (the capacity
        layout's own mask: cache slots, then the q new positions). ``writes``: [(row, past, n)]: the row's first n
        new K/V positions go to cache slots past..past+n-1 (other rows' and padded positions are not written).
        ``reads``: [(row, n, first)]: what comes back to the host: the row's first n positions of every output but
        the new K/V (the ``argmax`` output, where the engine has one, always: 8 bytes a position), the logits only
        from position ``first`` on (n - 1: the last one, all a prompt chunk needs). ``with_logits``: False copies
        no logits back (then the engine must have an ``argmax`` output); ``with_features``: False copies no target
        features back (no DSpark drafter reads them).
        Returns {"logits" / "argmax" / "features": {row: float32 [n - first, vocab] / int64 [n] / float32 [n, F]}}
        (arrays of their own, not views). Raises DSparkError for a shape outside the engine's profiles, a write
        beyond the bucket, or a TensorRT/CUDA failure."""
        if self.context is None:
            self.activate()
        cudart = _cuda()
        H2D, D2H, D2D = (cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost,
                         cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice)
        b, q = input_ids.shape
        bucket = self._bucket
        if b != self.batch:
            raise DSparkError(f"batch {b} but this backend was activated for batch {self.batch}")
        if attention_mask.shape != (b, 1, q, bucket + q):
            raise DSparkError(f"attention_mask {attention_mask.shape} does not match (batch, 1, q, bucket + q) = "
                              f"{(b, 1, q, bucket + q)}")
        for row, past, n in writes:
            if past + n > bucket:
                raise DSparkError(f"row {row}: positions {past}..{past + n - 1} do not fit capacity bucket {bucket}")
        for name, arr, dt in (("input_ids", input_ids, np.int64), ("position_ids", position_ids, np.int64),
                              ("attention_mask", attention_mask, np.bool_)):
            view = self._view(name, arr.shape, dt)
            view[...] = arr
            _check(cudart.cudaMemcpyAsync(self._dev[name], self._host[name][0], view.nbytes, H2D, self._stream), name)
        self._set_shapes(b, q, bucket)
        capturable = q <= self.decode_q and self.entry.profiles[self._profile]["name"] == PROFILE_DECODE
        self._execute((b, q, bucket), capturable)
        d = self.spec.dims
        row_b = d.head_dim * 4
        heads = d.num_kv_heads
        t0 = time.perf_counter()
        for (pk, pv), (nk, nv) in zip(past_names(d.num_layers), new_names(d.num_layers)):
            for cache, new in ((pk, nk), (pv, nv)):  # new [b*heads, q, hd] -> cache [b*heads, bucket, hd] at past
                for row, past, n in writes:
                    _check(cudart.cudaMemcpy2DAsync(int(self._dev[cache]) + (row * heads * bucket + past) * row_b,
                                                    bucket * row_b, int(self._dev[new]) + row * heads * q * row_b,
                                                    q * row_b, n * row_b, heads, D2D, self._stream), f"write {new}")
        self.stats["kv_writes"] += 2 * d.num_layers * len(writes)
        self.stats["kv_write_s"] += time.perf_counter() - t0
        names = [t.name for t in self.spec.outputs if not t.name.startswith("new.")
                 and (t.name != "logits" or with_logits) and (t.name != "features" or with_features)]
        if not with_logits and "argmax" not in names:
            raise DSparkError(f"{self.path.name} has no argmax output; copy the logits back (with_logits=True) or "
                              "rebuild the engine with `dspark-export build-trt`")
        specs = {t.name: t for t in self.spec.outputs}
        for name in names:  # [b, q] (argmax) or [b, q, width]: a row's first n positions are one contiguous span
            t = specs[name]
            per_pos = (int(t.shape[-1]) if len(t.shape) == 3 else 1) * np.dtype(_NP[t.dtype]).itemsize
            for row, n, first in reads:
                lo = first if name == "logits" else 0
                off = (row * q + lo) * per_pos
                _check(cudart.cudaMemcpyAsync(int(self._host[name][0]) + off, int(self._dev[name]) + off,
                                              (n - lo) * per_pos, D2H, self._stream), name)
                self.stats["d2h_bytes"] += (n - lo) * per_pos
        _check(cudart.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
        self._length = max([self._length] + [past + n for _, past, n in writes])
        out = {}
        for name in names:
            t = specs[name]
            full = self._view(name, (b, q, *t.shape[2:]), _NP[t.dtype])
            out[name] = {row: full[row, (first if name == "logits" else 0):n].copy() for row, n, first in reads}
        return out

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
             kv: list) -> StepOutput:
        """Run the engine once; the interface of :meth:`OrtDecoder.step` (every row at the same past).

        input_ids, position_ids: int64 [batch, q]; attention_mask: bool [batch, 1, q, past + q] (the growing
        layout's); kv: the per-layer handles of the cached past (``past`` = their length, which may be shorter
        than what the device holds after a rollback). Returns logits float32 [batch, q, vocab], features or
        None, and handles of length past + q. Raises DSparkError when the sequence outgrows the capacity or
        a shape is outside the engine's profiles.
        """
        if self.context is None:
            self.activate()
        b, q = input_ids.shape
        past = kv[0][0].shape[2]
        if b != self.batch:
            raise DSparkError(f"batch {b} but this backend was activated for batch {self.batch}")
        if past > self._length:
            raise DSparkError(f"the runner's cache claims {past} positions but the device holds {self._length}")
        bucket = self.use_bucket(past + q, keep=past)
        mask = widen_mask(attention_mask, past, bucket)
        out = self.run_rows(input_ids, position_ids, mask, [(r, past, q) for r in range(b)],
                            [(r, q, 0) for r in range(b)])
        logits = np.stack([out["logits"][r] for r in range(b)])
        feats = np.stack([out["features"][r] for r in range(b)]) if "features" in out else None
        d = self.spec.dims
        self._length = past + q
        h = DeviceKV((b, d.num_kv_heads, past + q, d.head_dim))
        return StepOutput(logits, feats, [(h, h) for _ in range(d.num_layers)])
