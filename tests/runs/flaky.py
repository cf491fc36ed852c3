"""Test run that crashes on its first --fail-times starts and then completes, like a run hit by a flaky node.

Each start appends one line to --counter (`start N resume|fresh ARGS`), so a test sees how often and how it ran.
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import writer

p = argparse.ArgumentParser()
p.add_argument("--events", required=True)
p.add_argument("--counter", required=True)
p.add_argument("--fail-times", type=int, default=2)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--step-time", type=float, default=0.1)
p.add_argument("--resume", action="store_true")
p.add_argument("--max-steps", type=int, default=None)
args = p.parse_args()
try:
    with open(args.counter) as fh:
        n = len(fh.readlines()) + 1
except FileNotFoundError:
    n = 1
with open(args.counter, "a") as fh:
    fh.write(f"start {n} {'resume' if args.resume else 'fresh'} {' '.join(sys.argv[1:])}\n")
steps = args.max_steps or args.steps
w = writer(args.events, steps)
w.emit("phase", phase="training")
first = 1 if not args.resume else 2
for step in range(first, steps + 1):
    time.sleep(args.step_time)
    w.emit("step", step=step, epoch=0, loss=1.0 / step, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=10,
           tokens_per_s=100.0, step_time_s=args.step_time, queue_depth=0, queue_wait_s=0.0, recompiles=0,
           total_steps=steps)
    print(f"step {step}", flush=True)
    if n <= args.fail_times:
        raise RuntimeError(f"flaky failure {n} (test crash)")
w.emit("run_end", reason="completed", exit_code=0, step=steps)
print("run ended: completed", flush=True)
