"""The inductor cache, done properly (issue 8): never a cache dir over the run's own files, per-run by default,
never cleared under another live run, and `inductor_cache_policy: clear | keyed` saying what it did and why.

Real processes throughout: the opsctl CLI, the agent, tmux, and test runs that write the real event contract.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "runs"))

from agentlib import drive, kill_tmux, of, opsctl, run_args, script_run  # noqa: E402

from opsctl import commands  # noqa: E402


def local_hosts(path: Path, runs: dict[str, dict[str, Any]]) -> Path:
    """A hosts.yaml with only the `local` host (runs in tmux on this machine, no SSH)."""
    path.write_text(yaml.safe_dump({"hosts": {"local": {"local": True, "runs": runs}}}, sort_keys=False))
    return path


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root with its content, to prove nothing was deleted or changed."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- item 1: an empty / "." / workdir cache dir never empties the workdir -------------------------------------
def test_agent_refuses_a_cache_dir_that_is_or_contains_the_runs_own_paths(tmp_path: Path) -> None:
    """Defence in depth: the agent re-checks what the client sent, so a client that skipped validation (or an
    older one) still cannot empty the workdir, the state dir or the log's directory."""
    work = tmp_path / "work"
    (work / "src").mkdir(parents=True)
    (work / "src" / "train.py").write_text("print('precious')\n")
    (work / "runs").mkdir()
    (work / "runs" / "train.log").write_text("old log\n")
    before = tree(work)
    for bad, why in [("", "empty path"), (".", "working directory"), (str(work), "workdir"),
                     (str(work / "runs"), "log"), (str(work / ".opsctl"), "state_dir"), (str(tmp_path), "workdir")]:
        args = run_args(work, "ok_run.py", "--steps", "1", inductor_cache_dir=bad, clean_roots=[str(tmp_path)],
                        state_dir=str(work / ".opsctl" / "t"), log=str(work / "runs" / "train.log"),
                        events=str(work / "runs" / "events.jsonl"))
        for verb in ("clean", "launch"):
            rc, msgs = drive(verb, args)
            checks = [m for m in of(msgs, "check") if m["name"] == "inductor_cache"]
            assert rc == 5, (verb, bad, msgs[-3:])
            assert checks and not checks[0]["ok"] and why in checks[0]["detail"], (verb, bad, checks)
            assert not of(msgs, "launched") and not of(msgs, "removed")
        after = {k: v for k, v in tree(work).items() if not k.startswith(".opsctl/")}
        assert after == before, bad  # sources and log untouched; launch never started


def test_hosts_check_refuses_a_cache_dir_over_the_runs_own_paths(tmp_path: Path) -> None:
    for value, expect in [("", "resolves to the workdir"), (".", "resolves to the workdir"),
                          ("runs", "contains the run's log"), (".opsctl", "contains the run's state_dir"),
                          (str(tmp_path.parent), "contains the run's workdir"),
                          ("/dev/shm/models", "contains the run's model_dir"),
                          ("ckpt", "contains the run's checkpoint_dir")]:
        hosts = local_hosts(tmp_path / "hosts.yaml", {"r": {
            "workdir": str(tmp_path), "command": ["true"], "log": "runs/r/train.log", "events": "runs/r/ev.jsonl",
            "model_dir": "/dev/shm/models/qwen", "checkpoint_dir": "ckpt/r", "inductor_cache_dir": value}})
        r = opsctl(hosts, "hosts", "check")
        line = hosts.read_text().splitlines().index(
            next(ln for ln in hosts.read_text().splitlines() if "inductor_cache_dir" in ln)) + 1
        assert r.returncode == commands.EXIT_USAGE, (value, r.stderr)
        flat = " ".join(r.stderr.split())
        assert f"{hosts}:{line}: hosts.local.runs.r.inductor_cache_dir:" in flat and expect in flat, (value, flat)


