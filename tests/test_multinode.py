"""Two "nodes" on this machine through torchrun's own c10d rendezvous: the training core spans hosts unchanged.

Each node is a separate `torchrun --nnodes 2 --node-rank i` on its own loopback address (127.0.0.2 hosts the
rendezvous store, 127.0.0.3 joins it); gloo traffic stays on the loopback interface. The split run (target rank on
node 1, drafter rank on node 0) must give exactly the losses of the same config run colocated in one process, as the
single-node split tests already prove for one process group.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from dflash_fixtures import run_config, tiny_run_yaml

from dflash.train import train

REPO = Path(__file__).resolve().parent.parent


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _losses(events: Path) -> list[float]:
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    return [e["loss"] for e in rows if e["kind"] == "step"]


def test_split_roles_across_two_torchrun_nodes_equal_the_colocated_losses(tmp_path: Path) -> None:
    sections = {"train": {"max_steps": 6, "checkpoint_every": 0, "log_every": 1},
                "dist": {"roles": "split", "target_ranks": 1}}
    cfg_file = tmp_path / "split.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_run_yaml(**sections)))
    head = "127.0.0.2"
    port = _free_port(head)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs = []
    for node, addr in ((0, head), (1, "127.0.0.3")):
        conf = "is_host=true" if node == 0 else "is_host=false"
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{head}:{port}",
                "--rdzv-id", "multinode-test", "--rdzv-conf", conf, "--local-addr", addr, "--max-restarts", "0",
                "-m", "dflash", "train", "--config", str(cfg_file), "--out", str(tmp_path / f"node{node}")]
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 - closed after wait below
        procs.append((subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))
    try:
        codes = [p.wait(timeout=240) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)  # the torchrun agent's own process group, recorded at start
                p.wait()
            log.close()
    logs = {n: (tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1)}
    assert codes == [0, 0], logs
    # Node 0 holds global rank 0 (the drafter: events, losses); node 1 the target rank.
    events = [json.loads(x) for x in (tmp_path / "node0" / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["kind"] == "run_start")
    assert start["world_size"] == 2 and start["roles"] == {"drafter": [0], "target": [1]}
    split_losses = _losses(tmp_path / "node0" / "events.jsonl")
    assert len(split_losses) == 6
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float reduction order as the one-thread ranks
    try:
        colocated = train(run_config(train=sections["train"]), tmp_path / "colocated")
    finally:
        torch.set_num_threads(threads)
    assert split_losses == colocated.losses
