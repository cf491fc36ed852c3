"""Alert rules for a watched run: each alert says what is wrong and quotes the evidence that shows it.

The TUI, `--plain` and `--once --json` all use these rules, so a person and a script are told the same thing.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from dflash.telemetry import ERROR_CLASSES, RESERVOIR_CAPACITY
from opsctl.remote.rules import MemoryWatch, slowdown, tau_regression  # the wrapper's notify: the same rules
from opsctl.runstate import RunView, phase_progress

WARMUP_STEPS = 3  # recompiles during the first steps are expected (shapes settle); later ones are a bug
GPU_IDLE_UTIL = 5.0  # percent
GPU_IDLE_AFTER_S = 30.0
STARVED_FRACTION = 0.5  # drafter waits more than half of its step for hidden states
QUEUE_WINDOW = 5  # steps looked at for starvation / backlog
QUEUE_MIN_STEPS = 3
CRITICAL = "critical"
WARNING = "warning"



def _error_class(name: str) -> str:
    """An `error` event class (dflash/telemetry.py ERROR_CLASSES) a rule reacts to: a renamed class fails here,
    at import, instead of silently never alerting again."""
    if name not in ERROR_CLASSES:
        raise ImportError(f"opsctl.alerts: error class {name!r} is not in dflash.telemetry.ERROR_CLASSES")
    return name


NAN, SLOW_KERNEL, RECOMPILE, UNCOMPILED_FLEX, DISK_FULL = map(
    _error_class, ("nan", "slow_kernel", "recompile", "uncompiled_flex", "disk_full"))

# Config keys that name the hidden-state reservoir's capacity (the training core's config names it).
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)\b")


@dataclass(frozen=True)
class Alert:
    """One problem, with the evidence a person needs to believe it without opening a shell."""

    key: str  # stable id: crashed, stalled, nan, slow_kernel, recompile, gpu_idle, queue_starved, ...
    severity: str  # "critical" or "warning"
    title: str
    evidence: str
    since: float | None = None  # when it was first seen (local clock of the watcher)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _as_float(x: Any) -> float | None:
    """Telemetry may carry NaN/inf as floats or as the strings "nan"/"inf" (see dflash/telemetry.py)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str) and x.lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
        return float(x)
    return None


def _find_capacity(config: Any) -> int | None:
    """The reservoir capacity at the contract's path in run_start's config; None when the run does not say."""
    node = config
    for key in RESERVOIR_CAPACITY:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, int) and not isinstance(node, bool) and node > 0:
        return node
    return None


def exception_line(traceback: str | None) -> str | None:
    """The line of a traceback that names the exception (its last non-empty, non-indented line)."""
    if not traceback:
        return None
    for line in reversed(traceback.rstrip().splitlines()):
        if line.strip() and not line.startswith((" ", "\t")):
            return line.strip()
    return None


