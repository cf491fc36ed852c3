"""Tests of the remote agent itself (opsctl/remote/agent.py and the wing shipped with it) over plain pipes: protocol,
file following, lifetime.

Launch/kill/status/clean behaviour through the CLI and SSH + pct lives in test_launch.py and friends.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import cleanup, drive, nvml_env, of, run_args, start  # noqa: E402

from opsctl import remote  # noqa: E402
from opsctl.channel import agent_source  # noqa: E402
from opsctl.remote import agent, base, cache, follow, procs, rules  # noqa: E402


def test_agent_source_is_ascii_and_stdlib_only() -> None:
    # The bootstrap reads N *characters* where the client sends the byte count: ASCII keeps them equal.
    allowed = set(sys.stdlib_module_names) | {"pynvml"}
    # the wing (opsctl/remote: the agent, the wrapper that tmux runs, what they share), and the blob the client
    # assembles from it: all stdlib-only ASCII
    wing = [Path(remote.__file__).with_name(f"{name}.py").read_bytes() for name in base.REMOTE_MODULES]
    for src in (*wing, agent_source()):
        assert all(b < 128 for b in src)
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] in allowed for a in node.names), ast.dump(node)
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                assert module.split(".")[0] in allowed or module.startswith("opsctl.remote."), ast.dump(node)
    assert not hasattr(agent, "WRAPPER_SOURCE")  # the wrapper is a module ruff lints, not a string


def test_shipped_blob_runs_isolated(tmp_path: Path) -> None:
    """The blob needs nothing but the stdlib: under `python3 -I -S` (no site-packages, where opsctl is installed
    here; no PYTHONPATH; no cwd on sys.path), the agent runs as shipped, and the wrapper it writes runs a command as
    `python3 -I -S - spec.json`."""
    blob = agent_source()
    p = subprocess.Popen([sys.executable, "-I", "-S", "-u", "-c", base.BOOTSTRAP, "hello", "{}"], cwd=tmp_path,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(str(len(blob)).encode() + b"\n" + blob)
    p.stdin.flush()  # stdin stays open while it works: EOF on it means the channel closed
    msgs = [json.loads(p.stdout.readline()), json.loads(p.stdout.readline())]
    p.stdin.close()
    assert p.wait(timeout=30) == 0 and [m["t"] for m in msgs] == ["hello", "bye"], msgs
    # the wrapper text the shipped agent writes at launch: the wrapper module's main with the wing's modules
    # (opsctl/remote) bundled in, byte for byte the very modules shipped with it, so the process tmux starts needs no
    # package. Run under another __name__, the blob only installs its bundle: the agent's module comes from it.
    show = ("import sys;g={'__name__':'shipped'};exec(sys.stdin.read(),g);"
            "from opsctl.remote.agent import wrapper_source;sys.stdout.write(wrapper_source())")
    wrapper = subprocess.run([sys.executable, "-I", "-S", "-c", show], cwd=tmp_path, input=blob, capture_output=True,
                             timeout=30, check=True).stdout
    assert wrapper.decode() == base.shipped_script("opsctl.remote.wrapper", "main()", base.remote_sources())
    spec = {"argv": [sys.executable, "-c", "print('from the run')"], "env": {}, "workdir": str(tmp_path),
            "log": str(tmp_path / "run.log"), "state_dir": str(tmp_path)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    ran = subprocess.run([sys.executable, "-I", "-S", "-", str(tmp_path / "spec.json")], cwd=tmp_path, input=wrapper,
                         capture_output=True, timeout=30)
    assert ran.returncode == 0, ran
    assert (tmp_path / "exit_code").read_text() == "0\n"
    assert (tmp_path / "run.log").read_text() == "from the run\n"
    assert json.loads((tmp_path / "pid").read_text())["pid"] > 0


def _wait_gone(pid: int, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not procs.alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_agent_exits_when_channel_closes(tmp_path: Path) -> None:
    (tmp_path / "run.log").write_text("x\n")
    p = start("follow", {**run_args(tmp_path, "chatty.py"), "options": {"until_exit": False}})
    assert p.stdout is not None and p.stdin is not None
    hello = json.loads(p.stdout.readline())
    assert json.loads(p.stdout.readline())["t"] in ("log", "proc")
    assert procs.alive(hello["pid"])
    t0 = time.monotonic()
    p.stdin.close()
    assert p.wait(timeout=3) == 0
    assert time.monotonic() - t0 < 1.0
    assert _wait_gone(hello["pid"])


def test_agent_exits_on_epipe(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text("")
    p = start("follow", {**run_args(tmp_path, "chatty.py"), "options": {"until_exit": False}})
    assert p.stdout is not None
    hello = json.loads(p.stdout.readline())
    p.stdout.close()  # the client went away but the channel's stdin stays open
    with log.open("a") as fh:
        fh.write("a line the agent cannot deliver\n")
    assert p.wait(timeout=3) == 0
    assert _wait_gone(hello["pid"])
    p.stdin.close()  # type: ignore[union-attr]


def _lines(tail: follow.Tail) -> tuple[list[tuple[int, int, bytes]], list[str]]:
    resets: list[str] = []
    return tail.read(resets), resets


def test_tail_offsets_truncation_rotation_and_partial_lines(tmp_path: Path) -> None:
    log = tmp_path / "f.log"
    log.write_bytes(b"one\ntwo\nthr")
    t = follow.Tail(str(log), 0)
    got, resets = _lines(t)
    assert [(o, e, b) for o, e, b in got] == [(0, 4, b"one"), (4, 8, b"two")] and resets == []
    with log.open("ab") as fh:
        fh.write(b"ee\n")
    got, _ = _lines(t)
    assert got == [(8, 14, b"three")]
    # resume from an offset: nothing before it again
    t2 = follow.Tail(str(log), 4)
    assert [b for _, _, b in _lines(t2)[0]] == [b"two", b"three"]
    # truncation, then the file grows back past the old offset before we look: still detected
    log.write_bytes(b"NEW first line that is long enough to pass the old offset\n")
    got, resets = _lines(t)
    assert resets == ["truncated"] and got == [(0, 58, b"NEW first line that is long enough to pass the old offset")]
    # rotation: the rest of the old file is read first, then the new one from 0
    with log.open("ab") as fh:
        fh.write(b"last of old\n")
    os.rename(log, tmp_path / "f.log.1")
    log.write_bytes(b"fresh\n")
    got, resets = _lines(t)
    assert [b for _, _, b in got] == [b"last of old", b"fresh"] and resets == ["rotated"]
    assert got[-1][:2] == (0, 6)
    os.unlink(log)
    got, resets = _lines(t)
    assert got == [] and resets == ["missing"]
    log.write_bytes(b"back\n")
    got, resets = _lines(t)
    assert [b for _, _, b in got] == [b"back"]


def test_tail_last_n_lines(tmp_path: Path) -> None:
    log = tmp_path / "f.log"
    log.write_bytes(b"".join(b"l%d\n" % i for i in range(100)) + b"partial")
    t = follow.Tail(str(log), -1, tail_lines=3)
    assert [b for _, _, b in _lines(t)[0]] == [b"l97", b"l98", b"l99"]


def test_follow_resumes_at_offsets_without_loss_or_repeat(tmp_path: Path) -> None:
    args = run_args(tmp_path, "chatty.py", "--lines", "300")
    try:
        rc, msgs = drive("launch", {**args, "ready_pattern": r"line 000010 "})
        assert rc == 0
        verdict = of(msgs, "verdict")[0]
        assert verdict["reason"] == "ready" and "matched" in verdict["detail"]
        seen = [m["line"].split()[1] for m in of(msgs, "log")]
        # the chatty run exits by itself; follow from where launch stopped, until the run ends
        rc, more = drive("follow", {**args, "options": {"log_offset": verdict["log_offset"], "events_offset": 0}})
        assert rc == 0 and of(more, "verdict")[0]["exit_code"] == 0
        seen += [m["line"].split()[1] for m in of(more, "log") if m["line"].startswith("line ")]
        assert seen == [f"{i:06d}" for i in range(300)]
    finally:
        cleanup(args)


def test_launch_refuses_on_failing_preflight_and_bad_manifest(tmp_path: Path) -> None:
    args = run_args(tmp_path, "ok_run.py", preflight=[sys.executable, "-c", "import sys; print('no fla'); sys.exit(3)"])
    rc, msgs = drive("launch", args)
    pre = [c for c in of(msgs, "check") if c["name"] == "preflight"][0]
    assert rc == base.EXIT_CODES["refused"] and not pre["ok"] and "exit 3" in pre["detail"] and "no fla" in pre["detail"]
    assert not of(msgs, "launched") and not (tmp_path / "state" / "pid").exists()
    model = tmp_path / "model"
    model.mkdir()
    (model / "w.bin").write_bytes(b"weights")
    import hashlib

    good = {"files": {"w.bin": {"size": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}}}
    (model / "manifest.json").write_text(json.dumps(good))
    ok, detail = cache.check_manifest(str(model), None)
    assert ok, detail
    (model / "w.bin").write_bytes(b"weightz")
    ok, detail = cache.check_manifest(str(model), None)
    assert not ok and "sha256" in detail
    rc, msgs = drive("launch", {**run_args(tmp_path, "ok_run.py"), "model_dir": str(model)})
    assert rc == 5 and [c for c in of(msgs, "check") if c["name"] == "model_dir"][0]["ok"] is False


def test_second_launch_refused_while_running(tmp_path: Path) -> None:
    args = run_args(tmp_path, "hang_loading.py", ready_timeout=0.5)
    try:
        rc, msgs = drive("launch", args)
        assert rc == base.EXIT_CODES["timeout"]
        rc, msgs = drive("launch", args)
        assert rc == base.EXIT_CODES["refused"]
        assert "already running" in [c for c in of(msgs, "check") if not c["ok"]][0]["detail"]
    finally:
        cleanup(args)


@pytest.mark.parametrize("script", ["ok_run.py"])
def test_wrapper_records_exit_code_and_tmux_keeps_dead_pane(tmp_path: Path, script: str) -> None:
    args = run_args(tmp_path, script, "--steps", "1", "--step-time", "0.05", "--load-time", "0")
    try:
        rc, msgs = drive("launch", {**args, "options": {"follow": True}})
        assert rc == 0
        assert (tmp_path / "state" / "exit_code").read_text().strip() == "0"
        rc, msgs = drive("status", args)
        st = of(msgs, "status")[0]
        assert st["proc"]["state"] == "exited" and st["session_exists"] and st["pane_dead"] is True
    finally:
        cleanup(args)


def test_run_that_writes_its_own_log_is_not_duplicated(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    args = run_args(tmp_path, "", command=[sys.executable, str(Path(__file__).parent / "runs" / "selflog.py"),
                                           str(log)], events=None)
    try:
        rc, msgs = drive("launch", args)
    finally:
        cleanup(args)
    assert rc == base.EXIT_CODES["failed"]
    lines = log.read_text().splitlines()
    # Two writers share the file (the run's FileHandler directly, its stdout/stderr through the wrapper's pipes), so
    # only each stream's own order is defined, not how the streams interleave: check "once each, in order".
    assert lines.count("banner before logging is set up") == 1
    assert [ln for ln in lines if ln.startswith("INFO")] == [f"INFO record {i}" for i in range(5)]  # once each
    assert [ln for ln in lines if ln.startswith("plain")] == [f"plain print {i}" for i in range(5)]
    assert lines.count("Traceback (most recent call last):") == 1 and lines.count("RuntimeError: selflog died") == 1
    assert lines.index("Traceback (most recent call last):") < lines.index("RuntimeError: selflog died")
    verdict = of(msgs, "verdict")[0]
    assert verdict["traceback"].endswith("RuntimeError: selflog died")


def test_agent_in_container_exits_when_ssh_drops(tmp_path: Path, sshd, pct_host, drop_ssh,
                                                 container) -> None:
    from opsctl import commands
    from opsctl.config import load_inventory, resolve
    from opsctl.transport import transport_for

    vmid = container(200)
    (tmp_path / "run.log").write_text("one\n")
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=vmid, runs={"r": {
        "workdir": str(tmp_path), "command": ["true"], "log": "run.log", "inductor_cache_dir": str(tmp_path / "c"),
        "clean_roots": [str(tmp_path)]}})
    host, run = resolve(load_inventory(hosts), "box", "r")
    assert run is not None
    t = transport_for(host)
    gen = commands.stream_agent(t, host, "follow", commands.run_args(run, log_offset=0, until_exit=False))
    hello = next(gen)
    assert next(gen)["t"] in ("log", "proc")
    alive = [sys.executable, "-c", "import os,sys; print(os.path.exists(f'/proc/{sys.argv[1]}'))", str(hello["pid"])]
    assert pct_host.pct("exec", str(vmid), "--", *alive).stdout.strip() == "True"  # its pid, in the container
    assert drop_ssh() >= 1
    with pytest.raises(commands.ChannelLost):
        for _ in gen:
            pass
    deadline = time.monotonic() + 3
    while pct_host.pct("exec", str(vmid), "--", *alive).stdout.strip() == "True":
        assert time.monotonic() < deadline, "agent still alive in the container after the SSH drop"
        time.sleep(0.1)
    t.close()


def _nvml_state(tmp: Path, **gpu0: object) -> Path:
    state = tmp / "nvml.json"
    state.write_text(json.dumps({"gpus": [{"name": "NVIDIA H200", **gpu0}, {"name": "NVIDIA H200"}]}))
    return state


def test_gpus_busy_refuses_launch_unless_forced_and_follow_samples(tmp_path: Path) -> None:
    import subprocess

    other = subprocess.Popen(["sleep", "60"])  # someone else's job on gpu0
    try:
        env = nvml_env(_nvml_state(tmp_path, procs=[{"pid": other.pid, "used_mb": 40960}], util=97))
        args = run_args(tmp_path, "hang_loading.py", ready_timeout=0.5)
        rc, msgs = drive("launch", args, env=env)
        assert msgs[0]["nvml"] == "ok"
        check = [c for c in of(msgs, "check") if c["name"] == "gpus_free"][0]
        assert rc == base.EXIT_CODES["refused"] and not check["ok"]
        assert f"gpu0 pid {other.pid} 40960 MiB" in check["detail"] and not of(msgs, "launched")
        # only the host's GPUs count: a job on gpu0 does not block a run on gpu1
        rc, msgs = drive("launch", {**args, "options": {"gpus": [1]}}, env=env)
        assert rc == base.EXIT_CODES["timeout"] and of(msgs, "launched")
        assert [c for c in of(msgs, "check") if c["name"] == "gpus_free"][0]["detail"] == "no compute processes on gpu1"
        load = [c for c in of(msgs, "check") if c["name"] == "host_load"][0]  # said, never a refusal
        assert load["ok"] and f" on {os.cpu_count()} CPU" in load["detail"] and isinstance(load["warn"], bool)
        cleanup(args)
        rc, msgs = drive("launch", {**args, "options": {"force": True, "gpu_interval": 0.2}}, env=env)
        assert rc == base.EXIT_CODES["timeout"] and "ignored: --force" in of(msgs, "check")[1]["detail"]
        samples = of(msgs, "gpu")
        assert len(samples) >= 2  # 0.5 s at 0.2 s intervals
        g0 = samples[-1]["gpus"][0]
        assert set(g0) >= {"index", "name", "util", "mem_used_mb", "mem_total_mb", "power_w", "temp_c",
                           "sm_clock_mhz", "mem_clock_mhz", "procs"}
        assert g0["util"] == 97 and g0["mem_used_mb"] == 40960
        assert g0["procs"] == [{"pid": other.pid, "used_mb": 40960, "whose": "other"}]
    finally:
        other.kill()
        other.wait()
        cleanup(run_args(tmp_path, "hang_loading.py"))


def test_gpu_processes_are_tagged_run_other_or_hidden(tmp_path: Path) -> None:
    """The dashboard marks which GPU processes are the run's: every process of its tree (torchrun's ranks are
    children, one even left the process group), not only its pid; someone else's visible job is `other`; a pid this
    PID namespace cannot see (a container) is `hidden`."""
    import subprocess

    other = subprocess.Popen(["sleep", "60"])
    marker = tmp_path / "pids"
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"gpus": [{"pids_file": str(marker), "pids_used_mb": 8000,
                                           "procs": [{"pid": other.pid, "used_mb": 100}], "hidden_pids": [4000000]}]}))
    env = nvml_env(state)
    args = run_args(tmp_path, "forker.py", "--marker", str(marker), kill_grace=[0.5, 0.5])
    try:
        rc, _ = drive("launch", {**args, "options": {"force": True}}, env=env)
        assert rc == 0
        ranks = [int(x) for x in marker.read_text().split()]
        rc, msgs = drive("status", args, env=env)
        whose = {p["pid"]: p["whose"] for p in of(msgs, "gpu")[-1]["gpus"][0]["procs"]}
        assert len(ranks) == 6 and {whose[p] for p in ranks} == {"run"}
        assert whose[other.pid] == "other" and whose[4000000] == "hidden"
    finally:
        other.kill()
        other.wait()
        cleanup(args)


def test_kill_mark_only_records_the_request_and_signals_nothing(tmp_path: Path) -> None:
    """The first phase of a group kill: every node marked before any is signalled, so a node whose ranks die of
    their peer's kill still ends `killed`."""
    args = run_args(tmp_path, "ok_run.py", "--steps", "100000", "--step-time", "0.05", "--load-time", "0",
                    kill_grace=[5, 5])
    try:
        assert drive("launch", args)[0] == 0
        pid = json.loads(Path(args["state_dir"], "pid").read_text())["pid"]
        rc, msgs = drive("kill", {**args, "options": {"mark_only": True}})
        assert rc == 0 and of(msgs, "verdict")[0]["reason"] == "marked"
        assert Path(args["state_dir"], "killed").is_file() and Path(f"/proc/{pid}").exists()
        os.kill(pid, signal.SIGKILL)  # it dies of something else before its own kill arrives
        rc, msgs = drive("status", args)
        assert of(msgs, "status")[0]["killed_by_opsctl"] is True
    finally:
        cleanup(args)


