"""Cache entries that heal: a content record written with each entry of the dflash cache (a pretrained target, a
directory of regenerated records), checked on every use, so a truncated or damaged entry is rebuilt (or refused,
naming its path) instead of failing every later run with a traceback that names no file.

What is recorded and checked, and why (cheap enough for every run):
- at write time, every file's size, sha256 and mtime (CONTENT, written last and atomically: it is the entry's
  "complete" mark);
- on use, every file's size (any truncation or append shows), and the sha256 of every file up to FULL_HASH_BYTES
  (configs, pretrain.json, complete.json, the tokenizer: they are read whole anyway); a larger file (weights, a long
  regen.jsonl) is re-hashed only when its mtime differs from the recorded one. A copied or moved cache (new mtimes) is
  hashed once in full on first use, still verifies, and its new mtimes are recorded; a damaged file of unchanged size and mtime is not caught, which
  is the price of not reading gigabytes on every start.

Entries written by an older dflash have no record: they are adopted when their structure checks out (every JSON file
parses, every safetensors file is as long as its header says, regen.jsonl has as many records as complete.json
promised), which catches what was seen failing (a truncated model.safetensors or pretrain.json, a regen.jsonl cut at
a line boundary); else they are rebuilt like a damaged one.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

CONTENT = "content.json"


def cache_home() -> Path:
    """The dflash cache on this host: $DFLASH_CACHE, else $XDG_CACHE_HOME/dflash, else ~/.cache/dflash (pretrained
    targets, regenerated data, the tiny tokenizer, fla's tuned kernel configs)."""
    if os.environ.get("DFLASH_CACHE"):
        return Path(os.environ["DFLASH_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash"

FULL_HASH_BYTES = 64 << 20
_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(directory: Path) -> list[Path]:
    """The entry's files, relative, sorted; the record itself and hidden files (temp files) left out."""
    out = []
    for p in directory.rglob("*"):
        rel = p.relative_to(directory)
        if p.is_file() and rel.name != CONTENT and not any(part.startswith(".") for part in rel.parts):
            out.append(rel)
    return sorted(out)


def record_content(directory: str | Path) -> dict[str, Any]:
    """Write CONTENT for every file in `directory` (fsync'd, renamed into place: a crash leaves no half record)."""
    d = Path(directory)
    files = {}
    for rel in _files(d):
        st = (d / rel).stat()
        files[str(rel)] = {"bytes": st.st_size, "sha256": sha256_file(d / rel), "mtime_ns": st.st_mtime_ns}
    record = {"format": 1, "files": files}
    _write_record(d, record)
    return record


def _write_record(d: Path, record: dict[str, Any]) -> None:
    tmp = d / f".{CONTENT}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(record, indent=1, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, d / CONTENT)


def content_problem(directory: str | Path) -> str | None:
    """None when the entry matches its record; else what is wrong, naming the file (see the module docstring for
    what is checked). `no content record` when there is none (an entry of an older dflash, or never finished).
    Call it holding the entry's lock: a file found whole under a new mtime is written back into the record."""
    d = Path(directory)
    rec_path = d / CONTENT
    if not rec_path.is_file():
        return f"{rec_path}: no content record"
    try:
        files = json.loads(rec_path.read_text())["files"]
        items = [(str(k), int(v["bytes"]), str(v["sha256"]), v.get("mtime_ns")) for k, v in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{rec_path}: unreadable content record ({type(exc).__name__})"
    touched = {}
    for rel, size, digest, mtime in items:
        f = d / rel
        try:
            st = f.stat()
        except OSError:
            return f"{f}: missing (listed in {CONTENT})"
        if st.st_size != size:
            return f"{f}: {st.st_size} bytes, {size} when written (truncated or replaced)"
        if (size <= FULL_HASH_BYTES or st.st_mtime_ns != mtime) and sha256_file(f) != digest:
            return f"{f}: sha256 differs from the one recorded when it was written (corrupt)"
        if st.st_mtime_ns != mtime:
            touched[rel] = st.st_mtime_ns
    if touched:  # same content, new mtimes (a copied cache): hashed in full once, the fast path from now on
        for rel, mtime_ns in touched.items():
            files[rel]["mtime_ns"] = mtime_ns
        _write_record(d, {"format": 1, "files": files})
    return None


def safetensors_problem(path: Path) -> str | None:
    """A safetensors file must be exactly as long as its header says (8-byte header size, JSON header, the tensors'
    data): a truncated one fails here with its path instead of in safetensors' loader."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                return f"{path}: {size} bytes, shorter than a safetensors header"
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                return f"{path}: header of {n} bytes in a {size}-byte file (truncated)"
            header = json.loads(fh.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        return f"{path}: unreadable safetensors header ({type(exc).__name__})"
    if 8 + n + end != size:
        return f"{path}: {size} bytes, its header says {8 + n + end} (truncated)"
    return None


def structure_problem(directory: str | Path) -> str | None:
    """The checks that need no record (for adopting an entry written by an older dflash): every JSON file parses,
    every safetensors file has the length its header gives."""
    d = Path(directory)
    for rel in _files(d):
        f = d / rel
        if f.suffix == ".json":
            try:
                json.loads(f.read_text())
            except (OSError, ValueError) as exc:
                return f"{f}: not valid JSON ({type(exc).__name__})"
        elif f.suffix == ".safetensors":
            problem = safetensors_problem(f)
            if problem:
                return problem
    return None


def dir_fingerprint(directory: str | Path) -> str:
    """A content key of a model directory that does not depend on where it lies: every file's name and size, the
    whole of each small file, and 16 evenly spaced 64 KiB samples of each large one (a re-saved, fine-tuned model
    changes every sample). Reads about 1 MiB per weight file, so a 27B target is keyed in well under a second."""
    d = Path(directory)
    h = hashlib.sha256()
    for rel in _files(d):
        f = d / rel
        size = f.stat().st_size
        h.update(f"{rel}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= _SAMPLES * _SAMPLE_BYTES:
                h.update(fh.read())
                continue
            for i in range(_SAMPLES):
                fh.seek((size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]


def target_identity(target: Any) -> dict[str, Any]:
    """What names a target's weights in a cache key (regenerated records, held-out sets), by content, never by where
    they lie (a copied or moved cache must find its entries): a pretrained target by its pretrain key (everything its
    weights depend on), any other directory by dir_fingerprint, a random init by its recipe. `target`: the run
    config's target section (dflash.target_config.TargetConfig)."""
    if target.path:
        done = Path(target.path) / "pretrain.json"
        try:
            key = json.loads(done.read_text()).get("key") if done.is_file() else None
        except (OSError, ValueError, AttributeError):
            key = None
        if key:
            return {"pretrain_key": key}
        return {"weights": dir_fingerprint(target.path)}
    return {"family": getattr(target, "family", None), "arch": target.arch, "seed": target.seed}


__all__ = ["CONTENT", "content_problem", "dir_fingerprint", "record_content", "safetensors_problem", "sha256_file",
           "structure_problem", "target_identity"]
