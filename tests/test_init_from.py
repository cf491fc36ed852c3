"""`dflash train --init-from EXPORT_DIR`: a new run starts from an exported (or released) z-lab-layout drafter.

Round trip: run A is exported; run B starts from that export through the real CLI. "B's drafter before its first
step" is observed through B's step-1 checkpoint with train.lr = 1e-30: AdamW then moves no float32 weight (the update
is ~1e-29 against weights >= 1e-3 whose spacing is >= 1e-10, and the decay factor 1 - 1e-32 rounds to 1), so the
checkpoint holds exactly the weights B started from; they must be the export's, and give the exported model's logits.
A mismatch (taps, block size, mask token, shapes) is refused with one line, exit 2, and nothing written to --out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from dflash_fixtures import run_config, tiny_run_yaml
from safetensors.torch import load_file as load_safetensors

from dflash.cli import main
from dflash.export import export_checkpoint
from dflash.train import train

DRAFTER = {"num_layers": 2, "layer_sliding_windows": [3, None]}
TARGET = {"tap_layers": [0, 2]}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run-a")
    cfg = run_config(train={"max_steps": 3, "checkpoint_every": 0, "eval_every": 0}, drafter=DRAFTER, target=TARGET)
    assert train(cfg, out).exit_code == 0
    return export_checkpoint(out / "checkpoints" / "step-3", tmp_path_factory.mktemp("exp") / "hf", dtype="float32")


def _config(tmp_path: Path, **sections: dict[str, Any]) -> Path:
    raw = tiny_run_yaml(drafter=dict(DRAFTER), target=dict(TARGET))
    raw["train"].update({"max_steps": 1, "checkpoint_every": 0, "eval_every": 0, "lr": 1e-30})
    for name, values in sections.items():
        raw[name].update(values)
    p = tmp_path / "run.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_init_from_round_trip_starts_from_the_exported_weights_and_logits(exported: Path, tmp_path: Path) -> None:
    from transformers import AutoModel

    from dflash.checkpoint import load_file
    from dflash.model import DraftBatch

    out = tmp_path / "run-b"
    assert main(["train", "--config", str(_config(tmp_path)), "--out", str(out), "--init-from", str(exported)]) == 0
    log = (out / "train.log").read_text()
    assert f"drafter initialised from {exported.resolve()} (float32 weights" in log
    state = load_file(out / "checkpoints" / "step-1", "drafter.pt")
    weights = load_safetensors(str(exported / "model.safetensors"))
    assert set(state) == set(weights) and all(torch.equal(state[k], weights[k]) for k in weights)

    from dflash.eval import load_checkpoint

    ours = load_checkpoint(out / "checkpoints" / "step-1").drafter
    hf = AutoModel.from_pretrained(str(exported), trust_remote_code=True).eval()
    meta = load_file(out / "checkpoints" / "step-1", "meta.json")
    vocab, b, mask = int(meta["target"]["vocab_size"]), ours.cfg.block_size, int(ours.cfg.mask_token_id)
    assert json.loads((exported / "config.json").read_text())["dflash_config"]["mask_token_id"] == mask
    g = torch.Generator().manual_seed(0)
    emb, head = torch.nn.Embedding(vocab, 32), torch.nn.Linear(32, vocab, bias=False)
    n = 24
    batch = DraftBatch(hidden=torch.randn(n, 64, generator=g), input_ids=torch.randint(0, vocab - 1, (n,), generator=g),
                       loss_mask=torch.ones(n, dtype=torch.bool), position_ids=torch.arange(n),
                       doc_ids=torch.zeros(n, dtype=torch.long))
    anchors = torch.tensor([2, 9, 17])
    with torch.no_grad():
        want = head(ours.block_states(batch, emb, anchors)).view(len(anchors), b, vocab)
        for j, a in enumerate(anchors.tolist()):
            block = torch.full((b,), mask)
            block[0] = batch.input_ids[a]
            got = hf(position_ids=torch.arange(0, a + b)[None], noise_embedding=emb(block)[None],
                     target_hidden=batch.hidden[:a][None])
            torch.testing.assert_close(head(got[0]), want[j], rtol=1e-5, atol=1e-5)


REFUSED = [
    ("taps", {"target": {"tap_layers": [1, 2]}}, "it reads target layers [0, 2], this run taps [1, 2]; set "
                                                 "target.tap_layers: [0, 2]"),
    ("block size", {"drafter": {"block_size": 8}}, "block size 4, this run drafts 8; set drafter.block_size: 4"),
    ("mask token", {"drafter": {"mask_token_id": 5}}, "this run's is 5; set drafter.mask_token_id:"),
    ("layers", {"drafter": {"num_layers": 1, "layer_sliding_windows": [3]}, "target": {"tap_layers": [0, 2]}},
     "2 layers, drafter.num_layers is 1"),
    ("heads", {"drafter": {"num_heads": 4, "num_kv_heads": 2}}, "has shape"),
    ("windows", {"drafter": {"layer_sliding_windows": [None, None]}}, "per-layer sliding windows [3, None]"),
]


@pytest.mark.parametrize("what,sections,line", REFUSED, ids=[r[0] for r in REFUSED])
def test_init_from_refuses_a_mismatch_with_one_line_and_writes_nothing(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str,
        sections: dict[str, Any], line: str) -> None:
    out = tmp_path / "out"
    rc = main(["train", "--config", str(_config(tmp_path, **sections)), "--out", str(out), "--init-from",
               str(exported)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, what
    assert len(err) == 1 and err[0].startswith(f"dflash: --init-from {exported.resolve()}: ") and line in err[0], err
    assert not out.exists()


def test_init_from_a_directory_that_is_not_an_export_is_refused(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["train", "--config", str(_config(tmp_path)), "--out", str(out), "--init-from",
                 str(tmp_path)]) == 2
    assert "not a drafter export" in capsys.readouterr().err and not out.exists()


def test_train_checks_init_from_again_when_it_builds_the_drafter(exported: Path, tmp_path: Path) -> None:
    """A config given to train() directly (not through the CLI) is checked where the drafter is built."""
    cfg = run_config(train={"max_steps": 1, "checkpoint_every": 0, "eval_every": 0, "init_from": str(exported)},
                     drafter={**DRAFTER, "block_size": 8}, target=TARGET)
    result = train(cfg, tmp_path / "out")
    assert result.exit_code == 2
    assert "set drafter.block_size: 4" in (tmp_path / "out" / "train.log").read_text()


def _zlab(exported: Path, tmp_path: Path, edit: Any) -> Path:
    import shutil

    zlab = tmp_path / "zlab"
    shutil.copytree(exported, zlab)
    cfg = json.loads((zlab / "config.json").read_text())
    edit(cfg)
    (zlab / "config.json").write_text(json.dumps(cfg))
    return zlab


def test_a_z_lab_config_without_is_causal_trains_with_its_causal_sliding_layers(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """z-lab's default (no is_causal): its sliding layer drafts the block causally. A run that says
    drafter.sliding_block_causal: true starts from it and keeps that rule (its export leaves is_causal out again);
    one that does not is told the field to set; dflash eval measures it with the causal rule."""
    from dflash.checkpoint import load_file
    from dflash.eval import load_export
    from dflash.export_check import TRAINED_RULE_KEY

    zlab = _zlab(exported, tmp_path, lambda c: (c.pop("is_causal"), c.pop(TRAINED_RULE_KEY)))
    out = tmp_path / "out"
    rc = main(["train", "--config", str(_config(tmp_path)), "--out", str(out), "--init-from", str(zlab)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "layers [0] draft the block causally" in err[0] and "no is_causal" in err[0]
    assert "set drafter.sliding_block_causal: true" in err[0]
    assert not out.exists()
    loaded = load_export(zlab)
    assert loaded.tap_layers == [0, 2] and loaded.drafter.cfg.sliding_block_causal is True
    assert [r.causal for r in loaded.drafter.rules] == [True, False]

    rc = main(["train", "--config", str(_config(tmp_path, drafter={"sliding_block_causal": True})), "--out", str(out),
               "--init-from", str(zlab)])
    assert rc == 0, capsys.readouterr().err
    ckpt = out / "checkpoints" / "step-1"
    assert load_file(ckpt, "meta.json")["drafter"]["sliding_block_causal"] is True
    again = export_checkpoint(ckpt, tmp_path / "again")
    cfg = json.loads((again / "config.json").read_text())
    assert "is_causal" not in cfg and cfg[TRAINED_RULE_KEY]["sliding_block_causal"] is True

    # an explicit is_causal false (bidirectional, as our export says): a causal run is told to turn it off
    bidir = _zlab(exported, tmp_path / "b", lambda c: None)
    rc = main(["train", "--config", str(_config(tmp_path, drafter={"sliding_block_causal": True})),
               "--out", str(tmp_path / "out2"), "--init-from", str(bidir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "block is bidirectional in every layer" in err[0]
    assert "set drafter.sliding_block_causal: false" in err[0]
    assert load_export(bidir).drafter.cfg.sliding_block_causal is False
    # speculators' window cannot start from an engine-rule drafter
    rc = main(["train", "--config", str(_config(tmp_path, drafter={"sliding_block_causal": True,
                                                                    "sliding_window_from": "anchor"})),
               "--out", str(tmp_path / "out3"), "--init-from", str(zlab)])
    assert rc == 2 and "set drafter.sliding_window_from: query" in capsys.readouterr().err


@pytest.mark.parametrize("what,edit,line", [
    ("is_causal true", lambda c: c.update(is_causal=True), "layers [0, 1] draft the block causally (is_causal is true)"),
    ("dflash_config.causal", lambda c: (c.pop("is_causal"), c["dflash_config"].update(causal=True)),
     "layers [0, 1] draft the block causally (dflash_config.causal is true)"),
])
def test_a_config_causal_in_its_full_attention_layers_is_still_refused(
        exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str, edit: Any, line: str) -> None:
    """Causal in every layer (a full-attention one included) is no drafter config: training from it, or measuring
    its tau, would silently change what its full layer computes."""
    from dflash.eval import EvalError, load_export

    zlab = _zlab(exported, tmp_path, edit)
    out = tmp_path / "out"
    for causal in ("false", "true"):
        rc = main(["train", "--config", str(_config(tmp_path, drafter={"sliding_block_causal": causal == "true"})),
                   "--out", str(out), "--init-from", str(zlab)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and line in err[0], (what, err)
        assert not out.exists()
    with pytest.raises(EvalError, match=line.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        load_export(zlab)
