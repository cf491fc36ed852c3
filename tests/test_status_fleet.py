"""`opsctl status` with no HOST asks every host of the inventory at the same time: a fleet with hosts that are down
waits about one connect timeout, not one per silent host in series, and prints the same rows in inventory order, the
containers' preflight lines in inventory order too, exit 3 naming every unreachable host.

Real sshd on 127.0.0.2 and 127.0.0.3 (each its own `pct` container), and two "hosts" that accept a connection and
never say a word (no SSH banner): the slowest kind of down host, as a hung machine or a firewall that swallows.
"""

from __future__ import annotations

import io
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.sshd import PctHost, Sshd, start_sshd
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import script_run  # noqa: E402

from opsctl import commands  # noqa: E402

TIMEOUT = 4  # connect_timeout of the silent hosts: two in series would take 8 s and more


class Mute:
    """A TCP port that accepts every connection and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()
        for c in self.accepted:
            c.close()


@pytest.fixture
def two_hosts(tmp_path_factory: pytest.TempPathFactory, pct_host: PctHost,
              container: Callable[..., int]) -> Iterator[list[tuple[Sshd, int]]]:
    made: list[tuple[Sshd, int]] = []
    try:
        for i, addr in enumerate(("127.0.0.2", "127.0.0.3")):
            vmid = container(241 + i)
            made.append((start_sshd(tmp_path_factory.mktemp(f"fleet{i}"), pct_host=pct_host, listen=addr), vmid))
        yield made
    finally:
        for s, _ in made:
            s.stop()


def fleet(tmp: Path, two: list[tuple[Sshd, int]], mutes: list[Mute]) -> Path:
    """Inventory order: silent0, a, b, silent1 (a silent host first: rows in the order answers came would differ)."""
    (tmp / "w").mkdir()
    run = script_run(tmp / "w", "ok_run.py", tmux_session="fleet-r")
    (sa, va), (sb, vb) = two
    silent = [{**sa.host_entry(port=m.port, connect_timeout=TIMEOUT), "runs": {"r": dict(run)}} for m in mutes]
    for e in silent:
        e["ssh"]["host"] = "127.0.0.1"
    hosts = {"silent0": silent[0], "a": {**sa.host_entry(pct=va), "runs": {"r": dict(run)}},
             "b": {**sb.host_entry(pct=vb), "runs": {"r": dict(run), "r2": {
                 **run, "tmux_session": "fleet-r2", "log": "r2.log", "events": "r2.jsonl"}}},  # files of its own
             "silent1": silent[1]}
    p = tmp / "hosts.yaml"
    p.write_text(yaml.safe_dump({"hosts": hosts}, sort_keys=False))
    return p


def status_in_process(hosts: Path, as_json: bool) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    ctx = commands.Ctx(hosts_file=str(hosts), raw=out, out=Console(file=out, width=300, highlight=False),
                       err=Console(file=err, width=300, highlight=False))
    t0 = time.monotonic()
    rc = commands.cmd_status(ctx, None, None, as_json=as_json)
    return rc, out.getvalue(), err.getvalue(), time.monotonic() - t0


def test_status_of_a_fleet_asks_every_host_at_once_in_about_one_timeout_rows_in_inventory_order(
        tmp_path: Path, two_hosts: list[tuple[Sshd, int]]) -> None:
    mutes = [Mute(), Mute()]
    try:
        hosts = fleet(tmp_path, two_hosts, mutes)
        rc, out, err, took = status_in_process(hosts, as_json=True)
        assert rc == commands.EXIT_TRANSPORT, err
        import json

        rows: list[dict[str, Any]] = json.loads(out)
        assert [(r["host"], r["run"], r["state"]) for r in rows] == [
            ("silent0", "r", "unreachable"), ("a", "r", "absent"), ("b", "r", "absent"), ("b", "r2", "absent"),
            ("silent1", "r", "unreachable")], rows
        assert TIMEOUT - 0.5 <= took < 2 * TIMEOUT - 1, took  # one timeout for both silent hosts, side by side
        assert [len(m.accepted) for m in mutes] == [1, 1]

        # The table: the containers' preflight lines (buffered per host) in inventory order, then the unreachables.
        rc, out, err, took = status_in_process(hosts, as_json=False)
        assert rc == commands.EXIT_TRANSPORT and took < 2 * TIMEOUT - 1, (took, err)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        (va, vb) = (v for _, v in two_hosts)
        assert [ln.split()[0:3] for ln in lines[:2]] == [["ok", "container", str(va)], ["ok", "container", str(vb)]], err
        assert [ln.split(":")[0] for ln in lines[2:]] == ["silent0", "silent1"], err
        hosts_col = [ln.split("│")[1].strip() for ln in out.splitlines() if ln.startswith("│") and "│ r" in ln]
        assert hosts_col == ["silent0", "a", "b", "b", "silent1"], out
        assert "Traceback" not in err
    finally:
        for m in mutes:
            m.close()
