"""watch's thinned backlog (HistoryThinner) and its fold (STATE_DIR/watch-fold.json).

The agent's `follow` with thin_history sends a long events history thinned and saves the fold; the run's wrapper
brings the fold up to date while the run writes (refresh_backlog_fold), so the first `watch` of a week-long run
reads a few appended lines, not all. Here, apart from the follower, so the wrapper imports only what it runs.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
from typing import Any

from opsctl.remote.base import (
    read_json,
)
from opsctl.remote.rules import (
    MAX_EVENT_LINE,
    MEM_NAMES,
    MEM_SETTLE_S,
    MEM_WINDOW,
    event_object,
)

# -- watch's thinned backlog and its fold (the agent's `follow` with thin_history sends it; the run's wrapper keeps the
# fold up to date while the run writes, so the first `watch` of a week-long run reads a few appended lines, not all)
FOLD_CHECK = 4096


# `follow` with `thin_history` (watch's backlog): the step events of a long history are sent at most THIN_POINTS
# apart (every 2^k-th step, the alignment the charts' RunSeries keeps), all the others and the last THIN_TAIL events
# whole. What a client folds from the history is then the same: every non-step event but heartbeats (evals, errors,
# checkpoints, run_start/run_end), each attempt's first THIN_HEAD steps (ETA warm-up, alert baselines), every step
# whose loss is not a finite number (the NaN alert), and a tail long enough that the ETA's moving average (alpha
# 0.05) and the alert windows (the latest step, queue and step-time windows) have forgotten the thinned middle.
# Heartbeats (one per rank every 5 s: a week of them outnumbers the steps) say only where the run is now, except
# for the memory rules (MemoryWatch): of the thinned middle only those that fill the rules' baseline windows are
# sent; the tail holds the recent windows (at least its last THIN_TAIL_S seconds: the allocator-retry window,
# RETRY_WINDOW_S, and the heartbeat before it, whatever the number of ranks writing).
THIN_POINTS = 4000
THIN_TAIL = 2000
THIN_TAIL_S = 900.0
THIN_HEAD = 50
THIN_HEARTBEATS_AFTER = 4 << 20  # a backlog this big is thinned for its heartbeats even when its steps are few
THIN_PROBE = 256 << 10  # bytes read from the events file's end to find its last step


def thin_stride(path: str, offset: int) -> int:
    """The power of two that leaves about THIN_POINTS steps of a history reaching the last step found in the file's
    last THIN_PROBE bytes (1: no thinning; a history that short costs nothing to send whole)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            start = max(offset, size - THIN_PROBE)
            fh.seek(start)
            chunk = fh.read(size - start)
    except OSError:
        return 1
    last = 0
    for raw in reversed(chunk.split(b"\n")[1 if start > offset else 0:]):
        if b'"step"' not in raw:
            continue
        ev = event_object(raw, len(raw))
        if isinstance(ev, dict) and ev.get("kind") == "step" and isinstance(ev.get("step"), int):
            last = ev["step"]
            break
    stride = 1
    while last // stride > THIN_POINTS:
        stride *= 2
    return stride


