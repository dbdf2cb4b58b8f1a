"""The capacity-layout decoder on a device (docs/design.md section 2). :class:`CapacityDecoder` owns the K/V cache,
inputs and outputs in device buffers sized once, a row per sequence, capacity buckets, and two ways to drive it:
:meth:`~CapacityDecoder.step` (the ``OrtDecoder`` interface, one sequence) and :meth:`~CapacityDecoder.use_bucket` /
:meth:`~CapacityDecoder.run_rows` (the batched :class:`~dspark_runtime.runners.device.DeviceBatchRunner`). A subclass
says how the graph runs on the bound buffers: :class:`~dspark_runtime.backends.ort_cuda.OrtDeviceDecoder` (ONNX
Runtime's CUDA provider), :class:`~dspark_runtime.backends.trt.decoder.TrtDecoder` (a TensorRT engine).

Buffers (:class:`DeviceLayout`): one cache allocation of ``2 x layers`` slots ``[rows, kv_heads, capacity, head_dim]``
(each layer's keys, then its values), of which the graph reads the first ``bucket`` positions; the graph's new K/V
land in a second allocation and are copied into the cache with one strided 3-D copy per row. Only the positions a
caller asks for come back (``argmax`` alone for greedy requests). Memory: :class:`~dspark_runtime.backends.device_memory.DeviceMemory`.
"""
from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_runtime.backends.ort import StepOutput
from dspark_runtime.backends.device_memory import CudaMemory, DeviceMemory
from dspark_runtime.errors import DSparkError
from dspark_runtime.engine_dir.graphspec import (BATCH, CAPACITY, KV_LAYOUT_CAPACITY, NEW_LEN, PAST_LEN, Q_LEN, new_names,
                                      past_names, resolve_axes, tensor_shape)
from dspark_runtime.backends.trt.profiles import capacity_buckets, choose_bucket

NUMPY_DTYPES = {"int64": np.int64, "float32": np.float32, "float16": np.float16, "bool": np.bool_}


class DeviceKV:
    """A handle to KV positions held on the device: ``shape`` [batch, kv_heads, length, head_dim] and
    slicing along the length axis (what :class:`~dspark_runtime.runners.kvcache.KVCache` does on rollback)."""

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
        return 0  # device memory, accounted by the decoder (kv_bytes)


def widen_mask(mask: np.ndarray, past: int, bucket: int, out: np.ndarray | None = None) -> np.ndarray:
    """The growing layout's mask ``[batch, 1, q, past + q]`` as the capacity layout's ``[batch, 1, q, bucket + q]``:
    slots ``0..past-1`` as given, ``past..bucket-1`` (not yet written, or stale after a rollback) hidden,
    the q new positions as given. Writes into ``out`` when given."""
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
    """Device/pinned byte sizes for one graph at (batch, capacity, max q). All sizes in bytes."""

    kv: int            # all layers' key + value cache buffers
    kv_scratch: int    # one layer's buffer, for re-layout between buckets
    inputs: dict       # input name -> bytes (ids, positions, mask at the largest shapes)
    outputs: dict      # output name -> bytes (logits, features, new K/V at the largest q)

    @property
    def total(self) -> int:
        return self.kv + self.kv_scratch + sum(self.inputs.values()) + sum(self.outputs.values())


