"""opsctl latency benchmark over loopback SSH + the `pct` stand-in: line latency, launch overhead, agent CPU.

Run: `python bench/ops_latency.py [--lines 2000] [--cpu-seconds 30]`; it prints a report and raw numbers (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--interval", type=float, default=0.005, help="seconds between lines of the chatty run")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--cpu-seconds", type=float, default=30)
    a = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="opsctl-bench-"))
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
        print(json.dumps(report, indent=2))
    finally:
        pct_host.stop_all()
        sshd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
