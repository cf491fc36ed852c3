"""Launch phases as one rich progress bar (`loading_target 12/64`, then `compiling`, ...) on a terminal, and as
one line per phase into a pipe: a 64-layer load is one moving bar, not 64 lines.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text


def settled_line(line: str) -> str:
    """A log line as a terminal leaves it: a carriage-return progress bar (tqdm's `Loading weights: 42%|...`, one
    state per `\r`, a newline only at the end) becomes its last drawn state. Printed whole, rich strips the `\r`s and
    the states run together into screens of bar; the log file keeps every state."""
    if "\r" not in line:
        return line
    states = [s.rstrip() for s in line.split("\r")]
    return next((s for s in reversed(states) if s.strip()), "")


class PhaseProgress:
    """Shows the training core's `phase` events (docs/events.md) while a launch waits for its first step.

    On a terminal: one bar per phase, the current one moving (i of n when the phase reports it, a pulse when not),
    earlier ones left complete above it; log lines print above the bars. Elsewhere: one `phase NAME` line when the
    phase changes, never one per i/n update."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal
        self.phase: str | None = None
        self._task: TaskID | None = None
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(SpinnerColumn(), TextColumn("[bold cyan]{task.description:<16}"), BarColumn(),
                                      MofNCompleteColumn(), TextColumn("{task.fields[detail]}", style="dim"),
                                      TimeElapsedColumn(), console=console, transient=False, redirect_stdout=False,
                                      redirect_stderr=False)

    def update(self, phase: Any, i: Any = None, n: Any = None, detail: Any = None) -> None:
        name = str(phase)
        counted = isinstance(i, int) and isinstance(n, int) and n > 0
        if self._progress is None:
            if name != self.phase:
                self.console.print(Text(f"phase {name}", style="dim"))
            self.phase = name
            return
        if name != self.phase:
            self._finish_task()
            if not self._progress.live.is_started:
                self._progress.start()
            self._task = self._progress.add_task(name, total=n if counted else None, detail=str(detail or ""))
            self.phase = name
        assert self._task is not None
        self._progress.update(self._task, completed=i if counted else None, total=n if counted else None,
                              detail=str(detail or ""))

    def _finish_task(self) -> None:
        if self._progress is not None and self._task is not None:
            task = self._progress.tasks[-1]
            total = task.total if task.total is not None else 1
            self._progress.update(self._task, total=total, completed=total)

    def line(self, text: str) -> bool:
        """Print a log line above the bars when they are showing (True), else leave it to the caller (False)."""
        if self._progress is None or not self._progress.live.is_started:
            return False
        self._progress.console.print(Text(text), soft_wrap=True)
        return True

    def stop(self) -> None:
        """The run is training (or the launch ended): complete the last bar and stop redrawing."""
        if self._progress is not None and self._progress.live.is_started:
            self._finish_task()
            self._progress.stop()
