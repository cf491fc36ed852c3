"""`opsctl status` of several runs of one host asks them side by side over the host's one SSH connection (it asked
them one after another and took ~1.5x `watch --once --json`: bench/ops_latency.py --only status), with the same rows
in the same order; a host that does not answer still costs one connection attempt, not one per run.

Real sshd and agents; the transport is the real one, only counted (how many agent streams are open at once).
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import script_run  # noqa: E402

from opsctl import commands  # noqa: E402
from opsctl.config import HostConfig, load_inventory  # noqa: E402
from opsctl.transport import Stream, transport_for  # noqa: E402

RUNS = ("a", "b", "c", "d")


class CountingTransport:
    """The real transport stack, counting the agent streams open at the same moment."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lock = threading.Lock()
        self.open = self.peak = self.total = 0

    def stream(self, argv: list[str], stdin_data: bytes = b"") -> Stream:
        s = self.inner.stream(argv, stdin_data)
        with self.lock:
            self.open += 1
            self.total += 1
            self.peak = max(self.peak, self.open)
        close = s.close

        def counted_close() -> None:
            with self.lock:
                self.open -= 1
            close()

        s.close = counted_close  # type: ignore[method-assign]
        return s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_status_asks_every_run_of_a_host_at_once_and_keeps_their_order(tmp_path: Path, sshd) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={
        name: script_run(tmp_path / name, "ok_run.py", tmux_session=f"par-{name}") for name in RUNS})
    for name in RUNS:
        (tmp_path / name).mkdir()
    inv = load_inventory(hosts)
    counted: list[CountingTransport] = []

    def factory(host: HostConfig) -> Any:
        counted.append(CountingTransport(transport_for(host, inventory=inv)))
        return counted[-1]

    out = status_json_in_process(hosts, factory)
    assert [(r["run"], r["state"]) for r in out] == [(name, "absent") for name in RUNS], out  # inventory order
    (t,) = counted  # one transport (one SSH connection) for the host
    assert t.total == len(RUNS) and t.peak >= 2, (t.total, t.peak)  # asked side by side, not one by one


def status_json_in_process(hosts: Path, factory: Any) -> list[dict[str, Any]]:
    """`status box --json` in this process (so the transport can be counted), its JSON parsed."""
    raw = io.StringIO()
    ctx = commands.Ctx(hosts_file=str(hosts), raw=raw, transport_factory=factory)
    assert commands.cmd_status(ctx, "box", None, as_json=True) == commands.EXIT_OK
    return json.loads(raw.getvalue())


def test_status_of_a_host_that_never_answers_tries_one_connection_not_one_per_run(tmp_path: Path, sshd) -> None:
    """A port that accepts and then says nothing (no SSH banner): every run is `unreachable` with the same reason,
    exit 3, after one connection attempt; the runs' parallel asks must not each pay a connect timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    try:
        hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={
            name: script_run(tmp_path, "ok_run.py", tmux_session=f"mute-{name}", log=f"{name}.log",
                             events=f"{name}.jsonl") for name in RUNS},
            port=listener.getsockname()[1], connect_timeout=2)
        env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
        r = subprocess.run([sys.executable, "-m", "opsctl", "--hosts", str(hosts), "status", "box", "--json"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == commands.EXIT_TRANSPORT, r.stderr
        rows = json.loads(r.stdout)
        assert [(x["run"], x["state"]) for x in rows] == [(name, "unreachable") for name in RUNS], rows
        assert len({x["reason"] for x in rows}) == 1 and "Traceback" not in r.stderr
        assert len(accepted) == 1, len(accepted)
    finally:
        listener.close()
        for c in accepted:
            c.close()
