"""`opsctl launch --follow --progress` / `logs -f --progress` (what `./dev demo` follows with): a run's training as one
progress bar on a terminal (step/total, loss, τ of the live `eval` events, tokens/s), a bounded number of lines into a
pipe, and every line still in the run's log (issue 25 item 15).

Real processes: the CLI as a user runs it (in a pseudo-terminal for the bar), a local host, and a run that writes the
real event contract (tests/runs/eval_run.py: steps, then an `eval` every few steps).
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import REPO, kill_tmux, script_run  # noqa: E402

STEPS = 60
TAUS = "2.5,3.1,3.4"  # evaluations at steps 20, 40 and 60


def _hosts(tmp_path: Path) -> Path:
    run = script_run(tmp_path, "eval_run.py", "--steps", str(STEPS), "--step-time", "0.05", "--eval-every", "20",
                     "--taus", TAUS)
    path = tmp_path / "hosts.yaml"
    path.write_text(yaml.safe_dump({"hosts": {"local": {"local": True, "runs": {"p": run}}}}))
    return path


def _argv(hosts: Path, *argv: str) -> list[str]:
    return [sys.executable, "-m", "opsctl", "--hosts", str(hosts), *argv]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPSCTL_HOSTS", "NO_COLOR")}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _in_pty(argv: list[str], timeout: float = 120) -> tuple[int, str]:
    """Run argv with stdin, stdout and stderr on a pseudo-terminal (as in a user's shell); its exit code and what
    the terminal received, cursor movements and colours stripped."""
    master, slave = pty.openpty()
    p = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=str(REPO),
                         env=_env(TERM="xterm-256color", COLUMNS="160", LINES="40"))
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif p.poll() is not None:
                break
        rc = p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    text = out.decode(errors="replace")
    text = re.sub(r"\x1b\[[0-9;]*m|\x1b\][^\x07]*\x07", "", text)  # colours, titles
    return rc, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "\n", text)  # cursor moves between redraws: new lines


def test_launch_follow_progress_on_a_terminal_draws_a_bar_with_step_loss_tau_and_tokens_per_s(tmp_path: Path) -> None:
    hosts = _hosts(tmp_path)
    try:
        rc, screen = _in_pty(_argv(hosts, "launch", "local", "p", "--follow", "--progress"))
    finally:
        kill_tmux(tmp_path, "p")
    assert rc == 0, screen[-3000:]
    bar = [ln for ln in screen.splitlines() if "tok/s" in ln and "/60" in ln]
    assert bar, screen[-3000:]
    last = bar[-1]
    assert "60/60" in last and "loss 0.0667" in last and "τ 3.40" in last, last
    # the run's rate (real tokens per wall second, what status and watch show): each step says 500 tok/s over its
    # 0.05 s, and the wall clock between steps adds the writing of the event
    rate = float(re.search(r"([\d,]+) tok/s", last)[1].replace(",", ""))
    assert 400 <= rate <= 505, last
    assert "━" in last  # a bar, not a line of text
    assert any("τ 2.50" in ln for ln in bar), "τ came from the live eval events, as each arrived"
    # the step lines are in the bar, not printed; the evaluations are said once each
    lines = set(screen.splitlines())
    assert not any(f"step {i}" == ln.strip() for i in range(1, STEPS + 1) for ln in lines)
    assert "eval step 40: τ 3.10 (n-gram 1.80)" in screen
    log = (tmp_path / "run.log").read_text().splitlines()
    assert [ln for ln in log if ln.startswith("step ")] == [f"step {i}" for i in range(1, STEPS + 1)]  # all kept


def test_launch_follow_progress_into_a_pipe_prints_a_bounded_number_of_lines(tmp_path: Path) -> None:
    hosts = _hosts(tmp_path)
    try:
        r = subprocess.run(_argv(hosts, "launch", "local", "p", "--follow", "--progress"), cwd=str(REPO),
                           capture_output=True, text=True, timeout=120, env=_env(NO_COLOR="1", TERM="dumb"))
    finally:
        kill_tmux(tmp_path, "p")
    assert r.returncode == 0, r.stderr
    steps = [ln for ln in r.stdout.splitlines() if re.match(r"step \d+/60 ", ln)]
    assert 3 <= len(steps) <= 22 and steps[-1].startswith("step 60/60  loss 0.0667  τ 3.40  "), r.stdout
    assert 400 <= float(re.search(r"([\d,]+) tok/s", steps[-1])[1].replace(",", "")) <= 505, steps[-1]  # the rate
    assert not re.search(r"^step \d+$", r.stdout, re.M)  # the run's own step lines stay in its log
    total = len(r.stdout.splitlines()) + len(r.stderr.splitlines())
    assert total < 45, (total, r.stdout, r.stderr)  # the run logs 60 step lines + 3 eval lines; no progress: > 63
    plain = subprocess.run(_argv(hosts, "logs", "local", "p", "-n", "1000"), cwd=str(REPO), capture_output=True,
                           text=True, timeout=60, env=_env(NO_COLOR="1"))
    assert len(re.findall(r"^step \d+$", plain.stdout, re.M)) == STEPS  # the full lines, still in the log


def test_logs_follow_progress_replays_to_the_end_and_needs_follow(tmp_path: Path) -> None:
    hosts = _hosts(tmp_path)
    try:
        r = subprocess.run(_argv(hosts, "launch", "local", "p", "--follow"), cwd=str(REPO), capture_output=True,
                           text=True, timeout=120, env=_env(NO_COLOR="1"))
        assert r.returncode == 0, r.stderr
        assert len(re.findall(r"^step \d+$", r.stdout, re.M)) == STEPS  # without --progress: every line, as before
        r = subprocess.run(_argv(hosts, "logs", "local", "p", "-f", "--progress"), cwd=str(REPO),
                           capture_output=True, text=True, timeout=60, env=_env(NO_COLOR="1"))
        assert r.returncode == 0, r.stderr
        assert "step 60/60  loss 0.0667  τ 3.40" in r.stdout, r.stdout
        assert len(r.stdout.splitlines()) < 45
        r = subprocess.run(_argv(hosts, "logs", "local", "p", "--progress"), cwd=str(REPO), capture_output=True,
                           text=True, timeout=60, env=_env(NO_COLOR="1"))
        assert r.returncode == 2 and "add -f" in r.stderr and "Traceback" not in r.stderr
    finally:
        kill_tmux(tmp_path, "p")
