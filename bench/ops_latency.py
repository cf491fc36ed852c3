"""opsctl latency benchmark over loopback SSH + the `pct` stand-in: line latency, launch overhead, agent CPU, and
the client side of `opsctl watch`: an idle dashboard's CPU and `watch --once --json` against `status --json`.

Run: `python bench/ops_latency.py [--lines 2000] [--cpu-seconds 30]`; it prints a report and raw numbers (JSON).
`--only watch` measures the watch figures alone (issue 25 item 11); `--only status` times `status HOST --json` against
`watch HOST --once --json` over all four runs of the host; `--only fleet` times `status` with no HOST over five hosts,
two of them silent (accept, never answer), asked in series (as before) and at once (as now). `--only long` times
`status HOST RUN --json` of a week-long run (--long-steps step events, an evaluation every 1000) on the local host:
reading the whole events file (no saved fold) against going on from the fold the previous status saved; and
`watch HOST --once` of the same run with every step event of its backlog (OPSCTL_WATCH_FULL_HISTORY=1), the thinned
backlog read whole (the first watch) and from the agent's saved backlog fold (every later watch); and
`export HOST RUN --tensorboard DIR` of it. `--only long-ssh` (issue 39 item 3): a week-long run of --long-steps steps
with a heartbeat every --heartbeat-every steps (2: a heartbeat each 5 s at 2.5 s a step, as dflash writes them) on a
pct container behind the loopback sshd: `status HOST RUN --json` (full read, then from its fold), `watch HOST --once`
(the first of the file, then from the agent's backlog fold) and the dashboard's first full frame (`opsctl watch
HOST:RUN` in a pseudo-terminal, from its start until it shows the run's last step), first and from the fold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pty
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from harness.sshd import make_pct_host, start_sshd  # noqa: E402

from opsctl import commands  # noqa: E402
from opsctl.config import load_inventory, resolve  # noqa: E402
from opsctl.transport import transport_for  # noqa: E402

VMID = 230
CHATTY = REPO / "tests" / "runs" / "chatty.py"
OK_RUN = REPO / "tests" / "runs" / "ok_run.py"


def pct(ms: list[float], q: float) -> float:
    s = sorted(ms)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def write_hosts(sshd: Any, base: Path, lines: int, interval: float) -> Path:
    runs = {
        "chat": {"workdir": str(base / "chat"), "log": "run.log", "ready_pattern": "^line 000000 ",
                 "command": ["{python}", str(CHATTY), "--lines", str(lines), "--interval", str(interval),
                             "--start-delay", "1.0", "--linger", "2"],
                 "inductor_cache_dir": str(base / "chat" / "cache"), "clean_roots": [str(base)],
                 "tmux_session": "bench-chat"},
        "quick": {"workdir": str(base / "quick"), "log": "run.log", "ready_pattern": "^ready ",
                  "command": ["{python}", "-c", "import time; print('ready', repr(time.time()), flush=True); "
                              "time.sleep(600)"],
                  "inductor_cache_dir": str(base / "quick" / "cache"), "clean_roots": [str(base)],
                  "tmux_session": "bench-quick", "kill_grace": [1, 1]},
        "idle": {"workdir": str(base / "idle"), "log": "run.log", "ready_pattern": "^line 000000 ",
                 "command": ["{python}", str(CHATTY), "--lines", "100000", "--interval", "1.0"],
                 "inductor_cache_dir": str(base / "idle" / "cache"), "clean_roots": [str(base)],
                 "tmux_session": "bench-idle", "kill_grace": [1, 1]},
        "done": {"workdir": str(base / "done"), "log": "run.log", "events": "events.jsonl",
                 "command": ["{python}", str(OK_RUN), "--events", str(base / "done" / "events.jsonl"), "--steps", "200",
                             "--step-time", "0.005", "--load-time", "0.1"],
                 "inductor_cache_dir": str(base / "done" / "cache"), "clean_roots": [str(base)],
                 "tmux_session": "bench-done", "kill_grace": [1, 1]},
    }
    for r in runs.values():
        Path(r["workdir"]).mkdir(parents=True, exist_ok=True)
    return sshd.write_hosts_yaml(base / "hosts.yaml", runs=runs, pct=VMID)


def quiet_ctx(hosts: Path) -> commands.Ctx:
    from rich.console import Console

    null = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the benchmark
    return commands.Ctx(hosts_file=str(hosts), out=Console(file=null), err=Console(file=null), raw=null)


def line_latency(hosts: Path) -> dict[str, Any]:
    """Launch the chatty run, then follow it through SSH + pct; latency = arrival - the time written in the line."""
    ctx = quiet_ctx(hosts)
    host, run = resolve(load_inventory(hosts), "box", "chat")
    assert run is not None
    rc = commands.cmd_launch(ctx, "box", "chat")
    assert rc == 0, f"launch failed rc={rc}"
    t = transport_for(host)
    lat: list[float] = []
    args = commands.run_args(run, log_offset=0, events_offset=0, gpu_interval=1.0)
    connected = None
    for m in commands.stream_agent(t, host, "follow", args):
        if m.get("t") == "hello":
            connected = time.time()
        if m.get("t") == "log" and m["line"].startswith("line "):
            now = time.time()
            sent = float(m["line"].split("t=")[1])
            if connected is not None and sent > connected:  # lines written before we connected are backlog
                lat.append((now - sent) * 1000)
    t.close()
    return {"lines": len(lat), "p50_ms": pct(lat, 50), "p90_ms": pct(lat, 90), "p99_ms": pct(lat, 99),
            "max_ms": max(lat), "mean_ms": statistics.fmean(lat)}


def launch_overhead(hosts: Path, repeats: int) -> dict[str, Any]:
    """Wall time of `opsctl launch` (in-process, from the call to READY) minus the run's own start-up."""
    host, run = resolve(load_inventory(hosts), "box", "quick")
    assert run is not None
    totals, startups, overheads = [], [], []
    for _ in range(repeats):
        ctx = quiet_ctx(hosts)
        t0 = time.time()
        t = transport_for(host)
        ready_at = printed = None
        for m in commands.stream_agent(t, host, "launch", commands.run_args(run)):
            if m.get("t") == "log" and m["line"].startswith("ready "):
                printed = float(m["line"].split()[1])
            if m.get("t") == "verdict":
                ready_at = time.time()
        t.close()
        info = json.loads((Path(run.state_dir or "") / "pid").read_text())
        started = float(info["started"])
        assert ready_at is not None and printed is not None
        startup = printed - started  # the run's python starting up until its ready line
        totals.append(ready_at - t0)
        startups.append(startup)
        overheads.append(ready_at - t0 - startup)
        commands.cmd_kill(ctx, "box", "quick")
    return {"repeats": repeats, "total_s": [round(x, 3) for x in totals], "run_startup_s": [round(x, 3) for x in startups],
            "overhead_s": [round(x, 3) for x in overheads], "overhead_median_s": round(statistics.median(overheads), 3),
            "overhead_max_s": round(max(overheads), 3)}


