"""File following for the agent: Tail (one append-only file by byte offset, surviving rotation and truncation, a
line's cost bounded by MAX_LOG_LINE), the Follower that multiplexes log lines, events, GPU samples and process
state onto the stream, and status's saved fold of the events file (FOLD_FILE).

Stdlib only: shipped in the agent's blob.
"""

from __future__ import annotations

import collections
import json
import os
import re
import time
from typing import Any

from opsctl.remote.base import (
    MAX_LOG_LINE,
    READ_CHUNK,
    batch,
    emit,
    read_json,
)
from opsctl.remote.procs import Nvml, ProcWatch, Run, tag_gpu_owners
from opsctl.remote.rules import (
    MAX_EVENT_LINE,
    event_object,
    traceback_from_lines,
)
from opsctl.remote.thin import (
    THIN_HEARTBEATS_AFTER,
    HistoryThinner,
    _fold_mark,
    resume_backlog_fold,
    save_backlog_fold,
    thin_stride,
)

TAIL_KEEP = 200  # log lines kept in memory for a crash report


# -- file following -----------------------------------------------------------------------------------------
class Tail:
    """Follows one append-only file by byte offset; survives truncation, rotation and deletion.

    A line costs at most `max_line` bytes of memory and of output, however long it is in the file (cut_line)."""

    def __init__(self, path: str, offset: int, tail_lines: int = 0, max_line: int = MAX_LOG_LINE) -> None:
        self.path = path
        self.fh: Any = None
        self.sig = b""
        self.ino: tuple[int, int] | None = None
        self.offset = max(0, offset)  # where the line being read starts: the resume point
        self.buf = b""  # that line's first bytes (at most max_line)
        self.skipped = 0  # and how many bytes of it after those were read and dropped
        self.max_line = max_line
        self.existed = False
        self._open()
        if offset < 0 and self.fh is not None:
            self.offset = self._tail_offset(tail_lines)

    def _open(self) -> None:
        try:
            fh = open(self.path, "rb")
        except OSError:
            self.fh, self.ino = None, None
            return
        st = os.fstat(fh.fileno())
        self.fh, self.ino, self.existed = fh, (st.st_dev, st.st_ino), True
        self.sig = os.pread(fh.fileno(), 64, 0)

    def position(self) -> int:
        """How far the file has been read (the resume point plus the unfinished line's bytes)."""
        return self.offset + len(self.buf) + self.skipped

    def size(self) -> int:
        return os.fstat(self.fh.fileno()).st_size if self.fh is not None else 0

    def _tail_offset(self, n: int) -> int:
        """Where the last n complete lines start: newlines counted backwards in fixed chunks, so a file whose last
        lines are huge costs one pass over them and 64 KiB of memory."""
        fd = self.fh.fileno()
        size = os.fstat(fd).st_size
        if n <= 0:
            return size
        pos, seen = size, 0
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            chunk = os.pread(fd, step, pos)
            i = len(chunk)
            while True:
                i = chunk.rfind(b"\n", 0, i)
                if i < 0:
                    break
                seen += 1
                if seen == n + 1:  # the newline before the n-th last complete line (the last one may be partial)
                    return pos + i + 1
        return 0

    def _reset(self, reason: str, resets: list[str]) -> None:
        resets.append(reason)
        self.offset = 0
        self.buf = b""
        self.skipped = 0
        self.sig = os.pread(self.fh.fileno(), 64, 0) if self.fh is not None else b""

    def read(self, resets: list[str]) -> list[tuple[int, int, bytes]]:
        """New complete lines as (start offset, end offset, bytes without newline, cut to max_line: cut_line)."""
        out: list[tuple[int, int, bytes]] = []
        try:
            st = os.stat(self.path)
            ino: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except OSError:
            st, ino = None, None
        if self.fh is not None and ino != self.ino:
            out += self._drain()  # the rest of the old file first: rotation must lose nothing
            self.fh.close()
            self.fh = None
            self._reset("rotated" if ino is not None else "missing", resets)
            if ino is None:
                self.ino = None
                return out
        if self.fh is None:
            if ino is None:
                return out
            was = self.existed
            self._open()
            if self.fh is None:
                return out
            if was and not resets:
                self._reset("rotated", resets)
        size = os.fstat(self.fh.fileno()).st_size
        if size < self.position() or self._rewritten():
            self._reset("truncated", resets)
        out += self._drain()
        return out

    def _rewritten(self) -> bool:
        """Truncated and already grown past our offset: the first bytes differ from those we saw."""
        if self.position() == 0:
            return False
        head = os.pread(self.fh.fileno(), 64, 0)
        if len(self.sig) < 64 and head.startswith(self.sig):
            self.sig = head  # the file was shorter than 64 bytes when opened and has grown since
            return False
        return head != self.sig

    def _drain(self) -> list[tuple[int, int, bytes]]:
        out: list[tuple[int, int, bytes]] = []
        data = os.pread(self.fh.fileno(), READ_CHUNK, self.position())
        if not data:
            return out
        base = self.position()  # file offset of data[0]
        pos = 0
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break
            whole = len(self.buf) + self.skipped + (nl - pos)
            head = self.buf + data[pos:min(nl, pos + max(0, self.max_line - len(self.buf)))]
            out.append((self.offset, base + nl + 1, cut_line(head, whole, self.max_line)))
            self.offset, self.buf, self.skipped = base + nl + 1, b"", 0
            pos = nl + 1
        rest = data[pos:]  # an unfinished line: keep its head, count the rest until its newline comes
        room = max(0, self.max_line - len(self.buf))
        self.buf += rest[:room]
        self.skipped += len(rest) - len(rest[:room])
        return out