class AlertTracker:
    """Remembers what the alert rules need beyond one RunView: history of steps, GPU samples, log tracebacks, link."""

    def __init__(self, tau_drop: Any = None) -> None:
        # the run's `tau_regression` thresholds (config.TauRegression or a dict of drop_frac/drop_min; None: defaults)
        drop = tau_drop.model_dump() if hasattr(tau_drop, "model_dump") else dict(tau_drop or {})
        self.tau_drop: tuple[float | None, float | None] = (drop.get("drop_frac"), drop.get("drop_min"))
        self._reset_run()
        self.link_state: str = "connecting"
        self.link_detail: str = ""
        self.link_since: float | None = None
        self._first_seen: dict[str, float] = {}

    def _reset_run(self) -> None:
        self.slow_kernels: dict[str, str] = {}
        self.kernel_errors: list[str] = []
        self.nan: str | None = None
        self.disk_full: str | None = None  # the last disk_full error since the last checkpoint that fit
        self.recompile_base: tuple[int, int] | None = None  # (step, recompiles) at the end of warm-up
        self.recompile_growth: str | None = None
        self.recompile_errors: list[str] = []
        self.recent_steps: deque[tuple[int, float, float, int]] = deque(maxlen=QUEUE_WINDOW)
        self.pace: tuple[Any, Any, Any] | None = None  # the last step event's (pace, pace_ref_s, step)
        self.capacity: int | None = None
        self.split_roles = False  # separate target and drafter ranks: only then can the queue starve or back up
        self.training_since: float | None = None
        self.idle_since: dict[int, float] = {}
        self.idle_util: dict[int, float] = {}
        self.last_gpu_ts: float | None = None
        self.gpus_with_procs: set[int] = set()
        self.log_exception: str | None = None
        self._in_traceback = False
        self.memory = MemoryWatch()  # memory_growth and alloc_retries (opsctl/remote/rules.py: notify's rules too)
        self.status_memory: tuple[Any, Any] = (None, None)  # the same rules' verdicts, from a `status` answer

    # -- input ---------------------------------------------------------------------------
    def observe(self, msg: dict[str, Any]) -> None:
        """Feed every agent message, in stream order (plus the watcher's own `link` messages)."""
        t = msg.get("t")
        if t == "log":
            self.observe_log(str(msg.get("line", "")))
        elif t == "event" and isinstance(msg.get("event"), dict):
            self._observe_event(msg["event"])
        elif t == "gpu":
            self._observe_gpu(msg)
        elif t == "link":
            self.set_link(str(msg.get("state")), str(msg.get("detail") or ""), msg.get("local_ts"))
        elif t == "status":  # status reads every heartbeat of the attempt but sends only the last: its verdicts
            self.status_memory = (msg.get("memory_growth"), msg.get("alloc_retries"))
        elif t == "hello":
            self.set_link("up", f"agent {msg.get('agent_version', '?')} on {msg.get('host', '?')}", msg.get("local_ts"))

    def set_link(self, state: str, detail: str, ts: Any = None) -> None:
        if state != self.link_state:
            self.link_since = float(ts) if isinstance(ts, (int, float)) else None
        self.link_state = state
        self.link_detail = detail

    def observe_log(self, line: str) -> None:
        # Cheap checks first: this runs for every log line of a very chatty run.
        if self._in_traceback:
            if line and not line.startswith((" ", "\t")) and _EXC_LINE.match(line):
                self.log_exception = line.strip()
                self._in_traceback = False
        elif line.startswith("Traceback (most recent call last)"):
            self._in_traceback = True

    def _observe_event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("kind")
        ts = ev.get("ts")
        if kind == "run_start":
            self._reset_run()
            kernels = ev.get("kernels") or {}
            # On a CPU run the PyTorch fallback is the only implementation there is: not worth an alert.
            on_cpu = str(ev.get("device") or "").startswith("cpu")
            self.slow_kernels = {} if on_cpu else {k: str(v) for k, v in kernels.items() if str(v) == "torch-fallback"}
            self.capacity = _find_capacity(ev.get("config"))
            roles = ev.get("roles") or {}
            # Colocated, the "wait" is the rank's own target forward and a full reservoir is its normal state.
            self.split_roles = isinstance(roles, dict) and bool(roles.get("target")) and bool(roles.get("drafter"))
        elif kind == "phase":
            if ev.get("phase") == "training" and self.training_since is None and _finite(ts):
                self.training_since = float(ts)
        elif kind == "step":
            self._observe_step(ev)
        elif kind == "checkpoint":
            self.disk_full = None  # a checkpoint that fit; a warning that the next one will not follows it
        elif kind == "error":
            cls = ev.get("class")
            message = str(ev.get("message") or "")
            if cls == DISK_FULL:
                self.disk_full = message
            elif cls == NAN and self.nan is None:
                self.nan = f"error nan: {message}"
            elif cls == SLOW_KERNEL:
                self.kernel_errors.append(message)
                del self.kernel_errors[:-5]
            elif cls in (RECOMPILE, UNCOMPILED_FLEX):
                self.recompile_errors.append(f"{cls}: {message}")
                del self.recompile_errors[:-5]
        self.memory.note(ev)  # after run_start's reset: the new attempt's watch sees its own run_start

    def _observe_step(self, ev: dict[str, Any]) -> None:
        ts = ev.get("ts")
        step = ev.get("step")
        if self.training_since is None and _finite(ts):
            self.training_since = float(ts)
        loss = _as_float(ev.get("loss"))
        if loss is not None and not math.isfinite(loss) and self.nan is None:
            self.nan = f"loss={loss} at step {step}"
        self.pace = (ev.get("pace"), ev.get("pace_ref_s"), step)
        rc = ev.get("recompiles")
        if isinstance(step, int) and isinstance(rc, int) and step > WARMUP_STEPS:
            if self.recompile_base is None:
                self.recompile_base = (step, rc)
            elif rc > self.recompile_base[1]:
                base_step, base_rc = self.recompile_base
                self.recompile_growth = f"recompiles {base_rc} at step {base_step} -> {rc} at step {step}"
        wait, st, depth = ev.get("queue_wait_s"), ev.get("step_time_s"), ev.get("queue_depth")
        if _finite(wait) and _finite(st) and isinstance(depth, int) and isinstance(step, int):
            self.recent_steps.append((step, float(wait), float(st), depth))

    def _observe_gpu(self, msg: dict[str, Any]) -> None:
        ts = msg.get("ts")
        if not _finite(ts):
            return
        self.last_gpu_ts = float(ts)
        for gpu in msg.get("gpus") or []:
            idx, util = gpu.get("index"), gpu.get("util")
            if not isinstance(idx, int) or not _finite(util):
                continue
            if gpu.get("procs"):
                self.gpus_with_procs.add(idx)
            else:
                self.gpus_with_procs.discard(idx)
            if util < GPU_IDLE_UTIL:
                self.idle_since.setdefault(idx, float(ts))
                self.idle_util[idx] = max(self.idle_util.get(idx, 0.0), float(util))
            else:
                self.idle_since.pop(idx, None)
                self.idle_util.pop(idx, None)

    # -- rules ---------------------------------------------------------------------------
    def evaluate(self, view: RunView, now: float) -> list[Alert]:
        """The alerts active for this view; `now` is the watcher's local clock (only used for `since`)."""
        found = list(self._rules(view))
        active = {a.key for a in found}
        for key in list(self._first_seen):
            if key not in active:
                del self._first_seen[key]
        out = []
        for a in found:
            since = self._first_seen.setdefault(a.key, now)
            out.append(Alert(a.key, a.severity, a.title, a.evidence, since))
        return out

    def _rules(self, v: RunView) -> Iterable[Alert]:
        if v.state == "crashed":
            yield Alert("crashed", CRITICAL, "run crashed", self._crash_evidence(v))
        if v.state == "refused":  # it will not go on by itself (never restarted): someone must change what it refused
            yield Alert("refused", CRITICAL, "run refused to start", self._crash_evidence(v))
        # `killed` is never an alert: the state is only derived when opsctl's kill marker exists (someone asked for
        # it); the badge and the summary's `ended` line say how it ended.
        if v.state == "stalled":
            where = phase_progress(v.phase or "no phase yet", v.phase_i, v.phase_n)
            yield Alert("stalled", CRITICAL, "run stalled",
                        f"no heartbeat or step for {v.heartbeat_age_s or 0:.0f} s (stall_after "
                        f"{v.stall_after_s or 0:g} s); last seen in {where}, step {v.step}")
        if self.link_state in ("lost", "reconnecting"):
            title = "SSH link lost" if self.link_state == "lost" else "SSH link lost, reconnecting"
            yield Alert("link", CRITICAL, title, self.link_detail or self.link_state)
        if self.nan is not None:
            yield Alert("nan", CRITICAL, "loss is NaN/inf", self.nan)
        if self.disk_full is not None and v.state not in ("crashed", "refused", "finished", "killed"):
            yield Alert("disk_full", CRITICAL, "checkpoints: disk full", self.disk_full)
        if self.slow_kernels or self.kernel_errors:
            parts = [f"{k}: {impl}" for k, impl in sorted(self.slow_kernels.items())] + self.kernel_errors
            yield Alert("slow_kernel", WARNING, "slow kernel fallback", "; ".join(parts))
        if self.recompile_growth or self.recompile_errors:
            parts = ([self.recompile_growth] if self.recompile_growth else []) + self.recompile_errors
            yield Alert("recompile", WARNING, "recompiles after warm-up", "; ".join(parts))
        if v.state in ("training", "stalled"):
            grew = self.memory.growth() or self.status_memory[0]
            if grew:
                yield Alert("memory_growth", WARNING, "memory keeps growing", grew)
            retried = self.memory.alloc_retries() or self.status_memory[1]
            if retried:
                yield Alert("alloc_retries", WARNING, "GPU allocator retrying", retried)
        if v.state == "training":
            idle = self._idle_evidence()
            if idle:
                yield Alert("gpu_idle", WARNING, "GPU idle while training", idle)
            slow = slowdown(*self.pace) if self.pace is not None else None
            if slow:
                yield Alert("slowdown", WARNING, "run got slower", slow)
        if v.state in ("training", "stalled"):
            yield from self._queue_rules()
        # A fact about the drafter, whatever the process does now: a finished run whose last tau is far below its
        # best ends with a worse drafter than one of its own checkpoints.
        fell = tau_regression(v.tau_best, v.tau_best_step, v.tau, v.tau_step, *self.tau_drop)
        if fell:
            yield Alert("tau_regression", WARNING, "τ fell below its best", fell)

    def _crash_evidence(self, v: RunView) -> str:
        parts: list[str] = []
        fatal = [e for e in v.errors if e.get("fatal")] or v.errors
        if fatal:
            err = fatal[-1]
            line = exception_line(err.get("traceback"))
            if line:
                parts += [line, f"error class {err.get('class')}"]
            else:
                parts.append(f"{err.get('class')}: {err.get('message')}")
        elif v.exception or self.log_exception:  # the agent's line (a `dflash: ...` refusal too) or the log's
            parts.append(str(v.exception or self.log_exception))
        if v.end_reason:
            parts.append(f"run_end {v.end_reason}")
        if v.exit_code is not None:
            parts.append(f"exit code {v.exit_code}")
        elif v.proc_state == "exited":
            parts.append("process exited without run_end")
        return "; ".join(parts) or "process gone"

    def _idle_evidence(self) -> str | None:
        if self.last_gpu_ts is None or self.training_since is None:
            return None
        # A GPU with no compute process belongs to someone else; if NVML lists no processes at all
        # (common inside a container), every GPU counts.
        watched = self.gpus_with_procs or set(self.idle_since)
        idle = []
        for idx in sorted(watched):
            start = self.idle_since.get(idx)
            if start is None:
                continue
            duration = self.last_gpu_ts - max(start, self.training_since)
            if duration > GPU_IDLE_AFTER_S:
                idle.append(f"GPU {idx} util <= {self.idle_util.get(idx, 0):.0f}% for {duration:.0f} s")
        return "; ".join(idle) + " while the run reports training" if idle else None

    def _queue_rules(self) -> Iterable[Alert]:
        if not self.split_roles or len(self.recent_steps) < QUEUE_MIN_STEPS:
            return
        waits = [s[1] for s in self.recent_steps]
        times = [s[2] for s in self.recent_steps]
        wait, st = statistics.median(waits), statistics.median(times)
        first, last = self.recent_steps[0][0], self.recent_steps[-1][0]
        if st > 0 and wait > STARVED_FRACTION * st:
            yield Alert("queue_starved", WARNING, "drafter starved of hidden states",
                        f"median queue wait {wait:.2f} s of {st:.2f} s step ({100 * wait / st:.0f}%), "
                        f"steps {first}-{last}")
        if self.capacity is not None and all(s[3] >= self.capacity for s in self.recent_steps):
            yield Alert("queue_backlog", WARNING, "hidden-state queue full",
                        f"queue depth {self.recent_steps[-1][3]}/{self.capacity} for steps {first}-{last}: "
                        "the drafter cannot keep up with the targets")
