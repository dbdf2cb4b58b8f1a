"""The CUDA check's phases on the tiny engines (``tiny-fp32``, ``tiny-fp16``, ``tiny-fp8`` of ``prepare_cuda``): parity
with ONNX Runtime's CPU provider through Polygraphy, the device decoder against the growing graph, greedy exactness
of speculative decoding on the GPU, and the FP8 QDQ graph on the CUDA provider. Run by ``check_cuda`` (phases 1-4).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from benchmarks.gpu import check_cuda_report as report
from benchmarks.gpu.check_cuda_report import check

PROMPTS = ["def quicksort(xs): return the list sorted, shortest code first", "hi", "a b c d e f g h i j k l m n"]


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
                   OnnxrtRunner(SessionFromOnnx(str(path), providers=[report.CUDA_EP]), name="cuda")]
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
    for label, prov in (("cpu", ["CPUExecutionProvider"]), ("cuda", [report.CUDA_EP])):
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