def long_lines(fh: Any, limit: int) -> Any:
    """(first bytes, length, ended by a newline) of each line of a binary file, without its newline: at most
    `limit + 1` bytes of a line are kept, so memory stays bounded however long a line is."""
    while True:
        head = fh.readline(limit + 1)
        if not head:
            return
        if head.endswith(b"\n"):
            yield head[:-1], len(head) - 1, True
            continue
        length, raw = len(head), head
        while not raw.endswith(b"\n"):  # the rest of a long line, read and dropped in chunks
            raw = fh.readline(1 << 20)
            if not raw:
                break
            length += len(raw) - raw.endswith(b"\n")
        yield head, length, raw.endswith(b"\n")


def bounded_lines(fh: Any, limit: int) -> Any:
    """The lines of a binary file without their newlines, each cut to `limit` bytes (cut_line)."""
    for head, length, _ in long_lines(fh, limit):
        yield cut_line(head, length, limit)


def cut_line(head: bytes, whole: int, limit: int) -> bytes:
    """A line of `whole` bytes as sent: itself when it fits in `limit`, else its first `limit` bytes and how much
    was cut, visibly (` ... [cut 19.9 MB]`)."""
    if whole <= limit:
        return head
    return head[:limit] + f" ... [cut {human_bytes(whole - limit)}]".encode()


def human_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


