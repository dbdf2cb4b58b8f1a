"""Is a graph's output independent of how the KV cache was filled? (chunk invariance)

Teacher-forces one token sequence (a prompt, then the target's own greedy continuation) through the same graph as
``q1`` (one token per call, as target-only decoding fills the cache), ``qB`` (blocks of B tokens, as accepted verify
blocks do) and ``q1-after-qB`` (the last position again alone on the qB cache). Per way: the first generated
position whose logits differ from ``q1``, max |difference| of logits and of each layer's keys/values, and the
argmax flips with the target's top-1 minus top-2 gap there (a flip at a gap of 1e-3 is a near-tie). Writes --out.

    python -m benchmarks.chunk_invariance --engine engines/qwen2.5-coder-1.5b-int8 --humaneval 1 --mt-bench 1 \\
        --max-new-tokens 64 --block 4
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from dspark_runtime.machine.row_invariance import teacher_force  # also used by the tests from here


def compare(ref_logits, ref_kv, logits, kv, prompt_len: int, block: int = 1) -> dict:
    """First differing generated position, max |diff| of logits / KV, argmax flips with the gap, and in
    the first layer that differs how many positions differ by their row in the block (row = position % block): a row whose
    keys were all visible (the last) computed like a lone token, earlier rows next to masked keys."""
    d = np.abs(logits - ref_logits).max(axis=-1)
    diff_pos = np.nonzero(d > 0)[0]
    flips = np.nonzero(logits.argmax(-1) != ref_logits.argmax(-1))[0]
    top2 = np.sort(ref_logits, axis=-1)[:, -2:]
    # per layer, per generated position: max |difference| of its keys and values (computed once)
    per_pos = [np.maximum(np.abs(k1 - k0).max(axis=(0, 1, 3)), np.abs(v1 - v0).max(axis=(0, 1, 3)))[prompt_len:]
               for (k0, v0), (k1, v1) in zip(ref_kv, kv)]
    kv_diff = [float(p.max(initial=0)) for p in per_pos]
    first_kv = [int(np.flatnonzero(p > 0)[0]) if np.any(p > 0) else None for p in per_pos]
    first_layer = next((i for i, f in enumerate(first_kv) if f is not None), None)
    # layer 0's keys/values depend on the token alone: differences start at layer >= 1
    diff0 = per_pos[first_layer or 0] > 0
    rows = np.arange(len(diff0)) % block
    first_rows = {int(r): [int(diff0[rows == r].sum()), int((rows == r).sum())] for r in range(block)}
    return {"first_logit_diff_position": int(diff_pos[0]) if len(diff_pos) else None,
            "max_abs_logit_diff": float(d.max()), "positions_with_logit_diff": int(len(diff_pos)),
            "argmax_flips": [{"position": int(p), "top1_minus_top2": float(top2[p, 1] - top2[p, 0])} for p in flips],
            "max_abs_kv_diff_per_layer": kv_diff, "first_layer_with_kv_diff": first_layer,
            "its_first_kv_diff_position": first_kv[first_layer] if first_layer is not None else None,
            "first_layer_kv_diff_by_block_row": first_rows}


def main(argv=None) -> int:
    from benchmarks.evalsets import load_prompts

    from dspark_runtime import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--role", default="target", choices=["target", "draft"])
    for ds in ("humaneval", "mbpp", "gsm8k", "mt-bench"):
        ap.add_argument(f"--{ds}", type=int, default=0, help=f"first N held-out {ds} prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block", type=int, default=4, help="verify block size to compare (q = gamma + 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--row-multiple", type=int, default=1,
                    help="pad every target call to a multiple of N rows (dspark_runtime.machine.row_invariance); 1 = the raw graph")
    ap.add_argument("--allow-slow-precision", action="store_true")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    a = ap.parse_args(argv)
    counts = {"humaneval": a.humaneval, "mbpp": a.mbpp, "gsm8k": a.gsm8k, "mt-bench": a.mt_bench}
    prompts = [(f"{ds}[{i}]", text) for ds, n in counts.items() if n for i, text in enumerate(load_prompts(ds, n))]
    if not prompts:
        ap.error("give at least one of --humaneval/--mbpp/--gsm8k/--mt-bench N")
    eng = Engine.load(a.engine, threads=a.threads, allow_slow_precision=a.allow_slow_precision,
                      row_multiple=a.row_multiple)
    runner = eng.runner(a.role)
    report = {"engine": a.engine, "role": a.role, "block": a.block, "row_multiple": a.row_multiple,
              "max_new_tokens": a.max_new_tokens,
              "precision": getattr(eng.manifest.graphs[a.role], "precision", None), "prompts": []}
    for key, text in prompts:
        t0 = time.perf_counter()
        prompt = eng.encode_prompt(text)
        res = eng.generate(text, max_new_tokens=a.max_new_tokens, draft=None) if a.role == "target" else None
        cont = list(res.token_ids) if res is not None else []
        if len(cont) < 2:
            print(f"{key}: fewer than 2 new tokens; skipped")
            continue
        ref_logits, ref_kv = teacher_force(runner, prompt, cont, 1)
        # the continuation must be the greedy path of the q1 logits (else generate() filled the cache differently)
        consistent = bool(np.all(ref_logits[:-1].argmax(-1) == np.asarray(cont[1:])))
        logits, kv = teacher_force(runner, prompt, cont, a.block)
        row = {"prompt": key, "prompt_tokens": len(prompt), "new_tokens": len(cont),
               "q1_reproduces_generate": consistent,
               f"q{a.block}": compare(ref_logits, ref_kv, logits, kv, len(prompt), a.block)}
        # same cache as qB, last position recomputed alone
        runner.rollback(runner.length - 1)
        last = np.array(runner.step(cont[-1:]))[-1]
        row[f"q1_after_q{a.block}_last_row_max_abs_diff"] = float(np.abs(last - logits[-1]).max())
        row["seconds"] = round(time.perf_counter() - t0, 1)
        report["prompts"].append(row)
        c = row[f"q{a.block}"]
        print(f"{key}: {len(cont)} tokens; q{a.block} vs q1: first logit diff at {c['first_logit_diff_position']}, "
              f"max |dlogit| {c['max_abs_logit_diff']:.3g}, max |dKV| {max(c['max_abs_kv_diff_per_layer']):.3g} "
              f"(first in layer {c['first_layer_with_kv_diff']} at position {c['its_first_kv_diff_position']}; there, "
              f"positions differing by block row [differing, total]: {c['first_layer_kv_diff_by_block_row']}), "
              f"argmax flips {[(f['position'], round(f['top1_minus_top2'], 4)) for f in c['argmax_flips']]}; "
              f"same cache, last row alone vs in the block: {row[f'q1_after_q{a.block}_last_row_max_abs_diff']:.3g}; "
              f"q1 reproduces generate(): {consistent}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
