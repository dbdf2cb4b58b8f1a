"""Code-writing prompts for the drafter's answer data, made from the Python standard library's documented functions.

The packaged training split holds only 180 code prompts (MBPP), too few for the answers to cover the code domain the
drafter is evaluated on. Each public function or method of the standard library with a docstring becomes one task:
its signature and the docstring's first paragraph, asking for an implementation. Only the prompt comes from the
library; the answer is the target's own (:mod:`dspark_export.drafter.data`). Keys are ``code-task:<module>.<name>``.

The list is packaged (``dspark_export/data/code-tasks.jsonl``, scanned from one Python version's standard
library), not scanned at run time: every Python version then offers the same prompts, and an answers file made on one
resolves its keys on another (each minor version adds and removes functions and rewrites docstrings).
"""
from __future__ import annotations

import ast
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

from dspark_runtime.errors import DSparkError

from dspark_export.paths import PACKAGE_DIR

#: the packaged task list: one JSON object a line, {"key", "signature", "summary"} (:func:`scan_stdlib`)
CODE_TASKS_FILE = PACKAGE_DIR / "data" / "code-tasks.jsonl"

# Folders of the standard library that are tests, demos, tooling or vendored code, not library functions.
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages", "venv", "pydoc_data",
              "tkinter", "__pycache__", "__phello__"}
_TEMPLATES = (
    "Write a Python function `{sig}` that does the following:\n\n{doc}",
    "Implement `{sig}` in Python.\n\n{doc}",
    "{doc}\n\nWrite this as a Python function with the signature `def {sig}:` and explain briefly how it works.",
)


def _summary(doc: str) -> str:
    """The docstring's first paragraph on one line."""
    return re.sub(r"\s+", " ", doc.strip().split("\n\n")[0]).strip()


def _modules(root: Path) -> list:
    files = sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))
    dirs = lambda p: p.relative_to(root).parts[:-1]  # noqa: E731
    return [p for p in files if not (set(dirs(p)) & _SKIP_DIRS) and not any(d.startswith("config-") for d in dirs(p))
            and not p.name.startswith(("_", "test"))]


def scan_stdlib(root: Path | None = None) -> list:
    """The code tasks of the standard library at ``root`` (default: the running Python's), in scan order:
    [{"key", "signature", "summary"}] for every public function or public-class method (a first ``self``/``cls``
    dropped) with a docstring whose first paragraph is 40-400 ASCII characters. What the packaged list
    (:data:`CODE_TASKS_FILE`) holds, written by ``python -m dspark_export.drafter.code_tasks``."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    tasks, seen = [], set()
    for path in _modules(root):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        found = [(None, n) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for c in tree.body:
            if isinstance(c, ast.ClassDef) and not c.name.startswith("_"):
                found += [(c.name, n) for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for cls, fn in found:
            doc = ast.get_docstring(fn)
            if fn.name.startswith("_") or not doc:
                continue
            text = _summary(doc)
            if not (40 <= len(text) <= 400 and text.isascii()):
                continue
            args = fn.args
            head = "posonlyargs" if args.posonlyargs else "args"
            params = getattr(args, head)
            if params and params[0].arg in ("self", "cls"):  # defaults belong to the tail: unchanged
                args = ast.arguments(**{**{f: getattr(args, f) for f in args._fields}, head: params[1:]})
            key = f"code-task:{module}.{fn.name if cls is None else f'{cls}.{fn.name}'}"
            if key in seen:
                continue  # a redefinition (property setter, platform branch): the first one only
            seen.add(key)
            tasks.append({"key": key, "signature": f"{fn.name}({ast.unparse(args)})", "summary": text})
    return tasks


def write_code_tasks(path: Path = CODE_TASKS_FILE, root: Path | None = None) -> int:
    """Write :func:`scan_stdlib` of ``root`` to ``path`` (JSONL, one task a line); returns the number of tasks."""
    tasks = scan_stdlib(root)
    Path(path).write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return len(tasks)


def stdlib_code_tasks(limit: int, seed: int = 0) -> list:
    """[(key, prompt)] of up to ``limit`` code tasks from the packaged list (:data:`CODE_TASKS_FILE`: the same
    tasks on every Python version), shuffled with ``seed``; a task's prompt asks for the function from its
    signature and docstring summary, in one of three phrasings chosen by its position. Raises DSparkError when the
    packaged list is missing or malformed."""
    try:
        tasks = [json.loads(line) for line in CODE_TASKS_FILE.read_text().splitlines() if line.strip()]
        tasks = [(t["key"], t["signature"], t["summary"]) for t in tasks]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DSparkError(f"{CODE_TASKS_FILE}: the packaged code-task list is missing or malformed ({e}); reinstall "
                          "dspark, or rewrite it with `python -m dspark_export.drafter.code_tasks`") from None
    random.Random(seed).shuffle(tasks)
    return [(key, _TEMPLATES[i % len(_TEMPLATES)].format(sig=sig, doc=doc))
            for i, (key, sig, doc) in enumerate(tasks[:limit])]


if __name__ == "__main__":
    print(f"{write_code_tasks()} code tasks from Python {sys.version.split()[0]}'s standard library -> {CODE_TASKS_FILE}")
