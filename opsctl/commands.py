"""The opsctl verbs (launch, status, logs, kill, clean, hosts check) on top of transports and the remote agent.

Each verb streams the agent's JSON lines and renders them; nothing here sleeps to poll a remote: it reads a stream.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from opsctl.alerts import AlertTracker
from opsctl.channel import ChannelLost, run_args, stream_agent
from opsctl.config import HostConfig, Inventory, InventoryError, RunConfig, check_inventory, load_inventory, resolve
from opsctl.inventory import BUILTIN, builtin_notice, discover, write_init, write_init_config
from opsctl.look import STATE_STYLES
from opsctl.progress import PhaseProgress, settled_line
from opsctl.remote.base import EXIT_CODES
from opsctl.runstate import ENDED_STATES, RunState, RunView, attempt_clock, phase_progress, unreachable_view
from opsctl.transport import PermanentTransportError, PreflightRefused, Transport, TransportError, transport_for
from opsctl.watch import (
    AgentSource,
    bad_events_text,
    fmt_duration,
    follow_connection,
    reconnect_delay,
    reconnecting,
    run_record,
    state_label,
)

# The agent's exit codes are opsctl's (its `bye rc` is what a verb returns): one table, in the agent.
EXIT_OK = EXIT_CODES["ok"]  # done / the run is ready / the run finished with status 0
EXIT_FAILED = EXIT_CODES["failed"]  # the run crashed or failed, or kill left survivors
EXIT_USAGE = EXIT_CODES["usage"]  # bad command line or hosts.yaml
EXIT_TRANSPORT = EXIT_CODES["transport"]  # host unreachable, host key refused, channel lost
EXIT_TIMEOUT = EXIT_CODES["timeout"]  # the run did not become ready within ready_timeout (it was left running)
EXIT_REFUSED = EXIT_CODES["refused"]  # preflight refused the launch (container stopped, GPUs busy, model dir, ...)
EXIT_TAKEN_OVER = EXIT_CODES["taken_over"]  # launch GROUP RUN --follow: another opsctl took over its supervision



PIPE_WIDTH = 1000  # into a pipe or file: lines as long as they are, not rich's default of 80 columns


def console(stderr: bool = False) -> Console:
    """A rich console that, into a pipe or file (and no COLUMNS set), neither wraps tables at 80 columns nor breaks
    a message mid-sentence: `opsctl status | grep`, logs of CI jobs and `2> err.txt` read whole lines."""
    con = Console(stderr=stderr, highlight=False)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con = Console(stderr=stderr, highlight=False, width=PIPE_WIDTH, soft_wrap=True)
    return con


class OpsError(Exception):
    """An operator-facing failure with the exit code it maps to."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Ctx:
    """What every verb needs: the inventory, where to print, and transport options."""

    hosts_file: str | None = None
    accept_new_host_key: bool = False
    out: Console = field(default_factory=console)
    err: Console = field(default_factory=lambda: console(stderr=True))
    raw: TextIO = field(default_factory=lambda: sys.stdout)  # log lines go here verbatim
    _inv: Inventory | None = None
    transport_factory: Callable[[HostConfig], Transport] | None = None  # tests may inject one (a real one)

    def inventory(self) -> Inventory:
        """hosts.yaml as found by opsctl.inventory.discover; the built-in fallback is said on stderr, once."""
        if self._inv is None:
            self.quiet_inventory()
            if self._inv is not None and self._inv.path is None:
                self.err.print(Text(f"opsctl: {builtin_notice()}", style="dim"), soft_wrap=True)
        assert self._inv is not None
        return self._inv

    def quiet_inventory(self) -> Inventory:
        """The inventory without the built-in notice (shell completion must print nothing but candidates)."""
        if self._inv is None:
            found = discover(self.hosts_file)
            try:
                self._inv = load_inventory(found.path)
            except InventoryError as exc:
                raise OpsError(str(exc), EXIT_USAGE) from None
        return self._inv

    def resolve(self, host: str, run: str | None) -> tuple[HostConfig, RunConfig | None]:
        try:
            return resolve(self.inventory(), host, run)
        except InventoryError as exc:
            if self.inventory().path is None:  # never name a hosts.yaml that does not exist
                exc = InventoryError([p._replace(file=BUILTIN) for p in exc.problems])
            raise OpsError(str(exc), EXIT_USAGE) from None

    def runs_of(self, host: str, run: str | None) -> tuple[HostConfig, list[RunConfig]]:
        h, r = self.resolve(host, run)
        if r is not None:
            return h, [r]
        return h, list(self.inventory().runs.get(host, {}).values())

    def transport(self, host: HostConfig) -> Transport:
        if self.transport_factory is not None:
            return self.transport_factory(host)
        try:
            return transport_for(host, accept_new_host_key=self.accept_new_host_key, inventory=self.inventory())
        except TransportError as exc:
            raise OpsError(f"{host.name}: {exc}", EXIT_TRANSPORT) from None

    def line(self, text: str) -> None:
        self.raw.write(text + "\n")
        self.raw.flush()


