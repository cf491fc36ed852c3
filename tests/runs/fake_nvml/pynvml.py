"""Stand-in for nvidia-ml-py's `pynvml`, for tests only: this CI machine has no GPU, so NVML cannot exist here.

It implements exactly the calls opsctl's agent makes, with the real signatures, units (bytes, mW, MHz) and
constants, and behaves like the driver: a listed process holds its GPU memory while it is alive. State comes
from the JSON file named by $FAKE_NVML: {"gpus": [{"name", "mem_total_mb", "util", "procs": [{"pid",
"used_mb"}], "pids_file": PATH (pids, whitespace-separated, that hold "pids_used_mb" each while alive),
"hidden_pids": [pids that hold memory but are not visible in this PID namespace]}]}.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS, NVML_CLOCK_SM, NVML_CLOCK_MEM = 0, 1, 2
NVML_ERROR_LIBRARY_NOT_FOUND = 12


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


def _state() -> dict[str, Any]:
    path = os.environ.get("FAKE_NVML")
    if not path:
        raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
    with open(path) as fh:
        return json.load(fh)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def nvmlInit() -> None:
    _state()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    if not 0 <= i < nvmlDeviceGetCount():
        raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
    return i


def _gpu(h: int) -> dict[str, Any]:
    return _state()["gpus"][h]


def nvmlDeviceGetName(h: int) -> str:
    return _gpu(h).get("name", "NVIDIA H200")


def nvmlDeviceGetComputeRunningProcesses(h: int) -> list[SimpleNamespace]:
    g = _gpu(h)
    procs = [SimpleNamespace(pid=p["pid"], usedGpuMemory=int(p["used_mb"] * 2**20))
             for p in g.get("procs", []) if _alive(p["pid"])]
    if g.get("pids_file") and os.path.exists(g["pids_file"]):
        with open(g["pids_file"]) as fh:
            pids = [int(x) for x in fh.read().split()]
        procs += [SimpleNamespace(pid=p, usedGpuMemory=int(g.get("pids_used_mb", 1000) * 2**20))
                  for p in pids if _alive(p)]
    procs += [SimpleNamespace(pid=p, usedGpuMemory=int(512 * 2**20)) for p in g.get("hidden_pids", [])]
    return procs


def nvmlDeviceGetMemoryInfo(h: int) -> SimpleNamespace:
    total = int(_gpu(h).get("mem_total_mb", 143771) * 2**20)
    used = sum(p.usedGpuMemory for p in nvmlDeviceGetComputeRunningProcesses(h))
    return SimpleNamespace(total=total, used=used, free=total - used)


def nvmlDeviceGetUtilizationRates(h: int) -> SimpleNamespace:
    return SimpleNamespace(gpu=_gpu(h).get("util", 0), memory=0)


def nvmlDeviceGetPowerUsage(h: int) -> int:
    return int(_gpu(h).get("power_w", 75.5) * 1000)


def nvmlDeviceGetTemperature(h: int, sensor: int) -> int:
    return int(_gpu(h).get("temp_c", 31))


def nvmlDeviceGetClockInfo(h: int, clock: int) -> int:
    return {NVML_CLOCK_SM: 1980, NVML_CLOCK_MEM: 3201}.get(clock, 1980)
