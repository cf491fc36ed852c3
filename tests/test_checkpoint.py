"""Tests of atomic checkpoints: manifest verification, refusal of corrupt or partial ones, keep_last pruning.

A corrupt newest checkpoint must stop a resume with a message naming the bad file, never be used silently.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from dflash.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_file,
    save_checkpoint,
    torch_bytes,
    verify_checkpoint,
)


def _save(out: Path, step: int, keep_last: int | None = None) -> Path:
    files = {"model.pt": torch_bytes({"w": torch.full((4,), float(step))}), "state.json": b'{"step": %d}' % step}
    return save_checkpoint(out, step, files, keep_last=keep_last).path


def test_save_writes_manifest_with_sizes_and_hashes(tmp_path: Path) -> None:
    saved = save_checkpoint(tmp_path, 3, {"a.bin": b"hello", "b.json": b"{}"})
    assert saved.path == tmp_path / "checkpoints" / "step-3"
    manifest_bytes = (saved.path / "manifest.json").read_bytes()
    assert saved.manifest_sha256 == hashlib.sha256(manifest_bytes).hexdigest()
    manifest = json.loads(manifest_bytes)
    assert manifest["files"]["a.bin"] == {"bytes": 5, "sha256": hashlib.sha256(b"hello").hexdigest()}
    assert verify_checkpoint(saved.path)["step"] == 3
    assert not [p for p in saved.path.parent.iterdir() if p.name.startswith(".tmp")]


def test_latest_is_newest_and_loads(tmp_path: Path) -> None:
    for s in (1, 10, 2):
        _save(tmp_path, s)
    path = latest_checkpoint(tmp_path)
    assert path is not None and path.name == "step-10"
    assert torch.equal(load_file(path, "model.pt")["w"], torch.full((4,), 10.0))


def test_corrupt_latest_is_refused_naming_the_file(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    bad = _save(tmp_path, 2)
    data = bytearray((bad / "model.pt").read_bytes())
    data[-5] ^= 0xFF  # same size, different content
    (bad / "model.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as exc:
        latest_checkpoint(tmp_path)
    msg = str(exc.value)
    assert str(bad / "model.pt") in msg and "sha256" in msg and "step-1" in msg


def test_truncated_and_partial_checkpoints_are_refused(tmp_path: Path) -> None:
    p = _save(tmp_path, 4)
    (p / "state.json").write_bytes(b"{")
    with pytest.raises(CheckpointError, match=r"state\.json: size 1 bytes, manifest says"):
        verify_checkpoint(p)
    (p / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json: missing \(partial checkpoint\)"):
        verify_checkpoint(p)
    # the run directory instead of one of its checkpoints (`dflash eval --checkpoint runs/tiny`): names the newest
    _save(tmp_path, 2)
    _save(tmp_path, 9)
    with pytest.raises(CheckpointError, match=r"a run directory, not a checkpoint; .* newest: .*step-9$"):
        verify_checkpoint(tmp_path)


def test_crashed_save_leaves_no_visible_checkpoint_and_is_cleaned(tmp_path: Path) -> None:
    _save(tmp_path, 1)

    def explode(dest: Path) -> None:
        dest.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, {"ok.bin": b"x", "boom.bin": explode})
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    path = latest_checkpoint(tmp_path)
    assert path is not None and path.name == "step-1"
    _save(tmp_path, 3)  # the next save removes the crashed temp dir
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_keep_last_prunes_oldest(tmp_path: Path) -> None:
    for s in range(1, 6):
        _save(tmp_path, s, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 4]


def test_no_checkpoint_returns_none(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None


def test_a_failed_save_removes_its_partial_directory_at_once_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    import errno

    save_checkpoint(tmp_path, 1, {"a.bin": b"x" * 10})

    def full(dest: Path) -> None:
        dest.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as err:
        save_checkpoint(tmp_path, 2, {"a.bin": b"y" * 10, "b.bin": full})
    assert err.value.errno == errno.ENOSPC
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-1"]
    saved = save_checkpoint(tmp_path, 3, {"a.bin": b"z"}, keep_last=1)
    assert saved.free_bytes > 0 and [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-3"]
