"""A group run's own record on its head node: its attempts (each one node attempt per node), its restart state, and
`opsctl history GROUP RUN` built from it and from every node's own history.

The record is written by the opsctl that launches and follows the group (`launch GROUP RUN --follow`): no process on
one host can stop and restart every node, so the group's restart policy lives in that client, and the record on the
head is how every other client (status, history, kill) sees what it does.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from rich.table import Table
from rich.text import Text

from opsctl.channel import run_args, stream_agent
from opsctl.commands import EXIT_OK, EXIT_TRANSPORT, Ctx, OpsError, fmt_tau
from opsctl.group import GroupRun, verdict
from opsctl.history import OUTCOME_STYLES
from opsctl.runstate import fmt_span, fmt_when
from opsctl.transport import TransportError

# A restart due this long ago that no new attempt followed: the opsctl that was to start it is gone.
RELAUNCH_GRACE_S = 60.0


class GroupRecord:
    """The head node's group.jsonl as the agent reads it: attempts merged by id (later keys win), with the head's
    clock, so that times written by one client are compared with another's on the same clock."""

    def __init__(self, records: list[dict[str, Any]], head_ts: float, lease: dict[str, Any] | None = None,
                 lease_granted: bool | None = None) -> None:
        merged: dict[int, dict[str, Any]] = {}
        for r in records:
            merged.setdefault(int(r["id"]), {}).update(r)
        self.attempts = [merged[k] for k in sorted(merged)]
        self.head_ts = head_ts
        self.offset = head_ts - time.time()  # head clock - this client's clock
        # The supervisor lease (opsctl.group_lease): its holder, `live` and `heartbeat_age_s` by the head's clock;
        # `lease_granted`: the answer to this call's lease operation or conditional record (None: none asked).
        self.lease = lease
        self.lease_granted = lease_granted

    def now(self) -> float:
        """The head's clock now."""
        return time.time() + self.offset

    @property
    def last(self) -> dict[str, Any] | None:
        return self.attempts[-1] if self.attempts else None

    def killed(self, gid: int | None) -> bool:
        return any(a.get("id") == gid and a.get("killed") for a in self.attempts)

    def restart_state(self) -> dict[str, Any] | None:
        """While the group waits out its back-off or is being relaunched: {n, max, at, reason, node, stale}.
        `stale`: the restart was due long ago and nothing relaunched it (its opsctl is gone)."""
        last = self.last
        if last is None or last.get("killed"):
            return None
        now = self.now()
        if last.get("restart_at") is not None:
            at = float(last["restart_at"])
            return {"n": last.get("restart_n"), "max": last.get("restart_max"), "at": at,
                    "reason": last.get("reason"), "node": last.get("node"), "attempt": last.get("id"),
                    "stale": now > at + RELAUNCH_GRACE_S}
        if last.get("by") == "restart" and not last.get("launched") and not last.get("outcome"):
            started = float(last.get("started") or 0)
            prev = next((a for a in self.attempts if a.get("id") == last.get("restart_of")), {})
            return {"n": last.get("restart"), "max": last.get("restart_max"), "at": started,
                    "reason": prev.get("reason"), "node": prev.get("node"), "attempt": last.get("id"),
                    "stale": now > started + RELAUNCH_GRACE_S}
        return None


def group_record(ctx: Ctx, gr: GroupRun, record: dict[str, Any] | None = None, lease: dict[str, Any] | None = None,
                 if_lease: str | None = None) -> tuple[GroupRecord, int | None]:
    """The group run's record on its head node (node 0's state dir), `record` appended first (without an `id`: a
    new attempt, whose id is returned). `lease`: an operation on the supervisor lease, done first (its answer:
    GroupRecord.lease_granted); `if_lease`: `record` is written only while that token holds the lease. Raises
    OpsError when the head cannot be asked."""
    head = gr.nodes[0]
    t = ctx.transport(head.host)
    opts: dict[str, Any] = {"record": record}
    if lease is not None:
        opts["lease"] = lease
    if if_lease is not None:
        opts["if_lease"] = if_lease
    try:
        for m in stream_agent(t, head.host, "group", run_args(head.run, **opts)):
            if m.get("t") == "group":
                return GroupRecord(list(m.get("records") or []), float(m.get("ts") or time.time()),
                                   m.get("lease"), m.get("lease_granted")), m.get("added")
            if m.get("t") == "error":
                raise OpsError(f"{head.host.name}: agent: {m.get('message')}", EXIT_TRANSPORT)
    except TransportError as exc:  # ChannelLost included
        raise OpsError(f"{head.host.name}: the group's record: {exc}", EXIT_TRANSPORT) from None
    finally:
        t.close()
    raise OpsError(f"{head.host.name}: the agent sent no group record", EXIT_TRANSPORT)


