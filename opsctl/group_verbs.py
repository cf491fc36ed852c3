"""The opsctl verbs on a group run (launch, status, kill, logs, clean, history, export): each node is a host's run.

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
import signal
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
    EXIT_TAKEN_OVER,
    EXIT_TIMEOUT,
    EXIT_TRANSPORT,
    EXIT_USAGE,
    STATE_COLOURS,
    Ctx,
    OpsError,
)
from opsctl.group import PEER_LOST, RUNNING, Group, GroupRun, Node, rankless, verdict
from opsctl.group_lease import Lease, TakenOver, who
from opsctl.group_record import GroupRecord, cmd_group_history, try_group_record
from opsctl.remote.rules import resume_argv, torchrun_root_cause, with_args
from opsctl.runstate import fmt_when
from opsctl.transport import PreflightRefused, Transport, TransportError

PEER_WAIT_S = 5.0  # after a peer-lost failure, how long launch waits for the node that caused it to say so


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
    attempt: int | None = None  # the node's own attempt id (its history), once launched
    killed: bool = False  # the node's run carries opsctl kill's marker
    refused: bool = False  # its run refused to start (run_end `refused`): a person must act, no restart helps

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


def _preflight_all(ctx: Ctx, g: Group, gr: GroupRun) -> list[OpsError]:
    """Every node's preflight, each said as it is done; the refusals (nothing starts unless every node passes)."""
    said: dict[int, OpsError | str] = {}

    def one(n: Node) -> int:
        try:
            said[n.index] = node_preflight(ctx, n)
        except OpsError as exc:
            said[n.index] = exc
        return EXIT_OK

    on_every_node(ctx, gr.nodes, one)  # every node at once, said in node order
    refusals: list[OpsError] = []
    for n in gr.nodes:
        got = said[n.index]
        if isinstance(got, OpsError):
            ctx.err.print(Text(f"FAIL {got}", style="red"))
            refusals.append(got)
        else:
            ctx.err.print(Text(f"ok   {label(n)}: {got}"))
    if refusals:
        ctx.err.print(Text(f"{g.name}/{gr.name}: refused, nothing started on any node "
                           f"({len(refusals)} of {len(gr.nodes)} failed preflight)", style="bold red"))
    return refusals


@dataclasses.dataclass
class _Attempt:
    """How one start of every node ended."""

    rc: int
    outcome: str  # ready (returned at READY) | finished | crashed | refused | killed | timeout | lost
    node_attempts: dict[int, int] = dataclasses.field(default_factory=dict)


# Called once a node failed, before the other nodes are stopped: (cause node, reason, killed by opsctl, and by
# keyword `refused`: the node's run refused to start).
BeforeStop = Callable[..., None]


def _attempt(ctx: Ctx, g: Group, gr: GroupRun, force: bool, follow: bool, fresh_cache: bool,
             extra_args: list[str], before_stop: BeforeStop, on_launched: Callable[[dict[int, int]], None],
             attach: dict[int, int] | None = None, lease: Lease | None = None) -> _Attempt:
    """Start every node's torchrun (preflight passed) and follow them: READY when every rank of every node
    stepped; one node failing stops the others. `attach` (node -> its running attempt): follow the nodes that
    already run instead of starting them. `lease`: this supervisor's, checked every turn of the loop (at least once
    a second): TakenOver ends the attempt's following at once, the nodes left to the new supervisor."""
    t0 = time.monotonic()
    if attach is None:
        ctx.err.print(f"[cyan]starting[/] {gr.name} on {len(gr.nodes)} nodes x {gr.nproc_per_node} ranks (world "
                      f"{gr.world_size}), rendezvous {gr.head}")
    lock = threading.Lock()
    q: queue.Queue[tuple[int, dict[str, Any] | Exception | None]] = queue.Queue()
    states = {n.index: _NodeLaunch(n) for n in gr.nodes}
    for i, aid in (attach or {}).items():
        states[i].launched, states[i].attempt = True, aid

    def worker(st: _NodeLaunch) -> None:
        n = st.node
        try:
            if attach is None:
                verb = "launch"
                args = run_args(n.run, force=force, follow=True, gpus=n.host.gpus, fresh_cache=fresh_cache,
                                extra_args=extra_args or [], host=n.host.name)
                args["ready_timeout"] = 10 * 365 * 86400.0  # the group decides READY and its timeout, not one node
            else:  # from now on: the log's new lines, the events' new ones, the verdict when the node ends
                verb, args = "follow", run_args(n.run, log_offset=-1, tail=0, events_offset=-1, gpu_interval=0)
            assert st.transport is not None
            for m in stream_agent(st.transport, n.host, verb, args):
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
    ready = attach is not None  # attached: every node was past READY when this opsctl came
    first_failure: float | None = None
    open_streams = len(states)
    told_launched = attach is not None

    def result(rc: int, outcome: str) -> _Attempt:
        return _Attempt(rc, outcome, {i: s.attempt for i, s in states.items() if s.attempt is not None})

    try:
        while True:
            if lease is not None:
                lease.check()
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
                    return result(EXIT_TIMEOUT, "timeout")
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
                        return result(EXIT_TRANSPORT, "lost")
                else:
                    _launch_message(ctx, st, m, lock)
            if not told_launched and all(s.attempt is not None for s in states.values()):
                told_launched = True
                on_launched({i: s.attempt for i, s in states.items() if s.attempt is not None})
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
                rc, outcome = _group_failed(ctx, g, gr, states, cause, lock, before_stop)
                return result(rc, outcome)
            if not ready and all(set(gr.ranks(s.node.index)) <= s.stepped or s.ok_exit for s in states.values()):
                ready = True
                ctx.err.print(f"[bold green]READY[/] {gr.name}: every rank of {len(gr.nodes)} nodes stepped "
                              f"(world {gr.world_size})  [{time.monotonic() - t0:.2f} s]")
                if not follow:
                    return result(EXIT_OK, "ready")
            if all(s.ok_exit for s in states.values()):
                if any(s.killed for s in states.values()):
                    return result(EXIT_FAILED, "killed")
                ctx.err.print(f"[bold green]{gr.name} finished[/] on every node")
                return result(EXIT_OK, "finished")
            if not open_streams:
                return result(EXIT_FAILED, "crashed")
    finally:
        for st in states.values():  # the agents' channels: the runs themselves go on in their tmux sessions
            if st.transport is not None:
                st.transport.close()


