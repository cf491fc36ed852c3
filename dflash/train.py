"""The `dflash train` job: a Trainer that builds data, target and drafter, steps, checkpoints, and ends on signals.

One process per rank, no GPU threads (the heartbeat thread only writes events). Every event follows docs/events.md;
rank 0 (always a drafter rank) writes the run-level events. The run directory itself is dflash/rundir.py's job.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash import checkpoint as ckpt
from dflash import compile_cache, fla_configs, triton_carry
from dflash.cache_entry import cache_home
from dflash.config import ConfigError, RunConfig, check_mask_token_id
from dflash.data import DataError, Document, TokenizerAdapter, load_tokenizer, read_documents, tokenize
from dflash.kernels import FlexWarningWatch, check_kernels, dynamo_counts, versions
from dflash.memory import apply_auto_checkpoint
from dflash.model import DFlashDrafter, compile_step_model, resolve_attention
from dflash.optim import build_optimizer
from dflash.pace import Pace
from dflash.pipeline import (
    Feeder,
    RemoteSource,
    Roles,
    TargetInfo,
    batch_real_tokens,
    compute_batch,
    init_distributed,
    recv_target_info,
    refeed,
    send_target_info,
    serve_target,
)
from dflash.rundir import (
    ResumeRefused,
    RunDir,
    UsageError,
    check_out,
    open_run_dir,
    select_start,
)
from dflash.runprep import Hook, pick_device, preflight  # noqa: F401 (pick_device: re-exported)
from dflash.target import Target, probe_kernels
from dflash.target_fusion import describe as describe_fusion
from dflash.telemetry import Heartbeat, hostname, stderr_line

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
FINAL_SAVE_RETRY_S = 15.0  # how often the final checkpoint is tried again on a full disk


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


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
    if ckpt.is_disk_full(exc):
        return "disk_full"
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower():
        return "oom"
    lower = text.lower()
    if "nccl" in lower or "gloo" in lower or type(exc).__name__ in ("DistBackendError", "DistNetworkError"):
        return "nccl"  # the contract's class for any collective / send-recv failure, gloo's included
    return "exception"


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


@dataclass
class Live:
    """What the heartbeat thread reads (plain attributes, written by the main thread)."""

    phase: str = "preparing_data"
    step: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def heartbeat(self) -> dict[str, Any]:
        gpu = reserved = retries = None
        if self.device.type == "cuda":
            gpu = round(torch.cuda.memory_allocated(self.device) / 2**20, 1)
            # reserved - allocated is the caching allocator's slack: fragmentation shows as it grows over hours
            reserved = round(torch.cuda.memory_reserved(self.device) / 2**20, 1)
            # ... until reserved reaches the card's limit: then it shows as retries (the allocator frees its whole
            # cache, a device-wide sync, and tries again), each a stall, the last one before an OOM
            retries = int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))
        return {"phase": self.phase, "step": self.step, "gpu_mem_mb": gpu, "gpu_reserved_mb": reserved,
                "gpu_alloc_retries": retries}


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
    world_size: int = 1


# A multi-rank run's Trainer (its DDP reducer, its gloo/NCCL subgroups) is never destroyed in-process: the
# destructors of torch's process-group objects can deadlock with the GIL after the run has ended (seen in CI: rank 0
# wrote run_end and then hung at train()'s return; pytorch#56297, #75097). The CLI leaves with os._exit instead.
_KEPT_ALIVE: list[object] = []


def prepare_documents(cfg: RunConfig) -> list[Document]:
    """Read and validate the corpus before anything is written (bad data must leave --out untouched)."""
    return read_documents(cfg.data)


def train(cfg: RunConfig, out: str | Path, *, max_steps: int | None = None, resume: bool | str = False,
          fresh: bool = False, allow_slow_kernels: bool = False, docs: list[Document] | None = None,
          on_step: Callable[[int, float], None] | None = None, before_lock: Hook | None = None,
          under_lock: Hook | None = None) -> TrainResult:
    """Run (or resume) training into `out`; returns the exit code the CLI should use. Never raises for run errors:
    they become `error` + `run_end` events (the events file is the contract), except UsageError/DataError/ConfigError
    raised before anything is written. `resume` may be "auto" (resume when OUT has a checkpoint). The checks before
    anything is written are dflash/runprep.py's preflight, run once here (`dflash train` adds its steps as the hooks)."""
    prep = preflight(cfg, out, resume=resume, fresh=fresh, docs=docs, before_lock=before_lock,
                     under_lock=under_lock)
    cfg, out, roles, device, resume = prep.cfg, prep.out, prep.roles, prep.device, prep.resume
    try:
        check_out(out, roles, resume=resume, fresh=fresh)
        init_distributed(roles, device, cfg.dist.backend, cfg.dist.timeout_s)
        run = open_run_dir(out, roles, resume=resume)
    except BaseException:
        prep.release()
        raise
    live = Live(device=device)

    def emergency_end(signum: int) -> None:
        # Second signal: best effort run_end from a helper thread (the main thread may hold the writer's lock).
        if roles.rank != 0:
            return
        t = threading.Thread(target=lambda: run.writer.emit(
            "run_end", reason="signal", exit_code=128 + signum, step=live.step,
            signal=signal.Signals(signum).name), daemon=True)
        t.start()
        t.join(0.5)

    gate = SignalGate(emergency_end).install()
    # Handlers first, heartbeat second: once a heartbeat is visible, a signal gets the clean shutdown.
    hb = Heartbeat(run.writer, live.heartbeat, cfg.train.heartbeat_s).start()
    trainer = Trainer(cfg, run, roles, device, live, gate, hb, prep.docs, on_step, tok=prep.tok, notes=prep.notes)
    try:
        result = trainer.run(max_steps=max_steps, resume=resume, allow_slow_kernels=allow_slow_kernels)
    finally:
        gate.restore()
        hb.stop()
        run.close()
        prep.release()
        if roles.world_size > 1:
            _KEPT_ALIVE.append(trainer)
            if dist.is_initialized():
                dist.destroy_process_group()
    result.out = out
    result.world_size = roles.world_size
    return result


