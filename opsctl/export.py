"""`opsctl export HOST|GROUP RUN --tensorboard DIR`: a run's events.jsonl (with --follow, NVML samples) as TensorBoard
scalars, written with tensorboard's own event-file writer so TensorBoard and `wandb sync --sync-tensorboard` read them.
"""

from __future__ import annotations

import heapq
import json
import math
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.text import Text

from opsctl.channel import ChannelLost, run_args, stream_agent
from opsctl.commands import EXIT_OK, EXIT_TRANSPORT, EXIT_USAGE, Ctx, OpsError, _follow_reconnecting, preflight
from opsctl.config import HostConfig, RunConfig
from opsctl.group import GroupRun
from opsctl.watch import bad_events_text

STATE_FILE = "opsctl-export.json"  # in DIR: where the last export stopped, so the next one adds only new events
# step event key -> TensorBoard tag (docs/events.md `step`)
STEP_TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "epoch": "train/epoch",
    "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "tokens": "perf/tokens",
    "queue_depth": "queue/depth", "queue_wait_s": "queue/wait_s", "recompiles": "compile/recompiles",
    "pace": "perf/pace",  # once the attempt's pace settled (dflash/pace.py): 1.3 or more is a `slowdown`
}
# per rank: rank{R}/... (group: node{N}/rank{R}/...)
HEARTBEAT_TAGS = {"rss_mb": "rss_mb", "gpu_mem_mb": "gpu_mem_mb", "gpu_reserved_mb": "gpu_reserved_mb",
                  "gpu_alloc_retries": "gpu_alloc_retries"}
GPU_TAGS = {"util": "util_pct", "mem_used_mb": "mem_used_mb", "power_w": "power_w", "temp_c": "temp_c",
            "sm_clock_mhz": "sm_clock_mhz"}  # per GPU: gpu{I}/... (group: node{N}/gpu{I}/...)


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)  # NaN/inf are kept: TensorBoard draws them, and a NaN loss is worth seeing