def agent_cpu(hosts: Path, pct_host: Any, seconds: float) -> dict[str, Any]:
    """CPU time of the agent process (read inside the container) while it follows a run at 1 Hz NVML sampling."""
    ctx = quiet_ctx(hosts)
    host, run = resolve(load_inventory(hosts), "box", "idle")
    assert run is not None
    assert commands.cmd_launch(ctx, "box", "idle") == 0
    t = transport_for(host)
    args = commands.run_args(run, log_offset=-1, tail=0, events_offset=0, gpu_interval=1.0, until_exit=False)
    gen = commands.stream_agent(t, host, "follow", args)
    hello = next(gen)
    pid = hello["pid"]
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        r = pct_host.pct("exec", str(VMID), "--", "cat", f"/proc/{pid}/stat")
        f = r.stdout.rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / tick  # utime + stime

    # let the agent's start-up (compiling its source) pass before measuring
    n = 0
    deadline = time.monotonic() + 2
    for m in gen:
        n += m.get("t") == "log"
        if time.monotonic() > deadline:
            break
    c0, w0 = cpu(), time.monotonic()
    deadline = w0 + seconds
    for m in gen:
        n += m.get("t") == "log"
        if time.monotonic() > deadline:
            break
    c1, w1 = cpu(), time.monotonic()
    gen.close()
    t.close()
    commands.cmd_kill(ctx, "box", "idle")
    return {"seconds": round(w1 - w0, 1), "cpu_s": round(c1 - c0, 3), "percent_of_one_core": round(100 * (c1 - c0) / (w1 - w0), 2),
            "log_lines_seen": n, "nvml": hello["nvml"]}


