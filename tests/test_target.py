"""Tests for the target adapter on a real tiny qwen3_5 (transformers' own code): taps, padding exactness, packing leak.

The fla varlen path needs a GPU and the kernels; its equality with padding is in tests/gpu/test_gpu_checks.py.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import pytest
import torch

from dflash.target import TINY_ARCH, Target, TargetConfig, default_tap_layers

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(TargetConfig(seed=0), num_draft_layers=2, device=CPU)


def random_ids(lengths: list[int], seed: int, vocab: int = TINY_ARCH["vocab_size"]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def right_pad(seqs: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


def test_default_tap_layers_follow_the_dflash_rule() -> None:
    assert default_tap_layers(64, 5) == [1, 16, 31, 46, 61]  # the Qwen3.6-27B recipe's taps
    assert default_tap_layers(36, 3) == [1, 17, 33]
    assert default_tap_layers(6, 2) == [1, 3]
    assert default_tap_layers(64, 1) == [32]  # one draft layer: the middle layer
    with pytest.raises(ValueError):
        default_tap_layers(3, 2)
    with pytest.raises(ValueError):
        default_tap_layers(8, 0)


def test_tiny_target_is_frozen_deterministic_and_fast() -> None:
    a = Target(TargetConfig(seed=7), num_draft_layers=2, device=CPU)  # the first build also imports transformers
    t0 = time.perf_counter()
    b = Target(TargetConfig(seed=7), num_draft_layers=2, device=CPU)
    assert time.perf_counter() - t0 < 2.0
    c = Target(TargetConfig(seed=8), num_draft_layers=2, device=CPU)
    assert a.model.config.model_type.startswith("qwen3_5")
    assert set(a.model.config.layer_types) == {"linear_attention", "full_attention"}
    assert not a.model.training
    assert not any(p.requires_grad for p in a.model.parameters())
    assert a.embed_tokens is a.model.get_input_embeddings() and not a.embed_tokens.weight.requires_grad
    assert a.lm_head is a.model.get_output_embeddings() and not a.lm_head.weight.requires_grad
    assert a.dtype == torch.float32 and a.tap_layers == [1, 3] and a.num_layers == 6
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.model.parameters(), c.model.parameters(), strict=True))


def test_taps_are_hf_hidden_states_id_plus_one(target: Target) -> None:
    ids = random_ids([12, 12], seed=1)
    x = torch.stack(ids)
    mask = torch.ones_like(x)
    with torch.inference_mode():
        ref = target.model(input_ids=x, attention_mask=mask, output_hidden_states=True).hidden_states
    got = target.hidden_states(x, mask)
    k = target.hidden_size
    assert got.shape == (2, 12, 2 * k)
    for j, layer in enumerate(target.tap_layers):
        torch.testing.assert_close(got[..., j * k : (j + 1) * k], ref[layer + 1], rtol=0, atol=0)


def test_padded_batch_equals_each_sequence_alone(target: Target) -> None:
    seqs = random_ids([23, 7, 16, 1], seed=2)
    ids, mask = right_pad(seqs, pad_id=5)
    batched = target.hidden_states(ids, mask)
    for i, s in enumerate(seqs):
        alone = target.hidden_states(s[None], torch.ones(1, len(s), dtype=torch.long))
        torch.testing.assert_close(batched[i, : len(s)], alone[0], rtol=1e-5, atol=1e-5)
    # the pad token's value must not matter either
    ids2, _ = right_pad(seqs, pad_id=77)
    torch.testing.assert_close(target.hidden_states(ids2, mask)[0], batched[0])


def test_naive_packing_with_position_ids_leaks_between_documents(target: Target) -> None:
    """Why the code pads: packing two documents into one row with only position_ids (no cu_seqlens) corrupts the second
    document in the linear-attention layers (their conv and recurrent state run straight across the boundary)."""
    first, second = random_ids([20, 18], seed=3)
    alone = [target.hidden_states(s[None], torch.ones(1, len(s), dtype=torch.long))[0] for s in (first, second)]
    packed_ids = torch.cat([first, second])[None]
    position_ids = torch.cat([torch.arange(20), torch.arange(18)])[None]
    packed = target._tapped(input_ids=packed_ids, position_ids=position_ids)[0]
    torch.testing.assert_close(packed[:20], alone[0], rtol=1e-5, atol=1e-5)  # the first document is unaffected
    leak = (packed[20:] - alone[1]).abs().max().item()  # vs the 1e-5 the padded path stays within
    assert leak > 100 * 1e-5, f"expected the second document to differ when packed naively, max diff {leak}"


def test_cpu_target_pads_and_refuses_packing(target: Target) -> None:
    assert target.packing == "pad"
    with pytest.raises(RuntimeError, match="packing"):
        target.hidden_states_packed(torch.zeros(1, 8, dtype=torch.long), torch.tensor([0, 4, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="varlen"):
        Target(TargetConfig(packing="varlen"), num_draft_layers=2, device=CPU)


def test_reference_fallback_refuses_cu_seqlens_itself(target: Target) -> None:
    """transformers' own fallback refuses boundaries it cannot honour; we rely on that as a second line of defence."""
    ids = torch.zeros(1, 8, dtype=torch.long)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed sequences"):
        target._tapped(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]), cu_seq_lens_q=cu)