class TensorBoardExport:
    """Turns telemetry events and agent GPU samples into scalars of one TensorBoard event file.

    A `run_start` with `resumed_from` writes a SessionLog START at the first step of the new attempt: TensorBoard's
    documented restart rule then drops the steps of the crashed attempt after its checkpoint, so a curve never
    shows two values for one step."""

    def __init__(self, logdir: Path, last_step: int = 0) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._logdir = logdir
        self._file_writer = EventFileWriter
        self._opened: Any = None  # the event file is made at the first scalar: an export with nothing new makes none
        self.step = last_step  # the x of samples that carry no step of their own (heartbeats, GPU samples)
        self.scalars = 0
        self.steps = 0
        self.restarts = 0
        self.evals = 0

    @property
    def _writer(self) -> Any:
        if self._opened is None:
            self._opened = self._file_writer(str(self._logdir), flush_secs=5, filename_suffix=".opsctl")
        return self._opened

    @property
    def wrote(self) -> bool:
        """Whether this export made an event file (it does only once there is something to put in it)."""
        return self._opened is not None

    def _scalars(self, values: list[tuple[str, float]], step: int, wall_time: float) -> None:
        """One event record for all the scalars of one moment (a step's 15, an evaluation's, a GPU sample's): a
        Summary holds any number of values, and TensorBoard's reader takes each as its own point. One record per
        scalar made a week-long run's export ~15x more records, each checksummed by tensorboard's pure-Python CRC."""
        if not values:
            return
        value = self._summary_pb2.Summary.Value
        summary = self._summary_pb2.Summary(value=[value(tag=tag, simple_value=v) for tag, v in values])
        self._writer.add_event(self._event_pb2.Event(wall_time=wall_time, step=step, summary=summary))
        self.scalars += len(values)

    def event(self, ev: dict[str, Any], prefix: str = "", run_level: bool = True) -> None:
        """One telemetry event (docs/events.md); kinds without numbers are skipped. `prefix` goes before the
        per-rank tags (a group's node: its GPU indices restart at 0, so node{N}/ keeps its tags apart); without
        `run_level` only heartbeats count: the run's own events come from the node with global rank 0."""
        kind = ev.get("kind")
        if not run_level and kind != "heartbeat":
            return
        ts = _number(ev.get("ts")) or time.time()
        if kind == "run_start":
            resumed = ev.get("resumed_from")
            if isinstance(resumed, int) and not isinstance(resumed, bool):
                start = self._event_pb2.SessionLog(status=self._event_pb2.SessionLog.START,
                                                   msg=f"resumed from step {resumed}")
                self._writer.add_event(self._event_pb2.Event(wall_time=ts, step=resumed + 1, session_log=start))
                self.step = resumed
                self.restarts += 1
        elif kind == "step" and isinstance(ev.get("step"), int):
            step = int(ev["step"])
            self.step = step
            self.steps += 1
            values = [(tag, v) for key, tag in STEP_TAGS.items() if (v := _number(ev.get(key))) is not None]
            acc = [a for a in (ev.get("acc") or []) if _number(a) is not None]
            values += [(f"acc/pos{i}", float(a)) for i, a in enumerate(acc, start=1)]
            finite = [float(a) for a in acc if math.isfinite(float(a))]
            if finite:
                values.append(("acc/mean", sum(finite) / len(finite)))
            self._scalars(values, step, ts)
        elif kind == "heartbeat":
            rank = ev.get("rank", 0)
            step = ev.get("step") if isinstance(ev.get("step"), int) else self.step
            self._scalars([(f"{prefix}rank{rank}/{name}", v) for key, name in HEARTBEAT_TAGS.items()
                           if (v := _number(ev.get(key))) is not None], step, ts)
        elif kind == "eval" and isinstance(ev.get("step"), int):
            self._eval(ev, ts)
        elif kind == "checkpoint":
            step = ev.get("step") if isinstance(ev.get("step"), int) else self.step
            self._scalars([(tag, v * scale) for key, tag, scale in (
                ("seconds", "checkpoint/seconds", 1.0), ("bytes", "checkpoint/gib", 2.0**-30),
                ("free_bytes", "checkpoint/free_gib", 2.0**-30)) if (v := _number(ev.get(key))) is not None], step, ts)

    def _eval(self, ev: dict[str, Any], ts: float) -> None:
        """An in-training evaluation at the step it evaluated: eval/tau, eval/ngram_tau (prompt lookup's on the same
        text), eval/accept_pos{k} for block positions k = 1..B-1 and eval/seconds. A null (nothing verified) is
        left out, never written as 0."""
        values = [(tag, v) for key, tag in (("tau", "eval/tau"), ("ngram_tau", "eval/ngram_tau"),
                                             ("seconds", "eval/seconds")) if (v := _number(ev.get(key))) is not None]
        values += [(f"eval/accept_pos{k}", v) for k, a in enumerate(ev.get("accept_by_position") or [], start=1)
                   if (v := _number(a)) is not None]
        self._scalars(values, int(ev["step"]), ts)
        self.evals += 1

    def gpu_sample(self, msg: dict[str, Any], prefix: str = "") -> None:
        """One agent `gpu` message (NVML, every GPU): scalars at the run's current step (in a group: node 0's)."""
        ts = _number(msg.get("ts")) or time.time()
        self._scalars([(f"{prefix}gpu{g['index']}/{name}", v) for g in msg.get("gpus") or []
                       if isinstance(g.get("index"), int)
                       for key, name in GPU_TAGS.items() if (v := _number(g.get(key))) is not None], self.step, ts)

    def flush(self) -> None:
        if self._opened is not None:
            self._opened.flush()

    def close(self) -> None:
        if self._opened is not None:
            self._opened.close()


@dataclass
class Source:
    """One events file of an export: a (host, run) pair, the prefix of its per-rank and per-GPU tags, and where the
    export stopped reading it. A host's run is one source; a group run is one per node."""

    host: HostConfig
    run: RunConfig
    prefix: str = ""  # "node{N}/" for a group's node: its GPU indices and tags never collide with another node's
    run_level: bool = True  # its run_start / step / checkpoint events are the run's (it holds global rank 0)
    key: str | None = None  # its offset's key under the state file's "nodes" (None: the top-level events_offset)
    offset: int = 0

    @property
    def name(self) -> str:
        return f"{self.host.name}:{self.run.name}"


def _exported(ident: dict[str, Any]) -> str:
    """What a state file (or the export asked for) is the export of, as the messages say it."""
    if ident.get("group") is not None:
        return f"group {ident['group']}/{ident.get('run')}"
    return f"{ident.get('host')}:{ident.get('run')}"


