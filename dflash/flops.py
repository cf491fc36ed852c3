"""The FLOPs model of one training step: the target forward, the drafter forward + backward, and the bf16 peak.

What MFU in bench/ and docs/perf.md means; every count is 2 FLOPs per multiply-add of a matmul (elementwise work:
norms, activations, RoPE, gates, softmax, the optimizer, is memory-bound and not counted). docs/perf.md explains it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

# fla's chunked Gated DeltaNet works on chunks of 64 tokens (fla.ops.gated_delta_rule.chunk, BT = 64).
DELTA_RULE_CHUNK = 64


# ---------------------------------------------------------------------------------------------- the target
@dataclass
class TargetLayerCost:
    """One decoder layer: weights that multiply every token, plus the mixer's own per-token/per-pair terms."""

    kind: str  # "full_attention" | "linear_attention"
    weights: int  # nn.Linear + depthwise Conv1d weights of the layer: each is one multiply-add per token
    heads: int = 0  # full attention: query heads; linear attention: value heads
    head_dim: int = 0  # full attention: q/k head dim; linear: key head dim
    value_dim: int = 0  # full attention: v head dim; linear: value head dim

    def per_token(self) -> float:
        """Matmul FLOPs per token that do not depend on the other tokens of the document."""
        f = 2.0 * self.weights
        if self.kind == "linear_attention":
            f += self.heads * delta_rule_per_token(self.head_dim, self.value_dim)
        return f

    def per_pair(self) -> float:
        """FLOPs per (query, key) pair the layer attends: QK^T and PV (full attention only)."""
        if self.kind != "full_attention":
            return 0.0
        return 2.0 * self.heads * (self.head_dim + self.value_dim)


def delta_rule_per_token(dk: int, dv: int, chunk: int = DELTA_RULE_CHUNK) -> float:
    """Chunked Gated DeltaNet per token and value head, as the chunk kernel computes it (dense C x C tiles).

    Per chunk of C tokens: K K^T, the W = T K and U = T V transforms, Q K^T and the intra-chunk output (2C^2 each
    over dk, dk, dv, dk, dv), the triangular solve (C^3/3 multiply-adds), and against the [dk, dv] state: W S,
    Q S and the update K^T V' (2 C dk dv each). Divided by C.
    """
    c = chunk
    return 6.0 * dk * dv + 2.0 * c * (3 * dk + 2 * dv) + (2.0 / 3.0) * c * c


def target_layer_costs(model: nn.Module) -> list[TargetLayerCost]:
    """The cost of every decoder layer, read off the built model (a meta-device one is enough: only shapes).

    Reading the weights rather than the config counts every family's real layout (Qwen3.5's gated q_proj is twice
    the query width; the GDN's split qkv / z / a / b projections; the depthwise conv).
    """
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    costs = []
    for kind, layer in zip(types, base.layers, strict=True):
        weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, (nn.Linear, nn.Conv1d)))
        if kind == "linear_attention":
            costs.append(TargetLayerCost(kind, weights, int(cfg.linear_num_value_heads),
                                         int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)))
        else:
            hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
            costs.append(TargetLayerCost("full_attention", weights, int(cfg.num_attention_heads), hd, hd))
    return costs


