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
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from benchmarks.evalsets import child_env

T0 = time.perf_counter()
REPORT: dict = {"checks": [], "phases": {}}
OUT: Path | None = None
CUDA_EP = "CUDAExecutionProvider"  # "CPUExecutionProvider" with --cpu-stand-in
PROMPTS = ["def quicksort(xs): return the list sorted, shortest code first", "hi", "a b c d e f g h i j k l m n"]


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


# -- 1. Polygraphy

def _growing_feeds(spec, past: int, q: int, seed: int) -> dict:
    d = spec.dims
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(3, d.vocab_size, (1, q)).astype(np.int64),
             "position_ids": np.arange(past, past + q, dtype=np.int64)[None],
             "attention_mask": np.tril(np.ones((q, past + q), bool), past)[None, None]}
    for i in range(d.num_layers):
        for kv in ("key", "value"):
            feeds[f"past.{i}.{kv}"] = (rng.normal(size=(1, d.num_kv_heads, past, d.head_dim)) * 0.5).astype(np.float32)
    return feeds


def _capacity_feeds(spec, past: int, q: int, bucket: int, seed: int) -> dict:
    g = _growing_feeds(spec, past, q, seed)
    d = spec.dims
    feeds = {k: g[k] for k in ("input_ids", "position_ids")}
    mask = np.zeros((1, 1, q, bucket + q), bool)
    mask[..., :past] = True
    mask[0, 0, :, bucket:] = np.tril(np.ones((q, q), bool))
    feeds["attention_mask"] = mask
    dtypes = {t.name: t.dtype for t in spec.inputs}
    for i in range(d.num_layers):
        for kv in ("key", "value"):
            name = f"past.{i}.{kv}"
            buf = np.zeros((1, d.num_kv_heads, bucket, d.head_dim), dtypes[name])
            buf[:, :, :past] = g[name]
            feeds[name] = buf
    return feeds


def polygraphy_parity(root: Path) -> list:
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator, CompareFunc
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.WARNING

    from dspark_runtime.engine_dir.manifest import load_manifest

    out = []
    cases = []
    m32 = load_manifest(root / "tiny-fp32")
    g = m32.graphs["target"]
    cases.append(("growing fp32", root / "tiny-fp32" / g.model_file, root / "tiny-fp32" / g.model_file,
                  [_growing_feeds(g.spec, p, q, s) for s, (p, q) in enumerate([(8, 1), (8, 4), (30, 5)])], 1e-3))
    for name in ("tiny-fp32", "tiny-fp16"):
        e = load_manifest(root / name).device_graphs["target"]
        ref = root / name / e.onnx  # the same graph on ONNX Runtime's CPU provider
        tol = 1e-3 if e.precision == "fp32" else 5e-2
        cases.append((f"capacity {e.precision}", root / name / e.onnx, ref,
                      [_capacity_feeds(e.spec, p, q, 32, s) for s, (p, q) in enumerate([(8, 1), (20, 5)])], tol))
    for label, path, ref, feeds, tol in cases:
        runners = [OnnxrtRunner(SessionFromOnnx(str(ref), providers=["CPUExecutionProvider"]), name="cpu"),
                   OnnxrtRunner(SessionFromOnnx(str(path), providers=[CUDA_EP]), name="cuda")]
        results = Comparator.run(runners, data_loader=feeds)
        acc = Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol={"": tol}, rtol={"": tol}))
        diffs = {}
        for it_cpu, it_cuda in zip(results["cpu"], results["cuda"]):
            for k in it_cpu:
                a, b = np.asarray(it_cpu[k]), np.asarray(it_cuda[k])
                diffs[k] = max(diffs.get(k, 0.0), float(np.abs(a.astype(np.float64) - b).max()) if a.size else 0.0)
        am = [float((np.asarray(c["logits"]).argmax(-1) == np.asarray(u["logits"]).argmax(-1)).mean())
              for c, u in zip(results["cpu"], results["cuda"])]
        row = {"graph": label, "tolerance": tol, "polygraphy_passed": bool(acc), "max_abs_diff": diffs,
               "argmax_agreement": min(am)}
        out.append(row)
        check(f"Polygraphy CUDA vs CPU, {label}", bool(acc) and min(am) == 1.0,
              f"max |dlogits| {diffs.get('logits', 0):.2e} (tol {tol}), argmax agreement {min(am):.3f}")
    return out


