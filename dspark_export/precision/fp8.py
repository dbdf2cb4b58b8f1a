"""FP8 (E4M3) QDQ graphs for TensorRT by NVIDIA ModelOpt's ONNX quantizer, and the choice between it and the
streaming QDQ writer (:func:`choose_fp8_writer`; ``fp8_writer`` ``auto`` | ``modelopt`` | ``stream``).

ModelOpt pins older onnx / onnxruntime-gpu than DSpark, so it lives in its own virtual environment
(:data:`SETUP_HINT`; found by :func:`modelopt_python`) and runs as a subprocess
(:mod:`dspark_export.precision.fp8_worker`), replaying the calibration steps DSpark records
(:func:`dspark_export.precision.activation_ranges.calibrate_graph`) on ONNX Runtime's CPU provider. Only weight
MatMuls are quantized; everything else stays fp32. ModelOpt holds the whole graph (a peak of several times the fp32
weights), unlike the streaming writer (:func:`dspark_export.precision.qdq.quantize_qdq`, peak ≈ one weight); ``auto``
takes ModelOpt only when it is installed and fits in the available memory. Measurements: docs/precision.md.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError

from dspark_export.graphs.onnx_io import graph_weight_bytes, quant_targets
from dspark_export.paths import cache_root
from dspark_export.precision.activation_ranges import calibrate_graph

SETUP_HINT = ('python3 -m venv ~/.cache/dspark/venvs/modelopt && ~/.cache/dspark/venvs/modelopt/bin/pip install '
              '"torch==2.13.0" "nvidia-modelopt[onnx]==0.47.0"  (or set DSPARK_MODELOPT_PYTHON)')


FP8_WRITERS = ("auto", "modelopt", "stream")
# ModelOpt's peak RSS over the graph's fp32 weight bytes (about 7.5x, rounded up; docs/precision.md)
MODELOPT_MEMORY_FACTOR = 8.0


def available_memory_bytes() -> int | None:
    """Memory this process could still allocate without swapping, bytes: ``psutil``'s
    ``virtual_memory().available`` when psutil is installed, else ``MemAvailable`` of ``/proc/meminfo``
    (kB -> bytes); None when neither can be read (not Linux and no psutil)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fp8_writer(writer: str) -> str:
    """``writer`` if it is one of :data:`FP8_WRITERS`, else DSparkError naming the choices."""
    if writer not in FP8_WRITERS:
        raise DSparkError(f"fp8 writer {writer!r} is unknown; choose one of {', '.join(FP8_WRITERS)} "
                          "(auto: ModelOpt when installed and its memory fits, else the streaming writer)")
    return writer


def choose_fp8_writer(src: Path, writer: str = "auto", log=print) -> tuple:
    """Which writer makes the fp8 graph of the fp32 graph ``src``: ``"modelopt"`` or ``"stream"``.

    ``writer``: ``"modelopt"`` / ``"stream"`` are taken as asked (an explicit ``"modelopt"`` without ModelOpt
    fails later in :func:`quantize_fp8` with the setup hint, as before); ``"auto"`` takes ModelOpt when
    :func:`modelopt_python` finds its environment and ``MODELOPT_MEMORY_FACTOR`` (8) x the graph's fp32
    weight bytes fits in :func:`available_memory_bytes`, else the memory-bounded streaming writer (also
    when the available memory cannot be read). The choice and its reason are logged.
    Returns (writer, reason: str). Raises DSparkError for an unknown writer name or a missing graph.
    """
    check_fp8_writer(writer)
    if writer != "auto":
        reason = f"--fp8-writer {writer} asked for"
    elif modelopt_python() is None:
        writer, reason = "stream", "NVIDIA ModelOpt is not installed"
    else:
        need = MODELOPT_MEMORY_FACTOR * graph_weight_bytes(src)
        avail = available_memory_bytes()
        gib = f"~{need / 2**30:.1f} GiB ({MODELOPT_MEMORY_FACTOR:.0f}x the fp32 weights of {Path(src).name})"
        if avail is None:
            writer, reason = "stream", f"ModelOpt needs {gib} and the available memory is unknown"
        elif need > avail:
            writer, reason = "stream", f"ModelOpt would need {gib}, more than the {avail / 2**30:.1f} GiB available"
        else:
            writer, reason = "modelopt", f"ModelOpt is installed and {gib} fits in {avail / 2**30:.1f} GiB available"
    log(f"  fp8 writer: {writer} ({reason})")
    return writer, reason


