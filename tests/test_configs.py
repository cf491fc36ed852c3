"""Every config shipped in configs/ loads and validates, so a typo in one is caught by CI rather than on a GPU box.

The GPU configs cannot train here; loading them checks every field name, type and the target/drafter shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.config import load_config
from dflash.target import default_tap_layers

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"tiny.yaml", "h200-4b-like.yaml", "qwen3.6-27b.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    arch = cfg.target.arch
    if "layer_types" in arch:
        assert len(arch["layer_types"]) == arch["num_hidden_layers"]
    if cfg.target.path is None:  # random init: the depth is known here
        layers = arch.get("num_hidden_layers", 6)
        taps = cfg.target.tap_layers or default_tap_layers(layers, cfg.drafter.num_layers)
        assert all(0 <= t < layers for t in taps)
    else:  # a model directory on the training box: its depth is only known there
        assert cfg.target.tap_layers is None or cfg.target.tap_layers == sorted(set(cfg.target.tap_layers))
    assert cfg.data.token_budget >= cfg.data.max_len
    assert cfg.drafter.num_anchors * cfg.drafter.block_size <= 4 * cfg.data.token_budget
