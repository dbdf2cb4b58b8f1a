#!/usr/bin/env bash
# Make this checkout's venv (README command 2's .venv) run graphs on an NVIDIA GPU through ONNX Runtime's CUDA
# provider (`--placement target=cuda`): onnxruntime-gpu 1.31.1 (a CUDA 13 / cuDNN 9 build, the newest GPU release)
# in place of the CPU package — both provide the module `onnxruntime`, so the CPU one is removed first and the GPU
# one reinstalled over whatever files the removal took — plus the CUDA 13 libraries as NVIDIA pip packages and
# cuda-python (device buffers, streams). Ends by listing the providers; exits non-zero when CUDA is not among them.
#
#   bash scripts/install_cuda.sh            # PY=path/to/python to use another environment
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m pip install -q -e . "cuda-python>=13.0,<14" "nvidia-cublas~=13.0" "nvidia-cuda-runtime~=13.0" \
    "nvidia-curand~=10.0" "nvidia-cufft~=12.0" "nvidia-cuda-nvrtc~=13.0" "nvidia-cudnn-cu13~=9.0"
"$PY" -m pip uninstall -q -y onnxruntime onnxruntime-gpu
"$PY" -m pip install -q --no-deps --force-reinstall "onnxruntime-gpu==1.31.1"
"$PY" - <<'PYEOF'
import sys
import onnxruntime as ort
ort.preload_dlls(cuda=True, cudnn=True, msvc=False)
p = ort.get_available_providers()
print(f"onnxruntime {ort.__version__}: {', '.join(p)}")
sys.exit(0 if "CUDAExecutionProvider" in p else "the CUDA provider is missing: see the lines above")
PYEOF
