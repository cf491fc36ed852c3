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
from textual.widgets import Button, Footer, Label, Static
from textual.widgets._footer import FooterKey
from textual_plotext import PlotextPlot

from opsctl.alerts import CRITICAL, Alert
from opsctl.look import BLOCKS, STATE_STYLES, nice_ticks, spark, state_badge, tick_labels  # noqa: F401 - re-exported
from opsctl.runstate import RunView, attempt_clock, phase_progress
from opsctl.watch import (  # noqa: F401 - re-exported
    SEV_ERROR,
    SEV_INFO,
    SEV_WARNING,
    LogLine,
    RunModel,
    RunSeries,
    SeverityClassifier,
    bad_events_text,
    ending_text,
    fmt_duration,
    fmt_num,
    state_label,
    tau_text,
)

SEVERITY_NAMES = ("all", "warning+", "error")

# Log lines a person must not miss; the first matching pattern decides the highlight.
HIGHLIGHTS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"Traceback \(most recent call last\)"), "bold white on red"),
    (re.compile(r"out of memory|\bOOM\b|OutOfMemoryError"), "bold white on dark_red"),
    (re.compile(r"\bNCCL\b"), "bold magenta"),
    (re.compile(r"\bWARN(ING)?\b|[Ww]arning\b"), "bold yellow"),
]
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

    def show(self, entries: Sequence[tuple[str, RunView, int]], current: int,
             groups: Sequence[dict[str, Any] | None] | None = None) -> None:
        text = Text()
        text.append("opsctl watch ", style="bold")
        seen: set[tuple[str, str]] = set()
        for i, (label, view, n_alerts) in enumerate(entries):
            info = groups[i] if groups else None
            if info is not None and (info["name"], info["run"]) not in seen:
                # a group run's own state before its first node: training only when every node trains
                seen.add((info["name"], info["run"]))
                text.append(f" {info['name']}/{info['run']} ", style="bold")
                text.append_text(group_badge(info))
                text.append(" :")
            text.append(" ")
            marker = "▶ " if i == current else "  "
            text.append(marker + label + " ", style="bold" if i == current else "")
            text.append_text(state_badge(view))
            if n_alerts:
                text.append(f" ⚠{n_alerts}", style="bold red")
        self.put(text)


def _rate(model: RunModel, view: RunView) -> str:
    """tokens/s as the run's rate (real tokens per wall second, opsctl.remote.rules.EtaClock), the last step's own
    value beside it."""
    avg = view.tokens_per_s_avg
    if avg is None:
        return fmt_num(view.tokens_per_s, 0)
    return f"{fmt_num(avg, 0)} avg (last {fmt_num(view.tokens_per_s, 0)})"


