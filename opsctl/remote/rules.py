"""The rules both sides of the tmux boundary share: the event contract's check, a log's crash line, argv rules,
the ETA clock, tau tracking, the memory watch and slowdown; the wrapper notifies and the client shows by them.

Stdlib only, like base: shipped to hosts inside the agent's blob and the wrapper file.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import shlex
import statistics
from typing import Any

# A run is stalled when no heartbeat, phase or step came for max(STALL_FLOOR_S, STALL_FACTOR x median step time)
# (or the run's stall_after): the wrapper's notifications and the client's views (runstate) use this one rule.
STALL_FLOOR_S = 60.0
STALL_FACTOR = 10.0

MAX_EVENT_LINE = 1 << 20  # an events line longer than this is not an event (docs/events.md): skipped, counted
# The event contract's types (docs/events.md; dflash/telemetry.py COMMON and KINDS, copied here because this file
# runs alone on the host: tests/test_one_state.py keeps the two equal). Every reader of an events file on the host
# (the agent's status, its folds, follow, history; the wrapper's EventsWatch) skips a line that fails
# `event_problem`, and the client (dflash.telemetry.parse_event, complete=False) judges it the same.
_INT, _NUM, _STR, _NUL, _LIST, _DICT, _BOOL = "int", "float|int", "str", "None", "list", "dict", "bool"
EVENT_COMMON: dict[str, tuple[str, ...]] = {"v": (_INT,), "ts": (_NUM,), "kind": (_STR,), "run_id": (_STR,),
                                            "rank": (_INT,), "seq": (_INT,)}
EVENT_KINDS: dict[str, dict[str, tuple[str, ...]]] = {
    "run_start": {"config": (_DICT,), "versions": (_DICT,), "kernels": (_DICT,), "device": (_STR,),
                  "world_size": (_INT,), "roles": (_DICT,), "resumed_from": (_INT, _NUL), "pid": (_INT,),
                  "host": (_STR,), "total_steps": (_INT,)},
    "phase": {"phase": (_STR,)},
    "heartbeat": {"phase": (_STR,), "step": (_INT,), "rss_mb": (_NUM,), "gpu_mem_mb": (_NUM, _NUL)},
    "step": {"step": (_INT,), "epoch": (_INT,), "loss": (_NUM,), "acc": (_LIST,), "lr": (_NUM,),
             "grad_norm": (_NUM,), "tokens": (_INT,), "tokens_per_s": (_NUM,), "step_time_s": (_NUM,),
             "queue_depth": (_INT,), "queue_wait_s": (_NUM,), "recompiles": (_INT,), "total_steps": (_INT,)},
    "checkpoint": {"path": (_STR,), "step": (_INT,), "manifest_sha256": (_STR,), "bytes": (_INT,),
                   "seconds": (_NUM,)},
    "error": {"class": (_STR,), "message": (_STR,), "traceback": (_STR, _NUL), "fatal": (_BOOL,)},
    "run_end": {"reason": (_STR,), "exit_code": (_INT,), "step": (_INT,)},
    "eval": {"step": (_INT,), "tau": (_NUM, _NUL), "accept_by_position": (_LIST,), "ngram_tau": (_NUM, _NUL),
             "block_size": (_INT,), "sequences": (_INT,), "tokens": (_INT,), "seconds": (_NUM,)},
}
_FLOAT_WORDS = ("nan", "inf", "-inf")  # how the writer spells a non-finite float (JSON has none)
_FLOAT_WORD_KEYS = frozenset(("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s"))
_PY_TYPES: dict[str, tuple[type, ...]] = {_INT: (int,), _NUM: (float, int), _STR: (str,), _NUL: (type(None),),
                                          _LIST: (list,), _DICT: (dict,), _BOOL: (bool,)}


def _exact(names: tuple[str, ...]) -> frozenset[type]:
    """The exact types json.loads gives for a key's accepted types (bool is its own type: accepted only if named)."""
    return frozenset(t for n in names for t in _PY_TYPES[n])