def preflight(ctx: Ctx, host: HostConfig, t: Transport) -> None:
    """The transport stack's own preflight (a container that must be running), said on stderr or refused."""
    try:
        checked = t.preflight()
    except PreflightRefused as exc:
        raise OpsError(f"{host.name}: {exc}", EXIT_REFUSED) from None
    except TransportError as exc:
        raise OpsError(f"{host.name}: {exc}", EXIT_TRANSPORT) from None
    if checked:
        ctx.err.print(f"[green]ok[/]  {checked}")


def _print_check(ctx: Ctx, m: dict[str, Any]) -> None:
    # `skipped`: the check could not be made (e.g. no NVML); neither a pass nor a failure.
    # `warn`: passed, but worth knowing (e.g. a host whose CPUs are all busy).
    mark = "[yellow]skip[/]" if m.get("skipped") else ("[red]FAIL[/]" if not m.get("ok") else
                                                        "[yellow]warn[/]" if m.get("warn") else "[green]ok[/]  ")
    ctx.err.print(f"{mark} {m.get('name')}: ", Text(str(m.get("detail", ""))), sep="")


def _print_verdict_failure(ctx: Ctx, m: dict[str, Any]) -> None:
    ctx.err.print(f"[bold red]{m.get('detail')}[/]")
    tb = m.get("traceback")
    if tb:
        ctx.err.print(Panel(Text(tb), title="traceback", border_style="red", expand=False))
    elif m.get("tail"):
        ctx.err.print(Panel(Text("\n".join(m["tail"])), title="last log lines", border_style="red", expand=False))


# -- launch -------------------------------------------------------------------------------------------------
def cmd_launch(ctx: Ctx, host_name: str, run_name: str, force: bool = False, follow: bool = False,
               fresh_cache: bool = False, extra_args: list[str] | None = None, progress: bool = False) -> int:
    host, run = ctx.resolve(host_name, run_name)
    assert run is not None
    t = ctx.transport(host)
    phases = PhaseProgress(ctx.err)
    train = None  # set once preflight passed; the `finally` below runs on a refused preflight too
    try:
        t0 = time.monotonic()
        preflight(ctx, host, t)
        state = RunState(stall_after_s=run.stall_after)
        train = _train_progress(ctx, state, host, run) if progress else None  # --follow --progress: one bar
        rc: int | None = None
        launched_at: float | None = None
        training = False  # the attempt reached training: the phase bars are done with
        offsets = {"log_offset": 0, "events_offset": 0}
        try:
            for m in stream_agent(t, host, "launch", run_args(run, force=force, follow=follow, gpus=host.gpus,
                                                               fresh_cache=fresh_cache, extra_args=extra_args or [],
                                                               host=host.name)):
                kind = m.get("t")
                state.apply(m)
                if kind == "check":
                    _print_check(ctx, m)
                elif kind == "launched":
                    launched_at = time.monotonic()
                    ctx.err.print(f"[cyan]launched[/] {run.name} on {host.name}: attempt {m.get('attempt')}, pid "
                                  f"{m['pid']} (pgid {m['pgid']}), tmux session {m['session']}, log {m['log']}"
                                  + (f", extra args {' '.join(extra_args)}".replace("[", r"\[") if extra_args else "")
                                  + f"  [{launched_at - t0:.2f} s]")
                elif kind == "log":
                    line = settled_line(m["line"])  # a `\r` progress bar as its last state (the log keeps all)
                    if train is not None and not train.log_line(line):
                        pass  # a step line, in the bar (the log keeps it)
                    elif not (ctx.raw.isatty() and phases.line(line)):  # above the bars on a terminal
                        ctx.line(line)
                    offsets["log_offset"] = m["end"]
                elif kind == "event":
                    offsets["events_offset"] = m["end"]
                    ev = m["event"]
                    if ev.get("kind") == "run_start":
                        training = False  # a new attempt (a restart): its loading phases are news again
                    if train is not None and train.active:
                        pass  # saving / evaluating inside training: the training bar says it
                    elif training:
                        pass  # without --progress too: an evaluation or a save mid-training is no launch phase
                    elif ev.get("kind") == "phase" and ev.get("phase") != "training":
                        phases.update(ev.get("phase"), ev.get("i"), ev.get("n"), ev.get("detail"))
                    elif ev.get("kind") in ("step", "run_end") or ev.get("phase") == "training":
                        phases.stop()
                        training = True
                    if train is not None:
                        train.event(ev)
                elif kind == "verdict":
                    phases.stop()
                    if train is not None and m.get("reason") != "ready":
                        train.stop()
                    _launch_verdict(ctx, m, state, run, t0)
                elif kind == "error":
                    ctx.err.print(f"[red]agent: {m.get('message')}[/]")
                elif kind == "bye":
                    rc = int(m["rc"])
        except TransportError as exc:
            phases.stop()
            if launched_at is None:
                raise OpsError(f"{host.name}: {exc}", EXIT_TRANSPORT) from None
            ctx.err.print(f"[yellow]{exc}; the run keeps going: reconnecting to follow it[/]")
            if not follow:
                return _resume_until_ready(ctx, host, run, t, offsets, state, t0)
            if train is not None:
                train.stop()
            return cmd_logs(ctx, host_name, run_name, follow=True, _offsets=offsets, progress=progress)
        return EXIT_FAILED if rc is None else rc
    finally:
        phases.stop()  # Ctrl-C included: leave the terminal's cursor and bars as they are
        if train is not None:
            train.stop()
        t.close()


