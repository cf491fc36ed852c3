"""Shared pytest fixtures: a real OpenSSH sshd on 127.0.0.1, the Proxmox `pct` stand-in, and its containers.

Session-scoped where start-up costs time (sshd, key generation), function-scoped where tests change state.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Compiled runs in tests start from their own caches: no artifacts shared through this host's compile cache
# ($DFLASH_CACHE/compile-cache), which would make one test's cold compile depend on another having run.
# tests/test_warm_start.py turns it on where that is what it checks.
os.environ["DFLASH_HOST_COMPILE_CACHE"] = "0"

from harness.sshd import PctHost, Sshd, make_pct_host, start_sshd  # noqa: E402


@pytest.fixture(scope="session")
def pct_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PctHost]:
    """The `pct` stand-in (bin dir + state root); every container still running is stopped at session end."""
    host = make_pct_host(tmp_path_factory.mktemp("pct"))
    yield host
    host.stop_all()


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory, pct_host: PctHost) -> Iterator[Sshd]:
    """A real sshd (own host + client keys, known_hosts pre-filled) whose sessions find the same `pct`."""
    server = start_sshd(tmp_path_factory.mktemp("sshd"), pct_host=pct_host)
    yield server
    server.stop()


@pytest.fixture
def drop_ssh(sshd: Sshd) -> Callable[[], int]:
    """Call it to kill every live SSH connection to the test sshd (by PID, as a network drop); returns how many."""
    return sshd.drop_connections


@pytest.fixture
def container(pct_host: PctHost) -> Iterator[Callable[..., int]]:
    """`container(200)` creates and starts CT 200 (`start=False`: created, stopped); stopped again afterwards."""
    made: list[int] = []

    def make(vmid: int = 200, start: bool = True) -> int:
        pct_host.create(vmid, start=start)
        made.append(vmid)
        return vmid

    yield make
    for vmid in made:
        if pct_host.pct("status", str(vmid), check=False).stdout.strip() == "status: running":
            pct_host.pct("stop", str(vmid), check=False)
