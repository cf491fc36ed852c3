"""The recipe options issue 40's ablations compare (drafter.position_weights, drafter.anchor_sampling,
drafter.sliding_block_causal, drafter.sliding_window_from): each computes
what its reference formula says, keeps fixed shapes, and a bad value is refused by the config with its line."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest
import torch
from dflash_fixtures import run_config

from dflash.config import ConfigError, config_from_dict
from dflash.model import DFlashDrafter, DraftBatch, DrafterConfig, dpace_weights, layer_rules, sample_anchors


def _batch(lengths: list[int], n: int, hidden: int = 16, taps: int = 1, seed: int = 0) -> DraftBatch:
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((n,), -1, dtype=torch.long)
    pos = torch.zeros(n, dtype=torch.long)
    start = 0
    for d, length in enumerate(lengths):
        doc[start:start + length] = d
        pos[start:start + length] = torch.arange(length)
        start += length
    return DraftBatch(hidden=torch.randn(n, hidden * taps, generator=g), input_ids=torch.randint(0, 50, (n,), generator=g),
                      loss_mask=doc >= 0, position_ids=pos, doc_ids=doc)


def test_dpace_weights_follow_the_reference_formula() -> None:
    torch.manual_seed(0)
    a, b, h, v = 3, 5, 8, 11
    head = torch.nn.Linear(h, v, bias=False)
    x = torch.randn(a * b, h)
    labels = torch.randint(0, v, (a * b,))
    valid = torch.ones(a, b, dtype=torch.bool)
    valid[:, 0] = False
    valid[2, 3:] = False  # a block cut by its document's end
    alpha = 0.5
    got = dpace_weights(x, head, labels, valid, alpha, chunk=4).reshape(a, b)
    with torch.no_grad():
        p = torch.softmax(head(x).double(), -1).gather(1, labels[:, None]).reshape(a, b)
    for i in range(a):
        for k in range(b):
            if not valid[i, k]:
                assert got[i, k] == 0
                continue
            want = 0.0
            for j in range(k, b):
                if valid[i, j]:
                    prod = 1.0
                    for t in range(j + 1):
                        prod *= float((1 - alpha) * p[i, t] + alpha) if valid[i, t] else 1.0
                    want += prod
            assert float(got[i, k]) == pytest.approx(want, rel=1e-5)
    # a position earlier in the block is part of every longer accepted run: never weighted less
    assert bool((got[:, 1:-1] >= got[:, 2:]).all())


def test_the_loss_is_the_weighted_mean_under_each_position_weighting() -> None:
    torch.manual_seed(1)
    batch = _batch([40, 30, 20], 96)
    emb, head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64, bias=False)
    base = DrafterConfig(num_layers=1, num_heads=2, num_kv_heads=1, block_size=4, num_anchors=8, mask_token_id=63,
                         attention="dense")
    anchors, keep = sample_anchors(batch, 8, 4, torch.Generator().manual_seed(0))
    losses = {}
    for pw in ("exp", "dpace", "uniform"):
        torch.manual_seed(2)
        d = DFlashDrafter(dataclasses.replace(base, position_weights=pw), 16, 1)
        out = d(batch, emb, head, anchors=anchors, keep=keep)
        assert torch.isfinite(out.loss) and out.weight_sum > 0
        losses[pw] = float(out.loss.detach())
        out.loss.backward()  # D-PACE's weights carry no grad; the loss still trains the drafter
        assert d.fc.weight.grad is not None and float(d.fc.weight.grad.abs().sum()) > 0
    assert losses["uniform"] != losses["exp"] != losses["dpace"]


def test_per_document_anchors_give_short_documents_their_share() -> None:
    """One 300-token document and ten of 10 tokens in a 400-token buffer, 40 anchors: drawn over the buffer the
    short documents get ~ 40 x 90/390 ~ 9 anchors; drawn per document ~ 40 x 10/11 ~ 36."""
    batch = _batch([300] + [10] * 10, 400)
    short = {"buffer": 0, "document": 0}
    for seed in range(20):
        for mode in short:
            anchors, keep = sample_anchors(batch, 40, 4, torch.Generator().manual_seed(seed),
                                           per_document=mode == "document")
            assert anchors.shape == (40,) and bool(keep.all())  # fixed shape; enough valid positions
            assert len(set(anchors.tolist())) == 40  # without replacement
            short[mode] += int((batch.doc_ids[anchors] > 0).sum())
    assert short["buffer"] / 20 < 15 and short["document"] / 20 > 28, short


def test_per_document_anchors_pad_with_kept_false_when_too_few_positions() -> None:
    batch = _batch([6, 5], 32)
    anchors, keep = sample_anchors(batch, 16, 4, torch.Generator().manual_seed(0), per_document=True)
    assert anchors.shape == (16,) and int(keep.sum()) == 5 + 4  # a and a+1 supervised, same document


@pytest.mark.parametrize(("field", "value", "words"), [
    ("position_weights", "linear", "expected one of exp, dpace, uniform"),
    ("anchor_sampling", "row", "expected one of buffer, document"),
    ("dpace_alpha", 0.0, "must be in (0, 1]"),
    ("sliding_window_from", "block", "expected one of query, anchor"),
    ("sliding_block_causal", "yes", "expected true or false"),
])
def test_a_bad_recipe_option_is_refused_by_the_config(field: str, value: object, words: str) -> None:
    raw = run_config().to_dict()
    raw["drafter"][field] = value
    with pytest.raises(ConfigError, match=rf"drafter\.{field}.*{words}".replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        config_from_dict(raw, "<test>")


def test_muon_trains_and_a_stopped_run_resumes_bit_identical(tmp_path: Path) -> None:
    """train.optimizer: muon (Muon on 2-D weights + AdamW on the rest): the checkpoint holds both optimizers' and
    schedulers' states, so a run stopped at step 3 and resumed ends on exactly the weights of one that ran through."""
    from dflash.checkpoint import load_file
    from dflash.train import train

    cfg = run_config(train={"max_steps": 6, "checkpoint_every": 3, "keep_last": 5, "optimizer": "muon",
                            "eval_every": 0})
    straight = train(cfg, tmp_path / "a")
    assert straight.exit_code == 0 and straight.losses[-1] < straight.losses[0]
    opt = load_file(tmp_path / "a" / "checkpoints" / "step-6", "optimizer.pt")
    assert len(opt["optimizers"]) == 2  # Muon and AdamW
    b = tmp_path / "b"

    def sigterm_at_3(step: int, _loss: float) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, handled by the run's own handler

    stopped = train(cfg, b, on_step=sigterm_at_3)
    assert (stopped.reason, stopped.step) == ("signal", 3)
    resumed = train(cfg, b, resume=True)
    assert resumed.exit_code == 0 and resumed.losses == straight.losses[3:]
    wa = load_file(tmp_path / "a" / "checkpoints" / "step-6", "drafter.pt")
    wb = load_file(b / "checkpoints" / "step-6", "drafter.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_an_adamw_checkpoint_keeps_adamws_own_state_dict(tmp_path: Path) -> None:
    from dflash.checkpoint import load_file
    from dflash.train import train

    assert train(run_config(train={"max_steps": 2, "eval_every": 0}), tmp_path).exit_code == 0
    opt = load_file(tmp_path / "checkpoints" / "step-2", "optimizer.pt")
    assert "optimizers" not in opt and "param_groups" in opt  # resumable by and from earlier versions


def test_a_peer_bench_variant_selecting_the_sliding_rules_is_a_valid_run_config() -> None:
    """bench/peer.py's --ours-variants go straight into the run config: the sliding-rule ablation must validate."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import peer

    variants = peer.parse_overrides("slc=drafter.layer_sliding_windows:[12,null]+drafter.sliding_block_causal:true;"
                                    "spec=drafter.layer_sliding_windows:[12,null]+drafter.sliding_block_causal:true"
                                    "+drafter.sliding_window_from:anchor")
    for _, changes in variants:
        raw = run_config().to_dict()
        raw["drafter"]["num_layers"] = 2
        for section, fields in changes.items():
            raw[section].update(fields)
        d = config_from_dict(raw, "<variant>").drafter
        assert d.layer_sliding_windows == [12, None] and d.sliding_block_causal is True
    assert d.sliding_window_from == "anchor"
    rules = layer_rules(d, [12, None])
    assert [(r.window, r.causal, r.from_anchor) for r in rules] == [(12, True, True), (None, False, False)]
