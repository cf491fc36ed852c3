"""Benchmark of `opsctl watch` ingest: a chatty run (20,000 log lines/s + 8 GPUs of NVML samples at 4 Hz) into the app.

Reports display lag (line written -> drawn on screen) p50/p99, dropped lines, RSS over time, CPU of the app and writer.
Usage: python bench/watch_ingest.py [--seconds 30] [--rate 20000] [--gpus 8] [--gpu-hz 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opsctl.tui import WatchApp  # noqa: E402
from opsctl.widgets import LogLine, LogPane  # noqa: E402

# The writer runs as its own process, as the remote agent does: JSON lines on a pipe, one write per batch.
WRITER = r"""
import json, sys, time
rate, seconds, gpus, gpu_hz = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
out = sys.stdout.buffer
dumps = json.dumps
pad = "x" * 40
t0 = time.time()
sent = 0
next_gpu = t0
off = 0
while True:
    now = time.time()
    if now - t0 >= seconds:
        break
    due = int((now - t0) * rate)
    chunk = []
    while sent < due:
        line = f"step log {sent} {time.time():.6f} rank0 | loss 2.3412 | tok/s 32768 | {pad}"
        end = off + len(line) + 1
        chunk.append(dumps({"t": "log", "ts": now, "off": off, "end": end, "line": line}))
        off = end
        sent += 1
    if now >= next_gpu:
        next_gpu += 1.0 / gpu_hz
        chunk.append(dumps({"t": "gpu", "ts": now, "gpus": [
            {"index": i, "name": "NVIDIA H200", "util": 90 + (sent + i) % 10, "mem_used_mb": 60000.0 + i,
             "mem_total_mb": 143771.0, "power_w": 650.0, "temp_c": 70.0, "sm_clock_mhz": 1980,
             "mem_clock_mhz": 3201, "procs": [{"pid": 1000 + i, "used_mb": 59000.0}]} for i in range(gpus)]}))
    if chunk:
        out.write(("\n".join(chunk) + "\n").encode())
        out.flush()
    time.sleep(0.002)
sys.stderr.write(json.dumps({"sent": sent}) + "\n")
"""


class PipeSource:
    """Agent messages from a child process's stdout, parsed on the worker thread as the real AgentSource does."""

    finite = True

    def __init__(self, argv: list[str], label: str = "bench:chatty") -> None:
        self.label = label
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def messages(self) -> Iterator[dict[str, Any]]:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            yield json.loads(raw)

    def kill(self) -> None:
        self.proc.terminate()

    def clean(self) -> None: ...

    def reconnect(self) -> None: ...


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    src = PipeSource([sys.executable, "-c", WRITER, str(args.rate), str(args.seconds), str(args.gpus),
                      str(args.gpu_hz)])
    app = WatchApp([src])
    lags: list[float] = []
    state = {"rendered": 0}
    seen: set[int] = set()

    def probe(line: LogLine) -> None:
        # Every line's first draw counts (a frame draws the pane's rows in any order); later redraws do not.
        if line.seq in seen:
            return
        seen.add(line.seq)
        if len(seen) > 200_000:
            floor = line.seq - 100_000
            seen.difference_update([s for s in seen if s < floor])
        state["rendered"] += 1
        parts = line.text.split(" ", 4)
        if len(parts) > 3 and parts[0] == "step":
            lags.append(time.time() - float(parts[3]))

    rss: list[tuple[float, float]] = []
    cpu0 = time.process_time()
    wall0 = time.monotonic()
    tick_gaps: list[float] = []
    async with app.run_test(size=(120, 50)) as pilot:
        app.query_one(LogPane).render_probe = probe
        last_tick = time.monotonic()
        ticks = app.ticks
        while src.proc.poll() is None or not app.replay_done():
            await asyncio.sleep(0.05)
            now = time.monotonic()
            if app.ticks != ticks:
                tick_gaps.append((now - last_tick) / (app.ticks - ticks))
                ticks, last_tick = app.ticks, now
            if not rss or now - wall0 - rss[-1][0] >= 1.0:
                rss.append((now - wall0, rss_mb()))
            if now - wall0 > args.seconds + 30:
                break
        await pilot.pause(0.3)
        wall = time.monotonic() - wall0
        cpu = time.process_time() - cpu0
        model = app.models[0]
        writer = json.loads(src.proc.stderr.read().decode().strip().splitlines()[-1]) if src.proc.stderr else {}
        child = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {
            "seconds": args.seconds, "rate_lines_per_s": args.rate, "gpus": args.gpus, "gpu_hz": args.gpu_hz,
            "lines_sent": writer.get("sent"), "lines_ingested": model.lines_total, "lines_dropped": model.dropped,
            "lines_lost_unaccounted": (writer.get("sent") or 0) - model.lines_total - model.dropped,
            "lines_drawn_first_time": state["rendered"],
            "lag_ms_p50": round(1000 * pct(lags, 0.50), 1), "lag_ms_p99": round(1000 * pct(lags, 0.99), 1),
            "lag_ms_max": round(1000 * max(lags), 1) if lags else None, "lag_samples": len(lags),
            "ui_tick_interval_ms_median": round(1000 * statistics.median(tick_gaps), 1) if tick_gaps else None,
            "ui_tick_interval_ms_p99": round(1000 * pct(tick_gaps, 0.99), 1) if tick_gaps else None,
            "app_cpu_percent_of_one_core": round(100 * cpu / wall, 1),
            "writer_cpu_percent_of_one_core": round(100 * (child.ru_utime + child.ru_stime) / wall, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rss_mb_at_s": {f"{t:.0f}": round(m, 1) for t, m in rss[:: max(1, len(rss) // 8)]},
            "threads": threading.active_count(),
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--rate", type=int, default=20_000, help="log lines per second")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpu-hz", type=float, default=4.0)
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    args = p.parse_args()
    if args.seconds <= 0 or args.rate <= 0 or args.gpus < 0 or args.gpu_hz <= 0:
        p.error("--seconds, --rate and --gpu-hz must be > 0, --gpus >= 0")
    result = asyncio.run(run(args))
    result["date_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    result["machine"] = f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}"
    result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
