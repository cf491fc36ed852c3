"""`opsctl clean` and the agent's path validation: only the cache dir's contents go, dangerous paths are refused.

Validation runs on the remote after resolving symlinks there; a link out of the allowed roots is refused.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import cleanup, drive, of, opsctl, run_args, script_run  # noqa: E402

from opsctl.remote import base, procs  # noqa: E402


@pytest.mark.parametrize("path, why", [
    ("", "empty"), ("   ", "empty"), ("/", "root"), ("~", "~"), ("~/cache", "~"), ("relative/dir", "absolute"),
    ("/tmp", "system"), ("/usr", "system"), ("/home", "system"), ("/etc", "system"), ("/dev/shm", "system"),
    ("/opt", "system"),
])
def test_validate_refuses_dangerous_paths(path: str, why: str) -> None:
    with pytest.raises(base.AgentError) as exc:
        procs.validate_clean_dir(path, ["/"], default_ok=False)
    assert why in str(exc.value)


def test_validate_roots_home_and_symlink_escapes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "cache").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    assert procs.validate_clean_dir(str(root / "cache"), [str(root)], False) == str(root / "cache")
    assert procs.validate_clean_dir(str(root), [str(root)], False) == str(root)  # the root itself may be emptied
    with pytest.raises(base.AgentError, match="not inside an allowed root"):
        procs.validate_clean_dir(str(outside), [str(root)], False)
    with pytest.raises(base.AgentError, match="none configured"):
        procs.validate_clean_dir(str(root / "cache"), [], False)
    (root / "escape").symlink_to(outside)  # looks inside the root, resolves outside it
    with pytest.raises(base.AgentError, match="resolves to"):
        procs.validate_clean_dir(str(root / "escape"), [str(root)], False)
    with pytest.raises(base.AgentError, match=r"\.\."):
        procs.validate_clean_dir(str(root / ".." / "outside"), [str(root)], False)
    home = os.path.realpath(os.path.expanduser("~"))
    with pytest.raises(base.AgentError, match="home"):
        procs.validate_clean_dir(home, [home, "/"], False)
    # torch's default location is allowed without a root
    assert procs.validate_clean_dir(procs.default_inductor_dir(), [], True) == os.path.realpath(
        procs.default_inductor_dir())


def _tree(tmp: Path) -> tuple[Path, Path]:
    cache = tmp / "cache"
    (cache / "sub" / "deep").mkdir(parents=True)
    (cache / "a.so").write_bytes(b"x" * 1000)
    (cache / "sub" / "deep" / "b.py").write_text("y")
    keep = tmp / "precious"
    keep.mkdir()
    (keep / "data.txt").write_text("keep me")
    (cache / "link-out").symlink_to(keep)  # a symlink inside the cache pointing out: the link goes, not the target
    (cache / "sub" / "link-file").symlink_to(keep / "data.txt")
    return cache, keep


def test_clean_over_ssh_pct_dry_run_then_real(tmp_path: Path, sshd, container: Callable[..., int]) -> None:
    vmid = container(200)
    cache, keep = _tree(tmp_path)
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=vmid, runs={
        "ok": script_run(tmp_path, "ok_run.py", "--steps", "1", "--step-time", "0.01", "--load-time", "0",
                         tmux_session="clean-ok")})
    assert opsctl(hosts, "launch", "box", "ok", "--follow").returncode == 0
    (cache / "new.so").write_bytes(b"z" * 10)  # written after launch cleared it
    (cache / "link-out").symlink_to(keep)
    r = opsctl(hosts, "clean", "box", "ok", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"would remove {cache / 'new.so'}" in r.stdout and f"would remove {cache / 'link-out'}" in r.stdout
    assert "would remove tmux:clean-ok" in r.stdout  # the dead pane kept by remain-on-exit
    assert (cache / "new.so").exists() and (cache / "link-out").is_symlink()  # dry run removed nothing
    r = opsctl(hosts, "clean", "box", "ok")
    assert r.returncode == 0, r.stderr
    assert list(cache.iterdir()) == [] and cache.is_dir()  # contents gone, the dir itself stays
    assert (keep / "data.txt").read_text() == "keep me"  # nothing outside it, not through symlinks either
    assert (tmp_path / "run.log").exists() and (tmp_path / "events.jsonl").exists()
    assert "removed tmux:clean-ok" in r.stdout
    r = opsctl(hosts, "clean", "box", "ok", "--dry-run")
    assert "tmux:" not in r.stdout  # the dead session is gone


def test_clean_refuses_escape_and_running_run(tmp_path: Path) -> None:
    cache, keep = _tree(tmp_path)
    roots = tmp_path / "roots"
    roots.mkdir()
    (roots / "cache").symlink_to(keep)
    rc, msgs = drive("clean", run_args(tmp_path, "ok_run.py", inductor_cache_dir=str(roots / "cache"),
                                       clean_roots=[str(roots)]))
    assert rc == base.EXIT_CODES["refused"] and not of(msgs, "removed")
    assert "resolves to" in of(msgs, "check")[0]["detail"] and (keep / "data.txt").exists()
    args = run_args(tmp_path, "hang_loading.py", ready_timeout=0.3, kill_grace=[0.5, 0.5])
    try:
        assert drive("launch", args)[0] == base.EXIT_CODES["timeout"]
        (cache / "x").write_text("in use")
        rc, msgs = drive("clean", args)
        assert rc == base.EXIT_CODES["refused"] and "is running" in of(msgs, "check")[0]["detail"]
        assert (cache / "x").exists()
        # A dry run on the live run reports what a real clean would refuse, as a warning, and exits 0.
        rc, msgs = drive("clean", {**args, "options": {"dry_run": True}})
        (check,) = of(msgs, "check")
        assert rc == base.EXIT_CODES["ok"] and check["ok"] and check["warn"], msgs
        assert check["detail"].startswith("a real clean would refuse: run is running") and (cache / "x").exists()
    finally:
        cleanup(args)


def test_clean_refuses_a_symlinked_cache_dir_that_leads_out(tmp_path: Path, sshd, container: Callable[..., int]) -> None:
    # The configured cache dir is a symlink inside the workdir pointing at a victim dir elsewhere. With no
    # clean_roots the cache dir is its own root, so resolving the root through the same link must not vouch for it.
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    work = tmp_path / "ops"
    work.mkdir()
    (work / "evil").symlink_to(victim)
    run = script_run(work, "ok_run.py", inductor_cache_dir=str(work / "evil"))
    run.pop("clean_roots")
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=container(200), runs={"ok": run})
    r = opsctl(hosts, "clean", "box", "ok")
    assert r.returncode == 5, (r.stdout, r.stderr)
    # the message is wrapped at the terminal width, where the temp path's length puts the breaks (xdist's is longer)
    assert f"{work / 'evil'} is a symlink to {victim}" in " ".join(r.stderr.split()), r.stderr
    assert (victim / "precious.txt").read_text() == "keep me"
    # explicit roots naming the link (or a dir below it) do not vouch for it either; a real root around the
    # target does
    for roots in ([str(work / "evil")], [str(work / "evil" / "sub")]):
        with pytest.raises(base.AgentError, match="is a symlink to"):
            procs.validate_clean_dir(str(work / "evil"), roots, False)
    assert procs.validate_clean_dir(str(work / "evil"), [str(tmp_path)], False) == str(victim)
    # a root that itself resolves to / or a system dir is no root
    (work / "slash").symlink_to("/")
    with pytest.raises(base.AgentError, match="not inside an allowed root"):
        procs.validate_clean_dir("/usr/lib/python3", [str(work / "slash")], False)
    assert (victim / "precious.txt").exists()


def test_clean_and_launch_refuse_while_a_finished_run_left_a_daemon(tmp_path: Path) -> None:
    # The main command exits by itself but leaves a double-forked daemon (held by the subreaper wrapper):
    # clean must not drop the pid file (kill's way to find it) or empty the cache under it, launch must not
    # start over it; after `kill` both go ahead.
    marker = tmp_path / "daemon"
    args = run_args(tmp_path, "daemonizer.py", "--marker", str(marker), "--exit-after", "0.3", kill_grace=[0.5, 0.5])
    try:
        assert drive("launch", {**args, "options": {"follow": True}})[0] == 0  # the main command exited 0
        daemon = int(marker.read_text().split()[0])
        assert procs.alive(daemon)
        (tmp_path / "cache").mkdir(exist_ok=True)
        (tmp_path / "cache" / "x.so").write_text("in use")
        rc, msgs = drive("clean", args)
        assert rc == base.EXIT_CODES["refused"], msgs
        assert f"left processes alive (pids [{daemon}])" in of(msgs, "check")[0]["detail"]
        assert not of(msgs, "removed") and (tmp_path / "state" / "pid").exists()
        assert (tmp_path / "cache" / "x.so").exists()
        rc, msgs = drive("launch", args)
        assert rc == base.EXIT_CODES["refused"] and procs.alive(daemon)
        assert "left processes alive" in [c for c in of(msgs, "check") if not c["ok"]][0]["detail"]
        rc, msgs = drive("kill", args)
        assert rc == 0 and not procs.alive(daemon), msgs
        rc, msgs = drive("clean", args)
        assert rc == 0 and not (tmp_path / "cache" / "x.so").exists()
    finally:
        cleanup(args)


def test_a_dry_run_exits_as_the_real_clean_would_for_a_refused_cache_dir(tmp_path: Path, sshd,
                                                                         container: Callable[..., int],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal printed as FAIL never exits 0 (issue 39): a cache dir the real clean refuses for what it is (a
    symlink out of its roots, found on the host; the home directory) fails a dry run with the same exit code 5."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    work = tmp_path / "ops"
    work.mkdir()
    (work / "evil").symlink_to(victim)
    run = script_run(work, "ok_run.py", inductor_cache_dir=str(work / "evil"))
    run.pop("clean_roots")
    hosts = sshd.write_hosts_yaml(tmp_path / "hosts.yaml", pct=container(200), runs={"ok": run})
    real = opsctl(hosts, "clean", "box", "ok")
    dry = opsctl(hosts, "clean", "box", "ok", "--dry-run")
    assert real.returncode == dry.returncode == 5, (real.stderr, dry.stderr)
    flat = " ".join(dry.stderr.split())
    assert f"FAIL inductor_cache: a real clean would refuse: refusing to clean '{work / 'evil'}'" in flat, flat
    assert (victim / "precious.txt").read_text() == "keep me"
    # the home directory (the agent's $HOME on the host: the local host here, whose HOME the test sets)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    local = tmp_path / "local.yaml"
    local.write_text(f"hosts:\n  local:\n    local: true\n    runs:\n      h:\n        workdir: {tmp_path}\n"
                     f"        command: ['true']\n        log: run.log\n        inductor_cache_dir: {home}\n"
                     f"        clean_roots: [{tmp_path}]\n")
    real = opsctl(local, "clean", "local", "h")
    dry = opsctl(local, "clean", "local", "h", "--dry-run")
    assert real.returncode == dry.returncode == 5, (real.stderr, dry.stderr)
    assert "FAIL inductor_cache: a real clean would refuse" in dry.stderr and "home directory" in dry.stderr
