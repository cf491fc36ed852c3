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


def _once(hosts: Path, *targets: str) -> list[dict]:
    r = opsctl(hosts, "watch", "--once", *targets, timeout=120)
    return json.loads(r.stdout)


def test_crash_reason_exception_line_and_exit_code_in_status_and_watch(tmp_path: Path, sshd) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={
        "boom": script_run(tmp_path, "crash_loading.py", "--delay", "0", tmux_session="st-reason")})
    try:
        assert opsctl(hosts, "launch", "box", "boom").returncode == 1
        exc = "FileNotFoundError: /dev/shm/model/shard-2.safetensors: no such file (test crash)"
        (st,) = json.loads(opsctl(hosts, "status", "box", "boom", "--json").stdout)
        assert st["state"] == "crashed" and st["exception"] == exc and st["reason"] == f"{exc} (exit 1)", st
        table = opsctl(hosts, "status", "box", "boom")
        # the state cell, however the table wraps it (its width depends on the other columns, pid digits included)
        cell = " ".join(c for c in (ln.split("│")[2].strip() for ln in table.stdout.splitlines()
                                    if ln.startswith("│")) if c)
        assert cell == f"crashed ({exc} (exit 1))", table.stdout
        (snap,) = _once(hosts, "box:boom")
        assert snap["state"] == "crashed" and snap["reason"] == f"{exc} (exit 1)", snap
    finally:
        opsctl(hosts, "clean", "box", "boom")


def test_a_dflash_config_error_is_a_refusal_with_its_line_in_status_watch_and_history(tmp_path: Path, sshd) -> None:
    """A real `dflash train` refusing its config exits 2 after one `dflash: ...` line and no traceback: that line
    (not `"exception": null`, `crashed (exit 2)`, `run crashed / exit code 2`) is why the run ended, in every view,
    and the run reads `refused` (it did not crash: the same config would be refused again, so it is not restarted)."""
    (tmp_path / "bad.yaml").write_text("train:\n  max_stepz: 3\n")
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"bad": {
        "workdir": str(tmp_path), "command": ["{python}", "-m", "dflash", "train", "--config", "bad.yaml", "--out",
                                              str(tmp_path / "out")],
        "log": "run.log", "events": "out/events.jsonl", "tmux_session": "st-badcfg", "ready_timeout": 120,
        "clean_roots": [str(tmp_path)], "inductor_cache_dir": str(tmp_path / "cache")}})
    line = "dflash: bad.yaml:2: train.max_stepz: unknown field"
    try:
        r = opsctl(hosts, "launch", "box", "bad")
        assert r.returncode == 1, r.stderr
        (st,) = json.loads(opsctl(hosts, "status", "box", "bad", "--json").stdout)
        assert st["state"] == "refused" and st["exit_code"] == 2, st
        assert st["exception"].startswith(line) and st["reason"].startswith(line) and st["reason"].endswith("(exit 2)")
        table = opsctl(hosts, "status", "box", "bad").stdout
        assert "refused (dflash: bad.yaml:2: train.max_stepz" in " ".join(table.split()), table
        (snap,) = _once(hosts, "box:bad")
        assert snap["state"] == "refused", snap
        assert snap["exception"] == st["exception"] and snap["reason"] == st["reason"], snap
        (alert,) = [a for a in snap["alerts"] if a["key"] == "refused"]
        assert line in alert["evidence"] and "exit code 2" in alert["evidence"], alert  # the TUI's alerts box
        (attempt,) = json.loads(opsctl(hosts, "history", "box", "bad", "--json").stdout)
        assert attempt["outcome"] == "refused" and attempt["exception"] == st["exception"], attempt
        assert line in " ".join(opsctl(hosts, "history", "box", "bad").stdout.split())
    finally:
        opsctl(hosts, "clean", "box", "bad")


def test_unreachable_host_is_unreachable_with_its_error_never_absent(tmp_path: Path, sshd) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # closed again: connections are refused
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", port=dead_port, runs={
        "a": script_run(tmp_path, "ok_run.py"), "b": script_run(tmp_path, "ok_run.py", log="b.log", events="b.jsonl")})
    r = opsctl(hosts, "status", "box", "--json")
    assert r.returncode == 3, r.stderr
    rows = json.loads(r.stdout)
    assert [row["run"] for row in rows] == ["a", "b"]
    for row in rows:
        assert row["state"] == "unreachable" and "Connection refused" in row["link_error"], row
        assert row["reason"] == row["link_error"]
    r = opsctl(hosts, "status", "box", "a", "--json")
    assert r.returncode == 3 and [row["state"] for row in json.loads(r.stdout)] == ["unreachable"]
    table = opsctl(hosts, "status", "box")
    flat = " ".join(table.stdout.split())
    assert table.returncode == 3 and "unreachable (" in flat and "absent" not in flat, flat
    assert "Connection refused" in " ".join(table.stderr.split())
    for snap in _once(hosts):
        assert snap["state"] == "unreachable", snap
        assert "Connection refused" in snap["reason"], snap


def test_unreachable_in_the_watch_model_fed_by_a_real_source(tmp_path: Path, sshd) -> None:
    """The dashboard's own RunModel + SourceWorker over the real AgentSource: a dead host reads `unreachable`."""
    import socket
    import time

    from opsctl import commands
    from opsctl.watch import RunModel, SourceWorker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", port=dead_port, runs={"a": script_run(tmp_path, "ok_run.py")})
    (src,) = commands.watch_sources(commands.Ctx(hosts_file=str(hosts)), ["box:a"])
    model = RunModel(src.label)
    worker = SourceWorker(src, backoff=(0.2,)).start()
    try:
        deadline = time.monotonic() + 30
        while model.view().state != "unreachable" and time.monotonic() < deadline:
            other, logs, _ = worker.drain()
            for m in other:
                model.ingest(m)
            time.sleep(0.05)
    finally:
        worker.stop()
    view = model.view()
    assert view.state == "unreachable" and "Connection refused" in (view.reason or ""), view


def test_status_says_finished_with_leftover_processes(tmp_path: Path, sshd) -> None:
    import time

    marker = tmp_path / "daemon"
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={"d": script_run(
        tmp_path, "daemonizer.py", "--marker", str(marker), "--exit-after", "0.3", kill_grace=[0.5, 0.5],
        tmux_session="st-leftover", ready_pattern=".")})
    try:
        opsctl(hosts, "launch", "box", "d")
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        daemon = int(marker.read_text().split()[0])
        deadline = time.monotonic() + 30
        (st,) = json.loads(opsctl(hosts, "status", "box", "d", "--json").stdout)
        # run_end arrives a moment before the process exits: leftovers are counted once it has exited
        while (st["state"], st["proc_state"]) != ("finished", "exited") and time.monotonic() < deadline:
            (st,) = json.loads(opsctl(hosts, "status", "box", "d", "--json").stdout)
        assert st["state"] == "finished" and st["leftover_pids"] == [daemon], st
        assert st["reason"] == f"leftover processes: PID {daemon}"
        table = " ".join(opsctl(hosts, "status", "box", "d").stdout.split())
        assert f"finished (leftover processes: PID {daemon})" in table, table
        assert opsctl(hosts, "kill", "box", "d").returncode == 0
        (st,) = json.loads(opsctl(hosts, "status", "box", "d", "--json").stdout)
        assert st["leftover_pids"] == [] and "leftover" not in (st["reason"] or ""), st
    finally:
        opsctl(hosts, "kill", "box", "d")
        opsctl(hosts, "clean", "box", "d")
