"""`opsctl watch --plain` (a rich Live view for terminals without full-screen support) and `--once --json`.

Both reuse the dashboard's workers, RunModel and alert rules, so they report exactly what the TUI shows.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from opsctl.alerts import CRITICAL
from opsctl.look import spark, state_badge
from opsctl.watch import (
    RunModel,
    SourceWorker,
    WatchSource,
    bad_events_text,
    ending_text,
    fmt_duration,
    fmt_num,
    fold,
    link_msg,
    stall_after_of,
    tau_drop_of,
    tau_text,
)

ONCE_TIMEOUT_S = 10.0  # --once: a source silent this long (no answer, or a stream that stopped) is given up
PLAIN_HZ = 4.0
PRINT_EVERY_S = 5.0  # --plain into a pipe or file: at most one snapshot this often


def snapshot_once(sources: Sequence[WatchSource], timeout_s: float = ONCE_TIMEOUT_S,
                  clock: Callable[[], float] | None = None) -> list[dict[str, Any]]:
    """Follow every source until its backlog is in (the agent's `backlog_end`) or its stream ended; one dict per run.

    Never a quiet spell as the end: a host busy reading a huge log says nothing for seconds and is not done. A source
    silent for `timeout_s` is given up: unreachable when it never answered, or when its stream stopped short."""
    if timeout_s <= 0:
        raise ValueError("timeout_s must be > 0")
    models = [RunModel(s.label, clock=clock, stall_after_s=stall_after_of(s), tau_drop=tau_drop_of(s)) for s in sources]
    workers = [SourceWorker(s) for s in sources]
    for w in workers:
        w.start()
    start = time.monotonic()
    given_up = [False] * len(workers)
    try:
        while True:
            now = time.monotonic()
            fold(workers, models)
            for i, w in enumerate(workers):
                done = w.ended.is_set() or w.caught_up.is_set()
                heard = w.last_agent_msg or start  # the watcher's own link messages (retries) are no answer
                given_up[i] = not done and now - heard >= timeout_s
            settled = [w.ended.is_set() or w.caught_up.is_set() or g for w, g in zip(workers, given_up, strict=True)]
            if all(settled) and not any(w.pending() for w in workers):
                break
            time.sleep(0.02)
        fold(workers, models)
    finally:
        for w in workers:
            w.stop()
    for w, m, g in zip(workers, models, given_up, strict=True):
        if not w.received or not m.heard:
            m.mark_unreachable(f"no answer within {timeout_s:g} s ({m.link})")
        elif g:
            m.ingest(link_msg("lost", f"the stream stopped before its backlog was complete (nothing for "
                                      f"{timeout_s:g} s)"))
    return [m.snapshot(log=getattr(getattr(s, "run", None), "log", None)) for m, s in zip(models, sources, strict=True)]


def render_run(model: RunModel, log_lines: int = 8) -> Panel:
    """One run as a rich panel: the same facts as the TUI's summary, GPUs, alerts and log tail."""
    view = model.view()
    alerts = model.alerts(view)
    head = Text()
    head.append(model.label + "  ", style="bold")
    head.append_text(state_badge(view))
    if view.reason:
        head.append(f" {view.reason}", style="bold red" if view.state in ("crashed", "unreachable") else "yellow")
    ended = ending_text(view)
    if ended:
        head.append(f"  ended {ended}")
    total = f"/{view.total_steps:,}" if view.total_steps else ""
    head.append(f"  step {view.step:,}{total}  epoch {'-' if view.epoch is None else view.epoch}"
                f"  loss {fmt_num(view.loss, 4)}  tok/s {fmt_num(view.tokens_per_s_avg, 0)}"
                f"  ETA {fmt_duration(view.eta_s)}  heartbeat "
                f"{'-' if view.heartbeat_age_s is None else fmt_duration(view.heartbeat_age_s) + ' ago'}"
                f"  link {model.link_text()}  log {model.lines_total:,} lines, {model.dropped:,} dropped"
                + (f"; {bad_events_text(view.bad_events)}" if view.bad_events else ""))
    tau = tau_text(view)
    if tau is not None:
        head.append(f"  τ {tau}")
    parts: list[Any] = [head]
    if view.gpus:
        table = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
        for col in ("gpu", "util", "", "mem", "power", "temp", "procs"):
            table.add_column(col)
        for g in view.gpus:
            idx = g.get("index")
            hist = model.gpu_hist.get(idx, {}) if isinstance(idx, int) else {}
            used, tot = g.get("mem_used_mb"), g.get("mem_total_mb")
            mem = f"{used / 1024:.1f}/{tot / 1024:.0f}G" if isinstance(used, (int, float)) and isinstance(
                tot, (int, float)) else "-"
            procs = " ".join(str(p.get("pid")) for p in (g.get("procs") or [])) or "none"
            table.add_row(f"GPU{idx}", f"{fmt_num(g.get('util'), 0)}%", spark(hist.get("util", []), 16, 0, 100), mem,
                          f"{fmt_num(g.get('power_w'), 0)}W", f"{fmt_num(g.get('temp_c'), 0)}°C", procs)
        parts.append(table)
    else:
        parts.append(Text(f"GPUs: none reported (nvml: {view.nvml or 'no sample yet'})", style="dim"))
    for a in alerts:
        style = "bold white on red" if a.severity == CRITICAL else "bold black on yellow"
        parts.append(Text.assemble((f" {a.title} ", style), f" {a.evidence}"))
    for line in list(model.log)[-log_lines:]:
        parts.append(Text(line.text, style="red" if line.sev == 2 else "", overflow="ellipsis", no_wrap=True))
    return Panel(Group(*parts), title=model.label)


def run_plain(sources: Sequence[WatchSource], bell: bool = False, hz: float = PLAIN_HZ,
              stream: TextIO | None = None, exit_when_ended: bool = True, print_every_s: float = PRINT_EVERY_S) -> int:
    """Live view until Ctrl-C (or until every stream has ended); exit code 0.

    On a terminal the view updates in place (rich Live). Into a pipe or file, Live would print nothing until the
    end, so there a fresh snapshot is printed whenever something changed, at most every `print_every_s`.
    """
    if hz <= 0 or print_every_s <= 0:
        raise ValueError("hz and print_every_s must be > 0")
    console = Console(file=stream or sys.stdout)
    models = [RunModel(s.label, stall_after_s=stall_after_of(s), tau_drop=tau_drop_of(s)) for s in sources]
    workers = [SourceWorker(s) for s in sources]
    seen: list[set[str]] = [set() for _ in sources]
    for w in workers:
        w.start()

    def frame() -> Group:
        panels = []
        for i, m in enumerate(models):
            panels.append(render_run(m))
            keys = {a.key for a in m.alerts(m.view())}
            if bell and keys - seen[i]:
                console.bell()
            seen[i] = keys
        return Group(*panels)

    def finished() -> bool:
        return exit_when_ended and all(w.ended.is_set() and not w.pending() for w in workers)

    try:
        if console.is_terminal:
            with Live(console=console, refresh_per_second=hz, transient=False) as live:
                while True:
                    fold(workers, models)
                    live.update(frame())
                    if finished():
                        break
                    time.sleep(1.0 / hz)
        else:
            last_print = -math.inf
            versions: list[int] = []
            while True:
                fold(workers, models)
                done = finished()
                now = time.monotonic()
                current = [m.version for m in models]
                if done or (current != versions and now - last_print >= print_every_s):
                    console.print(frame())
                    versions, last_print = current, now
                if done:
                    break
                time.sleep(1.0 / hz)
    except KeyboardInterrupt:
        pass
    finally:
        for w in workers:
            w.stop()
    return 0
