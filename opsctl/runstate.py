"""Run state derived from the agent stream (docs/agent-protocol.md) and telemetry events (docs/events.md).

One reducer shared by `launch`, `status`, `logs` and `watch`, so every view agrees on what a run is doing.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash.telemetry import PHASES, EventError, parse_event
from opsctl.remote.rules import (  # the wrapper's notifications use the same rule
    STALL_FACTOR,
    STALL_FLOOR_S,
    EtaClock,  # the ETA: the same rule as the agent's status
    TauTrack,  # the run's tau: the same rule as the agent's status and the notify
)

# Every phase the contract lists before `compiling` reads as loading (target, drafter, data).
LOADING_PHASES = frozenset(PHASES[:PHASES.index("compiling")])
# A run in one of these has ended: no heartbeat to age, its last phase is where it was when it ended.
ENDED_STATES = frozenset({"finished", "crashed", "killed", "refused"})
__all__ = ["ENDED_STATES", "LOADING_PHASES", "STALL_FACTOR", "STALL_FLOOR_S", "RunState", "RunView", "attempt_clock", "fmt_span",
           "fmt_when", "phase_progress", "unreachable_view"]


def phase_progress(phase: Any, i: Any, n: Any) -> str:
    """`loading_target 2/3`: a phase with its i/n progress when the run reports both (the one spelling)."""
    return f"{phase} {i}/{n}" if i is not None and n is not None else str(phase)


def fmt_span(seconds: float | None) -> str:
    """`45s`, `12m05s`, `3h07m`, `2d04h`: an attempt's length read at a glance (they last seconds to days)."""
    if seconds is None:
        return "-"
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_when(ts: float | None, short: bool = False) -> str:
    """A start time in the local time zone; `short`: the time alone when it is today (a week-long run's attempts
    span days, so other days keep their date)."""
    if ts is None:
        return "-"
    t = time.localtime(ts)
    if short:
        return time.strftime("%H:%M:%S" if t[:3] == time.localtime()[:3] else "%m-%d %H:%M", t)
    return time.strftime("%Y-%m-%d %H:%M:%S", t)


def attempt_clock(view: dict[str, Any]) -> str:
    """`#3 12:03:04 (4m12s)`: the current attempt, when it started and how long it has run (status' column)."""
    if view.get("started_at") is None:
        return "-"
    n = f"#{view['attempt']} " if view.get("attempt") is not None else ""
    return f"{n}{fmt_when(view['started_at'], short=True)} ({fmt_span(view.get('duration_s'))})"


