"""target.cuda_graph on the GPU (issue 24 item 1): the packed forward captured over fixed-shape inputs and replayed.

Written in a session without a GPU: never run yet. Run by `bash bench/gpu_checks.sh part5` (with the fla /
causal-conv1d wheels). tests/test_target_fixed_shape.py checks the fixed-shape inputs on the CPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dflash.target import TINY_ARCH, Target, TargetConfig, fixed_packed_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HAVE_FAST = importlib.util.find_spec("fla") is not None and importlib.util.find_spec("causal_conv1d") is not None
DEV = torch.device("cuda")
ARCH = {**TINY_ARCH, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64, "initializer_range": 0.05}
BUDGET, MIN_LEN, MAX_LEN = 4096, 1, 2048


def _graph_target() -> tuple[Target, list[str]]:
    logs: list[str] = []
    t = Target(TargetConfig(arch=ARCH, cuda_graph="on", fused_elementwise="off"), num_draft_layers=2, device=DEV)
    assert t.packing == "varlen", t.kernels
    assert t.enable_cuda_graph(BUDGET, MIN_LEN, MAX_LEN, logs.append)
    return t, logs


def _row(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ARCH["vocab_size"], (1, sum(lengths)), generator=g)
    return ids, torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


@pytest.mark.skipif(not HAVE_FAST, reason="needs flash-linear-attention and causal-conv1d")
def test_graph_replay_equals_the_eager_forward_exactly() -> None:
    """The replayed graph runs the kernels the eager forward over the same fixed-shape inputs runs: bit-equal states.
    Against today's unpadded packed forward (different grid sizes) the states are printed and held to bf16 rounding."""
    t, logs = _graph_target()
    ids, cu = _row([300, 1000, 77, 2000, 1, 619], seed=3)
    n = ids.shape[1]
    replayed = t.hidden_states_packed(ids, cu).clone()
    assert t.graphs is not None and t.graphs.failed is None, (t.graphs and t.graphs.failed, logs)
    assert t.graphs.captures == 1 and t.graphs.replays == 1
    fixed = fixed_packed_inputs(ids, cu, BUDGET, MAX_LEN, t.graphs.buckets)
    eager_fixed = t.hidden_states_fixed(fixed)[:, :n]
    t.graphs, graphs = None, t.graphs  # today's eager, unpadded path
    eager = t.hidden_states_packed(ids, cu)
    t.graphs = graphs
    diff = (replayed.double() - eager.double()).norm() / eager.double().norm()
    print(f"replay vs eager fixed: equal {torch.equal(replayed, eager_fixed)}; vs eager unpadded rel {diff:.2e}; "
          f"logs {logs}")
    assert torch.equal(replayed, eager_fixed)
    assert diff < 1e-2
    # replaying again after another row overwrote the static buffers gives the first row's states again
    t.hidden_states_packed(*_row([2000, 2000, 96], seed=4))
    assert torch.equal(t.hidden_states_packed(ids, cu), replayed)


@pytest.mark.skipif(not HAVE_FAST, reason="needs flash-linear-attention and causal-conv1d")
def test_a_different_document_count_replays_without_recapture() -> None:
    """Rows of 3, 6 and 12 documents (with the tail's pieces, within the 16-slot bucket) replay the one graph; each
    equals its eager fixed-shape forward; a row of 40 documents captures the 64-slot bucket once."""
    t, logs = _graph_target()
    assert t.graphs is not None
    for k, lengths in enumerate(([1500, 1500, 1000], [700] * 5 + [500], [300] * 12)):
        ids, cu = _row(lengths, seed=10 + k)
        out = t.hidden_states_packed(ids, cu).clone()
        fixed = fixed_packed_inputs(ids, cu, BUDGET, MAX_LEN, t.graphs.buckets)
        assert fixed.slots == 16
        assert torch.equal(out, t.hidden_states_fixed(fixed)[:, : ids.shape[1]]), lengths
    assert t.graphs.captures == 1 and t.graphs.replays == 3 and t.graphs.failed is None, logs
    ids, cu = _row([100] * 40, seed=20)
    t.hidden_states_packed(ids, cu)
    assert t.graphs.captures == 2 and sorted(t.graphs.graphs) == [16, 64], logs
    print(f"captures {t.graphs.captures}, replays {t.graphs.replays}; logs {logs}")


_TRAIN = r"""
import sys
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/gpu")
from dflash_fixtures import run_config
from test_gpu_checks import GPU_ARCH
from dflash.train import train
cfg = run_config(target={"arch": GPU_ARCH, "seed": 0, "cuda_graph": "on"},
                 train={"max_steps": 8, "checkpoint_every": 0, "compile": "false", "eval_every": 0})
print(train(cfg, sys.argv[1]).exit_code)
"""


@pytest.mark.skipif(not HAVE_FAST, reason="needs flash-linear-attention and causal-conv1d")
def test_dflash_train_captures_every_bucket_its_schedule_needs_before_the_first_step(tmp_path) -> None:
    """dflash/train.py `_precapture_graphs`: one real buffer per document-slot bucket the schedule needs runs through
    the target before the first step, so no step captures (a mid-run capture stalled step 37 of the 4B-like run)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _TRAIN, str(out)], cwd=repo, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "0", proc.stderr[-3000:]
    lines = (out / "train.log").read_text().splitlines()
    pre = [i for i, ln in enumerate(lines) if "captured before the first step" in ln]
    first_step = next(i for i, ln in enumerate(lines) if " step 1/" in ln)
    captures = [i for i, ln in enumerate(lines) if "captured the packed forward for" in ln]
    print("\n".join(ln for ln in lines if "cuda_graph" in ln))
    assert len(pre) == 1 and pre[0] < first_step, lines[:40]
    assert captures and all(i < pre[0] for i in captures), "a step captured a graph after the precapture"
    assert "runs eagerly" not in lines[pre[0]]
