"""`opsctl init` outside the repository: the sample run it writes must start where it was written, and launch's
preflight must refuse a run whose config file or workdir is not on the host before anything starts.

Real processes throughout: the CLI as a user runs it (cwd = a fresh directory, no --hosts), the real tiny dflash run
in tmux on the `local` host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import REPO, build_tiny_default, kill_tmux  # noqa: E402

from opsctl.commands import EXIT_REFUSED  # noqa: E402


def cli(cwd: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """opsctl as a newcomer runs it: in their own directory, inventory found as ./hosts.yaml (XDG_CONFIG_HOME there,
    so no ~/.config/opsctl/hosts.yaml of this machine is picked up; HOME stays: the tiny target is cached under it)."""
    env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb", XDG_CONFIG_HOME=str(cwd / ".config"))
    env.pop("OPSCTL_HOSTS", None)
    return subprocess.run([sys.executable, "-m", "opsctl", *argv], cwd=str(cwd), capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_init_sample_run_starts_outside_the_repository(tmp_path: Path) -> None:
    """It used to say `dflash: configs/tiny.yaml: cannot read config` after preflight passed: the config is now
    written beside hosts.yaml, so the sample reaches READY from a directory that is not the checkout."""
    build_tiny_default()  # the tiny target and records in the shared cache: the launch measures launching
    home = tmp_path / "newcomer"
    home.mkdir()
    assert REPO not in home.parents
    r = cli(home, "init")
    assert r.returncode == 0, r.stderr
    assert f"wrote {home / 'tiny.yaml'}" in r.stderr, r.stderr
    assert (home / "tiny.yaml").read_text() == (REPO / "configs" / "tiny.yaml").read_text()
    assert cli(home, "hosts", "check").returncode == 0
    try:
        r = cli(home, "launch", "local", "tiny")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert "READY tiny: first step event" in r.stderr and "FAIL" not in r.stderr, r.stderr
        assert "ok   config" not in r.stderr  # a passed config check says nothing more than the others
        (st,) = json.loads(cli(home, "status", "local", "tiny", "--json").stdout)
        assert st["state"] == "training" and st["step"] >= 1 and st["exception"] is None, st
        assert (home / "runs" / "tiny" / "events.jsonl").is_file()  # where the sample says, beside hosts.yaml
    finally:
        cli(home, "kill", "local", "tiny")
        kill_tmux(home, "tiny")
    # a second init keeps the user's config (it may be edited), and says so
    (home / "tiny.yaml").write_text("# mine\n")
    r = cli(home, "init", "--force")
    assert r.returncode == 0 and "kept the existing" in r.stderr and (home / "tiny.yaml").read_text() == "# mine\n"


def _refusal(stderr: str) -> str:
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("FAIL")]
    return line


def test_launch_refuses_a_run_whose_config_or_workdir_is_missing(tmp_path: Path) -> None:
    """One FAIL line naming the host, the path and what to do; exit 5 (refused); nothing started, no log made."""
    home = tmp_path / "newcomer"
    home.mkdir()
    assert cli(home, "init").returncode == 0
    (home / "tiny.yaml").unlink()
    r = cli(home, "launch", "local", "tiny", timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr
    line = _refusal(r.stderr)
    assert f"{home / 'tiny.yaml'} (the run's --config) does not exist on host local" in line, line
    assert "fix --config" in line and "Traceback" not in r.stderr and "READY" not in r.stderr
    assert not (home / "runs").exists() and not (home / ".opsctl" / "tiny" / "pid").exists()

    inv = yaml.safe_load((home / "hosts.yaml").read_text())
    inv["hosts"]["local"]["runs"]["tiny"]["workdir"] = str(tmp_path / "gone")
    (home / "hosts.yaml").write_text(yaml.safe_dump(inv))
    r = cli(home, "launch", "local", "tiny", timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr
    line = _refusal(r.stderr)
    assert f"{tmp_path / 'gone'} does not exist on host local: create it there" in line, line
    assert not (tmp_path / "gone").exists()
