"""The opsctl verbs on a group run (launch, status, kill, logs, clean): every node is a normal run on its host.

Each verb drives the per-host verbs on every node at once and says the group's answer: READY when every node's
ranks have stepped, `crashed` naming the node that died first, nothing left running when one node is gone.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import io
import json
import queue
import re
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from opsctl import commands
from opsctl.channel import run_args, stream_agent
from opsctl.commands import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TIMEOUT,
    EXIT_TRANSPORT,
    EXIT_USAGE,
    STATE_COLOURS,
    Ctx,
    OpsError,
)
from opsctl.group import Group, GroupRun, Node
from opsctl.transport import PreflightRefused, Transport, TransportError

RUNNING = ("starting", "loading", "compiling", "training", "stalled", "restarting")
PEER_WAIT_S = 5.0  # after a peer-lost failure, how long launch waits for the node that caused it to say so
PROGRESS = ("starting", "loading", "compiling", "training")  # a group is as far as its slowest node
# A rank that lost its peer fails with one of these: it is a follower of the crash, not its cause.
PEER_LOST = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|DistNetworkError|DistStoreError|"
                       r"remote process exited|NCCL communicator was aborted|Socket Timeout|RendezvousClosed",
                       re.I)


def group_of(ctx: Ctx, name: str | None) -> Group | None:
    """The group NAME names (None: it is a host, or the inventory cannot be read: the host verbs say why)."""
    if not name:
        return None
    try:
        groups = ctx.quiet_inventory().groups
    except OpsError:
        return None
    g = groups.get(name)
    return g if isinstance(g, Group) else None


def group_run(ctx: Ctx, g: Group, run: str | None) -> GroupRun:
    if run is None or run not in g.runs:
        close = difflib.get_close_matches(run or "", list(g.runs), n=1, cutoff=0.5)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        what = f"unknown run '{run}'{hint}" if run else "a group verb needs RUN"
        raise OpsError(f"group {g.name}: {what}; its runs: {', '.join(g.runs) or 'none'}", EXIT_USAGE)
    return g.runs[run]


def label(n: Node) -> str:
    return f"node{n.index} {n.host.name}"


class _Prefixed(io.TextIOBase):
    """A text stream that puts `[node1 box] ` before every line and writes whole lines under one lock, so the
    nodes' lines interleave by arrival and never mix inside a line."""

    def __init__(self, target: TextIO, prefix: str, lock: threading.Lock) -> None:
        self.target, self.prefix, self.lock, self.buf = target, prefix, lock, ""

    def write(self, s: str) -> int:
        self.buf += s
        *whole, self.buf = self.buf.split("\n")
        if whole:
            with self.lock:
                self.target.write("".join(f"{self.prefix}{line}\n" for line in whole))
                self.target.flush()
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@dataclasses.dataclass
class NodeCtx(Ctx):
    """A Ctx whose HOST RUN is one node of a group run, so the per-host verbs work on it unchanged."""

    node: Node | None = None

    def resolve(self, host: str, run: str | None) -> tuple[Any, Any]:
        assert self.node is not None
        return self.node.host, self.node.run

    def runs_of(self, host: str, run: str | None) -> tuple[Any, list[Any]]:
        assert self.node is not None
        return self.node.host, [self.node.run]


def node_ctx(ctx: Ctx, n: Node, lock: threading.Lock, raw: TextIO | None = None) -> NodeCtx:
    """Output of the node's verb goes to the caller's streams, each line prefixed with the node."""
    prefix = f"[{label(n)}] "
    err = Console(file=_Prefixed(ctx.err.file, prefix, lock), highlight=False, width=commands.PIPE_WIDTH,
                  soft_wrap=True)
    out = Console(file=_Prefixed(ctx.out.file, prefix, lock), highlight=False, width=commands.PIPE_WIDTH,
                  soft_wrap=True)
    return NodeCtx(hosts_file=ctx.hosts_file, accept_new_host_key=ctx.accept_new_host_key, out=out, err=err,
                   raw=raw or _Prefixed(ctx.raw, prefix, lock), _inv=ctx._inv,
                   transport_factory=ctx.transport_factory, node=n)


