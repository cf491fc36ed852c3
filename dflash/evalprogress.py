"""Progress of `dflash eval` on stderr, so minutes of target forwards are not minutes of silence.

On a terminal: one rich progress bar per phase (prompts done, tokens/s, ETA), redrawn in place. Anywhere else (a pipe,
a file, opsctl's log): plain lines, one per finished prompt batch, at most one a second plus the last of each phase,
never wrapped (rich is not used for them, so no 80-column console width applies). stdout is left alone: `--json`
output stays one JSON object.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class EvalProgress:
    """Phases (`target continuations`, `drafter pass`, ...) of `total` prompts each; `advance` after each batch."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None, min_interval_s: float = 1.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = isatty(self.stream) if tty is None else tty
        self.min_interval_s = min_interval_s
        self._bar: Any = None  # rich.progress.Progress, on a terminal
        self._task: Any = None
        self._name, self._total, self._done, self._tokens = "", 0, 0, 0
        self._t0 = self._last_line = 0.0
        self._final_written = False

    def phase(self, name: str, total: int) -> None:
        """Start a phase of `total` prompts (the previous one is closed as it stands)."""
        self._finish_line()
        self._name, self._total, self._done, self._tokens = name, max(0, total), 0, 0
        self._t0 = time.perf_counter()
        self._last_line = self._t0
        self._final_written = False
        if self.tty:
            if self._bar is None:
                self._bar = _rich_progress(self.stream)
                self._bar.start()
            self._task = self._bar.add_task(name, total=self._total, tps="-")

    def advance(self, prompts: int = 1, tokens: int = 0) -> None:
        """`prompts` more done, `tokens` more tokens processed (generated or scored) by them."""
        self._done = min(self._total, self._done + prompts)
        self._tokens += tokens
        if self._bar is not None:
            self._bar.update(self._task, completed=self._done, tps=self._rate())
            return
        now = time.perf_counter()
        if self._done >= self._total:
            if not self._final_written:
                self._line()
                self._final_written = True
        elif prompts and now - self._last_line >= self.min_interval_s:  # a batch of prompts finished
            self._line()
            self._last_line = now

    def close(self) -> None:
        """End the last phase (its final line if it has not been written) and stop the bar."""
        self._finish_line()
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> EvalProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------------------------
    def _rate(self) -> str:
        dt = time.perf_counter() - self._t0
        return f"{self._tokens / dt:,.0f}" if dt > 0 and self._tokens else "-"

    def _line(self) -> None:
        dt = time.perf_counter() - self._t0
        if self._done >= self._total:
            tail = f"done in {dt:.1f} s"
        elif self._done:
            tail = f"eta {dt / self._done * (self._total - self._done):.0f} s"
        else:
            tail = "eta -"
        self.stream.write(f"dflash eval: {self._name}: {self._done}/{self._total} prompts, {self._rate()} tokens/s, "
                          f"{tail}\n")
        self.stream.flush()

    def _finish_line(self) -> None:
        """A phase ended early (nothing to do, or an error) without its last plain line: write it."""
        if not self.tty and self._name and not self._final_written:
            self._line()
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self._done, tps=self._rate())
        self._name = ""


def isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _rich_progress(stream: TextIO) -> Any:
    """Columns that fit an 80-column terminal with the longest phase name (rich cuts a line that does not fit)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(bar_width=12), MofNCompleteColumn(),
                    TextColumn("prompts  {task.fields[tps]} tokens/s  eta"), TimeRemainingColumn(compact=True),
                    console=Console(file=stream), transient=False)
