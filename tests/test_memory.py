"""drafter.grad_checkpoint auto (issue 24 item 2): the decision from a memory budget, and HFU counting what recomputes."""

from __future__ import annotations

import pytest
import torch

from dflash.flops import DrafterShape, drafter_step_flops
from dflash.memory import (
    GIB,
    DrafterMemoryShape,
    apply_auto_checkpoint,
    auto_checkpoint,
    checkpointed_layer_bytes,
    choose_checkpoint_layers,
    layer_activation_bytes,
    resolve_grad_checkpoint,
)

SHAPE = DrafterMemoryShape(num_layers=5, n_ctx=16384, m=512 * 16, hidden=5120, q_width=5120, kv_width=1024,
                           intermediate=17408)


def test_all_layers_fit_none_checkpointed_tight_some_nothing_fits_all() -> None:
    assert choose_checkpoint_layers(5, 10, 1, 50) == 0  # exactly fits
    assert choose_checkpoint_layers(5, 10, 1, 49) == 1  # one layer over by 1 byte: checkpoint one (saves 9)
    assert choose_checkpoint_layers(5, 10, 1, 32) == 2  # 50 - 32 = 18 to save, 9 per layer
    assert choose_checkpoint_layers(5, 10, 1, 0) == 5
    assert choose_checkpoint_layers(5, 10, 10, 0) == 5  # checkpointing saves nothing: all, the most it can do
    with pytest.raises(ValueError, match="num_layers"):
        choose_checkpoint_layers(0, 10, 1, 100)


def test_the_estimate_counts_the_model_dims_and_the_decision_follows_free_memory() -> None:
    per = layer_activation_bytes(SHAPE)
    m = 512 * 16
    assert per == 2 * (m * (6 * 5120 + 3 * 5120 + 4 * 17408) + (16384 + m) * 4 * 1024)
    assert checkpointed_layer_bytes(SHAPE) == 2 * m * 5120
    roomy = auto_checkpoint(SHAPE, free_bytes=100 * GIB, fixed_bytes=10 * GIB)
    assert roomy.layers == 0 and "0 of 5 layers checkpointed" in roomy.line()
    tight = auto_checkpoint(SHAPE, free_bytes=10 * GIB + 8 * GIB + 3 * per, fixed_bytes=10 * GIB)
    assert 0 < tight.layers < 5
    assert (5 - tight.layers) * per + tight.layers * checkpointed_layer_bytes(SHAPE) <= 3 * per
    full = auto_checkpoint(SHAPE, free_bytes=5 * GIB, fixed_bytes=10 * GIB)
    assert full.layers == 5 and full.available_gib == 0


def test_setting_resolves_before_any_measurement_and_is_validated() -> None:
    assert resolve_grad_checkpoint(True, 5) == 5 and resolve_grad_checkpoint(False, 5) == 0
    assert resolve_grad_checkpoint("auto", 5) == 5  # safe until measured
    with pytest.raises(ValueError, match="true, false or auto"):
        resolve_grad_checkpoint("sometimes", 5)


def test_hfu_counts_only_the_checkpointed_layers_recompute() -> None:
    base = dict(hidden=256, num_taps=3, num_heads=4, num_kv_heads=2, head_dim=64, intermediate=768, vocab=1000,
                n_ctx=1024, num_anchors=16, block_size=4, pairs=[5000, 7000, 9000])
    none = drafter_step_flops(DrafterShape(**base))
    full = drafter_step_flops(DrafterShape(**base, grad_checkpoint=True))
    one = drafter_step_flops(DrafterShape(**base, grad_checkpoint=True, checkpoint_layers=1))
    three = drafter_step_flops(DrafterShape(**base, grad_checkpoint=True, checkpoint_layers=3))
    assert none.model == one.model == full.model  # MFU's numerator never changes
    assert none.hardware < one.hardware < full.hardware and three.hardware == pytest.approx(full.hardware)
    dense = (none.parts["q_o_proj"] + none.parts["kv_proj"] + none.parts["mlp"]) / 3
    assert one.hardware - none.hardware == pytest.approx(dense + 4.0 * 256 * 5000)  # layer 0 only


def test_auto_on_a_cpu_changes_nothing_and_the_drafter_checkpoints_the_first_k_layers() -> None:
    from dflash.model import DFlashDrafter, DrafterConfig

    cfg = DrafterConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, block_size=4, num_anchors=4,
                        mask_token_id=1, grad_checkpoint="auto")
    d = DFlashDrafter(cfg, 64, 2)
    assert d.checkpoint_layers == 3
    assert apply_auto_checkpoint(d, 256, 128, torch.device("cpu"), log=lambda m: pytest.fail(m)) is None
    assert DFlashDrafter(DrafterConfig(num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, block_size=4,
                                       num_anchors=4, mask_token_id=1), 64, 2).checkpoint_layers == 0


def test_config_takes_auto_and_refuses_other_words_by_field(tmp_path) -> None:
    from pathlib import Path

    from dflash.config import load_config

    base = (Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml").read_text()
    for value, ok in (("auto", True), ("true", True), ("sometimes", False)):
        p = tmp_path / f"{value}.yaml"
        p.write_text(base.replace("drafter:\n", f"drafter:\n  grad_checkpoint: {value}\n", 1))
        if ok:
            assert load_config(p).drafter.grad_checkpoint in ("auto", True)
        else:
            with pytest.raises(Exception, match=r"drafter\.grad_checkpoint.*true, false or auto"):
                load_config(p)
