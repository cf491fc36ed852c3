"""τ of a group run over the two real sshd "hosts" of tests/test_group.py: node 0 (global rank 0) writes the run's
`eval` events, as its steps, so its τ is the group's in status, history and export; a node whose ranks only
heartbeat while the run evaluates (phase `evaluating`) is training, never loading.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_group import (  # the agentlib helper `opsctl` comes along: test_group puts tests/runs on sys.path
    Node,
    group_history,
    group_status,
    nodes,  # noqa: F401 - the module's two-host fixture
    opsctl,
    write_hosts,
)

# Rank 0 writes the run's events through the contract's writer: run_start, steps, an evaluation at step 2 (τ 3.0)
# and one at step 4 (τ 2.5, below the best by more than the margin), then holds in `evaluating` until the file
# `done` exists. Rank 1 only heartbeats, its phase following rank 0's; it also writes an eval event of its own
# (τ 9.9, against the contract) that must never be taken for the group's.
RANKS = """
import os, socket, sys, time
from dflash.telemetry import EventWriter
rank = int(os.environ["RANK"])
w = EventWriter(sys.argv[1], run_id="g", rank=rank, truncate=True)
def beat(phase, step):
    w.emit("heartbeat", phase=phase, step=step, rss_mb=10.0, gpu_mem_mb=None)
def ev(step, tau):
    w.emit("eval", step=step, tau=tau, accept_by_position=[0.9, 0.5, 0.25], ngram_tau=1.5, block_size=4,
           sequences=4, tokens=64, seconds=0.1)
if rank == 0:
    w.emit("run_start", config={}, versions={}, kernels={}, device="cpu", world_size=2,
           roles={"colocated": [0, 1]}, resumed_from=None, pid=os.getpid(), host=socket.gethostname(),
           total_steps=4)
    w.emit("phase", phase="training")
for step in range(1, 5):
    beat("training", step)
    if rank == 0:
        w.emit("step", step=step, epoch=0, loss=1.0 / step, acc=[0.5, 0.25, 0.1], lr=1e-3, grad_norm=1.0,
               tokens=10, tokens_per_s=10.0, step_time_s=0.1, queue_depth=0, queue_wait_s=0.0, recompiles=0,
               total_steps=4)
    if step % 2 == 0:
        beat("evaluating", step)
        if rank == 0:
            w.emit("phase", phase="evaluating")
            ev(step, 3.0 if step == 2 else 2.5)
        else:
            ev(step, 9.9)
    time.sleep(0.1)
print(f"rank {rank} evaluating", flush=True)
while not os.path.exists("done"):
    beat("evaluating", 4)
    time.sleep(0.2)
if rank == 0:
    w.emit("run_end", reason="completed", exit_code=0, step=4)
"""


def _scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_node0_evaluations_are_the_group_tau_in_status_history_and_export(tmp_path: Path,
                                                                          nodes: list[Node]) -> None:  # noqa: F811
    (tmp_path / "ranks.py").write_text(RANKS)
    hosts = write_hosts(tmp_path, nodes, {}, command=["ranks.py", "out/node{node}/events.jsonl"],
                        events="out/node{node}/events.jsonl", kill_grace=[5, 2],
                        preflight=["mkdir", "-p", str(tmp_path / "out/node{node}")])
    try:
        r = opsctl(hosts, "launch", "pair", "r", timeout=120)
        assert r.returncode == 0, r.stderr
        deadline = time.monotonic() + 60
        rows: list[dict[str, Any]] = group_status(hosts)
        while not (rows[0]["tau_step"] == 4 and rows[1]["phase"] == "evaluating") and time.monotonic() < deadline:
            time.sleep(0.5)
            rows = group_status(hosts)
        node0, node1 = rows
        # node 1's heartbeats say `evaluating`: it is training, and so is the group
        assert node1["phase"] == "evaluating" and node1["state"] == "training", node1
        assert node0["state"] == "training" and node0["group"]["state"] == "training", node0
        g = node0["group"]
        assert (g["tau"], g["tau_step"], g["tau_best"], g["tau_best_step"], g["ngram_tau"]) == (2.5, 4, 3.0, 2, 1.5)
        assert any(a["key"] == "tau_regression" for a in node0["alerts"]), node0["alerts"]
        table = opsctl(hosts, "status", "pair", "r")
        (line0,) = [ln for ln in table.stdout.splitlines() if ln.startswith("│ 0 ")]
        assert "best τ (step)" in table.stdout and "2.50 (4)" in line0 and "3.00 (2)" in line0, table.stdout

        (tmp_path / "done").write_text("")
        while group_status(hosts)[0]["group"]["state"] != "finished" and time.monotonic() < deadline:
            time.sleep(0.5)
        (h,) = group_history(hosts)
        assert (h["last_tau"], h["last_tau_step"], h["best_tau"], h["best_tau_step"]) == (2.5, 4, 3.0, 2), h
        r = opsctl(hosts, "history", "pair", "r")
        assert "last τ (step)" in r.stdout and "2.50 (4)" in r.stdout and "3.00 (2)" in r.stdout, r.stdout

        tb = tmp_path / "tb"
        r = opsctl(hosts, "export", "pair", "r", "--tensorboard", str(tb))
        assert r.returncode == 0 and "2 evaluations" in r.stderr, r.stderr
        assert _scalars(tb, "eval/tau") == [(2, 3.0), (4, 2.5)]  # node 1's 9.9 is not the group's
        assert [s for s, _ in _scalars(tb, "eval/accept_pos3")] == [2, 4]
    finally:
        opsctl(hosts, "kill", "pair", "r", timeout=120)
