"""GPU-only: flex-attention gradients equal the dense rule's at the H200 quality bench's real training shape.

Why: on the H200 a drafter trained through the compiled flex path generalised far worse than the same recipe trained
dense (held-out accuracy 39 % vs 66.5 %, docs/quality.md) while the CPU paths agree to 1e-6. The other GPU checks
compare gradients only at small buffers (16 heads x 4096 x 8192 scores); here the score grid is 16 x 16384 x 32768
(over 2**31 elements, where flex kernels have had indexing and backward bugs upstream, pytorch#158212, #145869).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dflash.kernels import dynamo_counts
from dflash.model import DFlashDrafter, DraftBatch, DrafterConfig, compile_regions, sample_anchors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = torch.device("cuda")
HIDDEN, VOCAB, N, ANCHORS, BLOCK = 1024, 8192, 16384, 1024, 16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().double(), b.detach().double()
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item()


def _buffer(seed: int) -> DraftBatch:
    """51 regen-like records of 320 tokens (64 prompt + 256 supervised), then padding: the bench's buffers."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((N,), -1, dtype=torch.long)
    pos = torch.zeros(N, dtype=torch.long)
    sup = torch.zeros(N, dtype=torch.bool)
    for d in range(N // 320):
        s = d * 320
        doc[s:s + 320] = d
        pos[s:s + 320] = torch.arange(320)
        sup[s + 64:s + 320] = True
    return DraftBatch(hidden=torch.randn(N, 2 * HIDDEN, generator=g).to(torch.bfloat16),
                      input_ids=torch.randint(0, VOCAB - 1, (N,), generator=g), loss_mask=sup, position_ids=pos,
                      doc_ids=doc).to(DEV)


def _grads(d: torch.nn.Module, batch: DraftBatch, emb: torch.nn.Module, head: torch.nn.Module, anchors: torch.Tensor,
           keep: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    d.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = d(batch, emb, head, anchors=anchors, keep=keep)
    out.loss.backward()
    return out.loss.item(), {k.removeprefix("_orig_mod."): p.grad.detach().clone() for k, p in d.named_parameters()}


@pytest.mark.parametrize("compiled_step", [False, True, "regional"],
                         ids=["flex-module", "whole-step-compiled", "regional-compiled"])
def test_flex_gradients_equal_dense_at_the_bench_training_shape(compiled_step: bool | str) -> None:
    """regional-compiled: train.compile_scope regional (one layer and one CE chunk compiled, flex traced inside
    the layer); the second buffer must also compile nothing new."""
    torch.manual_seed(0)
    cfg = DrafterConfig(num_layers=2, num_heads=16, num_kv_heads=4, block_size=BLOCK, num_anchors=ANCHORS,
                        mask_token_id=VOCAB - 1, attention="dense")
    dense = DFlashDrafter(cfg, HIDDEN, 2).to(DEV)
    flex = copy.deepcopy(dense)
    flex.attention_backend = "flex-compiled"
    emb = torch.nn.Embedding(VOCAB, HIDDEN).to(DEV, torch.bfloat16).requires_grad_(False)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(DEV, torch.bfloat16).requires_grad_(False)
    if compiled_step == "regional":
        compile_regions(flex)
        runner: torch.nn.Module = flex
    else:
        runner = torch.compile(flex) if compiled_step else flex
    frames = []
    for seed in (1, 2):  # the second buffer runs the already compiled kernels with new anchors
        batch = _buffer(seed)
        anchors, keep = sample_anchors(batch, ANCHORS, BLOCK, torch.Generator(device=DEV).manual_seed(seed))
        loss_f, grads_f = _grads(runner, batch, emb, head, anchors, keep)
        loss_d, grads_d = _grads(dense, batch, emb, head, anchors, keep)
        err = {k: _rel(grads_f[k], grads_d[k]) for k in grads_d}
        worst = sorted(err.items(), key=lambda kv: -kv[1])[:4]
        print(f"buffer {seed}: loss flex {loss_f:.5f} dense {loss_d:.5f}; worst grads {worst}")
        assert abs(loss_f - loss_d) / abs(loss_d) < 2e-2
        assert worst[0][1] < 5e-2, f"flex gradients differ from the dense rule's: {worst}"
        frames.append(dynamo_counts()["frames"])
    if compiled_step:
        assert frames[1] == frames[0], f"recompiled on the second buffer: frames {frames}"
