"""`opsctl logs` through SSH + pct: last N lines, and `-f` across forced SSH drops with nothing lost or repeated.

The drops kill the per-connection sshd processes by PID, which is what a network drop does to the session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import REPO, kill_tmux, opsctl, script_run  # noqa: E402

N_LINES = 2000


def test_logs_tail_and_follow_across_ssh_drops(tmp_path: Path, sshd, drop_ssh: Callable[[], int],
                                               container: Callable[..., int]) -> None:
    vmid = container(200)
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=vmid, runs={
        "chat": script_run(tmp_path, "chatty.py", "--lines", str(N_LINES), "--interval", "0.005",
                           "--start-delay", "0.3", ready_pattern="^line 000000 ", events=None)})
    r = opsctl(hosts, "launch", "box", "chat")
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1")
    proc = subprocess.Popen([sys.executable, "-m", "opsctl", "--hosts", str(hosts), "logs", "box", "chat", "-f",
                             "-n", str(10 * N_LINES)], cwd=str(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    got: list[str] = []
    drops: list[int] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            got.append(line.rstrip("\n"))
            if len(got) in (300, 900):
                # Lines already read ahead into the pipe can reach 900 while the follower is still reconnecting
                # from the first cut (a loaded machine): cut its next connection, once it has one.
                deadline = time.monotonic() + 15
                while not (n := drop_ssh()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                drops.append(n)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout=120)
    rc = proc.wait(timeout=10)
    err = proc.stderr.read() if proc.stderr else ""
    assert rc == 0, err
    assert drops and all(n >= 1 for n in drops), drops  # the connection really was cut, twice
    assert err.count("link lost") >= 2 and "reconnecting" in err
    numbers = [ln.split()[1] for ln in got if ln.startswith("line ")]
    assert numbers == [f"{i:06d}" for i in range(N_LINES)]  # none lost, none repeated, in order
    # and the plain tail: exactly the last 3 lines
    r = opsctl(hosts, "logs", "box", "chat", "-n", "3")
    assert r.returncode == 0
    assert [ln.split()[1] for ln in r.stdout.splitlines()] == [f"{i:06d}" for i in range(N_LINES - 3, N_LINES)]


def test_logs_follow_reports_truncation(tmp_path: Path, sshd) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={
        "t": script_run(tmp_path, "chatty.py", "--lines", "5", "--linger", "10", ready_pattern="^line 000004 ",
                        events=None, tmux_session="logs-trunc")})
    request_cleanup = kill_tmux  # the run lives in a tmux server on this machine (no container to stop)
    try:
        _follow_truncated(hosts, tmp_path)
    finally:
        request_cleanup(tmp_path, "t")


def _follow_truncated(hosts: Path, tmp_path: Path) -> None:
    assert opsctl(hosts, "launch", "box", "t").returncode == 0
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1")
    proc = subprocess.Popen([sys.executable, "-m", "opsctl", "--hosts", str(hosts), "logs", "box", "t", "-f"],
                            cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    first = [proc.stdout.readline() for _ in range(5)]
    assert first[-1].startswith("line 000004")
    log = tmp_path / "run.log"
    log.write_text("after truncation\n")
    assert proc.stdout.readline() == "after truncation\n"
    t0 = time.monotonic()
    rc = proc.wait(timeout=20)
    assert rc == 0 and time.monotonic() - t0 < 15  # at the run's end (its 10 s linger), not at a timeout
    assert "log truncated" in (proc.stderr.read() if proc.stderr else "")


def test_watch_source_resumes_at_offsets(tmp_path: Path, sshd) -> None:
    """The source `opsctl watch` follows runs with: each messages() call is one connection, resumed exactly."""
    from opsctl import commands

    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={
        "c": script_run(tmp_path, "chatty.py", "--lines", "40", "--interval", "0.01", "--linger", "30",
                        ready_pattern="^line 000000 ",
                        events=None, tmux_session="watch-src")})
    try:
        assert opsctl(hosts, "launch", "box", "c").returncode == 0
        ctx = commands.Ctx(hosts_file=str(hosts))
        (src,) = commands.watch_sources(ctx, ["box:c"])
        assert src.label == "box:c"
        got: list[str] = []

        def consume() -> None:
            for _ in range(4):  # four connections, each cut after a few lines (as a dropped link would be)
                n = 0
                for m in src.messages():
                    if m["t"] == "log" and m["line"].startswith("line "):
                        got.append(m["line"].split()[1])
                        n += 1
                    if n == 10 or len(got) == 40:
                        break

        worker = threading.Thread(target=consume, daemon=True)  # a lost line would block: bound the wait
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), f"stream stalled after {len(got)} lines"
        assert got == [f"{i:06d}" for i in range(40)]
        src.kill()
        assert src.last_rc == 0 and ("killed" in src.last_output or "not running" in src.last_output)
    finally:
        kill_tmux(tmp_path, "c")


def _follow_err(hosts: Path, *argv: str, timeout: float = 60) -> tuple[int, str, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "opsctl", "--hosts", str(hosts), *argv], cwd=str(REPO),
                       capture_output=True, text=True, timeout=timeout, env=dict(os.environ, NO_COLOR="1", COLUMNS="200"))
    return r.returncode, " ".join(r.stderr.split()), time.monotonic() - t0


def test_follow_exits_3_at_once_on_permanent_errors(tmp_path: Path, sshd) -> None:
    """Host key unknown or changed, authentication refused, unknown host: `logs -f` and `launch --follow` exit 3
    with the message on the first try; retrying cannot help until a person acts."""
    from harness.sshd import keygen  # tests/ is on sys.path (conftest.py)

    run = {"r": script_run(tmp_path, "ok_run.py")}
    empty_kh = tmp_path / "empty_known_hosts"
    empty_kh.write_text("")
    other = keygen(tmp_path / "other_key", "other")
    changed_kh = tmp_path / "changed_known_hosts"
    changed_kh.write_text(f"[127.0.0.1]:{sshd.port} {' '.join(other.split()[:2])}\n")
    cases = [
        ({"known_hosts": str(empty_kh)}, "host key not in known_hosts"),
        ({"known_hosts": str(changed_kh)}, "HOST KEY MISMATCH"),
        ({"identity_file": str(tmp_path / "other_key")}, "authentication failed"),
        ({"host": "no-such-host.invalid"}, "cannot resolve host name 'no-such-host.invalid'"),
    ]
    for over, expect in cases:
        hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs=run, **over)
        for argv in (["logs", "box", "r", "-f"], ["launch", "box", "r", "--follow"]):
            rc, err, took = _follow_err(hosts, *argv)
            assert rc == 3 and expect in err, (over, argv, rc, err)
            assert "reconnecting" not in err and took < 30, (over, argv, took, err)


def test_follow_gives_up_after_reconnect_timeout_saying_each_retry(tmp_path: Path, sshd) -> None:
    """A link that stays lost (nothing listens on the port): retries with back-off, each on stderr, then exit 3
    after reconnect_timeout saying how long it tried."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # closed again: connections are refused
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"r": script_run(tmp_path, "ok_run.py")},
                                  port=dead_port)
    raw = (tmp_path / "hosts.yaml").read_text().replace("  box:\n", "  box:\n    reconnect_timeout: 2\n", 1)
    hosts.write_text(raw)
    rc, err, took = _follow_err(hosts, "logs", "box", "r", "-f")
    assert rc == 3, err
    assert 2 <= took < 30, took
    assert "attempt 1" in err and "attempt 2" in err and err.count("reconnecting in") >= 2, err
    assert "Connection refused" in err or "unreachable" in err, err
    assert "link lost and not back after trying for 2 s" in err and "reconnect_timeout 2 s" in err, err