# -- 2. the device decoder against the growing graph

def decoder_parity(root: Path) -> dict:
    from dspark_runtime import Engine

    res = {}
    for name in ("tiny-fp32", "tiny-fp16"):
        ref = Engine.load(root / name, threads=2).runner("target")
        eng = Engine.load(root / name, threads=2, placement="target=cuda")
        dev = eng.runner("target")
        prompt = list(range(5, 45))
        diffs, agree = [], []
        a, b = ref.prefill(prompt, chunk=16), dev.prefill(prompt, chunk=16)
        diffs.append(float(np.abs(a - b).max()))
        agree.append(bool(a.argmax() == b.argmax()))
        for toks, keep in (([3, 4, 5, 6], 42), ([9, 9], 44), ([1, 2, 3, 4, 5], 40), ([7], 41)):
            la, lb = ref.step(toks), dev.step(toks)
            diffs.append(float(np.abs(la - lb).max()))
            agree += list(la.argmax(-1) == lb.argmax(-1))
            ref.rollback(keep)
            dev.rollback(keep)
        st = dict(dev.backend.stats)
        tol = 1e-3 if name == "tiny-fp32" else 1e-1  # fp16: the tiny model's logits reach ~40 (x8 LM head)
        res[name] = {"max_abs_diff": max(diffs), "argmax_agreement": float(np.mean(agree)), "stats": st}
        check(f"device decoder vs CPU growing graph, {name}", max(diffs) < tol and all(agree),
              f"max |dlogits| {max(diffs):.2e} (tol {tol}), argmax {np.mean(agree):.3f}, relayouts {st['relayouts']}, "
              f"cache writes {st['kv_writes']} ({st['kv_write_mode']})")
        eng._backends["target"].deactivate()
    return res


# -- 3. exactness

def exactness(root: Path) -> dict:
    from dspark_runtime import Engine

    cpu = Engine.load(root / "tiny-fp32", threads=2)
    ref = [cpu.generate(t, max_new_tokens=32, draft=None, raw=True).token_ids for t in PROMPTS]
    res = {}
    for name in ("tiny-fp32", "tiny-fp16"):
        eng = Engine.load(root / name, threads=2, placement="target=cuda")
        plain = [eng.generate(t, max_new_tokens=32, draft=None, raw=True).token_ids for t in PROMPTS]
        spec = [eng.generate(t, max_new_tokens=32, draft="lm", draft_length=4, raw=True) for t in PROMPTS]
        batch = [r.token_ids for r in eng.generate_batch(PROMPTS, max_new_tokens=32, draft="lm", draft_length=4,
                                                          max_batch=3, raw=True)]
        st = dict(eng._backends["target"].stats)
        tau = float(np.mean([r.stats.accepted_length_mean for r in spec]))
        same_cpu = sum(p == r for p, r in zip(plain, ref))
        ok = [r.token_ids for r in spec] == plain and batch == plain and (name != "tiny-fp32" or plain == ref)
        res[name] = {"speculative_equals_target_only": [r.token_ids for r in spec] == plain,
                     "batch_equals_alone": batch == plain, "target_only_equals_cpu_fp32": f"{same_cpu}/3",
                     "tau": tau, "placement": spec[0].stats.placement, "stats": st}
        check(f"greedy exactness on the GPU, {name}", ok,
              f"speculative == target-only {res[name]['speculative_equals_target_only']}, batch of 3 == alone "
              f"{batch == plain}, == CPU fp32 {same_cpu}/3, tau {tau:.2f}; CUDA graph ids {st['captured']}, "
              f"replayed runs {st['replayed']}, uncaptured {st['uncaptured']}")
        eng._backends["target"].deactivate()
    return res


# -- 4. FP8

