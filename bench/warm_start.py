"""Compile warm starts: launch -> first step of a resumed `dflash train` with the inductor cache cleared, kept,
with only the run's saved mega-cache artifacts (OUT/compile_cache), or both (docs/warm-start.md).

Run: `python bench/warm_start.py [--config configs/tiny.yaml] [--scenarios cold,kept,artifacts,both]`. First a
fresh run of 1 step with an empty inductor cache (the `fresh` row: a cold compile) leaves checkpoint step-1, the
filled cache dir and the artifacts. Then every scenario resumes that checkpoint (`--resume --max-steps 2`) in its
own process and is killed (SIGKILL) as soon as its first step event is written, so no checkpoint is written and each
one starts from the same state:

  cold       empty inductor cache dir, no artifacts file          (opsctl `clear`, before this feature)
  kept       the fresh run's cache dir, no artifacts file         (opsctl `keyed`, key unchanged)
  artifacts  empty inductor cache dir, the artifacts file         (`clear`, a new host, or a `keyed` key change)
  both       the fresh run's cache dir and the artifacts file     (`keyed` with this feature: what a resume gets)
  newrun     a new run (another --out, `--fresh`) on an empty inductor + Triton cache, on the host the fresh run
             left its copies on: $DFLASH_CACHE/compile-cache (artifacts) and, on a GPU, $DFLASH_CACHE/fla-configs
             (fla's kernel choices) — what a new experiment of the same shape gets under opsctl's `clear`

Reported per launch: `first_step_s` (the first step's own wall time, compile included, from its `step` event),
launch -> first step (process start to that event, wall clock: imports, data, target load and compile), torch's
cache hit/miss counters and the warm-start line; then medians and ratios against `cold`; raw JSON last.
`--work DIR` keeps the primed run between invocations (on a device with a per-command time limit: prime and some
scenarios in one call, the rest in the next). `--compile-scope whole|regional` and `--drafter-layers N` set
train.compile_scope and drafter.num_layers of the primed run (issue 24: what the regional compile saves, and how
that grows with the depth); `--steady-steps N` adds a warm N-step run and its median step time. A benchmark, not a
test: numbers vary with load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash.telemetry import EventError, parse_line  # noqa: E402

SCENARIOS = {"cold": (False, False), "kept": (True, False), "artifacts": (False, True), "both": (True, True),
             "newrun": (False, False)}
# What a launch may use besides what its scenario names: nothing (the resumes), or this host's copies (newrun). The
# fresh run starts cold on purpose (DFLASH_WARM_START=0: it loads nothing, not even a copy an earlier invocation of
# this bench left on the host) and leaves both copies for newrun.
ISOLATED = {"DFLASH_HOST_COMPILE_CACHE": "0", "FLA_CACHE_MODE": "disabled"}
HOST_COPIES = {"DFLASH_HOST_COMPILE_CACHE": "1"}
CACHE_ENV = ("DFLASH_WARM_START", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_FORCE_DISABLE_CACHES")


class Work:
    """The bench's directory: the run, the primed inductor cache, the primed artifacts, per-launch caches and logs.
    Everything deleted here is inside it (checked), never anything the caller named elsewhere."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.config, self.run = self.root / "config.yaml", self.root / "run"
        self.primed_cache, self.primed_artifacts = self.root / "inductor-primed", self.root / "artifacts-primed"
        self.logs = self.root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def remove(self, path: Path) -> None:
        path = path.resolve()
        if path == self.root or self.root not in path.parents:
            raise SystemExit(f"refusing to delete {path}: not inside the bench work dir {self.root}")
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

    @property
    def primed(self) -> bool:
        return (self.primed_artifacts / "artifacts.json").is_file() and (self.run / "checkpoints").is_dir()


def write_config(work: Work, config: Path, compile_mode: str, scope: str | None = None,
                 layers: int | None = None) -> None:
    cfg = yaml.safe_load(config.read_text())
    # The copy lives in the work dir: paths the original meant next to itself are made absolute (dflash's rule).
    data, target = cfg.get("data") or {}, cfg.get("target") or {}
    for holder, key in ((data, "tokenizer"), (target, "path")):
        if isinstance(holder.get(key), str) and (config.parent / holder[key]).exists():
            holder[key] = str((config.parent / holder[key]).resolve())
    if isinstance(data.get("paths"), list):
        data["paths"] = [str((config.parent / x).resolve()) if (config.parent / x).exists() else x
                         for x in data["paths"]]
    train = cfg.setdefault("train", {})
    # keep_last 2: a scenario that writes step-2 before its kill lands must not delete the primed step-1.
    train.update(compile=compile_mode, log_every=1, checkpoint_every=0, keep_last=2)
    if scope is not None:
        train["compile_scope"] = scope
    if layers is not None:  # a deeper (or shallower) drafter: sliding windows keep the config's first and last
        drafter = cfg.setdefault("drafter", {})
        drafter["num_layers"] = layers
        windows = drafter.get("layer_sliding_windows")
        if isinstance(windows, list) and windows:
            drafter["layer_sliding_windows"] = [windows[0]] * (layers - 1) + [windows[-1]]
    work.config.write_text(yaml.safe_dump(cfg, sort_keys=False))


