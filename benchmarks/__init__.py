"""The measuring programs: each one ``python -m benchmarks.<name> --help`` from the repository root.

Results go to ``results/`` (indexed in ``results/README.md``); what they showed is in ``docs/results.md``.
Subjects with several files are subpackages: ``compare`` (DSpark against transformers and the peers),
``soak`` (``dspark serve`` under load and faults), ``peers`` (llama.cpp and ONNX Runtime GenAI workers and their
installer) and ``gpu`` (the checks on an NVIDIA GPU, run by ``scripts/gpu_check.sh``). Nothing here is shipped in
the wheel.
"""
