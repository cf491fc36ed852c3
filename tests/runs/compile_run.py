"""Test run that reports a `compiling` phase, then either trains one step or dies while compiling.

It prints the cache directories it was given (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) and leaves an
artifact in the inductor cache, as a real compile would, so tests can see what launch kept or cleared.
"""

from __future__ import annotations

import os
import time

from _common import parse, writer

args = parse(crash=0, hold=0.0)
w = writer(args.events, 1000)  # never "finished": a relaunch is allowed
cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
print(f"TORCHINDUCTOR_CACHE_DIR={cache}", flush=True)
print(f"TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR', '')}", flush=True)
print(f"DFLASH_WARM_START={os.environ.get('DFLASH_WARM_START', '')}", flush=True)
w.emit("phase", phase="compiling", detail="the first step compiles the drafter")
if cache:
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, f"artifact-{os.getpid()}.so"), "w") as fh:
        fh.write("compiled\n")
if args.crash:
    raise RuntimeError("inductor: compile worker died (test crash)")
time.sleep(args.hold)
w.emit("step", step=1, epoch=0, loss=1.0, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=1, tokens_per_s=1.0,
       step_time_s=0.1, queue_depth=0, queue_wait_s=0.0, recompiles=0, total_steps=1000)
w.emit("run_end", reason="completed", exit_code=0, step=1)
print("run ended: completed", flush=True)
