"""Code-writing prompts for the drafter's answer data, made from the Python standard library's documented functions.

The packaged training split holds only 180 code prompts (MBPP), too few for the answers to cover the code domain the
drafter is evaluated on. Each public function or method of the standard library with a docstring becomes one task:
its signature and the docstring's first paragraph, asking for an implementation. Only the prompt comes from the
library; the answer is the target's own (:mod:`dspark_export.drafter.data`). Keys are ``code-task:<module>.<name>``,
stable across Python patch releases as long as the function exists.
"""
from __future__ import annotations

import ast
import random
import re
import sysconfig
from pathlib import Path

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


def stdlib_code_tasks(limit: int, seed: int = 0) -> list:
    """[(key, prompt)] of up to ``limit`` code tasks, shuffled with ``seed`` (the same list on every run of one
    Python version). A task: a public function or public-class method (a first ``self``/``cls`` dropped) with a
    docstring whose first paragraph is 40-400 ASCII characters; its prompt asks for the function from its signature
    and that paragraph, in one of three phrasings chosen by the task's position."""
    root = Path(sysconfig.get_paths()["stdlib"])
    tasks, seen = [], set()
    for path in _modules(root):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
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
            tasks.append((key, f"{fn.name}({ast.unparse(args)})", text))
    random.Random(seed).shuffle(tasks)
    return [(key, _TEMPLATES[i % len(_TEMPLATES)].format(sig=sig, doc=doc))
            for i, (key, sig, doc) in enumerate(tasks[:limit])]
