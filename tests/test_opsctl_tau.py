"""τ live during training (issue 22 part 2), through a real sshd and the `pct` stand-in: a run that writes `eval`
events (tests/runs/eval_run.py, through dflash.telemetry's writer) crashes, is restarted with its resume argument by
the wrapper, and ends with τ below its best. status (table and JSON), watch --once, history, the tau_regression alert
and its notify all tell the same story; a run's own thresholds in hosts.yaml silence it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import opsctl, script_run  # noqa: E402
from test_notify import lines, recorder  # noqa: E402

from opsctl import commands  # noqa: E402
from opsctl.remote.rules import TauTrack, tau_regression  # noqa: E402

# evaluations every 2 steps: 2.0 @2, 3.7 @4 (the best), 3.5 @6, crash after 7; resumed after 6: 3.2 @8, 3.1 @10
TAUS = "2.0,3.7,3.5,3.2,3.1"
RESTART = {"when": "on-failure", "max": 1, "backoff_s": 0.5, "resume_args": ["--resume-step", "6"]}


@pytest.fixture
def ct(container: Callable[..., int]) -> int:
    return container(200)


def eval_run(d: Path, *extra: str, **over: Any) -> dict[str, Any]:
    d.mkdir(exist_ok=True)
    return script_run(d, "eval_run.py", "--taus", TAUS, "--steps", "10", "--step-time", "0.3", "--crash-at", "7",
                      *extra, restart=RESTART, tmux_session=f"tau-{d.name}", **over)


def write_hosts(sshd: Any, path: Path, ct: int, runs: dict[str, Any], notify: list[str]) -> Path:
    sshd.write_hosts_yaml(path, pct=ct, runs=runs)
    doc = yaml.safe_load(path.read_text())
    doc["hosts"]["box"]["notify"] = notify
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def status_json(hosts: Path, run: str) -> dict[str, Any]:
    r = opsctl(hosts, "status", "box", run, "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)
    return row


def test_tau_latest_and_best_across_a_resume_in_status_watch_history_alert_and_notify(tmp_path: Path, sshd,
                                                                                       ct: int) -> None:
    out, quiet_out = tmp_path / "notes", tmp_path / "quiet-notes"
    hosts = write_hosts(sshd, tmp_path / "hosts.yaml", ct, {"r": eval_run(tmp_path / "r")}, recorder(out))
    quiet = write_hosts(sshd, tmp_path / "quiet.yaml", ct, {
        "q": eval_run(tmp_path / "q", tau_regression={"drop_frac": 0.5, "drop_min": 0.2})}, recorder(quiet_out))
    assert opsctl(hosts, "launch", "box", "r", "--follow").returncode == commands.EXIT_OK
    assert opsctl(quiet, "launch", "box", "q", "--follow").returncode == commands.EXIT_OK

    # status --json: the latest τ of attempt 2 and the best, which attempt 1 measured (before the current
    # attempt's own events: the agent sends it across attempts)
    row = status_json(hosts, "r")
    assert row["state"] == "finished" and row["attempt"] == 2, row
    assert (row["tau"], row["tau_step"], row["tau_best"], row["tau_best_step"]) == (3.1, 10, 3.7, 4), row
    assert row["ngram_tau"] == 1.8 and row["tau_ci95"] == pytest.approx([3.0, 3.2]), row
    (alert,) = [a for a in row["alerts"] if a["key"] == "tau_regression"]
    assert alert["severity"] == "warning"
    assert alert["evidence"].startswith("best tau 3.70 at step 4, now 3.10 at step 10 (-0.60, -16 %"), alert
    # the run's own margin (50 %) keeps it quiet; its τ is shown all the same
    qrow = status_json(quiet, "q")
    assert (qrow["tau"], qrow["tau_best"]) == (3.1, 3.7) and not [a for a in qrow["alerts"]
                                                                  if a["key"] == "tau_regression"], qrow

    # the table: three τ columns, the step of each in brackets
    table = opsctl(hosts, "status", "box", "r")
    assert table.returncode == 0
    assert "τ (step)" in table.stdout and "best τ (step)" in table.stdout and "n-gram τ" in table.stdout
    (line,) = [ln for ln in table.stdout.splitlines() if ln.startswith("│ r ")]
    assert "3.10 (10)" in line and "3.70 (4)" in line and "1.80" in line, table.stdout

    # watch --once: the same record (it reads the whole events file: same latest and best)
    r = opsctl(hosts, "watch", "--once", "box:r", timeout=120)
    (snap,) = json.loads(r.stdout)
    assert (snap["tau"], snap["tau_step"], snap["tau_best"], snap["tau_best_step"]) == (3.1, 10, 3.7, 4), snap
    assert any(a["key"] == "tau_regression" for a in snap["alerts"]), snap

    # history: each attempt's own last and best τ
    r = opsctl(hosts, "history", "box", "r", "--json")
    assert r.returncode == 0, r.stderr
    a1, a2 = json.loads(r.stdout)
    assert (a1["last_tau"], a1["last_tau_step"], a1["best_tau"], a1["best_tau_step"]) == (3.5, 6, 3.7, 4), a1
    assert (a2["last_tau"], a2["last_tau_step"], a2["best_tau"], a2["best_tau_step"]) == (3.1, 10, 3.2, 8), a2
    r = opsctl(hosts, "history", "box", "r")
    assert "last τ (step)" in r.stdout and "best τ (step)" in r.stdout
    first, second = [ln for ln in r.stdout.splitlines() if ln.startswith(("│ 1 ", "│ 2 "))]
    assert "3.50 (6)" in first and "3.70 (4)" in first and "3.10 (10)" in second and "3.20 (8)" in second, r.stdout

    # notify: once, in attempt 2, when τ fell more than the margin below attempt 1's best; never for q
    got = lines(out, 3)
    time.sleep(1.0)
    got = lines(out, 3)
    assert [g[2:4] for g in got] == [["1", "restarting"], ["2", "tau_regression"], ["2", "finished"]], got
    assert got[1][4] in ("8", "10") and got[1][5].startswith("best tau 3.70 at step 4, now "), got
    assert [g[3] for g in lines(quiet_out, 2)] == ["restarting", "finished"]


def test_a_run_evaluating_is_training_with_its_phase(tmp_path: Path, sshd, ct: int) -> None:
    """The periodic `evaluating` phase (heartbeats carry it) is part of training, like `saving`: never loading."""
    run = script_run(tmp_path, "eval_run.py", "--taus", "2.0,2.5", "--steps", "4", "--step-time", "0.05",
                     "--hold-eval-s", "6", tmux_session="tau-hold")
    hosts = write_hosts(sshd, tmp_path / "hosts.yaml", ct, {"r": run}, recorder(tmp_path / "notes"))
    assert opsctl(hosts, "launch", "box", "r").returncode == commands.EXIT_OK
    deadline = time.monotonic() + 60
    row = status_json(hosts, "r")
    while row["phase"] != "evaluating" and time.monotonic() < deadline:
        time.sleep(0.3)
        row = status_json(hosts, "r")
    assert row["phase"] == "evaluating" and row["state"] == "training", row
    assert (row["tau"], row["tau_step"]) == (2.0, 2), row  # the evaluation at step 4 is still running
    while row["state"] != "finished" and time.monotonic() < deadline:
        time.sleep(0.3)
        row = status_json(hosts, "r")
    assert row["state"] == "finished" and (row["tau"], row["tau_step"], row["tau_best_step"]) == (2.5, 4, 4), row


def test_tau_track_forgets_evaluations_a_resume_or_fresh_start_discards() -> None:
    """As the charts do with steps: a resume from step S drops later evaluations, a fresh start all of them, and an
    evaluation at an earlier step than the last replaces what came after it."""
    t = TauTrack()
    for step, tau in ((2, 2.0), (4, 3.7), (6, 3.5)):
        t.note({"kind": "eval", "step": step, "tau": tau, "ngram_tau": 1.8})
    assert t.note({"kind": "run_start", "resumed_from": 2}) and [e["step"] for e in t.evals] == [2]
    t.note({"kind": "eval", "step": 4, "tau": None, "ngram_tau": None})  # nothing verified: no τ, never best
    assert t.latest()["tau"] is None and t.best()["step"] == 2 and t.regression() is None
    t.note({"kind": "eval", "step": 2, "tau": 2.5, "ngram_tau": 1.8})
    assert [e["step"] for e in t.evals] == [2] and t.best()["tau"] == 2.5
    assert t.note({"kind": "run_start", "resumed_from": None}) and t.latest() is None
    assert not t.note({"kind": "step", "step": 3})


def test_tau_regression_margin_is_relative_with_an_absolute_floor() -> None:
    assert tau_regression(3.0, 10, 2.75, 20) is None  # -0.25 < 10 % of 3.0 = 0.3
    assert tau_regression(3.0, 10, 2.69, 20) is not None
    assert tau_regression(1.5, 10, 1.31, 20) is None  # -0.19: 10 % is 0.15, but at least 0.2
    assert tau_regression(1.5, 10, 1.29, 20, frac=0.1, least=0.2) is not None
    assert tau_regression(1.5, 10, 1.29, 20, frac=0.1, least=0.5) is None
    assert tau_regression(None, None, 2.0, 20) is None and tau_regression(3.0, 10, None, 20) is None
