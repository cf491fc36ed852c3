"""Files and streams that must not take a command down (issue 21, items 4-7): dotted run names, billion-laughs and
oversized YAML, one huge log line, events of the wrong types. Every case goes through the real CLIs (`python -m
opsctl`, `python -m dflash`), real sshd on loopback and real tmux, as an operator would meet it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
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
        "a.b": script_run(tmp_path, "ok_run.py"),
        "a_b": script_run(tmp_path, "ok_run.py", log="a_b.log", events="a_b-events.jsonl")})  # files of its own
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


# -- item 5: billion laughs and oversized files ----------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


# Runs `python -m MODULE ARGS` and, at its exit, writes its own peak RSS (VmHWM of this process image: a forked
# child's rusage would also count the test process it was forked from) to $HWM_FILE.
_HWM_RUNNER = """\
import atexit, os, runpy, sys
def _hwm():
    with open("/proc/self/status") as fh:
        kib = next(ln for ln in fh if ln.startswith("VmHWM:")).split()[1]
    with open(os.environ["HWM_FILE"], "w") as out:
        out.write(kib)
atexit.register(_hwm)
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _measured(*argv: str, timeout: float = 120) -> tuple[int, str, float, float]:
    """Run a real CLI (`python -m MODULE ARGS`, argv starting with "-m") to its end: (exit code, its output, wall
    seconds, peak RSS in MiB). Past `timeout` it is killed (an unbounded parse would take the machine with it)."""
    assert argv[0] == "-m"
    with tempfile.TemporaryDirectory() as d:
        hwm = Path(d) / "hwm"
        env = dict(os.environ, COLUMNS="200", NO_COLOR="1", TERM="dumb", HWM_FILE=str(hwm))
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-c", _HWM_RUNNER, "-m", *argv[1:]], cwd=str(REPO), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                           timeout=timeout)
        wall = time.monotonic() - t0
        assert hwm.exists(), p.stdout
        return p.returncode, p.stdout, wall, int(hwm.read_text()) / 1024


def _billion_laughs(path: Path) -> Path:
    """The classic: 9 levels of 9 aliases, about 500 bytes of text that expand to 9**9 (387 million) strings."""
    rows = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    prev = "a"
    for name in "bcdefghi":
        rows.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
        prev = name
    path.write_text("\n".join(rows) + "\n")
    assert 400 < path.stat().st_size < 600
    return path


def test_billion_laughs_is_refused_at_once_by_both_clis(tmp_path: Path) -> None:
    laughs = _billion_laughs(tmp_path / "laughs.yaml")
    rc, out, wall, rss = _measured("-m", "opsctl", "--hosts", str(laughs), "hosts", "check")
    assert rc == commands.EXIT_USAGE and "Traceback" not in out, out
    assert out.strip().startswith(f"{laughs}:") and "MAX_ALIAS_NODES" in out and "100000 nodes" in out, out
    assert wall < 10 and rss < 150, (wall, rss)  # it was 4 GiB and a MemoryError after 33 s
    # dflash: the same refusal before anything is built; torch's import is the floor, measured on a missing config
    out_dir = tmp_path / "out"
    rc0, out0, wall0, rss0 = _measured("-m", "dflash", "train", "--config", str(tmp_path / "none.yaml"),
                                       "--out", str(out_dir))
    assert rc0 == 2 and "cannot read config" in out0, out0
    rc, out, wall, rss = _measured("-m", "dflash", "train", "--config", str(laughs), "--out", str(out_dir))
    assert rc == 2 and "Traceback" not in out, out
    # line 6 (`f`, 9**6 strings) is the first whose value passes the cap: it is named, the rest is never visited
    assert out.strip() == (f"dflash: {laughs}:6: aliases expand this document by more than 100000 nodes "
                           "(MAX_ALIAS_NODES in dflash/yamlfile.py; a 'billion laughs'?); write the values out or "
                           "use fewer nested aliases"), out
    assert wall < wall0 + 3 and rss < rss0 + 64, (wall, wall0, rss, rss0)
    assert not out_dir.exists()  # nothing written
    loop = tmp_path / "loop.yaml"
    loop.write_text("hosts: &h {local: {local: true, runs: {r: *h}}}\n")
    rc, out, wall, rss = _measured("-m", "opsctl", "--hosts", str(loop), "hosts", "check")
    assert rc == commands.EXIT_USAGE and "a recursive document" in out and "Traceback" not in out, out