class RunSummary(_Quiet):
    """The numbers of one run: phase, step and epoch, ETA, loss, throughput, heartbeat age, link and drops.

    `compact` (small terminals): the same facts on two lines, so an 8-GPU panel and the log still fit in 80x24."""

    compact = False

    def show(self, model: RunModel, view: RunView, shown: int, group: dict[str, Any] | None = None) -> None:
        t = Text()
        t.append(f"{model.label}  ", style="bold")
        t.append_text(state_badge(view))
        if view.reason:  # why: the crash's exception line and exit code, the unreachable host's error, leftovers
            t.append(f"  {view.reason}", style=reason_style(view.state))
        phase = phase_progress(view.phase or "-", view.phase_i, view.phase_n)
        total = f"/{view.total_steps:,}" if view.total_steps else ""
        pct = f" ({100 * view.step / view.total_steps:.0f}%)" if view.total_steps and view.step else ""
        epoch = "-" if view.epoch is None else str(view.epoch)
        running = view.proc_state == "running"
        # No exit code beside a running process: a resumed run's previous attempt ended, this one has not.
        process = f"{view.proc_state or '-'}  pid {view.pid or '-'}" + (
            "" if view.exit_code is None or running else f"  exit {view.exit_code}")
        heartbeat = "-" if view.heartbeat_age_s is None else f"{fmt_duration(view.heartbeat_age_s)} ago"
        lines, dropped = model.lines_total, model.dropped
        log = f"{lines:,} lines, {dropped:,} dropped" + (f", {shown:,} shown" if shown != lines else "")
        if view.bad_events:
            log += f"; {bad_events_text(view.bad_events)}"
        ended = ending_text(view)
        link = model.link_text()
        if self.compact:  # two lines, cut at the edge, never wrapped; the run's name first (the bar may cut it)
            t = Text(no_wrap=True, overflow="ellipsis")
            t.append(f"{model.label} ", style="bold")
            t.append_text(state_badge(view))
            # A never-reached host: only the why is known, and this line would cut it; the alerts box says it in
            # full, wrapped (the dashboard passes it as `why`).
            if not (view.state == "unreachable" and not model.state_seen):
                t.append(f" step {view.step:,}{total}{pct}  loss {fmt_num(view.loss, 4)}  tok/s "
                         f"{fmt_num(view.tokens_per_s_avg, 0)}  ETA "
                         f"{fmt_duration(view.eta_s)}")
            if view.tau_step is not None:
                t.append(f"  τ {fmt_num(view.tau, 2)}")
            if view.reason and not (view.state == "unreachable" and not model.state_seen):
                t.append(f"  {view.reason}", style=reason_style(view.state))
            t.append(f"\nphase {phase}  heartbeat {heartbeat}  {ended or process}  link {link}  log {log}",
                     style="dim")
            if group is not None:
                t.append(f"\ngroup {group['name']}/{group['run']} ", style="dim")
                t.append_text(group_badge(group))
                if group.get("reason"):
                    t.append(f" {group['reason']}", style=_group_style(group))
            self.put(t)
            return
        rows = [
            ("phase", phase),
            ("step", f"{view.step:,}{total}{pct}  epoch {epoch}"),
            ("ETA", fmt_duration(view.eta_s)),
            ("loss", fmt_num(view.loss, 4)),
            ("tokens/s", _rate(model, view)),
            ("step time", "-" if view.step_time_s is None else f"{view.step_time_s:.3f} s"),
            ("heartbeat", heartbeat),
            ("process", process),
            ("attempt", attempt_clock(view.to_dict())),
            ("link", link),
            ("log", log),
        ]
        if ended:
            rows.insert(1, ("ended", ended))
        tau = tau_text(view)
        if tau is not None:  # a run that evaluates during training (train.eval_every)
            rows.insert(rows.index(("loss", fmt_num(view.loss, 4))) + 1, ("τ", tau))
        for key, value in rows:
            t.append(f"\n{key:>10} ", style="dim")
            style = "bold red" if key == "log" and (dropped or view.bad_events) else ""
            t.append(value, style=style)
        if group is not None:  # this run is one node of a group run: the group's own state, and why
            t.append(f"\n{'group':>10} {group['name']}/{group['run']} ")
            t.append_text(group_badge(group))
            if group.get("reason"):
                t.append(f"\n{'':>10} {group['reason']}", style=_group_style(group))
        self.put(t)


def group_badge(info: dict[str, Any]) -> Text:
    """A group run's state as a badge: `TRAINING` only when every node trains, `CRASHED (node1)` naming the node
    that died first."""
    state = str(info.get("state") or "absent")
    label = state.upper()
    if state in ("crashed", "refused", "degraded", "unreachable", "stalled", "restarting") and info.get("node") is not None:
        label += f" (node{info['node']})"
    return Text(f" {label} ", style=STATE_STYLES.get(state, "bold reverse"))


def reason_style(state: str | None) -> str:
    """Why a run (or group) is in its state, in red where someone must act (it will not go on by itself), else yellow."""
    return "bold red" if state in ("crashed", "refused", "unreachable") else "yellow"


def _group_style(info: dict[str, Any]) -> str:
    return reason_style(info.get("state"))


