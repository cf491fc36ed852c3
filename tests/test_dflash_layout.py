"""The shape of the dflash package: no import cycle, training never leans on the `eval` verb, no private names
crossing modules (issue 41). Walks the real import statements (module-level and inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import assert_acyclic, package_imports

DFLASH = Path(__file__).resolve().parents[1] / "dflash"
MODULES = sorted(p.stem for p in DFLASH.glob("*.py") if p.stem != "__init__")


def _tree(name: str) -> ast.AST:
    return ast.parse((DFLASH / f"{name}.py").read_text())


def dflash_imports(name: str) -> set[str]:
    """The dflash modules `dflash/<name>.py` imports anywhere in its body (lazy imports included)."""
    return package_imports(DFLASH / f"{name}.py", "dflash", MODULES)


def test_no_import_cycle_among_dflash_modules() -> None:
    assert_acyclic({name: dflash_imports(name) for name in MODULES})


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
