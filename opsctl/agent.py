"""Remote agent of opsctl: one stdlib-only file streamed to the remote python3 (docs/agent-protocol.md).

It launches, follows, kills, cleans and reports one run, writing JSON lines on stdout; EOF on stdin ends it.
"""

# Keep this file ASCII only: the bootstrap reads it with sys.stdin.read(N) where N is a byte count.

from __future__ import annotations

import collections
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

# opsctl-bundle: the shipped copy registers the opsctl.remote modules here (remote/base.py splice)
from opsctl.remote.base import (
    AGENT_VERSION,
    EXIT_CODES,
    GROUP_FILE,
    MAX_LOG_LINE,
    NOTIFIERS_FILE,
    READ_CHUNK,
    RESTARTING_FILE,
    SYSTEM_DIRS,
    AgentError,
    bye,
    emit,
    read_json,  # a JSON object file, or None when missing, unreadable or not an object
    remote_sources,
    splice,
    watch_stdin,
)
from opsctl.remote.rules import (  # the rules the run's wrapper notifies by, and the client shows by
    MAX_EVENT_LINE,  # an events line longer than this is not an event (docs/events.md)
    EtaClock,
    MemoryWatch,
    TauTrack,
    crash_line,
    event_object,  # one events line as an event, or why it is none
    resume_argv,
    traceback_from_lines,
    with_args,
)

POLL_S = 0.05  # the agent's own file/process poll; the client never polls, it reads this stream
TAIL_KEEP = 200  # log lines kept in memory for a crash report

# The wrapper (opsctl/agent_wrapper.py) is the process tmux starts for the run; launch writes its text to
# STATE_DIR/wrapper.py. The client ships that text inside this blob: it replaces the WRAPPER_SLOT line below with
# `_SHIPPED_WRAPPER = '...'` (channel.agent_source), so the remote side still gets one self-contained stream.
_SHIPPED_WRAPPER: str | None = None  # replaced by the client with the wrapper's text


def wrapper_module_source() -> str:
    """agent_wrapper.py's own text: the copy shipped in the blob, or (agent imported in-process) the file beside
    this one. It imports opsctl.remote: run it where those modules are importable (the package, or the blob)."""
    if _SHIPPED_WRAPPER is not None:
        return _SHIPPED_WRAPPER
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_wrapper.py"), encoding="ascii") as fh:
        return fh.read()


def wrapper_source() -> str:
    """The text launch writes to STATE_DIR/wrapper.py: the wrapper with opsctl/remote's modules spliced in, so the
    process tmux starts runs under a bare python3 (no package on the host)."""
    return splice(wrapper_module_source(), remote_sources())


def _wrapper_rules() -> dict[str, Any]:
    """The wrapper's text run as a module (not as __main__): the rules it shares with the agent (attempt history,
    log rotation, a log's crash line, extra arguments), written once, used on both sides of the tmux boundary."""
    ns: dict[str, Any] = {"__name__": "opsctl_wrapper_rules"}
    exec(compile(wrapper_module_source(), "opsctl-wrapper", "exec"), ns)
    return ns


_W = _wrapper_rules()
history_add = _W["history_add"]
read_history = _W["read_history"]
history_lines = _W["_history_lines"]
proc_starttime = _W["proc_starttime"]
# watch's thinned backlog (HistoryThinner) and its fold (watch-fold.json): the wrapper keeps the fold up to date
HistoryThinner = _W["HistoryThinner"]
thin_stride = _W["thin_stride"]
THIN_POINTS: int = _W["THIN_POINTS"]
THIN_TAIL: int = _W["THIN_TAIL"]
THIN_TAIL_S: float = _W["THIN_TAIL_S"]
THIN_HEAD: int = _W["THIN_HEAD"]
THIN_HEARTBEATS_AFTER: int = _W["THIN_HEARTBEATS_AFTER"]
BACKLOG_FOLD_FILE: str = _W["BACKLOG_FOLD_FILE"]
BACKLOG_FOLD_FORMAT: int = _W["BACKLOG_FOLD_FORMAT"]
BACKLOG_FOLD_AFTER_BYTES: int = _W["BACKLOG_FOLD_AFTER_BYTES"]
FOLD_CHECK: int = _W["FOLD_CHECK"]
_fold_mark = _W["_fold_mark"]
_backlog_mark = _W["_backlog_mark"]


# -- output: emit, bye, watch_stdin (opsctl/remote/base.py) ----------------------------------------------

