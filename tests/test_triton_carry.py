"""Triton's kernel cache carried in OUT/compile_cache (dflash/triton_carry.py): restored only where missing, whole
entries or none, never outside the cache dir, refused with a reason when its key or bytes are wrong.

Triton is absent on CPU machines: the cache here is a directory in Triton's documented layout (one directory per
kernel, named by its key's hash), which is all the module reads or writes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from dflash import triton_carry

KEY = {"torch": "2.11.0+cu130", "triton": "3.6.0", "python": "3.12.3", "device": "NVIDIA H200 sm90", "graph": "ab"}
A, B, C = "A" * 52, "B" * 52, "C" * 52


def entry(root: Path, name: str, size: int = 100, age_s: float = 0.0) -> dict[str, bytes]:
    files = {"k.cubin": os.urandom(size), "k.json": json.dumps({"name": name}).encode()}
    (root / name).mkdir(parents=True, exist_ok=True)
    for f, data in files.items():
        (root / name / f).write_bytes(data)
        if age_s:
            t = time.time() - age_s
            os.utime(root / name / f, (t, t))
    return files


def contents(root: Path) -> dict[str, dict[str, bytes]]:
    return {d.name: {f.name: f.read_bytes() for f in d.iterdir()} for d in root.iterdir() if d.is_dir()}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(root))
    monkeypatch.delenv(triton_carry.MAX_BYTES_ENV, raising=False)
    return root


def test_saved_entries_come_back_only_where_missing(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "compile_cache"
    saved = {A: entry(cache, A), B: entry(cache, B)}
    (cache / "lock.tmp").write_text("not an entry")
    line = triton_carry.save(out, KEY, None)
    assert line.startswith("Triton kernels carried: 2 entries"), line
    meta = json.loads((out / triton_carry.META).read_text())
    assert meta["entries"] == [A, B] and meta["key"] == {"triton": "3.6.0", "device": "NVIDIA H200 sm90"}
    assert "unchanged (2 entries" in triton_carry.save(out, KEY, None)
    # a new host: B is there with its own bytes (another rank restored it first), A is missing
    for d in (A, B):
        for f in (cache / d).iterdir():
            f.unlink()
        (cache / d).rmdir()
    (cache / "lock.tmp").unlink()
    theirs = entry(cache, B)
    carry = triton_carry.restore(out, KEY)
    assert carry.restored == {A}, carry.reason
    assert carry.reason.startswith("restored 1 Triton kernel entries") and "1 were already" in carry.reason
    assert contents(cache) == {A: saved[A], B: theirs}
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # the staging dir is gone


def test_a_restore_needs_the_same_triton_and_device_and_whole_bytes(cache: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "compile_cache"
    entry(cache, A)
    triton_carry.save(out, KEY, None)
    for f in (cache / A).iterdir():
        f.unlink()
    (cache / A).rmdir()
    other = triton_carry.restore(out, {**KEY, "device": "NVIDIA B200 sm100", "graph": "zz"})
    assert not other.restored and other.reason == (
        "carried Triton kernels ignored: device NVIDIA H200 sm90 -> NVIDIA B200 sm100")
    assert triton_carry.restore(out, {**KEY, "graph": "another drafter", "torch": "2.13"}).restored == {A}
    for f in (cache / A).iterdir():
        f.unlink()
    (cache / A).rmdir()
    archive = out / triton_carry.ARCHIVE
    archive.write_bytes(archive.read_bytes()[:-40])  # a disk that lost the tail
    bad = triton_carry.restore(out, KEY)
    assert not bad.restored and "is corrupt" in bad.reason and not cache.joinpath(A).exists()
    nothing = triton_carry.restore(tmp_path / "never-saved", KEY)
    assert not nothing.restored and nothing.reason == ""


def test_an_archive_cannot_write_outside_its_entries(cache: Path, tmp_path: Path) -> None:
    """A hand-made archive with a matching sha256: traversal, absolute names, links and nested paths are skipped."""
    out = tmp_path / "out" / "compile_cache"
    out.mkdir(parents=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        def add(name: str, data: bytes = b"x", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.size, info.type, info.linkname = (len(data) if kind == tarfile.REGTYPE else 0), kind, link
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
        add(f"{A}/good.cubin", b"good")
        add(f"{B}/../../escaped")
        add("/tmp/absolute-" + B)
        add(f"{C}/link", kind=tarfile.SYMTYPE, link="/etc/passwd")
        add(f"{C}/deeper/file")
        add("short/file")
    data = buf.getvalue()
    (out / triton_carry.ARCHIVE).write_bytes(data)
    (out / triton_carry.META).write_text(json.dumps({"format": 1, "key": {"triton": "3.6.0",
                                                     "device": "NVIDIA H200 sm90"},
                                                     "sha256": hashlib.sha256(data).hexdigest()}))
    carry = triton_carry.restore(out, KEY)
    assert carry.restored == {A}
    assert contents(cache) == {A: {"good.cubin": b"good"}}
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/absolute-" + B).exists()


def test_over_the_cap_only_this_runs_entries_are_carried(cache: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared ~/.triton/cache may hold far more than one run needs: then only what this process compiled (newer
    than its start) or restored goes into the archive; when even that is over the cap, nothing, with the reason."""
    out = tmp_path / "out" / "compile_cache"
    entry(cache, A, size=600_000, age_s=3600)  # another run's, an hour old
    entry(cache, B, size=300_000, age_s=3600)  # restored by this run (old mtimes from the archive)
    carry = triton_carry.Carry(started=time.time(), restored={B})
    entry(cache, C, size=300_000)  # compiled by this run
    monkeypatch.setenv(triton_carry.MAX_BYTES_ENV, "1")  # 1 MiB: all three (1.2 MB) do not fit
    line = triton_carry.save(out, KEY, carry)
    assert line.startswith("Triton kernels carried: 2 entries"), line
    assert json.loads((out / triton_carry.META).read_text())["entries"] == [B, C]
    monkeypatch.setenv(triton_carry.MAX_BYTES_ENV, "0.5")
    line = triton_carry.save(tmp_path / "other", KEY, carry)
    assert line.startswith("Triton kernels not carried: 0.6 MiB in ") and "is over the" in line, line
    assert not (tmp_path / "other" / triton_carry.ARCHIVE).exists()


def test_nothing_to_carry_says_nothing(cache: Path, tmp_path: Path) -> None:
    """A CPU run (no Triton, or an empty cache) neither writes an archive nor logs a line."""
    assert triton_carry.save(tmp_path / "out", KEY, None) == ""
    assert not (tmp_path / "out").exists()
