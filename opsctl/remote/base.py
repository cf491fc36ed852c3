"""The remote side's base: the message stream (emit, bye), exit codes, limits and file names, and the bundle loader.

Stdlib only: shipped to hosts with the agent and the wrapper; the client imports the same constants from here.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

AGENT_VERSION = "1"
# How the client starts the agent (`python3 -u -c BOOTSTRAP VERB JSON`, the blob on stdin after its length, the
# blob being shipped_script("opsctl.remote.agent", ...)): here, so the client never imports the agent.
BOOTSTRAP = (
    'import sys;n=int(sys.stdin.readline());exec(compile(sys.stdin.read(n),"opsctl-agent","exec"))'
)
# What one line may cost: a longer log line is sent as its first MAX_LOG_LINE bytes and ` ... [cut 19.9 MB]`, so a
# 20 MB line (a dumped tensor, a progress bar without newlines) can neither flood the client nor hide newer lines.
MAX_LOG_LINE = 64 << 10
READ_CHUNK = 4 << 20  # bytes of one file read per poll
EXIT_CODES = {"ok": 0, "failed": 1, "usage": 2, "transport": 3, "timeout": 4, "refused": 5, "taken_over": 6}
HISTORY_FILE = "history.jsonl"  # one JSON object per line; lines of one attempt `id` merge, later keys win
GROUP_FILE = "group.jsonl"  # a group run's own attempts, on its head node, written by the opsctl that follows it
ROTATIONS_FILE = "log_rotations"  # how many times the log was rotated: maps an attempt's log_seq to LOG.N
RESTARTING_FILE = "restarting"  # exists while the wrapper waits out the back-off before the next attempt
# notifiers.WRAPPER_PID.json: the notify commands a wrapper runs now, its children that are not the run's processes
NOTIFIERS_FILE = "notifiers.{}.json"

# Directories whose contents must never be emptied wholesale: opsctl/config.py refuses them in hosts.yaml, and the
# agent checks again on the host after resolving symlinks there (one list, here).
SYSTEM_DIRS = {
    "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt", "/opt",
    "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/workspace", "/dev/shm",
    "/var/tmp", "/var/lib", "/usr/local", "/usr/lib",
}


def atomic_write(path: str, text: str) -> None:
    """Write-then-rename, so a reader never sees a half-written pid, exit_code or state file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as fh:
            obj = json.load(fh)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None


# -- the message stream: one JSON line per message on stdout, `bye` last -----------------------------------
_out_lock = threading.Lock()


_batch: list[bytes] | None = None  # while a backlog is sent (batch(True)): whole lines, written 64 KB at a time
_batched = 0


