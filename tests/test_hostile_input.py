"""Files and streams that must not take a command down (issue 21, items 4-7): dotted run names, billion-laughs and
oversized YAML, one huge log line, events of the wrong types. Every case goes through the real CLIs (`python -m
opsctl`, `python -m dflash`), real sshd on loopback and real tmux, as an operator would meet it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import kill_tmux, opsctl, script_run  # noqa: E402

from opsctl import commands  # noqa: E402


def _add_group(hosts: Path, name: str, run: str, members: list[str], entry: dict[str, Any]) -> None:
    doc = yaml.safe_load(hosts.read_text())
    doc["groups"] = {name: {"members": members, "runs": {run: entry}}}
    hosts.write_text(yaml.safe_dump(doc, sort_keys=False))


# -- item 4: a dotted run or group name ------------------------------------------------------------------------


def test_dotted_run_and_group_names_work_in_every_command(tmp_path: Path, sshd) -> None:
    dotted = "qwen3.6-27b"
    (tmp_path / "other").mkdir()
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", local_runs={
        dotted: script_run(tmp_path, "ok_run.py", "--steps", "2", "--step-time", "0.05"),
        "other": script_run(tmp_path / "other", "ok_run.py")})
    _add_group(hosts, "duo.v2", "a.b", ["box"], {
        "workdir": str(tmp_path), "nproc_per_node": 1, "command": ["train.py"], "log": "g{node}.log"})
    try:
        r = opsctl(hosts, "hosts", "check")
        assert r.returncode == 0, r.stderr
        assert f"ok local (local): {dotted}, other" in r.stdout and "ok group duo.v2 (box): a.b" in r.stdout
        assert opsctl(hosts, "hosts").returncode == 0
        r = opsctl(hosts, "launch", "local", dotted, "--follow")
        assert r.returncode == 0, r.stderr
        assert "tmux session dflash-qwen3_6-27b" in r.stderr, r.stderr  # the one spelling of its session
        r = opsctl(hosts, "status", "--json")
        assert r.returncode == 0, r.stderr
        rows = {(row.get("host"), row["run"]): row for row in json.loads(r.stdout)}
        st = rows[("local", dotted)]
        assert st["state"] == "finished" and st["step"] == 2 and st["session"] == "dflash-qwen3_6-27b", st
        assert rows[("local", "other")]["state"] == "absent"
        r = opsctl(hosts, "watch", "--once", f"local:{dotted}")
        assert r.returncode == 0, r.stderr
        (snap,) = json.loads(r.stdout)
        assert snap["state"] == "finished" and snap["step"] == 2, snap
        r = opsctl(hosts, "logs", "local", dotted, "-n", "1")
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        r = opsctl(hosts, "status", "duo.v2", "a.b", "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)[0]["state"] == "absent"
    finally:
        opsctl(hosts, "clean", "local", dotted)
        kill_tmux(tmp_path, dotted)


def test_dotted_name_whose_session_is_taken_is_refused_in_one_line(tmp_path: Path, sshd) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", local_runs={
        "a.b": script_run(tmp_path, "ok_run.py"), "a_b": script_run(tmp_path, "ok_run.py")})
    for argv in (["hosts", "check"], ["status"], ["launch", "local", "a_b"]):
        r = opsctl(hosts, *argv)
        assert r.returncode == commands.EXIT_USAGE, (argv, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        flat = " ".join(r.stderr.split())  # the console wraps long lines at its width
        assert flat.count("tmux session") == 1 and "'dflash-a_b'" in flat and "'a.b'" in flat, flat
        assert "hosts.local.runs.a_b: run 'a_b' and run 'a.b' on host local" in flat
        assert "set tmux_session on one of them" in flat
    assert not (tmp_path / ".opsctl").exists()  # nothing was launched
    # the way past it: a session of its own for one of them
    doc = yaml.safe_load(hosts.read_text())
    doc["hosts"]["local"]["runs"]["a.b"]["tmux_session"] = "dflash-ab-dotted"
    hosts.write_text(yaml.safe_dump(doc, sort_keys=False))
    assert opsctl(hosts, "hosts", "check").returncode == 0