def cmd_group_launch(ctx: Ctx, g: Group, run_name: str, force: bool = False, follow: bool = False,
                     fresh_cache: bool = False, extra_args: list[str] | None = None, take_over: bool = False) -> int:
    """Preflight every node, then start every node's torchrun; READY when every rank of every node stepped.

    With a restart policy and --follow this opsctl is the group's supervisor: a node that crashes gets every node
    stopped, and after the back-off every node starts again with the resume arguments, up to `max` restarts. No
    process on one host can stop and restart the other hosts' nodes, so without a following opsctl nothing
    restarts; every step is recorded on the head node (status, history and kill read it from any client). One
    supervisor at a time: it holds a lease on the head (opsctl.group_lease), and a second one is refused while
    that lease is live (two would both restart the group), unless `take_over`."""
    gr = group_run(ctx, g, run_name)
    name, policy, extra = f"{g.name}/{gr.name}", gr.restart, list(extra_args or [])
    supervised = bool(policy and follow)
    if take_over and not supervised:
        raise OpsError("--take-over moves the supervision of a group run to this opsctl: "
                       + ("it needs --follow" if policy else f"{name} has no restart policy, so no opsctl "
                          "supervises it (launch --follow alone follows it)"), EXIT_USAGE)
    if policy and not follow:
        ctx.err.print(Text(f"note: {name} has a restart policy, which only an opsctl that follows the group carries "
                           f"out (opsctl launch {g.name} {gr.name} --follow): this launch returns at READY, and a "
                           "crash after that stays a crash", style="yellow"))
    rec, _ = try_group_record(ctx, gr)
    other = rec.lease if supervised and rec is not None and rec.lease and not rec.lease.get("released") else None
    if other is not None and other.get("live") and not take_over:
        assert rec is not None
        raise OpsError(_supervised_elsewhere(g, gr, other, rec), EXIT_REFUSED)
    rs = rec.restart_state() if rec else None
    if rs and not rs["stale"]:
        raise OpsError(f"{name} is restarting (restart {rs['n']} of {rs['max']}, by the opsctl that follows it); "
                       f"stop it first: opsctl kill {g.name} {gr.name}"
                       + ("; --take-over works once it runs again" if take_over else ""), EXIT_REFUSED)
    lease = Lease(ctx, gr) if supervised else None
    expect = str(other.get("token")) if other is not None else None
    attach = _running_attempt(ctx, gr, rec) if follow and not extra and rec is not None else None
    if attach is not None:
        assert rec is not None and rec.last is not None
        gid = int(rec.last["id"])
        if lease is not None:
            lease.acquire(expect)
        ctx.err.print(f"[cyan]following[/] {name}: already running on every node (group attempt #{gid}); "
                      + ("carrying out its restart policy from now on" if policy else "until it ends"))
        if supervised:
            try_group_record(ctx, gr, {"id": gid, "supervised": True})
    else:
        if _preflight_all(ctx, g, gr):
            return EXIT_REFUSED
        if lease is not None:
            lease.acquire(expect)
        _, gid = try_group_record(ctx, gr, {"started": _head_now(rec), "by": "launch", "extra_args": extra,
                                            "supervised": supervised,
                                            "restart_max": policy.max if policy else None})
    if lease is None:
        return _follow_group(ctx, g, gr, rec, attach, gid, force, follow, fresh_cache, extra, None)
    if other is not None:
        assert rec is not None
        _say_replaced(ctx, name, other, rec)
    lease.start()
    restore = _sigterm_as_interrupt()
    try:
        return _follow_group(ctx, g, gr, rec, attach, gid, force, follow, fresh_cache, extra, lease)
    except TakenOver as exc:
        by = who(exc.lease) if exc.lease else "another opsctl"
        ctx.err.print(Text(f"{name}: supervision taken over by {by} (launch --take-over): this opsctl stops "
                           f"supervising, restarts nothing and exits {EXIT_TAKEN_OVER}; the group goes on under "
                           "the other one", style="bold yellow"))
        return EXIT_TAKEN_OVER
    finally:
        restore()
        lease.stop()


