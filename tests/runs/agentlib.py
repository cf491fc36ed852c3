"""Test helpers that speak the agent protocol over plain pipes, exactly as a local transport does.

Used by the agent-level tests; the CLI-level tests go through opsctl's real transports instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from opsctl.channel import agent_source
from opsctl.remote import base, procs

RUNS = Path(__file__).resolve().parent
SOURCE = agent_source()  # the blob the client ships: agent.py with the wrapper's text in it


FAKE_NVML_DIR = RUNS / "fake_nvml"


def nvml_env(state: Path) -> dict[str, str]:
    """Environment that makes `import pynvml` find the GPU stand-in (tests/runs/fake_nvml) with this state."""
    return {"PYTHONPATH": str(FAKE_NVML_DIR), "FAKE_NVML": str(state)}


def start(verb: str, args: dict[str, Any], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start the agent the way the client does: bootstrap line, then its byte length and source on stdin."""
    p = subprocess.Popen([sys.executable, "-u", "-c", base.BOOTSTRAP, verb, json.dumps(args)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, **(env or {})})
    assert p.stdin is not None
    p.stdin.write(str(len(SOURCE)).encode() + b"\n" + SOURCE)
    p.stdin.flush()
    return p


def drive(verb: str, args: dict[str, Any], timeout: float = 60,
          env: dict[str, str] | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Run one verb to its `bye`; return the exit code and every message (each stamped with `_rx`)."""
    p = start(verb, args, env)
    msgs: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    assert p.stdout is not None
    for raw in p.stdout:
        m = json.loads(raw)
        m["_rx"] = time.time()
        msgs.append(m)
        if m["t"] == "bye" or time.monotonic() > deadline:
            break
    p.stdin.close()  # type: ignore[union-attr]
    rc = p.wait(timeout=10)
    assert msgs and msgs[0]["t"] == "hello", msgs
    assert msgs[-1]["t"] == "bye" and msgs[-1]["rc"] == rc, msgs[-3:]
    return rc, msgs


def run_args(tmp: Path, script: str, *script_args: str, **kw: Any) -> dict[str, Any]:
    """Run settings (as opsctl's RunConfig sends them) for one of the scripts in tests/runs."""
    state = tmp / "state"
    args: dict[str, Any] = {
        "name": kw.pop("name", "t"), "workdir": str(tmp), "state_dir": str(state), "log": str(tmp / "run.log"),
        "events": str(tmp / "events.jsonl"), "tmux_session": kw.pop("session", f"opsctl-test-{os.getpid()}"),
        "command": [sys.executable, str(RUNS / script), *script_args] if script else kw.pop("command"),
        "env": {}, "inductor_cache_dir": str(tmp / "cache"), "clean_roots": [str(tmp)], "ready_timeout": 20,
        "kill_grace": [2, 2],
    }
    if script and script != "chatty.py":
        args["command"] += ["--events", str(tmp / "events.jsonl")]
    args.update(kw)
    return args


def of(msgs: list[dict[str, Any]], t: str) -> list[dict[str, Any]]:
    return [m for m in msgs if m["t"] == t]


def cleanup(args: dict[str, Any]) -> None:
    """Kill what a test started (through the agent's own kill verb) and its tmux server."""
    drive("kill", {**args, "kill_grace": [0.5, 0.5]})
    sock = procs.Run(args).tmux_socket()
    if os.path.exists(sock):
        subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True)


REPO = RUNS.parent.parent


def opsctl(hosts: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real CLI (`python -m opsctl`) as a user would; output is captured as text."""
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
    return subprocess.run([sys.executable, "-m", "opsctl", "--hosts", str(hosts), *argv], cwd=str(REPO),
                          capture_output=True, text=True, timeout=timeout, env=env)


def script_run(tmp: Path, script: str, *script_args: str, **over: Any) -> dict[str, Any]:
    """A hosts.yaml run entry for a script in tests/runs (the host's python runs it; paths absolute)."""
    run: dict[str, Any] = {
        "workdir": str(tmp), "command": ["{python}", str(RUNS / script), *script_args],
        "log": "run.log", "events": "events.jsonl", "inductor_cache_dir": str(tmp / "cache"),
        "clean_roots": [str(tmp)], "ready_timeout": 30, "kill_grace": [2, 2],
    }
    if script != "chatty.py":
        run["command"] += ["--events", str(tmp / "events.jsonl")]
    run.update(over)
    return run


_tiny_default_built = False


def build_tiny_default() -> None:
    """Build configs/tiny.yaml's pretrained target and regenerated records into the shared cache, once per process.

    Why: a fresh machine pays them on the first launch of the tiny run (over a minute on 2 cores); paid here, the
    launch tests measure launching, not first-use pretraining racing their ready_timeout.
    """
    global _tiny_default_built
    if _tiny_default_built:
        return
    from dflash.cli import _target_and_data
    from dflash.config import load_config
    from dflash.train import prepare_documents

    cfg = load_config(RUNS.parent.parent / "configs" / "tiny.yaml")
    _target_and_data(cfg, prepare_documents(cfg), None)
    _tiny_default_built = True


def tiny_run(tmp: Path, *extra: str) -> dict[str, Any]:
    """A hosts.yaml run entry for the training core's real embedded default (configs/tiny.yaml), out in TMP/tiny;
    its pretrained target and records are built first (build_tiny_default)."""
    build_tiny_default()
    out = tmp / "tiny"
    return {
        "workdir": str(REPO), "command": ["{python}", "-m", "dflash", "train", "--config", "configs/tiny.yaml",
                                          "--out", str(out), *extra],
        "log": str(out / "train.log"), "events": str(out / "events.jsonl"), "state_dir": str(tmp / "state"),
        "inductor_cache_dir": str(tmp / "inductor"), "clean_roots": [str(tmp)], "tmux_session": "tiny",
        "ready_timeout": 240, "kill_grace": [60, 10],
    }


def kill_tmux(workdir: Path, run: str) -> None:
    """Stop the tmux server a hosts.yaml run started outside a container (state_dir = WORKDIR/.opsctl/RUN)."""
    sock = procs.Run({"workdir": str(workdir), "state_dir": str(workdir / ".opsctl" / run)}).tmux_socket()
    if os.path.exists(sock):
        subprocess.run(["tmux", "-S", sock, "kill-server"], capture_output=True)