# -- NVML ---------------------------------------------------------------------------------------------------
class Nvml:
    """NVML through pynvml when importable; otherwise a reason that `hello` reports."""

    def __init__(self) -> None:
        self.mod: Any = None
        try:
            import pynvml  # type: ignore[import-not-found]
        except Exception as exc:  # noqa: BLE001 - any import failure means "unavailable"
            self.status = f"unavailable (pynvml not importable: {exc.__class__.__name__})"
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound on GPU-less hosts
            self.status = f"unavailable ({exc.__class__.__name__}: {exc})"
            return
        self.mod = pynvml
        self.status = "ok"

    @property
    def ok(self) -> bool:
        return self.mod is not None

    def sample(self) -> list[dict[str, Any]]:
        nv = self.mod
        if nv is None:
            return []
        gpus: list[dict[str, Any]] = []
        for i in range(nv.nvmlDeviceGetCount()):
            gpus.append(self._device(nv, i))
        return gpus

    @staticmethod
    def _device(nv: Any, i: int) -> dict[str, Any]:
        h = nv.nvmlDeviceGetHandleByIndex(i)
        g: dict[str, Any] = {"index": i}

        def get(key: str, fn: Any) -> None:
            try:
                g[key] = fn()
            except Exception:  # noqa: BLE001 - one unsupported field must not hide the rest
                g[key] = None

        get("name", lambda: _nvml_text(nv.nvmlDeviceGetName(h)))
        get("util", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu)
        get("mem_used_mb", lambda: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20)
        get("mem_total_mb", lambda: nv.nvmlDeviceGetMemoryInfo(h).total / 2**20)
        get("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
        get("temp_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
        get("sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
        get("mem_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))
        procs: list[dict[str, Any]] = []
        try:
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                used = getattr(p, "usedGpuMemory", None)
                procs.append({"pid": p.pid, "used_mb": None if used is None else used / 2**20})
        except Exception:  # noqa: BLE001
            pass
        g["procs"] = procs
        return g


def _nvml_text(v: Any) -> str:
    """NVML names are bytes in older pynvml releases and str in newer ones: one text either way."""
    return v.decode() if isinstance(v, bytes) else str(v)


# -- run settings -------------------------------------------------------------------------------------------
class Run:
    """The run's settings from JSON_ARGS, with paths resolved against the workdir."""

    def __init__(self, a: dict[str, Any]) -> None:
        if not isinstance(a, dict):
            raise AgentError("JSON_ARGS must be an object")
        self.args = a
        self.name = str(a.get("name") or "run")
        wd = a.get("workdir")
        if not wd or not isinstance(wd, str):
            raise AgentError("workdir is required")
        self.workdir = os.path.abspath(os.path.expanduser(wd))
        sd = a.get("state_dir")
        if not sd or not isinstance(sd, str):
            raise AgentError("state_dir is required")
        self.state_dir = self.path(sd)
        self.log = self.path(a.get("log") or os.path.join(self.state_dir, "run.log"))
        ev = a.get("events")
        self.events = self.path(ev) if ev else None
        self.session = str(a.get("tmux_session") or "opsctl-" + self.name)
        self.env = {str(k): str(v) for k, v in (a.get("env") or {}).items()}
        self.command = a.get("command")
        self.ready_pattern = a.get("ready_pattern")
        self.ready_timeout = float(a.get("ready_timeout") or 600)
        grace = a.get("kill_grace") or [10, 10]
        if not (isinstance(grace, list) and len(grace) == 2):
            raise AgentError(f"kill_grace must be a list of two numbers, got {grace!r}")
        self.kill_grace = (float(grace[0]), float(grace[1]))
        self.clean_roots = [str(r) for r in (a.get("clean_roots") or [])]
        self.inductor_cache_dir = a.get("inductor_cache_dir")
        self.cache_policy = str(a.get("inductor_cache_policy") or "clear")
        if self.cache_policy not in ("clear", "keyed"):
            raise AgentError(f"inductor_cache_policy must be clear or keyed, got {self.cache_policy!r}")
        self.cache_key_paths = [str(x) for x in (a.get("cache_key_paths") or [])]
        self.keep_logs = max(1, int(a.get("keep_logs") or 10))

    def path(self, p: str) -> str:
        return os.path.normpath(os.path.join(self.workdir, os.path.expanduser(str(p))))

    def state_file(self, name: str) -> str:
        """A file of this run's state dir (pid, exit_code, spec.json, tmux.sock, ...): every one is named here."""
        return os.path.join(self.state_dir, name)

    def argv(self) -> list[str]:
        c = self.command
        if isinstance(c, str) and c.strip():
            return ["/bin/sh", "-c", c]
        if isinstance(c, list) and c and all(isinstance(x, str) for x in c):
            return list(c)
        raise AgentError(f"command must be a non-empty argv list or a script string, got {c!r}")

    def tmux_socket(self) -> str:
        sock = self.state_file("tmux.sock")
        if len(sock.encode()) < 100:
            return sock
        # AF_UNIX paths are limited to ~107 bytes; derive a stable short path so later calls find it again.
        digest = hashlib.sha1(self.state_dir.encode()).hexdigest()[:16]
        d = os.path.join(tempfile.gettempdir(), f"opsctl-tmux-{os.getuid()}")
        os.makedirs(d, mode=0o700, exist_ok=True)
        return os.path.join(d, digest + ".sock")

    def cache_dir(self) -> tuple[str | None, bool]:
        """The inductor cache dir and whether it is the run's own default (STATE_DIR/inductor, allowed without
        a root). A configured value is taken as given, even "" or ".": validation must see it and refuse it."""
        if self.inductor_cache_dir is not None:
            return str(self.inductor_cache_dir), False
        if self.env.get("TORCHINDUCTOR_CACHE_DIR"):
            return self.env["TORCHINDUCTOR_CACHE_DIR"], False
        return self.default_cache_dir(), True

    def default_cache_dir(self) -> str:
        return os.path.join(self.state_dir, "inductor")

    def protected(self) -> list[tuple[str, str]]:
        """The run's own paths that an emptied cache dir must never be or contain (same rule as opsctl/config.py)."""
        out = [("workdir", self.workdir), ("state_dir", self.state_dir), ("log", self.log)]
        if self.events:
            out.append(("events", self.events))
        for key in ("model_dir", "checkpoint_dir"):
            if self.args.get(key):
                out.append((key, self.path(self.args[key])))
        return out

    def validated_cache(self) -> str:
        """The real path of this run's cache dir after every check (roots, system dirs, the run's own paths)."""
        cache, default_ok = self.cache_dir()
        return validate_clean_dir(cache, self.clean_roots, default_ok, protected=self.protected(),
                                  default_dir=self.default_cache_dir())


def default_inductor_dir() -> str:
    try:
        import getpass

        user = getpass.getuser()
    except Exception:  # noqa: BLE001
        user = str(os.getuid())
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r"[\\/:*?\"<>|]", "_", user))


# -- process state ------------------------------------------------------------------------------------------


def read_exit_code(path: str) -> int | None:
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, starttime) from /proc/PID/stat, or None if the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
    except OSError:
        return None
    rest = data[data.rfind(")") + 2:].split()
    try:
        return rest[0], int(rest[1]), int(rest[2]), int(rest[19])
    except (IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def all_procs() -> dict[int, tuple[str, int, int, int]]:
    out: dict[int, tuple[str, int, int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def wrapper_of(info: dict[str, Any]) -> int | None:
    """The run's wrapper pid if that process still is the wrapper (same start time), else None."""
    w, start = info.get("wrapper_pid"), info.get("wrapper_start")
    if not isinstance(w, int) or not isinstance(start, int):
        return None
    st = proc_stat(w)
    return w if st is not None and st[3] == start and st[0] not in ("Z", "X") else None


def run_procs(pid: int, pgid: int, known: dict[int, int], wrapper: int | None = None,
              exclude: frozenset[int] = frozenset()) -> dict[int, int]:
    """Live processes of the run: its process group, descendants of its pid (also those that left the group),
    every descendant of the wrapper (which, as a subreaper, adopts double-forked daemons), and processes seen
    before (tracked by start time, so a reused pid is not mistaken for ours). The wrapper itself is not one, nor
    are `exclude` (the wrapper's notify commands) and what they start."""
    procs = all_procs()
    found: dict[int, int] = {}
    for p, (state, ppid, pg, start) in procs.items():
        if state in ("Z", "X") or p == wrapper or p in exclude or ppid in exclude:
            continue
        if pg == pgid or p == pid or known.get(p) == start or (wrapper is not None and ppid == wrapper):
            found[p] = start
    changed = True
    while changed:
        changed = False
        for p, (state, ppid, _pg, start) in procs.items():
            if p not in found and ppid in found and state not in ("Z", "X"):
                found[p] = start
                changed = True
    return found


def notifiers(run: Run) -> frozenset[int]:
    """The notify commands the run's wrapper runs now (pid and start time checked): its children, not the run's."""
    wrapper = (read_json(run.state_file("pid")) or {}).get("wrapper_pid")
    try:
        with open(run.state_file(NOTIFIERS_FILE.format(wrapper))) as fh:
            pairs = json.load(fh)
    except (OSError, ValueError):
        return frozenset()
    return frozenset(int(p) for p, start in pairs if isinstance(p, int) and proc_starttime(p) == start)


def tag_gpu_owners(run: Run, gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark each GPU process `whose`: "run" (this run's process tree: torchrun's ranks too, not only its pid),
    "other" (another process this host can see), or "hidden" (NVML reports a pid outside this PID namespace, as in
    a container). The dashboard's GPU panel shows it per process."""
    info = read_json(run.state_file("pid")) or {}
    pid = info.get("pid")
    ours: set[int] = set()
    if isinstance(pid, int):
        pgid = info.get("pgid") if isinstance(info.get("pgid"), int) else pid
        ours = set(run_procs(pid, pgid, {}, wrapper_of(info), notifiers(run)))
    for g in gpus:
        for p in g.get("procs", []):
            q = p.get("pid")
            if isinstance(q, int):
                p["whose"] = "run" if q in ours else ("other" if proc_stat(q) is not None else "hidden")
    return gpus


def leftovers(run: Run) -> list[int]:
    """Live processes the run's wrapper still holds (adopted orphans) after the main command ended.

    Only the wrapper's descendants (wrapper checked by start time) count, so a reused pid is never taken for one."""
    info = read_json(run.state_file("pid")) or {}
    wrapper = wrapper_of(info)
    return sorted(run_procs(-1, -1, {}, wrapper, notifiers(run))) if wrapper is not None else []


class ProcWatch:
    """Process state of the run from STATE_DIR/pid and STATE_DIR/exit_code; emits `proc` on change."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.last: tuple[Any, ...] | None = None
        self.gone_since: float | None = None
        self._exception: tuple[Any, str | None] | None = None  # ((pid, exit code), exception line)
        self._left: tuple[float, list[int]] = (0.0, [])  # (when scanned, leftover pids)

    def exception(self, pid: Any, code: int | None) -> str | None:
        """The exception line of the last traceback in the log of an attempt that exited non-zero (once per exit)."""
        if code in (0, None):
            return None
        if self._exception is None or self._exception[0] != (pid, code):
            self._exception = ((pid, code), crash_line(self.run.log))
        return self._exception[1]

    def leftovers(self, info: dict[str, Any]) -> list[int]:
        """Processes the exited run left alive: the wrapper stays while any exists, so only then scan (<= 1/s)."""
        if wrapper_of(info) is None:
            return []
        now = time.monotonic()
        if now - self._left[0] >= 1.0:
            self._left = (now, leftovers(self.run))
        return self._left[1]

    def snapshot(self) -> dict[str, Any]:
        info = read_json(self.run.state_file("pid")) or {}
        code = read_exit_code(self.run.state_file("exit_code"))
        cleaned = not info and code is not None
        if cleaned:  # `clean` removed the ended run's pid file, not its attempts: still say which one it was
            last = (read_history(self.run.state_dir, self.run.log, self.run.keep_logs) or [{}])[-1]
            info = {"attempt": last.get("id"), "started": last.get("started")}
        pid = info.get("pid")
        pgid = info.get("pgid")
        restart = read_json(self.run.state_file(RESTARTING_FILE)) if code is None else None
        lost = None
        if restart is not None and wrapper_of(info) is None:
            # the wrapper died during its back-off: nothing will restart, until a launch carries the restart out
            lost, restart = restart, None
            code = lost.get("exit_code")
        ended = None
        if code is not None:
            state = "exited"
            try:
                ended = os.path.getmtime(self.run.state_file("exit_code"))  # written once, when the run ended
            except OSError:
                ended = (lost or {}).get("ended")
        elif restart is not None:
            state = "restarting"  # the attempt crashed; the wrapper starts the next one at restart["at"]
            ended = restart.get("ended")
            self.gone_since = None
        elif isinstance(pid, int) and alive(pid):
            state = "running"
            self.gone_since = None
        elif isinstance(pid, int):
            # The wrapper writes exit_code right after the run ends: wait up to 1 s for it. A dead wrapper writes
            # nothing more: exited at once (a one-shot status or history must not say running).
            now = time.monotonic()
            self.gone_since = self.gone_since or now
            wrapper_alive = wrapper_of(info) is not None
            state = "exited" if (not wrapper_alive or now - self.gone_since > 1.0) else "running"
        else:
            state = "absent"
        # The `killed` marker (written by `kill`, removed by `launch`) rides on every `proc` message, so a stream
        # that did not see the kill (a separate `opsctl kill` while `watch` follows) still reports `killed`.
        exited = state == "exited"
        if restart is not None:
            code = restart.get("exit_code")
        return {"state": state, "pid": pid, "pgid": pgid, "exit_code": code, "session": self.run.session,
                "killed_by_opsctl": os.path.exists(self.run.state_file("killed")),
                "killed_at": (read_json(self.run.state_file("killed")) or {}).get("ts"),
                "exception": (restart or lost or {}).get("exception") if restart or lost
                else (self.exception(pid, code) if exited else None),
                "restart_lost": lost, "signal": info.get("signal") if exited else None,
                "leftovers": self.leftovers(info) if exited else [],
                "attempt": info.get("attempt"), "started": info.get("started"), "ended": ended,
                "restarts": info.get("restarts"), "restart_max": info.get("restart_max"), "restart": restart,
                "cleaned": cleaned, "since": attempt_since(self.run)}

    def poll(self, force: bool = False) -> dict[str, Any]:
        snap = self.snapshot()
        key = (snap["state"], snap["pid"], snap["exit_code"], snap["killed_by_opsctl"], tuple(snap["leftovers"]),
               snap["exception"], snap["attempt"])
        if force or key != self.last:
            self.last = key
            emit("proc", **snap)
        return snap


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
        ring = _W["resume_backlog_fold"](self.run.state_dir, self.events.path, thinner)
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

    def _save_backlog(self, thinner: HistoryThinner) -> None:
        """Save the fold of the backlog just read (atomic; never raises: watch works the same without it)."""
        assert self.events is not None and thinner.kept is not None
        _W["save_backlog_fold"](self.run.state_dir, self.events.path, thinner, self.events.offset)

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
        `thin`: a long events backlog's step events are thinned (HistoryThinner); what follows is sent whole."""
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
                and not self.events.buf and not self.events.skipped:
            self._save_backlog(self.thinner)
        self._flush_thinner()
        self.thinner = None
        emit("backlog_end", **self.offsets())

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


# -- preflight (SYSTEM_DIRS: opsctl/remote/base.py) -------------------------------------------------------------
def validate_clean_dir(path: Any, roots: list[str], default_ok: bool,
                       protected: list[tuple[str, str]] | None = None, default_dir: str | None = None) -> str:
    """Return the real path of a directory that is safe to empty, or raise AgentError saying why not.

    Symlinks are resolved on this host before the root check, so a link pointing out of a root is refused.
    `protected` are the run's own paths (workdir, state dir, log, ...): the client refuses a cache dir that is
    or contains one of them, and so does this, again, after resolving links here (the remote never trusts the
    client). `default_ok` allows `default_dir` (torch's /tmp/torchinductor_<user> when not given) without a root."""
    if not isinstance(path, str) or not path.strip():
        raise AgentError("refusing to clean an empty path")
    if path.strip() in (".", "./"):
        raise AgentError(f"refusing to clean {path!r}: it is the working directory")
    if path.startswith("~"):
        raise AgentError(f"refusing to clean {path!r}: paths starting with ~ are not allowed, give an absolute path")
    if not os.path.isabs(path):
        raise AgentError(f"refusing to clean {path!r}: not an absolute path")
    real = os.path.realpath(path)
    home = os.path.realpath(os.path.expanduser("~"))
    if os.path.dirname(real) == real:
        raise AgentError(f"refusing to clean {path!r}: it is the file system root")
    if real == home or home.startswith(real.rstrip("/") + "/"):
        raise AgentError(f"refusing to clean {path!r}: it is the home directory or contains it")
    if real in SYSTEM_DIRS or real.count("/") < 2:
        raise AgentError(f"refusing to clean {path!r} (resolves to {real!r}): a system or top-level directory")
    for name, p in protected or []:
        rp = os.path.realpath(p)
        if rp == real or rp.startswith(real.rstrip("/") + "/"):
            raise AgentError(f"refusing to clean {path!r} (resolves to {real!r}): it is or contains the run's "
                             f"{name} {p}")
    lex = os.path.normpath(path)
    is_link = os.path.islink(lex)
    allowed: list[str] = []
    through_link: list[str] = []
    for r in roots:
        if not (isinstance(r, str) and os.path.isabs(r)):
            continue
        rl = os.path.normpath(r)
        if is_link and (rl == lex or rl.startswith(lex.rstrip("/") + "/")):
            # A root at or below the cache dir's own symlink resolves through that link: it would vouch for
            # wherever the link points (with no clean_roots configured the cache dir is its own root).
            through_link.append(rl)
            continue
        rr = os.path.realpath(rl)
        if os.path.dirname(rr) == rr or rr in SYSTEM_DIRS:
            continue  # a root that resolves to / or a system dir allows nothing
        allowed.append(rr)
    if default_ok:
        allowed.append(os.path.realpath(default_dir or default_inductor_dir()))
    for root in allowed:
        if real == root or real.startswith(root.rstrip("/") + "/"):
            return real
    if is_link:
        raise AgentError(f"refusing to clean {path!r} (resolves to {real!r}): {lex} is a symlink to {real}, outside the allowed roots "
                         f"{allowed or '(none besides the link itself)'}; point inductor_cache_dir at the real "
                         f"directory or add a clean_roots entry that contains {real}")
    raise AgentError(f"refusing to clean {path!r} (resolves to {real!r}): not inside an allowed root "
                     f"{allowed or '(none configured: set clean_roots)'}")


def empty_dir(real: str, dry_run: bool, quiet: bool = False) -> tuple[int, int]:
    """Remove the contents of a validated directory without following symlinks; emits `removed` per entry
    (unless `quiet`: launch reports one summary line instead)."""
    count = total = 0
    try:
        entries = sorted(os.listdir(real))
    except FileNotFoundError:
        return 0, 0
    for name in entries:
        p = os.path.join(real, name)
        size = _tree_size(p)
        if not quiet:
            emit("removed", path=p, bytes=size, dry_run=dry_run)
        count += 1
        total += size
        if dry_run:
            continue
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)  # rmtree never follows symlinks inside the tree
        else:
            os.unlink(p)
    return count, total


def _tree_size(p: str) -> int:
    try:
        st = os.lstat(p)
    except OSError:
        return 0
    if not os.path.isdir(p) or os.path.islink(p):
        return st.st_size
    total = 0
    for dirpath, _dirs, files in os.walk(p):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def check_manifest(model_dir: str, manifest: str | None) -> tuple[bool, str]:
    """Sizes and sha256 of the files a manifest lists: {"files": {rel: {size, sha256}}} or a list of entries."""
    mpath = manifest or os.path.join(model_dir, "manifest.json")
    if not os.path.isdir(model_dir):
        return False, f"model dir {model_dir} does not exist"
    data = read_json(mpath)
    if data is None:
        return False, f"manifest {mpath} missing or not a JSON object"
    files = data.get("files")
    if isinstance(files, list):
        files = {str(e.get("path")): e for e in files if isinstance(e, dict)}
    if not isinstance(files, dict) or not files:
        return False, f"manifest {mpath} has no 'files'"
    t0 = time.time()
    nbytes = 0
    for rel, meta in files.items():
        p = os.path.join(model_dir, rel)
        meta = meta if isinstance(meta, dict) else {"size": meta}
        try:
            size = os.path.getsize(p)
        except OSError:
            return False, f"{p} is missing"
        if meta.get("size") is not None and int(meta["size"]) != size:
            return False, f"{p} has {size} bytes, manifest says {meta['size']}"
        if meta.get("sha256"):
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() != meta["sha256"]:
                return False, f"{p} sha256 {h.hexdigest()[:16]} differs from the manifest"
        nbytes += size
    return True, f"{len(files)} files, {nbytes / 2**20:.1f} MiB match {mpath} ({time.time() - t0:.1f} s)"


def tmux(run: Run, *args: str, timeout: float = 10) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("tmux")
    if exe is None:
        raise AgentError("tmux is not installed on this host")
    env = dict(os.environ)
    env.pop("TMUX", None)
    # stdout/stderr to files, never pipes: a tmux server forked from here must not hold our channel open.
    with tempfile.TemporaryFile("w+") as out:
        cp = subprocess.run([exe, "-S", run.tmux_socket(), *args], stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, text=True, env=env, timeout=timeout)
        out.seek(0)
        return subprocess.CompletedProcess(cp.args, cp.returncode, out.read(), "")


def session_info(run: Run) -> dict[str, Any]:
    """Whether our tmux session exists and whether its pane is dead (remain-on-exit keeps it visible)."""
    if not os.path.exists(run.tmux_socket()) or shutil.which("tmux") is None:
        return {"exists": False, "pane_dead": None}
    cp = tmux(run, "list-panes", "-t", "=" + run.session, "-F", "#{pane_dead}")
    if cp.returncode != 0:
        return {"exists": False, "pane_dead": None}
    return {"exists": True, "pane_dead": cp.stdout.strip().splitlines()[:1] == ["1"]}


# -- inductor cache: who uses it, and its key ----------------------------------------------------------------
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _environ(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None  # gone, or another user's process (those cannot write our cache dir's files either)
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _uses_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps", "rb") as fh:
            return b"libtorch" in fh.read()
    except OSError:
        return False


def cache_users(real: str) -> list[tuple[str, int]]:
    """Live processes on this host whose inductor/triton cache lies in or over `real`: (run name, pid).

    Found through each process's environment (the launch wrapper sets TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR
    and OPSCTL_RUN for every run), so another run's cache is never emptied under it; for torch's shared default
    dir, any process that loaded libtorch without its own TORCHINDUCTOR_CACHE_DIR counts too."""
    is_default = real == os.path.realpath(default_inductor_dir())
    procs = all_procs()
    # This agent and its ancestors (the SSH session's shell, pct exec) only carry a login environment that
    # happens to export the variable: they are not runs using the cache.
    mine, p = set(), os.getpid()
    while p > 1 and p not in mine:
        mine.add(p)
        p = procs[p][1] if p in procs else 0
    out: list[tuple[str, int]] = []
    for pid, st in procs.items():
        if pid in mine or st[0] in ("Z", "X"):
            continue
        env = _environ(pid)
        if env is None:
            continue
        hit = False
        for key in CACHE_ENV:
            v = env.get(key)
            if v and os.path.isabs(v):
                rv = os.path.realpath(v)
                if rv == real or rv.startswith(real.rstrip("/") + "/") or real.startswith(rv.rstrip("/") + "/"):
                    hit = True
        if not hit and is_default and "TORCHINDUCTOR_CACHE_DIR" not in env and _uses_torch(pid):
            hit = True
        if hit:
            out.append((env.get("OPSCTL_RUN") or "(not an opsctl run)", pid))
    return sorted(out, key=lambda x: (x[0], x[1]))


def describe_users(users: list[tuple[str, int]]) -> str:
    by_run: dict[str, list[int]] = {}
    for name, pid in users:
        by_run.setdefault(name, []).append(pid)
    return "; ".join("run {} (pid {})".format(n, ", ".join(str(p) for p in pids[:8]) + (", ..." if len(pids) > 8 else ""))
                     for n, pids in by_run.items())


def _python_of(run: Run) -> str:
    """The interpreter the run uses when its argv starts with one (python3, .venv/bin/python), else this one."""
    argv = run.command if isinstance(run.command, list) else []
    if argv and re.match(r"python[\d.]*$", os.path.basename(str(argv[0]))):
        return str(argv[0]) if os.path.isabs(str(argv[0])) else (shutil.which(str(argv[0])) or sys.executable)
    return sys.executable


_VERSIONS_CODE = (
    "import json, sys\n"
    "from importlib import metadata\n"
    "def v(n):\n"
    "    try:\n"
    "        return metadata.version(n)\n"
    "    except Exception:\n"
    "        return 'none'\n"
    "print(json.dumps({'python': sys.version.split()[0], 'torch': v('torch'),"
    " 'triton': v('triton') if v('triton') != 'none' else v('pytorch-triton')}))\n"
)


def _git(workdir: str, *args: str) -> bytes | None:
    exe = shutil.which("git")
    if exe is None:
        return None
    try:
        cp = subprocess.run([exe, "-C", workdir, *args], stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return cp.stdout if cp.returncode == 0 else None


def _hash_tree(h: Any, root: str) -> int:
    """Hash every file under `root` (names and contents, in sorted order; bytecode and .git skipped)."""
    if os.path.isfile(root):
        files = [root]
    else:
        files = []
        for dirpath, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", ".git")]
            files += [os.path.join(dirpath, f) for f in names if not f.endswith((".pyc", ".pyo"))]
    n = 0
    for p in sorted(files):
        try:
            with open(p, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        h.update(p.encode(errors="surrogateescape") + b"\0" + data + b"\0")
        n += 1
    return n


def code_fingerprint(run: Run) -> str:
    """The code the run executes: `git <commit>[+dirty <hash of the diff and untracked files>]` for a git
    checkout, else `files <hash>` of cache_key_paths (default: the workdir's Python package dirs)."""
    head = _git(run.workdir, "rev-parse", "HEAD")
    if head:
        commit = head.decode().strip()[:12]
        diff = _git(run.workdir, "diff", "HEAD", "--binary") or b""
        untracked = _git(run.workdir, "ls-files", "--others", "--exclude-standard", "-z") or b""
        if not diff and not untracked:
            return f"git {commit}"
        h = hashlib.sha256(diff)
        for name in sorted(x for x in untracked.split(b"\0") if x):
            h.update(b"\0" + name + b"\0")
            try:
                with open(os.path.join(run.workdir, name.decode(errors="surrogateescape")), "rb") as fh:
                    h.update(fh.read(16 << 20))
            except OSError:
                pass
        return f"git {commit}+dirty {h.hexdigest()[:12]}"
    paths = [run.path(p) for p in run.cache_key_paths]
    if not paths:
        try:
            names = sorted(os.listdir(run.workdir))
        except OSError:
            names = []
        paths = [os.path.join(run.workdir, n) for n in names
                 if os.path.isfile(os.path.join(run.workdir, n, "__init__.py"))]
    h = hashlib.sha256()
    n = sum(_hash_tree(h, p) for p in paths)
    return f"files {h.hexdigest()[:12]} ({n} files)"


def cache_key(run: Run) -> dict[str, str]:
    """torch, triton and python versions of the run's interpreter plus the code fingerprint."""
    env = dict(os.environ)
    env.update(run.env)
    key: dict[str, str]
    try:
        cp = subprocess.run([_python_of(run), "-c", _VERSIONS_CODE], cwd=run.workdir, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        key = {k: str(v) for k, v in json.loads(cp.stdout.strip().splitlines()[-1]).items()}
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        key = {"python": "unknown", "torch": "unknown", "triton": "unknown", "error": f"{exc.__class__.__name__}"}
    key["code"] = code_fingerprint(run)
    return key


def previous_attempt(run: Run) -> dict[str, Any]:
    """What the last launch of this run came to: exit code, last phase, steps, its run_end, and its argv.

    Read from STATE_DIR (launch.json, exit_code, spec.json) and the events written since that launch: from the
    events file's size at the launch (launch.json `events_offset`), so a week of earlier attempts' events is not
    read again, and one line at most MAX_EVENT_LINE long (a longer one is skipped, never held whole)."""
    launch = read_json(run.state_file("launch.json")) or {}
    since = float(launch.get("ts", 0)) - 1.0
    out: dict[str, Any] = {"launched": bool(launch), "exit_code": read_exit_code(run.state_file("exit_code")),
                           "phase": None, "step": None, "total_steps": None, "run_end": None, "run_start": None,
                           "error": None, "argv": (read_json(run.state_file("spec.json")) or {}).get("argv")}
    if run.events and os.path.exists(run.events):
        with open(run.events, "rb") as fh:
            offset = launch.get("events_offset")
            if isinstance(offset, int) and 0 < offset <= os.fstat(fh.fileno()).st_size:
                fh.seek(offset)  # (a file shorter than that was truncated or replaced since: read it all)
            for head, length, complete in long_lines(fh, MAX_EVENT_LINE):
                if not complete:
                    break  # the line being written
                ev = event_object(head, length)  # an over-long or broken line is no event: skipped
                if not isinstance(ev, dict) or (isinstance(ev.get("ts"), (int, float)) and ev["ts"] < since):
                    continue
                kind = ev.get("kind")
                if kind == "run_start":
                    out.update(phase="starting", run_end=None, error=None, run_start=ev,
                               total_steps=ev.get("total_steps"), step=ev.get("resumed_from"))
                elif kind == "phase":
                    out["phase"] = ev.get("phase")
                elif kind == "step":
                    out["phase"] = "training"
                    out["step"] = ev.get("step")
                    if ev.get("total_steps"):
                        out["total_steps"] = ev["total_steps"]
                elif kind == "error" and ev.get("fatal"):
                    out["error"] = ev
                elif kind == "run_end":
                    out["run_end"] = ev
    return out


def lost_restart(run: Run, lost: dict[str, Any] | None, argv: list[str]) -> dict[str, Any] | None:
    """The restart a wrapper was waiting to start when it died (SIGKILL, OOM, a reboot during the back-off), which
    this launch carries out in its place: {n, of, argv} (argv with the policy's resume arguments), said on the
    launch's stream; None when there is none (or no restart policy now)."""
    policy = run.args.get("restart") or {}
    if not isinstance(lost, dict) or policy.get("when") != "on-failure":
        return None
    n = int(lost.get("n") or 1)
    resumed = resume_argv(argv, [str(a) for a in policy.get("resume_args") or []])
    emit("check", name="restart", ok=True,
         detail=f"restart {n} of {lost.get('max')} after attempt {lost.get('attempt')} (exit "
                f"{lost.get('exit_code')}) never started: the run's wrapper died during its back-off; starting it "
                "now" + (f", resuming with {' '.join(policy.get('resume_args') or [])}" if resumed != argv else ""))
    return {"n": n, "of": lost.get("attempt"), "argv": resumed}


def finished_refusal(run: Run, prev: dict[str, Any], argv: list[str]) -> str | None:
    """Why launching again would only break a run that already completed its last step (None: go ahead).

    The same command over unchanged files would be told `already at step N of N` by the training core and
    end as an error, hiding the result; a changed argv or a file named in it edited since lets it through."""
    end = prev.get("run_end")
    total = prev.get("total_steps")
    if not end or end.get("reason") != "completed" or end.get("exit_code") not in (0, None):
        return None
    step = end.get("step")
    if not (isinstance(step, int) and isinstance(total, int) and total > 0 and step >= total):
        return None
    if prev.get("argv") is not None and prev["argv"] != argv:
        return None
    ended = float(end.get("ts") or 0)
    for a in argv:
        p = run.path(a) if not a.startswith("-") else None
        try:
            if p and os.path.isfile(p) and os.path.getmtime(p) > ended:
                return None  # a config named in the command changed since it finished (e.g. more steps)
        except OSError:
            pass
    return (f"run {run.name} already finished: step {step} of {total} (run_end completed, exit 0); launching "
            f"it again would change nothing but its state. To train again: add --fresh to its command (a new "
            f"run in the same --out), raise the step count (train.max_steps in its config, or --max-steps), "
            f"or give it another --out")


def _argv_max_steps(argv: list[str]) -> int | None:
    """The `--max-steps N` (or `--max-steps=N`) of a dflash command line, the last one given; None without it."""
    found = None
    for i, a in enumerate(argv):
        value = argv[i + 1] if a == "--max-steps" and i + 1 < len(argv) else (
            a.split("=", 1)[1] if a.startswith("--max-steps=") else None)
        if value is not None and value.isdigit():
            found = int(value)
    return found


def beyond_refusal(run: Run, argv: list[str]) -> str | None:
    """Why this command would resume past its own last step (None: go ahead, or nothing says so).

    An attempt extended with `opsctl launch HOST RUN -- --max-steps 400` and stopped at step 139 leaves its newest
    checkpoint at 139; the plain command (its config's 100 steps) resumes from there and the training core refuses
    with `already at step 139 of 100` after its start-up. Known before anything starts when the command resumes
    (`--resume`, not `--fresh`), the newest checkpoint of the events still exists, and this command's length is
    known: its own `--max-steps`, or an earlier attempt with this very command line whose run_start had a fixed
    `train.max_steps` (an epochs-based config keeps the checkpoint's planned length instead: nothing to refuse) and
    no file named in it changed since."""
    if not run.events or "--fresh" in argv or not any(a == "--resume" or a.startswith("--resume=") for a in argv):
        return None
    ckpt: tuple[int, str] | None = None
    starts: list[dict[str, Any]] = []
    try:
        with open(run.events, "rb") as fh:
            for head, length, complete in long_lines(fh, MAX_EVENT_LINE):
                if not complete or (b'"checkpoint"' not in head and b'"run_start"' not in head):
                    continue
                ev = event_object(head, length)
                if not isinstance(ev, dict):
                    continue
                if ev.get("kind") == "checkpoint" and isinstance(ev.get("step"), int) and isinstance(ev.get("path"), str):
                    ckpt = (ev["step"], ev["path"])
                elif ev.get("kind") == "run_start" and isinstance(ev.get("ts"), (int, float)):
                    starts.append(ev)
    except OSError:
        return None
    if ckpt is None or not os.path.exists(run.path(ckpt[1])):
        return None
    step, total, how = ckpt[0], _argv_max_steps(argv), "its --max-steps"
    if total is None:
        for a in reversed(read_history(run.state_dir, run.log, run.keep_logs)):
            started, ended = a.get("started"), a.get("ended")
            if a.get("argv") != argv or not isinstance(started, (int, float)):
                continue
            mine = [e for e in starts if e["ts"] >= started - 1.0
                    and (not isinstance(ended, (int, float)) or e["ts"] <= ended + 1.0)]
            train = ((mine[-1].get("config") or {}).get("train") or {}) if mine else {}
            if not mine or not isinstance(mine[-1].get("total_steps"), int) or train.get("max_steps") is None:
                continue
            outputs = {run.path(run.events), run.path(run.log)}  # written by the run itself: no input changed
            for f in argv:
                p = run.path(f) if not f.startswith("-") else None
                try:
                    if p and p not in outputs and os.path.isfile(p) and os.path.getmtime(p) > started:
                        return None  # a config named in the command changed since (e.g. more steps)
                except OSError:
                    pass
            total, how = mine[-1]["total_steps"], f"its attempt #{a.get('id')} with this command trained {mine[-1]['total_steps']} steps"
            break
    if total is None or step < total:
        return None
    return (f"run {run.name} would resume past its own end: its newest checkpoint is at step {step} ({ckpt[1]}), "
            f"this command trains {total} steps ({how}); the training core would refuse it (already at step {step} "
            f"of {total}). To go on: opsctl launch HOST {run.name} -- --max-steps N (N above {step}); to start over: "
            f"add --fresh to its command, or give it another --out")


def rotate_logs(run: Run) -> tuple[str, int]:
    """Keep earlier attempts' logs: LOG -> LOG.1 -> ... -> LOG.keep_logs (the oldest beyond it goes); returns what
    was done and the rotation count an attempt records as its `log_seq` (the wrapper's rule, shared).

    Every launch used to truncate the log, so the traceback that made the user relaunch was gone."""
    return _W["rotate_logs"](run.log, run.keep_logs, run.state_dir)  # type: ignore[no-any-return]


def old_logs(run: Run) -> list[str]:
    """Earlier attempts' logs, oldest first (LOG.N ... LOG.1)."""
    return _W["old_logs"](run.log)  # type: ignore[no-any-return]


def cold_start_reasons(prev: dict[str, Any], fresh: bool) -> list[str]:
    """Why this launch must compile from nothing: asked for, or the last attempt died compiling (a bad cache entry
    would kill it again). Then the run's own saved compile artifacts (dflash's warm start, OUT/compile_cache) must not
    be loaded either: the launch sets DFLASH_WARM_START=0 for the run."""
    reasons = ["--fresh-cache"] if fresh else []
    if prev.get("phase") == "compiling" and (prev.get("exit_code") not in (0, None) or prev.get("error")
                                             or (prev.get("run_end") or {}).get("reason") in ("error", "signal")):
        reasons.append("the previous attempt died in phase compiling (exit {})".format(prev.get("exit_code")))
    return reasons


def prepare_cache(run: Run, real: str, prev: dict[str, Any], fresh: bool) -> str:
    """Clear or keep the run's cache dir by its policy; returns what was done and why (launch prints it)."""
    key_file = run.state_file("inductor_key.json")
    reasons = cold_start_reasons(prev, fresh)
    key: dict[str, str] | None = None
    if run.cache_policy == "clear":
        reasons.append("inductor_cache_policy clear")
    else:
        key = cache_key(run)
        old = read_json(key_file)
        if old is None or old.get("cache") != real or not isinstance(old.get("key"), dict):
            reasons.append("no key recorded for it yet")
        else:
            diff = [f"{k} {old['key'].get(k, 'none')} -> {key.get(k, 'none')}" for k in sorted(set(key) | set(old["key"]))
                    if key.get(k) != old["key"].get(k)]
            reasons += diff
        if key.get("error"):
            reasons.append(f"versions unknown ({key['error']})")
    os.makedirs(real, exist_ok=True)
    if reasons:
        n, size = empty_dir(real, dry_run=False, quiet=True)
        what = f"inductor cache cleared: {'; '.join(reasons)} ({real}: {n} entries, {size / 2**20:.1f} MiB)"
        if cold_start_reasons(prev, fresh):
            what += "; the run's saved compile artifacts are not loaded either (DFLASH_WARM_START=0)"
    else:
        n, size = _count_tree(real)
        what = (f"inductor cache kept: key unchanged (torch {key['torch']}, triton {key['triton']}, python "  # type: ignore[index]
                f"{key['python']}, {key['code']}) ({real}: {n} entries, {size / 2**20:.1f} MiB)")  # type: ignore[index]
    if key is not None:
        tmp = key_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"cache": real, "key": key, "ts": time.time()}, fh)
        os.replace(tmp, key_file)
    return what


def _count_tree(real: str) -> tuple[int, int]:
    try:
        names = os.listdir(real)
    except OSError:
        return 0, 0
    return len(names), sum(_tree_size(os.path.join(real, n)) for n in names)


def host_load_check(load1: float, cpus: int) -> tuple[bool, str]:
    """(warn, detail) for the host's 1-minute load average against its CPUs. A launch onto a host whose CPUs are
    already taken is not refused (GPU work needs little CPU) but is said: data loading and the launch stream compete
    for the cores, and on a CPU run every step slows in proportion (the tiny demo ran many times slower next to a
    test suite on 2 cores)."""
    busy = load1 > cpus
    detail = f"load {load1:.1f} over the last minute on {cpus} CPU{'s' if cpus != 1 else ''}"
    if busy:
        detail += ": more runnable work than CPUs; this run will share them and be slower (top / ps -eo pcpu,pid,args)"
    return busy, detail


# -- verbs --------------------------------------------------------------------------------------------------
def config_arg(argv: list[str]) -> str | None:
    """The run's config file, as the dflash CLI takes it (`--config FILE` or `--config=FILE`); None: not given."""
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def verb_launch(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    force = bool(opts.get("force"))
    extra = [str(a) for a in opts.get("extra_args") or []]  # `opsctl launch HOST RUN -- ARGS`: this attempt only
    argv = with_args(run.argv(), extra)
    where = str(opts.get("host") or socket.gethostname())
    if not os.path.isdir(run.workdir):
        what = "is not a directory" if os.path.exists(run.workdir) else "does not exist"
        emit("check", name="workdir", ok=False, detail=f"{run.workdir} {what} on host {where}: create it there, or "
             "set the run's `workdir:` in hosts.yaml to the directory the run starts in")
        return EXIT_CODES["refused"]
    config = config_arg(argv)
    if config is not None and not os.path.isfile(run.path(config)):
        # before anything is touched: `dflash: ...: cannot read config` from the started run said it too late
        emit("check", name="config", ok=False, detail=f"{run.path(config)} (the run's --config) does not exist on "
             f"host {where}: copy the config there, or fix --config in the run's command in hosts.yaml (a relative "
             f"path is read from the workdir {run.workdir})")
        return EXIT_CODES["refused"]
    os.makedirs(run.state_dir, exist_ok=True)
    failed: list[str] = []

    def check(name: str, good: bool, detail: str) -> None:
        emit("check", name=name, ok=good, detail=detail)
        if not good:
            failed.append(f"{name}: {detail}")

    def refused() -> int:
        """A refused launch is an attempt too (history says why), numbered like the others."""
        now = time.time()
        history_add(run.state_dir, started=now, ended=now, outcome="refused", reason="; ".join(failed),
                    argv=argv, extra_args=extra, by="launch")
        return EXIT_CODES["refused"]

    if shutil.which("tmux") is None:
        check("tmux", False, "tmux is not installed on this host (apt-get install tmux)")
        return refused()
    # One launch at a time per run: held until this agent exits (the kernel drops it with the process).
    lock_fd = os.open(run.state_file("launch.lock"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        check("not_running", False, "another opsctl launch of this run is in progress")
        return refused()
    prev = ProcWatch(run).snapshot()
    if prev["state"] == "running":
        check("not_running", False,
              "run already running (pid {}, tmux session {}); kill it first".format(prev["pid"], run.session))
        return refused()
    if prev["state"] == "restarting":
        r = prev.get("restart") or {}
        check("not_running", False, "run is restarting (restart {} of {} after attempt {} exited {}); kill it "
              "first".format(r.get("n"), r.get("max"), r.get("attempt"), r.get("exit_code")))
        return refused()
    lost = prev.get("restart_lost")
    left = leftovers(run)
    if left:
        check("not_running", False,
              f"the previous run exited but left processes alive (pids {left}); kill them first (opsctl kill)")
        return refused()
    emit("check", name="not_running", ok=True, detail=f"no live process recorded in {run.state_dir}")
    restart = lost_restart(run, lost, argv)
    prev = previous_attempt(run)
    why = finished_refusal(run, prev, argv)
    if why:  # before anything is touched: the finished run's files and state stay exactly as they are
        check("not_finished", False, why)
        return refused()
    why = beyond_refusal(run, argv)
    if why:  # likewise: an extended attempt's checkpoint is past this command's last step
        check("not_finished", False, why)
        return refused()

    ok = True
    if nvml.ok:
        gpus = opts.get("gpus")
        busy = [(g["index"], p["pid"], p.get("used_mb")) for g in nvml.sample() for p in g.get("procs", [])
                if not gpus or g["index"] in gpus]
        if busy and not force:
            ok = False
        check("gpus_free", not busy or force,
              ("busy: " + ", ".join(f"gpu{i} pid {p} {int(m or 0)} MiB" for i, p, m in busy)
               + (" (ignored: --force)" if force else "")) if busy
              else "no compute processes on " + (", ".join(f"gpu{i}" for i in gpus) if gpus else "any GPU"))
    else:
        emit("check", name="gpus_free", ok=True, detail="not checked: nvml " + nvml.status)
    try:
        warn, detail = host_load_check(os.getloadavg()[0], os.cpu_count() or 1)
        emit("check", name="host_load", ok=True, warn=warn, detail=detail)
    except OSError:  # no load average on this system: nothing to say
        pass

    if run.args.get("model_dir"):
        good, detail = check_manifest(run.path(run.args["model_dir"]),
                                      run.path(run.args["model_manifest"]) if run.args.get("model_manifest") else None)
        check("model_dir", good, detail)
        ok = ok and good

    pre = run.args.get("preflight")
    if pre:
        pargv = ["/bin/sh", "-c", pre] if isinstance(pre, str) else [str(x) for x in pre]
        env = dict(os.environ)
        env.update(run.env)
        try:
            cp = subprocess.run(pargv, cwd=run.workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                text=True, timeout=float(opts.get("preflight_timeout") or 300))
            out = (cp.stdout + cp.stderr).strip().splitlines()
            good = cp.returncode == 0
            detail = f"exit {cp.returncode}" + ((": " + " | ".join(out[-5:])) if out else "")
        except (OSError, subprocess.TimeoutExpired) as exc:
            good, detail = False, str(exc)
        check("preflight", good, detail)
        ok = ok and good

    real = ""
    try:
        real = run.validated_cache()
        users = cache_users(real)
        if users:
            check("inductor_cache", False, f"{real} is in use by {describe_users(users)}: not cleared, not shared; "
                  f"give this run its own inductor_cache_dir (the default is <state_dir>/inductor)")
            ok = False
        elif ok:
            emit("check", name="inductor_cache", ok=True,
                 detail=prepare_cache(run, real, prev, bool(opts.get("fresh_cache"))))
        else:
            emit("check", name="inductor_cache", ok=True, detail=f"{real} is valid; not touched (launch refused)")
    except (AgentError, OSError) as exc:
        check("inductor_cache", False, str(exc))
        ok = False
    if not ok:
        return refused()

    # A fresh start: remove what the previous run left, so state cannot be mistaken for this run's.
    for name in ("pid", "exit_code", "killed", RESTARTING_FILE):
        try:
            os.unlink(run.state_file(name))
        except FileNotFoundError:
            pass
    info = session_info(run)
    if info["exists"]:
        tmux(run, "kill-session", "-t", "=" + run.session)
    os.makedirs(os.path.dirname(run.log), exist_ok=True)
    rotated, log_seq = rotate_logs(run)
    emit("check", name="log", ok=True, detail=rotated)
    with open(run.log, "wb"):
        pass  # this attempt's log starts empty (the earlier ones were rotated, never truncated); offsets at 0
    env = dict(run.env)
    if cold_start_reasons(prev, bool(opts.get("fresh_cache"))):
        env["DFLASH_WARM_START"] = "0"  # dflash's own compile artifacts would bring back what was just cleared
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", real)
    env.setdefault("TRITON_CACHE_DIR", os.path.join(env["TORCHINDUCTOR_CACHE_DIR"], "triton"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["OPSCTL_RUN"] = run.name  # how cache_users() names the run that holds a cache dir
    env["OPSCTL_STATE_DIR"] = run.state_dir
    launch_ts = time.time()
    if restart is not None:  # this launch is the restart whose wrapper died during its back-off
        argv = restart["argv"]
        aid = history_add(run.state_dir, started=launch_ts, by="restart", restart=restart["n"],
                          restart_of=restart["of"], argv=argv, extra_args=extra, log_seq=log_seq)
    else:
        aid = history_add(run.state_dir, started=launch_ts, by="launch", argv=argv, extra_args=extra, log_seq=log_seq)
    # The wrapper runs the attempts: the first one (its id allocated here) and, by the restart policy, the next.
    spec = {"argv": argv, "env": env, "workdir": run.workdir, "log": run.log, "state_dir": run.state_dir,
            "name": run.name, "host": str(opts.get("host") or socket.gethostname()), "attempt": aid,
            "events": run.events, "restart": run.args.get("restart"), "notify": run.args.get("notify"),
            "tau_regression": run.args.get("tau_regression"),
            "stall_after": run.args.get("stall_after"), "keep_logs": run.keep_logs, "extra_args": extra,
            "restarts_used": restart["n"] if restart is not None else 0}
    with open(run.state_file("spec.json"), "w") as fh:
        json.dump(spec, fh)
    with open(run.state_file("wrapper.py"), "w") as fh:
        fh.write(wrapper_source())
    with open(run.state_file("tmux.conf"), "w") as fh:
        fh.write("set-option -g remain-on-exit on\nset-option -g history-limit 10000\n")
    events_offset = os.path.getsize(run.events) if run.events and os.path.exists(run.events) else 0
    with open(run.state_file("launch.json"), "w") as fh:
        json.dump({"ts": launch_ts, "session": run.session, "log": run.log, "events": run.events,
                   "events_offset": events_offset}, fh)
    cp = tmux(run, "-f", run.state_file("tmux.conf"), "new-session", "-d", "-s", run.session, "-x", "200", "-y", "50",
              "-c", run.workdir, sys.executable, run.state_file("wrapper.py"), run.state_file("spec.json"))
    if cp.returncode != 0:
        emit("error", message=f"tmux new-session failed: {cp.stdout.strip()}", fatal=True)
        history_add(run.state_dir, id=aid, ended=time.time(), outcome="crashed",
                    exception=f"tmux new-session failed: {cp.stdout.strip()}"[:500])
        return EXIT_CODES["failed"]
    tmux(run, "set-option", "-t", "=" + run.session, "remain-on-exit", "on")  # also when the server pre-existed
    deadline = time.monotonic() + 10
    info_pid: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        info_pid = read_json(run.state_file("pid"))
        if info_pid or read_exit_code(run.state_file("exit_code")) is not None:
            break
        time.sleep(0.02)
    if info_pid:
        emit("launched", pid=info_pid["pid"], pgid=info_pid["pgid"], session=run.session, log=run.log,
             events=run.events, socket=run.tmux_socket(), attempt=aid, argv=argv)
    follower = Follower(run, nvml, 0, events_offset, 0, float(opts.get("gpu_interval", 1.0)), launch_ts - 1.0)
    return follow_loop(follower, run, ready_deadline=time.monotonic() + run.ready_timeout,
                       keep_following=bool(opts.get("follow")))


def follow_loop(follower: Follower, run: Run, ready_deadline: float | None, keep_following: bool) -> int:
    """Ready / death / timeout verdicts for launch; `follow` runs it with no deadline until the run ends."""
    ready = ready_deadline is None
    while True:
        snap = follower.poll()
        if not ready and (follower.saw_step or follower.pattern_hit is not None):
            ready = True
            how = "first step event" if follower.saw_step else f"log line matched {run.ready_pattern!r}: {follower.pattern_hit}"
            emit("verdict", ok=True, reason="ready", detail=how, phase=follower.phase_text(), **follower.offsets())
            if not keep_following:
                return EXIT_CODES["ok"]
        if snap["state"] in ("exited", "absent") and (snap["state"] == "exited" or ready_deadline is not None):
            follower.poll()  # drain what the run wrote just before it died
            code = snap["exit_code"]
            if ready and ready_deadline is None and snap["state"] == "absent":
                emit("verdict", ok=False, reason="absent", detail="no process recorded for this run",
                     phase=follower.phase_text(), **follower.offsets())
                return EXIT_CODES["failed"]
            good = code == 0
            emit("verdict", ok=good and ready, reason="exited" if ready else "died_before_ready", exit_code=code,
                 phase=follower.phase_text(), traceback=None if good else follower.traceback(), tail=list(follower.lines)[-30:],
                 detail="run exited with status {}{}".format(code, "" if ready else " before it was ready, "
                                                           + follower.where_text()), **follower.offsets())
            return EXIT_CODES["ok"] if good and ready else EXIT_CODES["failed"]
        if not ready and ready_deadline is not None and time.monotonic() > ready_deadline:
            age = None if follower.last_event_ts is None else round(time.time() - follower.last_event_ts, 1)
            emit("verdict", ok=False, reason="timeout", phase=follower.phase_text(), last_event_age_s=age,
                 detail="not ready after {:g} s: stuck {}{}; the run was left running".format(run.ready_timeout, follower.where_text(), "" if age is None else f", last event {age:.1f} s ago"),
                 tail=list(follower.lines)[-10:], **follower.offsets())
            return EXIT_CODES["timeout"]
        time.sleep(POLL_S)


def never_launched(run: Run) -> bool:
    """No launch record, no pid file, no log: nothing was ever started here under this run's name."""
    return not any(p and os.path.exists(p) for p in (run.state_file("launch.json"), run.state_file("pid"), run.log))


def verb_follow(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    if opts.get("no_events"):
        run.events = None  # `logs` wants the human log only
        if never_launched(run):  # say so: printing nothing (or following a file that never comes) tells nothing
            emit("verdict", ok=True, reason="never_launched", detail=f"never launched: no launch record in {run.state_dir}, no "
                 f"log at {run.log}", log_offset=0, events_offset=0)
            return EXIT_CODES["ok"]
    if opts.get("all_logs"):
        # `logs --all`: every earlier attempt's log (rotated at launch), oldest first, then the current one.
        # `all_tail` N (`logs --all -n N`): the last N lines of each, the current one's through the follower's tail.
        olds = old_logs(run)
        keep = opts.get("all_tail")
        for i, path in enumerate(olds):
            emit("attempt", file=path, attempt=i + 1, attempts=len(olds) + 1, current=False)
            with open(path, "rb") as fh:
                lines = bounded_lines(fh, MAX_LOG_LINE)
                for raw in (collections.deque(lines, maxlen=int(keep)) if isinstance(keep, int) else lines):
                    emit("old_log", file=path, line=raw.decode("utf-8", errors="replace"))
        emit("attempt", file=run.log, attempt=len(olds) + 1, attempts=len(olds) + 1, current=True)
    follower = Follower(run, nvml, int(opts.get("log_offset", 0)), int(opts.get("events_offset", 0)),
                   int(opts.get("tail", 10)), float(opts.get("gpu_interval", 1.0)))
    if follower.events is not None:
        # the process (and its attempt's `since`) before the events: the client's RunState then folds an earlier
        # attempt's events for tau and charts only, as `status` does (attempt_since)
        follower.proc.poll(force=True)
    # what is there now (from the offsets, or the last `tail` lines), then `backlog_end`
    follower.catch_up(thin=bool(opts.get("thin_history")))
    if opts.get("once"):
        emit("verdict", ok=True, reason="snapshot", **follower.offsets())
        return EXIT_CODES["ok"]
    if not opts.get("until_exit", True):
        while True:
            follower.poll()
            time.sleep(POLL_S)
    return follow_loop(follower, run, ready_deadline=None, keep_following=True)


def attempt_since(run: Run) -> float:
    """Where the current attempt's events begin (the host's clock): a second before its launch or, for a restart, its
    own start. An event older than this is an earlier attempt's: it counts for the run's tau and the charts, never
    for this attempt's state or step. `status` folds by it, and every `proc` message carries it (`since`), so the
    client's RunState applies the same rule to what `watch` reads (an attempt killed before its run_start shows
    step 0 in both, not the previous attempt's last step)."""
    launch = read_json(run.state_file("launch.json")) or {}
    started = (read_json(run.state_file("pid")) or {}).get("started")
    ts = launch.get("ts")
    return max(float(ts) if isinstance(ts, (int, float)) else 0.0,
               float(started) if isinstance(started, (int, float)) else 0.0) - 1.0


def verb_status(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    proc_watch = ProcWatch(run)
    launch = read_json(run.state_file("launch.json")) or {}
    killed = read_json(run.state_file("killed"))
    since = attempt_since(run)
    # The events since the last run_start that a reducer needs: phase, last steps, errors, checkpoint, end.
    picked: dict[int, tuple[int, dict[str, Any]]] = {}
    steps: collections.deque[tuple[int, int, dict[str, Any]]] = collections.deque(maxlen=20)
    errors: collections.deque[tuple[int, int, dict[str, Any]]] = collections.deque(maxlen=50)
    last: dict[str, tuple[int, int, dict[str, Any]]] = {}
    size = 0
    tau = TauTrack()  # the run's evaluations across its attempts: the latest and the best tau so far
    eta = EtaClock()  # every step of the attempt, not only the last ones sent: the ETA watch shows too
    bad: list[Any] = [0, None]  # lines since the last run_start that are no event: how many, the last one's why
    mem = MemoryWatch()  # memory_growth / alloc_retries need the attempt's heartbeats, not the last one
    if run.events and os.path.exists(run.events):
        with open(run.events, "rb") as fh:
            off = fold_resume(run, fh, since, steps, errors, last, bad, tau, eta, mem)
            scanned_from = off
            for head, length, complete in long_lines(fh, MAX_EVENT_LINE):
                start, off = off, off + length + complete
                if not complete:
                    break
                ev = event_object(head, length)
                if isinstance(ev, str):
                    bad[:] = [bad[0] + 1, f"events file offset {start}: {ev}"]
                    continue
                tau.note(ev, (start, off, ev))
                kind = ev.get("kind")
                if kind == "run_start":
                    bad[:] = [0, None]  # the lines skipped since the last run_start, of any attempt (as RunState)
                if isinstance(ev.get("ts"), (int, float)) and ev["ts"] < since:
                    continue
                eta.note(ev)
                if kind == "run_start":
                    steps.clear()
                    errors.clear()
                    last.clear()
                    mem.__init__()
                mem.note(ev)
                if kind == "step":
                    steps.append((start, off, ev))
                elif kind == "error":
                    errors.append((start, off, ev))
                elif isinstance(kind, str):
                    last[kind] = (start, off, ev)
            size = off
            if size - scanned_from >= FOLD_AFTER_BYTES:
                fold_save(run, fh, since, size, steps, errors, last, bad, tau, eta, mem)
    taus = [e["ref"] for e in (tau.best(), tau.latest()) if e is not None]
    for item in list(last.values()) + list(steps) + list(errors) + taus:
        picked[item[0]] = (item[1], item[2])
    for start in sorted(picked):
        end, ev = picked[start]
        emit("event", off=start, end=end, event=ev)
    # proc after the events: a reducer resets the exit code when it sees run_start
    snap = proc_watch.poll(force=True)
    if nvml.ok:
        emit("gpu", gpus=tag_gpu_owners(run, nvml.sample()))
    sess = session_info(run)
    try:
        log_size = os.path.getsize(run.log)
    except OSError:
        log_size = None
    emit("status", name=run.name, proc=snap, killed_by_opsctl=killed is not None, killed=killed,
         launched_ts=launch.get("ts"), session=run.session, session_exists=sess["exists"],
         pane_dead=sess["pane_dead"], log=run.log, log_size=log_size, events=run.events, events_size=size,
         bad_events=bad[0], bad_event=bad[1], eta_clock=eta.state(), memory_growth=mem.growth(),
         alloc_retries=mem.alloc_retries())
    return EXIT_CODES["ok"]


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
            json.dump(state, out, separators=(",", ":"))
        os.replace(tmp, run.state_file(name))
    except (OSError, TypeError, ValueError):
        try:
            os.unlink(tmp)
        except OSError:
            pass


def nvml_holders(nvml: Nvml, ours: set[int], gpus: list[int] | None) -> list[tuple[int, int, float | None, str]]:
    """Compute processes on the GPUs (all, or the host's configured ones): (gpu, pid, MiB, whose).

    whose: `run` (a pid of the run), `hidden` (not visible here: NVML reports host pids, so inside a container a
    process of the run shows up under a pid this namespace does not have), or `other` (a visible process)."""
    if not nvml.ok:
        return []
    out = []
    for g in nvml.sample():
        if gpus and g["index"] not in gpus:
            continue
        for p in g.get("procs", []):
            pid = p["pid"]
            whose = "run" if pid in ours else ("other" if proc_stat(pid) is not None else "hidden")
            out.append((g["index"], pid, p.get("used_mb"), whose))
    return out


def gpu_released(nvml: Nvml, ours: set[int], before: list[tuple[int, int, float | None, str]],
                 gpus: list[int] | None, wait: float) -> tuple[bool | None, str]:
    """After the kill: no compute process of the run (or hidden from us, on a GPU the run used) holds memory.

    The driver frees a context a moment after the process dies, so this waits up to `wait` seconds. None when
    NVML cannot be asked: not a pass (a GPU host whose python lacks nvidia-ml-py must not look confirmed)."""
    if not nvml.ok:
        return None, "NOT CHECKED: GPU memory release not confirmed, nvml " + nvml.status
    used = {g for g, _p, _m, whose in before if whose in ("run", "hidden")}
    deadline = time.monotonic() + wait
    while True:
        left = [h for h in nvml_holders(nvml, ours, gpus)
                if h[3] == "run" or (h[3] == "hidden" and h[0] in used and h[1] in {b[1] for b in before})]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if left:
        return False, "GPU memory still held: " + ", ".join(
            f"gpu{g} pid {p} {int(m or 0)} MiB ({whose})" for g, p, m, whose in left)
    others = [h for h in nvml_holders(nvml, ours, gpus) if h[3] != "run"]
    note = ("; other processes on the GPUs: " + ", ".join(f"gpu{g} pid {p} ({w})" for g, p, _m, w in others)
            if others else "")
    return True, f"no process of the run holds GPU memory (checked {len(before)} before the kill){note}"


def verb_kill(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    info = read_json(run.state_file("pid"))
    proc_watch = ProcWatch(run)
    snap = proc_watch.poll(force=True)
    if not info or not isinstance(info.get("pid"), int):
        emit("verdict", ok=True, reason="not_running", detail=f"no process recorded in {run.state_dir}")
        return EXIT_CODES["ok"]
    pid, pgid = int(info["pid"]), int(info.get("pgid") or info["pid"])
    if wrapper_of(info) is not None and read_exit_code(run.state_file("exit_code")) is None:
        # First the marker: the wrapper never starts another attempt once it exists (restart policy), and it
        # records the attempt this kill ends as `killed`.
        with open(run.state_file("killed"), "w") as fh:
            json.dump({"ts": time.time(), "pid": pid, "pgid": pgid, "by": "opsctl kill"}, fh)
    if opts.get("mark_only"):
        # A group kill marks every node before it signals any: a node whose ranks die of their peer's kill (a failed
        # collective) before its own kill arrives must still read `killed`, not `crashed`.
        marked = os.path.exists(run.state_file("killed"))
        emit("verdict", ok=True, reason="marked" if marked else "not_running",
             detail="kill requested" if marked else f"no live attempt to mark in {run.state_dir}")
        return EXIT_CODES["ok"]
    if snap["state"] == "restarting":
        r = snap.get("restart") or {}
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if read_exit_code(run.state_file("exit_code")) is not None:
                proc_watch.poll()
                emit("verdict", ok=True, reason="killed", alive=[], exit_code=r.get("exit_code"), gpu_checked=False,
                     detail="restart cancelled: attempt {} had exited {}; restart {} of {} will not happen".format(
                         r.get("attempt"), r.get("exit_code"), r.get("n"), r.get("max")))
                return EXIT_CODES["ok"]
            now = read_json(run.state_file("pid")) or {}
            if isinstance(now.get("pid"), int) and now["pid"] != pid:  # it started just before the marker: kill it
                info, pid, pgid = now, int(now["pid"]), int(now.get("pgid") or now["pid"])
                break
            time.sleep(POLL_S)
    quiet = notifiers(run)

    def procs(seen: dict[int, int]) -> dict[int, int]:
        # the wrapper re-checked: it exits after the last one
        return run_procs(pid, pgid, seen, wrapper_of(info), quiet)  # type: ignore[arg-type]

    # Without the subreaper (not Linux, or an older wrapper) a double-forked daemon is out of our sight: say so.
    untracked = "" if info.get("subreaper") else "; detached descendants (double-forked daemons) could not be tracked: {}".format(
        info.get("subreaper_error") or "the run's wrapper did not record itself as a subreaper")
    known = procs({})
    if not known:
        emit("verdict", ok=True, reason="not_running", detail=f"pid {pid} and process group {pgid} are gone (state {snap['state']}){untracked}",
             exit_code=snap["exit_code"])
        return EXIT_CODES["ok"]
    with open(run.state_file("killed"), "w") as fh:
        json.dump({"ts": time.time(), "pid": pid, "pgid": pgid, "by": "opsctl kill"}, fh)
    events_offset = os.path.getsize(run.events) if run.events and os.path.exists(run.events) else 0
    grace = [run.kill_grace[0], run.kill_grace[1], 5.0]
    if opts.get("grace") is not None:
        g = opts["grace"]
        grace = [float(g[0]), float(g[1]), 5.0]
    seen_pids = dict(known)
    gpus_before = nvml_holders(nvml, set(seen_pids), opts.get("gpus"))
    for sig, wait in zip((signal.SIGINT, signal.SIGTERM, signal.SIGKILL), grace):  # noqa: B905 - the remote python may predate 3.10
        targets = procs(seen_pids)
        if not targets:
            break
        seen_pids.update(targets)
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
        for p in targets:
            st = proc_stat(p)
            if st is None or st[2] == pgid:
                continue  # killpg reached it: a second SIGINT would make the training core exit at once
            try:
                os.kill(p, sig)  # descendants that left the group (setsid/setpgid) too
            except OSError:
                pass
        deadline = time.monotonic() + wait
        left = targets
        while time.monotonic() < deadline:
            left = procs(seen_pids)
            if not left:
                break
            time.sleep(POLL_S)
        emit("killed", signal=signal.Signals(sig).name, pgid=pgid, alive=sorted(left))
        if not left:
            break
    left = procs(seen_pids)
    # The wrapper records the exit status right after the run ends; the training core writes run_end first.
    deadline = time.monotonic() + 3.0
    while read_exit_code(run.state_file("exit_code")) is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    run_end = None
    if run.events and os.path.exists(run.events):
        tail = Tail(run.events, events_offset)
        for _off, _end, raw in tail.read([]):
            ev = event_object(raw, _end - _off - 1)
            if isinstance(ev, dict) and ev.get("kind") == "run_end":
                run_end = ev
            if isinstance(ev, dict) and ev.get("kind") in ("run_end", "checkpoint"):
                emit("event", off=_off, end=_end, event=ev)
    proc_watch.poll()
    gpu_ok, gpu_detail = gpu_released(nvml, set(seen_pids), gpus_before, opts.get("gpus"),
                                      float(opts.get("gpu_release_wait", 10.0)))
    skipped = gpu_ok is None
    # Not checked is reported as such (ok false, skipped true) but does not fail the kill: on a CPU host there
    # is no GPU memory to hold, and the processes themselves were confirmed gone through /proc.
    emit("check", name="gpu_released", ok=bool(gpu_ok), skipped=skipped, detail=gpu_detail)
    ok = not left and (gpu_ok or skipped)
    emit("verdict", ok=ok, reason="killed" if ok else ("survivors" if left else "gpu_held"), alive=sorted(left),
         exit_code=read_exit_code(run.state_file("exit_code")), run_end=run_end, gpu_checked=not skipped,
         detail=(f"all {len(seen_pids)} processes gone" if not left else f"still alive: {sorted(left)}")
         + ("; GPU memory release not checked (no NVML)" if skipped else "") + untracked)
    return EXIT_CODES["ok"] if ok else EXIT_CODES["failed"]


def verb_clean(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    dry = bool(opts.get("dry_run"))
    snap = ProcWatch(run).snapshot()
    rc = EXIT_CODES["ok"]
    live = snap["state"] in ("running", "restarting")  # restarting: the wrapper starts the next attempt soon

    def refuse(detail: str, config: bool = False) -> int:
        """A refusal; in a dry run, what a real clean would refuse. `config`: the run's configuration is refused
        (its inductor_cache_dir is the home directory, a system directory, outside its roots): a dry run fails
        with the real clean's exit code 5, for no later moment makes that clean work. Otherwise it is the run's
        state now (running, processes left, another process using the cache): a dry run warns and exits 0."""
        soft = dry and not config
        emit("check", name="inductor_cache", ok=soft, warn=soft, detail=("a real clean would refuse: " if dry else "")
             + detail)
        return EXIT_CODES["ok"] if soft else EXIT_CODES["refused"]

    left = leftovers(run) if not live else []
    if live:
        rc = refuse("run is {} (pid {}): its compile cache is in use; not cleaned".format(
            "running" if snap["state"] == "running" else "restarting (the next attempt uses it)", snap["pid"]))
    elif left:
        rc = refuse(f"the run exited but left processes alive (pids {left}); they may use the cache and the pid "
                    f"file is how opsctl kill finds them: nothing cleaned, run opsctl kill first")
    else:
        try:
            real = run.validated_cache()
        except AgentError as exc:
            rc = refuse(str(exc), config=True)
        else:
            users = cache_users(real)
            if users:
                rc = refuse(f"{real} is in use by {describe_users(users)}: not cleaned")
            else:
                n, size = empty_dir(real, dry)
                emit("check", name="inductor_cache", ok=True,
                     detail=("would empty" if dry else "emptied") + f" {real}: {n} entries, {size / 2**20:.1f} MiB")
    if opts.get("logs"):
        # Earlier attempts' logs go only when asked (clean --logs); the current attempt's log always stays.
        for old in old_logs(run):
            emit("removed", path=old, bytes=_tree_size(old), dry_run=dry)
            if not dry:
                os.unlink(old)
    sess = session_info(run)
    if sess["exists"] and sess["pane_dead"]:
        emit("removed", path=f"tmux:{run.session}", bytes=0, dry_run=dry)
        if not dry:
            tmux(run, "kill-session", "-t", "=" + run.session)
    sock = run.tmux_socket()
    if not sess["exists"] and os.path.exists(sock) and not _socket_live(sock):
        emit("removed", path=sock, bytes=0, dry_run=dry)
        if not dry:
            os.unlink(sock)
    if not live and not left and os.path.exists(run.state_file("pid")):
        emit("removed", path=run.state_file("pid"), bytes=os.path.getsize(run.state_file("pid")), dry_run=dry)
        if not dry:
            os.unlink(run.state_file("pid"))
    return rc


def _socket_live(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError as exc:
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        s.close()


def verb_hello(run: Run | None, nvml: Nvml, opts: dict[str, Any]) -> int:
    return EXIT_CODES["ok"]


def verb_history(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    """Every attempt of the run, oldest first; an attempt with no end recorded is `running` or `restarting` when
    it is the live one, else `lost` (its wrapper died before it could write the end: SIGKILL, a reboot)."""
    attempts = read_history(run.state_dir, run.log, run.keep_logs)
    _W["attempt_taus"](run.events, attempts)
    snap = ProcWatch(run).snapshot()
    for a in attempts:
        if a.get("outcome") is None:
            live = a.get("id") == snap.get("attempt") and snap["state"] in ("running", "restarting")
            a["outcome"] = ("running" if snap["state"] == "running" else "restarting") if live else "lost"
        if isinstance(a.get("checkpoint"), str):  # keep_last deletes older checkpoints: never link one that is gone
            a["checkpoint_exists"] = os.path.exists(run.path(a["checkpoint"]))
    emit("history", attempts=attempts, state=snap["state"], current=snap.get("attempt"))
    return EXIT_CODES["ok"]


# The group's supervisor lease on its head node: one small JSON file rewritten in place (its heartbeat every few
# seconds would grow the append-only group.jsonl without end). Live while its heartbeat is younger than
# LEASE_STALE_INTERVALS of the refresh interval its holder recorded.
GROUP_LEASE_FILE = "group_lease.json"
LEASE_STALE_INTERVALS = 3.0


def _lease_view(cur: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    """The lease as clients see it: its holder, and whether it is live by the head's clock."""
    if cur is None:
        return None
    age = max(0.0, now - float(cur.get("heartbeat") or 0.0))
    live = not cur.get("released") and age <= LEASE_STALE_INTERVALS * float(cur.get("refresh_s") or 0.0)
    return {**cur, "heartbeat_age_s": age, "live": live}


def _group_lease(run: Run, op: dict[str, Any] | None, if_lease: str | None,
                 rec: dict[str, Any] | None) -> tuple[dict[str, Any] | None, bool | None, int | None]:
    """One lease operation and/or one record, under the history lock, so that two opsctls can never both hold the
    lease or both write a restart: (the lease now, granted, the record's id). `op`: acquire (granted when the lease
    is free, released, stale, already this token's, or held by `expect`: the token the caller saw and chose to
    replace), refresh and release (granted only to the token that holds it). `if_lease`: the record is written only
    while this token holds the lease (a supervisor that was taken over must not record a restart)."""
    os.makedirs(run.state_dir, exist_ok=True)
    path = run.state_file(GROUP_LEASE_FILE)
    lock = os.open(run.state_file("history.lock"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        cur = read_json(path)
        view = _lease_view(cur, now)
        granted: bool | None = None
        new: dict[str, Any] | None = None
        if op is not None:
            token = op.get("token")
            mine = cur is not None and cur.get("token") == token and not cur.get("released")
            kind = op.get("op")
            if kind == "acquire":
                granted = mine or view is None or not view["live"] or (cur or {}).get("token") == op.get("expect")
                if granted:
                    new = {"token": token, "host": op.get("host"), "pid": op.get("pid"),
                           "refresh_s": float(op.get("refresh_s") or 0.0), "since": now, "heartbeat": now}
            elif kind == "refresh":
                granted = mine
                new = {**cur, "heartbeat": now} if mine and cur is not None else None
            elif kind == "release":
                granted = mine
                new = {**cur, "released": now} if mine and cur is not None else None
            if new is not None:
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as fh:
                    json.dump(new, fh)
                os.replace(tmp, path)
                view = _lease_view(new, now)
        added = None
        holds = cur is not None and cur.get("token") == if_lease and not cur.get("released")
        if isinstance(rec, dict) and (if_lease is None or holds):
            added = history_add(run.state_dir, _file=GROUP_FILE, _locked=True, **rec)
        elif isinstance(rec, dict):
            granted = False
        return view, granted, added
    finally:
        os.close(lock)


def verb_group(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    """A group run's own records on its head node (its attempts, restart state, kill), appended like the history:
    the opsctl that follows the group writes them (no process on one host can stop and restart every node). With
    them, its supervisor lease (which opsctl carries out the restart policy now) and an operation on it."""
    rec, op, if_lease = opts.get("record"), opts.get("lease"), opts.get("if_lease")
    if isinstance(op, dict) or if_lease is not None:
        lease, granted, added = _group_lease(run, op if isinstance(op, dict) else None, if_lease,
                                             rec if isinstance(rec, dict) else None)
    else:
        added, granted = None, None
        if isinstance(rec, dict):
            os.makedirs(run.state_dir, exist_ok=True)
            added = history_add(run.state_dir, _file=GROUP_FILE, **rec)  # without an `id`: a new attempt, numbered
        lease = _lease_view(read_json(run.state_file(GROUP_LEASE_FILE)), time.time())
    emit("group", records=history_lines(run.state_file(GROUP_FILE)), added=added, ts=time.time(), lease=lease,
         lease_granted=granted)
    return EXIT_CODES["ok"]


VERBS = {"launch": verb_launch, "follow": verb_follow, "status": verb_status, "kill": verb_kill,
         "clean": verb_clean, "hello": verb_hello, "history": verb_history,
         "group": verb_group}


def main(argv: list[str]) -> None:
    watch_stdin()
    nvml = Nvml()
    # events_checked: every `event` this agent sends passed the contract's check (event_problem); the client need not
    # check it again (a week-long backlog's events cost the client a third of its fold in that check)
    emit("hello", agent_version=AGENT_VERSION, host=socket.gethostname(), pid=os.getpid(),
         python=sys.version.split()[0], nvml=nvml.status, verb=argv[0] if argv else None, events_checked=True)
    try:
        if len(argv) != 2 or argv[0] not in VERBS:
            raise AgentError("usage: agent VERB JSON_ARGS with VERB one of {}".format(", ".join(sorted(VERBS))))
        try:
            args = json.loads(argv[1])
        except ValueError as exc:
            raise AgentError(f"JSON_ARGS is not JSON: {exc}") from exc
        if not isinstance(args, dict):
            raise AgentError("JSON_ARGS must be an object")
        opts = args.pop("options", {}) or {}
        run = None if argv[0] == "hello" else Run(args)
        rc = VERBS[argv[0]](run, nvml, opts)  # type: ignore[arg-type]
    except AgentError as exc:
        emit("error", message=str(exc), fatal=True)
        rc = EXIT_CODES["usage"]
    except Exception as exc:  # noqa: BLE001 - report, never die silently
        import traceback

        emit("error", message=f"agent failed: {exc.__class__.__name__}: {exc}", fatal=True,
             traceback=traceback.format_exc())
        rc = EXIT_CODES["failed"]
    bye(rc)


if __name__ == "__main__":
    main(sys.argv[1:])
