"""`opsctl watch`: the live Textual dashboard of one or many runs, fed by agent message streams.

Only Textual lives here; the sources, per-source worker threads and RunModel it draws are opsctl/watch.py (UI-free).
The entry points are opsctl/tui.py, which imports this module only when the dashboard itself is shown (`--once` and
`--plain` do not pay for Textual).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Input, Static

from opsctl.alerts import CRITICAL, WARNING, Alert
from opsctl.watch import (
    DEFAULT_INBOX_LINES,
    DEFAULT_LOG_CAPACITY,
    QUIET_RANK,
    RunModel,
    SourceWorker,
    WatchSource,
    attention_rank,
    fold,
    group_infos,
    node_view,
    screenshot_dir,
    stall_after_of,
    tau_drop_of,
)
from opsctl.widgets import (
    AlertsPanel,
    Charts,
    ConfirmScreen,
    GpuPanel,
    LogPane,
    RunsBar,
    RunSummary,
    WatchFooter,
)

TICK_S = 0.1
IDLE_REFRESH_S = 1.0  # with nothing new, redraw this often (ages and stall verdicts move by the second)
CHART_EVERY_S = 0.5
class WatchApp(App[int]):
    """The dashboard: a bar of every run, then the selected run's numbers, charts, GPUs, alerts and log."""

    TITLE = "opsctl watch"
    CSS = """
    RunsBar { height: 1; background: $panel; }
    #top { height: auto; }
    RunSummary { width: 48; height: auto; border: round $primary; padding: 0 1; }
    #right { width: 1fr; height: auto; }
    Charts { height: 14; border: round $primary; }
    Charts.hidden { display: none; }
    AlertsPanel { height: auto; max-height: 8; border: round $success 50%; padding: 0 1; }
    AlertsPanel.-warning { border: round $warning; }
    AlertsPanel.-critical { border: round $error; }
    GpuPanel { border: round $primary; padding: 0 1; }
    LogPane { height: 1fr; min-height: 5; border: round $secondary; }
    #logstatus { height: 1; background: $panel; color: $text-muted; }
    #search { dock: bottom; display: none; }
    #search.visible { display: block; }
    .compact #top { layout: vertical; }
    .compact RunSummary { width: 1fr; border: none; padding: 0; text-wrap: nowrap; text-overflow: ellipsis; }
    .compact #right { width: 1fr; }
    .compact AlertsPanel { border: none; padding: 0; max-height: 3; }
    .compact AlertsPanel.-why { max-height: 5; }
    .compact GpuPanel { border: none; border-top: solid $primary; padding: 0; }
    .compact LogPane { min-height: 4; }
    .compact Charts { border: none; border-top: solid $primary; }
    .compact #right { overflow: hidden; }
    """
    BINDINGS = [
        Binding("k", "kill", "kill"),
        Binding("c", "clean", "clean"),
        Binding("r", "reconnect", "reconnect"),
        Binding("tab", "next_run", "next run", priority=True),
        Binding("slash", "search", "search"),
        Binding("v", "charts", "charts"),
        Binding("m", "metric", "metric", show=False),
        Binding("e", "smoothing", "smooth", show=False),
        Binding("g", "gpu_history", "GPU history", show=False),
        Binding("ctrl+s", "screenshot", "screenshot"),
        Binding("q", "quit", "quit"),
    ]
    COMPACT_BELOW = (100, 34)  # width, height: two-line summary, no charts (v shows them), so 8 GPUs + log fit 80x24
    LOG_MIN = 5  # log lines kept on a small terminal with the charts on: the charts shrink (and the GPUs fold) first
    CHART_MIN = 6  # rows under which a chart says nothing (its title, axis and labels take four)
    CHART_MAX = 14
    OPENING_S = 5.0  # until then (or a key), the dashboard moves to the run that needs attention

    def __init__(self, sources: Sequence[WatchSource], bell: bool = False, clock: Callable[[], float] | None = None,
                 tick_s: float = TICK_S, log_capacity: int = DEFAULT_LOG_CAPACITY,
                 inbox_lines: int = DEFAULT_INBOX_LINES, backoff: Sequence[float] | None = None,
                 followers: Sequence[SourceWorker] | None = None) -> None:
        """`followers`: one SourceWorker per source, possibly started already (tui.watch_main starts them before it
        imports this module, so the connection and the backlog overlap Textual's import and start-up); None: made
        here from `inbox_lines` and `backoff`, started on mount."""
        super().__init__()
        if not sources:
            raise ValueError("opsctl watch needs at least one run to watch")
        labels = [s.label for s in sources]
        if len(set(labels)) != len(labels):
            raise ValueError(f"two sources share a label: {labels}")
        self.sources = list(sources)
        self.models = [RunModel(s.label, clock=clock, log_capacity=log_capacity, stall_after_s=stall_after_of(s),
                                tau_drop=tau_drop_of(s)) for s in sources]
        if followers is not None and [w.source for w in followers] != self.sources:
            raise ValueError("followers must be one SourceWorker per source, in the sources' order")
        self.followers = (list(followers) if followers is not None
                          else [SourceWorker(s, inbox_lines=inbox_lines, backoff=backoff) for s in sources])
        self.tags = [getattr(s, "group", None) for s in sources]  # the group run each source is a node of
        self.bell_on = bell
        self.current = 0
        self._tick_s = tick_s
        self._alerted: list[set[str]] = [set() for _ in sources]
        self._shown: tuple[int, int, int, str | None] = (-1, -1, -1, None)
        self.ticks = 0  # batch-loop turns (the timer's, every tick_s), whether or not they redrew
        self.redraws = 0  # turns that redrew (something arrived, or IDLE_REFRESH_S passed)
        self._logstatus = ""
        self.last_screenshot: str | None = None
        self.chose = False  # the person picked a run (tab): stop moving to the one that needs attention
        self.charts_wanted: bool | None = None  # v: None = shown unless the terminal is small
        self._opened = time.monotonic()
        self._charts_at = 0.0
        self._full_at = 0.0  # when `tick` last redrew everything
        self._charts_behind = False  # a chart redraw was put off while a backlog poured in
        self._chart_rows: int | None = None  # the charts' height on a small terminal (None: the stylesheet's)

    def compose(self) -> ComposeResult:
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
        yield WatchFooter()

    def on_mount(self) -> None:
        # Kept as attributes: while a dialog is open, queries would look at the dialog's screen instead.
        self.main_screen = self.screen
        self.w_runs = self.query_one(RunsBar)
        self.w_summary = self.query_one(RunSummary)
        self.w_charts = self.query_one(Charts)
        self.w_gpus = self.query_one(GpuPanel)
        self.w_alerts = self.query_one(AlertsPanel)
        self.w_log = self.query_one(LogPane)
        self.w_logstatus = self.query_one("#logstatus", Static)
        self.w_charts.border_title = "whole run · m: metric · e: smoothing · v: hide"
        self.w_gpus.border_title = "GPUs · g: history"
        self.w_alerts.border_title = "alerts"
        self.w_log.border_title = "log"
        self.w_log.attach(self.models[0].log)
        self.w_log.focus()
        # The widget tree and CSS live as long as the app: keep them out of the full GC passes that a chatty
        # stream triggers, so those passes stay short (measured by bench/watch_ingest.py).
        gc.freeze()
        for worker in self.followers:
            worker.start()  # those watch_main started early go on as they are
        self._layout_for(self.size.width, self.size.height)
        self.tick()
        self.set_interval(self._tick_s, self._beat)

    def on_resize(self, event: events.Resize) -> None:
        if hasattr(self, "w_summary"):  # a resize can arrive before on_mount
            self._layout_for(event.size.width, event.size.height)

    def _layout_for(self, width: int, height: int) -> None:
        """Small terminals get the compact layout: an 8-GPU panel and the log still fit in 80x24."""
        compact = width < self.COMPACT_BELOW[0] or height < self.COMPACT_BELOW[1]
        self.main_screen.set_class(compact, "compact")  # not a dialog that may be open
        self.w_summary.compact = self.w_alerts.compact = compact
        self.w_summary._shown = self.w_alerts._shown = None  # redraw in the new form
        show = (not compact) if self.charts_wanted is None else self.charts_wanted
        self.w_charts.set_class(not show, "hidden")
        self.w_gpus.collapse(compact and show)  # charts on a small terminal: the GPU table folds to one line
        self._fit_charts()
        self.call_after_refresh(self._fit_charts)  # again once the folded table has its new height
        self._shown = (-1, -1, -1, None)
        for footer in self.main_screen.query(WatchFooter):
            footer.call_after_refresh(footer.recompose)  # the keys that fit this width

    def _fit_charts(self) -> None:
        """On a small terminal the charts take what the log leaves (at least LOG_MIN lines of it), at most
        CHART_MAX rows; below CHART_MIN they are hidden rather than drawn unreadable."""
        charts = self.w_charts
        if not self.main_screen.has_class("compact"):
            if self._chart_rows is not None:
                charts.styles.height = self._chart_rows = None  # the stylesheet's height again
            return
        if charts.has_class("hidden"):
            return
        others = sum(w.outer_size.height for w in (self.w_runs, self.w_summary, self.w_alerts, self.w_gpus,
                                                    self.w_logstatus))
        free = self.size.height - others - 1 - 2 - self.LOG_MIN  # the footer, the log's border, its lines
        rows = min(self.CHART_MAX, free)
        if rows < self.CHART_MIN:
            rows = 0
        if rows != self._chart_rows:
            charts.styles.height = self._chart_rows = rows
            self._shown = (-1, -1, -1, None)  # redraw at the new size

    def on_unmount(self) -> None:
        for worker in self.followers:
            worker.stop()
        gc.unfreeze()

    # -- the batch loop -----------------------------------------------------------------
    def drain(self) -> bool:
        """Fold every queued message into its run; True when the shown run changed."""
        return fold(self.followers, self.models)[self.current]

    def _beat(self) -> None:
        """The timer: fold what arrived; redraw when something did, a chart is owed, or IDLE_REFRESH_S passed (a
        finished run's dashboard then costs a redraw a second, not ten)."""
        self.ticks += 1
        changed = any(fold(self.followers, self.models))
        if self.main_screen.has_class("compact"):
            self._fit_charts()  # a summary or alerts box that grew or shrank moves the room left for the charts
        keyed = self.w_log.status() != self._logstatus  # a key paused, filtered or searched the log: say so now
        if changed or keyed or self._charts_behind or time.monotonic() - self._full_at >= IDLE_REFRESH_S:
            self.tick()

    def tick(self) -> None:
        self.redraws += 1
        self._full_at = time.monotonic()
        settling = [w.settling() for w in self.followers]  # before the fold (SourceWorker.settling)
        self.drain()
        entries = []
        ranks = []
        for i, model in enumerate(self.models):
            view = node_view(self.tags[i], model.view())
            alerts = model.alerts(view)
            if settling[i]:  # half a backlog: a past moment's state (an old heartbeat reads as a stall), not news
                ranks.append(QUIET_RANK)
            else:
                self._maybe_bell(i, alerts, view.state == "unreachable")
                ranks.append(attention_rank(view, alerts))
            entries.append((model.label, view, len(alerts)))
        if not self.chose and time.monotonic() - self._opened < self.OPENING_S:
            best = min(range(len(ranks)), key=lambda i: (ranks[i], i))
            if ranks[best] < ranks[self.current]:  # open on the run that needs someone: crashed, stalled, ...
                self.current = best
                self.w_log.attach(self.models[best].log)
        groups = (group_infos(self.tags, [{"host": label.partition(":")[0], **view.to_dict()}
                                          for label, view, _ in entries])
                  if any(self.tags) else [None] * len(entries))
        self.w_runs.show(entries, self.current, groups)
        model = self.models[self.current]
        current_view = entries[self.current][1]
        current_alerts = model.alerts(current_view)
        pane = self.w_log
        pane.sync()
        now = time.monotonic()
        charted = self._shown[1]
        # plotext redraws whole charts: while a backlog pours in, at most every CHART_EVERY_S; once it is in, at once
        pouring = now - self._charts_at < CHART_EVERY_S and self.followers[self.current].pending() > 0
        if self._shown[0] != self.current or (charted != model.chart_version and not pouring):
            self.w_charts.show(model)
            self._charts_at, charted = now, model.chart_version
        self._charts_behind = charted != model.chart_version
        if self._shown[0] != self.current or self._shown[2:] != (model.gpu_version, current_view.nvml):
            self.w_gpus.show(current_view, model.gpu_hist)
        self._shown = (self.current, charted, model.gpu_version, current_view.nvml)
        self.w_summary.show(model, current_view, len(pane.lines), group=groups[self.current])
        never = current_view.state == "unreachable" and not model.state_seen
        # Small terminals: the summary's one line would cut a never-reached host's error (its only news), so the
        # alerts box says it in full, wrapped (RunSummary leaves it off its line then).
        why = current_view.reason if never and self.w_summary.compact else None
        self.w_alerts.show(current_alerts, "nothing to check: the host was never reached" if never else "no alerts",
                           why=why)
        status = pane.status()
        if status != self._logstatus:
            self._logstatus = status
            self.w_logstatus.update(status)

    def _maybe_bell(self, i: int, alerts: list[Alert], unreachable: bool = False) -> None:
        # unreachable: a host never reached has no link alert (its state says it), yet it rings like one
        keys = {a.key for a in alerts if a.severity in (CRITICAL, WARNING)} | ({"unreachable"} if unreachable else set())
        new = keys - self._alerted[i]
        self._alerted[i] = keys
        if new and self.bell_on:
            self.bell()

    # -- keys ---------------------------------------------------------------------------
    def action_next_run(self) -> None:
        if isinstance(self.focused, Input):
            return
        self.chose = True
        self.current = (self.current + 1) % len(self.models)
        self.w_log.attach(self.models[self.current].log)
        self.tick()

    def _confirm_then(self, verb: str, action: Callable[[], object]) -> None:
        model = self.models[self.current]
        view = model.view()
        question = f"{verb} {model.label}? (state {view.state}, pid {view.pid or '-'}, pgid {view.pgid or '-'})"

        def done(answer: bool | None) -> None:
            if answer:
                self._in_thread(verb, self.models[self.current].label, action)

        self.push_screen(ConfirmScreen(question), done)

    @work(thread=True, exit_on_error=False)
    def _in_thread(self, verb: str, label: str, action: Callable[[], object]) -> None:
        """Kill and clean go over SSH and may block: never on the UI thread."""
        try:
            result: Any = action()
        except BaseException as exc:  # report any transport or agent failure to the person, not a traceback
            self.call_from_thread(self.notify, f"{verb} {label} failed: {exc}", severity="error")
            return
        if isinstance(result, int) and not isinstance(result, bool) and result != 0:
            self.call_from_thread(self.notify, f"{verb} {label} failed: exit {result}", severity="error")
        else:
            self.call_from_thread(self.notify, f"{verb} {label}: done")

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
        self.tick()

    def action_charts(self) -> None:
        shown = not self.w_charts.has_class("hidden")
        self.charts_wanted = not shown
        self._layout_for(self.size.width, self.size.height)  # also folds or unfolds the GPU table
        # draw them at the next tick (a hidden chart is not drawn)

    def action_metric(self) -> None:
        self.notify(f"right chart: {self.w_charts.next_metric()}", timeout=2)

    def action_smoothing(self) -> None:
        weight = self.w_charts.toggle_smoothing()
        self.notify(f"smoothing {'off' if not weight else f'on (EMA weight {weight:g})'}", timeout=2)

    def action_gpu_history(self) -> None:
        self.notify("GPU columns: " + ("history (sparklines)" if self.w_gpus.toggle_history() else "now (bars)"),
                    timeout=2)

    def action_screenshot(self, filename: str | None = None, path: str | None = None) -> None:
        """ctrl+s (and the command palette's screenshot): an SVG of the screen, in a directory that exists and is
        writable on a server (not a ~/Downloads that is not there), and the notification says where."""
        self.deliver_screenshot(filename, path)

    def deliver_screenshot(self, filename: str | None = None, path: str | None = None,
                           time_format: str | None = None) -> str | None:
        try:
            where = screenshot_dir(path)
            saved = self.save_screenshot(filename, str(where), time_format)
        except OSError as exc:
            self.notify(f"screenshot not saved: {exc}", severity="error", timeout=10)
            return None
        self.notify(f"screenshot saved to {saved}", timeout=10)
        self.last_screenshot = saved
        return saved

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
