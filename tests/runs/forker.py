"""Test run that forks children and grandchildren (one leaves the process group, one ignores SIGINT/SIGTERM).

Writes every pid to --marker so a test can check through /proc that none survives `opsctl kill`.
"""

from __future__ import annotations

import os
import signal
import time

from _common import parse, writer

args = parse(ckpt_dir="")
w = writer(args.events)
w.emit("phase", phase="training")
pids = [os.getpid()]


def spawn(stubborn: bool, own_group: bool, grandchild: bool) -> int:
    pid = os.fork()
    if pid:
        return pid
    if own_group:
        os.setsid()  # a descendant that left the run's process group
    if stubborn:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if grandchild and os.fork() == 0:
        while True:
            time.sleep(1)
    while True:
        time.sleep(1)


stop = {"sig": None}


def on_signal(signum: int, frame: object) -> None:
    stop["sig"] = signal.Signals(signum).name


pids.append(spawn(stubborn=False, own_group=False, grandchild=True))
pids.append(spawn(stubborn=True, own_group=False, grandchild=False))
pids.append(spawn(stubborn=False, own_group=True, grandchild=True))
signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
time.sleep(0.3)  # let the grandchildren start
all_pids = set(pids)
for p in list(pids):  # grandchildren: children of our children
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == p:
                all_pids.add(int(name))
if args.marker:
    with open(args.marker + ".tmp", "w") as fh:
        fh.write(" ".join(str(p) for p in sorted(all_pids)))
    os.replace(args.marker + ".tmp", args.marker)
step = 0
while stop["sig"] is None:
    time.sleep(0.1)
    step += 1
    if step == 1:
        w.emit("step", step=1, epoch=0, loss=1.0, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=1, tokens_per_s=1.0,
               step_time_s=0.1, queue_depth=0, queue_wait_s=0.0, recompiles=0, total_steps=1000)
if args.ckpt_dir:
    os.makedirs(args.ckpt_dir, exist_ok=True)
    path = os.path.join(args.ckpt_dir, "step.pt")
    with open(path, "w") as fh:
        fh.write("ckpt\n")
    w.emit("checkpoint", path=path, step=step, manifest_sha256="0" * 64, bytes=5, seconds=0.0)
w.emit("run_end", reason="signal", exit_code=0, step=step, signal=stop["sig"])
