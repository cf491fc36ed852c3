"""The shape of the dflash package: no import cycle, training never leans on the `eval` verb, no private names
crossing modules (issue 41). Walks the real import statements (module-level and inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

DFLASH = Path(__file__).resolve().parents[1] / "dflash"
MODULES = sorted(p.stem for p in DFLASH.glob("*.py") if p.stem != "__init__")


def _tree(name: str) -> ast.AST:
    return ast.parse((DFLASH / f"{name}.py").read_text())


def dflash_imports(name: str) -> set[str]:
    """The dflash modules `dflash/<name>.py` imports anywhere in its body (lazy imports included)."""
    found: set[str] = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("dflash.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "dflash":
                found |= {a.name for a in node.names if a.name in MODULES}
            elif node.module.startswith("dflash."):
                found.add(node.module.split(".")[1])
    return found - {name}


def test_no_import_cycle_among_dflash_modules() -> None:
    graph = {name: dflash_imports(name) for name in MODULES}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(name):], name]))
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            visit(dep, [*path, name])
        done.add(name)

    for name in MODULES:
        visit(name, [])


def test_training_measures_with_the_library_not_the_eval_verb() -> None:
    """tau statistics, held-out prompts and EvalError live in dflash/measure.py: training (train, heldout) imports it,
    never dflash/eval.py (the `eval` command), and measure imports none of its users."""
    for name in ("train", "heldout", "measure"):
        assert "eval" not in dflash_imports(name), name
    assert "measure" in dflash_imports("train") and "measure" in dflash_imports("heldout")
    assert not dflash_imports("measure") & {"eval", "heldout", "train", "cli"}


def test_no_module_imports_another_modules_private_name() -> None:
    crossing = []
    for name in MODULES:
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dflash."):
                crossing += [f"{name}: {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossing == []
