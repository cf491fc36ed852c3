"""`opsctl launch` end to end through a real sshd and the `pct` stand-in (PID + mount namespaces), plus local.

Ready verdict, crash reported within 1 s of the death with its traceback, hang -> timeout naming the phase.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import kill_tmux, opsctl, script_run, tiny_run  # noqa: E402

from opsctl import commands  # noqa: E402


@pytest.fixture
def ct(container: Callable[..., int]) -> int:
    return container(200)


def test_launch_ready_over_ssh_pct_then_status(tmp_path: Path, sshd, ct: int) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={
        "ok": script_run(tmp_path, "ok_run.py", "--steps", "3", "--step-time", "0.3")})
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "stale.so").write_bytes(b"x" * 100)
    r = opsctl(hosts, "launch", "box", "ok")
    assert r.returncode == commands.EXIT_OK, r.stderr
    assert "container 200 running" in r.stderr and "READY ok: first step event" in r.stderr
    assert "loading model" in r.stdout  # the log was streamed live
    assert not (tmp_path / "cache" / "stale.so").exists()  # the inductor cache was cleared first
    r = opsctl(hosts, "status", "box", "ok", "--json")
    (st,) = json.loads(r.stdout)
    assert r.returncode == 0 and st["state"] in ("training", "finished") and st["step"] >= 1, st
    assert st["pid"] is not None and st["nvml"].startswith("unavailable (")


def test_launch_follow_local_exits_with_run_status(tmp_path: Path, sshd) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", local_runs={
        "ok": script_run(tmp_path, "ok_run.py", "--steps", "3", "--step-time", "0.05", tmux_session="opsctl-t-follow")})
    try:
        r = opsctl(hosts, "launch", "local", "ok", "--follow")
    finally:
        kill_tmux(tmp_path, "ok")
    assert r.returncode == 0, r.stderr
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("step ")] == [
        "step 1 loss 5.000", "step 2 loss 2.500", "step 3 loss 1.667"]
    assert "run ended: completed" in r.stdout and "finished" in r.stderr


def test_crash_during_loading_reported_within_1s(tmp_path: Path, sshd, ct: int) -> None:
    marker = tmp_path / "died_at"
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={
        "crash": script_run(tmp_path, "crash_loading.py", "--marker", str(marker), "--delay", "0.5")})
    r = opsctl(hosts, "launch", "box", "crash")
    done = time.time()
    assert r.returncode == commands.EXIT_FAILED, r.stderr
    died = float(marker.read_text())
    print(f"crash reported {done - died:.3f} s after the raise (client exit)")
    assert done - died < 1.0, f"crash reported {done - died:.2f} s after the raise"
    assert "before it was ready, in phase loading_target 2/4" in r.stderr
    assert "Traceback (most recent call last)" in r.stderr
    assert "FileNotFoundError: /dev/shm/model/shard-2.safetensors" in r.stderr
    st = json.loads(opsctl(hosts, "status", "box", "crash", "--json").stdout)[0]
    assert st["state"] == "crashed" and st["exit_code"] == 1


def test_a_crash_before_any_event_says_so_not_a_phase_called_no_telemetry_events(tmp_path: Path, sshd) -> None:
    """It read `before it was ready, in phase no telemetry events`."""
    run = script_run(tmp_path, "ok_run.py", tmux_session="opsctl-t-noevents")
    run["command"] = ["{python}", "-c", "raise ValueError('bad thing happened')"]
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", local_runs={"early": run})
    try:
        r = opsctl(hosts, "launch", "local", "early")
    finally:
        kill_tmux(tmp_path, "early")
    assert r.returncode == commands.EXIT_FAILED, r.stderr
    assert "run exited with status 1 before it was ready, before its first telemetry event" in r.stderr
    assert "ValueError: bad thing happened" in r.stderr and "phase no telemetry" not in r.stderr


def test_a_command_that_cannot_start_says_why_in_status_too(tmp_path: Path, sshd) -> None:
    """history said `cannot start ... No such file or directory`, status only `crashed (exit 127)`."""
    run = script_run(tmp_path, "ok_run.py", tmux_session="opsctl-t-nocmd")
    run["command"] = [str(tmp_path / "no-such-python"), "train.py"]
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", local_runs={"nocmd": run})
    try:
        assert opsctl(hosts, "launch", "local", "nocmd").returncode == commands.EXIT_FAILED
    finally:
        kill_tmux(tmp_path, "nocmd")
    (st,) = json.loads(opsctl(hosts, "status", "local", "nocmd", "--json").stdout)
    assert st["state"] == "crashed" and st["exit_code"] == 127, st
    assert st["reason"].startswith(f"opsctl: cannot start ['{tmp_path / 'no-such-python'}', 'train.py']: [Errno 2]")


def test_hang_before_ready_times_out_naming_the_phase(tmp_path: Path, sshd, ct: int) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={
        "hang": script_run(tmp_path, "hang_loading.py", "--heartbeat", "0.3", ready_timeout=2, kill_grace=[1, 1])})
    r = opsctl(hosts, "launch", "box", "hang")
    assert r.returncode == commands.EXIT_TIMEOUT, r.stderr
    assert "stuck in phase loading_target 3/8" in r.stderr and "left running" in r.stderr
    st = json.loads(opsctl(hosts, "status", "box", "hang", "--json").stdout)[0]
    assert st["state"] == "loading" and st["proc_state"] == "running" and st["phase_i"] == 3  # left alone
    assert opsctl(hosts, "kill", "box", "hang").returncode == 0


def test_launch_refused_when_container_stopped(tmp_path: Path, sshd, container: Callable[..., int]) -> None:
    vmid = container(201, start=False)
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=vmid, runs={"ok": script_run(tmp_path, "ok_run.py")})
    r = opsctl(hosts, "launch", "box", "ok")
    assert r.returncode == commands.EXIT_REFUSED
    assert "container 201 is stopped" in r.stderr and not (tmp_path / "run.log").exists()


def test_help_teaches_examples_and_exit_codes() -> None:
    r = opsctl(Path("hosts.yaml"), "--help")
    assert r.returncode == 0 and "opsctl launch local tiny --follow" in r.stdout
    for code, what in [(0, "ok"), (1, "run failed"), (2, "bad command line"), (3, "unreachable"), (5, "refused")]:
        assert f" {code} " in r.stdout and what in r.stdout, (code, what)
    r = opsctl(Path("/nonexistent/hosts.yaml"), "status", "local")
    assert r.returncode == commands.EXIT_USAGE and "file not found" in r.stderr


@pytest.mark.slow
def test_real_tiny_run_ready_then_kill_writes_checkpoint(tmp_path: Path, sshd, ct: int) -> None:
    """The training core's embedded default through SSH + pct: ready at its first step; kill -> checkpoint."""
    out = tmp_path / "tiny"
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={"tiny": tiny_run(tmp_path)})
    r = opsctl(hosts, "launch", "box", "tiny", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "READY tiny: first step event" in r.stderr and "phase building_drafter" in r.stderr
    lines = (out / "train.log").read_text().splitlines()
    assert len(lines) == len(set(lines))  # the log is written by dflash and by our tee: no line twice
    r = opsctl(hosts, "kill", "box", "tiny", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "sent SIGINT" in r.stderr and "sent SIGTERM" not in r.stderr and "checkpoint written" in r.stderr
    st = json.loads(opsctl(hosts, "status", "box", "tiny", "--json").stdout)[0]
    assert st["state"] == "killed" and st["end_reason"] == "signal" and st["exit_code"] == 0
    ckpt = Path(st["last_checkpoint"])
    assert ckpt.is_dir() and (ckpt / "manifest.json").is_file()


def test_launch_follow_survives_ssh_drop(tmp_path: Path, sshd, ct: int, drop_ssh) -> None:
    import os
    import subprocess
    import threading

    n = 1500
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={
        "chat": script_run(tmp_path, "chatty.py", "--lines", str(n), "--interval", "0.002",
                           ready_pattern="^line 000000 ", events=None)})
    proc = subprocess.Popen([sys.executable, "-m", "opsctl", "--hosts", str(hosts), "launch", "box", "chat",
                             "--follow"], cwd=str(Path(__file__).resolve().parent.parent), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, NO_COLOR="1"))
    got: list[str] = []
    drops: list[int] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            got.append(line.rstrip("\n"))
            if len(got) == 200:
                drops.append(drop_ssh())

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout=120)
    rc = proc.wait(timeout=10)
    err = proc.stderr.read() if proc.stderr else ""
    assert drops and drops[0] >= 1, drops
    assert rc == 0, err
    assert "reconnecting" in err
    assert [ln.split()[1] for ln in got if ln.startswith("line ")] == [f"{i:06d}" for i in range(n)]


def test_hosts_check_and_unknown_names(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parent.parent
    r = opsctl(repo / "hosts.yaml", "hosts", "check")
    assert r.returncode == 0 and "local (local): tiny" in r.stdout
    bad = tmp_path / "hosts.yaml"
    bad.write_text("hosts:\n  box:\n    local: true\n    runs:\n      r:\n        workdir: /tmp\n        log: x.log\n"
                   "        command: [true]\n        ready_timeout: -3\n")
    r = opsctl(bad, "hosts", "check")
    assert r.returncode == commands.EXIT_USAGE and f"{bad}:9" in r.stderr and "ready_timeout" in r.stderr
    r = opsctl(repo / "hosts.yaml", "launch", "local", "tinny")
    assert r.returncode == commands.EXIT_USAGE and "did you mean 'tiny'" in r.stderr


def test_hostile_paths_and_args_reach_the_run_verbatim(tmp_path: Path, sshd, ct: int) -> None:
    """Paths and argv with spaces, quotes, $(), ; and backticks cross SSH + pct + the agent as plain data."""
    evil = "we ird $(touch PWNED) 'q' \"d\";`touch PWNED2`"
    work = tmp_path / evil
    work.mkdir()
    arg = "$(touch PWNED3); echo hi 'x' \"y\""
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={"evil": {
        "workdir": str(work), "command": ["{python}", "-c", "import sys, os; print('ARG=' + sys.argv[1]); "
                                          "print('CWD=' + os.getcwd())", arg],
        "log": "a log $(x).txt", "ready_pattern": "^CWD=", "inductor_cache_dir": str(work / "cache $(y)"),
        "clean_roots": [str(work)], "tmux_session": "evil-$(z)"}})
    r = opsctl(hosts, "launch", "box", "evil")
    assert r.returncode == 0, r.stderr
    assert f"ARG={arg}" in r.stdout and f"CWD={work}" in r.stdout
    assert (work / "a log $(x).txt").read_text().startswith(f"ARG={arg}\n")
    for name in ("PWNED", "PWNED2", "PWNED3"):
        for where in (Path.home(), Path("/"), Path(__file__).resolve().parent.parent):
            assert not (where / name).exists()
        assert not list(tmp_path.rglob(name))


def test_launch_waits_for_ready_across_ssh_drop(tmp_path: Path, sshd, ct: int, drop_ssh) -> None:
    import os
    import subprocess

    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={
        "ok": script_run(tmp_path, "ok_run.py", "--steps", "3", "--step-time", "0.2", "--load-time", "2")})
    proc = subprocess.Popen([sys.executable, "-m", "opsctl", "--hosts", str(hosts), "launch", "box", "ok"],
                            cwd=str(Path(__file__).resolve().parent.parent), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, NO_COLOR="1"))
    assert proc.stdout is not None
    assert proc.stdout.readline() == "loading model\n"  # the run is loading: cut the link now
    assert drop_ssh() >= 1
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "reconnecting" in err and "READY ok: first step event (after a reconnect)" in err
    assert "loading model" not in out  # resumed at the offset: the line is not shown twice


def _local_hosts(path: Path, runs: dict[str, dict]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({"hosts": {"local": {"local": True, "runs": runs}}}, sort_keys=False))
    return path


COUNTING_CRASH = ("import pathlib; p = pathlib.Path('n'); n = int(p.read_text()) + 1 if p.exists() else 1; "
                  "p.write_text(str(n)); print(f'attempt {n}', flush=True); raise RuntimeError(f'boom {n}')")


def test_relaunch_keeps_every_attempts_log_and_logs_all_shows_them(tmp_path: Path) -> None:
    """Launch rotates the log (LOG.1 ... LOG.keep_logs) instead of truncating it: the traceback that made the
    user relaunch survives; `logs` shows the current attempt, `logs --all` every one; `clean --logs` removes them."""
    hosts = _local_hosts(tmp_path / "hosts.yaml", {"r": {
        "workdir": str(tmp_path), "command": ["{python}", "-c", COUNTING_CRASH], "log": "run.log",
        "inductor_cache_dir": "cache", "keep_logs": 2, "tmux_session": "rotate-logs", "ready_timeout": 30}})
    log = tmp_path / "run.log"
    try:
        for _ in range(2):
            r = opsctl(hosts, "launch", "local", "r")
            assert r.returncode == commands.EXIT_FAILED, r.stderr
        assert "attempt 2" in log.read_text() and "attempt 1" not in log.read_text()
        first = (tmp_path / "run.log.1").read_text()
        assert "attempt 1" in first and "RuntimeError: boom 1" in first  # the earlier traceback is kept
        assert "earlier attempt's log kept as run.log.1" in " ".join(r.stderr.split())
        r = opsctl(hosts, "logs", "local", "r")
        assert r.returncode == 0 and "attempt 2" in r.stdout and "attempt 1" not in r.stdout
        r = opsctl(hosts, "logs", "local", "r", "--all")
        out = r.stdout.splitlines()
        h1 = out.index(f"=== attempt 1 of 2 (earlier attempt): {log}.1 ===")
        h2 = out.index(f"=== attempt 2 of 2 (current attempt): {log} ===")
        assert h1 < out.index("attempt 1") < h2 < out.index("attempt 2")
        assert "RuntimeError: boom 1" in out[h1:h2] and "RuntimeError: boom 2" in out[h2:]
        for _ in range(2):
            r = opsctl(hosts, "launch", "local", "r")
        assert "(the oldest, run.log.2, dropped: keep_logs 2)" in " ".join(r.stderr.split())
        assert [p.name for p in sorted(tmp_path.glob("run.log*"))] == ["run.log", "run.log.1", "run.log.2"]
        assert "attempt 4" in log.read_text() and "attempt 2" in (tmp_path / "run.log.2").read_text()
        r = opsctl(hosts, "clean", "local", "r")
        assert r.returncode == 0 and (tmp_path / "run.log.1").exists()  # only removed when asked
        r = opsctl(hosts, "clean", "local", "r", "--logs")
        assert r.returncode == 0 and f"removed {log}.2" in r.stdout and f"removed {log}.1" in r.stdout
        assert [p.name for p in tmp_path.glob("run.log*")] == ["run.log"] and "attempt 4" in log.read_text()
    finally:
        kill_tmux(tmp_path, "r")


def _files(root: Path) -> dict[str, tuple[bytes, int]]:
    # the attempt history (and its lock) is what a refused launch adds: the refusal is an attempt too
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in ("hosts.yaml", "history.jsonl", "history.lock")}


def test_relaunch_of_a_finished_run_is_refused_and_leaves_it_finished(tmp_path: Path) -> None:
    run = script_run(tmp_path, "ok_run.py", "--steps", "2", "--step-time", "0.05", "--load-time", "0",
                     tmux_session="finished-twice")
    hosts = _local_hosts(tmp_path / "hosts.yaml", {"done": run})
    try:
        assert opsctl(hosts, "launch", "local", "done", "--follow").returncode == 0
        st = json.loads(opsctl(hosts, "status", "local", "done", "--json").stdout)[0]
        assert (st["state"], st["step"], st["total_steps"]) == ("finished", 2, 2)
        deadline = time.monotonic() + 30  # under load the wrapper's pipe drain may land a moment after exit
        while "run ended: completed" not in (tmp_path / "run.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        before = _files(tmp_path)
        r = opsctl(hosts, "launch", "local", "done")
        flat = " ".join(r.stderr.split())
        assert r.returncode == commands.EXIT_REFUSED, r.stderr
        assert "already finished: step 2 of 2" in flat and "--fresh" in flat and "raise the step count" in flat
        assert _files(tmp_path) == before  # log, events, state files: not one byte or mtime changed
        last = json.loads((tmp_path / ".opsctl" / "done" / "history.jsonl").read_text().splitlines()[-1])
        assert last["outcome"] == "refused" and "already finished: step 2 of 2" in last["reason"]
        st = json.loads(opsctl(hosts, "status", "local", "done", "--json").stdout)[0]
        assert (st["state"], st["step"], st["total_steps"], st["exit_code"]) == ("finished", 2, 2, 0)
        # raising the step count (a changed command) trains again
        run["command"] = [a if a != "2" else "3" for a in run["command"]]
        hosts = _local_hosts(tmp_path / "hosts.yaml", {"done": run})
        r = opsctl(hosts, "launch", "local", "done", "--follow")
        assert r.returncode == 0, r.stderr
        st = json.loads(opsctl(hosts, "status", "local", "done", "--json").stdout)[0]
        assert (st["state"], st["step"], st["total_steps"]) == ("finished", 3, 3)
    finally:
        kill_tmux(tmp_path, "done")
