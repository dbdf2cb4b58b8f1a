"""The ONNX Runtime backend of a decoder graph: :class:`OrtDecoder`, the backend interface (Polygraphy-style: construct
cheaply, allocate on ``activate()``, run with ``step()``, free with ``deactivate()``; :class:`StepOutput` is a step's
result), the session options and process-wide thread pool every DSpark session uses, and the checks that refuse a GPU
precision on the CPU provider (unless asked for) or a GPU provider the installed onnxruntime lacks, naming the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError
from dspark_runtime.engine_dir.graphspec import (LOGITS_FROM, LOGITS_TO, GraphSpec, past_names, slot_bindings,
                                                 slot_call_outputs)
from dspark_runtime.backends.slot_binding import SlotBinding, WrittenEntries
from dspark_runtime.machine.huge_pages import HugePagesForNewMemory
from dspark_runtime.kernels import register_kernels
from dspark_runtime.machine.sysinfo import shared_pool_default  # noqa: F401 (re-exported)


@dataclass
class StepOutput:
    """Result of one decoder step.

    logits:   float32 [batch, q_len, vocab]
    features: float32 [batch, q_len, m * hidden] or None (graphs without feature layers)
    kv:       a sequence per layer of (key, value), float32 [batch, kv_heads, past_len + q_len, head_dim] (the
              scatter layout: the new entries, [batch, kv_heads, q_len, head_dim]; a graph with slot outputs reads
              them back from the written buffers when asked, :class:`WrittenEntries`)
    kv_written: the graph wrote the new entries into the caller's past arrays themselves (a scatter-layout graph
              with slot outputs, every past array C-contiguous float32 and writable); False: they are unchanged
    """

    logits: np.ndarray
    features: np.ndarray | None
    kv: list
    kv_written: bool = False


# Precisions built for GPUs. ONNX Runtime's CPU provider executes them correctly but slowly, so running
# one there must be asked for explicitly (allow_slow_precision=True).
GPU_PRECISIONS = {
    "fp8": "FP8 (E4M3) QDQ is built for TensorRT on GPUs of compute capability >= 8.9; ONNX Runtime's CPU "
           "provider has no FP8 matrix kernels and dequantizes every weight to float32 at every step, "
           "6-10x slower than the fp32 graph",
    "fp16": "fp16 graphs are built for GPUs; ONNX Runtime's CPU provider has few fp16 kernels and runs them "
            "through float32 casts, slower than the fp32 graph",
}
GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider", "NvTensorRTRTXExecutionProvider")

CUDA_INSTALL = ("pip uninstall -y onnxruntime onnxruntime-gpu && pip install onnxruntime-gpu==1.31.1 "
                "'cuda-python>=13,<14' (docs/gpu.md, 'Install and build')")


def cuda_provider_check():
    """Import onnxruntime with its CUDA provider usable: loads the CUDA and cuDNN libraries of the NVIDIA pip
    packages first where this onnxruntime can (``preload_dlls``). Returns the module. Raises DSparkError naming the
    install when the installed onnxruntime has no CUDA provider (the CPU package, or both packages installed over
    each other)."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise DSparkError(f"this onnxruntime ({ort.__version__}) has no CUDA execution provider (available: "
                          f"{', '.join(ort.get_available_providers())}); install the GPU package in its place: "
                          f"{CUDA_INSTALL}")
    preload = getattr(ort, "preload_dlls", None)  # onnxruntime-gpu >= 1.21; absent from older GPU builds
    if preload is not None:
        try:
            preload(cuda=True, cudnn=True, msvc=False)
        except Exception:  # libraries not in pip packages: the system's are found by the loader instead
            pass
    return ort


_SHARED_POOL_THREADS = None  # size of the process-wide ONNX Runtime intra-op pool once made


