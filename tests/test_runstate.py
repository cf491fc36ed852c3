"""The shared run-state reducer: every view (launch, status, watch) derives state the same way.

States follow docs/events.md "Run state, as opsctl derives it".
"""

from __future__ import annotations

from typing import Any

from opsctl.runstate import RunState

T0 = 1_000_000.0


def ev(kind: str, ts: float, **fields: Any) -> dict[str, Any]:
    return {"t": "event", "ts": ts, "event": {"v": 1, "ts": ts, "kind": kind, "run_id": "r", "rank": 0, "seq": 0,
                                                **fields}}


def proc(state: str, ts: float, exit_code: int | None = None) -> dict[str, Any]:
    return {"t": "proc", "ts": ts, "state": state, "pid": 42, "pgid": 42, "exit_code": exit_code}


def run_start(ts: float) -> dict[str, Any]:
    return ev("run_start", ts, config={}, versions={}, kernels={"causal_conv1d_fn": "torch-fallback"}, device="cpu",
              world_size=1, roles={"colocated": [0]}, resumed_from=None, pid=42, host="h", total_steps=100)


def step(n: int, ts: float, dt: float = 1.0, loss: float = 2.0) -> dict[str, Any]:
    return ev("step", ts, step=n, epoch=0, loss=loss, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=10,
              tokens_per_s=10.0, step_time_s=dt, queue_depth=1, queue_wait_s=0.0, recompiles=0, total_steps=100)


def test_absent_then_starting_then_loading_with_progress() -> None:
    rs = RunState()
    assert rs.view(T0).state == "absent"
    rs.apply(proc("running", T0))
    assert rs.view(T0).state == "starting"
    rs.apply(run_start(T0 + 1))
    rs.apply(ev("phase", T0 + 2, phase="loading_target", i=3, n=8))
    v = rs.view(T0 + 3)
    assert (v.state, v.phase, v.phase_i, v.phase_n) == ("loading", "loading_target", 3, 8)
    assert v.kernels == {"causal_conv1d_fn": "torch-fallback"}
    rs.apply(ev("phase", T0 + 4, phase="compiling"))
    assert rs.view(T0 + 5).state == "compiling"


def test_heartbeats_say_the_phase_until_phase_events_arrive() -> None:
    """A group node without global rank 0 gets only its ranks' heartbeats: the latest one's phase is where it is (not
    the first one's); once phase or step events arrive they are the truth, and a new attempt starts over."""
    rs = RunState()
    rs.apply(proc("running", T0))
    rs.apply(ev("heartbeat", T0 + 1, phase="loading_target"))
    rs.apply(ev("heartbeat", T0 + 2, phase="compiling"))
    assert rs.view(T0 + 2).phase == "compiling"
    rs.apply(run_start(T0 + 3))
    rs.apply(ev("phase", T0 + 4, phase="loading_data"))
    rs.apply(ev("heartbeat", T0 + 5, phase="loading_target"))  # a heartbeat thread's older word: events win
    assert rs.view(T0 + 5).phase == "loading_data"
    rs.apply(step(1, T0 + 6))
    rs.apply(ev("heartbeat", T0 + 7, phase="compiling"))
    assert rs.view(T0 + 7).phase == "training"
    rs.apply(run_start(T0 + 8))  # a resumed attempt: its heartbeats count again until its own phase events
    rs.apply(ev("heartbeat", T0 + 9, phase="loading_target"))
    assert rs.view(T0 + 9).phase == "loading_target"


def test_training_view_has_step_loss_and_eta() -> None:
    rs = RunState()
    rs.apply(proc("running", T0))
    rs.apply(run_start(T0))
    for n in range(1, 11):
        rs.apply(step(n, T0 + n * 2.0, dt=2.0, loss=3.0 - n * 0.1))
    v = rs.view(T0 + 21)
    assert v.state == "training" and v.step == 10
    assert abs(v.loss - 2.0) < 1e-9
    assert v.eta_s == 90 * 2.0
    assert v.heartbeat_age_s == 1.0


