"""The peers' worker of ``benchmarks.compare``: ``<peer venv>/bin/python -m benchmarks.peers.worker job.json``.

Runs under a peer's own venv (``benchmarks/peers/install.sh``): standard library, numpy and the peer's package only,
never the project (the repository root on PYTHONPATH makes ``benchmarks`` importable). Same job / output protocol
as the project's workers (:mod:`benchmarks.compare.workers`): fed the preflight's prompt token ids, one JSON line
per finished prompt, a last ``{"meta": ...}`` line. Backends: ``llama-cpp`` (llama-cpp-python on the target GGUF,
greedy; ``prompt_lookup``: its LlamaPromptLookupDecoding), ``llama-speculative`` (llama.cpp's binary, one process
a prompt, given the chat-template text whose tokenization must equal the ids) and ``ort-genai`` (onnxruntime-genai
on its builder's int4 graph; ``speculative``: its n-gram lookup).
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.evalsets import ids_digest, loadavg, round_stats
from benchmarks.peers import llama_speculative as lspec

WARMUP_IDS_NOTE = "warm-up: the first prompt's ids, 8 new tokens"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def file_bytes(paths) -> int:
    total = 0
    for p in paths:
        p = Path(p)
        if p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            total += p.stat().st_size
    return total


def timing_row(ids, new, t0, stamps, t_end) -> dict:
    """A result row from per-token commit timestamps (perf_counter) of one request started at t0."""
    row = {"prompt_tokens": len(ids), "prompt_digest": ids_digest(ids), "token_ids": list(new),
           "new_tokens": len(new)}
    if stamps:
        row["ttft_ms"] = (stamps[0] - t0) * 1e3
        row["decode_tokens"] = len(new) - 1
        row["decode_s"] = t_end - stamps[0]
    else:
        row.update(ttft_ms=(t_end - t0) * 1e3, decode_tokens=0, decode_s=0.0)
    ok = row["decode_tokens"] > 0 and row["decode_s"] > 0
    row["tokens_per_second"] = row["decode_tokens"] / row["decode_s"] if ok else None
    return row


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def pld_rounds(calls, generated) -> list:
    """(proposed, accepted) per verify round of llama-cpp-python's draft loop, from the draft model's
    calls [(tokens generated so far when it was called, draft tokens)] and the generated ids: the round
    started by call k commits generated[g_k:g_{k+1}]; accepted = its common prefix with the draft."""
    out = []
    for k, (g, draft) in enumerate(calls):
        if g >= len(generated):
            break
        end = calls[k + 1][0] if k + 1 < len(calls) else len(generated)
        out.append((len(draft), min(len(draft), common_prefix(generated[g:end], draft))))
    return out


# ------------------------------------------------------------------------------------------------


def _llama_cpp_worker(job, emit) -> dict:
    import numpy as np
    import llama_cpp as llama_cpp_pkg
    from llama_cpp import Llama, llama_cpp
    from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

    opts = job["options"]
    calls: list = []
    draft = None
    n_prompt_now = [0]
    if opts.get("prompt_lookup"):
        inner = LlamaPromptLookupDecoding(num_pred_tokens=int(opts["prompt_lookup"]),
                                          max_ngram_size=int(opts.get("max_ngram_size", 2)))

        class Recording(LlamaDraftModel):
            def __call__(self, input_ids, /, **kw):
                d = inner(input_ids, **kw)
                calls.append((len(input_ids) - n_prompt_now[0], [int(x) for x in d]))
                return d

        draft = Recording()
    t0 = time.perf_counter()
    llm = Llama(model_path=job["target_gguf"], n_ctx=job["n_ctx"], n_threads=job["threads"],
                n_threads_batch=job["threads"], logits_all=False, draft_model=draft, seed=0, verbose=False)
    load_s = time.perf_counter() - t0
    vocab = llm._model.vocab

    def run(ids, max_new):
        llm.reset()  # no KV prefix reuse from the previous prompt
        calls.clear()
        n_prompt_now[0] = len(ids)
        new, stamps = [], []
        t = time.perf_counter()
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            new.append(int(tok))
            if llama_cpp.llama_vocab_is_eog(vocab, tok) or len(new) >= max_new:
                break
        return new, t, stamps, time.perf_counter()

    t1 = time.perf_counter()
    run(job["prompts"][0]["ids"], 8)
    warmup_s = time.perf_counter() - t1
    for p in job["prompts"]:
        ids = p["ids"]
        new, t, stamps, t_end = run(ids, job["max_new_tokens"])
        row = timing_row(ids, new, t, stamps, t_end)
        if draft is not None:
            row.update(round_stats(pld_rounds(calls, new)))
        emit(p, row)
    return {"load_s": load_s, "warmup_s": warmup_s, "warmup": WARMUP_IDS_NOTE,
            "model_bytes": file_bytes([job["target_gguf"]]), "model_files": [job["target_gguf"]],
            "versions": {"llama_cpp_python": llama_cpp_pkg.__version__, "numpy": np.__version__},
            "logits_all": bool(llm._logits_all), "n_ctx": llm.n_ctx()}


def _llama_speculative_worker(job, emit) -> dict:
    from llama_cpp import Llama
    import llama_cpp as llama_cpp_pkg

    opts = job["options"]
    binary = job["llama_speculative"]
    vocab = Llama(model_path=job["target_gguf"], vocab_only=True, verbose=False)
    loads, rss, meta_runs = [], [], []
    for p in job["prompts"]:
        ids, text = p["ids"], p["rendered"]
        mine = vocab.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        if list(mine) != list(ids):
            k = next((i for i, (a, b) in enumerate(zip(mine, ids)) if a != b), min(len(mine), len(ids)))
            emit(p, {"error": f"llama.cpp tokenizes the prompt text differently from the preflight ids "
                              f"(first difference at {k}); not run"})
            continue
        argv = lspec.command(binary, job["target_gguf"], job["draft_gguf"], text,
                             max_new_tokens=job["max_new_tokens"], threads=job["threads"], n_ctx=job["n_ctx"],
                             seed=p.get("seed", 0), draft_max=opts.get("draft_max"))
        t = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        out_b, err_b = proc.communicate()
        wall = time.perf_counter() - t
        # max ru_maxrss over the binary's processes so far (each prompt is its own process)
        child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        stdout, stderr = out_b.decode("utf-8", "replace"), err_b.decode("utf-8", "replace")
        logs = Path(job.get("keep_logs") or Path(job["out"]).with_suffix(".logs"))  # beside the worker's output
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{p['key']}.stdout.txt").write_text(stdout)
        (logs / f"{p['key']}.stderr.txt").write_text(stderr)
        st = lspec.parse_output(stdout, stderr)
        if proc.returncode != 0 or not st["ok"]:
            tail = [l for l in stderr.strip().splitlines() if l.strip()][-1:] or ["no output"]
            emit(p, {"error": f"llama-speculative exited {proc.returncode}: {tail[0][:300]}"})
            continue
        produced = st["token_ids"]
        if len(produced) != st.get("n_predict", len(produced)):
            emit(p, {"error": f"parsed {len(produced)} token ids but the binary reports n_predict="
                              f"{st.get('n_predict')}; output not comparable"})
            continue
        new = produced[:job["max_new_tokens"]]  # it finishes its last round past -n
        row = {"prompt_tokens": len(ids), "prompt_digest": ids_digest(ids), "token_ids": new,
               "new_tokens": len(new), "produced_tokens": len(produced),
               # the first token is sampled from the prompt's logits at the end of "encoded"
               "ttft_ms": st["encode_s"] * 1e3,
               # "decoded" covers every produced token, the first included (sampled at its start)
               "decode_tokens": max(0, len(produced) - 1), "decode_s": st["decode_s"],
               "n_draft": st.get("n_draft"), "n_drafted": st.get("n_drafted"), "n_accept": st.get("n_accept"),
               "process_wall_s": wall, "process_peak_rss_mb": child_rss}
        row["tokens_per_second"] = (row["decode_tokens"] / row["decode_s"]
                                    if row["decode_tokens"] > 0 and row["decode_s"] > 0 else None)
        row.update(round_stats(st["rounds"]))
        if st.get("n_accept") is not None and st["n_accept"] != row["accepted"]:
            row["note"] = f"debug-log accepted {row['accepted']} != n_accept {st['n_accept']}"
        loads.append(wall - st["encode_s"] - st["decode_s"])
        if child_rss:
            rss.append(child_rss)
        meta_runs.append({"key": p["key"], "load_ms": st["load_ms"]})
        row["peak_rss_mb"] = child_rss
        emit(p, row)
    ver = subprocess.run([binary, "--version"], capture_output=True, text=True)
    return {"load_s": statistics.median(loads) if loads else None, "warmup_s": None,
            "load_note": "per prompt: the binary's process wall time minus its encode and decode time (model "
                         "loads, llama.cpp's own warm-up run, teardown); one process per prompt",
            "child_peak_rss_mb": max(rss) if rss else None,
            "model_bytes": file_bytes([job["target_gguf"], job["draft_gguf"]]),
            "model_files": [job["target_gguf"], job["draft_gguf"]],
            "versions": {"llama_cpp_python": llama_cpp_pkg.__version__,
                         "llama_speculative": (ver.stdout + ver.stderr).strip().splitlines()[:1]},
            "runs": meta_runs}


def _ort_genai_worker(job, emit) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    opts = job["options"]
    model_dir = job["ort_model"]
    t0 = time.perf_counter()
    config = og.Config(model_dir)
    config.clear_providers()  # CPU
    threads = {"intra_op_num_threads": job["threads"], "inter_op_num_threads": 1}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": threads}}}))
    model = og.Model(config)
    load_s = time.perf_counter() - t0
    spec = opts.get("speculative")

    def run(ids, max_new):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new)
        if spec:
            params.set_speculative_options(**spec)
        gen = og.Generator(model, params)
        new, stamps = [], []
        t = time.perf_counter()
        gen.append_tokens(np.array([ids], dtype=np.int32))
        while not gen.is_done() and len(new) < max_new:
            gen.generate_next_token()
            stamps.append(time.perf_counter())
            new.append(int(gen.get_next_tokens()[0]))
        t_end = time.perf_counter()
        stats = dict(gen.get_speculative_stats()) if spec else None
        del gen
        return new, t, stamps, t_end, stats

    t1 = time.perf_counter()
    run(job["prompts"][0]["ids"], 8)
    warmup_s = time.perf_counter() - t1
    for p in job["prompts"]:
        ids = p["ids"]
        new, t, stamps, t_end, stats = run(ids, job["max_new_tokens"])
        row = timing_row(ids, new, t, stamps, t_end)
        if stats is not None:
            prop = int(stats.get("draft_tokens_proposed", 0) or 0)
            acc = int(stats.get("draft_tokens_accepted", 0) or 0)
            # a lookup miss runs one plain step ("standard_fallback_steps"), not counted in "rounds": counted
            # here as a round that proposed nothing, as benchmarks.compare counts DSpark's n-gram misses; the first
            # token (sampled from the prefill's logits) is such a step for ort-genai, and no round here
            r = max(0, int(stats.get("rounds", 0) or 0) + int(stats.get("standard_fallback_steps", 0) or 0)
                    - (1 if new else 0))
            row.update(rounds=r, proposed=prop, accepted=acc, tau=(acc + r) / r if r else None,
                       acceptance_rate=acc / prop if prop else None,
                       ort_stats={k: v for k, v in stats.items() if isinstance(v, (int, float, bool))})
        emit(p, row)
    return {"load_s": load_s, "warmup_s": warmup_s, "warmup": WARMUP_IDS_NOTE,
            "model_bytes": file_bytes([f for f in Path(model_dir).iterdir() if f.suffix in (".onnx", ".data")
                                       or f.name.endswith(".onnx.data")]),
            "model_files": sorted(f.name for f in Path(model_dir).iterdir()),
            "versions": {"onnxruntime_genai": og.__version__, "numpy": np.__version__}}


BACKENDS = {"llama-cpp": _llama_cpp_worker, "llama-speculative": _llama_speculative_worker,
            "ort-genai": _ort_genai_worker}


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    out = open(job["out"], "w")
    progress = open(job["progress"], "a") if job.get("progress") else None

    def emit(p, row):
        row = {"system": job["system"], "dataset": p["dataset"], "index": p["index"], "key": p["key"], **row}
        if "peak_rss_mb" not in row:
            row["peak_rss_mb"] = peak_rss_mb()  # so far; benchmarks.compare replaces it by the worker's peak
        out.write(json.dumps(row) + "\n")
        out.flush()
        if progress is not None:
            progress.write(json.dumps({"row": row, "tag": job.get("tag")}) + "\n")
            progress.flush()
            os.fsync(progress.fileno())
        if row.get("error"):
            print(f"  {job['system']:14} {p['key']:14} ERROR {row['error']}", flush=True)
            return
        tps = row.get("tokens_per_second")
        tau = row.get("tau")
        print(f"  {job['system']:14} {p['key']:14} {row['new_tokens']:4d} tok  "
              f"{tps if tps is not None else float('nan'):7.2f} tok/s  ttft {row['ttft_ms']:7.0f} ms"
              + (f"  tau {tau:.2f}" if tau is not None else ""), flush=True)

    meta = BACKENDS[job["backend"]](job, emit)
    meta["peak_rss_mb"] = max(peak_rss_mb(), meta.get("child_peak_rss_mb") or 0)
    meta["loadavg"] = loadavg()
    meta["cpu_s"] = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                           resource.getrusage(resource.RUSAGE_CHILDREN)))
    out.write(json.dumps({"meta": meta}) + "\n")
    out.close()
    if progress is not None:
        progress.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
