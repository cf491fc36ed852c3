"""The teacher-forced tau (dflash/tau.py) is the decode loop's tau, step for step, on real targets and drafters.

CPU float32: the decode loop (`speculative_generate`) and the teacher-forced walk must produce identical anchors,
drafts, accepted counts and outputs, for the hybrid qwen3_5 target and a full-attention one, at B=8 and B=16, with a
drafter mixing sliding-window and full layers, and for prompt lookup.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from test_eval import VOCAB, attention_target, hybrid_target, prompt
from torch import nn

from dflash.model import DFlashDrafter, DrafterConfig
from dflash.speculative import DFlashProposer, NgramProposer, TargetLM, speculative_generate, target_greedy
from dflash.tau import continuation_length, drafts_at_anchors, walk


def drafter_with(block: int, seed: int = 0, **rule: object) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(num_layers=2, num_heads=2, num_kv_heads=1, block_size=block, mask_token_id=VOCAB - 1,
                        layer_sliding_windows=[6, None], attention="dense", **rule)  # type: ignore[arg-type]
    return DFlashDrafter(cfg, 32, 2).eval()


def overlay(raw: Sequence[int], truth: Sequence[int], anchor: int, block: int) -> list[int]:
    """The first j drafts replaced by the target's true tokens, j = anchor position mod B: every acceptance length
    happens, and the overlay depends on the anchor alone, so both methods apply the same one."""
    j = (anchor * 2654435761 >> 7) % block
    return [*truth[anchor + 1:anchor + 1 + j], *raw[j:]]


class OverlayProposer(DFlashProposer):
    def __init__(self, drafter: DFlashDrafter, target: TargetLM, truth: list[int]) -> None:
        super().__init__(drafter, target.embed_tokens, target.lm_head)
        self.truth, self.raw = truth, {}

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        raw = super().propose(seq, k)
        a = len(seq) - 1
        self.raw[a] = raw
        return overlay(raw, self.truth, a, self.block_size)


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("make", [hybrid_target, attention_target], ids=["qwen3_5", "qwen3"])
def test_teacher_forced_walk_reproduces_the_decode_loop_step_for_step(make: object, block: int) -> None:
    model: nn.Module = make()  # type: ignore[operator]
    target = TargetLM(model, [0, 2])
    drafter = drafter_with(block)
    seen: set[int] = set()
    for seed, max_new in ((1, 40), (2, 33), (3, 57)):
        p = prompt(12, seed)
        truth = [*p, *target_greedy(target, p, continuation_length(max_new, block)).tokens]
        dec_prop = OverlayProposer(drafter, target, truth)
        dec = speculative_generate(target, dec_prop, p, max_new, block)
        _, taps = target.forward(truth, 0, None, keep=1)
        assert taps is not None
        raw = drafts_at_anchors(drafter, target.embed_tokens, target.lm_head, taps, truth, len(p),
                                len(p) + max_new - 2).tolist()
        tf = walk(truth, len(p), lambda a, raw=raw, p=p, truth=truth: overlay(raw[a - len(p)], truth, a, block),
                  max_new, block)
        assert (tf.tokens, tf.anchor_pos, tf.drafts, tf.accepted) == \
            (dec.tokens, dec.anchor_pos, dec.drafts, dec.accepted)
        # The drafter's own drafts at every anchor decoding visited are the teacher-forced pass's, exactly.
        assert {a: raw[a - len(p)] for a in dec.anchor_pos} == dec_prop.raw
        seen |= set(dec.accepted)
        # Prompt lookup on the same text: its proposal depends on the committed prefix alone.
        ng_dec = speculative_generate(target, NgramProposer(), p, max_new, block)
        ng_tf = walk(truth, len(p), lambda a, truth=truth: NgramProposer().propose(truth[:a + 1], block - 1),
                     max_new, block)
        assert (ng_tf.tokens, ng_tf.anchor_pos, ng_tf.drafts, ng_tf.accepted) == \
            (ng_dec.tokens, ng_dec.anchor_pos, ng_dec.drafts, ng_dec.accepted)
    assert len(seen) >= 4 and max(seen) >= block // 2  # short and long acceptances were both exercised


@pytest.mark.parametrize("rule", [{"sliding_block_causal": True},
                                  {"sliding_block_causal": True, "sliding_window_from": "anchor"},
                                  {"sliding_window_from": "anchor"}], ids=["causal", "anchor-causal", "anchor"])
def test_the_decode_loop_drafts_with_the_drafters_own_sliding_rule(rule: dict[str, object]) -> None:
    """The decode loop builds its single-anchor mask per layer from the drafter's rule: its drafts at every anchor
    it visits are the training path's, for each sliding-layer rule."""
    target = TargetLM(attention_target(), [0, 2])
    drafter = drafter_with(8, **rule)
    p = prompt(12, 1)
    truth = [*p, *target_greedy(target, p, continuation_length(40, 8)).tokens]
    dec_prop = OverlayProposer(drafter, target, truth)
    dec = speculative_generate(target, dec_prop, p, 40, 8)
    _, taps = target.forward(truth, 0, None, keep=1)
    assert taps is not None
    raw = drafts_at_anchors(drafter, target.embed_tokens, target.lm_head, taps, truth, len(p), len(p) + 38).tolist()
    assert {a: raw[a - len(p)] for a in dec.anchor_pos} == dec_prop.raw
    bidirectional = drafts_at_anchors(drafter_with(8), target.embed_tokens, target.lm_head, taps, truth, len(p),
                                      len(p) + 38).tolist()
    assert raw != bidirectional  # the rule changes the drafts: the equality above is not vacuous