def _supervised_elsewhere(g: Group, gr: GroupRun, other: dict[str, Any], rec: GroupRecord) -> str:
    """Why a second supervisor is refused, whom it would compete with, and the ways out."""
    cmd = f"{g.name} {gr.name}"
    return (f"{g.name}/{gr.name} is supervised by another opsctl: {who(other, rec.offset)}; two supervisors would "
            f"both restart the group after a crash. Wait for it to end; look without supervising: opsctl status "
            f"{cmd} / opsctl watch {g.name}:{gr.name} / opsctl logs {cmd} -f; or replace it: opsctl launch {cmd} "
            f"--follow --take-over (when it is gone, or to move supervision here: it stops at its next heartbeat "
            f"and exits {EXIT_TAKEN_OVER})")


def _say_replaced(ctx: Ctx, name: str, other: dict[str, Any], rec: GroupRecord) -> None:
    """This opsctl replaced a supervisor's lease: a live one (--take-over) or one whose opsctl is gone."""
    age = float(other.get("heartbeat_age_s") or 0.0)
    every = float(other.get("refresh_s") or 0.0)
    if other.get("live"):
        ctx.err.print(Text(f"took over the supervision of {name} from {who(other, rec.offset)}: it stops "
                           f"supervising at its next heartbeat (within {every:g} s) and exits {EXIT_TAKEN_OVER}",
                           style="yellow"))
    else:
        ctx.err.print(Text(f"note: the previous supervisor of {name}, {other.get('host')} pid {other.get('pid')}, "
                           f"is gone (its last heartbeat {age:.0f} s ago, stale after {3 * every:g} s without one): "
                           "taking over its supervision", style="yellow"))