def test_concurrent_launches_of_one_run_start_it_once(tmp_path: Path) -> None:
    args = run_args(tmp_path, "hang_loading.py", ready_timeout=1.5)
    try:
        first = start("launch", args)
        assert first.stdout is not None
        while json.loads(first.stdout.readline())["t"] != "launched":
            pass
        rc, msgs = drive("launch", args)  # while the first agent still follows its launch
        assert rc == base.EXIT_CODES["refused"]
        assert [c for c in of(msgs, "check") if not c["ok"]][0]["name"] == "not_running"
        assert first.wait(timeout=10) == base.EXIT_CODES["timeout"]
        first.stdin.close()  # type: ignore[union-attr]
        first.stdout.close()
    finally:
        cleanup(args)


def test_follow_stream_reports_a_kill_made_by_another_client(tmp_path: Path) -> None:
    # `watch` follows while a separate `opsctl kill` stops the run: the stream's proc says killed_by_opsctl, so
    # the shared reducer shows `killed`, not a crash or a finish.
    from opsctl.runstate import RunState

    args = run_args(tmp_path, "ok_run.py", "--steps", "100000", "--step-time", "0.05", "--load-time", "0",
                    kill_grace=[5, 5])
    try:
        assert drive("launch", args)[0] == 0
        p = start("follow", {**args, "options": {"gpu_interval": 0}})
        assert p.stdout is not None and p.stdin is not None
        msgs = [json.loads(p.stdout.readline())]
        while msgs[-1]["t"] != "proc":  # following: the run is live
            msgs.append(json.loads(p.stdout.readline()))
        assert msgs[-1]["state"] == "running" and msgs[-1]["killed_by_opsctl"] is False
        assert drive("kill", args)[0] == 0
        for raw in p.stdout:
            msgs.append(json.loads(raw))
            if msgs[-1]["t"] == "bye":
                break
        p.stdin.close()
        p.wait(timeout=10)
        last = of(msgs, "proc")[-1]
        assert last["state"] == "exited" and last["killed_by_opsctl"] is True, last
        state = RunState()
        for m in msgs:
            state.apply(m)
        assert state.view(time.time()).state == "killed"
        # a stream opened after the kill says the same
        _rc, later = drive("follow", {**args, "options": {"once": True, "gpu_interval": 0}})
        assert of(later, "proc")[-1]["killed_by_opsctl"] is True
    finally:
        cleanup(args)


