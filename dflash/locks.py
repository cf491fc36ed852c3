"""One writer per directory: exclusive advisory `fcntl.flock` locks on run directories, regen data directories and
cache entries.

Why flock: the kernel drops the lock when the holder's last descriptor closes, which includes the process dying by
SIGKILL or an OOM kill, so a crash never leaves a stale lock for a person to delete. The lock file itself stays (it is
never unlinked: unlinking a lock file lets two processes hold locks on two different inodes); what it holds is only
the current or last holder's pid and host, for the refusal message.

Re-entrant within one process (a count per lock file): `dflash train` takes the run lock in the CLI before it writes
OUT/train.log, and train() takes it again for callers that use the API directly. flock would otherwise refuse the
second descriptor of the same process.

The descriptor is opened O_CLOEXEC, so programs started with exec (torch's compile workers) do not inherit the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUN_LOCK = "run.lock"  # inside a run directory (OUT/run.lock)


class LockBusy(RuntimeError):
    """Another live process holds the lock; the message names it (pid, host) and the lock file."""


@dataclass
class _Held:
    fd: int
    count: int


_HELD: dict[str, _Held] = {}


def sibling_lock(directory: str | Path) -> Path:
    """The lock file of a directory that must stay empty until it is complete (a pretrained target is renamed into
    place; a regen --out refuses foreign files): `.NAME.lock` next to it."""
    d = Path(directory)
    return d.parent / f".{d.name}.lock"


def run_lock(out: str | Path) -> Path:
    return Path(out) / RUN_LOCK


def holder(lock_file: Path) -> dict[str, Any]:
    """Who holds (or last held) the lock, as written by acquire(); `{}` when it cannot be read yet."""
    try:
        data = json.loads(lock_file.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(lock_file: Path) -> str:
    """`pid N on HOST`: the holder writes its name right after it gets the lock, so a reader that came in between
    may see the previous holder's name (a dead pid on this host) or nothing; give it half a second to appear."""
    here = socket.gethostname()
    info: dict[str, Any] = {}
    for _ in range(25):
        info = holder(lock_file)
        pid = info.get("pid")
        if isinstance(pid, int) and (info.get("host") != here or _alive(pid)):
            break
        time.sleep(0.02)
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}"


def acquire(lock_file: str | Path, what: str, *, wait: bool = False, log: Callable[[str], None] | None = None,
            hint: str = "wait for it to end, or use another directory", timeout_s: float | None = None) -> Path:
    """Take the exclusive lock on `lock_file` (created if absent) for this process.

    Busy and `wait` False: raise LockBusy naming the holder. Busy and `wait` True: say once (through `log`) whom it
    waits for, then block until the holder is done (cache entries: the second of two runs started at once reuses what
    the first builds instead of failing), or, with `timeout_s`, raise LockBusy after that long (a training step that
    shares a host cache must never hang on a stopped holder)."""
    p = Path(lock_file)
    key = str(p.resolve())
    if key in _HELD:
        _HELD[key].count += 1
        return p
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _describe(p)
            if not wait:
                raise LockBusy(f"{what} is in use by {who} (lock {p}); {hint}") from None
            if log is not None:
                log(f"{what} is in use by {who}: waiting for it (lock {p})")
            if timeout_s is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                deadline = time.monotonic() + timeout_s
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise LockBusy(f"{what} is still in use by {who} after {timeout_s:g} s (lock {p})") \
                                from None
                        time.sleep(0.05)
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": round(time.time(), 3)})
        os.ftruncate(fd, 0)
        os.pwrite(fd, (info + "\n").encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    _HELD[key] = _Held(fd=fd, count=1)
    return p


def release(lock_file: str | Path) -> None:
    """Give one hold back; the last one closes the descriptor, which drops the lock."""
    key = str(Path(lock_file).resolve())
    held = _HELD.get(key)
    if held is None:
        return
    held.count -= 1
    if held.count <= 0:
        del _HELD[key]
        os.close(held.fd)


@contextlib.contextmanager
def hold(lock_file: str | Path, what: str, *, wait: bool = False, log: Callable[[str], None] | None = None,
         hint: str = "wait for it to end, or use another directory", timeout_s: float | None = None) -> Iterator[Path]:
    p = acquire(lock_file, what, wait=wait, log=log, hint=hint, timeout_s=timeout_s)
    try:
        yield p
    finally:
        release(p)


def is_rank0() -> bool:
    """Under torchrun rank 0 holds the run lock for the whole job; the other ranks must not try (they would find it
    held by their own rank 0)."""
    return int(os.environ.get("RANK", "0") or 0) == 0


__all__ = ["RUN_LOCK", "LockBusy", "acquire", "hold", "holder", "is_rank0", "release", "run_lock", "sibling_lock"]
