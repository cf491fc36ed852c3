"""`opsctl history HOST RUN`: every attempt of a run (launches, restarts, refused launches), newest last.

The history lives on the host (STATE_DIR/history.jsonl, written by the agent and the run's wrapper), so every client
sees the same one; this module only asks the agent for it and prints it, like `sky jobs queue`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rich.table import Table
from rich.text import Text

from opsctl.channel import ChannelLost, run_args, stream_agent
from opsctl.commands import EXIT_FAILED, EXIT_OK, EXIT_TRANSPORT, Ctx, OpsError, fmt_tau, preflight
from opsctl.runstate import fmt_span, fmt_when

OUTCOME_STYLES = {"finished": "green", "crashed": "red", "killed": "yellow", "refused": "magenta",
                  "running": "cyan", "restarting": "yellow", "lost": "red"}


def fetch_history(ctx: Ctx, host_name: str, run_name: str) -> list[dict[str, Any]]:
    """The run's attempts as the agent reads them on the host, oldest first, each with `duration_s`."""
    host, run = ctx.resolve(host_name, run_name)
    assert run is not None
    t = ctx.transport(host)
    msg: dict[str, Any] | None = None
    errors: list[str] = []
    try:
        preflight(ctx, host, t)
        for m in stream_agent(t, host, "history", run_args(run)):
            if m.get("t") == "history":
                msg = m
            elif m.get("t") == "error":
                errors.append(str(m.get("message")))
    except ChannelLost as exc:
        raise OpsError(f"{host.name}: {exc}", EXIT_TRANSPORT) from None
    finally:
        t.close()
    if msg is None:
        raise OpsError(f"{host.name}/{run.name}: agent: {'; '.join(errors) or 'no history message'}", EXIT_FAILED)
    now = float(msg.get("ts") or time.time())  # the host's clock, like the records
    out = []
    for a in msg.get("attempts") or []:
        started, ended = a.get("started"), a.get("ended")
        end = ended if isinstance(ended, (int, float)) else (now if a.get("outcome") == "running" else None)
        a["duration_s"] = None if not isinstance(started, (int, float)) or end is None else max(0.0, end - started)
        out.append({"host": host.name, "run": run.name, **a})
    return out


WHY_LINES = 2  # a refusal's advice can fill a screen; the table shows its start (history --json has all of it)
WHY_CHARS = 160


def short_why(why: str) -> str:
    """The first WHY_LINES lines (at most WHY_CHARS) of why an attempt ended, `...` where cut."""
    lines = [ln for ln in str(why).splitlines() if ln.strip()]
    head = "\n".join(lines[:WHY_LINES])
    cut = len(lines) > WHY_LINES or len(head) > WHY_CHARS
    return (head[:WHY_CHARS].rstrip() + " ...") if cut else head


def _how(a: dict[str, Any]) -> Text:
    outcome = str(a.get("outcome") or "-")
    text = Text(outcome, style=OUTCOME_STYLES.get(outcome, "white"))
    why = a.get("exception") or (f"signal {a['signal']}" if a.get("signal") else None) or a.get("reason")
    if outcome == "refused" and a.get("reason"):  # the refusal's own words, as status gives them (runstate._reason)
        why = a["reason"]
    if why:
        text.append(f" ({short_why(why)})")
    return text


def _checkpoint(a: dict[str, Any]) -> Text:
    """The attempt's last checkpoint; `(deleted)` once keep_last removed it (never a link to nothing)."""
    path = a.get("checkpoint")
    if not path:
        return Text("-")
    if a.get("checkpoint_exists") is False:
        return Text.assemble(str(path), (" (deleted)", "dim"))
    return Text(str(path))


def cmd_history(ctx: Ctx, host_name: str, run_name: str, as_json: bool = False) -> int:
    """Every attempt: id, start, duration, how it ended, exit code, first and last step, log, checkpoint, and what
    started it (a launch or a restart, with the arguments given after --)."""
    attempts = fetch_history(ctx, host_name, run_name)
    if as_json:
        ctx.raw.write(json.dumps(attempts, default=str) + "\n")
        ctx.raw.flush()
        return EXIT_OK
    if not attempts:
        ctx.err.print(f"{host_name}/{run_name}: no attempts recorded (never launched by an opsctl that keeps "
                      f"history)")
        return EXIT_OK
    table = Table(title=f"{host_name}/{run_name}: {len(attempts)} attempt(s), newest last")
    cols = ["#", "started", "duration", "how it ended", "exit", "steps", "log", "checkpoint", "by"]
    show_tau = any(a.get("last_tau_step") is not None for a in attempts)  # the run evaluates during training
    if show_tau:
        cols[6:6] = ["last τ (step)", "best τ (step)"]
    for col in cols:
        # paths whole, folded onto more lines where the terminal is narrow: `/tmp/uxt/inv/ru…` named no file
        table.add_column(col, no_wrap=col in ("#", "started", "duration", "exit", "steps", "last τ (step)",
                                              "best τ (step)"),
                         overflow="fold" if col in ("log", "checkpoint") else "ellipsis")
    for a in attempts:
        first, last = a.get("first_step"), a.get("last_step")
        steps = "-" if last is None else (f"{first}-{last}" if first is not None and first != last else str(last))
        how = a.get("by") or "launch"
        if how == "restart":
            how = f"restart {a.get('restart')} of #{a.get('restart_of')}"
        extra = " ".join(a.get("extra_args") or [])
        cells: list[Any] = [str(a.get("id")), fmt_when(a.get("started")), fmt_span(a.get("duration_s")), _how(a),
                            "-" if a.get("exit_code") is None else str(a["exit_code"]), steps, a.get("log") or "-",
                            _checkpoint(a), how + (f" -- {extra}" if extra else "")]
        if show_tau:
            cells[6:6] = [fmt_tau(a.get("last_tau"), a.get("last_tau_step")),
                          fmt_tau(a.get("best_tau"), a.get("best_tau_step"))]
        table.add_row(*cells)
    ctx.out.print(table)
    return EXIT_OK