class Follower:
    """Multiplexes log lines, telemetry events, NVML samples and process state onto stdout."""

    def __init__(self, run: Run, nvml: Nvml, log_offset: int = 0, events_offset: int = 0, tail: int = 0,
                 gpu_interval: float = 1.0, min_event_ts: float = 0.0) -> None:
        self.run = run
        self.nvml = nvml
        self.log = Tail(run.log, log_offset, tail)
        self.events = Tail(run.events, events_offset, tail, MAX_EVENT_LINE) if run.events else None
        self.proc = ProcWatch(run)
        self.gpu_interval = gpu_interval
        self.next_gpu = 0.0
        self.min_event_ts = min_event_ts
        self.lines: collections.deque[str] = collections.deque(maxlen=TAIL_KEEP)
        self.phase: dict[str, Any] = {}
        self.last_event_ts: float | None = None
        self.saw_step = False
        self.saw_run_end: dict[str, Any] | None = None
        self.fatal_errors: list[dict[str, Any]] = []
        self.pattern = re.compile(run.ready_pattern) if run.ready_pattern else None
        self.pattern_hit: str | None = None
        self.thinner: HistoryThinner | None = None  # set by catch_up(thin=True) for the backlog only
        self._resumed_at: int | None = None  # the offset a saved backlog fold reached, when the backlog resumed it

    def poll(self) -> dict[str, Any]:
        resets: list[str] = []
        for off, end, raw in self.log.read(resets):
            for r in resets:
                emit("log_reset", reason=r, file="log")
            resets = []
            line = raw.decode("utf-8", errors="replace")
            self.lines.append(line)
            if self.pattern is not None and self.pattern_hit is None and self.pattern.search(line):
                self.pattern_hit = line
            emit("log", off=off, end=end, line=line)
        for r in resets:
            emit("log_reset", reason=r, file="log")
        if self.events is not None:
            resets = []
            for off, end, raw in self.events.read(resets):
                for r in resets:
                    self._flush_thinner()
                    emit("log_reset", reason=r, file="events")
                resets = []
                ev = event_object(raw, end - off - 1)
                if isinstance(ev, str):  # said, never silently dropped: the client counts it (RunState)
                    self._send("bad_event", off=off, end=end, error=ev)
                    continue
                self._note(ev)
                self._send("event", off=off, end=end, event=ev)
            for r in resets:
                self._flush_thinner()
                emit("log_reset", reason=r, file="events")
        now = time.monotonic()
        if self.gpu_interval > 0 and self.nvml.ok and now >= self.next_gpu:
            self.next_gpu = now + self.gpu_interval
            try:
                emit("gpu", gpus=tag_gpu_owners(self.run, self.nvml.sample()))
            except Exception as exc:  # noqa: BLE001 - a failing GPU query must not stop the log stream
                emit("error", message=f"nvml sample failed: {exc}", fatal=False)
        return self.proc.poll()

    def _send(self, kind: str, **fields: Any) -> None:
        if self.thinner is None:
            emit(kind, **fields)
            return
        for k, f in self.thinner.push(kind, fields):
            emit(k, **f)

    def _flush_thinner(self) -> None:
        if self.thinner is not None:
            self.thinner.kept = None  # a reset mid-backlog (or the end): nothing more to fold
            for k, f in self.thinner.flush():
                emit(k, **f)

    def _resume_backlog(self, thinner: HistoryThinner) -> None:
        """Send a saved backlog fold of this events file again, re-thinned to `thinner`'s stride, and go on reading
        from its offset; nothing (a full read follows) when there is none that fits the file as it is now."""
        assert self.events is not None
        ring = resume_backlog_fold(self.run.state_dir, self.events.path, thinner)
        if ring is None:
            return
        for kind, fields, _pinned in thinner.kept or []:
            ev = fields.get("event") if kind == "event" else None
            if isinstance(ev, dict):
                self._note(ev)
            emit(kind, **fields)
        for kind, fields in ring:
            ev = fields.get("event") if kind == "event" else None
            if isinstance(ev, dict):
                self._note(ev)
            for k, f in thinner.push(kind, fields):
                emit(k, **f)
        self.events.offset = ring.offset
        self._resumed_at = ring.offset

    def _save_backlog(self, thinner: HistoryThinner) -> None:
        """Save the fold of the backlog just read (atomic; never raises: watch works the same without it)."""
        assert self.events is not None and thinner.kept is not None
        save_backlog_fold(self.run.state_dir, self.events.path, thinner, self.events.offset)

    def _note(self, ev: dict[str, Any]) -> None:
        ts = ev.get("ts")
        if isinstance(ts, (int, float)) and ts < self.min_event_ts:
            return  # an event of a previous run in the same file
        kind = ev.get("kind")
        self.last_event_ts = ts if isinstance(ts, (int, float)) else time.time()
        if kind == "run_start":
            self.phase = {"phase": "starting"}
        elif kind in ("phase", "heartbeat") and (kind == "phase" or not self.phase):
            self.phase = {k: ev.get(k) for k in ("phase", "i", "n", "detail") if ev.get(k) is not None}
        elif kind == "step":
            self.saw_step = True
            self.phase = {"phase": "training", "step": ev.get("step")}
        elif kind == "error" and ev.get("fatal"):
            self.fatal_errors.append(ev)
        elif kind == "run_end":
            self.saw_run_end = ev

    def offsets(self) -> dict[str, int]:
        return {"log_offset": self.log.offset, "events_offset": self.events.offset if self.events else 0}

    def catch_up(self, thin: bool = False) -> None:
        """Poll until the log and events are read as far as they reached now, then say so (`backlog_end`): the
        client's `--once` ends on this, never on a quiet second, which a slow host or a huge line would break.
        `thin`: a long events backlog's step events are thinned (HistoryThinner); what follows is sent whole.
        The backlog's thousands of lines go out in 64 KB writes (base.batch), one ssh packet each, not one a line."""
        batch(True)
        try:
            self._catch_up(thin)
        finally:
            batch(False)
        emit("backlog_end", **self.offsets())

    def _catch_up(self, thin: bool) -> None:
        if thin and self.events is not None:
            stride = thin_stride(self.events.path, self.events.offset)
            big = self.events.size() - self.events.position() >= THIN_HEARTBEATS_AFTER
            self.thinner = HistoryThinner(stride) if stride > 1 or big else None
            if self.thinner is not None and self.events.position() == 0:  # the whole backlog: fold it
                if stride > 1:  # the client's step charts keep no finer stride (watch.RunSeries.raise_stride)
                    emit("thin", stride=stride)
                self.thinner.kept = []
                self._resume_backlog(self.thinner)
        goal = [(t, t.size()) for t in (self.log, self.events) if t is not None]
        while True:
            before = [t.position() for t, _ in goal]
            self.poll()
            behind = any(t.position() < size for t, size in goal)
            moved = [t.position() for t, _ in goal] != before
            if not (behind and moved):  # read to the goal, or nothing more to read (truncated meanwhile)
                break
        if self.thinner is not None and self.thinner.kept is not None and self.events is not None \
                and not self.events.buf and not self.events.skipped \
                and self.events.offset != self._resumed_at:  # nothing read past the saved fold: it is that one
            self._save_backlog(self.thinner)
        self._flush_thinner()
        self.thinner = None

    def where_text(self) -> str:
        """Where a run that is not ready stands, for a sentence: `in phase loading_target 3/8`, or that nothing said."""
        if self.phase:
            return "in phase " + self.phase_text()
        if not self.run.events:
            return "(no events file configured: nothing tells opsctl its phase)"
        return "before its first telemetry event"

    def phase_text(self) -> str:
        p = self.phase
        if not p:
            return "no telemetry events" + ("" if self.run.events else " (no events file configured)")
        text = str(p.get("phase"))
        if p.get("i") is not None and p.get("n") is not None:
            text += " {}/{}".format(p["i"], p["n"])
        if p.get("detail"):
            text += " ({})".format(p["detail"])
        return text

    def traceback(self) -> str | None:
        for ev in reversed(self.fatal_errors):
            if ev.get("traceback"):
                return str(ev["traceback"])
        return traceback_from_lines(list(self.lines))


