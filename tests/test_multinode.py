"""Two "nodes" on this machine through torchrun's own c10d rendezvous: the training core spans hosts unchanged.

Each node is a separate `torchrun --nnodes 2 --node-rank i` (through dflash.torchrun, as opsctl starts a group's
nodes) on its own loopback address (127.0.0.2 hosts the
rendezvous store, 127.0.0.3 joins it); gloo traffic stays on the loopback interface. The split run (target rank on
node 1, drafter rank on node 0) must give exactly the losses of the same config run colocated in one process, as the
single-node split tests already prove for one process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from dflash_fixtures import run_config, tiny_run_yaml

from dflash.train import train

REPO = Path(__file__).resolve().parent.parent
NODE_TIMEOUT_S = 240.0  # a 2-node run takes ~20 s here; past this it is hung, and the logs show where


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    """The live child PIDs of `pid` (Linux /proc)."""
    out: list[int] = []
    for f in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(x) for x in f.read_text().split()]
        except OSError:
            pass
    return out


def _run_nodes(tmp_path: Path, cfg_file: Path, nproc: int, tag: str) -> list[dict]:
    """Two torchrun nodes (127.0.0.2 hosts the c10d store, 127.0.0.3 joins) of `nproc` ranks each; node 0's events."""
    head = "127.0.0.2"
    port = _free_port(head)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "PYTHONFAULTHANDLER": "1"}
    procs = []
    for node, addr in ((0, head), (1, "127.0.0.3")):
        conf = "is_host=true" if node == 0 else "is_host=false"
        argv = [sys.executable, "-m", "dflash.torchrun", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head}:{port}",
                "--rdzv-id", f"multinode-{tag}", "--rdzv-conf", conf, "--local-addr", addr, "--max-restarts", "0",
                "-m", "dflash", "train", "--config", str(cfg_file), "--out", str(tmp_path / f"{tag}-node{node}")]
        log = open(tmp_path / f"{tag}-node{node}.log", "w")  # noqa: SIM115 - closed after wait below
        procs.append((subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))
    codes: list[int | None] = []
    try:
        deadline = time.monotonic() + NODE_TIMEOUT_S
        for p, _ in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)  # reported below with both nodes' logs, not as a bare TimeoutExpired
    finally:
        hung = [p for p, _ in procs if p.poll() is None]
        for p in hung:
            # torchrun starts each worker in a session of its own: abort the workers by PID (PYTHONFAULTHANDLER writes
            # every thread's stack into the node's log), then the agent, which has no workers left, exits.
            for child in _children(p.pid):
                os.kill(child, signal.SIGABRT)
        for p, log in procs:
            if p in hung:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)  # the agent's own process group, recorded at start
                    p.wait()
            log.close()
    logs = {n: (tmp_path / f"{tag}-node{n}.log").read_text()[-15000:] for n in (0, 1)}
    assert codes == [0, 0], logs
    # Node 0 holds global rank 0 (a drafter: events, losses).
    return [json.loads(x) for x in (tmp_path / f"{tag}-node0" / "events.jsonl").read_text().splitlines()]


def _write(tmp_path: Path, name: str, sections: dict) -> Path:
    cfg_file = tmp_path / name
    cfg_file.write_text(yaml.safe_dump(tiny_run_yaml(**sections)))
    return cfg_file


def test_split_roles_across_two_torchrun_nodes_equal_the_colocated_losses(tmp_path: Path) -> None:
    sections = {"train": {"max_steps": 6, "checkpoint_every": 0, "log_every": 1},
                "dist": {"roles": "split", "target_ranks": 1, "timeout_s": 60}}
    events = _run_nodes(tmp_path, _write(tmp_path, "split.yaml", sections), 1, "split")
    start = next(e for e in events if e["kind"] == "run_start")
    assert start["world_size"] == 2 and start["roles"] == {"drafter": [0], "target": [1]}
    split_losses = [e["loss"] for e in events if e["kind"] == "step"]
    assert len(split_losses) == 6
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float reduction order as the one-thread ranks
    try:
        colocated = train(run_config(train=sections["train"]), tmp_path / "colocated")
    finally:
        torch.set_num_threads(threads)
    assert split_losses == colocated.losses


def test_split_across_nodes_runs_one_split_per_node_and_equals_the_global_layout(tmp_path: Path) -> None:
    """Two nodes of two ranks, split, no target_ranks: each node's last rank runs the target for its own drafter
    (drafters 0 and 2, targets 1 and 3; no hidden state crosses nodes), and the losses are exactly those of the
    global layout (target_ranks: 2 -> drafters 0-1, targets 2-3), since which rank computes a buffer changes nothing."""
    train_s = {"max_steps": 4, "checkpoint_every": 0, "log_every": 1}
    pernode_cfg = {"train": train_s, "dist": {"roles": "split", "timeout_s": 60}}
    per_node = _run_nodes(tmp_path, _write(tmp_path, "node.yaml", pernode_cfg), 2, "pernode")
    start = next(e for e in per_node if e["kind"] == "run_start")
    assert start["world_size"] == 4 and start["roles"] == {"drafter": [0, 2], "target": [1, 3]}
    global_cfg = {"train": train_s, "dist": {"roles": "split", "target_ranks": 2, "timeout_s": 60}}
    glob = _run_nodes(tmp_path, _write(tmp_path, "global.yaml", global_cfg), 2, "global")
    assert next(e for e in glob if e["kind"] == "run_start")["roles"] == {"drafter": [0, 1], "target": [2, 3]}
    losses = [e["loss"] for e in per_node if e["kind"] == "step"]
    assert len(losses) == 4
    assert losses == [e["loss"] for e in glob if e["kind"] == "step"]
