"""`opsctl export HOST RUN --tensorboard DIR` through the real sshd + agent, read back with TensorBoard's own reader.

The events file is written by the contract's writer (dflash.telemetry.EventWriter), a resume included.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dflash.telemetry import EventWriter
from opsctl.export import STATE_FILE, TensorBoardExport

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import opsctl, script_run  # noqa: E402


def _attempt(w: EventWriter, first: int, last: int, resumed_from: int | None, loss_scale: float) -> None:
    w.emit("run_start", config={"data": {"reservoir": 4}}, versions={"python": "3"}, kernels={}, device="cpu",
           world_size=1, roles={"colocated": [0]}, resumed_from=resumed_from, pid=os.getpid(), host="h",
           total_steps=20)
    w.emit("phase", phase="training")
    for step in range(first, last + 1):
        w.emit("step", step=step, epoch=0, loss=loss_scale / step, acc=[0.5, 0.25, float("nan")], lr=1e-3,
               grad_norm=2.0, tokens=100, tokens_per_s=400.0 + step, step_time_s=0.25, queue_depth=3,
               queue_wait_s=0.01, recompiles=0, total_steps=20,
               **({"pace": 1.0 + step / 100, "pace_ref_s": 0.25} if step >= 9 else {}))  # once it settled
        w.emit("heartbeat", phase="training", step=step, rss_mb=1000.0 + step, gpu_mem_mb=None,
               gpu_alloc_retries=step // 4)
    w.emit("checkpoint", path="/ckpt", step=last, manifest_sha256="0" * 64, bytes=2**30, seconds=1.5,
           free_bytes=(40 - last) * 2**30)


def _scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_export_writes_tensorboard_scalars_that_its_reader_reads_back_resume_and_incremental(tmp_path: Path,
                                                                                             sshd) -> None:
    events = tmp_path / "events.jsonl"
    w = EventWriter(events, run_id="r1", truncate=True)
    _attempt(w, 1, 10, None, 5.0)  # crashes after step 10; the checkpoint it resumes from is step 6
    _attempt(w, 7, 12, 6, 50.0)
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"r": script_run(tmp_path, "ok_run.py")})
    out = tmp_path / "tb"
    r = opsctl(hosts, "export", "box", "r", "--tensorboard", str(out))
    assert r.returncode == 0, r.stderr
    assert "16 steps" in r.stderr and "1 resumed attempt" in r.stderr, r.stderr
    loss = _scalars(out, "train/loss")
    # TensorBoard's restart rule (SessionLog START at step 7) dropped the crashed attempt's steps 7..10
    assert [s for s, _ in loss] == list(range(1, 13)), loss
    assert loss[5][1] == pytest.approx(5.0 / 6) and loss[6][1] == pytest.approx(50.0 / 7)
    assert [v for _, v in _scalars(out, "perf/tokens_per_s")][-1] == pytest.approx(412.0)
    assert _scalars(out, "acc/pos1")[0][1] == pytest.approx(0.5)
    assert _scalars(out, "acc/mean")[0][1] == pytest.approx(0.375)  # NaN positions left out of the mean
    assert _scalars(out, "queue/depth")[0][1] == 3.0
    assert [(s, round(v, 2)) for s, v in _scalars(out, "perf/pace")] == [(s, 1.0 + s / 100) for s in (9, 10, 11, 12)]
    assert _scalars(out, "rank0/rss_mb")[-1] == (12, pytest.approx(1012.0))
    assert _scalars(out, "rank0/gpu_alloc_retries")[-1] == (12, 3.0)
    assert _scalars(out, "checkpoint/gib")[-1] == (12, pytest.approx(1.0))
    assert _scalars(out, "checkpoint/free_gib")[-1] == (12, pytest.approx(28.0))  # the space left, over the run
    state = json.loads((out / STATE_FILE).read_text())
    assert state["events_offset"] == events.stat().st_size and state["last_step"] == 12
    # one record per step, heartbeat and checkpoint (their scalars together), not one per scalar: a week-long
    # run's export was ~15x the records, each checksummed by tensorboard's pure-Python CRC (bench in docs/perf.md)
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    records = [e for f in sorted(out.glob("events.out.tfevents.*")) for e in EventFileLoader(str(f)).Load()
               if e.HasField("summary")]
    assert len(records) == 16 + 16 + 2, len(records)

    # the run goes on: a second export adds only what is new
    for step in (13, 14):
        w.emit("step", step=step, epoch=0, loss=1.0, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=100,
               tokens_per_s=500.0, step_time_s=0.25, queue_depth=3, queue_wait_s=0.0, recompiles=0, total_steps=20)
    w.close()
    r = opsctl(hosts, "export", "box", "r", "--tensorboard", str(out))
    assert r.returncode == 0 and "2 steps" in r.stderr, r.stderr
    assert [s for s, _ in _scalars(out, "train/loss")] == list(range(1, 15))

    # one directory per run: exporting another run into it is refused, naming the one it holds
    hosts2 = sshd.write_hosts_yaml(tmp_path / "hosts2.yaml", runs={"other": script_run(tmp_path, "ok_run.py")})
    r = opsctl(hosts2, "export", "box", "other", "--tensorboard", str(out))
    assert r.returncode == 2 and "holds the export of box:r" in r.stderr, r.stderr
    # a state file that is not this tool's (valid JSON, not an object) is refused with the way out, not a traceback
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / STATE_FILE).write_text("[1, 2]\n")
    r = opsctl(hosts, "export", "box", "r", "--tensorboard", str(tmp_path / "odd"))
    assert r.returncode == 2 and "unreadable export state (a JSON list, not an object)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_gpu_samples_become_per_gpu_scalars_at_the_current_step(tmp_path: Path) -> None:
    tb = TensorBoardExport(tmp_path)
    tb.event({"kind": "step", "ts": 10.0, "step": 5, "loss": 1.0})
    tb.gpu_sample({"t": "gpu", "ts": 11.0, "gpus": [
        {"index": 0, "util": 97, "mem_used_mb": 70000, "mem_total_mb": 81559, "power_w": 650.5, "temp_c": 71,
         "sm_clock_mhz": 1980, "procs": [{"pid": 1, "used_mb": 69000}]},
        {"index": 1, "util": None, "mem_used_mb": 10, "power_w": None, "temp_c": 30}]})
    tb.close()
    assert _scalars(tmp_path, "gpu0/util_pct") == [(5, 97.0)]
    assert _scalars(tmp_path, "gpu0/power_w") == [(5, pytest.approx(650.5))]
    assert _scalars(tmp_path, "gpu1/mem_used_mb") == [(5, 10.0)]
    assert "gpu1/util_pct" not in EventAccumulator(str(tmp_path)).Reload().Tags()["scalars"]


def test_export_follow_adds_steps_until_the_run_ends(tmp_path: Path, sshd) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"live": script_run(
        tmp_path, "ok_run.py", "--steps", "30", "--step-time", "0.1", tmux_session="export-follow")})
    try:
        assert opsctl(hosts, "launch", "box", "live").returncode == 0  # ready at its first step: still running
        out = tmp_path / "tb"
        r = opsctl(hosts, "export", "box", "live", "--tensorboard", str(out), "--follow", timeout=120)
        assert r.returncode == 0, r.stderr
        assert "following box:live" in r.stderr
        assert [s for s, _ in _scalars(out, "train/loss")] == list(range(1, 31))  # every step, to the end
    finally:
        opsctl(hosts, "clean", "box", "live")


def test_export_writes_eval_tau_ngram_and_acceptance_per_position_at_the_evaluated_step(tmp_path: Path,
                                                                                       sshd) -> None:
    """eval/tau, eval/ngram_tau, eval/accept_pos{k} (k = 1..B-1) at each evaluation's step; a resume drops the crashed
    attempt's evaluations after its checkpoint, like its steps; a null τ (nothing verified) is left out, never 0."""
    events = tmp_path / "events.jsonl"
    w = EventWriter(events, run_id="r1", truncate=True)

    def evaluate(step: int, tau: float | None) -> None:
        w.emit("phase", phase="evaluating")
        w.emit("eval", step=step, tau=tau, accept_by_position=[0.8, 0.5, None], accept_hist=[1, 2, 3, 4],
               ngram_tau=1.9, block_size=4, sequences=8, tokens=256, seconds=2.5, tau_ci95=[2.0, 3.0])

    _attempt(w, 1, 5, None, 5.0)
    evaluate(5, 2.5)
    _attempt(w, 6, 10, None, 5.0)  # another attempt, steps 6..10; it crashes after an evaluation at 10
    evaluate(10, 3.5)
    _attempt(w, 7, 12, 6, 50.0)  # resumed from the checkpoint at step 6: the evaluation at 10 is gone
    evaluate(12, None)
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"r": script_run(tmp_path, "ok_run.py")})
    out = tmp_path / "tb"
    r = opsctl(hosts, "export", "box", "r", "--tensorboard", str(out))
    assert r.returncode == 0 and "3 evaluations" in r.stderr, r.stderr
    assert _scalars(out, "eval/tau") == [(5, 2.5)]
    assert _scalars(out, "eval/ngram_tau") == [(5, pytest.approx(1.9)), (12, pytest.approx(1.9))]
    assert _scalars(out, "eval/accept_pos1") == [(5, pytest.approx(0.8)), (12, pytest.approx(0.8))]
    assert [s for s, _ in _scalars(out, "eval/accept_pos2")] == [5, 12]
    assert "eval/accept_pos3" not in EventAccumulator(str(out)).Reload().Tags()["scalars"]  # null: no point
    assert _scalars(out, "eval/seconds")[-1] == (12, 2.5)


