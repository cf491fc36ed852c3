"""Test run that trains steps and evaluates its drafter every --eval-every steps, like dflash.train with
`train.eval_every`: a `phase` `evaluating` line, then an `eval` event (docs/events.md), then more steps.

--taus gives the tau of each evaluation in order (the n-th evaluation of the run, counted from step 0, so a resumed
attempt continues the list). A fresh start crashes after step --crash-at (0: never); --resume-step S (a restart's
resume argument) continues after step S, as a run resumed from its checkpoint there. --hold-eval-s keeps the last evaluation in progress
that long (heartbeats go on, as the real writer's thread writes them) before its `eval` event.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from _common import parse

from dflash.telemetry import EventWriter, Heartbeat

args = parse(steps=10, step_time=0.05, eval_every=2, taus="", ngram=1.8, block_size=4, crash_at=0, resume_step=-1,
             hold_eval_s=0.0, heartbeat_s=0.2)
taus = [float(x) if x != "null" else None for x in args.taus.split(",") if x]
resumed = args.resume_step if args.resume_step >= 0 else None
w = EventWriter(args.events, run_id="eval-run", truncate=resumed is None)
w.emit("run_start", config={"script": "eval_run.py"}, versions={"python": sys.version.split()[0]}, kernels={},
       device="cpu", world_size=1, roles={"colocated": [0]}, resumed_from=resumed, pid=os.getpid(),
       host=socket.gethostname(), total_steps=args.steps)
now = {"phase": "training", "step": resumed or 0}
beat = Heartbeat(w, lambda: {"phase": now["phase"], "step": now["step"], "gpu_mem_mb": None},
                 interval_s=args.heartbeat_s).start()
w.emit("phase", phase="training")
B = args.block_size
for step in range((resumed or 0) + 1, args.steps + 1):
    time.sleep(args.step_time)
    w.emit("step", step=step, epoch=0, loss=4.0 / step, acc=[0.5] * (B - 1), lr=1e-3, grad_norm=1.0, tokens=100,
           tokens_per_s=500.0, step_time_s=args.step_time, queue_depth=0, queue_wait_s=0.0, recompiles=0,
           total_steps=args.steps)
    now["step"] = step
    print(f"step {step}", flush=True)
    k = step // args.eval_every - 1
    if args.eval_every and step % args.eval_every == 0 and 0 <= k < len(taus):
        now["phase"] = "evaluating"
        w.emit("phase", phase="evaluating")
        if step == args.steps and args.hold_eval_s:
            print("evaluating (held)", flush=True)
            time.sleep(args.hold_eval_s)
        tau = taus[k]
        acc = [None if tau is None else max(0.0, min(1.0, (tau - 1) / (B - 1) * (1.2 - 0.1 * i))) for i in range(B - 1)]
        w.emit("eval", step=step, tau=tau, accept_by_position=acc, accept_hist=[3, 2, 1, 4][:B] + [0] * (B - 4),
               ngram_tau=args.ngram, block_size=B, sequences=8, tokens=512, seconds=0.5,
               **({} if tau is None else {"tau_ci95": [tau - 0.1, tau + 0.1]}))
        print(f"eval at step {step}: tau {tau}", flush=True)
        now["phase"] = "training"
    if resumed is None and step == args.crash_at:
        beat.stop()
        raise RuntimeError(f"eval_run crash after step {step} (test crash)")
beat.stop()
w.emit("run_end", reason="completed", exit_code=0, step=args.steps)
print("run ended: completed", flush=True)
