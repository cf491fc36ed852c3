"""The launch's preflight: the inductor cache (who uses it, its key: versions and a code fingerprint, and whether
to clear it), the previous attempt and the refusals it leads to (finished, beyond its own end, a lost restart),
the model manifest check and the host's load.

Stdlib only: shipped in the agent's blob.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any

from opsctl.remote.attempts import (
    read_history,
)
from opsctl.remote.base import (
    emit,
    read_json,
)
from opsctl.remote.follow import long_lines
from opsctl.remote.procs import Run, _tree_size, all_procs, default_inductor_dir, empty_dir, read_exit_code
from opsctl.remote.rules import (
    MAX_EVENT_LINE,
    event_object,
    resume_argv,
)

# -- inductor cache: who uses it, and its key ----------------------------------------------------------------
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _environ(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None  # gone, or another user's process (those cannot write our cache dir's files either)
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _uses_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps", "rb") as fh:
            return b"libtorch" in fh.read()
    except OSError:
        return False


def cache_users(real: str) -> list[tuple[str, int]]:
    """Live processes on this host whose inductor/triton cache lies in or over `real`: (run name, pid).

    Found through each process's environment (the launch wrapper sets TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR
    and OPSCTL_RUN for every run), so another run's cache is never emptied under it; for torch's shared default
    dir, any process that loaded libtorch without its own TORCHINDUCTOR_CACHE_DIR counts too."""
    is_default = real == os.path.realpath(default_inductor_dir())
    procs = all_procs()
    # This agent and its ancestors (the SSH session's shell, pct exec) only carry a login environment that
    # happens to export the variable: they are not runs using the cache.
    mine, p = set(), os.getpid()
    while p > 1 and p not in mine:
        mine.add(p)
        p = procs[p][1] if p in procs else 0
    out: list[tuple[str, int]] = []
    for pid, st in procs.items():
        if pid in mine or st[0] in ("Z", "X"):
            continue
        env = _environ(pid)
        if env is None:
            continue
        hit = False
        for key in CACHE_ENV:
            v = env.get(key)
            if v and os.path.isabs(v):
                rv = os.path.realpath(v)
                if rv == real or rv.startswith(real.rstrip("/") + "/") or real.startswith(rv.rstrip("/") + "/"):
                    hit = True
        if not hit and is_default and "TORCHINDUCTOR_CACHE_DIR" not in env and _uses_torch(pid):
            hit = True
        if hit:
            out.append((env.get("OPSCTL_RUN") or "(not an opsctl run)", pid))
    return sorted(out, key=lambda x: (x[0], x[1]))


def describe_users(users: list[tuple[str, int]]) -> str:
    by_run: dict[str, list[int]] = {}
    for name, pid in users:
        by_run.setdefault(name, []).append(pid)
    return "; ".join("run {} (pid {})".format(n, ", ".join(str(p) for p in pids[:8]) + (", ..." if len(pids) > 8 else ""))
                     for n, pids in by_run.items())


def _python_of(run: Run) -> str:
    """The interpreter the run uses when its argv starts with one (python3, .venv/bin/python), else this one."""
    argv = run.command if isinstance(run.command, list) else []
    if argv and re.match(r"python[\d.]*$", os.path.basename(str(argv[0]))):
        return str(argv[0]) if os.path.isabs(str(argv[0])) else (shutil.which(str(argv[0])) or sys.executable)
    return sys.executable


_VERSIONS_CODE = (
    "import json, sys\n"
    "from importlib import metadata\n"
    "def v(n):\n"
    "    try:\n"
    "        return metadata.version(n)\n"
    "    except Exception:\n"
    "        return 'none'\n"
    "print(json.dumps({'python': sys.version.split()[0], 'torch': v('torch'),"
    " 'triton': v('triton') if v('triton') != 'none' else v('pytorch-triton')}))\n"
)


def _git(workdir: str, *args: str) -> bytes | None:
    exe = shutil.which("git")
    if exe is None:
        return None
    try:
        cp = subprocess.run([exe, "-C", workdir, *args], stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return cp.stdout if cp.returncode == 0 else None


def _hash_tree(h: Any, root: str) -> int:
    """Hash every file under `root` (names and contents, in sorted order; bytecode and .git skipped)."""
    if os.path.isfile(root):
        files = [root]
    else:
        files = []
        for dirpath, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", ".git")]
            files += [os.path.join(dirpath, f) for f in names if not f.endswith((".pyc", ".pyo"))]
    n = 0
    for p in sorted(files):
        try:
            with open(p, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        h.update(p.encode(errors="surrogateescape") + b"\0" + data + b"\0")
        n += 1
    return n


def code_fingerprint(run: Run) -> str:
    """The code the run executes: `git <commit>[+dirty <hash of the diff and untracked files>]` for a git
    checkout, else `files <hash>` of cache_key_paths (default: the workdir's Python package dirs)."""
    head = _git(run.workdir, "rev-parse", "HEAD")
    if head:
        commit = head.decode().strip()[:12]
        diff = _git(run.workdir, "diff", "HEAD", "--binary") or b""
        untracked = _git(run.workdir, "ls-files", "--others", "--exclude-standard", "-z") or b""
        if not diff and not untracked:
            return f"git {commit}"
        h = hashlib.sha256(diff)
        for name in sorted(x for x in untracked.split(b"\0") if x):
            h.update(b"\0" + name + b"\0")
            try:
                with open(os.path.join(run.workdir, name.decode(errors="surrogateescape")), "rb") as fh:
                    h.update(fh.read(16 << 20))
            except OSError:
                pass
        return f"git {commit}+dirty {h.hexdigest()[:12]}"
    paths = [run.path(p) for p in run.cache_key_paths]
    if not paths:
        try:
            names = sorted(os.listdir(run.workdir))
        except OSError:
            names = []
        paths = [os.path.join(run.workdir, n) for n in names
                 if os.path.isfile(os.path.join(run.workdir, n, "__init__.py"))]
    h = hashlib.sha256()
    n = sum(_hash_tree(h, p) for p in paths)
    return f"files {h.hexdigest()[:12]} ({n} files)"


def cache_key(run: Run) -> dict[str, str]:
    """torch, triton and python versions of the run's interpreter plus the code fingerprint."""
    env = dict(os.environ)
    env.update(run.env)
    key: dict[str, str]
    try:
        cp = subprocess.run([_python_of(run), "-c", _VERSIONS_CODE], cwd=run.workdir, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        key = {k: str(v) for k, v in json.loads(cp.stdout.strip().splitlines()[-1]).items()}
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        key = {"python": "unknown", "torch": "unknown", "triton": "unknown", "error": f"{exc.__class__.__name__}"}
    key["code"] = code_fingerprint(run)
    return key


def previous_attempt(run: Run) -> dict[str, Any]:
    """What the last launch of this run came to: exit code, last phase, steps, its run_end, and its argv.

    Read from STATE_DIR (launch.json, exit_code, spec.json) and the events written since that launch: from the
    events file's size at the launch (launch.json `events_offset`), so a week of earlier attempts' events is not
    read again, and one line at most MAX_EVENT_LINE long (a longer one is skipped, never held whole)."""
    launch = read_json(run.state_file("launch.json")) or {}
    since = float(launch.get("ts", 0)) - 1.0
    out: dict[str, Any] = {"launched": bool(launch), "exit_code": read_exit_code(run.state_file("exit_code")),
                           "phase": None, "step": None, "total_steps": None, "run_end": None, "run_start": None,
                           "error": None, "argv": (read_json(run.state_file("spec.json")) or {}).get("argv")}
    if run.events and os.path.exists(run.events):
        with open(run.events, "rb") as fh:
            offset = launch.get("events_offset")
            if isinstance(offset, int) and 0 < offset <= os.fstat(fh.fileno()).st_size:
                fh.seek(offset)  # (a file shorter than that was truncated or replaced since: read it all)
            for head, length, complete in long_lines(fh, MAX_EVENT_LINE):
                if not complete:
                    break  # the line being written
                ev = event_object(head, length)  # an over-long or broken line is no event: skipped
                if not isinstance(ev, dict) or (isinstance(ev.get("ts"), (int, float)) and ev["ts"] < since):
                    continue
                kind = ev.get("kind")
                if kind == "run_start":
                    out.update(phase="starting", run_end=None, error=None, run_start=ev,
                               total_steps=ev.get("total_steps"), step=ev.get("resumed_from"))
                elif kind == "phase":
                    out["phase"] = ev.get("phase")
                elif kind == "step":
                    out["phase"] = "training"
                    out["step"] = ev.get("step")
                    if ev.get("total_steps"):
                        out["total_steps"] = ev["total_steps"]
                elif kind == "error" and ev.get("fatal"):
                    out["error"] = ev
                elif kind == "run_end":
                    out["run_end"] = ev
    return out


def lost_restart(run: Run, lost: dict[str, Any] | None, argv: list[str]) -> dict[str, Any] | None:
    """The restart a wrapper was waiting to start when it died (SIGKILL, OOM, a reboot during the back-off), which
    this launch carries out in its place: {n, of, argv} (argv with the policy's resume arguments), said on the
    launch's stream; None when there is none (or no restart policy now)."""
    policy = run.args.get("restart") or {}
    if not isinstance(lost, dict) or policy.get("when") != "on-failure":
        return None
    n = int(lost.get("n") or 1)
    resumed = resume_argv(argv, [str(a) for a in policy.get("resume_args") or []])
    emit("check", name="restart", ok=True,
         detail=f"restart {n} of {lost.get('max')} after attempt {lost.get('attempt')} (exit "
                f"{lost.get('exit_code')}) never started: the run's wrapper died during its back-off; starting it "
                "now" + (f", resuming with {' '.join(policy.get('resume_args') or [])}" if resumed != argv else ""))
    return {"n": n, "of": lost.get("attempt"), "argv": resumed}


def finished_refusal(run: Run, prev: dict[str, Any], argv: list[str]) -> str | None:
    """Why launching again would only break a run that already completed its last step (None: go ahead).

    The same command over unchanged files would be told `already at step N of N` by the training core and
    end as an error, hiding the result; a changed argv or a file named in it edited since lets it through."""
    end = prev.get("run_end")
    total = prev.get("total_steps")
    if not end or end.get("reason") != "completed" or end.get("exit_code") not in (0, None):
        return None
    step = end.get("step")
    if not (isinstance(step, int) and isinstance(total, int) and total > 0 and step >= total):
        return None
    if prev.get("argv") is not None and prev["argv"] != argv:
        return None
    ended = float(end.get("ts") or 0)
    for a in argv:
        p = run.path(a) if not a.startswith("-") else None
        try:
            if p and os.path.isfile(p) and os.path.getmtime(p) > ended:
                return None  # a config named in the command changed since it finished (e.g. more steps)
        except OSError:
            pass
    return (f"run {run.name} already finished: step {step} of {total} (run_end completed, exit 0); launching "
            f"it again would change nothing but its state. To train again: add --fresh to its command (a new "
            f"run in the same --out), raise the step count (train.max_steps in its config, or --max-steps), "
            f"or give it another --out")


def _argv_max_steps(argv: list[str]) -> int | None:
    """The `--max-steps N` (or `--max-steps=N`) of a dflash command line, the last one given; None without it."""
    found = None
    for i, a in enumerate(argv):
        value = argv[i + 1] if a == "--max-steps" and i + 1 < len(argv) else (
            a.split("=", 1)[1] if a.startswith("--max-steps=") else None)
        if value is not None and value.isdigit():
            found = int(value)
    return found


def beyond_refusal(run: Run, argv: list[str]) -> str | None:
    """Why this command would resume past its own last step (None: go ahead, or nothing says so).

    An attempt extended with `opsctl launch HOST RUN -- --max-steps 400` and stopped at step 139 leaves its newest
    checkpoint at 139; the plain command (its config's 100 steps) resumes from there and the training core refuses
    with `already at step 139 of 100` after its start-up. Known before anything starts when the command resumes
    (`--resume`, not `--fresh`), the newest checkpoint of the events still exists, and this command's length is
    known: its own `--max-steps`, or an earlier attempt with this very command line whose run_start had a fixed
    `train.max_steps` (an epochs-based config keeps the checkpoint's planned length instead: nothing to refuse) and
    no file named in it changed since."""
    if not run.events or "--fresh" in argv or not any(a == "--resume" or a.startswith("--resume=") for a in argv):
        return None
    ckpt: tuple[int, str] | None = None
    starts: list[dict[str, Any]] = []
    try:
        with open(run.events, "rb") as fh:
            for head, length, complete in long_lines(fh, MAX_EVENT_LINE):
                if not complete or (b'"checkpoint"' not in head and b'"run_start"' not in head):
                    continue
                ev = event_object(head, length)
                if not isinstance(ev, dict):
                    continue
                if ev.get("kind") == "checkpoint" and isinstance(ev.get("step"), int) and isinstance(ev.get("path"), str):
                    ckpt = (ev["step"], ev["path"])
                elif ev.get("kind") == "run_start" and isinstance(ev.get("ts"), (int, float)):
                    starts.append(ev)
    except OSError:
        return None
    if ckpt is None or not os.path.exists(run.path(ckpt[1])):
        return None
    step, total, how = ckpt[0], _argv_max_steps(argv), "its --max-steps"
    if total is None:
        for a in reversed(read_history(run.state_dir, run.log, run.keep_logs)):
            started, ended = a.get("started"), a.get("ended")
            if a.get("argv") != argv or not isinstance(started, (int, float)):
                continue
            mine = [e for e in starts if e["ts"] >= started - 1.0
                    and (not isinstance(ended, (int, float)) or e["ts"] <= ended + 1.0)]
            train = ((mine[-1].get("config") or {}).get("train") or {}) if mine else {}
            if not mine or not isinstance(mine[-1].get("total_steps"), int) or train.get("max_steps") is None:
                continue
            outputs = {run.path(run.events), run.path(run.log)}  # written by the run itself: no input changed
            for f in argv:
                p = run.path(f) if not f.startswith("-") else None
                try:
                    if p and p not in outputs and os.path.isfile(p) and os.path.getmtime(p) > started:
                        return None  # a config named in the command changed since (e.g. more steps)
                except OSError:
                    pass
            total, how = mine[-1]["total_steps"], f"its attempt #{a.get('id')} with this command trained {mine[-1]['total_steps']} steps"
            break
    if total is None or step < total:
        return None
    return (f"run {run.name} would resume past its own end: its newest checkpoint is at step {step} ({ckpt[1]}), "
            f"this command trains {total} steps ({how}); the training core would refuse it (already at step {step} "
            f"of {total}). To go on: opsctl launch HOST {run.name} -- --max-steps N (N above {step}); to start over: "
            f"add --fresh to its command, or give it another --out")


def cold_start_reasons(prev: dict[str, Any], fresh: bool) -> list[str]:
    """Why this launch must compile from nothing: asked for, or the last attempt died compiling (a bad cache entry
    would kill it again). Then the run's own saved compile artifacts (dflash's warm start, OUT/compile_cache) must not
    be loaded either: the launch sets DFLASH_WARM_START=0 for the run."""
    reasons = ["--fresh-cache"] if fresh else []
    if prev.get("phase") == "compiling" and (prev.get("exit_code") not in (0, None) or prev.get("error")
                                             or (prev.get("run_end") or {}).get("reason") in ("error", "signal")):
        reasons.append("the previous attempt died in phase compiling (exit {})".format(prev.get("exit_code")))
    return reasons


def prepare_cache(run: Run, real: str, prev: dict[str, Any], fresh: bool) -> str:
    """Clear or keep the run's cache dir by its policy; returns what was done and why (launch prints it)."""
    key_file = run.state_file("inductor_key.json")
    reasons = cold_start_reasons(prev, fresh)
    key: dict[str, str] | None = None
    if run.cache_policy == "clear":
        reasons.append("inductor_cache_policy clear")
    else:
        key = cache_key(run)
        old = read_json(key_file)
        if old is None or old.get("cache") != real or not isinstance(old.get("key"), dict):
            reasons.append("no key recorded for it yet")
        else:
            diff = [f"{k} {old['key'].get(k, 'none')} -> {key.get(k, 'none')}" for k in sorted(set(key) | set(old["key"]))
                    if key.get(k) != old["key"].get(k)]
            reasons += diff
        if key.get("error"):
            reasons.append(f"versions unknown ({key['error']})")
    os.makedirs(real, exist_ok=True)
    if reasons:
        n, size = empty_dir(real, dry_run=False, quiet=True)
        what = f"inductor cache cleared: {'; '.join(reasons)} ({real}: {n} entries, {size / 2**20:.1f} MiB)"
        if cold_start_reasons(prev, fresh):
            what += "; the run's saved compile artifacts are not loaded either (DFLASH_WARM_START=0)"
    else:
        n, size = _count_tree(real)
        what = (f"inductor cache kept: key unchanged (torch {key['torch']}, triton {key['triton']}, python "  # type: ignore[index]
                f"{key['python']}, {key['code']}) ({real}: {n} entries, {size / 2**20:.1f} MiB)")  # type: ignore[index]
    if key is not None:
        tmp = key_file + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"cache": real, "key": key, "ts": time.time()}, fh)
        os.replace(tmp, key_file)
    return what