def test_oversized_config_files_are_refused_without_reading_them(tmp_path: Path) -> None:
    from dflash.yamlfile import MAX_CONFIG_BYTES

    big = tmp_path / "hosts.yaml"
    with big.open("w") as fh:  # 50 MB of plausible YAML: a hosts file that grew by mistake, or a log named as one
        fh.write("hosts:\n  local:\n    local: true\n    runs:\n")
        row = "      r{:07d}: {{workdir: /w, command: [x], log: l}}\n"
        while fh.tell() < 50_000_000:
            fh.write("".join(row.format(i) for i in range(fh.tell(), fh.tell() + 10_000)))
    for argv in (["-m", "opsctl", "--hosts", str(big), "hosts", "check"],
                 ["-m", "opsctl", "--hosts", str(big), "status"],
                 ["-m", "dflash", "train", "--config", str(big), "--out", str(tmp_path / "out")]):
        rc, out, wall, rss = _measured(*argv)
        assert rc == 2 and "Traceback" not in out, out
        assert f"{big}: {big.stat().st_size / 1e6:.1f} MB, over the {MAX_CONFIG_BYTES} byte cap on config files (MAX_CONFIG_BYTES" in out, out
        assert rss < 400 and wall < 15, (argv, wall, rss)  # opsctl took >120 s and 3.2 GiB
    assert not (tmp_path / "out").exists()
    # at the cap exactly is still a file (refused for its content, not its size)
    edge = tmp_path / "edge.yaml"
    edge.write_text("#" * (MAX_CONFIG_BYTES - 1) + "\n")
    rc, out, _, _ = _measured("-m", "opsctl", "--hosts", str(edge), "hosts", "check")
    assert rc == 2 and "cap" not in out and "top level must be a mapping" in out, out


# -- item 6: one huge log line ---------------------------------------------------------------------------------


def test_huge_log_line_is_cut_visibly_and_hides_neither_newer_lines_nor_the_run(tmp_path: Path, sshd) -> None:
    from opsctl.remote.base import MAX_LOG_LINE

    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={
        "big": script_run(tmp_path, "ok_run.py", "--steps", "10", "--step-time", "0.02", tmux_session="huge-line")})
    try:
        assert opsctl(hosts, "launch", "box", "big", "--follow").returncode == 0
        huge = 20_000_000
        with (tmp_path / "run.log").open("a") as fh:  # a dumped tensor, a progress bar that never wrote a newline
            fh.write("x" * huge + "\n")
            fh.writelines(f"newer {i}\n" for i in range(10))
        r = opsctl(hosts, "logs", "box", "big", "-n", "20")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert len(lines) == 20 and len(r.stdout) < 2 * MAX_LOG_LINE, (len(lines), len(r.stdout))
        assert lines[-10:] == [f"newer {i}" for i in range(10)]  # the newest lines, in order
        assert lines[-11] == "x" * MAX_LOG_LINE + " ... [cut 19.9 MB]"
        assert lines[-12] == "run ended: completed" and lines[0].startswith("step ")  # -n stays exact
        r = opsctl(hosts, "logs", "box", "big", "-n", "3")
        assert r.returncode == 0 and r.stdout.splitlines() == ["newer 7", "newer 8", "newer 9"]
        t0 = time.monotonic()
        r = opsctl(hosts, "watch", "--once", "box:big")
        assert r.returncode == 0, r.stderr
        (snap,) = json.loads(r.stdout)
        assert snap["state"] == "finished" and snap["step"] == 10, snap  # was `absent`, step 0
        assert snap["log_lines"] >= 12 and time.monotonic() - t0 < 30
    finally:
        opsctl(hosts, "clean", "box", "big")
        kill_tmux(tmp_path, "big")