def plan_buffers(entry, batch: int, capacity: int) -> BufferPlan:
    """Sizes of every static buffer a decoder allocates for ``entry`` (a manifest entry with ``spec``,
    ``kv_layout`` and ``profile_settings``: a TensorRT engine or a device graph) at ``batch`` sequences and
    ``capacity`` cached positions, from its declared tensors (:func:`dspark_runtime.engine_dir.graphspec.resolve_axes`): the
    largest ``q_len`` / ``new_len`` is the prefill chunk, the cache axis (``capacity``, ``past_len``) is
    ``capacity``, derived axes follow (``kv_len``; the DSpark drafter's ``ctx_len`` and ``mask_len``).
    ``kv`` is the bytes of the ``past.*`` inputs, ``kv_scratch`` one layer's buffer for the capacity layout's bucket
    re-layout (0 for other layouts). Raises DSparkError when ``batch`` or ``capacity`` exceeds what the entry's
    profile settings accept."""
    ps = entry.profile_settings
    if batch > ps["max_batch"]:
        raise DSparkError(f"batch {batch} exceeds the engine's max_batch {ps['max_batch']}; rebuild with --max-batch")
    if capacity > ps["capacity"]:
        raise DSparkError(f"capacity {capacity} exceeds the engine's {ps['capacity']}; rebuild with --capacity")
    d = entry.spec.dims
    q = int(ps["prefill_chunk"])
    sizes = resolve_axes(entry.spec, {BATCH: batch, Q_LEN: q, NEW_LEN: q, CAPACITY: capacity, PAST_LEN: capacity})

    def nbytes(t):
        return int(np.prod(tensor_shape(t, sizes))) * np.dtype(NUMPY_DTYPES[t.dtype]).itemsize
    kv = sum(nbytes(t) for t in entry.spec.inputs if t.name.startswith("past."))
    inputs = {t.name: nbytes(t) for t in entry.spec.inputs if not t.name.startswith("past.")}
    outputs = {t.name: nbytes(t) for t in entry.spec.outputs}
    scratch = kv // (2 * d.num_layers) if entry.kv_layout == KV_LAYOUT_CAPACITY else 0
    return BufferPlan(kv=kv, kv_scratch=scratch, inputs=inputs, outputs=outputs)


@dataclass(frozen=True)
class DeviceLayout:
    """Byte geometry of the cache and new-K/V slots of a capacity decoder (the module docstring). Pure.

    rows, kv_heads, head_dim, layers: the graph's; capacity: cache positions per row; new_len: positions a new-K/V
    slot holds per row (a multiple of every call length of the batched runner, so a 3-D copy's slice is a whole
    number of rows); itemsize: bytes per K/V element."""

    rows: int
    kv_heads: int
    head_dim: int
    layers: int
    capacity: int
    new_len: int
    itemsize: int

    @property
    def position_bytes(self) -> int:
        return self.head_dim * self.itemsize

    @property
    def slot_bytes(self) -> int:
        """One layer's keys (or values) in the cache: [rows, kv_heads, capacity, head_dim]."""
        return self.rows * self.kv_heads * self.capacity * self.position_bytes

    @property
    def new_slot_bytes(self) -> int:
        return self.rows * self.kv_heads * self.new_len * self.position_bytes

    def write_copy(self, row: int, past: int, n: int, q: int, bucket: int, rows: int = 1) -> dict:
        """The strided copy that moves the first ``n`` new positions of a call of ``q`` positions into cache slots
        ``past..past+n-1`` at pitch ``bucket``, for rows ``row..row+rows-1`` (the same past and n each) and every
        layer's keys and values at once: keyword arguments of
        :meth:`~dspark_runtime.backends.device_memory.DeviceMemory.copy_3d` with byte offsets ``dst`` / ``src`` from the cache
        and new-K/V bases (a row's heads follow the previous row's at the same pitch, so a run of rows is one
        copy)."""
        pb = self.position_bytes
        return dict(dst=(row * self.kv_heads * bucket + past) * pb, dpitch=bucket * pb, dslice=self.slot_bytes,
                    src=row * self.kv_heads * q * pb, spitch=q * pb, sslice=self.new_slot_bytes,
                    width=n * pb, height=self.kv_heads * rows, depth=2 * self.layers)

    def write_copies(self, writes: list, q: int, bucket: int) -> list[dict]:
        """The copies of :meth:`write_copy` for ``writes`` [(row, past, n)]: consecutive rows with the same past and
        n merged into one copy (a prefill or a batch at one length: a single copy for every row)."""
        runs = []  # [row, past, n, rows]
        for row, past, n in sorted(writes):
            if runs and runs[-1][0] + runs[-1][3] == row and runs[-1][1:3] == [past, n]:
                runs[-1][3] += 1
            else:
                runs.append([row, past, n, 1])
        return [self.write_copy(row, past, n, q, bucket, rows) for row, past, n, rows in runs]


