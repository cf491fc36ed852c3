"""The run's attempts, kept by both sides of the tmux boundary: the attempt history (STATE_DIR/history.jsonl),
log rotation (LOG -> LOG.1 ...), each attempt's taus, and a process's start time.

The wrapper records attempts as it starts and ends them; the agent reads them (status, history, launch's refusals)
and records a launch's: one set of rules, in one module both import. Stdlib only, like the whole wing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from typing import Any

from opsctl.remote.base import (
    HISTORY_FILE,
    ROTATIONS_FILE,
    atomic_write,
)
from opsctl.remote.rules import (
    TauTrack,
    _tau_num,
    event_problem,
)

# -- log rotation and the attempt history ---------------------------------------------------------------------


def _rotations(state_dir: str) -> int:
    try:
        with open(os.path.join(state_dir, ROTATIONS_FILE)) as fh:
            return int(fh.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def rotate_logs(log: str, keep: int, state_dir: str) -> tuple[str, int]:
    """Keep earlier attempts' logs: LOG -> LOG.1 -> ... -> LOG.keep (the oldest beyond it goes).

    Returns what was done and the rotation count after it: an attempt records that count as its `log_seq`, so its
    log is found again later as LOG.(count now - log_seq), however many attempts came since."""
    done = _rotations(state_dir)
    try:
        size = os.path.getsize(log)
    except OSError:
        return "no earlier log", done
    if size == 0:
        return "earlier log was empty", done
    keep = max(1, keep)
    dropped = os.path.exists(f"{log}.{keep}")
    for i in range(keep - 1, 0, -1):
        if os.path.exists(f"{log}.{i}"):
            os.replace(f"{log}.{i}", f"{log}.{i + 1}")
    os.replace(log, log + ".1")
    atomic_write(os.path.join(state_dir, ROTATIONS_FILE), f"{done + 1}\n")
    base = os.path.basename(log)
    return "earlier attempt's log kept as {}.1{}".format(
        base, f" (the oldest, {base}.{keep}, dropped: keep_logs {keep})" if dropped else ""), done + 1


def old_logs(log: str) -> list[str]:
    """Earlier attempts' logs, oldest first (LOG.N ... LOG.1)."""
    d, base = os.path.split(log)
    try:
        names = os.listdir(d or ".")
    except OSError:
        return []
    nums = sorted((int(m.group(1)) for m in (re.fullmatch(re.escape(base) + r"\.(\d+)", n) for n in names) if m),
                  reverse=True)
    return [f"{log}.{i}" for i in nums]


def history_add(state_dir: str, _file: str = HISTORY_FILE, _locked: bool = False, **fields: Any) -> int:
    """Append one record to the attempt history and return its attempt id; without `id` a new attempt is
    numbered (under a lock: the agent and the wrapper both add attempts). One write per line, O_APPEND.
    `_file`: another record file kept by the same rules (a group run's own attempts, GROUP_FILE). `_locked`: the
    caller holds history.lock already (a second flock of it in one process would wait on itself)."""
    path = os.path.join(state_dir, _file)
    lock = os.open(os.path.join(state_dir, "history.lock"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if not _locked:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if fields.get("id") is None:
            fields["id"] = max((int(r["id"]) for r in history_lines(path)), default=0) + 1
        data = (json.dumps(fields, separators=(",", ":"), default=str) + "\n").encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        os.close(lock)
    return int(fields["id"])


def history_lines(path: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                if not raw.endswith(b"\n"):
                    break  # a writer died mid-line: the rest is not a record
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("id"), int):
                    out.append(rec)
    except OSError:
        pass
    return out


def read_history(state_dir: str, log: str, keep_logs: int) -> list[dict[str, Any]]:
    """Every attempt, oldest first, its records merged; `log` is the file that holds its log now (None when that
    log was rotated out, removed by `clean --logs`, or empty and reused by the next attempt)."""
    merged: dict[int, dict[str, Any]] = {}
    for rec in history_lines(os.path.join(state_dir, HISTORY_FILE)):
        merged.setdefault(rec["id"], {}).update(rec)
    out = [merged[k] for k in sorted(merged)]
    now = _rotations(state_dir)
    seqs = [a.get("log_seq") for a in out]
    for i, a in enumerate(out):
        seq = a.pop("log_seq", None)
        a["log"] = None
        if not isinstance(seq, int) or seq in seqs[i + 1:]:
            continue
        k = now - seq
        path = log if k == 0 else f"{log}.{k}"
        if 0 <= k <= keep_logs and os.path.exists(path):
            a["log"] = path
    return out


def proc_starttime(pid: int | str = "self") -> int | None:
    """A process's start time in clock ticks (/proc/PID/stat field 22): with the pid, it names it uniquely."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def attempt_taus(events: str | None, attempts: list[dict[str, Any]]) -> None:
    """Each attempt's last and best tau (and their steps) from the events file: the eval events between its start
    and its end (the host's clock, as both are written); null where it evaluated nothing."""
    evals: list[tuple[float, int, float | None]] = []
    try:
        with open(events or "", "rb") as fh:
            for raw in fh:
                if b'"eval"' not in raw or not raw.endswith(b"\n"):
                    continue
                try:
                    ev = json.loads(raw)
                except ValueError:
                    continue
                if event_problem(ev) is None and ev.get("kind") == "eval" and isinstance(ev.get("ts"), (int, float)) \
                        and isinstance(ev.get("step"), int):
                    evals.append((float(ev["ts"]), ev["step"], _tau_num(ev.get("tau"))))
    except OSError:
        pass
    for a in attempts:
        start, end = a.get("started"), a.get("ended")
        mine = [e for e in evals if isinstance(start, (int, float)) and e[0] >= start
                and (not isinstance(end, (int, float)) or e[0] <= end)]
        track = TauTrack()
        for ts, step, tau in mine:
            track.note({"kind": "eval", "step": step, "tau": tau, "ts": ts})
        last, top = track.latest(), track.best()
        a["last_tau"] = None if last is None else last["tau"]
        a["last_tau_step"] = None if last is None else last["step"]
        a["best_tau"] = None if top is None else top["tau"]
        a["best_tau_step"] = None if top is None else top["step"]
