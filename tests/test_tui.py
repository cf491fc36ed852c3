"""`opsctl watch`: the Textual dashboard driven by recorded agent streams (Pilot and snapshot tests), plus --plain/--once.

The clock is injected (the agent's clock at the end of each recording) so ages, stall verdicts and snapshots are fixed.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from opsctl.plain import run_plain, snapshot_once
from opsctl.tui import WatchApp, replay_main, watch_main
from opsctl.watch import RecordedSource, SourceWorker, WatchSource, record, stall_after_of
from opsctl.widgets import (
    SEV_ERROR,
    SEV_WARNING,
    AlertsPanel,
    ConfirmScreen,
    GpuPanel,
    LogPane,
    RunsBar,
    RunSummary,
    spark,
)

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import REPO, opsctl, script_run, tiny_run  # noqa: E402

STREAMS = Path(__file__).parent / "fixtures" / "streams"
SIZE = (120, 40)


def last_ts(name: str) -> float:
    return max(json.loads(line)["ts"] for line in (STREAMS / f"{name}.jsonl").read_text().splitlines())


def recorded(name: str, **kw: Any) -> RecordedSource:
    return RecordedSource(STREAMS / f"{name}.jsonl", label=f"h200:{name}", **kw)


def app_for(*names: str, after_s: float = 2.0, **kw: Any) -> WatchApp:
    clock_at = max(last_ts(n) for n in names) + after_s
    return WatchApp([recorded(n) for n in names], clock=lambda: clock_at, **kw)


async def settle(pilot: Pilot[Any], timeout_s: float = 10.0) -> None:
    """Wait until every recording is replayed and folded in, then let one more frame render."""
    app = pilot.app
    assert isinstance(app, WatchApp)
    deadline = time.monotonic() + timeout_s
    while not app.replay_done():
        assert time.monotonic() < deadline, "replay did not finish"
        await pilot.pause(0.02)
    app.tick()
    await pilot.pause()


def text_of(app: WatchApp, widget: type) -> str:
    return str(app.query_one(widget).content)


# -- Pilot tests -------------------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_training_stream_shows_state_numbers_gpus_and_no_alerts() -> None:
    app = app_for("training")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        summary = text_of(app, RunSummary)
        assert "TRAINING" in summary
        assert "step 40/1,000 (4%)  epoch 0" in summary
        assert "loss 3.6152" in summary
        # the run's rate: ~49.2k real tokens a step, steps 1.5 s apart in the recording; the last step's own beside it
        rate = re.search(r"tokens/s ([\d,]+) avg \(last 33,393\)", summary)
        assert rate and float(rate[1].replace(",", "")) == pytest.approx(49_185 / 1.5, rel=0.01), summary
        assert "heartbeat 2s ago" in summary
        assert "ETA 24m" in summary or "ETA 23m" in summary
        assert text_of(app, AlertsPanel) == "no alerts"
        gpus = app.query_one(GpuPanel).render().plain.splitlines()
        assert gpus[0].split() == ["GPU", "util", "memory", "power", "temp", "SM/mem", "MHz", "processes"]
        assert gpus[1].split()[:2] == ["0", "97%"] and gpus[2].split()[:2] == ["1", "91%"]
        assert "60.2/140G" in gpus[1] and "1980/3201" in gpus[1]
        assert "31337 59.6G run" in gpus[1] and "31338 22.9G" in gpus[2]  # the run's own pid is marked
        model = app.models[0]
        loss = model.series["loss"]
        assert loss.steps == list(range(1, 41)) and loss.values[0] > loss.values[-1]
        assert len(model.gpu_hist[0]["util"]) == 48
        # Following: the last line of the log is on screen.
        pane = app.query_one(LogPane)
        assert pane.follow and int(pane.scroll_y) == pane.max_scroll_y
        assert pane.lines[-1].text.startswith("step    40")


@pytest.mark.anyio
async def test_followers_started_before_the_app_show_what_its_own_would() -> None:
    """tui.watch_main starts the workers before it imports Textual and hands them over: nothing that arrived before
    the app mounted is lost, and the screen is the one the app's own workers give."""
    clock_at = last_ts("training") + 2.0
    sources = [recorded("training")]
    early = [SourceWorker(s).start() for s in sources]
    deadline = time.monotonic() + 10
    while not early[0].ended.is_set():  # the whole recording queued before the app exists
        assert time.monotonic() < deadline
        time.sleep(0.02)
    shown = []
    for app in (WatchApp(sources, clock=lambda: clock_at, followers=early), app_for("training")):
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            shown.append((text_of(app, RunSummary), app.models[0].series["loss"].steps, app.models[0].lines_total))
    assert shown[0] == shown[1] and shown[0][1] == list(range(1, 41)) and shown[0][2] > 0, shown
    with pytest.raises(ValueError, match="one SourceWorker per source"):
        WatchApp([recorded("training")], followers=early)  # workers of other sources


@pytest.mark.anyio
async def test_real_h200_recording_replays_to_a_finished_run_with_its_gpu() -> None:
    # Recorded on the H200 device machine (scripts/record_stream.py, docs/gpu-checks.md): the tiny run with fla +
    # causal-conv1d kernels and compiled flex attention, NVML sampled at 1 Hz by the agent.
    msgs = [json.loads(line) for line in (STREAMS / "h200_tiny.jsonl").read_text().splitlines()]
    peak = max(g["mem_used_mb"] for m in msgs if m["t"] == "gpu" for g in m["gpus"])
    holders = {p["pid"] for m in msgs if m["t"] == "gpu" for g in m["gpus"] for p in g["procs"]}
    app = app_for("h200_tiny")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        summary = text_of(app, RunSummary)
        assert "FINISHED" in summary and "step 120/120" in summary
        model = app.models[0]
        assert len(model.gpu_hist[0]["util"]) > 30
        assert peak > 1000 and holders  # the run really held GPU memory while it trained
        alerts = text_of(app, AlertsPanel)
        assert "slow" not in alerts.lower()  # fla and causal_conv1d were bound: no fallback alert
        assert app.query_one(GpuPanel).render().plain.splitlines()[1].split()[0] == "0"


@pytest.mark.anyio
async def test_loading_stream_shows_progress_i_of_n() -> None:
    app = app_for("loading")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert "LOADING 5/8" in text_of(app, RunsBar)
        assert "phase loading_target 5/8" in text_of(app, RunSummary)