def new_slot_length(decode_q: int, prefill_chunk: int) -> int:
    """Positions per row of a new-K/V slot: the smallest multiple of both call lengths (``decode_q`` and the
    prefill chunk) that holds the longer: a call of either length then tiles a slot exactly."""
    return math.lcm(decode_q, prefill_chunk)


class CapacityDecoder(ABC):
    """A capacity-layout ``causal_lm`` graph on a device (the module docstring): buffers, buckets, rows and cache
    writes here; how the graph runs in the subclass (:meth:`_open`, :meth:`_bind`, :meth:`_run`, :meth:`_close`).

    Args:
        path: the graph file the subclass runs (ONNX graph or engine).
        entry: its manifest entry (``spec`` of the capacity layout, ``profile_settings``: max_batch, decode_q,
            prefill_chunk, capacity, min_bucket).
        batch: rows per call (<= max_batch; :meth:`set_rows` changes it).
        capacity: KV positions to allocate per row (default: the entry's).
        cuda_graphs: capture and replay decode calls (``q <= decode_q``) where the subclass can.
        memory: a factory of the :class:`~dspark_runtime.backends.device_memory.DeviceMemory` to allocate from (called on
            activation).
    Raises DSparkError for an entry of another layout or settings beyond its profile settings.
    """

    def __init__(self, path: str | Path, entry, batch: int = 1, capacity: int | None = None, cuda_graphs: bool = True,
                 memory=None):
        if entry.kv_layout != KV_LAYOUT_CAPACITY:
            raise DSparkError(f"{type(self).__name__} runs capacity-layout graphs; {Path(path).name} is "
                              f"{entry.kv_layout}")
        self.path = Path(path)
        self.entry = entry
        self.spec = entry.spec
        self.batch = batch
        ps = entry.profile_settings
        self.capacity = capacity or int(ps["capacity"])
        self.plan = plan_buffers(entry, batch, self.capacity)  # validates batch / capacity
        self.buckets = [b for b in capacity_buckets(int(ps["capacity"]), int(ps["min_bucket"])) if b < self.capacity]
        self.buckets.append(self.capacity)
        self.decode_q = int(ps["decode_q"])
        self.cuda_graphs = cuda_graphs
        self._memory_factory = memory
        self.memory: DeviceMemory | None = None
        self._active = False
        kv_type = next(t.dtype for t in self.spec.inputs if t.name.startswith("past."))
        self._kv_dtype = NUMPY_DTYPES[kv_type]
        # calls by kind, bucket re-layouts, cache write copies (count, host seconds issuing them, 3-D or per layer),
        # bytes copied back to the host: what the GPU check scripts print
        self.stats = {"captured": 0, "replayed": 0, "uncaptured": 0, "relayouts": 0, "kv_writes": 0,
                      "kv_write_s": 0.0, "kv_write_mode": "3d", "d2h_bytes": 0}

    # -- what a subclass provides

    @abstractmethod
    def _open(self) -> None:
        """Load the graph or engine (once per activation)."""

    @abstractmethod
    def _bind(self, key: tuple, buffers: dict) -> None:
        """Make the graph read and write ``buffers`` ({tensor name: (device address, shape)}) for calls of shape
        ``key`` = (rows, q, bucket); called before every call (cache what does not change)."""

    @abstractmethod
    def _run(self, key: tuple, capturable: bool) -> None:
        """Run the graph on the decoder's stream for a call of shape ``key`` (capture/replay a CUDA graph when
        ``capturable`` and :attr:`cuda_graphs`)."""

    def _forget_bindings(self) -> None:
        """Drop bindings and captured graphs (buffers are about to be freed). Default: nothing to drop."""

    @abstractmethod
    def _close(self) -> None:
        """Unload the graph or engine."""

    # -- lifecycle

    def activate(self) -> "CapacityDecoder":
        """Load the graph and allocate every buffer. Idempotent. Raises DSparkError when the device or the graph's
        runtime is missing or the graph does not load."""
        if self._active:
            return self
        self._preflight()
        self.memory = self._memory_factory() if self._memory_factory else self._default_memory()
        self._open()
        self._alloc()
        self._active = True
        return self

    def _preflight(self) -> None:
        """Check that the graph's runtime is installed before any device memory is taken. Default: nothing."""

    def _default_memory(self) -> DeviceMemory:
        return CudaMemory()

    def _alloc(self) -> None:
        mem, d = self.memory, self.spec.dims
        ps = self.entry.profile_settings
        self.layout = DeviceLayout(rows=self.batch, kv_heads=d.num_kv_heads, head_dim=d.head_dim, layers=d.num_layers,
                                   capacity=self.capacity, itemsize=np.dtype(self._kv_dtype).itemsize,
                                   new_len=new_slot_length(self.decode_q, int(ps["prefill_chunk"])))
        lay = self.layout
        self._kv = mem.malloc(2 * lay.layers * lay.slot_bytes)
        self._new = mem.malloc(2 * lay.layers * lay.new_slot_bytes)
        self._scratch = mem.malloc(lay.slot_bytes)
        # cache slots are read (masked, weight 0) before they are written: zeros, never a NaN that 0 x NaN spreads
        mem.zero(self._kv, 2 * lay.layers * lay.slot_bytes)
        io = {**self.plan.inputs, **{k: v for k, v in self.plan.outputs.items() if not k.startswith("new.")}}
        self._dev = {name: mem.malloc(n) for name, n in io.items()}
        self._host = {name: mem.host_buffer(n) for name, n in io.items()}
        self._bucket = self.buckets[0]
        self._length = 0  # positions written on the device (the longest row's)
        self._buffer_maps: dict = {}  # call shape -> _buffers(...), made once per allocation

    def _release(self) -> None:
        mem = self.memory
        self.memory.synchronize()
        self._forget_bindings()
        for ptr in (self._kv, self._new, self._scratch, *self._dev.values()):
            mem.free(ptr)
        for buf in self._host.values():
            mem.free_host(buf)
        self._dev, self._host = {}, {}

    def set_rows(self, batch: int) -> "CapacityDecoder":
        """Serve ``batch`` rows per call from now on (a batched runner's ``rows``): the buffers are re-planned and,
        when activated, re-allocated for it (the graph stays loaded; every cached position and captured graph is
        dropped, so only one runner uses this decoder at a time). No-op when already at ``batch``. Raises
        DSparkError beyond the graph's max_batch."""
        if batch == self.batch:
            return self
        plan = plan_buffers(self.entry, batch, self.capacity)  # validates before anything is freed
        if self._active:
            self._release()
        self.batch, self.plan = batch, plan
        if self._active:
            self._alloc()
        return self

    def deactivate(self) -> None:
        """Free the buffers, captured graphs and the graph itself."""
        if not self._active:
            return
        self._release()
        self._close()
        self.memory.close()
        self.memory, self._active = None, False

    @property
    def max_q(self) -> int:
        """Most tokens one call accepts (the prefill chunk); DecoderRunner.prefill chunks by it."""
        return int(self.entry.profile_settings["prefill_chunk"])

    @property
    def kv_bytes(self) -> int:
        """Device bytes of the KV cache buffers."""
        return self.plan.kv

    def empty_kv(self, batch: int) -> list:
        """A past of length 0 (device handles): per layer (key, value) of shape [batch, kv_heads, 0, head_dim]."""
        if batch != self.batch:
            raise DSparkError(f"this decoder was activated for batch {self.batch}, not {batch}")
        d = self.spec.dims
        h = DeviceKV((batch, d.num_kv_heads, 0, d.head_dim))
        return [(h, h) for _ in range(d.num_layers)]

    # -- buffers of one call

    def _view(self, name: str, shape: tuple, dtype) -> np.ndarray:
        n = int(np.prod(shape))
        return self._host[name][:n * np.dtype(dtype).itemsize].view(dtype).reshape(shape)

    def _buffers(self, b: int, q: int, bucket: int) -> dict:
        """{tensor name: (device address, shape)} of a call of shape (b, q, bucket)."""
        d, lay = self.spec.dims, self.layout
        out = {"input_ids": (self._dev["input_ids"], (b, q)), "position_ids": (self._dev["position_ids"], (b, q)),
               "attention_mask": (self._dev["attention_mask"], (b, 1, q, bucket + q))}
        kv_shape, new_shape = (b, d.num_kv_heads, bucket, d.head_dim), (b, d.num_kv_heads, q, d.head_dim)
        for i, ((pk, pv), (nk, nv)) in enumerate(zip(past_names(d.num_layers), new_names(d.num_layers))):
            out[pk] = (self._kv + 2 * i * lay.slot_bytes, kv_shape)
            out[pv] = (self._kv + (2 * i + 1) * lay.slot_bytes, kv_shape)
            out[nk] = (self._new + 2 * i * lay.new_slot_bytes, new_shape)
            out[nv] = (self._new + (2 * i + 1) * lay.new_slot_bytes, new_shape)
        for t in self.spec.outputs:
            if t.name == "argmax":
                out[t.name] = (self._dev[t.name], (b, q))
            elif not t.name.startswith("new."):
                out[t.name] = (self._dev[t.name], (b, q, int(t.shape[-1])))
        return out

    def _relayout(self, old: int, new: int, length: int) -> None:
        """Move the first ``length`` positions of every row and layer from bucket pitch ``old`` to ``new`` (through
        the scratch buffer, one layer at a time)."""
        lay, mem = self.layout, self.memory
        rows = self.batch * lay.kv_heads
        pb = lay.position_bytes
        for j in range(2 * lay.layers):
            slot = self._kv + j * lay.slot_bytes
            mem.copy_2d(self._scratch, length * pb, slot, old * pb, length * pb, rows)
            mem.copy_2d(slot, new * pb, self._scratch, length * pb, length * pb, rows)
        self.stats["relayouts"] += 1

    def _write_kv(self, writes: list, q: int, bucket: int) -> None:
        """Copy each (row, past, n) of ``writes``: the row's first n new positions into its cache slots past.."""
        lay, mem = self.layout, self.memory
        t0 = time.perf_counter()
        for c in lay.write_copies(writes, q, bucket):
            if (self.stats["kv_write_mode"] == "3d" and c["sslice"] % c["spitch"] == 0
                    and c["dslice"] % c["dpitch"] == 0):
                try:
                    mem.copy_3d(**{**c, "dst": self._kv + c["dst"], "src": self._new + c["src"]})
                    continue
                except DSparkError:  # a runtime without 3-D copies of linear memory: per layer from now on
                    self.stats["kv_write_mode"] = "2d"
            for j in range(c["depth"]):
                mem.copy_2d(self._kv + c["dst"] + j * c["dslice"], c["dpitch"], self._new + c["src"] + j * c["sslice"],
                            c["spitch"], c["width"], c["height"])
        self.stats["kv_writes"] += len(writes)
        self.stats["kv_write_s"] += time.perf_counter() - t0

    # -- one call

    def use_bucket(self, needed: int, keep: int | None = None) -> int:
        """Make the cache buffers' pitch the smallest bucket holding ``needed`` positions (the longest row's cached
        plus new ones), re-laying out the first ``keep`` positions of every row (default: all the device holds) when
        it changes. Returns the bucket. Raises DSparkError beyond the capacity."""
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
        """One call over all ``batch`` rows at the current bucket (:meth:`use_bucket` first).

        input_ids, position_ids: int64 [batch, q]; attention_mask: bool [batch, 1, q, bucket + q] (the capacity
        layout's own mask: cache slots, then the q new positions). ``writes``: [(row, past, n)]: the row's first n
        new K/V positions go to cache slots past..past+n-1 (other rows' and padded positions are not written).
        ``reads``: [(row, n, first)]: what comes back to the host: the row's first n positions of every output but
        the new K/V (the ``argmax`` output, where the graph has one, always: 8 bytes a position), the logits only
        from position ``first`` on. ``with_logits``: False copies no logits back (then the graph must have an
        ``argmax`` output); ``with_features``: False copies no target features back.
        Returns {"logits" / "argmax" / "features": {row: float32 [n - first, vocab] / int64 [n] / float32 [n, F]}}
        (arrays of their own). Raises DSparkError for a shape outside the profile settings, a write beyond the
        bucket, or a device failure."""
        self.activate()
        mem = self.memory
        b, q = input_ids.shape
        bucket = self._bucket
        if b != self.batch:
            raise DSparkError(f"batch {b} but this decoder was activated for batch {self.batch}")
        if q > self.max_q:
            raise DSparkError(f"a call of {q} positions exceeds the graph's prefill chunk {self.max_q}")
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
            mem.to_device(self._dev[name], view)
        key = (b, q, bucket)
        buffers = self._buffer_maps.get(key)
        if buffers is None:
            buffers = self._buffer_maps[key] = self._buffers(b, q, bucket)
        self._bind(key, buffers)
        self._run(key, capturable=q <= self.decode_q)
        self._write_kv(writes, q, bucket)
        names = [t.name for t in self.spec.outputs if not t.name.startswith("new.")
                 and (t.name != "logits" or with_logits) and (t.name != "features" or with_features)]
        if not with_logits and "argmax" not in names:
            raise DSparkError(f"{self.path.name} has no argmax output; copy the logits back (with_logits=True) or "
                              "rebuild the graph")
        specs = {t.name: t for t in self.spec.outputs}
        views = {}
        for name in names:  # [b, q] (argmax) or [b, q, width]: a row's first n positions are one contiguous span
            t = specs[name]
            dt = NUMPY_DTYPES[t.dtype]
            full = self._view(name, (b, q, *([int(t.shape[-1])] if len(t.shape) == 3 else [])), dt)
            views[name] = full
            if name == "argmax" and reads:  # 8 bytes a position: the rows' span in one copy
                lo, hi = min(r for r, _, _ in reads), max(r for r, _, _ in reads) + 1
                mem.to_host(full[lo:hi], self._dev[name] + lo * q * full.itemsize)
                self.stats["d2h_bytes"] += full[lo:hi].nbytes
                continue
            for row, n, first in reads:
                lo = first if name == "logits" else 0
                mem.to_host(full[row, lo:n], self._dev[name] + (row * q + lo) * full[0, 0].nbytes)
                self.stats["d2h_bytes"] += full[row, lo:n].nbytes
        mem.synchronize()
        self._length = max([self._length] + [past + n for _, past, n in writes])
        return {name: {row: views[name][row, (first if name == "logits" else 0):n].copy() for row, n, first in reads}
                for name in names}

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
             kv: list) -> StepOutput:
        """Run the graph once; the interface of :meth:`OrtDecoder.step` (every row at the same past).

        input_ids, position_ids: int64 [batch, q]; attention_mask: bool [batch, 1, q, past + q] (the growing
        layout's); kv: the per-layer handles of the cached past (``past`` = their length, which may be shorter
        than what the device holds after a rollback). Returns logits float32 [batch, q, vocab], features or
        None, and handles of length past + q. Raises DSparkError when the sequence outgrows the capacity or
        a shape is outside the profile settings.
        """
        self.activate()
        b, q = input_ids.shape
        past = kv[0][0].shape[2]
        if b != self.batch:
            raise DSparkError(f"batch {b} but this decoder was activated for batch {self.batch}")
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
