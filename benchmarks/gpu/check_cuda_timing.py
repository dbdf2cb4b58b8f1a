"""The CUDA check's timing of the Qwen2.5-1.5B-architecture fp16 device graph (``big/`` of ``prepare_cuda``, its
weights regenerated here): step times at q = 1, 2, 4, 8 and batch 1, 8, 32 with CUDA graphs on and off against the
HBM bound, and target-only decoding through the decoding loop (tokens/s). Run by ``check_cuda`` (phase 5).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from benchmarks.gpu.check_cuda_report import check, elapsed, save


# -- 5. the 1.5B-architecture graph

def regenerate_weights(big: Path) -> dict:
    """Write the big graph's weight file: small tensors as prepared, large ones seeded random (N(0, 0.02) in the
    tensor's type; float types only: fp16 / bf16 / fp32)."""
    spec = json.loads((big / "weights.json").read_text())
    small = np.load(big / "small.npz")
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 23) * 0.02).astype(np.float32)
    blocks = {1: block, 10: block.astype(np.float16)}
    u = block.view(np.uint32)
    blocks[16] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # bf16
    t = time.perf_counter()
    total = 0
    with open(big / spec["file"], "wb") as f:
        for i, tz in enumerate(spec["tensors"]):
            f.seek(tz["offset"])
            if f"t{i}" in small:
                f.write(small[f"t{i}"].tobytes())
            else:
                b = blocks.get(tz["data_type"])
                if b is None:
                    raise ValueError(f"tensor {tz['name']}: data type {tz['data_type']} is not a float type")
                raw = b.view(np.uint8)
                n, start = tz["length"], (i * 4099) % (raw.size // 2)
                while n > 0:
                    chunk = raw[start:start + n]
                    f.write(chunk.tobytes())
                    n -= chunk.size
                    start = 0
            total += tz["length"]
    return {"bytes": total, "seconds": round(time.perf_counter() - t, 1)}


def big_decoder(big: Path, cuda_graphs: bool, batch: int = 1):
    from dspark_runtime.engine_dir.manifest import DeviceGraphEntry
    from dspark_runtime.backends.ort_cuda import OrtDeviceDecoder

    entry = DeviceGraphEntry.from_json(json.loads((big / "device_graph.json").read_text()))
    return OrtDeviceDecoder(big, entry, batch=batch, cuda_graphs=cuda_graphs).activate()


def _batches(dec) -> list:
    most = int(dec.entry.profile_settings["max_batch"])
    return sorted({b for b in (1, 8, 32) if b <= most} | {most})


def _time_call(dec, b: int, q: int, past: int, n: int) -> float:
    from dspark_runtime.runners.device import call_inputs

    bucket = dec.use_bucket(past + q)
    rng = np.random.default_rng(q)
    segs = [(r, past, [int(x) for x in rng.integers(3, dec.spec.dims.vocab_size, q)]) for r in range(b)]
    ids, pos, mask = call_inputs(b, q, bucket, segs)
    writes, reads = [(r, past, q) for r in range(b)], [(r, q, 0) for r in range(b)]
    for _ in range(3):  # ONNX Runtime's warm-up runs, then its capture
        dec.run_rows(ids, pos, mask, writes, reads, with_logits=False, with_features=False)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        dec.run_rows(ids, pos, mask, writes, reads, with_logits=False, with_features=False)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def big_step_table(big: Path, deadline: float, graph_modes=(True, False), check_bound: bool = True) -> dict:
    rows = []
    for graphs in graph_modes:
        dec = big_decoder(big, graphs)
        past = min(500, dec.capacity // 2 - 8)
        for b in _batches(dec):
            dec.set_rows(b)
            dec._length = past  # the cache holds `past` positions per row (zeros: timing only)
            for q in (1, 2, 4, 8):
                if elapsed() > deadline:
                    rows.append({"skipped": f"deadline at batch {b} q {q} graphs {graphs}"})
                    break
                s = _time_call(dec, b, q, past, 20)
                rows.append({"cuda_graphs": graphs, "batch": b, "q": q, "context": past, "step_ms": round(s * 1e3, 3),
                             "tokens_per_s": round(b * q / s, 1)})
                print(f"  graphs {'on ' if graphs else 'off'} batch {b:2d} q {q}: {s * 1e3:7.3f} ms/step, "
                      f"{b * q / s:9.1f} positions/s", flush=True)
                save()
        stats = dict(dec.stats)
        dec.deactivate()
        rows.append({"cuda_graphs": graphs, "decoder_stats": stats})
    weight_bytes = sum(t["length"] for t in json.loads((big / "weights.json").read_text())["tensors"])
    hbm = weight_bytes / 4.8e12 * 1e3  # ms to read every weight once at the H200's 4.8 TB/s
    b1 = next((r["step_ms"] for r in rows if r.get("batch") == 1 and r.get("q") == 1 and r.get("cuda_graphs")), None)
    if b1 is not None and check_bound:
        check("batch-1 step within 3x of the HBM bound", b1 <= 3 * hbm,
              f"{b1:.3f} ms vs bound {hbm:.3f} ms ({weight_bytes / 1e9:.2f} GB of weights / 4.8 TB/s): {b1 / hbm:.2f}x")
    return {"rows": rows, "hbm_bound_ms": hbm, "weight_bytes": weight_bytes}


def big_loop(big: Path, deadline: float) -> list:
    """Target-only greedy decoding through the decoding loop (DeviceBatchRunner over the device decoder), B requests
    of 128 random prompt ids and 128 new tokens: tokens/s of the whole loop (prefill included, and apart)."""
    from dspark_runtime.decoding.loop import DecodingLoop
    from dspark_runtime.decoding.settings import LoopSettings
    from dspark_runtime.runners.device import DeviceBatchRunner

    dec = big_decoder(big, True)
    out = []
    rng = np.random.default_rng(1)
    for b in _batches(dec):
        if elapsed() > deadline:
            out.append({"skipped": f"deadline at batch {b}"})
            break
        n = min(128, dec.capacity // 4)  # prompt and new tokens each
        prompts = [[int(x) for x in rng.integers(3, dec.spec.dims.vocab_size, n)] for _ in range(b)]
        for rep in range(2):  # the first run captures the graphs
            runner = DeviceBatchRunner(dec, rows=b)
            loop = DecodingLoop(runner, None, LoopSettings(max_batch=b, prefill_budget=runner.max_chunk * b))
            t = time.perf_counter()
            reqs = [loop.submit(p, max_new_tokens=n) for p in prompts]
            loop.run()
            wall = time.perf_counter() - t
        ttft = float(np.mean([r.stats.ttft_s for r in reqs])) if hasattr(reqs[0].stats, "ttft_s") else None
        new = sum(len(r.token_ids) for r in reqs)
        out.append({"batch": b, "prompt": n, "new_tokens": n, "wall_s": round(wall, 3),
                    "tokens_per_s": round(new / wall, 1), "mean_ttft_s": ttft})
        print(f"  loop batch {b:2d}: {new} tokens in {wall:.2f} s = {new / wall:.1f} tok/s", flush=True)
        save()
    dec.deactivate()
    return out
