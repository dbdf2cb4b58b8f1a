"""The checks on an NVIDIA GPU: ``check_cuda`` (ONNX Runtime's CUDA provider, on inputs ``prepare_cuda`` makes on any
machine) and ``check_trt`` (the TensorRT path). ``scripts/gpu_check.sh`` prepares and runs them; a device call
carries 64 MiB of the working tree, so park the shipped drafter checkpoint first (``--park``, printed by the
prepare steps)."""
