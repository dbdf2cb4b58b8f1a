"""Why a test that needs an NVIDIA GPU cannot run here (None when it can): shared by the TensorRT runtime tests."""


def gpu_skip_reason(what: str) -> str | None:
    """None when cuda-python sees a CUDA GPU; else the reason, naming ``what`` needs it (e.g. "batched TensorRT
    decoding")."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return "cuda-python is not installed (pip install -e '.[trt]')"
    err, n = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or not n:
        return f"no CUDA GPU here ({err.name}); {what} needs an NVIDIA GPU"
    return None
