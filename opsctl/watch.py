"""The UI-free watch layer: the sources `opsctl watch` follows, the one resume-and-reconnect loop, RunModel per run.

tui.py (Textual) and plain.py (--plain / --once) only draw what this module knows; it imports no UI library.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import random
import re
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from opsctl.alerts import Alert, AlertTracker
from opsctl.channel import run_args, stream_agent
from opsctl.config import HostConfig, RunConfig
from opsctl.group import rankless, verdict
from opsctl.runstate import RunState, RunView
from opsctl.transport import Completed, PermanentTransportError, Stream, Transport

DEFAULT_LOG_CAPACITY = 10_000  # lines kept per run for scroll-back and search
DEFAULT_INBOX_LINES = 50_000  # log lines a worker may queue before the UI drains them; more are dropped (and counted)
DEFAULT_INBOX_OTHER = 20_000  # non-log messages likewise
HISTORY = 120  # points kept per GPU sparkline (the charts keep the whole run: RunSeries)
UNREACHABLE_AFTER_S = 20.0  # a host that has not answered a connect this long is shown unreachable
STATE_TYPES = frozenset({"event", "bad_event", "proc", "gpu", "hello", "killed"})
RECONNECT_BASE_S = 0.2  # first wait before reconnecting a lost link (doubling, with jitter)
RECONNECT_CAP_S = 10.0  # the longest wait between two reconnect attempts
SEV_INFO, SEV_WARNING, SEV_ERROR = 0, 1, 2
FULL_HISTORY_ENV = "OPSCTL_WATCH_FULL_HISTORY"  # =1: watch asks for every step event of the backlog (benchmarks)

_ERROR_RE = re.compile(
    r"Traceback|\bERROR\b|Error\b|Exception\b|out of memory|\bOOM\b|FATAL|CRITICAL|NCCL (WARN|ERROR)|Segmentation fault"
)
_WARN_RE = re.compile(r"\bWARN(ING)?\b|[Ww]arning\b")
# Substrings every error/warning match contains: `in` tests are ~20x cheaper than the regexes on ordinary lines.
_ERROR_HINTS = ("rror", "xception", "OOM", "out of memory", "FATAL", "CRITICAL", "NCCL", "Traceback", "Segmentation")
_WARN_HINTS = ("WARN", "arning")
# The retry part of a link message's detail: `... (retry in 0.4 s)`, `... (not retried: ...; r: try again)`.
_WHEN_RE = re.compile(r"\s*\(((?:retry in|not retried)[^()]*)\)\s*$")


@dataclass(slots=True)
class LogLine:
    """One human log line as kept in a run's ring buffer; `seq` counts every line ever received for the run."""

    seq: int
    text: str
    sev: int


class SeverityClassifier:
    """Tags log lines by severity; lines inside a traceback inherit `error` so a filter keeps the whole traceback."""

    def __init__(self) -> None:
        self._in_traceback = False

    def __call__(self, line: str) -> int:
        if self._in_traceback:
            if line.startswith((" ", "\t")) or not line:
                return SEV_ERROR
            self._in_traceback = False
            return SEV_ERROR  # the exception line itself
        if line.startswith("Traceback (most recent call last)"):
            self._in_traceback = True
            return SEV_ERROR
        if any(h in line for h in _ERROR_HINTS) and _ERROR_RE.search(line):
            return SEV_ERROR
        if any(h in line for h in _WARN_HINTS) and _WARN_RE.search(line):
            return SEV_WARNING
        return SEV_INFO


# -- one record per run: `status --json` and `watch --once --json` ------------------------------------------------
RECORD_EXTRAS = ("link", "alerts", "session", "session_exists", "log", "log_lines", "dropped_lines")


def run_record(host: str, run: str, view: RunView, *, link: str, alerts: Sequence[Alert],
               session: str | None = None, session_exists: bool | None = None, log: str | None = None,
               log_lines: int | None = None, dropped_lines: int | None = None) -> dict[str, Any]:
    """The one JSON object per run that `status --json` and `watch --once --json` print (docs/cli-json.md):
    host, run, every RunView field, then what the printing verb knows (null where it cannot know it)."""
    return {"host": host, "run": run, **view.to_dict(), "link": link, "alerts": [a.to_dict() for a in alerts],
            "session": session, "session_exists": session_exists, "log": log, "log_lines": log_lines,
            "dropped_lines": dropped_lines}


def state_label(view: RunView | dict[str, Any]) -> str:
    """`restarting (2/3)` while the wrapper waits to start restart 2 of at most 3; else the state itself."""
    d = view if isinstance(view, dict) else view.to_dict()
    state = str(d.get("state") or "absent")
    if state != "restarting":
        return state
    n, most = d.get("restart_n"), d.get("restart_max")
    return f"restarting ({n}/{most})" if n is not None and most is not None else state