def on_every_node(ctx: Ctx, nodes: list[Node], fn: Callable[[Node], int]) -> dict[int, int]:
    """fn(node) on every node at once (a kill must reach all nodes together: ranks wait on each other); a node's
    error is said with its node and becomes its exit code, the other nodes go on."""
    rcs: dict[int, int] = {}
    errors: list[str] = []

    def one(n: Node) -> None:
        try:
            rcs[n.index] = fn(n)
        except OpsError as exc:
            rcs[n.index] = exc.code
            errors.append(f"{label(n)}: {exc}")
        except TransportError as exc:
            rcs[n.index] = EXIT_TRANSPORT
            errors.append(f"{label(n)}: {exc}")

    threads = [threading.Thread(target=one, args=(n,), daemon=True) for n in nodes]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for e in errors:
        ctx.err.print(Text(e, style="red"))
    return rcs


# -- preflight ----------------------------------------------------------------------------------------------
def node_preflight(ctx: Ctx, n: Node) -> str:
    """Everything that can refuse a node before anything starts anywhere: the link, the container, a live run of
    the same name, the workdir and the run's preflight command. Raises OpsError; returns what was checked."""
    host, run = n.host, n.run
    t = ctx.transport(host)
    try:
        try:
            checked = t.preflight()
        except PreflightRefused as exc:
            raise OpsError(f"{label(n)}: {exc}", EXIT_REFUSED) from None
        view, _ = commands.run_status(ctx, host, run, t)
        if view.proc_state == "running" or view.state == "restarting":
            raise OpsError(f"{label(n)}: {run.name} is already {view.state} (pid {view.pid}); stop the group run "
                           "first (opsctl kill GROUP RUN)", EXIT_REFUSED)
        pre = run.preflight or ["true"]
        env = [f"{k}={v}" for k, v in run.env.items()]
        rc, out, err = t.run(["env", "-C", run.workdir, *env, *pre], timeout=300)
        if rc != 0:
            text = (out + err).decode(errors="replace").strip().splitlines()
            what = "preflight command" if run.preflight else "workdir"
            raise OpsError(f"{label(n)}: {what} failed (exit {rc}) in {run.workdir}"
                           + (": " + " | ".join(text[-3:]) if text else ""), EXIT_REFUSED)
    except TransportError as exc:
        raise OpsError(f"{label(n)}: {exc}", EXIT_TRANSPORT) from None
    finally:
        t.close()
    return ", ".join(x for x in (checked, f"{run.name} not running", f"workdir {run.workdir}",
                                 "preflight ok" if run.preflight else "") if x)


# -- launch -------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _NodeLaunch:
    node: Node
    transport: Transport | None = None
    launched: bool = False
    stepped: set[int] = dataclasses.field(default_factory=set)
    ended: bool = False
    ok_exit: bool = False
    failure: str | None = None
    failed_at: float = 0.0
    fatal: str | None = None  # the training core's last fatal error event on this node (class: message)

    @property
    def peer_lost(self) -> bool:
        """Failed because a peer went away: a consequence of another node's death, not the cause."""
        return bool(PEER_LOST.search(f"{self.fatal or ''} {self.failure or ''}"))


def _stepped_rank(ev: dict[str, Any]) -> int | None:
    """The rank an event proves to be in its training loop: a step, or a heartbeat at a step / in `training`
    (target ranks of a split run never step; their heartbeat says `training` once they serve buffers)."""
    kind, rank = ev.get("kind"), ev.get("rank", 0)
    if not isinstance(rank, int):
        return None
    if kind == "step" or (kind == "heartbeat" and ((ev.get("step") or 0) >= 1 or ev.get("phase") == "training")):
        return rank
    return None


