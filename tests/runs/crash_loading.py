"""Test run that raises while loading the target (shard 2 of 4), like a run dying on a missing file.

Writes the time just before the raise to --marker so a test can measure how fast the death is reported.
"""

from __future__ import annotations

import time

from _common import parse, writer

args = parse(delay=0.3)
w = writer(args.events)
w.emit("phase", phase="loading_target", i=1, n=4)
print("loading shard 1/4", flush=True)
time.sleep(args.delay)
w.emit("phase", phase="loading_target", i=2, n=4)
print("loading shard 2/4", flush=True)


def load_shard(n: int) -> None:
    raise FileNotFoundError(f"/dev/shm/model/shard-{n}.safetensors: no such file (test crash)")


if args.marker:
    with open(args.marker, "w") as fh:
        fh.write(repr(time.time()))
load_shard(2)
