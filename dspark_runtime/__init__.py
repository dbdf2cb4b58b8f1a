"""DSpark runtime: load an engine directory through its manifest and generate with speculative
decoding. Imports no torch; heavy backends are imported lazily."""
from dspark_runtime.errors import DSparkError, InputError, ManifestError

__version__ = "0.1.0"

__all__ = ["DSparkError", "InputError", "ManifestError", "Engine", "__version__"]


def __getattr__(name):  # lazy: importing the package must stay cheap
    if name == "Engine":
        from dspark_runtime.engine import Engine

        return Engine
    raise AttributeError(name)