def _sigterm_as_interrupt() -> Callable[[], None]:
    """While supervising, SIGTERM (a plain `kill PID`) ends this opsctl as Ctrl-C does: its lease released and the
    head told that nobody supervises, rather than a lease left to go stale. Returns what restores the handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, old)


def _follow_group(ctx: Ctx, g: Group, gr: GroupRun, rec: GroupRecord | None, attach: dict[int, int] | None,
                  gid: int | None, force: bool, follow: bool, fresh_cache: bool, extra: list[str],
                  lease: Lease | None) -> int:
    """The launched (or attached) group, followed to its end; as its supervisor (`lease`), every restart its
    policy allows. Raises TakenOver when another opsctl took the lease: nothing more is recorded or restarted."""
    name, policy, supervised = f"{g.name}/{gr.name}", gr.restart, lease is not None
    token = lease.token if lease is not None else None
    restarts: list[float] = []  # this launch's restarts (client clock), against the policy's max
    if attach is not None and rec is not None:  # taken over: the restarts made since the launch count too
        for a in reversed(rec.attempts):
            if a.get("by") != "restart":
                break
            restarts.insert(0, float(a.get("started") or 0.0) - rec.offset)
    resume = _resume_args(gr, extra)
    now_extra = extra
    while True:
        decision: dict[str, Any] = {"again": False}

        def before_stop(node: int, reason: str, killed: bool, gid: int | None = gid,
                        decision: dict[str, Any] = decision, refused: bool = False) -> None:
            if lease is not None:
                lease.check()  # taken over: the other supervisor records and restarts, not this one
            used = _restart_count(restarts, policy.within_s if policy else None)
            # A refusal (run_end `refused`: e.g. a resume it cannot make) needs a person: a restart would refuse
            # again, so it is never restarted, as the single-host wrapper never restarts one.
            again = supervised and not killed and not refused and policy is not None and used < policy.max
            r: dict[str, Any] = {"id": gid, "ended": _head_now(rec), "node": node, "reason": reason,
                                 "outcome": "killed" if killed else "refused" if refused else "crashed"}
            if again:
                assert policy is not None
                r.update(restart_n=used + 1, restart_max=policy.max, restart_at=_head_now(rec) + policy.backoff_s)
            elif supervised and refused and policy is not None:
                r["no_restart"] = REFUSAL_NOT_RESTARTED
            elif supervised and not killed and policy is not None:
                r["no_restart"] = f"restart limit reached ({used} of {policy.max} restarts used)"
            got, _ = try_group_record(ctx, gr, r, if_lease=token) if gid is not None else (None, None)
            if lease is not None and got is not None and got.lease_granted is False:
                lease.note_lost(got)  # only the lease's holder records the crash and decides the restart
                lease.check()
            if again and got is not None and got.killed(gid):  # `opsctl kill GROUP RUN` came first: no restart
                killed = True
                try_group_record(ctx, gr, {"id": gid, "outcome": "killed", "restart_at": None})
                again = False
            decision.update(again=again, killed=killed, n=used + 1, used=used,
                            at=time.monotonic() + (policy.backoff_s if policy else 0.0))

        def on_launched(ids: dict[int, int], gid: int | None = gid) -> None:
            if gid is not None:
                try_group_record(ctx, gr, {"id": gid, "launched": True, "nodes": {str(k): v for k, v in ids.items()}})

        try:
            res = _attempt(ctx, g, gr, force, follow, fresh_cache, now_extra, before_stop, on_launched, attach,
                           lease=lease)
            attach = None
        except KeyboardInterrupt:
            if supervised and gid is not None:  # nobody restarts the group now: status will say so
                try_group_record(ctx, gr, {"id": gid, "supervised": False}, if_lease=token)
            ctx.err.print(f"[yellow]interrupted[/]: {name} goes on on every node, "
                          + ("no longer supervised: a crash will not be restarted; " if supervised else "")
                          + f"opsctl status {g.name} {gr.name} / opsctl kill {g.name} {gr.name}")
            return 130
        if gid is not None and res.outcome in ("finished", "killed"):
            got, _ = try_group_record(ctx, gr)
            outcome = "killed" if res.outcome == "killed" or (got and got.killed(gid)) else "finished"
            try_group_record(ctx, gr, {"id": gid, "ended": _head_now(got), "outcome": outcome,
                                       "nodes": {str(k): v for k, v in res.node_attempts.items()}})
            if outcome == "killed":
                ctx.err.print(f"[yellow]{name} was killed[/] (opsctl kill): no restart")
                return EXIT_FAILED
        if res.outcome == "refused":
            if supervised and policy is not None:
                ctx.err.print(Text(f"{name}: not restarted: {REFUSAL_NOT_RESTARTED}", style="bold red"))
            return res.rc
        if res.outcome != "crashed" or not decision["again"]:
            if res.outcome == "crashed" and supervised and "used" in decision and not decision.get("killed"):
                assert policy is not None
                ctx.err.print(Text(f"{name}: restart limit reached ({decision.get('used')} of {policy.max}): the "
                                   "group stays crashed", style="bold red"))
            return res.rc
        assert policy is not None
        n = decision["n"]
        ctx.err.print(f"[yellow]restarting[/] {name}: every node stopped; restart {n} of {policy.max} in "
                      f"{policy.backoff_s:g} s" + (f", resuming with {' '.join(resume)}" if resume else ""))
        try:
            while True:  # the back-off; `opsctl kill GROUP RUN` from anywhere cancels the restart
                got, _ = try_group_record(ctx, gr)
                if lease is not None:
                    lease.check()
                if got is not None and got.killed(gid):
                    ctx.err.print(f"[yellow]{name}: restart {n} of {policy.max} cancelled[/]: the group was killed")
                    return EXIT_FAILED
                left = decision["at"] - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(1.0, left))
        except KeyboardInterrupt:  # the supervisor goes: say so on the head, so status does not wait for it
            try_group_record(ctx, gr, {"id": gid, "restart_at": None, "no_restart": "its opsctl was interrupted "
                                       f"before restart {n} of {policy.max}"}, if_lease=token)
            ctx.err.print(f"[yellow]{name}: restart {n} of {policy.max} cancelled[/] (interrupted): the group stays "
                          "crashed")
            return 130
        restarts.append(time.time())
        previous = gid
        got, gid = try_group_record(ctx, gr, {"started": _head_now(got), "by": "restart", "restart": n,
                                              "restart_of": previous, "restart_max": policy.max,
                                              "extra_args": [*extra, *resume], "supervised": True}, if_lease=token)
        if lease is not None and got is not None and got.lease_granted is False:
            lease.note_lost(got)  # the restart is the new holder's to make, never this one's too
            lease.check()
        if got is not None and got.killed(previous):  # killed just before this attempt was recorded
            try_group_record(ctx, gr, {"id": gid, "ended": _head_now(got), "outcome": "killed", "killed": True})
            return EXIT_FAILED
        if _preflight_all(ctx, g, gr):
            try_group_record(ctx, gr, {"id": gid, "ended": _head_now(got), "outcome": "refused",
                                       "reason": "a node failed preflight at the restart"})
            return EXIT_REFUSED
        now_extra = [*extra, *resume]


REFUSAL_NOT_RESTARTED = "a node refused to start; a refusal needs a person (a restart would refuse again)"


def _running_attempt(ctx: Ctx, gr: GroupRun, rec: GroupRecord) -> dict[int, int] | None:
    """node -> attempt id when every node runs the group's latest recorded attempt (launch --follow then follows
    and supervises it instead of refusing: the way back after the opsctl that followed it went away)."""
    last = rec.last
    if last is None or last.get("ended") or not last.get("nodes"):
        return None
    ids = {int(k): int(v) for k, v in last["nodes"].items()}
    rows, _ = group_rows(ctx, gr)
    live = {r["node"]: r.get("attempt") for r in rows if r.get("proc_state") == "running"}
    return ids if all(live.get(n.index) == ids.get(n.index) for n in gr.nodes) else None


def _head_now(rec: GroupRecord | None) -> float:
    return rec.now() if rec is not None else time.time()


def _restart_count(times: list[float], within: float | None) -> int:
    """Restarts that count against `max`: all of this launch's, or those of the last `within` seconds."""
    now = time.time()
    return len(times) if not within else sum(1 for t in times if now - t < within)


