"""`opsctl launch`: the training core's phases as one rich progress bar on a terminal, one line per phase in a pipe.

Through the real sshd and agent, with a run that reports its load layer by layer (tests/runs/phased_run.py).
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

from rich.console import Console

from opsctl import commands

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import opsctl, script_run  # noqa: E402


def _hosts(tmp_path: Path, sshd, session: str) -> Path:
    return sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"p": script_run(
        tmp_path, "phased_run.py", "--layers", "64", tmux_session=session)})


def test_piped_launch_prints_one_line_per_phase_not_per_layer(tmp_path: Path, sshd) -> None:
    hosts = _hosts(tmp_path, sshd, "prog-pipe")
    try:
        r = opsctl(hosts, "launch", "box", "p", "--follow")
        assert r.returncode == 0, r.stderr
        phase_lines = [ln for ln in r.stderr.splitlines() if ln.startswith("phase ")]
        assert phase_lines == ["phase loading_target", "phase compiling"], r.stderr
        assert "target loaded" in r.stdout
    finally:
        opsctl(hosts, "clean", "box", "p")


def test_terminal_launch_draws_a_progress_bar_that_ends_at_64_of_64(tmp_path: Path, sshd) -> None:
    hosts = _hosts(tmp_path, sshd, "prog-tty")
    buf, raw = io.StringIO(), io.StringIO()
    term = Console(file=buf, force_terminal=True, width=100, color_system=None, highlight=False)
    ctx = commands.Ctx(hosts_file=str(hosts), err=term, out=term, raw=raw)
    try:
        assert commands.cmd_launch(ctx, "box", "p", follow=True) == 0
    finally:
        commands.cmd_clean(commands.Ctx(hosts_file=str(hosts)), "box", "p")
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())  # cursor moves between redraws
    assert "loading_target" in screen and "64/64" in screen and "━" in screen, screen
    assert "compiling" in screen and "layer 64" in screen
    assert "phase loading_target" not in screen  # the pipe form is not used on a terminal
    assert "target loaded" in raw.getvalue()  # log lines still go to stdout
