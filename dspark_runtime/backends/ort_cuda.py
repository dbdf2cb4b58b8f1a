"""ONNX Runtime's CUDA execution provider on device-resident buffers: :class:`OrtDeviceDecoder`, the
:class:`~dspark_runtime.backends.device_decoder.CapacityDecoder` that ``--placement target=cuda`` runs on an engine's
device graph (manifest ``device_graphs``, from ``dspark-export build-cuda``).

ONNX Runtime reads and writes the decoder's buffers through one IOBinding per call shape (rows, q, bucket) on the
decoder's own stream, so the cache never crosses the bus. Decode/verify calls (``q <= decode_q``) replay ONNX
Runtime's CUDA graphs, one ``gpu_graph_id`` per call shape, never reused after the buffers are re-allocated (a
captured graph holds the addresses it was captured with); prefill chunks run uncaptured (id -1). Needs
``onnxruntime-gpu`` and cuda-python (:func:`cuda_provider_check` names the install); with ``memory=HostMemory`` the
same code runs on ONNX Runtime's CPU provider.
"""
from __future__ import annotations

from pathlib import Path

from dspark_runtime.backends.ort import CUDA_INSTALL, cuda_provider_check, session_options
from dspark_runtime.backends.device_decoder import NUMPY_DTYPES, CapacityDecoder
from dspark_runtime.errors import DSparkError

class OrtDeviceDecoder(CapacityDecoder):
    """A capacity-layout graph on ONNX Runtime's CUDA provider with device-resident buffers (the module docstring).

    Args (beyond :class:`~dspark_runtime.backends.device_decoder.CapacityDecoder`'s ``batch``, ``capacity``, ``cuda_graphs``,
    ``memory``):
        engine_dir: the engine directory; entry: its device graph (``Manifest.device_graphs[...]``).
        threads: intra-op threads of the CPU stand-in (host memory); unused on a GPU.
    Raises DSparkError (on activation) when onnxruntime has no CUDA provider, the CUDA libraries do not load (ONNX
    Runtime would fall back to the CPU: refused), or the graph does not load.
    """

    def __init__(self, engine_dir: str | Path, entry, batch: int = 1, capacity: int | None = None,
                 cuda_graphs: bool = True, memory=None, threads: int = 2):
        super().__init__(Path(engine_dir) / entry.onnx, entry, batch, capacity, cuda_graphs, memory)
        self.threads = threads
        self.session = None
        self._bindings: dict = {}
        self._graph_ids: dict = {}
        self._next_graph_id = 1  # ids are never reused (a captured graph holds its buffers' addresses)
        self._run_options: dict = {}

    def _preflight(self) -> None:
        if self._memory_factory is None:  # the GPU: the CUDA provider first, then cuda-python's memory
            cuda_provider_check()

    @property
    def on_gpu(self) -> bool:
        return self.memory is not None and self.memory.device_type == "cuda"

    def _open(self) -> None:
        if self.on_gpu:
            ort = cuda_provider_check()
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            opts = {"device_id": str(self.memory.device_id), "user_compute_stream": str(self.memory.stream),
                    "enable_cuda_graph": "1" if self.cuda_graphs else "0", "use_tf32": "0",
                    "arena_extend_strategy": "kSameAsRequested"}
            providers = [("CUDAExecutionProvider", opts)]
        else:
            import onnxruntime as ort

            so = session_options(self.threads)
            providers = ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(self.path), so, providers=providers)
        except Exception as e:
            raise DSparkError(f"ONNX Runtime could not load {self.path} on {providers[0][0] if self.on_gpu else 'CPU'}"
                              f": {e}") from e
        if self.on_gpu and self.session.get_providers()[0] != "CUDAExecutionProvider":
            raise DSparkError(f"ONNX Runtime created {self.path.name} on {self.session.get_providers()} instead of "
                              "the CUDA provider: its CUDA or cuDNN libraries did not load (ONNX Runtime's warning "
                              f"above names the missing one); install them (pip install nvidia-cudnn-cu13 "
                              f"nvidia-cublas) or reinstall: {CUDA_INSTALL}")
        self._ort = ort

    def _bind(self, key: tuple, buffers: dict) -> None:
        if key in self._bindings:
            return
        mem = self.memory
        io = self.session.io_binding()
        dtypes = {t.name: NUMPY_DTYPES[t.dtype] for t in (*self.spec.inputs, *self.spec.outputs)}
        outputs = {t.name for t in self.spec.outputs}
        for name, (ptr, shape) in buffers.items():
            bind = io.bind_output if name in outputs else io.bind_input
            bind(name, mem.device_type, mem.device_id, dtypes[name], list(shape), ptr)
        self._bindings[key] = io

    def _options(self, graph_id: int):
        ro = self._run_options.get(graph_id)
        if ro is None:
            ro = self._ort.RunOptions()
            if self.on_gpu:
                ro.add_run_config_entry("gpu_graph_id", str(graph_id))
                # the decoder synchronizes its own stream after the cache writes and copies back
                ro.add_run_config_entry("disable_synchronize_execution_providers", "1")
            self._run_options[graph_id] = ro
        return ro

    def _run(self, key: tuple, capturable: bool) -> None:
        graph_id = -1
        if capturable and self.cuda_graphs and self.on_gpu:
            graph_id = self._graph_ids.get(key)
            if graph_id is None:
                graph_id = self._graph_ids[key] = self._next_graph_id
                self._next_graph_id += 1
                self.stats["captured"] += 1
            else:
                self.stats["replayed"] += 1
        else:
            self.stats["uncaptured"] += 1
        try:
            self.session.run_with_iobinding(self._bindings[key], self._options(graph_id))
        except Exception as e:
            raise DSparkError(f"ONNX Runtime failed on {self.path.name} for call shape (rows, q, bucket) = {key}: "
                              f"{e}") from e

    def _forget_bindings(self) -> None:
        self._bindings.clear()
        self._graph_ids.clear()

    def _close(self) -> None:
        self.session = None
        self._run_options.clear()