def cmd_group_launch(ctx: Ctx, g: Group, run_name: str, force: bool = False, follow: bool = False,
                     fresh_cache: bool = False, extra_args: list[str] | None = None) -> int:
    """Preflight every node, then start every node's torchrun; READY when every rank of every node stepped."""
    gr = group_run(ctx, g, run_name)
    t0 = time.monotonic()
    refusals: list[OpsError] = []
    for n in gr.nodes:  # nothing starts anywhere unless every node passes
        try:
            ctx.err.print(Text(f"ok   {label(n)}: {node_preflight(ctx, n)}"))
        except OpsError as exc:
            ctx.err.print(Text(f"FAIL {exc}", style="red"))
            refusals.append(exc)
    if refusals:
        ctx.err.print(Text(f"{g.name}/{gr.name}: refused, nothing started on any node "
                           f"({len(refusals)} of {len(gr.nodes)} failed preflight)", style="bold red"))
        return max(x.code for x in refusals)
    ctx.err.print(f"[cyan]starting[/] {gr.name} on {len(gr.nodes)} nodes x {gr.nproc_per_node} ranks (world "
                  f"{gr.world_size}), rendezvous {gr.head}")
    lock = threading.Lock()
    q: queue.Queue[tuple[int, dict[str, Any] | Exception | None]] = queue.Queue()
    states = {n.index: _NodeLaunch(n) for n in gr.nodes}

    def worker(st: _NodeLaunch) -> None:
        n = st.node
        try:
            args = run_args(n.run, force=force, follow=True, gpus=n.host.gpus, fresh_cache=fresh_cache,
                            extra_args=extra_args or [], host=n.host.name)
            args["ready_timeout"] = 10 * 365 * 86400.0  # the group decides READY and its timeout, not one node
            assert st.transport is not None
            for m in stream_agent(st.transport, n.host, "launch", args):
                q.put((n.index, m))
        except Exception as exc:  # noqa: BLE001 - the main loop decides what a lost node means
            q.put((n.index, exc))
        finally:
            q.put((n.index, None))

    for st in states.values():
        st.transport = ctx.transport(st.node.host)
    threads = [threading.Thread(target=worker, args=(st,), daemon=True) for st in states.values()]
    for th in threads:
        th.start()
    deadline = t0 + gr.ready_timeout
    ready = False
    first_failure: float | None = None
    open_streams = len(states)
    try:
        while True:
            try:
                i, m = q.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())) if not ready else 1.0)
            except queue.Empty:
                i, m = -1, None
                if not ready and time.monotonic() > deadline:
                    waiting = [f"{label(s.node)} (ranks {sorted(set(gr.ranks(s.node.index)) - s.stepped)})"
                               for s in states.values() if not set(gr.ranks(s.node.index)) <= s.stepped]
                    ctx.err.print(f"[bold yellow]TIMEOUT[/] {gr.name}: not ready after {gr.ready_timeout:g} s; "
                                  f"waiting for {', '.join(waiting)}; the nodes were left running (opsctl kill "
                                  f"{g.name} {gr.name} stops them)")
                    return EXIT_TIMEOUT
            if i >= 0:
                st = states[i]
                if m is None:
                    open_streams -= 1
                    st.ended = True
                    if not st.ok_exit and st.failure is None and not ready:
                        st.failure = "its launch ended without a verdict"
                elif isinstance(m, Exception):
                    if not st.launched and st.failure is None:
                        st.failure = f"link lost before it started: {m}"
                    elif not st.ok_exit and st.failure is None:
                        # A lost link is not a dead node: nothing is stopped on its account.
                        ctx.err.print(Text(f"[{label(st.node)}] link lost ({m}); the group run goes on: opsctl "
                                           f"status {g.name} {gr.name} / opsctl logs {g.name} {gr.name} -f",
                                           style="yellow"))
                        return EXIT_TRANSPORT
                else:
                    _launch_message(ctx, st, m, lock)
            failed = [s for s in states.values() if s.failure]
            if failed:
                now = time.monotonic()
                first_failure = first_failure or now
                for s in failed:
                    s.failed_at = s.failed_at or now
                # Ranks that lost a peer fail at about the time the peer's node reports its own death: wait a
                # moment for the cause before naming a node.
                if all(s.peer_lost for s in failed) and now < first_failure + PEER_WAIT_S and open_streams:
                    continue
                cause = sorted(failed, key=lambda s: (s.peer_lost, s.failed_at))[0]
                return _group_failed(ctx, g, gr, states, cause, lock)
            if not ready and all(set(gr.ranks(s.node.index)) <= s.stepped or s.ok_exit for s in states.values()):
                ready = True
                ctx.err.print(f"[bold green]READY[/] {gr.name}: every rank of {len(gr.nodes)} nodes stepped "
                              f"(world {gr.world_size})  [{time.monotonic() - t0:.2f} s]")
                if not follow:
                    return EXIT_OK
            if all(s.ok_exit for s in states.values()):
                ctx.err.print(f"[bold green]{gr.name} finished[/] on every node")
                return EXIT_OK
            if not open_streams:
                return EXIT_FAILED
    finally:
        for st in states.values():  # the agents' channels: the runs themselves go on in their tmux sessions
            if st.transport is not None:
                st.transport.close()


