"""A full disk during a run: a real ENOSPC from a size-limited tmpfs mounted on the run's checkpoints directory (in a
private mount namespace of its own, so nothing outside the test sees it).

A tiny checkpoint is ~205 KiB; the tmpfs holds one. keep_last 1, a checkpoint every 2 steps, 6 steps: step-2 fits
(and warns that the next will not), step-4 does not (skipped, training goes on), the final step-6 does not either:
it is retried until space comes back or train.final_save_wait_s runs out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dflash_fixtures import tiny_run_yaml

REPO = Path(__file__).resolve().parent.parent

# Runs inside `unshare --mount`: mount the tmpfs, train in this process, optionally play the person who frees space
# when the run says it is waiting, then report what the checkpoints directory holds (the tmpfs goes with the
# namespace).
_DRIVER = """
import json, subprocess, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
import dflash.train
from dflash.config import load_config

out, cfg_file, free_when_waiting = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
ck = out / "checkpoints"
ck.mkdir(parents=True)
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(ck)], check=True)
dflash.train.FINAL_SAVE_RETRY_S = 0.5
freed = []

def free_space():
    while True:
        time.sleep(0.1)
        try:
            text = (out / "events.jsonl").read_text()
        except OSError:
            continue
        if "retrying every" in text:
            for d in ck.iterdir():
                if d.name.startswith("step-"):
                    subprocess.run(["rm", "-r", "--", str(d)], check=True)  # inside our tmpfs, by name
                    freed.append(d.name)
            return

if free_when_waiting:
    threading.Thread(target=free_space, daemon=True).start()
r = dflash.train.train(load_config(cfg_file), out)
print(json.dumps({"exit_code": r.exit_code, "reason": r.reason, "step": r.step, "freed": freed,
                  "left": sorted(p.name for p in ck.iterdir())}))
"""


def _run(tmp_path: Path, wait_s: float, free: bool) -> tuple[dict, list[dict]]:
    cfg = tiny_run_yaml(train={"max_steps": 6, "checkpoint_every": 2, "keep_last": 1, "final_save_wait_s": wait_s})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "driver.py").write_text(_DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, str(tmp_path / "driver.py"),
                        str(tmp_path / "out"), str(tmp_path / "run.yaml"), "1" if free else "0",
                        str(Path(__file__).parent)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    events = [json.loads(x) for x in (tmp_path / "out" / "events.jsonl").read_text().splitlines()]
    return result, events


def _kinds(events: list[dict]) -> list[str]:
    return [f"{e['kind']}:{e.get('step', e.get('class', ''))}" for e in events
            if e["kind"] in ("checkpoint", "error", "run_end")]


def test_a_full_disk_skips_a_checkpoint_and_the_final_one_waits_for_space(tmp_path: Path) -> None:
    result, events = _run(tmp_path, wait_s=120, free=True)
    assert result == {"exit_code": 0, "reason": "completed", "step": 6, "freed": ["step-2"], "left": ["step-6"]}
    assert _kinds(events) == ["checkpoint:2", "error:disk_full", "error:disk_full", "error:disk_full",
                              "checkpoint:6", "run_end:6"]
    warn, skipped, waiting = (e for e in events if e["kind"] == "error")
    assert not any(e["fatal"] for e in (warn, skipped, waiting))
    assert "after checkpoint step-2" in warn["message"] and "the next one will not fit" in warn["message"]
    assert skipped["message"].startswith("checkpoint step-4 not saved: No space left on device in ")
    assert "training goes on and the next save (step 6) tries again" in skipped["message"]
    assert waiting["message"].startswith("final checkpoint step-6 not saved") and "retrying every" in waiting["message"]
    first = next(e for e in events if e["kind"] == "checkpoint")
    assert 0 <= first["free_bytes"] < first["bytes"]
    # Training went on through the skipped checkpoint: every step ran.
    assert [e["step"] for e in events if e["kind"] == "step"] == [1, 2, 3, 4, 5, 6]


def test_a_final_checkpoint_that_never_fits_fails_the_run_and_keeps_the_previous_one(tmp_path: Path) -> None:
    result, events = _run(tmp_path, wait_s=0, free=False)
    # Nothing half-written is left behind: the failed attempts gave their space back.
    assert result == {"exit_code": 1, "reason": "error", "step": 6, "freed": [], "left": ["step-2"]}
    assert _kinds(events) == ["checkpoint:2", "error:disk_full", "error:disk_full", "error:disk_full",
                              "run_end:6"]
    fatal = [e for e in events if e["kind"] == "error"][-1]
    assert fatal["fatal"] and "final checkpoint step-6 not saved" in fatal["message"]
    assert "the newest checkpoint on disk is the one to resume from" in fatal["message"]
    assert events[-1]["reason"] == "error" and events[-1]["exit_code"] == 1


@pytest.mark.parametrize("errno_name", ["ENOSPC", "EDQUOT"])
def test_disk_full_is_its_own_error_class(errno_name: str) -> None:
    import errno

    from dflash.train import classify_error

    assert classify_error(OSError(getattr(errno, errno_name), "x")) == "disk_full"
    assert classify_error(OSError(errno.EACCES, "x")) == "exception"
