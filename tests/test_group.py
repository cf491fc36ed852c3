"""A group run across two real "hosts" on this machine, driven through the opsctl CLI as a user would.

Each host is its own OpenSSH sshd on its own loopback address (127.0.0.2, 127.0.0.3) with its own keys and its own
`pct` stand-in container (own PID and mount namespace); torchrun's c10d rendezvous and gloo stay on those addresses.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from dflash_fixtures import run_config, tiny_run_yaml
from harness.sshd import PctHost, Sshd, make_pct_host, start_sshd

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import opsctl  # noqa: E402

from dflash.train import train  # noqa: E402
from opsctl import commands  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ADDRS = ("127.0.0.2", "127.0.0.3")
VMID = 200

# Inside a container: every process but its init and this probe, with its command line (read, never signalled).
PROCS = """
import os
me = os.getpid()
out = []
for d in os.listdir("/proc"):
    if d.isdigit() and int(d) not in (1, me):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\\0", b" ").decode().strip()
        except OSError:
            continue
        if cmd:
            out.append([int(d), cmd])
print(__import__("json").dumps(out))
"""


class Node:
    def __init__(self, sshd: Sshd, pct: PctHost) -> None:
        self.sshd, self.pct = sshd, pct

    def procs(self) -> list[tuple[int, str]]:
        r = self.pct.pct("exec", str(VMID), "--", sys.executable, "-c", PROCS)
        return [(p, c) for p, c in json.loads(r.stdout)]

    def training(self) -> list[tuple[int, str]]:
        """The run's processes on this node: torchrun and its ranks (tmux and the wrapper aside)."""
        return [(p, c) for p, c in self.procs() if "dflash" in c and "wrapper.py" not in c and "tmux" not in c]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Node]]:
    made: list[Node] = []
    try:
        for i, addr in enumerate(ADDRS):
            base = tmp_path_factory.mktemp(f"host{i}")
            pct = make_pct_host(base / "pct")
            pct.create(VMID)
            made.append(Node(start_sshd(base / "sshd", pct_host=pct, listen=addr), pct))
        yield made
    finally:
        for n in made:
            n.sshd.stop()
            n.pct.stop_all()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_hosts(tmp: Path, nodes: list[Node], sections: dict[str, Any], **run_over: Any) -> Path:
    (tmp / "run.yaml").write_text(yaml.safe_dump(tiny_run_yaml(**sections)))
    hosts = {f"n{i}": n.sshd.host_entry(pct=VMID) for i, n in enumerate(nodes)}
    run: dict[str, Any] = {
        "nproc_per_node": 1, "workdir": str(tmp),
        "command": ["-m", "dflash", "train", "--config", "run.yaml", "--out", "out/node{node}", "--resume", "auto"],
        "log": "out/node{node}.log", "events": "out/node{node}/events.jsonl",
        "env": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        "inductor_cache_dir": str(tmp / "cache{node}"), "clean_roots": [str(tmp)],
        "ready_timeout": 180, "kill_grace": [20, 5]}
    run.update(run_over)
    doc = {"hosts": hosts, "groups": {"pair": {"members": ["n0", "n1"], "port": free_port(ADDRS[0]),
                                               "runs": {"r": run}}}}
    p = tmp / "hosts.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def group_status(hosts: Path) -> list[dict[str, Any]]:
    r = opsctl(hosts, "status", "pair", "r", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def losses(events: Path) -> list[float]:
    return [e["loss"] for e in map(json.loads, events.read_text().splitlines()) if e["kind"] == "step"]


def test_split_group_run_is_ready_on_both_nodes_and_equals_the_colocated_losses(tmp_path: Path,
                                                                                  nodes: list[Node]) -> None:
    sections = {"train": {"max_steps": 12, "checkpoint_every": 0, "log_every": 1, "heartbeat_s": 0.1},
                "dist": {"roles": "split", "target_ranks": 1}}
    hosts = write_hosts(tmp_path, nodes, sections)
    r = opsctl(hosts, "launch", "pair", "r", timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ok   node0 n0:" in r.stderr and "ok   node1 n1:" in r.stderr
    assert "READY r: every rank of 2 nodes stepped (world 2)" in r.stderr
    assert "[node0 n0] launched" in r.stderr and "[node1 n1] launched" in r.stderr
    # Both nodes are normal runs on their hosts; `logs -f` follows both, prefixed, until both ended.
    r = opsctl(hosts, "logs", "pair", "r", "-f", timeout=240)
    assert r.returncode == 0, r.stderr
    assert "[node1 n1] " in r.stdout and "[node0 n0] " in r.stdout
    assert any(line.startswith("[node1 n1] ") and "target rank done" in line for line in r.stdout.splitlines())
    r = opsctl(hosts, "logs", "pair", "r", "--node", "1", "-n", "5")
    assert r.returncode == 0 and "[node1" not in r.stdout and "target rank done" in r.stdout
    rows = group_status(hosts)
    assert [(x["node"], x["host"], x["state"]) for x in rows] == [(0, "n0", "finished"), (1, "n1", "finished")]
    assert rows[0]["group"]["state"] == "finished" and rows[0]["group"]["world_size"] == 2
    # Global rank 0 (node 0) is the drafter; node 1 holds the target rank.
    events = [json.loads(x) for x in (tmp_path / "out/node0/events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["kind"] == "run_start")
    assert start["world_size"] == 2 and start["roles"] == {"drafter": [0], "target": [1]}
    split = losses(tmp_path / "out/node0/events.jsonl")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' float reduction order
    try:
        colocated = train(run_config(train=sections["train"]), tmp_path / "colocated")
    finally:
        torch.set_num_threads(threads)
    assert len(split) == 12 and split == colocated.losses
    r = opsctl(hosts, "status", "pair")
    assert r.returncode == 0 and "pair/r: finished  2 nodes x 1 = world 2, rendezvous 127.0.0.2:" in r.stdout
    r = opsctl(hosts, "kill", "pair", "r")
    assert r.returncode == 0 and "[node0 n0] pair-r-node0 is not running" in r.stderr, r.stderr
    assert nodes[0].training() == [] and nodes[1].training() == []
    r = opsctl(hosts, "clean", "pair", "--dry-run")
    assert r.returncode == 0 and "[node1 n1] pair-r-node1: would remove" in r.stderr, r.stderr


def test_colocated_group_run_equals_the_single_node_run_of_the_same_world_size(tmp_path: Path,
                                                                                nodes: list[Node]) -> None:
    sections = {"train": {"max_steps": 8, "checkpoint_every": 0, "log_every": 1, "heartbeat_s": 0.1}}
    hosts = write_hosts(tmp_path, nodes, sections)
    r = opsctl(hosts, "launch", "pair", "r", "--follow", timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "READY r: every rank of 2 nodes stepped (world 2)" in r.stderr and "r finished on every node" in r.stderr
    events = [json.loads(x) for x in (tmp_path / "out/node0/events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["kind"] == "run_start")
    assert start["world_size"] == 2 and start["roles"] == {"colocated": [0, 1]}
    # The same config, world size 2 on one node (torchrun --standalone), outside opsctl.
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    one = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "dflash", "train", "--config", "run.yaml", "--out", "single"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    two_nodes = losses(tmp_path / "out/node0/events.jsonl")
    assert len(two_nodes) == 8 and two_nodes == losses(tmp_path / "single/events.jsonl")


def test_colocated_group_kill_leaves_nothing_and_a_dead_node_crashes_the_group(tmp_path: Path,
                                                                                nodes: list[Node]) -> None:
    sections = {"train": {"max_steps": 100000, "checkpoint_every": 0, "log_every": 1, "heartbeat_s": 0.2}}
    hosts = write_hosts(tmp_path, nodes, sections)
    r = opsctl(hosts, "launch", "pair", "r", timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "READY r: every rank of 2 nodes stepped (world 2)" in r.stderr
    rows = group_status(hosts)
    assert [x["state"] for x in rows] == ["training", "training"] and rows[0]["group"]["state"] == "training"
    assert nodes[0].training() and nodes[1].training()
    r = opsctl(hosts, "watch", "pair:r", "--once")  # the dashboard's snapshot: every node of the group run
    assert r.returncode == 0, r.stderr
    snaps = json.loads(r.stdout)
    assert [(x["host"], x["run"]) for x in snaps] == [("n0", "pair-r-node0"), ("n1", "pair-r-node1")]
    # each node with the group's own state: training, as every node trains (node 1 has no rank 0: its heartbeats)
    assert [(x["state"], x["group"]["state"], x["group"]["nodes"]) for x in snaps] == [("training", "training", 2)] * 2, [
        {k: x.get(k) for k in ("state", "phase", "proc_state", "step")} for x in snaps]
    # A second launch of a running group is refused on the node that runs it, and starts nothing.
    r = opsctl(hosts, "launch", "pair", "r")
    assert r.returncode == commands.EXIT_REFUSED and "nothing started on any node" in r.stderr
    r = opsctl(hosts, "kill", "pair", "r", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[node0 n0] killed" in r.stderr and "[node1 n1] killed" in r.stderr
    assert "killed pair/r on every node (2)" in r.stderr
    assert nodes[0].training() == [] and nodes[1].training() == []
    rows = group_status(hosts)
    assert [x["state"] for x in rows] == ["killed", "killed"] and rows[0]["group"]["state"] == "killed"

    # Again, followed (launch --follow), then node 1's ranks die by hand: the launch ends naming node 1, the
    # group is crashed, named after node 1, and nothing runs anywhere.
    cmd = [sys.executable, "-m", "opsctl", "--hosts", str(hosts), "launch", "pair", "r", "--follow"]
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True) as follow:
        assert follow.stderr is not None
        seen = []
        for line in follow.stderr:
            seen.append(line)
            if line.startswith("READY r:"):
                break
        assert seen and seen[-1].startswith("READY r:"), "".join(seen)
        ranks = [p for p, c in nodes[1].training() if "dflash.torchrun" not in c]
        assert ranks, nodes[1].procs()
        nodes[1].pct.pct("exec", str(VMID), "--", "kill", "-KILL", *map(str, ranks))
        rest = follow.stderr.read()
        assert follow.wait(timeout=120) == commands.EXIT_FAILED, rest
    assert "pair/r crashed: node1 n1: " in rest, rest
    deadline = time.monotonic() + 60
    while True:  # torchrun notices its dead worker within its monitor interval
        rows = group_status(hosts)
        if rows[1]["state"] == "crashed" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    info = rows[0]["group"]
    assert info["state"] == "crashed" and info["node"] == 1 and info["reason"].startswith("node1 n1: "), rows
    assert "Signal 9 (SIGKILL)" in info["reason"], rows  # torchrun's root cause, not its ChildFailedError
    deadline = time.monotonic() + 60
    while (nodes[0].training() or nodes[1].training()) and time.monotonic() < deadline:
        group_status(hosts)  # status stops what a crashed group still runs
        time.sleep(0.5)
    assert nodes[0].training() == [] and nodes[1].training() == []
    rows = group_status(hosts)
    assert rows[0]["group"]["state"] == "crashed" and rows[0]["group"]["node"] == 1
    assert rows[0]["state"] in ("crashed", "killed") and rows[1]["state"] == "crashed"


def test_a_member_failing_preflight_starts_nothing_anywhere(tmp_path: Path, nodes: list[Node]) -> None:
    hosts = write_hosts(tmp_path, nodes, {"train": {"max_steps": 4}})
    nodes[1].pct.pct("stop", str(VMID))
    try:
        r = opsctl(hosts, "launch", "pair", "r")
    finally:
        nodes[1].pct.create(VMID)
    assert r.returncode == commands.EXIT_REFUSED, r.stderr
    assert "ok   node0 n0:" in r.stderr and "FAIL node1 n1:" in r.stderr
    assert "refused, nothing started on any node (1 of 2 failed preflight)" in r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / ".opsctl").exists()
    assert nodes[0].training() == []
    # The run's own preflight command counts too: failing on node 0 only, it refuses the whole group.
    hosts = write_hosts(tmp_path, nodes, {"train": {"max_steps": 4}},
                        preflight=["test", "-e", str(tmp_path / "marker{node}")])
    (tmp_path / "marker1").write_text("")
    r = opsctl(hosts, "launch", "pair", "r")
    assert r.returncode == commands.EXIT_REFUSED, r.stderr
    assert "FAIL node0 n0: preflight command failed (exit 1)" in r.stderr and "ok   node1 n1:" in r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / ".opsctl").exists()


RANK_SCRIPT = """
import json, os, sys, time
rank = int(os.environ["RANK"])
with open(sys.argv[1], "a") as fh:
    fh.write(json.dumps({"kind": "heartbeat", "rank": rank, "step": 1, "phase": "training", "ts": time.time()}) + "\\n")
print(f"rank {rank} stepping", flush=True)
while True:  # no collective: a dead peer never reaches this rank, only opsctl can stop it
    if rank == 1 and os.path.exists(sys.argv[2]):
        raise SystemExit("rank 1: boom")
    time.sleep(0.1)
"""


def test_status_stops_what_a_crashed_group_still_runs(tmp_path: Path, nodes: list[Node]) -> None:
    (tmp_path / "ranks.py").write_text(RANK_SCRIPT)
    hosts = write_hosts(tmp_path, nodes, {}, command=["ranks.py", "out/node{node}/events.jsonl", "boom"],
                        events="out/node{node}/events.jsonl",
                        preflight=["mkdir", "-p", str(tmp_path / "out/node{node}")])
    r = opsctl(hosts, "launch", "pair", "r", timeout=120)
    assert r.returncode == 0 and "READY r: every rank of 2 nodes stepped" in r.stderr, r.stderr
    (tmp_path / "boom").write_text("")
    deadline = time.monotonic() + 60
    while not (proc := opsctl(hosts, "status", "pair", "r")).stderr and time.monotonic() < deadline:
        time.sleep(0.5)  # until status finds the crash (it says on stderr what it stops)
    assert "pair/r crashed (node1 n1: " in proc.stderr and "stopping node0 n0" in proc.stderr, proc.stderr
    assert "[node0 n0] killed pair-r-node0" in proc.stderr, proc.stderr
    assert [p for p, c in nodes[0].procs() if "ranks.py" in c] == []
    rows = group_status(hosts)
    assert [x["state"] for x in rows] == ["killed", "crashed"]
    assert rows[0]["group"]["state"] == "crashed" and rows[0]["group"]["node"] == 1


# A rank that steps at once; rank 1 dies always (mode `always`), or unless resumed once the file `boom` exists (mode
# `boom`); rank 0 runs until opsctl stops it, or, resumed, ends after a moment like rank 1.
RESTART_SCRIPT = """
import json, os, sys, time
rank, resumed = int(os.environ["RANK"]), "--resume" in sys.argv
with open(sys.argv[1], "a") as fh:
    fh.write(json.dumps({"kind": "heartbeat", "rank": rank, "step": 1, "phase": "training", "ts": time.time()}) + "\\n")
print(f"rank {rank} stepping, resumed {resumed}", flush=True)
time.sleep(1.0)
crash = rank == 1 and (sys.argv[2] == "always" or not resumed)
while crash and sys.argv[2] == "boom" and not os.path.exists("boom"):
    time.sleep(0.1)
if crash:
    raise SystemExit(f"rank 1: boom ({'resumed' if resumed else 'first'} attempt)")
while not resumed:
    time.sleep(0.1)
time.sleep(1.0)
print(f"rank {rank} done", flush=True)
"""


def restart_hosts(tmp: Path, nodes: list[Node], mode: str, max_restarts: int, backoff: float) -> Path:
    (tmp / "ranks.py").write_text(RESTART_SCRIPT)
    return write_hosts(tmp, nodes, {}, command=["ranks.py", "out/node{node}/events.jsonl", mode],
                       events="out/node{node}/events.jsonl", kill_grace=[5, 2],
                       preflight=["mkdir", "-p", str(tmp / "out/node{node}")],
                       restart={"when": "on-failure", "max": max_restarts, "backoff_s": backoff,
                                "resume_args": ["--resume"]})


def group_history(hosts: Path) -> list[dict[str, Any]]:
    r = opsctl(hosts, "history", "pair", "r", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def supervise(hosts: Path) -> subprocess.Popen[str]:
    """`launch --follow` in the background: the group's supervisor."""
    cmd = [sys.executable, "-m", "opsctl", "--hosts", str(hosts), "launch", "pair", "r", "--follow"]
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_group(hosts: Path, state: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        info = group_status(hosts)[0]["group"]
        if info["state"] == state:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.3)


def test_a_group_whose_node_crashes_once_is_restarted_as_a_whole(tmp_path: Path, nodes: list[Node]) -> None:
    hosts = restart_hosts(tmp_path, nodes, "boom", max_restarts=2, backoff=2.0)
    r = opsctl(hosts, "launch", "pair", "r")  # returns at READY, saying that nothing would restart it
    assert r.returncode == 0 and "only an opsctl that follows the group carries out" in " ".join(r.stderr.split())
    with supervise(hosts) as sup:
        # launch --follow on the running group takes over its supervision (no second start)
        assert sup.stderr is not None
        first = sup.stderr.readline()
        assert first.startswith("following pair/r: already running on every node (group attempt #1)"), first
        (tmp_path / "boom").write_text("")  # node 1's rank dies
        # another client sees the group between its attempts: restarting (1/2), naming node 1, stopping nothing
        info = wait_group(hosts, "restarting")
        assert (info["restart_n"], info["restart_max"], info["node"]) == (1, 2, 1), info
        assert info["reason"].startswith("restart 1/2 ") and "after node1 n1: " in info["reason"], info
        out, err = sup.communicate(timeout=120)
    assert sup.returncode == 0, err[-3000:]
    assert "pair/r crashed: node1 n1: " in err and "restart 1 of 2 in 2 s, resuming with --resume" in err, err
    assert err.count("READY r: every rank of 2 nodes stepped") == 1 and "r finished on every node" in err, err
    h = group_history(hosts)
    assert [(a["id"], a["by"], a["outcome"]) for a in h] == [(1, "launch", "crashed"), (2, "restart", "finished")]
    assert h[0]["supervised"] and h[1]["supervised"]
    assert h[0]["node"] == 1 and h[0]["reason"].startswith("node1 n1: "), h[0]
    # per node: node 1 crashed (its exit code), node 0 was stopped by opsctl because of it
    assert [(x["node"], x["outcome"]) for x in h[0]["nodes"]] == [(0, "stopped"), (1, "crashed")], h[0]
    assert h[0]["nodes"][1]["exit_code"] == 1 and h[0]["nodes"][0]["exit_code"] is not None
    assert (h[1]["restart"], h[1]["restart_of"], h[1]["restart_max"]) == (1, 1, 2)
    assert h[1]["extra_args"] == ["--resume"] and [x["outcome"] for x in h[1]["nodes"]] == ["finished"] * 2
    assert h[1]["started"] - h[0]["ended"] >= 2.0  # the back-off, after every node was stopped
    # every node's own second attempt ran with the resume flag, the first without
    assert [x["argv"][-1] for x in h[1]["nodes"]] == ["--resume"] * 2 and "--resume" not in h[0]["nodes"][0]["argv"]
    assert "resumed True" in (tmp_path / "out/node1.log").read_text()


def test_a_group_that_always_crashes_stops_after_max_and_a_kill_cancels_a_restart(tmp_path: Path,
                                                                                   nodes: list[Node]) -> None:
    hosts = restart_hosts(tmp_path, nodes, "always", max_restarts=1, backoff=0.5)
    r = opsctl(hosts, "launch", "pair", "r", "--follow", timeout=120)
    assert r.returncode == commands.EXIT_FAILED, r.stderr[-3000:]
    assert "restart limit reached (1 of 1): the group stays crashed" in r.stderr, r.stderr
    r = opsctl(hosts, "history", "pair", "r")  # the table: one row per group attempt, its nodes in it
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.lstrip("│ ")[:2] in ("1 ", "2 ")]
    assert len(rows) == 2 and all("crashed (node1 n1: torchrun: rank 1" in ln for ln in rows), r.stdout
    assert "node0 n0: stopped" in rows[0] and "restart 1 of 1 after #1" in rows[1], r.stdout
    info = group_status(hosts)[0]["group"]
    assert info["state"] == "crashed" and "not restarted: restart limit reached (1 of 1 restarts used)" in info["reason"], info
    assert nodes[0].training() == [] and [p for p, c in nodes[0].procs() if "ranks.py" in c] == []

    # A kill from another client during the back-off: no further attempt, the supervisor says so and ends.
    hosts = restart_hosts(tmp_path, nodes, "always", max_restarts=3, backoff=30.0)
    with supervise(hosts) as sup:
        wait_group(hosts, "restarting")
        # a second launch meanwhile is refused (without --follow it would not restart anything: it says so)
        r = opsctl(hosts, "launch", "pair", "r")
        assert r.returncode == commands.EXIT_REFUSED and "pair/r is restarting (restart 1 of 3" in r.stderr, r.stderr
        assert "only an opsctl that follows the group carries out" in " ".join(r.stderr.split()), r.stderr
        r = opsctl(hosts, "kill", "pair", "r")
        assert r.returncode == 0 and "pair/r: restart 1 of 3 cancelled" in r.stderr, r.stderr
        out, err = sup.communicate(timeout=30)
    assert sup.returncode == commands.EXIT_FAILED and "restart 1 of 3 cancelled: the group was killed" in err, err
    h = group_history(hosts)
    assert [a["outcome"] for a in h][-1] == "crashed" and h[-1]["restart_cancelled"], h
    assert group_status(hosts)[0]["group"]["state"] == "crashed"
    assert nodes[0].training() == [] and nodes[1].training() == []


def test_history_of_an_unfollowed_group_crash_names_the_node_and_reason_status_names(tmp_path: Path,
                                                                                    nodes: list[Node]) -> None:
    hosts = restart_hosts(tmp_path, nodes, "boom", max_restarts=1, backoff=0.5)
    r = opsctl(hosts, "launch", "pair", "r")  # returns at READY: no opsctl is there to record how it ends
    assert r.returncode == 0, r.stderr[-3000:]
    (tmp_path / "boom").write_text("")  # node 1's rank dies
    info = wait_group(hosts, "crashed")  # status names the node and why (and stops node 0)
    assert info["node"] == 1 and info["reason"].startswith("node1 n1: torchrun: rank 1"), info
    (h,) = group_history(hosts)
    assert (h["outcome"], h["node"]) == ("crashed", 1), h
    assert h["reason"] and info["reason"].startswith(h["reason"]), (h["reason"], info["reason"])
    assert [(x["node"], x["outcome"]) for x in h["nodes"]] == [(0, "stopped"), (1, "crashed")], h
    r = opsctl(hosts, "history", "pair", "r")
    assert "crashed (node1 n1: torchrun: rank 1" in r.stdout and "node0 n0: stopped" in r.stdout, r.stdout
    assert nodes[0].training() == [] and nodes[1].training() == []