def try_group_record(ctx: Ctx, gr: GroupRun, record: dict[str, Any] | None = None, if_lease: str | None = None
                     ) -> tuple[GroupRecord | None, int | None]:
    """group_record, or (None, None) when the head cannot be reached (the node verbs say why)."""
    try:
        return group_record(ctx, gr, record, if_lease=if_lease)
    except OpsError:
        return None, None


# -- opsctl history GROUP RUN --------------------------------------------------------------------------------
def _node_outcome(a: dict[str, Any] | None, cause: int | None, node: int, group_outcome: str | None) -> str:
    """How one node's attempt ended, as the group sees it: a node opsctl stopped after its peer crashed is
    `stopped`, not `killed`."""
    if a is None:
        return "not started"
    out = str(a.get("outcome") or "-")
    if out == "killed" and group_outcome in ("crashed", "refused") and cause is not None and cause != node:
        return "stopped"
    return out


# The wrapper's crash line of a torchrun node whose failed rank left no traceback: torchrun's root cause in it.
_TORCHRUN_CAUSE = re.compile(r"ChildFailedError: (.+) \(no traceback in the log\)$")


def _node_reason(a: dict[str, Any]) -> str:
    """A node attempt's reason as `status` words it for that node (RunState's `exception (exit N)`, torchrun's root
    cause for its ChildFailedError), so that history names what status named."""
    what = a.get("exception")
    if a.get("outcome") == "refused" and a.get("reason"):  # the refusal's own words, as status gives them
        what = a["reason"]
    m = _TORCHRUN_CAUSE.search(str(what or ""))
    if m:
        what = f"torchrun: {m.group(1)}"
    code = a.get("exit_code")
    return f"{what} (exit {code})" if what else f"exit {code}"


def crash_verdict(nodes: list[dict[str, Any]]) -> tuple[int | None, str | None]:
    """(node, reason) of a group attempt that crashed with no opsctl there to record why, from its nodes' own
    attempts (`nodes`: group_history's per-node entries): the same verdict `status GROUP RUN` gives, the node that
    died first and is not a peer's lost connection."""
    rows = []
    for x in nodes:
        started, ended = x.get("started"), x.get("ended")
        rows.append({"node": x["node"], "host": x["host"], "state": x["outcome"],
                     "reason": _node_reason(x), "exception": x.get("exception"), "started_at": started,
                     "duration_s": ended - started if isinstance(started, (int, float))
                     and isinstance(ended, (int, float)) else None})
    state, why, node = verdict(rows)
    return (node, why) if state in ("crashed", "refused") else (None, None)


