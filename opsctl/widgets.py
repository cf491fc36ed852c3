"""Small typed widgets of `opsctl watch`: state badge, run summary, charts, GPU panel, alerts, log pane, confirm dialog.

They only draw what the RunModel (opsctl/watch.py) already knows; none of them reads a stream or derives state.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.events import MouseScrollUp
from textual.geometry import Size
from textual.screen import ModalScreen
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Button, Label, Static

from opsctl.alerts import CRITICAL, Alert
from opsctl.runstate import RunView, phase_progress
from opsctl.watch import (  # noqa: F401 - re-exported
    SEV_ERROR,
    SEV_INFO,
    SEV_WARNING,
    LogLine,
    SeverityClassifier,
    fmt_duration,
    fmt_num,
    state_label,
)

BLOCKS = "▁▂▃▄▅▆▇█"
SEVERITY_NAMES = ("all", "warning+", "error")

STATE_STYLES: dict[str, str] = {
    "absent": "bold white on grey37",
    "starting": "bold black on grey70",
    "loading": "bold black on cyan",
    "compiling": "bold black on magenta",
    "training": "bold black on green",
    "stalled": "bold black on yellow",
    "finished": "bold white on blue",
    "crashed": "bold white on red",
    "killed": "bold white on dark_orange3",
    "unreachable": "bold white on purple",
    "restarting": "bold black on dark_orange",
}

# Log lines a person must not miss; the first matching pattern decides the highlight.
HIGHLIGHTS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"Traceback \(most recent call last\)"), "bold white on red"),
    (re.compile(r"out of memory|\bOOM\b|OutOfMemoryError"), "bold white on dark_red"),
    (re.compile(r"\bNCCL\b"), "bold magenta"),
    (re.compile(r"\bWARN(ING)?\b|[Ww]arning\b"), "bold yellow"),
]
# -- formatting ---------------------------------------------------------------------------
def spark(values: Sequence[float], width: int, lo: float | None = None, hi: float | None = None) -> str:
    """A one-line chart of the last `width` finite values; a flat series draws at its bottom."""
    vals = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)][-max(width, 0):]
    if not vals or width <= 0:
        return ""
    low = min(vals) if lo is None else lo
    high = max(vals) if hi is None else hi
    span = high - low
    out = []
    for v in vals:
        frac = 0.0 if span <= 0 else min(1.0, max(0.0, (v - low) / span))
        out.append(BLOCKS[min(len(BLOCKS) - 1, int(frac * (len(BLOCKS) - 1) + 0.5))])
    return "".join(out)


def state_badge(view: RunView) -> Text:
    """The one word that says what a run is doing, with loading progress (i/N) when the run reports it."""
    label = state_label(view).upper()
    if view.state == "loading":
        label = phase_progress(label, view.phase_i, view.phase_n)
    return Text(f" {label} ", style=STATE_STYLES.get(view.state, "bold reverse"))


# -- widgets ------------------------------------------------------------------------------
class _Quiet(Static):
    """A Static that redraws only when its text really changed: the batch loop calls `show` ten times a second."""

    _shown: Text | None = None

    def put(self, text: Text) -> None:
        if text != self._shown:
            self._shown = text
            self.update(text)


class RunsBar(_Quiet):
    """Every watched run on one line, so a crash on another host is seen while looking at this one."""

    def show(self, entries: Sequence[tuple[str, RunView, int]], current: int) -> None:
        text = Text()
        for i, (label, view, n_alerts) in enumerate(entries):
            if i:
                text.append("  ")
            marker = "▶ " if i == current else "  "
            text.append(marker + label + " ", style="bold" if i == current else "")
            text.append_text(state_badge(view))
            if n_alerts:
                text.append(f" ⚠{n_alerts}", style="bold red")
        self.put(text)


class RunSummary(_Quiet):
    """The numbers of one run: phase, step and epoch, ETA, loss, throughput, heartbeat age, link and drops."""

    def show(self, label: str, view: RunView, link: str, lines: int, dropped: int, shown: int) -> None:
        t = Text()
        t.append(f"{label}  ", style="bold")
        t.append_text(state_badge(view))
        if view.reason:  # why: the crash's exception line and exit code, the unreachable host's error, leftovers
            t.append(f"  {view.reason}", style="bold red" if view.state in ("crashed", "unreachable") else "yellow")
        phase = phase_progress(view.phase or "-", view.phase_i, view.phase_n)
        total = f"/{view.total_steps:,}" if view.total_steps else ""
        epoch = "-" if view.epoch is None else str(view.epoch)
        rows = [
            ("phase", phase),
            ("step", f"{view.step:,}{total}  epoch {epoch}"),
            ("ETA", fmt_duration(view.eta_s)),
            ("loss", fmt_num(view.loss, 4)),
            ("tokens/s", fmt_num(view.tokens_per_s, 0)),
            ("step time", "-" if view.step_time_s is None else f"{view.step_time_s:.3f} s"),
            ("heartbeat", "-" if view.heartbeat_age_s is None else f"{fmt_duration(view.heartbeat_age_s)} ago"),
            ("process", f"{view.proc_state or '-'}  pid {view.pid or '-'}"
                        + ("" if view.exit_code is None else f"  exit {view.exit_code}")),
            ("link", link),
            ("log", f"{lines:,} lines, {dropped:,} dropped" + (f", {shown:,} shown" if shown != lines else "")),
        ]
        for key, value in rows:
            t.append(f"\n{key:>10} ", style="dim")
            style = "bold red" if key == "log" and dropped else ""
            t.append(value, style=style)
        self.put(t)


class Charts(Widget):
    """Sparklines of loss, tokens/s, step time and hidden-state queue depth over the recent steps."""

    DEFAULT_CSS = "Charts { height: 4; }"
    SERIES = (("loss", "loss", "green", 4), ("tokens_per_s", "tok/s", "cyan", 0),
              ("step_time_s", "step s", "yellow", 3), ("queue_depth", "queue", "magenta", 0))

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._series: dict[str, Sequence[float]] = {}

    def show(self, series: dict[str, Sequence[float]]) -> None:
        self._series = {k: list(v) for k, v in series.items()}
        self.refresh()

    def render(self) -> Text:
        width = max(0, self.size.width - 24)
        t = Text()
        for i, (key, label, colour, digits) in enumerate(self.SERIES):
            vals = self._series.get(key) or []
            last = fmt_num(vals[-1], digits) if vals else "-"
            if i:
                t.append("\n")
            t.append(f"{label:>7} {last:>10} ", style="dim")
            lo = 0.0 if key == "queue_depth" else None
            t.append(spark(vals, width, lo=lo), style=colour)
        return t


class GpuPanel(Widget):
    """Per GPU: utilisation, memory, power and temperature as numbers and sparklines, and who holds the GPU."""

    DEFAULT_CSS = "GpuPanel { height: auto; }"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._gpus: list[dict[str, Any]] = []
        self._hist: dict[int, dict[str, Sequence[float]]] = {}
        self._nvml: str | None = None

    def show(self, gpus: list[dict[str, Any]], hist: dict[int, dict[str, Sequence[float]]], nvml: str | None) -> None:
        relayout = len(gpus) != len(self._gpus)
        self._gpus, self._hist, self._nvml = list(gpus), hist, nvml
        self.refresh(layout=relayout)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, len(self._gpus))

    def render(self) -> Text:
        if not self._gpus:
            return Text(f"GPUs: none reported (nvml: {self._nvml or 'no sample yet'})", style="dim")
        w = max(3, min(16, (self.size.width - 84) // 4))
        t = Text()
        for n, g in enumerate(self._gpus):
            idx = g.get("index", n)
            h = self._hist.get(idx, {})
            if n:
                t.append("\n")
            used, total = g.get("mem_used_mb"), g.get("mem_total_mb")
            t.append(f"GPU{idx} ", style="bold")
            t.append(f"{fmt_num(g.get('util'), 0):>3}% ")
            t.append(f"{spark(h.get('util', []), w, 0, 100):<{w}}", style="green")
            mem = "-" if not isinstance(used, (int, float)) or not isinstance(total, (int, float)) \
                else f"{used / 1024:.1f}/{total / 1024:.0f}G"
            t.append(f" {mem:>10} ")
            t.append(f"{spark(h.get('mem_used_mb', []), w, 0, total if isinstance(total, (int, float)) else None):<{w}}",
                     style="cyan")
            t.append(f" {fmt_num(g.get('power_w'), 0):>4}W ")
            t.append(f"{spark(h.get('power_w', []), w):<{w}}", style="yellow")
            t.append(f" {fmt_num(g.get('temp_c'), 0):>3}°C ")
            t.append(f"{spark(h.get('temp_c', []), w, 20, 95):<{w}}", style="red")
            procs = g.get("procs") or []
            desc = " ".join(f"{p.get('pid')}:{fmt_num((p.get('used_mb') or 0) / 1024, 1)}G" for p in procs[:3])
            if len(procs) > 3:
                desc += f" +{len(procs) - 3}"
            t.append(f" procs {desc or 'none'}", style="dim")
        return t


class AlertsPanel(_Quiet):
    """Every active alert with its evidence, critical ones first."""

    def show(self, alerts: Sequence[Alert]) -> None:
        if not alerts:
            self.put(Text("no alerts", style="dim green"))
            return
        t = Text()
        ordered = sorted(alerts, key=lambda a: (a.severity != CRITICAL, a.key))
        for i, a in enumerate(ordered):
            if i:
                t.append("\n")
            style = "bold white on red" if a.severity == CRITICAL else "bold black on yellow"
            t.append(f" {a.title} ", style=style)
            t.append(f"\n  {a.evidence}")
        self.put(t)


class LogPane(ScrollView, can_focus=True):
    """The run's human log from its ring buffer: follows the end, pauses when scrolled up, filters and searches.

    Only visible lines are drawn (Line API), so 20,000 lines/s cost the UI a screenful per frame, not 20,000 renders.
    """

    DEFAULT_CSS = "LogPane { overflow-x: hidden; }"
    BINDINGS = [
        Binding("s", "severity", "severity"),
        Binding("n", "next_match", "older match", show=False),
        Binding("N", "prev_match", "newer match", show=False),
        Binding("f", "follow", "follow"),
        Binding("end", "follow", "follow", show=False),
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._source: deque[LogLine] = deque()
        self._filtered: deque[LogLine] | None = None
        self._filtered_upto = -1  # last source seq considered for the filtered view
        self._filtered_appended = 0
        self._evicted_seen = 0
        self.min_sev = SEV_INFO
        self.search = ""
        self._search_re: re.Pattern[str] | None = None
        self.follow = True
        self._programmatic = 0
        self.render_probe: Callable[[LogLine], None] | None = None  # the ingest benchmark measures lag here

    # -- data -----------------------------------------------------------------------------
    @property
    def lines(self) -> deque[LogLine]:
        return self._filtered if self._filtered is not None else self._source

    def attach(self, source: deque[LogLine]) -> None:
        """Show another run's ring buffer (tab to the next run)."""
        self._source = source
        self._rebuild_filter()
        self.follow = True
        self.sync()

    def _filter_active(self) -> bool:
        # Search highlights and jumps; only the severity filter hides lines.
        return self.min_sev > SEV_INFO

    def _rebuild_filter(self) -> None:
        if self._filter_active():
            self._filtered = deque((ln for ln in self._source if ln.sev >= self.min_sev), maxlen=self._source.maxlen)
            self._filtered_appended = len(self._filtered)
        else:
            self._filtered = None
        self._filtered_upto = self._source[-1].seq if self._source else -1
        self._evicted_seen = self._evicted_total()

    def _evicted_total(self) -> int:
        """Lines that have fallen off the front of the shown list since it was built."""
        if self._filtered is not None:
            return self._filtered_appended - len(self._filtered)
        return (self._source[-1].seq + 1 - len(self._source)) if self._source else 0

    def sync(self) -> None:
        """Take the lines that arrived since the last call; keep following or keep the paused view still."""
        if self._filtered is not None:
            new: list[LogLine] = []
            for ln in reversed(self._source):
                if ln.seq <= self._filtered_upto:
                    break
                if ln.sev >= self.min_sev:
                    new.append(ln)
            self._filtered.extend(reversed(new))
            self._filtered_appended += len(new)
            if self._source:
                self._filtered_upto = self._source[-1].seq
        lines = self.lines
        evicted = self._evicted_total()
        moved_up = evicted - self._evicted_seen
        self._evicted_seen = evicted
        self._programmatic += 1
        try:
            self.virtual_size = Size(max(1, self.scrollable_content_region.width), len(lines))
            if self.follow:
                self.scroll_to(y=len(lines), animate=False, immediate=True)  # clamped to the last screenful
            elif moved_up > 0:
                # Lines fell off the front of the ring: move up by as many, so the same lines stay on screen.
                self.scroll_to(y=max(0, self.scroll_y - moved_up), animate=False, immediate=True)
        finally:
            self._programmatic -= 1
        self.refresh()

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if self._programmatic:
            return
        # At the bottom (also when a resize clamps the offset) means follow; moving up anywhere else pauses.
        if new_value >= self.max_scroll_y:
            self.follow = True
        elif new_value < old_value:
            self.follow = False

    def on_resize(self) -> None:
        self.sync()

    # Scrolling up is a request to stop following: decide it when the key or wheel arrives, not when a
    # (possibly animated) scroll lands, or the next batch would pull the view back to the end first.
    def action_scroll_up(self) -> None:
        self.follow = False
        super().action_scroll_up()

    def action_page_up(self) -> None:
        self.follow = False
        super().action_page_up()

    def action_scroll_home(self) -> None:
        self.follow = False
        super().action_scroll_home()

    def _on_mouse_scroll_up(self, event: MouseScrollUp) -> None:
        self.follow = False
        super()._on_mouse_scroll_up(event)

    # -- actions --------------------------------------------------------------------------
    def action_severity(self) -> None:
        self.min_sev = (self.min_sev + 1) % len(SEVERITY_NAMES)
        self._rebuild_filter()
        self.sync()

    def action_follow(self) -> None:
        self.follow = True
        self.sync()

    def set_search(self, term: str) -> None:
        """Highlight `term` and jump to its latest occurrence (pausing the follow); empty clears the search."""
        self.search = term
        self._search_re = re.compile(re.escape(term), re.IGNORECASE) if term else None
        if not term:
            self.follow = True
            self.sync()
            return
        self._jump(start=len(self.lines) - 1, step=-1)

    def action_next_match(self) -> None:
        self._jump(start=int(self.scroll_y) + self.size.height // 2 - 1, step=-1)

    def action_prev_match(self) -> None:
        self._jump(start=int(self.scroll_y) + self.size.height // 2 + 1, step=1)

    def _jump(self, start: int, step: int) -> bool:
        if self._search_re is None:
            return False
        lines = self.lines
        i = min(max(start, 0), len(lines) - 1)
        while 0 <= i < len(lines):
            if self._search_re.search(lines[i].text):
                self.follow = False
                self._programmatic += 1
                try:
                    self.scroll_to(y=max(0, i - self.size.height // 2), animate=False, immediate=True)
                finally:
                    self._programmatic -= 1
                self.refresh()
                return True
            i += step
        self.app.bell()
        return False

    def status(self) -> str:
        parts = [("following" if self.follow else "paused (f: follow)"), f"filter {SEVERITY_NAMES[self.min_sev]}"]
        if self.search:
            parts.append(f"search '{self.search}' (n/N)")
        return " | ".join(parts)

    # -- drawing --------------------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        lines = self.lines
        idx = int(self.scroll_y) + y
        if idx >= len(lines) or idx < 0:
            return Strip.blank(width, self.rich_style)
        line = lines[idx]
        if self.render_probe is not None:
            self.render_probe(line)
        text = Text(line.text, style="red" if line.sev == SEV_ERROR else "")
        for pattern, style in HIGHLIGHTS:
            if pattern.search(line.text):
                text.highlight_regex(pattern, style)
                break
        if self._search_re is not None:
            text.highlight_regex(self._search_re, "bold black on bright_yellow")
        strip = Strip(list(text.render(self.app.console)))
        return strip.crop_extend(int(self.scroll_x), int(self.scroll_x) + width, self.rich_style)


class ConfirmScreen(ModalScreen[bool]):
    """Asks before an action that cannot be undone (kill, clean); only `yes` returns True."""

    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 64; height: auto; border: thick $error; background: $surface; padding: 1 2; }
    ConfirmScreen Horizontal { height: auto; align-horizontal: center; margin-top: 1; }
    ConfirmScreen Button { margin: 0 2; }
    """
    BINDINGS = [Binding("y", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, id="question")
            with Horizontal():
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)