@dataclass
class RunView:
    """What a person wants to know about one run, at one instant."""

    # starting, loading, compiling, training, stalled, finished, crashed, killed, restarting (an attempt crashed
    # and the wrapper starts the next one after the back-off), refused (the run refused to start: run_end
    # `refused`, e.g. a resume it cannot make); absent: the host was reached and has no such run;
    # unreachable: the host could not be asked at all.
    state: str = "absent"
    phase: str | None = None
    phase_i: int | None = None
    phase_n: int | None = None
    step: int = 0
    total_steps: int | None = None
    epoch: int | None = None
    loss: float | None = None
    acc: list[float] = field(default_factory=list)
    lr: float | None = None
    tokens_per_s: float | None = None  # the last step's own (its compute alone)
    tokens_per_s_avg: float | None = None  # the run's rate: real tokens per wall second, recent steps (EtaClock)
    step_time_s: float | None = None
    queue_depth: int | None = None
    queue_wait_s: float | None = None
    recompiles: int | None = None
    eta_s: float | None = None
    heartbeat_age_s: float | None = None
    stall_after_s: float | None = None
    kernels: dict[str, str] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    end_reason: str | None = None
    exit_code: int | None = None  # the training core's own (run_end) when it wrote one, else the process's
    proc_exit_code: int | None = None  # what the process (or its launcher, e.g. torchrun) returned
    pid: int | None = None
    pgid: int | None = None
    proc_state: str | None = None
    last_checkpoint: str | None = None
    gpus: list[dict[str, Any]] = field(default_factory=list)
    nvml: str | None = None
    exception: str | None = None  # the exception line of the last traceback of an attempt that exited non-zero
    leftover_pids: list[int] = field(default_factory=list)  # processes an exited run left alive
    bad_events: int = 0  # events lines skipped because they break the contract (docs/events.md)
    bad_event: str | None = None  # why the last one was skipped, and where it is in the events file
    link_error: str | None = None  # why the host could not be reached (state `unreachable`)
    reason: str | None = None  # one line saying why the state is what it is: `RuntimeError: boom (exit 1)`
    attempt: int | None = None  # the current attempt's id (opsctl history HOST RUN lists them all)
    started_at: float | None = None  # when the current attempt started (Unix time, the host's clock)
    duration_s: float | None = None  # how long it ran (until now while it runs)
    cleaned: bool = False  # `opsctl clean` removed the ended run's pid file (its attempts are still in history)
    restart_n: int | None = None  # state restarting: which restart comes next (RESTARTING (n/max))
    restart_max: int | None = None  # the restart policy's max (None: no policy)
    restart_in_s: float | None = None  # state restarting: seconds until the next attempt starts
    # The drafter's exact serving acceptance length from the run's `eval` events (docs/events.md), across attempts
    # as resumes leave them: the latest (with prompt lookup's on the same text) and the best so far.
    tau: float | None = None
    tau_step: int | None = None
    tau_best: float | None = None
    tau_best_step: int | None = None
    ngram_tau: float | None = None
    tau_ci95: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def state_text(self) -> str:
        """`crashed (RuntimeError: boom (exit 1))`, `finished (leftover processes: PID 12)`: state and reason."""
        return f"{self.state} ({self.reason})" if self.reason else self.state


def unreachable_view(error: str) -> RunView:
    """The view of a run whose host could not be reached: never `absent`, which says the host answered."""
    first = error.strip().splitlines()[0] if error.strip() else "unreachable"
    return RunView(state="unreachable", link_error=first, reason=first)