def _launch_verdict(ctx: Ctx, m: dict[str, Any], state: RunState, run: RunConfig, t0: float) -> None:
    reason = m.get("reason")
    v = state.view()
    if reason == "ready":
        extra = f", step {v.step}, loss {v.loss:.4g}" if v.loss is not None else ""
        ctx.err.print(f"[bold green]READY[/] {run.name}: {m.get('detail')}{extra}  [{time.monotonic() - t0:.2f} s]")
    elif reason == "timeout":
        ctx.err.print(f"[bold yellow]TIMEOUT[/] {m.get('detail')}")
        if m.get("tail"):
            ctx.err.print(Panel(Text("\n".join(m["tail"])), title="last log lines", border_style="yellow",
                                expand=False))
    elif m.get("ok"):
        ctx.err.print(f"[bold green]{run.name} finished[/]: {m.get('detail')}")
    else:
        _print_verdict_failure(ctx, m)


def _resume_until_ready(ctx: Ctx, host: HostConfig, run: RunConfig, t: Transport, offsets: dict[str, int],
                        state: RunState, t0: float) -> int:
    """The channel dropped after the run started: follow it again from the same offsets until ready or dead."""
    deadline = t0 + run.ready_timeout
    pattern = re.compile(run.ready_pattern) if run.ready_pattern else None
    for m in _follow_reconnecting(ctx, host, run, offsets, events=True):
        state.apply(m)
        if m.get("t") == "log":
            ctx.line(settled_line(m["line"]))
            if pattern is not None and pattern.search(m["line"]):
                ctx.err.print(f"[bold green]READY[/] {run.name}: log line matched {run.ready_pattern!r} "
                              "(after a reconnect)")
                return EXIT_OK
        v = state.view()
        if m.get("t") == "event" and m["event"].get("kind") == "step":
            ctx.err.print(f"[bold green]READY[/] {run.name}: first step event (after a reconnect), step {v.step}")
            return EXIT_OK
        if m.get("t") == "verdict":
            _print_verdict_failure(ctx, m)
            return EXIT_FAILED
        if time.monotonic() > deadline:
            ctx.err.print(f"[bold yellow]TIMEOUT[/] not ready after {run.ready_timeout:g} s: in phase {v.phase}")
            return EXIT_TIMEOUT
    return EXIT_FAILED


# -- logs ---------------------------------------------------------------------------------------------------
def _follow_reconnecting(ctx: Ctx, host: HostConfig, run: RunConfig, offsets: dict[str, Any],
                         events: bool) -> Iterator[dict[str, Any]]:
    """Messages of `follow` across channel drops: reconnect with back-off and resume at the last offsets.

    `offsets` is updated in place from every message's `end`, so a resume neither loses nor repeats a line.
    A permanent error (host key, authentication, a name that never resolved) raises OpsError(3) at once; a lost
    link is retried, each retry said on stderr, for up to the host's reconnect_timeout (0: forever)."""
    connected_once = False
    lost_since: float | None = None

    def connect(attempt: int) -> Iterator[dict[str, Any]]:
        nonlocal connected_once
        t = ctx.transport(host)
        try:
            options = {"no_events": not events, "gpu_interval": 1.0 if events else 0,
                       "all_logs": bool(offsets.get("all_logs")), "all_tail": offsets.get("all_tail")}
            for m in follow_connection(t, host, run, offsets, **options):
                connected_once = True
                yield m
        finally:
            t.close()

    def lost(exc: Exception, attempt: int) -> None:
        nonlocal lost_since
        if isinstance(exc, PermanentTransportError) and (exc.kind != "dns" or not connected_once):
            raise OpsError(f"{host.name}: {exc}", EXIT_TRANSPORT) from None
        lost_since = _retry_wait(ctx, host, exc, attempt, None if attempt == 1 else lost_since,
                                 host.reconnect_timeout)

    yield from reconnecting(connect, lost, retry_on=(TransportError,))


def _retry_wait(ctx: Ctx, host: HostConfig, exc: Exception, attempt: int, lost_since: float | None,
                limit: float) -> float:
    """Say the link is lost and wait before retry `attempt`, or give up (OpsError 3) past `limit` seconds."""
    now = time.monotonic()
    since = lost_since if lost_since is not None else now
    tried = now - since
    why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    if limit > 0 and tried >= limit:
        raise OpsError(f"{host.name}: link lost and not back after trying for {tried:.0f} s ({attempt - 1} "
                       f"reconnect attempts, reconnect_timeout {limit:g} s): {why}", EXIT_TRANSPORT)
    wait = reconnect_delay(attempt)
    if limit > 0:
        wait = max(0.0, min(wait, since + limit - now))
    budget = "" if limit <= 0 else f", giving up {max(0.0, since + limit - now):.0f} s from now"
    ctx.err.print(Text(f"{host.name}: link lost ({why}); reconnecting in {wait:.1f} s "
                       f"(attempt {attempt}{budget})", style="yellow"))
    time.sleep(wait)  # back-off between reconnects, not a poll of the run
    return since