@pytest.mark.anyio
async def test_stalled_stream_raises_stalled_and_gpu_idle_alerts_with_evidence() -> None:
    app = app_for("stalled", after_s=0.0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        alerts = text_of(app, AlertsPanel)
        assert "run stalled" in alerts
        assert "no heartbeat or step for 120 s (stall_after 60 s); last seen in training, step 12" in alerts
        assert "GPU idle while training" not in alerts  # stalled is not "training"; the stall alert covers it
        assert "STALLED" in text_of(app, RunsBar) and "⚠1" in text_of(app, RunsBar)


@pytest.mark.anyio
async def test_configured_stall_after_of_the_source_is_used() -> None:
    # 2 s after the loading recording's last heartbeat: with hosts.yaml `stall_after: 0.5` that is a stall.
    src = recorded("loading")
    src.stall_after_s = 0.5  # type: ignore[attr-defined]
    clock_at = last_ts("loading") + 2
    app = WatchApp([src], clock=lambda: clock_at)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert "STALLED" in text_of(app, RunsBar)
        assert "no heartbeat or step for 2 s (stall_after 0.5 s)" in text_of(app, AlertsPanel)
    assert stall_after_of(recorded("loading")) is None


@pytest.mark.anyio
async def test_crashed_stream_alert_quotes_the_oom_and_log_highlights_traceback() -> None:
    app = app_for("crashed")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        alerts = text_of(app, AlertsPanel)
        assert "run crashed" in alerts
        assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.74 GiB" in alerts
        assert "exit code 1" in alerts
        pane = app.query_one(LogPane)
        tb = [ln for ln in pane.lines if ln.text.startswith("Traceback")]
        assert len(tb) == 1 and tb[0].sev == SEV_ERROR
        # The traceback line is drawn with the Traceback highlight (white on red).
        row = next(y for y in range(pane.size.height)
                   if pane.lines[int(pane.scroll_y) + y].text.startswith("Traceback"))
        strip = pane.render_line(row)
        styles = {str(seg.style) for seg in strip if "Traceback" in seg.text}
        assert any("on red" in s for s in styles), styles


@pytest.mark.anyio
async def test_kill_asks_first_and_calls_the_source_only_on_yes() -> None:
    app = app_for("training")
    source = app.sources[0]
    assert isinstance(source, RecordedSource)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("k")
        assert isinstance(app.screen, ConfirmScreen)
        assert "kill h200:training?" in app.screen.question and "pid 31337" in app.screen.question
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.pause(0.1)
        assert source.actions == [] and not app.models[0].state.killed_by_us
        await pilot.press("k")
        await pilot.click("#yes")
        for _ in range(250):
            if source.actions:
                break
            await pilot.pause(0.02)
        assert source.actions == ["kill"]
        assert app.models[0].state.killed_by_us  # a following run_end by signal reads as "killed"
        await pilot.press("c")
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert source.actions == ["kill"]
        await pilot.press("c", "y")
        for _ in range(250):
            if len(source.actions) == 2:
                break
            await pilot.pause(0.02)
        assert source.actions == ["kill", "clean"]


@pytest.mark.anyio
async def test_tab_switches_runs_and_each_keeps_its_own_log() -> None:
    app = app_for("training", "crashed")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        bar = text_of(app, RunsBar)
        assert "▶ h200:crashed" in bar and "TRAINING" in bar  # it opens on the crashed run
        assert "h200:crashed" in text_of(app, RunSummary)
        assert app.query_one(LogPane).lines is app.models[1].log
        assert "run crashed" in text_of(app, AlertsPanel)
        await pilot.press("tab")
        await pilot.pause()
        assert app.current == 0
        assert "h200:training" in text_of(app, RunSummary)
        assert app.query_one(LogPane).lines is app.models[0].log
        await pilot.press("tab")
        assert app.current == 1


class HangingSource:
    """A host whose SSH connect never returns (the real failure this guards against): messages() blocks forever."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.release = threading.Event()

    def messages(self) -> Iterator[dict[str, Any]]:
        self.release.wait()
        return iter(())

    def kill(self) -> None: ...

    def clean(self) -> None: ...

    def reconnect(self) -> None: ...


class DroppingSource:
    """A link that drops once, like a closed SSH channel: yields the first half, raises, then resumes after reconnect.

    It resumes after the last message delivered, as the agent's `follow` does from the last offsets.
    """

    finite = True  # the end of the recording is final; only the exception is a lost link

    def __init__(self, path: Path, label: str) -> None:
        self.label = label
        self.msgs = [json.loads(x) for x in path.read_text().splitlines()]
        self.pos = 0
        self.reconnects = 0
        self.dropped = False
        # The test opens the gate once it saw the lost link: a recovery faster than the UI's next look (a loaded
        # machine's scheduling) would otherwise hide the alert it checks.
        self.resume = threading.Event()

    def messages(self) -> Iterator[dict[str, Any]]:
        while self.pos < len(self.msgs):
            if not self.dropped and self.pos == len(self.msgs) // 2:
                self.dropped = True
                raise ConnectionResetError("Socket is closed")
            msg = self.msgs[self.pos]
            self.pos += 1
            yield msg

    def kill(self) -> None: ...

    def clean(self) -> None: ...

    def reconnect(self) -> None:
        self.reconnects += 1
        self.resume.wait(timeout=120)  # the worker's thread, as a real reconnect's handshake is


@pytest.mark.anyio
async def test_a_hanging_host_does_not_freeze_the_others_or_the_ui() -> None:
    hanging = HangingSource("dead:run")
    assert isinstance(hanging, WatchSource)
    clock_at = last_ts("training") + 2
    app = WatchApp([hanging, recorded("training")], clock=lambda: clock_at)
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + 10
        while not app.followers[1].ended.is_set() or app.followers[1].pending():
            assert time.monotonic() < deadline
            await pilot.pause(0.02)
        ticks = app.ticks
        deadline = time.monotonic() + 10  # a loaded machine may starve the loop for a while; a frozen one never ticks
        while app.ticks < ticks + 2:  # the batch loop keeps running
            assert time.monotonic() < deadline, (ticks, app.ticks)
            await pilot.pause(0.05)
        bar = text_of(app, RunsBar)
        # never ABSENT (that says the host answered): nobody has answered yet
        assert "dead:run  CONNECTING" in bar and "h200:training  TRAINING" in bar
        assert "dead:run" in text_of(app, RunSummary) and "link connecting" in text_of(app, RunSummary)
        await pilot.press("tab")
        assert "step 40/1,000" in text_of(app, RunSummary)
    hanging.release.set()


@pytest.mark.anyio
async def test_link_loss_is_alerted_then_recovers_without_losing_or_repeating_messages() -> None:
    source = DroppingSource(STREAMS / "training.jsonl", "h200:flaky")
    clock_at = last_ts("training") + 2
    app = WatchApp([source], clock=lambda: clock_at, backoff=(0.3,))
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + 60
        while "SSH link lost" not in text_of(app, AlertsPanel):
            assert time.monotonic() < deadline, text_of(app, AlertsPanel)
            await pilot.pause(0.02)
        assert "ConnectionResetError: Socket is closed" in text_of(app, AlertsPanel)
        source.resume.set()
        await settle(pilot)
        assert source.reconnects == 1
        assert text_of(app, AlertsPanel) == "no alerts"
        model = app.models[0]
        assert model.lines_total == sum(1 for m in source.msgs if m["t"] == "log")
        assert [ln.seq for ln in model.log] == list(range(model.lines_total))
        assert "step 40/1,000" in text_of(app, RunSummary)


@pytest.mark.anyio
async def test_reconnect_key_restarts_an_ended_stream() -> None:
    app = app_for("loading")
    source = app.sources[0]
    assert isinstance(source, RecordedSource)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        lines = app.models[0].lines_total
        await pilot.press("r")
        deadline = time.monotonic() + 10
        while app.models[0].lines_total < 2 * lines:
            assert time.monotonic() < deadline
            await pilot.pause(0.02)
        assert source.actions == ["reconnect"]


@pytest.mark.anyio
async def test_chatty_log_overflow_is_dropped_and_counted_never_silently() -> None:
    class Chatty:
        label = "h:chatty"
        finite = True

        def messages(self) -> Iterator[dict[str, Any]]:
            for i in range(5000):
                yield {"t": "log", "ts": 0.0, "off": i, "end": i + 1, "line": f"line {i}"}

        def kill(self) -> None: ...

        def clean(self) -> None: ...

        def reconnect(self) -> None: ...

    app = WatchApp([Chatty()], clock=lambda: 0.0, tick_s=3600, inbox_lines=1000)
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + 10
        while not app.followers[0].ended.is_set():
            assert time.monotonic() < deadline
            await pilot.pause(0.02)
        app.tick()
        model = app.models[0]
        # The first tick (at mount) may have drained a few early lines; every line is either shown or counted.
        assert model.dropped + model.lines_total == 5000
        assert model.dropped >= 3000 and model.lines_total >= 1000
        assert model.log[-1].text == "line 4999"  # the newest lines are kept
        assert f"{model.lines_total:,} lines, {model.dropped:,} dropped" in text_of(app, RunSummary)


@pytest.mark.anyio
async def test_log_pane_pauses_on_scroll_searches_and_filters() -> None:
    app = app_for("training")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        pane = app.query_one(LogPane)
        model = app.models[0]
        await pilot.press("pageup")
        assert not pane.follow
        await pilot.pause(0.3)  # let the scroll land (it may be animated) and a few batches pass
        assert not pane.follow and int(pane.scroll_y) < pane.max_scroll_y
        top = pane.lines[int(pane.scroll_y)].seq
        # More lines arrive while paused: the view stays where it was.
        for i in range(5):
            model.ingest({"t": "log", "ts": 0.0, "off": 0, "end": 0, "line": f"late line {i}"})
        app.tick()
        assert pane.lines[int(pane.scroll_y)].seq == top
        await pilot.press("f")
        assert pane.follow and pane.lines[int(pane.scroll_y) + pane.size.height - 1].text == "late line 4"
        # Search jumps to the match and highlights it.
        await pilot.press("slash", *"checkpoint", "enter")
        assert not pane.follow and pane.search == "checkpoint"
        shown = [pane.lines[int(pane.scroll_y) + y].text for y in range(pane.size.height)]
        assert any("saved checkpoint" in t for t in shown)
        assert "search 'checkpoint'" in str(app.query_one("#logstatus").content)
        # Severity filter: warnings and errors only, then errors only, then everything again.
        await pilot.press("s")
        assert [ln.sev >= SEV_WARNING for ln in pane.lines] == [True] * len(pane.lines)
        assert [ln.text[:8] for ln in pane.lines] == ["WARNING:"]
        await pilot.press("s")
        assert len(pane.lines) == 0
        await pilot.press("s")
        assert pane.lines is model.log
        await pilot.press("slash", "escape")
        assert pane.search == "" and pane.follow


@pytest.mark.anyio
async def test_keys_typed_into_the_search_box_are_text_not_commands() -> None:
    app = app_for("training")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("slash", "k", "q", "c", "tab", "enter")
        assert not isinstance(app.screen, ConfirmScreen) and app.is_running
        assert app.query_one(LogPane).search == "kqc"
        assert app.sources[0].actions == []  # type: ignore[attr-defined]


class BellCountingApp(WatchApp):
    """Counts bells instead of writing BEL to the (headless) terminal."""

    bells = 0

    def bell(self) -> None:
        self.bells += 1


@pytest.mark.anyio
async def test_bell_rings_once_per_new_alert_only_when_enabled() -> None:
    clock_at = last_ts("crashed") + 2
    quiet = BellCountingApp([recorded("crashed")], clock=lambda: clock_at)
    async with quiet.run_test(size=SIZE) as pilot:
        await settle(pilot)
    assert quiet.bells == 0
    loud = BellCountingApp([recorded("crashed")], clock=lambda: clock_at, bell=True)
    async with loud.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.pause(0.3)  # more ticks: the same alert must not ring again
    assert loud.bells == 1


class HalfBacklog:
    """The recorded training stream arriving in two reads, as a long run's backlog does over SSH: its first 40 s,
    then nothing until `release`. Folded alone, that first part is a past moment: against the watcher's clock its
    last heartbeat is ~80 s old, past the 60 s stall floor."""

    finite = True

    def __init__(self, label: str) -> None:
        self.label = label
        self.rows = [json.loads(ln) for ln in (STREAMS / "training.jsonl").read_text().splitlines() if ln.strip()]
        first = min(r["ts"] for r in self.rows)
        self.head = sum(1 for r in self.rows if r["ts"] < first + 40)
        self.release = threading.Event()

    def messages(self) -> Iterator[dict[str, Any]]:
        for i, msg in enumerate(self.rows):
            if i == self.head:
                self.release.wait()
            yield msg

    def kill(self) -> None: ...

    def clean(self) -> None: ...

    def reconnect(self) -> None: ...


@pytest.mark.anyio
async def test_half_a_backlog_neither_rings_nor_takes_the_dashboard() -> None:
    """A run whose history is still pouring in shows a past moment's state (an old heartbeat reads as a stall against
    now): the dashboard must not ring for it nor move to it in its opening seconds (both did, flakily, in the full
    suite of session 19, when a tick folded part of a recording)."""
    half = HalfBacklog("late:training")
    clock_at = last_ts("training") + 2
    app = BellCountingApp([recorded("training"), half], clock=lambda: clock_at, bell=True)
    async with app.run_test(size=SIZE) as pilot:
        late = app.followers[1]
        deadline = time.monotonic() + 10
        while not (app.followers[0].ended.is_set() and late.received >= half.head and not late.pending()):
            assert time.monotonic() < deadline
            await pilot.pause(0.02)
        ticks = app.ticks
        while app.ticks < ticks + 3:  # the half backlog folded and ranked by several ticks, inside OPENING_S
            await pilot.pause(0.05)
        assert time.monotonic() - app._opened < app.OPENING_S
        assert app.models[1].view().state == "stalled"  # what a half backlog looks like: the case this guards
        assert app.current == 0 and app.bells == 0
        half.release.set()
        await settle(pilot)
        assert app.models[1].view().state == "training"
        assert app.current == 0 and app.bells == 0


class LinkLostMidBacklog(HalfBacklog):
    """A live host whose link drops after the first part of its backlog (the stream raises, as a closed channel does)."""

    finite = False

    def messages(self) -> Iterator[dict[str, Any]]:
        yield from self.rows[: self.head]
        raise ConnectionResetError("Socket is closed")


@pytest.mark.anyio
async def test_a_link_lost_mid_backlog_is_news_at_once() -> None:
    """The wait for a backlog ends with its link: a host lost mid-way rings and takes the opening dashboard (its
    link alert is critical), instead of being held back as history still pouring in."""
    lost = LinkLostMidBacklog("lost:training")
    clock_at = last_ts("training") + 2
    app = BellCountingApp([recorded("training"), lost], clock=lambda: clock_at, bell=True, backoff=[60.0])
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + 10
        while not (app.current == 1 and app.bells >= 1):
            assert time.monotonic() < deadline, (app.current, app.bells)
            await pilot.pause(0.02)
        assert "SSH link lost" in text_of(app, AlertsPanel)


@pytest.mark.anyio
async def test_a_backlog_stuck_past_the_settle_limit_is_judged_as_it_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent stuck mid-backlog (link up, no `backlog_end`) is not waited for forever: after SETTLE_MAX_S what it
    sent is judged (here: a stall), so a hung agent cannot hide a run."""
    monkeypatch.setattr(SourceWorker, "SETTLE_MAX_S", 0.5)
    half = HalfBacklog("stuck:training")
    clock_at = last_ts("training") + 2
    app = BellCountingApp([recorded("training"), half], clock=lambda: clock_at, bell=True)
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + 4
        while not (app.current == 1 and app.bells == 1):
            assert time.monotonic() < deadline, (app.current, app.bells)
            await pilot.pause(0.02)
        assert app.models[1].view().state == "stalled"
        half.release.set()