def _launch_message(ctx: Ctx, st: _NodeLaunch, m: dict[str, Any], lock: threading.Lock) -> None:
    kind, prefix = m.get("t"), f"[{label(st.node)}] "
    if kind == "check":
        if not m.get("ok") and not m.get("skipped"):
            ctx.err.print(Text(f"{prefix}FAIL {m.get('name')}: {m.get('detail')}", style="red"))
    elif kind == "launched":
        st.launched = True
        ctx.err.print(Text(f"{prefix}launched: pid {m.get('pid')} (pgid {m.get('pgid')}), tmux session "
                           f"{m.get('session')}, log {m.get('log')}", style="cyan"))
    elif kind == "log":
        with lock:
            ctx.line(prefix + m["line"])
    elif kind == "event":
        ev = m["event"]
        r = _stepped_rank(ev)
        if r is not None:
            st.stepped.add(r)
        if ev.get("kind") == "error" and ev.get("fatal"):
            st.fatal = f"{ev.get('class')}: {ev.get('message')}"
    elif kind == "verdict":
        # A node whose ranks never write a step event (e.g. a target node) is not `ready` to its agent: its exit
        # status 0 is what counts.
        if m.get("reason") in ("exited", "died_before_ready") and m.get("exit_code") == 0:
            st.ok_exit = True
        elif not m.get("ok") and m.get("reason") != "timeout":
            st.failure = str(m.get("detail") or m.get("reason"))
            if m.get("traceback"):
                st.failure += ": " + str(m["traceback"]).strip().splitlines()[-1]
    elif kind == "error" and m.get("fatal"):
        st.failure = f"agent: {m.get('message')}"


def _group_failed(ctx: Ctx, g: Group, gr: GroupRun, states: dict[int, _NodeLaunch], first: _NodeLaunch,
                  lock: threading.Lock) -> int:
    """One node failed: stop every other node that started (kill: SIGINT first, so ranks checkpoint where they
    can), and say the group crashed, naming the node and why."""
    for st in states.values():
        if st.transport is not None:
            st.transport.close()
    others = [s.node for s in states.values() if s is not first and s.launched]
    ctx.err.print(Text(f"{g.name}/{gr.name} crashed: {label(first.node)}: {first.failure}"
                       + (f" ({first.fatal})" if first.fatal and first.fatal not in (first.failure or "") else ""),
                       style="bold red"))
    if others:
        ctx.err.print(f"stopping {', '.join(label(n) for n in others)}")
        stop_nodes(ctx, others, lock)
    return EXIT_FAILED


def stop_nodes(ctx: Ctx, nodes: list[Node], lock: threading.Lock) -> dict[int, int]:
    """Mark every node killed, then kill every node: once one node's ranks die, the others' fail their next
    collective and may exit before their own kill arrives; marked first, they still read `killed`."""
    on_every_node(ctx, nodes, lambda n: commands.cmd_mark_killed(node_ctx(ctx, n, lock), n.host.name, n.run.name))
    return on_every_node(ctx, nodes, lambda n: commands.cmd_kill(node_ctx(ctx, n, lock), n.host.name, n.run.name))


# -- status -------------------------------------------------------------------------------------------------
def group_verdict(gr: GroupRun, rows: list[dict[str, Any]]) -> tuple[str, str | None, int | None]:
    """(group state, why, the node it is about): crashed names the node whose failure came first and is not a
    peer's lost connection; training only when every node trains."""
    by_node = {r["node"]: r for r in rows}
    states = [by_node[n.index]["state"] for n in gr.nodes]
    crashed = [n for n in gr.nodes if by_node[n.index]["state"] == "crashed"]
    if crashed:
        def end(n: Node) -> float:
            r = by_node[n.index]
            return (r.get("started_at") or 0.0) + (r.get("duration_s") or 0.0)

        def follower(n: Node) -> bool:
            r = by_node[n.index]
            return bool(PEER_LOST.search(" ".join(str(r.get(k) or "") for k in ("reason", "exception"))))

        first = sorted(crashed, key=lambda n: (follower(n), end(n)))[0]
        running = [label(n) for n in gr.nodes if by_node[n.index]["state"] in RUNNING]
        why = f"{label(first)}: {by_node[first.index].get('reason') or 'crashed'}"
        if running:
            why += f"; still running: {', '.join(running)}"
        return "crashed", why, first.index
    unreachable = [n for n in gr.nodes if by_node[n.index]["state"] == "unreachable"]
    if unreachable:
        return "unreachable", ", ".join(label(n) for n in unreachable), unreachable[0].index
    if all(s == "absent" for s in states):
        return "absent", None, None
    running = [s for s in states if s in RUNNING]
    if running and len(running) < len(states):
        gone = [n for n in gr.nodes if by_node[n.index]["state"] not in RUNNING]
        return "degraded", ", ".join(f"{label(n)} {by_node[n.index]['state']}" for n in gone), gone[0].index
    if running:
        for s in ("stalled", "restarting"):
            if s in states:
                return s, None, states.index(s)
        slowest = min(states, key=lambda s: PROGRESS.index(s) if s in PROGRESS else 0)
        return slowest, None, None
    if all(s == "finished" for s in states):
        return "finished", None, None
    if "killed" in states:
        return "killed", None, None
    return states[0], None, None


