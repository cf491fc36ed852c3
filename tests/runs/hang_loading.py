"""Test run that hangs while loading (shard 3 of 8) but keeps writing heartbeats, like a deadlocked loader.
"""

from __future__ import annotations

import time

from _common import parse, writer

from dflash.telemetry import Heartbeat

args = parse(heartbeat=0.5)
w = writer(args.events)
w.emit("phase", phase="loading_target", i=3, n=8)
print("loading shard 3/8", flush=True)
Heartbeat(w, lambda: {"phase": "loading_target", "step": 0}, interval_s=args.heartbeat).start()
while True:
    time.sleep(3600)
