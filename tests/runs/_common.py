"""Shared helpers of the test run scripts: telemetry writer set-up and argument parsing.

The scripts stand in for training runs (they write the real event contract through dflash.telemetry).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dflash.telemetry import EventWriter  # noqa: E402


def parse(argv: list[str] | None = None, **extra: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--events", required=True)
    p.add_argument("--marker", default=None, help="file the script writes facts to (pids, times) for the test")
    for name, default in extra.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    return p.parse_args(argv)


def writer(path: str, total_steps: int = 10) -> EventWriter:
    w = EventWriter(path, run_id="test-run", truncate=True)
    w.emit("run_start", config={"script": os.path.basename(sys.argv[0])}, versions={"python": sys.version.split()[0]},
           kernels={}, device="cpu", world_size=1, roles={"colocated": [0]}, resumed_from=None, pid=os.getpid(),
           host=socket.gethostname(), total_steps=total_steps)
    return w


def train(w: EventWriter, steps: int, step_time: float) -> None:
    """The training phase of a stand-in run: `steps` step events `step_time` apart (each also printed), then a
    completed run_end."""
    import time

    w.emit("phase", phase="training")
    for step in range(1, steps + 1):
        time.sleep(step_time)
        w.emit("step", step=step, epoch=0, loss=1.0 / step, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=100,
               tokens_per_s=500.0, step_time_s=step_time, queue_depth=0, queue_wait_s=0.0, recompiles=0,
               total_steps=steps)
        print(f"step {step}", flush=True)
    w.emit("run_end", reason="completed", exit_code=0, step=steps)