def test_bad_inputs_are_refused(target: Target) -> None:
    ids = torch.zeros(2, 5, dtype=torch.long)
    left_padded = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="right-padded"):
        target.hidden_states(ids, left_padded)
    with pytest.raises(ValueError, match="shape"):
        target.hidden_states(ids, torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="tap_layers"):
        Target(TargetConfig(tap_layers=[1, 6]), num_draft_layers=2, device=CPU)
    with pytest.raises(ValueError, match="dtype"):
        Target(TargetConfig(dtype="fp8"), num_draft_layers=2, device=CPU)
    with pytest.raises(ValueError, match="packing"):
        Target(TargetConfig(packing="pack"), num_draft_layers=2, device=CPU)


def test_load_from_local_directory_gives_equal_outputs(target: Target, tmp_path: Path) -> None:
    target.model.save_pretrained(tmp_path / "tiny")
    progress: list[tuple[int, int]] = []
    loaded = Target(
        TargetConfig(path=str(tmp_path / "tiny")),
        num_draft_layers=2,
        device=CPU,
        on_progress=lambda i, n: progress.append((i, n)),
    )
    assert loaded.tap_layers == target.tap_layers and loaded.packing == "pad"
    assert not any(p.requires_grad for p in loaded.model.parameters())
    ids, mask = right_pad(random_ids([9, 14], seed=4))
    torch.testing.assert_close(loaded.hidden_states(ids, mask), target.hidden_states(ids, mask), rtol=0, atol=0)
    assert progress[0] == (0, 1) and progress[-1] == (1, 1)
    # transformers 5.25 turns Hub kernels on by default (on a GPU: fetched from the Hub whatever local_files_only
    # says); the loaded target must run the installed kernels only
    assert getattr(loaded.model, "use_kernels", False) is False
    weight_steps = [p for p in progress[1:-1]]
    assert weight_steps, "per-weight loading progress must be reported"
    assert [i for i, _ in weight_steps] == sorted(i for i, _ in weight_steps)
    assert weight_steps[-1][0] == weight_steps[-1][1]


def test_bf16_random_target_equals_itself_saved_and_reloaded(tmp_path: Path) -> None:
    """The random-init path must build what from_pretrained would load (RoPE tables stay fp32 in a bf16 model)."""
    built = Target(TargetConfig(dtype="bfloat16"), num_draft_layers=2, device=CPU)
    assert {p.dtype for p in built.model.parameters()} == {torch.bfloat16}
    assert all(b.dtype == torch.float32 for name, b in built.model.named_buffers() if "inv_freq" in name)
    built.model.save_pretrained(tmp_path / "bf16")
    loaded = Target(TargetConfig(path=str(tmp_path / "bf16"), dtype="bfloat16"), num_draft_layers=2, device=CPU)
    ids, mask = right_pad(random_ids([300, 120], seed=6))
    assert torch.equal(loaded.hidden_states(ids, mask), built.hidden_states(ids, mask))