def fp8_probe(root: Path) -> dict:
    from dspark_runtime.backends.ort import OrtDecoder
    from dspark_runtime.engine_dir.manifest import load_manifest

    m = load_manifest(root / "tiny-fp8")
    g = m.graphs["target"]
    path = root / "tiny-fp8" / g.model_file
    feeds = _growing_feeds(g.spec, 30, 5, 3)
    out = {}
    for label, prov in (("cpu", ["CPUExecutionProvider"]), ("cuda", [CUDA_EP])):
        dec = OrtDecoder(path, g.spec, threads=2, providers=prov, precision="fp8", allow_slow_precision=True)
        dec.activate()
        kv = [(feeds[f"past.{i}.key"], feeds[f"past.{i}.value"]) for i in range(g.spec.dims.num_layers)]
        r = dec.step(feeds["input_ids"], feeds["position_ids"], feeds["attention_mask"], kv)
        t = time.perf_counter()
        for _ in range(20):
            dec.step(feeds["input_ids"], feeds["position_ids"], feeds["attention_mask"], kv)
        out[label] = {"logits": r.logits, "ms": (time.perf_counter() - t) / 20 * 1e3,
                      "providers": dec.session.get_providers()}
    diff = float(np.abs(out["cpu"]["logits"] - out["cuda"]["logits"]).max())
    agree = float((out["cpu"]["logits"].argmax(-1) == out["cuda"]["logits"].argmax(-1)).mean())
    res = {"max_abs_diff_vs_cpu": diff, "argmax_agreement": agree,
           "step_ms": {k: v["ms"] for k, v in out.items()}, "providers": out["cuda"]["providers"]}
    check("FP8 QDQ graph on the CUDA provider", agree == 1.0,
          f"runs on {out['cuda']['providers'][0]}, max |dlogits| vs CPU {diff:.2e}, argmax {agree:.3f}, step "
          f"{out['cuda']['ms']:.2f} ms (CPU {out['cpu']['ms']:.2f} ms; tiny graph: launch-bound)")
    return res


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


def _big_decoder(big: Path, cuda_graphs: bool, batch: int = 1):
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
        dec = _big_decoder(big, graphs)
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

    dec = _big_decoder(big, True)
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
        dec = _big_decoder(big, graphs)
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


def use_cpu_stand_in() -> None:
    """Run every phase on ONNX Runtime's CPU provider with host memory for the device buffers."""
    global CUDA_EP
    from dspark_runtime.backends.device_memory import HostMemory
    from dspark_runtime.backends.ort_cuda import OrtDeviceDecoder

    CUDA_EP = "CPUExecutionProvider"
    OrtDeviceDecoder._preflight = lambda self: None
    OrtDeviceDecoder._default_memory = lambda self: HostMemory()


def main() -> int:
    """Runs the phases in order, each recorded with PASS/FAIL where it checks something (a failed phase is recorded
    and the run goes on):

    1. parity through Polygraphy: the tiny target's growing fp32 graph and its fp32/fp16 device graphs on the CUDA
       provider against ONNX Runtime's CPU provider (OnnxrtRunner + Comparator; max |diff| per output, tolerances);
    2. the device decoder (OrtDeviceDecoder: K/V resident on the GPU, IOBinding, CUDA graphs) against the growing graph
       on the CPU over a chunked prefill, verify steps and rollbacks across capacity buckets;
    3. exactness: greedy speculative (draft LM, γ=4) == target-only on the GPU == the CPU engine's target-only, for
       one request and three decoded together, fp32 and fp16 device graphs; CUDA-graph replays counted;
    4. FP8: the tiny FP8 QDQ graph on the CUDA provider (does it load and run, agreement with the CPU, step time);
    5. the Qwen2.5-1.5B-architecture fp16 device graph (weights regenerated here): step time at q = 1, 2, 4, 8 and
       batch 1, 8, 32 with CUDA graphs on and off, and target-only decoding through the decoding loop (tokens/s);
    6. peers on the same GPU (benchmarks/peers/gpu_peers.py: ONNX Runtime GenAI CUDA fp16 and transformers), time
       permitting (``--deadline-s``).
    """
    global OUT
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
    OUT = a.out
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
