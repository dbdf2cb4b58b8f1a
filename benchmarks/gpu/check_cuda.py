"""The runtime on ONNX Runtime's CUDA provider, checked and timed on an NVIDIA GPU in one run: parity with the CPU
provider (Polygraphy), the device decoder, exactness of speculative decoding, FP8, the 1.5B-architecture fp16 device
graph (step times, CUDA graphs, the decoding loop) and the peers on the same GPU (:func:`main` lists the phases).
Run by ``bash scripts/gpu_check.sh cuda`` on inputs ``benchmarks/gpu/prepare_cuda.py`` made; prints a transcript
and writes every figure to ``--out`` (JSON, rewritten after each phase; no host names or paths).

    python -m benchmarks.gpu.check_cuda .carry/gpu-cuda --out $OUT/gpu-check-cuda.json [--deadline-s 450]
    python -m benchmarks.gpu.check_cuda .carry/gpu-cuda --out x.json --cpu-stand-in   # its own code, on any CPU
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from benchmarks.gpu import check_cuda_report as report
from benchmarks.gpu.check_cuda_exactness import decoder_parity, exactness, fp8_probe, polygraphy_parity
from benchmarks.gpu.check_cuda_peers import peers
from benchmarks.gpu.check_cuda_profile import big_graph_ops, big_profile
from benchmarks.gpu.check_cuda_report import REPORT, elapsed, environment, phase, save, use_cpu_stand_in
from benchmarks.gpu.check_cuda_timing import big_loop, big_step_table, regenerate_weights


def main() -> int:
    """Runs the phases in order, each recorded with PASS/FAIL where it checks something (a failed phase is recorded
    and the run goes on; 1-4 in ``check_cuda_exactness``, 5 in ``check_cuda_timing`` and ``check_cuda_profile``, 6 in
    ``check_cuda_peers``, the record in ``check_cuda_report``):

    1. parity through Polygraphy: the tiny target's growing fp32 graph and its fp32/fp16 device graphs on the CUDA
       provider against ONNX Runtime's CPU provider (OnnxrtRunner + Comparator; max |diff| per output, tolerances);
    2. the device decoder (OrtDeviceDecoder: K/V resident on the GPU, IOBinding, CUDA graphs) against the growing graph
       on the CPU over a chunked prefill, verify steps and rollbacks across capacity buckets;
    3. exactness: greedy speculative (draft LM, γ=4) == target-only on the GPU == the CPU engine's target-only, for
       one request and three decoded together, fp32 and fp16 device graphs; CUDA-graph replays counted;
    4. FP8: the tiny FP8 QDQ graph on the CUDA provider (does it load and run, agreement with the CPU, step time);
    5. the Qwen2.5-1.5B-architecture fp16 device graph (weights regenerated here): step time at q = 1, 2, 4, 8 and
       batch 1, 8, 32 with CUDA graphs on and off, and target-only decoding through the decoding loop (tokens/s);
       on a GPU also the graph as ONNX Runtime optimizes it and the kernels of a verify step;
    6. peers on the same GPU (benchmarks/peers/gpu_peers.py: ONNX Runtime GenAI CUDA fp16 and transformers), time
       permitting (``--deadline-s``).
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="the folder benchmarks/gpu/prepare_cuda.py wrote")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline-s", type=float, default=450)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-check-work"))
    ap.add_argument("--skip", default="", help="comma-separated phases to skip: tiny,fp8,big,profile,table,loop,peers")
    ap.add_argument("--cpu-stand-in", action="store_true",
                    help="ONNX Runtime CPU and host memory in place of the GPU: checks this script's own code on any "
                         "machine (not a GPU result; peers skipped)")
    a = ap.parse_args()
    report.OUT = a.out
    skip = set(a.skip.split(","))
    if a.cpu_stand_in:
        use_cpu_stand_in()
        skip.update({"peers", "profile"})
        REPORT["cpu_stand_in"] = True
    a.work.mkdir(parents=True, exist_ok=True)
    phase("environment", environment)
    if "tiny" not in skip:
        phase("polygraphy parity", polygraphy_parity, a.root)
        phase("device decoder parity", decoder_parity, a.root)
        phase("exactness", exactness, a.root)
    if "fp8" not in skip:
        phase("fp8", fp8_probe, a.root)
    big = a.root / "big"
    if "big" not in skip and (big / "weights.json").exists():
        phase("regenerate weights", regenerate_weights, big)
        if "profile" not in skip:
            phase("1.5B graph as optimized", big_graph_ops, big)
            phase("1.5B step profile", big_profile, big)
        if "table" not in skip:
            phase("1.5B step table", big_step_table, big, a.deadline_s * 0.55)
        unfused = a.root / "big-unfused"  # the first H200 run's graph (no RoPE fusion, float32 cache): A/B in one run
        if "table" not in skip and (unfused / "weights.json").exists():
            phase("regenerate weights (before)", regenerate_weights, unfused)
            phase("1.5B step table, before the RoPE fusion and the fp16 cache", big_step_table, unfused,
                  a.deadline_s * 0.6, (True,), False)
            (unfused / json.loads((unfused / "weights.json").read_text())["file"]).unlink(missing_ok=True)
        if "loop" not in skip:
            phase("1.5B decoding loop", big_loop, big, a.deadline_s * 0.65)
        (big / json.loads((big / "weights.json").read_text())["file"]).unlink(missing_ok=True)
    if "peers" not in skip:
        phase("peers", peers, a.root, a.deadline_s, a.work)
    passed = sum(c["passed"] for c in REPORT["checks"])
    print(f"{passed}/{len(REPORT['checks'])} checks passed in {elapsed():.0f} s", flush=True)
    save()
    shutil.rmtree(a.work, ignore_errors=True)
    return 0 if passed == len(REPORT["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