def _rankless(row: dict[str, Any]) -> dict[str, Any]:
    """A node without global rank 0 never sees run_start or phase events (rank 0 writes them); its ranks say
    their phase in heartbeats only. While its process runs, that phase is its state, not `starting`."""
    if row["node"] > 0 and row["state"] == "starting" and row.get("proc_state") == "running" and row.get("phase"):
        phase = row["phase"]
        row["state"] = phase if phase in ("training", "compiling") else "loading"
    return row


ROOT_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.*)$")


def torchrun_root_cause(lines: list[str]) -> str | None:
    """torchrun ends a failed node's log with `Root Cause (first observed failure)`: the rank, its exit code and,
    for a signal, `Signal 9 (SIGKILL) received by PID ...`; its own exception (ChildFailedError) says none of it."""
    try:
        at = max(i for i, line in enumerate(lines) if "Root Cause" in line)
    except ValueError:
        return None
    got: dict[str, str] = {}
    for line in lines[at + 1:at + 12]:
        m = ROOT_FIELD.match(line)
        if m and m.group(1) not in got:
            got[m.group(1)] = m.group(2).strip()
    if not got:
        return None
    tb = got.get("traceback", "")
    detail = tb if tb and not tb.startswith("To enable traceback") else f"exitcode {got.get('exitcode', '?')}"
    return f"rank {got.get('rank', '?')}: {detail}"


def _root_cause(ctx: Ctx, n: Node) -> str | None:
    t = ctx.transport(n.host)
    try:
        args = run_args(n.run, log_offset=-1, tail=80, once=True, no_events=True, gpu_interval=0)
        return torchrun_root_cause([m["line"] for m in stream_agent(t, n.host, "follow", args) if m.get("t") == "log"])
    except TransportError:
        return None
    finally:
        t.close()


def group_rows(ctx: Ctx, gr: GroupRun) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """One `status --json` record per node (every node asked at once), each with its node index and the group."""
    rows: dict[int, list[dict[str, Any]]] = {}
    unreachable: dict[str, str] = {}

    def one(n: Node) -> int:
        got, error = commands._host_status(ctx, n.host, [n.run], quiet=True)
        for r in got:
            if r["state"] == "crashed" and "ChildFailedError" in str(r.get("reason")):
                cause = _root_cause(ctx, n)
                if cause:
                    r["reason"] = f"torchrun: {cause} (exit {r.get('exit_code')})"
        rows[n.index] = got
        if error is not None:
            unreachable[n.host.name] = error
        return EXIT_OK

    on_every_node(ctx, gr.nodes, one)
    out: list[dict[str, Any]] = []
    for n in gr.nodes:
        for r in rows.get(n.index, []):
            out.append(_rankless({**r, "node": n.index}))
    state, why, node = group_verdict(gr, out)
    info = {"name": gr.group, "run": gr.name, "state": state, "reason": why, "node": node,
            "nodes": len(gr.nodes), "nproc_per_node": gr.nproc_per_node, "world_size": gr.world_size,
            "rendezvous": gr.head}
    for r in out:
        r["group"] = info
    return out, unreachable


