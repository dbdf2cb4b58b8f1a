"""Backends that run a decoder graph. One small interface, Polygraphy-style: construct cheaply,
allocate on ``activate()``, run with ``step()``, free with ``deactivate()``.

Only ONNX Runtime is implemented here (CPU provider by default; CUDA / TensorRT execution
providers when the installed onnxruntime has them and the caller asks).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError
from dspark_runtime.graphspec import GraphSpec, past_names, present_names


@dataclass
class StepOutput:
    """Result of one decoder step.

    logits:   float32 [batch, q_len, vocab]
    features: float32 [batch, q_len, m * hidden] or None (graphs without feature layers)
    kv:       list per layer of (key, value), float32 [batch, kv_heads, past_len + q_len, head_dim]
    """

    logits: np.ndarray
    features: np.ndarray | None
    kv: list


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
    """Runs a ``causal_lm`` graph (growing KV layout) with ONNX Runtime.

    Args:
        path: the ``.onnx`` file (external weights beside it).
        spec: the GraphSpec recorded in the manifest.
        threads: intra-op threads (the machine's physical cores is a good default).
        providers: ONNX Runtime execution providers, default ``["CPUExecutionProvider"]``.
        precision: the graph's precision from the manifest ("fp32", "int8", "fp8", ...).
        allow_slow_precision: run an ``fp8``/``fp16`` graph on the CPU provider anyway; otherwise
            ``activate`` raises DSparkError saying why (see :func:`check_precision_for_providers`).
    """

    def __init__(self, path: str | Path, spec: GraphSpec, threads: int = 2, providers=None,
                 precision: str = "fp32", allow_slow_precision: bool = False):
        self.path = Path(path)
        self.spec = spec
        self.threads = threads
        self.providers = list(providers or ["CPUExecutionProvider"])
        self.precision = precision
        self.allow_slow_precision = allow_slow_precision
        self.session = None
        self._past = past_names(spec.dims.num_layers)
        self._present = present_names(spec.dims.num_layers)
        self._out_names = spec.output_names
        self._has_features = "features" in self._out_names

    def activate(self) -> "OrtDecoder":
        """Create the inference session (loads weights). Idempotent."""
        if self.session is not None:
            return self
        check_precision_for_providers(self.precision, self.providers, self.allow_slow_precision,
                                      what=f"graph {self.path.name}")
        import onnxruntime as ort

        avail = set(ort.get_available_providers())
        missing = [p for p in self.providers if p not in avail]
        if missing:
            raise DSparkError(f"ONNX Runtime execution provider(s) {missing} not available here "
                              f"(available: {sorted(avail)}); pick one of those")
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        # Two sessions (target + draft) share the cores in turn: spinning threads would steal them.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(str(self.path), so, providers=self.providers)
        except Exception as e:
            raise DSparkError(f"ONNX Runtime could not load {self.path}: {e}") from e
        return self

    def deactivate(self) -> None:
        """Drop the session and its memory."""
        self.session = None

    def empty_kv(self, batch: int) -> list:
        """A past of length 0: per layer (key, value) float32 [batch, kv_heads, 0, head_dim]."""
        d = self.spec.dims
        z = np.zeros((batch, d.num_kv_heads, 0, d.head_dim), dtype=np.float32)
        return [(z, z) for _ in range(d.num_layers)]

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray, attention_mask: np.ndarray,
             kv: list) -> StepOutput:
        """Run the graph once.

        input_ids, position_ids: int64 [batch, q_len]; attention_mask: bool
        [batch, 1, q_len, past_len + q_len]; kv: per layer (key, value) float32
        [batch, kv_heads, past_len, head_dim] (made contiguous here if they are views).
        """
        if self.session is None:
            self.activate()
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask}
        for (kn, vn), (k, v) in zip(self._past, kv):
            feeds[kn] = np.ascontiguousarray(k)
            feeds[vn] = np.ascontiguousarray(v)
        outs = self.session.run(self._out_names, feeds)
        logits = outs[0]
        features = outs[1] if self._has_features else None
        first = 2 if self._has_features else 1
        new_kv = [(outs[first + 2 * i], outs[first + 2 * i + 1]) for i in range(self.spec.dims.num_layers)]
        return StepOutput(logits, features, new_kv)
