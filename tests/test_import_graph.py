"""The package layout's import rules, over every import of ``dspark_runtime`` and ``dspark_export`` (module level and
inside functions): no cycle; the runtime imports neither the toolchain nor torch; and a module imports the project's
own modules at module level, except where the imported module loads a heavy dependency (``HEAVY``) that the importer
keeps lazy, or a package keeps its attributes lazy (``LAZY_ATTRIBUTES``). ``python tests/test_import_graph.py``
prints the lazy edges."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dspark_runtime", "dspark_export")
# third-party packages slow or optional enough that importing them only where they are used is right
HEAVY = {"torch", "transformers", "tensorrt", "tensorrt_rtx", "fastapi", "uvicorn", "ray", "onnx", "onnxscript",
         "cuda", "gguf", "prometheus_client", "matplotlib"}
# PEP 562: `from dspark_runtime import Engine` stays cheap until Engine is used
LAZY_ATTRIBUTES = {("dspark_runtime", "dspark_runtime.engine")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list:
    """``(imported module, at module level?)`` for every import statement in ``path``; ``from a import b`` names
    both ``a`` and ``a.b`` (the graph keeps whichever is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: relative import (the project imports absolutely)"
            out.append((node.module, id(node) in top))
            out += [(f"{node.module}.{a.name}", id(node) in top) for a in node.names]
    return out


def _graph():
    """``{module: {imported own module: at module level?}}`` and ``{module: third-party roots at module level}``."""
    files = {_module_name(f): f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))}
    graph, third = {}, {}
    for name, f in files.items():
        edges, roots = {}, set()
        for mod, top in _imports(f):
            if mod in files:
                edges[mod] = edges.get(mod, False) or top
            elif mod.split(".")[0] not in PACKAGES and top:
                roots.add(mod.split(".")[0])
        graph[name], third[name] = edges, roots
    return graph, third


def _heavy_modules(graph: dict, third: dict) -> set:
    """Own modules that load a ``HEAVY`` package when imported (directly or through module-level imports)."""
    heavy = {m for m, roots in third.items() if roots & HEAVY}
    changed = True
    while changed:
        changed = False
        for m, edges in graph.items():
            if m not in heavy and any(top and d in heavy for d, top in edges.items()):
                heavy.add(m)
                changed = True
    return heavy


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


def lazy_edges():
    """Function-level imports of own modules: ``[(importer, imported, allowed?)]``."""
    graph, third = _graph()
    heavy = _heavy_modules(graph, third)
    return [(m, d, d in heavy or (m, d) in LAZY_ATTRIBUTES)
            for m, edges in sorted(graph.items()) for d, top in sorted(edges.items()) if not top]


def test_no_import_cycle_counting_imports_inside_functions():
    graph, _ = _graph()
    assert len(graph) > 80  # both packages and their subpackages were read
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_runtime_never_imports_the_toolchain_or_torch():
    graph, third = _graph()
    for m, edges in graph.items():
        if m.startswith("dspark_runtime"):
            assert not [d for d in edges if d.startswith("dspark_export")], m
            assert "torch" not in third[m], m


def test_own_modules_are_imported_at_module_level_unless_heavy():
    bad = [f"{m} imports {d} inside a function" for m, d, allowed in lazy_edges() if not allowed]
    assert not bad, "\n".join(bad)


def test_the_checks_find_a_cycle_and_a_heavy_module():
    assert _cycle({"a": {"b": True}, "b": {"c": False}, "c": {"a": True}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": True}, "b": {}}) is None
    graph = {"a": {"b": True}, "b": {}, "c": {"a": False}}
    assert _heavy_modules(graph, {"a": set(), "b": {"torch"}, "c": set()}) == {"a", "b"}


if __name__ == "__main__":
    edges = lazy_edges()
    for m, d, allowed in edges:
        print(f"{'lazy ' if allowed else 'BAD  '} {m} -> {d}")
    print(f"{len(edges)} function-level imports of own modules, {sum(not a for *_, a in edges)} not allowed",
          file=sys.stderr)
