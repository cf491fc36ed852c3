"""Notifications through a real sshd and the `pct` stand-in: the run's wrapper runs the `notify` argv on the host on
crashed / finished / stalled / restarting, once per transition, without blocking the run; failures are logged.

The notify command appends its environment to a file, as a `curl` to ntfy or a mail command would send it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import opsctl, script_run  # noqa: E402

from opsctl import commands  # noqa: E402


@pytest.fixture
def ct(container: Callable[..., int]) -> int:
    return container(200)


def recorder(out: Path) -> list[str]:
    """A notify argv that appends one line per notification: host|run|attempt|state|step|reason."""
    return ["sh", "-c", 'echo "$OPSCTL_HOST|$OPSCTL_RUN|$OPSCTL_ATTEMPT|$OPSCTL_STATE|$OPSCTL_STEP|$OPSCTL_REASON"'
            f' >> {out}']


def hosts_with_notify(sshd: Any, path: Path, ct: int, runs: dict[str, Any], notify: list[str]) -> Path:
    """hosts.yaml with `notify` on the host (the runs inherit it unless they set their own)."""
    sshd.write_hosts_yaml(path, pct=ct, runs=runs)
    doc = yaml.safe_load(path.read_text())
    doc["hosts"]["box"]["notify"] = notify
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def lines(p: Path, n: int, timeout: float = 30) -> list[list[str]]:
    """The notifications once there are at least n (they arrive from a thread of the wrapper)."""
    deadline = time.monotonic() + timeout
    while True:
        got = [ln.split("|", 5) for ln in p.read_text().splitlines()] if p.exists() else []
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def state(hosts: Path) -> dict[str, Any]:
    r = opsctl(hosts, "status", "box", "r", "--json")
    st = json.loads(r.stdout)
    return st[0] if isinstance(st, list) else st


def test_notify_on_restarting_and_finished_once_each(tmp_path: Path, sshd, ct: int) -> None:
    out = tmp_path / "notes"
    run = script_run(tmp_path, "flaky.py", "--counter", str(tmp_path / "counter"), "--fail-times", "1",
                     restart={"when": "on-failure", "max": 2, "backoff_s": 0.5, "resume_args": ["--resume"]})
    hosts = hosts_with_notify(sshd, tmp_path / "hosts.yaml", ct, {"r": run}, recorder(out))
    assert opsctl(hosts, "launch", "box", "r", "--follow").returncode == commands.EXIT_OK
    got = lines(out, 2)
    time.sleep(1.0)  # nothing more may come
    assert lines(out, 2) == got and len(got) == 2, got
    restarting, finished = got
    assert restarting[:5] == ["box", "r", "1", "restarting", "1"], restarting
    assert "RuntimeError: flaky failure 1 (test crash) (exit 1); restart 1 of 2 in 0.5 s" in restarting[5]
    assert finished == ["box", "r", "2", "finished", "3", "exit 0"], finished
    log = (tmp_path / ".opsctl" / "r" / "notify.log").read_text()
    assert log.count(" ok restarting attempt 1: sh -c ") == 1 and log.count(" ok finished attempt 2: ") == 1, log


def test_notify_on_crash_at_the_restart_limit_and_its_failure_logged(tmp_path: Path, sshd, ct: int) -> None:
    out = tmp_path / "notes"
    failing = ["sh", "-c", f'echo "$OPSCTL_STATE" >> {out}; echo "ntfy said no" >&2; exit 7']
    run = script_run(tmp_path, "flaky.py", "--counter", str(tmp_path / "counter"), "--fail-times", "9",
                     restart={"when": "on-failure", "max": 1, "backoff_s": 0.2})
    hosts = hosts_with_notify(sshd, tmp_path / "hosts.yaml", ct, {"r": run}, failing)
    r = opsctl(hosts, "launch", "box", "r", "--follow")
    assert r.returncode == commands.EXIT_FAILED, r.stderr  # the failing notify command changed nothing
    assert [x[0] for x in lines(out, 2)] == ["restarting", "crashed"]
    log = tmp_path / ".opsctl" / "r" / "notify.log"
    deadline = time.monotonic() + 10
    while log.read_text().count("FAILED") < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    text = log.read_text()
    assert "FAILED crashed attempt 2: sh -c" in text and ": exit 7: ntfy said no" in text, text
    assert state(hosts)["state"] == "crashed"


def test_notify_on_stall_once_never_blocks_and_kill_is_silent(tmp_path: Path, sshd, ct: int) -> None:
    out = tmp_path / "notes"
    slow = tmp_path / "slow"
    # a run that loads, then says nothing more (one heartbeat, the next one in an hour); its own notify command
    # (over the host's) records, then sleeps 60 s: the run and opsctl must not wait for it (60, not 20: launch, stall
    # and kill take over 20 s on a loaded machine, e.g. under xdist beside other test runs)
    run = script_run(tmp_path, "hang_loading.py", "--heartbeat", "3600", stall_after=1.5, ready_timeout=2,
                     notify=["sh", "-c", f'echo "$OPSCTL_STATE|$OPSCTL_REASON" >> {out}; sleep 60; touch {slow}'])
    hosts = hosts_with_notify(sshd, tmp_path / "hosts.yaml", ct, {"r": run}, recorder(tmp_path / "host-notes"))
    t0 = time.monotonic()
    r = opsctl(hosts, "launch", "box", "r")
    assert r.returncode == commands.EXIT_TIMEOUT, r.stderr  # it only loads: never ready, left running
    got = lines(out, 1, timeout=30)
    assert [g[0] for g in got] == ["stalled"] and "no heartbeat, phase or step for" in got[0][1], got
    assert "(stall_after 2 s)" in got[0][1]
    time.sleep(3.0)
    assert len(lines(out, 1)) == 1  # once per stall, not once per check
    assert state(hosts)["state"] == "stalled"
    # the notify command still sleeps: kill ends the run at once, the sleeper is not taken for a leftover of the
    # run, and a kill notifies nothing
    k = opsctl(hosts, "kill", "box", "r")
    assert k.returncode == 0, k.stderr
    st = state(hosts)
    assert time.monotonic() - t0 < 60 and not slow.exists()
    assert st["state"] == "killed" and st["leftover_pids"] == [] and st["reason"] is None, st
    time.sleep(1.0)
    assert len(lines(out, 1)) == 1 and not (tmp_path / "host-notes").exists()


def run_ok_and_collect(tmp_path: Path, sshd: Any, ct: int, n: int, *args: str) -> list[list[str]]:
    """tests/runs/ok_run.py with `args`, launched and followed to its end with the recorder as notify: its n
    notifications, checked to be all of them (nothing more comes a second later)."""
    out = tmp_path / "notes"
    run = script_run(tmp_path, "ok_run.py", *args)
    hosts = hosts_with_notify(sshd, tmp_path / "hosts.yaml", ct, {"r": run}, recorder(out))
    assert opsctl(hosts, "launch", "box", "r", "--follow").returncode == commands.EXIT_OK
    got = lines(out, n)
    time.sleep(1.0)  # nothing more may come
    assert lines(out, n) == got and len(got) == n, got
    return got


def test_notify_on_disk_full_once_per_episode_then_finished(tmp_path: Path, sshd, ct: int) -> None:
    """A checkpoint that did not fit notifies once; more of the same do not until a checkpoint fits again."""
    got = run_ok_and_collect(tmp_path, sshd, ct, 3, "--steps", "6", "--step-time", "0.6", "--disk-full-steps",
                             "2,3,5", "--checkpoint-steps", "4")
    assert [g[3:5] for g in got] == [["disk_full", "2"], ["disk_full", "5"], ["finished", "6"]], got
    assert got[0][5] == "checkpoint step-2 not saved: No space left on device"


def test_notify_on_slowdown_once_per_episode(tmp_path: Path, sshd, ct: int) -> None:
    """A run whose step events say it got slower (`pace` >= 1.3) notifies once; again only after it was back to
    speed. A step a second apart: the wrapper, polling twice a second, sees each."""
    got = run_ok_and_collect(tmp_path, sshd, ct, 3, "--steps", "7", "--step-time", "1.0", "--paces",
                             ",1.4,1.5,1.0,1.0,1.35,")
    assert [g[3:5] for g in got] == [["slowdown", "2"], ["slowdown", "6"], ["finished", "7"]], got
    assert got[0][5].startswith("step time 0.70 s at step 2 (median of its last 100 steps), 1.40x the 0.50 s"), got


def test_notify_on_allocator_retries_once_per_episode(tmp_path: Path, sshd, ct: int) -> None:
    """Heartbeats whose gpu_alloc_retries rise while training (ten minutes in: the memory rules' settling time)
    notify `alloc_retries` once; again only after ten minutes without one (their clock: two minutes a step)."""
    got = run_ok_and_collect(tmp_path, sshd, ct, 3, "--steps", "10", "--step-time", "1.0", "--alloc-retries",
                             "0,0,1,1,1,1,1,1,2,2")
    assert [g[3:5] for g in got] == [["alloc_retries", "3"], ["alloc_retries", "9"], ["finished", "10"]], got
    assert got[0][5].startswith("rank 0: 1 allocator retries in 4 min (steps 1-3; 1 since its process started): "
                                "the CUDA caching allocator had to free its whole cache"), got


def test_the_wrapper_tells_memory_growth_once_by_the_alerts_rule(tmp_path: Path) -> None:
    """EventsWatch (the wrapper's reader of the events file) over a real events file: GPU reserved memory that grew
    past the memory_growth margin is told once, with watch's evidence, and not again while it lasts."""
    from dflash.telemetry import EventWriter
    from opsctl.alerts import AlertTracker
    from opsctl.remote.rules import MEM_SETTLE_S
    from opsctl.remote.wrapper import EventsWatch

    path = tmp_path / "events.jsonl"
    path.touch()
    watch = EventsWatch(str(path), None)
    w = EventWriter(path, run_id="r")
    events = [w.emit("phase", phase="training")]
    t0 = events[0]["ts"]
    for i in range(48):  # 4 minutes of heartbeats from the settling time on; +20 GiB reserved after the first two
        ts = t0 + MEM_SETTLE_S + 5 * i
        events.append(w.emit("heartbeat", ts=ts, phase="training", step=100 + i, rss_mb=100.0, gpu_mem_mb=60000.0,
                             gpu_reserved_mb=70000.0 + (20480.0 if i >= 24 else 0.0)))
    w.close()
    watch.poll()
    told = watch.take_memory()
    assert told == [("memory_growth", 147, "rank 0 GPU reserved 68.4 GiB at step 100 -> 88.4 GiB at step 147 "
                                           "(+20.0 GiB in 0.1 h)")]
    assert watch.take_memory() == []  # the same episode
    tracker = AlertTracker()  # watch's alert: the same evidence from the same events
    for ev in events:
        tracker.observe({"t": "event", "event": ev})
    assert tracker.memory.growth() == told[0][2]