class RunState:
    """Fold agent messages into a RunView. Feed every message with `apply`; read with `view(now)`."""

    def __init__(self, stall_after_s: float | None = None, killed_by_us: bool = False) -> None:
        self._v = RunView()
        self._stall_after = stall_after_s
        self._step_times: deque[float] = deque(maxlen=20)
        self._last_progress_ts: float | None = None  # heartbeat or step, writer's clock
        self._started_ts: float | None = None
        self._saw_run_start = False
        self._phase_events = False  # a phase or step event came: heartbeats no longer say the phase
        self._fatal_error = False
        self.killed_by_us = killed_by_us
        self._clock_skew = 0.0  # agent ts - local ts, so ages use the agent's clock
        self._run_end_ts: float | None = None
        self._ended: float | None = None
        self._restart_at: float | None = None
        self._killed_at: float | None = None  # when opsctl asked for the kill (the agent host's clock, as events')
        self._restart_lost: dict[str, Any] | None = None  # the restart whose wrapper died during the back-off
        self._signal: str | None = None  # the stop signal from outside opsctl that ended the attempt (the wrapper's)
        # Where the current attempt's events begin (the agent's `proc` `since`, opsctl.remote.procs.attempt_since): older
        # events are an earlier attempt's, counted for tau only, as `status` folds them.
        self._since: float | None = None
        self._events_checked = False  # the agent said (hello) it sends only events that passed the contract's check
        self.tau = TauTrack()
        self.eta = EtaClock()

    # -- input ---------------------------------------------------------------------------
    def apply(self, msg: dict[str, Any]) -> bool:
        """Fold one message in; False when it was an events line skipped for breaking the contract."""
        t = msg.get("t")
        if isinstance(msg.get("ts"), (int, float)):
            self._clock_skew = float(msg["ts"]) - time.time()
        if t == "status" and isinstance(msg.get("eta_clock"), dict):
            self.eta.load(msg["eta_clock"])  # folded over the whole attempt; the snapshot's last steps are too few
        ev = self.checked_event(msg) if t in ("event", "bad_event", "status") else None  # None: not one, or bad
        if ev is not None:
            self.apply_event(ev)
        elif t in ("event", "bad_event"):
            return False
        elif t == "proc":
            v = self._v
            v.proc_state = msg.get("state")
            v.pid = msg.get("pid", v.pid)
            v.pgid = msg.get("pgid", v.pgid)
            if msg.get("exit_code") is not None or v.proc_state == "running":
                v.proc_exit_code = msg.get("exit_code")  # a running (resumed, restarted) attempt has none yet
            if msg.get("attempt") is not None:
                v.attempt = msg["attempt"]
            if isinstance(msg.get("started"), (int, float)):
                v.started_at = float(msg["started"])
            self._ended = msg.get("ended") if isinstance(msg.get("ended"), (int, float)) else None
            restart = msg.get("restart") if v.proc_state == "restarting" else None
            v.restart_max = msg.get("restart_max") or None
            v.restart_n = restart.get("n") if isinstance(restart, dict) else None
            self._restart_at = restart.get("at") if isinstance(restart, dict) else None
            if msg.get("killed_by_opsctl"):
                self.killed_by_us = True
            if isinstance(msg.get("killed_at"), (int, float)):
                self._killed_at = float(msg["killed_at"])
            v.exception = msg.get("exception")
            v.cleaned = bool(msg.get("cleaned"))
            v.leftover_pids = [int(p) for p in msg.get("leftovers") or []]
            self._restart_lost = msg.get("restart_lost") if isinstance(msg.get("restart_lost"), dict) else None
            self._signal = msg.get("signal") if isinstance(msg.get("signal"), str) else None
            since = msg.get("since")
            if isinstance(since, (int, float)) and not isinstance(since, bool) and (self._since is None
                                                                                   or since > self._since):
                if self._since is not None and (self._started_ts is None or self._started_ts < since):
                    self._new_attempt()  # a new attempt began and has no run_start yet: nothing of the old one stays
                self._since = float(since)
        elif t == "gpu":
            self._v.gpus = list(msg.get("gpus") or [])
        elif t == "hello":
            self._v.nvml = msg.get("nvml")
            self._events_checked = msg.get("events_checked") is True
        elif t == "killed" or (t == "status" and msg.get("killed_by_opsctl")):
            self.killed_by_us = True
        return True

    def checked_event(self, msg: dict[str, Any]) -> dict[str, Any] | None:
        """The event of an `event` message if it is the contract (dflash.telemetry's own check), else None, counted
        in the view: one line of the wrong types (`"ts": "yesterday"`) must not take down every verb reading it.
        The lines the agent could not read as an object at all come as `bad_event` (or counted in `status`)."""
        if msg.get("t") == "status":
            if isinstance(msg.get("bad_events"), int) and msg["bad_events"] > 0:
                self._v.bad_events += msg["bad_events"]
                self._v.bad_event = msg.get("bad_event")
            return None
        if msg.get("t") == "bad_event":
            self._v.bad_events += 1
            self._v.bad_event = f"events file offset {msg.get('off')}: {msg.get('error')}"
            return None
        ev = msg.get("event")
        if self._events_checked and isinstance(ev, dict):
            return ev  # checked by the agent with the same table (opsctl/remote/rules.py event_problem): once is enough
        try:
            # the reader's check (types of the keys present); a copy: "nan" words stay as the writer put them
            parse_event(dict(ev) if isinstance(ev, dict) else ev, complete=False)
        except EventError as exc:
            self._v.bad_events += 1
            self._v.bad_event = f"events file offset {msg.get('off')}: {exc}"
            return None
        return ev

    def _new_attempt(self) -> None:
        """Forget everything of the attempt before: its step, phase, last metrics, errors, end and clocks (what
        `status` never reads, for it folds only the events of the current attempt)."""
        fresh = RunView()
        for key in ("phase", "phase_i", "phase_n", "step", "total_steps", "epoch", "loss", "acc", "lr",
                    "tokens_per_s", "step_time_s", "queue_depth", "queue_wait_s", "recompiles", "kernels", "errors",
                    "end_reason", "exit_code", "last_checkpoint"):
            setattr(self._v, key, getattr(fresh, key))
        self._saw_run_start = self._phase_events = self._fatal_error = False
        self._step_times.clear()
        self._last_progress_ts = self._started_ts = self._run_end_ts = None
        self.eta = EtaClock()

    def apply_event(self, ev: dict[str, Any]) -> None:
        v = self._v
        kind = ev.get("kind")
        ts = float(ev.get("ts", time.time()))
        if self.tau.note(ev):
            self._fold_tau()
        if kind == "run_start":
            v.bad_events, v.bad_event = 0, None  # the lines skipped since the last run_start (as status counts)
        if self._since is not None and ts < self._since:
            return  # an earlier attempt's event: its tau is noted, its state is not this attempt's
        self.eta.note(ev)
        if kind == "run_start":
            self._new_attempt()
            self._saw_run_start = True
            v.kernels = dict(ev.get("kernels") or {})
            v.total_steps = ev.get("total_steps")
            v.step = ev.get("resumed_from") or 0
            self._started_ts = ts
            self._last_progress_ts = ts
        elif kind == "phase":
            self._phase_events = True
            v.phase = ev.get("phase")
            v.phase_i = ev.get("i")
            v.phase_n = ev.get("n")
            self._last_progress_ts = ts
        elif kind == "heartbeat":
            # Until phase or step events arrive (a group node without global rank 0 never gets any: rank 0 writes
            # them), the latest heartbeat's phase is where the ranks are; after that the events are the truth.
            if not self._phase_events and isinstance(ev.get("phase"), str):
                v.phase = ev["phase"]
            self._last_progress_ts = ts
        elif kind == "step":
            self._phase_events = True
            v.phase = "training"
            v.phase_i = v.phase_n = None
            for key in ("step", "epoch", "loss", "lr", "tokens_per_s", "step_time_s", "queue_depth",
                        "queue_wait_s", "recompiles", "total_steps"):
                if key in ev:
                    setattr(v, key, ev[key])
            v.acc = list(ev.get("acc") or [])
            if isinstance(ev.get("step_time_s"), (int, float)) and math.isfinite(ev["step_time_s"]):
                self._step_times.append(float(ev["step_time_s"]))
            self._last_progress_ts = ts
        elif kind == "checkpoint":
            v.last_checkpoint = ev.get("path")
            self._last_progress_ts = ts
        elif kind == "error":
            v.errors.append({k: ev.get(k) for k in ("class", "message", "traceback", "fatal", "ts")})
            del v.errors[:-50]
            if ev.get("fatal"):
                self._fatal_error = True
        elif kind == "run_end":
            v.end_reason = ev.get("reason")
            v.exit_code = ev.get("exit_code")
            v.step = ev.get("step", v.step)
            self._run_end_ts = ts

    def _fold_tau(self) -> None:
        """The view's tau fields from the evaluations (not progress: the agent's status sends the best evaluation
        of an earlier attempt too, and its time says nothing about this one's heartbeat)."""
        v = self._v
        last, top = self.tau.latest(), self.tau.best()
        v.tau, v.tau_step = (last["tau"], last["step"]) if last else (None, None)
        v.ngram_tau = last["ngram_tau"] if last else None
        v.tau_ci95 = last["tau_ci95"] if last else None
        v.tau_best, v.tau_best_step = (top["tau"], top["step"]) if top else (None, None)

    # -- output --------------------------------------------------------------------------
    def stall_after(self) -> float:
        if self._stall_after is not None:
            return self._stall_after
        if self._step_times:
            return max(STALL_FLOOR_S, STALL_FACTOR * statistics.median(self._step_times))
        return STALL_FLOOR_S

    def view(self, now: float | None = None) -> RunView:
        """`now` is on the agent's clock (tests and replays pass it); by default the local clock plus the skew."""
        now = time.time() + self._clock_skew if now is None else now
        v = self._v
        v.stall_after_s = self.stall_after()
        v.heartbeat_age_s = None if self._last_progress_ts is None else max(0.0, now - self._last_progress_ts)
        if v.end_reason is not None and self._run_end_ts is not None and v.started_at is not None \
                and self._run_end_ts < v.started_at:
            v.end_reason = None  # the previous attempt's run_end: this one (restarted, resumed) has not ended
        if v.end_reason is None:  # no run_end (yet): the process's own code is all there is
            v.exit_code = v.proc_exit_code
        if v.started_at is not None:
            v.duration_s = max(0.0, (self._ended if self._ended is not None else now) - v.started_at)
        v.restart_in_s = None if self._restart_at is None else max(0.0, self._restart_at - now)
        v.state = self._derive_state(v)
        if v.state in ENDED_STATES:
            v.heartbeat_age_s = None  # nothing beats after the end: an age growing for days said nothing
        v.reason = self._reason(v)
        v.eta_s = self.eta.eta(v.step, v.total_steps) if v.step and v.state == "training" else None
        v.tokens_per_s_avg = self.eta.tokens_per_s() if v.tokens_per_s is not None else None
        return v

    def _reason(self, v: RunView) -> str | None:
        if v.state == "unreachable":
            return v.link_error
        parts: list[str] = []
        if v.state == "restarting":
            what = v.exception or (f"exit {v.proc_exit_code}" if v.proc_exit_code is not None else "crashed")
            parts.append(f"restart {v.restart_n}/{v.restart_max} in {v.restart_in_s or 0:.0f} s after {what}")
        if v.state in ("crashed", "refused"):
            fatal = next((e for e in reversed(v.errors) if e.get("fatal")), None)
            what = v.exception or (f"{fatal.get('class')}: {fatal.get('message')}" if fatal else None)
            if v.state == "refused" and fatal:
                what = fatal.get("message")  # the refusal's own words: its class says nothing more
            code = v.exit_code if v.exit_code is not None else v.proc_exit_code
            parts.append(f"{what} (exit {code})" if what else f"exit {code}")
        lost = self._restart_lost
        if lost is not None and v.state == "crashed":
            parts.append(f"restart {lost.get('n')}/{lost.get('max')} never started: the run's wrapper died during "
                         "its back-off (opsctl launch starts it, with the resume arguments)")
        if v.state == "killed" and self._signal and not self.killed_by_us:
            parts.append(f"by {self._signal} from outside opsctl")
        if v.leftover_pids and v.state in ("finished", "crashed", "killed", "refused"):
            parts.append("leftover processes: PID " + ", ".join(str(p) for p in v.leftover_pids))
        return "; ".join(parts) or None

    def _derive_state(self, v: RunView) -> str:
        alive = v.proc_state == "running"
        if v.proc_state == "restarting":
            return "restarting"
        if v.end_reason is not None:
            if v.end_reason == "error":
                # An error that ended the run after the kill was asked for is the kill's doing (a rank whose peer was
                # signalled first fails its collective): killed. One before it was a crash the kill only cleaned up.
                killed_first = self._killed_at is not None and self._run_end_ts is not None \
                    and self._run_end_ts >= self._killed_at - 0.5
                return "killed" if self.killed_by_us and killed_first else "crashed"
            if self.killed_by_us and v.end_reason == "signal":
                return "killed"
            if v.end_reason == "refused":
                return "refused"
            return "finished" if (v.exit_code in (0, None)) else "crashed"
        if v.proc_state == "exited":
            if self.killed_by_us or self._signal:
                return "killed"
            if v.proc_exit_code == 2 and (v.exception or "").startswith("dflash"):
                return "refused"  # a dflash command refused its config, data or arguments: the wrapper's rule
            return "crashed" if (self._fatal_error or v.exit_code not in (0,)) or self._saw_run_start else "finished"
        if self._fatal_error and not alive:
            return "crashed"
        if v.proc_state in (None, "absent") and not self._saw_run_start:
            return "absent"
        if v.heartbeat_age_s is not None and v.heartbeat_age_s > self.stall_after():
            return "stalled"
        if not self._saw_run_start:
            return "starting"
        if v.phase in LOADING_PHASES or v.phase is None:
            return "loading"
        if v.phase == "compiling":
            return "compiling"
        return "training"
