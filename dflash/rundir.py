"""The run directory of `dflash train`: what OUT may hold (--fresh/--resume), the run id, events and log writers, and
the point a run starts from (which checkpoint, which schedule, how many steps).

Everything that reads or writes OUT before the first step is here; dflash/train.py only uses what it returns.
"""

from __future__ import annotations

import json
import logging
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dflash import checkpoint as ckpt
from dflash.config import RunConfig
from dflash.data import Schedule, TokenizedCorpus, load_or_build_schedule
from dflash.pipeline import FeedState, Roles, drafter_feed, epochs_needed, total_steps_for
from dflash.telemetry import EventWriter


class UsageError(RuntimeError):
    """Bad input found after the config loaded (data, resume state): one line, exit 2."""


class ResumeRefused(UsageError):
    """A resume that cannot continue (corrupt newest checkpoint, nothing left to train): run_end reason `refused`,
    at the step of the checkpoint the run stands at, so status keeps showing how far it got."""

    def __init__(self, msg: str, step: int) -> None:
        super().__init__(msg)
        self.step = step


def check_out(out: Path, roles: Roles, *, resume: bool, fresh: bool) -> None:
    """What OUT holds against --resume/--fresh. --fresh deletes only OUT/checkpoints/step-N (and crashed temp dirs),
    and only once the whole config has been checked (the caller's job)."""
    found = ckpt.list_checkpoints(out)
    if found and fresh and roles.rank == 0:
        ckpt.remove_all(out)
        found = []
    if found and not resume and not fresh:
        raise UsageError(f"{out}: has checkpoints ({found[0][1].name}); pass --resume (or --fresh to start over) "
                         "or use a new --out")


@dataclass
class RunDir:
    """An opened run directory: the run id every rank shares, this rank's event writer and log."""

    out: Path
    run_id: str
    writer: EventWriter
    log: logging.Logger

    def close(self) -> None:
        self.writer.close()
        for h in self.log.handlers:
            h.close()


def open_run_dir(out: Path, roles: Roles, *, resume: bool) -> RunDir:
    """Create OUT, agree on the run id (kept across resumes, in OUT/run.json), open events.jsonl (truncated by rank 0
    for a fresh run, before the other ranks open it for appending) and the log."""
    out.mkdir(parents=True, exist_ok=True)
    run_file = out / "run.json"
    run_id = None
    if resume and run_file.is_file():
        run_id = json.loads(run_file.read_text()).get("run_id")
    if run_id is None:
        run_id = uuid.uuid4().hex[:12]
    if roles.world_size > 1:
        holder = [run_id]
        dist.broadcast_object_list(holder, src=0)
        run_id = holder[0]
    if roles.rank == 0:
        run_file.write_text(json.dumps({"run_id": run_id}) + "\n")
    writer = EventWriter(out / "events.jsonl", run_id, rank=roles.rank,
                         truncate=(roles.rank == 0 and not resume)) if roles.rank == 0 else None
    if roles.world_size > 1:
        dist.barrier()
    if writer is None:
        writer = EventWriter(out / "events.jsonl", run_id, rank=roles.rank)
    return RunDir(out=out, run_id=run_id, writer=writer, log=make_logger(out, roles.rank))


def make_logger(out: Path, rank: int) -> logging.Logger:
    """train.log (rank 0) or train.rankN.log, and stdout: the human side of the events."""
    log = logging.getLogger(f"dflash.train.{out.resolve()}.{rank}")
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    fmt = logging.Formatter("%(asctime)s " + (f"[rank {rank}] " if rank else "") + "%(message)s", "%H:%M:%S")
    name = "train.log" if rank == 0 else f"train.rank{rank}.log"
    for h in (logging.FileHandler(out / name), logging.StreamHandler(sys.stdout)):
        h.setFormatter(fmt)
        log.addHandler(h)
    return log


@dataclass
class StartPoint:
    """Where a run starts: its checkpoint (None: from scratch), the schedule and each drafter rank's feed."""

    resume_path: Path | None
    start_step: int
    total: int
    buffers_per_epoch: int
    n_epochs: int
    schedule: Schedule
    feeds: list[Any]
    states: list[FeedState] = field(default_factory=list)


def select_start(out: Path, cfg: RunConfig, roles: Roles, corpus: TokenizedCorpus, *, resume: bool,
                 max_steps: int | None) -> StartPoint:
    """The resume state (read by rank 0 and broadcast, so every rank continues from the same place) and the shared
    epoch schedule on disk (written by rank 0 only, read by the others)."""
    rank0 = roles.rank == 0
    n_d = len(roles.drafters)
    resume_state: dict[str, Any] | None = None
    resume_path: Path | None = None
    if resume and rank0:
        try:
            resume_path = ckpt.latest_checkpoint(out)
        except ckpt.CheckpointError as exc:  # the run still stands at its newest checkpoint's step
            raise ResumeRefused(str(exc), ckpt.list_checkpoints(out)[0][0]) from None
        if resume_path is None:
            raise UsageError(f"{out}: --resume given but no checkpoint in {ckpt.checkpoints_dir(out)}")
        resume_state = ckpt.load_file(resume_path, "pipeline.json")
    if roles.world_size > 1:
        holder = [resume_state, None if resume_path is None else str(resume_path)]
        dist.broadcast_object_list(holder, src=0)
        resume_state = holder[0]
        resume_path = None if holder[1] is None else Path(holder[1])
    if resume and resume_state is None:
        raise UsageError(f"{out}: nothing to resume")
    # A resumed run keeps its planned length unless --max-steps says otherwise.
    if max_steps is None and resume_state is not None and cfg.train.max_steps is None:
        planned = int(resume_state["total_steps"])
    else:
        planned = None
    sched_path = out / "schedule.json"
    if not resume and rank0 and sched_path.is_file():
        sched_path.unlink()  # a fresh run in an old directory makes its own schedule (ours by name, inside OUT)
    if roles.world_size > 1:
        dist.barrier()
    first = load_or_build_schedule(corpus, cfg.data, cfg.train.seed, 1, sched_path, write=False)
    bpe = len(first.epochs[0])
    total = planned or total_steps_for(bpe, cfg.train.epochs, max_steps or cfg.train.max_steps, n_d)
    n_epochs = epochs_needed(bpe, total, n_d)
    if roles.world_size > 1 and roles.rank != 0:
        dist.barrier()  # wait for rank 0 to write (or extend) the schedule, then read the same file
    schedule = load_or_build_schedule(corpus, cfg.data, cfg.train.seed, n_epochs, sched_path, write=rank0)
    if roles.world_size > 1 and roles.rank == 0:
        dist.barrier()
    feeds = [drafter_feed(schedule.buffers_per_epoch(), total, n_d, d) for d in range(n_d)]
    states = [FeedState()] * n_d
    start_step = int(resume_state["step"]) if resume_state else 0
    if resume_state is not None:
        states = [FeedState.from_json(s) for s in resume_state["feeds"]]
        if len(states) != n_d:
            raise ResumeRefused(f"{resume_path}: saved with {len(states)} drafter ranks, this job has {n_d}",
                                start_step)
    if start_step >= total:
        raise ResumeRefused(f"{resume_path}: already at step {start_step} of {total}; raise --max-steps to "
                            "continue", start_step)
    return StartPoint(resume_path=resume_path, start_step=start_step, total=total, buffers_per_epoch=bpe,
                      n_epochs=n_epochs, schedule=schedule, feeds=feeds, states=states)
