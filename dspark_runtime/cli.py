"""``dspark``: generate with an engine directory; verify it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

import dspark_runtime  # dspark_runtime.Engine is imported on first use (PEP 562): `dspark --help` stays cheap
from dspark_runtime.backends.prompt_place import PROMPT_PLACES, PROMPT_PLACES_HELP
from dspark_runtime.engine_dir.artifact import is_tarball
from dspark_runtime.engine_dir.artifact import unpack as unpack_tarball
from dspark_runtime.engine_dir.graphspec import slot_bindings
from dspark_runtime.engine_dir.manifest import PROMPT_GRAPH, load_manifest
from dspark_runtime.engine_dir.speculation import speculation_summary
from dspark_runtime.errors import DSparkError, InputError, ManifestError
from dspark_runtime.machine.huge_pages import exec_with_huge_page_malloc
from dspark_runtime.machine.sysinfo import DEFAULT_THREADS, cpu_difference, cpu_features, shared_pool_default
from dspark_runtime.serving import ray_serve


def _draft_length(value):  # --draft-length: None, "auto", "scheduled" or an integer
    if value is None or value in ("auto", "scheduled"):
        return value
    try:
        return int(value)
    except ValueError:
        raise InputError(f"--draft-length must be an integer, 'auto' or 'scheduled', got {value!r}")


def check_engine_path(path, tarball_ok: bool = False):
    """``path`` unchanged unless it names a file where an engine directory is needed: then a ManifestError that
    says so and how to get a directory (a build recipe: build it; a tarball: unpack it; manifest.json: pass its
    folder). Missing paths and directories without a manifest are left to ``load_manifest``'s messages.
    ``tarball_ok``: the command unpacks an engine tarball itself (``generate``, ``serve``)."""
    if path is None or not Path(path).is_file():
        return path
    p = Path(path)
    if is_tarball(p):
        if tarball_ok:
            return path
        raise ManifestError(f"{p} is an engine tarball, not an engine directory; unpack it with `dspark unpack {p}` "
                            "and pass the directory it writes (`dspark generate` and `dspark serve` take the "
                            "tarball itself)")
    if p.name == "manifest.json":
        fix = f"pass the folder that holds it ({p.parent})"
    elif p.suffix == ".json":
        raise ManifestError(f"{p} is a file, not an engine directory (a build recipe?); build it with "
                            f"`dspark-export build {p}` and pass the directory it writes")
    else:
        fix = ("pass the directory `dspark-export build` wrote (it holds manifest.json, e.g. engines/<name>/), "
               "or build one with `dspark-export build`")
    raise ManifestError(f"{p} is a file, not an engine directory; {fix}")


def engine_path_callback(tarball_ok: bool = False):
    """A click callback: :func:`check_engine_path` on an engine directory, before anything loads (both CLIs)."""
    return lambda ctx, param, value: check_engine_path(value, tarball_ok)


@click.group()
@click.version_option(package_name="dspark")
def cli():
    """DSpark runtime: speculative decoding from a built engine directory."""


@cli.command()
@click.option("--engine", "engine_dir", required=True, callback=engine_path_callback(tarball_ok=True),
              help="Engine directory (with manifest.json) or engine tarball (*.tar.gz from `dspark-export pack`).")
@click.option("--prompt", required=True, help="Prompt text (wrapped in the chat template unless --raw).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, default=None, help="Sampling seed.")
@click.option("--draft-length", default=None,
              help="Draft tokens per round, 'auto' (heuristic schedule) or 'scheduled' (DSpark: confidence-"
                   "scheduled verify length from the engine's cost table).")
@click.option("--draft-confidence", type=float, default=None,
              help="Static threshold: LM draft - end a block after the first draft token below this "
                   "probability; DSpark - cut before the first position whose prefix survival is below it.")
@click.option("--draft-confidence-rule", type=click.Choice(["survival", "deepspec"]), default="survival",
              show_default=True,
              help="How the DSpark drafter applies --draft-confidence: survival (ours: the calibrated prefix "
                   "survival) or deepspec (DeepSpec's rule: the first position whose own confidence is below it).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--draft", type=click.Choice(["auto", "router", "dspark", "eagle3", "lm", "ngram"]), default="auto",
              show_default=True,
              help="Drafter: router (per round, n-gram prompt lookup or the engine's DSpark/EAGLE-3/LM drafter, "
                   "whichever is expected to commit more), the engine's DSpark drafter, its EAGLE-3 drafter, its "
                   "draft LM, n-gram prompt lookup, "
                   "or auto (the router over a calibrated DSpark drafter with scheduled verify lengths where the "
                   "engine has a cost table, else its draft LM, else the router, else n-gram; `dspark info` says "
                   "which).")
@click.option("--no-speculation", is_flag=True, help="Target-only decoding.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token_ids, stats).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads.")
@click.option("--backend", type=click.Choice(["ort", "trt"]), default="ort", show_default=True,
              help="ort: ONNX Runtime. trt: the engine's TensorRT engines (capacity KV layout, CUDA graphs; NVIDIA GPU, "
                   "`dspark-export build-trt` first). Not yet verified on a GPU.")
@click.option("--placement", default=None,
              help="Where each graph runs: 'target=trt,draft=cuda,dspark=cpu' or one place for all (cpu, cuda, "
                   "trt-ep: ONNX Runtime providers, cuda/trt-ep need onnxruntime-gpu in place of onnxruntime; "
                   "trt: the engine's TensorRT engine). Default: every graph on the CPU; --backend trt = --placement "
                   "trt. Not yet verified on a GPU.")
@click.option("--prompts", type=click.Choice(list(PROMPT_PLACES)), default="auto", show_default=True,
              help=PROMPT_PLACES_HELP)
@click.option("--stream/--no-stream", default=True, help="Print text as it is generated (not with --json).")
@click.option("--allow-slow-precision", is_flag=True,
              help="Run fp8/fp16 graphs (built for GPUs) on ONNX Runtime's CPU provider anyway (6-10x slower than fp32).")
@click.option("--profile-on-load", is_flag=True,
              help="Re-measure the engine's cost table on this machine before generating (for --draft-length "
                   "scheduled; about a minute for a 1.5B target); the manifest is not changed.")
@click.option("--row-multiple", type=click.IntRange(min=1), default=None,
              help="Pad every target call to a multiple of N rows, making target-only and speculative decoding "
                   "compute each position bit for bit alike (default: what `dspark-export profile` probed on this "
                   "machine and stored in the manifest, else 1 = no padding).")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True,
              help="Subtracted from the logit of every token generated so far, once (OpenAI's; [-2, 2]).")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
              help="Subtracted per occurrence of every token generated so far (OpenAI's; [-2, 2]).")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="Divides positive / multiplies other logits of prompt and generated tokens (vLLM's; 1 = off).")
@click.option("--logprobs", type=click.IntRange(0, 20), default=None,
              help="Report each token's log-probability and this many alternatives (with --json).")
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A JSON Schema file: the output is JSON that satisfies it (needs `pip install 'dspark[grammar]'`).")
@click.option("--json-object", is_flag=True, help="The output is a JSON object (any; needs the grammar extra).")
def generate(engine_dir, prompt, max_new_tokens, temperature, top_p, top_k, seed, draft_length, draft_confidence,
             draft_confidence_rule, stop, raw, draft, no_speculation, as_json, threads, backend, placement, prompts,
             stream, allow_slow_precision, profile_on_load, row_multiple, presence_penalty, frequency_penalty,
             repetition_penalty, logprobs, json_schema, json_object):
    """Generate a completion for --prompt."""
    response_format = _response_format(json_schema, json_object)
    eng = dspark_runtime.Engine.load(engine_dir, threads=DEFAULT_THREADS if threads is None else threads,
                                     backend=backend, shared_thread_pool=shared_pool_default(), placement=placement,
                                     allow_slow_precision=allow_slow_precision, row_multiple=row_multiple,
                                     prompts=prompts)
    if profile_on_load:
        t = eng.profile()
        click.echo(f"profiled on load: t_draft {t['t_draft'] * 1e3:.0f} ms, t_verify B=1 {t['t_verify'][0] * 1e3:.0f} ms"
                   f" .. B={t['tokens'][-1]} {t['t_verify'][-1] * 1e3:.0f} ms", err=True)
    streaming = stream and not as_json
    res = eng.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                       seed=seed, draft=None if no_speculation else draft, draft_length=_draft_length(draft_length),
                       draft_confidence=draft_confidence, draft_confidence_rule=draft_confidence_rule,
                       stop=list(stop) or None, raw=raw,
                       stream=(lambda t: click.echo(t, nl=False)) if streaming else None,
                       presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                       repetition_penalty=repetition_penalty, logprobs=logprobs, response_format=response_format)
    s = res.stats
    if as_json:
        click.echo(json.dumps(res.to_json()))
        return
    if not streaming:
        click.echo(res.text, nl=False)
    click.echo()
    mode = "target-only" if s.drafter == "none" else f"speculative ({s.drafter} draft)"
    extra = "" if s.drafter == "none" else f" | tau {s.accepted_length_mean:.2f} | acceptance {s.acceptance_rate:.0%}"
    if s.draft_sources:  # the router: rounds per proposal source
        extra += " | rounds " + ", ".join(f"{k} {v['rounds']}" for k, v in s.draft_sources.items())
    if response_format is not None:
        extra += f" | grammar forced {s.forced_tokens} tokens, masked {s.masked_drafts} drafts"
    click.echo(f"--- {mode}: {s.new_tokens} tokens ({res.finish_reason}) | {s.tokens_per_second:.1f} tok/s"
               f"{extra} | TTFT {s.ttft_ms:.0f} ms | total {s.total_ms / 1e3:.1f} s", err=True)


def _response_format(json_schema: str | None, json_object: bool) -> dict | None:
    """The response_format of --json-schema FILE / --json-object, or None. Raises click.UsageError for both at once
    or a file that is not a JSON object."""
    if json_schema and json_object:
        raise click.UsageError("--json-schema and --json-object exclude each other; pass one")
    if json_object:
        return {"type": "json_object"}
    if not json_schema:
        return None
    try:
        schema = json.loads(Path(json_schema).read_text())
    except (OSError, ValueError) as e:
        raise click.UsageError(f"--json-schema {json_schema}: not a readable JSON file ({e}); pass a JSON Schema "
                               "file") from None
    if not isinstance(schema, dict):
        raise click.UsageError(f"--json-schema {json_schema}: a JSON Schema is a JSON object, got "
                               f"{type(schema).__name__}")
    return {"type": "json_schema", "json_schema": {"name": Path(json_schema).stem[:64] or "schema", "schema": schema}}


@cli.command()
@click.option("--engine", "engine_dir", required=True, callback=engine_path_callback(), help="Engine directory.")
def verify(engine_dir):
    """Re-hash every file of the engine against its manifest (sha256)."""
    m = load_manifest(engine_dir, verify=True, rehash=True)
    n = len(m.all_files())
    click.echo(f"{engine_dir}: manifest v{m.schema_version} '{m.name}', {n} files OK")


@cli.command()
@click.option("--engine", "engine_dir", required=True, callback=engine_path_callback(), help="Engine directory.")
def info(engine_dir):
    """Print the manifest summary: graphs, precision, validation figures."""
    m = load_manifest(engine_dir, verify=False)
    here = cpu_features()

    def cpu_line(rec) -> str:  # "<model> (<vendor>, N cores; ISA ...) — this machine's CPU" / "— NOT ...: <why>"
        if not isinstance(rec, dict) or not rec:
            return "not recorded"
        diff = cpu_difference(rec, here)
        fam = f", family {rec['family']}" if rec.get("family") else ""  # x86 family/model: the CPU's generation
        return (f"{rec.get('model') or '?'} ({rec.get('vendor') or '?'}{fam}, {rec.get('cores', '?')} cores; ISA "
                f"{' '.join(rec.get('flags') or []) or 'not recorded'}) — "
                + ("this machine's CPU" if diff is None else f"NOT this machine's CPU: {diff}"))

    click.echo(f"{m.name} (schema v{m.schema_version}, built {m.created})")
    click.echo(f"  build machine: {cpu_line(m.build_machine)}")
    counted: dict = {}  # file -> the graph whose size counts it (a prompt graph reads the target's data file)
    for k, g in m.graphs.items():
        shared, d = sorted({f"{f.path} of {counted[f.path]}" for f in g.files if f.path in counted}), g.spec.dims
        size = sum(f.size for f in g.files if counted.setdefault(f.path, k) == k) / 2**30
        click.echo(f"  {k}: {g.model_id}  {g.format}/{g.precision}  {size:.2f} GiB"
                   + (f" (+ {', '.join(shared)})" if shared else "") + f"  layers={d.num_layers} "
                   f"kv_heads={d.num_kv_heads} head_dim={d.head_dim} vocab={d.vocab_size} "
                   f"feature_layers={list(d.feature_layers)}  KV layout {g.spec.kv_layout}"
                   + ("  (one batch row per request: served output == solo output; "
                      + ("K/V written in place)" if slot_bindings(g.spec) else
                         "K/V buffers copied every call: rebuild the engine to write them in place)")
                      if g.spec.kv_layout == "scatter" else ""))
        if k == PROMPT_GRAPH:
            click.echo("    prompt chunks run on this graph, in every decoding mode (`dspark-export add-prompt-graph`; "
                       "`--prompts target` runs them on the target)")
        reports = g.validation or {}
        if reports and not all(isinstance(v, dict) for v in reports.values()):
            reports = {g.precision: reports}  # engines built before validation was keyed by precision
        for prec, v in reports.items():
            if "prefill_max_abs_logit_diff" in v:
                click.echo(f"    validation {prec}: max |dlogits| prefill {v['prefill_max_abs_logit_diff']:.2e} "
                           f"verify {v['verify_max_abs_logit_diff']:.2e}; argmax agreement "
                           f"{v['prefill_argmax_agreement']:.0%} / {v['verify_argmax_agreement']:.0%}")
            elif isinstance(v.get("prefill"), dict):  # `dspark-export quantize`: teacher-forced against its fp32 graph
                pre, ver = v["prefill"], v.get("verify", {})
                click.echo(f"    validation {prec} vs {v.get('reference', 'fp32 graph')}: top-1 agreement prefill "
                           f"{pre.get('top1_agreement', float('nan')):.0%} / verify "
                           f"{ver.get('top1_agreement', float('nan')):.0%}, max |dlogits| "
                           f"{pre.get('max_abs_logit_diff', float('nan')):.2f} / "
                           f"{ver.get('max_abs_logit_diff', float('nan')):.2f}")
            else:
                click.echo(f"    validation {prec}: max |dlogits| {v.get('max_abs_logit_diff', float('nan')):.2e}; "
                           f"argmax agreement {v.get('argmax_agreement', float('nan')):.0%}")
        q = g.quantization or {}
        if g.precision == "int4" and q:
            source = q.get("int4_source", q.get("source"))
            what = (f"GGUF blocks of {q.get('gguf')} {'kept' if q.get('kernels') else 're-packed'} ("
                    + ", ".join(f"{c['tensors']} {t}" for t, c in (q.get("gguf_types") or {}).items()) + ")"
                    + (f", compact: {len(q.get('approximated') or {})} tensors in fewer bits" if q.get("approximated") else "")
                    + (f"; {q['matmul_gguf']} MatMulGGUF on DSpark's kernels" if q.get("kernels") else "")
                    if source in ("gguf", "gguf-compact", "gguf-kernel") else q.get("method", "?"))
            click.echo(f"    int4 weights: {what}; {q.get('matmul_nbits', '?')} MatMulNBits, accuracy_level "
                       f"{q.get('accuracy_level', '?')}" + (f"; LM head screened in {h.get('screen_bits', 4)} bits, the best {h['candidates']} "
                                                           "rescored exactly" if (h := q.get("lm_head")) else ""))
    sp = m.speculation
    for line in speculation_summary(m):
        click.echo(line)
    if sp.dspark is not None:
        d = sp.dspark
        if not d.markov_rank and d.confidence_head is False:  # DeepSpec's DFlash: DSpark without both heads
            heads = "DFlash (Markov rank 0, no confidence head: fixed blocks or the router)"
        else:
            conf = {True: ", confidence head" + (" with Markov features" if d.confidence_head_with_markov else ""),
                    False: ", no confidence head"}.get(d.confidence_head, "")  # None: not recorded (older engines)
            heads = f"Markov {d.markov_head_type or 'none'} rank {d.markov_rank}{conf}"
        click.echo(f"  DSpark drafter: graph {d.graph}, block {d.block_size}, {heads}, draft vocabulary "
                   f"{d.draft_vocab_size or 'full'}, target layers {d.target_layer_ids}, STS "
                   f"temperatures {d.sts_temperatures or 'none (uncalibrated)'}")
    ri = sp.row_invariance
    if ri and not ri.get("row_multiple"):
        click.echo(f"  row padding: none; the probe ({ri.get('date', '?')}) found no padding that makes the target "
                   "row-count invariant on that machine")
    elif ri:
        head = ", the LM head on the real rows only" if ri.get("head_skips_padding") else ""
        click.echo(f"  row padding: target calls padded to a multiple of {ri.get('row_multiple') or 1} row(s){head} "
                   f"(probed {ri.get('date', '?')} on {ri.get('machine', '?')}, {ri.get('threads', '?')} threads, "
                   f"onnxruntime {ri.get('onnxruntime', '?')})")
    else:
        click.echo("  row padding: not probed (target calls unpadded; `dspark-export profile` probes it)")
    if ri:
        click.echo(f"    row probe CPU: {cpu_line(ri.get('cpu'))}")
    ct = sp.cost_table
    if ct:
        toks = ct.get("tokens") or []
        span = f"{toks[0]}..{toks[-1]}" if toks else "?"
        ctxs = [str(b.get("context")) for b in ct.get("buckets") or [ct] if b.get("context") is not None]
        at = f" at {', '.join(ctxs)} cached positions" if ctxs else ""
        click.echo(f"  cost table: verify B = {span} tokens{at}, measured on {ct.get('machine', '?')}, "
                   f"{ct.get('threads', '?')} threads")
        click.echo(f"    cost table CPU: {cpu_line(ct.get('cpu'))}")
    else:
        click.echo("  cost table: none (`dspark-export profile` measures it, for --draft-length scheduled)")
    for k, e in m.trt_engines.items():
        dec = next((p for p in e.profiles if p["name"] == "decode"), None)
        click.echo(f"  TensorRT engine {k}: {e.file.path} {e.file.size / 2**20:.1f} MiB, {e.flavour} {e.version}, "
                   f"{e.precision}, {e.kv_layout} KV layout, compute capabilities {', '.join(e.compute_capabilities)}, "
                   f"profiles {', '.join(p['name'] for p in e.profiles)}"
                   + (f" (decode input_ids max {dec['shapes']['input_ids']['max']})" if dec else "")
                   + f"; built in {e.build_seconds:.1f} s, peak RSS {e.peak_rss_bytes / 2**30:.2f} GiB")


@cli.command()
@click.argument("tarball")
@click.option("-o", "--out", "dest", default=".", show_default=True, help="Folder to unpack into (<out>/<name>).")
def unpack(tarball, dest):
    """Unpack an engine TARBALL (from `dspark-export pack`) and verify every file's sha256 against its manifest.
    (`dspark generate --engine x.tar.gz` unpacks into the cache by itself.)"""
    d = unpack_tarball(tarball, dest)
    click.echo(f"{d}: unpacked and verified")


@cli.command()
@click.option("--engine", "engine_dir", required=True, callback=engine_path_callback(tarball_ok=True),
              help="Engine directory (with manifest.json) or engine tarball (*.tar.gz from `dspark-export pack`).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Most requests decoding at once (one packed verify pass per round for all of them).")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests accepted beyond --max-batch, waiting for a slot; more are answered 429.")
@click.option("--draft", type=click.Choice(["auto", "router", "dspark", "eagle3", "lm", "ngram", "none"]),
              default="auto",
              show_default=True, help="Drafter (auto: the router — n-gram lookup or the DSpark drafter per request "
              "and round — with scheduled verify lengths over a calibrated DSpark drafter where the engine has a "
              "cost table, else the engine's draft LM, else the router, else n-gram; `dspark info` says which); "
              "none = target-only.")
@click.option("--draft-length", default=None, help="Draft tokens per round, or 'scheduled' (DSpark + cost table).")
@click.option("--draft-confidence", type=float, default=None, help="Static confidence threshold (see generate).")
@click.option("--prefill-budget", default="auto", show_default=True,
              help="Prompt tokens of joining requests fed per round while others decode (chunked prefill), or 'auto' "
                   "(from the engine's cost table; 64 without one).")
@click.option("--prefix-cache-mb", type=click.FloatRange(min=0), default=0, show_default=True,
              help="Prefix KV cache across requests (shared system prompts, chat turns): its memory bound in MiB, "
                   "least recently used blocks evicted beyond it; 0 = off. Needs the scatter KV layout (int4 engines).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads.")
@click.option("--max-context", type=click.IntRange(min=2), default=None,
              help="Prompt + max_tokens limit (default: the manifest's max_position_embeddings).")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="max_tokens of requests that give none.")
@click.option("--model-name", default=None, help="Model id served (default: the engine's name).")
@click.option("--shutdown-timeout", type=float, default=30.0, show_default=True,
              help="At shutdown, seconds open requests may still finish before they are cancelled.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.option("--backend", type=click.Choice(["ort", "trt"]), default="ort", show_default=True,
              help="ort: ONNX Runtime. trt: the engine's TensorRT engines (= --placement trt; batches of up to the "
                   "engines' build-trt --max-batch requests, so --max-batch must not exceed it). Not yet verified on a "
                   "GPU.")
@click.option("--placement", default=None,
              help="Where each graph runs (as `dspark generate --placement`; cpu, cuda, trt-ep, trt). Not yet "
                   "verified on a GPU.")
@click.option("--prompts", type=click.Choice(list(PROMPT_PLACES)), default="auto", show_default=True,
              help=PROMPT_PLACES_HELP)
@click.option("--ray", "use_ray", is_flag=True,
              help="Serve on Ray Serve (pip install 'dspark[ray]'): the same app in --replicas replicas, each loading "
                   "the engine (docs/serving.md, 'Scale-out on Ray Serve').")
@click.option("--replicas", type=click.IntRange(min=1), default=None, help="With --ray: replicas (default 1).")
@click.option("--autoscale", default=None, metavar="MIN:MAX",
              help="With --ray: autoscale between MIN and MAX replicas (instead of --replicas).")
@click.option("--target-ongoing-requests", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With --autoscale: requests in flight per replica that autoscaling aims at (default --max-batch).")
@click.option("--replica-cpus", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With --ray: Ray CPUs reserved per replica (default 1; --threads defaults to it, rounded).")
@click.option("--ray-address", default=None,
              help="With --ray: the Ray cluster to join ('auto': the one `ray start` runs here, or ray://HOST:10001); "
                   "default: start a new local one on this machine for this command.")
def serve(engine_dir, host, port, max_batch, max_queue, draft, draft_length, draft_confidence, prefill_budget,
          prefix_cache_mb, threads, max_context, default_max_tokens, model_name, shutdown_timeout, log_level, backend,
          placement, prompts, use_ray, replicas, autoscale, target_ongoing_requests, replica_cpus, ray_address):
    """Serve an OpenAI-compatible HTTP API (completions, chat, /metrics) with continuous batching; with --ray,
    in several replicas on Ray Serve."""
    prefill_budget = _prefill_budget(prefill_budget)
    if backend == "trt":
        if placement is not None:
            raise InputError("give either --backend trt or --placement (--placement trt is the same), not both")
        placement = "trt"
    ray_opts = {"--replicas": replicas, "--autoscale": autoscale, "--target-ongoing-requests": target_ongoing_requests,
                "--replica-cpus": replica_cpus, "--ray-address": ray_address}
    if not use_ray:
        given = [k for k, v in ray_opts.items() if v is not None]
        if given:
            raise InputError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} only with --ray (serving on "
                             f"Ray Serve); add --ray or drop {'them' if len(given) > 1 else 'it'}")
    else:
        _serve_ray(engine_dir, host=host, port=port, max_batch=max_batch, max_queue=max_queue, draft=draft,
                   draft_length=draft_length, draft_confidence=draft_confidence, threads=threads,
                   prefill_budget=prefill_budget, prefix_cache_mb=float(prefix_cache_mb),
                   max_context=max_context, default_max_tokens=default_max_tokens, model_name=model_name,
                   shutdown_timeout=shutdown_timeout, placement=placement, prompts=prompts, replicas=replicas,
                   autoscale=autoscale, target_ongoing_requests=target_ongoing_requests,
                   replica_cpus=replica_cpus, ray_address=ray_address)
        return
    try:
        from dspark_runtime.serving.server import serve as _serve
    except ImportError as e:
        raise InputError(f"`dspark serve` needs the serve extra: pip install 'dspark[serve]' ({e})")
    dl = _draft_length(draft_length)
    if dl == "auto":
        raise InputError("--draft-length auto is not available when serving; use an integer or 'scheduled'")
    _check_port_free(host, port)  # before the engine loads, not after
    eng = dspark_runtime.Engine.load(engine_dir, threads=DEFAULT_THREADS if threads is None else threads,
                                     shared_thread_pool=shared_pool_default(), placement=placement,
                                     prefix_cache_mb=prefix_cache_mb, prompts=prompts)
    _serve(eng, host=host, port=port, shutdown_timeout=shutdown_timeout, log_level=log_level,
           draft=None if draft == "none" else draft, draft_length=dl, draft_confidence=draft_confidence,
           max_batch=max_batch, max_queue=max_queue, max_context=max_context,
           default_max_tokens=default_max_tokens, model_name=model_name, prefill_budget=prefill_budget)


def _check_port_free(host: str, port: int) -> None:
    """Raise InputError when ``host``:``port`` cannot be listened on (another server holds it, a host that is not this
    machine's), naming the fix; a bind test as the server makes it (SO_REUSEADDR), released at once."""
    import socket  # only `dspark serve` needs it: `dspark --help` stays cheap

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise InputError(f"--host {host!r} does not resolve ({e}); pass an address of this machine, e.g. 127.0.0.1")
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}; pass another --port (or stop what "
                             "holds it)") from None


