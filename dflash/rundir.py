"""The run directory of `dflash train`: what OUT may hold (--fresh/--resume), the run id, events and log writers, and
the point a run starts from (which checkpoint, which schedule, how many steps).

Everything that reads or writes OUT before the first step is here; dflash/train.py only uses what it returns.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dflash import checkpoint as ckpt
from dflash import locks
from dflash.config import ConfigError, RunConfig, config_from_dict
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


def hold_run_lock(out: Path) -> Path:
    """OUT/run.lock for this process (dflash/locks.py): a second trainer on one OUT would interleave steps and
    checkpoints with the first. Refused in one line naming the holder; release with locks.release(path)."""
    try:
        return locks.acquire(locks.run_lock(out), str(out), hint="another dflash train writes there: stop it first "
                             "(opsctl kill, or SIGTERM that pid), or use another --out")
    except locks.LockBusy as exc:
        raise UsageError(str(exc)) from None


def drop_unused_run_dir(out: Path) -> None:
    """Remove an OUT that this process created only to lock it (a refusal found after the lock: bad data, a mask
    token outside a tokenizer's vocabulary): a refused run leaves no directory behind. Call it still holding the
    lock, so nobody else can be using the file it unlinks."""
    try:
        if [p.name for p in out.iterdir()] == [locks.RUN_LOCK]:
            (out / locks.RUN_LOCK).unlink()
            out.rmdir()
    except OSError:
        pass


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


# Resume policy per config field: a resume continues the same training, so what decides the model's shape, the
# target it learns from, the data and its order, or the objective must be what the checkpoint was trained with; how
# the run is computed (backends, memory), reported, saved or how long it runs may change. Fields not named here
# follow their section's rule (RESUME_SECTIONS), so a new field in a free section (dist, an eval section) is free.
RESUME_FREE = {
    # drafter: the same weights and the same function, computed another way
    "drafter.attention": "backend only (flex and dense compute the same attention)",
    "drafter.ce_chunk": "memory only (the loss is the same, in other chunks)",
    "drafter.grad_checkpoint": "memory only",
    # target: where and how it runs, not what it computes
    "target.dtype": "precision of the frozen target's forward (auto differs between CPU and GPU hosts)",
    "target.packing": "how buffers are laid out for the target's forward, not their content",
    "target.attention": "kernel choice only",
    "target.allow_slow_kernels": "a permission, not a setting",
    "target.pretrain.cache_dir": "where the cache lives; the entry is keyed by content",
    "target.regen.cache_dir": "where the cache lives; the entry is keyed by content",
    # data: where the tokenizer is cached (the tokenizer content is checked by schedule.json's fingerprint)
    "data.tokenizer_cache": "a location; the tokenizer's content is checked through schedule.json",
}
RESUME_FIXED = {
    # train: the optimizer and scheduler state come from the checkpoint, so a changed lr, betas or weight_decay
    # would be silently ignored (restored from it); grad_clip and the schedule shape would change the objective
    # halfway; the seed decides the data order (schedule.json) and the anchors.
    "train.seed", "train.lr", "train.betas", "train.weight_decay", "train.grad_clip", "train.warmup_frac",
    "train.min_lr_ratio",
}
# section -> True: every field must match unless in RESUME_FREE; False: only the RESUME_FIXED ones.
# train.max_steps/epochs (the run's length: --max-steps already extends a resumed run), checkpoint_every, keep_last,
# final_save_wait_s, heartbeat_s, log_every, compile, compile_backend, compile_scope are free; dist is free (the number of drafter
# ranks is checked against the checkpoint's feeds in select_start).
RESUME_SECTIONS = {"drafter": True, "target": True, "data": True, "train": False, "dist": False}


def _flatten(prefix: str, value: Any, into: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):  # an empty mapping (target.arch: {}) adds nothing: its keys are all unset
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, into)
    else:
        into[prefix] = value
    return into


def _fixed(name: str) -> bool:
    if name in RESUME_FREE or any(name.startswith(f + ".") for f in RESUME_FREE):
        return False
    section = name.split(".", 1)[0]
    if RESUME_SECTIONS.get(section, False):
        return True
    return name in RESUME_FIXED


def _shown(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, default=str)


def resume_config_differences(saved: dict[str, Any], cfg: RunConfig) -> list[str]:
    """`field: A in the checkpoint, B in the config` for every field that must not change on resume (see
    RESUME_SECTIONS). target.path is compared only when the config names one without target.pretrain: a pretrained
    target's path is where the cache put it (the pretrain settings, arch and seed identify it), and a config without
    target.path gets it from the cache or from the regenerated records it trains on."""
    try:  # through today's schema: a field newer than the checkpoint gets its default on both sides
        saved = config_from_dict(saved, "<checkpoint>").to_dict()
    except ConfigError:
        pass  # a field since removed or renamed: compare what was recorded
    now = cfg.to_dict()
    if cfg.target.path is None or cfg.target.pretrain is not None:
        saved = {**saved, "target": {k: v for k, v in (saved.get("target") or {}).items() if k != "path"}}
        now = {**now, "target": {k: v for k, v in now["target"].items() if k != "path"}}
    a, b = _flatten("", saved, {}), _flatten("", now, {})
    lines = []
    for name in sorted(set(a) | set(b)):
        if _fixed(name) and a.get(name) != b.get(name):
            lines.append(f"{name}: {_shown(a.get(name))} in the checkpoint, {_shown(b.get(name))} in the config")
    return lines


def check_resume_config(out: Path, cfg: RunConfig) -> None:
    """Refuse a resume whose config differs from the newest checkpoint's in a field that must not change, in one
    line naming each field, before anything is built or written (a changed drafter shape would otherwise fail in
    load_state_dict with a traceback, a changed target only after pretraining it).

    Only reads: meta.json of the newest checkpoint, checked against its manifest entry (size and sha256; it is
    small). A checkpoint whose meta.json is missing or does not verify is left to the full verification that
    select_start does (it refuses naming the file); one saved without a config (older dflash) is not compared."""
    found = ckpt.list_checkpoints(out)
    if not found:
        return
    path = found[0][1]
    meta_file = path / "meta.json"
    try:
        entry = json.loads((path / ckpt.MANIFEST).read_text())["files"]["meta.json"]
        data = meta_file.read_bytes()
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            return
        meta = json.loads(data)
        saved, saved_target = meta.get("config"), meta.get("target")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    if not isinstance(saved, dict):
        return
    differ = resume_config_differences(saved, cfg)
    if cfg.target.path is not None and cfg.target.pretrain is None and isinstance(saved_target, dict):
        differ += _target_shape_differences(saved_target, cfg)
    if differ:
        raise UsageError(f"{path}: refusing to resume with a changed config: {'; '.join(differ)}. Restore these "
                         "fields to resume, or start a new run (--fresh, or another --out)")


def _target_shape_differences(saved: dict[str, Any], cfg: RunConfig) -> list[str]:
    """A target named by path: its shape from its config.json against the one the checkpoint was trained on (the
    same path may hold other weights now)."""
    from dflash.target import target_shape

    try:
        shape = target_shape(cfg.target)
    except (OSError, ValueError):
        return []  # check_run names an unreadable target
    lines = []
    for name in ("num_layers", "hidden_size"):
        if saved.get(name) is not None and saved[name] != getattr(shape, name):
            lines.append(f"target {name}: {saved[name]} in the checkpoint, {getattr(shape, name)} in "
                         f"{cfg.target.path}/config.json")
    return lines


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
