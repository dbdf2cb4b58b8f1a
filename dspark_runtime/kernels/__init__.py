"""DSpark's own ONNX Runtime kernels: a custom-op library, ``ai.dspark.MatMulGGUF`` (``gguf_matmul.cc``: a weight
MatMul over a GGUF's own Q4_K / Q6_K blocks, llama.cpp's numerics, row-invariant by construction).

An engine graph that uses them names the library in its :class:`~dspark_runtime.engine_dir.graphspec.GraphSpec`
(``kernels``: a file beside the graph, listed and checksummed with it); :func:`register_kernels` adds it to a
session's options before the graph loads. The library is compiled when the engine is built
(:mod:`dspark_export.kernels.build`), so the runtime needs no compiler.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

from dspark_runtime.errors import DSparkError

DOMAIN = "ai.dspark"
OP_MATMUL_GGUF = "MatMulGGUF"
LIBRARY_NAME = "libdspark_kernels.so"
SOURCE = Path(__file__).with_name("gguf_matmul.cc")
# GGML type ids of the block types MatMulGGUF reads (its segment_types attribute)
GGML_TYPES = {"Q4_K": 12, "Q6_K": 14}


def register_kernels(so, library: Path) -> None:
    """Add the custom-op library ``library`` to ``onnxruntime.SessionOptions`` ``so``. Raises DSparkError naming
    the fix when the file is missing or does not load (another platform, a damaged copy)."""
    library = Path(library)
    if not library.is_file():
        raise DSparkError(f"{library} is missing: the graph runs on DSpark's kernels, which the engine ships beside "
                          "it; copy the whole engine directory, or rebuild it (`dspark-export build`)")
    try:
        so.register_custom_ops_library(str(library))
    except Exception as e:  # onnxruntime raises its own Fail/RuntimeError types
        raise DSparkError(f"{library} does not load here ({e}); rebuild the engine on this platform "
                          "(`dspark-export build`), or build it with --int4-source gguf-compact") from e


@lru_cache(maxsize=None)
def kernel_path(library: str) -> str:
    """Which code path the library computes with on this CPU: ``"avx512-vnni"``, ``"avx2"`` (no AVX-512 VNNI here:
    three times the instructions per weight) or ``"portable"`` (no AVX2 either: several times slower)."""
    lib = ctypes.CDLL(str(library))
    lib.DSparkKernelPath.restype = ctypes.c_char_p
    return lib.DSparkKernelPath().decode()
