"""`opsctl watch`: the live Textual dashboard of one or many runs, fed by agent message streams.

Each source is followed on its own thread and handed to the UI in batches, so a dead or chatty host never freezes the rest.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Input, Static

from opsctl.alerts import CRITICAL, WARNING, Alert, AlertTracker
from opsctl.runstate import RunState, RunView
from opsctl.widgets import (
    AlertsPanel,
    Charts,
    ConfirmScreen,
    GpuPanel,
    LogLine,
    LogPane,
    RunsBar,
    RunSummary,
    SeverityClassifier,
)

DEFAULT_LOG_CAPACITY = 10_000  # lines kept per run for scroll-back and search
DEFAULT_INBOX_LINES = 50_000  # log lines a worker may queue before the UI drains them; more are dropped (and counted)
DEFAULT_INBOX_OTHER = 20_000  # non-log messages likewise
HISTORY = 120  # points kept per chart / GPU sparkline
TICK_S = 0.1
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
STATE_TYPES = frozenset({"event", "proc", "gpu", "hello", "killed"})


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


def stall_after_of(source: WatchSource) -> float | None:
    """The run's configured stall threshold, if its source knows one (else RunState's default rule applies)."""
    value = getattr(source, "stall_after_s", None)
    if value is None:
        value = getattr(getattr(source, "run", None), "stall_after", None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


class RecordedSource:
    """Replays a recorded agent stream (JSON lines), as fast as possible or paced by its `ts` fields.

    It has no process behind it: kill/clean/reconnect are recorded in `actions` so tests can check what was asked.
    """

    finite = True  # its end is the end of the recording, not a lost link

    def __init__(self, path: str | Path, label: str | None = None, speed: float | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.path = Path(path)
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


class SourceWorker:
    """Follows one source on a daemon thread and queues its messages for the UI thread, bounded and counted.

    Link loss is retried with back-off (or at once on `request_reconnect`); a normal end waits for a manual reconnect.
    """

    def __init__(self, source: WatchSource, inbox_lines: int = DEFAULT_INBOX_LINES,
                 inbox_other: int = DEFAULT_INBOX_OTHER, backoff: Sequence[float] = BACKOFF_S) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._logs: deque[dict[str, Any]] = deque(maxlen=inbox_lines)
        self._other: deque[dict[str, Any]] = deque(maxlen=inbox_other)
        self._dropped = 0
        self._backoff = tuple(backoff) or (1.0,)
        self._attempt = 0  # reconnect attempts since the link last worked
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.received = 0
        self.ended = threading.Event()  # set while the stream has ended normally (until a reconnect)
        self._thread = threading.Thread(target=self._run, name=f"watch:{source.label}", daemon=True)

    def start(self) -> SourceWorker:
        self._thread.start()
        return self

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

    def drain(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        """(non-log messages, log messages, drops since the last drain), emptying the inbox."""
        with self._lock:
            other, logs, dropped = list(self._other), list(self._logs), self._dropped
            self._other.clear()
            self._logs.clear()
            self._dropped = 0
        return other, logs, dropped

    def _follow(self) -> None:
        announced = False
        for msg in self.source.messages():
            if self._stop.is_set():
                return
            if not announced:
                self._put(link_msg("up"))
                self._attempt = 0  # the link works again: the next loss starts the back-off from the beginning
                announced = True
            self._put(msg)

    def _run(self) -> None:
        # A recording ends for good; a live follow only ends when its channel closed, which is a lost link.
        finite = bool(getattr(self.source, "finite", False))
        self._attempt = 0
        while not self._stop.is_set():
            try:
                if self._attempt:
                    self._put(link_msg("reconnecting", f"attempt {self._attempt}"))
                    self.source.reconnect()
                self._follow()
                if not finite and not self._stop.is_set():
                    raise ConnectionError("stream closed")
            except Exception as exc:  # the transport's errors are many; every one means the link is gone
                self._attempt += 1
                delay = self._backoff[min(self._attempt - 1, len(self._backoff) - 1)]
                self._put(link_msg("lost", f"{type(exc).__name__}: {exc} (retry in {delay:g} s)"))
                self._wake.wait(delay)
                self._wake.clear()
                continue
            if self._stop.is_set():
                return
            self._put(link_msg("ended", "r: reconnect"))
            self.ended.set()
            self._wake.wait()
            self._wake.clear()
            self.ended.clear()
            self._attempt = 1

    def pending(self) -> int:
        with self._lock:
            return len(self._logs) + len(self._other)


class RunModel:
    """Everything shown about one run, folded on the UI thread from its source's messages."""

    def __init__(self, label: str, clock: Callable[[], float] | None = None,
                 log_capacity: int = DEFAULT_LOG_CAPACITY, history: int = HISTORY,
                 stall_after_s: float | None = None) -> None:
        self.label = label
        self.clock = clock  # None: live (local clock + agent skew); tests and replays pass the agent's clock
        self.state = RunState(stall_after_s=stall_after_s)
        self.tracker = AlertTracker()
        self.log: deque[LogLine] = deque(maxlen=log_capacity)
        self.lines_total = 0
        self.dropped = 0
        self._classify = SeverityClassifier()
        self.series: dict[str, deque[float]] = {k: deque(maxlen=history)
                                                for k in ("loss", "tokens_per_s", "step_time_s", "queue_depth")}
        self.gpu_hist: dict[int, dict[str, deque[float]]] = {}
        self._history = history
        self.link = "connecting"
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
            self.heard = True
        if t in STATE_TYPES:
            self.state.apply(msg)
        self.tracker.observe(msg)
        if t == "event":
            ev = msg.get("event") or {}
            if ev.get("kind") == "step":
                self.chart_version += 1
                for key, series in self.series.items():
                    value = ev.get(key)
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        series.append(float(value))
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
            if msg.get("state") == "lost":
                self.heard = False
                self.link_error = str(detail or "link lost")
        elif t == "log_reset":
            self.log.append(LogLine(self.lines_total, f"--- log {msg.get('reason', 'reset')} ---", 1))
            self.lines_total += 1

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
        if not self.heard and self.link_error is not None:
            # The host did not answer since the link was lost: say so, never `absent` ("reached, no such run").
            view = dataclasses.replace(view, state="unreachable", link_error=self.link_error, reason=self.link_error)
        return view

    def mark_unreachable(self, error: str) -> None:
        """No answer at all (e.g. `--once` gave up while still connecting): unreachable, with why."""
        if not self.heard and self.link_error is None:
            self.link_error = error
            self.version += 1

    def alerts(self, view: RunView) -> list[Alert]:
        return self.tracker.evaluate(view, self.clock() if self.clock is not None else time.time())

    def mark_killed(self) -> None:
        """The kill came from us: a `run_end` by signal (or the process gone) now reads as killed, not crashed."""
        self.state.killed_by_us = True
        self.version += 1

    def snapshot(self) -> dict[str, Any]:
        view = self.view()
        return {"label": self.label, "link": self.link, "log_lines": self.lines_total, "dropped_lines": self.dropped,
                "view": view.to_dict(), "alerts": [a.to_dict() for a in self.alerts(view)]}


