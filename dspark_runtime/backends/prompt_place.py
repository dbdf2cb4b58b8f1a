"""Where an engine's prompt chunks run (``Engine.load(prompts=...)``, ``dspark generate/serve --prompts``): on the
target graph like every other call, on the engine's integer-GEMM prompt graph (``dspark-export add-prompt-graph``), or
on the target graph through ONNX Runtime's OpenVINO provider (:mod:`dspark_runtime.backends.ort_openvino`). Either of
the last two runs every prompt chunk of every decoding mode (the scatter runners' ``prompt_backend``), so speculative
output still equals target-only output; the prompt's positions then differ slightly from the target graph's own.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from dspark_runtime.backends.ort_openvino import OrtOpenVinoDecoder
from dspark_runtime.machine import kernel_probe
from dspark_runtime.machine.row_invariance import check_prompt_chunks_invariant
from dspark_runtime.machine.sysinfo import OtherCpuWarning
from dspark_runtime.engine_dir.manifest import PROMPT_GRAPH
from dspark_runtime.errors import DSparkError, InputError

#: auto: the prompt graph where the engine has one (a CPU target of the scatter layout) that this CPU computes right
#: (:func:`prompt_graph_wrong_here`), else the target
PROMPT_PLACES = ("auto", "target", "prompt-graph", "openvino")
#: what each choice means, for the CLI's --prompts
PROMPT_PLACES_HELP = ("Where prompt chunks run, in every decoding mode alike: target; prompt-graph (the engine's, "
                      "`dspark-export add-prompt-graph`); openvino (the target on ONNX Runtime's OpenVINO provider, "
                      "Intel CPUs, pip install 'dspark[openvino]'); auto = prompt-graph where the engine has one "
                      "this CPU computes right, else target.")


def prompt_graph_wrong_here(manifest) -> bool:
    """True when the engine's prompt graph holds 8-bit weights (``quantization.weight_bits``; built on a CPU whose
    u8·s8 kernel accumulates exactly) and this CPU's kernel saturates
    (:func:`~dspark_runtime.machine.kernel_probe.u8s8_saturates`, AVX2 without VNNI): its results would be wrong
    here. A 7-bit prompt graph is right on every CPU."""
    g = manifest.graphs.get(PROMPT_GRAPH)
    return g is not None and (g.quantization or {}).get("weight_bits") == 8 and kernel_probe.u8s8_saturates()


def _rebuild_fix(what: str) -> str:
    return (f"{what}: its 8-bit weights need a u8*s8 kernel that does not saturate (VNNI, AMX), and this CPU's does; "
            "rebuild it for this CPU with `dspark-export add-prompt-graph ENGINE --weight-bits 7` (right on every CPU)")


def resolve_prompt_place(prompts: str, manifest, placement: dict) -> str:
    """The path prompt chunks take for ``prompts`` (one of :data:`PROMPT_PLACES`) on an engine of ``manifest`` placed
    by ``placement`` ({graph key: place}): "target", "prompt-graph" or "openvino". Raises InputError for an unknown
    choice, "prompt-graph" on an engine without one, or either of the two on a target that does not run on the CPU with
    the scatter KV layout (the runners that split prompt chunks off), and "prompt-graph" where the engine's prompt
    graph computes wrong results on this CPU (:func:`prompt_graph_wrong_here`; "auto" then takes the target, with an
    :class:`~dspark_runtime.machine.sysinfo.OtherCpuWarning`)."""
    if prompts not in PROMPT_PLACES:
        raise InputError(f"unknown prompt place {prompts!r}; choose one of {list(PROMPT_PLACES)}")
    cpu_scatter = placement["target"] == "cpu" and manifest.graphs["target"].spec.kv_layout == "scatter"
    has_graph = PROMPT_GRAPH in manifest.graphs and placement.get(PROMPT_GRAPH) == "cpu"
    if prompts == "auto":
        if not (has_graph and cpu_scatter):
            return "target"
        if prompt_graph_wrong_here(manifest):
            warnings.warn(_rebuild_fix("prompt chunks run on the target, not on this engine's prompt graph"),
                          OtherCpuWarning, stacklevel=3)
            return "target"
        return "prompt-graph"
    if prompts == "target":
        return "target"
    if not cpu_scatter:
        raise InputError(f"prompt chunks on {prompts} need the target on the CPU with the scatter KV layout (this "
                         f"one: {placement['target']}, {manifest.graphs['target'].spec.kv_layout}); use --prompts "
                         "target")
    if prompts == "prompt-graph" and not has_graph:
        raise InputError("this engine has no prompt graph on the CPU; add one with `dspark-export add-prompt-graph "
                         "ENGINE`, or use --prompts target")
    if prompts == "prompt-graph" and prompt_graph_wrong_here(manifest):
        raise InputError(_rebuild_fix("this engine's prompt graph would compute wrong results here") +
                         ", or use --prompts target")
    return prompts


class PromptChunkBackend:
    """The backend an engine's prompt chunks run on (the scatter runners' ``prompt_backend``), made on first use.

    Args:
        place: :func:`resolve_prompt_place`'s answer ("target": :meth:`get` gives None).
        engine_dir, manifest: the engine. backends: its {graph key: backend} (the prompt graph's and the target's).
        threads: inference threads of an OpenVINO session.
    """

    def __init__(self, place: str, engine_dir, manifest, backends: dict, threads: int):
        self.place = place
        self._backends = backends
        self._openvino = None
        if place == "openvino":
            t = manifest.graphs["target"]
            self._openvino = OrtOpenVinoDecoder(Path(engine_dir) / t.model_file, t.spec, threads, t.precision)

    def get(self, row_multiple: int):
        """The activated backend, or None for "target". The OpenVINO one is checked chunking-invariant on its first
        activation (its calls hold one request each: the batch cannot change them), with the target's calls padded to ``row_multiple`` rows (raises DSparkError where it is
        not, and drops the session)."""
        if self.place == "target":
            return None
        if self.place == "prompt-graph":
            return self._backends[PROMPT_GRAPH].activate()
        dec = self._openvino
        if dec.session is None:
            dec.activate()
            try:
                check_prompt_chunks_invariant(self._backends["target"].activate(), dec, row_multiple)
            except DSparkError:
                dec.deactivate()
                raise
        return dec
