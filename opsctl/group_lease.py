"""The supervisor lease of a group run: which opsctl carries out its restart policy now, held on the head node.

Two supervising opsctls would both restart the group after a crash; the lease lets one refuse, or take over from, the
other, and lets the one taken over notice it and stop (it exits with EXIT_TAKEN_OVER).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from typing import Any

from opsctl.commands import EXIT_REFUSED, Ctx, OpsError
from opsctl.group import GroupRun
from opsctl.group_record import GroupRecord, group_record
from opsctl.runstate import fmt_when

# How often a supervisor refreshes its lease's heartbeat; the lease is stale (its holder gone) after three intervals
# without one (opsctl.remote.agent.LEASE_STALE_INTERVALS). Tests set a short interval through the environment.
REFRESH_ENV = "OPSCTL_SUPERVISOR_REFRESH_S"
DEFAULT_REFRESH_S = 12.0


def refresh_interval() -> float:
    """$OPSCTL_SUPERVISOR_REFRESH_S when it is a positive number, else DEFAULT_REFRESH_S."""
    try:
        value = float(os.environ.get(REFRESH_ENV, ""))
    except ValueError:
        return DEFAULT_REFRESH_S
    return value if value > 0 else DEFAULT_REFRESH_S


def who(lease: dict[str, Any], offset: float = 0.0) -> str:
    """`host pid N (since HH:MM:SS, last heartbeat 3 s ago)`; `offset`: head clock - this client's clock."""
    since = lease.get("since")
    when = fmt_when(float(since) - offset, short=True) if isinstance(since, (int, float)) else "?"
    age = lease.get("heartbeat_age_s")
    beat = f"last heartbeat {age:.0f} s ago" if isinstance(age, (int, float)) else "no heartbeat"
    return f"{lease.get('host')} pid {lease.get('pid')} (since {when}, {beat})"


class TakenOver(Exception):
    """Another opsctl holds this supervisor's lease now (launch --take-over): this one must stop supervising."""

    def __init__(self, lease: dict[str, Any] | None) -> None:
        super().__init__("supervision taken over")
        self.lease = lease


class Lease:
    """This opsctl's claim to supervise one group run: acquired once, refreshed by a background thread (the
    follow loop never waits on the head for it), released at the end unless another opsctl took it."""

    def __init__(self, ctx: Ctx, gr: GroupRun) -> None:
        self.ctx, self.gr = ctx, gr
        self.token = secrets.token_hex(8)
        self.refresh_s = refresh_interval()
        self.lost: dict[str, Any] | None = None  # the lease as found when it was no longer this opsctl's
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def taken_over(self) -> bool:
        return self._lost.is_set()

    def acquire(self, expect: str | None) -> GroupRecord:
        """Take the lease: free, released or stale, or held by `expect` (the token this opsctl saw and chose to
        replace). Raises OpsError (refused) when another opsctl took it meanwhile, or the head cannot be asked:
        supervising without the lease is what the lease exists to prevent."""
        name = f"{self.gr.group}/{self.gr.name}"
        op = {"op": "acquire", "token": self.token, "expect": expect, "host": socket.gethostname(),
              "pid": os.getpid(), "refresh_s": self.refresh_s}
        try:
            rec, _ = group_record(self.ctx, self.gr, lease=op)
        except OpsError as exc:
            raise OpsError(f"{name}: cannot take its supervisor lease on the head node: {exc}", exc.code) from None
        if not rec.lease_granted:
            other = rec.lease or {}
            raise OpsError(f"{name}: another opsctl took its supervision meanwhile: {who(other, rec.offset)}; "
                           "nothing started", EXIT_REFUSED)
        return rec

    def start(self) -> None:
        """Refresh the heartbeat every refresh_s until stop(); a refresh that fails (head unreachable) is tried
        again at the next interval, a refresh refused (the token is not this one's) marks the lease lost."""
        self._thread = threading.Thread(target=self._refresher, name="supervisor-lease", daemon=True)
        self._thread.start()

    def _refresher(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                rec, _ = group_record(self.ctx, self.gr, lease={"op": "refresh", "token": self.token})
            except Exception:  # noqa: BLE001 - a missed heartbeat is not a reason to stop following
                continue
            if rec.lease_granted is False:
                self.note_lost(rec)
                return

    def note_lost(self, rec: GroupRecord | None) -> None:
        """The head answered that this token no longer holds the lease."""
        self.lost = rec.lease if rec is not None else None
        self._lost.set()

    def check(self) -> None:
        """Raise TakenOver once the lease is known lost."""
        if self._lost.is_set():
            raise TakenOver(self.lost)

    def stop(self) -> None:
        """Stop refreshing and release the lease (only if this token still holds it: the agent checks)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.refresh_s + 30.0)
        if self._lost.is_set():
            return
        deadline = time.monotonic() + 10.0
        while True:
            try:
                group_record(self.ctx, self.gr, lease={"op": "release", "token": self.token})
                return
            except OpsError:
                if time.monotonic() > deadline:
                    return  # the lease goes stale by itself
                time.sleep(1.0)
