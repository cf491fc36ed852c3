"""The remote agent's verbs and `main`: launch, follow, status, kill, clean, hello, history and group for one run,
each a stream of JSON lines on stdout (docs/agent-protocol.md); EOF on stdin ends it.

Shipped to the host as one stdlib-only blob with the rest of opsctl/remote (channel.agent_source,
base.shipped_script) and run by a bare `python3`. Keep it ASCII only: the bootstrap reads the blob with
sys.stdin.read(N) where N is a byte count. The client never imports this module (tests/test_remote_layout.py).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from opsctl.remote.attempts import attempt_taus, history_add, history_lines, read_history
from opsctl.remote.attempts import old_logs as logs_of
from opsctl.remote.attempts import rotate_logs as rotate_log_files
from opsctl.remote.base import (
    AGENT_VERSION,
    EXIT_CODES,
    GROUP_FILE,
    MAX_LOG_LINE,
    RESTARTING_FILE,
    AgentError,
    bye,
    emit,
    read_json,
    remote_sources,
    shipped_script,
    watch_stdin,
)
from opsctl.remote.cache import (
    beyond_refusal,
    cache_users,
    check_manifest,
    cold_start_reasons,
    describe_users,
    finished_refusal,
    host_load_check,
    lost_restart,
    prepare_cache,
    previous_attempt,
)
from opsctl.remote.follow import FOLD_AFTER_BYTES, Follower, Tail, bounded_lines, fold_resume, fold_save, long_lines
from opsctl.remote.procs import (
    Nvml,
    ProcWatch,
    Run,
    _tree_size,
    attempt_since,
    empty_dir,
    gpu_released,
    leftovers,
    notifiers,
    nvml_holders,
    proc_stat,
    read_exit_code,
    run_procs,
    session_info,
    tag_gpu_owners,
    tmux,
    wrapper_of,
)
from opsctl.remote.rules import (
    MAX_EVENT_LINE,
    EtaClock,
    MemoryWatch,
    TauTrack,
    event_object,
    with_args,
)

POLL_S = 0.05  # the agent's own file/process poll; the client never polls, it reads this stream


def wrapper_source() -> str:
    """The text launch writes to STATE_DIR/wrapper.py: the wrapper module's `main` with opsctl/remote's modules
    bundled in (base.shipped_script), so the process tmux starts runs under a bare python3 (no package on the host)."""
    return shipped_script("opsctl.remote.wrapper", "main()", remote_sources())


def rotate_logs(run: Run) -> tuple[str, int]:
    """Keep earlier attempts' logs: LOG -> LOG.1 -> ... -> LOG.keep_logs (the oldest beyond it goes); returns what
    was done and the rotation count an attempt records as its `log_seq` (the wrapper's rule, shared).

    Every launch used to truncate the log, so the traceback that made the user relaunch was gone."""
    return rotate_log_files(run.log, run.keep_logs, run.state_dir)


def old_logs(run: Run) -> list[str]:
    """Earlier attempts' logs, oldest first (LOG.N ... LOG.1)."""
    return logs_of(run.log)


# -- verbs --------------------------------------------------------------------------------------------------
def config_arg(argv: list[str]) -> str | None:
    """The run's config file, as the dflash CLI takes it (`--config FILE` or `--config=FILE`); None: not given."""
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def verb_launch(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    force = bool(opts.get("force"))
    extra = [str(a) for a in opts.get("extra_args") or []]  # `opsctl launch HOST RUN -- ARGS`: this attempt only
    argv = with_args(run.argv(), extra)
    where = str(opts.get("host") or socket.gethostname())
    if not os.path.isdir(run.workdir):
        what = "is not a directory" if os.path.exists(run.workdir) else "does not exist"
        emit("check", name="workdir", ok=False, detail=f"{run.workdir} {what} on host {where}: create it there, or "
             "set the run's `workdir:` in hosts.yaml to the directory the run starts in")
        return EXIT_CODES["refused"]
    config = config_arg(argv)
    if config is not None and not os.path.isfile(run.path(config)):
        # before anything is touched: `dflash: ...: cannot read config` from the started run said it too late
        emit("check", name="config", ok=False, detail=f"{run.path(config)} (the run's --config) does not exist on "
             f"host {where}: copy the config there, or fix --config in the run's command in hosts.yaml (a relative "
             f"path is read from the workdir {run.workdir})")
        return EXIT_CODES["refused"]
    os.makedirs(run.state_dir, exist_ok=True)
    failed: list[str] = []

    def check(name: str, good: bool, detail: str) -> None:
        emit("check", name=name, ok=good, detail=detail)
        if not good:
            failed.append(f"{name}: {detail}")

    def refused() -> int:
        """A refused launch is an attempt too (history says why), numbered like the others."""
        now = time.time()
        history_add(run.state_dir, started=now, ended=now, outcome="refused", reason="; ".join(failed),
                    argv=argv, extra_args=extra, by="launch")
        return EXIT_CODES["refused"]

    if shutil.which("tmux") is None:
        check("tmux", False, "tmux is not installed on this host (apt-get install tmux)")
        return refused()
    # One launch at a time per run: held until this agent exits (the kernel drops it with the process).
    lock_fd = os.open(run.state_file("launch.lock"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        check("not_running", False, "another opsctl launch of this run is in progress")
        return refused()
    prev = ProcWatch(run).snapshot()
    if prev["state"] == "running":
        check("not_running", False,
              "run already running (pid {}, tmux session {}); kill it first".format(prev["pid"], run.session))
        return refused()
    if prev["state"] == "restarting":
        r = prev.get("restart") or {}
        check("not_running", False, "run is restarting (restart {} of {} after attempt {} exited {}); kill it "
              "first".format(r.get("n"), r.get("max"), r.get("attempt"), r.get("exit_code")))
        return refused()
    lost = prev.get("restart_lost")
    left = leftovers(run)
    if left:
        check("not_running", False,
              f"the previous run exited but left processes alive (pids {left}); kill them first (opsctl kill)")
        return refused()
    emit("check", name="not_running", ok=True, detail=f"no live process recorded in {run.state_dir}")
    restart = lost_restart(run, lost, argv)
    prev = previous_attempt(run)
    why = finished_refusal(run, prev, argv)
    if why:  # before anything is touched: the finished run's files and state stay exactly as they are
        check("not_finished", False, why)
        return refused()
    why = beyond_refusal(run, argv)
    if why:  # likewise: an extended attempt's checkpoint is past this command's last step
        check("not_finished", False, why)
        return refused()

    ok = True
    if nvml.ok:
        gpus = opts.get("gpus")
        busy = [(g["index"], p["pid"], p.get("used_mb")) for g in nvml.sample() for p in g.get("procs", [])
                if not gpus or g["index"] in gpus]
        if busy and not force:
            ok = False
        check("gpus_free", not busy or force,
              ("busy: " + ", ".join(f"gpu{i} pid {p} {int(m or 0)} MiB" for i, p, m in busy)
               + (" (ignored: --force)" if force else "")) if busy
              else "no compute processes on " + (", ".join(f"gpu{i}" for i in gpus) if gpus else "any GPU"))
    else:
        emit("check", name="gpus_free", ok=True, detail="not checked: nvml " + nvml.status)
    try:
        warn, detail = host_load_check(os.getloadavg()[0], os.cpu_count() or 1)
        emit("check", name="host_load", ok=True, warn=warn, detail=detail)
    except OSError:  # no load average on this system: nothing to say
        pass

    if run.args.get("model_dir"):
        good, detail = check_manifest(run.path(run.args["model_dir"]),
                                      run.path(run.args["model_manifest"]) if run.args.get("model_manifest") else None)
        check("model_dir", good, detail)
        ok = ok and good

    pre = run.args.get("preflight")
    if pre:
        pargv = ["/bin/sh", "-c", pre] if isinstance(pre, str) else [str(x) for x in pre]
        env = dict(os.environ)
        env.update(run.env)
        try:
            cp = subprocess.run(pargv, cwd=run.workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                text=True, timeout=float(opts.get("preflight_timeout") or 300))
            out = (cp.stdout + cp.stderr).strip().splitlines()
            good = cp.returncode == 0
            detail = f"exit {cp.returncode}" + ((": " + " | ".join(out[-5:])) if out else "")
        except (OSError, subprocess.TimeoutExpired) as exc:
            good, detail = False, str(exc)
        check("preflight", good, detail)
        ok = ok and good

    real = ""
    try:
        real = run.validated_cache()
        users = cache_users(real)
        if users:
            check("inductor_cache", False, f"{real} is in use by {describe_users(users)}: not cleared, not shared; "
                  f"give this run its own inductor_cache_dir (the default is <state_dir>/inductor)")
            ok = False
        elif ok:
            emit("check", name="inductor_cache", ok=True,
                 detail=prepare_cache(run, real, prev, bool(opts.get("fresh_cache"))))
        else:
            emit("check", name="inductor_cache", ok=True, detail=f"{real} is valid; not touched (launch refused)")
    except (AgentError, OSError) as exc:
        check("inductor_cache", False, str(exc))
        ok = False
    if not ok:
        return refused()

    # A fresh start: remove what the previous run left, so state cannot be mistaken for this run's.
    for name in ("pid", "exit_code", "killed", RESTARTING_FILE):
        try:
            os.unlink(run.state_file(name))
        except FileNotFoundError:
            pass
    info = session_info(run)
    if info["exists"]:
        tmux(run, "kill-session", "-t", "=" + run.session)
    os.makedirs(os.path.dirname(run.log), exist_ok=True)
    rotated, log_seq = rotate_logs(run)
    emit("check", name="log", ok=True, detail=rotated)
    with open(run.log, "wb"):
        pass  # this attempt's log starts empty (the earlier ones were rotated, never truncated); offsets at 0
    env = dict(run.env)
    if cold_start_reasons(prev, bool(opts.get("fresh_cache"))):
        env["DFLASH_WARM_START"] = "0"  # dflash's own compile artifacts would bring back what was just cleared
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", real)
    env.setdefault("TRITON_CACHE_DIR", os.path.join(env["TORCHINDUCTOR_CACHE_DIR"], "triton"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["OPSCTL_RUN"] = run.name  # how cache_users() names the run that holds a cache dir
    env["OPSCTL_STATE_DIR"] = run.state_dir
    launch_ts = time.time()
    if restart is not None:  # this launch is the restart whose wrapper died during its back-off
        argv = restart["argv"]
        aid = history_add(run.state_dir, started=launch_ts, by="restart", restart=restart["n"],
                          restart_of=restart["of"], argv=argv, extra_args=extra, log_seq=log_seq)
    else:
        aid = history_add(run.state_dir, started=launch_ts, by="launch", argv=argv, extra_args=extra, log_seq=log_seq)
    # The wrapper runs the attempts: the first one (its id allocated here) and, by the restart policy, the next.
    spec = {"argv": argv, "env": env, "workdir": run.workdir, "log": run.log, "state_dir": run.state_dir,
            "name": run.name, "host": str(opts.get("host") or socket.gethostname()), "attempt": aid,
            "events": run.events, "restart": run.args.get("restart"), "notify": run.args.get("notify"),
            "tau_regression": run.args.get("tau_regression"),
            "stall_after": run.args.get("stall_after"), "keep_logs": run.keep_logs, "extra_args": extra,
            "restarts_used": restart["n"] if restart is not None else 0}
    with open(run.state_file("spec.json"), "w") as fh:
        json.dump(spec, fh)
    with open(run.state_file("wrapper.py"), "w") as fh:
        fh.write(wrapper_source())
    with open(run.state_file("tmux.conf"), "w") as fh:
        fh.write("set-option -g remain-on-exit on\nset-option -g history-limit 10000\n")
    events_offset = os.path.getsize(run.events) if run.events and os.path.exists(run.events) else 0
    with open(run.state_file("launch.json"), "w") as fh:
        json.dump({"ts": launch_ts, "session": run.session, "log": run.log, "events": run.events,
                   "events_offset": events_offset}, fh)
    cp = tmux(run, "-f", run.state_file("tmux.conf"), "new-session", "-d", "-s", run.session, "-x", "200", "-y", "50",
              "-c", run.workdir, sys.executable, run.state_file("wrapper.py"), run.state_file("spec.json"))
    if cp.returncode != 0:
        emit("error", message=f"tmux new-session failed: {cp.stdout.strip()}", fatal=True)
        history_add(run.state_dir, id=aid, ended=time.time(), outcome="crashed",
                    exception=f"tmux new-session failed: {cp.stdout.strip()}"[:500])
        return EXIT_CODES["failed"]
    tmux(run, "set-option", "-t", "=" + run.session, "remain-on-exit", "on")  # also when the server pre-existed
    deadline = time.monotonic() + 10
    info_pid: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        info_pid = read_json(run.state_file("pid"))
        if info_pid or read_exit_code(run.state_file("exit_code")) is not None:
            break
        time.sleep(0.02)
    if info_pid:
        emit("launched", pid=info_pid["pid"], pgid=info_pid["pgid"], session=run.session, log=run.log,
             events=run.events, socket=run.tmux_socket(), attempt=aid, argv=argv)
    follower = Follower(run, nvml, 0, events_offset, 0, float(opts.get("gpu_interval", 1.0)), launch_ts - 1.0)
    return follow_loop(follower, run, ready_deadline=time.monotonic() + run.ready_timeout,
                       keep_following=bool(opts.get("follow")))


def follow_loop(follower: Follower, run: Run, ready_deadline: float | None, keep_following: bool) -> int:
    """Ready / death / timeout verdicts for launch; `follow` runs it with no deadline until the run ends."""
    ready = ready_deadline is None
    while True:
        snap = follower.poll()
        if not ready and (follower.saw_step or follower.pattern_hit is not None):
            ready = True
            how = "first step event" if follower.saw_step else f"log line matched {run.ready_pattern!r}: {follower.pattern_hit}"
            emit("verdict", ok=True, reason="ready", detail=how, phase=follower.phase_text(), **follower.offsets())
            if not keep_following:
                return EXIT_CODES["ok"]
        if snap["state"] in ("exited", "absent") and (snap["state"] == "exited" or ready_deadline is not None):
            follower.poll()  # drain what the run wrote just before it died
            code = snap["exit_code"]
            if ready and ready_deadline is None and snap["state"] == "absent":
                emit("verdict", ok=False, reason="absent", detail="no process recorded for this run",
                     phase=follower.phase_text(), **follower.offsets())
                return EXIT_CODES["failed"]
            good = code == 0
            emit("verdict", ok=good and ready, reason="exited" if ready else "died_before_ready", exit_code=code,
                 phase=follower.phase_text(), traceback=None if good else follower.traceback(), tail=list(follower.lines)[-30:],
                 detail="run exited with status {}{}".format(code, "" if ready else " before it was ready, "
                                                           + follower.where_text()), **follower.offsets())
            return EXIT_CODES["ok"] if good and ready else EXIT_CODES["failed"]
        if not ready and ready_deadline is not None and time.monotonic() > ready_deadline:
            age = None if follower.last_event_ts is None else round(time.time() - follower.last_event_ts, 1)
            emit("verdict", ok=False, reason="timeout", phase=follower.phase_text(), last_event_age_s=age,
                 detail="not ready after {:g} s: stuck {}{}; the run was left running".format(run.ready_timeout, follower.where_text(), "" if age is None else f", last event {age:.1f} s ago"),
                 tail=list(follower.lines)[-10:], **follower.offsets())
            return EXIT_CODES["timeout"]
        time.sleep(POLL_S)


def never_launched(run: Run) -> bool:
    """No launch record, no pid file, no log: nothing was ever started here under this run's name."""
    return not any(p and os.path.exists(p) for p in (run.state_file("launch.json"), run.state_file("pid"), run.log))


def verb_follow(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    if opts.get("no_events"):
        run.events = None  # `logs` wants the human log only
        if never_launched(run):  # say so: printing nothing (or following a file that never comes) tells nothing
            emit("verdict", ok=True, reason="never_launched", detail=f"never launched: no launch record in {run.state_dir}, no "
                 f"log at {run.log}", log_offset=0, events_offset=0)
            return EXIT_CODES["ok"]
    if opts.get("all_logs"):
        # `logs --all`: every earlier attempt's log (rotated at launch), oldest first, then the current one.
        # `all_tail` N (`logs --all -n N`): the last N lines of each, the current one's through the follower's tail.
        olds = old_logs(run)
        keep = opts.get("all_tail")
        for i, path in enumerate(olds):
            emit("attempt", file=path, attempt=i + 1, attempts=len(olds) + 1, current=False)
            with open(path, "rb") as fh:
                lines = bounded_lines(fh, MAX_LOG_LINE)
                for raw in (collections.deque(lines, maxlen=int(keep)) if isinstance(keep, int) else lines):
                    emit("old_log", file=path, line=raw.decode("utf-8", errors="replace"))
        emit("attempt", file=run.log, attempt=len(olds) + 1, attempts=len(olds) + 1, current=True)
    follower = Follower(run, nvml, int(opts.get("log_offset", 0)), int(opts.get("events_offset", 0)),
                   int(opts.get("tail", 10)), float(opts.get("gpu_interval", 1.0)))
    if follower.events is not None:
        # the process (and its attempt's `since`) before the events: the client's RunState then folds an earlier
        # attempt's events for tau and charts only, as `status` does (attempt_since)
        follower.proc.poll(force=True)
    # what is there now (from the offsets, or the last `tail` lines), then `backlog_end`
    follower.catch_up(thin=bool(opts.get("thin_history")))
    if opts.get("once"):
        emit("verdict", ok=True, reason="snapshot", **follower.offsets())
        return EXIT_CODES["ok"]
    if not opts.get("until_exit", True):
        while True:
            follower.poll()
            time.sleep(POLL_S)
    return follow_loop(follower, run, ready_deadline=None, keep_following=True)


def verb_status(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    proc_watch = ProcWatch(run)
    launch = read_json(run.state_file("launch.json")) or {}
    killed = read_json(run.state_file("killed"))
    since = attempt_since(run)
    # The events since the last run_start that a reducer needs: phase, last steps, errors, checkpoint, end.
    picked: dict[int, tuple[int, dict[str, Any]]] = {}
    steps: collections.deque[tuple[int, int, dict[str, Any]]] = collections.deque(maxlen=20)
    errors: collections.deque[tuple[int, int, dict[str, Any]]] = collections.deque(maxlen=50)
    last: dict[str, tuple[int, int, dict[str, Any]]] = {}
    size = 0
    tau = TauTrack()  # the run's evaluations across its attempts: the latest and the best tau so far
    eta = EtaClock()  # every step of the attempt, not only the last ones sent: the ETA watch shows too
    bad: list[Any] = [0, None]  # lines since the last run_start that are no event: how many, the last one's why
    mem = MemoryWatch()  # memory_growth / alloc_retries need the attempt's heartbeats, not the last one
    if run.events and os.path.exists(run.events):
        with open(run.events, "rb") as fh:
            off = fold_resume(run, fh, since, steps, errors, last, bad, tau, eta, mem)
            scanned_from = off
            for head, length, complete in long_lines(fh, MAX_EVENT_LINE):
                start, off = off, off + length + complete
                if not complete:
                    break
                ev = event_object(head, length)
                if isinstance(ev, str):
                    bad[:] = [bad[0] + 1, f"events file offset {start}: {ev}"]
                    continue
                tau.note(ev, (start, off, ev))
                kind = ev.get("kind")
                if kind == "run_start":
                    bad[:] = [0, None]  # the lines skipped since the last run_start, of any attempt (as RunState)
                if isinstance(ev.get("ts"), (int, float)) and ev["ts"] < since:
                    continue
                eta.note(ev)
                if kind == "run_start":
                    steps.clear()
                    errors.clear()
                    last.clear()
                    mem.__init__()
                mem.note(ev)
                if kind == "step":
                    steps.append((start, off, ev))
                elif kind == "error":
                    errors.append((start, off, ev))
                elif isinstance(kind, str):
                    last[kind] = (start, off, ev)
            size = off
            if size - scanned_from >= FOLD_AFTER_BYTES:
                fold_save(run, fh, since, size, steps, errors, last, bad, tau, eta, mem)
    taus = [e["ref"] for e in (tau.best(), tau.latest()) if e is not None]
    for item in list(last.values()) + list(steps) + list(errors) + taus:
        picked[item[0]] = (item[1], item[2])
    for start in sorted(picked):
        end, ev = picked[start]
        emit("event", off=start, end=end, event=ev)
    # proc after the events: a reducer resets the exit code when it sees run_start
    snap = proc_watch.poll(force=True)
    if nvml.ok:
        emit("gpu", gpus=tag_gpu_owners(run, nvml.sample()))
    sess = session_info(run)
    try:
        log_size = os.path.getsize(run.log)
    except OSError:
        log_size = None
    emit("status", name=run.name, proc=snap, killed_by_opsctl=killed is not None, killed=killed,
         launched_ts=launch.get("ts"), session=run.session, session_exists=sess["exists"],
         pane_dead=sess["pane_dead"], log=run.log, log_size=log_size, events=run.events, events_size=size,
         bad_events=bad[0], bad_event=bad[1], eta_clock=eta.state(), memory_growth=mem.growth(),
         alloc_retries=mem.alloc_retries())
    return EXIT_CODES["ok"]


def verb_kill(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    info = read_json(run.state_file("pid"))
    proc_watch = ProcWatch(run)
    snap = proc_watch.poll(force=True)
    if not info or not isinstance(info.get("pid"), int):
        emit("verdict", ok=True, reason="not_running", detail=f"no process recorded in {run.state_dir}")
        return EXIT_CODES["ok"]
    pid, pgid = int(info["pid"]), int(info.get("pgid") or info["pid"])
    if wrapper_of(info) is not None and read_exit_code(run.state_file("exit_code")) is None:
        # First the marker: the wrapper never starts another attempt once it exists (restart policy), and it
        # records the attempt this kill ends as `killed`.
        with open(run.state_file("killed"), "w") as fh:
            json.dump({"ts": time.time(), "pid": pid, "pgid": pgid, "by": "opsctl kill"}, fh)
    if opts.get("mark_only"):
        # A group kill marks every node before it signals any: a node whose ranks die of their peer's kill (a failed
        # collective) before its own kill arrives must still read `killed`, not `crashed`.
        marked = os.path.exists(run.state_file("killed"))
        emit("verdict", ok=True, reason="marked" if marked else "not_running",
             detail="kill requested" if marked else f"no live attempt to mark in {run.state_dir}")
        return EXIT_CODES["ok"]
    if snap["state"] == "restarting":
        r = snap.get("restart") or {}
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if read_exit_code(run.state_file("exit_code")) is not None:
                proc_watch.poll()
                emit("verdict", ok=True, reason="killed", alive=[], exit_code=r.get("exit_code"), gpu_checked=False,
                     detail="restart cancelled: attempt {} had exited {}; restart {} of {} will not happen".format(
                         r.get("attempt"), r.get("exit_code"), r.get("n"), r.get("max")))
                return EXIT_CODES["ok"]
            now = read_json(run.state_file("pid")) or {}
            if isinstance(now.get("pid"), int) and now["pid"] != pid:  # it started just before the marker: kill it
                info, pid, pgid = now, int(now["pid"]), int(now.get("pgid") or now["pid"])
                break
            time.sleep(POLL_S)
    quiet = notifiers(run)

    def procs(seen: dict[int, int]) -> dict[int, int]:
        # the wrapper re-checked: it exits after the last one
        return run_procs(pid, pgid, seen, wrapper_of(info), quiet)  # type: ignore[arg-type]

    # Without the subreaper (not Linux, or an older wrapper) a double-forked daemon is out of our sight: say so.
    untracked = "" if info.get("subreaper") else "; detached descendants (double-forked daemons) could not be tracked: {}".format(
        info.get("subreaper_error") or "the run's wrapper did not record itself as a subreaper")
    known = procs({})
    if not known:
        emit("verdict", ok=True, reason="not_running", detail=f"pid {pid} and process group {pgid} are gone (state {snap['state']}){untracked}",
             exit_code=snap["exit_code"])
        return EXIT_CODES["ok"]
    with open(run.state_file("killed"), "w") as fh:
        json.dump({"ts": time.time(), "pid": pid, "pgid": pgid, "by": "opsctl kill"}, fh)
    events_offset = os.path.getsize(run.events) if run.events and os.path.exists(run.events) else 0
    grace = [run.kill_grace[0], run.kill_grace[1], 5.0]
    if opts.get("grace") is not None:
        g = opts["grace"]
        grace = [float(g[0]), float(g[1]), 5.0]
    seen_pids = dict(known)
    gpus_before = nvml_holders(nvml, set(seen_pids), opts.get("gpus"))
    for sig, wait in zip((signal.SIGINT, signal.SIGTERM, signal.SIGKILL), grace):  # noqa: B905 - the remote python may predate 3.10
        targets = procs(seen_pids)
        if not targets:
            break
        seen_pids.update(targets)
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
        for p in targets:
            st = proc_stat(p)
            if st is None or st[2] == pgid:
                continue  # killpg reached it: a second SIGINT would make the training core exit at once
            try:
                os.kill(p, sig)  # descendants that left the group (setsid/setpgid) too
            except OSError:
                pass
        deadline = time.monotonic() + wait
        left = targets
        while time.monotonic() < deadline:
            left = procs(seen_pids)
            if not left:
                break
            time.sleep(POLL_S)
        emit("killed", signal=signal.Signals(sig).name, pgid=pgid, alive=sorted(left))
        if not left:
            break
    left = procs(seen_pids)
    # The wrapper records the exit status right after the run ends; the training core writes run_end first.
    deadline = time.monotonic() + 3.0
    while read_exit_code(run.state_file("exit_code")) is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    run_end = None
    if run.events and os.path.exists(run.events):
        tail = Tail(run.events, events_offset)
        for _off, _end, raw in tail.read([]):
            ev = event_object(raw, _end - _off - 1)
            if isinstance(ev, dict) and ev.get("kind") == "run_end":
                run_end = ev
            if isinstance(ev, dict) and ev.get("kind") in ("run_end", "checkpoint"):
                emit("event", off=_off, end=_end, event=ev)
    proc_watch.poll()
    gpu_ok, gpu_detail = gpu_released(nvml, set(seen_pids), gpus_before, opts.get("gpus"),
                                      float(opts.get("gpu_release_wait", 10.0)))
    skipped = gpu_ok is None
    # Not checked is reported as such (ok false, skipped true) but does not fail the kill: on a CPU host there
    # is no GPU memory to hold, and the processes themselves were confirmed gone through /proc.
    emit("check", name="gpu_released", ok=bool(gpu_ok), skipped=skipped, detail=gpu_detail)
    ok = not left and (gpu_ok or skipped)
    emit("verdict", ok=ok, reason="killed" if ok else ("survivors" if left else "gpu_held"), alive=sorted(left),
         exit_code=read_exit_code(run.state_file("exit_code")), run_end=run_end, gpu_checked=not skipped,
         detail=(f"all {len(seen_pids)} processes gone" if not left else f"still alive: {sorted(left)}")
         + ("; GPU memory release not checked (no NVML)" if skipped else "") + untracked)
    return EXIT_CODES["ok"] if ok else EXIT_CODES["failed"]


def verb_clean(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    dry = bool(opts.get("dry_run"))
    snap = ProcWatch(run).snapshot()
    rc = EXIT_CODES["ok"]
    live = snap["state"] in ("running", "restarting")  # restarting: the wrapper starts the next attempt soon

    def refuse(detail: str, config: bool = False) -> int:
        """A refusal; in a dry run, what a real clean would refuse. `config`: the run's configuration is refused
        (its inductor_cache_dir is the home directory, a system directory, outside its roots): a dry run fails
        with the real clean's exit code 5, for no later moment makes that clean work. Otherwise it is the run's
        state now (running, processes left, another process using the cache): a dry run warns and exits 0."""
        soft = dry and not config
        emit("check", name="inductor_cache", ok=soft, warn=soft, detail=("a real clean would refuse: " if dry else "")
             + detail)
        return EXIT_CODES["ok"] if soft else EXIT_CODES["refused"]

    left = leftovers(run) if not live else []
    if live:
        rc = refuse("run is {} (pid {}): its compile cache is in use; not cleaned".format(
            "running" if snap["state"] == "running" else "restarting (the next attempt uses it)", snap["pid"]))
    elif left:
        rc = refuse(f"the run exited but left processes alive (pids {left}); they may use the cache and the pid "
                    f"file is how opsctl kill finds them: nothing cleaned, run opsctl kill first")
    else:
        try:
            real = run.validated_cache()
        except AgentError as exc:
            rc = refuse(str(exc), config=True)
        else:
            users = cache_users(real)
            if users:
                rc = refuse(f"{real} is in use by {describe_users(users)}: not cleaned")
            else:
                n, size = empty_dir(real, dry)
                emit("check", name="inductor_cache", ok=True,
                     detail=("would empty" if dry else "emptied") + f" {real}: {n} entries, {size / 2**20:.1f} MiB")
    if opts.get("logs"):
        # Earlier attempts' logs go only when asked (clean --logs); the current attempt's log always stays.
        for old in old_logs(run):
            emit("removed", path=old, bytes=_tree_size(old), dry_run=dry)
            if not dry:
                os.unlink(old)
    sess = session_info(run)
    if sess["exists"] and sess["pane_dead"]:
        emit("removed", path=f"tmux:{run.session}", bytes=0, dry_run=dry)
        if not dry:
            tmux(run, "kill-session", "-t", "=" + run.session)
    sock = run.tmux_socket()
    if not sess["exists"] and os.path.exists(sock) and not _socket_live(sock):
        emit("removed", path=sock, bytes=0, dry_run=dry)
        if not dry:
            os.unlink(sock)
    if not live and not left and os.path.exists(run.state_file("pid")):
        emit("removed", path=run.state_file("pid"), bytes=os.path.getsize(run.state_file("pid")), dry_run=dry)
        if not dry:
            os.unlink(run.state_file("pid"))
    return rc


def _socket_live(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError as exc:
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        s.close()


def verb_hello(run: Run | None, nvml: Nvml, opts: dict[str, Any]) -> int:
    return EXIT_CODES["ok"]


def verb_history(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    """Every attempt of the run, oldest first; an attempt with no end recorded is `running` or `restarting` when
    it is the live one, else `lost` (its wrapper died before it could write the end: SIGKILL, a reboot)."""
    attempts = read_history(run.state_dir, run.log, run.keep_logs)
    attempt_taus(run.events, attempts)
    snap = ProcWatch(run).snapshot()
    for a in attempts:
        if a.get("outcome") is None:
            live = a.get("id") == snap.get("attempt") and snap["state"] in ("running", "restarting")
            a["outcome"] = ("running" if snap["state"] == "running" else "restarting") if live else "lost"
        if isinstance(a.get("checkpoint"), str):  # keep_last deletes older checkpoints: never link one that is gone
            a["checkpoint_exists"] = os.path.exists(run.path(a["checkpoint"]))
    emit("history", attempts=attempts, state=snap["state"], current=snap.get("attempt"))
    return EXIT_CODES["ok"]


# The group's supervisor lease on its head node: one small JSON file rewritten in place (its heartbeat every few
# seconds would grow the append-only group.jsonl without end). Live while its heartbeat is younger than
# LEASE_STALE_INTERVALS of the refresh interval its holder recorded.
GROUP_LEASE_FILE = "group_lease.json"
LEASE_STALE_INTERVALS = 3.0


def _lease_view(cur: dict[str, Any] | None, now: float) -> dict[str, Any] | None:
    """The lease as clients see it: its holder, and whether it is live by the head's clock."""
    if cur is None:
        return None
    age = max(0.0, now - float(cur.get("heartbeat") or 0.0))
    live = not cur.get("released") and age <= LEASE_STALE_INTERVALS * float(cur.get("refresh_s") or 0.0)
    return {**cur, "heartbeat_age_s": age, "live": live}


def _group_lease(run: Run, op: dict[str, Any] | None, if_lease: str | None,
                 rec: dict[str, Any] | None) -> tuple[dict[str, Any] | None, bool | None, int | None]:
    """One lease operation and/or one record, under the history lock, so that two opsctls can never both hold the
    lease or both write a restart: (the lease now, granted, the record's id). `op`: acquire (granted when the lease
    is free, released, stale, already this token's, or held by `expect`: the token the caller saw and chose to
    replace), refresh and release (granted only to the token that holds it). `if_lease`: the record is written only
    while this token holds the lease (a supervisor that was taken over must not record a restart)."""
    os.makedirs(run.state_dir, exist_ok=True)
    path = run.state_file(GROUP_LEASE_FILE)
    lock = os.open(run.state_file("history.lock"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        cur = read_json(path)
        view = _lease_view(cur, now)
        granted: bool | None = None
        new: dict[str, Any] | None = None
        if op is not None:
            token = op.get("token")
            mine = cur is not None and cur.get("token") == token and not cur.get("released")
            kind = op.get("op")
            if kind == "acquire":
                granted = mine or view is None or not view["live"] or (cur or {}).get("token") == op.get("expect")
                if granted:
                    new = {"token": token, "host": op.get("host"), "pid": op.get("pid"),
                           "refresh_s": float(op.get("refresh_s") or 0.0), "since": now, "heartbeat": now}
            elif kind == "refresh":
                granted = mine
                new = {**cur, "heartbeat": now} if mine and cur is not None else None
            elif kind == "release":
                granted = mine
                new = {**cur, "released": now} if mine and cur is not None else None
            if new is not None:
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as fh:
                    json.dump(new, fh)
                os.replace(tmp, path)
                view = _lease_view(new, now)
        added = None
        holds = cur is not None and cur.get("token") == if_lease and not cur.get("released")
        if isinstance(rec, dict) and (if_lease is None or holds):
            added = history_add(run.state_dir, _file=GROUP_FILE, _locked=True, **rec)
        elif isinstance(rec, dict):
            granted = False
        return view, granted, added
    finally:
        os.close(lock)


def verb_group(run: Run, nvml: Nvml, opts: dict[str, Any]) -> int:
    """A group run's own records on its head node (its attempts, restart state, kill), appended like the history:
    the opsctl that follows the group writes them (no process on one host can stop and restart every node). With
    them, its supervisor lease (which opsctl carries out the restart policy now) and an operation on it."""
    rec, op, if_lease = opts.get("record"), opts.get("lease"), opts.get("if_lease")
    if isinstance(op, dict) or if_lease is not None:
        lease, granted, added = _group_lease(run, op if isinstance(op, dict) else None, if_lease,
                                             rec if isinstance(rec, dict) else None)
    else:
        added, granted = None, None
        if isinstance(rec, dict):
            os.makedirs(run.state_dir, exist_ok=True)
            added = history_add(run.state_dir, _file=GROUP_FILE, **rec)  # without an `id`: a new attempt, numbered
        lease = _lease_view(read_json(run.state_file(GROUP_LEASE_FILE)), time.time())
    emit("group", records=history_lines(run.state_file(GROUP_FILE)), added=added, ts=time.time(), lease=lease,
         lease_granted=granted)
    return EXIT_CODES["ok"]


VERBS = {"launch": verb_launch, "follow": verb_follow, "status": verb_status, "kill": verb_kill,
         "clean": verb_clean, "hello": verb_hello, "history": verb_history,
         "group": verb_group}


def main(argv: list[str]) -> None:
    watch_stdin()
    nvml = Nvml()
    # events_checked: every `event` this agent sends passed the contract's check (event_problem); the client need not
    # check it again (a week-long backlog's events cost the client a third of its fold in that check)
    emit("hello", agent_version=AGENT_VERSION, host=socket.gethostname(), pid=os.getpid(),
         python=sys.version.split()[0], nvml=nvml.status, verb=argv[0] if argv else None, events_checked=True)
    try:
        if len(argv) != 2 or argv[0] not in VERBS:
            raise AgentError("usage: agent VERB JSON_ARGS with VERB one of {}".format(", ".join(sorted(VERBS))))
        try:
            args = json.loads(argv[1])
        except ValueError as exc:
            raise AgentError(f"JSON_ARGS is not JSON: {exc}") from exc
        if not isinstance(args, dict):
            raise AgentError("JSON_ARGS must be an object")
        opts = args.pop("options", {}) or {}
        run = None if argv[0] == "hello" else Run(args)
        rc = VERBS[argv[0]](run, nvml, opts)  # type: ignore[arg-type]
    except AgentError as exc:
        emit("error", message=str(exc), fatal=True)
        rc = EXIT_CODES["usage"]
    except Exception as exc:  # noqa: BLE001 - report, never die silently
        import traceback

        emit("error", message=f"agent failed: {exc.__class__.__name__}: {exc}", fatal=True,
             traceback=traceback.format_exc())
        rc = EXIT_CODES["failed"]
    bye(rc)


if __name__ == "__main__":
    main(sys.argv[1:])
