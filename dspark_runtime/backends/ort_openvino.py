"""ONNX Runtime's OpenVINO execution provider on the CPU: :class:`OrtOpenVinoDecoder`, the target graph on which
``Engine.load(prompts="openvino")`` runs prompt chunks (verify and decode calls stay on ONNX Runtime's CPU provider),
and what makes that split exact.

The provider comes from the ``onnxruntime-ep-openvino`` plugin (``pip install 'dspark[openvino]'``; it bundles
OpenVINO and loads into the installed onnxruntime through ``register_execution_provider_library``; never the
``onnxruntime-openvino`` build, which replaces the ``onnxruntime`` module). The plugin offers a device on Intel CPUs
only. OpenVINO compiles the graph on its own kernels (int4 weights decompressed into bf16 matrix products on CPUs with
AMX), so its logits differ from the CPU provider's; what keeps speculative output equal to target-only output is that
every mode computes every prompt position on it, and that a position's result does not depend on the call's chunking
or batch (:attr:`OrtOpenVinoDecoder.prompt_calls_alone`, :attr:`~OrtOpenVinoDecoder.min_query_rows`), which
:func:`dspark_runtime.machine.row_invariance.check_prompt_chunks_invariant` verifies on this machine before the first
prompt runs on it.
"""
from __future__ import annotations

import json
from pathlib import Path

from dspark_runtime.backends.ort import OrtDecoder, session_options
from dspark_runtime.machine.huge_pages import HugePagesForNewMemory
from dspark_runtime.errors import DSparkError

OPENVINO_EP = "OpenVINOExecutionProvider"
OPENVINO_INSTALL = "pip install 'dspark[openvino]' (the onnxruntime-ep-openvino plugin)"
_REGISTERED = False  # the plugin's library is registered with this process's ONNX Runtime (once per process)


def openvino_cpu_devices() -> list:
    """ONNX Runtime's EP devices of the OpenVINO plugin on this machine's CPU, registering the plugin's library with
    ONNX Runtime on the first call. Raises DSparkError naming the install when the plugin is missing, and saying why
    when it offers no CPU device (a non-Intel CPU)."""
    import onnxruntime as ort

    try:
        import onnxruntime_ep_openvino as plugin
    except ImportError as e:
        raise DSparkError(f"prompt chunks on OpenVINO need the OpenVINO plugin of ONNX Runtime: {OPENVINO_INSTALL} "
                          f"({e})") from e
    global _REGISTERED
    if not _REGISTERED and not any(d.ep_name == OPENVINO_EP for d in ort.get_ep_devices()):
        try:
            ort.register_execution_provider_library(OPENVINO_EP, plugin.get_library_path())
            _REGISTERED = True
        except Exception as e:  # a plugin built for another onnxruntime
            raise DSparkError(f"ONNX Runtime {ort.__version__} could not load the OpenVINO plugin ({e}); install the "
                              f"plugin version this onnxruntime takes: {OPENVINO_INSTALL}") from e
    devices = [d for d in ort.get_ep_devices()
               if d.ep_name == OPENVINO_EP and d.device.type == ort.OrtHardwareDeviceType.CPU]
    if not devices:
        raise DSparkError("the OpenVINO plugin offers no device on this CPU (it runs on Intel CPUs only); run prompt "
                          "chunks on the target (--prompts target) or on a prompt graph (`dspark-export "
                          "add-prompt-graph`)")
    return devices


class OrtOpenVinoDecoder(OrtDecoder):
    """A ``causal_lm`` graph (the scatter layout's interface, :class:`~dspark_runtime.backends.ort.OrtDecoder`) on ONNX
    Runtime's OpenVINO provider, on the CPU, with ``threads`` inference threads (OpenVINO's own pool; ONNX Runtime's
    pool runs the nodes OpenVINO leaves to the CPU provider). OpenVINO's CPU defaults otherwise (bf16 inference where
    the CPU has AMX; ``config``: other OpenVINO CPU properties, e.g. ``{"INFERENCE_PRECISION_HINT": "f32"}``). Raises
    DSparkError on activation when the plugin or its device is missing or the graph does not load.

    As a prompt backend its calls hold one request each, with the LM head on that request's last position only, and at
    least :attr:`min_query_rows` query positions: OpenVINO's CPU kernels compute a position differently in calls of a
    few rows than in larger ones, and its LM head differently for one row than for several.
    """

    prompt_calls_alone = True
    min_query_rows = 8

    def __init__(self, path: str | Path, spec, threads: int = 2, precision: str = "int4", config: dict | None = None):
        super().__init__(path, spec, threads=threads, providers=[OPENVINO_EP, "CPUExecutionProvider"],
                         precision=precision)
        self.config = {"INFERENCE_NUM_THREADS": str(threads), **(config or {})}

    def activate(self) -> "OrtOpenVinoDecoder":
        """Create the session (OpenVINO compiles the graph: seconds). Idempotent."""
        if self.session is not None:
            return self
        import onnxruntime as ort

        devices = openvino_cpu_devices()
        so = session_options(self.threads)
        so.add_provider_for_devices(devices, {"load_config": json.dumps({"CPU": self.config})})
        try:
            with HugePagesForNewMemory(self.huge_pages):
                self.session = ort.InferenceSession(str(self.path), so)
        except Exception as e:
            raise DSparkError(f"ONNX Runtime's OpenVINO provider could not load {self.path}: {e}") from e
        if self.session.get_providers()[0] != OPENVINO_EP:
            got = self.session.get_providers()
            self.session = None
            raise DSparkError(f"ONNX Runtime created {self.path.name} on {got} instead of OpenVINO")
        return self
