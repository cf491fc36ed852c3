"""`launch --follow --progress` and `logs -f --progress`: a training run's steps as one progress bar, not one line each.

A 1200-step run printed 1200 step lines while followed (what `./dev demo` showed). Here the bar is drawn from the
event stream (docs/events.md: `step`, `eval`, `checkpoint`), with the numbers `status` and `watch` show (one
RunState): step/total, loss, tau of the last in-training `eval`, tokens/s, ETA. The log itself still holds
every line (`opsctl logs HOST RUN`); while the bar shows, only warnings and errors of the log are printed (a traceback
whole), and one line per evaluation and checkpoint. Into a pipe or file: one progress line per `every` steps
(about 20 for the whole run), never one per step.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

from opsctl.runstate import RunState, RunView
from opsctl.watch import SEV_WARNING, SeverityClassifier, fmt_duration

PIPE_LINES = 20  # into a pipe: about this many progress lines for a whole run, whatever its length


def _num(x: Any, digits: int) -> str:
    return "-" if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) else f"{x:.{digits}f}"


def progress_fields(view: RunView) -> dict[str, str]:
    """The bar's (and the pipe line's) numbers, formatted once so both say the same."""
    tokens = view.tokens_per_s_avg
    return {"loss": _num(view.loss, 4), "tau": _num(view.tau, 2),
            "rate": "-" if tokens is None else f"{tokens:,.0f}", "eta": fmt_duration(view.eta_s)}


class TrainProgress:
    """Renders a followed run's training from its messages (the agent's `log` and `event` lines).

    Idle until training starts (its `phase` event, or a first `step`; before it, the launch's phase bars and log lines are shown as they were);
    then `log_line` says whether a log line is still to be printed, and `event` moves the bar."""

    def __init__(self, console: Console, out: Console, state: RunState, where: str) -> None:
        self.console = console  # the bar (stderr, as the launch's phase bars)
        self.out = out  # the pipe form's lines and the lines printed above the bar
        self.state = state
        self.where = where  # how to read the whole log: `opsctl logs HOST RUN`
        self.live = console.is_terminal
        self.active = False
        self.shown_lines = 0
        self._classify = SeverityClassifier()
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._last_bucket = -1
        self._last_step: int | None = None
        self._printed = ""

    def _say(self, text: Text | str) -> None:
        if self._progress is not None and self._progress.live.is_started:
            self._progress.console.print(text, soft_wrap=True)
        else:
            self.out.print(text, soft_wrap=True, markup=False, highlight=False)

    def _start(self, total: int | None) -> None:
        self.active = True
        self._say(Text(f"training: progress below; every log line stays in the log ({self.where}); warnings and "
                       "errors are shown here", style="dim"))
        if self.live:
            self._progress = Progress(
                TextColumn("[bold green]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  τ {task.fields[tau]}  {task.fields[rate]} tok/s  "
                           "ETA {task.fields[eta]}"),
                TimeElapsedColumn(), console=self.console, transient=False, redirect_stdout=False,
                redirect_stderr=False)
            self._progress.start()
            self._task = self._progress.add_task("train", total=total, loss="-", tau="-", rate="-", eta="-")

    def log_line(self, line: str) -> bool:
        """Whether the caller should print this log line: every line before training, then warnings and errors
        only (printed here, above the bar, when it shows: the caller then prints nothing)."""
        sev = self._classify(line)
        if not self.active:
            return True
        if sev < SEV_WARNING:
            return False
        if self._progress is not None:
            self._say(Text(line, style="red" if sev > SEV_WARNING else "yellow"))
            return False
        return True

    def event(self, ev: dict[str, Any]) -> None:
        """One telemetry event, after the caller's `state.apply` of its message."""
        kind = ev.get("kind")
        if kind == "phase" and ev.get("phase") == "training" and not self.active:
            self._start(self.state.view().total_steps)  # before the first step's own log line
        elif kind == "step" and isinstance(ev.get("step"), int):
            view = self.state.view()
            if not self.active:
                self._start(view.total_steps)
            self._step(view)
        elif not self.active:
            return
        elif kind == "eval":
            view = self.state.view()
            ngram = f" (n-gram {_num(view.ngram_tau, 2)})" if view.ngram_tau is not None else ""
            self._say(Text(f"eval step {ev.get('step')}: τ {_num(ev.get('tau'), 2)}{ngram}", style="cyan"))
            self._refresh(view)
        elif kind == "checkpoint":
            self._say(Text(f"checkpoint step {ev.get('step')}: {ev.get('path')}", style="dim"))
        elif kind == "run_end":
            self.stop()

    def _fields(self, view: RunView) -> dict[str, str]:
        return progress_fields(view)

    def _refresh(self, view: RunView) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=view.step, total=view.total_steps or None,
                                  **self._fields(view))

    def _step(self, view: RunView) -> None:
        self._last_step = view.step
        if self._progress is not None:
            self._refresh(view)
            return
        total = view.total_steps or 0
        every = max(1, math.ceil(total / PIPE_LINES)) if total else 50
        bucket = view.step // every
        if bucket != self._last_bucket or (total and view.step == total):
            self._last_bucket = bucket
            self._print_line(view)

    def _line(self, view: RunView) -> str:
        f = self._fields(view)
        of = f"/{view.total_steps}" if view.total_steps else ""
        return f"step {view.step}{of}  loss {f['loss']}  τ {f['tau']}  {f['rate']} tok/s  ETA {f['eta']}"

    def _print_line(self, view: RunView) -> None:
        self._printed = self._line(view)
        self.out.print(self._printed, soft_wrap=True, markup=False, highlight=False)
        self.shown_lines += 1

    def stop(self) -> None:
        """The run ended (or the follow did): the bar stays on screen at its last step; no more redraws."""
        if self._progress is not None and self._progress.live.is_started:
            self._refresh(self.state.view())
            self._progress.stop()
        elif self._progress is None and self.active and self._last_step is not None:
            view = self.state.view()  # the pipe's last line: the run's end (a final eval's τ included)
            view.eta_s = None
            if self._line(view) != self._printed:
                self._print_line(view)
