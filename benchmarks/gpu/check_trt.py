"""The TensorRT runtime path checked on an NVIDIA GPU, on a tiny engine (run by ``bash scripts/gpu_check.sh trt``):
logits parity with ONNX Runtime CPU, exactness of speculative decoding, CUDA graphs, the DSpark drafter on TensorRT
and batched decoding (``DeviceBatchRunner``); each check printed PASS/FAIL with its numbers (:func:`main` lists
them), exit status 0 only if every check passed. ``--cpu-stand-in``: check 5 alone on any machine, ONNX Runtime
CPU standing in for the TensorRT engines (:func:`use_cpu_stand_ins`; run from the repository root: it uses the tests).

    PYTHONPATH=. .venv-gpu/bin/python -m benchmarks.gpu.check_trt ENGINE_DIR [--flavour auto|rtx|enterprise] [--rebuild]
    python -m benchmarks.gpu.check_trt ENGINE_DIR --cpu-stand-in
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dspark_runtime import Engine
from dspark_runtime.engine_dir.manifest import load_manifest
from dspark_runtime.backends.trt.decoder import TrtDecoder
from dspark_runtime.backends.trt.loader import import_tensorrt

RESULTS = []


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append(ok)
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def main() -> int:
    """The checks.

    ENGINE_DIR is a tiny engine (ONNX graphs + manifest; ``bash scripts/gpu_check.sh --prepare`` makes one on any
    machine). If it carries no TensorRT engines, or --rebuild, they are built here (enterprise TensorRT must
    build on the GPU it targets; TensorRT-RTX engines built ahead of time on a CPU are used as they are, which is
    the point of checking them). Checks, each printed PASS/FAIL with its numbers:

    1. logits parity, TensorRT vs ONNX Runtime CPU, over a chunked prefill and decode/verify steps with rollbacks
       that cross a capacity bucket (max |dlogits|, argmax agreement);
    2. speculative greedy (draft LM, γ=4) == target-only greedy on TensorRT, and == ONNX Runtime's greedy;
    3. CUDA graphs: decode steps captured after warm-up and replayed; time per step with and without graphs;
    4. the DSpark drafter on its TensorRT engine (placement ``dspark=trt``): block outputs and context K/V against its
       ONNX graph on ONNX Runtime CPU over a first call longer than the engine's prefill chunk (chunked) and three
       rounds (the device-resident context reused); speculative greedy with ``draft="dspark"`` on
       ``target=trt,dspark=trt`` == target-only greedy on TensorRT == ONNX Runtime CPU's target-only and DSpark
       speculative greedy; drafting pass time, TensorRT against ONNX Runtime CPU;
    5. batched decoding (``DeviceBatchRunner``, 4 rows): 4 prompts decoded together on TensorRT, target-only and with the
       draft LM and the DSpark drafter on TensorRT, against each prompt alone in a 4-row runner (the same call shapes:
       independent of the batch by construction except the capacity bucket), alone through ``generate`` (1 row: equal
       only where TensorRT's GEMMs do not depend on the row count), and ONNX Runtime CPU's target-only greedy; the same
       with the bucket pinned; timings (batched against one after another), capture keys, CUDA-graph replays and
       whether the engine's argmax output was used.
    Exit status 0 only if every check passed.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--flavour", default="auto")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--cpu-stand-in", action="store_true", help="check 5 only, ONNX Runtime CPU for the engines")
    a = ap.parse_args()
    if a.cpu_stand_in:
        use_cpu_stand_ins()
        check_batched(a.engine_dir, Engine.load(a.engine_dir, threads=2))
        print(f"{sum(RESULTS)}/{len(RESULTS)} checks passed (ONNX Runtime CPU standing in for TensorRT: not a GPU run)")
        return 0 if all(RESULTS) else 1
    trt, flavour, version = import_tensorrt(a.flavour)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    print(f"python {platform.python_version()}, {flavour} {version}, GPU: {gpu}")
    m = load_manifest(a.engine_dir)
    if a.rebuild or "target.capacity" not in m.trt_engines or m.trt_engines["target.capacity"].flavour != flavour:
        from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt
        from dspark_runtime.backends.trt.profiles import ProfileSettings

        cc = gpu.split(",")[1].strip() if "," in gpu else None
        ccs = (cc,) if flavour == "tensorrt-rtx" and cc else None
        t0 = time.perf_counter()
        build_trt(a.engine_dir, TrtBuildSettings(flavour=a.flavour, compute_capabilities=ccs, profile=ProfileSettings(
            max_batch=4, decode_q=5, prefill_chunk=16, capacity=128, min_bucket=32)), isolate=False)
        print(f"built TensorRT engines here in {time.perf_counter() - t0:.1f} s")
    else:
        e = m.trt_engines["target.capacity"]
        print(f"using the engines built ahead of time ({e.flavour} {e.version}, compute capabilities "
              f"{', '.join(e.compute_capabilities)}, built in {e.build_seconds:.1f} s)")

    ort_eng = Engine.load(a.engine_dir, threads=2)
    t0 = time.perf_counter()
    trt_eng = Engine.load(a.engine_dir, backend="trt")
    ra, rb = ort_eng.runner("target"), trt_eng.runner("target")
    print(f"TensorRT engine loaded and activated in {time.perf_counter() - t0:.2f} s "
          f"(KV buffers {rb.backend.kv_bytes / 2**20:.2f} MiB, buckets {rb.backend.buckets})")

    # 1. parity
    ids = list(range(5, 45))
    chunk = rb.backend.max_q  # the engine's prefill chunk
    la, lb = ra.prefill(ids, chunk=chunk), rb.prefill(ids, chunk=chunk)
    diffs, agree = [float(np.abs(la - lb).max())], [int(la.argmax() == lb.argmax())]
    for step in range(16):
        toks = [(7 * step + i) % 300 + 3 for i in range(1 + step % 5)]
        xa, xb = ra.step(toks), rb.step(toks)
        diffs.append(float(np.abs(xa - xb).max()))
        agree += list((xa.argmax(-1) == xb.argmax(-1)).astype(int))
        keep = ra.length - (step % 3)
        ra.rollback(keep)
        rb.rollback(keep)
    st = dict(rb.backend.stats)
    check("logits parity TensorRT vs ONNX Runtime", max(diffs) < 1e-2 and min(agree) == 1,
          f"max |dlogits| {max(diffs):.2e} over {len(diffs)} steps (prefill, decode/verify with rollbacks, "
          f"final length {rb.length}); argmax agreement {np.mean(agree):.0%}; backend stats {st}")

    # 2. exactness
    prompt = "def add(a, b):"
    ref = trt_eng.generate(prompt, max_new_tokens=32, draft=None)
    spec = trt_eng.generate(prompt, max_new_tokens=32, draft="lm", draft_length=4)
    ort_ref = ort_eng.generate(prompt, max_new_tokens=32, draft=None)
    check("speculative greedy == target-only greedy (TensorRT)", spec.token_ids == ref.token_ids,
          f"{len(ref.token_ids)} tokens, tau {spec.stats.accepted_length_mean:.2f}")
    check("TensorRT greedy == ONNX Runtime greedy", ref.token_ids == ort_ref.token_ids,
          f"first divergence at {next((i for i, (x, y) in enumerate(zip(ref.token_ids, ort_ref.token_ids)) if x != y), None)}")

    # 3. CUDA graphs
    def time_decode(graphs: bool, n: int = 200) -> tuple[float, dict]:
        e = load_manifest(a.engine_dir).trt_engines["target.capacity"]
        dec = TrtDecoder(a.engine_dir, e, cuda_graphs=graphs).activate()
        from dspark_runtime.runners.sequence import DecoderRunner

        r = DecoderRunner(dec)
        r.prefill(list(range(5, 25)))
        for _ in range(5):  # warm-up (and capture, with graphs)
            r.step([7])
            r.rollback(r.length - 1)
        t0 = time.perf_counter()
        for _ in range(n):
            r.step([7, 8, 9, 10, 11])
            r.rollback(r.length - 5)
        dt = (time.perf_counter() - t0) / n
        s = dict(dec.stats)
        dec.deactivate()
        return dt, s

    t_plain, s_plain = time_decode(False)
    t_graph, s_graph = time_decode(True)
    check("CUDA graphs captured and replayed", s_graph["captured"] >= 1 and s_graph["replayed"] >= 190,
          f"with graphs {s_graph}; without {s_plain}")
    print(f"decode step (q=5, tiny model): {t_plain * 1e6:.0f} us without CUDA graphs, {t_graph * 1e6:.0f} us with "
          f"({t_plain / t_graph:.2f}x)")
    check_dspark(a.engine_dir, ort_eng)
    check_batched(a.engine_dir, ort_eng)
    print(f"{sum(RESULTS)}/{len(RESULTS)} checks passed")
    return 0 if all(RESULTS) else 1