def _attempt_header(m: dict[str, Any]) -> str:
    """The line `logs --all` prints before each attempt's log (they are kept as LOG.N ... LOG.1, LOG)."""
    which = "current attempt" if m.get("current") else "earlier attempt"
    return f"=== attempt {m.get('attempt')} of {m.get('attempts')} ({which}): {m.get('file')} ==="


def cmd_logs(ctx: Ctx, host_name: str, run_name: str, follow: bool = False, lines: int | None = 50,
             _offsets: dict[str, int] | None = None, all_attempts: bool = False, progress: bool = False) -> int:
    """The current attempt's log (last `lines`, default 50, or follow); `all_attempts`: every kept attempt, oldest
    first, whole or (`lines` given) the last `lines` of each."""
    host, run = ctx.resolve(host_name, run_name)
    assert run is not None
    every = {"log_offset": 0} if lines is None else {"log_offset": -1, "tail": lines, "all_tail": lines}
    lines = 50 if lines is None else lines
    if not follow:
        t = ctx.transport(host)
        try:
            preflight(ctx, host, t)
            args = (run_args(run, once=True, no_events=True, gpu_interval=0, all_logs=True, **every)
                    if all_attempts else
                    run_args(run, log_offset=-1, tail=lines, once=True, no_events=True, gpu_interval=0))
            for m in stream_agent(t, host, "follow", args):
                if m.get("t") in ("log", "old_log"):
                    ctx.line(m["line"])
                elif m.get("t") == "attempt":
                    ctx.line(_attempt_header(m))
                elif m.get("t") == "verdict" and m.get("reason") == "never_launched":
                    return _never_launched(ctx, host, run, m)
        except ChannelLost as exc:
            raise OpsError(f"{host.name}: {exc}", EXIT_TRANSPORT) from None
        finally:
            t.close()
        return EXIT_OK
    offsets: dict[str, Any] = _offsets or ({"events_offset": 0, "all_logs": True, **every} if all_attempts
                                           else {"log_offset": -1, "events_offset": 0, "tail": lines})
    state = RunState(stall_after_s=run.stall_after)
    train = _train_progress(ctx, state, host, run) if progress else None  # -f --progress: one bar, not every line
    try:
        return _follow_log(ctx, host, run, offsets, train, state)
    finally:
        if train is not None:
            train.stop()


def _train_progress(ctx: Ctx, state: RunState, host: HostConfig, run: RunConfig) -> Any:
    from opsctl.train_progress import TrainProgress

    return TrainProgress(ctx.err, ctx.out, state, f"opsctl logs {host.name} {run.name}, or {run.log}")


def _follow_log(ctx: Ctx, host: HostConfig, run: RunConfig, offsets: dict[str, Any], train: Any,
                state: RunState) -> int:
    """`logs -f`: print the log as it grows (with `train`, a TrainProgress: its bar, from the events, instead of
    every step line) until the run ends; exit 0 when it ended with status 0."""
    rc = EXIT_OK
    for m in _follow_reconnecting(ctx, host, run, offsets, events=train is not None):
        kind = m.get("t")
        if train is not None:
            state.apply(m)
            if kind == "event":
                train.event(m["event"])
        if kind in ("log", "old_log"):
            if train is None or train.log_line(m["line"]):
                ctx.line(m["line"])
        elif kind == "attempt":
            ctx.line(_attempt_header(m))
        elif kind == "log_reset":
            ctx.err.print(f"[yellow]-- log {m.get('reason')}; reading it again from the start --[/]")
        elif kind == "verdict" and m.get("reason") == "never_launched":
            return _never_launched(ctx, host, run, m)
        elif kind == "verdict":
            code = m.get("exit_code")
            ctx.err.print(f"[dim]-- run exited with status {code} --[/]")
            rc = EXIT_OK if code == 0 else EXIT_FAILED
    return rc


def _never_launched(ctx: Ctx, host: HostConfig, run: RunConfig, m: dict[str, Any]) -> int:
    """A run that was never launched has no log to print or follow: one line saying so, exit 0 (as `status`, which
    shows it `absent`)."""
    ctx.err.print(f"{host.name}/{run.name}: no such run on {host.name}: {m.get('detail', 'never launched')}; start "
                  f"it with: opsctl launch {host.name} {run.name}", markup=False, highlight=False)
    return EXIT_OK


# -- status -------------------------------------------------------------------------------------------------
def run_status(ctx: Ctx, host: HostConfig, run: RunConfig, t: Transport,
               tracker: AlertTracker | None = None) -> tuple[RunView, dict[str, Any]]:
    """One snapshot of a run, reduced by the shared RunState (and the watch's alert rules, when `tracker` is
    given) so every view agrees."""
    msgs = list(stream_agent(t, host, "status", run_args(run)))
    st = next((m for m in msgs if m.get("t") == "status"), None)
    if st is None:
        err = next((m.get("message") for m in msgs if m.get("t") == "error"), "no status message")
        raise OpsError(f"{host.name}/{run.name}: agent: {err}", EXIT_FAILED)
    state = RunState(stall_after_s=run.stall_after, killed_by_us=bool(st.get("killed_by_opsctl")))
    for m in msgs:
        state.apply(m)
        if tracker is not None:
            tracker.observe(m)
    return state.view(), st


