"""Shared by the layout tests (tests/test_layout.py, test_dflash_layout.py, test_remote_layout.py): the imports a
package's module makes, read from its real import statements (module level and inside functions), and the cycle check."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path


def package_imports(path: Path, package: str, modules: Iterable[str]) -> set[str]:
    """The top-level modules of `package` that the file at `path` imports (`from pkg import mod` counts as mod)."""
    names = set(modules)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith(f"{package}.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == package:
                found |= {a.name for a in node.names if a.name in names}
            elif node.module.startswith(f"{package}."):
                found.add(node.module.split(".")[1])
    return found - {path.stem}


def assert_acyclic(graph: Mapping[str, Iterable[str]]) -> None:
    """AssertionError naming the first import cycle found (a -> b -> a)."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(name):], name]))
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            visit(dep, [*path, name])
        done.add(name)

    for name in graph:
        visit(name, [])
