"""Building DSpark's ONNX Runtime kernels library (:mod:`dspark_runtime.kernels`) for the engines that use it."""
