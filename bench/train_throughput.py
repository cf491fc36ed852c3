"""Summarise a training run's throughput from its telemetry (docs/events.md) and, optionally, a recorded agent stream.

Prints step time, tokens/s and GPU utilisation/memory during the training phase, as one JSON object and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.telemetry import read_events  # noqa: E402


def summarise(events_path: str, stream_path: str | None, skip: int) -> dict[str, Any]:
    events = list(read_events(events_path))
    start = next((e for e in events if e["kind"] == "run_start"), None)
    steps = [e for e in events if e["kind"] == "step"]
    if start is None or not steps:
        raise SystemExit(f"{events_path}: no run_start or no step events")
    timed = steps[skip:] if len(steps) > skip else steps
    out: dict[str, Any] = {
        "device": start["device"],
        "kernels": start["kernels"],
        "steps": len(steps),
        "first_step_s": steps[0]["step_time_s"],
        "step_time_median_s": statistics.median(s["step_time_s"] for s in timed),
        "tokens_per_s_median": statistics.median(s["tokens_per_s"] for s in timed),
        "supervised_tokens_per_step": statistics.median(s["tokens"] for s in timed),
        "recompiles_last": steps[-1]["recompiles"],
        "loss_first_last": [steps[0]["loss"], steps[-1]["loss"]],
        "acc_last": steps[-1]["acc"],
        "queue_wait_median_s": statistics.median(s["queue_wait_s"] for s in timed),
        "timed_steps": f"{timed[0]['step']}..{timed[-1]['step']}",
    }
    if stream_path:
        t0, t1 = timed[0]["ts"] - timed[0]["step_time_s"], timed[-1]["ts"]
        util: list[float] = []
        mem: list[float] = []
        for line in Path(stream_path).read_text().splitlines():
            m = json.loads(line)
            if m.get("t") == "gpu":
                for g in m["gpus"]:
                    mem.append(g["mem_used_mb"])
                    if t0 <= m["ts"] <= t1:
                        util.append(g["util"])
        out["gpu_util_training_mean"] = statistics.mean(util) if util else None
        out["gpu_util_samples"] = len(util)
        out["gpu_mem_peak_mb"] = max(mem) if mem else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("events", help="the run's events.jsonl")
    p.add_argument("--stream", help="an agent stream recorded with scripts/record_stream.py (for NVML samples)")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the medians")
    args = p.parse_args(argv)
    s = summarise(args.events, args.stream, args.skip)
    print(json.dumps(s, indent=1))
    print(f"\nsteps {s['steps']} (timed {s['timed_steps']}), first step {s['first_step_s']:.1f} s, "
          f"median step {s['step_time_median_s'] * 1e3:.1f} ms, {s['tokens_per_s_median']:,.0f} tokens/s, "
          f"recompiles {s['recompiles_last']}, GPU util {s.get('gpu_util_training_mean')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