# per kind: key -> (the exact types accepted, the contract's spelling of them), the common keys merged in: one dict
# lookup per key present (every reader on the host checks every line: 250,000 steps cost ~1 s, not ~8 s)
_SPECS: dict[str | None, dict[str, tuple[frozenset[type], str]]] = {
    kind: {k: (_exact(v), "/".join(v)) for k, v in {**EVENT_COMMON, **spec}.items()}
    for kind, spec in [*EVENT_KINDS.items(), (None, {})]}
_NUMBER_TYPES = (int, float, bool)  # dflash.telemetry's acc check: isinstance(a, (int, float)), bool included


def event_problem(ev: Any) -> str | None:
    """Why one events line (json.loads'ed) is no event by the contract's types, or None when it is one: the reader's
    check (dflash.telemetry.validate_event with complete=False): every key present of the right type, a missing key
    or a kind newer than this reader left to the reader's defaults. A line that fails it is skipped and counted."""
    if not isinstance(ev, dict):
        return "not a JSON object"
    kind = ev.get("kind")
    if type(kind) is not str:
        return "event: key 'kind' must be str" + ("" if "kind" in ev else " (it is missing)")
    spec = _SPECS.get(kind) or _SPECS[None]
    for key, value in ev.items():
        want = spec.get(key)
        if want is None or type(value) in want[0]:
            continue
        if key in _FLOAT_WORD_KEYS and value in _FLOAT_WORDS:
            continue
        if not any(isinstance(value, t) and not isinstance(value, bool) for t in want[0]):  # a subclass (not JSON's)
            where = "event" if key in EVENT_COMMON and key not in EVENT_KINDS.get(kind, {}) else kind
            return f"{where}: key {key!r} must be {want[1]}, got {type(value).__name__}"
    if kind == "step" and "acc" in ev and not all(type(a) in _NUMBER_TYPES or a in _FLOAT_WORDS for a in ev["acc"]):
        return "step: acc must be a list of numbers"
    if kind == "eval" and "accept_by_position" in ev and not all(
            a is None or type(a) in (int, float) for a in ev["accept_by_position"]):
        return "eval: accept_by_position must be a list of numbers (or null)"
    return None


# The last line of a Python traceback: `KeyboardInterrupt`, `RuntimeError: boom`, `torch.OutOfMemoryError: ...`.
_EXC_LINE = re.compile(r"[A-Za-z_][\w.]*(:.*)?$")


def traceback_from_lines(lines: list[str]) -> str | None:
    """The last Python traceback in a log: its header, the indented frames, and the exception line.

    stdout reaches the log through its own pipe and can land inside or after stderr's traceback, so other
    unindented lines between the header and the exception line are left out."""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last)"):
            return "\n".join(_traceback_at(lines, i))
    return None


def _traceback_at(lines: list[str], i: int) -> list[str]:
    out = [lines[i]]
    for line in lines[i + 1:]:
        if line and not line[0].isspace():
            if _EXC_LINE.match(line):
                out.append(line)
                break
            continue
        out.append(line)
    return out


# torchrun's own exception when a rank fails: it says that a rank failed, not why (the rank's own traceback, or the
# dflash CLI's one-line error, is earlier in the same log).
_LAUNCHER_ERROR = "torch.distributed.elastic."
# The one line a dflash command prints on a bad config/data/checkpoint before exiting 2 (no traceback): `dflash: ...`
# (train) or `dflash eval: ...`, possibly prefixed by torchrun's per-rank tag.
# The wrapper's own `opsctl: cannot start [...]: [Errno 2] ...` (a command that is not there) is read the same way.
_CLI_ERROR = re.compile(r"^(?:\[(?:default)?\d*\]?(?:rank\d+)?\]?:\s*)?(dflash(?: [a-z][a-z-]*)?: .+|opsctl: cannot "
                        r"start .+)$")
# How many last log lines a traceback-less failure's `dflash: ...` line is looked for in.
CLI_ERROR_TAIL = 20
# torchrun's `Root Cause (first observed failure)` block: the failed rank, its exit code, and for a signal its name.
_ROOT_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.*)$")


