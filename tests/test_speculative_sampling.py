"""Speculative sampling (temperature > 0) is lossless in distribution, on hybrid and full-attention targets.

The target's own sampling distribution is computed exactly: on a 16-token vocabulary every continuation of a short
prompt can be enumerated, so the probability of each token at each new position (and of each adjacent pair) comes from
plain full forwards without any cache, a path independent of the decoding code. Many short generations from a fixed
seed are then compared with it by Pearson's chi-square test; a verifier that is wrong on purpose fails the same check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

import dflash.speculative as spec
from dflash.model import DFlashDrafter, DrafterConfig
from dflash.speculative import (
    DFlashProposer,
    Generation,
    NgramProposer,
    TargetLM,
    prompt_generator,
    sampled_generations,
    speculative_sample,
    target_greedy,
    target_sample,
    verify_sampled,
)

VOCAB = 16
B = 3  # two drafts per block: rejections at position 1 and 2 and fully accepted blocks (the bonus draw) all happen
NEW = 3  # new tokens per generation: when the first verify step rejects its first draft, position 2 comes
# from a second step, drawn through the rolled-back cache
TEMPERATURE = 1.0
SEED_PROMPT = [3, 7]  # the prompt: these and the target's greedy continuation of them (random-init targets loop,
# so prompt lookup finds the likely next tokens in it and has its drafts accepted)
DRAWS = 800  # per check; with 1000 a full run of this file took 71 s at load 6 on 2 cores
# False-alarm rate: a correct sampler fails one test here with probability at most ALPHA over the choice of seed
# (Bonferroni: each of a test's M chi-square checks is held to ALPHA / M). 1e-3 keeps that rare while a wrong verifier
# (p-values below 1e-30 here) still fails by a wide margin; the seeds are fixed, so a run is deterministic.
ALPHA = 1e-3
MIN_EXPECTED = 5.0  # cells expected fewer times are pooled into one (the usual validity rule of Pearson's test)


def tiny_target(family: str, seed: int = 0) -> nn.Module:
    """qwen3_5: Gated DeltaNet layers around one full-attention layer (rolled back by restore + re-advance);
    qwen3: full attention only (rolled back by cropping the KV cache). Random init, 16-token vocabulary."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

    if family == "qwen3_5":
        cfg = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                layer_types=["linear_attention", "linear_attention", "full_attention",
                                             "linear_attention"],
                                num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
                                linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                linear_conv_kernel_dim=4, initializer_range=0.25, tie_word_embeddings=False)
    else:
        cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.25,
                          tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def tiny_drafter(seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(num_layers=1, num_heads=2, num_kv_heads=1, block_size=B, mask_token_id=VOCAB - 1,
                        attention="dense")
    return DFlashDrafter(cfg, 32, 2).eval()


TAPS = [0, 2]


# ----------------------------------------------------------------------------- the exact distribution and the test


def exact_joint(model: nn.Module, prompt: Sequence[int], n_new: int, temperature: float) -> Tensor:
    """P(x_0 .. x_{n-1}) of the target's sampling, [V] * n_new (float64): every prefix of each length is run
    through one batched full forward (no cache) and multiplied by the next token's softmax(logits / T)."""
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = torch.tensor([list(prompt)])
    with torch.no_grad():
        for _ in range(n_new):
            logits = model(input_ids=prefixes).logits[:, -1].double()
            cond = torch.softmax(logits / temperature, dim=-1)  # [prefixes, V]
            joint = (joint[:, None] * cond).reshape(-1)
            prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0),
                                  torch.arange(VOCAB).repeat(prefixes.shape[0])[:, None]], dim=1)
    return joint.reshape([VOCAB] * n_new)


def chi_square(counts: Tensor, probs: Tensor) -> tuple[float, int, float]:
    """Pearson's statistic of observed `counts` against `probs`, cells expected < MIN_EXPECTED times pooled: (stat,
    degrees of freedom, p-value). The p-value is the chi-square upper tail Q(df/2, stat/2), the regularised upper
    incomplete gamma function (torch.special.gammaincc; scipy is not a dependency)."""
    counts, probs = counts.reshape(-1).double(), probs.reshape(-1).double()
    n = float(counts.sum())
    expected = probs * n
    big = expected >= MIN_EXPECTED
    obs = [*counts[big].tolist()]
    exp = [*expected[big].tolist()]
    if (~big).any():
        obs.append(float(counts[~big].sum()))
        exp.append(float(expected[~big].sum()))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    df = len(exp) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, pvalue


