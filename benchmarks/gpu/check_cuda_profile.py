"""The CUDA check's profile of the 1.5B-architecture device graph: the node types ONNX Runtime's CUDA session makes
of it, and the GPU kernels of batch-1 verify steps (torch's profiler) with CUDA graphs off and on. Needs a GPU (the
CPU stand-in skips it). Run by ``check_cuda`` (phase 5, unless ``--skip profile``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks.gpu.check_cuda_report import save
from benchmarks.gpu.check_cuda_timing import big_decoder


def big_graph_ops(big: Path) -> dict:
    """The node types of the big graph as ONNX Runtime's CUDA session optimizes it (what the step's kernels come
    from)."""
    import collections

    import onnx

    from dspark_runtime.backends.ort import cuda_provider_check

    ort = cuda_provider_check()
    entry = json.loads((big / "device_graph.json").read_text())
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(big / "optimized.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.onnx.data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(big / entry["onnx"]), so, providers=["CUDAExecutionProvider"])
    opt = onnx.load(str(big / "optimized.onnx"), load_external_data=False)
    ops = collections.Counter(n.op_type for n in opt.graph.node)
    out = {"optimized_nodes": len(opt.graph.node), "optimized_ops": dict(ops.most_common(40))}
    print(f"  optimized graph: {len(opt.graph.node)} nodes: {ops.most_common(25)}", flush=True)
    for f in ("optimized.onnx", "optimized.onnx.data"):
        (big / f).unlink(missing_ok=True)
    return out


def big_profile(big: Path) -> dict:
    """The GPU kernels of 10 batch-1 verify steps (q 8; torch's profiler: CUPTI sees every kernel of the process),
    per step: count, summed kernel time, the top kernels; CUDA graphs off and on."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    from dspark_runtime.runners.device import call_inputs

    out = {}
    torch.cuda.init()
    for graphs in (False, True):
        dec = big_decoder(big, graphs)
        past, q = 500, 8
        bucket = dec.use_bucket(past + q)
        dec._length = past
        ids, pos, mask = call_inputs(1, q, bucket, [(0, past, list(range(100, 100 + q)))])
        args = (ids, pos, mask, [(0, past, q)], [(0, q, 0)])
        for _ in range(4):
            dec.run_rows(*args, with_logits=False, with_features=False)
        n = 10
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(n):
                dec.run_rows(*args, with_logits=False, with_features=False)
            wall = (time.perf_counter() - t) / n
        kernels = collections.defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if str(getattr(e, "device_type", "")).endswith("CUDA"):
                k = kernels[e.name[:90]]
                k[0] += 1
                k[1] += e.time_range.elapsed_us()  # a device event: its kernel's duration
        per_step = sum(c for c, _ in kernels.values()) / n
        busy = sum(t for _, t in kernels.values()) / n / 1e3
        top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:20]
        res = {"wall_ms": wall * 1e3, "kernels_per_step": per_step, "kernel_ms_per_step": busy,
               "top": [{"kernel": k, "per_step": c / n, "ms_per_step": t / n / 1e3} for k, (c, t) in top]}
        out["graphs_on" if graphs else "graphs_off"] = res
        print(f"  graphs {'on' if graphs else 'off'}: {wall * 1e3:.2f} ms/step wall, {per_step:.0f} kernels/step, "
              f"{busy:.2f} ms of kernel time/step", flush=True)
        for r in res["top"][:12]:
            print(f"    {r['ms_per_step']:7.3f} ms  x{r['per_step']:5.1f}  {r['kernel']}", flush=True)
        dec.deactivate()
        save()
    return out