def _unreachable_record(host: HostConfig, run: RunConfig, error: str) -> dict[str, Any]:
    # Not `absent` (that says the host answered and has no such run): the host could not be asked.
    return run_record(host.name, run.name, unreachable_view(error), link="unreachable", alerts=[], log=run.log)


STATUS_PARALLEL = 8  # agent calls at once on one connection: under sshd's default MaxSessions (10) channels


def _status_in_parallel(ctx: Ctx, host: HostConfig, runs: list[RunConfig],
                        t: Transport) -> list[Future[tuple[RunView, dict[str, Any], AlertTracker]]]:
    """Ask for every run's status at once, each on its own channel of the host's one connection: one agent start-up
    per run, side by side rather than one after another (4 runs took 2.2 s, against 1.5 s for `watch --once`, which
    already opened them in parallel: bench/ops_latency.py --only status). The caller reads the answers in the runs'
    order, so the rows and the first failure are the same as when they were asked one by one."""

    def one(run: RunConfig) -> tuple[RunView, dict[str, Any], AlertTracker]:
        tracker = AlertTracker(run.tau_regression)
        view, st = run_status(ctx, host, run, t, tracker)
        return view, st, tracker

    _connect(t)  # once, before the threads: a host that is down costs one connect timeout, not one per run
    with ThreadPoolExecutor(max_workers=max(1, min(STATUS_PARALLEL, len(runs))), thread_name_prefix="status") as pool:
        return [pool.submit(one, run) for run in runs]  # all answered when the pool closes


def _connect(t: Transport) -> None:
    """Open the SSH connection under a transport stack now (what its first command would do, with the same error)."""
    inner: Any = t
    while hasattr(inner, "inner"):  # pct exec over SSH: the connection is the inner transport's
        inner = inner.inner
    connect = getattr(inner, "connect", None)
    if callable(connect):
        connect()


def _host_status(ctx: Ctx, host: HostConfig, runs: list[RunConfig], quiet: bool) -> tuple[list[dict[str, Any]],
                                                                                          str | None]:
    """One record per run of `host` (the `status --json` schema) and, if it could not be reached, why."""
    rows: list[dict[str, Any]] = []
    unreachable: str | None = None
    try:
        t: Transport | None = ctx.transport(host)
    except OpsError as exc:
        if exc.code != EXIT_TRANSPORT:
            raise
        unreachable, t = str(exc), None
    try:
        if t is not None and not quiet:
            preflight(ctx, host, t)
        answers: list[Any] = [None] * len(runs)
        if t is not None:
            try:
                answers = _status_in_parallel(ctx, host, runs, t)
            except TransportError as exc:  # the connection could not be opened: every run unreachable, with why
                unreachable = str(exc)
        for run, answer in zip(runs, answers, strict=True):
            if unreachable is None:
                try:
                    view, st, tracker = answer.result()
                    rows.append(run_record(host.name, run.name, view, link="up", alerts=tracker.evaluate(view, time.time()),
                                           session=st.get("session"), session_exists=st.get("session_exists"),
                                           log=st.get("log")))
                    continue
                except TransportError as exc:  # ChannelLost included: the host did not answer
                    unreachable = str(exc)
            rows.append(_unreachable_record(host, run, unreachable))
    except OpsError as exc:
        if exc.code != EXIT_TRANSPORT:
            raise
        unreachable = str(exc)
        done = {r["run"] for r in rows}
        rows += [_unreachable_record(host, r, unreachable) for r in runs if r.name not in done]
    finally:
        if t is not None:
            t.close()
    return rows, unreachable


HOSTS_PARALLEL = 8  # hosts asked at once by `status` with no HOST: each a connection of its own


def _buffered(con: Console) -> Console:
    """A console that writes what `con` would (its colours, width, wrapping) into a buffer, to be replayed later."""
    return Console(file=io.StringIO(), force_terminal=con.is_terminal, color_system=con.color_system,  # type: ignore[arg-type]
                   width=con.width, highlight=False, soft_wrap=con.soft_wrap, no_color=con.no_color)


