"""The CUDA check's record and the provider under test: every figure goes into ``REPORT``, rewritten to ``--out``
after each check and phase (JSON: ``checks``, ``phases``, ``gpu``, ``versions``, ``providers``, ``cpu_stand_in``,
``wall_s``; no host names or paths); ``phase`` runs one phase and records a failure without stopping the run.
``CUDA_EP`` is the provider the phases put on the GPU side (ONNX Runtime's CPU one under ``--cpu-stand-in``).
Used by ``check_cuda``.
"""
from __future__ import annotations

import json
import platform
import subprocess
import time
import traceback
from pathlib import Path

import numpy as np

T0 = time.perf_counter()
REPORT: dict = {"checks": [], "phases": {}}
OUT: Path | None = None
CUDA_EP = "CUDAExecutionProvider"  # "CPUExecutionProvider" with --cpu-stand-in


def elapsed() -> float:
    return time.perf_counter() - T0


def save() -> None:
    REPORT["wall_s"] = round(elapsed(), 1)
    if OUT is not None:
        OUT.write_text(json.dumps(REPORT, indent=1, default=str))


def check(name: str, ok: bool, detail: str) -> None:
    REPORT["checks"].append({"name": name, "passed": bool(ok), "detail": detail})
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)
    save()


def phase(name: str, fn, *args):
    """Run one phase; a failure is recorded (with the traceback's last lines) and the run goes on."""
    t = time.perf_counter()
    print(f"== {name} ({elapsed():.0f} s)", flush=True)
    try:
        res = fn(*args)
        REPORT["phases"][name] = {"seconds": round(time.perf_counter() - t, 1), "result": res}
    except Exception as e:
        tb = traceback.format_exc().strip().splitlines()[-6:]
        REPORT["phases"][name] = {"seconds": round(time.perf_counter() - t, 1), "error": f"{type(e).__name__}: {e}",
                                  "traceback": tb}
        check(name, False, f"{type(e).__name__}: {e}")
        print("\n".join(tb), flush=True)
    save()


def environment() -> dict:
    import onnxruntime as ort

    from dspark_runtime.backends.ort import cuda_provider_check

    if CUDA_EP == "CUDAExecutionProvider":
        cuda_provider_check()
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    else:
        gpu = "none: ONNX Runtime CPU standing in for the GPU (--cpu-stand-in), not a GPU result"
    versions = {"python": platform.python_version(), "onnxruntime": ort.__version__, "numpy": np.__version__}
    for mod in ("polygraphy", "onnx", "torch", "transformers", "onnxruntime_genai"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as e:
            versions[mod] = f"not importable ({type(e).__name__})"
    try:
        from cuda.bindings import __version__ as cb
        versions["cuda-bindings"] = cb
    except Exception:
        pass
    REPORT.update(gpu=gpu, versions=versions, providers=ort.get_available_providers())
    print(f"GPU: {gpu}\nversions: {versions}\nproviders: {ort.get_available_providers()}", flush=True)
    return {"gpu": gpu}


def use_cpu_stand_in() -> None:
    """Run every phase on ONNX Runtime's CPU provider with host memory for the device buffers."""
    global CUDA_EP
    from dspark_runtime.backends.device_memory import HostMemory
    from dspark_runtime.backends.ort_cuda import OrtDeviceDecoder

    CUDA_EP = "CPUExecutionProvider"
    OrtDeviceDecoder._preflight = lambda self: None
    OrtDeviceDecoder._default_memory = lambda self: HostMemory()