def cmd_group_status(ctx: Ctx, g: Group, run_name: str | None, as_json: bool = False) -> int:
    """Per node the host's status row, plus the group's state. A crashed group's surviving nodes are stopped:
    a group is one run, and half of it can only wait on the dead half."""
    runs = [group_run(ctx, g, run_name)] if run_name else list(g.runs.values())
    all_rows: list[dict[str, Any]] = []
    unreachable: dict[str, str] = {}
    lock = threading.Lock()
    for gr in runs:
        rows, unr = group_rows(ctx, gr)
        info = rows[0]["group"] if rows else {}
        if info.get("state") == "crashed":
            survivors = [n for n in gr.nodes if next(r for r in rows if r["node"] == n.index)["state"] in RUNNING]
            if survivors:
                ctx.err.print(Text(f"{g.name}/{gr.name} crashed ({info['reason']}): stopping "
                                   f"{', '.join(label(n) for n in survivors)}", style="yellow"))
                stop_nodes(ctx, survivors, lock)
                rows, unr = group_rows(ctx, gr)
        all_rows += rows
        unreachable.update(unr)
    rc = EXIT_TRANSPORT if unreachable else EXIT_OK
    if as_json:
        ctx.raw.write(json.dumps(all_rows, default=str) + "\n")
        ctx.raw.flush()
        return rc
    for gr in runs:
        rows = [r for r in all_rows if r["group"]["run"] == gr.name]
        info = rows[0]["group"]
        title = Text(f"{g.name}/{gr.name}: ")
        title.append(info["state"], style=STATE_COLOURS.get(info["state"], "white"))
        if info.get("reason"):
            title.append(f" ({info['reason']})")
        title.append(f"  {info['nodes']} nodes x {info['nproc_per_node']} = world {info['world_size']}, "
                     f"rendezvous {info['rendezvous']}")
        table = Table(title=title, title_justify="left")
        for col in ("node", "host", "state", "phase", "step", "loss", "heartbeat", "pid", "exit", "reason"):
            table.add_column(col, no_wrap=col not in ("reason",))
        for r in rows:
            table.add_row(str(r["node"]), r["host"], Text(r["state"], style=STATE_COLOURS.get(r["state"], "white")),
                          r["phase"] or "-", str(r["step"]), "-" if r["loss"] is None else f"{r['loss']:.4g}",
                          "-" if r["heartbeat_age_s"] is None else f"{r['heartbeat_age_s']:.0f} s ago",
                          str(r["pid"] or "-"), "-" if r["exit_code"] is None else str(r["exit_code"]),
                          r.get("reason") or "")
        ctx.out.print(table)
    for name, error in unreachable.items():
        ctx.err.print(Text(f"{name}: unreachable: {error}", style="red"))
    return rc


# -- kill, logs, clean ----------------------------------------------------------------------------------------
def cmd_group_kill(ctx: Ctx, g: Group, run_name: str) -> int:
    """Every node at once (its ranks wait on each other's collectives), each node's result on its own lines."""
    gr = group_run(ctx, g, run_name)
    rcs = stop_nodes(ctx, gr.nodes, threading.Lock())
    worst = max(rcs.values()) if rcs else EXIT_FAILED
    bad = [label(n) for n in gr.nodes if rcs.get(n.index, EXIT_FAILED) != EXIT_OK]
    if bad:
        ctx.err.print(Text(f"{g.name}/{gr.name}: kill incomplete on {', '.join(bad)}", style="bold red"))
    else:
        ctx.err.print(f"[bold green]killed[/] {g.name}/{gr.name} on every node ({len(gr.nodes)})")
    return worst


def cmd_group_logs(ctx: Ctx, g: Group, run_name: str, follow: bool = False, lines: int = 50,
                   all_attempts: bool = False, node: int | None = None) -> int:
    """Every node's log with a `[nodeI host] ` prefix (interleaved by arrival with -f), or one node's as it is."""
    gr = group_run(ctx, g, run_name)
    if node is not None:
        if not 0 <= node < len(gr.nodes):
            raise OpsError(f"--node {node}: {g.name}/{gr.name} has nodes 0..{len(gr.nodes) - 1}", EXIT_USAGE)
        n = gr.nodes[node]
        return commands.cmd_logs(node_ctx(ctx, n, threading.Lock(), raw=ctx.raw), n.host.name, n.run.name,
                                 follow=follow, lines=lines, all_attempts=all_attempts)
    lock = threading.Lock()
    rcs = on_every_node(ctx, gr.nodes, lambda n: commands.cmd_logs(node_ctx(ctx, n, lock), n.host.name,
                                                                   n.run.name, follow=follow, lines=lines,
                                                                   all_attempts=all_attempts))
    return max(rcs.values()) if rcs else EXIT_FAILED


