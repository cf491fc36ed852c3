"""Test run whose events file gains valid-JSON lines of the wrong types mid-training (issue 39 item 1): a
`run_start` with `"resumed_from": "x"`, `"total_steps": "many"`, `"config": null`, then `"kind": 42`,
`"ts": "yesterday"`, `"step": "six"`; then it keeps stepping, and (with --hold) stays alive at its last step.
"""

from __future__ import annotations

import json
import time

from _common import parse, writer

args = parse(steps=26, bad_after=13, step_time=0.02, hold=0.0)
w = writer(args.events, args.steps)
w.emit("phase", phase="training")


def step(n: int) -> None:
    w.emit("step", step=n, epoch=0, loss=1.0 / n, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=100,
           tokens_per_s=500.0, step_time_s=args.step_time, queue_depth=0, queue_wait_s=0.0, recompiles=0,
           total_steps=args.steps)
    print(f"step {n}", flush=True)


for n in range(1, args.bad_after + 1):
    time.sleep(args.step_time)
    step(n)
now = time.time()
bad = [
    {"v": 1, "ts": now, "kind": "run_start", "run_id": "test-run", "rank": 0, "seq": 900, "resumed_from": "x",
     "total_steps": "many", "config": None, "versions": {}, "kernels": {}, "device": "cpu", "world_size": 1,
     "roles": {}, "pid": 1, "host": "h"},
    {"v": 1, "ts": now, "kind": 42, "run_id": "test-run", "rank": 0, "seq": 901},
    {"v": 1, "ts": "yesterday", "kind": "heartbeat", "run_id": "test-run", "rank": 0, "seq": 902,
     "phase": "training", "step": 13, "rss_mb": 1.0},
    {"v": 1, "ts": now, "kind": "step", "run_id": "test-run", "rank": 0, "seq": 903, "step": "six", "loss": 0.1},
]
with open(args.events, "a") as fh:  # one O_APPEND write per line, as EventWriter does
    for ev in bad:
        fh.write(json.dumps(ev) + "\n")
        fh.flush()
for n in range(args.bad_after + 1, args.steps + 1):
    time.sleep(args.step_time)
    step(n)
print("holding", flush=True)
time.sleep(args.hold)
if not args.hold:
    w.emit("run_end", reason="completed", exit_code=0, step=args.steps)