def _hosts_in_parallel(ctx: Ctx, targets: list[tuple[HostConfig, list[RunConfig]]],
                       quiet: bool) -> list[tuple[list[dict[str, Any]], str | None]]:
    """`_host_status` of every host at once (HOSTS_PARALLEL at a time), so that a host that is down costs one
    connect timeout for the whole fleet, not one per slow host in series. What a host says on stderr (a container's
    preflight line) is buffered and replayed in inventory order, and the first host (in that order) whose status
    raised raises here, after the lines of the hosts before it: the output is the one the series gave."""

    def one(host: HostConfig, runs: list[RunConfig]) -> tuple[Console, Any]:
        err = _buffered(ctx.err)
        mine = Ctx(hosts_file=ctx.hosts_file, accept_new_host_key=ctx.accept_new_host_key, out=ctx.out, err=err,
                   raw=ctx.raw, _inv=ctx._inv, transport_factory=ctx.transport_factory)
        try:
            return err, _host_status(mine, host, runs, quiet=quiet)
        except Exception as exc:  # noqa: BLE001 - raised below, in inventory order
            return err, exc

    with ThreadPoolExecutor(max_workers=max(1, min(HOSTS_PARALLEL, len(targets))), thread_name_prefix="hosts") as pool:
        futures = [pool.submit(one, host, runs) for host, runs in targets]
        out: list[tuple[list[dict[str, Any]], str | None]] = []
        for fut in futures:
            err, got = fut.result()
            said = err.file.getvalue()  # type: ignore[attr-defined]
            if said:
                ctx.err.file.write(said)
                ctx.err.file.flush()
            if isinstance(got, BaseException):
                raise got
            out.append(got)
    return out


# The state cell of `status` (and of the group verbs' tables): the dashboard's own badge style, one table for every
# view (opsctl/look.py). Each carries its background with its text colour, so it reads the same on a dark and a
# light terminal, where a bare foreground such as the stalled yellow would vanish on white (tests/test_state_colours.py).
STATE_COLOURS = STATE_STYLES


TAU_COLUMNS = ("τ (step)", "best τ (step)", "n-gram τ")


def fmt_tau(tau: Any, step: Any) -> str:
    """`3.41 (4000)`: a tau with the step it was measured after; `- (4000)` for an evaluation that verified nothing."""
    if step is None:
        return "-"
    return f"{'-' if not isinstance(tau, (int, float)) else f'{tau:.2f}'} ({step})"


def tau_cells(r: dict[str, Any]) -> list[str]:
    """The status row's TAU_COLUMNS: the latest tau, the best so far, prompt lookup's at the latest evaluation."""
    ngram = r.get("ngram_tau")
    return [fmt_tau(r.get("tau"), r.get("tau_step")), fmt_tau(r.get("tau_best"), r.get("tau_best_step")),
            "-" if not isinstance(ngram, (int, float)) else f"{ngram:.2f}"]


def cmd_status(ctx: Ctx, host_name: str | None, run_name: str | None, as_json: bool = False) -> int:
    """One row per run: of RUN, of every run of HOST, or (no HOST) of every host and run in the inventory."""
    if host_name is None:
        inv = ctx.inventory()
        targets = [(h, list(inv.runs.get(name, {}).values())) for name, h in inv.hosts.items()]
    else:
        targets = [ctx.runs_of(host_name, run_name)]
    rows: list[dict[str, Any]] = []
    unreachable: dict[str, str] = {}
    answers = ([_host_status(ctx, *targets[0], quiet=as_json)] if len(targets) == 1
               else _hosts_in_parallel(ctx, targets, quiet=as_json))
    for (host, _), (host_rows, error) in zip(targets, answers, strict=True):
        rows += host_rows
        if error is not None:
            unreachable[host.name] = error
    rc = EXIT_TRANSPORT if unreachable else EXIT_OK
    if as_json:  # always a list, whatever the arguments: the schema of `watch --once --json` (docs/cli-json.md)
        ctx.raw.write(json.dumps(rows, default=str) + "\n")
        ctx.raw.flush()
        return rc
    many_hosts = len(targets) > 1
    table = Table(title="status" if many_hosts else targets[0][0].name if targets else "status")
    show_gpus = any(r["gpus"] for r in rows)
    cols = (["host"] if many_hosts else []) + ["run", "state", "phase", "step", "loss", "tok/s", "ETA", "heartbeat",
                                                "pid", "exit", "attempt"]
    for col in cols:
        table.add_column(col, no_wrap=col in ("host", "run", "phase", "step", "attempt"))
    show_tau = any(r.get("tau_step") is not None for r in rows)  # a run that evaluates during training
    if show_tau:
        for col in TAU_COLUMNS:
            table.add_column(col, no_wrap=True)
    if show_gpus:
        table.add_column("GPUs")
    for r in rows:
        phase = phase_progress(r["phase"] or "-", r.get("phase_i"), r.get("phase_n"))
        if r["state"] in ENDED_STATES and r["state"] != "crashed":  # a crash's phase says where; others ended
            phase = "ended"
        step = f"{r['step']}" + (f"/{r['total_steps']}" if r.get("total_steps") else "")
        gpus = ", ".join(f"{g['index']}: {g.get('util')}% {int(g.get('mem_used_mb') or 0)} MiB" for g in r["gpus"])
        state = Text(state_label(r), style=STATE_COLOURS.get(r["state"], "white"))
        if r.get("reason"):  # the crash's exception line + exit code, the host's error, leftover processes
            state.append(f" ({r['reason']})")
        running = r.get("proc_state") == "running"
        cells = [r["run"], state, phase, step,
                 "-" if r["loss"] is None else f"{r['loss']:.4g}",
                 "-" if r["tokens_per_s_avg"] is None else f"{r['tokens_per_s_avg']:.0f}",  # the one watch shows
                 fmt_duration(r.get("eta_s")),
                 "-" if r["heartbeat_age_s"] is None else f"{r['heartbeat_age_s']:.0f} s ago",
                 str(r["pid"] or ("cleaned" if r.get("cleaned") else "-")),
                 "-" if r["exit_code"] is None or running else str(r["exit_code"]),
                 attempt_clock(r)]  # the current attempt: #id, when it started, how long it ran
        if many_hosts:
            cells.insert(0, r["host"])
        if show_tau:
            cells += tau_cells(r)
        if show_gpus:
            cells.append(gpus or "none")
        table.add_row(*cells)
    ctx.out.print(table)
    nvml = next((r.get("nvml") for r in rows if r.get("nvml") and r.get("nvml") != "ok"), None)
    if nvml:
        ctx.out.print(f"[dim]GPUs: nvml {nvml}[/]")
    for r in rows:
        for e in r["errors"][-3:]:
            ctx.out.print(Text(f"{r['run']}: {e.get('class')}: {e.get('message')}", style="red"))
        if r.get("bad_events"):  # skipped, never fatal: say so, with the last one's offset and why
            ctx.out.print(Text(f"{r['run']}: {bad_events_text(r['bad_events'])} (last: {r.get('bad_event')})",
                               style="yellow"))
    for name, error in unreachable.items():
        ctx.err.print(Text(f"{name}: unreachable: {error}", style="red"))
    return rc