def check_dspark(engine_dir: Path, ort_eng: Engine) -> None:
    """Check 4: the DSpark drafter graph on its TensorRT engine (dspark_runtime.backends.trt.dspark_graph.TrtDSparkGraph)."""
    from dspark_runtime.backends.trt.dspark_graph import TrtDSparkGraph

    m = load_manifest(engine_dir)
    if "dspark" not in m.trt_engines:
        check("DSpark drafter TensorRT engine present", False, f"engines: {sorted(m.trt_engines)}; re-run --prepare")
        return
    trt_eng = Engine.load(engine_dir, placement="target=trt,dspark=trt")
    ga, gb = ort_eng._backends["dspark"].activate(), trt_eng._backends["dspark"].activate()
    assert isinstance(gb, TrtDSparkGraph)
    rng = np.random.default_rng(0)
    kva, kvb, past, G = ga.empty_kv(1), gb.empty_kv(1), 0, gb.block_size
    fdim = ga.spec.inputs[0].shape[-1]
    diffs, agree = [], []
    for n in (40, 3, 5, 1):  # 40 > the engine's prefill chunk (16): chunked; then rounds on the resident context
        args = (rng.normal(size=(1, n, fdim)).astype(np.float32), np.arange(past, past + n)[None], np.array([[9]]),
                np.arange(past + n, past + n + G)[None], np.ones((1, 1, G, past + n + G), dtype=bool))
        ha, ba, kva = ga.run(*args, kva)
        hb, bb, kvb = gb.run(*args, kvb)
        past += n
        kv_diff = max(float(np.abs(x - y).max()) for pa, pb in zip(kva, kvb) for x, y in zip(pa, pb))
        diffs.append((float(np.abs(ha - hb).max()), float(np.abs(ba - bb).max()), kv_diff))
        agree += list((ba.argmax(-1) == bb.argmax(-1)).ravel().astype(int))
    worst = [max(d[i] for d in diffs) for i in range(3)]
    check("DSpark drafter TensorRT vs ONNX Runtime", worst[0] < 1e-2 and worst[2] < 1e-2 and min(agree) == 1,
          f"max |dhidden| {worst[0]:.2e}, |dbase_logits| {worst[1]:.2e}, |dcontext K/V| {worst[2]:.2e} over 4 calls "
          f"(context {past}); block argmax agreement {np.mean(agree):.0%}; stats {gb.stats}")
    prompt = "def add(a, b):"
    ref = trt_eng.generate(prompt, max_new_tokens=32, draft=None)
    spec = trt_eng.generate(prompt, max_new_tokens=32, draft="dspark", draft_length=4)
    ort_ref = ort_eng.generate(prompt, max_new_tokens=32, draft=None)
    ort_spec = ort_eng.generate(prompt, max_new_tokens=32, draft="dspark", draft_length=4)
    check("speculative greedy with dspark=trt == target-only greedy (TensorRT)", spec.token_ids == ref.token_ids,
          f"{len(ref.token_ids)} tokens, placement {spec.stats.placement}, tau {spec.stats.accepted_length_mean:.2f}")
    check("dspark=trt speculative == ONNX Runtime CPU (target-only and DSpark speculative)",
          spec.token_ids == ort_ref.token_ids == ort_spec.token_ids,
          f"ONNX Runtime tau {ort_spec.stats.accepted_length_mean:.2f}")

    def time_pass(g, reps: int = 100) -> float:
        kv = g.empty_kv(1)
        _, _, kv = g.run(rng.normal(size=(1, 20, fdim)).astype(np.float32), np.arange(20)[None], np.array([[9]]),
                         np.arange(20, 20 + G)[None], np.ones((1, 1, G, 20 + G), dtype=bool), kv)
        one = (rng.normal(size=(1, 1, fdim)).astype(np.float32), np.array([[20]]), np.array([[9]]),
               np.arange(21, 21 + G)[None], np.ones((1, 1, G, 21 + G), dtype=bool))
        t0 = time.perf_counter()
        for _ in range(reps):  # the same round again on the same 20-position context
            g.run(*one, kv)
        return (time.perf_counter() - t0) / reps

    t_ort, t_trt = time_pass(ga), time_pass(gb)
    print(f"DSpark drafting pass (tiny drafter, 20-position context, one new position): ONNX Runtime CPU "
          f"{t_ort * 1e6:.0f} us, TensorRT {t_trt * 1e6:.0f} us (context uploaded each call here)")