def distribution_checks(samples: Tensor, joint: Tensor) -> list[tuple[str, float, int, float]]:
    """One chi-square check per new position (its marginal) and per adjacent pair of positions (their joint):
    (what, stat, df, p-value) each."""
    n_new = samples.shape[1]
    out = []
    for j in range(n_new):
        marginal = joint.sum(dim=[d for d in range(n_new) if d != j])
        counts = torch.bincount(samples[:, j], minlength=VOCAB)
        out.append((f"position {j}", *chi_square(counts, marginal)))
    for j in range(n_new - 1):
        pair = joint.sum(dim=[d for d in range(n_new) if d not in (j, j + 1)])
        counts = torch.bincount(samples[:, j] * VOCAB + samples[:, j + 1], minlength=VOCAB * VOCAB)
        out.append((f"positions {j},{j + 1}", *chi_square(counts, pair)))
    return out


def failed_checks(samples: Tensor, joint: Tensor) -> list[str]:
    checks = distribution_checks(samples, joint)
    return [f"{what}: chi2 {stat:.1f} on {df} df, p {p:.2e}" for what, stat, df, p in checks
            if p < ALPHA / len(checks)]


def draw_many(generate: Callable[[torch.Generator], Generation], n: int, seed: int) -> tuple[Tensor, list[Generation]]:
    g = torch.Generator().manual_seed(seed)
    gens = [generate(g) for _ in range(n)]
    assert all(len(x.tokens) == NEW for x in gens)
    return torch.tensor([x.tokens for x in gens]), gens


def test_chi_square_upper_tail_matches_the_published_table() -> None:
    """The p-value machinery against the chi-square table of the NIST/SEMATECH e-Handbook of Statistical Methods,
    section 1.3.6.7.4 (upper critical values): 29.588 at 10 df and 0.001, 16.919 at 9 df and 0.05."""
    for crit, df, alpha in ((29.588, 10, 1e-3), (16.919, 9, 0.05)):
        q = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                          torch.tensor(crit / 2, dtype=torch.float64)))
        assert q == pytest.approx(alpha, rel=1e-3)
    # A sample drawn from the very distribution it is tested against passes; one from another distribution fails.
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(VOCAB, generator=g), 0)
    same = torch.bincount(torch.multinomial(probs, 4000, replacement=True, generator=g), minlength=VOCAB)
    other = torch.bincount(torch.multinomial(probs.flip(0), 4000, replacement=True, generator=g), minlength=VOCAB)
    assert chi_square(same, probs)[2] > ALPHA
    assert chi_square(other, probs)[2] < 1e-12


