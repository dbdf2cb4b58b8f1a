"""The in-place K/V write of a scatter graph with slot outputs (:func:`dspark_runtime.engine_dir.graphspec.slot_bindings`):
:class:`SlotBinding`, one session's ONNX Runtime IOBinding kept across calls, each slot output bound to the memory of
its past input so the graph's ``ScatterElements`` writes the new entries into the caller's buffers; and
:class:`WrittenEntries`, a call's new entries read back from those buffers only when a caller asks for them.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np


def _writable_in_place(a: np.ndarray) -> bool:
    return a.flags.c_contiguous and a.flags.writeable and a.dtype == np.float32


class SlotBinding:
    """The IOBinding of one ONNX Runtime session of a scatter graph with slot outputs, kept across its calls.

    Each slot input and its output (``slots``: {past input name: slot output name}) are bound to the memory of the
    caller's past array, and bound again only when a call passes other memory (another data address or shape): a
    decoding loop passes views of the same buffers every step, so a step binds its small inputs and its outputs
    only (the last call's buffers stay referenced until a call passes others or the binding is dropped). Only
    ``out_names`` come back; the new K/V entries stay in the buffers (:class:`WrittenEntries`). A past
    array that is not C-contiguous, float32 and writable is bound as a contiguous copy instead (the caller's array
    is then unchanged). Calls from several threads at once are safe: a call that finds the binding busy runs on a
    binding of its own.
    """

    def __init__(self, session, slots: dict, out_names: list):
        self.session = session
        self.slots = dict(slots)
        self.out_names = list(out_names)
        self._binding = session.io_binding()
        for name in self.out_names:  # bound first: a binding's outputs come back in the order first bound
            self._binding.bind_output(name)
        self._bound: dict = {}  # past input name -> (data address, shape, the bound array: kept alive while bound)
        self._lock = threading.Lock()

    def run(self, feeds: dict) -> tuple:
        """One call on ``feeds`` (every graph input, numpy). Returns (the outputs ``out_names``, numpy, in order;
        {past input name: the array the graph wrote}; whether every one of them is the caller's own array)."""
        if not self._lock.acquire(blocking=False):
            return SlotBinding(self.session, self.slots, self.out_names).run(feeds)
        try:
            return self._run(feeds)
        finally:
            self._lock.release()

    def _run(self, feeds: dict) -> tuple:
        import onnxruntime as ort

        bind, held, written, arrays = self._binding, [], True, {}
        for name, value in feeds.items():
            if name not in self.slots:
                held.append(np.ascontiguousarray(value))  # referenced until the run is over
                bind.bind_cpu_input(name, held[-1])
        for name, out in self.slots.items():
            a = feeds[name]
            if not _writable_in_place(a):
                a, written = np.array(a, dtype=np.float32, order="C"), False
            arrays[name] = a
            key = (a.__array_interface__["data"][0], a.shape)
            if self._bound.get(name, (None, None))[:2] == key:
                continue  # the same memory as the last call's (its array is still referenced here, so not reused)
            value = ort.OrtValue.ortvalue_from_numpy(a)  # wraps the array's memory, no copy
            bind.bind_ortvalue_input(name, value)
            bind.bind_ortvalue_output(out, value)
            self._bound[name] = (*key, a)
        for name in self.out_names:
            bind.bind_output(name)  # a fresh output each call (never the previous call's memory), same place
        self.session.run_with_iobinding(bind)
        got = bind.get_outputs()
        return [got[i].numpy() for i in range(len(self.out_names))], arrays, written


class WrittenEntries(Sequence):
    """The new K/V entries of a call that wrote them into its slot buffers: per layer (key, value) float32
    ``[batch, kv_heads, q_len, head_dim]``, gathered from the written buffers ``[batch, kv_heads, slots, head_dim]``
    at each row's ``position_ids`` (int64 ``[batch, q_len]``) on first read of a layer — a caller that keeps the
    buffers never pays for it. Read them before the buffers' next call."""

    def __init__(self, buffers: list, position_ids: np.ndarray):
        self._buffers = buffers
        self._index = np.asarray(position_ids, dtype=np.int64)[:, None, :, None]
        self._read: dict = {}

    def __len__(self) -> int:
        return len(self._buffers)

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(len(self)))]
        layer = range(len(self))[layer]  # IndexError past the end; a negative index counts from it
        if layer not in self._read:
            k, v = self._buffers[layer]
            self._read[layer] = (np.take_along_axis(k, self._index, axis=2),
                                 np.take_along_axis(v, self._index, axis=2))
        return self._read[layer]