def test_watch_main_once_json_prints_every_run(capsys: pytest.CaptureFixture[str]) -> None:
    # every stream answered: 0 (3 when a host could not be reached, as `opsctl status`)
    assert watch_main([recorded("loading"), recorded("crashed")], plain=False, once_json=True, bell=False) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(s["host"], s["run"], s["state"]) for s in out][1] == ("h200", "crashed", "crashed")
    assert out[0]["phase_i"] == 5 and out[0]["phase_n"] == 8
    with pytest.raises(SystemExit, match="no runs to watch"):
        watch_main([], plain=False, once_json=True, bell=False)


def test_replay_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_main(["--once-json", str(STREAMS / "stalled.jsonl")]) == 0
    (snap,) = json.loads(capsys.readouterr().out)
    assert (snap["host"], snap["run"], snap["step"]) == ("replay", "stalled", 12)
    with pytest.raises(SystemExit) as exc:
        replay_main([str(STREAMS / "missing.jsonl")])
    assert exc.value.code == 2 and "recorded stream not found" in capsys.readouterr().err


# -- snapshots (fixed size and clock) ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["loading", "training", "stalled", "crashed", "h200_tiny", "eight_gpus"])
def test_snapshot_main_screen(name: str, snap_compare: Any) -> None:
    app = app_for(name, after_s=0.0 if name == "stalled" else 2.0)

    async def run_before(pilot: Pilot[Any]) -> None:
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


@pytest.mark.parametrize("names", [("eight_gpus",), ("training", "crashed")])
def test_snapshot_compact_80x24(names: tuple[str, ...], snap_compare: Any) -> None:
    """The small terminal: 8 GPUs and the log on one 80x24 screen; with two runs it opens on the crashed one."""
    app = app_for(*names)

    async def run_before(pilot: Pilot[Any]) -> None:
        await settle(pilot)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


