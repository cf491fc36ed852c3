"""The `dflash train` loop: data -> target -> reservoir -> drafter step, with telemetry, checkpoints and signals.

One process per rank, no GPU threads (the heartbeat thread only writes events). Every event follows docs/events.md;
rank 0 (always a drafter rank) writes the run-level events.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash import checkpoint as ckpt
from dflash.config import ConfigError, RunConfig, check_mask_token_id, check_run
from dflash.data import DataError, Document, load_or_build_schedule, load_tokenizer, read_documents, tokenize
from dflash.kernels import FlexWarningWatch, check_kernels, dynamo_counts, versions
from dflash.model import DFlashDrafter, resolve_attention
from dflash.pipeline import (
    Feeder,
    FeedState,
    RemoteSource,
    Roles,
    TargetInfo,
    batch_real_tokens,
    compute_batch,
    drafter_feed,
    epochs_needed,
    init_distributed,
    recv_target_info,
    refeed,
    resolve_roles,
    send_target_info,
    serve_target,
    total_steps_for,
)
from dflash.target import Target, probe_kernels, target_shape
from dflash.telemetry import EventWriter, Heartbeat, hostname

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


class UsageError(RuntimeError):
    """Bad input found after the config loaded (data, resume state): one line, exit 2."""


class ResumeRefused(UsageError):
    """A resume that cannot continue (corrupt newest checkpoint, nothing left to train): run_end reason `refused`,
    at the step of the checkpoint the run stands at, so status keeps showing how far it got."""

    def __init__(self, msg: str, step: int) -> None:
        super().__init__(msg)
        self.step = step


# ---------------------------------------------------------------------------------------------- helpers
def lr_lambda(total_steps: int, warmup_frac: float, min_ratio: float) -> Callable[[int], float]:
    """Linear warm-up over warmup_frac of the run, then cosine from 1 down to min_ratio (multiplier of lr)."""
    warm = max(1, int(round(total_steps * warmup_frac))) if warmup_frac > 0 else 0

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        span = max(1, total_steps - warm)
        t = min(1.0, (step - warm) / span)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def classify_error(exc: BaseException) -> str:
    """The contract's error classes: what a person must do differs (smaller batch, network, data/lr, code)."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower():
        return "oom"
    if "nccl" in text.lower() or type(exc).__name__ in ("DistBackendError", "DistNetworkError"):
        return "nccl"
    return "exception"