# -- item 2: per-run default, handed to the run; never cleared under another live run -------------------------
def test_default_cache_is_per_run_and_reaches_the_run_as_env(tmp_path: Path) -> None:
    hosts = local_hosts(tmp_path / "hosts.yaml", {"c": script_run(
        tmp_path, "compile_run.py", inductor_cache_dir=None, clean_roots=None, tmux_session="cache-env")})
    raw = yaml.safe_load(hosts.read_text())
    for k in ("inductor_cache_dir", "clean_roots"):
        raw["hosts"]["local"]["runs"]["c"].pop(k)
    hosts.write_text(yaml.safe_dump(raw))
    try:
        r = opsctl(hosts, "launch", "local", "c", "--follow")
    finally:
        kill_tmux(tmp_path, "c")
    assert r.returncode == 0, r.stderr
    own = tmp_path / ".opsctl" / "c" / "inductor"
    assert f"TORCHINDUCTOR_CACHE_DIR={own}" in r.stdout and f"TRITON_CACHE_DIR={own / 'triton'}" in r.stdout
    assert "/tmp/torchinductor_" not in r.stdout + r.stderr
    assert list(own.glob("artifact-*.so"))


def test_launch_and_clean_refuse_a_cache_dir_a_live_run_uses(tmp_path: Path) -> None:
    shared = tmp_path / "shared-cache"
    runs = {"a": script_run(tmp_path / "a", "compile_run.py", "--hold", "120", inductor_cache_dir=str(shared),
                            clean_roots=[str(tmp_path)], tmux_session="cache-a", ready_pattern="^TRITON"),
            "b": script_run(tmp_path / "b", "compile_run.py", inductor_cache_dir=str(shared),
                            clean_roots=[str(tmp_path)], tmux_session="cache-b")}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    hosts = local_hosts(tmp_path / "hosts.yaml", runs)
    try:
        r = opsctl(hosts, "launch", "local", "a")
        assert r.returncode == 0, r.stderr
        pid = __import__("json").loads(opsctl(hosts, "status", "local", "a", "--json").stdout)[0]["pid"]
        (shared / "warm.so").write_text("a's compiled kernels")
        for argv in (["launch", "local", "b"], ["clean", "local", "b"]):
            r = opsctl(hosts, *argv)
            flat = " ".join(r.stderr.split())
            assert r.returncode == commands.EXIT_REFUSED, (argv, r.stderr)
            assert f"in use by run a (pid {pid}" in flat, (argv, flat)
            assert (shared / "warm.so").read_text() == "a's compiled kernels"
        assert not (tmp_path / "b" / "run.log").exists()  # b never started
    finally:
        opsctl(hosts, "kill", "local", "a")
        kill_tmux(tmp_path / "a", "a")
        kill_tmux(tmp_path / "b", "b")


