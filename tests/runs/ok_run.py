"""Test run that loads, then trains steps and honours SIGINT/SIGTERM like the training core.

On a signal it finishes the step, writes a checkpoint (a real file) and `run_end`, and exits 0.
"""

from __future__ import annotations

import os
import signal
import time

from _common import parse, writer

args = parse(steps=5, step_time=0.2, load_time=0.3, ckpt_dir="", signal_log="", disk_full_steps="",
             checkpoint_steps="", paces="", alloc_retries="")
# Steps after which the run reports a checkpoint that did not fit (a `disk_full` error, as dflash.train writes it) or
# one that did (a `checkpoint` event), comma-separated.
disk_full_at = {int(x) for x in args.disk_full_steps.split(",") if x}
checkpoint_at = {int(x) for x in args.checkpoint_steps.split(",") if x}
# Per step, the `pace` its event carries (dflash/pace.py; empty: none yet), comma-separated.
paces = {i + 1: float(x) for i, x in enumerate(args.paces.split(",")) if x}
# Per step, the gpu_alloc_retries of a heartbeat written after it (empty: none), comma-separated. Its `ts` is a
# synthetic clock, ten minutes into training and two minutes a step (the memory rules look at that much time).
alloc_retries = {i + 1: int(x) for i, x in enumerate(args.alloc_retries.split(",")) if x}
stop = {"sig": None}


def on_signal(signum: int, frame: object) -> None:
    if args.signal_log:
        with open(args.signal_log, "a") as fh:
            fh.write(signal.Signals(signum).name + "\n")
    if stop["sig"] is not None:
        os._exit(130)  # a second signal exits at once
    stop["sig"] = signal.Signals(signum).name


signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
w = writer(args.events, args.steps)
print("loading model", flush=True)
w.emit("phase", phase="loading_target", i=1, n=1)
time.sleep(args.load_time)
training_ts = w.emit("phase", phase="training")["ts"]
step = 0
while step < args.steps and stop["sig"] is None:
    time.sleep(args.step_time)
    step += 1
    w.emit("step", step=step, epoch=0, loss=5.0 / step, acc=[0.1, 0.05], lr=1e-3, grad_norm=1.0, tokens=100,
           tokens_per_s=500.0, step_time_s=args.step_time, queue_depth=0, queue_wait_s=0.0, recompiles=0,
           total_steps=args.steps, **({"pace": paces[step], "pace_ref_s": 0.5} if step in paces else {}))
    print(f"step {step} loss {5.0 / step:.3f}", flush=True)
    if step in alloc_retries:
        w.emit("heartbeat", ts=training_ts + 600 + 120 * step, phase="training", step=step, rss_mb=100.0,
               gpu_mem_mb=60000.0, gpu_reserved_mb=70000.0, gpu_alloc_retries=alloc_retries[step])
    if step in checkpoint_at:
        w.emit("checkpoint", path=f"/ckpt/step-{step}", step=step, manifest_sha256="0" * 64, bytes=10, seconds=0.0,
               free_bytes=5)
    if step in disk_full_at:
        w.emit("error", **{"class": "disk_full"}, message=f"checkpoint step-{step} not saved: No space left on device",
               traceback=None, fatal=False)
if stop["sig"] is not None and args.ckpt_dir:
    os.makedirs(args.ckpt_dir, exist_ok=True)
    path = os.path.join(args.ckpt_dir, f"step{step}.pt")
    with open(path, "w") as fh:
        fh.write(f"checkpoint at step {step}\n")
    w.emit("checkpoint", path=path, step=step, manifest_sha256="0" * 64, bytes=os.path.getsize(path), seconds=0.0)
reason = "signal" if stop["sig"] else "completed"
extra = {"signal": stop["sig"]} if stop["sig"] else {}
w.emit("run_end", reason=reason, exit_code=0, step=step, **extra)
print(f"run ended: {reason}", flush=True)
