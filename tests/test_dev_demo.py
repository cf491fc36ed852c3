"""`./dev demo` succeeds on every call: first run, after a finish, after a kill, after a crash (issue 8 item 4).

It runs the real script on a copy of the repo's entry files (dev, hosts.yaml, configs/) in a temporary directory,
with this test's virtualenv, so the real tiny run trains through opsctl exactly as a new user's would. The copy's
tiny config is shortened (fewer steps, no target pretraining) to keep four full demos affordable on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from opsctl.remote.procs import tmux_socket_path

REPO = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)


def _demo_dir(tmp: Path) -> Path:
    d = tmp / "demo"
    d.mkdir()
    for name in ("dev", "hosts.yaml", "pyproject.toml"):
        shutil.copy2(REPO / name, d / name)
    shutil.copytree(REPO / "configs", d / "configs")
    cfg = yaml.safe_load((d / "configs" / "tiny.yaml").read_text())
    cfg["train"].update(max_steps=24, checkpoint_every=8, eval_prompts=4)  # tau at each checkpoint on 4 prompts, not 32
    # dev's control flow is under test, not the one-off target pretraining (minutes on a loaded 2-core box)
    cfg["target"].pop("pretrain", None)
    (d / "configs" / "tiny.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    stamp = VENV / ".dflash-installed"
    # dev reinstalls when pyproject.toml is newer than the venv's stamp: this copy must not look newer
    os.utime(d / "pyproject.toml", (stamp.stat().st_mtime - 10, stamp.stat().st_mtime - 10))
    return d


def _run(d: Path, *argv: str, timeout: float = 420, prompts: int = 1) -> subprocess.CompletedProcess[str]:
    # DEMO_EVAL_PROMPTS: the demo's closing `dflash eval` on 4 prompts (the first demo, whose eval output is checked)
    # or 1 (the later ones, where only the run's ending is) instead of 32: its control flow is under test
    env = dict(os.environ, DFLASH_VENV=str(VENV), NO_COLOR="1", COLUMNS="200", TERM="dumb",
               DEMO_EVAL_PROMPTS=str(prompts))
    env.pop("OPSCTL_HOSTS", None)
    return subprocess.run(list(argv), cwd=str(d), env=env, capture_output=True, text=True, timeout=timeout)


def _status(d: Path) -> dict:
    r = _run(d, str(VENV / "bin" / "opsctl"), "status", "local", "tiny", "--json", timeout=60)
    return json.loads(r.stdout)[0]  # a list, one object per run (docs/cli-json.md)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_dev_demo_succeeds_first_after_finish_after_kill_after_crash(tmp_path: Path) -> None:
    if not (VENV / ".dflash-installed").is_file():
        pytest.skip("the venv was not made by ./dev (no .dflash-installed stamp): dev would reinstall it")
    d = _demo_dir(tmp_path)
    opsctl = str(VENV / "bin" / "opsctl")
    sock = Path(tmux_socket_path(str(d / ".opsctl" / "tiny")))  # under xdist's long temp root: /tmp/opsctl-tmux-UID/
    try:
        r = _run(d, "./dev", "demo", prompts=4)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        st = _status(d)
        assert (st["state"], st["step"], st["total_steps"]) == ("finished", 24, 24), st
        # the demo ends with the drafter's worth: eval of the final checkpoint on held-out prompts, with the baseline
        assert "dflash eval --checkpoint runs/tiny/checkpoints/step-24 --baseline ngram --num-prompts 4" in r.stdout
        assert "n-gram (prompt lookup)" in r.stdout and "4 prompts" in r.stdout, r.stdout[-3000:]

        r = _run(d, "./dev", "demo")  # after a finish: the finished run is kept aside, a new one trains
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert "the last tiny run had finished: kept it as runs/tiny." in r.stdout
        assert len(list(d.glob("runs/tiny.*"))) == 1 and _status(d)["state"] == "finished"

        shutil.rmtree(d / "runs" / "tiny")  # after a kill: resumes at the killed step
        assert _run(d, opsctl, "launch", "local", "tiny").returncode == 0
        assert _run(d, opsctl, "kill", "local", "tiny", timeout=180).returncode == 0
        assert _status(d)["state"] == "killed"
        r = _run(d, "./dev", "demo")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        st = _status(d)
        assert (st["state"], st["step"]) == ("finished", 24), st

        # after a crash (the trainer aborts mid-run: SIGABRT; a SIGKILL from outside opsctl now reads `killed`)
        shutil.rmtree(d / "runs" / "tiny")
        assert _run(d, opsctl, "launch", "local", "tiny").returncode == 0
        deadline = time.monotonic() + 240
        while _status(d)["step"] < 10 and time.monotonic() < deadline:  # past its first checkpoint
            time.sleep(0.5)
        os.kill(_status(d)["pid"], signal.SIGABRT)
        deadline = time.monotonic() + 60
        while _status(d)["state"] != "crashed" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _status(d)["state"] == "crashed"
        r = _run(d, "./dev", "demo")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        st = _status(d)
        assert (st["state"], st["step"]) == ("finished", 24), st
    finally:
        # the run lives in its own session: stop it through opsctl (by its pid file) before its tmux server
        _run(d, opsctl, "kill", "local", "tiny", timeout=180)
        if sock.exists():
            subprocess.run(["tmux", "-S", str(sock), "kill-server"], capture_output=True)
