"""The remote wing (opsctl/remote): the client reads shared rules from it (base, rules) and never imports the
shipped side (the agent's verbs and what only they and the wrapper use); the wing is stdlib-only, in small modules;
opsctl's import graph (subpackage included) has no cycle; the shipped blob runs on bare python3.

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
# shipped only, never imported by the client: the verbs and main (agent), the run's supervisor in tmux (wrapper), and
# what only they use (attempts, thin, procs, follow, cache). The client reads base and rules.
REMOTE_SIDE = {f"opsctl.remote.{m}" for m in ("attempts", "thin", "procs", "follow", "cache", "wrapper", "agent")}
SHARED = {"opsctl.remote", "opsctl.remote.base", "opsctl.remote.rules"}
MAX_LINES = 1000  # a remote module stays small enough to read whole


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
    clients = {name: path for name, path in MODULES.items() if not name.startswith("opsctl.remote")}
    assert {"opsctl.commands", "opsctl.config", "opsctl.tui", "opsctl.channel", "opsctl.runstate", "opsctl.watch",
            "opsctl.alerts"} <= clients.keys()
    assert "opsctl.agent" not in MODULES and "opsctl.agent_wrapper" not in MODULES  # moved into the wing
    for name, path in clients.items():
        assert not imports_of(path) & REMOTE_SIDE, (name, sorted(imports_of(path) & REMOTE_SIDE))
    # what the client imports of the wing imports nothing of the shipped side either
    for name in SHARED:
        assert not imports_of(MODULES[name]) & REMOTE_SIDE, name
    assert set(MODULES) - set(clients) == SHARED | REMOTE_SIDE  # every wing module is one or the other


def test_the_wing_is_small_modules_and_the_wrapper_runs_only_what_it_needs() -> None:
    """No module of the wing over MAX_LINES; the run's wrapper (alive for the whole run, in tmux) imports only the
    shared rules, the attempt history and the backlog fold, never the agent's verbs, follower or process scans."""
    for name in SHARED | REMOTE_SIDE:
        lines = MODULES[name].read_text().count("\n")
        assert lines <= MAX_LINES, (name, lines)
    ours = {d for d in imports_of(MODULES["opsctl.remote.wrapper"]) if d.startswith("opsctl.")}
    assert ours == {"opsctl.remote.base", "opsctl.remote.rules", "opsctl.remote.attempts", "opsctl.remote.thin"}, ours


def test_the_wing_is_stdlib_only() -> None:
    wing = {name: path for name, path in MODULES.items() if name.startswith("opsctl.remote")}
    assert {f"opsctl.remote.{m}" for m in base.REMOTE_MODULES} == wing.keys() - {"opsctl.remote"}  # all shipped
    for name, path in wing.items():
        for dep in imports_of(path):
            top = dep.split(".")[0]
            # pynvml: procs.Nvml's optional import (GPU figures when the host's python has it, a reason when not)
            assert top in sys.stdlib_module_names or top in ("__future__", "pynvml") or dep in wing, (name, dep)
    # the shipped side imports nothing of opsctl but the wing: that is what the blob carries
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
    """A script with the bundle slot (as base.shipped_script's has) imports the wing under `python3 -I -` once spliced;
    the modules it gets are the package's text, and they hand the same sources on (the agent writes the wrapper)."""
    script = ("from __future__ import annotations\nimport sys\n\n" + base.BUNDLE_SLOT
              + "from opsctl.remote.base import EXIT_CODES, remote_sources\nfrom opsctl.remote.rules import with_args\n"
              + "print(EXIT_CODES['refused'], with_args(['sh', '-c', 'run'], ['--x', 'a b']), "
              + "remote_sources() == SOURCES)\n")
    sources = base.remote_sources()
    head, _, tail = base.splice(script, sources).rpartition("print(")  # the script's own print: the last one
    text = f"{head}SOURCES = {sources!r}\nprint({tail}"
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


def test_blob_answers_a_bad_verb_with_usage_on_isolated_python(tmp_path: Path) -> None:
    """`--help` is no verb: the blob, under `python3 -I -S` with a PYTHONPATH holding nothing of the repo, says its
    usage (`error`, then `bye` with the usage exit code): main and the verbs' table load from the stream alone."""
    blob = agent_source()
    p = subprocess.Popen([sys.executable, "-I", "-S", "-u", "-c", base.BOOTSTRAP, "--help"], cwd=tmp_path,
                         env={"PYTHONPATH": str(tmp_path)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None
    p.stdin.write(str(len(blob)).encode() + b"\n" + blob)
    p.stdin.flush()
    msgs = [json.loads(line) for line in (p.stdout.readline(), p.stdout.readline(), p.stdout.readline()) if line]
    p.stdin.close()
    rc = p.wait(timeout=60)
    assert [m["t"] for m in msgs] == ["hello", "error", "bye"], (msgs, p.stderr.read()[-2000:])
    assert "usage: agent VERB JSON_ARGS" in msgs[1]["message"] and "launch" in msgs[1]["message"]
    assert rc == msgs[2]["rc"] == base.EXIT_CODES["usage"]


def test_every_wing_module_loads_from_the_bundle_alone(tmp_path: Path) -> None:
    """Each shipped module imports under `python3 -I -S -` from the bundle (no file: `__file__` unset), and what
    gets loaded besides the wing is the standard library only: a host needs python3 and nothing else."""
    names = [f"opsctl.remote.{m}" for m in base.REMOTE_MODULES]
    script = ("import sys\n\n" + base.BUNDLE_SLOT + "import importlib\n"
              + f"for name in {names!r}:\n    importlib.import_module(name)\n"
              + "ours = sorted(n for n in sys.modules if n.split('.')[0] == 'opsctl')\n"
              + "files = [n for n in ours if getattr(sys.modules[n], '__file__', None)]\n"
              + "other = sorted({n.split('.')[0] for n in sys.modules} - set(sys.stdlib_module_names)"
              + " - {'opsctl', '__main__'})\n"
              + "print(repr((ours, files, other)))\n")
    got = subprocess.run([sys.executable, "-I", "-S", "-"], cwd=tmp_path, input=base.splice(script, base.remote_sources()),
                         capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(tmp_path)})
    assert got.returncode == 0, got.stderr[-2000:]
    ours, files, other = ast.literal_eval(got.stdout)
    assert ours == sorted(["opsctl", "opsctl.remote", *names]) and files == [] and other == [], (ours, files, other)
