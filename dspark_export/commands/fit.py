"""``dspark-export calibrate``, ``profile`` and ``compare``: what is fitted to or measured on a built engine
(the drafter's STS temperatures and router priors, the round cost table and row padding, two engines' agreement).
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from dspark_runtime.backends.ort import shared_pool_default
from dspark_runtime.cli import engine_path_callback

from dspark_export.fit.calibrate_drafter import calibrate_engine
from dspark_export.fit.compare import compare_engines, format_report
from dspark_export.fit.cost_profile import profile_engine


@click.command()
@click.argument("engine_dir", type=click.Path(path_type=Path), callback=engine_path_callback())
@click.option("--prompts", "n_prompts", type=int, default=12, show_default=True,
              help="Calibration-split prompts to decode (never evaluation prompts).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--save-to-checkpoint", is_flag=True,
              help="Also write the fit as sts.json in the drafter's checkpoint folder, so engines compiled from it "
                   "later (add-draft) carry it. Without it that folder is left as it is.")
def calibrate(engine_dir, n_prompts, max_new_tokens, save_to_checkpoint):
    """Fit the DSpark confidence head's per-position STS temperatures on the calibration split and write
    them to ENGINE_DIR's manifest; prints the survival ECE per position before and after. The same greedy
    outputs give the router's priors (speculation.router): n-gram lookup's acceptance per match extent and
    position, and the DSpark drafter's per-position acceptance."""
    res = calibrate_engine(engine_dir, n_prompts, max_new_tokens, log=click.echo, save_to_checkpoint=save_to_checkpoint)
    click.echo(f"{res['rounds']} rounds; temperatures {[round(t, 3) for t in res['temperatures']]}")
    click.echo(f"{'pos':>3} {'ECE before':>10} {'ECE after':>9} {'mean pred':>9} {'mean true':>9} {'n':>5}")
    for r in res["report"]:
        click.echo(f"{r['position']:>3} {r['ece_before']:>10.4f} {r['ece_after']:>9.4f} {r['mean_pred']:>9.3f} "
                   f"{r['mean_true']:>9.3f} {r['n']:>5}")


@click.command()
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
            head = ", the LM head on the real rows only" if probe.get("head_skips_padding") else ""
            click.echo(f"row invariance: target calls padded to a multiple of {probe['row_multiple']} row(s){head} "
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


@click.command()
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
    rep = compare_engines(reference, candidate, counts={"humaneval": humaneval, "mbpp": mbpp, "gsm8k": gsm8k,
                                                        "mt-bench": mt_bench},
                          max_new_tokens=max_new_tokens, draft=None if draft == "none" else draft,
                          draft_length=draft_length, threads=threads, interleave=interleave, log=click.echo)
    click.echo(format_report(rep))
    if json_path:
        Path(json_path).write_text(json.dumps(rep, indent=1) + "\n")
        click.echo(f"wrote {json_path}")
