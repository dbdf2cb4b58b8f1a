"""Exactness through the CLI, as a user runs it: ``dspark generate --json`` with and without speculation on the
first N HumanEval prompts (greedy), token ids compared. Where they differ it prints the first differing position
and the target's logit gap (top-1 minus top-2) there, so a near-tie of batched arithmetic can be told from a bug.

    python -m benchmarks.check_exact --engine engines/qwen2.5-coder-1.5b --n 10 --max-new-tokens 128
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.evalsets import PROMPTS, child_env


def run(engine, prompt, max_new, extra):
    cmd = [sys.executable, "-m", "dspark_runtime.cli", "generate", "--engine", engine, "--prompt", prompt,
           "--max-new-tokens", str(max_new), "--json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if r.returncode != 0:
        sys.exit(f"dspark generate failed: {r.stderr}")
    return json.loads(r.stdout)


def logit_gap(engine_dir, prompt, prefix):
    import numpy as np

    from dspark_runtime import Engine

    eng = Engine.load(engine_dir)
    runner = eng.runner("target")
    runner.reset()
    logits = runner.prefill(eng.encode_prompt(prompt) + list(prefix))
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft", default="auto")
    a = ap.parse_args(argv)
    lines = (PROMPTS / "humaneval.jsonl").read_text().splitlines()[: a.n]
    same = 0
    for i, line in enumerate(lines):
        prompt = json.loads(line)["turns"][0]
        spec = run(a.engine, prompt, a.max_new_tokens, ["--draft", a.draft])
        base = run(a.engine, prompt, a.max_new_tokens, ["--no-speculation"])
        s, b = spec["token_ids"], base["token_ids"]
        ok = s == b
        same += ok
        msg = "identical" if ok else ""
        if not ok:
            k = next((j for j, (x, y) in enumerate(zip(s, b)) if x != y), min(len(s), len(b)))
            msg = f"DIFFER at token {k}: target logit gap there {logit_gap(a.engine, prompt, b[:k]):.4f}"
        st, bt = spec["stats"], base["stats"]
        print(f"humaneval[{i}] {len(s):4d} tokens  tau {st['accepted_length_mean']:.2f}  acceptance "
              f"{st['acceptance_rate']:.0%}  spec {st['tokens_per_second']:.2f} tok/s  target-only "
              f"{bt['tokens_per_second']:.2f} tok/s  {msg}", flush=True)
    print(f"{same}/{len(lines)} identical")
    return 0 if same == len(lines) else 1


if __name__ == "__main__":
    sys.exit(main())
