"""Native TensorRT backend for ``causal_lm`` engines in the capacity KV layout: :class:`TrtDecoder`, a
:class:`~dspark_runtime.backends.device_decoder.CapacityDecoder` whose calls run a TensorRT engine, and the TensorRT
helpers the DSpark drafter's engine shares (:mod:`dspark_runtime.backends.trt.dspark_graph`). No torch: cuda-python
for memory, the stream and CUDA graphs; TensorRT or TensorRT-RTX through :mod:`dspark_runtime.backends.trt.loader`.

Tensor addresses and input shapes are set when the call shape (rows, q, bucket) changes. Decode/verify calls
(``q <= decode_q``, the decode profile) are captured as one CUDA graph per call shape after ``warmup`` uncaptured runs
(TensorRT-RTX specialises kernels on first runs) and replayed from then on; prefill chunks run uncaptured. Not yet
verified on a GPU (docs/tensorrt.md).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from dspark_runtime.backends.device_decoder import CapacityDecoder, plan_buffers
from dspark_runtime.backends.device_memory import cuda_check, cuda_runtime
from dspark_runtime.errors import DSparkError
from dspark_runtime.engine_dir.manifest import TrtEngineEntry
from dspark_runtime.backends.trt.loader import import_tensorrt
from dspark_runtime.backends.trt.profiles import PROFILE_DECODE, pick_profile

_cuda = cuda_runtime  # the names the DSpark drafter's engine (trt_dspark) uses
_check = cuda_check

__all__ = ["TrtDecoder", "plan_buffers"]

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
    :func:`~dspark_runtime.backends.trt.profiles.pick_profile`), switching ``context`` to it on ``stream`` when it is not
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


class TrtDecoder(CapacityDecoder):
    """Runs a capacity-layout ``causal_lm`` TensorRT engine (see the module docstring).

    Args:
        engine_dir: the engine directory.
        entry: its manifest entry (``Manifest.trt_engines[...]``, ``kv_layout == "capacity"``).
        batch: rows per call (<= the engine's max_batch; DecoderRunner uses 1, a DeviceBatchRunner sets its own with
            :meth:`set_rows`).
        capacity: KV positions to allocate (default: the engine's capacity).
        cuda_graphs: capture and replay decode steps.
        warmup: uncaptured runs of a (batch, q, bucket) shape before it is captured.
    Raises DSparkError for an engine of another layout or settings beyond the engine's profiles.
    """

    def __init__(self, engine_dir: str | Path, entry: TrtEngineEntry, batch: int = 1, capacity: int | None = None,
                 cuda_graphs: bool = True, warmup: int = 2):
        super().__init__(Path(engine_dir) / entry.file.path, entry, batch, capacity, cuda_graphs)
        self.warmup = warmup
        self.context = None
        self._graphs: dict = {}  # call shape -> instantiated CUDA graph

    def _open(self) -> None:
        self._trt, self._logger, self._runtime, self.engine, self.context = _open_engine(self.path, self.entry)
        self._forget_bindings()

    def _forget_bindings(self) -> None:
        cudart = _cuda()
        for g in self._graphs.values():
            cudart.cudaGraphExecDestroy(g)
        self._graphs, self._seen, self._bound, self._profile = {}, {}, None, None

    def _bind(self, key: tuple, buffers: dict) -> None:
        if key == self._bound:
            return
        shapes = {name: shape for name, (_, shape) in buffers.items()
                  if name in {t.name for t in self.spec.inputs}}
        self._profile = _set_input_shapes(self.context, self.entry, self.memory.handle, shapes, self._profile)
        for name, (ptr, _) in buffers.items():
            if not self.context.set_tensor_address(name, int(ptr)):
                raise DSparkError(f"TensorRT refused the address of tensor {name}")
        self._bound = key

    def _run(self, key: tuple, capturable: bool) -> None:
        cudart = _cuda()
        stream = self.memory.handle
        capturable = capturable and self.entry.profiles[self._profile]["name"] == PROFILE_DECODE
        if key in self._graphs:
            _check(cudart.cudaGraphLaunch(self._graphs[key], stream), "cudaGraphLaunch")
            self.stats["replayed"] += 1
            return
        seen = self._seen.get(key, 0)
        self._seen[key] = seen + 1
        if capturable and self.cuda_graphs and seen >= self.warmup:
            _check(cudart.cudaStreamBeginCapture(stream,
                                                 cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
                   "cudaStreamBeginCapture")
            ok = self.context.execute_async_v3(int(self.memory.stream))
            graph = _check(cudart.cudaStreamEndCapture(stream), "cudaStreamEndCapture")
            if not ok:
                raise DSparkError(f"TensorRT execute_async_v3 failed while capturing shape {key}")
            self._graphs[key] = _check(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
            cudart.cudaGraphDestroy(graph)
            self.stats["captured"] += 1
            _check(cudart.cudaGraphLaunch(self._graphs[key], stream), "cudaGraphLaunch")
            return
        if not self.context.execute_async_v3(int(self.memory.stream)):
            raise DSparkError(f"TensorRT execute_async_v3 failed for shape (batch, q, bucket) = {key}")
        self.stats["uncaptured"] += 1

    def _close(self) -> None:
        self.context = self.engine = self._runtime = None
