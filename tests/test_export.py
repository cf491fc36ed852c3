"""Tests of `dflash export`: a trained tiny checkpoint becomes a loadable DFlashDraftModel-format HF directory.

The weights must load strictly into transformers' own Qwen3 decoder layer, proving the qwen3-style names and shapes;
and `AutoModel.from_pretrained(dir, trust_remote_code=True)` must build the shipped drafter with every weight and
give the logits dflash/model.py gives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
                     drafter={"num_layers": 2, "layer_sliding_windows": [3, None]},
                     target={"tap_layers": [0, 2]})
    assert train(cfg, out).exit_code == 0
    return out / "checkpoints" / "step-2"


@pytest.fixture(scope="module")
def trained_causal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same drafter trained with its sliding layer causal inside the block (z-lab's / vLLM's rule)."""
    out = tmp_path_factory.mktemp("run-causal")
    cfg = run_config(train={"max_steps": 2, "checkpoint_every": 0},
                     drafter={"num_layers": 2, "layer_sliding_windows": [3, None], "sliding_block_causal": True},
                     target={"tap_layers": [0, 2]})
    assert train(cfg, out).exit_code == 0
    return out / "checkpoints" / "step-2"


def test_export_writes_dflash_config_and_qwen3_weights(trained: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    dst = export_checkpoint(trained, tmp_path / "hf")  # bfloat16 by default, like released drafters
    cfg = json.loads((dst / "config.json").read_text())
    meta = load_file(trained, "meta.json")
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"} and (dst / "modeling_dflash.py").is_file()
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2]
    assert cfg["dflash_config"]["mask_token_id"] == meta["drafter"]["mask_token_id"]
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 4
    assert cfg["num_target_layers"] == 4 and cfg["num_hidden_layers"] == 2
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 3

    weights = load_safetensors(str(dst / "model.safetensors"))
    state = load_file(trained, "drafter.pt")
    assert set(weights) == set(state) and cfg["dtype"] == "bfloat16"
    assert all(weights[k].dtype == torch.bfloat16 and torch.equal(weights[k], state[k].to(torch.bfloat16))
               for k in state)
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


def _probe(vocab: int) -> tuple[torch.nn.Embedding, torch.nn.Linear, Any, torch.Tensor]:
    """A frozen embedding / LM head and a packed buffer: doc 0 = 0..29, doc 1 = 30..49, padding after; anchors near a
    doc start (less context than the window of 3), deep inside (the window binds, differently per block row) and in
    the second document."""
    from dflash.model import DraftBatch

    g = torch.Generator().manual_seed(0)
    emb = torch.nn.Embedding(vocab, 32)
    head = torch.nn.Linear(32, vocab, bias=False)
    n = 64
    doc = torch.tensor([0] * 30 + [1] * 20 + [-1] * 14)
    pos = torch.cat([torch.arange(30), torch.arange(20), torch.zeros(14, dtype=torch.long)])
    batch = DraftBatch(hidden=torch.randn(n, 64, generator=g), input_ids=torch.randint(0, vocab - 1, (n,), generator=g),
                       loss_mask=doc >= 0, position_ids=pos, doc_ids=doc)
    return emb, head, batch, torch.tensor([0, 1, 17, 33, 45])


def _hf_block_logits(hf: Any, emb: torch.nn.Embedding, head: torch.nn.Linear, batch: Any, anchors: torch.Tensor,
                     b: int, mask: int) -> torch.Tensor:
    """[A, B, V]: the exported HF model drafting each anchor's block alone, as an engine does."""
    rows = []
    with torch.no_grad():
        for a in anchors.tolist():
            start = 0 if a < 30 else 30  # the anchor's document: its context is every earlier position in it
            block = torch.full((b,), mask)
            block[0] = batch.input_ids[a]
            got = hf(position_ids=torch.arange(0, a - start + b)[None], noise_embedding=emb(block)[None],
                     target_hidden=batch.hidden[start:a][None])
            rows.append(head(got[0]))
    return torch.stack(rows)


@pytest.mark.parametrize("which", ["bidirectional", "causal"])
def test_automodel_with_remote_code_loads_the_drafter_and_matches_dflash_model(
        which: str, trained: Path, trained_causal: Path, tmp_path: Path) -> None:
    """For either sliding-layer rule the export's own modeling file (what engines are checked against) and dflash
    eval's `load_export` both give the training checkpoint's block logits."""
    from transformers import AutoModel

    from dflash.eval import load_checkpoint, load_export
    from dflash.model import DFlashDrafter, DrafterConfig

    ckpt = trained if which == "bidirectional" else trained_causal
    dst = export_checkpoint(ckpt, tmp_path / "hf", dtype="float32")  # exact logits need the training dtype
    hf, info = AutoModel.from_pretrained(str(dst), trust_remote_code=True, output_loading_info=True)
    assert type(hf).__name__ == "DFlashDraftModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = load_file(ckpt, "drafter.pt")
    assert set(hf.state_dict()) == set(state)
    assert all(torch.equal(hf.state_dict()[k], state[k]) for k in state)

    meta = load_file(ckpt, "meta.json")
    dcfg = DrafterConfig(**meta["drafter"])
    assert dcfg.sliding_block_causal is (which == "causal")
    ours = DFlashDrafter(dcfg, target_hidden_size=32, num_taps=2)
    ours.load_state_dict(state)
    ours.eval()
    hf.eval()
    vocab, b = int(meta["target"]["vocab_size"]), dcfg.block_size
    emb, head, batch, anchors = _probe(vocab)
    with torch.no_grad():
        want = head(ours.block_states(batch, emb, anchors)).view(len(anchors), b, vocab)
        from_ckpt = head(load_checkpoint(ckpt).drafter.block_states(batch, emb, anchors)).view(len(anchors), b, vocab)
        loaded = load_export(dst).drafter
        from_export = head(loaded.block_states(batch, emb, anchors)).view(len(anchors), b, vocab)
    assert loaded.cfg.sliding_block_causal is (which == "causal")
    torch.testing.assert_close(from_ckpt, want, rtol=0, atol=0)
    torch.testing.assert_close(from_export, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_hf_block_logits(hf, emb, head, batch, anchors, b, int(dcfg.mask_token_id)), want,
                               rtol=1e-5, atol=1e-5)


