"""The package's seams: no import cycle (inner imports included), a narrow kernel entry."""
import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "manyheads"
pytestmark = pytest.mark.skipif(not SRC.is_dir(), reason="needs the source tree")


def _module_name(path):
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted):
    path = SRC.parent / Path(*dotted.split("."))
    return (path.with_suffix(".py").exists() or path.with_suffix(".pyx").exists()
            or (path / "__init__.py").exists())


def _imports(path, name):
    """Every manyheads module that the file imports, anywhere in it (inner imports too)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "manyheads")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.split(".")[0] != "manyheads":
                continue
            # `from . import _core` imports the submodule; `from .x import name` imports x
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.add(sub if _is_module(sub) else target)
    found.discard(name)
    return found


def import_graph():
    graph = {}
    for path in SRC.rglob("*.py"):
        name = _module_name(path)
        graph[name] = _imports(path, name)
    return graph


def find_cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_static_import_graph_has_no_cycle():
    graph = import_graph()
    assert "manyheads.modules" in graph and "manyheads.interop" in graph["manyheads.modules"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["manyheads.interop"] = graph["manyheads.interop"] | {"manyheads.modules"}
    assert find_cycle(graph) is not None


def test_no_kernel_entry_takes_more_than_twelve_parameters():
    text = (SRC / "_kernels.pyx").read_text()
    signatures = re.findall(r"^\s*(?:cp)?def\s+(\w+)\s*\(([^)]*)\)", text, flags=re.M)
    assert len(signatures) > 10
    for name, params in signatures:
        count = len([p for p in params.split(",") if p.strip()])
        assert count <= 12, f"{name} takes {count} parameters"