def _resume_args(gr: GroupRun, extra: list[str]) -> list[str]:
    """What a restart appends to every node's command: the policy's resume_args, unless the command (with this
    launch's extra arguments) already carries them."""
    if gr.restart is None:
        return []
    want = [str(a) for a in gr.restart.resume_args]
    argv = with_args(gr.nodes[0].run.argv, extra)
    return [] if resume_argv(argv, want) == argv else want


def _launch_message(ctx: Ctx, st: _NodeLaunch, m: dict[str, Any], lock: threading.Lock) -> None:
    kind, prefix = m.get("t"), f"[{label(st.node)}] "
    if kind == "check":
        if not m.get("ok") and not m.get("skipped"):
            ctx.err.print(Text(f"{prefix}FAIL {m.get('name')}: {m.get('detail')}", style="red"))
        elif m.get("warn"):  # a passed check worth saying on a group launch too (e.g. a node with busy CPUs)
            ctx.err.print(Text(f"{prefix}warn {m.get('name')}: {m.get('detail')}", style="yellow"))
    elif kind == "launched":
        st.launched = True
        st.attempt = m.get("attempt") if isinstance(m.get("attempt"), int) else None
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
        elif ev.get("kind") == "run_end" and ev.get("reason") == "refused":
            st.refused = True
    elif kind == "verdict":
        # A node whose ranks never write a step event (e.g. a target node) is not `ready` to its agent: its exit
        # status 0 is what counts.
        if m.get("reason") in ("exited", "died_before_ready") and m.get("exit_code") == 0:
            st.ok_exit = True
        elif not m.get("ok") and m.get("reason") != "timeout":
            st.failure = str(m.get("detail") or m.get("reason"))
            if m.get("traceback"):
                st.failure += ": " + str(m["traceback"]).strip().splitlines()[-1]
    elif kind == "proc":
        st.killed = bool(m.get("killed_by_opsctl"))
    elif kind == "error" and m.get("fatal"):
        st.failure = f"agent: {m.get('message')}"


