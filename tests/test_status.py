"""`opsctl status` through SSH + pct: a finished, a crashed and a killed run side by side, table and JSON.

The state comes from the shared RunState reducer fed with the agent's snapshot (events tail + process state).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import opsctl, script_run  # noqa: E402


def test_status_of_finished_crashed_killed_and_never_started(tmp_path: Path, sshd,
                                                              container: Callable[..., int]) -> None:
    vmid = container(200)
    runs = {}
    for name, script, args in [("done", "ok_run.py", ["--steps", "2", "--step-time", "0.05"]),
                               ("boom", "crash_loading.py", ["--delay", "0"]),
                               ("stop", "ok_run.py", ["--steps", "1000", "--step-time", "0.05"]),
                               ("never", "ok_run.py", [])]:
        d = tmp_path / name
        d.mkdir()
        runs[name] = script_run(d, script, *args, tmux_session=f"st-{name}")
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=vmid, runs=runs)
    assert opsctl(hosts, "launch", "box", "done", "--follow").returncode == 0
    assert opsctl(hosts, "launch", "box", "boom").returncode == 1
    assert opsctl(hosts, "launch", "box", "stop").returncode == 0
    assert opsctl(hosts, "kill", "box", "stop").returncode == 0
    r = opsctl(hosts, "status", "box", "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["run"]: row for row in json.loads(r.stdout)}
    assert rows["done"]["state"] == "finished" and rows["done"]["step"] == 2 and rows["done"]["exit_code"] == 0
    assert rows["done"]["loss"] == 2.5 and rows["done"]["tokens_per_s"] == 500.0
    assert rows["boom"]["state"] == "crashed" and rows["boom"]["exit_code"] == 1
    assert rows["boom"]["phase"] == "loading_target" and rows["boom"]["phase_i"] == 2
    assert rows["stop"]["state"] == "killed" and rows["stop"]["end_reason"] == "signal"
    assert rows["never"]["state"] == "absent" and rows["never"]["pid"] is None
    table = opsctl(hosts, "status", "box")
    assert table.returncode == 0
    lines = {ln.split()[1]: ln for ln in table.stdout.splitlines() if ln.startswith("│")}
    assert "finished" in lines["done"] and "2/2" in lines["done"]
    assert "crashed" in lines["boom"] and "loading_target 2/4" in lines["boom"]
    assert "killed" in lines["stop"]
    assert "GPUs: nvml unavailable" in table.stdout
