"""The target's norms and MLP activation through compiled fused functions (dflash/target_fusion.py): the same hidden
states as transformers' eager modules, only while switched on, and eager again for any module whose math differs.
Run on the CPU with inductor (its C++ backend: the same traced graphs the GPU's Triton backend lowers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash import target_fusion
from dflash.target import build_target_model
from dflash.target_config import TargetConfig
from dflash.target_fusion import GATED_NORM, MLP, NORM, fuse


@pytest.fixture(scope="module")
def model() -> nn.Module:
    m = build_target_model(TargetConfig(seed=3), 97, dtype=torch.float32)
    m.eval().requires_grad_(False)
    with torch.no_grad():  # random-init norms are all ones / zeros: give them weights the formula can get wrong
        for mod in m.modules():
            if type(mod).__name__ in (NORM, GATED_NORM):
                mod.weight.normal_(0.0, 0.5)
    return m


def hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state


def test_fused_forward_equals_transformers_eager_and_only_while_on(model: nn.Module) -> None:
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    eager = hidden(model, ids)
    lines: list[str] = []
    fusion = fuse(model, log=lines.append)
    try:
        cfg = model.config.get_text_config()
        layers, full = cfg.num_hidden_layers, cfg.layer_types.count("full_attention")
        # two norms per layer, q/k norms per full-attention layer, the final norm; a gated norm per GDN layer
        assert fusion.patched == {NORM: 2 * layers + 2 * full + 1, GATED_NORM: layers - full, MLP: layers}
        assert torch.equal(hidden(model, ids), eager)  # off: the class's own forward, bit for bit
        assert fusion.checked == {}
        with fusion.on():
            hidden(model, ids)  # the first module of each kind: checked against eager (which it returns)
            fused = hidden(model, ids)
        assert set(fusion.checked) == {NORM, GATED_NORM, MLP} and not fusion.refused and not lines
        assert max(fusion.checked.values()) < 1e-5
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
        assert not torch.equal(fused, torch.zeros_like(fused))
        assert torch.equal(hidden(model, ids), eager)  # off again after the block
    finally:
        assert target_fusion.unfuse(model) == sum(fusion.patched.values())
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_module_whose_math_differs_goes_back_to_eager_with_a_log_line() -> None:
    """Another transformers version could change a formula (here: Llama's x.to(dtype) * w instead of Qwen3.5's
    zero-centred fp32 weight): the first call finds it and that kind stays eager."""

    class Qwen3_5RMSNorm(nn.Module):  # noqa: N801 - the transformers class name is what fuse() recognises
        def __init__(self) -> None:
            super().__init__()
            self.eps = 1e-6
            self.weight = nn.Parameter(torch.randn(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    class SiluFree(nn.Module):  # an MLP with another activation is never patched
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            self.act_fn = nn.GELU()

    SiluFree.__name__ = MLP
    net = nn.Sequential(Qwen3_5RMSNorm(), SiluFree())
    lines: list[str] = []
    fusion = fuse(net, backend="eager", log=lines.append)
    assert fusion.patched == {NORM: 1}
    x = torch.randn(3, 16)
    eager = net[0](x)
    with fusion.on():
        assert torch.equal(net[0](x), eager)
        assert NORM in fusion.refused and "back to eager" in lines[0] and NORM in lines[0]
        assert torch.equal(net[0](x), eager)  # stays eager
    assert "target.fused_elementwise: compiled (eager) for 1 Qwen3_5RMSNorm" == target_fusion.describe(fusion)


def test_the_functions_restate_transformers_formulas_in_bf16() -> None:
    """bf16 inputs as on the GPU: each function against the class it restates, bit for bit, uncompiled and compiled
    by inductor (which rounds the bf16 intermediates as eager does: without emulate_precision_casts a third of the
    gated norm's outputs differed in their last bit here)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 512, generator=g).bfloat16()
    gate = torch.randn(64, 512, generator=g).bfloat16()
    norm = q.Qwen3_5RMSNorm(512, eps=1e-6).bfloat16()
    gated = q.Qwen3_5RMSNormGated(512, eps=1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.normal_(generator=g)
        gated.weight.normal_(generator=g)
        assert torch.equal(target_fusion.rms_norm(x, norm.weight, norm.eps), norm(x))
        assert torch.equal(target_fusion.rms_norm_gated(x, gate, gated.weight, gated.variance_epsilon), gated(x, gate))
        assert torch.equal(target_fusion.silu_mul(x, gate), nn.functional.silu(x) * gate)
        fns = target_fusion.Fusion().fns
        assert torch.equal(fns[NORM](x, norm.weight, norm.eps), norm(x))
        assert torch.equal(fns[GATED_NORM](x, gate, gated.weight, gated.variance_epsilon), gated(x, gate))
        assert torch.equal(fns[MLP](x, gate), nn.functional.silu(x) * gate)


def test_the_setting_is_checked_and_only_the_packed_forward_takes_the_fused_path() -> None:
    from dflash.config import ConfigError, config_from_dict
    from dflash.target import Target, resolve_fused_elementwise

    with pytest.raises(ConfigError, match=r"target.fused_elementwise.*expected one of off, auto, on, got 'yes'"):
        config_from_dict({"target": {"fused_elementwise": "yes"}})
    assert config_from_dict({"target": {"fused_elementwise": "on"}}).target.fused_elementwise == "on"
    cpu = torch.device("cpu")
    assert Target(TargetConfig(), num_draft_layers=2, device=cpu).fusion is None  # off by default
    # only the packed varlen forward (CUDA, fla) uses the fused kernels: auto leaves the padded path alone, on refuses
    assert Target(TargetConfig(fused_elementwise="auto"), num_draft_layers=2, device=cpu).fusion is None
    with pytest.raises(ValueError, match=r"^target.fused_elementwise=on fuses the packed varlen target forward; this "
                                         r"target packs 'pad' .* Use fused_elementwise: auto or off.$"):
        Target(TargetConfig(fused_elementwise="on"), num_draft_layers=2, device=cpu)
    assert [resolve_fused_elementwise(c, "varlen") for c in ("off", "auto", "on")] == [False, True, True]

    t = Target(TargetConfig(seed=4), num_draft_layers=2, device=cpu)
    t.fusion = fuse(t.model)  # what a varlen target gets (resolved above); the padded path must still ignore it
    assert t.fusion.patched[NORM] > 0
    ids = torch.randint(0, t.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    padded = t.hidden_states(ids, mask)  # the padded path (and cached decoding): eager, never compiled
    assert t.fusion.checked == {}
    packed = t._tapped(fused=True, input_ids=ids, attention_mask=mask)  # what the packed paths call
    assert set(t.fusion.checked) == {NORM, GATED_NORM, MLP} and not t.fusion.refused
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_rows_of_every_length_reuse_the_compiled_graphs(model: nn.Module) -> None:
    """Training's packed rows vary in length (no fixed shape without the CUDA graph): after one recompile with the
    token count symbolic, no length compiles again (static shapes recompiled per length until dynamo's limit)."""
    from torch._dynamo.utils import counters

    fusion = fuse(model)
    try:
        torch._dynamo.reset()
        counters.clear()
        with fusion.on():
            for n in (40, 41, 57):
                hidden(model, torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(n)))
            after_three = counters["stats"]["unique_graphs"]
            for n in (23, 64, 99, 130, 31):
                out = hidden(model, torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(n)))
        assert counters["stats"]["unique_graphs"] == after_three
        # norms of [1, T, H] and [1, T, heads, d] (q/k norms), the gated norm, the MLP: each static, then symbolic
        assert after_three <= 2 * 5
        assert not fusion.refused
        eager = (target_fusion.unfuse(model), hidden(model, torch.randint(0, 97, (1, 31),
                                                                           generator=torch.Generator().manual_seed(31))))[1]
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    finally:
        target_fusion.unfuse(model)


def test_a_compiled_function_that_fails_costs_a_log_line_not_the_step(model: nn.Module) -> None:
    """A compiler error at the first fused call (another torch, no C++ compiler, a Triton bug): that kind runs eager
    from then on, the forward's result is eager's, and the run goes on."""
    ids = torch.randint(0, 97, (1, 33), generator=torch.Generator().manual_seed(9))
    eager = hidden(model, ids)
    lines: list[str] = []
    fusion = fuse(model, backend="eager", log=lines.append)
    calls = {"n": 0}

    def broken(*args: object) -> torch.Tensor:
        calls["n"] += 1
        raise RuntimeError("InductorError: no working C++ compiler")

    fusion.fns[GATED_NORM] = broken
    try:
        with fusion.on():
            out = hidden(model, ids)
            again = hidden(model, ids)
        assert calls["n"] == 1  # refused after the first failure: never tried again
        assert set(fusion.refused) == {GATED_NORM}
        assert fusion.refused[GATED_NORM].startswith("the compiled function failed: RuntimeError: InductorError")
        assert lines == [f"target.fused_elementwise: {GATED_NORM} back to eager: {fusion.refused[GATED_NORM]}"]
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again, eager, rtol=1e-5, atol=1e-5)
    finally:
        target_fusion.unfuse(model)