def modelopt_python() -> Path | None:
    """The Python of the ModelOpt environment, or None when none is installed: ``$DSPARK_MODELOPT_PYTHON``, else
    ``<cache>/venvs/modelopt`` (``$DSPARK_CACHE`` or ``~/.cache/dspark``), else ``/work/venvs/modelopt``."""
    env = os.environ.get("DSPARK_MODELOPT_PYTHON")
    cands = [Path(env)] if env else [cache_root() / "venvs" / "modelopt" / "bin" / "python",
                                     Path("/work/venvs/modelopt/bin/python")]
    for p in cands:
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def _normalise_external_data(dst: Path) -> None:
    """Make ``dst`` reference its weights as ``<dst name>.data`` (ModelOpt writes ``<dst name>_data``)."""
    import onnx

    model = onnx.load(str(dst), load_external_data=False)
    want = dst.name + ".data"
    locs = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    if locs == {want} or not locs:
        return
    if len(locs) != 1:
        raise DSparkError(f"ModelOpt wrote {dst}'s weights to several files {sorted(locs)}; expected one")
    (old,) = locs
    (dst.parent / old).rename(dst.parent / want)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = want
    onnx.save_model(model, str(dst))


def inspect_fp8_graph(path: Path) -> dict:
    """ONNX checker + ``polygraphy inspect model`` on an FP8 QDQ graph. Returns {"checker": "passed",
    "polygraphy": first lines of its summary, "fp8_tensors", "quantize_linear", "dequantize_linear"}.
    Raises DSparkError when either check fails."""
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except Exception as e:
        raise DSparkError(f"{path} fails the ONNX checker: {e}") from e
    model = onnx.load(str(path), load_external_data=False)
    fp8 = sum(t.data_type == onnx.TensorProto.FLOAT8E4M3FN for t in model.graph.initializer)
    ops = [n.op_type for n in model.graph.node]
    exe = shutil.which("polygraphy") or str(Path(os.sys.executable).with_name("polygraphy"))
    if not Path(exe).is_file():
        raise DSparkError("polygraphy is not installed; pip install polygraphy")
    proc = subprocess.run([exe, "inspect", "model", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DSparkError(f"polygraphy inspect model {path} failed: {proc.stderr[-500:]}")
    text = [l.strip() for l in proc.stdout.splitlines() if "----" in l or "Opset" in l]
    return {"checker": "passed", "polygraphy": text, "fp8_tensors": fp8,
            "quantize_linear": ops.count("QuantizeLinear"), "dequantize_linear": ops.count("DequantizeLinear")}


def quantize_fp8(src: Path, dst: Path, spec, calibration_ids: list, *, exclude=(), verify_len: int = 8,
                 python: Path | None = None, log=print) -> dict:
    """FP8 (E4M3) QDQ copy of the fp32 graph ``src`` at ``dst`` (+ ``dst.data``) with NVIDIA ModelOpt.

    Args:
        src: fp32 ``causal_lm`` graph (never modified; ModelOpt's intermediate files go to a temp folder).
        spec: its GraphSpec. calibration_ids: token-id lists of calibration-split prompts.
        exclude: module-name patterns kept fp32 (as :func:`dspark_export.graphs.onnx_io.quant_targets`).
        python: the ModelOpt environment's Python (default :func:`modelopt_python`).
    Returns the manifest's quantization record (method, settings, calibration summary, checks, time,
    peak RSS of the ModelOpt process). Raises DSparkError when ModelOpt is not installed or fails.
    """
    import onnx

    python = python or modelopt_python()
    if python is None:
        raise DSparkError(f"fp8 needs NVIDIA ModelOpt in its own environment; create it with: {SETUP_HINT}")
    src, dst = Path(src), Path(dst)
    t0 = time.perf_counter()
    targets, skipped = quant_targets(onnx.load(str(src), load_external_data=False), exclude)
    with tempfile.TemporaryDirectory(prefix="dspark-fp8-", dir=dst.parent) as tmp:
        tmp = Path(tmp).resolve()  # absolute: the worker runs with cwd=tmp (a relative -o path broke it)
        feeds = []
        table = calibrate_graph(src, spec, calibration_ids, verify_len=verify_len, exclude=exclude,
                                on_feeds=lambda f: feeds.append({k: np.array(v) for k, v in f.items()}), log=log)
        np.savez(tmp / "feeds.npz", **{f"{i}/{k}": v for i, f in enumerate(feeds) for k, v in f.items()})
        del feeds
        out = tmp / dst.name
        model_src = src.resolve()
        data = model_src.with_name(model_src.name + ".data")
        if data.is_file() and data.stat().st_nlink > 1:
            # onnx >= 1.18 refuses external data with several hard links ("potential hardlink attack"), and
            # `dspark-export quantize` hard-links unchanged graphs between engines: hand ModelOpt a private copy
            log(f"  {data.name} has {data.stat().st_nlink} hard links (shared with another engine); ModelOpt gets a copy")
            model_src = tmp / "src" / model_src.name
            model_src.parent.mkdir()
            shutil.copyfile(src.resolve(), model_src)
            shutil.copyfile(data, model_src.with_name(data.name))
        (tmp / "args.json").write_text(json.dumps({"src": str(model_src), "dst": str(out), "nodes": [
            t.node for t in targets], "feeds": str(tmp / "feeds.npz")}))
        log(f"  ModelOpt fp8 quantization of {src.name} ({len(targets)} MatMuls) in {python}")
        proc = subprocess.run([str(python), str(Path(__file__).with_name("fp8_worker.py")), str(tmp / "args.json")],
                              capture_output=True, text=True, cwd=tmp)
        if proc.returncode != 0 or not out.is_file():
            raise DSparkError(f"ModelOpt fp8 quantization failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
        _normalise_external_data(out)
        for p in (dst, dst.with_name(dst.name + ".data")):
            if p.exists():
                p.unlink()
        out.rename(dst)
        out.with_name(out.name + ".data").rename(dst.with_name(dst.name + ".data"))
    checks = inspect_fp8_graph(dst)
    child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    rep = {"precision": "fp8", "writer": "modelopt",
           "method": "NVIDIA ModelOpt ONNX PTQ (quantize_mode='fp8', calibration_method='max', "
           "calibration_eps=['cpu'], op_types_to_quantize=['MatMul'] on weight MatMuls, disable_mha_qdq, "
           "high_precision_dtype='fp32')", "activations": "FLOAT8E4M3FN per tensor",
           "weights": "FLOAT8E4M3FN (ModelOpt default scaling)", "quantized": len(targets),
           "excluded": sorted({q.module for q in skipped}), "excluded_patterns": list(exclude),
           "lm_head_quantized": any(q.module == "lm_head" for q in targets), "checks": checks,
           "calibration": table.summary(), "modelopt_python": str(python),
           "seconds": round(time.perf_counter() - t0, 1), "peak_rss_gb_modelopt": round(child_peak, 2),
           "requires": "TensorRT on compute capability >= 8.9 (ONNX Runtime CPU runs it 6-10x slower than fp32)"}
    log(f"  fp8 graph {dst.name}: checker passed, polygraphy inspected; {checks['fp8_tensors']} FP8 tensors; "
        f"{rep['seconds']:.0f} s, ModelOpt peak RSS {child_peak:.2f} GiB")
    return rep
