"""The package's import graph has no circle, counting imports made inside functions too.

A circle hidden by a function-level import still ties the modules together: neither can be read, tested or
moved without the other. The graph is read from the source (``ast``), so nothing is imported here.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "dsv4_sm120"


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The package's modules ``name`` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `from a.b import c` names module a.b.c or a name of a.b
                target = target.rpartition(".")[0]
            if target and target != name and target != PACKAGE:
                found.add(target)
    return found


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_imports_no_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert sum(len(v) for v in graph.values()) > 50, "the import graph was not read"
    assert _circle(graph) is None, " -> ".join(_circle(graph))


def test_the_reader_finds_a_circle_hidden_in_a_function():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


# The doors at the top of the house: what a user runs (the CLI, the doctor) and what sglang loads (the plugin).
# Nothing below them may import them: a fix area describes itself through dsv4_sm120.doctor_rows.
TOP = {"dsv4_sm120.cli", "dsv4_sm120.doctor", "dsv4_sm120.plugin"}


def test_no_module_below_the_doors_imports_them():
    modules = _modules()
    upward = sorted(f"{name} -> {target}" for name, path in modules.items() if name not in TOP
                    for target in _imports(name, path, modules) & TOP)
    assert upward == []