def _write(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def emit(t: str, **fields: Any) -> None:
    """One JSON line per message, whole lines per write, so the client never sees half a message."""
    global _batched
    msg = {"t": t, "ts": time.time()}
    msg.update(fields)
    data = (json.dumps(msg, separators=(",", ":"), default=str) + "\n").encode()
    with _out_lock:
        try:
            if _batch is not None:
                _batch.append(data)
                _batched += len(data)
                if _batched < 1 << 16:
                    return
                data = b"".join(_batch)
                _batch.clear()
                _batched = 0
            _write(data)
        except OSError:
            os._exit(0)  # EPIPE: the client is gone, and so are we


def batch(on: bool) -> None:
    """Collect emitted lines from now on (True), or write what was collected and stop collecting (False): a
    backlog of thousands of messages leaves in ~35 writes (ssh packets) instead of one each."""
    global _batch, _batched
    with _out_lock:
        if _batch:
            try:
                _write(b"".join(_batch))
            except OSError:
                os._exit(0)
        _batch, _batched = ([] if on else None), 0


_final_rc: list[int] = []


def bye(rc: int) -> None:
    _final_rc.append(rc)  # the stdin watcher may see EOF right after the client reads `bye`: same exit code
    batch(False)  # a bye mid-backlog (a refusal, a fault) goes out after the lines collected before it
    emit("bye", rc=rc)
    os._exit(rc)


def watch_stdin() -> None:
    """EOF on stdin means the channel closed: exit at once, leaving only the run (in tmux) behind."""

    def run() -> None:
        try:
            while sys.stdin.readline():
                pass
        except (OSError, ValueError):
            pass
        os._exit(_final_rc[0] if _final_rc else 0)

    threading.Thread(target=run, name="stdin-watch", daemon=True).start()


class AgentError(Exception):
    """Bad arguments or an environment the agent cannot work in; reported as `error` + `bye 2`."""


# -- the bundle: how a host gets these modules with nothing installed ---------------------------------------
# A shipped script (the agent's blob, the run's wrapper.py) is one text: LOADER, then `{module name: source}` of the
# whole wing (remote_sources), then its entry (`from opsctl.remote.agent import main; main(...)`). The loader is a
# sys.meta_path finder, so the modules import each other with plain `from opsctl.remote.X import ...` lines, each
# compiled when first imported, exactly as from the package; a host needs only python3. `splice` puts the same
# loader at a script's BUNDLE_SLOT line (shipped_script's own text holds one).
BUNDLE_SLOT = "# opsctl-bundle: the shipped copy registers the opsctl.remote modules here (remote/base.py splice)\n"
# opsctl/remote/NAME.py, every one shipped (lower layers first: base <- rules <- attempts, thin <- procs <- follow
# <- cache <- agent; the wrapper needs base, rules, attempts and thin only). tests/test_remote_layout.py keeps this
# list equal to the directory.
REMOTE_MODULES = ("base", "rules", "attempts", "thin", "procs", "follow", "cache", "wrapper", "agent")
LOADER = """def _opsctl_bundle(sources):
    import sys
    from importlib.machinery import ModuleSpec

    class Bundle:
        def find_spec(self, name, path=None, target=None):
            if name not in sources:
                return None
            package = any(other.startswith(name + ".") for other in sources)
            return ModuleSpec(name, self, origin="opsctl-bundle/" + name, is_package=package)

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            module.__bundle__ = sources
            exec(compile(sources[module.__name__], "opsctl-bundle/" + module.__name__, "exec"), module.__dict__)

    sys.meta_path.insert(0, Bundle())
"""


def remote_sources() -> dict[str, str]:
    """`{module name: text}` of the wing, parents first: the bundled copy when this module came from a bundle (the
    agent on a host writes the wrapper from it), else the files beside this one."""
    shipped: dict[str, str] | None = globals().get("__bundle__")
    if shipped is not None:
        return dict(shipped)
    here = os.path.dirname(os.path.abspath(__file__))

    def text(name: str) -> str:
        with open(os.path.join(here, name), encoding="ascii") as fh:
            return fh.read()

    sources = {"opsctl": "", "opsctl.remote": text("__init__.py")}
    sources.update((f"opsctl.remote.{name}", text(f"{name}.py")) for name in REMOTE_MODULES)
    return sources


def splice(script: str, sources: dict[str, str]) -> str:
    """`script` with its one BUNDLE_SLOT line replaced by the loader and `sources`: one stdlib-only text a bare
    `python3` runs (ASCII in, ASCII out: the agent's bootstrap counts characters as bytes)."""
    slot = "\n" + BUNDLE_SLOT
    if script.count(slot) != 1:
        raise RuntimeError(f"a shipped script must hold exactly one line {BUNDLE_SLOT!r}")
    return script.replace(slot, f"\n{LOADER}_opsctl_bundle({sources!r})\ndel _opsctl_bundle\n")


def shipped_script(module: str, call: str, sources: dict[str, str]) -> str:
    """The one text a bare `python3` runs as `module`'s program: the bundle, then `from MODULE import main` and
    `call` when run as __main__ (the agent's blob: `main(sys.argv[1:])`; the run's wrapper.py: `main()`). Executed
    under another __name__, it only installs the bundle (a test then imports what it wants from it)."""
    script = (f'"""opsctl: {module}, shipped with opsctl/remote bundled (remote/base.py shipped_script)."""\n\n'
              f"import sys\n\n{BUNDLE_SLOT}if __name__ == \"__main__\":\n    from {module} import main\n\n"
              f"    {call}\n")
    return splice(script, sources)
