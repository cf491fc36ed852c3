"""One colour per run state everywhere: `opsctl status`, the group verbs and the dashboard draw a state with the same
style (opsctl/look.py STATE_STYLES), and every such style is readable on a dark and on a light terminal.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import yaml
from rich.color import Color
from rich.style import Style

from opsctl import commands, group_verbs, runstate
from opsctl.look import STATE_STYLES

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import RUNS  # noqa: E402


def derivable_states() -> set[str]:
    """Every state RunState can report: the string literals `_derive_state` returns, and `unreachable_view`'s."""
    states: set[str] = set()
    for fn in (runstate.RunState._derive_state, runstate.unreachable_view):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Constant):
                states.add(node.value.value)
            elif isinstance(node, ast.IfExp):
                states |= {n.value for n in (node.body, node.orelse) if isinstance(n, ast.Constant)}
            elif isinstance(node, ast.keyword) and node.arg == "state" and isinstance(node.value, ast.Constant):
                states.add(node.value.value)
    return states


def test_every_state_runstate_can_report_has_one_style_shared_by_status_and_the_dashboard() -> None:
    states = derivable_states()
    assert {"absent", "starting", "loading", "compiling", "training", "stalled", "restarting", "finished", "crashed",
            "killed", "refused", "unreachable"} <= states, states  # the walk found them all
    assert states <= set(STATE_STYLES), states - set(STATE_STYLES)
    for state in states | {"degraded", "connecting"}:  # a group's partial state; the dashboard's first moments
        assert commands.STATE_COLOURS[state] == STATE_STYLES[state], state
        assert group_verbs.STATE_COLOURS[state] == STATE_STYLES[state], state


def _luminance(c: Color) -> float:
    def chan(v: int) -> float:
        x = v / 255
        return x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4

    r, g, b = c.get_truecolor()
    return 0.2126 * chan(r) + 0.7152 * chan(g) + 0.0722 * chan(b)


def test_every_state_style_brings_its_own_background_with_readable_text() -> None:
    """A bare foreground cannot suit both: the stalled yellow vanishes on a light terminal, a dark grey on a dark one.
    Each style sets text and background, at a WCAG contrast of at least 3:1 (bold text), so the terminal's own
    background never matters."""
    for state, style in STATE_STYLES.items():
        s = Style.parse(style)
        assert s.color is not None and s.bgcolor is not None and s.bold, (state, style)
        hi, lo = sorted((_luminance(s.color), _luminance(s.bgcolor)), reverse=True)
        assert (hi + 0.05) / (lo + 0.05) >= 3.0, (state, style, round((hi + 0.05) / (lo + 0.05), 2))


def test_status_table_draws_a_finished_run_in_the_dashboards_finished_colour(tmp_path: Path) -> None:
    """The real CLI in colour: the state cell of a finished run carries the badge's exact background (#005fd7)."""
    run = {"workdir": str(tmp_path), "command": ["{python}", str(RUNS / "ok_run.py"), "--events",
                                                 str(tmp_path / "events.jsonl"), "--steps", "3", "--step-time", "0.01"],
           "log": "run.log", "events": "events.jsonl", "tmux_session": "colour-done", "kill_grace": [1, 1]}
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump({"hosts": {"here": {"local": True, "runs": {"done": run}}}}))
    env = dict(os.environ, COLUMNS="200", TERM="xterm-256color", COLORTERM="truecolor", FORCE_COLOR="1")
    env.pop("NO_COLOR", None)

    def opsctl(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "opsctl", "--hosts", str(hosts), *argv], capture_output=True,
                              text=True, timeout=120, env=env)

    try:
        assert opsctl("launch", "here", "done").returncode == 0
        deadline = time.monotonic() + 60
        while "finished" not in (out := opsctl("status", "here", "done").stdout):
            assert time.monotonic() < deadline, out
            time.sleep(0.5)
        bg = Style.parse(STATE_STYLES["finished"]).bgcolor
        assert bg is not None
        r, g, b = bg.get_truecolor()
        assert f"48;2;{r};{g};{b}" in out, out  # the dashboard's FINISHED background, not a named ANSI colour
    finally:
        opsctl("clean", "here", "done")