# status folds the whole events file (every step of the attempt for the ETA, every evaluation for the best tau): a
# week-long run's 200,000 steps cost ~1 s a call. After reading FOLD_AFTER_BYTES or more, status saves what it folded
# (STATE_DIR/FOLD_FILE) with the byte offset it reached, and the next status goes on from there when the file is
# still the same one (inode, and the FOLD_CHECK bytes before the offset) and the attempt is the same (`since`).
FOLD_FILE = "status-fold.json"
FOLD_FORMAT = 3  # 2: the memory rules' windows (MemoryWatch) too; 3: lines of the wrong types skipped
FOLD_AFTER_BYTES = 4 << 20


def fold_resume(run: Run, fh: Any, since: float, steps: Any, errors: Any, last: dict[str, Any], bad: list[Any],
                tau: Any, eta: Any, mem: Any) -> int:
    """Restore a saved fold of this events file and attempt into the given accumulators, leave `fh` at its
    offset and return it; 0 (nothing restored, `fh` at the start) when there is none that fits."""
    saved = read_json(run.state_file(FOLD_FILE))
    try:
        if (not saved or saved.get("format") != FOLD_FORMAT or saved.get("events") != run.events
                or saved.get("since") != since):
            return 0
        mark = saved["mark"]
        offset = int(mark["offset"])
        if offset > os.fstat(fh.fileno()).st_size or _fold_mark(fh, offset) != mark:
            fh.seek(0)
            return 0
        steps.extend(tuple(x) for x in saved["steps"])
        errors.extend(tuple(x) for x in saved["errors"])
        last.update({k: tuple(v) for k, v in saved["last"].items()})
        bad[:] = saved["bad"]
        tau.evals = saved["tau"]
        eta.load(saved["eta"])
        mem.load(saved["memory"])
    except (KeyError, TypeError, ValueError, OSError):
        steps.clear()
        errors.clear()
        last.clear()
        bad[:] = [0, None]
        tau.evals = []
        eta.__init__()
        mem.__init__()
        fh.seek(0)
        return 0
    fh.seek(offset)
    return offset


def fold_save(run: Run, fh: Any, since: float, offset: int, steps: Any, errors: Any, last: dict[str, Any],
              bad: list[Any], tau: Any, eta: Any, mem: Any) -> None:
    """Save the fold at `offset` (atomic; never raises: status works the same without it). Only where a launch
    made STATE_DIR: status creates nothing."""
    if not os.path.isdir(run.state_dir):
        return
    save_state(run, FOLD_FILE, {"format": FOLD_FORMAT, "events": run.events, "since": since,
                                "mark": _fold_mark(fh, offset), "steps": list(steps), "errors": list(errors),
                                "last": last, "bad": bad, "tau": tau.evals, "eta": eta.state(),
                                "memory": mem.state()})


def save_state(run: Run, name: str, state: dict[str, Any]) -> None:
    """STATE_DIR/name as JSON, whole or not at all (a per-process temp file renamed over it: two agents saving at once
    never mix); never raises, for what it saves (a fold) is only ever a shortcut."""
    tmp = run.state_file(f".{name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as out:
            out.write(json.dumps(state, separators=(",", ":")))  # the C encoder: json.dump's is pure Python (~4x)
        os.replace(tmp, run.state_file(name))
    except (OSError, TypeError, ValueError):
        try:
            os.unlink(tmp)
        except OSError:
            pass