def _load_state(path: Path, ident: dict[str, str], sources: list[Source]) -> dict[str, Any]:
    """The state of the export DIR holds, the sources' offsets set from it; a DIR that holds another run's export
    (a host's run or a group's) is refused: its offsets would skip or repeat this run's events."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise OpsError(f"{path}: unreadable export state ({exc}); remove it to export everything again",
                       EXIT_USAGE) from None
    if not isinstance(state, dict):
        raise OpsError(f"{path}: unreadable export state (a JSON {type(state).__name__}, not an object); remove it "
                       "to export everything again", EXIT_USAGE)
    if {k: state.get(k) for k in ("host", "group", "run")} != {"host": None, "group": None, **ident}:
        raise OpsError(f"{path.parent} holds the export of {_exported(state)}, not {_exported(ident)}; give each run "
                       "its own directory (tensorboard --logdir PARENT shows them side by side)", EXIT_USAGE)
    for s in sources:
        if s.key is None:
            s.offset = int(state.get("events_offset", 0))
            continue
        node = (state.get("nodes") or {}).get(s.key) or {}
        if node and node.get("host") != s.host.name:
            raise OpsError(f"{path.parent}: node {s.key} of {_exported(ident)} was exported from {node.get('host')}, "
                           f"now it is {s.host.name} (the group's members changed); export into a new directory",
                           EXIT_USAGE)
        s.offset = int(node.get("events_offset", 0))
    return state


def _save_state(path: Path, ident: dict[str, str], sources: list[Source], last_step: int) -> None:
    state: dict[str, Any] = {**ident, "last_step": last_step}
    for s in sources:
        if s.key is None:
            state["events_offset"] = s.offset
        else:
            state.setdefault("nodes", {})[s.key] = {"host": s.host.name, "events_offset": s.offset}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def _snapshots(ctx: Ctx, host: HostConfig, run: RunConfig, offset: int) -> Iterator[dict[str, Any]]:
    """The whole events file from `offset`, in `follow --once` snapshots (the agent reads at most 4 MiB a call),
    until one brings nothing new."""
    while True:
        t = ctx.transport(host)
        got = False
        try:
            args = run_args(run, log_offset=-1, tail=0, events_offset=offset, once=True, gpu_interval=0)
            for m in stream_agent(t, host, "follow", args):
                if m.get("t") == "event":
                    got = True
                    offset = int(m["end"])
                yield m
        except ChannelLost as exc:
            raise OpsError(f"{host.name}: {exc}", EXIT_TRANSPORT) from None
        finally:
            t.close()
        if not got:
            return


def _timed(i: int, messages: Iterable[dict[str, Any]]) -> Iterator[tuple[float, int, dict[str, Any]]]:
    """A source's messages keyed by the latest event time so far (never decreasing), for merging the nodes."""
    ts = -math.inf
    for m in messages:
        if m.get("t") == "event":
            ts = max(ts, _number(m["event"].get("ts")) or ts)
        yield ts, i, m


def _backlog(ctx: Ctx, sources: list[Source]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Every source's events so far, the nodes' merged in time order: a resumed attempt's SessionLog START (from
    node 0) then drops the other nodes' samples of the crashed attempt too, and keeps those of the new one."""
    streams = [_timed(i, _snapshots(ctx, s.host, s.run, s.offset)) for i, s in enumerate(sources)]
    for _, i, m in heapq.merge(*streams, key=lambda x: (x[0], x[1])):
        yield i, m