def use_cpu_stand_ins() -> None:
    """Make the Engine run its trt-placed graphs on ONNX Runtime CPU.

    ``--cpu-stand-in`` runs check 5 alone on any machine, with ONNX Runtime CPU standing in for the TensorRT engines (the
    capacity graph behind ``TrtDecoder``'s row interface, ``tests/runtime/runners/test_device_runner.py``'s ``OrtDevice``; the drafter's ONNX
    graph for ``TrtDSparkGraph``): it checks this script's own code and the batched runner's bookkeeping before a GPU run,
    not TensorRT (the engine directory needs its TensorRT engines in the manifest: ``--prepare`` builds them on a CPU).
    """
    import dspark_runtime.backends.trt.decoder as trt_backend
    import dspark_runtime.backends.trt.dspark_graph as trt_dspark
    from dspark_runtime.drafting.dspark import OrtDSparkGraph
    from dspark_runtime.backends.trt.profiles import capacity_buckets

    try:
        from tests.runtime.runners.test_device_runner import OrtDevice
    except ImportError as e:
        raise SystemExit(f"--cpu-stand-in uses the repository's tests package: run it from the repository root "
                         f"(python -m benchmarks.gpu.check_trt ...) ({e})")

    def decoder(engine_dir, entry, **_):
        ps = entry.profile_settings
        dev = OrtDevice(Path(engine_dir) / entry.onnx, entry.spec, decode_q=ps["decode_q"], max_q=ps["prefill_chunk"],
                        buckets=capacity_buckets(ps["capacity"], ps["min_bucket"]))
        dev.activate = lambda: dev
        return dev

    def dspark_graph(engine_dir, entry, **_):
        g = load_manifest(engine_dir).graphs[entry.graph]
        return OrtDSparkGraph(Path(engine_dir) / g.model_file, g.spec, threads=2)

    trt_backend.TrtDecoder, trt_dspark.TrtDSparkGraph = decoder, dspark_graph