# -- sources, --once and --plain ---------------------------------------------------------------------------
def test_recorded_source_paces_by_ts_or_replays_at_once() -> None:
    delays: list[float] = []
    src = recorded("loading", speed=10.0, sleep=delays.append)
    msgs = list(src.messages())
    span = msgs[-1]["ts"] - msgs[0]["ts"]
    assert len(msgs) == 24 and span > 20
    assert delays and abs(max(delays) - span / 10.0) < 0.5
    fast: list[float] = []
    assert len(list(recorded("loading", sleep=fast.append).messages())) == 24 and fast == []
    with pytest.raises(ValueError, match="speed must be > 0"):
        recorded("loading", speed=0)
    with pytest.raises(FileNotFoundError, match="recorded stream not found"):
        RecordedSource(STREAMS / "nope.jsonl")


def test_worker_counts_drops_per_drain() -> None:
    class Burst:
        label = "b"
        finite = True

        def messages(self) -> Iterator[dict[str, Any]]:
            for i in range(30):
                yield {"t": "log", "line": str(i)}
            yield {"t": "gpu", "ts": 1.0, "gpus": []}

        def kill(self) -> None: ...

        def clean(self) -> None: ...

        def reconnect(self) -> None: ...

    w = SourceWorker(Burst(), inbox_lines=10).start()
    assert w.ended.wait(5)
    other, logs, dropped = w.drain()
    assert [m["line"] for m in logs] == [str(i) for i in range(20, 30)] and dropped == 20
    assert [m["t"] for m in other] == ["link", "gpu", "link"]
    assert w.drain() == ([], [], 0)
    w.stop()


def test_worker_treats_the_end_of_a_live_stream_as_a_lost_link_and_reconnects() -> None:
    class Closing:
        """Like the agent's follow when its SSH channel closes: the iterator just ends."""

        label = "h:closing"

        def __init__(self) -> None:
            self.calls = 0
            self.reconnects = 0
            self.hold = threading.Event()

        def messages(self) -> Iterator[dict[str, Any]]:
            self.calls += 1
            if self.calls > 2:
                self.hold.wait()
                return
            yield {"t": "hello", "ts": 1.0, "agent_version": "1", "host": "h", "pid": 1, "python": "3",
                   "nvml": "ok"}

        def kill(self) -> None: ...

        def clean(self) -> None: ...

        def reconnect(self) -> None:
            self.reconnects += 1

    src = Closing()
    w = SourceWorker(src, backoff=(0.05,)).start()
    deadline = time.monotonic() + 5
    while src.calls < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    other, _, _ = w.drain()
    links = [(m["state"], m["detail"]) for m in other if m["t"] == "link"]
    # Each loss follows a working link, so each retry is attempt 1 with the first back-off delay.
    assert links[:6] == [("up", ""), ("lost", "ConnectionError: stream closed (retry in 0.05 s)"),
                         ("reconnecting", "attempt 1"), ("up", ""),
                         ("lost", "ConnectionError: stream closed (retry in 0.05 s)"), ("reconnecting", "attempt 1")]
    assert src.reconnects == 2 and not w.ended.is_set()
    w.stop()
    src.hold.set()


def test_record_saves_a_stream_that_replays_identically(tmp_path: Path) -> None:
    src = recorded("crashed")
    out = tmp_path / "rec.jsonl"
    assert record(src, out, max_seconds=10) == 71
    assert list(RecordedSource(out).messages()) == list(src.messages())
    assert record(recorded("training"), tmp_path / "head.jsonl", max_seconds=10, max_messages=5) == 5
    assert [m["t"] for m in RecordedSource(tmp_path / "head.jsonl").messages()] == [
        "hello", "proc", "log", "event", "event"]
    start = time.monotonic()
    hanging = HangingSource("dead:run")
    assert record(hanging, tmp_path / "none.jsonl", max_seconds=0.3) == 0
    assert time.monotonic() - start < 2
    hanging.release.set()


def test_once_json_snapshot_of_every_run() -> None:
    snaps = snapshot_once([recorded("crashed"), recorded("training")], timeout_s=10,
                          clock=lambda: last_ts("training") + 2)
    by = {f'{s["host"]}:{s["run"]}': s for s in snaps}
    crashed, training = by["h200:crashed"], by["h200:training"]
    assert crashed["state"] == "crashed" and crashed["exit_code"] == 1
    assert [a["key"] for a in crashed["alerts"]] == ["crashed"]
    assert "torch.OutOfMemoryError" in crashed["alerts"][0]["evidence"]
    assert training["state"] == "training" and training["step"] == 40
    assert training["alerts"] == [] and training["log_lines"] == 52 and training["dropped_lines"] == 0
    json.dumps(snaps)  # what `--once --json` prints must serialise


def test_once_json_gives_up_on_a_hanging_host_within_the_timeout() -> None:
    hanging = HangingSource("dead:run")
    start = time.monotonic()
    snaps = snapshot_once([hanging, recorded("loading")], timeout_s=1.0)
    assert time.monotonic() - start < 3
    # never `absent` (that says the host answered and has no such run): it is unreachable, and says why
    assert snaps[0]["link"] == "unreachable" and snaps[0]["state"] == "unreachable"
    assert "no answer within 1 s" in snaps[0]["reason"]
    assert snaps[1]["state"] in ("loading", "stalled")
    hanging.release.set()


def test_plain_view_prints_state_alert_and_log_tail() -> None:
    out = io.StringIO()
    assert run_plain([recorded("crashed")], stream=out, hz=20) == 0
    text = out.getvalue()
    assert "CRASHED" in text and "run crashed" in text and "torch.OutOfMemoryError" in text
    assert "GPU0" in text


def test_spark_scales_and_skips_non_finite() -> None:
    assert spark([0, 50, 100], 3, 0, 100) == "▁▅█"
    assert spark([1.0, float("nan"), 1.0], 5) == "▁▁"
    assert spark([1, 2, 3, 4], 2) == "▁█"
    assert spark([], 4) == ""


# -- end to end: the real `opsctl watch` in tmux, over SSH + pct, against a live run ---------------------
def _screen(sock: Path) -> str:
    r = subprocess.run(["tmux", "-S", str(sock), "capture-pane", "-p", "-t", "watch"], capture_output=True, text=True)
    return r.stdout


def _wait_screen(sock: Path, *needles: str, timeout_s: float = 30.0) -> str:
    deadline = time.monotonic() + timeout_s
    screen = ""
    while time.monotonic() < deadline:
        screen = _screen(sock)
        if all(n in screen for n in needles):
            return screen
        time.sleep(0.2)
    raise AssertionError(f"{needles} not on screen after {timeout_s} s:\n{screen}")


class WatchInTmux:
    """The real `opsctl watch` in a tmux pane of its own server (own socket), read back with capture-pane."""

    def __init__(self, tmp: Path, hosts: Path, target: str) -> None:
        self.sock = tmp / "tmux.sock"
        cmd = f"{shlex.quote(sys.executable)} -m opsctl --hosts {shlex.quote(str(hosts))} watch {target}"
        subprocess.run(["tmux", "-S", str(self.sock), "new-session", "-d", "-s", "watch", "-x", "160", "-y", "50",
                        "-c", str(REPO), cmd], check=True, env=dict(os.environ, TERM="xterm-256color"))

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "-S", str(self.sock), "send-keys", "-t", "watch", *keys], check=True)

    def wait(self, *needles: str, timeout_s: float = 30.0) -> str:
        return _wait_screen(self.sock, *needles, timeout_s=timeout_s)

    def wait_for_step(self, at_least: int, timeout_s: float = 30.0) -> str:
        """The first screen whose summary shows step >= at_least."""
        deadline = time.monotonic() + timeout_s
        screen = ""
        while time.monotonic() < deadline:
            screen = _screen(self.sock)
            m = re.search(r"step ([\d,]+)/3,000", screen)
            if m and int(m.group(1).replace(",", "")) >= at_least:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"step >= {at_least} not on screen after {timeout_s} s:\n{screen}")

    def close(self) -> None:
        subprocess.run(["tmux", "-S", str(self.sock), "kill-server"], capture_output=True)


