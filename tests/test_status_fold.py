"""`status` on a long run goes on from where the last one stopped reading (opsctl.remote.follow fold_resume / fold_save):
the same answer as a full read, from the saved fold when the events file is still the same file and attempt, and
a full read whenever it is not. Real agent processes (tests/runs/agentlib.drive), real files."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import drive, of, run_args  # noqa: E402

from opsctl.remote import follow  # noqa: E402

T0 = time.time() - 10_000


def _line(kind: str, n: int, **kw: Any) -> str:
    return json.dumps({"v": 1, "ts": T0 + n, "kind": kind, "run_id": "x", "rank": 0, "seq": n, **kw}) + "\n"


def _steps(first: int, last: int, evals_every: int = 500) -> str:
    out = []
    for s in range(first, last + 1):
        out.append(_line("step", s, step=s, loss=1.0 / s, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=100,
                         tokens_per_s=500.0, step_time_s=1.0, pad="x" * 200, total_steps=100_000))
        if s % evals_every == 0:
            out.append(_line("eval", s, step=s, tau=2.0 + (s % 7000) / 1000, ngram_tau=1.4, sequences=32))
    return "".join(out)


def _status(args: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    rc, msgs = drive("status", args)
    assert rc == 0
    st = of(msgs, "status")[0]
    return ([(m["off"], m["end"], m["event"]) for m in of(msgs, "event")],
            {k: st[k] for k in ("events_size", "bad_events", "bad_event", "eta_clock")})


def _setup(tmp_path: Path) -> tuple[dict[str, Any], Path, Path]:
    args = run_args(tmp_path, "", command=["true"])
    state = Path(args["state_dir"])
    state.mkdir()
    (state / "launch.json").write_text(json.dumps({"ts": T0, "events": args["events"]}))
    events = Path(args["events"])
    events.write_text(_line("run_start", 0, total_steps=100_000, resumed_from=None) + _steps(1, 20_000)
                      + "not json\n")
    return args, events, state / follow.FOLD_FILE


def test_a_second_status_goes_on_from_the_saved_fold_and_answers_as_a_full_read(tmp_path: Path) -> None:
    args, events, fold = _setup(tmp_path)
    assert events.stat().st_size > follow.FOLD_AFTER_BYTES
    first = _status(args)
    assert fold.is_file() and json.loads(fold.read_text())["mark"]["offset"] == events.stat().st_size
    with events.open("a") as fh:  # the run goes on: steps, an error, an evaluation, a line that is no event
        fh.write(_steps(20_001, 20_600) + _line("error", 20_600, fatal=False, message="warn") + "{broken\n")
    resumed = _status(args)
    assert resumed != first and resumed[1]["events_size"] == events.stat().st_size
    fold.unlink()
    assert _status(args) == resumed  # a full read gives the same events, ETA, bad lines
    # The fold is trusted for what it read: an early evaluation rewritten in place (same size) far before the
    # checked tail is not seen again, which proves the second status did not read the file from its start.
    _status(args)
    text = events.read_text()
    i = text.index('"kind": "eval"')
    j = text.index('"tau": ', i) + len('"tau": ')
    events.write_text(text[:j] + "9.0" + text[j + 3:])
    assert 9.0 not in _taus(_status(args))
    fold.unlink()
    assert 9.0 in _taus(_status(args))  # the full read sees it


def _taus(result: tuple[list[Any], dict[str, Any]]) -> list[Any]:
    """The τ of every eval event status sent (not a substring of the whole answer: a timestamp such as
    1796468189.0197 holds "9.0" too, which made this test fail on the clock)."""
    return [ev.get("tau") for _, _, ev in result[0] if ev.get("kind") == "eval"]


def test_a_replaced_file_or_a_new_attempt_is_read_in_full(tmp_path: Path) -> None:
    args, events, fold = _setup(tmp_path)
    _status(args)
    assert fold.is_file()
    # The same size and inode, other bytes before the offset (a run restarted fresh truncates and rewrites):
    text = events.read_text()
    events.write_text(text.replace('"loss": 5e-05', '"loss": 6e-05'))
    fresh = _status(args)
    fold.unlink()
    assert _status(args) == fresh
    # A new attempt (launch.json's time moved): the saved fold is of another attempt.
    _status(args)
    launch = Path(args["state_dir"]) / "launch.json"
    launch.write_text(json.dumps({"ts": T0 + 15_000, "events": args["events"]}))
    with events.open("a") as fh:
        fh.write(_line("run_start", 15_001, total_steps=100_000, resumed_from=20_000) + _steps(20_001, 20_050))
    again = _status(args)
    fold.unlink()
    assert _status(args) == again
    assert again[1]["eta_clock"]["last"][0] == 20_050


def _beats(first: int, last: int, retries: Any) -> str:
    """A step event each second and a heartbeat every 5 with gpu_alloc_retries retries(step)."""
    out = []
    for s in range(first, last + 1):
        out.append(_line("step", s, step=s, loss=1.0 / s, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=100,
                         tokens_per_s=500.0, step_time_s=1.0, pad="x" * 200, total_steps=100_000))
        if s % 5 == 0:
            out.append(_line("heartbeat", s, phase="training", step=s, rss_mb=100.0, gpu_mem_mb=60000.0,
                             gpu_reserved_mb=70000.0, gpu_alloc_retries=retries(s)))
    return "".join(out)


def _memory_alert(args: dict[str, Any]) -> str | None:
    """The alloc_retries alert `status` raises (the client's AlertTracker over the agent's answer)."""
    import dataclasses

    from opsctl.alerts import AlertTracker
    from opsctl.runstate import RunState

    rc, msgs = drive("status", args)
    assert rc == 0
    tracker, state = AlertTracker(), RunState()
    for m in msgs:
        tracker.observe(m)
        state.apply(m)
    # no process was ever started here; the rule holds while a run trains (or stalls), as this one would be
    view = dataclasses.replace(state.view(), state="training")
    alerts = {a.key: a.evidence for a in tracker.evaluate(view, time.time())}
    return alerts.get("alloc_retries")


def test_status_raises_the_allocator_alert_from_every_heartbeat_of_the_attempt_read_whole_or_from_the_fold(
        tmp_path: Path) -> None:
    """status sends one heartbeat, but its agent runs the memory rules over all of them (a saved fold carries their
    windows): allocator retries within the last 10 minutes of the attempt are an alert either way."""
    args, events, fold = _setup(tmp_path)
    events.write_text(_line("run_start", 0, total_steps=100_000, resumed_from=None)
                      + _line("phase", 1, phase="training") + _beats(1, 20_000, lambda s: 0))
    assert _memory_alert(args) is None and fold.is_file()
    with events.open("a") as fh:  # two retries near the end: the window's base (step 19700) is in the fold
        fh.write(_beats(20_001, 20_300, lambda s: 2 if s >= 20_200 else 0))
    resumed = _memory_alert(args)
    assert resumed is not None and resumed.startswith(
        "rank 0: 2 allocator retries in 10 min (steps 19700-20300; 2 since its process started)"), resumed
    fold.unlink()
    assert _memory_alert(args) == resumed  # a full read: the same
