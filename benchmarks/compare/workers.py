"""The worker processes: each (chunk, system) pair runs in a fresh one, strictly one at a time.

A worker loads its model(s) once, warms up, runs its chunk's prompts and exits, so the run's peak memory is the
biggest single system's and each worker's peak RSS (``ru_maxrss``) is its system's alone; load and warm-up are timed
apart and never enter tokens/s. The project's workers are ``python -m benchmarks.compare --worker job.json``; a
peer's is ``python -m benchmarks.peers.worker job.json`` under the peer's own venv. Timing: TTFT = request start ->
first committed token; decode tokens/s = tokens after the first commit / time after it (HF: a timestamping streamer
in the same ``generate`` call).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.compare.report import first_divergence
from benchmarks.evalsets import child_env, ids_digest, loadavg, round_stats
from benchmarks.compare.resume import append_progress
from dspark_runtime.engine_dir.manifest import PROMPT_GRAPH

WARMUP_PROMPT = "Write a one-line Python function that adds two numbers."
PEER_WORKER = "benchmarks.peers.worker"  # run as a module under the peer's python


def position_counts_from_dspark(accepted_by_position, draft_length_histogram) -> tuple:
    """(tries, hits) per draft position from DSpark stats: a round with verify length ell tried
    positions 0..ell-1, so tries[k] = rounds with ell > k; hits[k] = fraction[k] * tries[k]."""
    hist = {int(k): int(v) for k, v in (draft_length_histogram or {}).items()}
    n = len(accepted_by_position or [])
    tries = [sum(v for ell, v in hist.items() if ell > k) for k in range(n)]
    hits = [int(round(f * t)) for f, t in zip(accepted_by_position, tries)]
    return tries, hits


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


class _TimingStreamer:
    """transformers streamer that timestamps every commit; the first put() is the prompt."""

    def __init__(self):
        self.prompt_seen = False
        self.commits = []  # (perf_counter, tokens)

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.commits.append((time.perf_counter(), int(value.numel())))

    def end(self):
        pass


def _hf_worker(job: dict, emit) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(job["threads"])
    opts = job["options"]
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(job["target"])
    model = AutoModelForCausalLM.from_pretrained(job["target"], dtype=torch.float32).eval()
    assistant = None
    if opts.get("assistant"):
        assistant = AutoModelForCausalLM.from_pretrained(job["draft"], dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0

    rounds: list = []
    orig = model._get_candidate_generator

    def recording_generator(*a, **k):  # one per generate call; record (proposed, accepted) per round
        cg = orig(*a, **k)
        upd = cg.update_candidate_strategy

        def update(input_ids, scores, num_matches):
            rounds.append((int(scores.shape[1]) - 1, int(num_matches)))
            return upd(input_ids, scores, num_matches)

        cg.update_candidate_strategy = update
        return cg

    model._get_candidate_generator = recording_generator
    gc = model.generation_config
    pad = gc.pad_token_id if gc.pad_token_id is not None else tok.pad_token_id

    def encode(text):
        return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False))

    def run(ids, max_new, seed):
        kw = dict(max_new_tokens=max_new, pad_token_id=pad)
        if job["temperature"] > 0:
            kw.update(do_sample=True, temperature=job["temperature"], top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kw.update(do_sample=False)
        if assistant is not None:
            kw["assistant_model"] = assistant
        if opts.get("prompt_lookup_num_tokens"):
            kw["prompt_lookup_num_tokens"] = opts["prompt_lookup_num_tokens"]
        kw.update(opts.get("generate_kwargs", {}))
        x = torch.tensor([ids], dtype=torch.long)
        streamer = _TimingStreamer()
        rounds.clear()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), streamer=streamer, **kw)
        t_end = time.perf_counter()
        return out[0, len(ids):].tolist(), t, t_end, streamer.commits, list(rounds)

    t1 = time.perf_counter()
    run(encode(WARMUP_PROMPT), 8, 0)
    warmup_s = time.perf_counter() - t1
    folders = [Path(job["target"])] + ([Path(job["draft"])] if assistant is not None else [])
    meta = {"load_s": load_s, "warmup_s": warmup_s,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "model_bytes": sum(f.stat().st_size for d in folders for f in d.glob("*.safetensors"))}
    if assistant is not None:  # the schedule transformers resolves for the assistant (its defaults)
        ag = assistant.generation_config
        d = ag._get_default_generation_params()
        meta["hf_assisted_config"] = {k: getattr(ag, k, None) if getattr(ag, k, None) is not None else d.get(k)
                                      for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                                "assistant_confidence_threshold")}
        try:
            import sklearn  # noqa: F401  (transformers adapts the confidence threshold only with it)

            meta["hf_assisted_config"]["threshold_adaptation"] = True
        except ImportError:
            meta["hf_assisted_config"]["threshold_adaptation"] = False
    for p in job["prompts"]:
        ids = encode(p["text"])
        new, t, t_end, commits, rnds = run(ids, job["max_new_tokens"], p["seed"])
        row = {"prompt_tokens": len(ids), "prompt_digest": ids_digest(ids), "token_ids": new,
               "new_tokens": len(new)}
        if commits:
            t_first, n_first = commits[0]
            row["ttft_ms"] = (t_first - t) * 1e3
            row["decode_tokens"] = len(new) - n_first
            row["decode_s"] = t_end - t_first
        else:
            row.update(ttft_ms=(t_end - t) * 1e3, decode_tokens=0, decode_s=0.0)
        ok = row["decode_tokens"] > 0 and row["decode_s"] > 0
        row["tokens_per_second"] = row["decode_tokens"] / row["decode_s"] if ok else None
        if opts.get("assistant") or opts.get("prompt_lookup_num_tokens"):
            row.update(round_stats(rnds))
        emit(p, row)
    return meta


def _dspark_worker(job: dict, emit) -> dict:
    from dspark_runtime import Engine

    opts = job["options"]
    t0 = time.perf_counter()
    from dspark_runtime.backends.ort import shared_pool_default

    eng = Engine.load(opts.get("engine") or job["engine"], threads=job["threads"],
                      shared_thread_pool=shared_pool_default(), prompts=opts.get("prompts", "auto"))
    draft = opts.get("draft")
    eng.batch(draft=draft, max_batch=1)  # activates the target and draft sessions, so their creation is load time
    load_s = time.perf_counter() - t0
    kw = dict(temperature=job["temperature"], draft=draft, draft_length=opts.get("draft_length"))
    t1 = time.perf_counter()
    eng.generate(WARMUP_PROMPT, max_new_tokens=8, seed=0, **kw)
    warmup_s = time.perf_counter() - t1
    for p in job["prompts"]:
        ids = eng.encode_prompt(p["text"])
        r = eng.generate(p["text"], max_new_tokens=job["max_new_tokens"], seed=p["seed"], **kw)
        s = r.stats
        row = {"prompt_tokens": len(ids), "prompt_digest": ids_digest(ids), "token_ids": list(r.token_ids),
               "new_tokens": len(r.token_ids), "ttft_ms": s.ttft_ms, "decode_tokens": max(0, len(r.token_ids) - 1),
               "decode_s": s.decode_ms / 1e3, "tokens_per_second": s.tokens_per_second if len(r.token_ids) > 1 else None}
        if draft is not None:
            tries, hits = position_counts_from_dspark(s.accepted_by_position, s.draft_length_histogram)
            row.update(rounds=s.num_rounds, proposed=s.proposed, accepted=s.accepted, tau=s.accepted_length_mean,
                       acceptance_rate=s.acceptance_rate if s.proposed else None, pos_tries=tries, pos_hits=hits)
        emit(p, row)
    return {"load_s": load_s, "warmup_s": warmup_s, "model_bytes": _engine_bytes(eng, draft)}


def _engine_bytes(eng, draft) -> int | None:
    """Bytes of the engine files a DSpark system loads: the target graph, the draft LM or DSpark drafter
    graph its draft uses, the drafter's heads file, and the prompt graph where prompt chunks run on it."""
    try:
        keys = set(eng.graphs_used(draft)) | ({PROMPT_GRAPH} if eng.prompts == "prompt-graph" else set())
        total = sum({f.path: f.size for k in keys for f in eng.manifest.graphs[k].files}.values())  # shared once
        ds = eng.manifest.speculation.dspark
        heads = ds.heads_file if ds is not None and eng.dspark_graph in keys else None
        if heads and (eng.dir / heads).is_file():
            total += (eng.dir / heads).stat().st_size
        return total
    except Exception:  # an engine layout this helper does not know: no figure rather than a wrong one
        return None