def test_wrapper_reaps_an_adopted_orphan_while_the_run_goes_on(tmp_path: Path) -> None:
    # A daemon the run double-forked exits by itself mid-run: the subreaper wrapper adopted it, so it must reap
    # it (no zombie piling up under the wrapper for the length of a training run).
    marker = tmp_path / "daemon"
    args = run_args(tmp_path, "daemonizer.py", "--marker", str(marker), "--daemon-life", "0.3",
                    kill_grace=[0.5, 0.5])
    try:
        assert drive("launch", args)[0] == 0
        daemon = int(marker.read_text().split()[0])
        main_pid = json.loads((tmp_path / "state" / "pid").read_text())["pid"]
        deadline = time.monotonic() + 5
        while procs.proc_stat(daemon) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procs.proc_stat(daemon) is None, procs.proc_stat(daemon)  # gone from /proc: reaped, not a zombie
        assert procs.alive(main_pid)  # and the main command was left alone
        rc, msgs = drive("kill", args)
        assert rc == 0 and of(msgs, "verdict")[0]["exit_code"] == 0  # Popen still got the main's real status
    finally:
        cleanup(args)


def test_traceback_from_lines_drops_stdout_lines_interleaved_by_the_pipes() -> None:
    log = ["step 1", "Traceback (most recent call last):", '  File "x.py", line 3, in <module>', "plain print 0",
           '    raise RuntimeError("boom")', "plain print 1", "RuntimeError: boom", "plain print 2"]
    assert rules.traceback_from_lines(log) == "\n".join(
        ["Traceback (most recent call last):", '  File "x.py", line 3, in <module>', '    raise RuntimeError("boom")',
         "RuntimeError: boom"])
    # The last of two tracebacks; a bare exception name ends it too; no traceback -> None.
    two = ["Traceback (most recent call last):", "  f", "ValueError: first", "Traceback (most recent call last):",
           "  g", "KeyboardInterrupt"]
    assert rules.traceback_from_lines(two) == "Traceback (most recent call last):\n  g\nKeyboardInterrupt"
    assert rules.traceback_from_lines(["just a log line"]) is None