def crash_line(log: str, window: int = 256 << 10) -> str | None:
    """Why the attempt in `log` failed, in one line (None when the log does not say): the exception line of its
    last traceback; under torchrun, whose own ChildFailedError comes last, the failed rank's exception or the dflash
    CLI's error line before it, else torchrun's root cause (rank and exit code)."""
    try:
        with open(log, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - window))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = text.splitlines()
    launcher: tuple[int, str] | None = None
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last)"):
            last = _traceback_at(lines, i)[-1]
            if last[:1].isspace() or last.startswith("Traceback"):
                continue
            if not last.startswith(_LAUNCHER_ERROR):
                return _cli_error_after(lines, i) or last
            launcher = launcher or (i, last)
        elif launcher is not None and (m := _CLI_ERROR.match(lines[i])):
            return m.group(1)
    if launcher is None:
        # No traceback: a dflash command that refused its config/data/arguments printed one `dflash: ...` line and
        # exited 2. Only near the end (the wrapper's and the shell's lines may follow it), so an early line that
        # merely starts with `dflash: ` is never taken for why the run ended.
        tail = lines[-CLI_ERROR_TAIL:]
        end = next((j for j in range(len(tail) - 1, -1, -1) if _CLI_ERROR.match(tail[j])), None)
        if end is None:
            return None
        start = end  # a config with several problems prints one line each: the first, and how many follow
        while start > 0 and _CLI_ERROR.match(tail[start - 1]):
            start -= 1
        first = _CLI_ERROR.match(tail[start])
        assert first is not None
        more = end - start
        return first.group(1) + (f" (and {more} more: see the log)" if more else "")
    cause = torchrun_root_cause(lines[launcher[0]:])
    return f"{launcher[1].split(':')[0]}: {cause} (no traceback in the log)" if cause else launcher[1]


def torchrun_root_cause(lines: list[str]) -> str | None:
    """`rank 1: Signal 9 (SIGKILL) received by PID 42` / `rank 1: exited with code 3`: the `Root Cause (first
    observed failure)` block torchrun ends a failed node's log with (None without one)."""
    at = max((j for j, line in enumerate(lines) if "Root Cause" in line), default=None)
    if at is None:
        return None
    got: dict[str, str] = {}
    for line in lines[at + 1:at + 12]:
        if (m := _ROOT_FIELD.match(line)) and m.group(1) not in got:
            got[m.group(1)] = m.group(2).strip()
    if "rank" not in got:
        return None
    tb = got.get("traceback", "")
    code = (got.get("exitcode") or "?").split()[0]  # `3 (pid: 4242)`
    detail = tb if tb and not tb.startswith("To enable traceback") else f"exited with code {code}"
    return f"rank {got['rank'].split()[0]}: {detail}"


def _cli_error_after(lines: list[str], i: int) -> str | None:
    """A dflash CLI error line after line i (it ends the run; a traceback before it is an earlier, handled one)."""
    for line in reversed(lines[i:]):
        if m := _CLI_ERROR.match(line):
            return m.group(1)
    return None


_SHELLS = ("sh", "bash", "dash", "zsh")


def with_args(argv: list[str], extra: list[str]) -> list[str]:
    """The command with `extra` arguments appended. A `sh -c SCRIPT` command gets them quoted onto the script
    (appended after it they would become $0, $1 and never reach the program)."""
    if not extra:
        return list(argv)
    if len(argv) == 3 and os.path.basename(argv[0]) in _SHELLS and argv[1] == "-c":
        return [argv[0], "-c", argv[2] + " " + " ".join(shlex.quote(a) for a in extra)]
    return list(argv) + list(extra)


def resume_argv(argv: list[str], resume_args: list[str]) -> list[str]:
    """The argv a restart runs: the resume arguments appended, unless the command already carries them."""
    n = len(resume_args)
    if not n or any(argv[i:i + n] == resume_args for i in range(len(argv) - n + 1)):
        return list(argv)
    if len(argv) == 3 and os.path.basename(argv[0]) in _SHELLS and argv[1] == "-c":
        if " ".join(shlex.quote(a) for a in resume_args) in argv[2]:
            return list(argv)
    return with_args(argv, resume_args)


