"""One truth about a run's state (issue 39 item 1): `status`, its saved fold, `watch --once`, `history` and `export`
skip and count the same events lines (a line of the wrong types among them) and agree on the attempt, its state and
its step; an attempt killed before its run_start is that attempt in both `status` and `watch`.

Real processes: the CLI over the repo's real sshd and the `pct` stand-in, the agent itself (agentlib.drive)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import drive, opsctl, run_args, script_run  # noqa: E402

from dflash.telemetry import EventError, parse_event  # noqa: E402
from opsctl.remote import follow, rules  # noqa: E402
from opsctl.runstate import RunState  # noqa: E402
from opsctl.watch import RunModel  # noqa: E402

FIELDS = ("state", "step", "total_steps", "attempt", "phase", "bad_events", "bad_event", "end_reason", "loss",
          "last_checkpoint")


def _record(r: Any) -> dict[str, Any]:
    assert r.returncode == 0, (r.stdout, r.stderr)
    rec = json.loads(r.stdout)
    rec = rec[0] if isinstance(rec, list) else rec
    return {k: rec[k] for k in FIELDS}


def _wait_for(path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}"
        time.sleep(0.1)


# -- the contract check: the host's copy (remote/rules.py event_problem) and the client's (dflash.telemetry) ----------
MALFORMED = [
    {"kind": "run_start", "resumed_from": "x"}, {"kind": "run_start", "total_steps": "many"},
    {"kind": "run_start", "config": None}, {"kind": 42}, {"ts": 1.0}, {"kind": "heartbeat", "ts": "yesterday"},
    {"kind": "step", "step": "six"}, {"kind": "step", "step": True}, {"kind": "step", "loss": "low"},
    {"kind": "step", "loss": [1]}, {"kind": "step", "acc": [0.5, "x"]}, {"kind": "error", "fatal": "yes"},
    {"kind": "eval", "accept_by_position": [True]}, {"kind": "run_end", "exit_code": 1.5}, {"kind": "step", "v": "1"},
]
GOOD = [
    {"kind": "step", "step": 3, "loss": "nan", "acc": ["nan", 0.5], "lr": "inf"}, {"kind": "future_kind", "x": []},
    {"kind": "run_start", "resumed_from": None, "total_steps": 10, "config": {}}, {"kind": "eval", "tau": None},
    {"kind": "error", "class": "oom", "message": "m", "traceback": None, "fatal": True}, {"kind": "phase"},
]


@pytest.mark.parametrize("ev", MALFORMED + GOOD)
def test_the_hosts_check_judges_every_line_as_the_clients_does(ev: dict[str, Any]) -> None:
    try:
        parse_event(dict(ev), complete=False)
        client = None
    except (EventError, TypeError) as exc:  # TypeError: dflash's float-word lookup of an unhashable value
        client = str(exc)
    host = rules.event_problem(dict(ev))
    assert (host is None) == (client is None) == (ev in GOOD), (host, client)


def test_the_hosts_copy_of_the_contract_is_the_contract() -> None:
    from dflash import telemetry

    def names(types: tuple[type, ...]) -> set[str]:
        return {"float|int" if t is float else "None" if t is type(None) else t.__name__ for t in types} - (
            {"int"} if float in types else set())

    assert {k: names(v) for k, v in telemetry.COMMON.items()} == {k: set(v) for k, v in rules.EVENT_COMMON.items()}
    assert telemetry.KINDS.keys() == rules.EVENT_KINDS.keys()
    for kind, spec in telemetry.KINDS.items():
        assert {k: names(v) for k, v in spec.items()} == {k: set(v) for k, v in rules.EVENT_KINDS[kind].items()}, kind


# -- the CLI's views over ssh + pct --------------------------------------------------------------------------------
def test_lines_of_the_wrong_types_leave_every_view_on_one_state_and_step(tmp_path: Path, sshd,
                                                                        container: Callable[..., int]) -> None:
    """The run of the issue: 13 steps, then a run_start with "resumed_from": "x", "total_steps": "many",
    "config": null, a line with "kind": 42, one with "ts": "yesterday", a step with "step": "six"; 13 more steps."""
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=container(200), runs={
        "m": script_run(tmp_path, "malformed_run.py", "--hold", "600", tmux_session="one-state-m", kill_grace=[1, 1])})
    try:
        assert opsctl(hosts, "launch", "box", "m").returncode == 0
        _wait_for(tmp_path / "run.log", "holding")
        st = _record(opsctl(hosts, "status", "box", "m", "--json"))
        wa = _record(opsctl(hosts, "watch", "box", "--once", "--json"))
        assert st == wa
        assert (st["state"], st["step"], st["total_steps"], st["attempt"], st["bad_events"]) == (
            "training", 26, 26, 1, 4), st
        assert "key 'step' must be int, got str" in st["bad_event"], st
        assert opsctl(hosts, "kill", "box", "m").returncode == 0
        st = _record(opsctl(hosts, "status", "box", "m", "--json"))
        assert st == _record(opsctl(hosts, "watch", "box", "--once", "--json"))
        assert (st["state"], st["step"], st["bad_events"]) == ("killed", 26, 4), st
        (h,) = json.loads(opsctl(hosts, "history", "box", "m", "--json").stdout)
        assert (h["first_step"], h["last_step"], h["outcome"]) == (1, 26, "killed"), h
        r = opsctl(hosts, "export", "box", "m", "--tensorboard", str(tmp_path / "tb"))
        flat = " ".join(r.stderr.split())
        assert r.returncode == 0 and ": 26 steps," in flat and "4 bad event lines skipped" in flat, r.stderr
    finally:
        opsctl(hosts, "kill", "box", "m")


def test_an_attempt_killed_before_its_run_start_is_the_same_attempt_in_status_and_watch(
        tmp_path: Path, sshd, container: Callable[..., int]) -> None:
    vmid = container(200)
    run = script_run(tmp_path, "ok_run.py", "--steps", "3", "--step-time", "0.01", "--load-time", "0",
                     tmux_session="one-state-k", kill_grace=[1, 1])
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=vmid, runs={"k": run})
    try:
        assert opsctl(hosts, "launch", "box", "k", "--follow").returncode == 0
        # the next attempt dies in its imports: no event of its own (the events file still ends with the last one's)
        run["command"] = ["{python}", "-c", "import time; print('importing torch', flush=True); time.sleep(600)"]
        run["ready_pattern"] = "^never"
        run["ready_timeout"] = 1
        hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=vmid, runs={"k": run})
        opsctl(hosts, "launch", "box", "k")
        _wait_for(tmp_path / "run.log", "importing torch")
        running = [_record(opsctl(hosts, verb, "box", *args, "--json")) for verb, args in
                   (("status", ("k",)), ("watch", ("--once",)))]
        assert running[0] == running[1]
        assert (running[0]["attempt"], running[0]["step"], running[0]["total_steps"]) == (2, 0, None), running
        assert opsctl(hosts, "kill", "box", "k").returncode == 0
        st = _record(opsctl(hosts, "status", "box", "k", "--json"))
        wa = _record(opsctl(hosts, "watch", "box", "--once", "--json"))
        assert st == wa
        assert (st["state"], st["attempt"], st["step"], st["total_steps"], st["phase"]) == (
            "killed", 2, 0, None, None), st
    finally:
        opsctl(hosts, "kill", "box", "k")


# -- the agent's own readers: status, its saved fold, the full and the thinned watch backlog -----------------------
def test_status_its_fold_and_both_watch_backlogs_skip_and_count_the_same_lines(tmp_path: Path) -> None:
    t0 = time.time() - 100_000
    args = run_args(tmp_path, "", command=["true"])
    state = Path(args["state_dir"])
    state.mkdir()
    (state / "launch.json").write_text(json.dumps({"ts": t0, "events": args["events"]}))

    def line(kind: Any, n: int, **kw: Any) -> str:
        return json.dumps({"v": 1, "ts": t0 + n, "kind": kind, "run_id": "x", "rank": 0, "seq": n, **kw}) + "\n"

    def steps(a: int, b: int) -> str:
        return "".join(line("step", s, step=s, loss=1.0 / s, acc=[0.5], lr=1e-3, tokens=100, tokens_per_s=500.0,
                            step_time_s=1.0, total_steps=30_000, pad="x" * 300) for s in range(a, b + 1))

    bad = (line("run_start", 15_000, resumed_from="x", total_steps="many", config=None) + line(42, 15_000)
           + line("heartbeat", 15_000, phase="training", step=3).replace(f'"ts": {t0 + 15_000}', '"ts": "yesterday"')
           + line("step", 15_000, step="six"))
    events = Path(args["events"])
    events.write_text(line("run_start", 0, total_steps=30_000, resumed_from=None) + steps(1, 15_000) + bad)
    assert events.stat().st_size > follow.FOLD_AFTER_BYTES  # status saves its fold here

    def status() -> dict[str, Any]:  # as commands.run_status folds it
        rc, msgs = drive("status", args)
        assert rc == 0
        state = RunState()
        for m in msgs:
            state.apply(m)
        view = state.view(t0 + 30_010).to_dict()
        return {k: view[k] for k in FIELDS}

    def watch(thin: bool) -> dict[str, Any]:
        rc, msgs = drive("follow", {**args, "options": {"log_offset": -1, "events_offset": 0, "tail": 0, "once": True,
                                                        "gpu_interval": 0, "thin_history": thin}}, timeout=120)
        assert rc == 0
        model = RunModel("box:r", clock=lambda: t0 + 30_010)
        for m in msgs:
            if m["t"] not in ("bye", "verdict"):
                model.ingest(m)
        return {k: model.snapshot()[k] for k in FIELDS}

    first = status()
    assert (state / follow.FOLD_FILE).is_file()
    with events.open("a") as fh:
        fh.write(steps(15_001, 30_000 - 5))
    views = {"status (fold)": status(), "status (full)": None, "watch": watch(False), "watch (thinned)": watch(True)}
    (state / follow.FOLD_FILE).unlink()
    views["status (full)"] = status()
    assert first["step"] == 15_000 and first["bad_events"] == 4, first
    want = views["watch"]
    assert all(v == want for v in views.values()), views
    assert (want["state"], want["step"], want["total_steps"], want["bad_events"]) == ("training", 29_995, 30_000, 4)