def test_a_causal_sliding_drafter_exports_without_is_causal_and_the_rule_decides_its_logits(
        trained_causal: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """sliding_block_causal is served by leaving is_causal out (vLLM, SGLang and z-lab then run the sliding layers
    causal); the trained rule is recorded under our own key, never dflash_config.causal (vLLM reads that). The same
    weights with is_causal false draft different logits, so the round trip above really tests the causal rule."""
    from transformers import AutoModel

    from dflash.cli import main
    from dflash.export_check import TRAINED_RULE_KEY

    dst = export_checkpoint(trained_causal, tmp_path / "hf", dtype="float32")
    cfg = json.loads((dst / "config.json").read_text())
    assert "is_causal" not in cfg and "causal" not in cfg["dflash_config"]
    assert cfg[TRAINED_RULE_KEY] == {"sliding_block_causal": True, "sliding_window_from": "query"}
    assert main(["export", "--check", str(dst)]) == 0
    assert "is what this drafter was trained for" in capsys.readouterr().out

    meta = load_file(trained_causal, "meta.json")
    vocab, b, mask = int(meta["target"]["vocab_size"]), int(meta["drafter"]["block_size"]), \
        int(meta["drafter"]["mask_token_id"])
    emb, head, batch, anchors = _probe(vocab)
    causal = _hf_block_logits(AutoModel.from_pretrained(str(dst), trust_remote_code=True).eval(), emb, head, batch,
                              anchors, b, mask)
    (dst / "config.json").write_text(json.dumps({**cfg, "is_causal": False}))
    bidirectional = _hf_block_logits(AutoModel.from_pretrained(str(dst), trust_remote_code=True).eval(), emb, head,
                                     batch, anchors, b, mask)
    assert (causal - bidirectional).abs().max() > 1e-3


def test_export_refuses_a_window_counted_from_the_anchor_in_one_line(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """speculators' window rule trains and evaluates, but no engine serves it: nothing is written."""
    from dflash.cli import main
    from dflash.eval import load_checkpoint

    out = tmp_path / "run"
    cfg = run_config(train={"max_steps": 1, "checkpoint_every": 0, "eval_every": 0},
                     drafter={"num_layers": 2, "layer_sliding_windows": [3, None], "sliding_window_from": "anchor"},
                     target={"tap_layers": [0, 2]})
    assert train(cfg, out).exit_code == 0
    ckpt = out / "checkpoints" / "step-1"
    assert load_checkpoint(ckpt).drafter.cfg.sliding_window_from == "anchor"
    dst = tmp_path / "hf"
    rc = main(["export", "--checkpoint", str(ckpt), "--out", str(dst)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1, err
    assert "drafter.sliding_window_from: anchor" in err[0] and "no engine serves" in err[0]
    assert not dst.exists() and not list(tmp_path.glob(".hf.tmp*"))


def test_export_files_share_one_mode_from_the_umask_weights_included(trained: Path, tmp_path: Path) -> None:
    """safetensors writes through a 0600 temp file: the weights must be as readable as config.json (a serving user
    other than the exporter reads them)."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        dst = export_checkpoint(trained, tmp_path / "hf")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in dst.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, {k: oct(v) for k, v in modes.items()}
    old = os.umask(0o077)  # a private umask stays private, for the weights too
    try:
        dst = export_checkpoint(trained, tmp_path / "private")
    finally:
        os.umask(old)
    assert {stat.S_IMODE(p.stat().st_mode) for p in dst.iterdir()} == {0o600}


def test_export_info_is_portable_absolute_paths_only_as_informational_fields(trained: Path, tmp_path: Path) -> None:
    import hashlib

    dst = export_checkpoint(trained, tmp_path / "hf")
    info = json.loads((dst / "dflash_export.json").read_text())
    assert "source" not in info and "path" not in info["target"]
    assert info["source_checkpoint"] == "checkpoints/step-2"
    assert info["source_manifest_sha256"] == hashlib.sha256((trained / "manifest.json").read_bytes()).hexdigest()
    assert info["source_local_path_informational"] == str(trained.resolve())
    assert info["target"]["hub_id"] is None and info["target"]["local_path_informational"] is None  # random init
    # every other absolute path lives under a key that says it is informational
    def paths(obj: object, key: str = "") -> list[str]:
        if isinstance(obj, dict):
            return [p for k, v in obj.items() for p in paths(v, k)]
        if isinstance(obj, list):
            return [p for v in obj for p in paths(v, key)]
        return [key] if isinstance(obj, str) and obj.startswith("/") else []
    assert set(paths(info)) == {"source_local_path_informational"}, info


def test_portable_target_keeps_a_hub_id_and_marks_a_local_dir_informational(tmp_path: Path) -> None:
    from dflash.export import portable_target

    facts = {"num_layers": 4, "vocab_size": 10}
    local = tmp_path / "targets" / "abc"
    local.mkdir(parents=True)
    assert portable_target({**facts, "path": str(local)}) == {
        **facts, "hub_id": None, "local_path_informational": str(local.resolve())}
    assert portable_target({**facts, "path": "Qwen/Qwen3-8B"}) == {
        **facts, "hub_id": "Qwen/Qwen3-8B", "local_path_informational": None}
