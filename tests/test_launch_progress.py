"""`opsctl launch`: the training core's phases as one rich progress bar on a terminal, one line per phase in a pipe.

Through the real sshd and agent, with a run that reports its load layer by layer (tests/runs/phased_run.py).
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import yaml
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


# -- a `\r` progress bar in the log (transformers' `Loading weights`): its last state, once -------------------------
class _TtyBuffer(io.StringIO):
    """stdout that says it is a terminal: launch then prints log lines above its phase bars (PhaseProgress.line)."""

    def isatty(self) -> bool:
        return True


def _bar_hosts(tmp_path: Path, session: str) -> Path:
    run = script_run(tmp_path, "bar_run.py", "--n", "30", tmux_session=session)
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump({"hosts": {"here": {"local": True, "runs": {"bar": run}}}}))
    return hosts


FINAL_BAR = "Loading weights: 100%|██████████| 30/30 [30it]"


def test_launch_shows_a_carriage_return_bar_as_its_last_state_and_the_log_keeps_every_state(tmp_path: Path) -> None:
    """Piped: the bar's line is its final state alone (no `\\r`, no 0 % ... 97 % states); on a terminal, the same one
    line above the phase bars, not the 31 states run together. The log file still has all of them."""
    hosts = _bar_hosts(tmp_path, "bar-pipe")
    try:
        r = opsctl(hosts, "launch", "here", "bar", "--follow")
        assert r.returncode == 0, r.stderr
        assert r.stdout.count("Loading weights") == 1, r.stdout  # (text mode would turn a `\r` into a line)
        assert FINAL_BAR in r.stdout.splitlines() and "target loaded" in r.stdout
        log = (tmp_path / "run.log").read_bytes()
        assert log.count(b"\rLoading weights") == 31 and b"Loading weights:  50%" in log  # all kept
    finally:
        opsctl(hosts, "clean", "here", "bar")

    (tmp_path / "tty").mkdir()
    hosts = _bar_hosts(tmp_path / "tty", "bar-tty")
    buf = io.StringIO()
    term = Console(file=buf, force_terminal=True, width=100, color_system=None, highlight=False)
    ctx = commands.Ctx(hosts_file=str(hosts), err=term, out=term, raw=_TtyBuffer())
    try:
        assert commands.cmd_launch(ctx, "here", "bar", follow=True) == 0
    finally:
        commands.cmd_clean(commands.Ctx(hosts_file=str(hosts)), "here", "bar")
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    assert screen.count("Loading weights") == 1 and FINAL_BAR in screen, screen
    assert "loading_target" in screen and "30/30" in screen  # the phase bar still draws
