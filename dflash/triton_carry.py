"""Triton's kernel cache carried in OUT/compile_cache beside torch's mega-cache artifacts, so a restart whose cache
dir was emptied (opsctl's default `clear` policy, a new host) skips fla's first-call JIT and autotuning too.

fla's kernels are Triton kernels that torch's mega-cache does not hold: on a cold H200 the 27B-like target's first
forward compiles and autotunes them for 37.7 s (docs/perf.md), and a resume with artifacts alone was 47.5 s against
16.1 s with the cache kept (docs/warm-start.md). Triton's cache is content-addressed (each entry is a directory
named by a hash of the kernel source, its options, the Triton version and the GPU target), so restoring an entry that
this process will not use is harmless: it is never looked up. Nothing here ever fails a run.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash.compile_cache import key_changes, write_with_key

ARCHIVE = "triton.tar.gz"
META = "triton.json"
FORMAT = 1
KEY_PARTS = ("triton", "device")  # of compile_cache's artifact key: what a compiled Triton kernel depends on
# The most a run carries (compressed size is smaller); a shared ~/.triton/cache can hold far more than one run needs.
MAX_BYTES_ENV = "DFLASH_TRITON_CARRY_MAX_MB"
DEFAULT_MAX_MB = 512
# Triton names an entry by a base32/hex hash; anything else in the dir (temp files, locks) is not carried.
ENTRY = re.compile(r"^[A-Za-z0-9_-]{16,128}$")


def cache_dir() -> Path | None:
    """The Triton cache this process compiles into: TRITON_CACHE_DIR (opsctl sets it), else Triton's own default;
    None where Triton is not installed (CPU machines): nothing to carry."""
    env = os.environ.get("TRITON_CACHE_DIR", "").strip()
    if env:
        return Path(env)
    try:
        from triton import knobs  # type: ignore[import-not-found]

        return Path(knobs.cache.dir)
    except Exception:  # noqa: BLE001 - no Triton (CPU), or an older Triton without knobs
        try:
            import triton  # noqa: F401  # type: ignore[import-not-found]
        except Exception:  # noqa: BLE001
            return None
        return Path.home() / ".triton" / "cache"


def _max_bytes() -> int:
    try:
        return int(float(os.environ.get(MAX_BYTES_ENV, DEFAULT_MAX_MB)) * 2**20)
    except ValueError:
        return DEFAULT_MAX_MB * 2**20


@dataclass
class Carry:
    """What restore() did at this start; save() needs it to tell this run's entries from others."""

    started: float
    restored: set[str] = field(default_factory=set)
    reason: str = ""  # the human line; empty when there was nothing to do (no Triton, nothing carried yet)


def _entries(root: Path) -> dict[str, tuple[int, float]]:
    """entry name -> (bytes, newest mtime) for each well-formed entry directory of the cache."""
    found: dict[str, tuple[int, float]] = {}
    try:
        with os.scandir(root) as it:
            for e in it:
                if not (ENTRY.match(e.name) and e.is_dir(follow_symlinks=False)):
                    continue
                size, newest = 0, 0.0
                with os.scandir(e.path) as files:
                    for f in files:
                        if f.is_file(follow_symlinks=False):
                            st = f.stat(follow_symlinks=False)
                            size += st.st_size
                            newest = max(newest, st.st_mtime)
                found[e.name] = (size, newest)
    except OSError:
        return found
    return found