def test_vlm_format_checkpoint_loads_as_its_text_model(tmp_path: Path) -> None:
    """Qwen3.5 releases ship as Qwen3_5ForConditionalGeneration (text + vision); the target must load the text part."""
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    torch.manual_seed(0)
    vlm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=dict(TINY_ARCH), vision_config=vision)).eval()
    vlm.save_pretrained(tmp_path / "vlm")
    loaded = Target(TargetConfig(path=str(tmp_path / "vlm")), num_draft_layers=2, device=CPU)
    assert (loaded.hidden_size, loaded.vocab_size, loaded.num_layers) == (64, TINY_ARCH["vocab_size"], 6)
    ids = torch.stack(random_ids([10], seed=5))
    with torch.inference_mode():
        ref = vlm.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states
    got = loaded.hidden_states(ids, torch.ones_like(ids))
    torch.testing.assert_close(got, torch.cat([ref[2], ref[4]], dim=-1), rtol=0, atol=0)


def test_missing_directory_fails_with_its_name(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="nope"):
        Target(TargetConfig(path=str(tmp_path / "nope")), num_draft_layers=2, device=CPU)


@pytest.mark.parametrize(("family", "model_class", "hybrid"), [("qwen3_5", "Qwen3_5ForCausalLM", True),
                                                                ("qwen3", "Qwen3ForCausalLM", False)])
def test_each_family_builds_its_causal_lm_with_the_shape_the_checks_predict(family: str, model_class: str,
                                                                             hybrid: bool) -> None:
    """One registry entry per family: the model built, the shape the config checks use and the kernel probe agree."""
    from dflash.target import FAMILIES, build_target_model, probe_kernels, target_shape

    cfg = TargetConfig(family=family, arch={"num_hidden_layers": 4}, seed=3)
    model = build_target_model(cfg, vocab=300)
    assert type(model).__name__ == model_class and FAMILIES[family].hybrid is hybrid
    assert model.get_input_embeddings().weight.shape == (300, 64)
    types = model.config.layer_types
    assert types == (["linear_attention", "linear_attention", "full_attention", "linear_attention"] if hybrid
                     else ["full_attention"] * 4)  # a changed depth repeats the family's pattern
    shape = target_shape(cfg, vocab=300)
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size) == (4, 64, 300)
    assert target_shape(cfg).vocab_size is None  # the tokenizer's size is not known yet
    kernels = probe_kernels(cfg, 300)  # a full-attention target has no linear-attention op to bind
    assert (set(kernels.values()) != {"absent"}) is hybrid
    same = build_target_model(cfg, vocab=300)  # seeded: the same weights every time
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values(), strict=True))
    t = Target(cfg, num_draft_layers=2, device=CPU, vocab=300)
    assert (t.num_layers, t.vocab_size, t.tap_layers, t.kernels) == (4, 300, [1, 1], kernels)


def test_an_explicit_arch_vocab_size_is_the_embedding_even_with_a_smaller_tokenizer() -> None:
    """A target reserves ids past the tokenizer's last token (a drafter's mask id): target.arch.vocab_size wins."""
    from dflash.target import target_arch, target_shape

    cfg = TargetConfig(arch={"vocab_size": 600})
    assert target_arch(cfg, vocab=512)["vocab_size"] == 600
    assert target_shape(cfg, vocab=512).vocab_from == "target.arch.vocab_size"
    assert target_arch(TargetConfig(), vocab=512)["vocab_size"] == 512
    with pytest.raises(ValueError, match=r"^target.arch.layer_types: has 2 entries for target.arch.num_hidden_layers=3"):
        target_arch(TargetConfig(arch={"num_hidden_layers": 3, "layer_types": ["full_attention"] * 2}))