class Trainer:
    """One training process: build() sets up data, target and drafter; step() is one optimizer step; save() one
    checkpoint; train() the loop. The step counter is `global_step`, kept in `live` where the heartbeat reads it."""

    def __init__(self, cfg: RunConfig, run: RunDir, roles: Roles, device: torch.device, live: Live,
                 gate: SignalGate, hb: Heartbeat, docs: list[Document],
                 on_step: Callable[[int, float], None] | None, tok: TokenizerAdapter | None = None,
                 notes: list[str] | None = None) -> None:
        self.cfg, self.run_dir, self.roles, self.device = cfg, run, roles, device
        self.writer, self.log, self.live, self.gate, self.hb = run.writer, run.log, live, gate, hb
        self.docs = docs
        self.tok = tok  # preflight's (dflash/runprep.py), when reading it wrote nothing; else loaded in _build_data
        self.data_notes = notes or []
        self.on_step = on_step
        self.rank0 = roles.rank == 0
        self.triton: triton_carry.Carry | None = None  # what this host's Triton cache got back (target ranks)
        self.fla_store: Path | None = None  # where fla's tuned kernel configs are kept on this host (target ranks)
        self.losses: list[float] = []
        self.t_start = time.perf_counter()
        # new_group is collective over the whole world: every rank (target ranks too) creates it, in the same order.
        self.drafter_group: Any = None
        if roles.split and len(roles.drafters) > 1:
            self.drafter_group = dist.new_group(roles.drafters)
        self._in_training = False  # the `training` phase is entered once (docs/events.md)
        self._flex_warned = self._recompile_warned = False
        self._frames_after_warmup: int | None = None
        self.pace = Pace()  # this attempt's step time against its own settled pace (the step events' `pace`)

    @property
    def global_step(self) -> int:
        return self.live.step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.live.step = value

    # -- events
    def emit(self, kind: str, **fields: Any) -> None:
        if self.rank0 or kind in ("error", "heartbeat"):
            self.writer.emit(kind, **fields)

    def phase(self, name: str, **extra: Any) -> None:
        self.live.phase = name
        self.emit("phase", phase=name, **extra)

    def end(self, reason: str, code: int, **extra: Any) -> TrainResult:
        self.hb.stop()  # run_end is the last line of a run: no heartbeat after it
        self.emit("run_end", reason=reason, exit_code=code, step=self.global_step, **extra)
        self.log.info("run_end: %s (exit %d) at step %d", reason, code, self.global_step)
        return TrainResult(exit_code=code, reason=reason, step=self.global_step, losses=self.losses)

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
        """build() then train(); every failure becomes classified `error` + `run_end` events."""
        try:
            early = self.build(max_steps, resume, allow_slow_kernels)
            return early if early is not None else self.train()
        except ResumeRefused as exc:
            self.global_step = exc.step
            self.emit("error", **{"class": "config"}, message=str(exc), traceback=None, fatal=True)
            self.log.error("%s", exc)
            stderr_line(f"dflash: {exc}")
            return self.end("refused", EXIT_USAGE)
        except (UsageError, DataError, ConfigError, ckpt.CheckpointError) as exc:
            self.emit("error", **{"class": "config"}, message=str(exc), traceback=None, fatal=True)
            self.log.error("%s", exc)
            stderr_line(f"dflash: {exc}")
            return self.end("error", EXIT_USAGE)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the event stream, classified
            cls = classify_error(exc)
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            if cls == "nccl" and "timed out" in msg.lower():
                msg = f"{msg} (a peer rank did not answer within dist.timeout_s = {self.cfg.dist.timeout_s:g} s)"
            self.writer.emit("error", **{"class": cls}, message=msg, traceback=traceback.format_exc(), fatal=True)
            self.log.error("fatal %s error: %s\n%s", cls, msg, traceback.format_exc())
            return self.end("error", EXIT_ERROR)

    # -- build
    def build(self, max_steps: int | None, resume: bool, allow_slow_kernels: bool) -> TrainResult | None:
        """Data and schedule, kernel preflight, target, drafter and optimizer; checking for a first signal at every
        phase boundary. Returns the run's result when it ends here (signal, slow kernels, a target-only rank)."""
        cfg, roles = self.cfg, self.roles
        tok = self._build_data(max_steps, resume)
        if self.stop_requested():
            return self.end_on_signal()
        allowed = allow_slow_kernels or cfg.target.allow_slow_kernels
        self._fla_configs()  # before the probe: fla reads its config mode once, at import
        kernels = {**probe_kernels(cfg.target, tok.vocab_size),
                   "attention": resolve_attention(cfg.drafter.attention, self.device)}
        self._run_start(kernels, resume)
        problems = check_kernels(kernels, self.device, allowed)
        if problems:
            for p in problems:
                self.emit("error", **{"class": "slow_kernel"}, message=p, traceback=None, fatal=True)
                self.log.error("preflight: %s", p)
            return self.end("error", EXIT_ERROR)
        if self.stop_requested():
            return self.end_on_signal()
        self._build_target(tok.vocab_size)
        # The probe above saw a weightless instance; what counts is what the loaded model really bound.
        problems = loaded_kernel_problems(kernels, self.info.kernels, self.device, allowed)
        if problems:
            for p in problems:
                self.emit("error", **{"class": "slow_kernel"}, message=p, traceback=None, fatal=not allowed)
                self.log.error("loaded target: %s", p)
            if not allowed:
                stderr_line(f"dflash: loaded target: {problems[0]}")
                return self.end("error", EXIT_ERROR)
        else:
            self.log.info("loaded target binds the kernels the probe saw")
        self._build_heldout(tok)
        if self.stop_requested():
            return self.end_on_signal()
        self._precapture_graphs()
        if self.stop_requested():
            return self.end_on_signal()
        if roles.role == "target":
            return self._serve_target()
        self._build_drafter(tok.mask_token_id)
        if self.stop_requested():
            return self.end_on_signal()
        self._build_feeder()
        return None

    def _build_data(self, max_steps: int | None, resume: bool) -> Any:
        """Tokenizer, corpus and start point (same on every rank; only rank 0 writes the tokenizer and schedule)."""
        cfg, roles = self.cfg, self.roles
        tok_cache = Path(cfg.data.tokenizer_cache) if cfg.data.tokenizer_cache else self.run_dir.out / "tokenizer"
        tok = self.tok  # loaded once per process: by preflight, or here when a tiny BPE had to be trained
        if tok is None and (roles.rank == 0 or roles.world_size == 1):
            tok = load_tokenizer(cfg.data, self.docs, tok_cache)  # rank 0 trains and writes it
        if roles.world_size > 1:
            dist.barrier()
            if tok is None:
                tok = load_tokenizer(cfg.data, self.docs, tok_cache)  # the other ranks read what rank 0 wrote
        assert tok is not None
        self.tok = tok
        self.corpus = tokenize(self.docs, tok)
        if roles.rank == 0:  # what `dflash data inspect` shows, once, in the log
            from dflash.data_inspect import training_summary_lines

            for note in self.data_notes:  # an empty file, a file read twice: said, not refused
                self.log.warning("data: warning: %s", note)
            for line in training_summary_lines(self.docs, self.corpus, tok, cfg.data, cfg.train.seed):
                self.log.info("%s", line)
        self.start = select_start(self.run_dir.out, cfg, roles, self.corpus, resume=resume, max_steps=max_steps)
        self.total = self.start.total
        self.global_step = self.start.start_step
        return tok

    def _run_start(self, kernels: dict[str, str], resume: bool) -> None:
        cfg, roles, st = self.cfg, self.roles, self.start
        self.emit("run_start", config=cfg.to_dict(), versions=versions(), kernels=kernels, device=str(self.device),
                  world_size=roles.world_size, roles=roles.as_event(),
                  resumed_from=st.start_step if resume else None, pid=os.getpid(), host=hostname(),
                  total_steps=self.total)
        self.log.info("run %s: %s on %s, %d steps (%d buffers/epoch of %d tokens, %d epochs), roles %s%s",
                      self.writer.run_id, "resume" if resume else "start", self.device, self.total,
                      st.buffers_per_epoch, cfg.data.token_budget, st.n_epochs, roles.as_event(),
                      f" from step {st.start_step}" if resume else "")

    def _eval_every(self) -> int:
        t = self.cfg.train
        return t.checkpoint_every if t.eval_every is None else t.eval_every

    def _build_heldout(self, tok: Any) -> None:
        """Rank 0's held-out set for the `eval` events (dflash/heldout.py), made with the training target right after
        it is loaded (no second instance; split: target rank 0 makes it for drafter rank 0), then read from the cache.
        A corpus with nothing held out turns evaluation off with a line saying why: it never stops a run."""
        from dflash import heldout
        from dflash.measure import EvalError

        self.heldout: heldout.HeldOutSet | None = None
        if not self._eval_every():
            return
        roles = self.roles
        if roles.split and roles.rank == roles.targets[0]:
            assert self.target is not None
            if heldout.Remote.serve(self.target, 0, self.device):
                self.log.info("eval: made the held-out set for drafter rank 0")
            return
        if not self.rank0:
            return
        self.phase("preparing_data", detail="held-out eval set")
        info = self.info
        remote = heldout.Remote(roles.targets[0], self.device, info.hidden_size * len(info.tap_layers),
                                info.dtype) if roles.split else None
        if remote is not None:
            make: heldout.Continue = remote
        else:
            assert self.target is not None  # colocated: every rank holds the target
            make = functools.partial(heldout.continuations, self.target)
        try:
            self.heldout = heldout.build(self.cfg, tok, make, block_size=self.cfg.drafter.block_size,
                                         total_steps=self.total, n_drafters=len(roles.drafters),
                                         run_dir=self.run_dir.out, device=self.device,
                                         log=lambda m: self.log.info("%s", m))
        except (EvalError, DataError) as exc:
            self.log.warning("eval: off for this run: %s (train.eval_every: 0 silences this)", exc)
            return
        finally:
            if remote is not None:
                remote.done()
        hs = self.heldout
        self.log.info("eval: tau on %d held-out sequences (%s) every %d steps; prompt lookup's tau there %s",
                      len(hs.sequences), hs.source, self._eval_every(),
                      "-" if hs.ngram_tau is None else f"{hs.ngram_tau:.3f}")

    def evaluate(self) -> None:
        """The drafter's exact serving tau on the held-out set: rank 0 alone (no collective; the other ranks wait at
        the next step's), dense attention, no target forward (the set carries the target's taps)."""
        from dflash import heldout

        if getattr(self, "heldout", None) is None:
            return
        assert self.heldout is not None
        prev_phase = self.live.phase
        self.phase("evaluating")
        autocast = self.device.type == "cuda"
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            res = heldout.evaluate(self.drafter, self.info.embed_tokens, self.info.lm_head, self.heldout, self.device)
        self.emit("eval", step=self.global_step, **res)
        tau, ng = res["tau"], res["ngram_tau"]
        self.log.info("eval step %d: tau %s (prompt lookup %s) on %d held-out sequences, %d tokens, %.2fs",
                      self.global_step, "-" if tau is None else f"{tau:.3f}", "-" if ng is None else f"{ng:.3f}",
                      res["sequences"], res["tokens"], res["seconds"])
        self.live.phase = prev_phase

    def _build_target(self, vocab: int) -> None:
        """The target (target and colocated ranks) or its frozen embedding/LM head (drafter ranks in split mode)."""
        cfg, roles, device = self.cfg, self.roles, self.device
        self.phase("loading_target", i=0, n=1)
        self.target: Target | None = None
        if roles.is_target:
            self._restore_triton()

            def progress(i: int, n: int) -> None:
                self.phase("loading_target", i=i, n=n)

            try:
                self.target = Target(cfg.target, cfg.drafter.num_layers, device, on_progress=progress, vocab=vocab)
            except ValueError as exc:  # the target names the bad field (target.arch, target.tap_layers, ...)
                raise UsageError(str(cfg.error(exc))) from None
            if self.target.enable_cuda_graph(cfg.data.token_budget, cfg.data.min_len, cfg.data.max_len,
                                             lambda msg: self.log.info("%s", msg)):
                self.log.info("target.cuda_graph: %s: the packed forward is captured per document-slot bucket %s",
                              cfg.target.cuda_graph, self.target.graphs.buckets if self.target.graphs else [])
            if self.target.fusion is not None:
                self.log.info("%s", describe_fusion(self.target.fusion))
            info = TargetInfo.from_target(self.target)
            if self.target.vocab_size < vocab:
                raise UsageError(f"target vocab {self.target.vocab_size} is smaller than the tokenizer's {vocab}")
            check_mask_token_id(cfg, self.target.vocab_size, "the loaded target's embedding")
            if roles.split and roles.target_index == 0:
                for d in roles.drafters:
                    send_target_info(info, d, device)
        else:
            info = recv_target_info(roles.targets[0], device)
        self.info = info
        self.log.info("target: %d layers, hidden %d, taps %s, packing %s, kernels %s (%.1fs)", info.num_layers,
                      info.hidden_size, info.tap_layers, info.packing, info.kernels, time.perf_counter() - self.t_start)

    def _precapture_graphs(self) -> None:
        """target.cuda_graph: capture every document-slot bucket the schedule's buffers need now, before the first
        step, instead of when a row first needs one. Why: a capture mid-run stalls that step (0.90 s at step 37 of the
        4B-like H100 run, docs/perf.md) and, days in, could fail for memory the run has since taken; done here it
        runs before READY, and grad_checkpoint: auto (the drafter's build, next) sees the graphs' memory as taken.
        The target forward of one real buffer per bucket is what captures it (the path every step takes)."""
        graphs = self.target.graphs if self.target is not None else None
        if graphs is None or graphs.failed is not None:
            return
        sched = self.start.schedule
        keys = ((e, i) for e, ep in enumerate(sched.epochs) for i in range(len(ep)))
        reps = graphs.representatives((k, [n for _, _, n in sched.buffer(k)]) for k in keys)
        if not reps:
            return
        self.phase("loading_target", detail=f"capturing the target forward for document-slot buckets {list(reps)}")
        t0, before = time.perf_counter(), graphs.captures
        for key in reps.values():
            compute_batch(self.target, self.corpus, sched.buffer(key), self.cfg.data.token_budget)
            if graphs.failed is not None or self.stop_requested():
                break
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.log.info("target.cuda_graph: %d of the %d buckets the schedule needs %s captured before the first step "
                      "(%.1fs)%s", graphs.captures - before, len(reps), list(reps), time.perf_counter() - t0,
                      f"; {graphs.failed}: the target forward runs eagerly" if graphs.failed else "")

    def _serve_target(self) -> TrainResult:
        """A target rank in split mode: compute hidden states for the drafter ranks until the schedule ends."""
        assert self.target is not None
        st = self.start
        refeeds = [refeed(st.feeds[d], st.states[d]) for d in range(len(self.roles.drafters))]
        self.live.phase = "training"
        sent = serve_target(self.roles, self.target, self.corpus, st.schedule, refeeds, self.cfg.data.token_budget,
                            self.device, on_item=lambda n: self._record_fla_configs() if n == 1 else None)
        self.log.info("target rank done: %d buffers sent", sent)
        return TrainResult(exit_code=EXIT_OK, reason="completed", step=0)

    def _build_drafter(self, mask_token_id: int | None) -> None:
        """Drafter (DDP among the drafter ranks), optimizer, schedule and generator; restored from the checkpoint."""
        cfg, roles, device, info = self.cfg, self.roles, self.device, self.info
        d = roles.drafter_index
        self.phase("building_drafter")
        self.dcfg = cfg.drafter if cfg.drafter.mask_token_id is not None else \
            dataclasses.replace(cfg.drafter, mask_token_id=mask_token_id)
        if self.dcfg.mask_token_id is None:
            raise UsageError("drafter.mask_token_id: the tokenizer has no mask token; set it in the config")
        torch.manual_seed(cfg.train.seed)  # identical init on every drafter rank and in every layout
        try:
            self.drafter = DFlashDrafter(self.dcfg, info.hidden_size, len(info.tap_layers)).to(device)
            apply_auto_checkpoint(self.drafter, cfg.data.token_budget, info.hidden_size * len(info.tap_layers),
                                  device, lambda msg: self.log.info("%s", msg))
        except ValueError as exc:  # e.g. drafter.hidden_size != target hidden size
            raise UsageError(str(cfg.error(exc))) from None
        if cfg.train.init_from is not None and self.start.resume_path is None:
            self._init_from(cfg.train.init_from)
        self.model: nn.Module = self.drafter
        if len(roles.drafters) > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.drafter, process_group=self.drafter_group,
                                                 device_ids=[device.index] if device.type == "cuda" else None)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        t = cfg.train
        self.opt, self.sched = build_optimizer(list(self.drafter.named_parameters()), t.optimizer, t.lr, t.betas,
                                               t.weight_decay, t.muon_weight_decay,
                                               lr_lambda(self.total, t.warmup_frac, t.min_lr_ratio))
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(t.seed * 1000 + d + 1)
        path = self.start.resume_path
        if path is not None:
            self.drafter.load_state_dict(ckpt.load_file(path, "drafter.pt"))
            self.opt.load_state_dict(ckpt.load_file(path, "optimizer.pt"))
            self.sched.load_state_dict(ckpt.load_file(path, "scheduler.pt"))
            rngs = ckpt.load_file(path, "rng.pt")
            _set_rng_state(rngs[d] if isinstance(rngs, list) else rngs, self.gen)
            self.log.info("resumed from %s", path)

    def _init_from(self, export_dir: str) -> None:
        """A new run starts from an exported / released drafter (dflash/init_from.py); a resume ignores it."""
        from dflash.init_from import InitFromError, check_init_from, load_init_from

        try:
            check_init_from(export_dir, self.dcfg, self.info.hidden_size, list(self.info.tap_layers))
        except InitFromError as exc:
            raise UsageError(str(exc)) from None
        got = load_init_from(self.drafter, export_dir)
        self.log.info("drafter initialised from %s (%s weights%s)", got["path"], got["dtype"],
                      f", step {got['step']} of run {got['run_id']}" if got.get("step") is not None else "")

    def _build_feeder(self) -> None:
        """Where buffers come from (the local target, or the target ranks), mixed through the reservoir; compile."""
        cfg, roles, device, info = self.cfg, self.roles, self.device, self.info
        d, t = roles.drafter_index, cfg.train
        if roles.split:
            self.source: Any = RemoteSource(roles, cfg.data.token_budget, info.hidden_size * len(info.tap_layers),
                                            info.dtype, device)
        else:
            target, corpus, schedule = self.target, self.corpus, self.start.schedule

            def source(_j: int, key: Any) -> Any:
                return compute_batch(target, corpus, schedule.buffer(key), cfg.data.token_budget)

            self.source = source
        self.feeder = Feeder(self.start.feeds[d], cfg.data.reservoir, t.seed * 1000 + d, self.source,
                             self.start.states[d])
        self.compile_on = t.compile == "true" or (t.compile == "auto" and device.type == "cuda")
        self.warm: compile_cache.WarmStart | None = None
        if self.compile_on:
            self._warm_start()
        self.step_model = (compile_step_model(self.model, self.drafter, t.compile_scope, t.compile_backend)
                           if self.compile_on else self.model)
        if self.compile_on:
            assert self.warm is not None
            self.phase("compiling", detail=f"the first step compiles the drafter; {self.warm.summary()}",
                       warm_start=self.warm.event())
        self.log.info("drafter: %d params, attention %s, compile %s (setup %.1fs)",
                      sum(p.numel() for p in self.params), self.drafter.attention_backend,
                      f"{self.compile_on} ({t.compile_scope})" if self.compile_on else self.compile_on,
                      time.perf_counter() - self.t_start)

    def _warm_start(self) -> None:
        """Caches on, and the run's saved mega-cache artifacts loaded before the first compiled step when their key
        matches this process (docs/warm-start.md): a restart then skips inductor's codegen even if its cache dir
        was emptied (opsctl's default `clear` policy, or a new host)."""
        caches = compile_cache.enable_caches()
        info = self.info
        graph = {"drafter": dataclasses.asdict(self.dcfg), "token_budget": self.cfg.data.token_budget,
                 "compile_backend": self.cfg.train.compile_backend, "attention": self.drafter.attention_backend,
                 "target": {"hidden_size": info.hidden_size, "taps": len(info.tap_layers), "dtype": str(info.dtype),
                            "vocab_size": info.vocab_size},
                 "drafter_ranks": len(self.roles.drafters), "autocast": self.device.type == "cuda"}
        if self.cfg.train.compile_scope != "whole":  # only then: the keys of artifacts saved before it stay valid
            graph["compile_scope"] = self.cfg.train.compile_scope
        self.artifact_key = compile_cache.artifact_key(self.device, graph)
        self.warm = compile_cache.load(self.run_dir.out, self.artifact_key, caches,
                                       host=compile_cache.host_dir(self.artifact_key))
        self.log.info("warm start %s: %s", "used" if self.warm.used else "not used", self.warm.reason)

    def _fla_configs(self) -> None:
        """fla's kernel choices recorded by earlier runs on this host and GPU are given to fla (target ranks on a GPU),
        so the first forward compiles one config per kernel instead of autotuning (dflash/fla_configs.py); the configs
        shipped with dflash for this GPU (dflash/fla_seed) are merged in first, for a fresh host. A cold
        start asked for (DFLASH_WARM_START=0) loads none; its choices are still recorded."""
        if self.device.type != "cuda" or not self.roles.is_target:
            return
        gpu = torch.cuda.get_device_name(self.device)
        self.fla_store = fla_configs.store_dir(cache_home(), gpu)
        if self.fla_store is not None and not compile_cache.warm_start_off():
            for line in (fla_configs.seed(self.fla_store, fla_configs.seed_dir(gpu)),
                         fla_configs.enable(self.fla_store)):
                if line:
                    self.log.info("%s", line)

    def _record_fla_configs(self) -> None:
        """After the target's first forward of this attempt (every fla kernel of it has been tuned)."""
        line = fla_configs.record(self.fla_store)
        if line:
            self.log.info("%s", line)

    def _restore_triton(self) -> None:
        """Before the target's first forward: the Triton kernels (fla's, inductor's) an earlier attempt carried in
        OUT/compile_cache go back into this host's Triton cache, so fla does not JIT and autotune again."""
        if compile_cache.warm_start_off():
            return
        self.triton = triton_carry.restore(compile_cache.cache_dir(self.run_dir.out),
                                           compile_cache.artifact_key(self.device, {}))
        if self.triton.reason:
            self.log.info("triton kernels: %s", self.triton.reason)

    def _first_step_fields(self, t0: float) -> dict[str, Any]:
        """What the first compiled step of this attempt reports: its time (the compile is in it), whether the warm
        start was used, and torch's cache hit/miss counters, which show what it saved."""
        first_s = time.perf_counter() - t0
        counts = compile_cache.counters()
        warm = self.warm is not None and self.warm.used
        self.log.info("first compiled step: %.2f s (warm start %s; fx graph cache %d hit / %d miss, aot autograd "
                      "cache %d hit / %d miss)", first_s, "used" if warm else "not used", counts["fxgraph_hit"],
                      counts["fxgraph_miss"], counts["aotautograd_hit"], counts["aotautograd_miss"])
        return {"first_step_s": round(first_s, 3), "warm_start": warm, "compile_cache": counts}

    def _save_artifacts(self) -> None:
        """Rank 0 keeps what this attempt compiled (or hit) for the next start; never fails the run."""
        if self.rank0:
            own = compile_cache.cache_dir(self.run_dir.out)
            prev = self.warm.sha256 if self.warm is not None and Path(self.warm.path or "").parent == own else None
            self.log.info("%s", compile_cache.save(self.run_dir.out, self.artifact_key, prev,
                                                   host=compile_cache.host_dir(self.artifact_key)))
            line = triton_carry.save(compile_cache.cache_dir(self.run_dir.out), self.artifact_key, self.triton)
            if line:
                self.log.info("%s", line)

    # -- the loop
    def _disk_full(self, message: str) -> None:
        self.emit("error", **{"class": "disk_full"}, message=message, traceback=None, fatal=False)
        self.log.warning("%s", message)

    def _write_checkpoint(self, files: dict[str, bytes], final: bool) -> ckpt.SavedCheckpoint | None:
        """A full disk must not end a week-long run whose state is still in memory. A periodic checkpoint is then
        skipped (training goes on; the next one tries again); the final one is retried every FINAL_SAVE_RETRY_S
        for up to train.final_save_wait_s, unless a signal asks the run to stop, then fails the run (the previous
        checkpoint stays). Either way the failed attempt's partial directory is already gone (save_checkpoint)."""
        where = ckpt.checkpoints_dir(self.run_dir.out)
        deadline = time.monotonic() + self.cfg.train.final_save_wait_s
        announced = False
        while True:
            try:
                return ckpt.save_checkpoint(self.run_dir.out, self.global_step, files,
                                            keep_last=self.cfg.train.keep_last)
            except OSError as exc:
                if not ckpt.is_disk_full(exc):
                    raise
                need = sum(len(v) for v in files.values())
                free = shutil.disk_usage(where).free
                what = (f"checkpoint step-{self.global_step} not saved: {exc.strerror} in {where} ({_mib(free)} "
                        f"free, it needs {_mib(need)})")
                if not final:
                    every = self.cfg.train.checkpoint_every
                    self._disk_full(f"{what}; training goes on and the next save (step "
                                    f"{min(self.global_step + every, self.total)}) tries again: free space there or lower "
                                    f"train.keep_last ({self.cfg.train.keep_last})")
                    return None
                if self.gate.received is not None or time.monotonic() >= deadline:
                    raise OSError(exc.errno, f"final {what}; the newest checkpoint on disk is the one to resume "
                                             f"from") from exc
                if not announced:
                    self._disk_full(f"final {what}; retrying every {FINAL_SAVE_RETRY_S:g} s for up to "
                                    f"{self.cfg.train.final_save_wait_s:g} s (train.final_save_wait_s): free space "
                                    f"there; `opsctl kill` gives up")
                    announced = True
                until = min(deadline, time.monotonic() + FINAL_SAVE_RETRY_S)
                while time.monotonic() < until and self.gate.received is None:
                    time.sleep(0.2)

    def train(self) -> TrainResult:
        """Step until the planned length, a signal (finish the step, checkpoint) or a non-finite loss."""
        reason = "completed"
        while self.global_step < self.total:
            if self.global_step == self.start.start_step and self.stop_requested():
                return self.end_on_signal()  # a signal during setup or compiling: no step has run, nothing to save
            stats = self.step()
            if stats.nonfinite:
                return self.end("error", EXIT_ERROR)
            if self.on_step is not None:
                self.on_step(self.global_step, stats.loss)
            if stats.stop or (len(self.roles.drafters) == 1 and self.gate.received is not None):
                reason = "signal"
                break
            every = self.cfg.train.checkpoint_every
            if every and self.global_step % every == 0 and self.global_step < self.total:
                self.save()
            every = self._eval_every()
            if every and self.global_step % every == 0 and self.global_step < self.total:
                self.evaluate()
        if reason == "signal" and self.roles.split:
            self.source.stop(self.feeder.pending_targets(self.roles))
        self.save(final=True)
        if reason == "completed" and self._eval_every():
            self.evaluate()  # the final drafter's tau (after its checkpoint: an eval never delays the save)
        self.phase("finishing")
        if reason == "signal":
            return self.end("signal", EXIT_OK, signal=self.gate.name or "SIGTERM")
        return self.end("completed", EXIT_OK)

    def step(self) -> StepStats:
        """One optimizer step and its `step` event; a non-finite loss is reported (event + fatal error) and no
        optimizer step is taken: the caller ends the run."""
        if not self.compile_on:
            self._enter_training()
        t0 = time.perf_counter()
        key, batch = self.feeder.next()
        batch = batch.to(self.device)
        wait_s = self.feeder.last_wait_s
        self.model.train()
        autocast = self.device.type == "cuda"
        with FlexWarningWatch() as watch, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            out = self.step_model(batch, self.info.embed_tokens, self.info.lm_head, generator=self.gen)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip))
        lr = float(self.sched.get_last_lr()[0])
        stats = self._reduce_stats(out, batch)
        if stats.nonfinite:
            self.step_event(key, stats, lr, grad_norm, t0, wait_s, 0)
            self.emit("error", **{"class": "nan"}, message=f"non-finite loss {stats.loss} at step "
                      f"{self.global_step + 1}", traceback=None, fatal=True)
            self.log.error("non-finite loss %s at step %d: stopping", stats.loss, self.global_step + 1)
            return stats
        # Compiled forward and backward ran: `training` starts just before the first optimizer step.
        self._enter_training()
        self.opt.step()
        self.sched.step()
        self.global_step += 1
        recompiles = self._recompiles()
        self._report_fallbacks(watch)
        self.losses.append(stats.loss)
        first = self.compile_on and self.global_step == self.start.start_step + 1
        extra = self._first_step_fields(t0) if first else None
        self.step_event(key, stats, lr, grad_norm, t0, wait_s, recompiles, extra)
        if self.global_step == self.start.start_step + 1:
            self._record_fla_configs()  # after the step's own time was taken
        if first:
            self._save_artifacts()
        return stats

    def _report_fallbacks(self, watch: FlexWarningWatch) -> None:
        """Compiled code that went eager (flex's own warning, or dynamo at its recompile limit) is an error event:
        the run goes on, correct but many times slower and larger, and a person must see why."""
        for line in watch.fallbacks:
            cls = "uncompiled_flex" if "flex_attention" in line or "create_block_mask" in line else "recompile"
            self.emit("error", **{"class": cls}, message=line[:500], traceback=None, fatal=False)
            self.log.error("%s", line)
        if watch.triggered and not self._flex_warned:
            self._flex_warned = True
            self.emit("error", **{"class": "uncompiled_flex"}, message=watch.triggered[0][:500],
                      traceback=None, fatal=False)
            self.log.error("%s", watch.triggered[0])

    def _enter_training(self) -> None:
        if not self._in_training:
            self.phase("training")
            self._in_training = True

    def _recompiles(self) -> int:
        """Dynamo frames compiled since the first step: anything after warm-up is a recompile (reported once)."""
        if not self.compile_on:
            return 0
        frames = dynamo_counts()["frames"]
        if self._frames_after_warmup is None:
            self._frames_after_warmup = frames
        recompiles = frames - self._frames_after_warmup
        if recompiles > 0 and not self._recompile_warned:
            self._recompile_warned = True
            self.emit("error", **{"class": "recompile"}, traceback=None, fatal=False,
                      message=f"drafter step recompiled after warm-up ({recompiles} new frames)")
        return recompiles

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
            dist.all_reduce(red, group=self.drafter_group)
            vals = red.cpu()
        return StepStats(loss=float(vals[0]) / n_d, tokens=int(vals[1]), real_tokens=int(vals[2]),
                         nonfinite=bool(vals[3] > 0), stop=bool(vals[4] > 0),
                         acc=[round(float(a) / n_d, 4) for a in vals[5:]])

    def step_event(self, key: Any, st: StepStats, lr: float, grad_norm: float, t0: float, wait_s: float,
                   recompiles: int, extra: dict[str, Any] | None = None) -> None:
        """`extra` (the first compiled step's fields) is always written, whatever log_every says."""
        step_time = time.perf_counter() - t0
        if not st.nonfinite:
            self.pace.note(step_time, time.monotonic())  # every step, logged or not
        step = self.global_step if not st.nonfinite else self.global_step + 1
        if step % self.cfg.train.log_every and step != self.total and not st.nonfinite and not extra:
            return
        tps = st.real_tokens / max(step_time, 1e-9)
        self.emit("step", step=step, epoch=int(key[0]), loss=st.loss, acc=st.acc, lr=lr, grad_norm=grad_norm,
                  tokens=st.tokens, tokens_per_s=tps, step_time_s=step_time,
                  queue_depth=len(self.feeder.reservoir), queue_wait_s=wait_s, recompiles=recompiles,
                  total_steps=self.total, buffer=[int(key[0]), int(key[1])], **self.pace.fields(), **(extra or {}))
        self.log.info("step %d/%d  loss %.4f  acc[1] %.3f  lr %.2e  gnorm %.2f  %.0f tok/s  %.2fs", step,
                      self.total, st.loss, st.acc[0] if st.acc else float("nan"), lr, grad_norm, tps, step_time)

    # -- checkpoints
    def save(self, final: bool = False) -> None:
        """Gather every drafter rank's feed position and RNG, then rank 0 writes one atomic checkpoint (`final`: the
        one at the end of the run or on a signal)."""
        n_d = len(self.roles.drafters)
        mine = {"feed": self.feeder.state().to_json(), "rng": _rng_state(self.gen)}
        if n_d > 1:
            gathered: list[Any] = [None] * n_d
            dist.all_gather_object(gathered, mine, group=self.drafter_group)
        else:
            gathered = [mine]
        if not self.rank0:
            return
        prev_phase = self.live.phase
        self.phase("saving")
        info = self.info
        pipeline = {"step": self.global_step, "total_steps": self.total, "feeds": [g["feed"] for g in gathered]}
        meta = {"target": {"num_layers": info.num_layers, "tap_layers": info.tap_layers,
                           "hidden_size": info.hidden_size, "vocab_size": info.vocab_size,
                           "dtype": str(info.dtype).replace("torch.", ""), "path": self.cfg.target.path},
                "drafter": dataclasses.asdict(self.dcfg), "run_id": self.writer.run_id, "config": self.cfg.to_dict()}
        files = {
            "drafter.pt": ckpt.torch_bytes(self.drafter.state_dict()),
            "optimizer.pt": ckpt.torch_bytes(self.opt.state_dict()),
            "scheduler.pt": ckpt.torch_bytes(self.sched.state_dict()),
            "rng.pt": ckpt.torch_bytes([g["rng"] for g in gathered] if n_d > 1 else gathered[0]["rng"]),
            "pipeline.json": ckpt.json_bytes(pipeline),
            "meta.json": ckpt.json_bytes(meta),
        }
        saved = self._write_checkpoint(files, final)
        if saved is not None:
            self.emit("checkpoint", path=str(saved.path), step=saved.step, manifest_sha256=saved.manifest_sha256,
                      bytes=saved.bytes, seconds=saved.seconds, free_bytes=saved.free_bytes)
            self.log.info("checkpoint %s (%.1f MB, %.2fs)", saved.path, saved.bytes / 2**20, saved.seconds)
            if not final and saved.free_bytes < saved.bytes:
                self._disk_full(f"{_mib(saved.free_bytes)} left in {saved.path.parent} after checkpoint "
                                f"step-{saved.step} ({_mib(saved.bytes)}): the next one will not fit; free space there "
                                f"or lower train.keep_last ({self.cfg.train.keep_last})")
        # `training` is entered once (docs/events.md); heartbeats go back to it without a new phase event.
        self.live.phase = prev_phase
