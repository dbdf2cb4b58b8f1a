"""The Hugging Face transformers peer: ``generate`` in fp16 with a dynamic and a static cache (:func:`cmd_hf` says
how the decode steps are timed).

    python -m benchmarks.peers.gpu_peers hf HF_FOLDER --out hf.json [--device cuda|cpu]
"""
from __future__ import annotations

import time
import traceback

from benchmarks.peers.gpu_peers_report import (WARMUP_NEW_TOKENS, Deadline, Report, Scrubber, eos_id, finish,
                                               gpu_info, median, model_summary, package_versions, parse_batches,
                                               prompt_ids, record_config, rnd)


def cmd_hf(a) -> int:
    """hf: transformers generate timing.

    transformers ``AutoModelForCausalLM`` in fp16 on CUDA, ``attn_implementation="sdpa"``,
    ``generate(do_sample=False, min_new_tokens=N, max_new_tokens=N, disable_compile=True)`` with (a) the
    default dynamic cache and (b) ``cache_implementation="static"`` (``disable_compile`` keeps
    transformers from torch.compiling the forward, which it does by itself for a static cache on
    CUDA). Decode = (time of generate with N new tokens) - (time with 1 new token), over N - 1 steps;
    prefill_ms = the time of generate with 1 new token.
    """
    scrub = Scrubber({"hf": a.hf})
    report = Report(a.out, "hf", scrub)
    d = report.data
    d["versions"] = package_versions()
    import torch
    from transformers import AutoModelForCausalLM
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    d["gpu"] = gpu_info() if device == "cuda" else {}
    d["cuda"] = {"torch.version.cuda": torch.version.cuda} if device == "cuda" else {}
    d["model"] = model_summary(a.hf)
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[a.dtype]
    caches = [c for c in a.caches.split(",") if c]
    batches = parse_batches(a.batches)
    d["settings"] = {"device": device, "dtype": a.dtype, "attn_implementation": a.attn,
                     "batches": batches, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                     "repeats": a.repeats, "seed": a.seed, "caches": caches, "torch_compile": False,
                     "deadline_s": a.deadline_s, "warmup_new_tokens": WARMUP_NEW_TOKENS,
                     "search": "greedy (do_sample=False), min_new_tokens = max_new_tokens = N",
                     "decode": "t(generate N new) - t(generate 1 new), over N - 1 steps"}
    report.write()
    t_load = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.hf, dtype=dtype, attn_implementation=a.attn).to(device).eval()
    d["model"]["load_s"] = round(time.perf_counter() - t_load, 2)
    report.write()
    eos = eos_id(a.hf)
    ids_all = torch.from_numpy(prompt_ids(max(batches), a.prompt_len, eos, a.seed))

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def gen(ids, n, cache):
        kw = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=eos, eos_token_id=eos,
                  use_cache=True, disable_compile=True, attention_mask=torch.ones_like(ids))
        if cache != "dynamic":
            kw["cache_implementation"] = cache
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **kw)
        sync()
        p = ids.shape[1]
        return time.perf_counter() - t0, out.shape[1] - p, out[0, p:p + 16].tolist(), out[:, p].tolist()

    deadline = Deadline(a.deadline_s)
    for b in batches:
        ids = ids_all[:b].to(device)
        for cache in caches:
            variant = f"hf-{cache}"
            skip = deadline.reason_to_skip(variant)
            if skip:
                report.skip(variant, b, skip)
                continue
            t_cfg = time.perf_counter()
            row = {"system": "transformers", "variant": variant, "cache": cache, "batch": b,
                   "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "cuda_graph": False}
            try:
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                gen(ids, WARMUP_NEW_TOKENS, cache)
                reps = []
                for _ in range(a.repeats):
                    t1, n1, _, _ = gen(ids, 1, cache)
                    tn, nn, head, firsts = gen(ids, a.new_tokens, cache)
                    dec = tn - t1
                    steps = a.new_tokens - 1
                    reps.append({"prefill_ms": rnd(t1 * 1e3), "generate_n_ms": rnd(tn * 1e3),
                                 "decode_ms": rnd(dec * 1e3), "decode_steps": steps,
                                 "decode_ms_per_step": rnd(dec * 1e3 / max(1, steps), 4),
                                 "generated": [n1, nn], "row0_first16": head,
                                 "first_token_per_row": firsts})
                per_step = median([r["decode_ms_per_step"] for r in reps], 4)
                row.update({
                    "prefill_ms": median([r["prefill_ms"] for r in reps]),
                    "decode_steps": a.new_tokens - 1,
                    "decode_ms_per_step": per_step,
                    "tokens_per_s": rnd(b * 1e3 / per_step, 1) if per_step and per_step > 0 else None,
                    "generated_tokens_ok": all(r["generated"] == [1, a.new_tokens] for r in reps),
                    "row0_first16": reps[0]["row0_first16"],
                    "first_token_per_row": reps[0]["first_token_per_row"],
                    "repeats": reps,
                })
                if device == "cuda":
                    row["peak_gpu_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20)
            except Exception as e:  # noqa: BLE001
                row["error"] = scrub(f"{type(e).__name__}: {e}")[:2000]
                row["traceback_tail"] = scrub(traceback.format_exc())[-1500:]
            record_config(d, report, deadline, variant, row, t_cfg)
    return finish(d, report)
