"""GPU-only checks (H200): kernels really bound, fla varlen == padded target, flex == dense drafter, no recompiles.

Skipped without CUDA. Run by bench/gpu_checks.sh, once without and once with the fla / causal-conv1d wheels.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.kernels import FlexWarningWatch, check_kernels, dynamo_counts, versions
from dflash.model import DFlashDrafter, DraftBatch, DrafterConfig, sample_anchors
from dflash.target import TINY_ARCH, Target, TargetConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HAVE_FAST = importlib.util.find_spec("fla") is not None and importlib.util.find_spec("causal_conv1d") is not None
DEV = torch.device("cuda")
FAST = {
    "chunk_gated_delta_rule": "fla",
    "fused_recurrent_gated_delta_rule": "fla",
    "causal_conv1d_fn": "causal_conv1d",
    "causal_conv1d_update": "causal_conv1d",
}
# Bigger than the CPU tiny model so the kernels see realistic head sizes (64) and several chunks per sequence.
GPU_ARCH = {
    **TINY_ARCH,
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "initializer_range": 0.05,  # larger than the default 0.02 so the recurrent layers visibly move the residual stream
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64; NaN anywhere fails every comparison."""
    a64, b64 = a.detach().double(), b.detach().double()
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item()


def test_kernels_bound_match_the_installed_packages() -> None:
    target = Target(TargetConfig(arch=GPU_ARCH), num_draft_layers=2, device=DEV)
    print("versions", versions())
    print("kernels", target.kernels, "packing", target.packing, "dtype", target.dtype)
    assert target.dtype == torch.bfloat16
    if HAVE_FAST:
        assert target.kernels == FAST
        assert check_kernels(target.kernels, DEV, allow_slow=False) == []
        assert target.packing == "varlen"
    else:
        assert set(target.kernels.values()) == {"torch-fallback"}
        problems = check_kernels(target.kernels, DEV, allow_slow=False)
        print("preflight refuses:", problems)
        assert len(problems) == 4
        assert check_kernels(target.kernels, DEV, allow_slow=True) == []
        assert target.packing == "pad"
        with pytest.raises(ValueError, match="varlen"):
            Target(TargetConfig(arch=GPU_ARCH, packing="varlen"), num_draft_layers=2, device=DEV)


@pytest.mark.skipif(not HAVE_FAST, reason="needs flash-linear-attention and causal-conv1d")
@pytest.mark.parametrize("dtype,tol", [("bfloat16", 2e-2), ("float32", 2e-3)])
def test_fla_varlen_target_equals_padded(dtype: str, tol: float) -> None:
    target = Target(TargetConfig(arch=GPU_ARCH, fused_elementwise="off", dtype=dtype), num_draft_layers=2, device=DEV)
    assert target.packing == "varlen"
    # PyTorch's varlen flash kernel has no float32 ("FlashAttention only support fp16 and bf16 data type"): auto
    # keeps a float32 target's full attention on sdpa with the block-diagonal mask
    assert target.attention == ("sdpa" if dtype == "float32" else "varlen")
    lengths = [300, 1000, 77, 2000, 1, 619]
    g = torch.Generator(device="cpu").manual_seed(0)
    docs = [torch.randint(0, GPU_ARCH["vocab_size"], (n,), generator=g) for n in lengths]
    t = max(lengths)
    ids = torch.zeros(len(docs), t, dtype=torch.long)
    mask = torch.zeros(len(docs), t, dtype=torch.long)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = d, 1
    padded = target.hidden_states(ids.to(DEV), mask.to(DEV))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed_ids = torch.cat(docs)[None].to(DEV)
    packed = target.hidden_states_packed(packed_ids, cu)
    assert packed.shape == (1, sum(lengths), 2 * GPU_ARCH["hidden_size"])
    errors = [rel(packed[0, int(cu[i]) : int(cu[i + 1])], padded[i, : lengths[i]]) for i in range(len(lengths))]
    # negative control: the same packed row with position_ids only (no cu_seqlens / seq_idx) leaks across documents
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(DEV)
    naive = target._tapped(input_ids=packed_ids, position_ids=pos)
    # (first 64 tokens of each later document, where the carried-over state matters most)
    heads = [(i, min(64, lengths[i])) for i in range(1, len(lengths)) if lengths[i] > 1]
    naive_err = [rel(naive[0, int(cu[i]) : int(cu[i]) + k], padded[i, :k]) for i, k in heads]
    print(
        f"{dtype}: varlen vs padded rel err per doc {[f'{e:.2e}' for e in errors]}; "
        f"naive packing (first 64 tokens of docs 1..) {[f'{e:.2e}' for e in naive_err]}"
    )
    assert max(errors) < tol
    assert min(naive_err) > max(tol, 5 * max(errors))


