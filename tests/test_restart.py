"""The restart policy through a real sshd and the `pct` stand-in: the run's wrapper restarts a crashed attempt on the
host (no client connected), with the resume arguments, after the back-off, up to `max`; a kill never restarts.

The run (tests/runs/flaky.py) crashes on its first N starts and records every start in a counter file.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import opsctl, script_run  # noqa: E402

from opsctl import commands  # noqa: E402
from opsctl.config import InventoryError, parse_inventory  # noqa: E402

HOSTS = """\
hosts:
  gpu1:
    local: true
    notify: [curl, -d, done, https://ntfy.example/runs]
    runs:
      a:
        workdir: /srv/a
        command: [python3, train.py]
        log: train.log
        restart: {when: on-failure, max: 2, backoff_s: 5, resume_args: [--resume, auto]}
      b:
        workdir: /srv/b
        command: [python3, train.py]
        log: train.log
        notify: [mail, -s, run-b, me@example.org]
"""


def test_restart_and_notify_in_hosts_yaml() -> None:
    inv = parse_inventory(HOSTS, file="hosts.yaml")
    a, b = inv.runs["gpu1"]["a"], inv.runs["gpu1"]["b"]
    assert (a.restart.when, a.restart.max, a.restart.backoff_s, a.restart.resume_args) == (
        "on-failure", 2, 5.0, ["--resume", "auto"])
    assert b.restart.when == "never"  # the default: a crash stays a crash
    assert a.notify == ["curl", "-d", "done", "https://ntfy.example/runs"]  # the host's, inherited
    assert b.notify == ["mail", "-s", "run-b", "me@example.org"]  # the run's own wins
    bad = (HOSTS.replace("max: 2", "max: 0").replace("when: on-failure", "when: always")
           .replace("backoff_s: 5", "backof_s: 5").replace("notify: [mail, -s, run-b, me@example.org]", "notify: []"))
    with pytest.raises(InventoryError) as ei:
        parse_inventory(bad, file="hosts.yaml")
    lines = str(ei.value).splitlines()
    assert "hosts.yaml:10: hosts.gpu1.runs.a.restart.when: Input should be 'never' or 'on-failure'" in lines
    assert "hosts.yaml:10: hosts.gpu1.runs.a.restart.max: Input should be greater than or equal to 1" in lines
    assert ("hosts.yaml:10: hosts.gpu1.runs.a.restart.backof_s: unknown key 'backof_s' (did you mean 'backoff_s'?)"
            in lines)
    assert any(ln.startswith("hosts.yaml:15: hosts.gpu1.runs.b.notify: notify is an argv list") for ln in lines)


@pytest.fixture
def ct(container: Callable[..., int]) -> int:
    return container(200)


def flaky(tmp: Path, fail_times: int, max_restarts: int, backoff: float) -> dict[str, Any]:
    return script_run(tmp, "flaky.py", "--counter", str(tmp / "counter"), "--fail-times", str(fail_times),
                      restart={"when": "on-failure", "max": max_restarts, "backoff_s": backoff,
                               "resume_args": ["--resume"]})


def status(hosts: Path) -> dict[str, Any]:
    r = opsctl(hosts, "status", "box", "r", "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    return st[0] if isinstance(st, list) else st


def history(hosts: Path) -> list[dict[str, Any]]:
    r = opsctl(hosts, "history", "box", "r", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def wait_for(hosts: Path, pred: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = status(hosts)
        if pred(st):
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.2)


def starts(tmp: Path) -> list[str]:
    """How each start of flaky.py ran: `fresh` or `resume`."""
    return [ln.split()[2] for ln in (tmp / "counter").read_text().splitlines()]


def test_crashes_twice_then_succeeds_ends_finished_with_three_attempts(tmp_path: Path, sshd, ct: int) -> None:
    # a 6 s back-off: status polls (a process each) must see the first one on a loaded machine (3 s was missed)
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={"r": flaky(tmp_path, 2, 3, 6.0)})
    r = opsctl(hosts, "launch", "box", "r")  # ready at attempt 1's first step; the client then goes away
    assert r.returncode == commands.EXIT_OK, r.stderr
    # with no client connected, the wrapper on the host waits out the back-off: status sees it
    st = wait_for(hosts, lambda s: s["state"] == "restarting")
    assert (st["restart_n"], st["restart_max"], st["attempt"]) == (1, 3, 1), st
    assert "restart 1/3" in st["reason"] and "RuntimeError: flaky failure 1 (test crash)" in st["reason"]
    st = wait_for(hosts, lambda s: s["state"] == "finished")
    assert st["attempt"] == 3 and st["exit_code"] == 0 and st["step"] == 3, st
    assert st["started_at"] is not None and st["duration_s"] is not None and st["duration_s"] < 30
    assert starts(tmp_path) == ["fresh", "resume", "resume"]  # a restart carries the resume flag
    h = history(hosts)
    assert [a["outcome"] for a in h] == ["crashed", "crashed", "finished"], h
    assert [a["id"] for a in h] == [1, 2, 3] and [a["by"] for a in h] == ["launch", "restart", "restart"]
    assert [a["exception"] for a in h[:2]] == ["RuntimeError: flaky failure 1 (test crash)",
                                               "RuntimeError: flaky failure 2 (test crash)"]
    assert [a["exit_code"] for a in h] == [1, 1, 0]
    assert "--resume" not in h[0]["argv"] and h[1]["argv"][-1] == h[2]["argv"][-1] == "--resume"
    assert [(a["first_step"], a["last_step"]) for a in h] == [(1, 1), (2, 2), (2, 3)]
    # each attempt's own log, rotated like a launch's: the crash is in the log of the attempt that crashed
    assert [a["log"] for a in h] == [str(tmp_path / "run.log.2"), str(tmp_path / "run.log.1"), str(tmp_path / "run.log")]
    assert "flaky failure 1" in (tmp_path / "run.log.2").read_text()
    log = (tmp_path / "run.log").read_text()
    assert log.startswith("[opsctl] attempt 3: restart 2 of 3 after attempt 2: RuntimeError: flaky failure 2 (test "
                          "crash) (exit 1)\n") and "run ended: completed" in log, log
    assert h[1]["started"] - h[0]["ended"] >= 6.0  # the back-off


def test_a_run_that_always_crashes_stops_after_max(tmp_path: Path, sshd, ct: int) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={"r": flaky(tmp_path, 99, 2, 0.3)})
    r = opsctl(hosts, "launch", "box", "r", "--follow")  # follows through the restarts to the final exit
    assert r.returncode == commands.EXIT_FAILED, r.stderr
    assert r.stdout.count("flaky failure") >= 3
    st = wait_for(hosts, lambda s: s["state"] == "crashed")
    assert st["attempt"] == 3 and st["proc_exit_code"] == 1, st
    time.sleep(1.0)  # a fourth attempt would start now
    h = history(hosts)
    assert [a["outcome"] for a in h] == ["crashed"] * 3, h
    assert starts(tmp_path) == ["fresh", "resume", "resume"]
    assert status(hosts)["state"] == "crashed"


def test_kill_never_restarts(tmp_path: Path, sshd, pct_host, ct: int) -> None:
    # a long attempt killed by opsctl: killed, no second attempt
    run = script_run(tmp_path, "ok_run.py", "--steps", "1000", "--step-time", "0.1", "--ckpt-dir",
                     str(tmp_path / "ckpt"), kill_grace=[5, 5], restart={"when": "on-failure", "max": 3, "backoff_s": 0.2})
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={"r": run})
    assert opsctl(hosts, "launch", "box", "r").returncode == 0
    assert opsctl(hosts, "kill", "box", "r").returncode == 0
    time.sleep(1.0)
    assert status(hosts)["state"] == "killed"
    (h,) = history(hosts)
    assert h["outcome"] == "killed" and h["run_end"] == "signal" and h["exit_code"] == 0, h
    assert h["checkpoint"] == str(tmp_path / "ckpt" / f"step{h['last_step']}.pt")  # the one the kill made

    # a crash, then `opsctl kill` during the back-off: the restart is cancelled
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={"r": flaky(tmp_path, 99, 3, 30.0)})
    assert opsctl(hosts, "launch", "box", "r").returncode == 0
    wait_for(hosts, lambda s: s["state"] == "restarting")
    # while it waits, nothing else takes the run over: launch and clean refuse (clean would drop the pid file)
    r = opsctl(hosts, "launch", "box", "r")
    assert r.returncode == commands.EXIT_REFUSED and "run is restarting (restart 1 of 3" in r.stderr, r.stderr
    r = opsctl(hosts, "clean", "box", "r")
    assert r.returncode == commands.EXIT_REFUSED and "restarting (the next attempt uses it)" in r.stderr, r.stderr
    r = opsctl(hosts, "kill", "box", "r")
    assert r.returncode == 0 and "restart cancelled: attempt 2 had exited 1" in " ".join(r.stderr.split()), r.stderr
    st = status(hosts)
    assert st["state"] == "killed", st
    assert [a["outcome"] for a in history(hosts)] == ["killed", "crashed", "refused"]
    assert starts(tmp_path) == ["fresh"]

    # the run's process killed by a signal (not by opsctl): a signal never restarts either
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={"r": run})
    assert opsctl(hosts, "launch", "box", "r").returncode == 0
    pid = status(hosts)["pid"]
    pct_host.pct("exec", str(ct), "--", sys.executable, "-c", f"import os; os.kill({pid}, 9)")
    st = wait_for(hosts, lambda s: s["proc_state"] == "exited")
    time.sleep(1.0)
    h = history(hosts)
    assert [a["outcome"] for a in h] == ["killed", "crashed", "refused", "killed"], h  # someone stopped it
    assert h[-1]["signal"] == "SIGKILL", h
    st = status(hosts)
    assert st["state"] == "killed" and st["proc_exit_code"] == 137 and st["reason"] == "by SIGKILL from outside opsctl"


def test_a_dflash_config_refusal_is_not_restarted(tmp_path: Path, sshd) -> None:
    """`dflash train` refusing its config (one `dflash: ...` line, exit 2) was a crash to the restart policy: three
    more attempts, each refused the same way, and three notifications. It is a refusal: one attempt, no restart."""
    (tmp_path / "bad.yaml").write_text("train:\n  max_stepz: 3\n")
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"r": {
        "workdir": str(tmp_path), "command": ["{python}", "-m", "dflash", "train", "--config", "bad.yaml", "--out",
                                              str(tmp_path / "out")],
        "log": "run.log", "events": "out/events.jsonl", "tmux_session": "rs-badcfg", "ready_timeout": 120,
        "clean_roots": [str(tmp_path)], "inductor_cache_dir": str(tmp_path / "cache"),
        "restart": {"when": "on-failure", "max": 2, "backoff_s": 0.3}}})
    try:
        r = opsctl(hosts, "launch", "box", "r")
        assert r.returncode == commands.EXIT_FAILED, r.stderr
        st = wait_for(hosts, lambda s: s["state"] == "refused")
        time.sleep(1.5)  # a restart would have started by now (back-off 0.3 s)
        h = history(hosts)
        assert [a["outcome"] for a in h] == ["refused"], h
        assert h[0]["exception"].startswith("dflash: bad.yaml:2: train.max_stepz: unknown field"), h
        assert status(hosts)["attempt"] == st["attempt"] == 1
    finally:
        opsctl(hosts, "clean", "box", "r")
