"""watch's backlog of a long run arrives thinned (opsctl/remote/thin.py HistoryThinner): the real agent's `follow` with
and without `thin_history` over one events file, each folded by the dashboard's own RunModel at one fixed clock.

What a person reads must not change: the whole `watch --once --json` record (state, step, ETA, tau, errors, alerts,
bad-line count) is equal, the charts keep the same curve at the resolution they draw, and only step events are left out.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import drive, of, opsctl, run_args, script_run  # noqa: E402

from opsctl.remote import rules  # noqa: E402
from opsctl.remote.thin import BACKLOG_FOLD_FILE, THIN_TAIL, refresh_backlog_fold, thin_stride  # noqa: E402
from opsctl.watch import RunModel  # noqa: E402

T0 = 1_790_000_000.0


def _write_events(path: Path, steps: int, resume_at: int) -> float:
    total = steps + 10_000  # still going: the ETA depends on the rate the history leaves
    """A long run's events: an attempt that ends by signal at `resume_at`, a resumed one to `steps`; evals every
    500 steps, heartbeats every 7, a checkpoint every 2000, one NaN loss, recompile counts that move twice, an
    error event, one line that is no event, and the step rate changing in the last attempt (the ETA must see it)."""
    t = T0
    lines: list[dict[str, Any]] = []

    def ev(kind: str, **kw: Any) -> None:
        lines.append({"v": 1, "ts": t, "kind": kind, "run_id": "x", "rank": 0, "seq": len(lines), **kw})

    def attempt(first: int, last: int, resumed: int | None) -> None:
        nonlocal t
        ev("run_start", total_steps=total, resumed_from=resumed)
        ev("phase", phase="compiling")
        rc = 0
        for n in range(first, last + 1):
            t += 30.0 if n == first else (3.0 if n < steps - 1000 else 2.0)
            rc += n in (first + 5, 31_001)  # warm-up, then one growth the recompile alert must name
            loss = float("nan") if n == 30_123 else 4.0 / math.sqrt(n)
            ev("step", step=n, epoch=0, loss=loss, acc=[0.5, 0.4], lr=1e-3, grad_norm=1.0, tokens=4096,
               tokens_per_s=1365.0, step_time_s=2.9, queue_depth=0, queue_wait_s=0.0, recompiles=rc,
               total_steps=total)
            if n % 7 == 0:
                ev("heartbeat", step=n, phase="training", rss_mb=1000.0 + n / 100)
            if n % 500 == 0:
                ev("eval", step=n, tau=2.0 + n / steps, accept_by_position=[0.5] * 15, ngram_tau=1.4, sequences=32,
                   tokens=4096, seconds=1.0)
            if n % 2000 == 0:
                ev("checkpoint", step=n, path=f"/ckpt/step-{n}", seconds=4.0)
            if n == 9_000:
                ev("error", **{"class": "disk_full"}, message="no space left for checkpoint", traceback=None,
                   fatal=False)
        if last != steps:
            ev("run_end", reason="signal", step=last, exit_code=143)

    attempt(1, resume_at, None)
    attempt(resume_at - 1500 + 1, steps, resume_at - 1500)
    last_start = max(i for i, line in enumerate(lines) if line["kind"] == "run_start")
    with open(path, "w") as fh:
        for i, line in enumerate(lines):
            fh.write(json.dumps(line) + "\n")
            if i == last_start + 100:  # counted: in the attempt of the last run_start (as status counts them)
                fh.write("not json at all\n")
    return t


def _follow(tmp: Path, thin: bool) -> list[dict[str, Any]]:
    args = run_args(tmp, "", command=["true"])
    rc, msgs = drive("follow", {**args, "options": {"log_offset": -1, "events_offset": 0, "tail": 0, "once": True,
                                                    "gpu_interval": 0, "thin_history": thin}}, timeout=120)
    assert rc == 0
    return msgs


def _fold(msgs: list[dict[str, Any]], now: float) -> RunModel:
    model = RunModel("box:r", clock=lambda: now)
    for m in msgs:
        if m["t"] not in ("bye", "verdict"):
            model.ingest(m)
    return model


def test_a_thinned_backlog_folds_to_the_same_record_and_curve(tmp_path: Path) -> None:
    steps = 40_000
    last_ts = _write_events(tmp_path / "events.jsonl", steps, 24_000)
    full, thin = _follow(tmp_path, False), _follow(tmp_path, True)
    ends = [[(m["log_offset"], m["events_offset"]) for m in of(msgs, "backlog_end")] for msgs in (full, thin)]
    assert ends[0] == ends[1] and ends[0][0][1] == (tmp_path / "events.jsonl").stat().st_size  # the resume point
    n_full, n_thin = (sum(1 for m in msgs if m["t"] == "event" and m["event"]["kind"] == "step")
                      for msgs in (full, thin))
    assert n_full == 40_000 + 1_500 and n_thin < n_full * 0.25, (n_full, n_thin)
    # every other kind of line but heartbeats is sent whole, in the same order; of the heartbeats (one every 7 steps
    # here) those of the tail and the few that fill the memory rules' baseline windows
    others = [[(m["t"], m.get("off")) for m in msgs if m["t"] == "bad_event"
               or (m["t"] == "event" and m["event"]["kind"] not in ("step", "heartbeat"))] for msgs in (full, thin)]
    assert others[0] == others[1]
    beats = [sum(1 for m in msgs if m["t"] == "event" and m["event"]["kind"] == "heartbeat") for msgs in (full, thin)]
    assert beats[0] > 5_000 and beats[1] < 0.1 * beats[0], beats
    offs = [m["off"] for m in thin if m["t"] in ("event", "bad_event")]
    assert offs == sorted(offs)

    now = last_ts + 5.0
    a, b = _fold(full, now), _fold(thin, now)
    ra, rb = a.snapshot(), b.snapshot()
    assert ra == rb, {k: (ra[k], rb[k]) for k in ra if ra[k] != rb.get(k)}
    assert ra["step"] == steps and ra["tau_step"] == steps and ra["bad_events"] == 1
    assert abs(ra["eta_s"] - 10_000 * 2.0) < 1.0, ra["eta_s"]  # the last 1,000 steps' rate, 2.0 s a step
    keys = {x["key"] for x in ra["alerts"]}
    assert {"nan", "recompile"} <= keys, keys  # both found in the thinned middle of the history
    evidence = {x["key"]: x["evidence"] for x in ra["alerts"]}
    assert "step 30123" in evidence["nan"] and "-> 2 at step 40000" in evidence["recompile"], evidence
    # the charts: equal to a read of every step, point for point (watch.RunSeries keeps what the steps present
    # decide, and the client keeps no finer stride than the agent thinned to: the `thin` message)
    assert [m["stride"] for m in thin if m["t"] == "thin"] == [16] and not [m for m in full if m["t"] == "thin"]
    for key in a.series:
        sa, sb = a.series[key], b.series[key]
        assert json.dumps([sa.steps, sa.values, sa.stride]) == json.dumps([sb.steps, sb.values, sb.stride]), key
        assert (sa.steps[0], sa.steps[-1]) == ((500, steps) if key in ("tau", "ngram_tau") else (1, steps)), key
    assert len(a.series["loss"]) > 2_000 and len(a.series["tau"]) == steps // 500
    assert a.attempt_marks == b.attempt_marks


def test_a_short_history_is_sent_whole(tmp_path: Path) -> None:
    _write_events(tmp_path / "events.jsonl", 3_000, 2_000)
    assert thin_stride(str(tmp_path / "events.jsonl"), 0) == 1
    full, thin = _follow(tmp_path, False), _follow(tmp_path, True)
    strip = [[{k: v for k, v in m.items() if k not in ("_rx", "ts", "local_ts")} for m in msgs
              if m["t"] in ("event", "bad_event", "backlog_end")] for msgs in (full, thin)]
    assert strip[0] == strip[1]


def _messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the client folds, without the transport's timestamps."""
    return [{k: v for k, v in m.items() if k not in ("_rx", "ts", "local_ts")} for m in msgs
            if m["t"] in ("event", "bad_event", "backlog_end")]


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Equal message lists (a NaN loss equals itself here)."""
    return json.dumps(_messages(a), sort_keys=True) == json.dumps(_messages(b), sort_keys=True)


def test_the_next_watch_of_a_long_history_resends_the_saved_backlog_and_reads_only_what_was_appended(
        tmp_path: Path) -> None:
    """watch's backlog fold (opsctl/remote/thin.py BACKLOG_FOLD_FILE): the first thinned read of a long file saves what it
    sent; the next sends the same messages without parsing the file again; after the run wrote on (the stride
    doubles) the saved part is re-thinned to the new stride and equals a fresh thinned read message for message; a
    file rewritten under the fold is read whole again."""
    events = tmp_path / "events.jsonl"
    last_ts = _write_events(events, 40_000, 24_000)
    (tmp_path / "state").mkdir()
    fold = tmp_path / "state" / BACKLOG_FOLD_FILE
    first = _follow(tmp_path, True)
    saved = json.loads(fold.read_text())
    assert saved["mark"]["offset"] == events.stat().st_size and saved["stride"] == 16
    assert len(saved["ring"]) == THIN_TAIL and any(not p for _, _, p in saved["middle"])

    before = fold.stat()
    second = _follow(tmp_path, True)
    assert _same(first, second)
    after_second = fold.stat()  # nothing was read past the fold: it is not written again (0.2 s of a 250k-step run's)
    assert (after_second.st_ino, after_second.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # and it came from the fold, not from parsing the file: a mark on a saved message comes back
    tampered = json.loads(fold.read_text())
    hb = next(f for k, f, _ in tampered["middle"] if k == "event" and f["event"]["kind"] == "heartbeat")
    hb["event"]["rss_mb"] = -1.0
    fold.write_text(json.dumps(tampered))
    assert any(m["t"] == "event" and m["event"].get("rss_mb") == -1.0 for m in _follow(tmp_path, True))
    fold.write_text(json.dumps(saved))

    # the run goes on to step 70,000: the stride becomes 32, the fold's middle is re-thinned
    with open(events, "a") as fh:
        t = last_ts
        for n in range(40_001, 70_001):
            t += 2.0
            fh.write(json.dumps({"v": 1, "ts": t, "kind": "step", "run_id": "x", "rank": 0, "seq": n, "step": n,
                                 "epoch": 0, "loss": 4.0 / math.sqrt(n), "acc": [0.5, 0.4], "lr": 1e-3,
                                 "grad_norm": 1.0, "tokens": 4096, "tokens_per_s": 1365.0, "step_time_s": 2.0,
                                 "queue_depth": 0, "queue_wait_s": 0.0, "recompiles": 2, "total_steps": 50_000})
                     + "\n")
    assert thin_stride(str(events), 0) == 32
    resumed = _follow(tmp_path, True)
    assert json.loads(fold.read_text())["stride"] == 32  # saved again, at the new end
    fold.unlink()
    fresh = _follow(tmp_path, True)
    assert _same(resumed, fresh)
    steps = [m["event"]["step"] for m in resumed if m["t"] == "event" and m["event"]["kind"] == "step"]
    assert 2_000 < len(steps) < 0.25 * 71_500 and steps[-1] == 70_000

    # a file rewritten under the fold (same path, other bytes before its offset): not trusted, read whole
    fresh_fold = fold.read_text()
    lines = events.read_text().splitlines(keepends=True)
    k = next(i for i, line in enumerate(lines) if '"kind": "step"' in line)  # the first step: always sent
    ev = json.loads(lines[k])
    lines[k] = json.dumps({**ev, "loss": 9.5}) + "\n"
    events.write_text("".join(lines))  # the same inode, the same last bytes
    fold.write_text(fresh_fold)
    after = _follow(tmp_path, True)
    assert [m["event"]["loss"] for m in after if m["t"] == "event" and m["event"].get("step") == ev["step"]][0] == 9.5
    assert _same(after, (fold.unlink(), _follow(tmp_path, True))[1])


def test_heartbeats_of_a_thinned_backlog_keep_the_memory_alerts_and_the_last_beat(tmp_path: Path) -> None:
    """Two ranks' heartbeats every 5 s over ~14 h (20,000 steps at 2.5 s): host RSS grows 10 -> 14 GiB, and the
    allocator retried in the last minutes. The thinned backlog holds a fraction of the heartbeats, and the record
    (memory_growth and alloc_retries alerts with their evidence, the heartbeat's age, the state) is the full read's."""
    t = T0
    lines: list[dict[str, Any]] = []

    def ev(kind: str, **kw: Any) -> None:
        lines.append({"v": 1, "ts": t, "kind": kind, "run_id": "x", "rank": kw.pop("rank", 0), "seq": len(lines),
                      **kw})

    steps = 20_000
    ev("run_start", total_steps=30_000, resumed_from=None)
    ev("phase", phase="training")
    retries = 0
    for n in range(1, steps + 1):
        t += 2.5
        ev("step", step=n, epoch=0, loss=4.0 / math.sqrt(n), acc=[0.5], lr=1e-3, grad_norm=1.0, tokens=4096,
           tokens_per_s=1600.0, step_time_s=2.5, queue_depth=0, queue_wait_s=0.0, recompiles=0, total_steps=30_000)
        if n % 2 == 0:
            if n > steps - 200:
                retries += 1
            for rank in (0, 1):
                ev("heartbeat", rank=rank, phase="training", step=n, rss_mb=10_240.0 + 4096.0 * n / steps,
                   gpu_mem_mb=60_000.0, gpu_reserved_mb=70_000.0, gpu_alloc_retries=retries)
    with open(tmp_path / "events.jsonl", "w") as fh:
        fh.writelines(json.dumps(line) + "\n" for line in lines)
    full, thin = _follow(tmp_path, False), _follow(tmp_path, True)
    beats = [sum(1 for m in msgs if m["t"] == "event" and m["event"]["kind"] == "heartbeat") for msgs in (full, thin)]
    assert beats[0] == 20_000 and beats[1] < 0.25 * beats[0], beats
    now = t + 3.0
    ra, rb = _fold(full, now).snapshot(), _fold(thin, now).snapshot()
    assert ra == rb, {k: (ra[k], rb[k]) for k in ra if ra[k] != rb.get(k)}
    evidence = {x["key"]: x["evidence"] for x in ra["alerts"]}
    assert "host RSS 10.1 GiB at step 240 -> 14.0 GiB at step 20000" in evidence["memory_growth"] and "rank 1" in evidence["memory_growth"], evidence
    assert "allocator retries" in evidence["alloc_retries"], evidence
    assert ra["state"] == "training" and ra["heartbeat_age_s"] == 3.0 and ra["step"] == steps


def test_the_wrappers_refresh_leaves_the_fold_a_thinned_follow_would_and_goes_on_from_it(tmp_path: Path) -> None:
    """refresh_backlog_fold (the run's wrapper runs it while the run writes, and when it ends): the
    fold it saves makes the next `follow` send exactly what a fresh thinned read sends, also after the run wrote on
    (read from the saved offset on, an over-long line and a line that is no JSON among the new ones)."""

    events = tmp_path / "events.jsonl"
    last_ts = _write_events(events, 40_000, 24_000)
    state = tmp_path / "state"
    state.mkdir()
    fold = state / BACKLOG_FOLD_FILE
    refresh_backlog_fold(str(state), str(events))
    assert json.loads(fold.read_text())["mark"]["offset"] == events.stat().st_size
    from_fold = _follow(tmp_path, True)
    fold.unlink()
    assert _same(from_fold, _follow(tmp_path, True))
    refresh_backlog_fold(str(state), str(events))
    with open(events, "a") as fh:
        t = last_ts
        for n in range(40_001, 41_001):
            t += 2.0
            fh.write(json.dumps({"v": 1, "ts": t, "kind": "step", "run_id": "x", "rank": 0, "seq": n, "step": n,
                                 "epoch": 0, "loss": 4.0 / math.sqrt(n), "acc": [0.5], "lr": 1e-3, "grad_norm": 1.0,
                                 "tokens": 4096, "tokens_per_s": 1365.0, "step_time_s": 2.0, "queue_depth": 0,
                                 "queue_wait_s": 0.0, "recompiles": 2, "total_steps": 50_000}) + "\n")
            if n == 40_500:
                fh.write('{"kind": "step", "pad": "' + "x" * (rules.MAX_EVENT_LINE + 10) + '"}\n')
                fh.write("not json\n")
        fh.write(partial := '{"v": 1, "kind": "step", "ste')  # the line being written: not folded yet
    before = fold.read_text()
    refresh_backlog_fold(str(state), str(events))
    saved = json.loads(fold.read_text())
    assert fold.read_text() != before and saved["mark"]["offset"] == events.stat().st_size - len(partial)
    resumed = _follow(tmp_path, True)
    fold.unlink()
    fresh = _follow(tmp_path, True)
    assert _same(resumed, fresh)
    bad = [m["error"] for m in fresh if m["t"] == "bad_event"]
    assert bad[-2:] == [f"longer than {rules.MAX_EVENT_LINE} bytes (MAX_EVENT_LINE)", "not JSON"], bad


def test_the_first_watch_of_a_long_run_sends_the_fold_its_wrapper_kept(tmp_path: Path, sshd,
                                                                       container: Callable[..., int]) -> None:
    """A real launch over ssh + pct of a run that writes 16,000 steps (5 MB of events) and ends: its wrapper leaves
    watch's backlog fold, and the first `watch --once` sends it (a mark put in the fold shows) instead of reading the
    file; what it shows is what a read of the whole file shows."""
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=container(200), runs={
        "r": script_run(tmp_path, "ok_run.py", "--steps", "16000", "--step-time", "0", "--load-time", "0",
                        tmux_session="kept-fold")})
    fold = tmp_path / ".opsctl" / "r" / BACKLOG_FOLD_FILE
    try:
        assert opsctl(hosts, "launch", "box", "r", "--follow", timeout=300).returncode == 0
        deadline = time.monotonic() + 60
        while not fold.exists():
            assert time.monotonic() < deadline, "the wrapper left no fold"
            time.sleep(0.1)
        assert json.loads(fold.read_text())["mark"]["offset"] == (tmp_path / "events.jsonl").stat().st_size

        def record() -> dict[str, Any]:
            r = opsctl(hosts, "watch", "box", "--once", "--json")
            assert r.returncode == 0, r.stderr
            rec = json.loads(r.stdout)
            return {k: v for k, v in (rec[0] if isinstance(rec, list) else rec).items() if k != "link"}

        saved = fold.read_text()
        tampered = json.loads(saved)
        last = tampered["ring"][-2][1]["event"]  # the last step (before run_end)
        assert last["kind"] == "step" and last["step"] == 16_000
        last["loss"] = 123.0
        fold.write_text(json.dumps(tampered))
        assert record()["loss"] == 123.0  # sent from the fold the wrapper kept, not read from the file
        fold.write_text(saved)
        kept = record()
        fold.unlink()
        whole = record()
        assert kept == whole and whole["step"] == 16_000 and whole["state"] == "finished"
    finally:
        opsctl(hosts, "kill", "box", "r")
