"""States that say what happened (issue 21, item 9), with the real CLI, wrapper, tmux and processes on a local host:
a wrapper that dies during its restart back-off, a shell-wrapped command killed by a signal from outside, a resume
the training core refuses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from dflash_fixtures import tiny_run_yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import kill_tmux, opsctl  # noqa: E402


def local_hosts(tmp: Path, run: dict[str, Any]) -> Path:
    p = tmp / "hosts.yaml"
    p.write_text(yaml.safe_dump({"hosts": {"local": {"local": True, "runs": {"r": run}}}}, sort_keys=False))
    return p


def status(hosts: Path) -> dict[str, Any]:
    r = opsctl(hosts, "status", "local", "r", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)[0]  # type: ignore[no-any-return]


def history(hosts: Path) -> list[dict[str, Any]]:
    r = opsctl(hosts, "history", "local", "r", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def wait_for(hosts: Path, pred: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = status(hosts)
        if pred(st):
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.2)


def pid_file(tmp: Path) -> dict[str, Any]:
    return json.loads((tmp / ".opsctl" / "r" / "pid").read_text())  # type: ignore[no-any-return]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# Each start appends a line to `starts` (with its arguments) and exits 3 after a moment.
CRASHING = ("import sys, time; open('starts', 'a').write(' '.join(sys.argv[1:]) + '\\n'); print('started', "
            "flush=True); time.sleep(0.5); sys.exit(3)")


def test_a_wrapper_killed_during_its_back_off_is_said_by_status_and_launch_carries_out_the_restart(
        tmp_path: Path) -> None:
    hosts = local_hosts(tmp_path, {
        "workdir": str(tmp_path), "command": ["{python}", "-c", CRASHING, "fresh"], "log": "run.log",
        "inductor_cache_dir": "cache", "tmux_session": "t-lost-restart", "ready_timeout": 2,
        "restart": {"when": "on-failure", "max": 2, "backoff_s": 60, "resume_args": ["--resume"]}})
    try:
        opsctl(hosts, "launch", "local", "r")  # no telemetry: returns at its ready timeout
        wait_for(hosts, lambda s: s["state"] == "restarting")
        wrapper = pid_file(tmp_path)["wrapper_pid"]
        os.kill(wrapper, signal.SIGKILL)  # an OOM kill of the wrapper, a reboot: nothing is left to restart
        deadline = time.monotonic() + 10
        while alive(wrapper) and time.monotonic() < deadline:
            time.sleep(0.05)
        st = status(hosts)
        assert st["state"] == "crashed" and st["exit_code"] == 3, st
        assert st["reason"] == ("exit 3; restart 1/2 never started: the run's wrapper died during its back-off "
                                "(opsctl launch starts it, with the resume arguments)"), st
        r = opsctl(hosts, "launch", "local", "r")  # the restart, carried out now: resumed, numbered as a restart
        said = " ".join(r.stderr.split())
        assert ("restart: restart 1 of 2 after attempt 1 (exit 3) never started: the run's wrapper died during its "
                "back-off; starting it now, resuming with --resume") in said, r.stderr
        st = wait_for(hosts, lambda s: s["state"] == "restarting" and s["attempt"] == 2)
        assert (st["restart_n"], st["restart_max"]) == (2, 2), st  # the policy's count goes on from there
        h = history(hosts)
        assert [(a["id"], a["by"], a.get("restart"), a.get("restart_of")) for a in h] == [
            (1, "launch", None, None), (2, "restart", 1, 1)], h
        assert h[1]["argv"][-2:] == ["fresh", "--resume"], h
        assert (tmp_path / "starts").read_text().splitlines()[:2] == ["fresh", "fresh --resume"]
    finally:
        opsctl(hosts, "kill", "local", "r")
        kill_tmux(tmp_path, "r")


# A command string runs as `bash -c STRING`; two commands, so bash waits for python instead of exec'ing it.
SHELL_RUN = "echo started; {python} -c 'import os, time; open(\"pid\", \"w\").write(str(os.getpid())); time.sleep(300)'"


def test_a_shell_wrapped_command_killed_from_outside_reads_killed_and_is_never_restarted(tmp_path: Path) -> None:
    hosts = local_hosts(tmp_path, {
        "workdir": str(tmp_path), "command": SHELL_RUN.replace("{python}", sys.executable), "log": "run.log",
        "inductor_cache_dir": "cache", "tmux_session": "t-shell-kill", "ready_timeout": 2,
        "restart": {"when": "on-failure", "max": 3, "backoff_s": 0.2}})
    try:
        opsctl(hosts, "launch", "local", "r")  # no telemetry: returns at its ready timeout, the run going on
        deadline = time.monotonic() + 30
        while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)  # a person's kill -9: bash reports exit 137
        st = wait_for(hosts, lambda s: s["proc_state"] == "exited")
        time.sleep(1.0)  # a restart would have started by now (back-off 0.2 s)
        st = status(hosts)
        assert st["state"] == "killed" and st["exit_code"] == 137, st
        assert st["reason"] == "by SIGKILL from outside opsctl", st
        h = history(hosts)
        assert [(a["outcome"], a["signal"], a["exit_code"]) for a in h] == [("killed", "SIGKILL", 137)], h
        assert "restart" not in (tmp_path / "run.log").read_text().split("started", 1)[1]
    finally:
        opsctl(hosts, "kill", "local", "r")
        kill_tmux(tmp_path, "r")


def test_a_refused_resume_reads_refused_with_the_refusal_and_is_never_restarted(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tiny_run_yaml(
        train={"max_steps": 2, "checkpoint_every": 1, "keep_last": 3})))
    out = tmp_path / "out"
    train = [sys.executable, "-m", "dflash", "train", "--config", "run.yaml", "--out", str(out)]
    hosts = local_hosts(tmp_path, {
        "workdir": str(tmp_path), "command": [*train, "--resume", "--max-steps", "4"], "log": "run.log",
        "events": str(out / "events.jsonl"), "inductor_cache_dir": "cache", "tmux_session": "t-refused",
        "ready_timeout": 120, "env": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        "restart": {"when": "on-failure", "max": 2, "backoff_s": 0.2}})
    done = subprocess.run(train, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    bad = out / "checkpoints" / "step-2" / "optimizer.pt"
    bad.write_bytes(bad.read_bytes()[:-10])  # truncated: the newest checkpoint cannot be resumed from
    later = time.time() + 1
    os.utime(tmp_path / "run.yaml", (later, later))  # launch would refuse to relaunch the finished run unchanged
    try:
        opsctl(hosts, "launch", "local", "r")
        st = wait_for(hosts, lambda s: s["proc_state"] == "exited", timeout=120)
        time.sleep(1.0)  # a restart would have started by now (back-off 0.2 s)
        st = status(hosts)
        assert st["state"] == "refused" and st["end_reason"] == "refused" and st["exit_code"] == 2, st
        assert st["reason"].startswith(f"refusing to resume: {bad}: size") and st["reason"].endswith("(exit 2)"), st
        h = history(hosts)
        assert [(a["outcome"], a["exit_code"]) for a in h] == [("refused", 2)], h
        assert h[0]["reason"] == st["reason"].removesuffix(" (exit 2)"), h
        r = opsctl(hosts, "history", "local", "r")
        assert "refused (refusing to resume: " in r.stdout, r.stdout
        r = opsctl(hosts, "status", "local", "r")
        assert "refused" in r.stdout and "crashed" not in r.stdout, r.stdout
    finally:
        opsctl(hosts, "kill", "local", "r")
        kill_tmux(tmp_path, "r")
