"""The host as the agent sees it: NVML sampling, the run's settings (Run), its processes (the process group, the
wrapper's adopted descendants, GPU owners, leftovers), the `proc` state stream (ProcWatch), tmux, and the checks
that a directory may be emptied (validate_clean_dir, empty_dir).

Stdlib only (pynvml when importable): shipped in the agent's blob.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any

from opsctl.remote.attempts import (
    proc_starttime,
    read_history,
)
from opsctl.remote.base import (
    NOTIFIERS_FILE,
    RESTARTING_FILE,
    SYSTEM_DIRS,
    AgentError,
    emit,
    read_json,
)
from opsctl.remote.rules import (
    crash_line,
)


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
def tmux_socket_path(state_dir: str) -> str:
    """The run's tmux socket: STATE_DIR/tmux.sock, or, where that path is too long for AF_UNIX (~107 bytes), a
    stable short path derived from the state dir, so later calls (and a test's teardown) find it again."""
    sock = os.path.join(state_dir, "tmux.sock")
    if len(sock.encode()) < 100:
        return sock
    digest = hashlib.sha1(state_dir.encode()).hexdigest()[:16]
    d = os.path.join(tempfile.gettempdir(), f"opsctl-tmux-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return os.path.join(d, digest + ".sock")


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
        return tmux_socket_path(self.state_dir)

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


# -- clean-dir checks (SYSTEM_DIRS: opsctl/remote/base.py) ------------------------------------------------------
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