def _launch_live(tmp_path: Path, sshd: Any, ct: int) -> Path:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=ct, runs={
        "tiny": script_run(tmp_path, "ok_run.py", "--steps", "3000", "--step-time", "0.2",
                           "--ckpt-dir", str(tmp_path / "ckpt"))})
    (tmp_path / "cache").mkdir()
    r = opsctl(hosts, "launch", "box", "tiny")
    assert r.returncode == 0, r.stderr
    return hosts


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_watch_in_tmux_survives_an_ssh_drop(tmp_path: Path, sshd: Any, container: Any, drop_ssh: Any) -> None:
    hosts = _launch_live(tmp_path, sshd, container(200))
    watch = WatchInTmux(tmp_path, hosts, "box:tiny")
    try:
        watch.wait("TRAINING", "link up")
        assert drop_ssh() >= 1
        screen = watch.wait("SSH link lost", timeout_s=10)
        assert "ChannelLost" in screen or "TransportError" in screen or "closed" in screen, screen
        screen = watch.wait("link up", "no alerts", timeout_s=20)  # back, from the saved offsets
        step = int(re.search(r"step ([\d,]+)/3,000", screen).group(1).replace(",", ""))  # type: ignore[union-attr]
        later = watch.wait_for_step(step + 3, timeout_s=20)  # a step number shows for only 0.2 s: compare, not match
        lines = [ln for ln in later.splitlines() if re.search(r"│step \d+ loss", ln)]
        nums = [int(re.search(r"step (\d+) loss", ln).group(1)) for ln in lines]  # type: ignore[union-attr]
        assert len(nums) >= 3, f"the run's log lines did not reach the screen:\n{later}"
        assert nums == list(range(nums[0], nums[0] + len(nums))), nums  # no line lost or repeated on screen
    finally:
        watch.close()
        opsctl(hosts, "kill", "box", "tiny")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_watch_in_tmux_over_ssh_pct_live_run_then_kill_from_the_dashboard(tmp_path: Path, sshd: Any,
                                                                            container: Any) -> None:
    # The real training core (configs/tiny.yaml, lengthened so it is still training when killed).
    out = tmp_path / "tiny"
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=container(200),
                                  runs={"tiny": tiny_run(tmp_path, "--max-steps", "3000")})
    r = opsctl(hosts, "launch", "box", "tiny", timeout=300)
    assert r.returncode == 0, r.stderr
    watch = WatchInTmux(tmp_path, hosts, "box:tiny")
    try:
        # The GPU line comes with the host's first NVML answer, which may render a frame after TRAINING: wait for it
        # too (a screen taken on TRAINING alone raced it under load: CI-like full-suite run, 2026-12-04).
        screen = watch.wait("box:tiny", "TRAINING", "loss", "opsctl watch", "GPUs: none reported (nvml: unavailable (",
                            timeout_s=60)
        assert re.search(r"step [\d,]+/3,000", screen), screen
        assert re.search(r"loss \d\.\d{4}", screen), screen
        assert "no alerts" in screen  # a healthy CPU run: no slow-kernel alert (nothing faster exists on a CPU)
        assert "GPUs: none reported (nvml: unavailable (" in screen  # the container has no NVML: said, not hidden
        watch.keys("k")
        watch.wait("kill box:tiny?")
        watch.keys("y")
        # killed on request: the badge and the summary's `ended` line, no alert (nobody needs to act)
        screen = watch.wait("KILLED", "ended run_end signal", timeout_s=90)
        assert "exit code 0" in screen and "no alerts" in screen and "run killed" not in screen
        saved = sorted((out / "checkpoints").glob("step-*"))  # the run checkpointed on the way out
        assert saved and (saved[-1] / "manifest.json").is_file()
        watch.keys("q")
    finally:
        watch.close()
        opsctl(hosts, "kill", "box", "tiny")


# -- issue 12: charts over the whole run, nvitop-like GPUs, health at a glance ---------------------------------
def _run_start(ts: float, resumed_from: int | None = None, reservoir: int = 4) -> dict[str, Any]:
    return {"t": "event", "ts": ts, "off": 0, "end": 1, "event": {
        "v": 1, "ts": ts, "kind": "run_start", "run_id": "r", "rank": 0, "seq": 0, "config": {"data": {"reservoir":
                                                                                                   reservoir}},
        "versions": {}, "kernels": {}, "device": "cuda:0", "world_size": 1, "roles": {"colocated": [0]},
        "resumed_from": resumed_from, "pid": 7, "host": "h", "total_steps": 1000}}


def _step(n: int, ts: float, step_time: float = 1.0, loss: float | None = None, tps: float = 1000.0) -> dict[str, Any]:
    return {"t": "event", "ts": ts, "off": 0, "end": 1, "event": {
        "v": 1, "ts": ts, "kind": "step", "run_id": "r", "rank": 0, "seq": n, "step": n, "epoch": 0,
        "loss": 10.0 / n if loss is None else loss, "acc": [0.5], "lr": 1e-3, "grad_norm": 1.0, "tokens": 100,
        "tokens_per_s": tps, "step_time_s": step_time, "queue_depth": 4, "queue_wait_s": 0.0, "recompiles": 0,
        "total_steps": 1000}}


def test_charts_keep_the_whole_run_across_a_resume_and_thin_beyond_capacity() -> None:
    from opsctl.watch import RunModel, RunSeries

    model = RunModel("h:r")
    model.ingest({"t": "proc", "ts": 0.0, "state": "running", "pid": 7, "pgid": 7, "exit_code": None})
    model.ingest(_run_start(0.0))
    for n in range(1, 301):  # more than the old 120-point window
        model.ingest(_step(n, float(n)))
    loss = model.series["loss"]
    assert loss.steps == list(range(1, 301)) and loss.values[0] == 10.0
    model.ingest(_run_start(400.0, resumed_from=250))  # crashed after 300, resumed from the step-250 checkpoint
    model.ingest(_step(251, 401.0, loss=0.5))
    assert loss.steps[-2:] == [250, 251] and loss.values[-1] == 0.5  # steps 251-300 of the crashed attempt gone
    series = RunSeries(capacity=100)
    for n in range(1, 1001):
        series.add(n, float(n))
    assert len(series) <= 100 and series.steps[0] == 1 and series.steps[-1] >= 990  # still spans the whole run
    assert series.stride > 1


def test_eta_is_an_ema_of_the_step_time_and_one_slow_step_barely_moves_it() -> None:
    from opsctl.watch import RunModel

    now = [0.0]
    model = RunModel("h:r", clock=lambda: now[0])
    model.ingest({"t": "proc", "ts": 0.0, "state": "running", "pid": 7, "pgid": 7, "exit_code": None})
    model.ingest(_run_start(0.0))
    now[0] = 101.0
    for n in range(1, 101):
        model.ingest(_step(n, float(n), step_time=1.0, tps=1000.0 + (50 if n % 2 else -50)))
    before = model.view().eta_s
    assert before == pytest.approx(900.0)  # 900 steps left at 1.0 s
    model.ingest(_step(101, 160.0, step_time=60.0))  # a checkpoint step: the old last-20 median rule jumped too
    after = model.view().eta_s
    assert after is not None and after < 1.15 * before, (before, after)
    now[0] = 161.0
    for n in range(102, 262):  # the run really got slower: the ETA follows within a few dozen steps
        model.ingest(_step(n, 160.0 + 2.0 * (n - 101), step_time=2.0))  # the wall clock counts (EtaClock)
    now[0] = 160.0 + 2.0 * 161
    assert model.view().eta_s == pytest.approx((1000 - 261) * 2.0, rel=0.05)
    assert model.view().tokens_per_s_avg == pytest.approx(1000.0, rel=0.05)  # 2000 tokens / 2 s, not the last +-50