# -- tau: the drafter's serving acceptance length, from `eval` events (docs/events.md) --------------------------
# A tau_regression: the latest tau fell below the best so far by more than max(TAU_DROP_FRAC x best, TAU_DROP_MIN).
# 10 %: the run-to-run spread of tau on a fixed held-out set is a few %, and a 5 % dip after a learning-rate
# change is normal; 0.2 tokens: below that a drop is not worth waking anyone (tau is ~2-6 for useful drafters).
TAU_DROP_FRAC = 0.10
TAU_DROP_MIN = 0.2


def _tau_num(x: Any) -> float | None:
    """A finite number as float; None for null, NaN, inf, or anything else."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x in (float("inf"), float("-inf")):
        return None
    return float(x)


class EtaClock:
    """Wall seconds per training step of the current attempt: the one ETA rule of `status` (the agent folds every
    step event of the attempt into it and sends its state) and of `watch`/`launch` (their RunState folds the same
    events), so both show the same ETA at the same step.

    The wall clock between step events, not their `step_time_s`: that one times a step's compute alone, so a run
    whose data waits, evaluations and checkpoints take time finished far later than it promised. An exponential
    moving average (alpha 0.05: about the last 40 intervals) of each interval's seconds per step, each counted as at
    most CLIP times (at least 1/CLIP of) the average: one 10-minute checkpoint moves the ETA a few percent, a lasting
    change of speed still wins within a few dozen steps. Over an attempt's first WARMUP intervals the rate is their
    median instead: the first intervals of a run (compile, allocator, first evaluation) are often many times the
    steady one, and an average seeded with one of them took some 70 steps to come down. Until two step events
    came: the last `step_time_s`.

    The same clock gives the run's tokens/s (`tokens_per_s`): an average of each step's real tokens (its
    `tokens_per_s` x `step_time_s`, same ALPHA and CLIP) over the average wall seconds per step. A step's own
    `tokens_per_s` times its compute alone: the steps of a colocated run whose target ran ahead by the reservoir
    read several times the run's speed (217k against 51k tok/s at the end of the 4B-like run), a checkpoint step a
    fraction of it; status, watch and launch show this one rate instead."""

    ALPHA = 0.05
    CLIP = 3.0
    WARMUP = 20  # about 1 / ALPHA: after as many intervals the average has forgotten its seed

    def __init__(self) -> None:
        self.per_step: float | None = None  # the moving average, seconds per step
        self.fallback: float | None = None  # the last step_time_s, until an interval exists
        self.last: tuple[int, float] | None = None  # (step, ts) of the last step event
        self.warm: list[float] = []  # the first WARMUP intervals' seconds per step
        self.tokens: float | None = None  # the moving average of a step's real tokens

    def note(self, ev: dict[str, Any]) -> None:
        kind = ev.get("kind")
        if kind == "run_start":  # a new attempt (a resume, another host): its speed is its own
            self.__init__()  # type: ignore[misc]
            return
        step, ts = ev.get("step"), ev.get("ts")
        if kind != "step" or not isinstance(step, int) or not _finite(ts):
            return
        if _finite(ev.get("step_time_s")):
            self.fallback = float(ev["step_time_s"])
            if _finite(ev.get("tokens_per_s")) and ev["tokens_per_s"] >= 0 and ev["step_time_s"] > 0:
                n = float(ev["tokens_per_s"]) * float(ev["step_time_s"])
                if self.tokens is None:
                    self.tokens = n
                else:
                    if self.tokens > 0:
                        n = min(max(n, self.tokens / self.CLIP), self.tokens * self.CLIP)
                    self.tokens += self.ALPHA * (n - self.tokens)
        if self.last is not None and step > self.last[0] and ts >= self.last[1]:
            x = (float(ts) - self.last[1]) / (step - self.last[0])
            if len(self.warm) < self.WARMUP:
                self.warm.append(x)
                ordered = sorted(self.warm)
                mid = len(ordered) // 2
                self.per_step = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
            elif self.per_step is not None:
                if self.per_step > 0:
                    x = min(max(x, self.per_step / self.CLIP), self.per_step * self.CLIP)
                self.per_step += self.ALPHA * (x - self.per_step)
        self.last = (step, float(ts))

    def seconds_per_step(self) -> float | None:
        return self.per_step if self.per_step is not None else self.fallback

    def tokens_per_s(self) -> float | None:
        """Real tokens per wall second over the attempt's recent steps (None: no step yet)."""
        per_step = self.seconds_per_step()
        return None if self.tokens is None or not per_step or per_step <= 0 else self.tokens / per_step

    def eta(self, step: int, total_steps: int | None) -> float | None:
        """Seconds until `total_steps` from `step` (None: nothing to go by)."""
        rate = self.seconds_per_step()
        if not total_steps or rate is None:
            return None
        return max(0, total_steps - step) * rate

    def state(self) -> dict[str, Any]:
        """What the agent's `status` sends (its snapshot carries only the last steps, too few to fold again)."""
        return {"per_step": self.per_step, "fallback": self.fallback, "last": self.last, "warm": self.warm,
                "tokens": self.tokens}

    def load(self, st: dict[str, Any]) -> None:
        self.per_step = float(st["per_step"]) if _finite(st.get("per_step")) else None
        self.fallback = float(st["fallback"]) if _finite(st.get("fallback")) else None
        last = st.get("last")
        self.last = (int(last[0]), float(last[1])) if isinstance(last, (list, tuple)) and len(last) == 2 else None
        warm = st.get("warm")
        self.warm = [float(x) for x in warm if _finite(x)][: self.WARMUP] if isinstance(warm, list) else []
        self.tokens = float(st["tokens"]) if _finite(st.get("tokens")) else None  # absent in a fold saved before it


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class TauTrack:
    """The run's evaluations in step order, as resumes leave them: a `run_start` resumed from step S forgets the
    evaluations after S (a fresh start forgets them all), and an evaluation at step S replaces any at S or later,
    as the charts do with steps. status, history, the tau_regression alert and its notify all read this one rule."""

    def __init__(self) -> None:
        self.evals: list[dict[str, Any]] = []  # {step, tau, ngram_tau, tau_ci95, ts, ref}; ref: the caller's

    def note(self, ev: dict[str, Any], ref: Any = None) -> bool:
        """Fold one event (any kind; only run_start and eval count); True when the evaluations changed."""
        kind = ev.get("kind")
        if kind == "run_start":
            r = ev.get("resumed_from")
            keep = r if isinstance(r, int) and not isinstance(r, bool) else -1
            n = len(self.evals)
            while self.evals and self.evals[-1]["step"] > keep:
                self.evals.pop()
            return len(self.evals) != n
        step = ev.get("step")
        if kind != "eval" or not isinstance(step, int) or isinstance(step, bool):
            return False
        while self.evals and self.evals[-1]["step"] >= step:
            self.evals.pop()
        ci = ev.get("tau_ci95")
        ci = [_tau_num(x) for x in ci] if isinstance(ci, list) and len(ci) == 2 else None
        self.evals.append({"step": step, "tau": _tau_num(ev.get("tau")), "ngram_tau": _tau_num(ev.get("ngram_tau")),
                           "tau_ci95": ci if ci and None not in ci else None, "ts": ev.get("ts"), "ref": ref})
        return True

    def latest(self) -> dict[str, Any] | None:
        return self.evals[-1] if self.evals else None

    def best(self) -> dict[str, Any] | None:
        """The evaluation with the highest tau (the earliest of equals), None before any tau."""
        top: dict[str, Any] | None = None
        for e in self.evals:
            if e["tau"] is not None and (top is None or e["tau"] > top["tau"]):
                top = e
        return top

    def regression(self, frac: float | None = None, least: float | None = None) -> str | None:
        """The evidence when the latest tau is below the best by more than the margin, else None."""
        last, top = self.latest(), self.best()
        if last is None or top is None:
            return None
        return tau_regression(top["tau"], top["step"], last["tau"], last["step"], frac, least)