def _tokenize_worker(job: dict, emit) -> dict:
    """Preflight: prompt ids from the HF tokenizer's chat template and from the DSpark engine (when a DSpark
    system runs; ``job["engine"]`` None otherwise), and the rendered chat-template text (llama-speculative)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(job["target"])
    eng = None
    if job.get("engine"):
        from dspark_runtime import Engine

        eng = Engine.load(job["engine"], threads=1)
    for p in job["prompts"]:
        msgs = [{"role": "user", "content": p["text"]}]
        hf = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ds = eng.encode_prompt(p["text"]) if eng is not None else hf
        row = {"hf_ids": hf, "dspark_ids": ds, "first_diff": first_divergence(hf, ds), "rendered": rendered}
        emit(p, row)
    versions = {}
    for mod in ("transformers", "torch", "onnxruntime", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    manifest = {k: getattr(g, "model_id", None) for k, g in eng.manifest.graphs.items()} if eng is not None else {}
    return {"versions": versions, "engine_models": manifest}


def worker_main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    out = open(job["out"], "w")

    def emit(p, row):
        row = {"system": job["system"], "dataset": p["dataset"], "index": p["index"], "key": p["key"], **row}
        out.write(json.dumps(row) + "\n")
        out.flush()
        if job.get("progress"):  # the run's resume file: this (prompt, system) is done
            append_progress(Path(job["progress"]), {"row": {**row, "peak_rss_mb": _peak_rss_mb()}, "tag": job.get("tag")})
        if job["backend"] != "tokenize":
            tps = row.get("tokens_per_second")
            tau = row.get("tau")
            print(f"  {job['system']:14} {p['key']:14} {row['new_tokens']:4d} tok  "
                  f"{tps if tps is not None else float('nan'):7.2f} tok/s  ttft {row['ttft_ms']:7.0f} ms"
                  + (f"  tau {tau:.2f}" if tau is not None else ""), flush=True)

    fn = {"hf": _hf_worker, "dspark": _dspark_worker, "tokenize": _tokenize_worker}[job["backend"]]
    meta = fn(job, emit)
    meta["peak_rss_mb"] = _peak_rss_mb()
    meta["loadavg"] = loadavg()  # ~threads when the worker had the machine to itself
    meta["cpu_s"] = _cpu_s()
    out.write(json.dumps({"meta": meta}) + "\n")
    out.close()
    return 0


def run_worker(job: dict, tmp: Path, tag: str) -> tuple:
    """Run one worker subprocess to completion; returns (rows, meta, error or None). A peer system's worker
    is ``benchmarks.peers.worker`` under the peer's own python (``job["python"]``)."""
    jp = tmp / f"{tag}.json"
    job["out"] = str(tmp / f"{tag}.out.jsonl")
    job["tag"] = tag
    jp.write_text(json.dumps(job))
    argv = ([job["python"], "-m", PEER_WORKER, str(jp)] if job.get("python")
            else [sys.executable, "-m", "benchmarks.compare", "--worker", str(jp)])
    env = child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                    PYTHONUNBUFFERED="1")
    t = time.perf_counter()
    err_log = tmp / f"{tag}.stderr.txt"  # library warnings; its tail is shown when the worker fails
    with open(err_log, "w") as ef:
        proc = subprocess.run(argv, env=env, stdout=sys.stderr, stderr=ef)
    rows, meta = [], {}
    if Path(job["out"]).is_file():
        for line in Path(job["out"]).read_text().splitlines():
            obj = json.loads(line)
            if "meta" in obj:
                meta = obj["meta"]
            else:
                rows.append(obj)
    meta["wall_s"] = time.perf_counter() - t
    err = None
    if proc.returncode != 0:
        tail = err_log.read_text(errors="replace").strip().splitlines()[-15:]
        err = f"worker exited {proc.returncode}: " + (tail[-1] if tail else "")
        print("\n".join(tail), file=sys.stderr)
    return rows, meta, err
