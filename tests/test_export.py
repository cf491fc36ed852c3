"""Tests of `dflash export`: a trained tiny checkpoint becomes a loadable DFlashDraftModel-format HF directory.

The weights must load strictly into transformers' own Qwen3 decoder layer, proving the qwen3-style names and shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dflash_fixtures import run_config
from safetensors.torch import load_file as load_safetensors

from dflash.checkpoint import CheckpointError, load_file
from dflash.export import ExportError, export_checkpoint
from dflash.train import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    cfg = run_config(train={"max_steps": 2, "checkpoint_every": 0},
                     drafter={"num_layers": 2, "layer_sliding_windows": [16, None]},
                     target={"tap_layers": [0, 2]})
    assert train(cfg, out).exit_code == 0
    return out / "checkpoints" / "step-2"


def test_export_writes_dflash_config_and_qwen3_weights(trained: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    dst = export_checkpoint(trained, tmp_path / "hf")
    cfg = json.loads((dst / "config.json").read_text())
    meta = load_file(trained, "meta.json")
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2]
    assert cfg["dflash_config"]["mask_token_id"] == meta["drafter"]["mask_token_id"]
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 4
    assert cfg["num_target_layers"] == 4 and cfg["num_hidden_layers"] == 2
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 16

    weights = load_safetensors(str(dst / "model.safetensors"))
    state = load_file(trained, "drafter.pt")
    assert set(weights) == set(state)
    assert all(torch.equal(weights[k], state[k]) for k in state)
    assert weights["fc.weight"].shape == (32, 2 * 32)  # two taps of a 32-wide target

    hf = AutoConfig.from_pretrained(str(dst))
    assert hf.model_type == "qwen3" and hf.hidden_size == 32 and hf.head_dim == cfg["head_dim"]
    for i in range(2):
        layer = Qwen3DecoderLayer(hf, i)
        prefix = f"layers.{i}."
        layer.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}, strict=True)


def test_export_refuses_corrupt_checkpoint_and_non_empty_out(trained: Path, tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep me")
    with pytest.raises(ExportError, match="not an empty directory"):
        export_checkpoint(trained, busy)
    assert (busy / "x").read_text() == "keep me"
    import shutil

    broken = tmp_path / "step-2"
    shutil.copytree(trained, broken)
    with open(broken / "drafter.pt", "r+b") as fh:
        fh.seek(100)
        fh.write(b"\x00\x01\x02")
    with pytest.raises(CheckpointError, match=r"drafter\.pt: sha256"):
        export_checkpoint(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()
