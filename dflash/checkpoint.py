"""Atomic, verifiable checkpoints: write into a temp dir, fsync, rename; a manifest of sizes and sha256 per file.

Resume policy: `--resume` takes the newest `step-N` and refuses to start if it fails verification (naming the file),
rather than silently falling back to an older one: training from an older step would quietly redo work and overwrite
newer checkpoints. Delete the broken directory (the message says which) to resume from the previous one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^\.tmp-step-(\d+)(-\d+)?$")


class CheckpointError(RuntimeError):
    """A checkpoint that must not be trusted; the message names the directory and the offending file."""


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(exc: BaseException) -> bool:
    """No space (or quota) left: the one write failure a run can outlive, since its state is still in memory."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


@dataclass
class SavedCheckpoint:
    path: Path
    step: int
    manifest_sha256: str
    bytes: int
    seconds: float
    free_bytes: int  # left on the checkpoints' file system after the save (and the pruning)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


@contextlib.contextmanager
def atomic_directory(dst: Path) -> Iterator[Path]:
    """Yield a sibling temp directory that becomes `dst` (absent or empty) only if the block completes.

    Why: an export or a pretrained target is read by other programs under its final name, so a crash or a kill
    mid-write must leave nothing there, only a `.NAME.tmpPID` that the next attempt removes.
    """
    tmp = dst.parent / f".{dst.name}.tmp{os.getpid()}"
    if tmp.exists():  # ours by name: a crashed earlier attempt of this very process id
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _fsync_dir(tmp)
        if dst.exists():
            dst.rmdir()
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


def checkpoints_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _is_abandoned_tmp(name: str) -> bool:
    """A `.tmp-step-N-PID` save directory that no live save can be writing: this process's own (an earlier failed
    attempt), or one whose process is gone. Another live process's save in progress is never touched (two trainers
    on one OUT are refused by the run lock, but a directory must not depend on that to stay intact); a name without
    a pid is from an older dflash and is removed as before."""
    m = _TMP_RE.match(name)
    if m is None:
        return False
    if m.group(2) is None:
        return True
    pid = int(m.group(2)[1:])
    return pid == os.getpid() or not _pid_alive(pid)


def save_checkpoint(out: str | Path, step: int, files: dict[str, bytes | Callable[[Path], None]],
                    keep_last: int | None = None) -> SavedCheckpoint:
    """Write `files` (name -> bytes, or a writer called with the destination path) as OUT/checkpoints/step-N.

    The directory appears under its final name only once every file and the manifest are on disk (fsync'd), so a
    crash mid-save leaves a `.tmp-step-N-PID` directory that resume ignores and the next save cleans up (once that
    PID is gone: see _is_abandoned_tmp).
    """
    t0 = time.perf_counter()
    root = checkpoints_dir(out)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.iterdir():  # leftovers of a crashed save: ours by name pattern, inside our own dir
        if stale.is_dir() and _is_abandoned_tmp(stale.name):
            shutil.rmtree(stale)
    for name in files:
        if "/" in name or name in (MANIFEST, "", ".", ".."):
            raise ValueError(f"bad checkpoint file name {name!r}")
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    tmp.mkdir()
    entries: dict[str, dict[str, Any]] = {}
    try:
        for name, content in files.items():
            dest = tmp / name
            if isinstance(content, bytes):
                _write_bytes(dest, content)
            else:
                content(dest)
                with open(dest, "rb+") as fh:
                    os.fsync(fh.fileno())
            entries[name] = {"bytes": dest.stat().st_size, "sha256": _sha256_file(dest)}
        manifest = json_bytes({"step": step, "files": entries, "created": time.time()})
        _write_bytes(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
    except BaseException:
        # A failed save gives its space back at once (a full disk must not stay full of a half checkpoint); the
        # directory is ours: made above, by name, inside our own checkpoints dir.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = root / f"step-{step}"
    if final.exists():  # re-saving the same step (e.g. a signal right after a periodic save): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    if keep_last is not None:
        prune(out, keep_last)
    total = sum(e["bytes"] for e in entries.values()) + len(manifest)
    return SavedCheckpoint(path=final, step=step, manifest_sha256=hashlib.sha256(manifest).hexdigest(), bytes=total,
                           seconds=time.perf_counter() - t0, free_bytes=shutil.disk_usage(root).free)


def list_checkpoints(out: str | Path) -> list[tuple[int, Path]]:
    """Finished checkpoints (final names only), newest first."""
    root = checkpoints_dir(out)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check every file against the manifest; return the manifest or raise CheckpointError naming the file."""
    p = Path(path)
    mpath = p / MANIFEST
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except FileNotFoundError:
        inside = list_checkpoints(p) if p.is_dir() else []
        if inside:  # `--checkpoint runs/tiny`: the run directory, not one of its checkpoints
            raise CheckpointError(f"{p}: a run directory, not a checkpoint; pass one of its checkpoints, e.g. the "
                                  f"newest: {inside[0][1]}") from None
        raise CheckpointError(f"{mpath}: missing (partial checkpoint)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{mpath}: unreadable manifest ({exc})") from None
    m = _STEP_RE.match(p.name)
    if m and int(m.group(1)) != step:
        raise CheckpointError(f"{mpath}: says step {step}, directory says {m.group(1)}")
    for name, entry in files.items():
        f = p / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (listed in the manifest)")
        size = f.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{f}: size {size} bytes, manifest says {entry['bytes']} (truncated or replaced)")
        if _sha256_file(f) != entry["sha256"]:
            raise CheckpointError(f"{f}: sha256 does not match the manifest (corrupt)")
    return manifest


def latest_checkpoint(out: str | Path) -> Path | None:
    """The newest checkpoint, verified; a corrupt newest one raises (see the module docstring for why)."""
    found = list_checkpoints(out)
    if not found:
        return None
    _, path = found[0]
    try:
        verify_checkpoint(path)
    except CheckpointError as exc:
        older = f"; the previous one is {found[1][1]}" if len(found) > 1 else ""
        raise CheckpointError(f"refusing to resume: {exc}. Delete {path} to resume from an older checkpoint{older}") \
            from None
    return path


def load_file(path: str | Path, name: str) -> Any:
    """Read one file of a verified checkpoint: `.json` as JSON, anything else with torch.load."""
    f = Path(path) / name
    if name.endswith(".json"):
        return json.loads(f.read_text())
    return torch.load(f, map_location="cpu", weights_only=False)


def prune(out: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest keep_last checkpoints (only `step-N` dirs inside OUT/checkpoints)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    removed = []
    for _, p in list_checkpoints(out)[keep_last:]:
        shutil.rmtree(p)
        removed.append(p)
    return removed


def remove_all(out: str | Path) -> list[Path]:
    """Delete every checkpoint of OUT (finished and crashed temp dirs), for an explicit fresh start."""
    root = checkpoints_dir(out)
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and (_STEP_RE.match(p.name) or _TMP_RE.match(p.name)):
                shutil.rmtree(p)
                removed.append(p)
    return removed
