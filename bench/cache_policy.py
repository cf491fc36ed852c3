"""Inductor cache kept vs cleared: time from `opsctl launch` to the first training step (READY), tiny run on CPU
with `train.compile: true`, under `inductor_cache_policy: clear` and `keyed`.

Run: `python bench/cache_policy.py [--repeats 3]`. Each launch starts the run fresh (`--fresh`), waits for its
first step (opsctl's READY line carries the seconds since launch), then stops it with `opsctl kill`. Under
`clear` every launch compiles from nothing; under `keyed` the first launch fills the run's cache and later ones
reuse it. Prints one line per launch and the raw numbers as JSON. A benchmark, not a test: numbers vary with load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent


def opsctl(hosts: Path, *argv: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200", TERM="dumb")
    return subprocess.run([sys.executable, "-m", "opsctl", "--hosts", str(hosts), *argv], cwd=str(REPO),
                          capture_output=True, text=True, timeout=timeout, env=env)


def setup(base: Path, policy: str, src: Path) -> Path:
    """A workdir (not a git checkout) with a compiled tiny config, and a hosts.yaml with one local run whose
    `dflash` comes from `src` (a checkout; the key hashes its dflash/ since the workdir is not a git checkout)."""
    work = base / policy
    work.mkdir()
    cfg = yaml.safe_load((src / "configs" / "tiny.yaml").read_text())
    cfg["train"]["compile"] = True
    (work / "tiny_compile.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    run = {"workdir": str(work), "log": "out/train.log", "events": "out/events.jsonl",
           "command": ["{python}", "-m", "dflash", "train", "--config", "tiny_compile.yaml", "--out", "out", "--fresh"],
           "inductor_cache_policy": policy, "cache_key_paths": [str(src / "dflash")], "env": {"PYTHONPATH": str(src)},
           "tmux_session": f"bench-cache-{policy}", "ready_timeout": 900, "kill_grace": [60, 10]}
    hosts = base / f"hosts-{policy}.yaml"
    hosts.write_text(yaml.safe_dump({"hosts": {"local": {"local": True, "runs": {"tiny": run}}}}, sort_keys=False))
    return hosts


def one_launch(hosts: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    r = opsctl(hosts, "launch", "local", "tiny")
    wall = time.monotonic() - t0
    flat = " ".join(r.stderr.split())
    ready = re.search(r"READY tiny: .*?\[([\d.]+) s\]", flat)
    cache = re.search(r"inductor_cache: (inductor cache \w+: .*?MiB\))", flat)
    k = opsctl(hosts, "kill", "local", "tiny", timeout=300)
    if r.returncode != 0 or ready is None:
        raise SystemExit(f"launch failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return {"to_first_step_s": float(ready.group(1)), "wall_s": round(wall, 2), "cache": cache.group(1) if cache else None,
            "kill_rc": k.returncode}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--src", type=Path, default=REPO,
                   help="checkout whose dflash the run imports (e.g. `git archive HEAD | tar -x -C DIR`)")
    args = p.parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        base = Path(tmp)
        for policy in ("clear", "keyed"):
            hosts = setup(base, policy, args.src.resolve())
            results[policy] = []
            try:
                for i in range(args.repeats):
                    res = one_launch(hosts)
                    results[policy].append(res)
                    print(f"{policy:5} launch {i + 1}: first step {res['to_first_step_s']:7.2f} s after launch  "
                          f"| {res['cache']}", flush=True)
            finally:
                sock = base / policy / ".opsctl" / "tiny" / "tmux.sock"
                if sock.exists():
                    subprocess.run(["tmux", "-S", str(sock), "kill-server"], capture_output=True)
    clear = [r["to_first_step_s"] for r in results["clear"]]
    warm = [r["to_first_step_s"] for r in results["keyed"][1:]]
    print(f"clear (every launch compiles): median {statistics.median(clear):.2f} s to the first step")
    print(f"keyed, cache kept (launch 2..): median {statistics.median(warm):.2f} s to the first step"
          if warm else "keyed: needs --repeats >= 2")
    print(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
                      "cpus": os.cpu_count(), "loadavg": os.getloadavg(), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
