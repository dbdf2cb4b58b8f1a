"""The DSpark drafter graph (``dspark_draft``) on its TensorRT engine: :class:`TrtDSparkGraph`, the interface of
:class:`dspark_runtime.drafting.dspark.OrtDSparkGraph`, plus the pure planning of long first calls
(:func:`plan_dspark_chunks`, :func:`dspark_chunk_mask`). Engine loading, device/pinned buffers and profile selection
are the decoder backend's (:mod:`dspark_runtime.backends.trt.decoder`). Not yet verified on a GPU (docs/tensorrt.md).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError
from dspark_runtime.engine_dir.graphspec import KV_LAYOUT_GROWING, past_names, present_names
from dspark_runtime.engine_dir.manifest import TrtEngineEntry
from dspark_runtime.backends.trt.decoder import (_bind_buffers, _check, _cuda, _free_buffers, _open_engine, _set_input_shapes,
                                        plan_buffers)


def plan_dspark_chunks(past: int, n_new: int, max_new: int, capacity: int) -> list[tuple[int, int]]:
    """The calls that append ``n_new`` committed positions to a DSpark drafter context of ``past`` positions when
    one call takes at most ``max_new`` (the engine's prefill chunk): ``[(start, end), ...]`` column ranges of the
    new features, the last call also producing the block. ``n_new == 0`` (a one-token prompt's first round) is one
    call ``(0, 0)``: the backend feeds one masked padding column and drops its K/V. Raises DSparkError when the
    context would outgrow ``capacity`` (the engine's ``past_len`` range)."""
    if max_new < 1:
        raise DSparkError(f"max_new must be >= 1, got {max_new}")
    if past + n_new > capacity:
        raise DSparkError(f"the DSpark drafter's context needs {past + n_new} positions but its TensorRT engine takes "
                          f"{capacity}; rebuild it with a larger --capacity or shorten the request")
    if n_new == 0:
        return [(0, 0)]
    return [(s, min(n_new, s + max_new)) for s in range(0, n_new, max_new)]


def dspark_chunk_mask(attention_mask: np.ndarray, past: int, n_new: int, start: int, end: int) -> np.ndarray:
    """The mask of the call covering new columns ``start..end-1`` (:func:`plan_dspark_chunks`) from the whole call's
    ``attention_mask`` bool [b, 1, γ, past + n_new + γ]: the context columns up to ``past + end`` and the γ block
    columns, [b, 1, γ, past + end + γ]. The context K/V of a position depends on its own feature and position only
    (the drafter projects each committed target feature), so chunked calls build the same context as one call and
    the last one's block sees all of it. ``start == end == 0``: one hidden padding column (see
    :func:`plan_dspark_chunks`). Raises DSparkError for a mask of another length."""
    b, one, g, total = attention_mask.shape
    if total != past + n_new + g:
        raise DSparkError(f"attention_mask has {total} key positions but past ({past}) + new ({n_new}) + block ({g}) "
                          f"= {past + n_new + g}")
    ctx = attention_mask[..., :past + end]
    if start == end:  # the padding column, hidden
        ctx = np.concatenate([ctx, np.zeros((b, one, g, 1), dtype=bool)], axis=-1)
    return np.ascontiguousarray(np.concatenate([ctx, attention_mask[..., past + n_new:]], axis=-1))


class TrtDSparkGraph:
    """Runs a ``dspark_draft`` TensorRT engine (growing context layout, ``build-trt``'s ``<key>`` entry) with the
    interface of :class:`dspark_runtime.drafting.dspark.OrtDSparkGraph` (``block_size``, ``embeds_anchor``, ``embedding``,
    ``spec``, ``activate``, ``empty_kv``, ``run``), so :class:`~dspark_runtime.drafting.dspark.DSparkDrafter` drives it
    unchanged.

    The context K/V stays the drafter's: host arrays [rows, kv_heads, S, head_dim] per layer that it grows, pads,
    compacts and drops rows of between rounds (as on ONNX Runtime). A call uploads the past it is handed into
    device buffers, runs the engine and copies the present (past + new positions) and the block's outputs back.
    When the past handed in is the very list the previous call returned (the drafter changed nothing since), the
    device's own present is copied device-to-device instead of uploading it again. More new positions than the
    engine's prefill chunk (a prompt's first round) run as several calls (:func:`plan_dspark_chunks`); one with none
    feeds a hidden padding column. No CUDA graphs: the past length changes every call.

    Args:
        engine_dir: the engine directory; entry: its manifest entry (graph of kind ``dspark_draft``, growing layout).
        embedding: the :class:`~dspark_runtime.drafting.dspark.EmbeddingRows` the anchor rows are read from (set later by
            the Engine, as for ONNX Runtime).
        batch: most rows per call (<= the engine's max_batch); capacity: most context positions (default: the
            engine's).
    Raises DSparkError for an entry of another kind or layout, or settings beyond the engine's profiles.
    Not yet verified on a GPU (docs/tensorrt.md).
    """

    def __init__(self, engine_dir: str | Path, entry: TrtEngineEntry, embedding=None, batch: int = 1,
                 capacity: int | None = None):
        if entry.spec.kind != "dspark_draft" or entry.kv_layout != KV_LAYOUT_GROWING:
            raise DSparkError(f"TrtDSparkGraph runs dspark_draft engines of the growing layout; {entry.file.path} is "
                              f"a {entry.spec.kind} engine of the {entry.kv_layout} layout")
        self.path = Path(engine_dir) / entry.file.path
        self.entry, self.spec, self.embedding, self.batch = entry, entry.spec, embedding, batch
        self.capacity = capacity or int(entry.profile_settings["capacity"])
        self.plan = plan_buffers(entry, batch, self.capacity)  # validates batch / capacity
        self.max_new = int(entry.profile_settings["prefill_chunk"])
        self.block_size = next(t for t in self.spec.inputs if t.name == "block_positions").shape[1]
        self.embeds_anchor = any(t.name == "anchor_embeds" for t in self.spec.inputs)
        self._past = past_names(self.spec.dims.num_layers)
        self._present = present_names(self.spec.dims.num_layers)
        self.context = None
        self.stats = {"calls": 0, "engine_runs": 0, "uploads": 0, "resident": 0}

    @property
    def session(self):
        """Truthy once activated (the attribute :class:`OrtDSparkGraph` callers test)."""
        return self.context

    def activate(self) -> "TrtDSparkGraph":
        """Deserialize the engine and allocate every device and pinned host buffer at the plan's sizes (the past
        and present context buffers for ``capacity`` positions plus a prefill chunk). Idempotent. Raises DSparkError
        when TensorRT or CUDA is missing or the engine does not load on this GPU."""
        if self.context is not None:
            return self
        cudart = _cuda()
        self._trt, self._logger, self._runtime, self.engine, self.context = _open_engine(self.path, self.entry)
        self._stream = _check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking), "cudaStreamCreate")
        per_layer = self.plan.kv // (2 * self.spec.dims.num_layers)
        self._dev, self._host = _bind_buffers(
            self.context, {}, {**{n: per_layer for pair in self._past for n in pair}, **self.plan.inputs,
                               **self.plan.outputs})
        self._profile = None
        self._resident = None  # the kv list the last call returned while its present is still on the device
        return self

    def deactivate(self) -> None:
        """Free the buffers and the stream."""
        if self.context is None:
            return
        _free_buffers(self._dev, self._host, self._stream)
        self.context = self.engine = self._runtime = None
        self._dev, self._host, self._resident = {}, {}, None

    def empty_kv(self, batch: int) -> list:
        """A context of length 0: per layer (key, value) float32 [batch, kv_heads, 0, head_dim] (host arrays)."""
        d = self.spec.dims
        z = np.zeros((batch, d.num_kv_heads, 0, d.head_dim), dtype=np.float32)
        return [(z, z) for _ in range(d.num_layers)]

    def _view(self, name: str, shape: tuple, dtype) -> np.ndarray:
        n = int(np.prod(shape))
        return np.frombuffer(self._host[name][1], dtype=dtype, count=n).reshape(shape)

    def _upload(self, name: str, arr: np.ndarray) -> None:
        cudart = _cuda()
        self._view(name, arr.shape, arr.dtype)[...] = arr
        _check(cudart.cudaMemcpyAsync(self._dev[name], self._host[name][0], arr.nbytes,
                                      cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self._stream), f"upload {name}")

    def _present_to_past(self, nbytes: int) -> None:
        cudart = _cuda()
        for (pk, pv), (ok, ov) in zip(self._past, self._present):
            for past, present in ((pk, ok), (pv, ov)):
                _check(cudart.cudaMemcpyAsync(self._dev[past], self._dev[present], nbytes,
                                              cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self._stream),
                       f"{present} -> {past}")

    def _set_shapes(self, shapes: dict) -> None:
        self._profile = _set_input_shapes(self.context, self.entry, self._stream, shapes, self._profile)

    def run(self, features, feature_positions, anchor_ids, block_positions, attention_mask, kv):
        """One drafting call; the interface of :meth:`OrtDSparkGraph.run`.

        features float32 [b, n, F]; feature_positions int64 [b, n]; anchor_ids int64 [b, 1]; block_positions int64
        [b, γ]; attention_mask bool [b, 1, γ, past + n + γ]; kv per layer (key, value) float32 [b, kvh, past, hd]
        (host arrays). Returns (hidden float32 [b, γ, d], base_logits float32 [b, γ, V_d], present kv per layer
        float32 [b, kvh, past + n, hd], host arrays). Raises DSparkError for more rows than the backend was made
        for, a context beyond the engine's capacity, a graph that takes the anchor's embedding with no table
        given, or a TensorRT/CUDA failure.
        """
        if self.context is None:
            self.activate()
        cudart = _cuda()
        b, n, fdim = features.shape
        past = int(kv[0][0].shape[2])
        d = self.spec.dims
        if b > self.batch:
            raise DSparkError(f"{b} rows but this TensorRT drafter was made for {self.batch}; rebuild the engine "
                              "with a larger --max-batch and construct it with that batch")
        if self.embeds_anchor:
            if self.embedding is None:
                raise DSparkError(f"{self.path}: the DSpark drafter engine takes the anchor's embedding row but the "
                                  "manifest names no table (speculation.dspark.embedding); re-run "
                                  "`dspark-export add-draft`")
            anchor_name, anchor = "anchor_embeds", self.embedding.rows(anchor_ids)
        else:
            anchor_name, anchor = "anchor_ids", np.ascontiguousarray(anchor_ids, dtype=np.int64)
        chunks = plan_dspark_chunks(past, n, self.max_new, self.capacity)
        self.stats["calls"] += 1
        kv_row = d.num_kv_heads * d.head_dim * 4  # bytes per context position per batch row
        if kv is self._resident and past:
            self._present_to_past(b * past * kv_row)
            self.stats["resident"] += 1
        elif past:
            for (pk, pv), (k, v) in zip(self._past, kv):
                self._upload(pk, np.ascontiguousarray(k, dtype=np.float32))
                self._upload(pv, np.ascontiguousarray(v, dtype=np.float32))
            self.stats["uploads"] += 1
        self._upload(anchor_name, anchor)
        self._upload("block_positions", np.ascontiguousarray(block_positions, dtype=np.int64))
        cur = past
        for i, (s, e) in enumerate(chunks):
            if s == e:  # no new position: one hidden padding column
                f = np.zeros((b, 1, fdim), dtype=np.float32)
                fp = np.zeros((b, 1), dtype=np.int64)
            else:
                f = np.ascontiguousarray(features[:, s:e], dtype=np.float32)
                fp = np.ascontiguousarray(feature_positions[:, s:e], dtype=np.int64)
            m = dspark_chunk_mask(attention_mask, past, n, s, e)
            self._upload("features", f)
            self._upload("feature_positions", fp)
            self._upload("attention_mask", m)
            shapes = {"features": f.shape, "feature_positions": fp.shape, anchor_name: anchor.shape,
                      "block_positions": tuple(block_positions.shape), "attention_mask": m.shape}
            for pk, pv in self._past:
                shapes[pk] = shapes[pv] = (b, d.num_kv_heads, cur, d.head_dim)
            self._set_shapes(shapes)
            if not self.context.execute_async_v3(int(self._stream)):
                raise DSparkError(f"TensorRT execute_async_v3 failed for the DSpark drafter (rows {b}, context {cur}, "
                                  f"new {f.shape[1]})")
            self.stats["engine_runs"] += 1
            cur += f.shape[1]
            if i + 1 < len(chunks):  # this call's context is the next call's past
                self._present_to_past(b * cur * kv_row)
        g = self.block_size
        outs = {"hidden": (b, g, d.hidden_size), "base_logits": (b, g, d.vocab_size)}
        outs.update({name: (b, d.num_kv_heads, cur, d.head_dim) for pair in self._present for name in pair})
        for name, shape in outs.items():
            _check(cudart.cudaMemcpyAsync(self._host[name][0], self._dev[name], int(np.prod(shape)) * 4,
                                          cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self._stream), name)
        _check(cudart.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
        res = {name: self._view(name, shape, np.float32).copy() for name, shape in outs.items()}
        keep = past + n  # drops the padding column of a call with no new position
        present = [(res[k][:, :, :keep], res[v][:, :, :keep]) for k, v in self._present]
        self._resident = present if keep == cur else None
        return res["hidden"], res["base_logits"], present