_RANK_SCRIPTS = {
    # rank 1 raises: its own traceback comes before torchrun's ChildFailedError
    "raises": 'import os, time\nif os.environ["RANK"] == "1":\n    raise RuntimeError("boom on rank 1")\ntime.sleep(5)\n',
    # "cli_error" is the real dflash CLI on a bad config: one line on stderr from every rank, exit 2, no traceback
    # a rank that dies without a word
    "silent": 'import os, time\nif os.environ["RANK"] == "1":\n    os._exit(3)\ntime.sleep(5)\n',
}


@pytest.mark.parametrize("case, want", [
    ("raises", "RuntimeError: boom on rank 1"),
    ("cli_error", "dflash: bad.yaml:2: train.lr: must be positive, got -1.0"),
    ("silent", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: rank 1: exited with code 3 "
               "(no traceback in the log)"),
])
def test_crash_line_under_torchrun_names_the_rank_failure_not_torchruns_own_error(tmp_path: Path, case: str,
                                                                                  want: str) -> None:
    """Every multi-GPU run goes through torchrun, whose ChildFailedError traceback ends the log and only says that a
    rank failed: status must show why (the rank's exception, the CLI's error line, or the root cause's rank and
    exit code). Real torchrun, two CPU ranks."""
    if case == "cli_error":
        (tmp_path / "bad.yaml").write_text("train:\n  lr: -1\n")
        command = ["-m", "dflash", "train", "--config", "bad.yaml", "--out", "out"]
    else:
        script = tmp_path / f"{case}.py"
        script.write_text(_RANK_SCRIPTS[case])
        command = [str(script)]
    log = tmp_path / f"{case}.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    with open(log, "wb") as fh:
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                            str(_free_port()), *command], cwd=tmp_path, env=env, stdout=fh, stderr=subprocess.STDOUT,
                           timeout=120)
    assert r.returncode != 0
    text = log.read_text()
    assert "ChildFailedError" in text and rules.traceback_from_lines(text.splitlines()).endswith("ChildFailedError: ")
    assert rules.crash_line(str(log)) == want


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_host_load_check_warns_only_when_runnable_work_exceeds_the_cpus() -> None:
    assert cache.host_load_check(1.5, 2) == (False, "load 1.5 over the last minute on 2 CPUs")
    warn, detail = cache.host_load_check(5.2, 2)
    assert warn and detail.startswith("load 5.2 over the last minute on 2 CPUs: more runnable work than CPUs")
    assert cache.host_load_check(1.0, 1) == (False, "load 1.0 over the last minute on 1 CPU")