def test_stalled_after_floor_or_multiple_of_median_step_time() -> None:
    rs = RunState()
    rs.apply(proc("running", T0))
    rs.apply(run_start(T0))
    for n in range(1, 6):
        rs.apply(step(n, T0 + n * 10.0, dt=10.0))
    last = T0 + 50
    assert rs.view(last + 99).state == "training"  # 10 x median 10 s = 100 s
    assert rs.view(last + 101).state == "stalled"
    # A heartbeat is progress too: a long compile with heartbeats is not a stall.
    rs.apply(ev("heartbeat", last + 150, phase="training", step=5, rss_mb=1.0, gpu_mem_mb=None))
    assert rs.view(last + 160).state == "training"


def test_configured_stall_after_wins() -> None:
    rs = RunState(stall_after_s=5)
    rs.apply(proc("running", T0))
    rs.apply(run_start(T0))
    assert rs.view(T0 + 4).state == "loading"
    assert rs.view(T0 + 6).state == "stalled"


def test_finished_crashed_killed() -> None:
    done = RunState()
    for m in (proc("running", T0), run_start(T0), step(1, T0 + 1),
              ev("run_end", T0 + 2, reason="completed", exit_code=0, step=1), proc("exited", T0 + 2, 0)):
        done.apply(m)
    assert done.view(T0 + 3).state == "finished"

    crashed = RunState()
    for m in (proc("running", T0), run_start(T0),
              ev("error", T0 + 1, **{"class": "oom", "message": "CUDA out of memory", "traceback": "tb", "fatal": True}),
              ev("run_end", T0 + 1, reason="error", exit_code=1, step=0)):
        crashed.apply(m)
    v = crashed.view(T0 + 2)
    assert v.state == "crashed" and v.errors[0]["class"] == "oom"

    vanished = RunState()  # died without run_end (SIGKILL, segfault)
    for m in (proc("running", T0), run_start(T0), proc("exited", T0 + 1, 137)):
        vanished.apply(m)
    assert vanished.view(T0 + 2).state == "crashed"

    killed = RunState()
    for m in (proc("running", T0), run_start(T0), {"t": "killed", "ts": T0 + 1, "signal": "SIGINT", "pgid": 42,
                                                     "alive": [42]},
              ev("run_end", T0 + 2, reason="signal", exit_code=0, step=3)):
        killed.apply(m)
    assert killed.view(T0 + 3).state == "killed"

    # A signal that opsctl did not send (someone's Ctrl-C) is a clean finish.
    interrupted = RunState()
    for m in (proc("running", T0), run_start(T0), ev("run_end", T0 + 2, reason="signal", exit_code=0, step=3)):
        interrupted.apply(m)
    assert interrupted.view(T0 + 3).state == "finished"


def test_resume_clears_previous_end() -> None:
    rs = RunState()
    for m in (proc("running", T0), run_start(T0), ev("run_end", T0 + 1, reason="signal", exit_code=0, step=4)):
        rs.apply(m)
    resumed = run_start(T0 + 10)
    resumed["event"]["resumed_from"] = 4
    rs.apply(resumed)
    v = rs.view(T0 + 11)
    assert v.state == "loading" and v.step == 4 and v.end_reason is None


def test_a_new_attempt_drops_the_errors_of_the_last_one_as_status_does() -> None:
    """watch folds the whole events file, status the current attempt: the last attempt's fatal error stayed in
    watch's `errors` (and could name a later crash) after a resume."""
    rs = RunState()
    for m in (proc("running", T0), run_start(T0),
              ev("error", T0 + 1, **{"class": "ValueError", "message": "old boom", "traceback": "", "fatal": True}),
              ev("run_end", T0 + 2, reason="crashed", exit_code=1, step=3), proc("exited", T0 + 3, exit_code=1)):
        rs.apply(m)
    assert rs.view(T0 + 4).errors[0]["message"] == "old boom"
    rs.apply(proc("running", T0 + 10))
    rs.apply(run_start(T0 + 10))
    assert rs.view(T0 + 11).errors == []
    for m in (ev("run_end", T0 + 12, reason="crashed", exit_code=1, step=3), proc("exited", T0 + 13, exit_code=1)):
        rs.apply(m)
    v = rs.view(T0 + 14)
    assert v.state == "crashed" and "old boom" not in (v.reason or "")


