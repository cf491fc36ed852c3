"""opsctl.remote.cache.previous_attempt reads the events of the last launch only: from the events file's size at that launch
(launch.json `events_offset`), so neither a week of earlier attempts nor a line an earlier attempt left half-written
(killed mid-write, disk full) is read again."""

from __future__ import annotations

import json
import time
from pathlib import Path

from opsctl.remote.cache import previous_attempt
from opsctl.remote.procs import Run
from opsctl.remote.rules import MAX_EVENT_LINE


def _run(tmp_path: Path) -> Run:
    return Run({"name": "r", "workdir": str(tmp_path), "state_dir": "state", "events": "events.jsonl",
                "command": ["true"]})


def _ev(**kw: object) -> bytes:
    return (json.dumps({"v": 1, "ts": time.time(), "run_id": "x", "rank": 0, "seq": 0, **kw}) + "\n").encode()


def test_reads_from_the_launchs_offset_past_a_half_written_line_of_the_attempt_before(tmp_path: Path) -> None:
    run = _run(tmp_path)
    Path(run.state_dir).mkdir()
    before = _ev(kind="step", step=90, total_steps=100) + b'{"v": 1, "kind": "step", "ste'  # killed mid-write
    after = _ev(kind="run_start", total_steps=100, resumed_from=90) + _ev(kind="step", step=91, total_steps=100)
    Path(run.events).write_bytes(before + after)
    launch = {"ts": time.time() - 5, "session": "s", "log": run.log, "events": run.events}
    Path(run.state_file("launch.json")).write_text(json.dumps({**launch, "events_offset": len(before)}))
    prev = previous_attempt(run)
    assert (prev["phase"], prev["step"], prev["run_start"]["resumed_from"]) == ("training", 91, 90)
    # Without the offset (a launch.json written before it was recorded) the glued line hides this attempt's start.
    Path(run.state_file("launch.json")).write_text(json.dumps(launch))
    assert previous_attempt(run)["run_start"] is None
    # An offset past the end (the file was replaced since) reads the file from its start.
    Path(run.state_file("launch.json")).write_text(json.dumps({**launch, "events_offset": 10 * len(before + after)}))
    assert previous_attempt(run)["step"] == 91


def test_an_over_long_line_is_skipped_and_the_events_after_it_still_count(tmp_path: Path) -> None:
    run = _run(tmp_path)
    Path(run.state_dir).mkdir()
    huge = b'{"kind": "step", "pad": "' + b"x" * (MAX_EVENT_LINE + 10) + b'"}\n'
    Path(run.events).write_bytes(_ev(kind="run_start", total_steps=10) + huge + _ev(kind="step", step=4))
    Path(run.state_file("launch.json")).write_text(json.dumps({"ts": time.time() - 5, "events_offset": 0}))
    prev = previous_attempt(run)
    assert (prev["step"], prev["total_steps"]) == (4, 10)
