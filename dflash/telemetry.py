"""Telemetry events (JSON lines) as defined in docs/events.md: the one contract between dflash and opsctl.

Standard library only, so the ops client and tests can import it without torch.
"""

from __future__ import annotations

import json
import math
import os
import resource
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
MAX_LINE_BYTES = 60 * 1024

COMMON: dict[str, tuple[type, ...]] = {
    "v": (int,),
    "ts": (float, int),
    "kind": (str,),
    "run_id": (str,),
    "rank": (int,),
    "seq": (int,),
}

_NUM = (float, int)
_OPT_STR = (str, type(None))
_OPT_NUM = (float, int, type(None))

# kind -> required key -> accepted types (optional keys are documented but not required).
KINDS: dict[str, dict[str, tuple[type, ...]]] = {
    "run_start": {
        "config": (dict,),
        "versions": (dict,),
        "kernels": (dict,),
        "device": (str,),
        "world_size": (int,),
        "roles": (dict,),
        "resumed_from": (int, type(None)),
        "pid": (int,),
        "host": (str,),
        "total_steps": (int,),
    },
    "phase": {"phase": (str,)},
    "heartbeat": {"phase": (str,), "step": (int,), "rss_mb": _NUM, "gpu_mem_mb": _OPT_NUM},
    "step": {
        "step": (int,),
        "epoch": (int,),
        "loss": _NUM,
        "acc": (list,),
        "lr": _NUM,
        "grad_norm": _NUM,
        "tokens": (int,),
        "tokens_per_s": _NUM,
        "step_time_s": _NUM,
        "queue_depth": (int,),
        "queue_wait_s": _NUM,
        "recompiles": (int,),
        "total_steps": (int,),
    },
    "checkpoint": {
        "path": (str,),
        "step": (int,),
        "manifest_sha256": (str,),
        "bytes": (int,),
        "seconds": _NUM,
    },
    "error": {"class": (str,), "message": (str,), "traceback": _OPT_STR, "fatal": (bool,)},
    "run_end": {"reason": (str,), "exit_code": (int,), "step": (int,)},
    "eval": {
        "step": (int,),
        "tau": _OPT_NUM,
        "accept_by_position": (list,),
        "ngram_tau": _OPT_NUM,
        "block_size": (int,),
        "sequences": (int,),
        "tokens": (int,),
        "seconds": _NUM,
    },
}

PHASES = ("loading_target", "building_drafter", "preparing_data", "compiling", "training", "saving", "evaluating",
          "finishing")
ERROR_CLASSES = ("oom", "nccl", "nan", "exception", "slow_kernel", "uncompiled_flex", "recompile", "config",
                 "disk_full")
END_REASONS = ("completed", "signal", "error", "refused")
# Where run_start's `config` holds the drafter reservoir's capacity (the bound on `step.queue_depth`).
RESERVOIR_CAPACITY = ("data", "reservoir")


class EventError(ValueError):
    """An event line that breaks the contract in docs/events.md."""


def _check_types(obj: dict[str, Any], spec: dict[str, tuple[type, ...]], where: str, complete: bool = True) -> None:
    for key, types in spec.items():
        if key not in obj:
            if not complete:
                continue
            raise EventError(f"{where}: missing key {key!r}")
        value = obj[key]
        # bool is an int subclass; only accept it where bool is named.
        if isinstance(value, bool) and bool not in types:
            raise EventError(f"{where}: key {key!r} must be {'/'.join(t.__name__ for t in types)}, got bool")
        if not isinstance(value, types):
            raise EventError(
                f"{where}: key {key!r} must be {'/'.join(t.__name__ for t in types)}, got {type(value).__name__}"
            )


def validate_event(obj: Any, complete: bool = True) -> dict[str, Any]:
    """Raise EventError unless obj is a valid event; return it unchanged.

    `complete=False` is the reader's check (opsctl): every key present has the contract's type, but a key left out
    or a kind newer than this reader is left to the reader's defaults, so a reader never breaks on a value of the
    wrong type and never refuses a writer that is a version ahead."""
    if not isinstance(obj, dict):
        raise EventError(f"event must be a JSON object, got {type(obj).__name__}")
    if not complete:
        if not isinstance(obj.get("kind"), str):
            raise EventError("event: key 'kind' must be str" + ("" if "kind" in obj else " (it is missing)"))
        _check_types(obj, COMMON, "event", complete=False)
        if obj["kind"] in KINDS:
            _check_types(obj, KINDS[obj["kind"]], obj["kind"], complete=False)
        _check_lists(obj, obj["kind"])
        return obj
    _check_types(obj, COMMON, "event")
    kind = obj["kind"]
    if kind not in KINDS:
        raise EventError(f"unknown event kind {kind!r}")
    if obj["v"] != SCHEMA_VERSION:
        raise EventError(f"{kind}: schema version {obj['v']} is not {SCHEMA_VERSION}")
    _check_types(obj, KINDS[kind], kind)
    if kind in ("phase", "heartbeat") and obj["phase"] not in PHASES:
        raise EventError(f"{kind}: unknown phase {obj['phase']!r}")
    if kind == "error" and obj["class"] not in ERROR_CLASSES:
        raise EventError(f"error: unknown class {obj['class']!r}")
    if kind == "run_end" and obj["reason"] not in END_REASONS:
        raise EventError(f"run_end: unknown reason {obj['reason']!r}")
    _check_lists(obj, kind)
    return obj


