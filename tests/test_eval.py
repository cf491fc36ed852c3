"""Tests of `dflash eval` and its decoding core: speculative decoding is lossless on hybrid and full-attention targets.

Targets are real transformers models (tiny, random init); the slow reference decoder is written plainly here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from dflash_fixtures import run_config
from torch import nn

from dflash.model import DFlashDrafter, DraftBatch, DrafterConfig
from dflash.speculative import (
    DFlashProposer,
    Generation,
    NgramProposer,
    TargetLM,
    first_difference,
    speculative_generate,
    target_greedy,
)

VOCAB = 96
B = 5


def hybrid_target(seed: int = 0) -> nn.Module:
    """A qwen3_5 hybrid: Gated DeltaNet layers (conv + recurrent state) around one full-attention layer."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
                            linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                            linear_conv_kernel_dim=4, initializer_range=0.25, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def attention_target(seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.25,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def prompt(n: int = 12, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()


class Scripted:
    """Drafts the target's true tokens for the first j block positions and a wrong one after, j cycling through
    `script`: every acceptance length (all rejected .. all accepted) happens, in a known order."""

    name = "scripted"

    def __init__(self, truth: Sequence[int], prompt_len: int, script: Sequence[int]) -> None:
        self.truth, self.p, self.script, self.step = list(truth), prompt_len, list(script), 0

    def start(self, prompt: Sequence[int], taps: torch.Tensor) -> None:
        pass

    def commit(self, taps: torch.Tensor) -> None:
        pass

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        j = self.script[self.step % len(self.script)]
        self.step += 1
        good = self.truth[len(seq) - self.p: len(seq) - self.p + k]
        return good[:j] + [(t + 1) % VOCAB for t in good[j:]]


def scripted_run(model: nn.Module, taps: list[int], max_new: int = 20,
                 readvance: str | None = None) -> tuple[TargetLM, list[int], object]:
    target = TargetLM(model, taps)
    if readvance is not None:
        target.readvance = readvance
    p = prompt()
    truth = target_greedy(target, p, max_new + B).tokens  # long enough that every draft has B-1 true tokens
    script = list(range(B))
    gen = speculative_generate(target, Scripted(truth, len(p), script), p, max_new, B)
    return target, truth, (gen, script)


def crop_only(self: TargetLM, cache: object, snap: object, attn_len: int | None = None) -> None:
    """A wrong rollback: the Gated DeltaNet state treated like a KV cache (cropped, never restored)."""
    self.crop_attention(cache, snap.attn_len if attn_len is None else attn_len)  # type: ignore[attr-defined]


@pytest.mark.parametrize("readvance", ["mixers", "forward"])
def test_hybrid_target_lossless_at_every_acceptance_length(readvance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    target, truth, (gen, script) = scripted_run(hybrid_target(), [0, 2], readvance=readvance)
    assert gen.tokens == truth[:20]
    assert gen.accepted == [script[i % B] for i in range(len(gen.accepted))]  # 0, 1, .., B-1, 0, ...
    assert set(gen.accepted) == set(range(B))
    # One verify forward per step; each step that rejected a draft token re-advances the restored DeltaNet states,
    # through the mixers alone (no extra target forward) or with one more target forward.
    partial = sum(1 for a in gen.accepted[:-1] if a < B - 1)  # the last step ends the output: no rollback
    if readvance == "mixers":
        assert gen.target_forwards == 1 + len(gen.accepted) and target.mixer_readvances == partial
    else:
        assert gen.target_forwards == 1 + len(gen.accepted) + partial and target.mixer_readvances == 0

    monkeypatch.setattr(TargetLM, "restore", crop_only)
    p = prompt()
    broken = speculative_generate(target, Scripted(truth, len(p), script), p, 20, B)
    assert first_difference(truth[:20], broken.tokens) is not None


def test_full_attention_target_lossless_one_forward_per_block() -> None:
    target, truth, (gen, script) = scripted_run(attention_target(), [0, 1])
    assert gen.tokens == truth[:20]
    assert gen.accepted == [script[i % B] for i in range(len(gen.accepted))]
    assert gen.target_forwards == 1 + len(gen.accepted)  # KV cache cropped: never a second forward
    p = prompt()
    ngram = speculative_generate(target, NgramProposer(), p, 20, B)
    assert ngram.tokens == truth[:20]


def test_ngram_proposer_takes_latest_longest_match() -> None:
    ng = NgramProposer(max_ngram=2)
    assert ng.propose([1, 2, 3, 9, 2, 3, 7, 5, 2, 3], 2) == [7, 5]  # latest "2 3" wins over the first one
    assert ng.propose([4, 1, 2, 5, 3, 2], 3) == [5, 3, 2]  # no "3 2" earlier: falls back to the 1-gram "2"
    assert ng.propose([1, 2, 3], 4) == []


def _drafter(seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(num_layers=2, num_heads=2, num_kv_heads=1, block_size=B, mask_token_id=VOCAB - 1,
                        layer_sliding_windows=[6, None], attention="dense")
    return DFlashDrafter(cfg, 32, 2).eval()


class Overlay(DFlashProposer):
    """The real DFlash proposer, its first j drafts replaced by true tokens (j scripted) so acceptances > 0 happen;
    keeps every raw drafter output for comparison."""

    def __init__(self, drafter: DFlashDrafter, target: TargetLM, truth: list[int], p: int) -> None:
        super().__init__(drafter, target.embed_tokens, target.lm_head)
        self.truth, self.p, self.step, self.raw = truth, p, 0, []

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        raw = super().propose(seq, k)
        self.raw.append(raw)
        drafts = overlay(raw, self.truth, len(seq) - self.p, self.step)
        self.step += 1
        return drafts


def overlay(raw: list[int], truth: list[int], i: int, step: int) -> list[int]:
    j = step % B
    return truth[i:i + j] + raw[j:]


def slow_reference(model: nn.Module, taps: list[int], drafter: DFlashDrafter, p: list[int], truth: list[int],
                   max_new: int) -> tuple[list[int], list[int], list[list[int]]]:
    """Speculative decoding with no cache at all: every step re-runs the target on the whole prefix, drafts with the
    drafter's training-path `block_states` over the whole buffer (the anchor's own state included, masked by the
    rule), verifies by re-running the target on prefix + drafts."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    with torch.no_grad():
        seq = list(p)
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        new, accepted, raws, step = [seq[-1]], [], [], 0
        while len(new) < max_new:
            n = len(seq)
            hs = model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
            hidden = torch.cat([hs[t + 1][0] for t in taps], dim=-1)
            batch = DraftBatch(hidden=hidden, input_ids=torch.tensor(seq), loss_mask=torch.ones(n, dtype=torch.bool),
                               position_ids=torch.arange(n), doc_ids=torch.zeros(n, dtype=torch.long))
            states = drafter.block_states(batch, embed, torch.tensor([n - 1]))
            raw = head(states[1:]).argmax(-1).tolist()
            raws.append(raw)
            drafts = overlay(raw, truth, n - len(p), step)
            step += 1
            verified = model(input_ids=torch.tensor([seq + drafts])).logits[0, n - 1:].argmax(-1).tolist()
            k = 0
            while k < len(drafts) and drafts[k] == verified[k]:
                k += 1
            accepted.append(k)
            add = (drafts[:k] + [verified[k]])[: max_new - len(new)]
            seq += add
            new += add
    return new, accepted, raws


@pytest.mark.parametrize("make", [hybrid_target, attention_target], ids=["qwen3_5", "qwen3"])
def test_fast_path_matches_slow_reference(make: object) -> None:
    model = make()  # type: ignore[operator]
    taps = [0, 2]
    drafter = _drafter()
    target = TargetLM(model, taps)
    p = prompt()
    truth = target_greedy(target, p, 24 + B).tokens
    fast_prop = Overlay(drafter, target, truth, len(p))
    fast = speculative_generate(target, fast_prop, p, 24, B)
    slow, slow_accepted, slow_raw = slow_reference(model, taps, drafter, p, truth, 24)
    assert fast.tokens == slow == truth[:24]
    assert fast.accepted == slow_accepted
    assert fast_prop.raw == slow_raw  # the cached drafter context is exactly the training-path context
    assert max(fast.accepted) == B - 1 and min(fast.accepted) == 0


# ----------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dflash.train import train

    out = tmp_path_factory.mktemp("run")
    cfg = run_config(train={"max_steps": 2, "checkpoint_every": 0})
    assert train(cfg, out).exit_code == 0
    return out / "checkpoints" / "step-2"


def test_eval_json_on_a_trained_checkpoint(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dflash.cli import main

    code = main(["eval", "--checkpoint", str(checkpoint), "--json", "--method", "decode", "--baseline", "ngram",
                 "--num-prompts", "2",
                 "--prompt-tokens", "12", "--max-new-tokens", "10"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["lossless"] is True
    b = res["block_size"]
    assert b == 4 and res["prompts"] == 2 and res["new_tokens"] == 20
    assert len(res["accept_hist"]) == b and sum(res["accept_hist"]) == res["steps"]
    assert len(res["accept_by_position"]) == len(res["train_acc_by_position"]) == len(res["match_by_position"]) == b - 1
    assert res["tau"] == pytest.approx(1 + sum(res["accept_by_position"]), abs=1e-3)
    # The training path at the anchors decoding used drafts exactly what serving drafted: no train/serve mismatch.
    assert res["train_acc_at_serve_anchors"] == res["match_by_position"]
    assert set(res["tokens_per_s"]) == {"target", "dflash"} and res["speedup"] > 0
    assert 1.0 <= res["baseline"]["ngram"]["tau"] <= b
    assert "stdlib sources after the embedded corpus cap" in res["prompts_from"]
    lo, hi = res["tau_ci95"]
    assert lo <= res["tau"] <= hi and res["baseline"]["ngram"]["tau_ci95"][0] <= res["baseline"]["ngram"]["tau"]
    ratio = res["tau_over_ngram"]
    assert ratio["ratio"] == pytest.approx(res["tau"] / res["baseline"]["ngram"]["tau"], abs=1e-3)
    assert ratio["ci95"][0] <= ratio["ratio"] <= ratio["ci95"][1]


def test_tau_interval_is_the_spread_over_prompts_paired_for_the_ratio() -> None:
    """The interval says how much a tau (and DFlash over n-gram) could move with other prompts of the same kind:
    none when every prompt decodes alike, wide when prompts differ, and the ratio resampled on the same prompts."""
    from dflash.eval import tau_interval

    def gen(accepted: list[int]) -> Generation:
        return Generation(tokens=[], accepted=accepted)

    same = [gen([3, 1]), gen([3, 1]), gen([3, 1])]  # tau 3.0 on every prompt
    half = [gen([1, 1]), gen([1, 1]), gen([1, 1])]  # tau 2.0
    (a, b, r) = tau_interval([same, half])
    assert a == (3.0, 3.0) and b == (2.0, 2.0) and r == (1.5, 1.5)
    mixed = [gen([0] * 4), gen([7] * 4), gen([3] * 4), gen([1] * 4), gen([5] * 4)]  # per-prompt tau 1, 8, 4, 2, 6
    lo, hi = tau_interval([mixed])[0]
    assert 1.0 < lo < 4.2 < hi < 8.0  # pooled tau 4.2 inside, the extremes outside
    # Paired: a second method doing exactly twice as well on every prompt has a ratio interval of one point, although
    # each method's own interval is wide.
    double = [gen([2 * a + 1 for a in g.accepted]) for g in mixed]
    (m1, m2, ratio) = tau_interval([double, mixed])
    assert m1[1] - m1[0] > 1.0 and m2[1] - m2[0] > 1.0 and ratio == (2.0, 2.0)
    assert tau_interval([mixed]) == tau_interval([mixed])  # seeded: the same report twice


def test_eval_human_output_and_prompt_file(checkpoint: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from dflash.cli import main

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"text": "def main(argv):\n    return"}) + "\n")
    assert main(["eval", "--checkpoint", str(checkpoint), "--prompts", str(f), "--max-new-tokens", "6",
                 "--method", "decode"]) == 0
    out = capsys.readouterr().out
    assert "dflash" in out and "acceptance τ (tokens/verify step)" in out and "train@serve" in out and f"prompts: {f}" in out

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    assert main(["eval", "--checkpoint", str(checkpoint), "--prompts", str(bad)]) == 2
    assert "bad.jsonl:1: expected an object with a 'text' string" in capsys.readouterr().err


def test_evaluate_reports_a_broken_rollback_with_its_position(monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash.eval import evaluate

    model = hybrid_target()
    target = TargetLM(model, [0, 2])
    monkeypatch.setattr(TargetLM, "restore", crop_only)
    res = evaluate(target, _drafter(), [prompt()], 16, train_acc=False)
    assert res["lossless"] is False
    assert "prompt 0 (dflash): output differs from the target's greedy decoding at new token" in res["errors"][0]
    # The error says how far from a tie it was (a fresh forward's gap), so a numerics problem reads as one.
    assert re.search(r"the lower [0-9.e+-]+ below the top logit \(relative\), over the tie tolerance 0\.0001",
                     res["errors"][0]), res["errors"][0]
    assert res["numerics"] == {"dtype": "float32", "device": "cpu", "autocast": False, "exact_float32": True,
                               "tie_tol": 1e-4}


def test_references_computed_once_serve_every_block_size() -> None:
    """evaluate(references=...) must judge against the given greedy outputs exactly as if it had decoded them itself
    (the H200 bench evaluates one drafter at B=8 and B=16 against one set of references)."""
    from dflash.eval import evaluate, reference_generations

    target = TargetLM(hybrid_target(), [0, 2])
    prompts = [prompt(seed=s) for s in (1, 2)]
    drafter = _drafter()
    refs = reference_generations(target, prompts, 16)
    assert [r.tokens for r in refs] == [target_greedy(target, p, 16).tokens for p in prompts]
    own = evaluate(target, drafter, prompts, 16, train_acc=False)
    reused = evaluate(target, drafter, prompts, 16, train_acc=False, references=refs)
    for key in ("tau", "accept_hist", "accept_by_position", "lossless", "new_tokens"):
        assert reused[key] == own[key], key
    # A reference that is not the target's output is caught as a lossless failure, so references are really used.
    wrong = [dataclasses.replace(refs[0], tokens=[(t + 1) % VOCAB for t in refs[0].tokens]), refs[1]]
    res = evaluate(target, drafter, prompts, 16, train_acc=False, references=wrong)
    assert res["lossless"] is False and "prompt 0 (dflash)" in res["errors"][0]
    with pytest.raises(ValueError, match="1 references for 2 prompts"):
        evaluate(target, drafter, prompts, 16, train_acc=False, references=refs[:1])


def test_heldout_documents_of_configured_data_were_never_scheduled(tmp_path: Path) -> None:
    from dflash.data import build_schedule, load_tokenizer, read_documents, tokenize
    from dflash.eval import EvalError, Loaded, heldout_documents

    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"d{i:02d}.txt").write_text(f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(40)))
    cfg = run_config(data={"paths": [str(data)], "max_len": 32, "min_len": 4, "token_budget": 64})
    docs = read_documents(cfg.data)
    tok = load_tokenizer(cfg.data, docs, tmp_path / "tok")
    loaded = Loaded(drafter=_drafter(), tap_layers=[0], source="x", cfg=cfg, run_dir=None,
                    pipeline={"total_steps": 1, "feeds": [{}]}, target_meta={})
    held, desc = heldout_documents(loaded, docs, tok)
    sched = build_schedule(tokenize(docs, tok), cfg.data, cfg.train.seed, 1)
    trained = {piece[0] for piece in sched.epochs[0][0]}  # a 1-step run trains on the first buffer only
    assert {d.source for d in held} == {d.source for i, d in enumerate(docs) if i not in trained}
    assert held and f"{len(held)} of 12 documents" in desc

    loaded.pipeline = {"total_steps": len(sched.epochs[0]), "feeds": [{}]}  # the whole epoch: nothing held out
    with pytest.raises(EvalError, match="pass --prompts FILE"):
        heldout_documents(loaded, docs, tok)


def test_tie_margin_separates_rounding_ties_from_real_differences() -> None:
    from dflash.eval import tie_margin

    model = hybrid_target()
    target = TargetLM(model, [0])
    p = prompt()
    logits, _ = target.forward(p, 0, None, keep=1, taps=False)
    top, low = int(logits[-1].argmax()), int(logits[-1].argmin())
    twin = (top + 1) % VOCAB
    with torch.no_grad():  # a token whose LM-head row equals the top token's: the same logit, a true tie
        model.get_output_embeddings().weight[twin] = model.get_output_embeddings().weight[top]
    assert tie_margin(target, p, top, twin, 1e-4) == pytest.approx(0.0, abs=1e-6)
    assert tie_margin(target, p, top, low, 1e-4) is None  # far below the top: a real error, never excused
    assert tie_margin(target, p, top, None, 1e-4) is None  # a length difference is never a tie


def test_tie_tolerance_follows_the_precision_the_target_really_computes_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 on a GPU is TF32 inside fla's chunked kernels unless exact_float32_kernels ran: a 1e-4 tolerance
    there reads rounding as a lossless failure (an H200 run, 2026-12-03); bf16 autocast is bf16 whatever the
    weights' dtype."""
    from dflash.eval import default_tie_tol
    from dflash.kernels import F32_ENV, exact_float32_kernels, float32_is_exact

    assert default_tie_tol(torch.bfloat16, "cpu") == 3e-2
    assert default_tie_tol(torch.float32, "cpu") == 1e-4 and float32_is_exact("cpu")
    monkeypatch.delenv(F32_ENV, raising=False)
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not float32_is_exact("cuda") and default_tie_tol(torch.float32, "cuda") == 3e-3
        state = exact_float32_kernels()
        assert os.environ[F32_ENV] == "ieee" and state["triton_f32_default"] == "ieee"
        assert float32_is_exact("cuda") and default_tie_tol(torch.float32, "cuda") == 1e-4
        torch.set_float32_matmul_precision("high")  # PyTorch's own TF32 matmuls: not exact either
        assert not float32_is_exact("cuda") and default_tie_tol(torch.float32, "cuda") == 3e-3
    finally:
        torch.set_float32_matmul_precision(precision)
    monkeypatch.setenv(F32_ENV, "tf32x3")  # the user's explicit choice wins
    assert exact_float32_kernels()["triton_f32_default"] == "tf32x3" and not float32_is_exact("cuda")


def test_eval_an_exported_drafter(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dflash.cli import main
    from dflash.export import export_checkpoint

    hf = export_checkpoint(checkpoint, tmp_path / "hf")
    f = tmp_path / "p.txt"
    f.write_text("import os\n")
    assert main(["eval", "--drafter", str(hf), "--prompts", str(f), "--max-new-tokens", "6", "--json",
                 "--method", "decode"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["source"] == str(hf) and res["lossless"] is True and res["block_size"] == 4
    assert res["new_tokens"] == 6 and res["prompts"] == 1
    # a damaged export is refused in one line with exit 2 (bad input), never a traceback or exit 1 (= lossless failed)
    (hf / "model.safetensors").write_bytes((hf / "model.safetensors").read_bytes()[:1000])
    capsys.readouterr()
    assert main(["eval", "--drafter", str(hf), "--prompts", str(f), "--max-new-tokens", "6"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors: cannot be read" in err and "export --check" in err and "Traceback" not in err
    (hf / "config.json").write_text("{")
    assert main(["eval", "--drafter", str(hf), "--prompts", str(f), "--max-new-tokens", "6"]) == 2
    assert "config.json: cannot be read as JSON" in capsys.readouterr().err
    # `dflash eval | head`: rich's console exited 1 on the closed pipe, which for eval says "not lossless"
    p = subprocess.Popen([sys.executable, "-m", "dflash", "eval", "--checkpoint", str(checkpoint), "--prompts", str(f),
                          "--max-new-tokens", "6"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # before the first write (it loads torch and the target first)
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 141, err
    assert "Traceback" not in err
    # the run directory for --checkpoint names the checkpoint to pass
    assert main(["eval", "--checkpoint", str(checkpoint.parent.parent), "--prompts", str(f)]) == 2
    assert f"newest: {checkpoint}" in capsys.readouterr().err