def causal_pairs(doc_lengths: Sequence[int]) -> int:
    """(query, key) pairs of causal attention inside each document: L (L + 1) / 2 per document."""
    return sum(n * (n + 1) // 2 for n in doc_lengths)


@dataclass
class TargetFlops:
    """FLOPs of one target forward over a buffer of documents."""

    layers_run: int
    tokens: int
    linear: float  # projections, conv, delta rule
    attention: float  # full-attention QK^T and PV over the causal pairs of each document
    lm_head: float  # 0 unless the forward computes logits (plain transformers does; the project's never)

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.lm_head


def target_forward_flops(costs: Sequence[TargetLayerCost], doc_lengths: Sequence[int], layers_run: int,
                         hidden_size: int = 0, vocab_size: int = 0, lm_head: bool = False) -> TargetFlops:
    """A forward through the first `layers_run` layers of the documents `doc_lengths` (packed or padded rows alike:
    only real tokens and in-document pairs count, the work on padding is not useful work).

    The project's forward stops after the deepest tapped layer (max(tap_layers) + 1 layers) and never runs the LM
    head; plain transformers runs every layer and the LM head (2 H V per token) unless told otherwise.
    """
    tokens = sum(doc_lengths)
    pairs = causal_pairs(doc_lengths)
    run = costs[:layers_run]
    linear = sum(c.per_token() for c in run) * tokens
    attention = sum(c.per_pair() for c in run) * pairs
    head = 2.0 * hidden_size * vocab_size * tokens if lm_head else 0.0
    return TargetFlops(layers_run=len(run), tokens=tokens, linear=linear, attention=attention, lm_head=head)


# ---------------------------------------------------------------------------------------------- the drafter
def drafter_attention_pairs(anchor_positions: Tensor, anchor_in_doc: Tensor, block_size: int,
                            window: int | None, causal: bool = False, from_anchor: bool = False) -> int:
    """(query, key) pairs the drafter's mask allows, summed over all anchors: what dense_mask(...).sum() counts,
    without building the [A*B, N + A*B] mask.

    Query k of the block at anchor a (position `pos` in its document) reads context keys p in its document with
    p < a and a + k - p < w: min(pos, w - k - 1) of them (pos without a window); and the block keys j with
    k - j < w: B - max(0, k - w + 1), or with `causal` (j <= k too) min(k + 1, w). Window counted from the anchor
    (`from_anchor`): min(pos, w) context keys for every k, the block unwindowed (B, or k + 1 causal). An anchor
    outside any document (padding) reads no context.
    """
    k = torch.arange(block_size, device=anchor_positions.device)
    pos = anchor_positions.long()[:, None]
    if window is None:
        ctx = pos.expand(-1, block_size)
        blk = k + 1 if causal else torch.full((block_size,), block_size, device=k.device)
    elif from_anchor:
        ctx = pos.clamp(max=window).expand(-1, block_size)
        blk = k + 1 if causal else torch.full((block_size,), block_size, device=k.device)
    else:
        ctx = torch.minimum(pos, (window - k - 1).clamp(min=0)[None, :])
        blk = (k + 1).clamp(max=window) if causal else block_size - (k - window + 1).clamp(min=0)
    ctx = ctx * anchor_in_doc.long()[:, None]
    return int(ctx.sum()) + int(blk.sum()) * anchor_positions.shape[0]


def block_mask_pairs(block_mask: Any) -> int:
    """(query, key) pairs flex-attention really computes for a BlockMask: every non-empty tile (partial or full) is
    computed whole, Q_BLOCK x KV_BLOCK pairs (per batch and head entry of the mask; the drafter's has one of each)."""
    q_block, kv_block = block_mask.BLOCK_SIZE
    tiles = int(block_mask.kv_num_blocks.sum())
    if block_mask.full_kv_num_blocks is not None:
        tiles += int(block_mask.full_kv_num_blocks.sum())
    return tiles * q_block * kv_block


@dataclass
class DrafterShape:
    """What the drafter step's cost depends on: the config's sizes and this buffer's attention pairs per layer."""

    hidden: int
    num_taps: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    n_ctx: int  # token_budget
    num_anchors: int
    block_size: int
    pairs: list[int]  # allowed (query, key) pairs per layer
    grad_checkpoint: bool = False
    flex_hw_pairs: list[int] | None = None  # pairs the kernel really computes (non-empty 128x128 tiles), if known
    checkpoint_layers: int | None = None  # the first k layers recompute (drafter.grad_checkpoint auto); None: all/none

    @property
    def m(self) -> int:
        return self.num_anchors * self.block_size


@dataclass
class DrafterFlops:
    """One drafter step. `model` is what MFU counts (forward + backward, 2x forward for what is trained, 1x where
    only one gradient is needed); `hardware` adds what the GPU recomputes: checkpointed layers, the CE chunks'
    logits, and flash attention's backward re-forming the scores."""

    parts: dict[str, float] = field(default_factory=dict)  # forward FLOPs per part
    model: float = 0.0
    hardware: float = 0.0


def drafter_step_flops(s: DrafterShape) -> DrafterFlops:
    """Forward parts, then the model and hardware totals of forward + backward (see DrafterFlops)."""
    h, m, n = s.hidden, s.m, s.n_ctx
    q_w, kv_w = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    layers = len(s.pairs)
    fwd = {
        "fc": 2.0 * n * s.num_taps * h * h,
        "q_o_proj": layers * 2.0 * m * h * q_w * 2,
        "kv_proj": layers * 2.0 * (n + m) * h * kv_w * 2,
        "mlp": layers * 2.0 * m * h * s.intermediate * 3,
        "attention": sum(4.0 * q_w * p for p in s.pairs),
        "lm_head": 2.0 * m * h * s.vocab,
    }
    layer_fwd = fwd["q_o_proj"] + fwd["kv_proj"] + fwd["mlp"] + fwd["attention"]
    # Backward: the layers train (input and weight gradients: 2x); fc's input is data (weight gradient only: 1x);
    # the LM head is frozen (input gradient only: 1x); the embedding is a lookup.
    model = sum(fwd.values()) + 2.0 * layer_fwd + fwd["fc"] + fwd["lm_head"]
    hw_attention = sum(4.0 * q_w * p for p in (s.flex_hw_pairs or s.pairs))
    hardware = model + (hw_attention - fwd["attention"]) * 3.0  # fwd + 2x bwd over the tiles really computed
    hardware += 0.5 * hw_attention  # the backward recomputes QK^T (2.5x forward instead of 2x)
    hardware += fwd["lm_head"]  # chunked CE: each chunk's logits are recomputed in backward
    k = s.checkpoint_layers if s.checkpoint_layers is not None else (layers if s.grad_checkpoint else 0)
    if k:  # each checkpointed layer's forward again in backward (dense parts are equal per layer)
        hw_pairs = s.flex_hw_pairs or s.pairs
        hardware += (layer_fwd - fwd["attention"]) * k / layers + sum(4.0 * q_w * p for p in hw_pairs[:k])
    return DrafterFlops(parts=fwd, model=model, hardware=hardware)


# ---------------------------------------------------------------------------------------------- the card
def measure_matmul_tflops(device: torch.device | str, n: int = 8192, iters: int = 20,
                          dtype: torch.dtype = torch.bfloat16) -> float:
    """The dense matmul rate this device reaches now: [n, n] @ [n, n] in `dtype`, best of three timed batches.

    MFU is against this, measured in the same run (not a datasheet peak): on CUDA with events after a warm-up.
    """
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    flops = 2.0 * n ** 3 * iters
    for _ in range(3):
        a @ b  # warm-up: cuBLAS heuristics, clocks
    best = math.inf
    for _ in range(3):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                a @ b
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    return flops / best / 1e12


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    """Achieved FLOP/s over the measured peak, as a fraction."""
    if seconds <= 0 or peak_tflops <= 0:
        return math.nan
    return flops / seconds / (peak_tflops * 1e12)


def as_row(name: str, flops: float, seconds: float, peak_tflops: float, extra: dict[str, Any] | None = None
           ) -> dict[str, Any]:
    """One report row: phase, ms, TFLOP (model), achieved TFLOP/s and MFU."""
    row: dict[str, Any] = {"phase": name, "ms": round(seconds * 1e3, 2), "tflop": round(flops / 1e12, 3),
                           "tflops_per_s": round(flops / seconds / 1e12, 1) if seconds > 0 else None,
                           "mfu": round(mfu(flops, seconds, peak_tflops), 4) if flops else None}
    row.update(extra or {})
    return row
