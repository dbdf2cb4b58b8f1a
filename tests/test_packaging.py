"""Issue 18: the package works outside the source checkout. The prompt sets and the build recipes are package
data, the wheel carries the Apache-2.0 LICENSE, and a wheel built from this tree, installed (without
dependencies) into a fresh venv that sees this suite's installed dependencies, builds a tiny engine from a
packaged recipe and generates with it from a directory outside the checkout."""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from dspark_runtime.errors import DSparkError

ROOT = Path(__file__).resolve().parent.parent
DATASETS = ("aime25", "gsm8k", "humaneval", "math500", "mbpp", "mt-bench")
RECIPES = ("qwen2.5-coder-1.5b", "smollm2-135m")


def test_prompts_and_recipes_are_package_data():
    from dspark_export.paths import PACKAGE_DIR, prompt_file, prompts_dir, recipe_names, recipes_dir

    assert prompts_dir().parent.parent == PACKAGE_DIR and recipes_dir().parent == PACKAGE_DIR
    for ds in DATASETS:
        assert prompt_file(ds).is_file()
    assert (prompts_dir() / "README.md").is_file()
    assert set(RECIPES) <= set(recipe_names())
    # one copy in git: the old places are gone
    assert not (ROOT / "data" / "prompts").exists() and not list((ROOT / "engines").glob("*.json"))
    with pytest.raises(DSparkError, match="no prompt set 'nope'.*humaneval"):
        prompt_file("nope")


def test_recipe_resolution(tmp_path, monkeypatch):
    """A packaged recipe by name (with or without .json, or at its old place engines/NAME.json); a user's file
    stays a path; anything else names the packaged recipes."""
    from dspark_export.paths import recipes_dir, resolve_recipe

    monkeypatch.chdir(tmp_path)
    want = recipes_dir() / "qwen2.5-coder-1.5b.json"
    for spec in ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b.json", "engines/qwen2.5-coder-1.5b.json"):
        assert resolve_recipe(spec) == want, spec
    own = tmp_path / "engines" / "qwen2.5-coder-1.5b.json"  # a file the user has wins over the packaged one
    own.parent.mkdir()
    own.write_text("{}")
    assert resolve_recipe("engines/qwen2.5-coder-1.5b.json") == Path("engines/qwen2.5-coder-1.5b.json")
    assert resolve_recipe(str(own)) == own
    for bad in ("nope", "elsewhere/qwen2.5-coder-1.5b.json", "engines/nope.json"):
        with pytest.raises(DSparkError, match="not found.*qwen2.5-coder-1.5b, smollm2-135m"):
            resolve_recipe(bad)


def test_pyproject_ships_data_and_license():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license-files\s*=\s*\["LICENSE"\]', text, re.M)
    lic = (ROOT / "LICENSE").read_text()
    assert "Apache License" in lic and "Version 2.0, January 2004" in lic and "END OF TERMS AND CONDITIONS" in lic


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def _run(args, cwd, env, timeout=300):
    r = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{args}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r


def test_wheel_outside_the_checkout(tiny_pair, tmp_path):
    """Build the wheel from a copy of this tree (offline, no build isolation), install it with --no-deps into a
    fresh venv whose only view of the suite's venv is its site-packages directory (a .pth line: the suite's
    editable install of this checkout is not processed there), then, from a directory outside the checkout:
    the packaged prompts and recipes are found inside the install, `dspark-export build <packaged recipe>` with
    the tiny models builds an engine and `dspark generate` runs it."""
    try:
        import setuptools
    except ImportError:
        pytest.skip("setuptools is not installed in the test venv (the test extra has it): pip install 'setuptools>=77'")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (license-files): pip install 'setuptools>=77'")

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in ("dspark_runtime", "dspark_export"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", wheels, src], tmp_path, _clean_env())
    (whl,) = wheels.glob("dspark-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for ds in DATASETS:
        assert f"dspark_export/data/prompts/{ds}.jsonl" in names
    assert "dspark_export/data/prompts/README.md" in names
    assert "dspark_export/data/code-tasks.jsonl" in names  # the drafter's code tasks (drafter/code_tasks.py)
    assert "dspark_runtime/machine/u8s8_probe.onnx" in names  # the kernel probe's graph, read without onnx
    for r in RECIPES:
        assert f"dspark_export/recipes/{r}.json" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    assert not any(n.startswith(("tests/", "scripts/", "engines/", "benchmarks/", "results/")) for n in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, _clean_env())
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", whl], tmp_path,
         _clean_env())
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path,
                     _clean_env()).stdout.strip())
    # after the install (pip would otherwise see the suite's editable dspark): the suite's dependencies
    (site / "zz_suite_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "work"  # outside the checkout; the cwd of every command below
    work.mkdir()
    env = _clean_env(DSPARK_CACHE=str(tmp_path / "cache"))
    probe = _run([py, "-c", """
import json
import dspark_export, dspark_runtime
from dspark_export.paths import prompts_dir, recipes_dir, resolve_recipe
from dspark_export.fit.compare import eval_prompts
from dspark_export.drafter.data import calibration_prompts
from dspark_export.drafter.data import TRAIN_SPLIT, split_prompts
print(json.dumps({"export": dspark_export.__file__, "runtime": dspark_runtime.__file__,
                  "prompts": str(prompts_dir()), "recipe": str(resolve_recipe("qwen2.5-coder-1.5b")),
                  "eval": [x[:2] for x in eval_prompts({"humaneval": 1, "mbpp": 1})],
                  "calib": len(calibration_prompts(4)), "train": len(split_prompts(TRAIN_SPLIT)["mbpp"])}))
"""], work, env)
    info = json.loads(probe.stdout)
    for key in ("export", "runtime", "prompts", "recipe"):
        assert Path(info[key]).resolve().is_relative_to(site.resolve()), (key, info[key])
        assert not Path(info[key]).resolve().is_relative_to(ROOT), (key, info[key])
    assert info["eval"] == [["humaneval", 1], ["mbpp", 201]] and info["calib"] == 4 and info["train"] == 180

    tdir, ddir = tiny_pair
    r = _run([venv / "bin" / "dspark-export", "build", "smollm2-135m", "--target", tdir, "--draft", ddir,
              "--name", "tiny", "--in-process"], work, env)
    assert str(site / "dspark_export" / "recipes" / "smollm2-135m.json") in r.stdout
    m = json.loads((work / "engines" / "tiny" / "manifest.json").read_text())
    assert m["name"] == "tiny" and m["speculation"]["draft_length"] == 4  # the packaged recipe's draft length
    r = _run([venv / "bin" / "dspark", "generate", "--engine", "engines/tiny", "--prompt", "def add(a, b):",
              "--max-new-tokens", "8", "--json"], work, env)
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) > 0 and out["stats"]["new_tokens"] == len(out["token_ids"])
