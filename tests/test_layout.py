"""The shape of the opsctl package: which module may import which (issue 9's layering rules).

Walks the real import statements (module-level and inside functions) rather than trusting a diagram.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from import_graph import assert_acyclic, package_imports

OPSCTL = Path(__file__).resolve().parents[1] / "opsctl"
MODULES = sorted(p.stem for p in OPSCTL.glob("*.py") if p.stem != "__init__")


def opsctl_imports(name: str) -> set[str]:
    """The opsctl modules `opsctl/<name>.py` imports anywhere in its body (lazy imports included)."""
    return package_imports(OPSCTL / f"{name}.py", "opsctl", MODULES)


def test_no_import_cycle_among_opsctl_modules() -> None:
    assert_acyclic({name: opsctl_imports(name) for name in MODULES})


def test_layers_point_one_way() -> None:
    # --plain / --once must work without the Textual app; the watch model is UI-free; the remote halves are alone.
    assert "tui" not in opsctl_imports("plain")
    assert not opsctl_imports("watch") & {"tui", "widgets", "plain", "commands", "cli"}
    assert not {"agent", "agent_wrapper"} & set(MODULES)  # the remote halves live in the wing (test_remote_layout.py)
    src = (OPSCTL / "watch.py").read_text()
    assert "textual" not in src and "rich" not in src


def test_each_module_imports_alone() -> None:
    for name in (m for m in MODULES if m != "__main__"):  # __main__ runs the CLI on import, by design
        got = subprocess.run([sys.executable, "-c", f"import opsctl.{name}"], capture_output=True, text=True,
                             timeout=120)
        assert got.returncode == 0, (name, got.stderr[-2000:])


def test_client_imports_the_event_contract_instead_of_copying_it() -> None:
    # opsctl may import two dflash modules, both torch-free: the event contract and the YAML reader.
    for name in MODULES:
        for node in ast.walk(ast.parse((OPSCTL / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash"):
                assert node.module in ("dflash.telemetry", "dflash", "dflash.yamlfile"), (name, node.module)
                if node.module == "dflash":
                    assert [a.name for a in node.names] == ["yamlfile"], (name, ast.dump(node))
    contract = (OPSCTL.parent / "dflash" / "telemetry.py").read_text()
    for node in ast.walk(ast.parse(contract)):
        if isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            assert (node.module or "").split(".")[0] in sys.stdlib_module_names | {"__future__"}

    from dflash import telemetry
    from opsctl import alerts, runstate

    assert runstate.LOADING_PHASES == {"loading_target", "building_drafter", "preparing_data"}
    assert runstate.LOADING_PHASES < set(telemetry.PHASES) and "compiling" in telemetry.PHASES
    assert {alerts.NAN, alerts.SLOW_KERNEL, alerts.RECOMPILE, alerts.UNCOMPILED_FLEX} <= set(telemetry.ERROR_CLASSES)


def test_small_rules_live_once() -> None:
    from opsctl import commands, config, runstate
    from opsctl.remote import agent, base, procs

    assert config.SYSTEM_DIRS is procs.SYSTEM_DIRS is base.SYSTEM_DIRS  # hosts.yaml and the agent refuse the same dirs
    assert {name: getattr(commands, f"EXIT_{name.upper()}") for name in base.EXIT_CODES} == agent.EXIT_CODES
    assert runstate.phase_progress("loading_target", 2, 3) == "loading_target 2/3"
    assert runstate.phase_progress("compiling", None, 3) == "compiling"
    problem = config.Problem("hosts.yaml", 3, "hosts.a.ssh.port", "bad")
    assert problem == ("hosts.yaml", 3, "hosts.a.ssh.port", "bad") and problem.field == "hosts.a.ssh.port"
    assert not hasattr(runstate, "STATES")