@pytest.mark.anyio
async def test_a_running_resumed_run_shows_no_stale_exit_code(tmp_path: Path) -> None:
    msgs = [{"t": "proc", "ts": 1.0, "state": "exited", "pid": 7, "pgid": 7, "exit_code": 0},
            _run_start(1.0), _step(1, 2.0),
            {"t": "event", "ts": 3.0, "off": 0, "end": 1, "event": {
                "v": 1, "ts": 3.0, "kind": "run_end", "run_id": "r", "rank": 0, "seq": 9, "reason": "signal",
                "exit_code": 0, "step": 1}},
            {"t": "proc", "ts": 10.0, "state": "running", "pid": 8, "pgid": 8, "exit_code": None},
            _run_start(11.0, resumed_from=1), _step(2, 12.0)]
    stream = tmp_path / "resumed.jsonl"
    stream.write_text("".join(json.dumps(m) + "\n" for m in msgs))
    app = WatchApp([RecordedSource(stream, label="h:resumed")], clock=lambda: 13.0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        view = app.models[0].view()
        assert view.state == "training" and view.proc_state == "running"
        summary = text_of(app, RunSummary)
        assert "running  pid 8" in summary and "exit" not in summary, summary


@pytest.mark.anyio
async def test_opens_on_the_run_that_needs_attention_then_tab_moves_on() -> None:
    app = app_for("training", "crashed", "loading")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert app.current == 1 and "▶ h200:crashed" in text_of(app, RunsBar)  # crashed first, not the first listed
        await pilot.press("tab")
        assert app.current == 2
        app.tick()
        assert app.current == 2  # once the person chose, the dashboard stays where they are


@pytest.mark.anyio
async def test_a_kill_we_asked_for_shows_killed_and_how_it_ended_not_an_alert() -> None:
    class Killed(RecordedSource):
        """The training recording, then what the agent sends after `opsctl kill`: run_end by signal, exited."""

        def messages(self) -> Iterator[dict[str, Any]]:
            yield from super().messages()
            ts = last_ts("training")
            yield {"t": "killed", "ts": ts + 0.5, "signal": "SIGINT", "pgid": 31337, "alive": []}
            yield {"t": "event", "ts": ts + 1, "off": 0, "end": 1, "event": {
                "v": 1, "ts": ts + 1, "kind": "run_end", "run_id": "h200-demo", "rank": 0, "seq": 999,
                "reason": "signal", "exit_code": 0, "step": 40, "signal": "SIGINT"}}
            yield {"t": "proc", "ts": ts + 1.5, "state": "exited", "pid": 31337, "pgid": 31337, "exit_code": 0,
                   "killed_by_opsctl": True}

    clock_at = last_ts("training") + 3
    app = WatchApp([Killed(STREAMS / "training.jsonl", label="h200:killed")], clock=lambda: clock_at)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert "KILLED" in text_of(app, RunsBar) and "⚠" not in text_of(app, RunsBar)
        assert text_of(app, AlertsPanel) == "no alerts"
        assert "ended run_end signal, exit code 0, at step 40" in text_of(app, RunSummary)


class RefusedSource:
    """A host that refuses every connection (what the transport raises for a dead sshd port)."""

    def __init__(self, label: str) -> None:
        self.label = label

    def messages(self) -> Iterator[dict[str, Any]]:
        raise ConnectionRefusedError(111, "Connection refused")

    def kill(self) -> None: ...

    def clean(self) -> None: ...

    def reconnect(self) -> None: ...


@pytest.mark.anyio
async def test_an_unreachable_host_gets_the_unreachable_badge_and_the_dashboard_opens_on_it() -> None:
    clock_at = last_ts("training") + 2
    app = WatchApp([recorded("training"), RefusedSource("gone:run")], clock=lambda: clock_at, backoff=(5.0,))
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + 10
        while "UNREACHABLE" not in text_of(app, RunsBar):
            assert time.monotonic() < deadline, text_of(app, RunsBar)
            await pilot.pause(0.05)
        assert app.current == 1 and "Connection refused" in text_of(app, RunSummary)


@pytest.mark.anyio
async def test_eight_gpus_and_the_log_fit_80x24() -> None:
    app = app_for("eight_gpus")
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert app.main_screen.has_class("compact") and app.w_charts.has_class("hidden")
        gpus = app.query_one(GpuPanel)
        rows = gpus.render().plain.splitlines()
        assert len(rows) == 9 and rows[0].split()[:2] == ["GPU", "util"]
        for i, row in enumerate(rows[1:]):
            assert row.split()[0] == str(i) and "/140G" in row and "W" in row and "°C" in row, row
        assert "31337 run" in rows[1]  # the run's own process is marked as the run's
        assert gpus.region.bottom <= 24 and gpus.region.height == 10  # all eight rows on screen
        pane = app.query_one(LogPane)
        assert pane.region.y + pane.region.height <= 23 and pane.size.height >= 4  # and still 4+ log lines
        assert text_of(app, AlertsPanel) == "no alerts"  # a full reservoir on a colocated run is no alarm
        await pilot.press("g")
        assert "(history)" in gpus.render().plain
        await pilot.press("v")
        await pilot.pause()
        assert not app.w_charts.has_class("hidden")  # charts on demand even on a small terminal


@pytest.mark.anyio
async def test_chart_keys_cycle_the_metric_and_toggle_smoothing_and_the_queue_chart_is_calm() -> None:
    from opsctl.widgets import Chart

    app = app_for("eight_gpus")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        right = app.query_one("#chart-right", Chart)
        assert right.key == "tokens_per_s"
        await pilot.press("m", "m")
        await pilot.pause()
        assert right.key == "queue_depth"
        built = re.sub(r"\x1b\[[0-9;]*m", "", right.plt.build())
        assert "queue depth 4 of 4" in built
        ticks = [float(m) for m in re.findall(r"^\s*(-?\d+(?:\.\d+)?)┤", built, re.M)]
        assert max(ticks) == 4.0 and min(ticks) == 0.0, built  # the 0..capacity axis: full is a calm top line
        assert app.w_charts.smoothing > 0
        await pilot.press("e")
        assert app.w_charts.smoothing == 0
        left = re.sub(r"\x1b\[[0-9;]*m", "", app.query_one("#chart-loss", Chart).plt.build())
        assert "loss 2.3120" in left and "step" in left


@pytest.mark.anyio
async def test_screenshot_key_saves_somewhere_writable_and_says_where(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # a server: no ~/Downloads
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.delenv("OPSCTL_SCREENSHOT_DIR", raising=False)
    app = app_for("training")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+s")
        await pilot.pause(0.2)
        saved = Path(app.last_screenshot or "")
        assert saved.parent == tmp_path / ".local" / "state" / "opsctl" / "screenshots" and saved.is_file()
        assert "<svg" in saved.read_text()[:2000]
        assert any(str(saved) in str(n.message) for n in app._notifications), "the notification names the file"


@pytest.mark.anyio
async def test_a_restarting_run_is_shown_as_restarting_n_of_max(tmp_path: Path) -> None:
    # What the agent's `proc` says while the wrapper waits out a restart's back-off (docs/agent-protocol.md).
    msgs = [{"t": "hello", "ts": 1.0, "agent_version": "1", "host": "h", "pid": 1, "python": "3", "nvml": "ok"},
            _run_start(1.0), _step(1, 2.0),
            {"t": "proc", "ts": 5.0, "state": "restarting", "pid": 7, "pgid": 7, "exit_code": 1,
             "exception": "RuntimeError: boom", "attempt": 2, "started": 1.0, "ended": 4.0, "restarts": 1,
             "restart_max": 3, "restart": {"attempt": 2, "n": 2, "max": 3, "at": 65.0, "ended": 4.0, "exit_code": 1,
                                           "exception": "RuntimeError: boom"}}]
    stream = tmp_path / "restarting.jsonl"
    stream.write_text("".join(json.dumps(m) + "\n" for m in msgs))
    app = WatchApp([RecordedSource(stream, label="h:flaky")], clock=lambda: 6.0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        assert "RESTARTING (2/3)" in text_of(app, RunsBar)
        assert "RESTARTING (2/3)" in text_of(app, RunSummary)


# -- τ live during training (train.eval_every) -------------------------------------------------------------
@pytest.mark.anyio
async def test_tau_is_drawn_next_to_loss_over_the_whole_run_and_its_fall_is_alerted() -> None:
    from opsctl.widgets import Chart

    app = app_for("evaluating")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        model = app.models[0]
        assert model.series["tau"].steps == [10, 20, 30, 40, 50, 60]
        assert model.series["tau"].values == [2.1, 3.0, 3.6, 3.9, 3.3, 3.4]
        assert model.series["ngram_tau"].steps == [10, 20, 30, 40, 50, 60]
        right = app.query_one("#chart-right", Chart)
        assert right.key == "tau"  # next to loss, by default, for a run that evaluates
        built = re.sub(r"\x1b\[[0-9;]*m", "", right.plt.build())
        assert "τ 3.40 at step 60" in built and "step" in built, built
        ticks = [float(m) for m in re.findall(r"^\s*(-?\d+(?:\.\d+)?)┤", built, re.M)]
        assert min(ticks) < 2.1 and max(ticks) >= 3.8, built  # the whole run: every evaluation, n-gram's too
        summary = text_of(app, RunSummary)
        assert "TRAINING" in summary  # after an evaluation, the steps go on: training, never another state
        assert "τ 3.40 at step 60 (best 3.90 at step 40; n-gram 1.85)" in summary, summary
        alerts = text_of(app, AlertsPanel)
        assert "τ fell below its best" in alerts and "best tau 3.90 at step 40, now 3.40 at step 60" in alerts, alerts
        await pilot.press("m")
        await pilot.pause()
        assert right.key == "tokens_per_s"
        await pilot.press("m", "m", "m")
        await pilot.pause()
        assert right.key == "tau"


def test_plain_and_once_json_show_tau() -> None:
    out = io.StringIO()
    assert run_plain([recorded("evaluating")], stream=out, hz=20) == 0
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", out.getvalue()).split())  # the panel's lines wrap at 80 columns
    assert "τ 3.40 at step 60 (best 3.90 at step 40; n-gram 1.85)" in text, text
    assert "τ fell below its best" in text
    (snap,) = snapshot_once([recorded("evaluating")], timeout_s=10)
    assert (snap["tau"], snap["tau_step"], snap["tau_best"], snap["tau_best_step"], snap["ngram_tau"]) == (
        3.4, 60, 3.9, 40, 1.85), snap
    assert snap["tau_ci95"] == [3.28, 3.52] and snap["state"] in ("training", "stalled")
    assert [a["key"] for a in snap["alerts"] if a["key"] == "tau_regression"] == ["tau_regression"]


def test_snapshot_tau_chart_next_to_loss(snap_compare: Any) -> None:
    app = app_for("evaluating")

    async def run_before(pilot: Pilot[Any]) -> None:
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


# -- issue 25 item 11: the dashboard at 80x24, its colours, axes, attempt marks and idle cost -----------------------
def _screen_text(app: WatchApp) -> list[str]:
    return [strip.text for strip in app.screen._compositor.render_strips()]


@pytest.mark.anyio
async def test_footer_at_80x24_keeps_q_v_and_ctrl_s_and_fits() -> None:
    from textual.widgets._footer import FooterKey

    app = app_for("eight_gpus")
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.pause(0.2)
        keys = {k.key_display: k for k in app.query(FooterKey)}
        assert {"q", "v", "^s"} <= set(keys), sorted(keys)
        assert all(k.region.right <= 80 and k.region.width > 0 for k in keys.values())  # none cut at the edge
        assert "q quit" in _screen_text(app)[-1]
        assert keys["^s"].description == "snap"  # the short label; ctrl+s still saves a screenshot
    app = app_for("eight_gpus")
    async with app.run_test(size=SIZE) as pilot:  # room enough: every key with its full label
        await settle(pilot)
        await pilot.pause(0.2)
        descriptions = {k.key_display: k.description for k in app.query(FooterKey)}
        assert descriptions["^s"] == "screenshot" and descriptions["f"] == "follow" and descriptions["q"] == "quit"


@pytest.mark.anyio
async def test_compact_summary_names_the_run() -> None:
    app = app_for("training", "crashed")
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert app.main_screen.has_class("compact")
        first = text_of(app, RunSummary).splitlines()[0]
        assert first.startswith("h200:crashed  CRASHED "), first
        await pilot.press("tab")
        assert text_of(app, RunSummary).startswith("h200:training  TRAINING "), text_of(app, RunSummary)


@pytest.mark.anyio
async def test_log_keeps_five_lines_at_80x24_with_charts_on() -> None:
    app = app_for("eight_gpus")
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("v")
        for _ in range(3):  # the charts take their height from what the others left, a frame later
            await pilot.pause(0.1)
        charts, pane, gpus = app.w_charts, app.query_one(LogPane), app.query_one(GpuPanel)
        assert not charts.has_class("hidden") and charts.region.height >= app.CHART_MIN, charts.region
        assert gpus.collapsed and gpus.region.height == 2  # the GPU table folds to one line under its rule
        assert "8 GPUs  util 96% avg" in gpus.render().plain
        assert pane.size.height >= app.LOG_MIN and pane.region.bottom <= 23, (pane.size, pane.region)
        screen = "\n".join(_screen_text(app))
        assert "loss 2.3120" in screen and "step    60 | loss 2.3120" in screen  # chart and the last log line
        await pilot.press("v")
        await pilot.pause(0.1)
        assert charts.has_class("hidden") and not gpus.collapsed and gpus.region.height == 10


@pytest.mark.anyio
async def test_alerts_box_is_calm_without_alerts_and_red_with_a_critical_one() -> None:
    borders = {}
    for name in ("training", "crashed"):
        app = app_for(name)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            panel = app.query_one(AlertsPanel)
            borders[name] = panel.styles.border_top[1]
            error = app.get_css_variables()["error"]
            if name == "training":
                assert str(panel.content) == "no alerts" and panel.has_class("-none"), panel.classes
                assert not panel.has_class("-critical")
            else:
                assert panel.has_class("-critical") and "run crashed" in str(panel.content)
    assert borders["training"] != borders["crashed"]
    assert borders["crashed"].hex.lower() == error.lower()[:7] and borders["training"].hex.lower() != error.lower()[:7]


def test_state_styles_give_every_state_its_own_distinct_colour() -> None:
    import itertools
    import math

    from rich.style import Style

    from opsctl.look import STATE_STYLES

    states = {"absent", "connecting", "starting", "loading", "compiling", "training", "stalled", "restarting",
              "finished", "crashed", "killed", "refused", "unreachable", "degraded"}
    assert states <= set(STATE_STYLES), states - set(STATE_STYLES)
    backgrounds = {}
    for state, style in STATE_STYLES.items():
        bg = Style.parse(style).bgcolor
        assert bg is not None and bg.triplet is not None, (state, style)  # an exact colour: themes cannot merge two
        backgrounds[state] = tuple(bg.triplet)
    close = [(a, b, round(math.dist(backgrounds[a], backgrounds[b])))
             for a, b in itertools.combinations(backgrounds, 2) if math.dist(backgrounds[a], backgrounds[b]) < 60]
    assert not close, close
    assert math.dist(backgrounds["unreachable"], backgrounds["finished"]) > 200  # the pair seen alike in issue 25


@pytest.mark.anyio
async def test_a_host_never_reached_says_cannot_connect_once() -> None:
    clock_at = last_ts("training") + 2
    for size in (SIZE, (80, 24)):
        app = WatchApp([recorded("training"), RefusedSource("gone:run")], clock=lambda: clock_at, backoff=(5.0,))
        async with app.run_test(size=size) as pilot:
            deadline = time.monotonic() + 10
            while "UNREACHABLE" not in text_of(app, RunsBar) or app.current != 1:
                assert time.monotonic() < deadline, text_of(app, RunsBar)
                await pilot.pause(0.05)
            app.tick()
            await pilot.pause(0.1)
            said = " ".join(text_of(app, w) for w in (RunsBar, RunSummary, AlertsPanel))
            assert "cannot connect to gone: ConnectionRefusedError" in said, said
            assert said.count("Connection refused") == 1, said
            assert "SSH link lost" not in " ".join(_screen_text(app))
            assert "never reached" in text_of(app, AlertsPanel)
            view = app.models[1].view()
            assert view.reason == "cannot connect to gone: ConnectionRefusedError: [Errno 111] Connection refused"
            assert app.models[1].link_text() == "lost (retry in 5 s)"


def test_axis_ticks_are_round_and_short_with_units() -> None:
    from opsctl.look import nice_ticks, tick_labels

    assert tick_labels(nice_ticks(3947.5, 4712.0)) == ["3.8k", "4.0k", "4.2k", "4.4k", "4.6k", "4.8k"]
    assert tick_labels(nice_ticks(431000.0, 440987.5)) == ["430.0k", "432.5k", "435.0k", "437.5k", "440.0k",
                                                           "442.5k"]
    assert tick_labels(nice_ticks(0.0123, 0.0456), "s") == ["10ms", "20ms", "30ms", "40ms", "50ms"]
    assert tick_labels(nice_ticks(0.8, 2.4), "s") == ["0.5s", "1.0s", "1.5s", "2.0s", "2.5s"]
    assert tick_labels(nice_ticks(2.31, 7.3)) == ["2", "4", "6", "8"]
    assert tick_labels(nice_ticks(0.0, 4.0)) == ["0", "1", "2", "3", "4"]
    assert tick_labels([0.0, 100e3, 200e3]) == ["0", "100k", "200k"]  # zero is 0, never 0k
    assert tick_labels(nice_ticks(2.0e6, 3.1e6)) == ["2.0M", "2.5M", "3.0M", "3.5M"]
    assert nice_ticks(1.0, 1.0) == [1.0] and nice_ticks(float("nan"), 1.0) == []


@pytest.mark.anyio
async def test_tokens_and_step_time_axes_show_round_ticks_with_units() -> None:
    from opsctl.widgets import Chart

    app = app_for("eight_gpus")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        right = app.query_one("#chart-right", Chart)
        built = re.sub(r"\x1b\[[0-9;]*m", "", right.plt.build())
        labels = re.findall(r"^\s*(\S+)┤", built, re.M)
        assert right.key == "tokens_per_s" and labels and all(re.fullmatch(r"\d+(\.\d)?k", x) for x in labels), built
        await pilot.press("m")
        await pilot.pause()
        built = re.sub(r"\x1b\[[0-9;]*m", "", right.plt.build())
        labels = re.findall(r"^\s*(\S+)┤", built, re.M)
        assert right.key == "step_time_s" and labels and all(re.fullmatch(r"\d+(\.\d)?ms", x) for x in labels), built


def _resumed_stream(tmp_path: Path, resume: bool) -> Path:
    """Steps 1-30, a kill at 30 (run_end signal), then (resume) a new attempt from the step-20 checkpoint."""
    msgs: list[dict[str, Any]] = [{"t": "proc", "ts": 0.0, "state": "running", "pid": 7, "pgid": 7,
                                   "exit_code": None}, _run_start(0.0)]
    msgs += [_step(n, float(n), loss=5.0 - n / 20) for n in range(1, 31)]
    msgs.append({"t": "event", "ts": 31.0, "off": 0, "end": 1, "event": {
        "v": 1, "ts": 31.0, "kind": "run_end", "run_id": "r", "rank": 0, "seq": 99, "reason": "signal",
        "exit_code": 0, "step": 30, "signal": "SIGTERM"}})
    msgs.append({"t": "proc", "ts": 32.0, "state": "exited", "pid": 7, "pgid": 7, "exit_code": 0})
    if resume:
        msgs += [{"t": "proc", "ts": 40.0, "state": "running", "pid": 8, "pgid": 8, "exit_code": None},
                 _run_start(41.0, resumed_from=20)]
        msgs += [_step(n, 41.0 + n, loss=5.0 - n / 20) for n in range(21, 61)]
    path = tmp_path / f"attempts-{resume}.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in msgs))
    return path


@pytest.mark.anyio
async def test_kills_and_resumes_are_marked_on_the_charts(tmp_path: Path) -> None:
    from opsctl.widgets import Chart

    for resume, marks in ((False, [(30, "signal")]), (True, [(20, "resumed")])):
        app = WatchApp([RecordedSource(_resumed_stream(tmp_path, resume), label="h:r")], clock=lambda: 102.0)
        async with app.run_test(size=SIZE) as pilot:
            await settle(pilot)
            assert app.models[0].attempt_marks == marks  # a resume's mark replaces the kill past its checkpoint
            for chart in app.query(Chart):
                built = re.sub(r"\x1b\[[0-9;]*m", "", chart.plt.build()).splitlines()
                top = next(line for line in built if "┌" in line)
                inner = top[top.index("┌") + 1:top.rindex("┐")]
                if resume:
                    assert "┬" in inner, "\n".join(built)  # the vertical line at step 20 meets the frame
                    assert any("│ attempts" in line for line in built), "\n".join(built)
            # a fresh start (no resumed_from) begins a new curve without the old marks
            app.models[0].ingest(_run_start(500.0))
            assert app.models[0].attempt_marks == []


@pytest.mark.anyio
async def test_an_idle_dashboard_redraws_once_a_second_not_every_tick() -> None:
    app = app_for("h200_tiny")
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.pause(0.2)
        pane = app.query_one(LogPane)
        ticks, redraws, synced = app.ticks, app.redraws, pane._synced
        await pilot.pause(0.6)
        assert app.ticks >= ticks + 2  # the batch loop runs (new messages would be folded within tick_s)
        assert app.redraws <= redraws + 1 and pane._synced == synced  # nothing new: no redraw, the log not drawn


def test_once_json_and_plain_do_not_import_textual() -> None:
    code = ("import sys, opsctl.cli, opsctl.tui, opsctl.plain; "
            "print(sorted(m for m in ('textual', 'plotext', 'textual_plotext', 'opsctl.dashboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=str(REPO))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_snapshot_compact_80x24_with_charts_on(snap_compare: Any) -> None:
    """v on a small terminal: the charts shrink to what is left, the GPU table folds to a line, the log keeps 5+."""
    app = app_for("eight_gpus")

    async def run_before(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        await pilot.press("v")
        for _ in range(3):
            await pilot.pause(0.1)
        app.tick()
        await pilot.pause()

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


# -- issue 25 leftovers: a long error is readable at 80x24, not cut with `…` ----------------------------------------
LONG_ERROR = ("No route to host while connecting to gpu-box-17.cluster.example.org port 2222 through the jump host "
              "bastion.example.org")


class LongErrorSource(RefusedSource):
    """A host whose connection fails with a long error (a routed name, a port and a jump host in the message)."""

    def messages(self) -> Iterator[dict[str, Any]]:
        raise OSError(113, LONG_ERROR)


def _words(lines: list[str]) -> str:
    return " ".join(" ".join(lines).split())


@pytest.mark.anyio
async def test_a_long_unreachable_error_is_said_in_full_at_80x24_once() -> None:
    """The compact summary line cut it at the edge (`... [Errno …`); the alerts box now says it whole, wrapped, once,
    with the never-reached note under it."""
    clock_at = last_ts("training") + 2
    app = WatchApp([recorded("training"), LongErrorSource("gpu-box-17:qwen27b")], clock=lambda: clock_at,
                   backoff=(5.0,))
    async with app.run_test(size=(80, 24)) as pilot:
        deadline = time.monotonic() + 10
        while "UNREACHABLE" not in text_of(app, RunsBar) or app.current != 1:
            assert time.monotonic() < deadline, text_of(app, RunsBar)
            await pilot.pause(0.05)
        app.tick()
        await pilot.pause(0.2)
        reason = app.models[1].view().reason
        assert reason is not None and LONG_ERROR in reason and len(reason) > 80
        screen = _screen_text(app)
        assert _words(screen).count(" ".join(reason.split())) == 1, screen  # every word on screen, once
        assert not any("…" in line for line in screen[:8]), screen[:8]
        assert "never reached" in _words(screen)
        assert LONG_ERROR not in text_of(app, RunSummary)  # not cut on the summary line as well


@pytest.mark.anyio
async def test_a_crash_evidence_wraps_in_the_alerts_box_at_80x24() -> None:
    app = app_for("training", "crashed")
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.pause(0.2)
        (alert,) = [a for a in app.models[app.current].alerts(app.models[app.current].view()) if a.key == "crashed"]
        assert len(alert.evidence) > 80
        assert " ".join(alert.evidence.split()) in _words(_screen_text(app)), _screen_text(app)[:8]
