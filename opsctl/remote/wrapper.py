"""The run's wrapper: the process tmux starts, which runs the command, tees it to the log and records its exit.

At launch the agent writes STATE_DIR/wrapper.py: this module's `main` with opsctl/remote bundled in
(base.shipped_script), stdlib-only and ASCII like the agent, so a bare python3 runs it.

It puts the run in its own session/process group, records pid and pgid, tees output to the log and writes the exit
status when the run ends. tmux starts it with a plain argv (`python3 wrapper.py spec.json`: no shell quoting).
On Linux it is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): a descendant whose parent exits (a double-forked
daemon) is re-parented to the wrapper instead of pid 1, so `kill` finds it among the wrapper's descendants. The
wrapper records the exit status when the main command ends, then stays (reaping) until every such leftover is gone:
while it lives, the leftovers stay findable; the tmux pane turns dead only after them.

Every start of the command is an *attempt* recorded in STATE_DIR/history.jsonl. The wrapper is also where the
run's restart policy lives (a crashed attempt is started again, with the resume arguments, after the back-off:
it needs no client connected) and where `notify` commands are fired on crashed / finished / stalled / restarting /
disk_full / tau_regression.
The rules both halves and the client share (the event contract's check, a log's crash line, argv rules, ETA, tau,
memory, slowdown) live in opsctl/remote/rules.py; what the wrapper shares with the agent only, in attempts.py (the
attempt history, log rotation) and thin.py (watch's thinned backlog and its fold, kept up to date here while the
run writes).
"""

from __future__ import annotations

import collections
import json
import os
import select
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from opsctl.remote.attempts import (
    history_add,
    proc_starttime,
    rotate_logs,
)
from opsctl.remote.base import (
    NOTIFIERS_FILE,
    RESTARTING_FILE,
    atomic_write,
    read_json,
)
from opsctl.remote.rules import (
    _SHELLS,
    STALL_FACTOR,
    STALL_FLOOR_S,
    MemoryWatch,
    TauTrack,
    crash_line,
    event_problem,
    resume_argv,
    slowdown,
)
from opsctl.remote.thin import refresh_backlog_fold

NOTIFY_TIMEOUT_S = 30.0  # a notify command still running after this is killed (and the failure logged)


