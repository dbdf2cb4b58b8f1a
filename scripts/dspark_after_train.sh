#!/usr/bin/env bash
# After `dspark-export train-draft`: compile the DSpark drafter into the Qwen engine (beside the 0.5B
# draft LM), calibrate its confidence head on the calibration split, profile the round cost table,
# then benchmark DSpark against the 0.5B draft on held-out prompts in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
E=${ENGINE:-engines/qwen2.5-coder-1.5b}
CK=${CHECKPOINT:-engines/drafters/qwen2.5-coder-1.5b-dspark}
.venv/bin/dspark-export add-draft "$E" "$CK" --target qwen2.5-coder-1.5b-instruct
.venv/bin/dspark-export calibrate "$E" --prompts "${CALIB_PROMPTS:-8}" --max-new-tokens 96
.venv/bin/dspark-export profile "$E"
.venv/bin/python -m benchmarks.bench --engine "$E" --humaneval "${N_HE:-8}" --mbpp "${N_MBPP:-8}" \
  --mt-bench "${N_MT:-4}" --draft "${DRAFTERS:-dspark:7,lm:7,dspark:scheduled}" --max-new-tokens 128 \
  --out results/bench-dspark-qwen2.5-coder-1.5b.json