def timings(times: dict[str, list[float]]) -> dict[str, Any]:
    """Each `NAME_s` series as rounded seconds, with its median under `NAME_median_s`."""
    out: dict[str, Any] = {}
    for key, vals in times.items():
        out[key] = [round(v, 3) for v in vals]
        out[key.replace("_s", "_median_s")] = round(statistics.median(vals), 3)
    return out


def _opsctl(hosts: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The real CLI, as a user runs it (a fresh interpreter: its imports are part of what is measured)."""
    return subprocess.run([sys.executable, "-m", "opsctl", "--hosts", str(hosts), *argv], cwd=str(REPO),
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, TERM="dumb"))


def finished_run(hosts: Path) -> None:
    """Launch the `done` run and wait until `status` says it finished (the dashboard then has nothing to follow)."""
    r = _opsctl(hosts, "launch", "box", "done")
    assert r.returncode == 0, r.stdout + r.stderr
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        (row,) = json.loads(_opsctl(hosts, "status", "box", "done", "--json").stdout)
        if row["state"] == "finished":
            return
        time.sleep(0.5)
    raise AssertionError(f"the done run did not finish: {row}")


def once_vs_status(hosts: Path, repeats: int) -> dict[str, Any]:
    """Wall time of `opsctl watch box:done --once --json` and of `opsctl status box done --json` (fresh processes,
    alternated so the machine's load falls on both alike), and of `python -c 'import opsctl.cli'` alone."""
    times: dict[str, list[float]] = {"once_json_s": [], "status_json_s": [], "import_cli_s": []}
    for _ in range(repeats):
        for key, argv in (("once_json_s", ("watch", "box:done", "--once", "--json")),
                          ("status_json_s", ("status", "box", "done", "--json"))):
            t0 = time.perf_counter()
            r = _opsctl(hosts, *argv)
            times[key].append(time.perf_counter() - t0)
            assert r.returncode == 0 and json.loads(r.stdout)[0]["state"] == "finished", r.stdout + r.stderr
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import opsctl.cli"], check=True, cwd=str(REPO))
        times["import_cli_s"].append(time.perf_counter() - t0)
    out: dict[str, Any] = {"repeats": repeats}
    out.update(timings(times))
    out["once_over_status"] = round(out["once_json_median_s"] / out["status_json_median_s"], 2)
    return out


def host_once_vs_status(hosts: Path, repeats: int) -> dict[str, Any]:
    """All runs of one host (4: one finished, three never launched): `opsctl status box --json` against `opsctl watch
    box --once --json`, fresh processes, alternated; both must print the same states in the same order."""
    times: dict[str, list[float]] = {"status_json_s": [], "once_json_s": []}
    for _ in range(repeats):
        states = {}
        for key, argv in (("status_json_s", ("status", "box", "--json")),
                          ("once_json_s", ("watch", "box", "--once", "--json"))):
            t0 = time.perf_counter()
            r = _opsctl(hosts, *argv)
            times[key].append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stdout + r.stderr
            states[key] = [(row["run"], row["state"]) for row in json.loads(r.stdout)]
        assert states["status_json_s"] == states["once_json_s"] and len(states["once_json_s"]) == 4, states
    out: dict[str, Any] = {"repeats": repeats, "runs": 4}
    out.update(timings(times))
    print(f"all 4 runs of a host: status --json median {out['status_json_median_s']:.2f} s; watch --once --json "
          f"median {out['once_json_median_s']:.2f} s")
    return out


def fleet_status(sshd: Any, base: Path, repeats: int, silent_timeout: float = 3.0) -> dict[str, Any]:
    """`status` of every host (in this process, so no interpreter start-up): five hosts, each with the four runs of
    write_hosts, hosts 2 and 4 silent (a port that accepts and never sends a banner, connect_timeout 3 s), asked one
    after another (the loop `status` had) and at once (HOSTS_PARALLEL). Same rows both ways."""
    import socket

    import yaml

    mutes = []
    for _ in range(2):
        m = socket.socket()
        m.bind(("127.0.0.1", 0))
        m.listen(64)  # the kernel accepts; nobody reads or writes
        mutes.append(m)
    doc = yaml.safe_load(write_hosts(sshd, base, 10, 0.01).read_text())
    box = doc["hosts"]["box"]
    hosts: dict[str, Any] = {}
    for i in range(5):
        entry = json.loads(json.dumps(box))
        if i in (1, 3):
            entry["ssh"]["port"] = mutes[i // 2].getsockname()[1]
            entry["ssh"]["connect_timeout"] = silent_timeout
            entry.pop("pct", None)
        hosts[f"h{i}"] = entry
    path = base / "fleet.yaml"
    path.write_text(yaml.safe_dump({"hosts": hosts}, sort_keys=False))
    times: dict[str, list[float]] = {"series_s": [], "parallel_s": []}
    try:
        for _ in range(repeats):
            ctx = quiet_ctx(path)
            inv = ctx.inventory()
            targets = [(h, list(inv.runs.get(n, {}).values())) for n, h in inv.hosts.items()]
            t0 = time.perf_counter()
            series = [r for h, runs in targets for r in commands._host_status(ctx, h, runs, quiet=True)[0]]
            times["series_s"].append(time.perf_counter() - t0)
            raw = __import__("io").StringIO()
            ctx = commands.Ctx(hosts_file=str(path), out=ctx.out, err=ctx.err, raw=raw)
            t0 = time.perf_counter()
            rc = commands.cmd_status(ctx, None, None, as_json=True)
            times["parallel_s"].append(time.perf_counter() - t0)
            rows = json.loads(raw.getvalue())
            assert rc == commands.EXIT_TRANSPORT, rc
            assert [(r["host"], r["run"], r["state"]) for r in rows] == [
                (r["host"], r["run"], r["state"]) for r in series], (rows, series)
    finally:
        for m in mutes:
            m.close()
    out: dict[str, Any] = {"repeats": repeats, "hosts": 5, "silent_hosts": 2, "runs_per_host": 4,
                           "silent_connect_timeout_s": silent_timeout}
    out.update(timings(times))
    print(f"status of 5 hosts (2 silent, connect_timeout {silent_timeout:g} s): in series median "
          f"{out['series_median_s']:.2f} s; at once median {out['parallel_median_s']:.2f} s")
    return out


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def watch_idle_cpu(hosts: Path, seconds: float, size: tuple[int, int] = (120, 40), settle_s: float = 5.0) -> dict[str, Any]:
    """CPU of a real `opsctl watch box:done` (the Textual app in a pseudo-terminal) on a finished run: nothing
    changes, so what it spends is the dashboard's idle cost. Measured after `settle_s` of start-up."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the dashboard in a terminal of `size`
        os.environ.update(TERM="xterm-256color", COLUMNS=str(size[0]), LINES=str(size[1]))
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "-m", "opsctl", "--hosts", str(hosts), "watch", "box:done"])
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    got = bytearray()

    def drain() -> None:  # a terminal that is not read blocks the app's writes
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            got.extend(chunk)

    threading.Thread(target=drain, daemon=True).start()
    try:
        time.sleep(settle_s)
        assert b"FINISHED" in got, "the dashboard did not show the finished run"
        c0, w0, n0 = _cpu_s(pid), time.monotonic(), len(got)
        time.sleep(seconds)
        c1, w1, n1 = _cpu_s(pid), time.monotonic(), len(got)
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        os.close(fd)
    return {"seconds": round(w1 - w0, 1), "cpu_s": round(c1 - c0, 3),
            "percent_of_one_core": round(100 * (c1 - c0) / (w1 - w0), 2), "terminal_bytes_written": n1 - n0,
            "size": f"{size[0]}x{size[1]}"}


def watch_report(hosts: Path, seconds: float, repeats: int) -> dict[str, Any]:
    finished_run(hosts)
    report = {"once_vs_status": once_vs_status(hosts, repeats),
              "watch_idle_120x40": watch_idle_cpu(hosts, seconds),
              "watch_idle_80x24": watch_idle_cpu(hosts, seconds, size=(80, 24))}
    ov = report["once_vs_status"]
    print(f"watch --once --json: median {ov['once_json_median_s']:.2f} s; status --json: median "
          f"{ov['status_json_median_s']:.2f} s ({ov['once_over_status']:.2f}x); import opsctl.cli alone: "
          f"{ov['import_cli_median_s']:.2f} s")
    for key in ("watch_idle_120x40", "watch_idle_80x24"):
        w = report[key]
        print(f"idle dashboard on a finished run ({w['size']}): {w['percent_of_one_core']:.2f} % of one core over "
              f"{w['seconds']} s ({w['cpu_s']} CPU s, {w['terminal_bytes_written']} bytes drawn)")
    return report


def write_long_events(path: Path, steps: int, heartbeat_every: int = 0, step_s: float = 3.0) -> None:
    """A week-long run's events: `steps` step events `step_s` apart, an evaluation every 1000 steps and (with
    `heartbeat_every`) a heartbeat every that many steps, ending now."""
    t = time.time() - step_s * steps
    with open(path, "w") as fh:
        fh.write(json.dumps({"v": 1, "ts": t, "kind": "run_start", "run_id": "x", "rank": 0, "seq": 0,
                             "total_steps": int(1.5 * steps), "resumed_from": None}) + "\n")
        for n in range(1, steps + 1):
            t += step_s
            fh.write(json.dumps({"v": 1, "ts": t, "kind": "step", "run_id": "x", "rank": 0, "seq": n, "step": n,
                                 "epoch": 0, "loss": 1.0 / n, "acc": [0.5, 0.4, 0.3, 0.2], "lr": 1e-3,
                                 "grad_norm": 1.0, "tokens": 49152, "tokens_per_s": 16384.0, "step_time_s": step_s,
                                 "queue_depth": 0, "queue_wait_s": 0.0, "recompiles": 0,
                                 "total_steps": int(1.5 * steps)}) + "\n")
            if heartbeat_every and n % heartbeat_every == 0:
                fh.write(json.dumps({"v": 1, "ts": t + step_s / 2, "kind": "heartbeat", "run_id": "x", "rank": 0,
                                     "seq": n, "phase": "training", "step": n, "rss_mb": 20_000.0,
                                     "gpu_mem_mb": 60_000.0, "gpu_reserved_mb": 70_000.0,
                                     "gpu_alloc_retries": 0}) + "\n")
            if n % 1000 == 0:
                fh.write(json.dumps({"v": 1, "ts": t, "kind": "eval", "run_id": "x", "rank": 0, "seq": n, "step": n,
                                     "tau": 2.0 + n / steps, "accept_by_position": [0.5] * 15, "ngram_tau": 1.4,
                                     "sequences": 32, "tokens": 4096, "seconds": 1.0}) + "\n")


def long_run_status(base: Path, steps: int, repeats: int) -> dict[str, Any]:
    """status of one run whose events file holds `steps` step events: full read vs the saved fold (opsctl.remote.follow
    FOLD_FILE), each `repeats` times, alternating; the local host (no SSH: the agent's reading is what differs)."""
    from opsctl.remote.follow import FOLD_FILE
    from opsctl.remote.thin import BACKLOG_FOLD_FILE
    from opsctl.watch import FULL_HISTORY_ENV

    base.mkdir(parents=True)
    write_long_events(base / "events.jsonl", steps)
    state = base / ".opsctl" / "r"
    state.mkdir(parents=True)  # as a launch leaves it: status saves its fold only where a launch made STATE_DIR
    hosts = base / "hosts.yaml"
    hosts.write_text(f"hosts:\n  box:\n    local: true\n    runs:\n      r:\n        command: ['true']\n"
                     f"        workdir: {base}\n        log: {base}/run.log\n        events: {base}/events.jsonl\n"
                     f"        state_dir: {state}\n")
    full: list[float] = []
    folded: list[float] = []
    for _ in range(repeats):
        (state / FOLD_FILE).unlink(missing_ok=True)
        for sink in (full, folded):  # the first reads it all and saves the fold; the second goes on from it
            t0 = time.perf_counter()
            r = _opsctl(hosts, "status", "box", "r", "--json")
            sink.append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stderr
    # watch --once (the dashboard's first frame folds the same backlog): every step event vs the thinned backlog,
    # read whole (the first watch of the file) and from the agent's backlog fold (BACKLOG_FOLD_FILE: every later one)
    watch_full: list[float] = []
    watch_thin: list[float] = []
    watch_fold: list[float] = []
    for _ in range(repeats):
        (state / BACKLOG_FOLD_FILE).unlink(missing_ok=True)
        for sink, full_history in ((watch_full, "1"), (watch_thin, "0"), (watch_fold, "0")):
            os.environ[FULL_HISTORY_ENV] = full_history
            t0 = time.perf_counter()
            r = _opsctl(hosts, "watch", "box", "--once")
            sink.append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stderr
    os.environ.pop(FULL_HISTORY_ENV, None)
    # export of the whole run to TensorBoard (every scalar of every step: no thinning), once
    t0 = time.perf_counter()
    r = _opsctl(hosts, "export", "box", "r", "--tensorboard", str(base / "tb"))
    export_s = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    return {"steps": steps, "events_mb": round((base / "events.jsonl").stat().st_size / 1e6, 1),
            "watch_once_full_s": [round(x, 3) for x in watch_full], "watch_once_thinned_s": [round(x, 3) for x in watch_thin],
            "watch_full_median_s": round(statistics.median(watch_full), 3),
            "watch_thinned_median_s": round(statistics.median(watch_thin), 3),
            "watch_once_from_fold_s": [round(x, 3) for x in watch_fold],
            "watch_from_fold_median_s": round(statistics.median(watch_fold), 3),
            "export_s": round(export_s, 2), "export_mb": round(sum(f.stat().st_size for f in (base / "tb").iterdir()) / 1e6, 1),
            "full_read_s": [round(x, 3) for x in full], "from_fold_s": [round(x, 3) for x in folded],
            "full_median_s": round(statistics.median(full), 3), "fold_median_s": round(statistics.median(folded), 3)}


def first_frame(hosts: Path, target: str, shows: bytes, size: tuple[int, int] = (160, 50),
                timeout: float = 120.0) -> float:
    """Seconds from starting `opsctl watch TARGET` in a pseudo-terminal until its screen shows `shows` (the run's last
    step, drawn once the backlog is folded: the first full frame), then the dashboard is stopped (SIGTERM)."""
    t0 = time.perf_counter()
    pid, fd = pty.fork()
    if pid == 0:
        os.environ.update(TERM="xterm-256color", COLUMNS=str(size[0]), LINES=str(size[1]))
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "-m", "opsctl", "--hosts", str(hosts), "watch", target])
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    got = bytearray()
    seen = threading.Event()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return
            if not chunk:
                return
            got.extend(chunk)
            if shows in got:
                seen.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert seen.wait(timeout), f"the dashboard never showed {shows!r}"
        return time.perf_counter() - t0
    finally:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        os.close(fd)


def long_run_ssh(sshd: Any, base: Path, steps: int, repeats: int, heartbeat_every: int) -> dict[str, Any]:
    """The week-long run on the pct container behind the loopback sshd (issue 39 item 3): status (full, from its
    fold), watch --once (first, from the backlog fold) and the dashboard's first full frame (first, from the fold)."""
    from opsctl.remote.follow import FOLD_FILE
    from opsctl.remote.thin import BACKLOG_FOLD_FILE

    base.mkdir(parents=True)
    events = base / "events.jsonl"
    write_long_events(events, steps, heartbeat_every)
    state = base / ".opsctl" / "r"
    state.mkdir(parents=True)  # as a launch leaves it: the agent saves its folds only where a launch made STATE_DIR
    short = base / "short"  # the floor: the same verbs on a 200-step run (the CLI's start-up, ssh, pct, the agent)
    short.mkdir()
    write_long_events(short / "events.jsonl", 200, heartbeat_every)

    def run(d: Path) -> dict[str, Any]:
        return {"workdir": str(d), "command": ["true"], "log": "run.log", "events": "events.jsonl",
                "state_dir": str(d / ".opsctl" / d.name), "inductor_cache_dir": str(d / "cache"),
                "clean_roots": [str(d)]}

    hosts = sshd.write_hosts_yaml(base / "hosts.yaml", pct=VMID, runs={"r": {**run(base), "state_dir": str(state)}})
    floor_hosts = sshd.write_hosts_yaml(base / "floor.yaml", pct=VMID, runs={"s": run(short)})
    times: dict[str, list[float]] = {k: [] for k in ("status_full_s", "status_fold_s", "watch_once_first_s",
                                                    "watch_once_fold_s", "frame_first_s", "frame_fold_s",
                                                    "floor_status_s", "floor_watch_once_s", "floor_frame_s",
                                                    "wrapper_refresh_s", "watch_once_wrapper_fold_s")}
    def shows(n: int) -> bytes:  # the summary's `step N/TOTAL`: `200` alone is in Textual's own escapes (?2004h)
        return f"{n:,}/{int(1.5 * n):,}".encode()

    for _ in range(repeats):
        for key, argv in (("floor_status_s", ("status", "box", "s", "--json")),
                          ("floor_watch_once_s", ("watch", "box", "--once"))):
            t0 = time.perf_counter()
            r = _opsctl(floor_hosts, *argv)
            times[key].append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stderr
        times["floor_frame_s"].append(first_frame(floor_hosts, "box:s", shows(200)))
        (state / FOLD_FILE).unlink(missing_ok=True)
        for key in ("status_full_s", "status_fold_s"):
            t0 = time.perf_counter()
            r = _opsctl(hosts, "status", "box", "r", "--json")
            times[key].append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stderr
        (state / BACKLOG_FOLD_FILE).unlink(missing_ok=True)
        for key in ("watch_once_first_s", "watch_once_fold_s"):
            t0 = time.perf_counter()
            r = _opsctl(hosts, "watch", "box", "--once")
            times[key].append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stderr
        (state / BACKLOG_FOLD_FILE).unlink(missing_ok=True)
        times["frame_first_s"].append(first_frame(hosts, "box:r", shows(steps)))
        times["frame_fold_s"].append(first_frame(hosts, "box:r", shows(steps)))
        try:  # the fold the run's wrapper keeps (opsctl/remote/thin.py refresh_backlog_fold), then the first watch
            from opsctl.remote.thin import refresh_backlog_fold
        except ImportError:  # an opsctl before it
            continue
        (state / BACKLOG_FOLD_FILE).unlink(missing_ok=True)
        t0 = time.perf_counter()
        refresh_backlog_fold(str(state), str(events))  # its first pass over the whole file, in the wrapper's thread
        times["wrapper_refresh_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = _opsctl(hosts, "watch", "box", "--once")
        times["watch_once_wrapper_fold_s"].append(time.perf_counter() - t0)
        assert r.returncode == 0, r.stderr
    out: dict[str, Any] = {"steps": steps, "heartbeat_every": heartbeat_every,
                           "events_mb": round(events.stat().st_size / 1e6, 1),
                           "lines": sum(1 for _ in events.open("rb"))}
    for key, xs in times.items():
        if not xs:
            continue
        out[key] = [round(x, 3) for x in xs]
        out[key[:-2] + "_median_s"] = round(statistics.median(xs), 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--interval", type=float, default=0.005, help="seconds between lines of the chatty run")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--cpu-seconds", type=float, default=30)
    ap.add_argument("--only", choices=("watch", "status", "fleet", "long", "long-ssh"),
                    help="watch: the dashboard's idle CPU and --once --json vs status; status: status --json vs "
                         "watch --once --json over all runs of a host; fleet: status of 5 hosts (2 silent) in series "
                         "and at once; long: status of a week-long run, full read vs the saved fold, and its watch --once, every "
                         "step event vs the thinned backlog, and its TensorBoard export; long-ssh: the same run (with heartbeats) on a "
                         "pct container over ssh: status, watch --once and the dashboard's first full frame")
    ap.add_argument("--long-steps", type=int, default=200_000, help="step events of --only long's run")
    ap.add_argument("--heartbeat-every", type=int, default=2, help="--only long-ssh: a heartbeat every N steps")
    ap.add_argument("--watch-seconds", type=float, default=20, help="how long the idle dashboard is measured")
    ap.add_argument("--repeats", type=int, default=5, help="runs of --once --json and status --json each")
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="opsctl-bench-"))
    if a.only == "long":  # local host only: no sshd needed
        report = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                  "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
                  "long_run_status": long_run_status(base / "long", a.long_steps, a.repeats)}
        print(json.dumps(report, indent=2))
        shutil.rmtree(base)  # this call's own mkdtemp (70 MB of events at the default size)
        return 0
    pct_host = make_pct_host(base / "pct")
    sshd = start_sshd(base / "sshd", pct_host=pct_host)
    try:
        pct_host.create(VMID)
        hosts = write_hosts(sshd, base / "runs", a.lines, a.interval)
        report: dict[str, Any] = {
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}",
            "path": "client -> paramiko SSH (127.0.0.1) -> pct stand-in (nsenter PID+mount ns) -> agent",
        }
        if a.only == "status":
            finished_run(hosts)
            report["host_status"] = host_once_vs_status(hosts, a.repeats)
            print(json.dumps(report, indent=2))
            return 0
        if a.only == "long-ssh":
            report["long_run_ssh"] = long_run_ssh(sshd, base / "long", a.long_steps, a.repeats, a.heartbeat_every)
            print(json.dumps(report, indent=2))
            shutil.rmtree(base / "long")  # this call's own mkdtemp (~100 MB of events at the default size)
            return 0
        if a.only == "fleet":
            report["fleet_status"] = fleet_status(sshd, base / "fleet", a.repeats)
            print(json.dumps(report, indent=2))
            return 0
        if a.only == "watch":
            report["watch"] = watch_report(hosts, a.watch_seconds, a.repeats)
            print(json.dumps(report, indent=2))
            return 0
        report["line_latency"] = line_latency(hosts)
        report["launch_overhead"] = launch_overhead(hosts, a.launches)
        report["agent_cpu_follow_1hz"] = agent_cpu(hosts, pct_host, a.cpu_seconds)
        ll, lo, ac = report["line_latency"], report["launch_overhead"], report["agent_cpu_follow_1hz"]
        print(f"line latency over {ll['lines']} lines: p50 {ll['p50_ms']:.1f} ms, p99 {ll['p99_ms']:.1f} ms, "
              f"max {ll['max_ms']:.1f} ms   (goal p99 < 250 ms: {'ok' if ll['p99_ms'] < 250 else 'MISSED'})")
        print(f"launch overhead (excluding the run's start-up): median {lo['overhead_median_s']:.2f} s, "
              f"max {lo['overhead_max_s']:.2f} s   (goal < 2 s: {'ok' if lo['overhead_max_s'] < 2 else 'MISSED'})")
        print(f"agent CPU following at 1 Hz: {ac['percent_of_one_core']:.2f} % of one core over {ac['seconds']} s "
              f"(goal < 2 %: {'ok' if ac['percent_of_one_core'] < 2 else 'MISSED'}); nvml: {ac['nvml']}")
        report["watch"] = watch_report(hosts, a.watch_seconds, a.repeats)
        print(json.dumps(report, indent=2))
    finally:
        pct_host.stop_all()
        sshd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
