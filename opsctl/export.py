"""`opsctl export HOST RUN --tensorboard DIR`: a run's events.jsonl (and, with --follow, NVML samples) as TensorBoard
scalars, written with tensorboard's own event-file writer so TensorBoard and `wandb sync --sync-tensorboard` read them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rich.text import Text

from opsctl.channel import ChannelLost, run_args, stream_agent
from opsctl.commands import EXIT_OK, EXIT_TRANSPORT, EXIT_USAGE, Ctx, OpsError, _follow_reconnecting, preflight
from opsctl.config import HostConfig, RunConfig

STATE_FILE = "opsctl-export.json"  # in DIR: where the last export stopped, so the next one adds only new events
# step event key -> TensorBoard tag (docs/events.md `step`)
STEP_TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "epoch": "train/epoch",
    "tokens_per_s": "perf/tokens_per_s", "step_time_s": "perf/step_time_s", "tokens": "perf/tokens",
    "queue_depth": "queue/depth", "queue_wait_s": "queue/wait_s", "recompiles": "compile/recompiles",
}
HEARTBEAT_TAGS = {"rss_mb": "rss_mb", "gpu_mem_mb": "gpu_mem_mb"}  # per rank: rank{R}/...
GPU_TAGS = {"util": "util_pct", "mem_used_mb": "mem_used_mb", "power_w": "power_w", "temp_c": "temp_c",
            "sm_clock_mhz": "sm_clock_mhz"}  # per GPU: gpu{I}/...


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
        self._writer = EventFileWriter(str(logdir), flush_secs=5, filename_suffix=".opsctl")
        self.step = last_step  # the x of samples that carry no step of their own (heartbeats, GPU samples)
        self.scalars = 0
        self.steps = 0
        self.restarts = 0

    def _scalar(self, tag: str, value: float, step: int, wall_time: float) -> None:
        summary = self._summary_pb2.Summary(value=[self._summary_pb2.Summary.Value(tag=tag, simple_value=value)])
        self._writer.add_event(self._event_pb2.Event(wall_time=wall_time, step=step, summary=summary))
        self.scalars += 1

    def event(self, ev: dict[str, Any]) -> None:
        """One telemetry event (docs/events.md); kinds without numbers are skipped."""
        kind = ev.get("kind")
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
            for key, tag in STEP_TAGS.items():
                value = _number(ev.get(key))
                if value is not None:
                    self._scalar(tag, value, step, ts)
            acc = [a for a in (ev.get("acc") or []) if _number(a) is not None]
            for i, a in enumerate(acc, start=1):
                self._scalar(f"acc/pos{i}", float(a), step, ts)
            finite = [float(a) for a in acc if math.isfinite(float(a))]
            if finite:
                self._scalar("acc/mean", sum(finite) / len(finite), step, ts)
        elif kind == "heartbeat":
            rank = ev.get("rank", 0)
            step = ev.get("step") if isinstance(ev.get("step"), int) else self.step
            for key, name in HEARTBEAT_TAGS.items():
                value = _number(ev.get(key))
                if value is not None:
                    self._scalar(f"rank{rank}/{name}", value, step, ts)
        elif kind == "checkpoint":
            step = ev.get("step") if isinstance(ev.get("step"), int) else self.step
            for key, tag, scale in (("seconds", "checkpoint/seconds", 1.0), ("bytes", "checkpoint/gib", 2.0**-30)):
                value = _number(ev.get(key))
                if value is not None:
                    self._scalar(tag, value * scale, step, ts)

    def gpu_sample(self, msg: dict[str, Any]) -> None:
        """One agent `gpu` message (NVML, every GPU): scalars at the run's current step."""
        ts = _number(msg.get("ts")) or time.time()
        for g in msg.get("gpus") or []:
            idx = g.get("index")
            if not isinstance(idx, int):
                continue
            for key, name in GPU_TAGS.items():
                value = _number(g.get(key))
                if value is not None:
                    self._scalar(f"gpu{idx}/{name}", value, self.step, ts)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _load_state(path: Path, host: str, run: str) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise OpsError(f"{path}: unreadable export state ({exc}); remove it to export everything again",
                       EXIT_USAGE) from None
    if (state.get("host"), state.get("run")) != (host, run):
        raise OpsError(f"{path.parent} holds the export of {state.get('host')}:{state.get('run')}, not {host}:{run}; "
                       "give each run its own directory (tensorboard --logdir PARENT shows them side by side)",
                       EXIT_USAGE)
    return state


def _save_state(path: Path, state: dict[str, Any]) -> None:
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


def cmd_export(ctx: Ctx, host_name: str, run_name: str, logdir: str, follow: bool = False) -> int:
    """`opsctl export HOST RUN --tensorboard DIR [--follow]`: exit 0 once the events so far are written."""
    host, run = ctx.resolve(host_name, run_name)
    assert run is not None
    out = Path(logdir).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OpsError(f"cannot create {out}: {exc}", EXIT_USAGE) from None
    state_path = out / STATE_FILE
    state = _load_state(state_path, host.name, run.name)
    offset = int(state.get("events_offset", 0))
    t = ctx.transport(host)
    try:
        preflight(ctx, host, t)
    finally:
        t.close()
    tb = TensorBoardExport(out, last_step=int(state.get("last_step", 0)))
    started = time.monotonic()

    def save() -> None:
        tb.flush()
        _save_state(state_path, {"host": host.name, "run": run.name, "events_offset": offset, "last_step": tb.step})

    def take(messages: Iterable[dict[str, Any]]) -> None:
        nonlocal offset
        last_save = time.monotonic()
        for m in messages:
            kind = m.get("t")
            if kind == "event":
                tb.event(m["event"])
                offset = int(m["end"])
            elif kind == "gpu":
                tb.gpu_sample(m)
            elif kind == "log_reset" and m.get("file") == "events":
                offset = 0
                ctx.err.print(Text(f"{run.name}: events.jsonl was {m.get('reason')}; exporting it again from the "
                                   "start", style="yellow"), soft_wrap=True)
            elif kind == "error":
                ctx.err.print(Text(f"agent: {m.get('message')}", style="red"), soft_wrap=True)
            if time.monotonic() - last_save > 5:  # --follow for days: the state on disk stays near the data
                save()
                last_save = time.monotonic()

    try:
        take(_snapshots(ctx, host, run, offset))
        if follow:
            ctx.err.print(f"{tb.steps} steps so far; following {host.name}:{run.name} (Ctrl-C stops; the export "
                          "stays readable)", soft_wrap=True)
            take(_follow_reconnecting(ctx, host, run, {"log_offset": -1, "tail": 0, "events_offset": offset},
                                      events=True))
    except KeyboardInterrupt:
        pass
    finally:
        save()
        tb.close()
    ctx.err.print(f"exported {host.name}:{run.name}: {tb.steps} steps, {tb.scalars} scalars"
                  + (f", {tb.restarts} resumed attempt(s)" if tb.restarts else "")
                  + f" into {out.resolve()} in {time.monotonic() - started:.1f} s; view: tensorboard --logdir "
                  f"{out.resolve()}", soft_wrap=True)
    return EXIT_OK
