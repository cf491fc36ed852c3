"""fla's tuned kernel configs kept per host and GPU, so a new run's first target forward compiles one config per fla
kernel instead of autotuning every candidate (issue 24: the cold first step).

fla 0.6 has its own store for this (fla/ops/utils/cache.py): with FLA_CACHE_MODE=strict its autotuners look up
FLA_CONFIG_DIR/{kernel}.json for the exact autotune key before they benchmark anything, and autotune as before when
the key is not there. fla ships no configs in its wheel, and its autotuning (dozens of candidate kernels compiled and
timed) is, we expect (not yet measured), most of the 37.7-49.5 s a fresh H200 spends in the 27B-like target's first
forward (docs/perf.md). Triton's own cache of those results (fla's `cache_results`) lives in the Triton cache dir, which opsctl's default `clear`
policy empties at every launch and which a new run dir does not carry (dflash/triton_carry.py carries it per run).
So: after a run's first step this module writes what fla's autotuners chose into a host store
($DFLASH_CACHE/fla-configs/GPU/fla-V_triton-V/, one file per kernel, fla's own format), and every later start of a
target rank on that host, GPU and versions points fla at it. Nothing here ever fails a run: an unreadable store is
ignored (fla then autotunes), a kernel name several autotuners share (most of fla's: one function name in many op
modules) is filed under the name qualified by its module, for recording and lookup alike, and a user's own
FLA_CACHE_MODE / FLA_CONFIG_DIR are left as set.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import json
import os
import re
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

from dflash import locks
from dflash.kernels import package_version

MODE_ENV, DIR_ENV = "FLA_CACHE_MODE", "FLA_CONFIG_DIR"
MODE = "strict"  # exact key or fla's own autotuning: never a config tuned for another shape
STORE = "fla-configs"
# Configs tuned on our own device runs, shipped with dflash: dflash/fla_seed/GPU/fla-V_triton-V/ (the store's layout
# below its root). A host whose store lacks a kernel's key gets the shipped entry before its first forward.
SEED_ROOT = Path(__file__).parent / "fla_seed"
LOCK = ".store.lock"
LOCK_WAIT_S = 10.0  # another rank writing takes milliseconds; a stopped holder must not hang a training step
FLA_MODULE = "fla.ops.utils.cache"  # holds FLA_CACHE_MODE, read once at fla's import


def _version(*dists: str) -> str | None:
    """The first of these distributions that is installed (fla is `fla-core` or `flash-linear-attention`)."""
    return next((v for d in dists if (v := package_version(d)) is not None), None)


def _safe(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z.]+", "_", name).strip("_") or "unknown"


def _versions() -> str | None:
    fla, triton = _version("fla-core", "flash-linear-attention"), _version("triton")
    if fla is None or triton is None:
        return None
    return f"fla-{_safe(fla)}_triton-{_safe(triton)}"


def store_dir(root: Path, gpu_name: str) -> Path | None:
    """The store for this GPU and these fla/Triton versions (a config names Triton options, and fla's kernels and
    their keys change between versions); None where fla or Triton is not installed (CPU machines)."""
    versions = _versions()
    return None if versions is None else Path(root) / STORE / _safe(gpu_name) / versions


def seed_dir(gpu_name: str, root: Path = SEED_ROOT) -> Path | None:
    """The shipped configs for this GPU and these versions (None without fla or Triton; may not exist)."""
    versions = _versions()
    return None if versions is None else Path(root) / _safe(gpu_name) / versions


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
    try:
        # fla reads its mode once, at import: imported now (all of it: fla's package imports every op) under the
        # mode just set, or switched if something imported it before
        mod = sys.modules.get(FLA_MODULE) or importlib.import_module(FLA_MODULE)
        mod.FLA_CACHE_MODE = mod.FlaCacheMode(MODE)
        adopted = adopt()
    except Exception as exc:  # noqa: BLE001 - an fla without this store or mode: it autotunes, as it would anyway
        env.pop(MODE_ENV, None)
        env.pop(DIR_ENV, None)
        return f"fla kernel configs: not used: {type(exc).__name__}: {exc}"
    return (f"fla kernel configs: {entries} tuned keys of {kernels} kernels from {path} ({MODE_ENV}={MODE}: a kernel "
            f"whose key is there compiles that config alone, without autotuning; {adopted} plain Triton autotuners "
            "of fla given the same lookup)")


def seed(path: Path | None, src: Path | None) -> str:
    """Merge the shipped configs for this GPU and these versions into the host store (before `enable`), so even a
    fresh machine's first forward skips fla's autotuning. Why a copy and not a second lookup dir: fla reads one
    FLA_CONFIG_DIR, and a host's own tuned entries (its own shapes) must keep winning; an entry already in the host
    store is never replaced. Returns the log line, "" when nothing was shipped for this GPU or nothing was missing.
    Never raises: a seed that cannot be merged leaves fla to autotune, as it would without one."""
    if path is None or src is None or not Path(src).is_dir():
        return ""
    src = Path(src)
    try:
        added = kernels = 0
        path.mkdir(parents=True, exist_ok=True)
        with locks.hold(path / LOCK, "the fla kernel config store", wait=True, timeout_s=LOCK_WAIT_S):
            for f in sorted(src.glob("*.json")):
                shipped = _read(f)
                entries = shipped.get("autotune_entries") if shipped else None
                if not isinstance(entries, dict) or not entries:
                    continue
                n = _add_entries(path / f.name, entries, {k: v for k, v in shipped.items() if k != "autotune_entries"})
                added += n
                kernels += n > 0
    except (OSError, locks.LockBusy) as exc:
        return f"fla kernel configs: shipped configs not merged into {path}: {exc}"
    if not added:
        return ""
    return f"fla kernel configs: {added} tuned keys of {kernels} kernels shipped with dflash ({src}) added to {path}"


def _unwrap(obj: Any) -> Iterator[Any]:
    """An fla kernel is a module attribute wrapped as heuristics(autotuner(jit)): follow `.fn` a few levels."""
    for _ in range(4):
        if obj is None:
            return
        yield obj
        obj = getattr(obj, "fn", None)


def kernel_name(obj: Any) -> str | None:
    """The name fla's store files a kernel under: CachedAutotuner's `kernel_name`, else (a plain Triton Autotuner)
    its innermost function's name, which is what CachedAutotuner would compute (`fn.fn.__name__`)."""
    name = getattr(obj, "kernel_name", None)
    if isinstance(name, str):
        return name
    name = getattr(getattr(obj, "base_fn", None), "__name__", None)
    return name if isinstance(name, str) else None


