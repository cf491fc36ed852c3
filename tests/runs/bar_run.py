"""Test run that draws a carriage-return progress bar while it loads, as transformers' `Loading weights` does (tqdm:
one `\r`-separated state per update, a newline only when the bar closes), then trains a few steps.
"""

from __future__ import annotations

import sys
import time

from _common import parse, writer

args = parse(n=30, tick=0.01, steps=3, step_time=0.05)
w = writer(args.events, args.steps)
w.emit("phase", phase="loading_target", i=0, n=args.n)
for i in range(args.n + 1):
    pct = 100 * i // args.n
    bar = "█" * (10 * i // args.n)
    sys.stdout.write(f"\rLoading weights: {pct:3d}%|{bar:<10}| {i}/{args.n} [{i}it]")
    sys.stdout.flush()
    if i:
        w.emit("phase", phase="loading_target", i=i, n=args.n, detail=f"tensor {i}")
    time.sleep(args.tick)
sys.stdout.write("\n")
print("target loaded", flush=True)
w.emit("phase", phase="training")
for step in range(1, args.steps + 1):
    time.sleep(args.step_time)
    w.emit("step", step=step, epoch=0, loss=1.0 / step, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=100,
           tokens_per_s=500.0, step_time_s=args.step_time, queue_depth=0, queue_wait_s=0.0, recompiles=0,
           total_steps=args.steps)
    print(f"step {step}", flush=True)
w.emit("run_end", reason="completed", exit_code=0, step=args.steps)
