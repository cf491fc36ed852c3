"""fla's tuned kernel configs kept per host and GPU, so a new run's first target forward compiles one config per fla
kernel instead of autotuning every candidate (issue 24: the cold first step).

fla 0.6 has its own store for this (fla/ops/utils/cache.py): with FLA_CACHE_MODE=strict its autotuners look up
FLA_CONFIG_DIR/{kernel}.json for the exact autotune key before they benchmark anything, and autotune as before when
the key is not there. fla ships no configs in its wheel, and its autotuning (dozens of candidate kernels compiled and
timed) is, we expect (not yet measured), most of the 37.7-49.5 s a fresh H200 spends in the 27B-like target's first forward (docs/perf.md). Triton's
own cache of those results (fla's `cache_results`) lives in the Triton cache dir, which opsctl's default `clear`
policy empties at every launch and which a new run dir does not carry (dflash/triton_carry.py carries it per run).
So: after a run's first step this module writes what fla's autotuners chose into a host store
($DFLASH_CACHE/fla-configs/GPU/fla-V_triton-V/, one file per kernel, fla's own format), and every later start of a
target rank on that host, GPU and versions points fla at it. Nothing here ever fails a run: an unreadable store is
ignored (fla then autotunes), a kernel name two autotuners share is never recorded (a config of one would be looked
up for the other), and a user's own FLA_CACHE_MODE / FLA_CONFIG_DIR are left as set.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

from dflash import locks

MODE_ENV, DIR_ENV = "FLA_CACHE_MODE", "FLA_CONFIG_DIR"
MODE = "strict"  # exact key or fla's own autotuning: never a config tuned for another shape
STORE = "fla-configs"
LOCK = ".store.lock"
LOCK_WAIT_S = 10.0  # another rank writing takes milliseconds; a stopped holder must not hang a training step
FLA_MODULE = "fla.ops.utils.cache"  # holds FLA_CACHE_MODE, read once at fla's import


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _safe(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z.]+", "_", name).strip("_") or "unknown"


def store_dir(root: Path, gpu_name: str) -> Path | None:
    """The store for this GPU and these fla/Triton versions (a config names Triton options, and fla's kernels and
    their keys change between versions); None where fla or Triton is not installed (CPU machines)."""
    fla, triton = _version("fla-core", "flash-linear-attention"), _version("triton")
    if fla is None or triton is None:
        return None
    return Path(root) / STORE / _safe(gpu_name) / f"fla-{_safe(fla)}_triton-{_safe(triton)}"


def key_hash(key: Any) -> str:
    """fla's entry name for an autotune key (AutotuneKey.key_hash in fla/ops/utils/cache.py: md5 of the compact,
    key-sorted JSON of the key with tuples as lists)."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def _json_key(key: Any) -> list[Any] | None:
    """An autotune key (a tuple of ints, strings such as dtypes, bools) as JSON, or None when it holds anything JSON
    cannot carry unchanged (such a key could never match on lookup)."""
    try:
        back = json.loads(json.dumps(list(key)))
    except (TypeError, ValueError):
        return None
    return back if back == list(key) else None


def _config(cfg: Any) -> dict[str, Any] | None:
    """A triton.Config as fla's loader reads it back (kwargs, num_warps, num_stages, num_ctas, maxnreg,
    ir_override); None when its kwargs are not plain JSON values."""
    try:
        kwargs = dict(cfg.kwargs)
        json.dumps(kwargs)
        return {"kwargs": kwargs, "num_warps": int(cfg.num_warps), "num_stages": int(cfg.num_stages),
                "num_ctas": int(getattr(cfg, "num_ctas", 1) or 1), "maxnreg": getattr(cfg, "maxnreg", None),
                "ir_override": getattr(cfg, "ir_override", None)}
    except (AttributeError, TypeError, ValueError):
        return None


def _count(path: Path) -> tuple[int, int]:
    kernels = entries = 0
    for f in sorted(path.glob("*.json")):
        data = _read(f)
        if data and isinstance(data.get("autotune_entries"), dict) and data["autotune_entries"]:
            kernels += 1
            entries += len(data["autotune_entries"])
    return kernels, entries