def _follow_all(ctx: Ctx, sources: list[Source]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Every source's new events and GPU samples as they come, reconnecting like `logs -f`, until each run ended
    (a group: every node's); the nodes are followed at once, each by a thread, their messages by arrival."""
    def follow(s: Source) -> Iterator[dict[str, Any]]:
        return _follow_reconnecting(ctx, s.host, s.run, {"log_offset": -1, "tail": 0, "events_offset": s.offset},
                                    events=True)

    if len(sources) == 1:
        yield from ((0, m) for m in follow(sources[0]))
        return
    q: queue.Queue[tuple[int, dict[str, Any] | BaseException | None]] = queue.Queue()

    def pump(i: int, s: Source) -> None:
        try:
            for m in follow(s):
                q.put((i, m))
        except BaseException as exc:  # noqa: BLE001 - said by the main thread, which owns the exit code
            q.put((i, exc))
            return
        q.put((i, None))

    for i, s in enumerate(sources):
        threading.Thread(target=pump, args=(i, s), daemon=True, name=f"export-{s.name}").start()
    left = len(sources)
    while left:
        i, m = q.get()
        if m is None:
            left -= 1
        elif isinstance(m, BaseException):
            raise m
        else:
            yield i, m


def export_sources(ctx: Ctx, sources: list[Source], logdir: str, ident: dict[str, str], follow: bool) -> int:
    """The export of one run from its sources (one (host, run) pair, or a group's nodes) into one event file
    stream in DIR, resumable through DIR's state file; exit 0 once the events so far are written."""
    what = _exported(ident)
    out = Path(logdir).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OpsError(f"cannot create {out}: {exc}", EXIT_USAGE) from None
    state_path = out / STATE_FILE
    state = _load_state(state_path, ident, sources)
    for s in sources:
        t = ctx.transport(s.host)
        try:
            preflight(ctx, s.host, t)
        finally:
            t.close()
    tb = TensorBoardExport(out, last_step=int(state.get("last_step", 0)))
    started = time.monotonic()

    def save() -> None:
        tb.flush()
        _save_state(state_path, ident, sources, tb.step)

    # a week-long run's backlog takes a while (200,000 steps: ~16 s): on a terminal a spinner counts what is written
    status = ctx.err.status(f"exporting {what} ...") if ctx.err.is_terminal else None

    bad: list[Any] = [0, None]  # events lines skipped (the agent's bad_event): how many, the last one's where and why

    def take(messages: Iterable[tuple[int, dict[str, Any]]]) -> None:
        last_save = last_shown = time.monotonic()
        for i, m in messages:
            if status is not None and time.monotonic() - last_shown > 0.2:
                status.update(f"exporting {what}: {tb.steps:,} steps, {tb.scalars:,} scalars (step {tb.step:,})")
                last_shown = time.monotonic()
            s, kind = sources[i], m.get("t")
            if kind == "event":
                tb.event(m["event"], prefix=s.prefix, run_level=s.run_level)
                s.offset = int(m["end"])
            elif kind == "bad_event":  # a line that breaks the contract: skipped by every reader, and said
                bad[:] = [bad[0] + 1, f"{s.name}: events file offset {m.get('off')}: {m.get('error')}"]
                s.offset = int(m["end"])
            elif kind == "gpu":
                tb.gpu_sample(m, prefix=s.prefix)
            elif kind == "log_reset" and m.get("file") == "events":
                s.offset = 0
                ctx.err.print(Text(f"{s.name}: events.jsonl was {m.get('reason')}; exporting it again from the "
                                   "start", style="yellow"), soft_wrap=True)
            elif kind == "error":
                ctx.err.print(Text(f"agent ({s.host.name}): {m.get('message')}", style="red"), soft_wrap=True)
            if time.monotonic() - last_save > 5:  # --follow for days: the state on disk stays near the data
                save()
                last_save = time.monotonic()

    try:
        if status is not None:
            status.start()
        take(_backlog(ctx, sources))
        if status is not None:
            status.stop()
        if follow:
            nodes = f" ({len(sources)} nodes)" if len(sources) > 1 else ""
            ctx.err.print(f"{tb.steps} steps so far; following {what}{nodes} (Ctrl-C stops; the export stays "
                          "readable)", soft_wrap=True)
            take(_follow_all(ctx, sources))
    except KeyboardInterrupt:
        pass
    finally:
        if status is not None:
            status.stop()
        save()
        tb.close()
    if bad[0]:
        ctx.err.print(Text(f"{bad_events_text(bad[0])} (last: {bad[1]}): they break the event contract "
                           "(docs/events.md) and are not exported", style="yellow"), soft_wrap=True)
    if not tb.wrote:
        ctx.err.print(f"nothing new to export from {what} since the last export into {out.resolve()}: no event file "
                      "written", soft_wrap=True)
        return EXIT_OK
    # Text: a run named `m` on host `box` is `box:m:`, which rich's markup would draw as an emoji
    ctx.err.print(Text(f"exported {what}: {tb.steps} steps, " + (f"{tb.evals} evaluations, " if tb.evals else "")
                       + f"{tb.scalars} scalars"
                       + (f", {tb.restarts} resumed attempt(s)" if tb.restarts else "")
                       + f" into {out.resolve()} in {time.monotonic() - started:.1f} s; view: tensorboard --logdir "
                       f"{out.resolve()}"), soft_wrap=True)
    return EXIT_OK


def cmd_export(ctx: Ctx, host_name: str, run_name: str, logdir: str, follow: bool = False) -> int:
    """`opsctl export HOST RUN --tensorboard DIR [--follow]`: exit 0 once the events so far are written."""
    host, run = ctx.resolve(host_name, run_name)
    assert run is not None
    return export_sources(ctx, [Source(host, run)], logdir, {"host": host.name, "run": run.name}, follow)


def cmd_group_export(ctx: Ctx, gr: GroupRun, logdir: str, follow: bool = False) -> int:
    """`opsctl export GROUP RUN --tensorboard DIR [--follow]`: the training scalars from the node that holds global
    rank 0 (it alone writes run_start, step and checkpoint events), every node's heartbeats and GPU samples under
    node{N}/, into one event file stream."""
    sources = [Source(n.host, n.run, prefix=f"node{n.index}/", run_level=0 in gr.ranks(n.index), key=str(n.index))
               for n in gr.nodes]
    return export_sources(ctx, sources, logdir, {"group": gr.group, "run": gr.name}, follow)