class WatchApp(App[int]):
    """The dashboard: a bar of every run, then the selected run's numbers, charts, GPUs, alerts and log."""

    TITLE = "opsctl watch"
    CSS = """
    RunsBar { height: 1; background: $panel; }
    #top { height: auto; }
    RunSummary { width: 46; height: auto; border: round $primary; padding: 0 1; }
    #right { width: 1fr; height: auto; }
    Charts { border: round $primary; height: 6; padding: 0 1; }
    AlertsPanel { height: auto; min-height: 6; border: round $error; padding: 0 1; }
    GpuPanel { border: round $primary; padding: 0 1; }
    LogPane { height: 1fr; min-height: 5; border: round $secondary; }
    #logstatus { height: 1; background: $panel; color: $text-muted; }
    #search { dock: bottom; display: none; }
    #search.visible { display: block; }
    """
    BINDINGS = [
        Binding("k", "kill", "kill"),
        Binding("c", "clean", "clean"),
        Binding("r", "reconnect", "reconnect"),
        Binding("tab", "next_run", "next run", priority=True),
        Binding("slash", "search", "search"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, sources: Sequence[WatchSource], bell: bool = False, clock: Callable[[], float] | None = None,
                 tick_s: float = TICK_S, log_capacity: int = DEFAULT_LOG_CAPACITY,
                 inbox_lines: int = DEFAULT_INBOX_LINES, backoff: Sequence[float] = BACKOFF_S) -> None:
        super().__init__()
        if not sources:
            raise ValueError("opsctl watch needs at least one run to watch")
        labels = [s.label for s in sources]
        if len(set(labels)) != len(labels):
            raise ValueError(f"two sources share a label: {labels}")
        self.sources = list(sources)
        self.models = [RunModel(s.label, clock=clock, log_capacity=log_capacity, stall_after_s=stall_after_of(s))
                       for s in sources]
        self.followers = [SourceWorker(s, inbox_lines=inbox_lines, backoff=backoff) for s in sources]
        self.bell_on = bell
        self.current = 0
        self._tick_s = tick_s
        self._alerted: list[set[str]] = [set() for _ in sources]
        self._shown: tuple[int, int, int, str | None] = (-1, -1, -1, None)
        self.ticks = 0
        self._logstatus = ""

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield RunsBar(id="runs")
        with Horizontal(id="top"):
            yield RunSummary(id="summary")
            with Vertical(id="right"):
                yield Charts(id="charts")
                yield AlertsPanel(id="alerts")
        yield GpuPanel(id="gpus")
        yield LogPane(id="log")
        yield Static(id="logstatus")
        yield Input(placeholder="search the log (enter: find, escape: clear)", id="search")
        yield Footer()

    def on_mount(self) -> None:
        # Kept as attributes: while a dialog is open, queries would look at the dialog's screen instead.
        self.w_runs = self.query_one(RunsBar)
        self.w_summary = self.query_one(RunSummary)
        self.w_charts = self.query_one(Charts)
        self.w_gpus = self.query_one(GpuPanel)
        self.w_alerts = self.query_one(AlertsPanel)
        self.w_log = self.query_one(LogPane)
        self.w_logstatus = self.query_one("#logstatus", Static)
        self.w_charts.border_title = "loss · tokens/s · step time · queue depth"
        self.w_gpus.border_title = "GPUs"
        self.w_alerts.border_title = "alerts"
        self.w_log.border_title = "log"
        self.w_log.attach(self.models[0].log)
        self.w_log.focus()
        # The widget tree and CSS live as long as the app: keep them out of the full GC passes that a chatty
        # stream triggers, so those passes stay short (measured by bench/watch_ingest.py).
        gc.freeze()
        for worker in self.followers:
            worker.start()
        self.tick()
        self.set_interval(self._tick_s, self.tick)

    def on_unmount(self) -> None:
        for worker in self.followers:
            worker.stop()
        gc.unfreeze()

    # -- the batch loop -----------------------------------------------------------------
    def drain(self) -> bool:
        """Fold every queued message into its run; True when the shown run changed."""
        changed = False
        for i, (worker, model) in enumerate(zip(self.followers, self.models, strict=True)):
            other, logs, dropped = worker.drain()
            if not (other or logs or dropped):
                continue
            for msg in other:
                model.ingest(msg)
            model.ingest_logs(logs)
            model.add_dropped(dropped)
            changed = changed or i == self.current
        return changed

    def tick(self) -> None:
        self.ticks += 1
        self.drain()
        entries = []
        for i, model in enumerate(self.models):
            view = model.view()
            alerts = model.alerts(view)
            self._maybe_bell(i, alerts)
            entries.append((model.label, view, len(alerts)))
            if i == self.current:
                current_view, current_alerts = view, alerts
        self.w_runs.show(entries, self.current)
        model = self.models[self.current]
        pane = self.w_log
        pane.sync()
        if self._shown[0] != self.current or self._shown[1] != model.chart_version:
            self.w_charts.show(model.series)
        if self._shown[0] != self.current or self._shown[2:] != (model.gpu_version, current_view.nvml):
            self.w_gpus.show(current_view.gpus, model.gpu_hist, current_view.nvml)
        self._shown = (self.current, model.chart_version, model.gpu_version, current_view.nvml)
        self.w_summary.show(model.label, current_view, model.link, model.lines_total, model.dropped, len(pane.lines))
        self.w_alerts.show(current_alerts)
        status = pane.status()
        if status != self._logstatus:
            self._logstatus = status
            self.w_logstatus.update(status)

    def _maybe_bell(self, i: int, alerts: list[Alert]) -> None:
        keys = {a.key for a in alerts if a.severity in (CRITICAL, WARNING)}
        new = keys - self._alerted[i]
        self._alerted[i] = keys
        if new and self.bell_on:
            self.bell()

    # -- keys ---------------------------------------------------------------------------
    def action_next_run(self) -> None:
        if isinstance(self.focused, Input):
            return
        self.current = (self.current + 1) % len(self.models)
        self.w_log.attach(self.models[self.current].log)
        self.tick()

    def _confirm_then(self, verb: str, action: Callable[[], object]) -> None:
        model = self.models[self.current]
        view = model.view()
        question = f"{verb} {model.label}? (state {view.state}, pid {view.pid or '-'}, pgid {view.pgid or '-'})"

        def done(answer: bool | None) -> None:
            if answer:
                self._in_thread(verb, action)

        self.push_screen(ConfirmScreen(question), done)

    def _in_thread(self, verb: str, action: Callable[[], object]) -> None:
        """Kill and clean go over SSH and may block: never on the UI thread."""
        label = self.models[self.current].label

        def run() -> None:
            try:
                result: Any = action()
            except BaseException as exc:  # report any transport or agent failure to the person, not a traceback
                self.call_from_thread(self.notify, f"{verb} {label} failed: {exc}", severity="error")
                return
            if isinstance(result, int) and not isinstance(result, bool) and result != 0:
                self.call_from_thread(self.notify, f"{verb} {label} failed: exit {result}", severity="error")
            else:
                self.call_from_thread(self.notify, f"{verb} {label}: done")

        threading.Thread(target=run, name=f"{verb}:{label}", daemon=True).start()

    def action_kill(self) -> None:
        i = self.current

        def kill() -> object:
            self.models[i].mark_killed()
            return self.sources[i].kill()

        self._confirm_then("kill", kill)

    def action_clean(self) -> None:
        self._confirm_then("clean", self.sources[self.current].clean)

    def action_reconnect(self) -> None:
        worker = self.followers[self.current]
        self.models[self.current].link = "reconnecting: requested"
        worker.request_reconnect()

    def action_search(self) -> None:
        box = self.query_one("#search", Input)
        box.add_class("visible")
        box.value = self.query_one(LogPane).search
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        pane = self.query_one(LogPane)
        pane.set_search(event.value)
        event.input.remove_class("visible")
        pane.focus()

    def on_key(self, event: events.Key) -> None:
        box = self.query_one("#search", Input)
        if event.key == "escape" and box.has_class("visible"):
            box.remove_class("visible")
            pane = self.query_one(LogPane)
            pane.set_search("")
            pane.focus()
            event.stop()

    def action_quit(self) -> None:  # type: ignore[override]
        self.exit(0)

    # -- for tests and the benchmark ----------------------------------------------------
    def replay_done(self) -> bool:
        """Every source has ended and every queued message has been folded in."""
        return all(w.ended.is_set() and not w.pending() for w in self.followers)


def watch_main(sources: list[WatchSource], plain: bool, once_json: bool, bell: bool) -> int:
    """Entry point for `opsctl watch`: the Textual app, `--plain` (rich Live) or `--once --json` (one snapshot)."""
    if not sources:
        raise SystemExit("opsctl watch: no runs to watch (check hosts.yaml or the HOST:RUN arguments)")
    if once_json:
        from opsctl.plain import snapshot_once

        snaps = snapshot_once(sources)
        print(json.dumps(snaps, indent=2, default=str))
        return 0 if all(s["link"] != "connecting" and not s["link"].startswith("lost") for s in snaps) else 1
    if plain:
        from opsctl.plain import run_plain

        return run_plain(sources, bell=bell)
    result = WatchApp(sources, bell=bell).run()
    return int(result or 0)


def replay_main(argv: list[str] | None = None) -> int:
    """`python -m opsctl.tui [--speed X] [--plain | --once-json] FILE...`: the dashboard over recorded streams (demos)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m opsctl.tui", description=replay_main.__doc__)
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="recorded agent stream (JSON lines)")
    p.add_argument("--speed", type=float, default=None, help="replay at X times real time (default: at once)")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--once-json", action="store_true")
    p.add_argument("--bell", action="store_true")
    args = p.parse_args(argv)
    try:
        sources: list[WatchSource] = [RecordedSource(f, label=f"replay:{f.stem}", speed=args.speed) for f in args.files]
    except (FileNotFoundError, ValueError) as exc:
        p.error(str(exc))
    return watch_main(sources, plain=args.plain, once_json=args.once_json, bell=args.bell)


if __name__ == "__main__":
    raise SystemExit(replay_main())