def test_long_line_written_in_pieces_costs_one_cut_line_with_exact_offsets(tmp_path: Path) -> None:
    from opsctl.remote.follow import Tail

    log = tmp_path / "run.log"
    log.write_bytes(b"first\n")
    t = Tail(str(log), 0, max_line=10)
    assert t.read([]) == [(0, 6, b"first")]
    with log.open("ab") as fh:
        fh.write(b"y" * 3000)  # an unfinished line, longer than the cap: held as its head only
    assert t.read([]) == [] and len(t.buf) == 10 and t.skipped == 2990
    with log.open("ab") as fh:
        fh.write(b"y" * 2000 + b"\nnext\n")
    assert t.read([]) == [(6, 5007, b"y" * 10 + b" ... [cut 5.0 KB]"), (5007, 5012, b"next")]
    assert t.offset == 5012 and t.buf == b"" and t.skipped == 0  # a reconnect resumes exactly after it


# -- item 7: an event line of the wrong types ------------------------------------------------------------------


def test_event_line_of_wrong_types_is_skipped_and_counted_by_every_verb(tmp_path: Path, sshd) -> None:
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", runs={
        "r": script_run(tmp_path, "bad_event_run.py", "--steps", "5", tmux_session="bad-event")})
    try:
        # `"ts": "yesterday", "step": "three"` in the middle of real events (tests/runs/bad_event_run.py)
        r = opsctl(hosts, "launch", "box", "r", "--follow")
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr  # was exit 1, ValueError in runstate
        assert "r finished" in r.stderr
        with (tmp_path / "events.jsonl").open("a") as fh:  # and lines that are no JSON object at all
            fh.write("not json\n[1, 2]\n")
        r = opsctl(hosts, "status", "box", "r", "--json")
        assert r.returncode == 0, r.stderr
        (st,) = json.loads(r.stdout)
        assert st["state"] == "finished" and st["step"] == 5 and st["loss"] == 0.2, st  # the good events all count
        assert st["bad_events"] == 3 and st["bad_event"].endswith(": not a JSON object"), st
        r = opsctl(hosts, "watch", "--once", "box:r")
        assert r.returncode == 0, r.stderr
        (snap,) = json.loads(r.stdout)
        assert snap["state"] == "finished" and snap["step"] == 5 and snap["bad_events"] == 3, snap
        table = opsctl(hosts, "status", "box", "r")
        assert table.returncode == 0
        assert "r: 3 bad event lines skipped (last: events file offset" in " ".join(table.stdout.split())
        r = opsctl(hosts, "history", "box", "r", "--json")
        assert r.returncode == 0, r.stderr
    finally:
        opsctl(hosts, "clean", "box", "r")
        kill_tmux(tmp_path, "r")


def test_reader_check_names_the_wrong_type_and_keeps_a_newer_writers_events() -> None:
    from dflash.telemetry import EventError, parse_event
    from opsctl.runstate import RunState

    base = {"v": 1, "ts": 5.0, "run_id": "r", "rank": 0, "seq": 1}
    rs = RunState()
    assert rs.apply({"t": "event", "off": 0, "end": 9, "event": {**base, "kind": "step", "step": 3, "loss": "nan"}})
    assert rs.view(6.0).step == 3  # "nan" is the contract's word for NaN, and keys left out are the reader's defaults
    assert rs.apply({"t": "event", "off": 9, "end": 20, "event": {**base, "kind": "eval_v2", "tau": [1]}})
    assert not rs.apply({"t": "event", "off": 20, "end": 40, "event": {**base, "ts": "yesterday", "kind": "step"}})
    assert not rs.apply({"t": "event", "off": 40, "end": 60, "event": {**base, "kind": "step", "acc": ["x"]}})
    v = rs.view(6.0)
    assert v.step == 3 and v.bad_events == 2 and v.bad_event == "events file offset 40: step: acc must be a list of numbers"
    try:
        parse_event({**base, "kind": "step", "step": 1})  # the writer's check still wants every key
    except EventError as exc:
        assert "missing key 'epoch'" in str(exc)
    else:
        raise AssertionError("an incomplete step event passed the complete check")
    for bad in ([1], {"a": 1}):  # unhashable where a float word may stand: refused as an event, not a TypeError
        try:
            parse_event({**base, "kind": "step", "step": 1, "loss": bad}, complete=False)
        except EventError as exc:
            assert "loss" in str(exc)
        else:
            raise AssertionError(f"loss={bad!r} passed the reader's check")