def test_follow_with_reconnect_timeout_0_keeps_retrying(tmp_path: Path, sshd) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"r": script_run(tmp_path, "ok_run.py")},
                                  port=dead_port)
    hosts.write_text(hosts.read_text().replace("  box:\n", "  box:\n    reconnect_timeout: 0\n", 1))
    proc = subprocess.Popen([sys.executable, "-m", "opsctl", "--hosts", str(hosts), "logs", "box", "r", "-f"],
                            cwd=str(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, NO_COLOR="1", COLUMNS="300"))
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        for line in proc.stderr:  # back-off 0.2, 0.4, 0.8, 1.6 s (x jitter): attempt 5 comes within seconds
            seen.append(line)
            if "(attempt 5)" in line:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert any("(attempt 5)" in ln for ln in seen), seen
    assert not any("giving up" in ln or "not back after" in ln for ln in seen), seen


def test_reconnect_delay_backs_off_with_jitter() -> None:
    import random

    from opsctl import watch

    rng = random.Random(1)
    delays = [[watch.reconnect_delay(a, rng) for a in range(1, 9)] for _ in range(50)]
    for row in delays:
        for a, d in enumerate(row, start=1):
            base = min(watch.RECONNECT_CAP_S, watch.RECONNECT_BASE_S * 2 ** (a - 1))
            assert 0.5 * base <= d <= base
    assert len({row[3] for row in delays}) > 10  # jitter: followers of one host do not retry in lockstep
    assert max(row[-1] for row in delays) <= watch.RECONNECT_CAP_S


