"""`opsctl kill` through SSH + pct: SIGINT, SIGTERM, SIGKILL over the whole process tree, checked in /proc.

The forker run has a child that ignores SIGINT/SIGTERM and a grandchild that left the process group (setsid).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import opsctl, script_run  # noqa: E402

from opsctl import commands  # noqa: E402

LIVE = """
import sys
alive = []
for p in sys.argv[1:]:
    try:
        with open(f"/proc/{p}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        continue
    if state not in ("Z", "X"):
        alive.append(int(p))
print(alive)
"""


def live_in_container(pct_host, vmid: int, pids: list[int]) -> list[int]:
    """Which of these container PIDs are alive, asked inside the container's PID namespace."""
    r = pct_host.pct("exec", str(vmid), "--", sys.executable, "-c", LIVE, *map(str, pids))
    return json.loads(r.stdout.strip())


def test_kill_forked_tree_escalates_and_leaves_nothing(tmp_path: Path, sshd, pct_host,
                                                        container: Callable[..., int]) -> None:
    vmid = container(200)
    marker = tmp_path / "pids"
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=vmid, runs={
        "fork": script_run(tmp_path, "forker.py", "--marker", str(marker), "--ckpt-dir", str(tmp_path / "ckpt"),
                           kill_grace=[1, 1])})
    r = opsctl(hosts, "launch", "box", "fork")
    assert r.returncode == 0, r.stderr
    pids = [int(p) for p in marker.read_text().split()]
    assert len(pids) == 6  # main, 3 children, 2 grandchildren
    assert live_in_container(pct_host, vmid, pids) == sorted(pids)
    r = opsctl(hosts, "kill", "box", "fork")
    assert r.returncode == commands.EXIT_OK, r.stderr
    # the stubborn child survives SIGINT and SIGTERM; SIGKILL ends it
    assert "sent SIGINT" in r.stderr and "sent SIGTERM" in r.stderr and "sent SIGKILL" in r.stderr
    assert "checkpoint written" in r.stderr and "run_end: reason signal" in r.stderr
    assert (tmp_path / "ckpt" / "step.pt").read_text() == "ckpt\n"
    # no NVML here: the GPU check is reported as not made, never as passed
    assert "skip gpu_released: NOT CHECKED: GPU memory release not confirmed, nvml unavailable" in r.stderr
    assert "ok   gpu_released" not in r.stderr
    assert "all 6 processes gone; GPU memory release not checked (no NVML)" in r.stderr
    assert live_in_container(pct_host, vmid, pids) == []
    st = json.loads(opsctl(hosts, "status", "box", "fork", "--json").stdout)[0]
    assert st["state"] == "killed" and st["proc_state"] == "exited"
    # killing again is harmless and says so
    r = opsctl(hosts, "kill", "box", "fork")
    assert r.returncode == 0 and "not running" in r.stderr


def test_kill_polite_run_stops_at_sigint(tmp_path: Path, sshd, container: Callable[..., int]) -> None:
    vmid = container(200)
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=vmid, runs={
        "ok": script_run(tmp_path, "ok_run.py", "--steps", "1000", "--step-time", "0.05",
                         "--ckpt-dir", str(tmp_path / "ckpt"), "--signal-log", str(tmp_path / "signals"),
                         kill_grace=[5, 5])})
    assert opsctl(hosts, "launch", "box", "ok").returncode == 0
    r = opsctl(hosts, "kill", "box", "ok")
    assert r.returncode == 0, r.stderr
    assert "sent SIGINT" in r.stderr and "sent SIGTERM" not in r.stderr
    # exactly one SIGINT: a second one means "exit at once, no checkpoint" to the training core
    assert (tmp_path / "signals").read_text() == "SIGINT\n"
    ckpts = list((tmp_path / "ckpt").iterdir())
    assert len(ckpts) == 1 and ckpts[0].name.startswith("step")
    st = json.loads(opsctl(hosts, "status", "box", "ok", "--json").stdout)[0]
    assert st["state"] == "killed" and st["end_reason"] == "signal" and st["exit_code"] == 0
    # the dashboard (its --once snapshot follows the run's stream) agrees with status: killed, not finished
    r = opsctl(hosts, "watch", "--once", "box:ok")
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert [s["state"] for s in snap] == ["killed"], snap
    assert "crashed" not in [a["key"] for a in snap[0]["alerts"]]


