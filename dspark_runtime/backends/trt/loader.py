"""The TensorRT import shim: one place that picks enterprise ``tensorrt`` or TensorRT for RTX
(``tensorrt_rtx_bindings``, PyPI wheels ``tensorrt-rtx-cu13-libs`` + ``tensorrt-rtx-cu13-bindings``).
Both expose the same builder/parser/runtime API for what DSpark uses; the differences that matter
(RTX: ahead-of-time builds without a GPU, target compute capabilities on the builder config, precision
only from the graph; enterprise: builds need the GPU they target, needed for Hopper and datacenter
Blackwell) are handled by the callers, keyed on the flavour name returned here.
"""
from __future__ import annotations

import importlib
import os

from dspark_runtime.errors import DSparkError

FLAVOUR_RTX, FLAVOUR_ENTERPRISE = "tensorrt-rtx", "tensorrt"
_MODULES = {FLAVOUR_RTX: "tensorrt_rtx_bindings", FLAVOUR_ENTERPRISE: "tensorrt"}
FLAVOURS = ("auto", "rtx", "enterprise")
ENV_FLAVOUR = "DSPARK_TRT_FLAVOUR"
INSTALL_HINT = ("install TensorRT for RTX with `pip install -e '.[trt]'` (tensorrt-rtx-cu13-libs and "
                "tensorrt-rtx-cu13-bindings 1.7.1.116) or enterprise TensorRT with `pip install tensorrt`")


def _canonical(flavour: str) -> list[str]:
    if flavour in ("rtx", FLAVOUR_RTX):
        return [FLAVOUR_RTX]
    if flavour in ("enterprise", FLAVOUR_ENTERPRISE):
        return [FLAVOUR_ENTERPRISE]
    if flavour == "auto":
        return [FLAVOUR_RTX, FLAVOUR_ENTERPRISE]  # RTX first: it builds without a GPU
    raise DSparkError(f"unknown TensorRT flavour {flavour!r}; choose one of {', '.join(FLAVOURS)}")


def import_tensorrt(flavour: str | None = None):
    """Import TensorRT. Returns ``(module, flavour_name, version)``.

    flavour: "rtx" (``tensorrt_rtx_bindings``), "enterprise" (``tensorrt``), "auto" (RTX if installed,
    else enterprise), or the flavour names recorded in manifests ("tensorrt-rtx", "tensorrt"). None:
    ``$DSPARK_TRT_FLAVOUR`` or "auto". Raises DSparkError naming what to install when none imports.
    """
    flavour = flavour or os.environ.get(ENV_FLAVOUR) or "auto"
    errors = []
    for name in _canonical(flavour):
        try:
            mod = importlib.import_module(_MODULES[name])
        except ImportError as e:  # a missing wheel, or one whose native libraries do not load
            errors.append(f"{_MODULES[name]}: {e}")
            continue
        return mod, name, str(getattr(mod, "__version__", "unknown"))
    raise DSparkError(f"TensorRT ({flavour}) is not importable ({'; '.join(errors)}); {INSTALL_HINT}")


def tensorrt_available(flavour: str = "auto") -> bool:
    """True when :func:`import_tensorrt` would succeed for ``flavour``."""
    try:
        import_tensorrt(flavour)
        return True
    except DSparkError:
        return False