# ----------------------------------------------------------------------------- lossless in distribution


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny forwards on one intra-op thread: with two threads on the shared, busy cores a 4-token sample took 440 ms
    instead of 14 ms (measured at load 10 on 2 cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@dataclass
class Case:
    target: TargetLM
    prompt: list[int]
    joint: Tensor  # the exact P(x_0 .. x_{NEW-1}) of the target's sampling after `prompt`


@functools.lru_cache(maxsize=2)
def case(family: str) -> Case:
    model = tiny_target(family)
    target = TargetLM(model, TAPS)
    prompt = SEED_PROMPT + target_greedy(target, SEED_PROMPT, 4).tokens
    return Case(target, prompt, exact_joint(model, prompt, NEW, TEMPERATURE))


def proposer(name: str, target: TargetLM) -> DFlashProposer | NgramProposer:
    return DFlashProposer(tiny_drafter(), target.embed_tokens, target.lm_head) if name == "dflash" else NgramProposer()


def test_target_sample_matches_the_exact_distribution() -> None:
    """The reference sampler (eval's baseline) draws what the enumeration says."""
    c = case("qwen3")
    samples, _ = draw_many(lambda g: target_sample(c.target, c.prompt, NEW, TEMPERATURE, g), DRAWS, seed=1)
    assert failed_checks(samples, c.joint) == []


# dflash: drafts drawn from the drafter's softmax(logits / T), verified with min(1, p/q) and the residual
# max(0, p - q); ngram: prompt lookup, a point mass. The hybrid family adds the Gated DeltaNet rollback under sampling
# (restore + mixer re-advance); the proposer only changes which branch of the verifier runs, covered on qwen3.
@pytest.mark.parametrize(("family", "name"), [("qwen3_5", "dflash"), ("qwen3", "dflash"), ("qwen3", "ngram")])
def test_speculative_sampling_matches_the_target_distribution(family: str, name: str) -> None:
    c = case(family)
    prop = proposer(name, c.target)
    samples, gens = draw_many(lambda g: speculative_sample(c.target, prop, c.prompt, NEW, B, TEMPERATURE, g), DRAWS,
                              seed=2)
    accepted = [a for x in gens for a in x.accepted]
    assert set(accepted) == set(range(B)), f"acceptance lengths seen: {sorted(set(accepted))}"
    assert any(len(x.accepted) > 1 and x.accepted[0] < len(x.drafts[0]) for x in gens)  # drawn after a rollback
    assert failed_checks(samples, c.joint) == []


def always_accept(p: Tensor, drafts: Sequence[int], q: Tensor | None, generator: torch.Generator) -> tuple[int, int]:
    """Wrong on purpose: every draft kept, then a bonus token from p."""
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=generator))


def resample_from_p(p: Tensor, drafts: Sequence[int], q: Tensor | None,
                    generator: torch.Generator) -> tuple[int, int]:
    """Wrong on purpose, subtly: the right acceptance test, but a rejected position is redrawn from p itself instead of
    the residual max(0, p - q), so tokens the drafter favours come out too often."""
    k, token = verify_sampled(p, drafts, q, generator)
    if k < len(drafts):
        token = int(torch.multinomial(p[k], 1, generator=generator))
    return k, token


@pytest.mark.parametrize(("name", "wrong"), [("ngram", always_accept), ("dflash", resample_from_p)],
                         ids=["ngram-always_accept", "dflash-resample_from_p"])