# -- kill ---------------------------------------------------------------------------------------------------
def cmd_mark_killed(ctx: Ctx, host_name: str, run_name: str) -> int:
    """Record a kill request on the run without signalling it (the first phase of a group kill)."""
    host, run = ctx.resolve(host_name, run_name)
    assert run is not None
    t = ctx.transport(host)
    rc = EXIT_FAILED
    try:
        preflight(ctx, host, t)
        for m in stream_agent(t, host, "kill", run_args(run, gpus=host.gpus, mark_only=True)):
            if m.get("t") == "error":
                ctx.err.print(f"[red]agent: {m.get('message')}[/]")
            elif m.get("t") == "bye":
                rc = int(m["rc"])
    except ChannelLost as exc:
        raise OpsError(f"{host.name}: {exc}", EXIT_TRANSPORT) from None
    finally:
        t.close()
    return rc


def cmd_kill(ctx: Ctx, host_name: str, run_name: str) -> int:
    host, run = ctx.resolve(host_name, run_name)
    assert run is not None
    t = ctx.transport(host)
    rc = EXIT_FAILED
    try:
        preflight(ctx, host, t)
        for m in stream_agent(t, host, "kill", run_args(run, gpus=host.gpus)):
            kind = m.get("t")
            if kind == "killed":
                alive = m.get("alive") or []
                ctx.err.print(f"sent {m['signal']} to process group {m['pgid']}: "
                              + (f"[yellow]{len(alive)} still alive {alive}[/]" if alive else "[green]all gone[/]"))
            elif kind == "event":
                ev = m["event"]
                if ev.get("kind") == "checkpoint":
                    ctx.err.print(f"checkpoint written: {ev.get('path')} (step {ev.get('step')})")
                elif ev.get("kind") == "run_end":
                    ctx.err.print(f"run_end: reason {ev.get('reason')}, exit code {ev.get('exit_code')}, "
                                  f"step {ev.get('step')}")
            elif kind == "check":
                _print_check(ctx, m)
            elif kind == "verdict":
                if m.get("reason") == "not_running":
                    ctx.err.print(f"{run.name} is not running: {m.get('detail')}")
                elif m.get("ok"):
                    ctx.err.print(f"[bold green]killed[/] {run.name}: {m.get('detail')}")
                else:
                    ctx.err.print(f"[bold red]kill incomplete[/]: {m.get('detail')}")
            elif kind == "error":
                ctx.err.print(f"[red]agent: {m.get('message')}[/]")
            elif kind == "bye":
                rc = int(m["rc"])
    except ChannelLost as exc:
        raise OpsError(f"{host.name}: {exc}", EXIT_TRANSPORT) from None
    finally:
        t.close()
    return rc


# -- clean --------------------------------------------------------------------------------------------------
def cmd_clean(ctx: Ctx, host_name: str, run_name: str | None, dry_run: bool = False, logs: bool = False) -> int:
    host, runs = ctx.runs_of(host_name, run_name)
    t = ctx.transport(host)
    worst = EXIT_OK
    try:
        preflight(ctx, host, t)
        for run in runs:
            n = total = 0
            for m in stream_agent(t, host, "clean", run_args(run, dry_run=dry_run, logs=logs)):
                kind = m.get("t")
                if kind == "removed":
                    n += 1
                    total += int(m.get("bytes") or 0)
                    ctx.out.print(("would remove " if dry_run else "removed ") + m["path"], markup=False)
                elif kind == "check":
                    _print_check(ctx, m)
                elif kind == "error":
                    ctx.err.print(f"[red]agent: {m.get('message')}[/]")
                elif kind == "bye":
                    worst = max(worst, int(m["rc"]))
            ctx.err.print(f"{run.name}: {'would remove' if dry_run else 'removed'} {n} entries, "
                          f"{total / 2**20:.1f} MiB")
    except ChannelLost as exc:
        raise OpsError(f"{host.name}: {exc}", EXIT_TRANSPORT) from None
    finally:
        t.close()
    return worst


