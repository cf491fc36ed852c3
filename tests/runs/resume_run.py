"""Test run that resumes like `dflash train --resume auto` (dflash/rundir.py select_start): its length is --max-steps,
else the config's `max_steps`; it starts after the newest checkpoint in --out, and refuses (`already at step S of T`,
a fatal error, run_end `refused`, exit 2) when that checkpoint is at or past its length. On SIGINT/SIGTERM it saves
a checkpoint at its step (a real file, a `checkpoint` event) and ends with run_end `signal`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from _common import parse

from dflash.telemetry import EventWriter

args = parse(out="", config="", max_steps=0, resume="", step_time=0.05)
out = Path(args.out)
(out / "ckpt").mkdir(parents=True, exist_ok=True)
cfg_steps = json.loads(Path(args.config).read_text())["max_steps"]
total = args.max_steps or cfg_steps
saved = sorted(int(p.name.split("-")[1]) for p in (out / "ckpt").glob("step-*")) if args.resume else []
start = saved[-1] if saved else 0
w = EventWriter(args.events, run_id="resume-run")
stop = {"sig": False}


def on_signal(signum: int, frame: object) -> None:
    stop["sig"] = True


signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
if start >= total:
    why = f"{out / 'ckpt' / f'step-{start}'}: already at step {start} of {total}; raise --max-steps to continue"
    print(f"dflash train: {why}", flush=True)
    w.emit("error", **{"class": "config"}, message=why, traceback=None, fatal=True)
    w.emit("run_end", reason="refused", exit_code=2, step=start)
    sys.exit(2)
w.emit("run_start", config={"train": {"max_steps": cfg_steps}}, versions={}, kernels={}, device="cpu", world_size=1,
       roles={"colocated": [0]}, resumed_from=start if saved else None, pid=os.getpid(), host=socket.gethostname(),
       total_steps=total)
w.emit("phase", phase="training")
step = start
while step < total and not stop["sig"]:
    time.sleep(args.step_time)
    step += 1
    w.emit("step", step=step, epoch=0, loss=1.0 / step, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=100,
           tokens_per_s=500.0, step_time_s=args.step_time, queue_depth=0, queue_wait_s=0.0, recompiles=0,
           total_steps=total)
    print(f"step {step}", flush=True)
path = out / "ckpt" / f"step-{step}"
path.write_text(f"checkpoint at step {step}\n")
w.emit("checkpoint", path=str(path), step=step, manifest_sha256="0" * 64, bytes=path.stat().st_size, seconds=0.0)
w.emit("run_end", reason="signal" if stop["sig"] else "completed", exit_code=0, step=step)
print(f"run ended at step {step}", flush=True)
