"""The target's fused norms / MLP activation (dflash/target_fusion.py) on the GPU: inductor's Triton kernels give the
packed forward's hidden states to bf16 rounding, and no kind is sent back to eager. Run by bench/gpu_checks.sh
(with the fla / causal-conv1d wheels); tests/test_target_fusion.py checks the same on the CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_cuda_graph_target import ARCH, _row

from dflash import target_fusion
from dflash.target import Target, TargetConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs the fla wheel")]


def test_fused_packed_forward_equals_eager_to_bf16_rounding() -> None:
    t = Target(TargetConfig(arch=ARCH, fused_elementwise="off"), num_draft_layers=2, device=torch.device("cuda"))
    assert t.packing == "varlen", t.kernels
    with torch.no_grad():
        for m in t.model.modules():
            if type(m).__name__ in (target_fusion.NORM, target_fusion.GATED_NORM):
                m.weight.normal_(0.0, 0.5)
    ids, cu = _row([300, 1000, 77, 2000, 1, 619], seed=5)
    eager = t.hidden_states_packed(ids, cu).clone()
    lines: list[str] = []
    fusion = target_fusion.fuse(t.model, log=lines.append)
    with fusion.on():
        t.hidden_states_packed(ids, cu)  # compiles; the first module of each kind is checked against eager
        fused = t.hidden_states_packed(ids, cu).clone()
    rel = float((fused.double() - eager.double()).norm() / eager.double().norm())
    print(f"fused vs eager: rel {rel:.2e}; first-call checks {fusion.checked}; patched {fusion.patched}")
    assert not fusion.refused and not lines, (fusion.refused, lines)
    assert set(fusion.checked) == {target_fusion.NORM, target_fusion.GATED_NORM, target_fusion.MLP}
    assert rel < 1e-2
    assert torch.equal(t.hidden_states_packed(ids, cu), eager)  # off again: eager, bit for bit


def test_a_captured_graph_replays_the_fused_kernels() -> None:
    """target.cuda_graph on with target.fused_elementwise on: the fused kernels compile and pass their first-call check
    in the warm-up before the capture, the capture holds them, and the replay equals the fused eager forward over
    the same fixed-shape inputs bit for bit (and eager transformers to bf16 rounding)."""
    from test_cuda_graph_target import BUDGET, MAX_LEN, MIN_LEN

    from dflash.target import fixed_packed_inputs

    logs: list[str] = []
    t = Target(TargetConfig(arch=ARCH, cuda_graph="on", fused_elementwise="on"), num_draft_layers=2,
               device=torch.device("cuda"))
    assert t.packing == "varlen" and t.fusion is not None, t.kernels
    assert t.enable_cuda_graph(BUDGET, MIN_LEN, MAX_LEN, logs.append)
    ids, cu = _row([300, 1000, 77, 2000, 1, 619], seed=6)
    n = ids.shape[1]
    replayed = t.hidden_states_packed(ids, cu).clone()
    assert t.graphs is not None and t.graphs.failed is None, (t.graphs.failed, logs)
    assert t.graphs.captures == 1 and not t.fusion.refused, (t.fusion.refused, logs)
    assert set(t.fusion.checked) == {target_fusion.NORM, target_fusion.GATED_NORM, target_fusion.MLP}
    fixed = fixed_packed_inputs(ids, cu, BUDGET, MAX_LEN, t.graphs.buckets)
    assert torch.equal(replayed, t.hidden_states_fixed(fixed)[:, :n])  # fused eager, the same kernels
    t.fusion.active = False
    fusion, t.fusion = t.fusion, None  # transformers' eager modules over the same inputs
    eager = t.hidden_states_fixed(fixed)[:, :n]
    t.fusion = fusion
    rel = float((replayed.double() - eager.double()).norm() / eager.double().norm())
    print(f"graph + fused vs eager: rel {rel:.2e}; logs {logs}")
    assert rel < 1e-2