class HistoryThinner:
    """Holds the last THIN_TAIL messages of a backlog and lets older ones out in order, dropping the step events
    nobody would miss (see THIN_POINTS). `push` and `flush` return the messages to send now. With `kept` a list,
    every message let out before the tail is also recorded there as (kind, fields, pinned) for the backlog fold:
    pinned messages are kept at any stride, the others only for being on this one."""

    def __init__(self, stride: int) -> None:
        self.stride = stride
        self.ring: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        self.head = 0  # step events let out since the last run_start
        self.kept: list[tuple[str, dict[str, Any], bool]] | None = None
        # The memory rules' baselines (remote/rules.py MemoryWatch: a rank's first MEM_WINDOW heartbeats of each figure
        # once MEM_SETTLE_S of training passed) over what was let out: which heartbeats of the middle count.
        self.memory: dict[str, Any] = {"since": None, "base": {}}
        self.ring_ts: collections.deque[float | None] = collections.deque()  # each ring message's event time
        self.last_ts: float | None = None  # the newest event's time: the tail keeps THIN_TAIL_S seconds before it

    def push(self, kind: str, fields: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        self.ring.append((kind, fields))
        ev = fields.get("event") if kind == "event" else None
        ts = ev.get("ts") if isinstance(ev, dict) else None
        ts = float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else None
        self.ring_ts.append(ts)
        if ts is not None and (self.last_ts is None or ts > self.last_ts):
            self.last_ts = ts
        out = []
        while len(self.ring) > THIN_TAIL:
            first = self.ring_ts[0]
            if first is not None and self.last_ts is not None and first >= self.last_ts - THIN_TAIL_S:
                break  # within the tail's seconds
            self.ring_ts.popleft()
            item = self.ring.popleft()
            keep, pinned = self._judge(item)
            if keep:
                out.append(item)
                if self.kept is not None:
                    self.kept.append((item[0], item[1], pinned))
        return out

    def flush(self) -> list[tuple[str, dict[str, Any]]]:
        for item in self.ring:  # the tail goes whole; its run_starts still reset the counters for what follows
            self._judge(item)
        out, self.ring, self.ring_ts = list(self.ring), collections.deque(), collections.deque()
        return out

    def _baseline(self, ev: dict[str, Any]) -> bool:
        """Whether this event fills a memory rule's baseline window (MemoryWatch.note's rule, its base lists only)."""
        kind, ts, mem = ev.get("kind"), ev.get("ts"), self.memory
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
            return False
        if mem["since"] is None and (kind == "step" or (kind == "phase" and ev.get("phase") == "training")):
            mem["since"] = float(ts)
        step, rank = ev.get("step"), ev.get("rank")
        if (kind != "heartbeat" or mem["since"] is None or ts < mem["since"] + MEM_SETTLE_S
                or not isinstance(step, int) or not isinstance(rank, int)):
            return False
        grew = False
        for key in MEM_NAMES:
            mb = ev.get(key)
            if isinstance(mb, (int, float)) and not isinstance(mb, bool) and math.isfinite(mb):
                n = mem["base"].get(f"{rank}:{key}", 0)
                if n < MEM_WINDOW:
                    mem["base"][f"{rank}:{key}"] = n + 1
                    grew = True
        return grew

    def _judge(self, item: tuple[str, dict[str, Any]]) -> tuple[bool, bool]:
        """(send it, pinned: sent whatever the stride)."""
        kind, fields = item
        ev = fields.get("event") if kind == "event" else None
        if not isinstance(ev, dict):
            return True, True
        kind = ev.get("kind")
        if kind == "run_start":
            self.head = 0
            self.memory = {"since": None, "base": {}}
            return True, True
        if kind == "heartbeat":  # sent only where it fills a memory rule's baseline window
            return self._baseline(ev), True
        if self.memory["since"] is None:
            self._baseline(ev)  # where training began: the baselines start MEM_SETTLE_S after it
        if kind != "step":
            return True, True
        self.head += 1
        step, loss = ev.get("step"), ev.get("loss")
        if (self.head <= THIN_HEAD or not isinstance(step, int) or not isinstance(loss, (int, float))
                or isinstance(loss, bool) or not math.isfinite(loss)):
            return True, True
        return step % self.stride == 0, False


# The thinned backlog of a long events file costs the agent a parse of every line (~1 s for a week-long run's 70 MB)
# at every `watch`. After catching up a backlog of BACKLOG_FOLD_AFTER_BYTES or more, the agent saves what it let out
# before the tail (with whether each is pinned), the tail itself and the thinner's counter, at the byte offset it
# reached (STATE_DIR/BACKLOG_FOLD_FILE, marked as the status fold is and by the file's first bytes); the next `watch`
# of the same file sends the saved messages again (re-thinned to its possibly larger stride) and reads only what was
# appended since.
BACKLOG_FOLD_FILE = "watch-fold.json"
BACKLOG_FOLD_FORMAT = 2  # 2: lines of the wrong types are bad_event messages (event_problem); heartbeats thinned
BACKLOG_FOLD_AFTER_BYTES = 4 << 20


def _fold_mark(fh: Any, offset: int) -> dict[str, Any]:
    st = os.fstat(fh.fileno())
    fh.seek(max(0, offset - FOLD_CHECK))
    tail = fh.read(min(offset, FOLD_CHECK))
    return {"ino": st.st_ino, "dev": st.st_dev, "offset": offset, "tail": hashlib.sha256(tail).hexdigest()}


def _backlog_mark(fh: Any, offset: int) -> dict[str, Any]:
    """The status fold's mark and the file's first FOLD_CHECK bytes: a file rewritten in place (same inode) with the
    same last bytes but other history must not be taken for the one folded (the watch fold sends that history)."""
    fh.seek(0)
    head = fh.read(min(offset, FOLD_CHECK))
    return {**_fold_mark(fh, offset), "head": hashlib.sha256(head).hexdigest()}


class _Ring(list):  # type: ignore[type-arg]
    """The saved tail of a backlog fold, with the byte offset the fold reached."""

    offset = 0


def resume_backlog_fold(state_dir: str, events: str, thinner: HistoryThinner) -> _Ring | None:
    """Load the saved backlog fold of `events` into `thinner` (its middle re-thinned to the thinner's stride, as
    `kept`; its counters) and return the saved tail to push again, with the offset to read on from; None (the
    thinner untouched) when there is none that fits the file as it is now."""
    saved = read_json(os.path.join(state_dir, BACKLOG_FOLD_FILE))
    try:
        if (not saved or saved.get("format") != BACKLOG_FOLD_FORMAT or saved.get("events") != events
                or int(saved["stride"]) > thinner.stride or thinner.stride % int(saved["stride"])):
            return None
        mark = saved["mark"]
        offset = int(mark["offset"])
        with open(events, "rb") as fh:
            if offset > os.fstat(fh.fileno()).st_size or _backlog_mark(fh, offset) != mark:
                return None
        middle = [(str(k), f, bool(p)) for k, f, p in saved["middle"]]
        ring = _Ring((str(k), f) for k, f in saved["ring"])
        head = int(saved["head"])
        memory = {"since": saved["memory"]["since"],
                  "base": {str(k): int(n) for k, n in saved["memory"]["base"].items()}}
    except (KeyError, TypeError, ValueError, OSError):
        return None
    kept: list[tuple[str, dict[str, Any], bool]] = []
    for kind, fields, pinned in middle:
        ev = fields.get("event") if kind == "event" else None
        if not pinned and isinstance(ev, dict) and ev.get("step", 0) % thinner.stride:
            continue  # on the old stride, not on this one
        kept.append((kind, fields, pinned))
    thinner.head, thinner.kept, thinner.memory = head, kept, memory
    ring.offset = offset
    return ring


def save_backlog_fold(state_dir: str, events: str, thinner: HistoryThinner, offset: int) -> None:
    """Save the fold of a backlog read to `offset` (atomic; never raises: watch works the same without it). Only
    where a launch made STATE_DIR, and for a backlog of BACKLOG_FOLD_AFTER_BYTES or more."""
    if thinner.kept is None or not os.path.isdir(state_dir) or offset < BACKLOG_FOLD_AFTER_BYTES:
        return
    try:
        with open(events, "rb") as fh:
            mark = _backlog_mark(fh, offset)
    except OSError:
        return
    save_json_state(state_dir, BACKLOG_FOLD_FILE, {
        "format": BACKLOG_FOLD_FORMAT, "events": events, "stride": thinner.stride, "head": thinner.head,
        "mark": mark, "middle": thinner.kept, "ring": [list(item) for item in thinner.ring],
        "memory": thinner.memory})


def save_json_state(state_dir: str, name: str, state: dict[str, Any]) -> None:
    """STATE_DIR/name as JSON, whole or not at all (a per-process temp file renamed over it: two writers saving at
    once never mix); never raises, for what it saves (a fold) is only ever a shortcut."""
    tmp = os.path.join(state_dir, f".{name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as out:
            out.write(json.dumps(state, separators=(",", ":")))  # the C encoder: json.dump's is pure Python (~4x)
        os.replace(tmp, os.path.join(state_dir, name))
    except (OSError, TypeError, ValueError):
        try:
            os.unlink(tmp)
        except OSError:
            pass


def refresh_backlog_fold(state_dir: str, events: str | None) -> None:
    """Bring watch's backlog fold of `events` up to the file's end, as the agent's thinned `follow` would leave it
    (the saved fold re-thinned and the lines appended since, each judged by event_object: the same messages).
    The wrapper runs this every BACKLOG_KEEP_S while the run writes (and once when an attempt ends), so the first
    `watch` of a week-long run sends the fold and reads minutes of lines, not a week of them. Complete lines only;
    a file rewritten under the fold is read from its start."""
    if not events or not os.path.isdir(state_dir):
        return
    try:
        size = os.path.getsize(events)
    except OSError:
        return
    if size < BACKLOG_FOLD_AFTER_BYTES:
        return
    thinner = HistoryThinner(thin_stride(events, 0))
    thinner.kept = []
    ring = resume_backlog_fold(state_dir, events, thinner)
    offset = 0
    if ring is not None:
        offset = ring.offset
        if offset == size:
            return  # nothing appended: the saved fold is the file's
        for kind, fields in ring:
            thinner.push(kind, fields)
    with open(events, "rb") as fh:
        fh.seek(offset)
        while offset < size:
            raw = fh.readline(MAX_EVENT_LINE + 2)
            if not raw.endswith(b"\n"):
                if len(raw) <= MAX_EVENT_LINE + 1:
                    break  # the line being written (or the file's end): the fold stops before it
                rest = raw  # an over-long line: read to its end, never held whole
                length = len(raw)
                while not rest.endswith(b"\n"):
                    rest = fh.readline(1 << 20)
                    if not rest:
                        return  # unfinished: fold nothing of it (the next refresh reads it again)
                    length += len(rest)
                end = offset + length
                thinner.push("bad_event", {"off": offset, "end": end,
                                           "error": f"longer than {MAX_EVENT_LINE} bytes (MAX_EVENT_LINE)"})
                offset = end
                continue
            end = offset + len(raw)
            ev = event_object(raw[:-1], len(raw) - 1)
            if isinstance(ev, str):
                thinner.push("bad_event", {"off": offset, "end": end, "error": ev})
            else:
                thinner.push("event", {"off": offset, "end": end, "event": ev})
            offset = end
    save_backlog_fold(state_dir, events, thinner, offset)