def test_walk_stops_where_decoding_stops() -> None:
    """A stop token inside an accepted run cuts the output there; the step still counts what was verified."""
    seq = [5, 6, 1, 2, 3, 9, 4, 4, 4, 4, 4, 4]  # prompt [5, 6], then 1 2 3 <stop 9> ...
    g = walk(seq, 2, lambda a: seq[a + 1:a + 4], 20, 4, stop_ids=[9])
    assert g.tokens == [1, 2, 3, 9] and g.anchor_pos == [2] and g.accepted == [3]
    g = walk(seq, 2, lambda a: seq[a + 1:a + 4], 3, 4)  # max_new_tokens cuts the output, not the count
    assert g.tokens == [1, 2, 3] and g.accepted == [3]
    with pytest.raises(ValueError, match="too short to verify a block at anchor"):
        walk(seq[:5], 2, lambda a: [0, 0, 0], 20, 4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dflash_fixtures import run_config

    from dflash.train import train

    out = tmp_path_factory.mktemp("run")
    cfg = run_config(drafter={"block_size": 8, "sliding_window": 16}, train={"max_steps": 4, "checkpoint_every": 0})
    assert train(cfg, out).exit_code == 0
    return out / "checkpoints" / "step-4"


def test_eval_methods_report_the_same_tau_on_a_trained_checkpoint(checkpoint: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from dflash.cli import main

    args = ["eval", "--checkpoint", str(checkpoint), "--json", "--baseline", "ngram", "--num-prompts", "3",
            "--prompt-tokens", "12", "--max-new-tokens", "24"]
    assert main([*args, "--method", "decode"]) == 0
    dec = json.loads(capsys.readouterr().out)
    assert main(args) == 0  # teacher-forced is the default
    tf = json.loads(capsys.readouterr().out)
    assert dec["method"] == "decode" and tf["method"] == "teacher-forced" and dec["lossless"] is True
    for key in ("tau", "accept_by_position", "accept_hist", "steps", "accepted", "tau_ci95", "match_by_position",
                "train_acc_by_position", "train_acc_at_serve_anchors", "new_tokens", "tau_over_ngram"):
        assert tf[key] == dec[key], key
    for key in ("tau", "accept_by_position", "accepted", "tau_ci95"):
        assert tf["baseline"]["ngram"][key] == dec["baseline"]["ngram"][key], key
    assert "tokens_per_s" not in tf and "lossless" not in tf


def test_eval_teacher_forced_human_output_names_what_it_leaves_to_decode(checkpoint: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from dflash.cli import main

    assert main(["eval", "--checkpoint", str(checkpoint), "--num-prompts", "2", "--prompt-tokens", "12",
                 "--max-new-tokens", "8", "--baseline", "ngram"]) == 0
    out = capsys.readouterr().out
    assert "teacher-forced" in out and "acceptance τ (tokens/verify step)" in out and "--method decode" in out
    assert "speed vs target" not in out


def test_eval_temperature_samples_speculatively_and_refuses_teacher_forced(checkpoint: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from dflash.cli import main

    args = ["eval", "--checkpoint", str(checkpoint), "--num-prompts", "2", "--prompt-tokens", "12",
            "--max-new-tokens", "10", "--temperature", "1"]
    assert main([*args, "--json", "--baseline", "ngram", "--seed", "3"]) == 0  # decode is the default at T > 0
    res = json.loads(capsys.readouterr().out)
    assert (res["method"], res["temperature"], res["draft"], res["seed"]) == ("decode", 1.0, "sample", 3)
    assert res["lossless"] is None and "distribution" in res["lossless_check"]
    assert 1.0 <= res["tau"] <= 8 and len(res["accept_by_position"]) == 7 and res["baseline"]["ngram"]["tau"] >= 1
    assert main([*args, "--json", "--baseline", "ngram", "--seed", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["accepted"] == res["accepted"]  # a seed reproduces a run
    assert main([*args, "--method", "teacher-forced"]) == 2
    assert "teacher-forced gives the exact tau of greedy decoding only" in capsys.readouterr().err
