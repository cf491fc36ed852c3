"""Test run with a known wall time per step: it writes `steps` step events whose timestamps lie `wall` seconds
apart (with a seeded +-jitter; from the run's start on, into the future: `status` reads only the events after
the launch, and a heartbeat with the real time follows them), each saying a `step_time_s` of only `compute` seconds (a step's compute,
without the data waits, evaluations and checkpoints between steps), then heartbeats until it is signalled.

So the true remainder is known: (total - steps) x wall seconds.
"""

from __future__ import annotations

import random
import signal
import sys
import time

from _common import parse, writer

args = parse(steps=300, total=1000, wall=2.0, compute=0.5, jitter=0.5, seed=0)
stop = {"sig": False}
signal.signal(signal.SIGINT, lambda *_: stop.update(sig=True))
signal.signal(signal.SIGTERM, lambda *_: stop.update(sig=True))
rng = random.Random(args.seed)
gaps = [args.wall + rng.uniform(-args.jitter, args.jitter) for _ in range(args.steps)]
now = time.time()
w = writer(args.events, args.total)
w.emit("phase", phase="training")
ts = now
for step in range(1, args.steps + 1):
    if step > 1:
        ts += gaps[step - 1]
    w.emit("step", ts=ts, step=step, epoch=0, loss=5.0 / step, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=100,
           tokens_per_s=100 / args.compute, step_time_s=args.compute, queue_depth=0, queue_wait_s=0.0, recompiles=0,
           total_steps=args.total)
print(f"wrote {args.steps} steps, {sum(gaps[1:]) / (args.steps - 1):.4f} s apart on average", flush=True)
while not stop["sig"]:
    w.emit("heartbeat", step=args.steps, phase="training", rss_mb=10.0, gpu_mem_mb=None)
    time.sleep(0.5)
w.emit("run_end", reason="signal", exit_code=0, step=args.steps, signal="SIGINT")
sys.exit(0)
