"""bench/gpu_checks.sh's parts (issue 24): every GPU check in exactly one part, each part within one device call."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}


def _listed_parts() -> dict[str, tuple[int, list[tuple[str, bool]]]]:
    """Parse `bash bench/gpu_checks.sh --list`: part -> (estimate s, [(node id, with fla)])."""
    out = subprocess.run(["bash", "bench/gpu_checks.sh", "--list"], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=60, check=True).stdout
    parts: dict[str, tuple[int, list[tuple[str, bool]]]] = {}
    current = None
    for line in out.splitlines():
        if m := re.match(r"^(part\w+)\s+(\d+) s\b", line):
            current = m.group(1)
            parts[current] = (int(m.group(2)), [])
        elif current and (m := re.match(r"^\s+\d+\s+(tests/gpu/\S+)(\s+\[without fla)?", line)):
            parts[current][1].append((m.group(1), m.group(2) is None))
    return parts


def _collected_gpu_checks() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "tests/gpu"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240).stdout
    return [line.strip() for line in out.splitlines() if line.startswith("tests/gpu/")]


def test_every_gpu_check_is_in_exactly_one_part_and_each_part_fits_one_device_call() -> None:
    parts = _listed_parts()
    assert len(parts) >= 2
    for name, (seconds, checks) in parts.items():
        assert checks, f"{name} has no checks"
        assert seconds <= 540, f"{name} is estimated at {seconds} s, over the 540 s a part may take"
        assert seconds >= sum(1 for _ in checks), name
    collected = _collected_gpu_checks()
    assert len(collected) >= 20, collected  # tests/gpu really was collected
    with_fla = [node for _, checks in parts.values() for node, fla in checks if fla]
    for node in collected:
        assert with_fla.count(node) == 1, f"{node} is in {with_fla.count(node)} parts (bench/gpu_checks_parts.py)"
    assert set(with_fla) <= set(collected), set(with_fla) - set(collected)  # no stale entries
    nofla = [node for _, checks in parts.values() for node, fla in checks if not fla]
    assert nofla == ["tests/gpu/test_gpu_checks.py::test_kernels_bound_match_the_installed_packages"]


def test_a_part_prints_its_summary_and_fails_when_checks_cannot_run(tmp_path: Path) -> None:
    """Out of time before the first check: every check reported 'not started', the summary printed, exit 1."""
    proc = subprocess.run(["bash", "bench/gpu_checks.sh", "part4"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**_env(), "OUT": str(tmp_path), "GPU_CHECKS_BUDGET_S": "5",
                               "GPU_CHECKS_WHEELS": str(tmp_path / "no-wheels")})  # a checkout's .whl is for the GPU
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = [line for line in proc.stdout.splitlines() if line.startswith("gpu_checks part4:")]
    assert len(summary) == 1 and "3 not started" in summary[0] and "0 passed" in summary[0], proc.stdout
    assert proc.stdout.count("NOT STARTED tests/gpu/") == 3
    assert "gpu_checks part4:" in (tmp_path / "gpu-part4.log").read_text()


def test_an_unknown_part_is_refused_by_name() -> None:
    proc = subprocess.run(["bash", "bench/gpu_checks.sh", "part99"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**_env(), "OUT": "/nonexistent"})
    assert proc.returncode == 2
    assert "unknown part 'part99'" in proc.stderr and "part1" in proc.stderr and "Traceback" not in proc.stderr
