"""The peers' worker of ``benchmarks.compare``: ``<peer venv>/bin/python -m benchmarks.peers.worker job.json``.

Runs under a peer's own venv (``benchmarks/peers/install.sh``): standard library, numpy and the peer's package only,
never the project (the repository root on PYTHONPATH makes ``benchmarks`` importable). Same job / output protocol
as the project's workers (:mod:`benchmarks.compare.workers`): fed the preflight's prompt token ids, one JSON line
per finished prompt, a last ``{"meta": ...}`` line. Backends: ``llama-cpp`` (llama-cpp-python on the target GGUF,
greedy; ``prompt_lookup``: its LlamaPromptLookupDecoding), ``llama-speculative`` (llama.cpp's binary, one process
a prompt, given the chat-template text whose tokenization must equal the ids), ``ort-genai`` (onnxruntime-genai
on its builder's int4 graph; ``speculative``: its n-gram lookup) and ``openvino-genai`` (OpenVINO GenAI's
LLMPipeline on optimum-intel's int4 export; ``prompt_lookup``: its prompt lookup decoding, ``draft``: the draft
model's export as ``draft_model``).
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
    # a draft model makes llama-cpp-python keep every position's logits, but it sizes that buffer from the
    # logits_all argument (n_batch rows when False): prompts over n_batch tokens then fail, so ask for it outright
    llm = Llama(model_path=job["target_gguf"], n_ctx=job["n_ctx"], n_threads=job["threads"],
                n_threads_batch=job["threads"], logits_all=draft is not None, draft_model=draft, seed=0,
                verbose=False)
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


# OpenVINO CPU properties that decide what the int4 model computes in; recorded as the device gives them
OV_PRECISION_KEYS = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION",
                     "DYNAMIC_QUANTIZATION_GROUP_SIZE", "EXECUTION_MODE_HINT")
OV_OPTIONS = ("prompt_lookup", "draft")
# the draft's num_assistant_tokens when none is set: openvino.genai's continuous-batching speculative pipeline
# (speculative_decoding/continuous_batching/pipeline_impl.hpp, default_num_assistant_tokens) applies it per request
OV_DEFAULT_NUM_ASSISTANT_TOKENS = 5


def ov_property_str(value) -> str:
    """An OpenVINO property value as text: an element type by its short name (f32, bf16, u8), an enum by its name."""
    if hasattr(value, "to_string"):
        return value.to_string()
    return getattr(value, "name", None) or str(value)


def ov_settings(job) -> dict:
    """The OpenVINO GenAI worker's settings from its job, checked: {"model", "draft_model" (None without
    ``draft``), "properties" (device properties for every model: INFERENCE_NUM_THREADS), "prompt_lookup" (None or
    {"num_assistant_tokens", "max_ngram_size"}, both > 0), "num_assistant_tokens" (the draft's; None: the
    library's default)}. Raises ValueError naming the fix for an unknown option, a bad prompt_lookup or a model
    folder that install.sh did not export."""
    opts = dict(job.get("options") or {})
    bad = sorted(set(opts) - set(OV_OPTIONS))
    if bad:
        raise ValueError(f"openvino-genai: unknown option(s) {bad}; the options are {', '.join(OV_OPTIONS)}")
    if opts.get("prompt_lookup") and opts.get("draft"):
        raise ValueError("openvino-genai: prompt_lookup and draft are two systems; give one of them")
    threads = int(job["threads"])
    if threads < 1:
        raise ValueError(f"openvino-genai: threads must be >= 1, got {threads}")
    pld = opts.get("prompt_lookup")
    if pld:
        if not isinstance(pld, dict) or set(pld) != {"num_assistant_tokens", "max_ngram_size"} \
                or not all(isinstance(v, int) and v > 0 for v in pld.values()):
            raise ValueError(f"openvino-genai: prompt_lookup must be {{'num_assistant_tokens': N, 'max_ngram_size': "
                             f"M}} with N, M > 0 (got {pld!r})")
    draft = opts.get("draft")
    if draft is not None and not isinstance(draft, (bool, dict)):
        raise ValueError(f"openvino-genai: draft must be true or {{'num_assistant_tokens': N}} (got {draft!r})")
    nat = draft.get("num_assistant_tokens") if isinstance(draft, dict) else None
    models = [("ov_model", True), ("ov_draft_model", bool(draft))]
    for key, needed in models:
        if not needed:
            continue
        d = job.get(key)
        if not d or not (Path(d) / "openvino_model.xml").is_file():
            name = Path(d).name.removesuffix("-int4") if d else "MODEL"
            raise ValueError(f"openvino-genai: no OpenVINO model at {d} ({key}); run `benchmarks/peers/install.sh "
                             f"openvino-model {name}`")
    return {"model": str(job["ov_model"]), "draft_model": str(job["ov_draft_model"]) if draft else None,
            "properties": {"INFERENCE_NUM_THREADS": threads}, "prompt_lookup": dict(pld) if pld else None,
            "num_assistant_tokens": nat}


def commit_row(ids, new, t0, commits, t_end) -> dict:
    """A result row from the commits of one request started at t0: [(perf_counter, tokens committed)], one per
    pipeline step (a speculative round commits its accepted tokens + 1). TTFT = t0 -> first commit; decode =
    the tokens after the first commit / the time after it."""
    row = {"prompt_tokens": len(ids), "prompt_digest": ids_digest(ids), "token_ids": list(new),
           "new_tokens": len(new)}
    if commits:
        t_first, n_first = commits[0]
        row.update(ttft_ms=(t_first - t0) * 1e3, decode_tokens=max(0, len(new) - n_first), decode_s=t_end - t_first)
    else:
        row.update(ttft_ms=(t_end - t0) * 1e3, decode_tokens=0, decode_s=0.0)
    ok = row["decode_tokens"] > 0 and row["decode_s"] > 0
    row["tokens_per_second"] = row["decode_tokens"] / row["decode_s"] if ok else None
    return row


def ov_rounds(commits, width: int, max_new: int) -> list:
    """(proposed, accepted) per verify round from the commits' token counts: every commit after the first (the
    prefill's token) is a round that committed accepted + 1 tokens; proposed = the candidates OpenVINO verifies,
    ``width`` (num_assistant_tokens; a prompt-lookup miss is padded to it) capped at the tokens left but one."""
    out, done = [], commits[0][1] if commits else 0
    for _, n in commits[1:]:
        out.append((max(0, min(width, max_new - done - 1)), max(0, n - 1)))
        done += n
    return out


def ov_model_rt_info(model_dir) -> dict:
    """What an exported openvino_model.xml says in its rt_info, as strings: ``runtime_options`` (LLMPipeline applies
    them over the device defaults) and ``weight_compression`` (NNCF's settings of the export: mode, group_size,
    ratio, backup_mode, ...; values over 100 characters left out); {} for each it lacks."""
    import xml.etree.ElementTree as ET

    out, in_rt = {"runtime_options": {}, "weight_compression": {}}, False
    for event, el in ET.iterparse(str(Path(model_dir) / "openvino_model.xml"), events=("start", "end")):
        if el.tag == "rt_info" and event == "start":
            in_rt = True
        elif in_rt and event == "end" and el.tag in out:
            out[el.tag] = {c.tag: c.get("value") for c in el if c.get("value") is not None
                           and len(c.get("value")) <= 100}
        elif el.tag == "layers" and event == "end":
            el.clear()  # the graph: not needed, not kept
    return out


def _openvino_genai_worker(job, emit) -> dict:
    """OpenVINO GenAI's LLMPipeline on CPU (its default paged-attention backend; prompt lookup and a draft model
    need it) fed each prompt's ids as an int64 ov.Tensor, greedy from the model's own generation config, timed by a
    streamer. Meta ``openvino``: the device defaults (precisions), the model's rt_info, what we set, and
    ``effective`` = defaults < the model's runtime_options < ours, as LLMPipeline applies them."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    st = ov_settings(job)
    core = ov.Core()
    device_defaults = {}
    for k in OV_PRECISION_KEYS:
        try:
            device_defaults[k] = ov_property_str(core.get_property("CPU", k))
        except Exception:  # a property this OpenVINO does not have
            pass
    rt_info = ov_model_rt_info(st["model"])
    runtime_options = rt_info["runtime_options"]
    kw = dict(st["properties"])
    if st["prompt_lookup"]:
        kw["prompt_lookup"] = True
    if st["draft_model"]:
        kw["draft_model"] = ov_genai.draft_model(st["draft_model"], "CPU", **st["properties"])
    t0 = time.perf_counter()
    pipe = ov_genai.LLMPipeline(st["model"], "CPU", **kw)
    load_s = time.perf_counter() - t0
    config = pipe.get_generation_config()  # the model's own (EOS ids from its generation_config.json)
    config.do_sample = False
    if st["prompt_lookup"]:
        config.num_assistant_tokens = st["prompt_lookup"]["num_assistant_tokens"]
        config.max_ngram_size = st["prompt_lookup"]["max_ngram_size"]
    elif st["draft_model"] and st["num_assistant_tokens"]:
        config.num_assistant_tokens = st["num_assistant_tokens"]
    speculative = bool(st["prompt_lookup"] or st["draft_model"])

    class Commits(ov_genai.StreamerBase):
        """Timestamps every write: one per pipeline step (called on OpenVINO's streamer thread)."""

        def __init__(self):
            super().__init__()
            self.commits = []

        def write(self, token):
            n = len(token) if isinstance(token, (list, tuple)) else 1
            self.commits.append((time.perf_counter(), n))
            return ov_genai.StreamingStatus.RUNNING

        def end(self):
            pass

    def run(ids, max_new):
        config.max_new_tokens = max_new
        streamer = Commits()
        x = ov.Tensor(np.array([ids], dtype=np.int64))
        t = time.perf_counter()
        res = pipe.generate(x, config, streamer)
        t_end = time.perf_counter()
        return [int(v) for v in res.tokens[0]][:max_new], t, streamer.commits, t_end, res

    t1 = time.perf_counter()
    run(job["prompts"][0]["ids"], 8)
    warmup_s = time.perf_counter() - t1
    width = (config.num_assistant_tokens or OV_DEFAULT_NUM_ASSISTANT_TOKENS) if speculative else 0
    for p in job["prompts"]:
        ids = p["ids"]
        new, t, commits, t_end, res = run(ids, job["max_new_tokens"])
        row = commit_row(ids, new, t, commits, t_end)
        notes = []
        streamed = sum(n for _, n in commits)
        if streamed != len(new):
            notes.append(f"the streamer saw {streamed} tokens, the result has {len(new)}")
        pm = res.perf_metrics  # OpenVINO's own figures, beside ours
        row["ov_metrics"] = {"ttft_ms": pm.get_ttft().mean, "tpot_ms": pm.get_tpot().mean,
                             "throughput": pm.get_throughput().mean, "generate_ms": pm.get_generate_duration().mean}
        if speculative:
            row.update(round_stats(ov_rounds(commits, width, job["max_new_tokens"])))
            if any(n > width + 1 for _, n in commits[1:]):
                notes.append(f"a round committed more than num_assistant_tokens + 1 = {width + 1} tokens")
            ext = getattr(res, "extended_perf_metrics", None)
            if ext is not None and hasattr(ext, "get_num_accepted_tokens"):  # the draft model's pipeline only
                rate = ext.get_draft_acceptance_rate()
                row["ov_stats"] = {"num_accepted_tokens": int(ext.get_num_accepted_tokens()),
                                   "num_draft_tokens": int(ext.get_num_draft_tokens()),
                                   "draft_acceptance_rate": float(getattr(rate, "mean", rate))}
        if notes:
            row["note"] = "; ".join(notes)
        emit(p, row)
    model_dirs = [st["model"]] + ([st["draft_model"]] if st["draft_model"] else [])
    return {"load_s": load_s, "warmup_s": warmup_s, "warmup": WARMUP_IDS_NOTE,
            "model_bytes": file_bytes([f for d in model_dirs for f in Path(d).glob("openvino_model.*")]),
            "model_files": [str(Path(d) / "openvino_model.xml") for d in model_dirs],
            "versions": {"openvino_genai": ov_genai.get_version(), "openvino": ov.get_version(),
                         "numpy": np.__version__},
            "openvino": {"device_properties": st["properties"], "device_defaults": device_defaults,
                         "model_runtime_options": runtime_options,
                         "model_weight_compression": rt_info["weight_compression"],
                         "effective": {**device_defaults, **runtime_options,
                                       **{k: str(v) for k, v in st["properties"].items()}},
                         "num_assistant_tokens": width or None,
                         "num_assistant_tokens_set": config.num_assistant_tokens if speculative else None,
                         "max_ngram_size": config.max_ngram_size if st["prompt_lookup"] else None}}


BACKENDS = {"llama-cpp": _llama_cpp_worker, "llama-speculative": _llama_speculative_worker,
            "ort-genai": _ort_genai_worker, "openvino-genai": _openvino_genai_worker}


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