def tau_regression(best: float | None, best_step: int | None, now: float | None, now_step: int | None,
                   frac: float | None = None, least: float | None = None) -> str | None:
    """The one tau_regression rule (the wrapper's notify and the clients' alert): its evidence, quoting both
    evaluations, when `now` is below `best` by more than max(frac x best, least); None otherwise."""
    frac = TAU_DROP_FRAC if frac is None else float(frac)
    least = TAU_DROP_MIN if least is None else float(least)
    if best is None or now is None:
        return None
    drop = best - now
    margin = max(frac * best, least)
    if drop <= margin:
        return None
    return (f"best tau {best:.2f} at step {best_step}, now {now:.2f} at step {now_step} "
            f"(-{drop:.2f}, -{100 * drop / best:.0f} %; margin {margin:.2f}: {100 * frac:g} % of the best, "
            f"at least {least:g})")


# -- slowdown: a step event's `pace` (dflash/pace.py: the median of the attempt's last 100 step times over the fastest
# median of 100 it has held, the first taken once 5 minutes of training passed) at or past SLOW_FACTOR. 1.3: a fixed token budget's step time
# moves a few % with the batch's mix; a third slower for a hundred steps is a throttled or shared GPU, a degraded
# link, a starved data path, and on a week-long run it costs days.
SLOW_FACTOR = 1.3


