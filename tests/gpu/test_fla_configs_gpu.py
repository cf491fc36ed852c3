"""fla's tuned kernel configs round trip through fla's own loader on a GPU (dflash/fla_configs.py, issue 24): a
process with an empty Triton cache autotunes and records; the next one, with another empty Triton cache and the
store, benchmarks no candidate at all and computes the same hidden states; and `dflash train` does both by itself.
Each side is its own process: fla reads FLA_CACHE_MODE once, at import."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs the fla wheel")]
REPO = Path(__file__).resolve().parents[2]

_PROBE = r"""
import json, os, sys, time, torch
from pathlib import Path
from dflash import fla_configs
store = Path(sys.argv[1])
print(fla_configs.enable(store), file=sys.stderr)
from triton.runtime.autotuner import Autotuner
assert hasattr(Autotuner, "_bench"), "Triton's Autotuner has no _bench: count the candidates another way"
benched = []
timed = Autotuner._bench
def counting(self, *args, **kwargs):  # instrumentation only: which autotuner times a candidate, by its store name
    names = {id(obj): name for name, obj in fla_configs.store_names().items()}
    benched.append(names.get(id(self)) or fla_configs.kernel_name(self) or "?")
    return timed(self, *args, **kwargs)
Autotuner._bench = counting
sys.path.insert(0, "tests/gpu")
from test_gpu_checks import GPU_ARCH
from dflash.target import Target, TargetConfig
target = Target(TargetConfig(arch=GPU_ARCH, fused_elementwise="off"), 2, torch.device("cuda"))
lengths = [300, 1000, 77, 2000, 1, 619]
g = torch.Generator().manual_seed(0)
docs = [torch.randint(0, GPU_ARCH["vocab_size"], (n,), generator=g) for n in lengths]
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
t0 = time.perf_counter()
hidden = target.hidden_states_packed(torch.cat(docs)[None].cuda(), cu)
torch.cuda.synchronize()
first_s = time.perf_counter() - t0
line = fla_configs.record(store)
torch.save(hidden.cpu(), sys.argv[2])
print(json.dumps({"benched": len(benched), "kernels": sorted(set(benched)), "first_s": first_s, "record": line,
                  "mode": os.environ.get("FLA_CACHE_MODE"), "kernels_bound": target.kernels}))
"""


def _env(tmp: Path, name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR")}
    env.update(TRITON_CACHE_DIR=str(tmp / f"triton-{name}"), TORCHINDUCTOR_CACHE_DIR=str(tmp / f"inductor-{name}"),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return env


def test_recorded_configs_skip_autotuning_and_give_the_same_hidden_states(tmp_path: Path) -> None:
    store = tmp_path / "store"
    res = {}
    for name in ("record", "load"):  # each with its own empty Triton cache: a new host, or a cleared cache
        proc = subprocess.run([sys.executable, "-c", _PROBE, str(store), str(tmp_path / f"{name}.pt")],
                              cwd=REPO, env=_env(tmp_path, name), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        res[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(name, res[name], proc.stderr.strip().splitlines()[:1])
    rec, load = res["record"], res["load"]
    recorded = {p.stem for p in store.glob("*.json")}
    assert rec["mode"] is None and rec["benched"] > 0 and "recorded" in rec["record"]
    assert set(rec["kernels"]) <= recorded, f"tuned, not recorded: {set(rec['kernels']) - recorded}"
    assert load["mode"] == "strict"
    assert not set(load["kernels"]) & recorded, f"autotuned although recorded: {load['kernels']}"
    assert load["benched"] == 0, f"fla kernels the store does not reach: {load['kernels']}"
    assert load["record"] == ""  # nothing new to add
    assert torch.equal(torch.load(tmp_path / "record.pt"), torch.load(tmp_path / "load.pt"))
    print(f"first packed forward: {rec['first_s']:.1f} s autotuning, {load['first_s']:.1f} s from the store")
    assert load["first_s"] < rec["first_s"]


_TRAIN = r"""
import json, sys
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/gpu")
from dflash_fixtures import run_config
from test_gpu_checks import GPU_ARCH
from dflash.train import train
cfg = run_config(target={"arch": GPU_ARCH, "seed": 0},
                 train={"max_steps": 2, "checkpoint_every": 0, "compile": "false", "eval_every": 0})
print(train(cfg, sys.argv[1]).exit_code)
"""


def test_dflash_train_records_after_its_first_step_and_the_next_run_loads(tmp_path: Path) -> None:
    logs = {}
    for name in ("first", "second"):
        env = {**_env(tmp_path, name), "DFLASH_CACHE": str(tmp_path / "cache")}
        proc = subprocess.run([sys.executable, "-c", _TRAIN, str(tmp_path / name)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "0", proc.stderr[-3000:]
        text = (tmp_path / name / "train.log").read_text()
        logs[name] = [ln for ln in text.splitlines() if "fla kernel configs" in ln]
        print(name, logs[name])
    store = next((tmp_path / "cache" / "fla-configs").glob("*/*"))
    first, second = logs["first"], logs["second"]
    assert "none recorded yet" in first[0] and "recorded" in first[1] and str(store) in first[1]
    assert len(second) == 1 and f"from {store}" in second[0] and "without autotuning" in second[0]