def _check_lists(obj: dict[str, Any], kind: str) -> None:
    """The elements of the contract's lists of numbers (present ones: the types are checked before)."""
    if kind == "step" and not all(isinstance(a, (int, float)) for a in obj.get("acc", ())):
        raise EventError("step: acc must be a list of numbers")
    if kind == "eval" and not all(a is None or (isinstance(a, (int, float)) and not isinstance(a, bool))
                                  for a in obj.get("accept_by_position", ())):
        raise EventError("eval: accept_by_position must be a list of numbers (or null)")


def _json_safe(value: Any) -> Any:
    """NaN/inf are not JSON; encode them as strings the reader turns back into floats."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


_FLOAT_WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_FLOAT_KEYS = ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s")


def parse_line(line: str | bytes) -> dict[str, Any]:
    """Parse and validate one line; raise EventError on anything else."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EventError(f"not JSON: {exc}") from exc
    return parse_event(obj)


def parse_event(obj: Any, complete: bool = True) -> dict[str, Any]:
    """One event as json.loads returned it (a reader that parsed the line itself, e.g. opsctl's agent): its
    "nan"/"inf" words made floats again, then validated (validate_event); raise EventError unless it fits."""
    if isinstance(obj, dict):
        for key in _FLOAT_KEYS:
            word = obj.get(key)
            if isinstance(word, str) and word in _FLOAT_WORDS:  # a list or dict there is the validator's to refuse
                obj[key] = _FLOAT_WORDS[word]
        if isinstance(obj.get("acc"), list):
            obj["acc"] = [_FLOAT_WORDS.get(a, a) if isinstance(a, str) else a for a in obj["acc"]]
    return validate_event(obj, complete)


class EventWriter:
    """Appends contract events to one file; safe for several processes (one O_APPEND write per line)."""

    def __init__(self, path: str | os.PathLike[str], run_id: str, rank: int = 0, truncate: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
        self._fd = os.open(self.path, flags, 0o644)
        self.run_id = run_id
        self.rank = rank
        self._seq = 0
        self._lock = threading.Lock()  # the heartbeat thread shares the writer

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            event = {"v": SCHEMA_VERSION, "ts": time.time(), "kind": kind, "run_id": self.run_id,
                     "rank": self.rank, "seq": self._seq, **fields}
            validate_event(event)
            data = _encode(event)
            os.write(self._fd, data)
            self._seq += 1
            return event

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> EventWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _encode(event: dict[str, Any]) -> bytes:
    data = (json.dumps(_json_safe(event), separators=(",", ":")) + "\n").encode()
    if len(data) <= MAX_LINE_BYTES:
        return data
    # Too long: cut the traceback (keep its end, where the exception is) or the config.
    event = dict(event)
    if isinstance(event.get("traceback"), str):
        excess = len(data) - MAX_LINE_BYTES + 64
        event["traceback"] = "...(cut)...\n" + event["traceback"][excess:]
    if "config" in event:
        event["config"] = {"_cut": "config too large for one event line"}
    data = (json.dumps(_json_safe(event), separators=(",", ":")) + "\n").encode()
    return data[: MAX_LINE_BYTES - 1] + b"\n" if len(data) > MAX_LINE_BYTES else data


@dataclass
class ReadStats:
    lines: int = 0
    invalid: int = 0
    errors: list[str] = field(default_factory=list)


def read_events(path: str | os.PathLike[str], stats: ReadStats | None = None) -> Iterator[dict[str, Any]]:
    """Yield every valid event of a file; an unterminated last line and invalid lines are skipped (and counted)."""
    stats = stats if stats is not None else ReadStats()
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            stats.lines += 1
            try:
                yield parse_line(raw)
            except EventError as exc:
                stats.invalid += 1
                if len(stats.errors) < 20:
                    stats.errors.append(str(exc))


def rss_mb() -> float:
    """Current resident set size in MiB (Linux /proc; falls back to peak RSS)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Heartbeat:
    """Background thread that writes `heartbeat` events; it touches no GPU work, only reads counters."""

    def __init__(self, writer: EventWriter, state: Callable[[], dict[str, Any]], interval_s: float = 5.0) -> None:
        self._writer = writer
        self._state = state
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def beat(self) -> None:
        state = {"phase": "loading_target", "step": 0, "gpu_mem_mb": None, **self._state()}
        self._writer.emit("heartbeat", rss_mb=round(rss_mb(), 1), **state)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except (OSError, EventError):
                pass  # a full disk must not kill training; the missing heartbeats are the signal
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval + 1)


def stderr_line(line: str) -> None:
    """One line on stderr in one write(): print() writes the text and its newline in two, so ranks of a torchrun
    sharing one log could glue two lines together (CI saw it), and opsctl reads a crash's reason from such lines."""
    global last_stderr_line
    last_stderr_line = line
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


last_stderr_line: str | None = None  # the last stderr_line: a command's error line, for torchrun's report (cli.main)


def hostname() -> str:
    return socket.gethostname()