def _group_failed(ctx: Ctx, g: Group, gr: GroupRun, states: dict[int, _NodeLaunch], first: _NodeLaunch,
                  lock: threading.Lock, before_stop: BeforeStop) -> tuple[int, str]:
    """One node failed: stop every other node that started (kill: SIGINT first, so ranks checkpoint where they
    can), and say the group crashed, naming the node and why (or that opsctl kill stopped it)."""
    for st in states.values():
        if st.transport is not None:
            st.transport.close()
    others = [s.node for s in states.values() if s is not first and s.launched]
    reason = str(first.failure) + (f" ({first.fatal})" if first.fatal and first.fatal not in (first.failure or "")
                                   else "")
    if "ChildFailedError" in reason:  # torchrun's own exception: its root cause says which rank and how
        cause = _root_cause(ctx, first.node)
        reason = f"torchrun: {cause}" if cause else reason
    killed = any(s.killed for s in states.values())
    refused = first.refused and not killed
    if refused and first.fatal:  # the refusal's own words, as status gives them
        reason = f"{first.fatal.split(': ', 1)[-1]} ({first.failure})"
    before_stop(first.node.index, f"{label(first.node)}: {reason}", killed, refused=refused)
    if killed:
        ctx.err.print(Text(f"{g.name}/{gr.name} killed (opsctl kill): {label(first.node)} ended", style="yellow"))
    elif refused:
        ctx.err.print(Text(f"{g.name}/{gr.name} refused: {label(first.node)} refused to start: {reason}",
                           style="bold red"))
    else:
        ctx.err.print(Text(f"{g.name}/{gr.name} crashed: {label(first.node)}: {reason}", style="bold red"))
    if others:
        ctx.err.print(f"stopping {', '.join(label(n) for n in others)}")
        stop_nodes(ctx, others, lock)
    return EXIT_FAILED, "killed" if killed else "refused" if refused else "crashed"


def stop_nodes(ctx: Ctx, nodes: list[Node], lock: threading.Lock) -> dict[int, int]:
    """Mark every node killed, then kill every node: once one node's ranks die, the others' fail their next
    collective and may exit before their own kill arrives; marked first, they still read `killed`."""
    on_every_node(ctx, nodes, lambda n: commands.cmd_mark_killed(node_ctx(ctx, n, lock), n.host.name, n.run.name))
    return on_every_node(ctx, nodes, lambda n: commands.cmd_kill(node_ctx(ctx, n, lock), n.host.name, n.run.name))


# -- status -------------------------------------------------------------------------------------------------
def group_verdict(gr: GroupRun, rows: list[dict[str, Any]]) -> tuple[str, str | None, int | None]:
    """(group state, why, the node it is about) of a group run from its nodes' status rows (opsctl.group.verdict)."""
    by_node = {r["node"]: r for r in rows}
    return verdict([by_node[n.index] for n in gr.nodes])


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

    got: dict[str, GroupRecord | None] = {}
    reader = threading.Thread(target=lambda: got.update(rec=try_group_record(ctx, gr)[0]), daemon=True)
    reader.start()  # the group's own record on the head, while the nodes are asked
    on_every_node(ctx, gr.nodes, one)
    reader.join()
    out: list[dict[str, Any]] = []
    for n in gr.nodes:
        for r in rows.get(n.index, []):
            out.append(rankless({**r, "node": n.index}))
    state, why, node = group_verdict(gr, out)
    rec = got.get("rec")
    restart = rec.restart_state() if rec is not None else None
    info: dict[str, Any] = {"restart_n": None, "restart_max": gr.restart.max if gr.restart else None,
                            "restart_in_s": None, "attempt": rec.last.get("id") if rec and rec.last else None}
    if restart is not None and not restart["stale"]:
        # The opsctl that follows the group is between two attempts: every node stopped (or being stopped, or
        # starting again); a node's old `crashed` is not the group's state.
        assert rec is not None
        left = max(0.0, restart["at"] - rec.now())
        state, node = "restarting", restart["node"]
        why = (f"restart {restart['n']}/{restart['max']} " + (f"in {left:.0f} s " if left else "starting ")
               + f"after {restart['reason'] or 'a crash'}")
        info.update(restart_n=restart["n"], restart_in_s=left)
    elif state == "refused" and gr.restart is not None:  # whoever follows the group: a refusal is never restarted
        why = f"{why}; not restarted: {REFUSAL_NOT_RESTARTED}"
    elif state == "crashed" and gr.restart is not None and rec is not None and rec.last is not None:
        if restart is not None:
            why = f"{why}; restart {restart['n']}/{restart['max']} was due and never started: no opsctl follows " \
                  f"the group (opsctl launch {gr.group} {gr.name} --follow starts it again)"
        elif not rec.last.get("supervised"):
            why = f"{why}; not restarted: the restart policy needs an opsctl following the group (opsctl " \
                  f"launch {gr.group} {gr.name} --follow)"
        elif rec.last.get("no_restart"):
            why = f"{why}; not restarted: {rec.last['no_restart']}"
    info.update({"name": gr.group, "run": gr.name, "state": state, "reason": why, "node": node,
                 "nodes": len(gr.nodes), "nproc_per_node": gr.nproc_per_node, "world_size": gr.world_size,
                 "rendezvous": gr.head, "supervisor": _supervisor_info(rec)})
    info.update(group_tau(gr, out))
    for r in out:
        r["group"] = info
    return out, unreachable


