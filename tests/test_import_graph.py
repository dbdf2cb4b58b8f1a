"""The package layout (the one-core issue): no import cycles among the modules of ``dspark_runtime`` and
``dspark_export`` (module-level imports; imports inside functions are deliberate late bindings), and the runtime never
imports the export toolchain or torch at module level."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dspark_runtime", "dspark_export")


def _module_imports(path: Path, package: str) -> set:
    """Modules of our two packages that ``path`` imports at module level (not inside functions or classes)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y / from . import x
                base = package if node.level == 1 else ""
                mod = f"{base}.{node.module}" if node.module else base
                out.add(mod)
                if not node.module:
                    out |= {f"{base}.{a.name}" for a in node.names}
            elif node.module:
                out.add(node.module)
                out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.split(".")[0] in PACKAGES or m.split(".")[0] == "torch"}


def _graph() -> dict:
    graph = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            graph[name] = _module_imports(f, pkg)
    return {m: {d for d in deps if d in graph or d.split(".")[0] == "torch"} for m, deps in graph.items()}


def _cycle(graph: dict):
    """One import cycle (a list of modules) or None: depth-first search over the module graph."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycles_and_the_runtime_stays_torch_free():
    graph = _graph()
    assert len(graph) > 50  # both packages were read
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    for m, deps in graph.items():
        if m.startswith("dspark_runtime"):
            bad = sorted(d for d in deps if d.startswith("dspark_export") or d.split(".")[0] == "torch")
            assert not bad, f"{m} imports {bad} at module level"


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
