"""GPU: issue 40's recipe options run inside the real compiled training step (flex-attention, torch.compile of the
whole drafter step) without a recompile after warm-up, with a finite, falling loss: D-PACE's extra no-grad pass over
the block logits, per-document anchor sampling (scatter_add + topk) and Muon on CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dflash_fixtures import run_config

from dflash.train import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VARIANTS = {
    "dpace": {"drafter": {"position_weights": "dpace"}},
    "document": {"drafter": {"anchor_sampling": "document"}},
    "muon": {"train": {"optimizer": "muon"}},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_recipe_option_trains_compiled_without_recompiles(name: str, tmp_path: Path) -> None:
    sections = {"drafter": {"num_anchors": 64, "attention": "auto"},
                "data": {"token_budget": 1024, "max_len": 96},
                "train": {"max_steps": 40, "checkpoint_every": 0, "eval_every": 0, "compile": "true"}}
    for sec, fields in VARIANTS[name].items():
        sections[sec] = {**sections.get(sec, {}), **fields}
    res = train(run_config(**sections), tmp_path / name)
    assert res.exit_code == 0, (tmp_path / name / "train.log").read_text()[-3000:]
    steps = [json.loads(line) for line in (tmp_path / name / "events.jsonl").read_text().splitlines()
             if '"kind": "step"' in line or '"kind":"step"' in line]
    assert len(steps) == 40
    losses = [s["loss"] for s in steps]
    print(f"{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f}; recompiles {[s.get('recompiles') for s in steps][-1]}")
    assert all(torch.isfinite(torch.tensor(v)) for v in losses)
    assert sum(losses[-5:]) < sum(losses[:5])
    assert steps[-1].get("recompiles", 0) == 0
