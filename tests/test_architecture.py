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


CSRC = SRC.parent.parent / "csrc"


def c_functions(text):
    """(name, first line, lines) of every function definition in C source text: a line
    at column 0 that opens a definition, up to the closing brace at column 0."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        head = lines[i]
        if re.match(r"^[A-Za-z_].*\(", head) and not head.startswith(("#", "typedef")) \
                and not head.rstrip().endswith((";", "\\")):
            j = i
            while j < len(lines) and not lines[j].rstrip().endswith("{") \
                    and not lines[j].rstrip().endswith(";"):
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("{"):
                k = j + 1
                while k < len(lines) and not lines[k].startswith("}"):
                    k += 1
                name = re.search(r"(\w+(?:\(\w+\))?)\s*\(", head)
                yield (name.group(1) if name else head), i + 1, k - i + 1
                i = k
        i += 1


def test_no_kernel_file_reaches_700_lines_and_no_c_function_100():
    files = sorted(CSRC.glob("*.[ch]"))
    assert len(files) > 10
    for path in files:
        text = path.read_text()
        assert text.count("\n") < 700, path.name
        for name, line, length in c_functions(text):
            assert length <= 100, f"{path.name}:{line} {name} has {length} lines"


def test_the_function_finder_measures_a_function():
    body = "static int f(int x)\n{\n" + "    x += 1;\n" * 120 + "    return x;\n}\n"
    assert [(n, length) for n, _, length in c_functions(body)] == [("f", 124)]


def test_the_build_and_the_dispatcher_read_one_isa_list():
    from manyheads import _kernels

    setup = _setup_module()
    files = list(setup.isa_flags(str(CSRC)))
    # the build's kernel files, best first, are the dispatcher's paths, best first
    assert [f.removeprefix("mh_").removesuffix(".c") for f in files] == list(_kernels.isa_names())
    assert {f for f, _ in setup.c_sources(csrc=str(CSRC))} == {p.name for p in CSRC.glob("*.c")}


def _setup_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("manyheads_setup", SRC.parent.parent / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # (setup() itself only runs as a script)
    return setup


@pytest.mark.parametrize("takes_flags", [True, False])
def test_a_kernel_file_that_fails_with_flags_the_compiler_takes_stops_the_build(
        takes_flags, monkeypatch):
    """A kernel file is built without its target flags only when the compiler rejects
    the flags themselves; when it takes them, the file's own error stops the build
    (a path left out unseen would ship a slower wheel)."""
    import threading
    from setuptools.errors import CompileError

    setup = _setup_module()
    monkeypatch.chdir(SRC.parent.parent)  # (setup.py runs from the source tree's root)
    flags = ["-mavx512f"]
    calls = []

    class Compiler:  # stands in for the C compiler: the kernel file fails with its flags
        def compile(self, sources, output_dir, extra_postargs, **kw):
            name = Path(sources[0]).name
            calls.append((name, list(extra_postargs)))
            if name == "flags_check.c" and takes_flags:
                return ["flags_check.o"]
            if "-mavx512f" in extra_postargs:
                raise CompileError(f"{name}: error")
            return [name + ".o"]

    ext = setup.BuildExt.__new__(setup.BuildExt)
    ext.compiler, ext.build_temp = Compiler(), "build"
    ext._probes, ext._probe_lock = {}, threading.Lock()
    if takes_flags:
        with pytest.raises(CompileError, match="mh_avx512.c"):
            ext._compile_c("mh_avx512.c", ["-O3"], flags)
    else:
        assert ext._compile_c("mh_avx512.c", ["-O3"], flags) == ["mh_avx512.c.o"]
    assert calls[0] == ("mh_avx512.c", ["-O3", "-mavx512f"])
    assert calls[1] == ("flags_check.c", ["-O3", "-mavx512f"])
    assert len(calls) == (2 if takes_flags else 3)