def test_plain_command_without_events() -> None:
    rs = RunState()
    rs.apply(proc("running", T0))
    assert rs.view(T0 + 1).state == "starting"
    rs.apply(proc("exited", T0 + 2, 0))
    assert rs.view(T0 + 3).state == "finished"
    bad = RunState()
    bad.apply(proc("running", T0))
    bad.apply(proc("exited", T0 + 2, 3))
    assert bad.view(T0 + 3).state == "crashed"


def test_run_end_exit_code_wins_over_launcher_exit_code() -> None:
    # torchrun exits 1 after SIGTERM even when every rank wrote run_end(signal, exit 0): trust the training core.
    for ordering in ("end_first", "proc_first"):
        rs = RunState()
        end = ev("run_end", T0 + 2, reason="signal", exit_code=0, step=3)
        gone = proc("exited", T0 + 2, 1)
        for m in (proc("running", T0), run_start(T0), *((end, gone) if ordering == "end_first" else (gone, end))):
            rs.apply(m)
        v = rs.view(T0 + 3)
        assert (v.state, v.exit_code, v.proc_exit_code) == ("finished", 0, 1), ordering


def test_process_exit_seen_before_the_events_replay() -> None:
    # `status` of a dead run may deliver the process state before the event history.
    rs = RunState()
    for m in (proc("exited", T0 + 5, 1), run_start(T0), ev("phase", T0 + 1, phase="loading_target", i=1, n=2)):
        rs.apply(m)
    v = rs.view(T0 + 6)
    assert (v.state, v.exit_code) == ("crashed", 1)


def test_killed_marker_from_status_or_proc() -> None:
    for marker in ({"t": "status", "ts": T0 + 3, "killed_by_opsctl": True},
                   {**proc("exited", T0 + 3, 0), "killed_by_opsctl": True}):
        rs = RunState()
        for m in (proc("running", T0), run_start(T0), ev("run_end", T0 + 2, reason="signal", exit_code=0, step=3),
                  marker):
            rs.apply(m)
        assert rs.view(T0 + 4).state == "killed"


def test_an_error_after_the_kill_was_asked_for_reads_killed_one_before_it_crashed() -> None:
    """A group kill: the rank whose peer was signalled first fails its collective and ends with an error. Asked for
    first, that is the kill's doing (killed); an error that ended the run before the kill stays a crash."""
    def fold(kill_ts: float, end_ts: float) -> str:
        rs = RunState()
        for m in (proc("running", T0), run_start(T0), step(1, T0 + 1),
                  ev("error", end_ts, **{"class": "runtime", "message": "Connection closed by peer", "traceback": "tb",
                                         "fatal": True}),
                  ev("run_end", end_ts, reason="error", exit_code=1, step=1),
                  {**proc("exited", end_ts + 0.5, 1), "killed_by_opsctl": True, "killed_at": kill_ts}):
            rs.apply(m)
        return rs.view(end_ts + 1).state

    assert fold(kill_ts=T0 + 5, end_ts=T0 + 5.2) == "killed"
    assert fold(kill_ts=T0 + 9, end_ts=T0 + 5.2) == "crashed"


def test_a_dflash_command_that_refused_its_config_before_starting_reads_refused_not_crashed() -> None:
    rs = RunState()
    rs.apply(proc("running", T0))
    msg = proc("exited", T0 + 1, exit_code=2)
    msg["exception"] = "dflash: c.yaml:2: train.lr: expected a number, got 'fast'"
    rs.apply(msg)
    v = rs.view(T0 + 2)
    assert v.state == "refused" and v.reason == "dflash: c.yaml:2: train.lr: expected a number, got 'fast' (exit 2)"
    other = RunState()  # any other command's exit 2 (or a traceback) is still a crash
    other.apply(proc("running", T0))
    msg = proc("exited", T0 + 1, exit_code=2)
    msg["exception"] = "ValueError: boom"
    other.apply(msg)
    assert other.view(T0 + 2).state == "crashed"