# -- the wrapper ------------------------------------------------------------------------------------------------
def _subreaper() -> str | None:
    """None when we became a child subreaper, else why not (then detached descendants cannot be tracked)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
            return f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}"
        return None
    except Exception as exc:  # not Linux (no prctl), or no ctypes
        return f"prctl(PR_SET_CHILD_SUBREAPER) unavailable: {exc.__class__.__name__}: {exc}"


# Held while a child is started and its pid noted, and while the orphan reaper reaps: the reaper must never take
# the exit status of an attempt or a notify command (their Popen.wait needs it), however fast that one exits.
_SPAWN = threading.Lock()


def _reap_orphans(current: list[int]) -> None:
    """Reap adopted orphans as they exit, never the main command or a notify command (their Popen.wait reaps
    them): peek with WNOWAIT first, so a long run that sheds detached helpers does not pile up zombies."""
    while True:
        with _SPAWN:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            except (ChildProcessError, OSError):
                info = None
            if info is not None and info.si_pid not in current:
                try:
                    os.waitpid(info.si_pid, os.WNOHANG)
                except (ChildProcessError, OSError):
                    pass
                continue
        time.sleep(0.5)


def _ignore(signum: int, frame: Any) -> None:
    pass  # a handler (not SIG_IGN) so the run itself still gets default signal behaviour after exec


class Notifier:
    """Fires the run's `notify` argv on a state transition, in a thread: it never blocks the run, and each
    outcome (exit status, or why it could not run) is appended to STATE_DIR/notify.log."""

    def __init__(self, argv: list[str] | None, state_dir: str, env: dict[str, str], workdir: str,
                 children: list[int]) -> None:
        self.argv = [str(a) for a in argv] if argv else []
        self.state_dir = state_dir
        # not the cache variables: a notify command carrying them would look like a user of the run's cache
        self.env = {k: v for k, v in env.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        self.file = os.path.join(state_dir, NOTIFIERS_FILE.format(os.getpid()))
        self.workdir = workdir
        self.children = children  # pids the orphan reaper must leave to their Popen
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.live: dict[int, int | None] = {}

    def fire(self, state: str, fields: dict[str, Any]) -> None:
        if not self.argv:
            return
        env = dict(self.env)
        env["OPSCTL_STATE"] = state
        for k, v in fields.items():
            env["OPSCTL_" + k.upper()] = "" if v is None else str(v)
        t = threading.Thread(target=self._run, args=(state, env), daemon=True)
        self.threads.append(t)
        t.start()

    def _log(self, text: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            with open(os.path.join(self.state_dir, "notify.log"), "a") as fh:
                fh.write(f"{stamp} {text}\n")
        except OSError:
            pass

    def _publish(self) -> None:
        try:
            if self.live:
                atomic_write(self.file, json.dumps([[p, s] for p, s in self.live.items()]) + "\n")
            else:
                os.unlink(self.file)
        except OSError:
            pass

    def _run(self, state: str, env: dict[str, str]) -> None:
        what = f"{state} attempt {env.get('OPSCTL_ATTEMPT')}: {shlex.join(self.argv)}"
        with tempfile.TemporaryFile() as out:
            try:
                with self.lock, _SPAWN:
                    p = subprocess.Popen(self.argv, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
                    self.children.append(p.pid)
                    self.live[p.pid] = proc_starttime(p.pid)
                    self._publish()
            except OSError as exc:
                self._log(f"FAILED {what}: cannot start: {exc}")
                return
            try:
                rc = p.wait(NOTIFY_TIMEOUT_S)
                why = "" if rc == 0 else f"exit {rc}"
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                rc = p.wait()
                why = f"timed out after {NOTIFY_TIMEOUT_S:g} s (killed)"
            finally:
                with self.lock:
                    self.live.pop(p.pid, None)
                    if p.pid in self.children:
                        self.children.remove(p.pid)
                    self._publish()
            out.seek(0)
            tail = " | ".join(out.read().decode("utf-8", "replace").strip().splitlines()[-3:])
        self._log((f"FAILED {what}: {why}" if why else f"ok {what}") + (f": {tail}" if tail else ""))

    def wait(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for t in list(self.threads):
            t.join(max(0.0, end - time.monotonic()))


class EventsWatch:
    """Tails the run's events file for one attempt: first/last step, last checkpoint, run_end, and the progress
    clock that says `stalled` (the notification fires once per stall; progress ends the stall)."""

    def __init__(self, path: str | None, stall_after: float | None, tau_drop: dict[str, Any] | None = None) -> None:
        self.path = path
        self.stall_after_cfg = stall_after
        self.lock = threading.Lock()
        # tau over every attempt of this wrapper (seed_tau adds the earlier launches'): tau_regression's reference
        self.tau = TauTrack()
        self.tau_drop = tau_drop or {}
        self.tau_told = False
        self.reset(time.time())

    def reset(self, since: float) -> None:
        with self.lock:
            self.offset, self.head = 0, b""
            if self.path:
                try:
                    with open(self.path, "rb") as fh:
                        self.offset = os.fstat(fh.fileno()).st_size
                        self.head = fh.read(64)
                except OSError:
                    pass
            self.since = since - 1.0
            self.first_step: int | None = None
            self.last_step: int | None = None
            self.checkpoint: str | None = None
            self.run_end: dict[str, Any] | None = None
            self.fatal: str | None = None  # the message of the last fatal error (a refusal's own words)
            self.last_progress: float | None = None
            self.step_times: collections.deque[float] = collections.deque(maxlen=20)
            self.stalled = False
            # a `disk_full` error to notify: once per episode (until a checkpoint that fits ends it)
            self.disk_full: tuple[int | None, str] | None = None
            self.disk_full_told = False
            self.pace: tuple[Any, Any, int] | None = None  # the last step event's (pace, pace_ref_s, step)
            self.slow_told = False
            self.memory = MemoryWatch()  # memory_growth and alloc_retries, once per episode each
            self.growth_told = self.retries_told = False

    def poll(self) -> None:
        if not self.path:
            return
        with self.lock:
            try:
                with open(self.path, "rb") as fh:
                    size = os.fstat(fh.fileno()).st_size
                    head = fh.read(64)
                    if size < self.offset or not (head.startswith(self.head) or self.head.startswith(head)):
                        self.offset = 0  # truncated (a fresh run_start), maybe grown again: read it from its start
                    self.head = head
                    fh.seek(self.offset)
                    data = fh.read(8 << 20)
            except OSError:
                return
            cut = data.rfind(b"\n") + 1
            self.offset += cut
            for raw in data[:cut].splitlines():
                try:
                    ev = json.loads(raw)
                except ValueError:
                    continue
                if event_problem(ev) is None:  # the agent's readers skip the same lines (agent.event_object)
                    self._note(ev)

    def seed_tau(self) -> None:
        """The evaluations already in the events file (a launch that resumes a run): the best tau so far may be
        older than this wrapper. Only eval and run_start lines are parsed."""
        try:
            with open(self.path or "", "rb") as fh:
                for raw in fh:
                    if raw.endswith(b"\n") and (b'"eval"' in raw or b'"run_start"' in raw):
                        try:
                            ev = json.loads(raw)
                        except ValueError:
                            continue
                        if event_problem(ev) is None:
                            self.tau.note(ev)
        except OSError:
            pass

    def _note(self, ev: dict[str, Any]) -> None:
        ts = ev.get("ts")
        if not isinstance(ts, (int, float)) or ts < self.since:
            return
        kind = ev.get("kind")
        if kind == "error" and ev.get("fatal") and ev.get("message"):
            self.fatal = str(ev["message"])
        self.tau.note(ev)
        if kind == "run_start":
            self.memory = MemoryWatch()
        self.memory.note(ev)
        if kind in ("run_start", "phase", "heartbeat", "step", "checkpoint"):
            self.last_progress = float(ts)
            self.stalled = False
        if kind == "step" and isinstance(ev.get("step"), int):
            self.first_step = ev["step"] if self.first_step is None else self.first_step
            self.last_step = ev["step"]
            st = ev.get("step_time_s")
            if isinstance(st, (int, float)) and st == st and st >= 0:
                self.step_times.append(float(st))
            self.pace = (ev.get("pace"), ev.get("pace_ref_s"), ev["step"])
        elif kind == "run_start" and isinstance(ev.get("resumed_from"), int) and self.last_step is None:
            self.last_step = ev["resumed_from"]
        elif kind == "checkpoint" and ev.get("path"):
            self.checkpoint = str(ev["path"])
            self.disk_full, self.disk_full_told = None, False
        elif kind == "error" and ev.get("class") == "disk_full" and not self.disk_full_told:
            self.disk_full, self.disk_full_told = (self.last_step, str(ev.get("message") or "disk full")), True
        elif kind == "run_end":
            self.run_end = ev
            if isinstance(ev.get("step"), int):
                self.last_step = ev["step"]

    def stall_after(self) -> float:
        if self.stall_after_cfg:
            return float(self.stall_after_cfg)
        if self.step_times:
            return max(STALL_FLOOR_S, STALL_FACTOR * statistics.median(self.step_times))
        return STALL_FLOOR_S

    def take_disk_full(self) -> tuple[int | None, str] | None:
        """(step, message) of a disk_full error not notified yet, once per episode."""
        with self.lock:
            got, self.disk_full = self.disk_full, None
            return got

    def take_tau_regression(self) -> tuple[int, str] | None:
        """(step, evidence) of a tau regression not notified yet: once per episode (until tau is back within the
        margin of its best)."""
        with self.lock:
            evidence = self.tau.regression(self.tau_drop.get("drop_frac"), self.tau_drop.get("drop_min"))
            if not self._new_episode("tau_told", evidence) or evidence is None:
                return None
            last = self.tau.latest()
            return (last["step"] if last else 0), evidence

    def _new_episode(self, told: str, evidence: str | None) -> bool:
        """True once per episode of a condition (`evidence` not None), False while it lasts and after it ended;
        `told` names the attribute that remembers whether this episode was notified."""
        if evidence is None:
            setattr(self, told, False)
            return False
        if getattr(self, told):
            return False
        setattr(self, told, True)
        return True

    def take_slowdown(self) -> tuple[int, str] | None:
        """(step, evidence) of a slowdown not notified yet: once per episode (until the pace is back under
        SLOW_FACTOR; a new attempt starts a new pace)."""
        with self.lock:
            evidence = slowdown(*self.pace) if self.pace is not None else None
            if not self._new_episode("slow_told", evidence) or evidence is None or self.pace is None:
                return None
            return self.pace[2], evidence

    def take_memory(self) -> list[tuple[str, int | None, str]]:
        """(state, step, evidence) of memory_growth / alloc_retries not notified yet: once per episode each (until
        the rule no longer holds; a new attempt starts new windows)."""
        out = []
        with self.lock:
            for state, told, evidence in (("memory_growth", "growth_told", self.memory.growth()),
                                          ("alloc_retries", "retries_told", self.memory.alloc_retries())):
                if self._new_episode(told, evidence) and evidence is not None:
                    out.append((state, self.memory.last_step(), evidence))
        return out

    def check_stall(self) -> float | None:
        """The silence in seconds when the run just became stalled (once per stall), else None."""
        with self.lock:
            if self.stalled or self.last_progress is None or self.run_end is not None:
                return None
            age = time.time() - self.last_progress
            if age > self.stall_after():
                self.stalled = True
                return age
            return None


BACKLOG_KEEP_S = 300.0  # how often the wrapper brings watch's backlog fold up to date while the run writes
_fold_lock = threading.Lock()


def _refresh_fold(state_dir: str, events: str | None) -> None:
    """refresh_backlog_fold, one at a time, never raising (the wrapper's own work must go on whatever happens)."""
    with _fold_lock:
        try:
            refresh_backlog_fold(state_dir, events)
        except Exception:  # noqa: BLE001 - a shortcut for watch: a bad file or a full disk must not end the wrapper
            pass


class Attempt:
    """One start of the command: tee its output to the log (minus lines the run wrote there itself), wait."""

    def __init__(self, spec: dict[str, Any], argv: list[str], env: dict[str, str], children: list[int]) -> None:
        self.spec = spec
        self.argv = argv
        self.env = env
        self.children = children
        self.logf = open(spec["log"], "ab+", buffering=0)  # read too: put() looks for lines the run wrote itself
        self.lock = threading.Lock()
        # A run that writes the log file itself (a logging FileHandler next to a stdout StreamHandler, as dflash
        # does) would see every line twice. Such a handler writes the file before stdout, so when a stdout line
        # arrives its copy is already in the file: read what others appended since we last looked (minus what we
        # wrote ourselves) and drop stdout lines found there. stderr (tracebacks, warnings) always goes in.
        self.scan: dict[str, Any] = {"pos": os.fstat(self.logf.fileno()).st_size, "ours": {}, "foreign": {}}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> str | None:
        """Start the command; None, or why it could not start (written to the log too)."""
        with _SPAWN:
            try:
                self.proc = subprocess.Popen(self.argv, cwd=self.spec["workdir"], env=self.env,
                                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             start_new_session=True)
            except OSError as exc:
                msg = f"opsctl: cannot start {self.argv!r}: {exc}"
                self.logf.write((msg + "\n").encode())
                return msg
            self.children.append(self.proc.pid)
        return None

    @staticmethod
    def _count(d: dict[bytes, int], line: bytes, k: int) -> None:
        n = d.get(line, 0) + k
        if n > 0:
            d[line] = n
        else:
            d.pop(line, None)

    def _rescan(self) -> None:
        scan, fd = self.scan, self.logf.fileno()
        size = os.fstat(fd).st_size
        if size < scan["pos"]:
            scan["pos"] = 0  # truncated by the run
        if size <= scan["pos"]:
            return
        data = os.pread(fd, size - scan["pos"], scan["pos"])
        cut = data.rfind(b"\n") + 1
        scan["pos"] += cut
        for line in data[:cut].split(b"\n")[:-1]:
            if scan["ours"].get(line):
                self._count(scan["ours"], line, -1)
            else:
                self._count(scan["foreign"], line, 1)
        if len(scan["foreign"]) > 20000:  # lines the run logs to the file only: forget them
            scan["foreign"].clear()

    def put(self, data: bytes, is_stdout: bool) -> None:
        with self.lock:
            lines = data.split(b"\n")
            tail = lines.pop()  # b"" when data ends with a newline
            keep = []
            if is_stdout:
                try:
                    self._rescan()
                except OSError:
                    pass  # never let the pump die: the run would block on a full pipe
            for line in lines:
                if is_stdout and self.scan["foreign"].get(line):
                    self._count(self.scan["foreign"], line, -1)  # the run already wrote this line to the log
                    continue
                keep.append(line + b"\n")
                self._count(self.scan["ours"], line, 1)
            out = b"".join(keep) + tail
            if out:
                self.logf.write(out)
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            except OSError:
                pass

    def safe_put(self, data: bytes, is_stdout: bool) -> None:
        try:
            self.put(data, is_stdout)
        except Exception:
            pass  # keep draining the pipe whatever happens to the log: a full pipe would block the run

    def pump(self, fd: int, is_stdout: bool) -> None:
        buf = b""
        while True:
            ready, _, _ = select.select([fd], [], [], 0.3)
            if not ready:
                if buf:  # a partial line (a progress bar, a prompt): hand it over rather than sit on it
                    self.safe_put(buf, is_stdout)
                    buf = b""
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                if buf:
                    self.safe_put(buf, is_stdout)
                return
            buf += chunk
            cut = buf.rfind(b"\n") + 1
            if cut:  # whole lines only, so stdout and stderr never interleave inside a line
                self.safe_put(buf[:cut], is_stdout)
                buf = buf[cut:]

    def wait(self) -> int:
        """The attempt's exit status (128 + N for a death by signal N), once its output is drained."""
        proc = self.proc
        assert proc is not None and proc.stdout is not None and proc.stderr is not None
        threads = [threading.Thread(target=self.pump, args=(proc.stdout.fileno(), True), daemon=True),
                   threading.Thread(target=self.pump, args=(proc.stderr.fileno(), False), daemon=True)]
        for t in threads:
            t.start()
        rc = proc.wait()
        if proc.pid in self.children:
            self.children.remove(proc.pid)
        self.signal = -rc if rc < 0 else None
        # Drain what the run wrote before it died (threads end at EOF at once), but a child that keeps the pipes
        # open must not hold back the exit status: 0.8 s at most keeps "crash reported within 1 s of death".
        end = time.time() + 0.8
        for t in threads:
            t.join(max(0.0, end - time.time()))
        return rc if rc >= 0 else 128 - rc

    def close(self) -> None:
        try:
            self.logf.close()
        except OSError:
            pass


def _say(text: str) -> None:
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except OSError:
        pass


# A process ended by one of these was stopped by someone (a person's `kill`, opsctl's own escalation): `killed`,
# never restarted. Other signals (SIGSEGV, SIGABRT, SIGBUS, ...) are the program's own crash.
STOP_SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def shell_signal(argv: list[str], code: int) -> int | None:
    """The signal that ended a shell-wrapped command (`bash -c STRING`, how a command string runs): the shell
    reports its child's death by signal N as exit status 128 + N, so that is the signal, as for a direct child.
    (A script that itself ends with `exit 137` reads the same: a shell cannot tell the two apart.)"""
    if len(argv) < 2 or os.path.basename(argv[0]) not in _SHELLS or argv[1] != "-c" or not 128 < code < 128 + 65:
        return None
    try:
        return int(signal.Signals(code - 128))
    except ValueError:
        return None


def oom_kills() -> int | None:
    """The kernel's OOM kills in this process's cgroup so far (cgroup v2 memory.events), None where unreadable: a
    SIGKILL that came with a new OOM kill is the run's crash (out of memory), not someone stopping it."""
    try:
        with open("/proc/self/cgroup") as fh:
            path = next((ln.split(":", 2)[2].strip() for ln in fh if ln.startswith("0::")), None)
        if path is None:
            return None
        with open(os.path.join("/sys/fs/cgroup", path.lstrip("/"), "memory.events")) as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def _restart_count(times: list[float], within: float | None, now: float) -> int:
    """Restarts that count against `max`: all of this launch's, or those of the last `within` seconds."""
    return len(times) if not within else sum(1 for t in times if now - t < within)


def main() -> None:
    """Run spec.json's command (argv[1]) attempt after attempt (restart policy), then stay until leftovers end."""
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    state = spec["state_dir"]
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, _ignore)
    env = dict(os.environ)
    env.pop("TMUX", None)
    env.pop("TMUX_PANE", None)
    env.update(spec["env"])
    policy = spec.get("restart") or {}
    restart_max = int(policy.get("max") or 0) if policy.get("when") == "on-failure" else 0
    backoff = float(policy.get("backoff_s") or 0)
    within = policy.get("within_s")
    argv = list(spec["argv"])
    resume = resume_argv(argv, [str(a) for a in policy.get("resume_args") or []])
    run_name = str(spec.get("name") or env.get("OPSCTL_RUN") or "run")
    children: list[int] = []
    notifier = Notifier(spec.get("notify"), state, {**env, "OPSCTL_HOST": str(spec.get("host") or socket.gethostname()),
                                                    "OPSCTL_RUN": run_name}, spec["workdir"], children)
    watch = EventsWatch(spec.get("events"), spec.get("stall_after"), spec.get("tau_regression"))
    watch.seed_tau()
    killed_file = os.path.join(state, "killed")
    restarting_file = os.path.join(state, RESTARTING_FILE)
    reaper_error = _subreaper()
    if reaper_error is None and hasattr(os, "waitid"):
        threading.Thread(target=_reap_orphans, args=(children,), daemon=True).start()
    aid = spec.get("attempt")
    # A launch that carries out a restart whose wrapper died during its back-off: those restarts count against max
    # (as recent ones), and its attempt runs with the resume arguments.
    restart_times: list[float] = [time.time()] * int(spec.get("restarts_used") or 0)
    current = {"attempt": aid, "running": False}

    def tell_disk_full() -> None:
        full = watch.take_disk_full()
        if full is not None:
            notifier.fire("disk_full", {"attempt": current["attempt"], "step": full[0], "reason": full[1]})

    def tell_tau() -> None:
        tau = watch.take_tau_regression()
        if tau is not None:
            notifier.fire("tau_regression", {"attempt": current["attempt"], "step": tau[0], "reason": tau[1]})

    def tell_slow() -> None:
        slow = watch.take_slowdown()
        if slow is not None:
            notifier.fire("slowdown", {"attempt": current["attempt"], "step": slow[0], "reason": slow[1]})
        for state, step, reason in watch.take_memory():
            notifier.fire(state, {"attempt": current["attempt"], "step": step, "reason": reason})

    def stall_monitor() -> None:
        while True:
            time.sleep(0.5)
            watch.poll()
            if not current["running"]:
                continue
            tell_disk_full()
            tell_tau()
            tell_slow()
            age = watch.check_stall()
            if age is not None:
                notifier.fire("stalled", {"attempt": current["attempt"], "step": watch.last_step,
                                          "reason": f"no heartbeat, phase or step for {age:.0f} s "
                                                    f"(stall_after {watch.stall_after():.0f} s)"})

    threading.Thread(target=stall_monitor, daemon=True).start()

    def keep_fold() -> None:
        """watch's backlog fold, brought up to date every BACKLOG_KEEP_S at the lowest priority: a shortcut for the
        first `watch` of a long run, never a cost to the run (any failure leaves the fold as it was)."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass
        while True:
            time.sleep(float(spec.get("backlog_keep_s") or BACKLOG_KEEP_S))
            _refresh_fold(state, spec.get("events"))

    threading.Thread(target=keep_fold, daemon=True).start()
    code = 127
    while True:
        started = time.time()
        watch.reset(started)
        attempt = Attempt(spec, argv if not restart_times else resume, env, children)
        why_not = attempt.start()
        if why_not is not None:
            attempt.close()
            if aid is not None:
                history_add(state, id=aid, ended=time.time(), outcome="crashed", exit_code=127, exception=why_not)
            atomic_write(os.path.join(state, "exit_code"), "127\n")
            notifier.fire("crashed", {"attempt": aid, "step": None, "reason": why_not + " (exit 127)"})
            break
        assert attempt.proc is not None
        atomic_write(os.path.join(state, "pid"), json.dumps({
            "pid": attempt.proc.pid, "pgid": attempt.proc.pid, "wrapper_pid": os.getpid(),
            "wrapper_start": proc_starttime(), "subreaper": reaper_error is None, "subreaper_error": reaper_error,
            "started": started, "attempt": aid, "restarts": len(restart_times), "restart_max": restart_max}) + "\n")
        if aid is not None:
            history_add(state, id=aid, pid=attempt.proc.pid, started=started)
        try:
            os.unlink(restarting_file)
        except FileNotFoundError:
            pass
        current.update(attempt=aid, running=True)
        ooms = oom_kills()
        code = attempt.wait()
        current["running"] = False
        ended = time.time()
        attempt.close()
        watch.poll()
        tell_disk_full()  # one the run wrote just before it ended comes before how it ended
        tell_tau()
        killed = os.path.exists(killed_file)
        run_end = watch.run_end or {}
        if attempt.signal is None:
            attempt.signal = shell_signal(attempt.argv, code)
        signame = None if attempt.signal is None else signal.Signals(attempt.signal).name
        oom = signame == "SIGKILL" and ooms is not None and (oom_kills() or 0) > ooms
        if killed or (signame in STOP_SIGNALS and not oom):
            outcome = "killed"  # by opsctl kill, or by a signal someone sent from outside
        elif code == 0:
            outcome = "finished"
        elif run_end.get("reason") == "refused":
            outcome = "refused"  # the run refused to start (a resume it cannot make): a restart would refuse too
        elif code == 2 and (crash_line(spec["log"]) or "").startswith("dflash"):
            # a dflash command refused its config, data or arguments (one `dflash: ...` line, exit 2) before it
            # started: the same files would be refused again, so no restart (it made three, each refused)
            outcome = "refused"
        else:
            outcome = "crashed"
        # a kill's KeyboardInterrupt is no news
        exception = crash_line(spec["log"]) if outcome in ("crashed", "refused") else None
        if oom:
            exception = exception or "killed by the kernel's OOM killer (out of memory)"
        # A kill (opsctl's marker, a signal that ended the process, or a run that says it stopped on a signal)
        # never restarts: someone wanted it to stop.
        by_signal = attempt.signal is not None or run_end.get("reason") == "signal"
        used = _restart_count(restart_times, within, ended)
        again = outcome == "crashed" and not by_signal and used < restart_max
        refusal = watch.fatal if outcome == "refused" else None
        what = exception or refusal or (f"killed by signal {signame}" if signame else None)
        reason = f"{what} (exit {code})" if what else f"exit {code}"
        if outcome == "killed" and not killed:
            # status reads it from here (proc `signal`): killed, and by whom, not crashed
            info = read_json(os.path.join(state, "pid")) or {}
            atomic_write(os.path.join(state, "pid"), json.dumps({**info, "signal": signame}) + "\n")
        if aid is not None:
            history_add(state, id=aid, ended=ended, outcome=outcome, exit_code=code, exception=exception,
                        signal=signame, first_step=watch.first_step, last_step=watch.last_step,
                        checkpoint=watch.checkpoint, run_end=run_end.get("reason"), reason=refusal)
        if not again:
            atomic_write(os.path.join(state, "exit_code"), f"{code}\n")
            _say(f"\n[opsctl] run exited with status {code}")
            if outcome == "crashed" and restart_max and not by_signal:
                reason += f"; restart limit reached ({used} of {restart_max})"
            if outcome in ("finished", "crashed"):
                notifier.fire(outcome, {"attempt": aid, "step": watch.last_step, "reason": reason})
            elif outcome == "refused":  # notify's states stay as documented: a refusal is a run that did not go on
                notifier.fire("crashed", {"attempt": aid, "step": watch.last_step, "reason": f"refused: {reason}"})
            break
        n = used + 1
        at = ended + backoff
        atomic_write(restarting_file, json.dumps({"attempt": aid, "n": n, "max": restart_max, "at": at,
                                                  "ended": ended, "exit_code": code, "exception": exception}) + "\n")
        _say(f"\n[opsctl] run exited with status {code}; restart {n} of {restart_max} in {backoff:g} s")
        notifier.fire("restarting", {"attempt": aid, "step": watch.last_step,
                                     "reason": f"{reason}; restart {n} of {restart_max} in {backoff:g} s"})
        while time.time() < at and not os.path.exists(killed_file):
            time.sleep(0.1)
        if os.path.exists(killed_file):  # `opsctl kill` during the back-off: no new attempt
            atomic_write(os.path.join(state, "exit_code"), f"{code}\n")
            try:
                os.unlink(restarting_file)
            except FileNotFoundError:
                pass
            _say("[opsctl] restart cancelled: the run was killed")
            break
        restart_times.append(time.time())
        rotated, seq = rotate_logs(spec["log"], int(spec.get("keep_logs") or 10), state)
        previous = aid
        aid = history_add(state, started=time.time(), by="restart", restart=n, restart_of=previous,
                          argv=resume, extra_args=spec.get("extra_args") or [], log_seq=seq)
        header = f"[opsctl] attempt {aid}: restart {n} of {restart_max} after attempt {previous}: {reason}"
        with open(spec["log"], "w") as fh:  # the new attempt's own log, opening with why it exists
            fh.write(header + "\n")
        _say(f"{header}; {rotated}")
    notifier.wait(NOTIFY_TIMEOUT_S + 1)
    _refresh_fold(state, spec.get("events"))  # the ended run's whole history, folded for the next watch
    # Leftovers the run left behind (adopted orphans, see above): reap them until none is left.
    try:
        if os.waitpid(-1, os.WNOHANG) == (0, 0):
            _say("[opsctl] waiting for processes the run left behind (opsctl kill ends them)")
    except (ChildProcessError, OSError):
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except OSError:
            time.sleep(0.1)


if __name__ == "__main__":
    main()