def _buffer(n: int, doc_lengths: list[int], hidden_dim: int, vocab: int, seed: int) -> DraftBatch:
    g = torch.Generator(device="cpu").manual_seed(seed)
    doc = torch.full((n,), -1, dtype=torch.long)
    pos = torch.zeros(n, dtype=torch.long)
    lm = torch.zeros(n, dtype=torch.bool)
    start = 0
    for d, length in enumerate(doc_lengths):
        doc[start : start + length] = d
        pos[start : start + length] = torch.arange(length)
        lm[start + 8 : start + length] = True  # a short unsupervised prompt per document
        start += length
    return DraftBatch(
        hidden=torch.randn(n, hidden_dim, generator=g).to(torch.bfloat16),
        input_ids=torch.randint(0, vocab - 1, (n,), generator=g),
        loss_mask=lm,
        position_ids=pos,
        doc_ids=doc,
    ).to(DEV)


H, VOCAB, N = 256, 4096, 4096


def _drafter(backend: str, num_anchors: int, **rule: Any) -> tuple[DFlashDrafter, torch.nn.Embedding, torch.nn.Linear]:
    torch.manual_seed(0)
    cfg = DrafterConfig(
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        num_anchors=num_anchors,
        mask_token_id=VOCAB - 1,
        attention=backend,
        layer_sliding_windows=[512, None],
        ce_chunk=1024,
    )
    cfg = dataclasses.replace(cfg, **rule)
    d = DFlashDrafter(cfg, target_hidden_size=H, num_taps=2).to(DEV)
    emb = torch.nn.Embedding(VOCAB, H).to(DEV).requires_grad_(False)
    head = torch.nn.Linear(H, VOCAB, bias=False).to(DEV).requires_grad_(False)
    return d, emb, head


