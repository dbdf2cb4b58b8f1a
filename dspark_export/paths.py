"""Where fetched and converted models live: ``$DSPARK_CACHE`` or ``~/.cache/dspark``."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Root of the DSpark cache (``$DSPARK_CACHE`` overrides ``~/.cache/dspark``)."""
    env = os.environ.get("DSPARK_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark"


def models_dir() -> Path:
    """Folder holding converted Hugging Face model folders, one per model name."""
    return cache_root() / "models"


def repo_root() -> Path:
    """The source checkout (holds ``data/prompts/`` and ``engines/`` recipes)."""
    return Path(__file__).resolve().parent.parent