def slowdown(pace: Any, ref_s: Any, step: Any) -> str | None:
    """The one slowdown rule (the wrapper's notify and the clients' alert): its evidence when the step event's
    pace is at or past SLOW_FACTOR, else None."""
    p, r = _tau_num(pace), _tau_num(ref_s)
    if p is None or r is None or p < SLOW_FACTOR:
        return None
    return (f"step time {p * r:.2f} s at step {step} (median of its last 100 steps), {p:.2f}x the {r:.2f} s this "
            f"attempt has held at its best (alert from {SLOW_FACTOR:g}x)")


# -- memory: a rank's heartbeats (docs/events.md) once MEM_SETTLE_S of training passed (loading, compiling and the
# first caches have grown memory by then). memory_growth: the median of the last MEM_WINDOW heartbeats of a figure
# (host RSS, GPU allocated, GPU reserved) more than max(MEM_GROWTH_FRAC, MEM_GROWTH_MIN_MB) above the median of its
# first MEM_WINDOW: a leak or fragmentation that ends a week-long run (medians: one spike is not growth).
# alloc_retries: the CUDA caching allocator retried (freed its whole cache, a device-wide sync, to find memory)
# within the last RETRY_WINDOW_S: memory at the card's limit or fragmented, where reserved memory cannot grow and
# growth sees nothing; none for that long ends it.
MEM_SETTLE_S = 600.0
MEM_WINDOW = 12  # heartbeats (a minute at the default heartbeat_s of 5)
MEM_GROWTH_FRAC = 0.2
MEM_GROWTH_MIN_MB = 2048.0
RETRY_WINDOW_S = 600.0
MEM_NAMES = {"rss_mb": "host RSS", "gpu_mem_mb": "GPU allocated", "gpu_reserved_mb": "GPU reserved"}