BATCH_PROMPTS = ["def add(a, b):", "Write a haiku about rain falling on a quiet city street at night.", "def fib(n):",
                 "List three prime numbers and explain why each one is prime, step by step."]


def check_batched(engine_dir: Path, ort_eng: Engine, n: int = 32) -> None:
    """Check 5: batched TensorRT decoding (dspark_runtime.runners.device.DeviceBatchRunner) against each request alone."""
    m = load_manifest(engine_dir)
    most = int(m.trt_engines["target.capacity"].profile_settings["max_batch"])
    if most < 4:
        check("TensorRT engines take 4 rows", False, f"built for max_batch {most}; re-run --prepare (max_batch 4)")
        return
    eng = Engine.load(engine_dir, backend="trt")
    ort_ref = [ort_eng.generate(p, max_new_tokens=n, draft=None).token_ids for p in BATCH_PROMPTS]

    def alone_in(rows: int, p: str, draft, pin: bool = False) -> list:
        gen = eng.batch(draft=draft, max_batch=rows)
        gen.target.pin_bucket = pin
        req = gen.submit(eng.encode_prompt(p), max_new_tokens=n)
        gen.run()
        return req.token_ids

    for draft in (None, "lm", "dspark"):
        name = draft or "target-only"
        for pin in (False, True):
            gen = eng.batch(draft=draft, max_batch=4)
            gen.target.pin_bucket = pin
            before = dict(gen.target.decoder.stats)
            t0 = time.perf_counter()
            reqs = [gen.submit(eng.encode_prompt(p), max_new_tokens=n) for p in BATCH_PROMPTS]
            gen.run()
            t_batch = time.perf_counter() - t0
            batched = [r.token_ids for r in reqs]
            runner, dec = gen.target, gen.target.decoder
            keys = sorted(runner.calls)
            dstats = {k: (v - before.get(k, 0) if isinstance(v, (int, float)) else v) for k, v in dec.stats.items()}
            if "kv_writes" in dstats:  # the per-row K/V writes and what came back, this run
                rounds, toks = max(gen.stats.rounds, 1), max(sum(map(len, batched)), 1)
                print(f"  {name}: per round {dstats['kv_writes'] / rounds:.0f} K/V write copies issued in "
                      f"{1e3 * dstats['kv_write_s'] / rounds:.3f} ms of host time; {dstats['d2h_bytes'] / toks:.0f} "
                      "bytes copied to the host per committed token", flush=True)
            alone4 = [alone_in(4, p, draft, pin) for p in BATCH_PROMPTS]
            what = f"{name}, bucket {'pinned' if pin else 'by the longest row'}"
            check(f"batched == alone in a 4-row runner ({what})", batched == alone4,
                  f"{sum(map(len, batched))} tokens, {gen.stats.rounds} rounds, {gen.stats.target_calls} target "
                  f"calls; capture keys (rows, q, bucket) {keys}; decoder {dstats}; device argmax "
                  f"{runner.device_argmax}; first differing request "
                  f"{next((i for i, (x, y) in enumerate(zip(batched, alone4)) if x != y), None)}")
            if pin:
                continue
            check(f"batched == ONNX Runtime CPU target-only greedy ({name})", batched == ort_ref,
                  f"first differing request {next((i for i, (x, y) in enumerate(zip(batched, ort_ref)) if x != y), None)}")
            t0 = time.perf_counter()
            solo = [eng.generate(p, max_new_tokens=n, draft=draft).token_ids for p in BATCH_PROMPTS]
            t_solo = time.perf_counter() - t0
            check(f"batched (4 rows) == generate one at a time (1 row) ({name})", batched == solo,
                  "equal only where a row's GEMM results do not depend on the call's row count; first differing "
                  f"request {next((i for i, (x, y) in enumerate(zip(batched, solo)) if x != y), None)}")
            toks = sum(map(len, batched))
            print(f"  {name}: 4 requests batched {t_batch:.2f} s ({toks / t_batch:.0f} tok/s) against one after "
                  f"another {t_solo:.2f} s ({toks / t_solo:.0f} tok/s): {t_solo / t_batch:.2f}x (tiny model, first "
                  "runs include warm-up and CUDA-graph capture)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
