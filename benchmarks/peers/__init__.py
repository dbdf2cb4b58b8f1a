"""The peers DSpark is compared with (llama.cpp, ONNX Runtime GenAI): their installer (``install.sh``), the worker
``benchmarks.compare`` runs under each peer's own venv, llama.cpp helpers, and the GPU peers of the CUDA check.
Modules here import the standard library (and the peer's package) only: they run outside the project's venv."""
