"""Test run whose events file holds one line of valid JSON that breaks the contract's types (`"ts": "yesterday"`)
among real events, as a hand edit, a foreign writer or a half-migrated tool would leave it.
"""

from __future__ import annotations

import json
import time

from _common import parse, writer

args = parse(steps=5, step_time=0.05)
w = writer(args.events, args.steps)
w.emit("phase", phase="loading_target", i=1, n=1)
with open(args.events, "a") as fh:  # one O_APPEND write, as EventWriter does
    fh.write(json.dumps({"v": 1, "ts": "yesterday", "kind": "step", "run_id": "test-run", "rank": 0, "seq": 99,
                         "step": "three", "loss": "low"}) + "\n")
w.emit("phase", phase="training")
for step in range(1, args.steps + 1):
    time.sleep(args.step_time)
    w.emit("step", step=step, epoch=0, loss=1.0 / step, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=100,
           tokens_per_s=500.0, step_time_s=args.step_time, queue_depth=0, queue_wait_s=0.0, recompiles=0,
           total_steps=args.steps)
    print(f"step {step}", flush=True)
w.emit("run_end", reason="completed", exit_code=0, step=args.steps)
