"""Checks an engine runs when it loads (:meth:`dspark_runtime.engine.Engine.load`): the target's row padding from the
manifest's probe, whether the probe and the cost table were measured on this CPU, and whether an INT8 graph's
weights and DSpark's own kernels (:mod:`dspark_runtime.kernels`) suit this CPU. Each reads the manifest and warns or raises; none touches a graph.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from dspark_runtime.engine_dir.manifest import Manifest
from dspark_runtime.errors import InputError
from dspark_runtime.kernels import kernel_path
from dspark_runtime.machine import kernel_probe
from dspark_runtime.machine.sysinfo import OtherCpuWarning, cpu_difference, cpu_features


def target_sha256(manifest: Manifest) -> str:
    """The sha256 of the target graph's first file (what a stored row padding probe names)."""
    return manifest.graphs["target"].files[0].sha256


def row_multiple(manifest: Manifest, engine_dir: Path, backend: str, given: int | None, threads: int) -> int:
    """The target's row padding (:mod:`dspark_runtime.machine.row_invariance`): ``given``, else the probed value in
    the manifest (``speculation.row_invariance.row_multiple``, written by ``dspark-export profile`` for
    the ONNX Runtime backend), else 1. A stored probe is ignored (with a warning) when it was made on
    another target graph, and a warning says when it was made with another thread count. Raises
    InputError for a value that is not a positive integer, or above 1 with the TensorRT backend (its
    decode profile and CUDA graphs are sized for unpadded verify blocks; not probed)."""
    if given is None:
        probe = manifest.speculation.row_invariance or {}
        given = probe.get("row_multiple") if probe.get("backend", "ort") == backend else None
        if given is not None and probe.get("target_sha256") not in (None, target_sha256(manifest)):
            warnings.warn(f"{engine_dir}: the stored row padding was probed on another target graph; ignored (run "
                          "`dspark-export profile --row-probe-only` on this engine)", stacklevel=3)
            given = None
        elif given is not None and probe.get("threads") not in (None, threads):
            warnings.warn(f"{engine_dir}: the row padding ({given}) was probed with {probe['threads']} threads, this "
                          f"engine runs {threads}; re-probe with `dspark-export profile --row-probe-only --threads "
                          f"{threads}` if outputs must be bit-exact", stacklevel=3)
        given = 1 if given is None else given
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise InputError(f"row_multiple must be a positive integer (1 = no padding), got {given!r}")
    if given > 1 and backend != "ort":
        raise InputError("row padding (row_multiple > 1) is for the ONNX Runtime backend; the TensorRT engines' "
                         "decode profile and CUDA graphs are sized for unpadded verify blocks")
    return given


def head_skips_padding(manifest: Manifest, backend: str, given_row_multiple: int | None) -> bool:
    """Whether the target's LM head may skip padding positions (:attr:`~dspark_runtime.runners.base.BatchRunner.
    head_skips_padding`): the stored row probe found it invariant, and that probe's padding is the one in use (no
    ``given_row_multiple``, the probe made for this backend and this target graph)."""
    probe = manifest.speculation.row_invariance or {}
    return (given_row_multiple is None and probe.get("backend", "ort") == backend and bool(probe.get("row_multiple"))
            and probe.get("target_sha256") in (None, target_sha256(manifest)) and bool(probe.get("head_skips_padding")))


def check_int8_weights(manifest: Manifest, engine_dir: Path, backend: str) -> None:
    """Warn (:class:`~dspark_runtime.machine.sysinfo.OtherCpuWarning`) when an INT8 graph holds 8-bit U8S8 weights
    (``reduce_range`` False in its quantization record) and this CPU's u8·s8 kernel saturates
    (:func:`~dspark_runtime.machine.kernel_probe.u8s8_saturates`): its outputs would be wrong here."""
    eight_bit = [k for k, g in manifest.graphs.items()
                 if g.precision == "int8" and (g.quantization or {}).get("reduce_range") is False]
    if eight_bit and backend == "ort":
        if kernel_probe.u8s8_saturates():
            warnings.warn(f"{engine_dir}: graph(s) {', '.join(eight_bit)} hold 8-bit U8S8 weights, but this CPU's "
                          "u8*s8 kernel saturates (no VNNI): their outputs will be wrong here; re-quantize with "
                          "the default 7-bit weights (`dspark-export quantize`)", OtherCpuWarning, stacklevel=4)


def check_kernels(manifest: Manifest, engine_dir: Path) -> None:
    """Warn (:class:`~dspark_runtime.machine.sysinfo.OtherCpuWarning`) when a graph runs on DSpark's kernels
    (``spec.kernels``) and this CPU takes their portable path (no AVX2): correct, but several times slower than the
    engine was built for."""
    libs = sorted({g.spec.kernels for g in manifest.graphs.values() if g.spec.kernels})
    for lib in libs:
        path = Path(engine_dir) / lib
        if path.is_file() and kernel_path(str(path)) == "portable":
            warnings.warn(f"{engine_dir}: this CPU has no AVX2, so DSpark's kernels ({lib}) run their portable path, "
                          "several times slower; rebuild the engine here with `--int4-source gguf-compact`",
                          OtherCpuWarning, stacklevel=4)


def check_cpu(manifest: Manifest, engine_dir: Path, backend: str, probe_used: bool = True) -> None:
    """Warn (once, :class:`~dspark_runtime.machine.sysinfo.OtherCpuWarning`) when the stored row padding probe
    (``speculation.row_invariance``, when this engine uses it: ``probe_used`` and its backend and target
    graph) or the cost table (``speculation.cost_table``) was measured on another CPU than this one
    (:func:`~dspark_runtime.machine.sysinfo.cpu_difference` of their ``cpu`` records): both depend on the ISA
    paths of ONNX Runtime's kernels. Records without ``cpu`` (older engines) are not checked."""
    spec = manifest.speculation
    probe = spec.row_invariance or {}
    table = spec.cost_table or {}
    records = []
    if (probe_used and isinstance(probe.get("cpu"), dict) and probe.get("backend", "ort") == backend
            and probe.get("target_sha256") in (None, target_sha256(manifest))):
        records.append(("the row padding probe (speculation.row_invariance)", probe["cpu"]))
    if isinstance(table.get("cpu"), dict):
        records.append(("the cost table (speculation.cost_table)", table["cpu"]))
    if not records:
        return
    here = cpu_features()
    diffs = [(what, d) for what, rec in records if (d := cpu_difference(rec, here)) is not None]
    if not diffs:
        return
    if len(diffs) == 2 and diffs[0][1] == diffs[1][1]:
        what = f"the row padding probe and the cost table were measured on another CPU ({diffs[0][1]})"
    else:
        what = "; ".join(f"{w} was measured on another CPU ({d})" for w, d in diffs)
    warnings.warn(f"{engine_dir}: {what}; row-count invariance and round costs depend on the CPU's ISA paths "
                  f"in ONNX Runtime's kernels: run `dspark-export profile {engine_dir}` on this machine",
                  OtherCpuWarning, stacklevel=4)
