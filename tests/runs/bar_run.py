"""Test run that draws a carriage-return progress bar while it loads, as transformers' `Loading weights` does (tqdm:
one `\r`-separated state per update, a newline only when the bar closes), then trains a few steps.
"""

from __future__ import annotations

import sys
import time

from _common import parse, train, writer

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
train(w, args.steps, args.step_time)