def _module(obj: Any) -> str | None:
    """The module that defines an autotuner's kernel function (Triton's Autotuner keeps it as `base_fn`, else it is
    the plain function at the end of the `.fn` chain)."""
    fn = getattr(obj, "base_fn", None)
    if not inspect.isfunction(fn):
        fn = next((o for o in _unwrap(obj) if inspect.isfunction(o)), None)
    mod = getattr(fn, "__module__", None)
    return mod if isinstance(mod, str) else None


def store_names() -> dict[str, Any]:
    """Every fla autotuner loaded in this process by the name its configs are filed under in the store.

    fla 0.6 files configs by the kernel function's name alone, and most of its autotuned kernels share that name with
    another op's (the session-15 H200 store held 4 kernels and left 8 shared names out). A shared name is therefore
    qualified by the defining module (`chunk_fwd_kernel_o__fla_ops_common_chunk_o`): the name depends only on the
    code, so the run that records and the run that looks up agree, and two kernels never read each other's file.
    Names still shared after that (one module defining a kernel twice) are left out."""
    named: dict[str, list[Any]] = {}
    for name, objs in autotuners().items():
        if len(objs) == 1:
            named.setdefault(name, []).append(objs[0])
            continue
        for obj in objs:
            mod = _module(obj)
            if mod is not None:
                named.setdefault(f"{name}__{re.sub(r'[^0-9A-Za-z]+', '_', mod)}", []).append(obj)
    return {name: objs[0] for name, objs in named.items() if len(objs) == 1 and re.fullmatch(r"[A-Za-z0-9_]+", name)}


def _is_autotuner(obj: Any) -> bool:
    """A Triton Autotuner (fla's CachedAutotuner or a plain one): `cache` maps an autotune key to the chosen
    triton.Config."""
    return (kernel_name(obj) is not None and isinstance(getattr(obj, "cache", None), dict)
            and isinstance(getattr(obj, "keys", None), (list, tuple))
            and isinstance(getattr(obj, "configs", None), list))