def bad_events_text(n: int) -> str:
    """`2 bad event lines skipped`: events lines that break the contract (RunState counts them), said by every view."""
    return f"{n} bad event line{'' if n == 1 else 's'} skipped"


def ending_text(view: RunView) -> str | None:
    """How an ended attempt ended, one line: `run_end signal, exit code 0, at step 1,234` (None while it runs)."""
    if view.state not in ("finished", "crashed", "killed", "refused"):
        return None
    parts = [f"run_end {view.end_reason}" if view.end_reason else "process gone without run_end"]
    if view.exit_code is not None:
        parts.append(f"exit code {view.exit_code}")
    parts.append(f"at step {view.step:,}")
    return ", ".join(parts)


# Which run `opsctl watch` opens on: the one that needs someone first (lower is more urgent). A kill you asked for
# needs nobody.
ATTENTION = {"crashed": 0, "refused": 0, "stalled": 1, "unreachable": 2, "restarting": 3}
QUIET_RANK = 9  # attention_rank of a run with nothing to say (and of one whose history is still pouring in)


def attention_rank(view: RunView, alerts: Sequence[Alert]) -> int:
    if view.state in ATTENTION:
        return ATTENTION[view.state]
    if any(a.severity == "critical" for a in alerts):
        return 4
    if alerts:
        return 5
    return QUIET_RANK


def fmt_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def fmt_num(x: Any, digits: int = 3) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return "-"
    if not math.isfinite(x):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}" if abs(x) < 1e-3 and x != 0 else f"{x:.{digits}f}"


# -- following the agent across lost links ------------------------------------------------------------------
def reconnect_delay(attempt: int, rng: random.Random | None = None) -> float:
    """Exponential back-off with jitter for reconnect `attempt` (1, 2, ...): many followers of one host that
    lost its link must not all knock again in the same instant. The one back-off rule of every follower."""
    base = min(RECONNECT_CAP_S, RECONNECT_BASE_S * 2 ** (attempt - 1))
    return base * (rng or random).uniform(0.5, 1.0)


def advance_offsets(offsets: dict[str, Any], msg: dict[str, Any]) -> None:
    """Move the resume point past `msg`, so the next connection neither loses nor repeats a line.

    Only the first connection asks for history (`tail`, `all_logs`); every later one resumes at the offsets."""
    offsets.pop("tail", None)
    offsets.pop("all_logs", None)
    kind = msg.get("t")
    if kind == "log":
        offsets["log_offset"] = msg["end"]
    elif kind in ("event", "bad_event"):
        offsets["events_offset"] = msg["end"]
    elif kind == "log_reset":
        offsets["events_offset" if msg.get("file") == "events" else "log_offset"] = 0


def follow_connection(transport: Transport, host: HostConfig, run: RunConfig, offsets: dict[str, Any],
                      **options: Any) -> Iterator[dict[str, Any]]:
    """One connection of the agent's `follow` from `offsets`, which every message advances in place."""
    args = run_args(run, log_offset=offsets["log_offset"], events_offset=offsets["events_offset"],
                    tail=offsets.get("tail", 0), **options)
    for msg in stream_agent(transport, host, "follow", args):
        advance_offsets(offsets, msg)
        yield msg


def reconnecting(connect: Callable[[int], Iterable[dict[str, Any]]], lost: Callable[[Exception, int], None],
                 retry_on: tuple[type[Exception], ...], attempt: int = 0) -> Iterator[dict[str, Any]]:
    """Messages of successive connections until `bye` or a connection's normal end: the one reconnect loop.

    `connect(attempt)` opens a connection (`attempt`: failed tries since the link last delivered a message, 0 at
    first). A `retry_on` error from it calls `lost(exc, attempt)`, which waits (or raises to give up), then the
    loop connects again; any other error propagates."""
    while True:
        try:
            with closing(iter(connect(attempt))) as stream:  # type: ignore[type-var]
                for msg in stream:
                    attempt = 0
                    yield msg
                    if msg.get("t") == "bye":
                        return
            return
        except retry_on as exc:
            attempt += 1
            lost(exc, attempt)


@runtime_checkable
class WatchSource(Protocol):
    """One run on one host, as the dashboard consumes it (the agent's `follow` stream, or a recording)."""

    label: str  # "host:run"

    def messages(self) -> Iterator[dict[str, Any]]:
        """Blocking iterator of agent messages (docs/agent-protocol.md); raises or ends when the link is lost."""
        ...

    def kill(self) -> None: ...

    def clean(self) -> None: ...

    def reconnect(self) -> None:
        """Re-establish the link; the next `messages()` resumes after the last offsets seen."""
        ...

    # Optional attributes: `finite = True`: the stream's normal end is final (a recording); without it, an end is
    # a lost link and is retried with back-off, like an exception from `messages()`. `stall_after_s`: the run's
    # configured stall threshold (hosts.yaml `stall_after`; the agent source's `run.stall_after` also works).