def enable(path: Path | None, env: MutableMapping[str, str] | None = None) -> str:
    """Point fla at the store when it holds configs (before the target's first forward). Returns the log line."""
    env = os.environ if env is None else env
    if env.get(MODE_ENV) or env.get(DIR_ENV):
        return (f"fla kernel configs: {MODE_ENV}={env.get(MODE_ENV, '')!r} {DIR_ENV}={env.get(DIR_ENV, '')!r} set in "
                "the environment: left as set, nothing recorded")
    if path is None:
        return ""
    kernels, entries = _count(path) if path.is_dir() else (0, 0)
    if not kernels:
        return (f"fla kernel configs: none recorded yet in {path}: fla autotunes, and this run records its choices "
                "after its first step")
    env[MODE_ENV], env[DIR_ENV] = MODE, str(path)
    mod = sys.modules.get(FLA_MODULE)  # fla already imported: its mode was read at import
    if mod is not None and hasattr(mod, "FlaCacheMode"):
        try:
            mod.FLA_CACHE_MODE = mod.FlaCacheMode(MODE)
        except Exception as exc:  # noqa: BLE001 - an fla without this mode: it autotunes, as it would anyway
            return f"fla kernel configs: not used: the imported fla has no {MODE!r} mode ({exc})"
    return (f"fla kernel configs: {entries} tuned keys of {kernels} kernels from {path} ({MODE_ENV}={MODE}: a kernel "
            "whose key is there compiles that config alone, without autotuning)")


def _unwrap(obj: Any) -> Iterator[Any]:
    """An fla kernel is a module attribute wrapped as heuristics(autotuner(jit)): follow `.fn` a few levels."""
    for _ in range(4):
        if obj is None:
            return
        yield obj
        obj = getattr(obj, "fn", None)


def _is_autotuner(obj: Any) -> bool:
    """fla's CachedAutotuner (a triton Autotuner): its `cache` maps an autotune key to the triton.Config chosen."""
    return (isinstance(getattr(obj, "kernel_name", None), str) and isinstance(getattr(obj, "cache", None), dict)
            and isinstance(getattr(obj, "keys", None), (list, tuple)))


def autotuners() -> dict[str, list[Any]]:
    """fla's autotuners loaded in this process, by kernel name (several objects under one name: ambiguous)."""
    found: dict[int, Any] = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for value in list(getattr(mod, "__dict__", {}).values()):
            try:
                for obj in _unwrap(value):
                    if _is_autotuner(obj):
                        found[id(obj)] = obj
            except Exception:  # noqa: BLE001 - a lazy proxy whose attributes raise: not an autotuner
                continue
    by_name: dict[str, list[Any]] = {}
    for obj in found.values():
        by_name.setdefault(obj.kernel_name, []).append(obj)
    return by_name


def _read(f: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(f: Path, data: dict[str, Any]) -> None:
    tmp = f.with_name(f".{f.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, f)


def record(path: Path | None, env: MutableMapping[str, str] | None = None) -> str:
    """Add what fla's autotuners chose in this process to the store (after the first step: every kernel of the
    target's forward has run). Entries already there are kept; files are replaced whole (temp + rename) under the
    store's lock. Returns the log line, "" when there is nothing new. Never raises."""
    env = os.environ if env is None else env
    if path is None or ((env.get(MODE_ENV) or env.get(DIR_ENV)) and env.get(DIR_ENV) != str(path)):
        return ""  # the user's own fla settings: not ours to write into
    try:
        tuners = autotuners()
        triton = _version("triton")
        new = kernels = skipped = 0
        path.mkdir(parents=True, exist_ok=True)
        with locks.hold(path / LOCK, "the fla kernel config store", wait=True, timeout_s=LOCK_WAIT_S):
            for name, objs in sorted(tuners.items()):
                if len(objs) > 1:
                    skipped += 1
                    continue
                entries = {}
                for key, cfg in objs[0].cache.items():
                    jkey, jcfg = _json_key(key), _config(cfg)
                    if jkey is not None and jcfg is not None:
                        entries[key_hash(jkey)] = {"autotune_key": jkey, "config": jcfg}
                if not entries or not re.fullmatch(r"[A-Za-z0-9_]+", name):
                    continue
                f = path / f"{name}.json"
                data = _read(f) or {}
                have = data.get("autotune_entries") if isinstance(data.get("autotune_entries"), dict) else {}
                add = {h: e for h, e in entries.items() if h not in have}
                if not add:
                    continue
                _write(f, {"kernel_name": name, "triton_version": triton, "autotune_entries": {**have, **add},
                           "default_config": None})
                new += len(add)
                kernels += 1
    except (OSError, locks.LockBusy) as exc:
        return f"fla kernel configs: not recorded in {path}: {exc}"
    except Exception as exc:  # noqa: BLE001 - an odd object in fla's modules must not end a training step
        return f"fla kernel configs: not recorded in {path}: {type(exc).__name__}: {exc}"
    if not new:
        return ""
    extra = f"; {skipped} kernel names shared by several autotuners not recorded" if skipped else ""
    return f"fla kernel configs: recorded {new} tuned keys of {kernels} kernels in {path}{extra}"


__all__ = ["DIR_ENV", "MODE", "MODE_ENV", "autotuners", "enable", "key_hash", "record", "store_dir"]