def test_reexport_with_nothing_new_writes_no_event_file_and_says_so(tmp_path: Path, sshd) -> None:
    events = tmp_path / "events.jsonl"
    w = EventWriter(events, run_id="r1", truncate=True)
    _attempt(w, 1, 3, None, 5.0)
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"r": script_run(tmp_path, "ok_run.py")})
    out = tmp_path / "tb"
    r = opsctl(hosts, "export", "box", "r", "--tensorboard", str(out))
    assert r.returncode == 0 and "3 steps" in r.stderr, r.stderr
    files = sorted(p.name for p in out.iterdir() if p.name.startswith("events.out.tfevents"))
    assert len(files) == 1, files
    for _ in range(2):  # nothing new: no (empty) event file per call, and one line saying why
        r = opsctl(hosts, "export", "box", "r", "--tensorboard", str(out))
        assert r.returncode == 0, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("nothing new to export from box:r"), r.stderr
        assert "no event file written" in r.stderr
        assert sorted(p.name for p in out.iterdir() if p.name.startswith("events.out.tfevents")) == files
    w.emit("step", step=4, epoch=0, loss=1.0, acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=100, tokens_per_s=500.0,
           step_time_s=0.25, queue_depth=3, queue_wait_s=0.0, recompiles=0, total_steps=20)
    w.close()
    r = opsctl(hosts, "export", "box", "r", "--tensorboard", str(out))  # something new: a new file with it
    assert r.returncode == 0 and "1 steps" in r.stderr, r.stderr
    assert len([p for p in out.iterdir() if p.name.startswith("events.out.tfevents")]) == 2
    assert [s for s, _ in _scalars(out, "train/loss")] == [1, 2, 3, 4]


