"""Warm starts of the compiled drafter step: torch's FX graph and AOT autograd caches on, and torch's mega-cache
artifacts saved in OUT/compile_cache, so a restart whose inductor cache was wiped still skips most of the compile.

The artifacts are keyed like opsctl's keyed inductor cache (torch/triton/python versions, the device, a hash of what
shapes the compiled graph); a file with another key, unreadable or corrupt, is ignored with a reason: a cold start.
A copy is also kept per host and key under $DFLASH_CACHE/compile-cache/ (the newest HOST_KEEP keys), so a *new* run
of a graph this host compiled before (another learning rate, other data, a new --out) starts warm too.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

DIR_NAME = "compile_cache"
BLOB = "artifacts.bin"
META = "artifacts.json"
FORMAT = 1
# Set to 0 to start cold on purpose (e.g. opsctl's --fresh-cache, or to measure the cold compile): nothing is loaded,
# and the first step still saves fresh artifacts.
ENV_OFF = "DFLASH_WARM_START"
# Set to 0 to keep compiled artifacts per run only (no copy under $DFLASH_CACHE/compile-cache, none loaded from it).
HOST_ENV = "DFLASH_HOST_COMPILE_CACHE"
HOST_DIR = "compile-cache"
HOST_KEEP = 8  # keys kept per host (27B-like artifacts are ~33 MiB each); the least recently saved go first
HOST_LOCK_WAIT_S = 30.0  # another run writing its copy takes a second; a stopped holder must not hang a step


def warm_start_off() -> bool:
    """DFLASH_WARM_START=0: start cold on purpose (nothing loaded or restored; the first step still saves)."""
    return os.environ.get(ENV_OFF, "").strip().lower() in ("0", "off", "false", "no")


def cache_dir(out: Path) -> Path:
    return Path(out) / DIR_NAME


def enable_caches() -> dict[str, bool]:
    """Turn on the local FX graph cache and AOT autograd cache and return what is in effect.

    Both default to on in open-source torch 2.11-2.13, but an environment (TORCHINDUCTOR_FX_GRAPH_CACHE=0,
    TORCHINDUCTOR_AUTOGRAD_CACHE=0, TORCHINDUCTOR_FORCE_DISABLE_CACHES=1) can turn them off, and then every restart
    compiles from nothing and mega-cache artifacts have nothing to fill: the run must say so, not be slow silently.
    An environment override wins over the assignment here (torch's own precedence), which is what its user asked for.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    disabled = bool(getattr(inductor_config, "force_disable_caches", False))
    return {"fx_graph_cache": bool(inductor_config.fx_graph_cache) and not disabled,
            "autograd_cache": bool(functorch_config.enable_autograd_cache) and not disabled}


def _triton_version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("triton")
    except Exception:  # noqa: BLE001 - absent on CPU machines
        return "none"


def device_name(device: torch.device) -> str:
    """What compiled code depends on: the GPU model and compute capability, or the CPU architecture."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"{torch.cuda.get_device_name(index)} sm{major}{minor}"
    return f"{device.type} {platform.machine()}"


def artifact_key(device: torch.device, graph: dict[str, Any]) -> dict[str, str]:
    """The key of a run's artifacts: versions, device, and a hash of the graph-shaping settings in `graph`
    (drafter shape, token budget, compile backend, ...; not the learning rate or the step count)."""
    text = json.dumps(graph, sort_keys=True, default=str)
    return {"torch": torch.__version__, "triton": _triton_version(), "python": platform.python_version(),
            "device": device_name(device), "graph": hashlib.sha256(text.encode()).hexdigest()[:16]}


@dataclass
class WarmStart:
    """What happened to the saved artifacts at this start; `reason` is the human line (also in the event)."""

    used: bool
    reason: str
    path: str | None = None
    bytes: int | None = None
    load_s: float | None = None
    artifacts: dict[str, int] | None = None
    sha256: str | None = None

    def event(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "sha256"}

    def summary(self) -> str:
        """A few words for the `compiling` phase's detail (status, watch, launch show it): where the compile comes
        from, so a person knows whether to expect seconds or minutes."""
        if not self.used:
            return "cold: no usable saved artifacts" if not self.reason.startswith("not loaded") else \
                f"cold: {self.reason.removeprefix('not loaded: ')}"
        source = "this host's copy" if "this host's copy" in self.reason else "the run's saved artifacts"
        return f"warm: {source}"


def _counts(info: Any) -> dict[str, int]:
    """CacheInfo's artifact lists (inductor, aot_autograd, autotune, pgo, precompile) as counts."""
    found = {}
    for name in ("inductor", "aot_autograd", "autotune", "pgo", "precompile"):
        items = getattr(info, f"{name}_artifacts", None)
        if isinstance(items, list) and items:
            found[name] = len(items)
    return found


def key_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`name old -> new` for each key part that differs (the reason a saved file is ignored)."""
    return [f"{k} {old.get(k, 'none')} -> {new.get(k, 'none')}" for k in sorted(set(old) | set(new))
            if str(old.get(k)) != str(new.get(k))]


def host_dir(key: dict[str, str]) -> Path | None:
    """This host's copy of the artifacts of `key` (None when DFLASH_HOST_COMPILE_CACHE=0)."""
    if os.environ.get(HOST_ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    from dflash.cache_entry import cache_home

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_home() / HOST_DIR / digest


def load(out: Path, key: dict[str, str], caches: dict[str, bool], host: Path | None = None) -> WarmStart:
    """Load OUT's artifacts into torch's caches when their key matches, else this host's copy of the same key (an
    earlier run of the same graph); never raises (a cold start is always safe)."""
    if warm_start_off():
        return WarmStart(False, f"not loaded: {ENV_OFF}={os.environ[ENV_OFF]}")
    if not all(caches.values()):
        off = ", ".join(k for k, v in caches.items() if not v)
        return WarmStart(False, f"not loaded: torch's {off} is disabled in this environment")
    run = _load_dir(cache_dir(out), key)
    if run.used or host is None or not (host / META).exists():
        return run
    got = _load_dir(host, key)
    if got.used:
        got.reason += f" (this host's copy of the same graph; the run's own: {run.reason})"
        return got
    run.reason += f"; this host's copy {got.reason}"
    return run


def _load_dir(d: Path, key: dict[str, str]) -> WarmStart:
    meta_path, blob_path = d / META, d / BLOB
    if not meta_path.exists():
        return WarmStart(False, f"no saved artifacts in {d} (none saved yet by this run, or removed)")
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("key"), dict):
            raise ValueError("no key in it")
    except (OSError, ValueError) as exc:
        return WarmStart(False, f"ignored {meta_path}: unreadable ({exc})", str(blob_path))
    if meta.get("format") != FORMAT:
        return WarmStart(False, f"ignored {blob_path}: format {meta.get('format')} is not {FORMAT}", str(blob_path))
    diff = key_changes(meta["key"], key)
    if diff:
        return WarmStart(False, f"ignored {blob_path}: key changed ({'; '.join(diff)})", str(blob_path))
    try:
        data = blob_path.read_bytes()
    except OSError as exc:
        return WarmStart(False, f"ignored {blob_path}: unreadable ({exc.strerror or exc})", str(blob_path))
    sha = hashlib.sha256(data).hexdigest()
    if len(data) != meta.get("bytes") or sha != meta.get("sha256"):
        return WarmStart(False, f"ignored {blob_path}: corrupt ({len(data)} bytes, sha256 {sha[:12]}; saved "
                                f"{meta.get('bytes')} bytes, sha256 {str(meta.get('sha256'))[:12]})",
                         str(blob_path), len(data))
    t0 = time.perf_counter()
    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as exc:  # noqa: BLE001 - whatever torch raises on bad bytes, the run starts cold instead
        return WarmStart(False, f"ignored {blob_path}: torch could not load it ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:200] if str(exc) else ''})", str(blob_path), len(data))
    load_s = round(time.perf_counter() - t0, 3)
    if info is None:  # torch logs a warning and returns None for bytes it cannot unpickle
        return WarmStart(False, f"ignored {blob_path}: torch could not deserialize it", str(blob_path), len(data))
    counts = _counts(info)
    what = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no artifacts"
    return WarmStart(True, f"loaded {what} from {blob_path} ({len(data) / 2**20:.1f} MiB, {load_s:.2f} s)",
                     str(blob_path), len(data), load_s, counts, sha)


def write_with_key(d: Path, blob_name: str, data: bytes, meta_name: str, meta: dict[str, Any]) -> None:
    """The blob, then its key file (with the blob's sha256), each atomically (temp + fsync + rename): a crash in
    between leaves a key that does not match the blob, which the loader ignores."""
    d.mkdir(parents=True, exist_ok=True)
    for name, payload in ((blob_name, data), (meta_name, (json.dumps(meta, indent=1) + "\n").encode())):
        tmp = d / f".{name}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, d / name)


def _saved_sha(d: Path) -> str | None:
    try:
        meta = json.loads((d / META).read_text())
    except (OSError, ValueError):
        return None
    return meta.get("sha256") if isinstance(meta, dict) else None


def save(out: Path, key: dict[str, str], previous_sha: str | None = None, host: Path | None = None) -> str:
    """Write what this process compiled or loaded from its caches to OUT/compile_cache, and to this host's copy of
    the key when given (atomic: temp + rename, the blob before its key file, so a crash in between leaves a sha256
    mismatch, which load() ignores; the host copy under its flock: several runs may save one key at once).
    `previous_sha`: what OUT already holds. Returns the human line; never raises (losing the warm start must not
    lose the run)."""
    d = cache_dir(out)
    try:
        result = torch.compiler.save_cache_artifacts()
    except Exception as exc:  # noqa: BLE001 - see docstring
        return f"compile artifacts not saved: torch failed to serialize them ({type(exc).__name__}: {exc})"
    if result is None:
        return "compile artifacts not saved: torch recorded none (caches disabled?)"
    data, info = result
    sha = hashlib.sha256(data).hexdigest()
    meta = {"format": FORMAT, "key": key, "bytes": len(data), "sha256": sha, "artifacts": _counts(info),
            "saved": time.time()}
    what = ", ".join(f"{n} {k}" for k, n in meta["artifacts"].items())
    if sha == previous_sha:
        line = f"compile artifacts unchanged ({d / BLOB})"
    else:
        try:
            write_with_key(d, BLOB, data, META, meta)
            line = f"compile artifacts saved: {what} ({len(data) / 2**20:.1f} MiB) to {d / BLOB}"
        except OSError as exc:
            line = f"compile artifacts not saved: {exc}"
    if host is not None:
        line += f"; {_save_host(host, data, meta)}"
    return line


def _save_host(host: Path, data: bytes, meta: dict[str, Any]) -> str:
    from dflash import locks

    try:
        host.mkdir(parents=True, exist_ok=True)
        with locks.hold(host / ".lock", "this host's compile cache entry", wait=True, timeout_s=HOST_LOCK_WAIT_S):
            if _saved_sha(host) == meta["sha256"]:
                os.utime(host)  # still in use: the last to be pruned
                return f"this host's copy unchanged ({host})"
            write_with_key(host, BLOB, data, META, meta)
            os.utime(host)
        pruned = prune_host(host.parent, HOST_KEEP)
    except (OSError, locks.LockBusy) as exc:
        return f"this host's copy not saved: {exc}"
    return f"this host's copy saved in {host}" + (f" ({pruned} older keys removed)" if pruned else "")


def prune_host(root: Path, keep: int) -> int:
    """Keep the `keep` most recently saved key directories of this host's compile cache; returns how many went.
    Only directories named like a key digest directly under `root` are ever removed."""
    import shutil

    keys = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and len(p.name) == 16
            and all(c in "0123456789abcdef" for c in p.name)]
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:  # removed meanwhile by another run's prune
            return 0.0

    keys.sort(key=mtime, reverse=True)
    gone = 0
    for p in keys[keep:]:
        shutil.rmtree(p, ignore_errors=True)
        gone += 1
    return gone


def counters() -> dict[str, int]:
    """This process's cache hits and misses so far (torch's own counters): proof of what the warm start saved."""
    from torch._dynamo.utils import counters as c

    return {"fxgraph_hit": int(c["inductor"].get("fxgraph_cache_hit", 0)),
            "fxgraph_miss": int(c["inductor"].get("fxgraph_cache_miss", 0)),
            "aotautograd_hit": int(c["aot_autograd"].get("autograd_cache_hit", 0)),
            "aotautograd_miss": int(c["aot_autograd"].get("autograd_cache_miss", 0))}
