"""The run's wrapper: the process tmux starts, which runs the command, tees it to the log and records its exit.

The agent writes this file's text to STATE_DIR/wrapper.py at launch; it is stdlib-only and ASCII, like the agent.

It puts the run in its own session/process group, records pid and pgid, tees output to the log and writes the exit
status when the run ends. tmux starts it with a plain argv (`python3 wrapper.py spec.json`: no shell quoting).
On Linux it is a child subreaper (prctl PR_SET_CHILD_SUBREAPER): a descendant whose parent exits (a double-forked
daemon) is re-parented to the wrapper instead of pid 1, so `kill` finds it among the wrapper's descendants. The
wrapper records the exit status when the main command ends, then stays (reaping) until every such leftover is gone:
while it lives, the leftovers stay findable; the tmux pane turns dead only after them.
"""

# Keep this file ASCII only and stdlib only: the client ships its text inside the agent's blob (agent.WRAPPER_SLOT).

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any


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


def _reap_orphans(main_pid: int) -> None:
    """Reap adopted orphans as they exit, never the main command (Popen.wait reaps that one): peek with WNOWAIT
    first, so a long run that sheds detached helpers does not pile up zombies under the wrapper."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        except (ChildProcessError, OSError):
            info = None
        if info is None or info.si_pid == main_pid:
            time.sleep(0.5)
            continue
        try:
            os.waitpid(info.si_pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def _starttime() -> int | None:
    """Our start time in clock ticks (/proc/self/stat field 22): with the pid, it names this process uniquely."""
    try:
        with open("/proc/self/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _atomic(path: str, text: str) -> None:
    """Write-then-rename, so the agent never reads a half-written pid or exit_code file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _ignore(signum: int, frame: Any) -> None:
    pass  # a handler (not SIG_IGN) so the run itself still gets default signal behaviour after exec


def main() -> None:
    """Run spec.json's command (argv[1]) to its end, then stay until its leftovers are gone."""
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    state = spec["state_dir"]
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, _ignore)
    env = dict(os.environ)
    env.pop("TMUX", None)
    env.pop("TMUX_PANE", None)
    env.update(spec["env"])
    argv = spec["argv"]
    reaper_error = _subreaper()
    logf = open(spec["log"], "ab+", buffering=0)  # read too: put() looks for lines the run wrote itself
    try:
        proc = subprocess.Popen(argv, cwd=spec["workdir"], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        msg = f"opsctl: cannot start {argv!r}: {exc}\n"
        logf.write(msg.encode())
        _atomic(os.path.join(state, "exit_code"), "127\n")
        return
    _atomic(os.path.join(state, "pid"), json.dumps({"pid": proc.pid, "pgid": proc.pid,
            "wrapper_pid": os.getpid(), "wrapper_start": _starttime(), "subreaper": reaper_error is None,
            "subreaper_error": reaper_error, "started": time.time()}) + "\n")
    lock = threading.Lock()
    # A run that writes the log file itself (a logging FileHandler next to a stdout StreamHandler, as dflash
    # does) would see every line twice. Such a handler writes the file before stdout, so when a stdout line
    # arrives its copy is already in the file: read what others appended since we last looked (minus what we
    # wrote ourselves) and drop stdout lines found there. stderr (tracebacks, warnings) always goes in.
    scan: dict[str, Any] = {"pos": os.fstat(logf.fileno()).st_size, "ours": {}, "foreign": {}}

    def _count(d: dict[bytes, int], line: bytes, k: int) -> None:
        n = d.get(line, 0) + k
        if n > 0:
            d[line] = n
        else:
            d.pop(line, None)

    def _rescan() -> None:
        size = os.fstat(logf.fileno()).st_size
        if size < scan["pos"]:
            scan["pos"] = 0  # truncated by the run
        if size <= scan["pos"]:
            return
        data = os.pread(logf.fileno(), size - scan["pos"], scan["pos"])
        cut = data.rfind(b"\n") + 1
        scan["pos"] += cut
        for line in data[:cut].split(b"\n")[:-1]:
            if scan["ours"].get(line):
                _count(scan["ours"], line, -1)
            else:
                _count(scan["foreign"], line, 1)
        if len(scan["foreign"]) > 20000:  # lines the run logs to the file only: forget them
            scan["foreign"].clear()

    def put(data: bytes, is_stdout: bool) -> None:
        with lock:
            lines = data.split(b"\n")
            tail = lines.pop()  # b"" when data ends with a newline
            keep = []
            if is_stdout:
                try:
                    _rescan()
                except OSError:
                    pass  # never let the pump die: the run would block on a full pipe
            for line in lines:
                if is_stdout and scan["foreign"].get(line):
                    _count(scan["foreign"], line, -1)  # the run already wrote this line to the log
                    continue
                keep.append(line + b"\n")
                _count(scan["ours"], line, 1)
            out = b"".join(keep) + tail
            if out:
                logf.write(out)
            try:
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            except OSError:
                pass

    def safe_put(data: bytes, is_stdout: bool) -> None:
        try:
            put(data, is_stdout)
        except Exception:
            pass  # keep draining the pipe whatever happens to the log: a full pipe would block the run

    def pump(fd: int, is_stdout: bool) -> None:
        buf = b""
        while True:
            ready, _, _ = select.select([fd], [], [], 0.3)
            if not ready:
                if buf:  # a partial line (a progress bar, a prompt): hand it over rather than sit on it
                    safe_put(buf, is_stdout)
                    buf = b""
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                if buf:
                    safe_put(buf, is_stdout)
                return
            buf += chunk
            cut = buf.rfind(b"\n") + 1
            if cut:  # whole lines only, so stdout and stderr never interleave inside a line
                safe_put(buf[:cut], is_stdout)
                buf = buf[cut:]

    assert proc.stdout is not None and proc.stderr is not None
    threads = [threading.Thread(target=pump, args=(proc.stdout.fileno(), True), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr.fileno(), False), daemon=True)]
    for t in threads:
        t.start()
    if reaper_error is None and hasattr(os, "waitid"):
        threading.Thread(target=_reap_orphans, args=(proc.pid,), daemon=True).start()
    rc = proc.wait()
    code = rc if rc >= 0 else 128 - rc
    # Drain what the run wrote before it died (threads end at EOF at once), but a child that keeps the pipes open
    # must not hold back the exit status: 0.8 s at most keeps "crash reported within 1 s of death".
    end = time.time() + 0.8
    for t in threads:
        t.join(max(0.0, end - time.time()))
    _atomic(os.path.join(state, "exit_code"), f"{code}\n")
    try:
        sys.stdout.write(f"\n[opsctl] run exited with status {code}\n")
        sys.stdout.flush()
    except OSError:
        pass
    # Leftovers the run left behind (adopted orphans, see above): reap them until none is left.
    try:
        if os.waitpid(-1, os.WNOHANG) == (0, 0):
            sys.stdout.write("[opsctl] waiting for processes the run left behind (opsctl kill ends them)\n")
            sys.stdout.flush()
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
