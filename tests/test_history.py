"""`opsctl history` and `opsctl launch HOST RUN -- ARGS`: every launch is an attempt recorded on the host (id, start,
end, how it ended, exit code, steps, its log file, checkpoint, extra arguments), newest last.

Through the real CLI on the local host (tmux, the wrapper); the shared rules (log mapping, argument joining) directly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import cleanup, drive, kill_tmux, of, opsctl, run_args, script_run  # noqa: E402

from opsctl import commands  # noqa: E402
from opsctl.remote import attempts, base, rules  # noqa: E402


def history(hosts: Path) -> list[dict[str, Any]]:
    r = opsctl(hosts, "history", "local", "r", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def status(hosts: Path) -> dict[str, Any]:
    st = json.loads(opsctl(hosts, "status", "local", "r", "--json").stdout)
    return st[0] if isinstance(st, list) else st


def test_history_of_launches_kills_crashes_refusals_and_extra_args(tmp_path: Path, sshd) -> None:
    counter = tmp_path / "counter"
    run = script_run(tmp_path, "flaky.py", "--counter", str(counter), "--fail-times", "1", "--steps", "400",
                     "--step-time", "0.05", tmux_session="opsctl-t-history", kill_grace=[0.5, 0.5])
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", local_runs={"r": run})
    try:
        assert history(hosts) == []
        # 1: crashes at its first step (flaky.py fails its first start)
        r = opsctl(hosts, "launch", "local", "r", "--follow")
        assert r.returncode == commands.EXIT_FAILED and "attempt 1," in r.stderr, r.stderr
        # 2: runs long, with extra arguments for this attempt only; 3: refused while 2 runs; then 2 is killed
        r = opsctl(hosts, "launch", "local", "r", "--", "--step-time", "0.1")
        assert r.returncode == 0 and "attempt 2," in r.stderr and "extra args --step-time 0.1" in r.stderr, r.stderr
        st = status(hosts)
        assert st["attempt"] == 2 and st["state"] == "training", st
        assert abs(st["started_at"] - time.time()) < 30 and 0 <= st["duration_s"] < 30
        r = opsctl(hosts, "status", "local", "r")  # the table: the attempt, its start and how long it has run
        assert r.returncode == 0 and re.search(r"#2 (\d\d-\d\d )?\d\d:\d\d(:\d\d)? \(\d+s\)", r.stdout), r.stdout
        r = opsctl(hosts, "launch", "local", "r")
        assert r.returncode == commands.EXIT_REFUSED
        assert opsctl(hosts, "kill", "local", "r").returncode == 0
        # 4: `--` arguments change the run's command: this one completes quickly
        r = opsctl(hosts, "launch", "local", "r", "--follow", "--", "--max-steps", "3")
        assert r.returncode == 0, r.stderr
        h = history(hosts)
        assert [a["id"] for a in h] == [1, 2, 3, 4]
        assert [a["outcome"] for a in h] == ["crashed", "killed", "refused", "finished"], h
        assert h[0]["exception"] == "RuntimeError: flaky failure 1 (test crash)" and h[0]["exit_code"] == 1
        assert h[1]["extra_args"] == ["--step-time", "0.1"] and h[1]["argv"][-2:] == ["--step-time", "0.1"]
        assert h[1]["first_step"] == 1 and h[1]["last_step"] >= 1 and h[1]["exception"] is None
        assert "not_running: run already running" in h[2]["reason"] and h[2]["log"] is None
        assert h[3]["extra_args"] == ["--max-steps", "3"] and h[3]["last_step"] == 3 and h[3]["exit_code"] == 0
        assert all(a["host"] == "local" and a["run"] == "r" for a in h)
        assert all(a["ended"] >= a["started"] and a["duration_s"] == a["ended"] - a["started"] for a in h)
        # the counter file saw exactly the three starts, with the extra arguments where given
        assert [ln.split(" ", 3)[3] for ln in counter.read_text().splitlines()][1:] == [
            f"--counter {counter} --fail-times 1 --steps 400 --step-time 0.05 --events {tmp_path / 'events.jsonl'}"
            " --step-time 0.1",
            f"--counter {counter} --fail-times 1 --steps 400 --step-time 0.05 --events {tmp_path / 'events.jsonl'}"
            " --max-steps 3"]
        # each attempt names the file that holds its log now
        assert [a["log"] for a in h] == [str(tmp_path / "run.log.2"), str(tmp_path / "run.log.1"), None,
                                         str(tmp_path / "run.log")]
        assert "flaky failure 1" in (tmp_path / "run.log.2").read_text()
        assert opsctl(hosts, "clean", "local", "r", "--logs").returncode == 0
        assert [a["log"] for a in history(hosts)] == [None, None, None, str(tmp_path / "run.log")]
        # the table: newest last, how each ended, the extra arguments
        r = opsctl(hosts, "history", "local", "r")
        assert r.returncode == 0, r.stderr
        rows = [ln for ln in r.stdout.splitlines() if ln.lstrip("│ ").split(" ")[0] in ("1", "2", "3", "4")]
        assert [ln.lstrip("│ ").split(" ")[0] for ln in rows] == ["1", "2", "3", "4"], r.stdout
        assert "crashed (RuntimeError" in rows[0] and "killed" in rows[1] and "refused (not_running" in rows[2]
        assert "finished" in rows[3] and "--step-time 0.1" in r.stdout and "run.log.1" not in r.stdout
    finally:
        kill_tmux(tmp_path, "r")


def test_arguments_without_a_double_dash_are_refused(tmp_path: Path, sshd) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", local_runs={"r": script_run(tmp_path, "ok_run.py")})
    r = opsctl(hosts, "launch", "local", "r", "--max-steps")
    assert r.returncode == commands.EXIT_USAGE  # argparse: an unknown option
    r = opsctl(hosts, "launch", "local", "r", "200")
    assert r.returncode == commands.EXIT_USAGE and "go after --" in r.stderr, r.stderr
    assert not (tmp_path / ".opsctl" / "r" / "history.jsonl").exists()  # nothing was launched, nor refused


def test_an_attempt_whose_wrapper_died_is_lost(tmp_path: Path) -> None:
    args = run_args(tmp_path, "ok_run.py", "--steps", "1000", "--step-time", "0.1")
    try:
        assert drive("launch", args)[0] == 0
        attempts = of(drive("history", args)[1], "history")[0]["attempts"]
        assert [a["outcome"] for a in attempts] == ["running"]
        info = json.loads((tmp_path / "state" / "pid").read_text())
        os.kill(info["wrapper_pid"], signal.SIGKILL)  # a reboot, an OOM kill of the wrapper: no end recorded
        os.kill(info["pid"], signal.SIGKILL)
        time.sleep(0.5)
        attempts = of(drive("history", args)[1], "history")[0]["attempts"]
        assert [a["outcome"] for a in attempts] == ["lost"] and attempts[0].get("ended") is None, attempts
    finally:
        cleanup(args)


def test_history_maps_each_attempt_to_its_rotated_log(tmp_path: Path) -> None:
    log, state = str(tmp_path / "run.log"), str(tmp_path / "state")
    Path(state).mkdir()
    for i in range(4):
        _, seq = attempts.rotate_logs(log, 2, state)  # keep_logs 2: the oldest log goes
        Path(log).write_text("" if i == 2 else f"attempt {i + 1}\n")  # attempt 3 writes nothing
        attempts.history_add(state, started=float(i), log_seq=seq)
    _, seq = attempts.rotate_logs(log, 2, state)  # a fifth attempt
    Path(log).write_text("attempt 5\n")
    attempts.history_add(state, started=4.0, log_seq=seq)
    attempts.history_add(state, started=5.0, outcome="refused")  # a refused launch never rotates, and has no log
    h = attempts.read_history(state, log, 2)
    assert [a["id"] for a in h] == [1, 2, 3, 4, 5, 6]
    # 1 rotated out (keep_logs 2), 2 -> LOG.2, 3 was empty and its file reused by 4 -> LOG.1, 5 -> LOG
    assert [a["log"] for a in h] == [None, log + ".2", None, log + ".1", log, None]
    assert Path(log + ".2").read_text() == "attempt 2\n" and Path(log + ".1").read_text() == "attempt 4\n"
    attempts.history_add(state, id=2, outcome="crashed")  # a later record of an attempt merges into it
    assert attempts.read_history(state, log, 2)[1]["outcome"] == "crashed"
    with open(Path(state) / base.HISTORY_FILE, "a") as fh:
        fh.write('{"id": 6, "started"')  # a writer that died mid-line leaves no attempt behind
    assert len(attempts.read_history(state, log, 2)) == 6


def test_attempt_clock_spells_start_and_duration() -> None:
    from opsctl.runstate import attempt_clock, fmt_span

    assert [fmt_span(x) for x in (None, 5, 725, 3 * 3600 + 7 * 60, 2 * 86400 + 4 * 3600)] == [
        "-", "5s", "12m05s", "3h07m", "2d04h"]
    noon = time.mktime((*time.localtime()[:3], 12, 0, 0, 0, 0, -1))  # today, 12:00 local time
    assert attempt_clock({"attempt": 3, "started_at": noon, "duration_s": 252}) == "#3 12:00:00 (4m12s)"
    assert attempt_clock({"attempt": 3, "started_at": noon - 3 * 86400, "duration_s": 1}) == (
        "#3 " + time.strftime("%m-%d %H:%M", time.localtime(noon - 3 * 86400)) + " (1s)")  # another day: its date
    assert attempt_clock({"attempt": None, "started_at": None}) == "-"


def test_extra_and_resume_arguments_join_the_command() -> None:
    assert rules.with_args(["python", "train.py"], ["--max-steps", "200"]) == ["python", "train.py", "--max-steps", "200"]
    # a shell script gets them quoted onto the script, where the program sees them (not as $0, $1)
    assert rules.with_args(["bash", "-c", "python train.py"], ["--note", "a b"]) == [
        "bash", "-c", "python train.py --note 'a b'"]
    assert rules.resume_argv(["python", "t.py", "--resume", "auto"], ["--resume", "auto"]) == [
        "python", "t.py", "--resume", "auto"]  # already there: not twice
    assert rules.resume_argv(["python", "t.py"], ["--resume", "auto"]) == ["python", "t.py", "--resume", "auto"]
    assert rules.resume_argv(["sh", "-c", "python t.py --resume auto"], ["--resume", "auto"]) == [
        "sh", "-c", "python t.py --resume auto"]


def test_history_and_status_of_an_ended_and_cleaned_run(tmp_path: Path) -> None:
    """history: whole paths (folded, never `...`), a checkpoint keep_last deleted says `(deleted)`, a refusal's
    advice cut to its start; status of an ended run: phase `ended`, no heartbeat age; after `clean` it still names
    the last attempt (pid `cleaned`), as history lists it."""
    deep = tmp_path / "a-rather-long-directory-name" / "and-another-one-below-it"
    deep.mkdir(parents=True)
    ckpt = deep / "ckpt"
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(json.dumps({"hosts": {"local": {"local": True, "runs": {"r": script_run(
        deep, "ok_run.py", "--steps", "1000", "--step-time", "0.05", "--checkpoint-steps", "1",
        "--ckpt-dir", str(ckpt), tmux_session="hist-ended")}}}}))
    try:
        assert opsctl(hosts, "launch", "local", "r").returncode == 0
        assert opsctl(hosts, "kill", "local", "r").returncode == 0
        (a,) = history(hosts)
        assert a["checkpoint"].startswith(str(ckpt)) and a["checkpoint_exists"] is True, a
        kept = a["checkpoint"]
        os.unlink(kept)  # as keep_last does
        env = dict(os.environ, COLUMNS="100", NO_COLOR="1", TERM="dumb")
        r = subprocess.run([sys.executable, "-m", "opsctl", "--hosts", str(hosts), "history", "local", "r"],
                           capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0 and "…" not in r.stdout, r.stdout
        rows = [ln.split("│") for ln in r.stdout.splitlines() if ln.startswith("│")]  # the one attempt's lines
        cells = ["".join(row[i].strip() for row in rows) for i in range(len(rows[0]))]  # each column, unfolded
        assert kept + "(deleted)" in cells and str(deep / "run.log") in cells, (cells, r.stdout)
        st = status(hosts)
        assert st["state"] == "killed" and st["heartbeat_age_s"] is None and st["phase"] == "training", st
        row = next(ln for ln in opsctl(hosts, "status", "local", "r").stdout.splitlines() if "│ r " in ln)
        assert " ended " in row and " s ago" not in row and "#1 " in row, row
        assert opsctl(hosts, "clean", "local", "r").returncode == 0
        st = status(hosts)
        assert st["cleaned"] is True and st["attempt"] == 1 and st["pid"] is None, st
        row = next(ln for ln in opsctl(hosts, "status", "local", "r").stdout.splitlines() if "│ r " in ln)
        assert " cleaned " in row and "#1 " in row, row
    finally:
        kill_tmux(deep, "r")


def test_history_cuts_a_long_refusal_to_its_first_lines() -> None:
    from opsctl.history import short_why

    advice = "not_finished: run already finished\n" + "\n".join(f"advice line {i}" for i in range(24))
    assert short_why(advice) == "not_finished: run already finished\nadvice line 0 ..."
    assert short_why("RuntimeError: boom") == "RuntimeError: boom"
    assert short_why("x" * 500).endswith(" ...") and len(short_why("x" * 500)) < 170
