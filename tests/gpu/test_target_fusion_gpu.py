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
    t = Target(TargetConfig(arch=ARCH), num_draft_layers=2, device=torch.device("cuda"))
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