# -- hosts --------------------------------------------------------------------------------------------------
def cmd_hosts_check(ctx: Ctx) -> int:
    found = discover(ctx.hosts_file)
    problems = check_inventory(found.path) if found.path is not None else []
    if problems:
        for p in problems:
            ctx.err.print(Text(p, style="red"))
        return EXIT_USAGE
    inv = ctx.inventory()
    for name, h in inv.hosts.items():
        runs = ", ".join(inv.runs.get(name, {})) or "(no runs)"
        ctx.out.print(f"[green]ok[/] {name} ({h.kind}{'' if h.pct is None else f' {h.pct}'}): {runs}")
    ctx.err.print(f"{inv.path or BUILTIN}: valid, {len(inv.hosts)} host(s)")
    return EXIT_OK


def _reach(h: HostConfig) -> str:
    """How a host is reached, as a person would write it: `local`, `ml@gpu1:22`, `root@pve-box -> pct 200`."""
    if h.local:
        base = "local"
    else:
        assert h.ssh is not None
        user = f"{h.ssh.user}@" if h.ssh.user else ""
        jump = f" via {h.ssh.jump}" if h.ssh.jump else ""
        base = f"ssh {user}{h.ssh.host}:{h.ssh.port}{jump}"
    return base + (f" -> pct {h.pct}" if h.pct is not None else "")


def cmd_hosts_list(ctx: Ctx) -> int:
    """`opsctl hosts`: what the inventory defines, without connecting anywhere, and which file it is."""
    inv = ctx.inventory()
    table = Table(title=f"inventory: {inv.path or BUILTIN}", title_justify="left")
    for col in ("host", "reached through", "GPUs", "runs"):
        table.add_column(col, no_wrap=col != "runs")
    for name, h in inv.hosts.items():
        gpus = "all" if h.gpus is None else ",".join(str(g) for g in h.gpus)
        table.add_row(name, _reach(h), gpus, ", ".join(inv.runs.get(name, {})) or "(no runs)")
    ctx.out.print(table)
    return EXIT_OK


def cmd_init(ctx: Ctx, path: str, force: bool = False) -> int:
    """`opsctl init`: a commented hosts.yaml to start from, checked by the same loader before it is announced."""
    target = Path(path)
    try:
        write_init(target, force=force)
    except FileExistsError as exc:
        raise OpsError(str(exc), EXIT_USAGE) from None
    except OSError as exc:
        raise OpsError(f"cannot write {target}: {exc}", EXIT_USAGE) from None
    inv = load_inventory(target)  # the template must stay valid: a broken one fails here, not at the next verb
    try:
        config_note = write_init_config(target)
    except OSError as exc:
        raise OpsError(f"wrote {target.resolve()}, but not the sample run's config beside it: {exc}",
                       EXIT_USAGE) from None
    ctx.err.print(f"wrote {target.resolve()}: host(s) {', '.join(inv.hosts)}; edit it, then `opsctl hosts check`",
                  soft_wrap=True, markup=False)
    ctx.err.print(config_note, soft_wrap=True, markup=False)
    return EXIT_OK


# -- watch --------------------------------------------------------------------------------------------------
def _quietly(ctx: Ctx, verb: Callable[..., int], host_name: str, run_name: str) -> tuple[int, str]:
    """Run a verb with its output in a buffer, not on the terminal a full-screen UI owns: (exit code, output)."""
    buf = io.StringIO()
    con = Console(file=buf, highlight=False, width=120)
    quiet = Ctx(hosts_file=ctx.hosts_file, accept_new_host_key=ctx.accept_new_host_key, out=con, err=con, raw=buf,
                _inv=ctx._inv, transport_factory=ctx.transport_factory)
    try:
        rc = verb(quiet, host_name, run_name)
    except OpsError as exc:
        buf.write(str(exc) + "\n")
        rc = exc.code
    return rc, buf.getvalue()


def watch_sources(ctx: Ctx, targets: list[str]) -> list[AgentSource]:
    """HOST[:RUN] arguments (none: every run in hosts.yaml) -> one source per run."""
    inv = ctx.inventory()
    pairs: list[tuple[str, str]] = []
    if not targets:
        pairs = [(h, r) for h, runs in inv.runs.items() for r in runs]
    for tgt in targets:
        host, _, run = tgt.partition(":")
        if run:
            pairs.append((host, run))
        else:
            ctx.resolve(host, None)
            pairs += [(host, r) for r in inv.runs.get(host, {})]
    sources = []
    for h, r in pairs:
        host, run = ctx.resolve(h, r)
        assert run is not None
        sources.append(AgentSource(host, run, ctx.transport, kill=functools.partial(_quietly, ctx, cmd_kill, h, r),
                                   clean=functools.partial(_quietly, ctx, cmd_clean, h, r)))
    return sources