def _count_tree(real: str) -> tuple[int, int]:
    try:
        names = os.listdir(real)
    except OSError:
        return 0, 0
    return len(names), sum(_tree_size(os.path.join(real, n)) for n in names)


def host_load_check(load1: float, cpus: int) -> tuple[bool, str]:
    """(warn, detail) for the host's 1-minute load average against its CPUs. A launch onto a host whose CPUs are
    already taken is not refused (GPU work needs little CPU) but is said: data loading and the launch stream compete
    for the cores, and on a CPU run every step slows in proportion (the tiny demo ran many times slower next to a
    test suite on 2 cores)."""
    busy = load1 > cpus
    detail = f"load {load1:.1f} over the last minute on {cpus} CPU{'s' if cpus != 1 else ''}"
    if busy:
        detail += ": more runnable work than CPUs; this run will share them and be slower (top / ps -eo pcpu,pid,args)"
    return busy, detail


def check_manifest(model_dir: str, manifest: str | None) -> tuple[bool, str]:
    """Sizes and sha256 of the files a manifest lists: {"files": {rel: {size, sha256}}} or a list of entries."""
    mpath = manifest or os.path.join(model_dir, "manifest.json")
    if not os.path.isdir(model_dir):
        return False, f"model dir {model_dir} does not exist"
    data = read_json(mpath)
    if data is None:
        return False, f"manifest {mpath} missing or not a JSON object"
    files = data.get("files")
    if isinstance(files, list):
        files = {str(e.get("path")): e for e in files if isinstance(e, dict)}
    if not isinstance(files, dict) or not files:
        return False, f"manifest {mpath} has no 'files'"
    t0 = time.time()
    nbytes = 0
    for rel, meta in files.items():
        p = os.path.join(model_dir, rel)
        meta = meta if isinstance(meta, dict) else {"size": meta}
        try:
            size = os.path.getsize(p)
        except OSError:
            return False, f"{p} is missing"
        if meta.get("size") is not None and int(meta["size"]) != size:
            return False, f"{p} has {size} bytes, manifest says {meta['size']}"
        if meta.get("sha256"):
            h = hashlib.sha256()
            with open(p, "rb") as fh:
                for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() != meta["sha256"]:
                return False, f"{p} sha256 {h.hexdigest()[:16]} differs from the manifest"
        nbytes += size
    return True, f"{len(files)} files, {nbytes / 2**20:.1f} MiB match {mpath} ({time.time() - t0:.1f} s)"
