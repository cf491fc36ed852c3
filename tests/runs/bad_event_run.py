"""Test run whose events file holds one line of valid JSON that breaks the contract's types (`"ts": "yesterday"`)
among real events, as a hand edit, a foreign writer or a half-migrated tool would leave it.
"""

from __future__ import annotations

import json

from _common import parse, train, writer

args = parse(steps=5, step_time=0.05)
w = writer(args.events, args.steps)
w.emit("phase", phase="loading_target", i=1, n=1)
with open(args.events, "a") as fh:  # one O_APPEND write, as EventWriter does
    fh.write(json.dumps({"v": 1, "ts": "yesterday", "kind": "step", "run_id": "test-run", "rank": 0, "seq": 99,
                         "step": "three", "loss": "low"}) + "\n")
train(w, args.steps, args.step_time)
