"""One ETA (opsctl.remote.rules.EtaClock) in `status`, `status --json`, `watch --once` and the dashboard's RunModel,
checked against a run whose wall time per step is known (tests/runs/eta_run.py: steps 2.0 s apart, each saying a
step_time_s of 0.5 s), over a real sshd.

They disagreed (175 s vs 480 s with ~300 s left): status folded only the snapshot's last 20 step_time_s values into
an EMA, watch the whole run's, and step_time_s leaves out everything between steps. The same clock gives the run's
tokens/s: status showed the last step's own figure (its compute alone: 4x the true rate here; 217k against 51k tok/s
at the end of a colocated run), watch an average of those.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import opsctl, script_run  # noqa: E402

from opsctl import commands  # noqa: E402
from opsctl.remote.rules import EtaClock  # noqa: E402
from opsctl.watch import RunModel, SourceWorker, fmt_duration  # noqa: E402

STEPS, TOTAL, WALL, COMPUTE = 300, 1000, 2.0, 0.5
TRUE_REMAINDER = (TOTAL - STEPS) * WALL


def _model_view(hosts: Path) -> tuple[float | None, float | None]:
    """The dashboard's own model fed by the real AgentSource until it has the run's last step."""
    (src,) = commands.watch_sources(commands.Ctx(hosts_file=str(hosts)), ["box:eta"])
    model = RunModel(src.label)
    worker = SourceWorker(src).start()
    try:
        deadline = time.monotonic() + 60
        while (model.view().step != STEPS or model.view().state != "training") and time.monotonic() < deadline:
            other, _, _ = worker.drain()
            for m in other:
                model.ingest(m)
            time.sleep(0.05)
    finally:
        worker.stop()
    view = model.view()
    assert view.step == STEPS and view.state == "training", view
    return view.eta_s, view.tokens_per_s_avg


def test_status_and_watch_show_one_eta_near_the_true_remainder(tmp_path: Path, sshd) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"eta": script_run(
        tmp_path, "eta_run.py", "--steps", str(STEPS), "--total", str(TOTAL), "--wall", str(WALL),
        "--compute", str(COMPUTE), tmux_session="st-eta")})
    try:
        r = opsctl(hosts, "launch", "box", "eta")
        assert r.returncode == 0, r.stderr
        (st,) = json.loads(opsctl(hosts, "status", "box", "eta", "--json").stdout)
        assert st["state"] == "training" and st["step"] == STEPS, st
        eta = st["eta_s"]
        assert eta == pytest.approx(TRUE_REMAINDER, rel=0.05), eta  # the old rule said 700 x 0.5 s = 350 s
        (snap,) = json.loads(opsctl(hosts, "watch", "--once", "box:eta", timeout=120).stdout)
        assert snap["step"] == STEPS and snap["eta_s"] == pytest.approx(eta, rel=1e-9), snap
        # tokens/s: 100 real tokens per step over ~2.0 wall seconds, not the 100 / 0.5 s each step event says
        rate = st["tokens_per_s_avg"]
        assert st["tokens_per_s"] == pytest.approx(100 / COMPUTE) and rate == pytest.approx(100 / WALL, rel=0.05), st
        assert snap["tokens_per_s_avg"] == pytest.approx(rate, rel=1e-9), snap
        assert _model_view(hosts) == pytest.approx((eta, rate), rel=1e-9)
        table = opsctl(hosts, "status", "box", "eta").stdout
        (row,) = [ln for ln in table.splitlines() if ln.startswith("│") and " eta " in ln]
        assert f" {fmt_duration(eta)} " in row, (fmt_duration(eta), row)
        cells = [c.strip() for c in row.split("│")]
        assert f"{rate:.0f}" in cells and f"{100 / COMPUTE:.0f}" not in cells, row
    finally:
        opsctl(hosts, "kill", "box", "eta")
        opsctl(hosts, "clean", "box", "eta")


def _step(n: int, ts: float, step_time: float = 1.0) -> dict:
    return {"kind": "step", "step": n, "ts": ts, "step_time_s": step_time}


def test_eta_clock_counts_wall_time_and_one_slow_step_barely_moves_it() -> None:
    clock = EtaClock()
    clock.note(_step(1, 0.0, step_time=0.3))
    assert clock.eta(1, 11) == pytest.approx(10 * 0.3)  # one step event: its step_time_s is all there is
    for n in range(2, 101):
        clock.note(_step(n, (n - 1) * 1.0, step_time=0.3))
    before = clock.eta(100, 1000)
    assert before == pytest.approx(900.0)  # the wall clock between steps, not their 0.3 s of compute
    clock.note(_step(101, 99.0 + 600.0))  # a 10-minute checkpoint
    assert clock.eta(101, 1000) < 1.15 * before
    ts = 699.0
    for n in range(102, 262):  # the run really got slower: the ETA follows within a few dozen steps
        ts += 2.0
        clock.note(_step(n, ts))
    assert clock.eta(261, 1000) == pytest.approx((1000 - 261) * 2.0, rel=0.05)
    copy = EtaClock()
    copy.load(json.loads(json.dumps(clock.state())))  # as the agent's status sends it
    assert copy.eta(261, 1000) == clock.eta(261, 1000)
    clock.note({"kind": "run_start", "ts": ts})  # a resumed attempt's speed is its own
    assert clock.eta(261, 1000) is None


def test_slow_first_steps_do_not_set_the_pace() -> None:
    """A run's first intervals (compile, first evaluation) at 30x and 8x the steady 1 s: the ETA is the steady one
    within a few steps (the old average seeded with 30 s still said ~2.4x after 20 steps), and survives status."""
    clock = EtaClock()
    ts = 0.0
    clock.note(_step(1, ts))
    for n, dt in zip(range(2, 5), (30.0, 8.0, 1.0), strict=True):
        ts += dt
        clock.note(_step(n, ts))
    for n in range(5, 10):
        ts += 1.0
        clock.note(_step(n, ts))
    assert clock.eta(9, 1009) == pytest.approx(1000.0, rel=0.05)
    for n in range(10, 60):  # past the warm-up the moving average takes over from the median, at the same pace
        ts += 1.0
        clock.note(_step(n, ts))
    assert clock.eta(59, 1059) == pytest.approx(1000.0, rel=0.05)
    copy = EtaClock()
    copy.load(json.loads(json.dumps(clock.state())))
    ts += 1.0
    copy.note(_step(60, ts))
    clock.note(_step(60, ts))
    assert copy.eta(60, 1060) == clock.eta(60, 1060)


def _tstep(n: int, ts: float, step_time: float, tps: float) -> dict:
    return {**_step(n, ts, step_time), "tokens_per_s": tps}


def test_the_run_rate_is_real_tokens_per_wall_second_and_an_odd_step_barely_moves_it() -> None:
    """A colocated run as the 4B-like H100 run was (16,384 tokens a step, ~0.32 s apart): a 60-s checkpoint step and
    the last steps that only train (the target ran ahead by the reservoir: 0.08 s, 205k tok/s each) move the rate a
    little; the step events' own tokens_per_s say 4x. The rate survives status's transfer and a new attempt resets it."""
    clock = EtaClock()
    assert clock.tokens_per_s() is None
    tokens, ts = 16384.0, 0.0
    clock.note(_tstep(1, ts, 20.0, tokens / 20.0))  # the compiled first step: its own figure until an interval exists
    assert clock.tokens_per_s() == pytest.approx(tokens / 20.0)
    ts += 20.0
    for n in range(2, 200):
        ts += 0.32
        clock.note(_tstep(n, ts, 0.30, tokens / 0.30))  # 0.02 s of data wait between steps: the wall clock counts it
    steady = tokens / 0.32
    assert clock.tokens_per_s() == pytest.approx(steady, rel=0.02)
    ts += 60.0
    clock.note(_tstep(200, ts, 0.30, tokens / 0.30))  # a checkpoint between steps
    assert clock.tokens_per_s() > 0.85 * steady
    for n in range(201, 204):
        ts += 0.08
        clock.note(_tstep(n, ts, 0.08, tokens / 0.08))
    assert clock.tokens_per_s() < 1.3 * steady  # a step event's own figure: 205k, 4x
    copy = EtaClock()
    copy.load(json.loads(json.dumps(clock.state())))  # as the agent's status sends it
    assert copy.tokens_per_s() == clock.tokens_per_s()
    old = clock.state()
    del old["tokens"]  # a fold the agent saved before the rate existed: no rate until the next step, not a crash
    copy.load(old)
    assert copy.tokens_per_s() is None
    clock.note({"kind": "run_start", "ts": ts})
    assert clock.tokens_per_s() is None