def adopt() -> int:
    """Give fla's plain Triton autotuners fla's own CachedAutotuner class, so the store serves every fla kernel, and
    every autotuner its store name (store_names: CachedAutotuner looks up `self.kernel_name`).

    Why: fla decorates only some kernels with its `fla_cache_autotune` (the chunked Gated DeltaNet's KKT, WY and
    state kernels); others that the same forward runs use Triton's plain `autotune` (fla/ops/utils/cumsum.py,
    fla/ops/common/chunk_o.py), and fla's own switch for them (`configure_fla_cache_autotune`) must run before fla is
    imported, which importing it defeats. CachedAutotuner is a subclass of Triton's Autotuner that adds only the store
    lookup before Triton's own `run`, and needs only `kernel_name` besides, so an instance's class is swapped in
    place (every wrapper that holds it sees the change). Returns how many were adopted."""
    cached = getattr(sys.modules.get(FLA_MODULE), "CachedAutotuner", None)
    plain = getattr(sys.modules.get("triton.runtime.autotuner"), "Autotuner", None)
    if not isinstance(cached, type) or not isinstance(plain, type) or not issubclass(cached, plain):
        return 0
    n = 0
    for name, obj in store_names().items():
        if type(obj) is plain:
            obj.__class__ = cached
            n += 1
        if isinstance(obj, cached):
            obj.kernel_name = name
    return n


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
        by_name.setdefault(str(kernel_name(obj)), []).append(obj)
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


def _add_entries(f: Path, entries: dict[str, Any], header: dict[str, Any]) -> int:
    """Write into one kernel's file (fla's format: `header` fields + `autotune_entries`) the entries it lacks; an
    entry already there is never replaced. The caller holds the store's lock. Returns how many were added."""
    data = _read(f) or {}
    have = data.get("autotune_entries") if isinstance(data.get("autotune_entries"), dict) else {}
    add = {h: e for h, e in entries.items() if h not in have}
    if add:
        _write(f, {**header, "autotune_entries": {**have, **add}})
    return len(add)


def record(path: Path | None, env: MutableMapping[str, str] | None = None) -> str:
    """Add what fla's autotuners chose in this process to the store (after the first step: every kernel of the
    target's forward has run). Entries already there are kept; files are replaced whole (temp + rename) under the
    store's lock. Returns the log line, "" when there is nothing new. Never raises."""
    env = os.environ if env is None else env
    if path is None or ((env.get(MODE_ENV) or env.get(DIR_ENV)) and env.get(DIR_ENV) != str(path)):
        return ""  # the user's own fla settings: not ours to write into
    try:
        tuners = store_names()
        skipped = sum(len(objs) for objs in autotuners().values()) - len(tuners)
        triton = _version("triton")
        new = kernels = 0
        path.mkdir(parents=True, exist_ok=True)
        with locks.hold(path / LOCK, "the fla kernel config store", wait=True, timeout_s=LOCK_WAIT_S):
            for name, obj in sorted(tuners.items()):
                entries = {}
                for key, cfg in obj.cache.items():
                    jkey, jcfg = _json_key(key), _config(cfg)
                    if jkey is not None and jcfg is not None:
                        entries[key_hash(jkey)] = {"autotune_key": jkey, "config": jcfg}
                if not entries:
                    continue
                n = _add_entries(path / f"{name}.json", entries,
                                 {"kernel_name": name, "triton_version": triton, "default_config": None})
                new += n
                kernels += n > 0
    except (OSError, locks.LockBusy) as exc:
        return f"fla kernel configs: not recorded in {path}: {exc}"
    except Exception as exc:  # noqa: BLE001 - an odd object in fla's modules must not end a training step
        return f"fla kernel configs: not recorded in {path}: {type(exc).__name__}: {exc}"
    if not new:
        return ""
    extra = f"; {skipped} autotuners without a name of their own not recorded" if skipped else ""
    return f"fla kernel configs: recorded {new} tuned keys of {kernels} kernels in {path}{extra}"


__all__ = ["DIR_ENV", "MODE", "MODE_ENV", "adopt", "autotuners", "enable", "kernel_name", "key_hash", "record",
           "seed", "seed_dir", "store_dir", "store_names"]
