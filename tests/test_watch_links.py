"""`opsctl watch`'s link to a host through a real sshd: a permanent SSH error (host key unknown or changed,
authentication refused) is shown once as that host's error and not retried; a transient one (connection refused) is
retried with back-off. Each source is followed by the dashboard's own worker over the real transport stack.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import paramiko
from harness.sshd import Sshd

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import script_run  # noqa: E402

from opsctl.config import HostConfig, load_inventory  # noqa: E402
from opsctl.transport import Transport, transport_for  # noqa: E402
from opsctl.watch import AgentSource, RunModel, SourceWorker, fold  # noqa: E402


class Following:
    """One run of host `box` followed as `opsctl watch` does, counting the connections it opens."""

    def __init__(self, tmp: Path, sshd: Sshd, **ssh_over: Any) -> None:
        hosts = sshd.write_hosts_yaml(tmp / "hosts.yaml", runs={"r": script_run(tmp, "ok_run.py")}, **ssh_over)
        inv = load_inventory(hosts)
        self.connects = 0
        source = AgentSource(inv.hosts["box"], inv.runs["box"]["r"], self._connect, kill=lambda: (0, ""),
                             clean=lambda: (0, ""))
        self.source = source
        self.worker = SourceWorker(source, backoff=(0.05,)).start()
        self.model = RunModel(source.label)

    def _connect(self, host: HostConfig) -> Transport:
        self.connects += 1
        return transport_for(host)

    def links(self, seconds: float) -> list[tuple[str, str]]:
        """The link messages of the next `seconds`, folded into the run's model as the dashboard does."""
        got: list[tuple[str, str]] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            other, _, _ = self.worker.drain()
            got += [(m["state"], m["detail"]) for m in other if m["t"] == "link"]
            for m in other:
                self.model.ingest(m)
            time.sleep(0.05)
        return got


def _assert_shown_once_and_not_retried(f: Following, needle: str) -> None:
    links = f.links(2.0)  # with a 0.05 s back-off a retrying worker would connect ~20 times by now
    assert f.connects == 1 and len(links) == 1 and links[0][0] == "failed", (f.connects, links)
    assert needle in links[0][1] and links[0][1].endswith("(not retried: it needs a person; r: try again)"), links
    view = f.model.view()
    assert view.state == "unreachable" and needle in (view.reason or ""), view
    assert f.worker.ended.is_set()  # `watch --once` ends on it rather than waiting out its timeout
    f.worker.request_reconnect()  # `r` in the dashboard: one more try, failing the same way, once
    links = f.links(1.0)
    assert f.connects == 2 and [s for s, _ in links] == ["reconnecting", "failed"], links
    f.worker.stop()


def test_watch_shows_an_unknown_host_key_once_and_does_not_retry_it(tmp_path: Path, sshd: Sshd) -> None:
    f = Following(tmp_path, sshd, known_hosts=str(tmp_path / "empty_known_hosts"))
    _assert_shown_once_and_not_retried(f, "host key not in known_hosts")


def test_watch_shows_a_changed_host_key_once_and_does_not_retry_it(tmp_path: Path, sshd: Sshd) -> None:
    other = paramiko.Ed25519Key.from_private_key_file(sshd.identity_file)  # any key that is not the host's
    kh = tmp_path / "known_hosts"
    kh.write_text(f"[127.0.0.1]:{sshd.port} {other.get_name()} {other.get_base64()}\n")
    f = Following(tmp_path, sshd, known_hosts=str(kh))
    _assert_shown_once_and_not_retried(f, "HOST KEY MISMATCH")


def test_watch_shows_a_refused_authentication_once_and_does_not_retry_it(tmp_path: Path, sshd: Sshd) -> None:
    key = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    f = Following(tmp_path, sshd, identity_file=str(key))
    _assert_shown_once_and_not_retried(f, "authentication failed")


def test_watch_keeps_retrying_a_refused_connection_with_back_off(tmp_path: Path, sshd: Sshd) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there: Connection refused, which a restarted sshd mends
    f = Following(tmp_path, sshd, port=port)
    links = f.links(2.0)
    assert f.connects >= 3 and "failed" not in [s for s, _ in links], (f.connects, links)
    assert any(s == "lost" and "Connection refused" in d and "(retry in 0.05 s)" in d for s, d in links), links
    assert not f.worker.ended.is_set() and f.model.view().state == "unreachable"
    f.worker.stop()


def test_fold_brings_a_permanent_error_into_the_snapshot(tmp_path: Path, sshd: Sshd) -> None:
    """`watch --once --json` prints the permanent error as the run's link_error (status --json's schema)."""
    f = Following(tmp_path, sshd, known_hosts=str(tmp_path / "empty_known_hosts"))
    deadline = time.monotonic() + 10
    while not f.worker.ended.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    fold([f.worker], [f.model])
    rec = f.model.snapshot()
    assert rec["state"] == "unreachable" and rec["link"] == "unreachable", rec
    assert "host key not in known_hosts" in rec["link_error"] and "not retried" in rec["link_error"], rec
    f.worker.stop()


def test_asked_says_the_agent_was_started_or_the_connect_failed(tmp_path: Path, sshd: Sshd) -> None:
    """AgentSource.asked, what the dashboard waits for (briefly) before it loads Textual: set once the agent's
    command went out over the real ssh, before the agent's first message is folded; and set by a connect that failed
    (a dashboard of an unreachable host must not wait out its whole head start for nothing)."""
    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    good = Following(tmp_path / "good", sshd)
    assert good.source.asked.wait(30)
    deadline = time.monotonic() + 30
    while not any(m["t"] == "hello" for m in good.worker.drain()[0]):
        assert time.monotonic() < deadline, "no hello from the agent"
        time.sleep(0.05)
    good.worker.stop()
    bad = Following(tmp_path / "bad", sshd, known_hosts=str(tmp_path / "empty_known_hosts"))
    assert bad.source.asked.wait(30)
    assert [s for s, _ in bad.links(0.5)] == ["failed"]
    bad.worker.stop()