def test_logs_of_a_run_never_launched_says_so_and_exits_like_status(tmp_path: Path, sshd) -> None:
    """Printing nothing (or `-f` waiting forever on a log that never comes) told a newcomer nothing: one line, exit 0
    (as `status`, which shows the run `absent`), with or without -f, over a real sshd."""
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={
        "chat": script_run(tmp_path, "chatty.py", "--lines", "3", ready_pattern="^line ", events=None)})
    for extra in ([], ["-f"], ["--all"]):
        t0 = time.monotonic()
        r = opsctl(hosts, "logs", "box", "chat", *extra)
        assert r.returncode == 0 and r.stdout == "", (extra, r.stdout, r.stderr)
        assert "box/chat: no such run on box: never launched" in r.stderr, r.stderr
        assert "opsctl launch box chat" in r.stderr and time.monotonic() - t0 < 60
    r = opsctl(hosts, "launch", "box", "chat")
    assert r.returncode == 0, r.stderr
    try:
        r = opsctl(hosts, "logs", "box", "chat", "-n", "2")
        assert r.returncode == 0 and "never launched" not in r.stderr and r.stdout.strip(), r.stderr
    finally:
        opsctl(hosts, "kill", "box", "chat")
        opsctl(hosts, "clean", "box", "chat")  # the run ended by itself: its dead pane's tmux server goes with clean


MANY_LINES_CRASH = ("import pathlib; p = pathlib.Path('n'); n = int(p.read_text()) + 1 if p.exists() else 1; "
                    "p.write_text(str(n)); [print(f'attempt {n} line {i}', flush=True) for i in range(30)]; "
                    "raise SystemExit(1)")


def test_logs_all_with_n_prints_the_last_n_lines_of_each_attempt(tmp_path: Path, sshd) -> None:
    """`logs --all -n 5` printed every line of every attempt: -n is now the last N of each, under its header;
    without -n, --all still prints every attempt whole."""
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"r": {
        "workdir": str(tmp_path), "command": ["{python}", "-c", MANY_LINES_CRASH], "log": "run.log",
        "inductor_cache_dir": "cache", "tmux_session": "logs-all-n", "ready_timeout": 30}})
    log = tmp_path / "run.log"
    try:
        for _ in range(2):
            assert opsctl(hosts, "launch", "box", "r").returncode == 1
        r = opsctl(hosts, "logs", "box", "r", "--all", "-n", "2")
        assert r.returncode == 0, r.stderr
        out = r.stdout.splitlines()
        h1, h2 = out.index(f"=== attempt 1 of 2 (earlier attempt): {log}.1 ==="), out.index(
            f"=== attempt 2 of 2 (current attempt): {log} ===")
        assert h1 == 0 and h2 == 3 and len(out) == 6, out  # two lines of each attempt, whatever they are
        assert out[1:3] == log.with_name("run.log.1").read_text().splitlines()[-2:]
        assert out[4:6] == log.read_text().splitlines()[-2:]
        whole = opsctl(hosts, "logs", "box", "r", "--all").stdout.splitlines()
        assert "attempt 1 line 0" in whole and "attempt 2 line 0" in whole and len(whole) > 60
        r = opsctl(hosts, "logs", "box", "r", "--all", "-n", "2", "-f")  # the run has ended: -f ends too
        assert r.stdout.splitlines() == out, r.stdout
    finally:
        opsctl(hosts, "clean", "box", "r")
