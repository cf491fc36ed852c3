"""Test run that reports a long load (loading_target i/N per layer), a compile phase, then trains a few steps.

It stands in for a real target load, whose `phase` events come once per layer (docs/events.md).
"""

from __future__ import annotations

import time

from _common import parse, train, writer

args = parse(layers=64, layer_time=0.01, steps=3, step_time=0.05)
w = writer(args.events, args.steps)
w.emit("phase", phase="loading_target", i=0, n=1)
for i in range(1, args.layers + 1):
    time.sleep(args.layer_time)
    w.emit("phase", phase="loading_target", i=i, n=args.layers, detail=f"layer {i}")
print("target loaded", flush=True)
w.emit("phase", phase="compiling")
time.sleep(0.2)
train(w, args.steps, args.step_time)
