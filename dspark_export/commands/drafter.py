"""``dspark-export train-draft``: train a DSpark drafter for a target, in resumable stages."""
from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource

from dspark_runtime.cli import engine_path_callback

from dspark_export.drafter.pipeline import PipelineSettings, train_draft_pipeline
from dspark_export.drafter.train import TrainSettings, bf16_native
from dspark_export.models.catalog import resolve_model
from dspark_export.paths import cache_root


@click.command("train-draft")
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
              help="Answers of an earlier run (its answers.jsonl, or .jsonl.gz) to start from (with --answer-prompts N, "
                   "its first N records); only the prompts they lack are answered.")
@click.option("--answer-prompts", type=int, default=None,
              help="Training prompts the target answers (default: the whole training split + the ShareGPT prompts + "
                   "the code tasks).")
@click.option("--sharegpt-prompts", type=int, default=500, show_default=True,
              help="ShareGPT first turns among the prompts the target answers.")
@click.option("--code-task-prompts", type=click.IntRange(min=0), default=2000, show_default=True,
              help="Code tasks made from the Python standard library's documented functions among the prompts the "
                   "target answers.")
@click.option("--stdlib-tokens", type=int, default=40000, show_default=True,
              help="Tokens of Python standard-library source to teacher-force.")
@click.option("--sharegpt-tokens", type=int, default=40000, show_default=True,
              help="Assistant tokens of ShareGPT chats to teacher-force.")
@click.option("--feature-tokens", type=click.IntRange(min=1), default=None,
              help="Cap the features stage at the sequences holding this many tokens (default: all). The one setting "
                   "--resume accepts, until training starts: it sizes a run in progress to the time left.")
@click.option("--features-on", type=click.Choice(["cpu", "openvino", "torch-bf16"]), default="cpu",
              show_default=True,
              help="Where the training features are computed: cpu (the --engine's target graph on ONNX Runtime's CPU "
                   "provider, the deployed arithmetic), openvino (that graph on its OpenVINO provider: bf16 on AMX; "
                   "Intel CPUs, pip install 'dspark[openvino]') or torch-bf16 (the target's Hugging Face weights in "
                   "torch bf16, on the CPU's bf16 units). Without --engine the features come from those weights in "
                   "torch fp32 unless torch-bf16 is given. docs/drafter.md compares their speed and distance from "
                   "the deployed graph.")
@click.option("--epochs", type=float, default=2.0, show_default=True,
              help="Passes over the training sequences.")
@click.option("--method", type=click.Choice(["dspark", "eagle3"]), default="dspark", show_default=True,
              help="The drafter family: dspark (DSpark, or DFlash with --markov-rank 0 --no-confidence-head) or "
                   "eagle3 (EAGLE-3: one layer over the fused target layers, training-time test over --ttt-length "
                   "steps; compiled with --draft eagle3).")
@click.option("--ttt-length", type=click.IntRange(min=1), default=7, show_default=True,
              help="EAGLE-3: draft steps trained and drafted per round.")
@click.option("--layers", type=int, default=1, show_default=True, help="Drafter layers.")
@click.option("--intermediate-size", type=int, default=3072, show_default=True, help="Drafter MLP width.")
@click.option("--moe-experts", type=int, default=0, show_default=True,
              help="Experts of an MoE FFN in each drafter layer (0: dense MLP).")
@click.option("--moe-top-k", type=int, default=2, show_default=True, help="Experts routed per token (MoE).")
@click.option("--moe-intermediate-size", type=int, default=None, help="Each expert's width (MoE).")
@click.option("--block-size", type=int, default=7, show_default=True, help="Block size gamma.")
@click.option("--markov-rank", type=int, default=64, show_default=True, help="Markov head rank (0 = DFlash).")
@click.option("--markov-head", type=click.Choice(["vanilla", "gated", "rnn"]), default="vanilla", show_default=True)
@click.option("--confidence-head/--no-confidence-head", default=True, show_default=True,
              help="Train the confidence head (scheduled verify lengths need it). --markov-rank 0 "
                   "--no-confidence-head trains DeepSpec's DFlash (fixed blocks or the router).")
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
@click.option("--init", "init_ckpt", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="Continue training this DSpark checkpoint (e.g. engines/drafters/<target>-dspark) instead of "
                   "starting from scratch: its architecture, draft vocabulary and mask token are kept, the features "
                   "are extracted over its vocabulary, and a fresh warmup + cosine schedule runs at --lr.")