def events_from(path: Path, offset: int) -> list[dict[str, Any]]:
    """The valid, complete event lines written after byte `offset` (this launch's; an earlier launch killed
    mid-line leaves a fragment that the first new line completes into garbage, which is skipped)."""
    if not path.exists():
        return []
    with open(path, "rb") as fh:
        fh.seek(offset)
        raw = fh.read()
    found = []
    for chunk in raw.split(b"\n")[:-1]:
        try:
            found.append(parse_line(chunk))
        except EventError:
            continue
    return found


def launch(work: Work, name: str, cache: Path, extra: list[str], kill_at_first_step: bool,
           timeout: float, out: Path | None = None, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """One `dflash train` process; its first step's figures from the events it wrote after it started (and,
    when it is not killed there, the step times of every later step)."""
    out = out if out is not None else work.run
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    # Each scenario names what it starts from (ISOLATED unless told): not this host's copy of an earlier launch's
    # artifacts ($DFLASH_CACHE/compile-cache) nor fla kernel configs one recorded (fla's own default, `disabled`,
    # set explicitly: dflash then neither loads nor records them; dflash/fla_configs.py).
    env = {k: v for k, v in env.items() if k not in ISOLATED}
    env.update(PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"),
               **(ISOLATED if env_extra is None else env_extra))
    log = work.logs / f"{name}.log"
    events = out / "events.jsonl"
    offset = events.stat().st_size if events.exists() else 0
    t_launch = time.time()
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(work.config), "--out",
                                 str(out), *extra], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    step: dict[str, Any] | None = None
    compiling: dict[str, Any] | None = None
    try:
        while time.time() - t_launch < timeout:
            if events.exists():
                mine = events_from(events, offset)
                compiling = next((e for e in mine if e["kind"] == "phase" and e["phase"] == "compiling"), None)
                step = next((e for e in mine if e["kind"] == "step"), None)
                if step is not None:
                    break
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        if proc.poll() is None and (step is None or kill_at_first_step):  # timed out, or measured
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if step is None:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{name}: no step event (exit {proc.returncode}); log {log}:\n{tail}")
    warm = (compiling or {}).get("warm_start") or {}
    later = [e["step_time_s"] for e in events_from(events, offset) if e["kind"] == "step"][1:]
    return {"later_step_s": later, "first_step_s": step.get("first_step_s", step["step_time_s"]), "to_first_step_s":
            round(step["ts"] - t_launch, 2), "compile_cache": step.get("compile_cache"),
            "warm_start": warm.get("reason"), "exit_code": rc, "log": str(log)}


def prime(work: Work, timeout: float) -> dict[str, Any]:
    """The fresh 1-step run with an empty cache: the cold figure of a fresh start, and everything the scenarios
    resume from."""
    for p in (work.run, work.primed_cache, work.primed_artifacts):
        work.remove(p)
    res = launch(work, "fresh", work.primed_cache, ["--fresh", "--max-steps", "1"], False, timeout,
                 env_extra={**HOST_COPIES, "DFLASH_WARM_START": "0"})
    if res["exit_code"] != 0 or not (work.run / "compile_cache" / "artifacts.json").is_file():
        raise SystemExit(f"fresh run: exit {res['exit_code']}, artifacts saved: "
                         f"{(work.run / 'compile_cache').exists()}; see {res['log']}")
    shutil.copytree(work.run / "compile_cache", work.primed_artifacts)
    return res


def scenario(work: Work, name: str, i: int, timeout: float) -> dict[str, Any]:
    keep_cache, artifacts = SCENARIOS[name]
    cache = work.root / f"inductor-{name}-{i}"
    work.remove(cache)
    if name == "newrun":
        out = work.root / f"newrun-{i}"
        work.remove(out)
        cache.mkdir()
        try:
            return launch(work, f"{name}-{i}", cache, ["--fresh", "--max-steps", "1"], True, timeout, out, HOST_COPIES)
        finally:
            work.remove(cache)
            work.remove(out)
    if keep_cache:
        shutil.copytree(work.primed_cache, cache, ignore=shutil.ignore_patterns("locks"))
    else:
        cache.mkdir()
    work.remove(work.run / "compile_cache")
    for ckpt in (work.run / "checkpoints").iterdir():  # back to the primed step-1, whatever the last launch wrote
        if ckpt.name != "step-1":
            work.remove(ckpt)
    if artifacts:
        shutil.copytree(work.primed_artifacts, work.run / "compile_cache")
    try:
        return launch(work, f"{name}-{i}", cache, ["--resume", "--max-steps", "2"], True, timeout)
    finally:
        work.remove(cache)


