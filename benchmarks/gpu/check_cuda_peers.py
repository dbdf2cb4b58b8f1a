"""The CUDA check's peers phase: ``benchmarks.peers.gpu_peers`` (a random Qwen2.5-1.5B-architecture model, ONNX
Runtime GenAI CUDA fp16 and transformers) on the same GPU, each step a child process within the deadline; their
JSON reports go into the check's. Run by ``check_cuda`` (phase 6).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.evalsets import child_env
from benchmarks.gpu.check_cuda_report import elapsed, save


# -- 6. peers

def peers(root: Path, deadline: float, work: Path) -> dict:
    res = {}
    hf = work / "peer-hf"
    left = deadline - elapsed()
    if left < 60:
        return {"skipped": "no time left"}
    steps = [("make-model", [str(hf)]),
             ("genai", [str(hf), str(work / "peer-genai"), "--out", str(work / "genai.json"), "--cuda-graph", "both",
                        "--repeats", "2"]),
             ("hf", [str(hf), "--out", str(work / "hf.json"), "--caches", "dynamic,static", "--repeats", "1"])]
    for name, args in steps:
        left = deadline - elapsed()
        if left < 30:
            res[name] = {"skipped": "deadline"}
            continue
        t = time.perf_counter()
        limit = [] if name == "make-model" else ["--deadline-s", str(int(left - 10))]
        p = subprocess.run([sys.executable, "-m", "benchmarks.peers.gpu_peers", name, *args, *limit],
                           capture_output=True, text=True, timeout=left, env=child_env())
        res[name] = {"rc": p.returncode, "seconds": round(time.perf_counter() - t, 1),
                     "tail": (p.stdout + p.stderr)[-1500:]}
        print(f"  peer {name}: rc {p.returncode} in {time.perf_counter() - t:.0f} s", flush=True)
        js = work / f"{name}.json"
        if js.exists():
            res[name]["result"] = json.loads(js.read_text())
        save()
    return res