TAU_KEYS = ("tau", "tau_step", "tau_best", "tau_best_step", "ngram_tau")


def group_tau(gr: GroupRun, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The group's tau: that of the node holding global rank 0, which alone writes eval events (as its steps)."""
    head = next((r for r in rows if 0 in gr.ranks(r["node"])), {})
    return {k: head.get(k) for k in TAU_KEYS}


def _supervisor_info(rec: GroupRecord | None) -> dict[str, Any] | None:
    """The opsctl that holds the group's supervisor lease (`stale`: its heartbeat stopped, it is gone), None when
    none does (never supervised, or it released the lease when it ended)."""
    lease = rec.lease if rec is not None else None
    if lease is None or lease.get("released"):
        return None
    assert rec is not None
    return {"host": lease.get("host"), "pid": lease.get("pid"),
            "since": float(lease["since"]) - rec.offset if isinstance(lease.get("since"), (int, float)) else None,
            "heartbeat_age_s": lease.get("heartbeat_age_s"), "refresh_s": lease.get("refresh_s"),
            "stale": not lease.get("live")}


def _supervisor_line(info: dict[str, Any]) -> Text:
    """`supervised by HOST pid N ...` / `not supervised ...`, under a group run's status table."""
    sup = info.get("supervisor")
    if sup is None:
        return Text("not supervised (no opsctl carries out its restart policy now)", style="yellow")
    age = sup.get("heartbeat_age_s")
    beat = f"heartbeat {age:.0f} s ago" if isinstance(age, (int, float)) else "no heartbeat"
    if sup.get("stale"):
        return Text(f"not supervised: its supervisor {sup['host']} pid {sup['pid']} is gone ({beat}); a crash is "
                    "not restarted", style="yellow")
    return Text(f"supervised by {sup['host']} pid {sup['pid']} since {fmt_when(sup.get('since'), short=True)} "
                f"({beat})")


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
        if info.get("state") in ("crashed", "refused"):  # a refused node stops the group as a crash does
            survivors = [n for n in gr.nodes if next(r for r in rows if r["node"] == n.index)["state"] in RUNNING]
            if survivors:
                ctx.err.print(Text(f"{g.name}/{gr.name} {info['state']} ({info['reason']}): stopping "
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
        show_tau = info.get("tau_step") is not None  # node 0's evaluations are the group's
        cols = ["node", "host", "state", "phase", "step", "loss", "heartbeat", "pid", "exit", "reason"]
        if show_tau:
            cols[6:6] = commands.TAU_COLUMNS
        for col in cols:
            table.add_column(col, no_wrap=col not in ("reason",))
        for r in rows:
            cells: list[Any] = [str(r["node"]), r["host"], Text(r["state"], style=STATE_COLOURS.get(r["state"], "white")),
                                r["phase"] or "-", str(r["step"]), "-" if r["loss"] is None else f"{r['loss']:.4g}",
                                "-" if r["heartbeat_age_s"] is None else f"{r['heartbeat_age_s']:.0f} s ago",
                                str(r["pid"] or "-"), "-" if r["exit_code"] is None else str(r["exit_code"]),
                                r.get("reason") or ""]
            if show_tau:
                cells[6:6] = commands.tau_cells(r)
            table.add_row(*cells)
        ctx.out.print(table)
        if gr.restart is not None:  # only a run with a restart policy has a supervisor
            ctx.out.print(_supervisor_line(info))
    for name, error in unreachable.items():
        ctx.err.print(Text(f"{name}: unreachable: {error}", style="red"))
    return rc


# -- kill, logs, clean ----------------------------------------------------------------------------------------
def cmd_group_kill(ctx: Ctx, g: Group, run_name: str) -> int:
    """Every node at once (its ranks wait on each other's collectives), each node's result on its own lines."""
    gr = group_run(ctx, g, run_name)
    rec, _ = try_group_record(ctx, gr)
    last = rec.last if rec is not None else None
    restart = rec.restart_state() if rec is not None else None
    if last is not None and (not last.get("ended") or (restart is not None and not restart["stale"])):
        # Recorded first: the opsctl that follows the group never restarts a group that was killed.
        try_group_record(ctx, gr, {"id": last["id"], "killed": True})
        if restart is not None and not restart["stale"]:
            ctx.err.print(f"{g.name}/{gr.name}: restart {restart['n']} of {restart['max']} cancelled")
    rcs = stop_nodes(ctx, gr.nodes, threading.Lock())
    worst = max(rcs.values()) if rcs else EXIT_FAILED
    bad = [label(n) for n in gr.nodes if rcs.get(n.index, EXIT_FAILED) != EXIT_OK]
    if bad:
        ctx.err.print(Text(f"{g.name}/{gr.name}: kill incomplete on {', '.join(bad)}", style="bold red"))
    else:
        ctx.err.print(f"[bold green]killed[/] {g.name}/{gr.name} on every node ({len(gr.nodes)})")
    return worst


def cmd_group_logs(ctx: Ctx, g: Group, run_name: str, follow: bool = False, lines: int | None = 50,
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


def _node_histories(ctx: Ctx, gr: GroupRun) -> dict[int, list[dict[str, Any]]]:
    """Every node's own attempts (its history on its host), asked of every node at once."""
    from opsctl.history import fetch_history

    lock = threading.Lock()
    out: dict[int, list[dict[str, Any]]] = {}

    def one(n: Node) -> int:
        out[n.index] = fetch_history(node_ctx(ctx, n, lock), n.host.name, n.run.name)
        return EXIT_OK

    on_every_node(ctx, gr.nodes, one)
    return out


GROUP_VERBS = ("launch", "status", "logs", "kill", "clean", "history", "export")


def cmd_hosts_with_groups(ctx: Ctx, check: bool = False) -> int:
    """`opsctl hosts [check]`: the hosts' listing, then the groups: members in node order (the head first), the
    rendezvous and each run's shape and restart policy."""
    rc = commands.cmd_hosts_check(ctx) if check else commands.cmd_hosts_list(ctx)
    if rc != EXIT_OK:
        return rc
    groups = ctx.inventory().groups
    if check:
        for g in groups.values():
            ctx.out.print(f"[green]ok[/] group {g.name} ({', '.join(g.members)}): {', '.join(g.runs) or '(no runs)'}")
        if groups:
            ctx.err.print(f"{len(groups)} group(s)")
        return rc
    if not groups:
        return rc
    table = Table(title="groups: one run across several hosts (node i = the i-th member)", title_justify="left")
    for col in ("group", "members", "rendezvous", "runs"):
        table.add_column(col, no_wrap=col != "runs")
    for g in groups.values():
        runs = []
        for gr in g.runs.values():
            how = f"{gr.name}: {len(gr.nodes)} x {gr.nproc_per_node} = world {gr.world_size}"
            if gr.restart is not None:
                how += f", restart {gr.restart.when} max {gr.restart.max} (by launch --follow)"
            runs.append(how)
        members = ", ".join(f"{m} (head)" if i == 0 else m for i, m in enumerate(g.members))
        endpoint = next(iter(g.runs.values())).head if g.runs else f"{g.head}:{g.port}"
        table.add_row(g.name, members, endpoint, "\n".join(runs) or "(no runs)")
    ctx.out.print(table)
    return rc


def dispatch(ctx: Ctx, args: Any, extra: list[str] | None) -> int | None:
    """The CLI's hook: a verb whose HOST names a group runs here (None: HOST is a host, the host verbs run)."""
    if args.verb == "watch":
        return _watch(ctx, args)
    if args.verb == "hosts":
        return cmd_hosts_with_groups(ctx, check=args.hosts_verb == "check")
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
                                fresh_cache=args.fresh_cache, extra_args=extra, take_over=args.take_over)
    if args.verb == "status":
        return cmd_group_status(ctx, g, args.run, as_json=args.json)
    if args.verb == "history":
        gr = group_run(ctx, g, args.run)
        return cmd_group_history(ctx, gr, _node_histories(ctx, gr), as_json=args.json)
    if args.verb == "logs":
        if args.lines is not None and args.lines < 0:
            raise OpsError("-n must be >= 0", EXIT_USAGE)
        return cmd_group_logs(ctx, g, args.run, follow=args.follow, lines=args.lines, all_attempts=args.all,
                              node=args.node)
    if args.verb == "kill":
        return cmd_group_kill(ctx, g, args.run)
    if args.verb == "export":
        from opsctl.export import cmd_group_export

        return cmd_group_export(ctx, group_run(ctx, g, args.run), args.tensorboard, follow=args.follow)
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
    from opsctl.watch import AgentSource, GroupTag

    runs = [group_run(ctx, g, run)] if run else list(g.runs.values())
    return [AgentSource(n.host, n.run, ctx.transport, kill=functools.partial(_quiet, ctx, cmd_group_kill, g, gr.name),
                        clean=functools.partial(_quiet, ctx, cmd_group_clean, g, gr.name),
                        group=GroupTag(g.name, gr.name, n.index, len(gr.nodes)))
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
