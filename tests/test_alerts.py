"""Alert rules of `opsctl watch`: each fires on the situation it names, stays quiet otherwise, and quotes its evidence.

Messages are built the way the agent emits them (docs/agent-protocol.md) around contract events (docs/events.md).
"""

from __future__ import annotations

import math
from typing import Any

from opsctl.alerts import GPU_IDLE_AFTER_S, Alert, AlertTracker, exception_line
from opsctl.runstate import RunState

T0 = 1_767_225_600.0
FAST = {"chunk_gated_delta_rule": "fla", "causal_conv1d_fn": "causal_conv1d", "attention": "flex-compiled"}


def ev(kind: str, ts: float, **fields: Any) -> dict[str, Any]:
    return {"t": "event", "ts": ts, "event": {"v": 1, "ts": ts, "kind": kind, "run_id": "r", "rank": 0, "seq": 0,
                                                **fields}}


def run_start(ts: float, kernels: dict[str, str] | None = None, config: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    return ev("run_start", ts, config=config or {}, versions={}, kernels=kernels or FAST, device="cuda:0",
              world_size=2, roles={"target": [0], "drafter": [1]}, resumed_from=None, pid=7, host="h",
              total_steps=100)


def step(n: int, ts: float, loss: float = 2.0, dt: float = 1.0, wait: float = 0.01, depth: int = 2,
         recompiles: int = 1) -> dict[str, Any]:
    return ev("step", ts, step=n, epoch=0, loss=loss, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=10,
              tokens_per_s=10.0, step_time_s=dt, queue_depth=depth, queue_wait_s=wait, recompiles=recompiles,
              total_steps=100)


def gpu(ts: float, utils: list[float], procs: bool = True) -> dict[str, Any]:
    return {"t": "gpu", "ts": ts, "gpus": [
        {"index": i, "name": "H200", "util": u, "mem_used_mb": 1000.0, "mem_total_mb": 143771.0, "power_w": 100.0,
         "temp_c": 40.0, "procs": [{"pid": 7, "used_mb": 900.0}] if procs else []} for i, u in enumerate(utils)]}


class Run:
    """A RunState and an AlertTracker fed the same messages, as the dashboard's RunModel does."""

    def __init__(self, stall_after_s: float | None = None) -> None:
        self.state = RunState(stall_after_s=stall_after_s)
        self.tracker = AlertTracker()
        self.feed({"t": "proc", "ts": T0, "state": "running", "pid": 7, "pgid": 7, "exit_code": None})

    def feed(self, *msgs: dict[str, Any]) -> None:
        for m in msgs:
            if m["t"] != "log":
                self.state.apply(m)
            self.tracker.observe(m)

    def alerts(self, now: float) -> dict[str, Alert]:
        return {a.key: a for a in self.tracker.evaluate(self.state.view(now), now)}


def training_run(steps: int = 10, **kw: Any) -> Run:
    r = Run()
    r.feed(run_start(T0), ev("phase", T0 + 1, phase="training"))
    for n in range(1, steps + 1):
        r.feed(step(n, T0 + 1 + n, **kw))
    return r


def test_healthy_training_run_has_no_alerts() -> None:
    r = training_run(10)
    r.feed(gpu(T0 + 11, [97.0, 95.0]))
    assert r.alerts(T0 + 12) == {}


def test_crashed_alert_quotes_the_exception_line_of_the_fatal_error() -> None:
    r = training_run(3)
    tb = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\nRuntimeError: NCCL timeout'
    r.feed(ev("error", T0 + 10, **{"class": "nccl", "message": "collective timed out", "traceback": tb,
                                    "fatal": True}),
           ev("run_end", T0 + 11, reason="error", exit_code=1, step=3))
    a = r.alerts(T0 + 12)["crashed"]
    assert a.severity == "critical"
    assert a.evidence == "RuntimeError: NCCL timeout; error class nccl; run_end error; exit code 1"


def test_crash_without_events_takes_the_exception_from_the_log() -> None:
    r = Run()
    for line in ["starting", "Traceback (most recent call last):", '  File "run.py", line 3, in <module>',
                 "    import flash_attn", "ModuleNotFoundError: No module named 'flash_attn'", "bye"]:
        r.feed({"t": "log", "ts": T0, "off": 0, "end": 1, "line": line})
    r.feed({"t": "proc", "ts": T0 + 1, "state": "exited", "pid": 7, "pgid": 7, "exit_code": 1})
    a = r.alerts(T0 + 2)["crashed"]
    assert a.evidence == "ModuleNotFoundError: No module named 'flash_attn'; exit code 1"


def test_stalled_names_the_silence_and_where_the_run_was() -> None:
    r = Run(stall_after_s=60)
    r.feed(run_start(T0), ev("phase", T0 + 1, phase="loading_target", i=3, n=8))
    assert "stalled" not in r.alerts(T0 + 50)
    a = r.alerts(T0 + 95)["stalled"]
    assert a.evidence == "no heartbeat or step for 94 s (stall_after 60 s); last seen in loading_target 3/8, step 0"
    r.feed(ev("heartbeat", T0 + 96, phase="loading_target", step=0, rss_mb=1.0, gpu_mem_mb=None))
    assert "stalled" not in r.alerts(T0 + 97)  # progress resumed: the alert clears


def test_nan_loss_is_reported_with_its_step_from_float_or_string() -> None:
    r = training_run(4)
    r.feed(step(5, T0 + 20, loss=math.nan))
    assert r.alerts(T0 + 21)["nan"].evidence == "loss=nan at step 5"
    r2 = training_run(4)
    r2.feed(step(5, T0 + 20, loss="inf"))  # type: ignore[arg-type]  # the writer's JSON-safe spelling
    assert r2.alerts(T0 + 21)["nan"].evidence == "loss=inf at step 5"


def test_nan_error_event_also_raises_nan() -> None:
    r = training_run(4)
    r.feed(ev("error", T0 + 20, **{"class": "nan", "message": "grad norm is nan", "traceback": None,
                                    "fatal": False}))
    assert r.alerts(T0 + 21)["nan"].evidence == "error nan: grad norm is nan"


def test_slow_kernel_fallback_at_start_lists_the_kernels() -> None:
    r = Run()
    r.feed(run_start(T0, kernels={"chunk_gated_delta_rule": "torch-fallback", "causal_conv1d_fn": "torch-fallback",
                                  "attention": "flex-compiled"}))
    a = r.alerts(T0 + 1)["slow_kernel"]
    assert a.severity == "warning"
    assert a.evidence == "causal_conv1d_fn: torch-fallback; chunk_gated_delta_rule: torch-fallback"
    r2 = Run()
    r2.feed(run_start(T0), ev("error", T0 + 1, **{"class": "slow_kernel", "message": "48 layers on torch fallback",
                                                   "traceback": None, "fatal": False}))
    assert r2.alerts(T0 + 2)["slow_kernel"].evidence == "48 layers on torch fallback"
    r3 = Run()
    r3.feed(run_start(T0))
    assert "slow_kernel" not in r3.alerts(T0 + 1)
    on_cpu = run_start(T0, kernels={"chunk_gated_delta_rule": "torch-fallback"})
    on_cpu["event"]["device"] = "cpu"  # nothing faster exists there
    r4 = Run()
    r4.feed(on_cpu)
    assert "slow_kernel" not in r4.alerts(T0 + 1)


def test_recompiles_during_warmup_are_fine_later_ones_alert() -> None:
    r = Run()
    r.feed(run_start(T0), ev("phase", T0, phase="training"))
    for n, rc in [(1, 1), (2, 2), (3, 3), (4, 3), (5, 3), (6, 3)]:
        r.feed(step(n, T0 + n, recompiles=rc))
    assert "recompile" not in r.alerts(T0 + 7)
    r.feed(step(7, T0 + 7, recompiles=5))
    assert r.alerts(T0 + 8)["recompile"].evidence == "recompiles 3 at step 4 -> 5 at step 7"


def test_uncompiled_flex_error_is_a_recompile_alert() -> None:
    r = training_run(2)
    r.feed(ev("error", T0 + 5, **{"class": "uncompiled_flex", "message": "flex_attention called without "
                                  "torch.compile()", "traceback": None, "fatal": False}))
    assert r.alerts(T0 + 6)["recompile"].evidence == "uncompiled_flex: flex_attention called without torch.compile()"


def test_gpu_idle_while_training_only_after_the_threshold_and_only_gpus_of_the_run() -> None:
    r = training_run(3)
    # GPU 0 (the run's) idles; GPU 1 has no process of anyone and is ignored.
    t = T0 + 10
    for k in range(0, int(GPU_IDLE_AFTER_S) + 6, 2):
        msg = gpu(t + k, [1.0, 0.0])
        msg["gpus"][1]["procs"] = []
        r.feed(msg)
        if k <= GPU_IDLE_AFTER_S:
            assert "gpu_idle" not in r.alerts(t + k), k
    a = r.alerts(t + 40)["gpu_idle"]
    assert a.evidence == "GPU 0 util <= 1% for 34 s while the run reports training"
    busy = gpu(t + 40, [90.0, 0.0])
    busy["gpus"][1]["procs"] = []
    r.feed(busy)
    assert "gpu_idle" not in r.alerts(t + 41)


def test_gpu_idle_during_loading_is_not_an_alert() -> None:
    r = Run()
    r.feed(run_start(T0), ev("phase", T0 + 1, phase="loading_target", i=1, n=8))
    for k in range(0, 60, 5):
        r.feed(gpu(T0 + 1 + k, [0.0]), ev("heartbeat", T0 + 1 + k, phase="loading_target", step=0, rss_mb=1.0,
                                          gpu_mem_mb=None))
    assert "gpu_idle" not in r.alerts(T0 + 61)


def test_queue_starvation_and_backlog() -> None:
    starving = training_run(6, dt=2.0, wait=1.5)
    a = starving.alerts(T0 + 10)["queue_starved"]
    assert a.evidence == "median queue wait 1.50 s of 2.00 s step (75%), steps 2-6"
    backlog = Run()
    backlog.feed(run_start(T0, config={"data": {"reservoir": 8}}), ev("phase", T0, phase="training"))
    for n in range(1, 7):
        backlog.feed(step(n, T0 + n, depth=8))
    alerts = backlog.alerts(T0 + 7)
    assert alerts["queue_backlog"].evidence.startswith("queue depth 8/8 for steps 2-6")
    assert "queue_starved" not in alerts
    healthy = training_run(6, dt=2.0, wait=0.1, depth=3)
    assert not {"queue_starved", "queue_backlog"} & set(healthy.alerts(T0 + 10))


def test_queue_rules_do_not_apply_to_colocated_runs() -> None:
    # Colocated, the feeder runs the target forward itself: its "wait" is compute, and the reservoir is kept full.
    r = Run()
    start = run_start(T0, config={"data": {"reservoir": 4}})
    start["event"]["roles"] = {"colocated": [0]}
    r.feed(start, ev("phase", T0, phase="training"))
    for n in range(1, 7):
        r.feed(step(n, T0 + n, dt=2.0, wait=1.8, depth=4))
    assert not {"queue_starved", "queue_backlog"} & set(r.alerts(T0 + 7))


def test_link_lost_and_reconnecting_then_up_again() -> None:
    r = training_run(2)
    r.feed({"t": "link", "state": "lost", "detail": "SSHException: Socket is closed (retry in 2 s)",
            "local_ts": T0})
    a = r.alerts(T0 + 4)["link"]
    assert (a.title, a.evidence) == ("SSH link lost", "SSHException: Socket is closed (retry in 2 s)")
    r.feed({"t": "link", "state": "reconnecting", "detail": "attempt 1", "local_ts": T0 + 2})
    assert r.alerts(T0 + 4)["link"].title == "SSH link lost, reconnecting"
    r.feed({"t": "link", "state": "up", "detail": "", "local_ts": T0 + 3})
    assert "link" not in r.alerts(T0 + 4)


def test_since_is_kept_while_active_and_reset_after_clearing() -> None:
    r = Run(stall_after_s=10)
    r.feed(run_start(T0))
    assert r.tracker.evaluate(r.state.view(T0 + 20), 100.0)[0].since == 100.0
    assert r.tracker.evaluate(r.state.view(T0 + 30), 200.0)[0].since == 100.0
    r.feed(ev("heartbeat", T0 + 31, phase="loading_target", step=0, rss_mb=1.0, gpu_mem_mb=None))
    assert r.tracker.evaluate(r.state.view(T0 + 32), 300.0) == []
    assert r.tracker.evaluate(r.state.view(T0 + 60), 400.0)[0].since == 400.0


def test_exception_line() -> None:
    assert exception_line("Traceback (most recent call last):\n  File 'a'\nValueError: bad\n\n") == "ValueError: bad"
    assert exception_line(None) is None
    assert exception_line("   \n") is None


def test_a_kill_we_asked_for_is_no_alert_and_says_how_it_ended() -> None:
    from opsctl.watch import ending_text

    r = training_run(3)
    r.state.killed_by_us = True
    r.feed(ev("run_end", T0 + 10, reason="signal", exit_code=0, step=3, signal="SIGINT"))
    alerts = r.alerts(T0 + 11)
    assert alerts == {}  # killed on request: the badge says so, nothing to alert anyone about
    assert r.state.view(T0 + 11).state == "killed"
    assert ending_text(r.state.view(T0 + 11)) == "run_end signal, exit code 0, at step 3"


def test_a_checkpoint_skipped_for_a_full_disk_is_an_alert_until_one_fits_again() -> None:
    r = Run()
    r.feed(run_start(T0), ev("phase", T0 + 1, phase="training"), step(1, T0 + 2))
    assert "disk_full" not in r.alerts(T0 + 3)
    msg = "checkpoint step-100 not saved: No space left on device in /r/checkpoints (1.0 MiB free, it needs 9.0 MiB)"
    r.feed(ev("error", T0 + 3, **{"class": "disk_full", "message": msg, "traceback": None, "fatal": False}),
           step(2, T0 + 4))
    a = r.alerts(T0 + 5)["disk_full"]
    assert a.severity == "critical" and a.evidence == msg
    r.feed(ev("checkpoint", T0 + 6, path="/r/checkpoints/step-200", step=200, manifest_sha256="x", bytes=9,
              seconds=0.1, free_bytes=100))
    assert "disk_full" not in r.alerts(T0 + 7)
    # The warning that the next checkpoint will not fit follows the checkpoint that just fit: it stays.
    r.feed(ev("checkpoint", T0 + 8, path="/r/checkpoints/step-300", step=300, manifest_sha256="y", bytes=9,
              seconds=0.1, free_bytes=5),
           ev("error", T0 + 8, **{"class": "disk_full", "message": "the next one will not fit", "traceback": None,
                                  "fatal": False}))
    assert r.alerts(T0 + 9)["disk_full"].evidence == "the next one will not fit"


def _beats(r: Run, t0: float, t1: float, mb: Any, rank: int = 0, every: float = 5.0, key: str = "rss_mb") -> None:
    """Heartbeats every `every` s from t0 to t1, memory mb(t) for `key` (MB)."""
    t = t0
    while t <= t1:
        fields = {"rss_mb": 3000.0, "gpu_mem_mb": 60000.0, "gpu_reserved_mb": 70000.0, key: float(mb(t))}
        r.feed(ev("heartbeat", t, phase="training", step=int(t - T0), rank=rank, **fields))
        t += every


def _training(r: Run) -> None:
    r.feed(run_start(T0), ev("phase", T0, phase="training"), step(1, T0 + 1))


def test_host_memory_that_keeps_growing_after_warm_up_is_an_alert_with_the_figures() -> None:
    r = Run(stall_after_s=1e9)
    _training(r)
    # Loading and compiling grow memory in the first minutes: not growth (the baseline starts after MEM_SETTLE_S).
    _beats(r, T0 + 5, T0 + 600, lambda t: 3000 + 10 * (t - T0))
    _beats(r, T0 + 605, T0 + 3600, lambda t: 9000.0)
    assert "memory_growth" not in r.alerts(T0 + 3601)
    # Then a leak: +1 GiB every 10 minutes for 2 hours.
    _beats(r, T0 + 3605, T0 + 3600 + 7200, lambda t: 9000 + (t - T0 - 3600) / 600 * 1024)
    a = r.alerts(T0 + 10801)["memory_growth"]
    assert a.severity == "warning"
    assert a.evidence == "rank 0 host RSS 8.8 GiB at step 600 -> 20.7 GiB at step 10800 (+12.0 GiB in 2.8 h)"


def test_one_memory_spike_or_growth_within_the_margin_is_not_an_alert() -> None:
    r = Run(stall_after_s=1e9)
    _training(r)
    _beats(r, T0 + 5, T0 + 4000, lambda t: 30000.0 if int(t) % 600 == 0 else 9000.0)  # one heartbeat in 120
    # +1.5 GiB (under max(20 %, 2 GiB)), and a spike in the latest heartbeat (a mean of the window would alert)
    _beats(r, T0 + 4005, T0 + 8000, lambda t: 30000.0 if t == T0 + 8000 else 9000 + 1500.0)
    assert "memory_growth" not in r.alerts(T0 + 8001)


def test_gpu_reserved_growth_on_another_rank_is_named() -> None:
    r = Run(stall_after_s=1e9)
    _training(r)
    _beats(r, T0 + 5, T0 + 4000, lambda t: 70000.0, rank=3, key="gpu_reserved_mb")
    _beats(r, T0 + 4005, T0 + 6000, lambda t: 70000.0 + 20000.0, rank=3, key="gpu_reserved_mb")
    a = r.alerts(T0 + 6001)["memory_growth"]
    assert a.evidence == "rank 3 GPU reserved 68.4 GiB at step 600 -> 87.9 GiB at step 6000 (+19.5 GiB in 1.5 h)"


def test_a_refused_run_raises_a_critical_alert_with_the_refusal_and_no_disk_full() -> None:
    r = training_run(2)
    r.feed(ev("error", T0 + 10, **{"class": "config", "message": "refusing to resume: drafter.num_layers: 3 in the "
                                    "checkpoint, 2 in the config", "traceback": None, "fatal": True}),
           ev("run_end", T0 + 11, reason="refused", exit_code=2, step=2))
    alerts = r.alerts(T0 + 12)
    assert set(alerts) == {"refused"}, alerts
    a = alerts["refused"]
    assert a.severity == "critical" and a.title == "run refused to start"
    assert a.evidence.startswith("config: refusing to resume: drafter.num_layers: 3 in the checkpoint")
    assert a.evidence.endswith("run_end refused; exit code 2")


def _retry_beats(r: Run, t0: float, t1: float, count: Any, rank: int = 0) -> None:
    """Heartbeats every 5 s from t0 to t1 with gpu_alloc_retries count(t) (cumulative, as torch counts them)."""
    t = t0
    while t <= t1:
        r.feed(ev("heartbeat", t, phase="training", step=int(t - T0), rank=rank, rss_mb=3000.0, gpu_mem_mb=60000.0,
                  gpu_reserved_mb=70000.0, gpu_alloc_retries=count(t)))
        t += 5.0


def test_allocator_retries_while_training_are_an_alert_until_ten_minutes_pass_without_one() -> None:
    r = Run(stall_after_s=1e9)
    _training(r)
    # Compiling and the first minutes may retry: not counted (the same settling time as memory_growth).
    _retry_beats(r, T0 + 5, T0 + 600, lambda t: int((t - T0) // 60))
    _retry_beats(r, T0 + 605, T0 + 3600, lambda t: 10)
    assert "alloc_retries" not in r.alerts(T0 + 3601)
    # Reserved memory at the card's limit: a retry every 2 minutes from 1 h on (memory_growth sees nothing).
    _retry_beats(r, T0 + 3605, T0 + 4800, lambda t: 10 + int((t - T0 - 3600) // 120))
    a = r.alerts(T0 + 4801)["alloc_retries"]
    assert a.severity == "warning" and a.title == "GPU allocator retrying"
    assert a.evidence.startswith("rank 0: 5 allocator retries in 10 min (steps 4200-4800; 20 since its process "
                                 "started): the CUDA caching allocator had to free its whole cache"), a.evidence
    assert "expandable_segments:True" in a.evidence and "memory_growth" not in r.alerts(T0 + 4801)
    # No retry for ten minutes: cleared.
    _retry_beats(r, T0 + 4805, T0 + 5395, lambda t: 20)
    assert "alloc_retries" in r.alerts(T0 + 5396)  # the last retry (step 4800) is 595 s old
    _retry_beats(r, T0 + 5400, T0 + 5500, lambda t: 20)
    assert "alloc_retries" not in r.alerts(T0 + 5501)


def test_a_new_process_on_a_rank_or_a_cpu_run_is_no_retry_alert_and_another_rank_is_named() -> None:
    r = Run(stall_after_s=1e9)
    _training(r)
    _retry_beats(r, T0 + 605, T0 + 1200, lambda t: 40, rank=1)
    _retry_beats(r, T0 + 1205, T0 + 1800, lambda t: 0, rank=1)  # a restarted process: its counter starts again
    _retry_beats(r, T0 + 605, T0 + 1800, lambda t: None, rank=0)  # a CPU rank writes null
    assert "alloc_retries" not in r.alerts(T0 + 1801)
    _retry_beats(r, T0 + 1805, T0 + 1900, lambda t: 1 if t > T0 + 1850 else 0, rank=1)
    assert r.alerts(T0 + 1901)["alloc_retries"].evidence.startswith("rank 1: 1 allocator retries in 10 min")
