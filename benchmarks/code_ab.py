"""Two checkouts of the runtime on one engine, side by side in one run: tokens/s and the token ids of every mode.

Each (checkout, mode) runs in its own process through the public API only (``Engine.load``, ``generate``), so an
older checkout works unchanged; the checkouts alternate per mode and per repeat. Greedy decoding: the token ids must
be identical across checkouts (and every speculative mode's must equal target-only's). Writes
results/code-ab-<engine>.json.

    python -m benchmarks.code_ab --engine engines/qwen2.5-coder-1.5b --before ../before --prompts 2 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.evalsets import RESULTS, ROOT, load_prompts, machine

DATASETS = ("humaneval", "mt-bench", "gsm8k", "mbpp")
# runs inside the checkout under test: public API only
WORKER = """
import json, sys, time
from dspark_runtime import Engine
spec = json.load(open(sys.argv[1]))
eng = Engine.load(spec["engine"])
draft = None if spec["mode"] == "none" else spec["mode"]
eng.generate(spec["prompts"][0], max_new_tokens=4, draft=draft)  # warm-up: sessions activated
out = []
for p in spec["prompts"]:
    t = time.perf_counter()
    r = eng.generate(p, max_new_tokens=spec["max_new_tokens"], draft=draft)
    out.append({"ids": list(map(int, r.token_ids)), "seconds": time.perf_counter() - t})
json.dump(out, open(sys.argv[2], "w"))
"""


def run_one(checkout: Path, spec: dict, tmp: Path) -> list:
    """One worker process in ``checkout`` (its packages first on the path): per prompt, the ids and seconds."""
    src, dst = tmp / "spec.json", tmp / "out.json"
    src.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(checkout))
    subprocess.run([sys.executable, "-c", WORKER, str(src), str(dst)], env=env, check=True, cwd=str(checkout))
    return json.loads(dst.read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--before", required=True, help="the other checkout (e.g. a git worktree of an older commit)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per dataset (evaluation split)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--modes", default="none,lm,router", help="draft modes: none (target-only), lm, router, ...")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    engine = str(Path(a.engine).resolve())
    prompts = [p for ds in DATASETS for p in load_prompts(ds, a.prompts)]
    checkouts = {"before": Path(a.before).resolve(), "after": ROOT}
    runs = {name: {m: [] for m in a.modes.split(",")} for name in checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            for mode in a.modes.split(","):
                order = list(checkouts) if rep % 2 == 0 else list(reversed(checkouts))
                for name in order:
                    spec = {"engine": engine, "mode": mode, "prompts": prompts, "max_new_tokens": a.max_new_tokens}
                    runs[name][mode].append(run_one(checkouts[name], spec, Path(tmp)))
                    secs = sum(r["seconds"] for r in runs[name][mode][-1])
                    print(f"repeat {rep} {mode:8s} {name:6s} {secs:7.2f} s", flush=True)
    rows, all_same = [], True
    target_only = runs["after"].get("none", [None])[0]
    for mode in a.modes.split(","):
        ids = {name: [r["ids"] for r in runs[name][mode][0]] for name in checkouts}
        same = ids["before"] == ids["after"]
        exact = target_only is None or ids["after"] == [r["ids"] for r in target_only]
        all_same &= same and exact
        tok = {name: sum(len(r["ids"]) for rep in runs[name][mode] for r in rep) /
               sum(r["seconds"] for rep in runs[name][mode] for r in rep) for name in checkouts}
        rows.append({"mode": mode, "ids_identical_before_after": same, "ids_equal_target_only": exact,
                     "tokens_per_second": tok, "after_over_before": tok["after"] / tok["before"]})
        print(f"{mode:8s} before {tok['before']:6.2f} tok/s  after {tok['after']:6.2f} tok/s  "
              f"ratio {tok['after'] / tok['before']:.3f}  ids identical: {same}  == target-only: {exact}")
    out = Path(a.out or RESULTS / f"code-ab-{Path(a.engine).name}.json")
    out.write_text(json.dumps({"tool": "benchmarks/code_ab.py", "machine": machine(), "engine": Path(a.engine).name,
                               "prompts_per_dataset": a.prompts, "datasets": DATASETS,
                               "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
