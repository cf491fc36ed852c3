"""Launch after an extended attempt, and what `launch --follow` draws mid-training (issue 39 item 5), through the real
CLI over the repo's sshd and `pct` stand-in.

A run extended with `-- --max-steps 400` and killed leaves its newest checkpoint past the plain command's last step:
a plain launch is refused by preflight (exit 5, nothing started), not by the training core after its start-up. An
evaluation in the middle of training is no launch phase: `launch --follow` without `--progress` draws no bar for it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import opsctl, script_run  # noqa: E402


def _wait_for(path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}"
        time.sleep(0.05)


def test_a_plain_launch_after_an_extended_and_killed_attempt_is_refused_by_preflight(
        tmp_path: Path, sshd, container: Callable[..., int]) -> None:
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"max_steps": 5}))
    run = script_run(tmp_path, "resume_run.py", "--out", str(tmp_path / "out"), "--config", str(config),
                     "--resume", "auto", "--step-time", "0.05", tmux_session="extended", kill_grace=[5, 2])
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=container(200), runs={"r": run})
    log = tmp_path / "run.log"
    try:
        r = opsctl(hosts, "launch", "box", "r", "--follow")
        assert r.returncode == 0 and "run ended at step 5" in log.read_text(), r.stderr
        assert opsctl(hosts, "launch", "box", "r", "--", "--max-steps", "400").returncode == 0
        _wait_for(log, "step 9\n")
        assert opsctl(hosts, "kill", "box", "r").returncode == 0
        stopped = int(log.read_text().split("run ended at step ")[1].split()[0])
        assert 9 <= stopped < 400
        before = log.read_text()
        r = opsctl(hosts, "launch", "box", "r")
        flat = " ".join(r.stderr.split())
        assert r.returncode == 5, r.stderr
        assert f"FAIL not_finished: run r would resume past its own end: its newest checkpoint is at step {stopped}" \
            in flat and "this command trains 5 steps (its attempt #1 with this command trained 5 steps)" in flat, flat
        assert "-- --max-steps N" in flat and "launched" not in flat
        assert log.read_text() == before  # nothing started: the log is the killed attempt's
        last = json.loads(opsctl(hosts, "history", "box", "r", "--json").stdout)[-1]
        assert last["outcome"] == "refused" and "would resume past its own end" in last["reason"]
        # the same extension again goes on from the checkpoint
        r = opsctl(hosts, "launch", "box", "r", "--", "--max-steps", str(stopped + 2))
        assert r.returncode == 0, r.stderr
        _wait_for(log, f"run ended at step {stopped + 2}")
    finally:
        opsctl(hosts, "kill", "box", "r")


def test_launch_follow_without_progress_draws_no_phase_for_an_evaluation_mid_training(
        tmp_path: Path, sshd, container: Callable[..., int]) -> None:
    run = script_run(tmp_path, "eval_run.py", "--steps", "6", "--eval-every", "2", "--taus", "2.0,2.5,3.0",
                     tmux_session="follow-evals")
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=container(200), runs={"r": run})
    try:
        r = opsctl(hosts, "launch", "box", "r", "--follow")
        assert r.returncode == 0, r.stderr
        events = (tmp_path / "events.jsonl").read_text()
        assert events.count('"phase":"evaluating"') == 3  # the run did evaluate mid-training, three times
        assert "phase evaluating" not in r.stderr and "evaluating" not in r.stderr, r.stderr
        assert "step 6" in r.stdout
    finally:
        opsctl(hosts, "kill", "box", "r")