def test_kill_confirms_gpu_memory_released_through_nvml(tmp_path: Path) -> None:
    # NVML through the GPU stand-in (tests/runs/fake_nvml): the run's processes hold memory while alive.
    from agentlib import cleanup, drive, nvml_env, of, run_args

    marker = tmp_path / "pids"
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"gpus": [{"pids_file": str(marker), "pids_used_mb": 8000}]}))
    env = nvml_env(state)
    args = run_args(tmp_path, "forker.py", "--marker", str(marker), kill_grace=[0.5, 0.5])
    try:
        rc, msgs = drive("launch", args, env=env)
        assert rc == 0
        rc, msgs = drive("kill", args, env=env)
        check = [c for c in of(msgs, "check") if c["name"] == "gpu_released"][0]
        assert rc == 0 and check["ok"], check
        assert "no process of the run holds GPU memory (checked 6 before the kill)" in check["detail"]
        # a context that outlives the run and is not visible from here (NVML shows host pids in a container)
        state.write_text(json.dumps({"gpus": [{"pids_file": str(marker), "hidden_pids": [4000000]}]}))
        assert drive("launch", {**args, "options": {"force": True}}, env=env)[0] == 0
        rc, msgs = drive("kill", {**args, "options": {"gpu_release_wait": 0.5}}, env=env)
        check = [c for c in of(msgs, "check") if c["name"] == "gpu_released"][0]
        assert rc == 1 and not check["ok"] and "gpu0 pid 4000000 512 MiB (hidden)" in check["detail"]
        assert of(msgs, "verdict")[0]["reason"] == "gpu_held"
    finally:
        cleanup(args)


def test_kill_finds_a_double_forked_daemon(tmp_path: Path, sshd, pct_host, container: Callable[..., int]) -> None:
    # The run forks, the child calls setsid and forks the daemon, the child exits: the daemon's parent is gone.
    vmid = container(200)
    marker = tmp_path / "daemon"
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=vmid, runs={
        "d": script_run(tmp_path, "daemonizer.py", "--marker", str(marker), kill_grace=[0.5, 0.5])})
    r = opsctl(hosts, "launch", "box", "d")
    assert r.returncode == 0, r.stderr
    daemon, ppid = (int(x) for x in marker.read_text().split())
    assert live_in_container(pct_host, vmid, [daemon]) == [daemon]
    r = opsctl(hosts, "kill", "box", "d")
    assert live_in_container(pct_host, vmid, [daemon]) == [], r.stderr  # found and killed, not left running
    assert r.returncode == commands.EXIT_OK, r.stderr
    # the main process stops at SIGINT; the daemon ignores SIGINT and SIGTERM, so SIGKILL is what ends it
    assert "sent SIGKILL" in r.stderr and "killed d: all 2 processes gone" in r.stderr, r.stderr
    assert "could not be tracked" not in r.stderr
    info = json.loads((tmp_path / ".opsctl" / "d" / "pid").read_text())
    assert info["subreaper"] is True and ppid == info["wrapper_pid"]  # adopted by the wrapper, not by pid 1
    assert live_in_container(pct_host, vmid, [info["wrapper_pid"]]) == []  # the wrapper reaped it, then left


def test_kill_says_when_detached_descendants_cannot_be_tracked(tmp_path: Path) -> None:
    # Where prctl(PR_SET_CHILD_SUBREAPER) is unavailable (not Linux) the wrapper records why; kill must not
    # claim everything is gone without saying that double-forked daemons were out of its sight.
    from agentlib import cleanup, drive, of, run_args

    args = run_args(tmp_path, "ok_run.py", "--steps", "100000", "--step-time", "0.05", "--load-time", "0",
                    kill_grace=[2, 2])
    try:
        assert drive("launch", args)[0] == 0
        pid_file = tmp_path / "state" / "pid"
        info = json.loads(pid_file.read_text())
        assert info["subreaper"] is True and info["subreaper_error"] is None  # Linux: tracked
        pid_file.write_text(json.dumps({**info, "subreaper": False,
                                        "subreaper_error": "prctl(PR_SET_CHILD_SUBREAPER) unavailable: no prctl"}))
        rc, msgs = drive("kill", args)
        verdict = of(msgs, "verdict")[0]
        assert rc == 0 and verdict["reason"] == "killed"
        assert verdict["detail"].startswith("all 1 processes gone"), verdict
        assert "detached descendants (double-forked daemons) could not be tracked: prctl(PR_SET_CHILD_SUBREAPER) " \
               "unavailable: no prctl" in verdict["detail"]
    finally:
        cleanup(args)