def steady(work: Work, steps: int, timeout: float) -> dict[str, Any]:
    """Steady-state step time: a fresh run of `steps` steps in its own dir on a copy of the primed cache (so its
    first step is warm); the median of its steps after the first (step_time_s: data wait, forward, backward,
    optimizer)."""
    cache, out = work.root / "inductor-steady", work.root / "steady-run"
    for p in (cache, out):
        work.remove(p)
    shutil.copytree(work.primed_cache, cache, ignore=shutil.ignore_patterns("locks"))
    try:
        res = launch(work, "steady", cache, ["--fresh", "--max-steps", str(steps)], False, timeout, out)
    finally:
        work.remove(cache)
    later = res["later_step_s"]
    res["median_step_s"] = statistics.median(later) if later else None
    return res


def line(name: str, res: dict[str, Any]) -> str:
    c = res["compile_cache"] or {}
    counts = (f"fxgraph {c.get('fxgraph_hit')} hit/{c.get('fxgraph_miss')} miss, aot autograd "
              f"{c.get('aotautograd_hit')}/{c.get('aotautograd_miss')}") if c else "no counters"
    return (f"{name:12} first step {res['first_step_s']:8.2f} s | launch -> first step {res['to_first_step_s']:8.2f} s"
            f" | {counts} | {res['warm_start']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=REPO / "configs" / "tiny.yaml",
                   help="run config (GPU: configs/h200-4b-like.yaml or bench/h200-27b-like.yaml)")
    p.add_argument("--scenarios", default="cold,kept,artifacts,both",
                   help=f"comma-separated, from {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--repeats", type=int, default=1, help="launches per scenario (medians reported)")
    p.add_argument("--work", type=Path, default=None,
                   help="keep the primed run here between invocations (default: a temp dir, deleted)")
    p.add_argument("--reprime", action="store_true", help="with --work: prime again even if primed")
    p.add_argument("--compile", default="true", choices=["true", "auto"], help="train.compile for the run")
    p.add_argument("--compile-scope", choices=["whole", "regional"], default=None,
                   help="train.compile_scope for the run (default: the config's): the whole drafter step, or one "
                        "layer and one CE chunk compiled once and reused (a fresh --work, or --reprime, to change)")
    p.add_argument("--drafter-layers", type=int, default=None,
                   help="override drafter.num_layers (a deeper drafter shows what the compile scope saves)")
    p.add_argument("--steady-steps", type=int, default=0,
                   help="also run a fresh N-step run on the primed (warm) cache and report its median step time "
                        "after the first (steady state; default 0 = off)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch to its first step")
    p.add_argument("--json-out", type=Path, default=None, help="also write the raw JSON here")
    args = p.parse_args(argv)
    names = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in names if s not in SCENARIOS]
    if bad:
        p.error(f"unknown scenario {bad[0]!r}; choose from {', '.join(SCENARIOS)}")
    if not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    tmp = None
    if args.work is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-warm-")
        args.work = Path(tmp.name)
    work = Work(args.work)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        if args.reprime or not work.primed:
            write_config(work, args.config.resolve(), args.compile, args.compile_scope, args.drafter_layers)
            print(f"priming: fresh 1-step run of {args.config} in {work.run} (cold compile)", flush=True)
            results["fresh"] = [prime(work, args.timeout)]
            print(line("fresh", results["fresh"][0]), flush=True)
        else:
            primed_cfg = yaml.safe_load(work.config.read_text())
            for flag, got, want in (
                    ("--compile-scope", (primed_cfg.get("train") or {}).get("compile_scope"), args.compile_scope),
                    ("--drafter-layers", (primed_cfg.get("drafter") or {}).get("num_layers"), args.drafter_layers)):
                if want is not None and got != want:
                    raise SystemExit(f"{work.run} was primed with {flag} {got}, not {want}: add --reprime, or "
                                     f"another --work")
            print(f"already primed: {work.run} (--reprime to start over)", flush=True)
        for name in names:
            for i in range(args.repeats):
                res = scenario(work, name, i + 1, args.timeout)
                results.setdefault(name, []).append(res)
                print(line(f"{name} {i + 1}", res), flush=True)
        if args.steady_steps > 1:
            res = steady(work, args.steady_steps, args.timeout)
            results["steady"] = [res]
            print(f"steady       {len(res['later_step_s'])} steps after a warm first step: median "
                  f"{res['median_step_s']:.3f} s/step (first {res['first_step_s']:.2f} s)", flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    med = {k: statistics.median(r["first_step_s"] for r in v) for k, v in results.items()}
    med_launch = {k: statistics.median(r["to_first_step_s"] for r in v) for k, v in results.items()}
    base = "cold" if "cold" in med else ("fresh" if "fresh" in med else None)
    for k in med:
        ratio = f"  = {med[k] / med[base]:.2f}x {base}'s first step" if base and med[base] > 0 else ""
        print(f"{k:10} median first step {med[k]:8.2f} s, launch -> first step {med_launch[k]:8.2f} s{ratio}")
    raw = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "config": str(args.config),
           "compile_scope": args.compile_scope, "drafter_layers": args.drafter_layers,
           "python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
           "results": results}
    print(json.dumps(raw))
    if args.json_out:
        args.json_out.write_text(json.dumps(raw, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