@click.option("--reuse-data", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="Start this new run from another run's work directory: its answers, sequences and features "
                   "(linked, not copied) and their settings, so another configuration trains on the same data "
                   "without repeating those stages.")
@click.pass_context
def train_draft(ctx, target, out_dir, work_dir, resume_dir, time_limit, engine_dir, compile_into, seed_answers,
                answer_prompts, sharegpt_prompts, code_task_prompts, stdlib_tokens, sharegpt_tokens, feature_tokens,
                features_on, epochs, method, ttt_length, layers,
                intermediate_size, moe_experts,
                moe_top_k, moe_intermediate_size, block_size, markov_rank, markov_head, confidence_head, draft_vocab,
                mask_token_id, lr,
                ce_weight, l1_weight, anchors_per_seq, train_crop, seqs_per_step, bf16, init_ckpt, reuse_data):
    """Train a DSpark (or, with --method eagle3, an EAGLE-3) drafter for TARGET on this machine (target frozen;
    DeepSpec's losses), resumable in stages: answers -> sequences -> features -> training -> calibration.

    Data: the target's own greedy answers to the training split of the packaged prompt sets (never a calibration
    or evaluation prompt) and ShareGPT first turns, the Python standard library's source and ShareGPT chat turns,
    teacher-forced through the target. An interrupted run (a reboot, --time-limit) continues with
    `dspark-export train-draft --resume WORK`.
    """
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
            data_flags = ("seed_answers", "answer_prompts", "sharegpt_prompts", "code_task_prompts", "stdlib_tokens",
                          "sharegpt_tokens", "feature_tokens", "features_on", "draft_vocab")
            given = [f"--{n.replace('_', '-')}" for n in data_flags
                     if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
            if given:
                raise click.UsageError(f"--reuse-data takes the data (and its settings) of {reuse_data}; drop "
                                       f"{', '.join(given)}")
            if work_dir is None:
                raise click.UsageError("--reuse-data starts a new run: give it its own --work directory")
        if init_ckpt is not None:
            arch = ("layers", "intermediate_size", "moe_experts", "moe_top_k", "moe_intermediate_size", "block_size",
                    "markov_rank", "markov_head", "confidence_head", "draft_vocab", "mask_token_id", "method")
            given = [f"--{n.replace('_', '-')}" for n in arch
                     if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
            if given:
                raise click.UsageError(f"--init continues {init_ckpt} with its own architecture, draft vocabulary and "
                                       f"mask token; drop {', '.join(given)}")
        if features_on == "openvino" and engine_dir is None:
            raise click.UsageError(f"--features-on {features_on} runs the --engine's target graph there: give --engine "
                                   "ENGINE (without it the features come from the torch model)")
        if method == "eagle3" and (layers != 1 or moe_experts):
            raise click.UsageError("--method eagle3 trains one dense draft layer (DeepSpec's EAGLE-3 evaluator drafts "
                                   "with one); drop --layers / --moe-experts")
        tdir = resolve_model(target)
        work = work_dir or cache_root() / "drafter" / tdir.name
        p = PipelineSettings(answer_prompts=answer_prompts, sharegpt_prompts=sharegpt_prompts,
                             code_task_prompts=code_task_prompts,
                             num_layers=layers, intermediate_size=intermediate_size, block_size=block_size,
                             markov_rank=markov_rank, markov_head_type=markov_head, confidence_head=confidence_head,
                             draft_vocab_size=draft_vocab or 0, stdlib_tokens=stdlib_tokens,
                             sharegpt_tokens=sharegpt_tokens, feature_tokens=feature_tokens, features_on=features_on,
                             moe_experts=moe_experts, moe_top_k=moe_top_k,
                             moe_intermediate_size=moe_intermediate_size, mask_token_id=mask_token_id,
                             method=method, ttt_length=ttt_length,
                             init=None if init_ckpt is None else str(init_ckpt))
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