def test_a_wrong_verifier_fails_the_same_check(name: str, wrong: Callable[..., tuple[int, int]],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The check has power: the same draws (same seed, same count) through a broken verifier are caught."""
    c = case("qwen3")
    monkeypatch.setattr(spec, "verify_sampled", wrong)
    prop = proposer(name, c.target)
    samples, _ = draw_many(lambda g: speculative_sample(c.target, prop, c.prompt, NEW, B, TEMPERATURE, g), DRAWS,
                           seed=2)
    assert failed_checks(samples, c.joint) != []


# ----------------------------------------------------------------------------- the verifier, the records, the seed


def test_verifier_keeps_a_draft_drawn_from_p_itself_and_never_returns_a_rejected_point_mass() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, VOCAB, generator=g), -1)
    for _ in range(200):  # q == p: min(1, p/q) = 1, always kept; a bonus token follows
        drafts = torch.multinomial(p[:2], 1, generator=g).squeeze(-1).tolist()
        assert verify_sampled(p, drafts, p[:2], g)[0] == 2
    impossible = p.clone()
    impossible[0, 5] = 0.0  # the target never says 5 at the first position: the point-mass draft 5 is rejected
    for _ in range(200):
        k, token = verify_sampled(impossible, [5, 1], None, g)
        assert k == 0 and token != 5


def test_sampling_records_steps_like_the_greedy_path() -> None:
    """anchor_pos, drafts and accepted mean what they mean for greedy decoding (eval's statistics read them), and the
    hybrid rolls back through its mixers without extra target forwards."""
    from dflash.eval import acceptance_stats

    c = case("qwen3_5")
    prop = proposer("dflash", c.target)
    g = torch.Generator().manual_seed(3)
    readvances0 = c.target.mixer_readvances
    gens = [speculative_sample(c.target, prop, c.prompt, 10, B, TEMPERATURE, g) for _ in range(30)]
    p = len(c.prompt)
    for gen in gens:
        assert len(gen.tokens) == 10 and len(gen.anchor_pos) == len(gen.drafts) == len(gen.accepted)
        assert gen.anchor_pos[0] == p  # the first anchor: the token sampled after the prompt's prefill
        for a, nxt, k in zip(gen.anchor_pos, gen.anchor_pos[1:], gen.accepted, strict=False):
            assert nxt == a + k + 1  # the next anchor is the token drawn after the accepted drafts
        for a, drafts, k in zip(gen.anchor_pos, gen.drafts, gen.accepted, strict=True):
            assert len(drafts) == B - 1 and 0 <= k <= len(drafts)
            i = a + 1 - p  # index of the step's first new token
            assert gen.tokens[i:i + k] == drafts[:k][: len(gen.tokens) - i]  # accepted drafts are committed as drafted
        assert gen.target_forwards == 1 + len(gen.accepted)  # prefill + one verify per step
    # Every step that rejected a draft and was not the last re-advanced the restored Gated DeltaNet states.
    partial = sum(1 for gen in gens for k, d in zip(gen.accepted[:-1], gen.drafts[:-1], strict=True) if k < len(d))
    assert partial > 0 and c.target.mixer_readvances - readvances0 == partial
    stats = acceptance_stats(gens, B)
    assert stats["steps"] == sum(len(gen.accepted) for gen in gens) == sum(stats["accept_hist"])
    assert stats["tau"] == pytest.approx(1 + sum(stats["accept_by_position"]), abs=1e-3)


def test_a_seed_reproduces_a_run() -> None:
    c = case("qwen3")

    def run(seed: int) -> list[tuple[list[int], list[int]]]:
        g = torch.Generator().manual_seed(seed)
        prop = proposer("dflash", c.target)
        return [(x.tokens, x.accepted) for x in
                (speculative_sample(c.target, prop, c.prompt, 8, B, TEMPERATURE, g) for _ in range(5))]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sampled_generations_gives_each_prompt_its_own_stream() -> None:
    """What eval will call: every method decodes every prompt, each (prompt, method) from its own generator, so the
    DFlash outputs do not move when the prompt-lookup baseline runs between them, and each is reproducible alone."""
    c = case("qwen3")
    drafter = tiny_drafter()
    prompts = [c.prompt, c.prompt[:4]]
    out = sampled_generations(c.target, drafter, prompts, 6, TEMPERATURE, seed=5, baseline_ngram=True)
    assert set(out) == {"target", "dflash", "ngram"}
    assert all(len(gens) == 2 and all(len(x.tokens) == 6 for x in gens) for gens in out.values())
    assert all(x.accepted for x in out["dflash"]) and not any(x.accepted for x in out["target"])
    alone = sampled_generations(c.target, drafter, prompts, 6, TEMPERATURE, seed=5)
    assert set(alone) == {"target", "dflash"}
    assert [x.tokens for x in alone["dflash"]] == [x.tokens for x in out["dflash"]]
    prop = DFlashProposer(drafter, c.target.embed_tokens, c.target.lm_head)
    again = speculative_sample(c.target, prop, prompts[1], 6, B, TEMPERATURE, prompt_generator("cpu", 5, 1))
    assert again.tokens == out["dflash"][1].tokens


def test_argmax_drafts_are_the_greedy_dflash_drafts() -> None:
    """draft="argmax": DFlash drafts its greedy tokens (a point mass), not a sample from q."""
    c = case("qwen3")
    _, taps = c.target.forward(c.prompt, 0, None, keep=1)
    assert taps is not None
    for seed in range(4):
        prop = proposer("dflash", c.target)
        gen = speculative_sample(c.target, prop, c.prompt, 4, B, TEMPERATURE, torch.Generator().manual_seed(seed),
                                 draft="argmax")
        fresh = proposer("dflash", c.target)
        fresh.start(c.prompt, taps)
        assert gen.drafts[0] == fresh.propose([*c.prompt, gen.tokens[0]], B - 1)


def test_refuses_a_temperature_that_is_not_positive() -> None:
    c = case("qwen3")
    g = torch.Generator()
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        speculative_sample(c.target, NgramProposer(), c.prompt, 4, B, 0.0, g)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        target_sample(c.target, c.prompt, 4, -1.0, g)
    with pytest.raises(ValueError, match="draft must be 'sample' or 'argmax'"):
        speculative_sample(c.target, NgramProposer(), c.prompt, 4, B, 1.0, g, draft="top")
