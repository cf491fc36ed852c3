"""The remote wing (opsctl/remote): the client reads shared rules from it and never imports the agent's verbs; the
wing is stdlib-only; opsctl's import graph (subpackage included) has no cycle; the shipped blob runs on bare python3.

Walks the real import statements (module-level and lazy) of every opsctl module, dotted names included.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from import_graph import assert_acyclic

from opsctl.channel import agent_source
from opsctl.remote import base

OPSCTL = Path(__file__).resolve().parents[1] / "opsctl"
REMOTE_SIDE = {"opsctl.agent", "opsctl.agent_wrapper"}  # the verbs and the wrapper: shipped, never imported by the client


def module_name(path: Path) -> str:
    parts = path.relative_to(OPSCTL.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(OPSCTL.rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports anywhere in its body: `from opsctl import agent` counts as opsctl.agent."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, (path, ast.dump(node))  # absolute imports only: the bundle registers full names
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
    return found


def test_the_client_never_imports_the_agent() -> None:
    clients = {name: path for name, path in MODULES.items()
               if name not in REMOTE_SIDE and not name.startswith("opsctl.remote")}
    assert {"opsctl.commands", "opsctl.config", "opsctl.tui", "opsctl.channel", "opsctl.runstate"} <= clients.keys()
    for name, path in clients.items():
        assert not imports_of(path) & REMOTE_SIDE, (name, sorted(imports_of(path) & REMOTE_SIDE))


def test_the_wing_is_stdlib_only() -> None:
    wing = {name: path for name, path in MODULES.items() if name.startswith("opsctl.remote")}
    assert {f"opsctl.remote.{m}" for m in base.REMOTE_MODULES} <= wing.keys()
    for name, path in wing.items():
        for dep in imports_of(path):
            top = dep.split(".")[0]
            assert top in sys.stdlib_module_names or top == "__future__" or dep in wing, (name, dep)
    # the agent and the wrapper import nothing of opsctl but the wing: that is what the blob carries
    for name in REMOTE_SIDE:
        ours = {d for d in imports_of(MODULES[name]) if d.split(".")[0] == "opsctl"}
        assert ours and ours <= wing.keys(), (name, ours)


def test_no_import_cycle_in_opsctl() -> None:
    assert_acyclic({name: {d for d in imports_of(path) if d in MODULES and d != name}
                    for name, path in MODULES.items()})


def test_blob_answers_hello_on_isolated_python(tmp_path: Path) -> None:
    """`python3 -I -S` (no site-packages, where opsctl is installed here; no PYTHONPATH; no cwd on sys.path) in an
    empty directory: the blob's loader gives the agent opsctl.remote from the stream itself."""
    blob = agent_source()
    assert all(b < 128 for b in blob)
    p = subprocess.Popen([sys.executable, "-I", "-S", "-u", "-c", base.BOOTSTRAP, "hello", "{}"], cwd=tmp_path, env={},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None
    p.stdin.write(str(len(blob)).encode() + b"\n" + blob)
    p.stdin.flush()  # stdin stays open while it answers: EOF on it means the channel closed
    msgs = [json.loads(line) for line in (p.stdout.readline(), p.stdout.readline()) if line]
    p.stdin.close()
    rc = p.wait(timeout=60)
    assert rc == 0 and [m["t"] for m in msgs] == ["hello", "bye"], (msgs, p.stderr.read()[-2000:])
    assert msgs[0]["agent_version"] == base.AGENT_VERSION and msgs[1]["rc"] == base.EXIT_CODES["ok"]


def test_splice_registers_the_wing_for_a_bare_script(tmp_path: Path) -> None:
    """A script with the bundle slot (as agent_wrapper.py has) imports the wing under `python3 -I -` once spliced;
    the modules it gets are the package's text, and they hand the same sources on (the agent writes the wrapper)."""
    script = ("from __future__ import annotations\nimport sys\n\n" + base.BUNDLE_SLOT
              + "from opsctl.remote.base import EXIT_CODES, remote_sources\nfrom opsctl.remote.rules import with_args\n"
              + "print(EXIT_CODES['refused'], with_args(['sh', '-c', 'run'], ['--x', 'a b']), "
              + "remote_sources() == SOURCES)\n")
    sources = base.remote_sources()
    text = base.splice(script, sources).replace("print(", f"SOURCES = {sources!r}\nprint(", 1)
    got = subprocess.run([sys.executable, "-I", "-S", "-"], cwd=tmp_path, input=text.encode("ascii"), capture_output=True,
                         timeout=60, env={})
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.decode() == "5 ['sh', '-c', \"run --x 'a b'\"] True\n"
    try:
        base.splice("no slot here\n", sources)
    except RuntimeError as exc:
        assert "exactly one line" in str(exc)
    else:
        raise AssertionError("a script without the slot must be refused")