def _thin(steps: Sequence[int], values: Sequence[float], width: int) -> tuple[list[int], list[float]]:
    """At most ~2 points per column (a chart cannot show more), keeping the last one."""
    n = len(steps)
    stride = max(1, n // max(1, 2 * width))
    idx = list(range(0, n, stride))
    if idx and idx[-1] != n - 1:
        idx.append(n - 1)
    return [steps[i] for i in idx], [values[i] for i in idx]


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing (an EMA, debiased at the start) of a curve; non-finite values pass through."""
    out: list[float] = []
    last, n = 0.0, 0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        last = last * weight + (1 - weight) * v
        n += 1
        out.append(last / (1 - weight**n))
    return out


class Chart(PlotextPlot):
    """One metric over the whole run (x: step), with axes and labels; raw points faint, the smoothed curve on top."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.key = ""
        self._again: Callable[[], None] | None = None  # the last draw, to redo at a new size

    def on_resize(self) -> None:
        # Ticks, the x label and the thinning depend on the size: a chart first drawn before the layout (or on a
        # terminal that changed size) is drawn again, not stretched.
        if self._again is not None:
            self._again()

    def draw(self, key: str, series: RunSeries, smoothing: float, capacity: int | None,
             marks: Sequence[tuple[int, str]] = ()) -> None:
        self._again = lambda: self.draw(key, series, smoothing, capacity, marks)
        label, colour, unit = CHART_STYLE[key]
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        self.key = key
        width = max(10, self.size.width)
        steps, values = _thin(series.steps, series.values, width)
        finite = [(s, v) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
        note = ""
        fixed = None
        if key == "queue_depth" and capacity:
            # A full reservoir is the normal state of a healthy run (the targets are ahead): draw it on a fixed
            # 0..capacity axis in a calm colour, never as a red wall; the queue alerts say when it is a problem.
            fixed = (0.0, float(capacity))
            note = f" of {capacity} (full: targets ahead)"
        if finite:
            xs = [s for s, _ in finite]
            ys = [v for _, v in finite]
            if smoothing > 0 and len(ys) > 2:
                plt.plot(xs, ys, color="gray", marker="braille")
                plt.plot(xs, smooth(ys, smoothing), color=colour, marker="braille")
            else:
                plt.plot(xs, ys, color=colour, marker="braille")
            lo, hi = xs[0], xs[-1]
            plt.xticks(sorted({round(lo + (hi - lo) * k / 4) for k in range(5)}))
            _y_axis(plt, fixed or (min(ys), max(ys)), AXIS_UNIT.get(key, ""), self.size.height)
            _attempt_lines(plt, marks, lo, hi)
            last = values[-1]
            shown = fmt_num(int(last) if key == "queue_depth" and math.isfinite(last) else last,
                            {"loss": 4, "step_time_s": 3}.get(key, 1))
            title = f"{label} {shown}{unit}{note}"
        else:
            title = f"{label}: no steps yet"
        if len(title) > width - 8:  # plotext drops a title wider than its plot: keep the short form
            title = title.split(" (")[0]
        plt.title(title)
        shown_marks = finite and any(xs[0] <= m <= xs[-1] for m, _ in marks)
        if self.size.height >= 10:  # a short chart (a small terminal) keeps its rows for the curve
            plt.xlabel("step" + ("  (smoothed)" if smoothing > 0 and len(finite) > 2 else "")
                       + ("  │ attempts" if shown_marks else ""))
        self.refresh()


    def draw_tau(self, tau: RunSeries, ngram: RunSeries, view: RunView) -> None:
        """τ at each evaluation over the whole run, never smoothed (each point is exact on the same held-out set: a
        smoothed curve would hide the drop the tau_regression alert is about), prompt lookup's τ faint beside it."""
        self._again = lambda: self.draw_tau(tau, ngram, view)
        plt = self.plt
        plt.clear_data()
        plt.clear_figure()
        self.key = "tau"
        width = max(10, self.size.width)
        if ngram.steps:
            plt.plot(ngram.steps, ngram.values, color="gray", marker="braille")
        if tau.steps:
            plt.plot(tau.steps, tau.values, color="magenta", marker="braille")
            lo, hi = tau.steps[0], tau.steps[-1]
            plt.xticks(sorted({round(lo + (hi - lo) * k / 4) for k in range(5)}))
            values = [v for v in [*tau.values, *ngram.values] if math.isfinite(v)]
            if values:
                _y_axis(plt, (min(values), max(values)), "", self.size.height)
        title = f"τ {tau_text(view)}" if view.tau_step is not None else "τ: no evaluation yet"
        if len(title) > width - 8:
            title = title.split(" (")[0]
        plt.title(title)
        plt.xlabel("step" + ("  (gray: n-gram)" if ngram.steps else ""))
        self.refresh()


AXIS_UNIT = {"step_time_s": "s"}  # tokens/s and queue depth are counts (k/M suffixes), loss and τ plain numbers


def _y_axis(plt: Any, span: tuple[float, float], unit: str, height: int) -> None:
    """Round y ticks with short labels (`4.0k`, `250ms`) over `span`, the axis stretched to the outer ticks."""
    lo, hi = span
    if hi - lo <= 1e-9 * max(abs(lo), abs(hi), 1.0):  # a flat curve (or its smoothing's rounding): centre it
        half = abs(lo) / 2 or 1.0
        lo, hi = lo - half, hi + half
    ticks = nice_ticks(lo, hi, n=5 if height >= 10 else 3)
    if len(ticks) < 2:
        return
    plt.ylim(ticks[0], ticks[-1])
    plt.yticks(ticks, tick_labels(ticks, unit))


def _attempt_lines(plt: Any, marks: Sequence[tuple[int, str]], lo: float, hi: float) -> None:
    """A vertical line where an attempt ended or the next one resumed (RunModel.attempt_marks), inside the curve:
    red for a crash, orange for a signal (a kill), white for a resume."""
    for step, what in marks:
        if lo <= step <= hi:
            plt.vline(step, "red" if what == "error" else ("orange" if what == "signal" else "white"))


CHART_STYLE: dict[str, tuple[str, str, str]] = {
    "loss": ("loss", "green", ""), "tokens_per_s": ("tokens/s", "cyan", ""),
    "step_time_s": ("step time", "yellow", " s"), "queue_depth": ("queue depth", "blue", ""),
    "tau": ("τ", "magenta", ""),
}
# τ first: next to loss whenever the run evaluates (train.eval_every); skipped for a run that has no evaluation yet
RIGHT_CHARTS = ("tau", "tokens_per_s", "step_time_s", "queue_depth")


class Charts(Horizontal):
    """Loss and one more metric (m: τ, tokens/s, step time, queue depth) over the whole run, side by side."""

    DEFAULT_CSS = "Charts { height: 12; } Charts Chart { width: 1fr; height: 1fr; }"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.right = 0
        self.smoothing = 0.6  # TensorBoard's default weight; e: off and on again
        self._model: RunModel | None = None

    def compose(self) -> ComposeResult:
        yield Chart(id="chart-loss")
        yield Chart(id="chart-right")

    def show(self, model: RunModel) -> None:
        self._model = model
        if not self.display or not self.is_mounted:
            return
        capacity = model.tracker.capacity
        left, right = self.query_one("#chart-loss", Chart), self.query_one("#chart-right", Chart)
        left.draw("loss", model.series["loss"], self.smoothing, capacity, model.attempt_marks)
        key = self._right_key(model)
        if key == "tau":
            right.draw_tau(model.series["tau"], model.series["ngram_tau"], model.view())
        else:
            right.draw(key, model.series[key], self.smoothing, capacity, model.attempt_marks)

    def _right_key(self, model: RunModel | None) -> str:
        """The right chart's metric: τ only for a run that has evaluated (else the next one)."""
        key = RIGHT_CHARTS[self.right]
        if key == "tau" and (model is None or not model.series["tau"]):
            key = RIGHT_CHARTS[(self.right + 1) % len(RIGHT_CHARTS)]
        return key

    def next_metric(self) -> str:
        shown = self._right_key(self._model)
        self.right = (RIGHT_CHARTS.index(shown) + 1) % len(RIGHT_CHARTS)
        if self._model is not None:
            self.show(self._model)
        return CHART_STYLE[self._right_key(self._model)][0]

    def toggle_smoothing(self) -> float:
        self.smoothing = 0.0 if self.smoothing else 0.6
        if self._model is not None:
            self.show(self._model)
        return self.smoothing


def _bar(frac: float | None, width: int, warn: bool = False) -> Text:
    """`██████▌░░░`: a fraction as a bar of `width` cells (eighths for the last cell); `warn`: yellow from 80 %,
    red from 95 % (memory; a busy GPU is what we want, its util bar stays green)."""
    if width <= 0:
        return Text()
    if frac is None or not math.isfinite(frac):
        return Text("·" * width, style="dim")
    frac = min(1.0, max(0.0, frac))
    eighths = int(round(frac * width * 8))
    full, part = divmod(eighths, 8)
    cells = "█" * full + ("▏▎▍▌▋▊▉"[part - 1] if part else "")
    style = "green" if not warn else ("red" if frac >= 0.95 else ("yellow" if frac >= 0.8 else "cyan"))
    return Text.assemble((cells, style), ("░" * (width - len(cells)), "dim"))


def _owner(proc: dict[str, Any], view: RunView) -> str:
    """`run` / `other` / `hidden` when the agent tags the process (`whose`), `run` for the run's own pid, else ``."""
    whose = proc.get("whose")
    if isinstance(whose, str):
        return whose
    return "run" if proc.get("pid") in (view.pid, view.pgid) and proc.get("pid") is not None else ""


class GpuPanel(Widget):
    """One row per GPU, nvitop-like: util (bar, or history with g), memory used/total as a bar, power, temperature,
    SM/memory clocks and the processes on it (pid, memory, whether it is the run's). Eight GPUs fit 80x24."""

    DEFAULT_CSS = "GpuPanel { height: auto; }"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._gpus: list[dict[str, Any]] = []
        self._hist: dict[int, dict[str, Sequence[float]]] = {}
        self._nvml: str | None = None
        self._view = RunView()
        self.history = False  # g: sparklines of util and memory instead of bars
        self.collapsed = False  # one summary line: a small terminal showing the charts (tui.WatchApp._layout_for)

    def show(self, view: RunView, hist: dict[int, dict[str, Sequence[float]]]) -> None:
        relayout = len(view.gpus) != len(self._gpus)
        self._gpus, self._hist, self._nvml, self._view = list(view.gpus), hist, view.nvml, view
        self.refresh(layout=relayout)

    def toggle_history(self) -> bool:
        self.history = not self.history
        self.refresh()
        return self.history

    def collapse(self, collapsed: bool) -> None:
        if collapsed != self.collapsed:
            self.collapsed = collapsed
            self.refresh(layout=True)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return 1 + len(self._gpus) if self._gpus and not self.collapsed else 1

    def render(self) -> Text:
        if not self._gpus:
            return Text(f"GPUs: none reported (nvml: {self._nvml or 'no sample yet'})", style="dim")
        if self.collapsed:
            return self._one_line()
        width = max(60, self.size.width)
        both_clocks = width >= 100  # narrow: the SM clock only
        clock_w = 10 if both_clocks else 5
        # fixed columns: idx 4, util 5, mem 11, power 6, temp 6, clocks (+ spaces); the bars and the processes
        # share the rest, bars first up to 20 cells each
        rest = width - (4 + 5 + 11 + 6 + 6 + clock_w + 7)
        bar = max(6, min(20, rest // 3))
        procs_w = max(6, rest - 2 * bar)
        t = Text()
        t.append(f"{'GPU':>3} {'util':>4} {'(history)' if self.history else '':<{bar}} {'memory':>10} "
                 f"{'':<{bar}} {'power':>5} {'temp':>5} {'SM/mem MHz' if both_clocks else 'SM':>{clock_w}} "
                 "processes", style="bold dim")
        for n, g in enumerate(self._gpus):
            idx = g.get("index", n)
            h = self._hist.get(idx, {}) if isinstance(idx, int) else {}
            used, total, util = g.get("mem_used_mb"), g.get("mem_total_mb"), g.get("util")
            num = isinstance(used, (int, float)) and isinstance(total, (int, float)) and total > 0
            t.append(f"\n{idx!s:>3} ", style="bold")
            t.append(f"{fmt_num(util, 0):>3}% ")
            if self.history:
                t.append(f"{spark(h.get('util', []), bar, 0, 100):<{bar}}", style="green")
            else:
                t.append_text(_bar(util / 100 if isinstance(util, (int, float)) else None, bar))
            mem = f"{used / 1024:.1f}/{total / 1024:.0f}G" if num else "-"  # type: ignore[operator]
            t.append(f" {mem:>10} ")
            if self.history:
                t.append(f"{spark(h.get('mem_used_mb', []), bar, 0, total if num else None):<{bar}}", style="cyan")
            else:
                t.append_text(_bar(used / total if num else None, bar, warn=True))  # type: ignore[operator]
            temp = g.get("temp_c")
            t.append(f" {fmt_num(g.get('power_w'), 0):>4}W")
            t.append(f" {fmt_num(temp, 0):>3}°C",
                     style="red" if isinstance(temp, (int, float)) and temp >= 85 else "")
            clocks = f"{fmt_num(g.get('sm_clock_mhz'), 0)}" + (
                f"/{fmt_num(g.get('mem_clock_mhz'), 0)}" if both_clocks else "")
            t.append(f" {clocks.replace(',', ''):>{clock_w}} ")
            t.append_text(self._procs(g.get("procs") or [], procs_w))
        return t

    def _one_line(self) -> Text:
        """Every GPU in one line (mean util, memory used of total, hottest): the table returns when the charts go."""
        def nums(key: str) -> list[float]:
            return [float(g[key]) for g in self._gpus if isinstance(g.get(key), (int, float))]

        util, used, total, temp = nums("util"), nums("mem_used_mb"), nums("mem_total_mb"), nums("temp_c")
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f"{len(self._gpus)} GPU{'s' if len(self._gpus) != 1 else ''}", style="bold")
        t.append(f"  util {fmt_num(sum(util) / len(util), 0) if util else '-'}% avg")
        if used and total:
            t.append(f"  memory {sum(used) / 1024:.0f}/{sum(total) / 1024:.0f}G")
        if temp:
            t.append(f"  max {fmt_num(max(temp), 0)}°C", style="red" if max(temp) >= 85 else "")
        t.append("  (v: hide charts for the table)", style="dim")
        return t

    def _procs(self, procs: list[dict[str, Any]], width: int) -> Text:
        """`pid memG owner` per process while they fit, then `pid owner`, then a count; `+N` for the rest."""
        if not procs:
            return Text("none", style="dim")
        for with_mem in (True, False):
            out = Text(no_wrap=True, overflow="ellipsis")
            fitted = 0
            for i, p in enumerate(procs):
                owner = _owner(p, self._view)
                used = p.get("used_mb")
                part = str(p.get("pid"))
                if with_mem:
                    part += f" {fmt_num(used / 1024, 1) + 'G' if isinstance(used, (int, float)) else '?'}"
                part += f" {owner}" if owner else ""
                more = len(f" +{len(procs) - i - 1}") if i < len(procs) - 1 else 0
                if out.cell_len + (1 if i else 0) + len(part) + more > width:
                    break
                out.append(" " if i else "")
                out.append(part, style="green" if owner == "run" else ("yellow" if owner == "other" else ""))
                fitted += 1
            if fitted:
                if fitted < len(procs):
                    out.append(f" +{len(procs) - fitted}", style="dim")
                return out
        return Text(f"{len(procs)} proc{'s' if len(procs) != 1 else ''}", style="dim")


class AlertsPanel(_Quiet):
    """Every active alert with its evidence, critical ones first; `compact`: one line per alert, wrapped (not cut)
    when its evidence is longer than the terminal is wide."""

    compact = False

    def show(self, alerts: Sequence[Alert], quiet: str = "no alerts", why: str | None = None) -> None:
        """`quiet`: what to say with no alert (a host never reached has no alert rules to run, not a clean bill).
        `why`: an error said first, in full (a never-reached host's, on a small terminal where the summary line
        would cut it). Compact or not, long lines wrap rather than being cut: the evidence is the point."""
        # The box's colour says the worst alert in it: calm with none, yellow for warnings, red for a critical one.
        worst = "none" if not alerts else ("critical" if any(a.severity == CRITICAL for a in alerts) else "warning")
        for level in ("none", "warning", "critical"):
            self.set_class(level == worst, f"-{level}")
        self.set_class(bool(why) and not alerts, "-why")  # room for the error and the line under it
        if not alerts:
            t = Text(quiet, style="dim green" if quiet == "no alerts" else "dim")
            if why:
                t = Text.assemble((why, "bold red"), "\n", t)
            self.put(t)
            return
        t = Text()
        ordered = sorted(alerts, key=lambda a: (a.severity != CRITICAL, a.key))
        for i, a in enumerate(ordered):
            if i:
                t.append("\n")
            style = "bold white on red" if a.severity == CRITICAL else "bold black on yellow"
            t.append(f" {a.title} ", style=style)
            t.append(f" {a.evidence}" if self.compact else f"\n  {a.evidence}")
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
        self._synced: tuple[Any, ...] = ()  # what `sync` last drew: size, last line, count, follow, list

    # -- data -----------------------------------------------------------------------------
    @property
    def lines(self) -> deque[LogLine]:
        return self._filtered if self._filtered is not None else self._source

    def attach(self, source: deque[LogLine]) -> None:
        """Show another run's ring buffer (tab to the next run)."""
        self._source = source
        self._synced = ()
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
        size = Size(max(1, self.scrollable_content_region.width), len(lines))
        drawn = (size, lines[-1].seq if lines else -1, len(lines), self.follow, id(lines))
        if drawn == self._synced and not moved_up:
            return  # nothing new: no redraw (the batch loop calls this ten times a second, an idle run must cost ~0)
        self._synced = drawn
        self._programmatic += 1
        try:
            self.virtual_size = size
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
        self._synced = ()
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
        self._synced = ()
        self.sync()

    def action_follow(self) -> None:
        self.follow = True
        self._synced = ()
        self.sync()

    def set_search(self, term: str) -> None:
        """Highlight `term` and jump to its latest occurrence (pausing the follow); empty clears the search."""
        self.search = term
        self._search_re = re.compile(re.escape(term), re.IGNORECASE) if term else None
        if not term:
            self.follow = True
            self._synced = ()
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



class WatchFooter(Footer):
    """The key bar, made to fit: full labels when they fit; else short labels (compact style), and then the least
    needed keys left out until the rest fit, `q quit` last of all. Every key still works whether shown or not."""

    # Shorter words for narrow terminals (80 columns), by action.
    SHORT = {"next_run": "next", "reconnect": "reconn", "screenshot": "snap", "severity": "filter", "search": "find"}
    # Most needed first: what a narrow footer keeps. Actions not listed come last.
    PRIORITY = ("quit", "charts", "screenshot", "kill", "next_run", "severity", "search", "reconnect", "clean", "follow")

    def compose(self) -> ComposeResult:
        if not self._bindings_ready:
            return
        active = self.screen.active_bindings
        seen: set[str] = set()
        keys: list[tuple[Binding, bool, str]] = []
        for _, binding, enabled, tooltip in active.values():
            if binding.show and binding.action not in seen:
                seen.add(binding.action)
                keys.append((binding, enabled, tooltip))
        width = self.app.size.width
        full, short = self.fit(keys, width)
        self.compact = not full
        palette = None
        if self.show_command_palette and self.app.ENABLE_COMMAND_PALETTE and full:
            palette = active.get(self.app.COMMAND_PALETTE_BINDING)
            used = sum(self.item_width(self.app.get_key_display(b), b.description, False) for b, _, _ in short)
            if palette is not None and used + self.item_width(
                    self.app.get_key_display(palette[1]), palette[1].description, False) > width:
                palette = None
        for binding, enabled, tooltip in short:
            key = FooterKey(binding.key, self.app.get_key_display(binding),
                            binding.description if full else self.SHORT.get(binding.action, binding.description),
                            binding.action, disabled=not enabled, tooltip=tooltip or binding.description)
            key.compact = not full
            yield key
        if palette is not None:
            _, binding, enabled, tooltip = palette
            yield FooterKey(binding.key, self.app.get_key_display(binding), binding.description, binding.action,
                            classes="-command-palette", disabled=not enabled,
                            tooltip=binding.tooltip or binding.description)

    @staticmethod
    def item_width(key: str, description: str, compact: bool) -> int:
        """Cells one key takes: ` k kill ` in the normal style, `k kill` and a one-cell margin when compact."""
        return len(key) + 1 + len(description) + (1 if compact else 2)

    def fit(self, keys: list[tuple[Binding, bool, str]], width: int) -> tuple[bool, list[tuple[Binding, bool, str]]]:
        """(full labels?, the keys shown, in their order): full when they all fit; else short labels and the least
        needed keys dropped until the rest fit in `width`."""
        display = self.app.get_key_display
        if sum(self.item_width(display(b), b.description, False) for b, _, _ in keys) <= width:
            return True, keys

        def need(item: tuple[Binding, bool, str]) -> int:
            action = item[0].action
            return self.PRIORITY.index(action) if action in self.PRIORITY else len(self.PRIORITY)

        shown = list(keys)
        widths = {id(k): self.item_width(display(k[0]), self.SHORT.get(k[0].action, k[0].description), True)
                  for k in keys}
        for item in sorted(keys, key=need, reverse=True):
            if sum(widths[id(k)] for k in shown) <= width or item[0].action == "quit":
                break
            shown.remove(item)
        return False, shown
