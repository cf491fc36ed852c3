"""One supervisor per group run: a second `launch GROUP RUN --follow` is refused while the first one's lease is live,
`--take-over` moves supervision (the first exits with EXIT_TAKEN_OVER), and a dead supervisor's stale lease is taken.

The same two real sshd "hosts" (127.0.0.2, 127.0.0.3, each its own `pct` container) as tests/test_group.py, whose
fixture and helpers these tests share; every supervisor is a real `opsctl launch ... --follow` subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from test_group import (  # the agentlib helper `opsctl` comes along: test_group puts tests/runs on sys.path
    REPO,
    Node,
    group_history,
    group_status,
    nodes,  # noqa: F401 - the module's two-host fixture
    opsctl,
    restart_hosts,
)

from opsctl import commands
from opsctl.group_lease import REFRESH_ENV

# The supervisors here refresh their lease every second (not every 12 s), so a dead one's lease is stale after 3 s
# and a taken-over one notices within about a second: set for every opsctl these tests start (they inherit it).
REFRESH_S = "1"


@pytest.fixture(autouse=True)
def short_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REFRESH_ENV, REFRESH_S)


@contextmanager
def supervisor(hosts: Path, *more: str) -> Iterator[subprocess.Popen[str]]:
    """`launch pair r --follow [MORE]` in the background; killed by its pid if a failing test leaves it running."""
    cmd = [sys.executable, "-m", "opsctl", "--hosts", str(hosts), "launch", "pair", "r", "--follow", *more]
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stderr is not None:
            proc.stderr.close()


def read_until(proc: subprocess.Popen[str], prefix: str) -> list[str]:
    """The process's stderr lines up to and including the first that starts with `prefix`."""
    assert proc.stderr is not None
    seen: list[str] = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(prefix):
            return seen
    raise AssertionError(f"no line starting {prefix!r}; got:\n{''.join(seen)}")


def ranks(of: list[Node]) -> list[set[int]]:
    """Per node, the pids of the run's torchrun and ranks: ranks.py in their command line (the opsctl agents that
    follow the run carry it too, in their arguments: not the run's)."""
    return [{p for p, c in n.procs() if "ranks.py" in c and "opsctl-agent" not in c} for n in of]


def supervisor_of(hosts: Path) -> dict[str, Any] | None:
    return group_status(hosts)[0]["group"]["supervisor"]


@pytest.fixture
def group(tmp_path: Path, nodes: list[Node]) -> Iterator[Path]:  # noqa: F811 - the imported fixture
    """The restart test group of tests/test_group.py (node 1 crashes once `boom` exists, the resumed attempt ends
    on both nodes), killed at the end whatever the test left running."""
    hosts = restart_hosts(tmp_path, nodes, "boom", max_restarts=2, backoff=1.0)
    try:
        yield hosts
    finally:
        opsctl(hosts, "kill", "pair", "r", timeout=120)
        assert ranks(nodes) == [set(), set()]


def crash_once_and_finish(tmp_path: Path, sup: subprocess.Popen[str]) -> str:
    """Node 1's rank dies; the supervisor restarts the group once and it finishes: the supervisor's stderr."""
    (tmp_path / "boom").write_text("")
    _, err = sup.communicate(timeout=120)
    assert sup.returncode == 0, err[-3000:]
    assert "restart 1 of 2 in 1 s" in err and "r finished on every node" in err, err
    return err