def cmd_group_clean(ctx: Ctx, g: Group, run_name: str | None, dry_run: bool = False, logs: bool = False) -> int:
    """clean on every node of every run of the group (or of RUN)."""
    runs = [group_run(ctx, g, run_name)] if run_name else list(g.runs.values())
    lock = threading.Lock()
    worst = EXIT_OK
    for gr in runs:
        rcs = on_every_node(ctx, gr.nodes, lambda n: commands.cmd_clean(node_ctx(ctx, n, lock), n.host.name,
                                                                        n.run.name, dry_run=dry_run, logs=logs))
        worst = max([worst, *rcs.values()])
    return worst


GROUP_VERBS = ("launch", "status", "logs", "kill", "clean")


def dispatch(ctx: Ctx, args: Any, extra: list[str] | None) -> int | None:
    """The CLI's hook: a verb whose HOST names a group runs here (None: HOST is a host, the host verbs run)."""
    if args.verb == "watch":
        return _watch(ctx, args)
    g = group_of(ctx, getattr(args, "host", None)) if args.verb in GROUP_VERBS else None
    if g is None:
        if getattr(args, "node", None) is not None:
            raise OpsError("--node is for group runs (a HOST that names a group in hosts.yaml)", EXIT_USAGE)
        return None
    if args.verb == "launch":
        if args.extra_args:
            raise OpsError(f"unexpected arguments {' '.join(args.extra_args)!r}: arguments for the run's command go "
                           "after --", EXIT_USAGE)
        return cmd_group_launch(ctx, g, args.run, force=args.force, follow=args.follow,
                                fresh_cache=args.fresh_cache, extra_args=extra)
    if args.verb == "status":
        return cmd_group_status(ctx, g, args.run, as_json=args.json)
    if args.verb == "logs":
        if args.lines < 0:
            raise OpsError("-n must be >= 0", EXIT_USAGE)
        return cmd_group_logs(ctx, g, args.run, follow=args.follow, lines=args.lines, all_attempts=args.all,
                              node=args.node)
    if args.verb == "kill":
        return cmd_group_kill(ctx, g, args.run)
    return cmd_group_clean(ctx, g, args.run, dry_run=args.dry_run, logs=args.logs)


def _quiet(ctx: Ctx, verb: Callable[..., int], *args: Any) -> tuple[int, str]:
    """A group verb with its output in a buffer (the full-screen watch owns the terminal): (exit code, output)."""
    buf = io.StringIO()
    con = Console(file=buf, highlight=False, width=120)
    quiet = Ctx(hosts_file=ctx.hosts_file, accept_new_host_key=ctx.accept_new_host_key, out=con, err=con, raw=buf,
                _inv=ctx._inv, transport_factory=ctx.transport_factory)
    try:
        rc = verb(quiet, *args)
    except OpsError as exc:
        buf.write(str(exc) + "\n")
        rc = exc.code
    return rc, buf.getvalue()


def watch_sources(ctx: Ctx, g: Group, run: str | None) -> list[Any]:
    """`watch GROUP[:RUN]`: every node of the group run as a source (its GPUs and log); `k` / `c` on any node
    kill / clean the whole group run, never one node alone (the others would only wait on it)."""
    from opsctl.watch import AgentSource

    runs = [group_run(ctx, g, run)] if run else list(g.runs.values())
    return [AgentSource(n.host, n.run, ctx.transport, kill=functools.partial(_quiet, ctx, cmd_group_kill, g, gr.name),
                        clean=functools.partial(_quiet, ctx, cmd_group_clean, g, gr.name))
            for gr in runs for n in gr.nodes]


def _watch(ctx: Ctx, args: Any) -> int | None:
    """`watch GROUP[:RUN] [HOST[:RUN] ...]`: the nodes of the group runs next to the hosts' runs (None: no group
    among the targets, the host watch runs as it is)."""
    groups = [(g, run) for host, _, run in (t.partition(":") for t in args.targets)
              if (g := group_of(ctx, host)) is not None]
    if not groups:
        return None
    from opsctl.tui import watch_main

    others = [t for t in args.targets if group_of(ctx, t.partition(":")[0]) is None]
    sources = [*(commands.watch_sources(ctx, others) if others else []),
               *(s for g, run in groups for s in watch_sources(ctx, g, run or None))]
    return watch_main(sources, plain=args.plain, once_json=args.once or args.json, bell=args.bell)