def test_a_random_target_takes_a_real_size_vocabulary_over_a_small_tokenizer() -> None:
    """Throughput runs need the real LM-head cost (Qwen3.6-27B: 248,320 rows) with the tiny tokenizer: the extra rows
    are embedding/LM-head rows no input id reaches; the hidden states of real ids are computed as usual."""
    from dflash.target import target_shape

    cfg = TargetConfig(arch={"vocab_size": 248_320, "num_hidden_layers": 3}, seed=1)
    assert target_shape(cfg, vocab=300).vocab_size == 248_320
    t = Target(cfg, num_draft_layers=1, device=CPU, vocab=300)
    assert t.vocab_size == 248_320
    assert t.lm_head.weight.shape == (248_320, 64) and t.embed_tokens.weight.shape == (248_320, 64)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    hs = t.hidden_states(ids, torch.ones_like(ids))
    assert hs.shape == (2, 12, 64) and torch.isfinite(hs).all()


def test_an_arch_vocab_size_smaller_than_the_tokenizer_is_refused_by_name() -> None:
    from dflash.target import target_arch, target_shape

    small = TargetConfig(arch={"vocab_size": 256})
    want = r"^target.arch.vocab_size: must be at least the tokenizer's vocabulary \(300\).*got 256$"
    for build in (lambda: target_arch(small, vocab=300), lambda: target_shape(small, vocab=300),
                  lambda: Target(small, num_draft_layers=1, device=CPU, vocab=300)):
        with pytest.raises(ValueError, match=want):
            build()
    assert target_arch(small, vocab=256)["vocab_size"] == 256  # equal is fine
    assert target_arch(small)["vocab_size"] == 256  # tokenizer not known yet: nothing to compare