def enable_shared_thread_pool(threads: int) -> int:
    """Make, once per process, the intra-op thread pool that every ONNX Runtime session of the process then
    shares (ONNX Runtime's global thread pools; threads may spin), and return its size (the first call's
    ``threads``; later calls keep it).

    Why: a speculative round alternates the draft and the target session many times. With one pool per session,
    spinning threads of the idle session steal the cores from the busy one, so per-session pools must not spin,
    and every operator then pays a thread wake-up. The same call limits numpy's BLAS (OpenBLAS, MKL, ...) to one
    thread, process-wide, with threadpoolctl: the runtime's numpy work between graph calls (the DSpark drafter's
    heads, acceptance) is small, and a multi-threaded BLAS would wake threads that fight the pool's spinning ones
    for the cores. Measured effect: docs/serving.md, "Threads".

    Process-wide and irreversible (ONNX Runtime's rule): afterwards every session in the process must be made
    with ``use_per_session_threads = False`` — :func:`session_options` does that for DSpark's own sessions; code
    that creates other ONNX Runtime sessions in the same process must too. So the library leaves it off
    (``Engine.load(shared_thread_pool=False)``) and the CLI, the server and the benchmarks turn it on.
    Raises DSparkError when this onnxruntime has no global thread pools."""
    global _SHARED_POOL_THREADS
    if _SHARED_POOL_THREADS is None:
        try:
            from onnxruntime.capi import _pybind_state

            _pybind_state.set_global_thread_pool_sizes(int(threads), 1)
        except (ImportError, AttributeError, RuntimeError) as e:
            raise DSparkError(f"this onnxruntime cannot make a shared thread pool ({e}); load the engine with "
                              "shared_thread_pool=False") from e
        _SHARED_POOL_THREADS = int(threads)
        limit_blas_threads()
    return _SHARED_POOL_THREADS


def limit_blas_threads(threads: int = 1) -> list:
    """Limit every BLAS library numpy (or anything else in the process) has loaded to ``threads`` threads,
    process-wide, with threadpoolctl (:func:`enable_shared_thread_pool` says why); returns threadpoolctl's
    description of the libraries it changed (empty when none is loaded). No-op when threadpoolctl is missing."""
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        return []
    threadpool_limits(limits=int(threads), user_api="blas")
    return [i for i in threadpool_info() if i.get("user_api") == "blas"]