@dataclass(frozen=True)
class GroupTag:
    """The group run a source is one node of (`watch GROUP[:RUN]` tags its node sources), so the dashboard can
    say the group's own state next to each node's."""

    group: str
    run: str
    node: int
    nodes: int

    @property
    def name(self) -> str:
        return f"{self.group}/{self.run}"


def node_view(tag: GroupTag | None, view: RunView) -> RunView:
    """A group node's view with the state its ranks report: a node without global rank 0 never sees run_start or
    phase events, so while its process runs its heartbeats' phase is its state, not `starting` (as in status)."""
    if tag is None or tag.node == 0 or view.state != "starting":
        return view
    state = rankless({"node": tag.node, "state": view.state, "proc_state": view.proc_state, "phase": view.phase})
    return view if state["state"] == view.state else dataclasses.replace(view, state=state["state"])


def group_infos(tags: Sequence[GroupTag | None], records: Sequence[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """Per source, its group run's own state from every watched node of that run (None: no group's node): the
    `group` object of `status --json` (`name`, `run`, `state`, `reason`, `node`, `nodes`; training only when every
    node trains, crashed naming the node that died first). `records`: per source, its RunView as a dict plus
    `host`."""
    members: dict[tuple[str, str], list[int]] = {}
    for i, tag in enumerate(tags):
        if tag is not None:
            members.setdefault((tag.group, tag.run), []).append(i)
    infos: dict[tuple[str, str], dict[str, Any]] = {}
    for key, idx in members.items():
        idx = sorted(idx, key=lambda i: tags[i].node)  # type: ignore[union-attr]
        rows = [rankless({**records[i], "node": tags[i].node}) for i in idx]  # type: ignore[union-attr]
        state, why, node = verdict(rows)
        first = tags[idx[0]]
        assert first is not None
        infos[key] = {"name": first.group, "run": first.run, "state": state, "reason": why, "node": node,
                      "nodes": first.nodes, "watched": len(idx)}
    return [None if t is None else infos[(t.group, t.run)] for t in tags]


def stall_after_of(source: WatchSource) -> float | None:
    """The run's configured stall threshold, if its source knows one (else RunState's default rule applies)."""
    value = getattr(source, "stall_after_s", None)
    if value is None:
        value = getattr(getattr(source, "run", None), "stall_after", None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def tau_drop_of(source: WatchSource) -> Any:
    """The run's configured tau_regression thresholds, if its source knows its run (else the defaults apply)."""
    return getattr(getattr(source, "run", None), "tau_regression", None)


class RecordedSource:
    """Replays a recorded agent stream (JSON lines), as fast as possible or paced by its `ts` fields.

    It has no process behind it: kill/clean/reconnect are recorded in `actions` so tests can check what was asked.
    """

    finite = True  # its end is the end of the recording, not a lost link

    def __init__(self, path: str | Path, label: str | None = None, speed: float | None = None,
                 sleep: Callable[[float], None] = time.sleep, group: GroupTag | None = None) -> None:
        self.path = Path(path)
        self.group = group
        if not self.path.is_file():
            raise FileNotFoundError(f"recorded stream not found: {self.path}")
        self.label = label or self.path.stem
        if speed is not None and speed <= 0:
            raise ValueError(f"speed must be > 0 (or None for as fast as possible), got {speed}")
        self.speed = speed
        self._sleep = sleep
        self.actions: list[str] = []
        self.invalid_lines = 0

    def messages(self) -> Iterator[dict[str, Any]]:
        first_ts: float | None = None
        started = time.monotonic()
        with self.path.open(encoding="utf-8") as fh:
            for raw in fh:
                if not raw.strip():
                    continue
                try:
                    msg = json.loads(raw)
                except json.JSONDecodeError:
                    self.invalid_lines += 1
                    continue
                if not isinstance(msg, dict):
                    self.invalid_lines += 1
                    continue
                ts = msg.get("ts")
                if self.speed is not None and isinstance(ts, (int, float)):
                    if first_ts is None:
                        first_ts = float(ts)
                    delay = (float(ts) - first_ts) / self.speed - (time.monotonic() - started)
                    if delay > 0:
                        self._sleep(delay)
                yield msg

    def kill(self) -> None:
        self.actions.append("kill")

    def clean(self) -> None:
        self.actions.append("clean")

    def reconnect(self) -> None:
        self.actions.append("reconnect")


def record(source: WatchSource, path: str | Path, max_seconds: float, max_messages: int | None = None) -> int:
    """Save a live source's stream as JSON lines, in arrival order (a fixture for RecordedSource).

    Stops after `max_seconds` of wall time, `max_messages`, or when the stream ends or fails; returns the count.
    """
    if max_seconds <= 0:
        raise ValueError(f"max_seconds must be > 0, got {max_seconds}")
    got: list[dict[str, Any]] = []
    lock = threading.Lock()
    done = threading.Event()

    def pump() -> None:
        try:
            for msg in source.messages():
                with lock:
                    got.append(msg)
                if done.is_set() or (max_messages is not None and len(got) >= max_messages):
                    break
        finally:
            done.set()

    threading.Thread(target=pump, name=f"record:{source.label}", daemon=True).start()
    done.wait(max_seconds)
    done.set()
    with lock:
        msgs = got[:max_messages] if max_messages is not None else list(got)
    with Path(path).open("w", encoding="utf-8") as fh:
        for m in msgs:
            fh.write(json.dumps(m, separators=(",", ":")) + "\n")
    return len(msgs)


def link_msg(state: str, detail: str = "") -> dict[str, Any]:
    """The watcher's own message about the link (not from the agent): up / lost / reconnecting / ended."""
    return {"t": "link", "state": state, "detail": detail, "local_ts": time.time()}


class _Stopped(Exception):
    """The worker was stopped while waiting to reconnect."""


class _Permanent(Exception):
    """The link failed in a way retrying cannot mend (host key unknown or changed, authentication refused)."""


def permanent_link_error(exc: Exception, connected_once: bool) -> bool:
    """What every follower gives up on at once (logs -f and launch --follow exit 3 on it): host key and
    authentication failures; a host name that does not resolve only before the link ever worked (afterwards it
    may be a resolver outage). Connection refused, timeouts and a dropped link are retried."""
    return isinstance(exc, PermanentTransportError) and (exc.kind != "dns" or not connected_once)


class SourceWorker:
    """Follows one source on a daemon thread and queues its messages for the UI thread, bounded and counted.

    Link loss is retried with back-off (or at once on `request_reconnect`); a normal end waits for a manual reconnect,
    and so does a permanent error (permanent_link_error: said once as link `failed`, never retried by itself).
    """

    def __init__(self, source: WatchSource, inbox_lines: int = DEFAULT_INBOX_LINES,
                 inbox_other: int = DEFAULT_INBOX_OTHER, backoff: Sequence[float] | None = None) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._logs: deque[dict[str, Any]] = deque(maxlen=inbox_lines)
        self._other: deque[dict[str, Any]] = deque(maxlen=inbox_other)
        self._dropped = 0
        self._backoff = tuple(backoff or ())  # waits per attempt (tests); empty: reconnect_delay, like every follower
        self._finite = bool(getattr(source, "finite", False))  # a recording ends for good, a live follow never
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.received = 0
        self.ended = threading.Event()  # set while the stream has ended normally (until a reconnect)
        self.connected_once = False  # an agent message ever came through this worker's link
        self.caught_up = threading.Event()  # the agent said `backlog_end`: all it had at connect time is queued
        self._up_at: float | None = None  # monotonic time the link first came up; -inf once it went down (settling)
        self.last_agent_msg: float | None = None  # monotonic time of the last message from the host (not `link`)
        self._thread = threading.Thread(target=self._run, name=f"watch:{source.label}", daemon=True)

    def start(self) -> SourceWorker:
        """Start following (once: a worker already started, as `opsctl watch` starts them before Textual loads so
        the SSH handshake and the agent's backlog overlap the dashboard's own start-up, is left as it is)."""
        if not self.started:
            self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    SETTLE_MAX_S = 30.0  # a backlog not in after this long (an agent stuck mid-way) is judged as it stands

    def settling(self) -> bool:
        """Its history is still pouring in: the link up, but neither `backlog_end` nor the end of the stream yet.

        Until then the run's state is that of a past moment (a week-old heartbeat reads as a stall against now), so
        the dashboard neither rings nor jumps to it for what it shows. A link lost mid-backlog, or a backlog still
        not in after SETTLE_MAX_S, ends the wait: that is news. Read it before folding: everything queued before the
        flag was set is folded by that fold."""
        up_at = self._up_at
        return (up_at is not None and not (self.caught_up.is_set() or self.ended.is_set())
                and time.monotonic() - up_at < self.SETTLE_MAX_S)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def request_reconnect(self) -> None:
        self._wake.set()

    def _put(self, msg: dict[str, Any]) -> None:
        with self._lock:
            box = self._logs if msg.get("t") == "log" else self._other
            if len(box) == box.maxlen:
                self._dropped += 1
            box.append(msg)
            self.received += 1
        if msg.get("t") != "link":
            self.last_agent_msg = time.monotonic()
        elif msg.get("state") == "up":
            self._up_at = time.monotonic() if self._up_at is None else self._up_at
        else:  # lost, reconnecting, failed, ended: no longer a backlog pouring in (settling)
            self._up_at = float("-inf")
        if msg.get("t") == "backlog_end":
            self.caught_up.set()

    def drain(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        """(non-log messages, log messages, drops since the last drain), emptying the inbox."""
        with self._lock:
            other, logs, dropped = list(self._other), list(self._logs), self._dropped
            self._other.clear()
            self._logs.clear()
            self._dropped = 0
        return other, logs, dropped

    def _delay(self, attempt: int) -> float:
        if not self._backoff:
            return reconnect_delay(attempt)
        return self._backoff[min(attempt - 1, len(self._backoff) - 1)]

    def _connection(self, attempt: int) -> Iterator[dict[str, Any]]:
        """One connection as the UI sees it: `reconnecting` before a retry, `up` at its first message; the end of
        a live stream (its channel closed) is a lost link, the end of a recording is final."""
        if attempt:
            self._put(link_msg("reconnecting", f"attempt {attempt}"))
            self.source.reconnect()
        announced = False
        for msg in self.source.messages():
            if self._stop.is_set():
                return
            if not announced:
                self._put(link_msg("up"))
                announced = self.connected_once = True
            yield msg
        if not self._finite and not self._stop.is_set():
            raise ConnectionError("stream closed")

    def _lost(self, exc: Exception, attempt: int) -> None:
        if permanent_link_error(exc, self.connected_once):
            self._put(link_msg("failed", f"{exc} (not retried: it needs a person; r: try again)"))
            raise _Permanent
        delay = self._delay(attempt)
        self._put(link_msg("lost", f"{type(exc).__name__}: {exc} (retry in {delay:.3g} s)"))
        self._wake.wait(delay)  # `request_reconnect` cuts the wait short
        self._wake.clear()
        if self._stop.is_set():
            raise _Stopped

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            try:
                # the transport's errors are many; every one means the link is gone
                for msg in reconnecting(self._connection, self._lost, retry_on=(Exception,), attempt=attempt):
                    self._put(msg)
            except _Stopped:
                return
            except _Permanent:
                permanent = True
            else:
                permanent = False
            if self._stop.is_set():
                return
            if not permanent:
                self._put(link_msg("ended", "r: reconnect"))
            self.ended.set()
            self._wake.wait()
            self._wake.clear()
            self.ended.clear()
            attempt = 1

    def pending(self) -> int:
        with self._lock:
            return len(self._logs) + len(self._other)


class RunSeries:
    """One metric over the whole run as (step, value) points, for the charts: loaded from the events backlog on
    connect and kept across reconnects and restarts. It keeps the points whose step is a multiple of `stride`, the
    run's first point and its newest; once more than `capacity` - 2 are multiples, the stride doubles (and the points
    off it go), so a week of steps stays a few thousand points spanning it all.

    What it keeps depends on the steps present, never on the order or the company they came in: a backlog thinned by
    the agent to every S-th step (opsctl/remote/thin.py HistoryThinner, `thin` message: `raise_stride(S)`) leaves
    exactly the points a read of every step leaves, so the charts of a week-long run are the same either way.

    A resumed attempt starts again at `resumed_from + 1`: the points of the crashed attempt from there on go, as
    TensorBoard drops them, so the curve never has two values for one step."""

    def __init__(self, capacity: int = 4000) -> None:
        if capacity < 4:
            raise ValueError(f"capacity must be >= 4, got {capacity}")
        self.capacity = capacity
        self.steps: list[int] = []
        self.values: list[float] = []
        self.stride = 1
        self._aligned = 0  # points whose step is a multiple of the stride

    def __len__(self) -> int:
        return len(self.steps)

    def truncate_after(self, step: int) -> None:
        """Forget points past `step` (a resume from the checkpoint at `step`)."""
        cut = bisect.bisect_right(self.steps, step)
        del self.steps[cut:]
        del self.values[cut:]
        self._aligned = sum(1 for s in self.steps if s % self.stride == 0)

    def add(self, step: int, value: float) -> None:
        if self.steps and step <= self.steps[-1]:
            self.truncate_after(step - 1)  # a step seen again: the newer attempt's value wins
        if len(self.steps) >= 2 and self.steps[-1] % self.stride:
            del self.steps[-1]  # the newest point off the stride: this one is newer
            del self.values[-1]
        self.steps.append(step)
        self.values.append(value)
        self._aligned += step % self.stride == 0
        while self._aligned > self.capacity - 2:
            self.raise_stride(self.stride * 2)

    def raise_stride(self, stride: int) -> None:
        """Keep from now on only the steps that are multiples of `stride` (a power of two at least the current one),
        besides the first and the newest point."""
        if stride <= self.stride:
            return
        self.stride = stride
        last = len(self.steps) - 1
        keep = [i for i, s in enumerate(self.steps) if i in (0, last) or s % stride == 0]
        self.steps = [self.steps[i] for i in keep]
        self.values = [self.values[i] for i in keep]
        self._aligned = sum(1 for s in self.steps if s % stride == 0)


CHART_KEYS = ("loss", "tokens_per_s", "step_time_s", "queue_depth")
EVAL_KEYS = ("tau", "ngram_tau")  # from `eval` events, at the step evaluated (the τ chart)


def tau_text(view: RunView) -> str | None:
    """`3.41 at step 4,000 (best 3.70 at step 2,000; n-gram 1.88)`: the run's τ in one line, None before any eval."""
    if view.tau_step is None:
        return None
    text = f"{fmt_num(view.tau, 2)} at step {view.tau_step:,}"
    extra = []
    if view.tau_best_step is not None and view.tau_best_step != view.tau_step:
        extra.append(f"best {fmt_num(view.tau_best, 2)} at step {view.tau_best_step:,}")
    if view.ngram_tau is not None:
        extra.append(f"n-gram {fmt_num(view.ngram_tau, 2)}")
    return text + (f" ({'; '.join(extra)})" if extra else "")


class RunModel:
    """Everything shown about one run, folded on the UI thread from its source's messages."""

    def __init__(self, label: str, clock: Callable[[], float] | None = None,
                 log_capacity: int = DEFAULT_LOG_CAPACITY, history: int = HISTORY,
                 stall_after_s: float | None = None, tau_drop: Any = None) -> None:
        self.label = label
        self.clock = clock  # None: live (local clock + agent skew); tests and replays pass the agent's clock
        self.state = RunState(stall_after_s=stall_after_s)
        self.tracker = AlertTracker(tau_drop)
        self.log: deque[LogLine] = deque(maxlen=log_capacity)
        self.lines_total = 0
        self.dropped = 0
        self._classify = SeverityClassifier()
        # the whole run, for the charts
        self.series: dict[str, RunSeries] = {k: RunSeries() for k in CHART_KEYS + EVAL_KEYS}
        self.gpu_hist: dict[int, dict[str, deque[float]]] = {}
        # Where one attempt ended or the next resumed, as (step, "resumed" | run_end's reason), for the charts: a
        # kill and its resume leave a mark on the curve instead of a seam nobody can see.
        self.attempt_marks: list[tuple[int, str]] = []
        self._history = history
        self.link = "connecting"
        self._link_short = "connecting"  # the link's state and when it is tried again, without the error
        self._born = time.monotonic()
        self.state_seen = False  # any agent message ever (a recording's end keeps what it showed)
        self.heard = False  # an agent message arrived since the link was last lost (else: unreachable)
        self.link_error: str | None = None
        self.version = 0  # any change
        self.chart_version = 0  # a step arrived
        self.gpu_version = 0  # a GPU sample arrived

    def ingest(self, msg: dict[str, Any]) -> None:
        t = msg.get("t")
        self.version += 1
        if t == "log":
            line = str(msg.get("line", ""))
            self.log.append(LogLine(self.lines_total, line, self._classify(line)))
            self.lines_total += 1
            self.tracker.observe_log(line)
            return
        if t != "link":
            self.heard = self.state_seen = True
        if t in STATE_TYPES and not self.state.apply(msg):
            return  # an events line that breaks the contract: counted by the state, seen by nothing else
        self.tracker.observe(msg)
        if t == "event":
            ev = msg.get("event") or {}
            kind = ev.get("kind")
            if kind == "step" and isinstance(ev.get("step"), int):
                self.chart_version += 1
                for key, series in self.series.items():
                    value = ev.get(key)
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        series.add(ev["step"], float(value))
            elif kind == "eval" and isinstance(ev.get("step"), int):
                self.chart_version += 1
                for key in EVAL_KEYS:
                    value = ev.get(key)
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                        self.series[key].add(ev["step"], float(value))
            elif kind == "run_start":
                resumed = ev.get("resumed_from")
                for series in self.series.values():  # a resume continues the curve, a fresh start begins one
                    series.truncate_after(resumed if isinstance(resumed, int) else -1)
                self._mark_attempt(resumed if isinstance(resumed, int) else None, "resumed")
                self.chart_version += 1
            elif kind == "run_end" and ev.get("reason") in ("signal", "error") and isinstance(ev.get("step"), int):
                self._mark_attempt(ev["step"], str(ev["reason"]))
                self.chart_version += 1
        elif t == "gpu":
            self.gpu_version += 1
            for g in msg.get("gpus") or []:
                idx = g.get("index")
                if not isinstance(idx, int):
                    continue
                hist = self.gpu_hist.setdefault(idx, {k: deque(maxlen=self._history)
                                                      for k in ("util", "mem_used_mb", "power_w", "temp_c")})
                for key, series in hist.items():
                    value = g.get(key)
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        series.append(float(value))
        elif t == "link":
            detail = msg.get("detail")
            self.link = str(msg.get("state")) + (f" ({detail})" if detail else "")
            when = _WHEN_RE.search(str(detail or ""))
            self._link_short = str(msg.get("state")) + (f" ({when.group(1)})" if when else "")
            if msg.get("state") in ("lost", "failed"):  # failed: a permanent error, not retried
                self.heard = False
                self.link_error = str(detail or "link lost")
        elif t == "thin":  # the backlog comes thinned to every `stride`-th step: the step charts keep no finer
            stride = msg.get("stride")
            if isinstance(stride, int) and not isinstance(stride, bool) and stride > 1:
                for key in CHART_KEYS:
                    self.series[key].raise_stride(stride)
                self.chart_version += 1
        elif t == "log_reset":
            if msg.get("file") == "events":  # a fresh run truncated events.jsonl: its curves start over
                for series in self.series.values():
                    series.truncate_after(-1)
                self.attempt_marks.clear()
                self.chart_version += 1
                return
            self.log.append(LogLine(self.lines_total, f"--- log {msg.get('reason', 'reset')} ---", 1))
            self.lines_total += 1

    def _mark_attempt(self, step: int | None, what: str) -> None:
        """An attempt boundary at `step` (None: a fresh start, whose curve begins again without marks). Marks past a
        resume's checkpoint go with the points they stood on; one mark per step, the newest."""
        if step is None:
            self.attempt_marks.clear()
            return
        cut = step if what == "resumed" else step - 1
        self.attempt_marks = [(s, w) for s, w in self.attempt_marks if s <= cut and s != step]
        self.attempt_marks.append((step, what))

    def ingest_logs(self, msgs: list[dict[str, Any]]) -> None:
        """The hot path (a chatty run sends tens of thousands of lines a second): `ingest` for log messages only."""
        if not msgs:
            return
        append, classify, observe = self.log.append, self._classify, self.tracker.observe_log
        n = self.lines_total
        for msg in msgs:
            line = str(msg.get("line", ""))
            append(LogLine(n, line, classify(line)))
            observe(line)
            n += 1
        self.lines_total = n
        self.version += 1

    def add_dropped(self, n: int) -> None:
        if n:
            self.dropped += n
            self.version += 1

    def view(self) -> RunView:
        view = self.state.view(self.clock() if self.clock is not None else None)
        if not self.heard and self.link_error is None and time.monotonic() - self._born > UNREACHABLE_AFTER_S:
            self.link_error = f"no answer for {UNREACHABLE_AFTER_S:g} s ({self.link})"  # a connect that hangs
        if not self.heard and self.link_error is not None:
            # The host did not answer since the link was lost: say so, never `absent` ("reached, no such run").
            reason = self.link_error
            if not self.state_seen:  # never reached at all: one line that says so (alerts() drops the link alert)
                reason = f"cannot connect to {self.label.partition(':')[0]}: {_WHEN_RE.sub('', reason).strip()}"
            view = dataclasses.replace(view, state="unreachable", link_error=self.link_error, reason=reason)
        elif not self.heard and not self.state_seen:
            view = dataclasses.replace(view, state="connecting")  # not `absent`: nobody has answered yet
        return view

    def mark_unreachable(self, error: str) -> None:
        """No answer at all (e.g. `--once` gave up while still connecting): unreachable, with why."""
        if not self.heard and self.link_error is None:
            self.link_error = error
            self.version += 1

    def link_text(self) -> str:
        """The link as the summary shows it: for a host never reached, its state and next try only (the error is the
        view's reason, `cannot connect to HOST: ...`, said once); else the state with its detail."""
        return self._link_short if not self.state_seen and self.link_error is not None else self.link

    def alerts(self, view: RunView) -> list[Alert]:
        alerts = self.tracker.evaluate(view, self.clock() if self.clock is not None else time.time())
        if not self.state_seen and view.state == "unreachable":  # the state and its reason already say it, once
            alerts = [a for a in alerts if a.key != "link"]
        return alerts

    def mark_killed(self) -> None:
        """The kill came from us: a `run_end` by signal (or the process gone) now reads as killed, not crashed."""
        self.state.killed_by_us = True
        self.version += 1

    def snapshot(self, log: str | None = None) -> dict[str, Any]:
        """This run as `watch --once --json` prints it: the `status --json` record (docs/cli-json.md)."""
        view = self.view()
        host, _, run = self.label.partition(":")
        return run_record(host, run or host, view, link="up" if self.heard else "unreachable",
                          alerts=self.alerts(view), log=log, log_lines=self.lines_total, dropped_lines=self.dropped)


def fold(workers: Sequence[SourceWorker], models: Sequence[RunModel]) -> list[bool]:
    """Fold every queued message into its run (the dashboard, --plain and --once); per run: was there any."""
    got = []
    for worker, model in zip(workers, models, strict=True):
        other, logs, dropped = worker.drain()
        for msg in other:
            model.ingest(msg)
        model.ingest_logs(logs)
        model.add_dropped(dropped)
        got.append(bool(other or logs or dropped))
    return got


class _Asking:
    """A transport that sets `asked` once its stream's command went out (AgentSource.asked); the rest is the
    transport's own."""

    def __init__(self, inner: Transport, asked: threading.Event) -> None:
        self._inner = inner
        self._asked = asked

    def stream(self, argv: list[str], stdin_data: bytes = b"") -> Stream:
        try:
            return self._inner.stream(argv, stdin_data)
        finally:
            self._asked.set()

    def argv_for(self, argv: list[str]) -> list[str] | str:
        return self._inner.argv_for(argv)

    def run(self, argv: list[str], input: bytes | None = None, timeout: float | None = None) -> Completed:
        return self._inner.run(argv, input=input, timeout=timeout)

    def preflight(self) -> str | None:
        return self._inner.preflight()

    def close(self) -> None:
        self._inner.close()


class AgentSource:
    """One run followed through the agent, as `opsctl watch` consumes it (a WatchSource).

    `messages()` is one connection: it ends, or raises TransportError, when the link is lost; the next call
    resumes at the last offsets seen, so the dashboard neither loses nor repeats a line across reconnects.
    `kill` / `clean` are the verbs' own paths (commands.watch_sources passes them): output and exit code land in
    `last_output` / `last_rc`, never on the terminal a full-screen UI owns."""

    def __init__(self, host: HostConfig, run: RunConfig, connect: Callable[[HostConfig], Transport],
                 kill: Callable[[], tuple[int, str]], clean: Callable[[], tuple[int, str]], tail: int = 200,
                 group: GroupTag | None = None) -> None:
        self.host = host
        self.group = group  # a node of this group run (`watch GROUP[:RUN]`)
        self.run = run
        self.label = f"{host.name}:{run.name}"
        self.offsets: dict[str, Any] = {"log_offset": -1, "events_offset": 0, "tail": tail}
        self.last_output = ""
        self.last_rc: int | None = None
        self._connect = connect
        self._kill = kill
        self._clean = clean
        # Set once the first connection's agent was started (its command sent) or the attempt failed: what the
        # dashboard waits for, briefly, before it loads Textual (tui.watch_main), so the handshake does not share
        # the interpreter with Textual's import and the remote start-up overlaps it instead.
        self.asked = threading.Event()

    def messages(self) -> Iterator[dict[str, Any]]:
        try:
            transport = _Asking(self._connect(self.host), self.asked)
        except BaseException:
            self.asked.set()  # no transport at all: nothing to wait for
            raise
        try:
            # thin_history: a week of step events arrives as the few thousand the charts keep (remote/thin.py's
            # HistoryThinner), so the dashboard and --once draw in a second, not after folding 200,000 events
            yield from follow_connection(transport, self.host, self.run, self.offsets, gpu_interval=1.0,
                                         until_exit=False, thin_history=os.environ.get(FULL_HISTORY_ENV) != "1")
        finally:
            self.asked.set()
            transport.close()

    def kill(self) -> None:
        """The same path as `opsctl kill`."""
        self.last_rc, self.last_output = self._kill()

    def clean(self) -> None:
        self.last_rc, self.last_output = self._clean()

    def reconnect(self) -> None:
        pass  # every messages() call opens a fresh connection from the saved offsets


# Where the dashboard saves screenshots (ctrl+s): here, not in the Textual module, so nothing imports Textual for it.
SCREENSHOT_ENV = "OPSCTL_SCREENSHOT_DIR"


def screenshot_dir(explicit: str | None = None) -> Path:
    """Where screenshots go: the given dir, $OPSCTL_SCREENSHOT_DIR, ~/Downloads when it exists and is writable,
    else $XDG_STATE_HOME/opsctl/screenshots (~/.local/state/...), else the temp dir; created when missing."""
    candidates: list[Path] = []
    for value in (explicit, os.environ.get(SCREENSHOT_ENV)):
        if value:
            candidates.append(Path(value).expanduser())
    downloads = Path.home() / "Downloads"
    if downloads.is_dir() and os.access(downloads, os.W_OK):
        candidates.append(downloads)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    candidates += [Path(state) / "opsctl" / "screenshots", Path(tempfile.gettempdir())]
    for place in candidates:
        try:
            place.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(place, os.W_OK):
            return place
    raise OSError(f"no writable directory among {', '.join(map(str, candidates))}")
