"""The driver of a comparison run: settings, the prompt-id preflight, the schedule of workers, the outputs.

Prompts: the first --n of the evaluation split of each --datasets entry, first turn, each system's own rendering of
the chat template; the preflight checks HF's and DSpark's prompt ids are identical (stops if the first differs) and
feeds the HF ids to every peer. The prompt list alternates datasets and is cut into chunks of --chunk; chunk c runs
the systems in the order rotated by c, so machine drift hits all alike. Writes --out-dir: compare.json (rows,
summary, machine, settings, command line), REPORT.md and the plots; ``--report-only`` rebuilds the last two.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import compare as package
from benchmarks.compare.plots import make_plots
from benchmarks.compare.report import add_correctness, render_report, summarize, table, worker_loads, worker_sizes
from benchmarks.compare.resume import append_progress, fingerprint, open_progress, schedule
from benchmarks.compare.systems import (SYSTEMS, check_peers, default_peer_dir, gguf_for, peer_context,
                                        peer_files, peer_job_fields, split_variant, variant_name)
from benchmarks.compare.workers import run_worker, worker_main
from benchmarks.evalsets import EVAL_START, RESULTS, load_prompts, loadavg, machine
from dspark_runtime.engine import DEFAULT_THREADS  # affinity and cgroup quota, at most 8


def interleave(per_dataset: dict) -> list:
    """Round-robin over datasets: [(dataset, index_in_split, text), ...] alternating datasets."""
    out, k = [], 0
    while any(k < len(v) for v in per_dataset.values()):
        for ds, prompts in per_dataset.items():
            if k < len(prompts):
                out.append((ds, k, prompts[k]))
        k += 1
    return out


def resolve_model(arg: str) -> Path:
    p = Path(arg)
    if p.is_dir():
        return p.resolve()
    from dspark_export.models.catalog import model_path

    try:
        q = model_path(arg)
    except Exception as e:  # FetchError: unknown name
        raise SystemExit(f"error: {arg!r} is neither a folder nor a known model name ({e})")
    if not q.is_dir():
        raise SystemExit(f"error: model {arg!r} is not fetched ({q} missing); run `dspark-export fetch {arg}`")
    return q


def write_outputs(result: dict, out_dir: Path, final: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    head = {k: v for k, v in result.items() if k != "rows"}
    text = json.dumps(head, indent=1)[:-2] + ',\n "rows": [\n' + ",\n".join(
        "  " + json.dumps(r, separators=(",", ":")) for r in rows) + "\n ]\n}\n"
    (out_dir / "compare.json").write_text(text)
    if final:
        plots = make_plots(result, out_dir)
        (out_dir / "REPORT.md").write_text(render_report(result, plots))


def run_schedule(plan: list, chunks: list, result: dict, make_job, run, progress: Path, out_dir: Path,
                 t_start: float) -> None:
    """Run every (chunk, system, prompts) of ``plan`` (see :func:`schedule`), one worker at a time, appending
    rows and worker records to ``result`` and the worker record to the progress file. ``make_job(system,
    prompts)`` builds the job; ``run(job, tag)`` runs it and returns (rows, meta, error)."""
    settings = result["settings"]
    for c, s, todo in plan:
        print(f"[chunk {c + 1}/{len(chunks)}] {s}: {len(todo)} prompts "
              f"({time.perf_counter() - t_start:.0f} s elapsed)", file=sys.stderr, flush=True)
        tag = f"c{c}-{s}"
        rows, meta, err = run(make_job(s, todo), tag)
        for r in rows:
            r["peak_rss_mb"] = meta.get("peak_rss_mb", r.get("peak_rss_mb"))
        done = {r["key"] for r in rows}
        rows += [{"system": s, "dataset": p["dataset"], "index": p["index"], "key": p["key"], "error": err
                  or "no result"} for p in todo if p["key"] not in done]
        result["rows"] += rows
        worker = {"system": s, "chunk": c, "tag": tag, **meta, "error": err}
        result["workers"].append(worker)
        append_progress(progress, {"worker": worker, "tag": tag})
        if "hf_assisted_config" in meta:
            settings["hf_assisted_config"] = meta["hf_assisted_config"]
        if meta.get("attn_implementation"):
            settings["hf_attn_implementation"] = meta["attn_implementation"]
        if meta.get("versions") and SYSTEMS[split_variant(s)[0]].peer:
            for k, v in meta["versions"].items():
                settings.setdefault("peer_versions", {})[k] = v if isinstance(v, str) else " ".join(map(str, v))
        if result.get("sessions"):
            result["sessions"][-1]["wall_s"] = time.perf_counter() - t_start
        write_outputs(result, out_dir, final=False)  # partial results survive a crash


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=package.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="fetched model name or HF folder")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                    help="fetched model name or HF folder (hf-assisted; its GGUF: llama-speculative's -md)")
    ap.add_argument("--engine", default="engines/qwen2.5-coder-1.5b", help="DSpark engine directory of the same target")
    ap.add_argument("--datasets", default="humaneval,mbpp,gsm8k,mt-bench")
    ap.add_argument("--n", type=int, default=3, help="prompts per dataset (first N of its evaluation split)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--systems", default=",".join(s for s in SYSTEMS if SYSTEMS[s].peer is None),
                    help=f"comma list of: {', '.join(SYSTEMS)} (default: the project's and transformers' systems; "
                         "the peers need benchmarks/peers/install.sh)")
    ap.add_argument("--temperature", default="0", help="comma list; 0 = greedy (default); '0,1.0' runs every "
                    "system greedy and at temperature 1.0 (variant name@T1) interleaved in one run")
    ap.add_argument("--sampled-systems", default=None, help="comma list: the systems to run at the non-zero "
                    "temperatures (default: all of --systems but the peers, which run greedy only)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed base (prompt number added)")
    ap.add_argument("--chunk", type=int, default=4, help="prompts per worker process (interleaving granularity)")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    ap.add_argument("--lm-draft-length", type=int, default=None, help="override dspark-lm gamma (3)")
    ap.add_argument("--ngram-draft-length", type=int, default=None, help="override dspark-ngram gamma (4)")
    ap.add_argument("--pld-tokens", type=int, default=None, help="override hf-pld prompt_lookup_num_tokens (10)")
    ap.add_argument("--peer-dir", default=None, help="where benchmarks/peers/install.sh put the peers (default "
                    "$DSPARK_PEER_DIR or ${DSPARK_CACHE:-~/.cache/dspark}/peers)")
    ap.add_argument("--target-gguf", default=None, help="the llama.cpp peers' target GGUF (default: the GGUF "
                    "--target was fetched as, <cache>/gguf/<name>.gguf)")
    ap.add_argument("--draft-gguf", default=None, help="llama-speculative's draft GGUF (default: --draft's)")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out-dir (its progress.jsonl): "
                    "pairs (prompt, system) already done are skipped; the settings must be the same")
    ap.add_argument("--out-dir", default=str(RESULTS / "compare"))
    ap.add_argument("--report-only", action="store_true", help="rebuild REPORT.md + plots from --out-dir/compare.json")
    ap.add_argument("--notes", default=None, help="with --report-only: a markdown file (the analysis of the run) "
                    "stored in compare.json and placed in REPORT.md after the tables")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker_main(a.worker)
    out_dir = Path(a.out_dir)
    if a.report_only:
        result = json.loads((out_dir / "compare.json").read_text())
        if a.notes:
            result["notes"] = Path(a.notes).read_text()
        st = result["settings"]
        add_correctness(result["rows"], greedy="temperatures" in st or st.get("temperature", 0) == 0)
        result["summary"] = summarize(result["rows"], st["systems"], st["datasets"])
        write_outputs(result, out_dir, final=True)
        print(f"wrote {out_dir / 'REPORT.md'}")
        return 0

    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad or not systems:
        ap.error(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    try:
        temps = [float(t) for t in a.temperature.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--temperature {a.temperature!r}: give numbers, e.g. 0 or 0,1.0")
    if not temps or any(t < 0 for t in temps) or len(set(temps)) != len(temps):
        ap.error(f"--temperature {a.temperature!r}: give distinct temperatures >= 0, e.g. 0 or 0,1.0")
    sampled = ([s.strip() for s in a.sampled_systems.split(",") if s.strip()] if a.sampled_systems
               else [s for s in systems if not SYSTEMS[s].peer])  # the peers run greedy only
    bad = [s for s in sampled if s not in systems]
    if bad:
        ap.error(f"--sampled-systems {bad} are not in --systems")
    peer_sampled = [s for s in sampled if SYSTEMS[s].peer] if any(t > 0 for t in temps) else []
    if peer_sampled:
        ap.error(f"the peers {peer_sampled} run greedy only; leave them out of --sampled-systems")
    variants = [variant_name(s, t) for t in temps for s in (systems if t == 0 else sampled)]
    datasets = [d.strip() for d in a.datasets.split(",") if d.strip()]
    bad = [d for d in datasets if d not in EVAL_START]
    if bad:
        ap.error(f"unknown dataset(s) {bad}; choose from {', '.join(EVAL_START)}")
    if a.n < 1 or a.max_new_tokens < 1 or a.chunk < 1:
        ap.error("--n, --max-new-tokens and --chunk must be >= 1")
    target = resolve_model(a.target)
    draft = resolve_model(a.draft) if "hf-assisted" in systems else None
    draft_name = draft.name if draft else Path(a.draft).name
    base_systems, systems = systems, variants
    uses_dspark = any(SYSTEMS[s].backend == "dspark" for s in base_systems)
    engine = Path(a.engine).resolve()
    if uses_dspark and not (engine / "manifest.json").is_file():
        raise SystemExit(f"error: {engine} is not an engine directory (no manifest.json); build it first")
    # the peers: refused up front, with the command that installs what is missing
    peer_dir = Path(a.peer_dir).expanduser() if a.peer_dir else default_peer_dir()
    uses_peers = [s for s in base_systems if SYSTEMS[s].peer]
    peer_models = None
    if uses_peers:
        target_gguf = gguf_for(target, a.target_gguf)
        draft_gguf = gguf_for(draft if draft else Path(a.draft), a.draft_gguf)
        msgs = check_peers(uses_peers, peer_dir, target.name, draft_name, target_gguf, draft_gguf)
        if msgs:
            raise SystemExit("error: peer systems not installed (peer dir " + str(peer_dir) + "):\n  "
                             + "\n  ".join(msgs))
        files = peer_files(peer_dir, target.name, draft_name)
        peer_models = {"peer_dir": str(peer_dir.resolve()), "target_gguf": str(target_gguf),
                       "draft_gguf": str(draft_gguf), "llama_speculative": str(files["llama_speculative"]),
                       "ort_model": str(files["ort_model"])}
        if any(SYSTEMS[s].peer == "openvino" for s in uses_peers):  # only then: runs without it resume as before
            peer_models.update(ov_model=str(files["ov_model"]), ov_draft_model=str(files["ov_draft_model"]))
    specs = {s: dict(SYSTEMS[s].options) for s in base_systems}
    if a.lm_draft_length and "dspark-lm" in specs:
        specs["dspark-lm"]["draft_length"] = a.lm_draft_length
    if a.ngram_draft_length and "dspark-ngram" in specs:
        specs["dspark-ngram"]["draft_length"] = a.ngram_draft_length
    if a.pld_tokens and "hf-pld" in specs:
        specs["hf-pld"]["prompt_lookup_num_tokens"] = a.pld_tokens

    jobs = interleave({ds: load_prompts(ds, a.n) for ds in datasets})
    prompts = [{"dataset": ds, "index": i, "key": f"{ds}[{i}]", "text": text, "seed": a.seed + k}
               for k, (ds, i, text) in enumerate(jobs)]
    settings = {"target": str(target), "target_name": target.name, "draft": str(draft) if draft else None,
                "draft_name": draft_name, "engine": str(a.engine) if uses_dspark else None,
                "datasets": datasets, "n": a.n, "max_new_tokens": a.max_new_tokens, "temperatures": temps,
                "seed": a.seed, "chunk": a.chunk, "threads": a.threads, "systems": systems,
                "system_options": specs, "split": "evaluation (dspark_export/data/prompts/README.md)",
                "descriptions": {s: SYSTEMS[s].description for s in base_systems}, "peer_models": peer_models}
    command = shlex.join(["python", "-m", "benchmarks.compare", *(sys.argv[1:] if argv is None else argv)])
    result = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
              "settings": settings, "loadavg_start": loadavg(), "summary": {}, "rows": [], "workers": []}
    la = result["loadavg_start"]
    if la and la[0] > 0.5:
        print(f"WARNING: load average {la[0]:.2f} at start: other processes compete for the CPU. torch's OpenMP "
              "threads slow down badly under contention (HF numbers become meaningless); run on an idle machine.",
              file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="dspark-compare-"))
    base = {"target": str(target), "draft": str(draft) if draft else None, "engine": str(engine),
            "max_new_tokens": a.max_new_tokens, "temperature": 0.0, "threads": a.threads}

    # preflight: identical prompt ids from both chat-template implementations; the peers get these ids
    print(f"{len(prompts)} prompts x {len(systems)} systems; preflight: prompt token ids"
          + (" (HF vs DSpark)" if uses_dspark else " (HF chat template)"), file=sys.stderr)
    rows, meta, err = run_worker({**base, "engine": str(engine) if uses_dspark else None, "system": "tokenize",
                                  "backend": "tokenize", "options": {}, "prompts": prompts}, tmp, "tokenize")
    if err:
        raise SystemExit(f"error: preflight failed: {err}")
    settings["versions"] = meta.get("versions", {})
    settings["engine_models"] = meta.get("engine_models", {})
    mism = [r["key"] for r in rows if r["first_diff"] is not None]
    result["prompt_check"] = {"n": len(rows), "all_identical": not mism, "mismatched": mism,
                              **({} if uses_dspark else {"hf_only": True})}
    if rows and rows[0]["first_diff"] is not None:
        r0 = rows[0]
        result["prompt_check"]["first_prompt"] = {"hf_ids": r0["hf_ids"], "dspark_ids": r0["dspark_ids"]}
        write_outputs(result, out_dir, final=False)
        raise SystemExit(f"error: HF and DSpark chat templates give different prompt ids for {r0['key']} "
                         f"(first difference at {r0['first_diff']}); see {out_dir / 'compare.json'}")
    if mism:
        print(f"WARNING: prompt token ids differ for {mism}", file=sys.stderr)
    em = settings["engine_models"].get("target")
    if em and em != target.name:
        print(f"WARNING: engine target is {em!r}, HF target is {target.name!r}", file=sys.stderr)
    by_key = {r["key"]: r for r in rows}
    for p in prompts:  # the ids every peer is fed (HF chat template; = DSpark's where both were made)
        p["ids"], p["rendered"] = by_key[p["key"]]["hf_ids"], by_key[p["key"]]["rendered"]
    if uses_peers:
        settings["peer_n_ctx"] = peer_context(max(len(p["ids"]) for p in prompts), a.max_new_tokens)

    # resume: the pairs already done are kept; every chunk still runs its remaining systems in rotated order
    fp = fingerprint(settings, prompts)
    progress, old_rows, old_workers = open_progress(out_dir, fp, a.resume)
    result["rows"], result["workers"] = list(old_rows), list(old_workers)
    done = {(r["system"], r["key"]) for r in old_rows}
    chunks = [prompts[i:i + a.chunk] for i in range(0, len(prompts), a.chunk)]
    plan = schedule(chunks, systems, done)
    if a.resume:
        print(f"--resume: {len(done)} of {len(prompts) * len(systems)} (prompt, system) pairs already done; "
              f"{sum(len(t) for _, _, t in plan)} to run", file=sys.stderr)
    prev = out_dir / "compare.json"
    result["sessions"] = (json.loads(prev.read_text()).get("sessions", []) if a.resume and prev.is_file() else [])
    prior_wall = sum(x.get("wall_s") or 0 for x in result["sessions"])
    result["sessions"].append({"date": result["date"], "wall_s": 0.0, "resumed": a.resume,
                               "pairs_run": sum(len(t) for _, _, t in plan)})

    def make_job(s, todo):
        name, temp = split_variant(s)
        return {**base, "system": s, "backend": SYSTEMS[name].backend, "options": specs[name], "temperature": temp,
                "prompts": todo, "progress": str(progress), **peer_job_fields(s, settings, peer_dir)}

    def _terminate(signum, frame):  # SIGTERM as Ctrl-C: subprocess.run then kills the running worker
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    t_start = time.perf_counter()
    run_schedule(plan, chunks, result, make_job, lambda job, tag: run_worker(job, tmp, tag), progress, out_dir,
                 t_start)
    session_wall = time.perf_counter() - t_start
    result["sessions"][-1]["wall_s"] = session_wall
    result["wall_s"] = prior_wall + session_wall

    add_correctness(result["rows"])
    result["summary"] = summarize(result["rows"], systems, datasets)
    result["loadavg_end"] = loadavg()
    write_outputs(result, out_dir, final=True)
    print(table(result["summary"]["all"], systems, with_memory=True, loads=worker_loads(result),
                sizes=worker_sizes(result)))
    print(f"\nwrote {out_dir / 'compare.json'} and {out_dir / 'REPORT.md'} ({session_wall:.0f} s this session)")
    errors = sum(1 for r in result["rows"] if r.get("error"))
    if errors:
        print(f"{errors} prompt runs failed; worker logs kept in {tmp}; `--resume` re-runs them", file=sys.stderr)
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    return 0