def test_a_long_export_shows_its_progress_on_a_terminal(tmp_path: Path) -> None:
    """A week-long run's export takes seconds to minutes: on a terminal a spinner counts the steps written (on a
    pipe, only the final line, as the test above reads). The local host; stderr on a pseudo-terminal."""
    events = tmp_path / "events.jsonl"
    w = EventWriter(events, run_id="r1", truncate=True)
    w.emit("run_start", config={}, versions={}, kernels={}, device="cpu", world_size=1, roles={"colocated": [0]},
           resumed_from=None, pid=os.getpid(), host="h", total_steps=30_000)
    for step in range(1, 30_001):
        w.emit("step", step=step, epoch=0, loss=1.0 / step, acc=[0.5, 0.25], lr=1e-3, grad_norm=1.0, tokens=100,
               tokens_per_s=400.0, step_time_s=0.25, queue_depth=0, queue_wait_s=0.0, recompiles=0,
               total_steps=30_000)
    w.close()
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(f"hosts:\n  box:\n    local: true\n    runs:\n      r:\n        command: ['true']\n"
                     f"        workdir: {tmp_path}\n        log: {tmp_path}/run.log\n        events: {events}\n"
                     f"        state_dir: {tmp_path}/state\n")
    leader, follower = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="160")
    p = subprocess.Popen([sys.executable, "-m", "opsctl", "--hosts", str(hosts), "export", "box", "r",
                          "--tensorboard", str(tmp_path / "tb")], stdin=subprocess.DEVNULL, stdout=follower,
                         stderr=follower, env=env, cwd=str(Path(__file__).resolve().parents[1]))
    os.close(follower)
    out = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert p.wait(timeout=120) == 0
    os.close(leader)
    text = out.decode("utf-8", "replace")
    assert re.search(r"exporting box:r: [\d,]+ steps, [\d,]+ scalars \(step [\d,]+\)", text), text[-2000:]
    assert "exported box:r: 30000 steps" in text
