"""Test run that reports a long load (loading_target i/N per layer), a compile phase, then trains a few steps.

It stands in for a real target load, whose `phase` events come once per layer (docs/events.md).
"""

from __future__ import annotations

import time

from _common import parse, writer

args = parse(layers=64, layer_time=0.01, steps=3, step_time=0.05)
w = writer(args.events, args.steps)
w.emit("phase", phase="loading_target", i=0, n=1)
for i in range(1, args.layers + 1):
    time.sleep(args.layer_time)
    w.emit("phase", phase="loading_target", i=i, n=args.layers, detail=f"layer {i}")
print("target loaded", flush=True)
w.emit("phase", phase="compiling")
time.sleep(0.2)
w.emit("phase", phase="training")
for step in range(1, args.steps + 1):
    time.sleep(args.step_time)
    w.emit("step", step=step, epoch=0, loss=1.0 / step, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=100,
           tokens_per_s=500.0, step_time_s=args.step_time, queue_depth=0, queue_wait_s=0.0, recompiles=0,
           total_steps=args.steps)
    print(f"step {step}", flush=True)
w.emit("run_end", reason="completed", exit_code=0, step=args.steps)