def _prefill_budget(value: str):
    """``--prefill-budget``: 'auto' or a positive integer; raises InputError naming the expected form."""
    if value == "auto":
        return value
    n = int(value) if value.strip().isdigit() else 0
    if n < 1:
        raise InputError(f"--prefill-budget takes a positive number of tokens or 'auto', got {value!r}")
    return n


def _autoscale(value: str) -> tuple:
    """``MIN:MAX`` -> (min, max); raises InputError naming the expected form."""
    try:
        lo, hi = (int(x) for x in value.split(":"))
    except ValueError:
        raise InputError(f"--autoscale takes MIN:MAX replicas (e.g. 1:4), got {value!r}") from None
    if lo < 0 or hi < max(1, lo):
        raise InputError(f"--autoscale MIN:MAX needs 0 <= MIN <= MAX and MAX >= 1, got {value!r}")
    return lo, hi


def _serve_ray(engine_dir, *, replicas, autoscale, target_ongoing_requests, replica_cpus, ray_address, host, port,
               draft_length, **app) -> None:
    """``dspark serve --ray``: :func:`dspark_runtime.serving.ray_serve.run` with the command's options. Raises InputError
    for bad options or without Ray Serve; ManifestError when a local cluster (no --ray-address) would load a missing or
    broken engine directory."""
    dl = _draft_length(draft_length)
    if dl == "auto":
        raise InputError("--draft-length auto is not available when serving; use an integer or 'scheduled'")
    if replicas is not None and autoscale is not None:
        raise InputError("--replicas and --autoscale exclude each other: a fixed count or MIN:MAX, not both")
    if target_ongoing_requests is not None and autoscale is None:
        raise InputError("--target-ongoing-requests applies to autoscaling: add --autoscale MIN:MAX")
    lo, hi = _autoscale(autoscale) if autoscale is not None else (None, None)
    if ray_address is None and not Path(engine_dir).is_file():  # a tarball: the replicas unpack and check it
        load_manifest(engine_dir, verify=False)  # the replicas run here: a wrong path fails now, not in each replica
    settings = ray_serve.RayServeSettings(engine=str(engine_dir), draft_length=dl, num_replicas=replicas or 1,
                                          min_replicas=lo, max_replicas=hi,
                                          target_ongoing_requests=target_ongoing_requests,
                                          replica_cpus=1.0 if replica_cpus is None else float(replica_cpus), **app)
    ray_serve.run(settings, address=ray_address, host=host, port=port, log=click.echo)


def run_cli(group: click.Group, argv=None) -> None:
    """Run a click group: user errors print one line and exit 2, no traceback (``dspark`` and ``dspark-export``)."""
    try:
        group.main(args=argv, standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except DSparkError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


def main(argv=None):
    """Console entry point of ``dspark`` (restarted with huge-page malloc where that helps, unless given ``argv``)."""
    if argv is None:  # the console script: restarted once, before anything is loaded
        exec_with_huge_page_malloc()
    run_cli(cli, argv)


if __name__ == "__main__":
    main()