# -- the policy: clear (default) and keyed ---------------------------------------------------------------------
def _launch(hosts: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    r = opsctl(hosts, "launch", "local", "k", "--follow", *extra)
    return r


def _cache_line(r: subprocess.CompletedProcess[str]) -> str:
    flat = " ".join(r.stderr.split())
    start = flat.index("inductor_cache: ")
    return flat[start:start + 400]


def test_cache_policy_clear_empties_the_runs_cache_at_every_launch_and_says_so(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    hosts = local_hosts(tmp_path / "hosts.yaml", {"k": script_run(tmp_path, "compile_run.py",
                                                                    tmux_session="policy-clear")})
    try:
        assert _launch(hosts).returncode == 0
        assert list(cache.glob("artifact-*.so"))
        r = _launch(hosts)
    finally:
        kill_tmux(tmp_path, "k")
    assert r.returncode == 0, r.stderr
    assert "inductor cache cleared: inductor_cache_policy clear" in _cache_line(r)
    assert len(list(cache.glob("artifact-*.so"))) == 1  # only this attempt's


def test_cache_policy_keyed_keeps_the_cache_while_its_key_is_unchanged(tmp_path: Path) -> None:
    """Kept across launches; cleared when the code changes, after a death while compiling, on --fresh-cache."""
    cache = tmp_path / "cache"
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VERSION = 1\n")
    hosts = local_hosts(tmp_path / "hosts.yaml", {"k": script_run(
        tmp_path, "compile_run.py", tmux_session="policy-keyed", inductor_cache_policy="keyed")})

    def crash_next(crash: bool) -> None:
        raw = yaml.safe_load(hosts.read_text())
        cmd = [a for a in raw["hosts"]["local"]["runs"]["k"]["command"] if a not in ("--crash", "1")]
        raw["hosts"]["local"]["runs"]["k"]["command"] = cmd + (["--crash", "1"] if crash else [])
        hosts.write_text(yaml.safe_dump(raw, sort_keys=False))

    try:
        r = _launch(hosts)
        assert r.returncode == 0, r.stderr
        assert "inductor cache cleared: no key recorded for it yet" in _cache_line(r)
        first = sorted(cache.glob("artifact-*.so"))
        r = _launch(hosts)
        assert r.returncode == 0, r.stderr
        line = _cache_line(r)
        assert "inductor cache kept: key unchanged (torch " in line and "files " in line, line
        assert "DFLASH_WARM_START=\n" in r.stdout  # a kept cache: the run's saved compile artifacts may load
        assert set(first) < set(cache.glob("artifact-*.so"))  # the earlier attempt's artifacts survived

        (pkg / "__init__.py").write_text("VERSION = 2\n")  # the code that runs changed
        r = _launch(hosts)
        line = _cache_line(r)
        assert r.returncode == 0 and "inductor cache cleared: code files " in line and " -> files " in line, line
        assert not any(p.exists() for p in first)

        crash_next(True)
        r = _launch(hosts)
        assert r.returncode == commands.EXIT_FAILED and "RuntimeError: inductor: compile worker died" in r.stderr
        crash_next(False)
        r = _launch(hosts)
        line = _cache_line(r)
        assert r.returncode == 0 and "the previous attempt died in phase compiling (exit 1)" in line, line
        assert "not loaded either (DFLASH_WARM_START=0)" in line and "DFLASH_WARM_START=0" in r.stdout

        r = _launch(hosts, "--fresh-cache")
        assert r.returncode == 0 and "inductor cache cleared: --fresh-cache" in _cache_line(r)
        assert "DFLASH_WARM_START=0" in r.stdout  # dflash's warm start must not bring back what was cleared
        assert len(list(cache.glob("artifact-*.so"))) == 1
    finally:
        kill_tmux(tmp_path, "k")


def test_cache_key_of_a_git_workdir_is_commit_plus_dirty_diff(tmp_path: Path) -> None:
    from opsctl.remote import cache, procs

    def git(*a: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True,
                       env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                            "GIT_COMMITTER_EMAIL": "t@t"})

    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / ".gitignore").write_text("state/\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "one")
    run = procs.Run({"workdir": str(tmp_path), "state_dir": str(tmp_path / "state"), "command": ["true"]})
    clean = cache.code_fingerprint(run)
    assert clean.startswith("git ") and "+dirty" not in clean
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "pid").write_text("1")  # ignored files are not code
    assert cache.code_fingerprint(run) == clean
    (tmp_path / "train.py").write_text("print(2)\n")
    dirty = cache.code_fingerprint(run)
    assert dirty.startswith(clean + "+dirty ")
    (tmp_path / "new.py").write_text("x = 1\n")  # an untracked file changes it too
    assert cache.code_fingerprint(run) not in (clean, dirty)
    key = cache.cache_key(run)
    assert set(key) >= {"torch", "triton", "python", "code"} and key["python"] == sys.version.split()[0]
    t0 = time.monotonic()
    cache.cache_key(run)
    assert time.monotonic() - t0 < 30  # cheap enough for every launch (no torch import)
