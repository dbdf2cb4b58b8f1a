"""Where things live: fetched and converted models (``$DSPARK_CACHE`` or ``~/.cache/dspark``), the prompt sets and
build recipes shipped inside the package (``dspark_export/data/prompts/``, ``dspark_export/recipes/``: package
data, so an installed wheel has them too), and the source checkout when running from one."""
from __future__ import annotations

from pathlib import Path

from dspark_runtime.errors import DSparkError
from dspark_runtime.engine_dir.integrity import cache_root  # noqa: F401  (the one cache root; re-exported here)

PACKAGE_DIR = Path(__file__).resolve().parent


def models_dir() -> Path:
    """Folder holding converted Hugging Face model folders, one per model name."""
    return cache_root() / "models"


def repo_root() -> Path:
    """The source checkout this package runs from (it holds ``engines/drafters/``, the trained drafters that are
    too big for the wheel); from an installed wheel, the current directory. Only for resolving relative paths
    of checkout files a user names (``dspark:engines/drafters/...``): prompts and recipes are package data
    (:func:`prompts_dir`, :func:`recipes_dir`)."""
    root = PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() and (root / "dspark_runtime").is_dir() else Path.cwd()


def prompts_dir() -> Path:
    """The prompt sets (one ``<dataset>.jsonl`` each; splits in its ``README.md``), shipped in the package."""
    return PACKAGE_DIR / "data" / "prompts"


def prompt_file(dataset: str) -> Path:
    """``<dataset>.jsonl`` of the packaged prompt sets; raises DSparkError naming the sets when there is none."""
    p = prompts_dir() / f"{dataset}.jsonl"
    if not p.is_file():
        have = ", ".join(sorted(q.stem for q in prompts_dir().glob("*.jsonl"))) or "none"
        raise DSparkError(f"no prompt set {dataset!r} in {prompts_dir()} (have: {have})")
    return p


def recipes_dir() -> Path:
    """The build recipes (``<name>.json``) shipped in the package."""
    return PACKAGE_DIR / "recipes"


def recipe_names() -> list:
    """Names of the packaged recipes (``dspark-export build NAME``), sorted."""
    return sorted(p.stem for p in recipes_dir().glob("*.json"))


def resolve_recipe(spec: str | Path) -> Path:
    """The recipe file ``dspark-export build SPEC`` reads.

    An existing file is itself (a user's own recipe). Otherwise a packaged recipe by name: ``NAME`` or
    ``NAME.json``, and ``engines/NAME.json`` (where the checkout kept recipes before they became package data,
    as older docs and reports write it). Raises DSparkError listing the packaged recipes when neither matches.
    """
    p = Path(spec).expanduser()
    if p.is_file():
        return p
    name = p.name[:-len(".json")] if p.name.endswith(".json") else p.name
    legacy = len(p.parts) == 2 and p.parts[0] == "engines" and p.suffix == ".json"
    if (len(p.parts) == 1 or legacy) and name and (recipes_dir() / f"{name}.json").is_file():
        return recipes_dir() / f"{name}.json"
    if p.is_dir():
        raise DSparkError(f"recipe {spec} is a directory (a built engine?); give a recipe file or one of the "
                          f"packaged recipes: {', '.join(recipe_names())}")
    raise DSparkError(f"recipe {spec} not found: give a recipe file (JSON: name, target, draft, precision, ...) or "
                      f"the name of a packaged recipe: {', '.join(recipe_names())} (in {recipes_dir()})")