def test_packed_indices_come_from_the_host_boundaries_alone() -> None:
    """Positions, document ids and the longest document for the varlen kernels, derived on the CPU (no device
    round trip, so no host sync in the forward); bad boundaries are refused with the boundaries shown."""
    from dflash.target import packed_indices

    idx = packed_indices(torch.tensor([0, 3, 5, 9], dtype=torch.int32), 9)
    assert idx.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert idx.seq_idx.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2] and idx.seq_idx.dtype == torch.int32
    assert idx.cu_seqlens.dtype == torch.long and idx.cu_seqlens.device.type == "cpu" and idx.max_len == 4
    # the fixed-shape buffer's tail is one more document: positions restart there
    tail = packed_indices(torch.tensor([0, 3, 5, 8]), 8)
    assert tail.position_ids.tolist()[-3:] == [0, 1, 2] and tail.seq_idx.tolist()[-1] == 2
    for bad, n in (([0, 3, 3, 9], 9), ([1, 9], 9), ([0, 4], 9), ([0], 0)):
        with pytest.raises(ValueError, match="cu_seqlens must be strictly increasing"):
            packed_indices(torch.tensor(bad), n)
    # fla's chunk index, (document, chunk within it) for every 64-token chunk of every document, written plainly:
    lengths = [100, 64, 1, 129, 63]
    big = packed_indices(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), sum(lengths))
    plain = [[d, c] for d, n in enumerate(lengths) for c in range(-(-n // 64))]
    assert big.chunk_indices.tolist() == plain and big.chunk_indices.dtype == torch.long
    assert idx.chunk_indices.tolist() == [[0, 0], [1, 0], [2, 0]]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_varlen_attention_target_equals_sdpa_on_right_padded_rows(family: str) -> None:
    """target.attention varlen registers its attention with transformers; padded rows (the only path on CPU) then get
    no mask and attend causally, which is exact for every real token of a right-padded row."""
    from transformers import AttentionInterface

    from dflash.target import VARLEN_ATTENTION

    cfg = TargetConfig(family=family, seed=4)
    sdpa = Target(cfg, num_draft_layers=2, device=CPU)
    varlen = Target(TargetConfig(family=family, seed=4, attention="varlen"), num_draft_layers=2, device=CPU)
    assert VARLEN_ATTENTION in AttentionInterface._global_mapping
    assert varlen.model.config._attn_implementation == VARLEN_ATTENTION
    lengths = [7, 19, 1, 12]
    ids = torch.zeros(4, 19, dtype=torch.long)
    mask = torch.zeros(4, 19, dtype=torch.long)
    for i, (n, d) in enumerate(zip(lengths, random_ids(lengths, seed=5), strict=True)):
        ids[i, :n], mask[i, :n] = d, 1
    a, b = sdpa.hidden_states(ids, mask), varlen.hidden_states(ids, mask)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(b[i, :n], a[i, :n], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="target.attention must be one of auto, sdpa, varlen; got 'flex_attention'"):
        Target(TargetConfig(attention="flex_attention"), num_draft_layers=2, device=CPU)


def test_target_attention_auto_picks_varlen_only_for_packed_rows_with_torchs_varlen_kernel() -> None:
    from dflash.target import resolve_target_attention

    assert resolve_target_attention("auto", "varlen", True) == "varlen"
    assert resolve_target_attention("auto", "pad", True) == "sdpa"  # padded rows gain nothing from varlen
    assert resolve_target_attention("auto", "varlen", False) == "sdpa"
    assert resolve_target_attention("sdpa", "varlen", True) == "sdpa"
    # the flash kernel has no float32 (a float32 target crashed in it on an H200): auto falls back, explicit refuses
    assert resolve_target_attention("auto", "varlen", True, torch.float32) == "sdpa"
    assert resolve_target_attention("auto", "varlen", True, torch.float16) == "varlen"
    with pytest.raises(ValueError, match="float16 or bfloat16 only; this target is float32"):
        resolve_target_attention("varlen", "varlen", True, torch.float32)
    assert resolve_target_attention("varlen", "pad", True, torch.float32) == "varlen"  # padded rows: sdpa inside
    with pytest.raises(ValueError, match="needs torch.nn.attention.varlen"):
        resolve_target_attention("varlen", "varlen", False)
    # On CPU packing resolves to pad, so the default target keeps sdpa.
    t = Target(TargetConfig(seed=1), num_draft_layers=2, device=CPU)
    assert (t.packing, t.attention) == ("pad", "sdpa")
    assert t.model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3"])
def test_decoding_puts_a_varlen_attention_target_back_on_sdpa(family: str) -> None:
    """The packed-row varlen function gets no mask from transformers, so a cached decode through it would attend
    wrongly (queries after cached keys): it refuses, and TargetLM (eval) switches the model to sdpa, decoding exactly
    as the sdpa target does."""
    from transformers import DynamicCache

    from dflash.speculative import TargetLM, target_greedy

    varlen = Target(TargetConfig(family=family, seed=4, attention="varlen"), num_draft_layers=2, device=CPU)
    sdpa = Target(TargetConfig(family=family, seed=4, attention="sdpa"), num_draft_layers=2, device=CPU)
    prompt = random_ids([9], seed=3)[0]
    cache = DynamicCache(config=varlen.model.config)
    kw = "cache" if "cache" in inspect.signature(varlen.model.forward).parameters else "past_key_values"
    with torch.no_grad():
        varlen.model(input_ids=prompt[None, :5], use_cache=True, **{kw: cache})
        with pytest.raises(RuntimeError, match="cached decode"):
            varlen.model(input_ids=prompt[None, 5:], use_cache=True, **{kw: cache})
    lm = TargetLM(varlen.model, [0, 1])
    assert varlen.model.config._attn_implementation == "sdpa"
    got = target_greedy(lm, prompt.tolist(), 12).tokens
    assert got == target_greedy(TargetLM(sdpa.model, [0, 1]), prompt.tolist(), 12).tokens