def _read_meta(d: Path) -> dict | None:
    try:
        meta = json.loads((d / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def restore(out_cache: Path, key: dict[str, str]) -> Carry:
    """Put the carried entries that this host's Triton cache lacks into it (each entry extracted aside, then renamed
    into place: a rank reading the cache meanwhile sees whole entries or none). `key` is compile_cache's artifact
    key: only its Triton version and device must match (entries are content-addressed; the graph does not matter)."""
    carry = Carry(started=time.time())
    root = cache_dir()
    meta = _read_meta(out_cache)
    if root is None or meta is None:
        return carry
    old = meta.get("key") if isinstance(meta.get("key"), dict) else {}
    diff = key_changes({k: old.get(k) for k in KEY_PARTS}, {k: key.get(k) for k in KEY_PARTS})
    if diff:
        carry.reason = f"carried Triton kernels ignored: {'; '.join(diff)}"
        return carry
    path = out_cache / ARCHIVE
    try:
        data = path.read_bytes()
    except OSError as exc:
        carry.reason = f"carried Triton kernels unreadable: {exc.strerror or exc}"
        return carry
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        carry.reason = f"carried Triton kernels ignored: {path} is corrupt (sha256 differs from {META})"
        return carry
    t0 = time.perf_counter()
    have = set(_entries(root))
    staging = root / f".dflash-carry-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = []
            for m in tar.getmembers():
                parts = Path(m.name).parts
                # entry/file only: no absolute paths, no '..', no links or devices (filter="data" checks again)
                if (len(parts) == 2 and ENTRY.match(parts[0]) and m.isfile() and parts[1] not in ("..", ".")
                        and parts[0] not in have):
                    members.append(m)
            tar.extractall(staging, members=members, filter="data")
        for name in sorted({Path(m.name).parts[0] for m in members}):
            try:
                os.rename(staging / name, root / name)
                carry.restored.add(name)
            except OSError:  # another rank put it there first: its copy is the same content
                pass
    except (OSError, tarfile.TarError, EOFError) as exc:
        carry.reason = f"carried Triton kernels not restored: {exc}"
        return carry
    finally:
        _remove_staging(staging)
    carry.reason = (f"restored {len(carry.restored)} Triton kernel entries ({len(data) / 2**20:.1f} MiB) from {path} "
                    f"in {time.perf_counter() - t0:.2f} s; {len(have)} were already in {root}")
    return carry


def _remove_staging(staging: Path) -> None:
    """Delete only our own staging dir (named by our pid, inside the cache dir), bottom-up, never following links."""
    if not staging.name.startswith(".dflash-carry-") or not staging.is_dir() or staging.is_symlink():
        return
    for dirpath, dirnames, filenames in os.walk(staging, topdown=False):
        for f in filenames:
            os.unlink(os.path.join(dirpath, f))
        for d in dirnames:
            p = os.path.join(dirpath, d)
            os.unlink(p) if os.path.islink(p) else os.rmdir(p)
    os.rmdir(staging)


def save(out_cache: Path, key: dict[str, str], carry: Carry | None) -> str:
    """Archive the Triton cache entries for the next start: all of them when they fit the cap (opsctl's cache dirs
    hold one run's, or one key's, kernels), else only those this process compiled or restored. Skipped when the
    archive already holds exactly these entries. Returns the human line ("" when the cache is empty or there is no
    Triton); never raises."""
    root = cache_dir()
    entries = _entries(root) if root is not None else {}
    if root is None or not entries:
        return ""
    cap = _max_bytes()
    chosen = entries
    if sum(s for s, _ in entries.values()) > cap and carry is not None:
        chosen = {k: v for k, v in entries.items() if v[1] >= carry.started - 1 or k in carry.restored}
    total = sum(s for s, _ in chosen.values())
    if not chosen:
        return (f"Triton kernels not carried: {root} is over the {cap / 2**20:.1f} MiB cap ({MAX_BYTES_ENV}) and "
                f"none of its entries are this run's")
    if total > cap:
        return (f"Triton kernels not carried: {total / 2**20:.1f} MiB in {root} is over the {cap / 2**20:.1f} MiB cap "
                f"({MAX_BYTES_ENV})")
    want = {k: key.get(k) for k in KEY_PARTS}
    old = _read_meta(out_cache)
    if old is not None and sorted(old.get("entries") or []) == sorted(chosen) and old.get("key") == want and \
            (out_cache / ARCHIVE).exists():
        return f"Triton kernels unchanged ({len(chosen)} entries in {out_cache / ARCHIVE})"
    t0 = time.perf_counter()
    buf = io.BytesIO()
    try:
        with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
            for name in sorted(chosen):
                for f in sorted((root / name).iterdir()):
                    if f.is_file() and not f.is_symlink():
                        tar.add(f, arcname=f"{name}/{f.name}", recursive=False)
        data = buf.getvalue()
        meta = {"format": FORMAT, "key": want, "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(), "entries": sorted(chosen), "saved": time.time()}
        write_with_key(out_cache, ARCHIVE, data, META, meta)
    except OSError as exc:
        return f"Triton kernels not carried: {exc}"
    return (f"Triton kernels carried: {len(chosen)} entries, {total / 2**20:.1f} MiB -> {len(data) / 2**20:.1f} MiB in "
            f"{out_cache / ARCHIVE} ({time.perf_counter() - t0:.1f} s)")
