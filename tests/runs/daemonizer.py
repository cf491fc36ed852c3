"""Test run that leaves a daemon behind: fork, setsid, fork again, the middle process exits (a double fork).

The daemon's parent is gone, so without a subreaper it re-parents to pid 1; its pid goes to --marker.
With --exit-after S the main process exits by itself after S seconds, leaving the daemon behind; with
--daemon-life S the daemon exits by itself after S seconds.
"""

from __future__ import annotations

import os
import signal
import time

from _common import parse, writer

args = parse(exit_after=0.0, daemon_life=0.0)
w = writer(args.events)
w.emit("phase", phase="training")
r, wfd = os.pipe()
if os.fork() == 0:
    os.setsid()  # leaves the run's session and process group
    if os.fork() == 0:
        os.close(r)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a daemon that ignores the polite signals
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(wfd, str(os.getpid()).encode())
        os.close(wfd)
        if args.daemon_life:
            time.sleep(args.daemon_life)
            os._exit(0)
        while True:
            time.sleep(1)
    os._exit(0)  # the middle process: the daemon is orphaned
os.close(wfd)
daemon = int(os.read(r, 32).decode())
os.close(r)
time.sleep(0.2)  # the middle process has exited by now: the daemon's parent is whoever adopted it
with open(f"/proc/{daemon}/stat") as fh:
    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
if args.marker:
    with open(args.marker + ".tmp", "w") as fh:
        fh.write(f"{daemon} {ppid}\n")
    os.replace(args.marker + ".tmp", args.marker)
stop = {"sig": None}


def on_signal(signum: int, frame: object) -> None:
    stop["sig"] = signal.Signals(signum).name


signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
w.emit("step", step=1, epoch=0, loss=1.0, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=1, tokens_per_s=1.0,
       step_time_s=0.1, queue_depth=0, queue_wait_s=0.0, recompiles=0, total_steps=1000)
end = time.monotonic() + args.exit_after if args.exit_after else None
while stop["sig"] is None and (end is None or time.monotonic() < end):
    time.sleep(0.05)
w.emit("run_end", reason="signal" if stop["sig"] else "completed", exit_code=0, step=1, signal=stop["sig"])
