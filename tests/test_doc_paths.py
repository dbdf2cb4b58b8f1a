"""Every repository file that a docstring or comment of the packages, or a link or path in ``README.md`` and
``docs/``, names exists: paths are found by their first folder (one of ``TRACKED_ROOTS``) or as a relative Markdown
link, except in a doc's "Old → new paths" section; paths with placeholders (``<name>``, ``*``, ``{…}``) and
generated folders (``engines/<name>/``) are not checked."""
import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dspark_runtime", "dspark_export", "benchmarks")
TRACKED_ROOTS = ("dspark_runtime", "dspark_export", "benchmarks", "scripts", "docs", "tests", "results", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w)" % "|".join(re.escape(r) for r in TRACKED_ROOTS))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _paths_in(text: str) -> list:
    """Paths named in ``text``; one followed by a placeholder (``-{a,b}``, ``*``, ``<x>``) is returned with a ``*``."""
    return [m.group(1).rstrip(".") + ("*" if re.match(r"[-_.]?[*{<\[]", text[m.end():]) else "")
            for m in PATH.finditer(text)]


def _exists(path: str, base: Path) -> bool:
    if any(c in path for c in "<>*{}$"):
        return True
    return (ROOT / path).exists() or (base / path).exists()


def _source_texts(path: Path) -> list:
    """The docstrings and comments of one Python file."""
    src = path.read_text()
    texts = [ast.get_docstring(n, clean=False) or "" for n in ast.walk(ast.parse(src))
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    texts += [t.string for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT]
    return texts


def missing_in_packages() -> list:
    out = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            for text in _source_texts(f):
                out += [f"{f.relative_to(ROOT)}: {p}" for p in _paths_in(text) if not _exists(p, f.parent)]
    return out


def _without_path_map(text: str) -> str:
    """``text`` less its "## Old → new paths" section, which names files that moved on purpose."""
    start = text.find("\n## Old → new paths")
    if start < 0:
        return text
    end = text.find("\n## ", start + 1)
    return text[:start] + (text[end:] if end >= 0 else "")


def missing_in_docs() -> list:
    out = []
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = _without_path_map(f.read_text())
        paths = _paths_in(text) + [m.group(1) for m in LINK.finditer(text) if "://" not in m.group(1)
                                   and not m.group(1).startswith("mailto:")]
        out += [f"{f.relative_to(ROOT)}: {p}" for p in paths if not _exists(p, f.parent)]
    return sorted(set(out))


def test_docstrings_and_comments_name_files_that_exist():
    missing = missing_in_packages()
    assert not missing, "\n".join(missing)


def test_readme_and_docs_link_files_that_exist():
    missing = missing_in_docs()
    assert not missing, "\n".join(missing)


def test_the_path_finder_reads_paths_and_placeholders():
    assert _paths_in("see dspark_runtime/decoding/loop.py. and `docs/design.md`") == [
        "dspark_runtime/decoding/loop.py", "docs/design.md"]
    assert not _exists("dspark_runtime/no_such_module.py", ROOT)
    assert _exists("engines/<name>/manifest.json", ROOT)