def pick_device(roles: Roles) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(roles.local_rank % torch.cuda.device_count())
        return torch.device("cuda", roles.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def loaded_kernel_problems(probed: dict[str, str], loaded: dict[str, str], device: torch.device | str,
                           allow_slow: bool) -> list[str]:
    """Problems with the kernels the loaded target bound: a difference from the early meta-device probe (run_start
    named the probe's kernels, so it would have lied), then check_kernels on what is really bound."""
    problems = []
    for op in sorted(set(probed) | set(loaded)):
        if op == "attention":  # the drafter's, not the target's
            continue
        if probed.get(op) != loaded.get(op):
            problems.append(f"{op}: the loaded target binds {loaded.get(op, 'nothing')}, the preflight probe saw "
                            f"{probed.get(op, 'nothing')}")
    attention = {"attention": probed["attention"]} if "attention" in probed else {}
    problems += check_kernels({**loaded, **attention}, device, allow_slow)
    return problems


def _rng_state(gen: torch.Generator) -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(), "anchors": gen.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any], gen: torch.Generator) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    gen.set_state(state["anchors"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _make_logger(out: Path, rank: int) -> logging.Logger:
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
class Live:
    """What the heartbeat thread reads (plain attributes, written by the main thread)."""

    phase: str = "preparing_data"
    step: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def heartbeat(self) -> dict[str, Any]:
        gpu = None
        if self.device.type == "cuda":
            gpu = round(torch.cuda.memory_allocated(self.device) / 2**20, 1)
        return {"phase": self.phase, "step": self.step, "gpu_mem_mb": gpu}


class SignalGate:
    """First SIGTERM/SIGINT: finish the step, checkpoint, exit 0. Second: exit at once (128 + signal number)."""

    def __init__(self, on_second: Callable[[int], None]) -> None:
        self.received: int | None = None
        self._on_second = on_second
        self._old: dict[int, Any] = {}

    def install(self) -> SignalGate:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is not None:
            self._on_second(signum)
            os._exit(128 + signum)
        self.received = signum

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    @property
    def name(self) -> str | None:
        return None if self.received is None else signal.Signals(self.received).name


# ---------------------------------------------------------------------------------------------- the run
@dataclass
class StepStats:
    """One step's numbers, already combined over all drafter ranks."""

    loss: float
    tokens: int
    real_tokens: int
    nonfinite: bool
    stop: bool
    acc: list[float]


@dataclass
class TrainResult:
    exit_code: int
    reason: str
    step: int
    losses: list[float] = field(default_factory=list)
    out: Path | None = None


def prepare_documents(cfg: RunConfig) -> list[Document]:
    """Read and validate the corpus before anything is written (bad data must leave --out untouched)."""
    return read_documents(cfg.data)


def train(cfg: RunConfig, out: str | Path, *, max_steps: int | None = None, resume: bool = False,
          fresh: bool = False, allow_slow_kernels: bool = False, docs: list[Document] | None = None,
          on_step: Callable[[int, float], None] | None = None) -> TrainResult:
    """Run (or resume) training into `out`; returns the exit code the CLI should use. Never raises for run errors:
    they become `error` + `run_end` events (the events file is the contract), except UsageError/DataError raised
    before anything is written."""
    roles = resolve_roles(cfg.dist)
    device = pick_device(roles)
    out = Path(out)
    # The whole config is checked before anything below deletes (--fresh) or truncates (events.jsonl) a thing.
    check_run(cfg, device.type)
    if docs is None:
        docs = prepare_documents(cfg)
    if fresh and resume:
        raise UsageError("--fresh and --resume exclude each other")
    if cfg.data.tokenizer is not None and cfg.drafter.mask_token_id is not None:
        # A tokenizer directory's size is known once it is read (never written): still before anything is written.
        shape = target_shape(cfg.target, load_tokenizer(cfg.data, docs, out / "tokenizer").vocab_size)
        if shape.vocab_size is not None:
            check_mask_token_id(cfg, shape.vocab_size, shape.vocab_from)
    found = ckpt.list_checkpoints(out)
    if found and fresh and (roles.rank == 0):
        ckpt.remove_all(out)  # explicit --fresh: only step-N dirs inside OUT/checkpoints go
        found = []
    if found and not resume and not fresh:
        raise UsageError(f"{out}: has checkpoints ({found[0][1].name}); pass --resume (or --fresh to start over) "
                         "or use a new --out")
    init_distributed(roles, device, cfg.dist.backend)
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
    # Rank 0 truncates (fresh run) before the others open for appending.
    writer = EventWriter(out / "events.jsonl", run_id, rank=roles.rank,
                         truncate=(roles.rank == 0 and not resume)) if roles.rank == 0 else None
    if roles.world_size > 1:
        dist.barrier()
    if writer is None:
        writer = EventWriter(out / "events.jsonl", run_id, rank=roles.rank)
    log = _make_logger(out, roles.rank)
    live = Live(device=device)
    step_holder = {"step": 0}

    def emergency_end(signum: int) -> None:
        # Second signal: best effort run_end from a helper thread (the main thread may hold the writer's lock).
        if roles.rank != 0:
            return
        t = threading.Thread(target=lambda: writer.emit(
            "run_end", reason="signal", exit_code=128 + signum, step=step_holder["step"],
            signal=signal.Signals(signum).name), daemon=True)
        t.start()
        t.join(0.5)

    gate = SignalGate(emergency_end).install()
    # Handlers first, heartbeat second: once a heartbeat is visible, a signal gets the clean shutdown.
    hb = Heartbeat(writer, live.heartbeat, cfg.train.heartbeat_s).start()
    runner = _Run(cfg, out, roles, device, writer, log, live, gate, step_holder, docs, on_step, hb)
    try:
        result = runner.run(max_steps=max_steps, resume=resume, allow_slow_kernels=allow_slow_kernels)
    finally:
        gate.restore()
        hb.stop()
        writer.close()
        for h in log.handlers:
            h.close()
        if roles.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
    result.out = out
    return result


class _Run:
    """State of one training process; split out of `train` so setup and teardown stay readable."""

    def __init__(self, cfg: RunConfig, out: Path, roles: Roles, device: torch.device, writer: EventWriter,
                 log: logging.Logger, live: Live, gate: SignalGate, step_holder: dict[str, int],
                 docs: list[Document], on_step: Callable[[int, float], None] | None, hb: Heartbeat) -> None:
        self.cfg, self.out, self.roles, self.device = cfg, out, roles, device
        self.writer, self.log, self.live, self.gate = writer, log, live, gate
        self.step_holder = step_holder
        self.docs = docs
        self.on_step = on_step
        self.hb = hb
        self.rank0 = roles.rank == 0
        self.step = 0
        self.losses: list[float] = []
        # new_group is collective over the whole world: every rank (target ranks too) creates it, in the same order.
        self.drafter_group: Any = None
        if roles.split and len(roles.drafters) > 1:
            self.drafter_group = dist.new_group(roles.drafters)

    # -- events
    def emit(self, kind: str, **fields: Any) -> None:
        if self.rank0 or kind in ("error", "heartbeat"):
            self.writer.emit(kind, **fields)

    def phase(self, name: str, **extra: Any) -> None:
        self.live.phase = name
        self.emit("phase", phase=name, **extra)

    def end(self, reason: str, code: int, **extra: Any) -> TrainResult:
        self.hb.stop()  # run_end is the last line of a run: no heartbeat after it
        self.emit("run_end", reason=reason, exit_code=code, step=self.step, **extra)
        self.log.info("run_end: %s (exit %d) at step %d", reason, code, self.step)
        return TrainResult(exit_code=code, reason=reason, step=self.step, losses=self.losses)

    def stop_requested(self) -> bool:
        """A first signal seen at a phase boundary before any step ran: stop there, do not load or step.

        Only a single-process run stops between phases; with several ranks the signal is agreed on in the step's
        all-reduce (one rank alone leaving would leave the others waiting in a collective)."""
        return self.gate.received is not None and self.roles.world_size == 1

    def end_on_signal(self) -> TrainResult:
        """Nothing ran since the last checkpoint (or since the start), so there is nothing to save."""
        self.log.info("%s before the first step: stopping at the %s boundary", self.gate.name, self.live.phase)
        return self.end("signal", EXIT_OK, signal=self.gate.name or "SIGTERM")

    def run(self, *, max_steps: int | None, resume: bool, allow_slow_kernels: bool) -> TrainResult:
        try:
            return self._run(max_steps, resume, allow_slow_kernels)
        except ResumeRefused as exc:
            self.step = exc.step
            self.emit("error", **{"class": "config"}, message=str(exc), traceback=None, fatal=True)
            self.log.error("%s", exc)
            print(f"dflash: {exc}", file=sys.stderr)
            return self.end("refused", EXIT_USAGE)
        except (UsageError, DataError, ConfigError, ckpt.CheckpointError) as exc:
            self.emit("error", **{"class": "config"}, message=str(exc), traceback=None, fatal=True)
            self.log.error("%s", exc)
            print(f"dflash: {exc}", file=sys.stderr)
            return self.end("error", EXIT_USAGE)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the event stream, classified
            cls = classify_error(exc)
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            self.writer.emit("error", **{"class": cls}, message=msg, traceback=traceback.format_exc(), fatal=True)
            self.log.error("fatal %s error: %s\n%s", cls, msg, traceback.format_exc())
            return self.end("error", EXIT_ERROR)

    # -- the body
    def _run(self, max_steps: int | None, resume: bool, allow_slow_kernels: bool) -> TrainResult:
        cfg, roles, device, out = self.cfg, self.roles, self.device, self.out
        t_start = time.perf_counter()
        # Data: tokenizer, corpus, schedule (same on every rank; only rank 0 writes the schedule file).
        tok_cache = Path(cfg.data.tokenizer_cache) if cfg.data.tokenizer_cache else out / "tokenizer"
        if roles.rank == 0 or roles.world_size == 1:
            tok = load_tokenizer(cfg.data, self.docs, tok_cache)
        if roles.world_size > 1:
            dist.barrier()
            if roles.rank != 0:
                tok = load_tokenizer(cfg.data, self.docs, tok_cache)
        corpus = tokenize(self.docs, tok)
        n_d = len(roles.drafters)
        # Resume state, read by rank 0 and broadcast so every rank (target ranks too) continues from the same place.
        resume_state: dict[str, Any] | None = None
        resume_path: Path | None = None
        if resume and self.rank0:
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
        if not resume and self.rank0 and sched_path.is_file():
            sched_path.unlink()  # a fresh run in an old directory makes its own schedule (ours by name, inside OUT)
        if roles.world_size > 1:
            dist.barrier()
        first = load_or_build_schedule(corpus, cfg.data, cfg.train.seed, 1, sched_path, write=False)
        bpe = len(first.epochs[0])
        total = planned or total_steps_for(bpe, cfg.train.epochs, max_steps or cfg.train.max_steps, n_d)
        n_epochs = epochs_needed(bpe, total, n_d)
        if roles.world_size > 1 and roles.rank != 0:
            dist.barrier()  # wait for rank 0 to write (or extend) the schedule, then read the same file
        schedule = load_or_build_schedule(corpus, cfg.data, cfg.train.seed, n_epochs, sched_path,
                                          write=self.rank0)
        if roles.world_size > 1 and roles.rank == 0:
            dist.barrier()
        feeds = [drafter_feed(schedule.buffers_per_epoch(), total, n_d, d) for d in range(n_d)]
        states = [FeedState()] * n_d
        if resume_state is not None:
            states = [FeedState.from_json(s) for s in resume_state["feeds"]]
        start_step = int(resume_state["step"]) if resume_state else 0
        if resume_state is not None and len(states) != n_d:
            raise ResumeRefused(f"{resume_path}: saved with {len(states)} drafter ranks, this job has {n_d}",
                                start_step)
        if start_step >= total:
            raise ResumeRefused(f"{resume_path}: already at step {start_step} of {total}; raise --max-steps to "
                                "continue", start_step)
        self.step = start_step
        self.step_holder["step"] = start_step
        if self.stop_requested():
            return self.end_on_signal()

        attention = resolve_attention(cfg.drafter.attention, device)
        kernels = {**probe_kernels(cfg.target, tok.vocab_size), "attention": attention}
        self.emit("run_start", config=cfg.to_dict(), versions=versions(), kernels=kernels, device=str(device),
                  world_size=roles.world_size, roles=roles.as_event(), resumed_from=start_step if resume else None,
                  pid=os.getpid(), host=hostname(), total_steps=total)
        self.log.info("run %s: %s on %s, %d steps (%d buffers/epoch of %d tokens, %d epochs), roles %s%s",
                      self.writer.run_id, "resume" if resume else "start", device, total, bpe, cfg.data.token_budget,
                      n_epochs, roles.as_event(), f" from step {start_step}" if resume else "")
        problems = check_kernels(kernels, device, allow_slow_kernels or cfg.target.allow_slow_kernels)
        if problems:
            for p in problems:
                self.emit("error", **{"class": "slow_kernel"}, message=p, traceback=None, fatal=True)
                self.log.error("preflight: %s", p)
            return self.end("error", EXIT_ERROR)
        if self.stop_requested():
            return self.end_on_signal()

        # Target (target and colocated ranks) or its frozen embedding/LM head (drafter ranks in split mode).
        self.phase("loading_target", i=0, n=1)
        info: TargetInfo
        target = None
        if roles.is_target:
            def progress(i: int, n: int) -> None:
                self.phase("loading_target", i=i, n=n)

            try:
                target = Target(cfg.target, cfg.drafter.num_layers, device, on_progress=progress, vocab=tok.vocab_size)
            except ValueError as exc:  # the target names the bad field (target.arch, target.tap_layers, ...)
                raise UsageError(str(cfg.error(exc))) from None
            info = TargetInfo.from_target(target)
            if target.vocab_size < tok.vocab_size:
                raise UsageError(f"target vocab {target.vocab_size} is smaller than the tokenizer's {tok.vocab_size}")
            check_mask_token_id(cfg, target.vocab_size, "the loaded target's embedding")
            if roles.split and roles.target_index == 0:
                for d in roles.drafters:
                    send_target_info(info, d, device)
        else:
            info = recv_target_info(roles.targets[0], device)
        self.log.info("target: %d layers, hidden %d, taps %s, packing %s, kernels %s (%.1fs)", info.num_layers,
                      info.hidden_size, info.tap_layers, info.packing, info.kernels, time.perf_counter() - t_start)
        # The probe above saw a weightless instance; what counts is what the loaded model really bound.
        allowed = allow_slow_kernels or cfg.target.allow_slow_kernels
        problems = loaded_kernel_problems(kernels, info.kernels, device, allowed)
        if problems:
            for p in problems:
                self.emit("error", **{"class": "slow_kernel"}, message=p, traceback=None, fatal=not allowed)
                self.log.error("loaded target: %s", p)
            if not allowed:
                print(f"dflash: loaded target: {problems[0]}", file=sys.stderr)
                return self.end("error", EXIT_ERROR)
        else:
            self.log.info("loaded target binds the kernels the probe saw")
        if self.stop_requested():
            return self.end_on_signal()

        if roles.role == "target":
            assert target is not None
            refeeds = [refeed(feeds[d], states[d]) for d in range(n_d)]
            self.live.phase = "training"
            sent = serve_target(roles, target, corpus, schedule, refeeds, cfg.data.token_budget, device)
            self.log.info("target rank done: %d buffers sent", sent)
            return TrainResult(exit_code=EXIT_OK, reason="completed", step=0)

        return self._train(cfg, info, target, corpus, schedule, feeds, states, total, start_step, resume_path,
                           tok.mask_token_id, t_start)

    def _train(self, cfg: RunConfig, info: TargetInfo, target: Any, corpus: Any, schedule: Any, feeds: list[Any],
               states: list[FeedState], total: int, start_step: int, resume_path: Path | None,
               mask_token_id: int | None, t_start: float) -> TrainResult:
        roles, device = self.roles, self.device
        d = roles.drafter_index
        n_d = len(roles.drafters)
        self.phase("building_drafter")
        dcfg = cfg.drafter if cfg.drafter.mask_token_id is not None else \
            dataclasses.replace(cfg.drafter, mask_token_id=mask_token_id)
        if dcfg.mask_token_id is None:
            raise UsageError("drafter.mask_token_id: the tokenizer has no mask token; set it in the config")
        torch.manual_seed(cfg.train.seed)  # identical init on every drafter rank and in every layout
        try:
            drafter = DFlashDrafter(dcfg, info.hidden_size, len(info.tap_layers)).to(device)
        except ValueError as exc:  # e.g. drafter.hidden_size != target hidden size
            raise UsageError(str(cfg.error(exc))) from None
        model: nn.Module = drafter
        if n_d > 1:
            group = self._dgroup()
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(drafter, device_ids=[device.index] if device.type == "cuda" else None,
                                            process_group=group)
        params = [p for p in drafter.parameters() if p.requires_grad]
        t = cfg.train
        opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, t.warmup_frac, t.min_lr_ratio))
        gen = torch.Generator(device=device)
        gen.manual_seed(t.seed * 1000 + d + 1)

        if resume_path is not None:
            drafter.load_state_dict(ckpt.load_file(resume_path, "drafter.pt"))
            opt.load_state_dict(ckpt.load_file(resume_path, "optimizer.pt"))
            sched.load_state_dict(ckpt.load_file(resume_path, "scheduler.pt"))
            rngs = ckpt.load_file(resume_path, "rng.pt")
            _set_rng_state(rngs[d] if isinstance(rngs, list) else rngs, gen)
            self.log.info("resumed from %s", resume_path)
        self.step = start_step
        self.step_holder["step"] = start_step
        self.live.step = start_step
        if self.stop_requested():
            return self.end_on_signal()

        if roles.split:
            source: Callable[[int, Any], Any] = RemoteSource(
                roles, cfg.data.token_budget, info.hidden_size * len(info.tap_layers), info.dtype, device)
        else:
            def source(_j: int, key: Any) -> Any:
                return compute_batch(target, corpus, schedule.buffer(key), cfg.data.token_budget)
        feeder = Feeder(feeds[d], cfg.data.reservoir, t.seed * 1000 + d, source, states[d])

        compile_on = t.compile == "true" or (t.compile == "auto" and device.type == "cuda")
        step_model = torch.compile(model, backend=t.compile_backend) if compile_on else model
        embed, head = info.embed_tokens, info.lm_head
        autocast = device.type == "cuda"
        flex_warned = False
        frames_after_warmup: int | None = None
        recompile_warned = False
        if compile_on:
            self.phase("compiling", detail="the first step compiles the drafter")
        entered_training = False
        self.log.info("drafter: %d params, attention %s, compile %s (setup %.1fs)",
                      sum(p.numel() for p in params), drafter.attention_backend, compile_on,
                      time.perf_counter() - t_start)
        reason = "completed"
        while self.step < total:
            if self.step == start_step and self.stop_requested():
                return self.end_on_signal()  # a signal during setup or compiling: no step has run, nothing to save
            if not compile_on and not entered_training:
                self.phase("training")
                entered_training = True
            t0 = time.perf_counter()
            key, batch = feeder.next()
            batch = batch.to(device)
            wait_s = feeder.last_wait_s
            model.train()
            with FlexWarningWatch() as watch, torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                out = step_model(batch, embed, head, generator=gen)
            loss = out.loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, t.grad_clip))
            lr = float(sched.get_last_lr()[0])
            stats = self._reduce_stats(out, batch)
            loss_v = stats.loss
            if stats.nonfinite:
                self.step_event(key, stats, lr, grad_norm, t0, wait_s, feeder, total, 0)
                self.emit("error", **{"class": "nan"}, message=f"non-finite loss {loss_v} at step {self.step + 1}",
                          traceback=None, fatal=True)
                self.log.error("non-finite loss %s at step %d: stopping", loss_v, self.step + 1)
                return self.end("error", EXIT_ERROR)
            if compile_on and not entered_training:
                # Forward and backward are compiled now: `training` starts just before the first optimizer step.
                self.phase("training")
                entered_training = True
            opt.step()
            sched.step()
            self.step += 1
            self.step_holder["step"] = self.step
            self.live.step = self.step
            recompiles = 0
            if compile_on:
                frames = dynamo_counts()["frames"]
                if frames_after_warmup is None:
                    frames_after_warmup = frames
                recompiles = frames - frames_after_warmup
                if recompiles > 0 and not recompile_warned:
                    recompile_warned = True
                    self.emit("error", **{"class": "recompile"}, traceback=None, fatal=False,
                              message=f"drafter step recompiled after warm-up ({recompiles} new frames)")
            if watch.triggered and not flex_warned:
                flex_warned = True
                self.emit("error", **{"class": "uncompiled_flex"}, message=watch.triggered[0][:500],
                          traceback=None, fatal=False)
            self.losses.append(loss_v)
            self.step_event(key, stats, lr, grad_norm, t0, wait_s, feeder, total, recompiles)
            if self.on_step is not None:
                self.on_step(self.step, loss_v)
            if stats.stop or (len(roles.drafters) == 1 and self.gate.received is not None):
                reason = "signal"
                break
            if t.checkpoint_every and self.step % t.checkpoint_every == 0 and self.step < total:
                self.save(drafter, opt, sched, gen, feeder, total, info, dcfg)
        if reason == "signal" and roles.split:
            assert isinstance(source, RemoteSource)
            source.stop(feeder.pending_targets(len(roles.targets), d, n_d))
        self.save(drafter, opt, sched, gen, feeder, total, info, dcfg)
        self.phase("finishing")
        if reason == "signal":
            return self.end("signal", EXIT_OK, signal=self.gate.name or "SIGTERM")
        return self.end("completed", EXIT_OK)

    def _reduce_stats(self, out: Any, batch: Any) -> StepStats:
        """One small all-reduce per step over the drafter ranks: mean loss and accuracy, token counts, and the
        decisions every rank must take together (stop on a signal, stop on a non-finite loss), so none is left
        waiting in a collective the others skipped."""
        acc = out.acc.detach().float().cpu()
        vals = torch.cat([torch.tensor([float(out.loss.detach()), float(int(out.num_tokens)),
                                        float(batch_real_tokens(batch)), 0.0, 1.0 if self.gate.received else 0.0]),
                          acc])
        vals[3] = 0.0 if math.isfinite(float(vals[0])) else 1.0
        n_d = len(self.roles.drafters)
        if n_d > 1:
            dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            red = vals.to(dev, torch.float64)
            dist.all_reduce(red, group=self._dgroup())
            vals = red.cpu()
        return StepStats(loss=float(vals[0]) / n_d, tokens=int(vals[1]), real_tokens=int(vals[2]),
                         nonfinite=bool(vals[3] > 0), stop=bool(vals[4] > 0),
                         acc=[round(float(a) / n_d, 4) for a in vals[5:]])

    def _dgroup(self) -> Any:
        """The drafter ranks' process group (None = the world, in colocated mode)."""
        return self.drafter_group

    def step_event(self, key: Any, st: StepStats, lr: float, grad_norm: float, t0: float, wait_s: float,
                   feeder: Feeder, total: int, recompiles: int) -> None:
        step_time = time.perf_counter() - t0
        step = self.step if not st.nonfinite else self.step + 1
        if step % self.cfg.train.log_every and step != total and not st.nonfinite:
            return
        tps = st.real_tokens / max(step_time, 1e-9)
        self.emit("step", step=step, epoch=int(key[0]), loss=st.loss, acc=st.acc, lr=lr, grad_norm=grad_norm,
                  tokens=st.tokens, tokens_per_s=tps, step_time_s=step_time, queue_depth=len(feeder.reservoir),
                  queue_wait_s=wait_s, recompiles=recompiles, total_steps=total, buffer=[int(key[0]), int(key[1])])
        self.log.info("step %d/%d  loss %.4f  acc[1] %.3f  lr %.2e  gnorm %.2f  %.0f tok/s  %.2fs", step, total,
                      st.loss, st.acc[0] if st.acc else float("nan"), lr, grad_norm, tps, step_time)

    def save(self, drafter: DFlashDrafter, opt: Any, sched: Any, gen: torch.Generator, feeder: Feeder, total: int,
             info: TargetInfo, dcfg: Any) -> None:
        n_d = len(self.roles.drafters)
        mine = {"feed": feeder.state().to_json(), "rng": _rng_state(gen)}
        if n_d > 1:
            gathered: list[Any] = [None] * n_d
            dist.all_gather_object(gathered, mine, group=self._dgroup())
        else:
            gathered = [mine]
        if not self.rank0:
            return
        prev_phase = self.live.phase
        self.phase("saving")
        pipeline = {"step": self.step, "total_steps": total, "feeds": [g["feed"] for g in gathered]}
        meta = {"target": {"num_layers": info.num_layers, "tap_layers": info.tap_layers,
                           "hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
                           "dtype": str(info.dtype).replace("torch.", ""), "path": self.cfg.target.path},
                "drafter": dataclasses.asdict(dcfg), "run_id": self.writer.run_id, "config": self.cfg.to_dict()}
        files = {
            "drafter.pt": ckpt.torch_bytes(drafter.state_dict()),
            "optimizer.pt": ckpt.torch_bytes(opt.state_dict()),
            "scheduler.pt": ckpt.torch_bytes(sched.state_dict()),
            "rng.pt": ckpt.torch_bytes([g["rng"] for g in gathered] if n_d > 1 else gathered[0]["rng"]),
            "pipeline.json": ckpt.json_bytes(pipeline),
            "meta.json": ckpt.json_bytes(meta),
        }
        saved = ckpt.save_checkpoint(self.out, self.step, files, keep_last=self.cfg.train.keep_last)
        self.emit("checkpoint", path=str(saved.path), step=saved.step, manifest_sha256=saved.manifest_sha256,
                  bytes=saved.bytes, seconds=saved.seconds)
        self.log.info("checkpoint %s (%.1f MB, %.2fs)", saved.path, saved.bytes / 2**20, saved.seconds)
        # `training` is entered once (docs/events.md); heartbeats go back to it without a new phase event.
        self.live.phase = prev_phase