class MemoryWatch:
    """The memory rules over one attempt's events (the wrapper's notify and the clients' alerts use this one)."""

    def __init__(self) -> None:
        self.training_since: float | None = None
        # per (rank, heartbeat key): (baseline samples, recent samples); samples are (ts, step, MB)
        self.mem: dict[tuple[int, str], tuple[list[tuple[float, int, float]],
                                              collections.deque[tuple[float, int, float]]]] = {}
        # per rank: (ts, step, gpu_alloc_retries) from RETRY_WINDOW_S before its latest heartbeat on
        self.retries: dict[int, collections.deque[tuple[float, int, int]]] = {}

    def note(self, ev: dict[str, Any]) -> None:
        """Feed every event of the attempt in order (a run_start begins a new attempt: start a new MemoryWatch)."""
        kind, ts = ev.get("kind"), ev.get("ts")
        if not _finite(ts):
            return
        if self.training_since is None and (kind == "step" or (kind == "phase" and ev.get("phase") == "training")):
            self.training_since = float(ts)
        if kind != "heartbeat":
            return
        step, rank = ev.get("step"), ev.get("rank")
        if (self.training_since is None or float(ts) < self.training_since + MEM_SETTLE_S
                or not isinstance(step, int) or not isinstance(rank, int)):
            return
        count = ev.get("gpu_alloc_retries")
        if isinstance(count, int) and not isinstance(count, bool):
            seen = self.retries.setdefault(rank, collections.deque())
            if seen and count < seen[-1][2]:
                seen.clear()  # another process on this rank (its counter starts again)
            seen.append((float(ts), step, count))
            while len(seen) > 1 and seen[1][0] <= float(ts) - RETRY_WINDOW_S:
                seen.popleft()
        for key in MEM_NAMES:
            mb = ev.get(key)
            if not _finite(mb):
                continue
            base, recent = self.mem.setdefault((rank, key), ([], collections.deque(maxlen=MEM_WINDOW)))
            if len(base) < MEM_WINDOW:
                base.append((float(ts), step, float(mb)))
            recent.append((float(ts), step, float(mb)))

    def growth(self) -> str | None:
        grew = []
        for (rank, key), (base, recent) in sorted(self.mem.items()):
            if len(base) < MEM_WINDOW or len(recent) < MEM_WINDOW or recent[0][0] <= base[-1][0]:
                continue  # the two windows must not overlap
            b = statistics.median(x[2] for x in base)
            now = statistics.median(x[2] for x in recent)
            if now - b < max(MEM_GROWTH_FRAC * b, MEM_GROWTH_MIN_MB):
                continue
            hours = max(recent[-1][0] - base[0][0], 1.0) / 3600
            grew.append(f"rank {rank} {MEM_NAMES[key]} {b / 1024:.1f} GiB at step {base[0][1]} -> "
                        f"{now / 1024:.1f} GiB at step {recent[-1][1]} (+{(now - b) / 1024:.1f} GiB in {hours:.1f} h)")
        return "; ".join(grew) or None

    def alloc_retries(self) -> str | None:
        found = []
        for rank, seen in sorted(self.retries.items()):
            if len(seen) < 2 or seen[-1][2] <= seen[0][2]:
                continue
            (t0, s0, c0), (t1, s1, c1) = seen[0], seen[-1]
            found.append(f"rank {rank}: {c1 - c0} allocator retries in {(t1 - t0) / 60:.0f} min (steps {s0}-{s1}; "
                         f"{c1} since its process started)")
        if not found:
            return None
        return ("; ".join(found) + ": the CUDA caching allocator had to free its whole cache (a device-wide sync) to "
                "find memory: fragmentation or memory at the card's limit, often the step before an OOM; "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True usually ends it")

    def last_step(self) -> int | None:
        steps = [recent[-1][1] for _, recent in self.mem.values() if recent]
        return max(steps) if steps else None

    def state(self) -> dict[str, Any]:
        """JSON for status's saved fold (opsctl/remote/follow.py fold_save): a later status goes on from it."""
        return {"since": self.training_since,
                "mem": [[rank, key, base, list(recent)] for (rank, key), (base, recent) in self.mem.items()],
                "retries": [[rank, list(seen)] for rank, seen in self.retries.items()]}

    def load(self, st: dict[str, Any]) -> None:
        self.training_since = st["since"]
        self.mem = {(int(rank), str(key)): ([tuple(x) for x in base],  # type: ignore[misc]
                                            collections.deque((tuple(x) for x in recent), maxlen=MEM_WINDOW))
                    for rank, key, base, recent in st["mem"]}
        self.retries = {int(rank): collections.deque(tuple(x) for x in seen)  # type: ignore[misc]
                        for rank, seen in st["retries"]}


def event_object(raw: bytes, length: int) -> Any:
    """One events line as an event, or why it is none (a str): not JSON, not an object, or a key of the wrong type
    (event_problem, the contract's reader check). Every reader here (follow, status and its fold, the watch fold,
    launch's verdicts, the previous attempt) takes its lines from this one function, so a line of the wrong types
    (`"step": "six"`, a run_start with `"resumed_from": "x"`) is skipped and counted alike by all of them."""
    if length > MAX_EVENT_LINE:
        return f"longer than {MAX_EVENT_LINE} bytes (MAX_EVENT_LINE)"
    try:
        ev = json.loads(raw)
    except ValueError:
        return "not JSON"
    if not isinstance(ev, dict):
        return "not a JSON object"
    why = event_problem(ev)
    return ev if why is None else why
