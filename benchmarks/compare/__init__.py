"""Head-to-head on one target: transformers (plain, assisted, prompt lookup), the DSpark runtime (target-only, draft
LM, n-gram, DSpark drafter, router) and the peers (llama.cpp, ONNX Runtime GenAI); same held-out prompts, same
max_new_tokens, greedy and/or sampled (``--temperature 0,1.0``), one worker process at a time, interleaved.

    python -m benchmarks.compare --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --engine engines/qwen2.5-coder-1.5b --datasets humaneval,mbpp,gsm8k,mt-bench --n 3 --max-new-tokens 128
    # + the peers (after `bash benchmarks/peers/install.sh all`): --systems ...,llama-cpp,ort-genai,ort-genai-ngram

Writes --out-dir (default results/compare/): compare.json, REPORT.md and PNG plots; ``--resume`` continues a run.
Modules: systems, run (driver), workers, resume, report, plots.
"""