def _step(
    d: DFlashDrafter,
    batch: DraftBatch,
    emb: torch.nn.Module,
    head: torch.nn.Module,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    bf16: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    d.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = d(batch, emb, head, anchors=anchors, keep=keep)
    out.loss.backward()
    torch.cuda.synchronize()
    return (
        out.loss.detach(),
        {k.removeprefix("_orig_mod."): p.grad.detach().clone() for k, p in d.named_parameters()},
        time.perf_counter() - t0,
    )


@pytest.mark.parametrize("num_anchors", [64, 256])
@pytest.mark.parametrize("precision,tol", [("bf16", 2e-2), ("fp32", 2e-3)])
def test_flex_equals_dense_forward_and_grads(precision: str, tol: float, num_anchors: int) -> None:
    bf16 = precision == "bf16"
    dense, emb, head = _drafter("dense", num_anchors)
    flex = copy.deepcopy(dense)
    flex.attention_backend = "flex-compiled"
    if bf16:
        emb, head = emb.to(torch.bfloat16), head.to(torch.bfloat16)
    batch = _buffer(N, [700, 1500, 33, 1200, 400], 2 * H, VOCAB, seed=1)
    if not bf16:
        batch.hidden = batch.hidden.float()
    anchors, keep = sample_anchors(batch, num_anchors, 16, torch.Generator(device=DEV).manual_seed(0))
    with FlexWarningWatch() as watch:
        loss_f, grads_f, _ = _step(flex, batch, emb, head, anchors, keep, bf16)  # compiles
        loss_f, grads_f, t_flex = _step(flex, batch, emb, head, anchors, keep, bf16)
    loss_d, grads_d, _ = _step(dense, batch, emb, head, anchors, keep, bf16)
    loss_d, grads_d, t_dense = _step(dense, batch, emb, head, anchors, keep, bf16)
    assert watch.triggered == []
    grad_err = {k: rel(grads_f[k], grads_d[k]) for k in grads_d}
    worst = max(grad_err, key=grad_err.get)
    print(
        f"{precision} A={num_anchors}: loss flex {loss_f.item():.6f} dense {loss_d.item():.6f} rel {rel(loss_f, loss_d):.2e}; "
        f"worst grad {worst} {grad_err[worst]:.2e}; step flex {t_flex * 1e3:.1f} ms dense {t_dense * 1e3:.1f} ms"
    )
    assert torch.isfinite(loss_f) and rel(loss_f, loss_d) < tol
    assert grad_err[worst] < tol


@pytest.mark.parametrize("causal,window_from", [(True, "query"), (False, "anchor"), (True, "anchor")])
def test_flex_equals_dense_under_each_sliding_rule(causal: bool, window_from: str) -> None:
    """drafter.sliding_block_causal / sliding_window_from (issue 40's sliding-window ablation): the compiled flex
    mask on CUDA gives the exact dense rule's loss and gradients for each, with a window short enough (24) that the
    rules differ."""
    rule = {"layer_sliding_windows": [24, None], "sliding_block_causal": causal, "sliding_window_from": window_from}
    dense, emb, head = _drafter("dense", 64, **rule)
    flex = copy.deepcopy(dense)
    flex.attention_backend = "flex-compiled"
    batch = _buffer(N, [700, 1500, 33, 1200, 400], 2 * H, VOCAB, seed=1)
    batch.hidden = batch.hidden.float()
    anchors, keep = sample_anchors(batch, 64, 16, torch.Generator(device=DEV).manual_seed(0))
    with FlexWarningWatch() as watch:
        _step(flex, batch, emb, head, anchors, keep, False)  # compiles
        loss_f, grads_f, _ = _step(flex, batch, emb, head, anchors, keep, False)
    loss_d, grads_d, _ = _step(dense, batch, emb, head, anchors, keep, False)
    base, _, _ = _step(_drafter("dense", 64, layer_sliding_windows=[24, None])[0], batch, emb, head, anchors, keep,
                       False)
    assert watch.triggered == []
    grad_err = {k: rel(grads_f[k], grads_d[k]) for k in grads_d}
    worst = max(grad_err, key=grad_err.get)
    print(f"causal={causal} from={window_from}: loss flex {loss_f.item():.6f} dense {loss_d.item():.6f} "
          f"(query-bidirectional rule {base.item():.6f}); worst grad {worst} {grad_err[worst]:.2e}")
    assert torch.isfinite(loss_f) and rel(loss_f, loss_d) < 2e-3 and grad_err[worst] < 2e-3
    assert rel(loss_d, base) > 1e-6  # the rule changed what the sliding layer reads


def test_compiled_flex_does_not_recompile_across_buffers() -> None:
    d, emb, head = _drafter("flex", 256)
    assert d.attention_backend == "flex-compiled"
    emb, head = emb.to(torch.bfloat16), head.to(torch.bfloat16)
    layouts = [[4096], [1000, 2000, 500, 596], [64] * 60, [3000, 900]]
    gen = torch.Generator(device=DEV).manual_seed(1)
    times = []
    with FlexWarningWatch() as watch:
        for i, layout in enumerate(layouts):
            batch = _buffer(N, layout, 2 * H, VOCAB, seed=10 + i)
            anchors, keep = sample_anchors(batch, 256, 16, gen)
            _, _, dt = _step(d, batch, emb, head, anchors, keep, bf16=True)
            times.append(dt)
            if i == 0:
                warm = dynamo_counts()
    after = dynamo_counts()
    print(
        f"dynamo after warm-up {warm}, after 3 more buffers {after}; step times ms {[round(t * 1e3, 1) for t in times]}"
    )
    assert watch.triggered == []
    assert after == warm


def test_whole_drafter_under_torch_compile_matches_and_does_not_recompile() -> None:
    """The train loop compiles the whole drafter step (flex inside it): same loss as uncompiled flex, no recompiles."""
    d, emb, head = _drafter("flex", 256)
    emb, head = emb.to(torch.bfloat16), head.to(torch.bfloat16)
    ref = copy.deepcopy(d)
    compiled = torch.compile(d)
    layouts = [[4096], [1000, 2000, 500, 596], [64] * 60, [3000, 900]]
    gen = torch.Generator(device=DEV).manual_seed(2)
    frames, times = [], []
    with FlexWarningWatch() as watch:
        for i, layout in enumerate(layouts):
            batch = _buffer(N, layout, 2 * H, VOCAB, seed=20 + i)
            anchors, keep = sample_anchors(batch, 256, 16, gen)
            loss_c, grads_c, dt = _step(compiled, batch, emb, head, anchors, keep, bf16=True)  # type: ignore[arg-type]
            loss_r, grads_r, _ = _step(ref, batch, emb, head, anchors, keep, bf16=True)
            frames.append(dynamo_counts()["frames"])
            times.append(dt)
            worst = max(rel(grads_c[k], grads_r[k]) for k in grads_r)
            print(
                f"buffer {i}: loss compiled {loss_c.item():.6f} eager-module {loss_r.item():.6f} worst grad rel {worst:.2e}"
            )
            assert rel(loss_c, loss_r) < 2e-2 and worst < 5e-2
    print(f"dynamo frames after each buffer {frames}; step ms {[round(t * 1e3, 1) for t in times]}")
    assert watch.triggered == []
    assert frames[1:] == [frames[0]] * 3


def test_training_size_flex_equals_dense_and_step_cost() -> None:
    """At a training-like buffer (N=16384, A=512, B=16, H=1024): same loss both ways; step time and memory recorded."""
    h, n = 1024, 16384
    batch = _buffer(n, [3000, 5000, 2000, 6000], 3 * h, VOCAB, seed=30)
    anchors, keep = sample_anchors(batch, 512, 16, torch.Generator(device=DEV).manual_seed(0))
    losses = {}
    for backend in ("flex", "dense"):
        torch.manual_seed(0)
        cfg = DrafterConfig(
            num_layers=1,
            num_heads=16,
            num_kv_heads=4,
            head_dim=64,
            block_size=16,
            num_anchors=512,
            mask_token_id=VOCAB - 1,
            attention=backend,
            ce_chunk=2048,
        )
        d = DFlashDrafter(cfg, target_hidden_size=h, num_taps=3).to(DEV)
        torch.manual_seed(1)
        emb = torch.nn.Embedding(VOCAB, h).to(DEV, torch.bfloat16).requires_grad_(False)
        head = torch.nn.Linear(h, VOCAB, bias=False).to(DEV, torch.bfloat16).requires_grad_(False)
        _step(d, batch, emb, head, anchors, keep, bf16=True)  # warm-up / compile
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        runs = [_step(d, batch, emb, head, anchors, keep, bf16=True) for _ in range(5)]
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        ts = sorted(r[2] for r in runs)
        losses[backend] = runs[0][0]
        print(f"{backend}: N={n} A=512 B=16 H={h}: step median {ts[2] * 1e3:.1f} ms, peak extra memory {peak:.0f} MiB")
        del d, emb, head, runs
    assert rel(losses["flex"], losses["dense"]) < 2e-2


def test_load_from_directory_onto_the_gpu(tmp_path: Path) -> None:
    """A saved target loads from its directory straight onto the GPU and gives the same tapped states."""
    built = Target(TargetConfig(arch=GPU_ARCH, fused_elementwise="off"), num_draft_layers=2, device=DEV)
    built.model.save_pretrained(tmp_path / "t")
    progress: list[tuple[int, int]] = []
    loaded = Target(
        TargetConfig(path=str(tmp_path / "t"), fused_elementwise="off"),
        num_draft_layers=2,
        device=DEV,
        on_progress=lambda i, n: progress.append((i, n)),
    )
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.kernels == built.kernels and loaded.packing == built.packing
    ids = torch.randint(0, GPU_ARCH["vocab_size"], (2, 300), device=DEV)
    mask = torch.ones_like(ids)
    assert rel(loaded.hidden_states(ids, mask), built.hidden_states(ids, mask)) < 1e-3  # same bf16 weights
    print(f"load progress reports: {len(progress)}, last {progress[-1]}")
    assert progress[-1] == (1, 1)


@pytest.mark.skipif(not HAVE_FAST, reason="needs flash-linear-attention and causal-conv1d")
@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_target_attention_options_equal_padded_per_document(attention: str) -> None:
    """target.attention varlen (PyTorch's varlen flash attention) gives every packed document the states the padded
    forward gives it, as sdpa does; so does a fixed-shape row (token budget, the tail one dummy document) through
    the pipeline."""
    from dflash.data import TokenizedCorpus
    from dflash.pipeline import compute_batch

    sdpa = Target(TargetConfig(arch=GPU_ARCH, fused_elementwise="off", attention="sdpa"), num_draft_layers=2,
                  device=DEV)
    other = Target(TargetConfig(arch=GPU_ARCH, fused_elementwise="off", attention=attention), num_draft_layers=2,
                   device=DEV)
    lengths = [300, 1000, 77, 2000, 1, 619]
    g = torch.Generator(device="cpu").manual_seed(3)
    docs = [torch.randint(0, GPU_ARCH["vocab_size"], (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(docs), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = d, 1
    padded = sdpa.hidden_states(ids.to(DEV), mask.to(DEV))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = other.hidden_states_packed(torch.cat(docs)[None], cu)
    errors = [rel(packed[0, int(cu[i]) : int(cu[i + 1])], padded[i, : lengths[i]]) for i in range(len(lengths))]
    corpus = TokenizedCorpus(ids=docs, loss_mask=[torch.ones(n, dtype=torch.bool) for n in lengths], fingerprint="g")
    pieces = [(i, 0, n) for i, n in enumerate(lengths)]
    budget = sum(lengths) + 500
    fixed = compute_batch(other, corpus, pieces, budget, fixed_shape=True)
    loose = compute_batch(other, corpus, pieces, budget)
    print(f"{attention}: packed vs padded rel err per doc {[f'{e:.2e}' for e in errors]}; fixed-shape vs not "
          f"{rel(fixed.hidden, loose.hidden):.2e}")
    assert max(errors) < 2e-2
    assert rel(fixed.hidden, loose.hidden) < 1e-2 and not fixed.hidden[sum(lengths):].any()
    # the whole batch is on the GPU already: the drafter step's batch.to(device) copies (and waits for) nothing
    assert {t.device.type for t in (fixed.input_ids, fixed.loss_mask, fixed.position_ids, fixed.doc_ids)} == {"cuda"}


@pytest.mark.skipif(not HAVE_FAST, reason="needs flash-linear-attention and causal-conv1d")
def test_default_attention_is_varlen_for_packed_training_and_sdpa_for_decoding() -> None:
    """target.attention auto: the training target (packed varlen rows) runs PyTorch's varlen attention; the same model
    handed to TargetLM (eval) decodes on sdpa, greedily identical to a target built on sdpa."""
    from dflash.speculative import TargetLM, target_greedy

    auto = Target(TargetConfig(arch=GPU_ARCH, fused_elementwise="off"), num_draft_layers=2, device=DEV)
    assert (auto.packing, auto.attention) == ("varlen", "varlen")
    sdpa = Target(TargetConfig(arch=GPU_ARCH, fused_elementwise="off", attention="sdpa"), num_draft_layers=2,
                  device=DEV)
    prompt = torch.randint(0, GPU_ARCH["vocab_size"], (40,), generator=torch.Generator().manual_seed(2)).tolist()
    got = target_greedy(TargetLM(auto.model, auto.tap_layers), prompt, 24).tokens
    assert auto.model.config._attn_implementation == "sdpa"
    assert got == target_greedy(TargetLM(sdpa.model, sdpa.tap_layers), prompt, 24).tokens


def test_compiled_flex_over_more_shapes_than_the_recompile_limit_never_falls_back() -> None:
    """The tests/gpu failure of issue 11: one process, more drafter shapes (64..512 anchors, two windows) than the
    recompile limit (lowered to 2 to keep compile time down), inductor. Every shape gets its own compiled flex pair;
    dynamo never gives up and nothing runs eager flex."""
    from torch._dynamo import config as dynamo_config

    from dflash.kernels import recompile_limit_hits

    shapes = [(64, 2048), (256, 4096), (128, 3072)]  # more than the (lowered) limit, each compiled once
    hits = recompile_limit_hits()
    times = []
    with dynamo_config.patch(recompile_limit=2), FlexWarningWatch() as watch:
        for i, (a, n) in enumerate(shapes):
            d, emb, head = _drafter("flex", a)
            emb, head = emb.to(torch.bfloat16), head.to(torch.bfloat16)
            batch = _buffer(n, [n // 2, n // 4, n // 8], 2 * H, VOCAB, seed=40 + i)
            anchors, keep = sample_anchors(batch, a, 16, torch.Generator(device=DEV).manual_seed(i))
            _step(d, batch, emb, head, anchors, keep, bf16=True)
            _, _, dt = _step(d, batch, emb, head, anchors, keep, bf16=True)
            times.append(round(dt * 1e3, 1))
    print(f"{len(shapes)} shapes, second-step ms {times}; fallbacks {watch.fallbacks}")
    assert watch.fallbacks == [] and watch.triggered == [] and recompile_limit_hits() == hits


_F32_PROBE = r"""
import json, sys, torch
from dflash.kernels import exact_float32_kernels, float32_is_exact
state = exact_float32_kernels() if sys.argv[1] == "exact" else {}  # before anything imports fla's kernels
from dflash.speculative import TargetLM
from dflash.target import Target, TargetConfig
torch.set_float32_matmul_precision("highest")
arch = json.loads(sys.argv[2])
lm = TargetLM(Target(TargetConfig(arch=arch, dtype="float32"), 2, torch.device("cuda")).model, [0])
ids = torch.randint(0, arch["vocab_size"], (96,), generator=torch.Generator().manual_seed(0)).tolist()
full, _ = lm.forward(ids, 0, None, keep=33, taps=False)  # positions 63..95, one chunked forward
cache = lm.new_cache()
rows = [lm.forward(ids[:64], 0, cache, keep=1, taps=False)[0][-1]]  # position 63
for t in range(64, 96):  # one token at a time: the recurrent kernels
    rows.append(lm.forward([ids[t]], t, cache, keep=1, taps=False)[0][-1])
a, b = full.double(), torch.stack(rows).double()
print(json.dumps({"state": state, "exact": float32_is_exact("cuda"), "rel": ((a - b).norm() / a.norm()).item()}))
"""


@pytest.mark.skipif(not HAVE_FAST, reason="needs the fla wheel")
def test_exact_float32_kernels_make_chunked_and_recurrent_logits_agree() -> None:
    """The lossless check of a float32 evaluation needs chunked (verify) and recurrent (decode) forwards to agree to
    float32 rounding; fla's chunked kernels multiply in TF32 on Hopper unless exact_float32_kernels ran first (in a
    fresh process: the switch must precede the first compile)."""
    import json
    import subprocess
    import sys

    res = {}
    for mode in ("default", "exact"):
        proc = subprocess.run([sys.executable, "-c", _F32_PROBE, mode, json.dumps(GPU_ARCH)], capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        res[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    print("float32 chunked vs recurrent logits", res)
    assert res["exact"]["exact"] and res["exact"]["state"]["fla_solve_tril"] == "ieee"
    assert res["exact"]["rel"] < 1e-5


@pytest.mark.skipif(not HAVE_FAST, reason="needs flash-linear-attention and causal-conv1d")
def test_regen_batch_at_the_cuda_rows_cap_decodes() -> None:
    """4096 prompts x 16 Gated DeltaNet value heads overflowed fla's launch grid (y <= 65,535) on an H200; regen
    lowers its batch to cuda_rows_cap. A batch of exactly that many prompts must run."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from dflash.regen import CUDA_GRID_Y_MAX, cuda_rows_cap, generate_batch

    arch = {**GPU_ARCH, "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32, "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**arch)).to(DEV, torch.bfloat16).eval()
    cap = cuda_rows_cap(model.config)
    assert cap == CUDA_GRID_Y_MAX // 16
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, arch["vocab_size"], (cap, 12), generator=g).tolist()
    outs = generate_batch(model, prompts, 3, 0.0, [], DEV)
    assert len(outs) == cap and all(len(gen) == 3 and why == "length" for gen, why in outs)
