"""The suite's layout under xdist (tests/conftest.py): the tables name real tests, and the heaviest units come first."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from conftest import HEAVY, SHARED_FIXTURE_FILES, SLOW_TESTS, TINY_DEFAULT_FILES

TESTS = Path(__file__).resolve().parent


def _functions(file: str) -> list[str]:
    """The file's test functions, in file order."""
    tree = ast.parse((TESTS / file).read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


def test_every_named_test_and_file_exists() -> None:
    """A renamed test would silently lose its place (slow marker, order): each name in the tables is a real one."""
    for file in SHARED_FIXTURE_FILES | TINY_DEFAULT_FILES:
        assert (TESTS / file).is_file(), file
    for name in SLOW_TESTS | set(HEAVY):
        file, _, func = name.partition("::")
        if not func:  # a whole file: one scheduling unit only when its tests are grouped
            assert file in SHARED_FIXTURE_FILES, name
            continue
        assert file not in SHARED_FIXTURE_FILES or name not in HEAVY, f"{name}: weigh its file, the unit"
        assert func in _functions(file), name


def test_a_worker_collects_the_heaviest_units_first_and_keeps_each_files_own_order() -> None:
    files = ["test_cli.py", "test_dev_demo.py", "test_peer_bench.py", "test_suite_order.py", "test_warm_start.py"]
    env = dict(os.environ, PYTEST_XDIST_WORKER="gw0")  # conftest sorts only on a worker
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        *(str(TESTS / f) for f in files)], cwd=TESTS.parent, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ids = [line.split("tests/", 1)[1] for line in r.stdout.splitlines() if "::" in line]
    peer = [i for i in ids if i.startswith("test_peer_bench.py::")]
    # the heaviest unit first, whole, in its file's order (its last test reuses the others' output in place)
    assert ids[: len(peer)] == peer and peer[-1].endswith("::test_a_second_call_with_one_more_variant_trains_and_"
                                                           "evaluates_only_that_one"), ids
    order = [i.split("[")[0] for i in ids]
    # the next heaviest, a grouped file too: whole and in file order (its module fixture built in its first test)
    warm = [i for i, name in enumerate(order) if name.startswith("test_warm_start.py::")]
    assert warm == list(range(len(peer), len(peer) + len(warm))), ids
    assert [order[i] for i in warm] == [f"test_warm_start.py::{f}" for f in _functions("test_warm_start.py")], ids
    demo = order.index("test_dev_demo.py::test_dev_demo_succeeds_first_after_finish_after_kill_after_crash")
    sigterm = order.index("test_cli.py::test_sigterm_finishes_step_checkpoints_and_exits_0")  # slow, not HEAVY
    assert warm[-1] < demo < sigterm, ids
    # slow first, then grouped files, then the rest: this file's light tests come last
    assert set(order[-2:]) == {f"test_suite_order.py::{f}" for f in _functions("test_suite_order.py")}, ids
