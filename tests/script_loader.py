"""Import a file of scripts/ as a module (the scripts are not a package)."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str, module_name: str):
    """scripts/<name>.py imported as ``module_name`` (registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(module_name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = mod
    spec.loader.exec_module(mod)
    return mod
