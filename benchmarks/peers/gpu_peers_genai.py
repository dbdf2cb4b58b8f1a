"""The ONNX Runtime GenAI peer: its model builder's fp16 CUDA model (fp32 on the CPU), then ``og.Generator``
timing with and without CUDA graphs (:func:`cmd_genai` says how).

    python -m benchmarks.peers.gpu_peers genai HF_FOLDER WORK --out genai.json [--ep cuda|cpu]
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks.peers.gpu_peers_report import (WARMUP_NEW_TOKENS, Deadline, Report, Scrubber, elapsed, eos_id,
                                               finish, gpu_info, median, model_summary, package_versions,
                                               parse_batches, prompt_ids, record_config, rnd)


def run_builder(a, report: Report, scrub: Scrubber) -> Path | None:
    work = Path(a.work)
    precision = a.precision or ("fp16" if a.ep == "cuda" else "fp32")
    out = work / f"onnx-{precision}-{a.ep}"
    cache = work / "cache"
    argv = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(Path(a.hf).resolve()),
            "-o", str(out.resolve()), "-p", precision, "-e", a.ep, "-c", str(cache.resolve())]
    build = {"argv": [scrub(x) for x in argv[1:]], "precision": precision, "ep": a.ep,
             "output_name": out.name}
    report.data["build"] = build
    if (out / "genai_config.json").is_file() and not a.rebuild:
        build["reused"] = True
        build["output_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        report.write()
        return out
    if a.deadline_s is not None and elapsed() >= a.deadline_s:
        build["error"] = "deadline passed before the build"
        report.write()
        return None
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / f"builder-{precision}-{a.ep}.log"
    timeout = None if a.deadline_s is None else max(1.0, a.deadline_s - elapsed())
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    build["wall_s"] = round(time.perf_counter() - t0, 1)
    build["rc"] = rc
    build["peak_rss_mb_children"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
    build["log_name"] = log_path.name
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines()
             if ln.strip() and "it/s]" not in ln and "s/it]" not in ln]  # no tqdm progress lines
    build["log_tail"] = [scrub(line)[-300:] for line in lines[-12:]]
    if rc != 0 or not (out / "genai_config.json").is_file():
        build["error"] = "builder timed out (deadline)" if rc is None else f"builder failed (rc {rc})"
        report.write()
        return None
    build["output_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    gc = json.loads((out / "genai_config.json").read_text())
    build["genai_config"] = {
        "provider_options": gc["model"]["decoder"]["session_options"].get("provider_options"),
        "past_present_share_buffer": gc["search"].get("past_present_share_buffer"),
        "context_length": gc["model"].get("context_length"),
    }
    report.write()
    return out


def ort_cuda_info(preload: bool) -> dict:
    """onnxruntime's CUDA build and providers; with ``preload``, ``onnxruntime.preload_dlls()`` first
    (loads the CUDA / cuDNN libraries of the nvidia-* pip packages, e.g. torch's, so the CUDA EP that
    onnxruntime-genai opens later finds them without LD_LIBRARY_PATH)."""
    out = {}
    try:
        import onnxruntime as ort
        out["ort_version"] = ort.__version__
        try:
            from onnxruntime.capi import build_and_package_info as bpi
            out["ort_build_cuda_version"] = getattr(bpi, "cuda_version", None)
            out["ort_package_name"] = getattr(bpi, "package_name", None)
        except ImportError:
            pass
        if preload and hasattr(ort, "preload_dlls"):
            try:
                ort.preload_dlls()
                out["preload_dlls"] = "called"
            except Exception as e:  # noqa: BLE001
                out["preload_dlls"] = f"failed: {type(e).__name__}: {e}"[:300]
        out["ort_available_providers"] = ort.get_available_providers()
    except Exception as e:  # noqa: BLE001
        out["ort_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


def genai_load(og, onnx_dir: Path, ep: str, cuda_graph: bool):
    config = og.Config(str(onnx_dir))
    config.clear_providers()
    if ep == "cuda":
        config.append_provider("cuda")
        config.set_provider_option("cuda", "enable_cuda_graph", "1" if cuda_graph else "0")
    return og.Model(config)


def genai_once(og, model, ids, new_tokens: int):
    """One generation. append_tokens runs the prefill forward pass; the first generate_next_token
    only picks the first token from its logits; every later one runs a 1-token forward pass, then
    picks. Returns (prefill_s, first_token_s, decode step times [s], new tokens per row, the first
    16 new tokens of row 0, the first new token of every row)."""
    import numpy as np
    b, p = ids.shape
    params = og.GeneratorParams(model)
    params.set_search_options(batch_size=b, do_sample=False, max_length=p + new_tokens,
                              min_length=p + new_tokens)
    gen = og.Generator(model, params)
    block = np.ascontiguousarray(ids, dtype=np.int32)
    t0 = time.perf_counter()
    gen.append_tokens(block)
    t1 = time.perf_counter()
    gen.generate_next_token()  # the first token, from the prefill's logits (no forward pass)
    t2 = time.perf_counter()
    steps = []
    last = t2
    while not gen.is_done():
        gen.generate_next_token()
        now = time.perf_counter()
        steps.append(now - last)
        last = now
    seqs = [gen.get_sequence(i) for i in range(b)]
    t3 = time.perf_counter()
    if steps:
        steps[-1] += t3 - last  # the device->host copy of the sequences closes the last step
    del gen, params
    return (t1 - t0, t2 - t0, steps, [len(s) - p for s in seqs], [int(x) for x in seqs[0][p:p + 16]],
            [int(s[p]) for s in seqs])


def cmd_genai(a) -> int:
    """genai: onnxruntime-genai's model builder, then Generator timing.

    Runs onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder -i HF -o
    WORK/onnx-<precision>-<ep> -p fp16 -e cuda -c WORK/cache``; fp32 for ``--ep cpu``, the builder
    has no fp16 CPU) unless its output is already there (``--rebuild`` redoes it), then times
    ``og.Generator``: per configuration a ``GeneratorParams`` with ``batch_size=B, do_sample=False,
    min_length = max_length = P + N`` (so exactly N tokens come: EOS is masked below min_length, and
    the static KV buffers the CUDA model uses, ``search.past_present_share_buffer``, are sized to
    max_length, not to the 32k context), ``append_tokens`` of a (B, P) block of ids (the prefill),
    then ``generate_next_token`` until ``is_done``. CUDA graphs are a provider option
    (``enable_cuda_graph`` of the ``cuda`` provider in genai_config.json) set here through
    ``og.Config.set_provider_option``, so one build serves both; GenAI requires the shared
    past/present buffer for graph capture (it raises otherwise), captures only 1-token decode steps
    (the prefill runs eagerly) and captures one graph per Generator, during its first decode steps
    (those steps are in the mean, not in the median).
    """
    scrub = Scrubber({"hf": a.hf, "work": a.work})
    report = Report(a.out, "genai", scrub)
    d = report.data
    d["versions"] = package_versions()
    d["gpu"] = gpu_info() if a.ep == "cuda" else {}
    d["model"] = model_summary(a.hf)
    variants = {"both": [False, True], "on": [True], "off": [False]}[a.cuda_graph] if a.ep == "cuda" else [False]
    batches = parse_batches(a.batches)
    d["settings"] = {"ep": a.ep, "batches": batches, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                     "repeats": a.repeats, "seed": a.seed, "cuda_graph_variants": variants,
                     "deadline_s": a.deadline_s, "warmup_new_tokens": WARMUP_NEW_TOKENS,
                     "search": "greedy (do_sample=False), min_length = max_length = P + N"}
    report.write()
    if a.ep == "cuda":
        d["cuda"].update(ort_cuda_info(preload=not a.no_preload))
        report.write()
    try:
        import onnxruntime_genai as og
        d["versions"]["onnxruntime_genai.__version__"] = og.__version__
        if a.ep == "cuda":
            d["cuda"]["og.is_cuda_available"] = bool(og.is_cuda_available())
    except Exception as e:  # noqa: BLE001
        d["status"] = "failed"
        report.note(f"import onnxruntime_genai failed: {e!r}")
        return 1
    onnx_dir = run_builder(a, report, scrub)
    if onnx_dir is None:
        d["status"] = "failed"
        report.write()
        return 1
    if a.build_only:
        d["status"] = "done"
        report.note("--build-only: no timing")
        return 0
    ids_all = prompt_ids(max(batches), a.prompt_len, eos_id(a.hf), a.seed)
    deadline = Deadline(a.deadline_s)
    models = {}
    for b in batches:
        for cg in variants:
            variant = f"genai-{a.ep}" + ("-cudagraph" if cg else "")
            skip = deadline.reason_to_skip(variant)
            if skip:
                report.skip(variant, b, skip)
                continue
            t_cfg = time.perf_counter()
            row = {"system": "onnxruntime-genai", "variant": variant, "batch": b, "prompt_len": a.prompt_len,
                   "new_tokens": a.new_tokens, "cuda_graph": cg}
            try:
                if cg not in models:
                    t_load = time.perf_counter()
                    models[cg] = genai_load(og, onnx_dir, a.ep, cg)
                    row["model_load_s"] = round(time.perf_counter() - t_load, 2)
                model = models[cg]
                row["device_type"] = str(getattr(model, "device_type", ""))
                ids = ids_all[:b]
                genai_once(og, model, ids, WARMUP_NEW_TOKENS)
                reps = []
                for _ in range(a.repeats):
                    prefill, first, steps, ngen, head, firsts = genai_once(og, model, ids, a.new_tokens)
                    dec = sum(steps)
                    reps.append({"prefill_ms": rnd(prefill * 1e3), "first_token_ms": rnd(first * 1e3),
                                 "decode_ms": rnd(dec * 1e3), "decode_steps": len(steps),
                                 "decode_ms_per_step": rnd(dec * 1e3 / max(1, len(steps)), 4),
                                 "decode_ms_per_step_median": rnd(median(steps) * 1e3 if steps else None),
                                 "step_ms_first5": [rnd(s * 1e3) for s in steps[:5]],
                                 "step_ms_max": rnd(max(steps) * 1e3 if steps else None),
                                 "generated_per_row": sorted(set(ngen)), "row0_first16": head,
                                 "first_token_per_row": firsts})
                steps_n = reps[-1]["decode_steps"]
                per_step = median([r["decode_ms_per_step"] for r in reps], 4)
                per_step_med = median([r["decode_ms_per_step_median"] for r in reps])
                row.update({
                    "prefill_ms": median([r["prefill_ms"] for r in reps]),
                    "first_token_ms": median([r["first_token_ms"] for r in reps]),
                    "decode_steps": steps_n,
                    "decode_ms_per_step": per_step,
                    "tokens_per_s": rnd(b * 1e3 / per_step, 1) if per_step else None,
                    "decode_ms_per_step_median": per_step_med,
                    "tokens_per_s_median": rnd(b * 1e3 / per_step_med, 1) if per_step_med else None,
                    "generated_tokens_ok": all(r["generated_per_row"] == [a.new_tokens] for r in reps),
                    "row0_first16": reps[0]["row0_first16"],
                    "first_token_per_row": reps[0]["first_token_per_row"],
                    "repeats": reps,
                })
            except Exception as e:  # noqa: BLE001
                row["error"] = scrub(f"{type(e).__name__}: {e}")[:2000]
                row["traceback_tail"] = scrub(traceback.format_exc())[-1500:]
            record_config(d, report, deadline, variant, row, t_cfg)
    return finish(d, report)