def group_history(ctx: Ctx, gr: GroupRun, node_histories: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every group attempt, oldest first, each with its nodes' own attempts (outcome, exception, exit code, ...);
    `node_histories`: every node's own history (opsctl.history.fetch_history), by node index."""
    rec, _ = group_record(ctx, gr)
    per_node = {i: {int(a["id"]): a for a in h} for i, h in node_histories.items()}
    out: list[dict[str, Any]] = []
    restart = rec.restart_state()
    for g in rec.attempts:
        ids = {int(k): int(v) for k, v in (g.get("nodes") or {}).items()}
        nodes = []
        for n in gr.nodes:
            a = per_node.get(n.index, {}).get(ids[n.index]) if n.index in ids else None
            nodes.append({"node": n.index, "host": n.host.name, "run": n.run.name,
                          "attempt": None if a is None else a.get("id"),
                          "outcome": _node_outcome(a, g.get("node"), n.index, g.get("outcome")),
                          **{k: (a or {}).get(k) for k in ("exit_code", "exception", "signal", "reason",
                                                           "first_step", "last_step", "log", "checkpoint", "argv")}})
        outcome, cause, why = g.get("outcome"), g.get("node"), g.get("reason")
        if outcome is None:  # not recorded (no opsctl followed it to its end): what its nodes say
            outs = [x["outcome"] for x in nodes]
            outcome = ("crashed" if "crashed" in outs else "refused" if "refused" in outs
                       else "running" if "running" in outs
                       else "finished" if outs and all(o == "finished" for o in outs)
                       else "killed" if "killed" in outs else "lost")
            if g.get("killed") and outcome not in ("crashed", "refused"):
                outcome = "killed"
            if restart and restart["attempt"] == g.get("id") and not restart["stale"]:
                outcome = "starting"  # a restart's attempt, its nodes not launched yet
            if outcome in ("crashed", "refused") and cause is None:  # which node and why, as status says it
                times = {i: (per_node.get(n.index, {}).get(ids.get(n.index, -1)) or {}) for i, n in enumerate(gr.nodes)}
                cause, why = crash_verdict([{**x, "started": times[i].get("started"), "ended": times[i].get("ended")}
                                            for i, x in enumerate(nodes)])
                for x in nodes:  # a node opsctl stopped because of the crash (status stops them) is `stopped`
                    x["outcome"] = _node_outcome({"outcome": x["outcome"]} if x["attempt"] is not None else None,
                                                 cause, x["node"], outcome)
        started, ended = g.get("started"), g.get("ended")
        end = ended if isinstance(ended, (int, float)) else (rec.head_ts if outcome == "running" else None)
        out.append({"group": gr.group, "run": gr.name, "id": g.get("id"), "started": started, "ended": ended,
                    "duration_s": None if not isinstance(started, (int, float)) or end is None
                    else max(0.0, end - started),
                    "by": g.get("by"), "restart": g.get("restart"), "restart_of": g.get("restart_of"),
                    "restart_max": g.get("restart_max"), "supervised": g.get("supervised"),
                    "restart_cancelled": bool(g.get("killed") and g.get("restart_at") is not None),
                    "outcome": outcome, "node": cause, "reason": why,
                    "extra_args": g.get("extra_args") or [], "nodes": nodes})
    return out


def group_attempt_taus(gr: GroupRun, attempts: list[dict[str, Any]],
                       node_histories: dict[int, list[dict[str, Any]]]) -> None:
    """Each group attempt's last and best tau: those of its attempt on the node holding global rank 0 (it alone
    writes eval events, as its steps)."""
    head = next((n.index for n in gr.nodes if 0 in gr.ranks(n.index)), None)
    own = {a.get("id"): a for a in node_histories.get(head, [])} if head is not None else {}
    for g in attempts:
        x = next((x for x in g["nodes"] if x["node"] == head), None)
        a = own.get(x["attempt"], {}) if x is not None else {}
        g.update({k: a.get(k) for k in ("last_tau", "last_tau_step", "best_tau", "best_tau_step")})


def cmd_group_history(ctx: Ctx, gr: GroupRun, node_histories: dict[int, list[dict[str, Any]]],
                      as_json: bool = False) -> int:
    """One row per group attempt: how it ended (crashed naming the node and why), and each node's own ending."""
    attempts = group_history(ctx, gr, node_histories)
    group_attempt_taus(gr, attempts, node_histories)
    if as_json:
        ctx.raw.write(json.dumps(attempts, default=str) + "\n")
        ctx.raw.flush()
        return EXIT_OK
    name = f"{gr.group}/{gr.name}"
    if not attempts:
        ctx.err.print(f"{name}: no group attempts recorded (each node's own: opsctl history HOST "
                      f"{gr.nodes[0].run.name})")
        return EXIT_OK
    table = Table(title=f"{name}: {len(attempts)} attempt(s) of the group, newest last")
    show_tau = any(a.get("last_tau_step") is not None for a in attempts)
    cols = ["#", "started", "duration", "how it ended", "nodes", "args"]
    if show_tau:
        cols[5:5] = ["last τ (step)", "best τ (step)"]
    for col in cols:
        table.add_column(col, no_wrap=col in ("#", "started", "duration", "last τ (step)", "best τ (step)"))
    for a in attempts:
        outcome = str(a["outcome"])
        how = Text(outcome, style=OUTCOME_STYLES.get(outcome, "white"))
        if a.get("reason"):
            how.append(f" ({a['reason']})")
        nodes = Text()
        for x in a["nodes"]:
            if nodes:
                nodes.append("\n")
            nodes.append(f"node{x['node']} {x['host']}: ")
            nodes.append(x["outcome"], style=OUTCOME_STYLES.get(x["outcome"], "white"))
            detail = x.get("exception") or (f"signal {x['signal']}" if x.get("signal") else None)
            if x.get("exit_code") is not None:
                detail = f"{detail}, exit {x['exit_code']}" if detail else f"exit {x['exit_code']}"
            if detail:
                nodes.append(f" ({detail})")
        by = a.get("by") or "launch"
        if by == "restart":
            by = f"restart {a.get('restart')} of {a.get('restart_max')} after #{a.get('restart_of')}"
        extra = " ".join(a.get("extra_args") or [])
        cells: list[Any] = [str(a["id"]), fmt_when(a.get("started")), fmt_span(a.get("duration_s")), how, nodes,
                            by + (f" -- {extra}" if extra else "")]
        if show_tau:
            cells[5:5] = [fmt_tau(a.get("last_tau"), a.get("last_tau_step")),
                          fmt_tau(a.get("best_tau"), a.get("best_tau_step"))]
        table.add_row(*cells)
    ctx.out.print(table)
    return EXIT_OK