def session_options(threads: int):
    """``onnxruntime.SessionOptions`` for a CPU session of ``threads`` intra-op threads: on the process-wide pool
    when :func:`enable_shared_thread_pool` made one (its size then applies), else a per-session pool whose
    threads do not spin (two sessions take turns on the cores). Graph optimizations: all."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if _SHARED_POOL_THREADS is not None:
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return so


def check_precision_for_providers(precision: str, providers, allow_slow_precision: bool = False,
                                  what: str = "graph") -> None:
    """Refuse a GPU-only precision (``fp8``, ``fp16``) on ONNX Runtime's CPU provider.

    Raises DSparkError saying why and how to proceed, unless a GPU provider is listed first or
    ``allow_slow_precision``.
    """
    why = GPU_PRECISIONS.get(precision)
    if why is None or allow_slow_precision or (providers and providers[0] in GPU_PROVIDERS):
        return
    raise DSparkError(f"{what} is {precision}: {why}. Run it on a GPU execution provider, use an fp32 or int8 "
                      "engine on this CPU, or pass allow_slow_precision=True (`dspark generate "
                      "--allow-slow-precision`) to run it on the CPU anyway")


class OrtDecoder:
    """Runs a ``causal_lm`` graph with ONNX Runtime: the growing KV layout (past in, present out), or the scatter
    layout (slot buffers in, new entries out; graphs with slot outputs write the new entries into the given buffers
    in place, :attr:`StepOutput.kv_written`).

    Args:
        path: the ``.onnx`` file (external weights beside it).
        spec: the GraphSpec recorded in the manifest.
        threads: intra-op threads (the machine's physical cores is a good default).
        providers: ONNX Runtime execution providers, default ``["CPUExecutionProvider"]``.
        precision: the graph's precision from the manifest ("fp32", "int8", "fp8", ...).
        allow_slow_precision: run an ``fp8``/``fp16`` graph on the CPU provider anyway; otherwise
            ``activate`` raises DSparkError saying why (see :func:`check_precision_for_providers`).
        huge_pages: put the memory the session allocates (its prepacked weights) on huge pages
            (:class:`~dspark_runtime.machine.huge_pages.HugePagesForNewMemory`; False: leave it on base pages).
    """

    #: as a prompt backend (:attr:`~dspark_runtime.runners.scatter.ScatterRunner.prompt_backend`): whether each call
    #: must hold one request with its LM head on one position, and the fewest query positions a call computes
    #: (shorter ones padded); kernels whose results depend on the call's rows otherwise (OpenVINO's) need them
    prompt_calls_alone = False
    min_query_rows = 1

    def __init__(self, path: str | Path, spec: GraphSpec, threads: int = 2, providers=None,
                 precision: str = "fp32", allow_slow_precision: bool = False, huge_pages: bool = True):
        self.path = Path(path)
        self.spec = spec
        self.threads = threads
        self.providers = list(providers or ["CPUExecutionProvider"])
        self.precision = precision
        self.allow_slow_precision = allow_slow_precision
        self.huge_pages = huge_pages
        self.session = None
        self._past = past_names(spec.dims.num_layers)
        # scatter graphs exported with the written slot buffers as outputs: the K/V write happens in place
        self._slots = slot_bindings(spec)
        slot_outputs = set(self._slots.values())
        self._out_names = [n for n in spec.output_names if n not in slot_outputs]
        self._has_features = "features" in self._out_names
        self._slot_call_outputs = slot_call_outputs(spec) if self._slots else []
        self._slot_binding = None
        self.takes_logits_from = LOGITS_FROM in spec.input_names  # graphs exported before it compute every position
        self.takes_logits_to = LOGITS_TO in spec.input_names  # ... and before this, every position from logits_from on

    @property
    def writes_kv_in_place(self) -> bool:
        """Whether :meth:`step` writes the new entries into the given past arrays (a scatter graph with slot
        outputs); the caller must then pass no rows it does not want written."""
        return bool(self._slots)

    def activate(self) -> "OrtDecoder":
        """Create the inference session (loads weights). Idempotent."""
        if self.session is not None:
            return self
        check_precision_for_providers(self.precision, self.providers, self.allow_slow_precision,
                                      what=f"graph {self.path.name}")
        import onnxruntime as ort

        if "CUDAExecutionProvider" in self.providers:
            cuda_provider_check()  # names the install when this onnxruntime is the CPU package
        avail = set(ort.get_available_providers())
        missing = [p for p in self.providers if p not in avail]
        if missing:
            raise DSparkError(f"ONNX Runtime execution provider(s) {missing} not available here "
                              f"(available: {sorted(avail)}); pick one of those")
        so = session_options(self.threads)
        if self.spec.kernels:
            register_kernels(so, self.path.parent / self.spec.kernels)
        try:
            with HugePagesForNewMemory(self.huge_pages):  # the weights it prepacks: streamed every step
                self.session = ort.InferenceSession(str(self.path), so, providers=self.providers)
        except Exception as e:
            raise DSparkError(f"ONNX Runtime could not load {self.path}: {e}") from e
        if self.providers[0] in GPU_PROVIDERS and self.session.get_providers()[0] != self.providers[0]:
            got = self.session.get_providers()
            self.session = None
            raise DSparkError(f"ONNX Runtime created {self.path.name} on {got} instead of {self.providers[0]}: its "
                              "GPU libraries did not load (ONNX Runtime's warning above names the missing one)")
        return self

    def deactivate(self) -> None:
        """Drop the session and its memory."""
        self.session = None
        self._slot_binding = None

    def empty_kv(self, batch: int) -> list:
        """A past of length 0: per layer (key, value) float32 [batch, kv_heads, 0, head_dim]."""
        d = self.spec.dims
        z = np.zeros((batch, d.num_kv_heads, 0, d.head_dim), dtype=np.float32)
        return [(z, z) for _ in range(d.num_layers)]

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
             kv: list, logits_from: int = 0, logits_to: int | None = None) -> StepOutput:
        """Run the graph once.

        input_ids, position_ids: int64 [batch, q_len]; attention_mask: bool
        [batch, 1, q_len, past_len + q_len]; kv: per layer (key, value) float32
        [batch, kv_heads, past_len, head_dim] (made contiguous here if they are views; a scatter graph with slot
        outputs writes the new entries into them in place when they are C-contiguous, :attr:`StepOutput.kv_written`
        says so); logits_from, logits_to: the query positions whose logits come back, logits_from..logits_to - 1
        (``takes_logits_from`` / ``takes_logits_to`` graphs; the logits are then [batch, logits_to - logits_from,
        vocab]); 0 and None = all. Raises DSparkError for a range the graph does not take (logits_from > 0 or
        logits_to < q_len without the input) or an empty or out-of-range one.
        """
        if self.session is None:
            self.activate()
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        q_len = input_ids.shape[1]
        end = q_len if logits_to is None else logits_to
        if not 0 <= logits_from < end <= q_len:
            raise DSparkError(f"logits of positions {logits_from}..{end - 1} asked of a call of {q_len} positions")
        if self.takes_logits_from:
            feeds[LOGITS_FROM] = np.array([logits_from], np.int64)
        elif logits_from:
            raise DSparkError(f"graph {self.path.name} computes the logits of every position (exported before "
                              f"{LOGITS_FROM!r}); call it with logits_from=0")
        if self.takes_logits_to:
            feeds[LOGITS_TO] = np.array([end], np.int64)
        elif end < q_len:
            raise DSparkError(f"graph {self.path.name} computes the logits up to the call's last position (exported "
                              f"before {LOGITS_TO!r}); call it with logits_to=None")
        if self._slots:
            return self._run_writing_slots(feeds, kv, position_ids)
        first = 2 if self._has_features else 1
        outs = self.run_with_kv(feeds, kv, first)[0]
        new_kv = [(outs[first + 2 * i], outs[first + 2 * i + 1]) for i in range(self.spec.dims.num_layers)]
        return StepOutput(outs[0], outs[1] if self._has_features else None, new_kv, False)

    def _run_writing_slots(self, feeds: dict, kv: list, position_ids: np.ndarray) -> StepOutput:
        """One call of a scatter graph with slot outputs on the session's :class:`SlotBinding` (made on the first
        call of a session); the step's new entries are read back from the written buffers when asked."""
        for names, arrays in zip(self._past, kv):
            feeds.update(zip(names, arrays))
        if self._slot_binding is None or self._slot_binding.session is not self.session:
            self._slot_binding = SlotBinding(self.session, self._slots, self._slot_call_outputs)
        outs, arrays, written = self._slot_binding.run(feeds)
        buffers = [(arrays[k], arrays[v]) for k, v in self._past]
        return StepOutput(outs[0], outs[1] if self._has_features else None, WrittenEntries(buffers, position_ids),
                          written)

    def run_with_kv(self, feeds: dict, kv: list, first: int) -> tuple:
        """Run the session on ``feeds`` plus the past ``kv`` (per layer (key, value), made contiguous here); returns
        (every output, in the spec's order; the K/V outputs per layer, the pairs from output ``first`` on)."""
        if self.session is None:
            self.activate()
        for (kn, vn), (k, v) in zip(self._past, kv):
            feeds[kn] = np.ascontiguousarray(k)
            feeds[vn] = np.ascontiguousarray(v)
        outs = self.session.run(self._out_names, feeds)
        return outs, [(outs[first + 2 * i], outs[first + 2 * i + 1]) for i in range(self.spec.dims.num_layers)]