def test_a_second_supervisor_is_refused_and_starts_nothing(tmp_path: Path, nodes: list[Node],  # noqa: F811
                                                            group: Path) -> None:
    r = opsctl(group, "launch", "pair", "r", "--take-over")
    assert r.returncode == commands.EXIT_USAGE and "--take-over moves the supervision" in r.stderr, r.stderr
    with supervisor(group) as first:
        read_until(first, "READY r:")
        sup = supervisor_of(group)
        assert sup is not None and sup["pid"] == first.pid and not sup["stale"], sup
        before = ranks(nodes)
        assert all(before), before
        r = opsctl(group, "launch", "pair", "r", "--follow")
        assert r.returncode == commands.EXIT_REFUSED, r.stderr
        text = " ".join(r.stderr.split())
        assert "pair/r is supervised by another opsctl: " in text and f" pid {first.pid} (since " in text, text
        assert "last heartbeat " in text and "opsctl status pair r" in text, text
        assert "opsctl launch pair r --follow --take-over" in text, text
        # nothing new on any node, no new group attempt, and the lease is still the first one's
        assert ranks(nodes) == before
        assert [a["id"] for a in group_history(group)] == [1]
        assert supervisor_of(group)["pid"] == first.pid  # type: ignore[index]
        r = opsctl(group, "status", "pair", "r")
        assert r.returncode == 0 and "supervised by " in r.stdout and f" pid {first.pid} since " in r.stdout, r.stdout
        assert first.poll() is None  # the first one goes on supervising: it restarts the crash
        crash_once_and_finish(tmp_path, first)
    h = group_history(group)
    assert [(a["id"], a["by"], a["outcome"]) for a in h] == [(1, "launch", "crashed"), (2, "restart", "finished")]
    # it released its lease at the end: nobody supervises now
    assert supervisor_of(group) is None
    r = opsctl(group, "status", "pair", "r")
    assert r.returncode == 0 and "not supervised (no opsctl carries out its restart policy now)" in r.stdout, r.stdout


def test_take_over_moves_supervision_and_the_first_exits(tmp_path: Path, nodes: list[Node],  # noqa: F811
                                                         group: Path) -> None:
    with supervisor(group) as first:
        read_until(first, "READY r:")
        before = ranks(nodes)
        with supervisor(group, "--take-over") as second:
            said = read_until(second, "took over the supervision of pair/r from ")
            assert said[0].startswith("following pair/r: already running on every node (group attempt #1)"), said
            assert f" pid {first.pid} (since " in said[-1], said
            _, err = first.communicate(timeout=60)
            assert first.returncode == commands.EXIT_TAKEN_OVER, err
            assert "pair/r: supervision taken over by " in err and f" pid {second.pid} " in err, err
            assert ranks(nodes) == before  # the take-over neither stopped nor started anything
            sup = supervisor_of(group)
            assert sup is not None and sup["pid"] == second.pid and not sup["stale"], sup
            # a crash now: the new supervisor alone restarts it, exactly once
            crash_once_and_finish(tmp_path, second)
    h = group_history(group)
    assert [(a["id"], a["by"], a["outcome"]) for a in h] == [(1, "launch", "crashed"), (2, "restart", "finished")]
    assert (h[1]["restart"], h[1]["restart_of"]) == (1, 1)


def test_a_dead_supervisors_stale_lease_is_taken_over_without_asking(tmp_path: Path, nodes: list[Node],  # noqa: F811
                                                                     group: Path) -> None:
    with supervisor(group) as first:
        read_until(first, "READY r:")
        sup = supervisor_of(group)
        assert sup is not None and sup["pid"] == first.pid
        os.kill(int(sup["pid"]), signal.SIGKILL)  # by its recorded pid: it cannot release its lease
        assert first.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while not (sup := supervisor_of(group) or {}).get("stale"):
        assert time.monotonic() < deadline, sup
        time.sleep(0.5)
    assert sup["heartbeat_age_s"] > 3 * float(REFRESH_S), sup
    r = opsctl(group, "status", "pair", "r")
    assert r.returncode == 0 and f"not supervised: its supervisor {sup['host']} pid {first.pid} is gone" in r.stdout
    with supervisor(group) as second:  # no --take-over: the lease is stale
        said = read_until(second, "note: the previous supervisor of pair/r, ")
        assert said[0].startswith("following pair/r: already running on every node (group attempt #1)"), said
        assert f" pid {first.pid}, is gone (its last heartbeat " in said[-1] and "taking over" in said[-1], said
        sup = supervisor_of(group)
        assert sup is not None and sup["pid"] == second.pid and not sup["stale"], sup
        crash_once_and_finish(tmp_path, second)
    h = group_history(group)
    assert [(a["id"], a["by"], a["outcome"]) for a in h] == [(1, "launch", "crashed"), (2, "restart", "finished")]
