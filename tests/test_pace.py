"""A run that got slower is said (issue: "told the moment it ... runs slow"): the trainer writes each step's pace
against the best pace the attempt has held (dflash/pace.py), the dashboard and status raise `slowdown` from it, and the
run's wrapper notifies once per episode (opsctl/remote/wrapper.py). Real trainings, real event files."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_alerts import T0, Run, run_start, step  # noqa: E402

from dflash import pace as pace_mod  # noqa: E402
from dflash.pace import Pace  # noqa: E402
from opsctl.remote.rules import SLOW_FACTOR, slowdown  # noqa: E402
from opsctl.remote.wrapper import EventsWatch  # noqa: E402


def feed(p: Pace, times: list[float], t: float, dt: float = 1.0) -> float:
    for x in times:
        t += dt
        p.note(x, t)
    return t


def test_the_pace_is_the_recent_median_over_the_settled_one() -> None:
    p = Pace(settle_s=60, window=10)
    t = feed(p, [90.0], 0.0)  # the first step compiles: never counted
    t = feed(p, [2.0] * 59, t)  # settling: not counted either
    assert p.fields() == {} and p.ref is None
    t = feed(p, [2.0] * 5 + [2.2] * 5, t)  # the reference window
    assert p.ref == pytest.approx(2.1) and p.fields() == {}  # no recent window yet
    t = feed(p, [2.1] * 9 + [60.0], t)  # one very slow step (a page fault) is no slowdown
    assert p.fields() == {"pace": 1.0, "pace_ref_s": 2.1}
    t = feed(p, [2.8] * 6, t)  # a lasting change wins once it is most of the window
    assert p.fields()["pace"] == pytest.approx(2.8 / 2.1, abs=1e-3)


def test_the_reference_is_the_best_pace_held_so_a_slow_settling_does_not_hide_a_later_slowdown() -> None:
    """An attempt that settled while another job shared its GPU (2.8 s) speeds up when that job leaves (2.0 s): the
    reference follows the faster window, so the next slow spell (2.8 s again) is 1.4x, a slowdown, not 1.0x."""
    p = Pace(settle_s=10, window=10)
    t = feed(p, [90.0] + [2.8] * 10, 0.0)  # compile step, then settling
    t = feed(p, [2.8] * 10, t)  # the reference window, while shared
    assert p.ref == pytest.approx(2.8)
    t = feed(p, [2.0] * 4, t)  # a few fast steps are not yet a faster pace held
    assert p.ref == pytest.approx(2.8) and p.fields() == {}
    t = feed(p, [2.0] * 6, t)  # a whole window at 2.0: the best pace held
    assert p.ref == pytest.approx(2.0) and p.fields() == {"pace": 1.0, "pace_ref_s": 2.0}
    t = feed(p, [2.8] * 10, t)
    assert p.fields()["pace"] == pytest.approx(1.4) and slowdown(p.fields()["pace"], p.ref, 40) is not None
    assert p.ref == pytest.approx(2.0)  # a slower window never raises the reference
    t = feed(p, [2.1] * 3 + [1.0] + [2.1] * 6, t)  # one fast outlier step does not move a median of the window
    assert p.ref == pytest.approx(2.0)


def test_slowdown_fires_from_the_factor_and_quotes_both_times() -> None:
    assert slowdown(1.29, 2.0, 500) is None and slowdown(None, 2.0, 500) is None and slowdown(1.5, None, 5) is None
    text = slowdown(SLOW_FACTOR, 2.0, 500)
    assert text is not None and "step time 2.60 s at step 500" in text and "1.30x the 2.00 s" in text


def test_the_dashboard_says_slowdown_while_training_and_not_after() -> None:
    r = Run()
    r.feed(run_start(T0), ev_step(1, T0 + 1, 1.0, 2.0))
    assert "slowdown" not in r.alerts(T0 + 1)
    r.feed(ev_step(2, T0 + 2, 1.35, 2.0))
    a = r.alerts(T0 + 2)["slowdown"]
    assert a.severity == "warning" and "1.35x the 2.00 s this attempt has held at its best" in a.evidence
    r.feed(ev_step(3, T0 + 3, 1.1, 2.0))  # back to speed: the alert clears
    assert "slowdown" not in r.alerts(T0 + 3)
    r.feed(ev_step(4, T0 + 4, 1.5, 2.0), run_start(T0 + 5))  # a new attempt: its pace is its own
    assert "slowdown" not in r.alerts(T0 + 5)
    r.feed(ev_step(5, T0 + 6, 1.5, 2.0), {"t": "proc", "ts": T0 + 7, "state": "exited", "pid": 7, "pgid": 7,
                                          "exit_code": 0})
    assert "slowdown" not in r.alerts(T0 + 8)  # a finished run is no longer slow


def ev_step(n: int, ts: float, pace: float, ref: float) -> dict[str, Any]:
    m = step(n, ts, dt=pace * ref)
    m["event"].update(pace=pace, pace_ref_s=ref)
    return m


def test_the_wrapper_notifies_once_per_episode(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text("")
    w = EventsWatch(str(events), None)

    def write(n: int, pace: float | None) -> None:
        line = {"v": 1, "ts": time.time(), "kind": "step", "run_id": "r", "rank": 0, "seq": n, "step": n,
                "step_time_s": 2.0}
        if pace is not None:
            line.update(pace=pace, pace_ref_s=2.0)
        with events.open("a") as fh:
            fh.write(json.dumps(line) + "\n")
        w.poll()

    write(1, None)
    assert w.take_slowdown() is None
    write(2, 1.4)
    told = w.take_slowdown()
    assert told is not None and told[0] == 2 and "1.40x" in told[1]
    write(3, 1.5)
    assert w.take_slowdown() is None  # the same episode: said once
    write(4, 1.0)
    assert w.take_slowdown() is None
    write(5, 1.31)
    assert w.take_slowdown() is not None  # a new episode


def test_a_training_run_writes_its_pace_once_it_settled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_fixtures import run_config

    from dflash.telemetry import read_events
    from dflash.train import train

    monkeypatch.setattr(pace_mod, "SETTLE_S", 0.0)
    monkeypatch.setattr(pace_mod, "WINDOW", 3)
    assert train(run_config(train={"max_steps": 9, "checkpoint_every": 0}), tmp_path).exit_code == 0
    steps = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "step"]
    # step 1 never counts; steps 2-4 are the reference, 5-7 fill the recent window: from step 7 on, a pace
    assert [("pace" in e) for e in steps] == [False] * 6 + [True] * 3
    for e in steps[6:]:
        assert e["pace_ref_s"] > 0 and 0.2 < e["pace"] < 5  # a ratio of medians of this CPU's step times
