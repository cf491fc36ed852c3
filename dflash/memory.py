"""drafter.grad_checkpoint: auto (issue 24 item 2): recompute a drafter layer's forward only where memory needs it.

Checkpointing every layer costs a second forward of each in backward (HFU above MFU for nothing when the card has
room). `auto` keeps the activations of as many layers as fit the memory measured after the target is loaded and
checkpoints the rest (the first k layers). The estimate is deliberately simple and counted from the model's dims;
what a GPU session has to confirm is in docs/perf.md ("Issue 24: built, not yet measured on a GPU").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GIB = 1024 ** 3
DEFAULT_MARGIN = 8 * GIB  # allocator fragmentation, CE chunks' logits, flex's block masks, the compile's workspaces


@dataclass(frozen=True)
class DrafterMemoryShape:
    """What a drafter step's activations depend on: M = anchors x block rows of queries, N context rows."""

    num_layers: int
    n_ctx: int  # token_budget
    m: int  # num_anchors * block_size
    hidden: int
    q_width: int  # num_heads * head_dim
    kv_width: int  # num_kv_heads * head_dim
    intermediate: int
    dtype_bytes: int = 2  # bf16 autocast


def layer_activation_bytes(s: DrafterMemoryShape) -> int:
    """Bytes one layer keeps for backward without checkpointing: on the M query rows the norms' and projections'
    inputs and outputs (~6 H + 3 q + 4 I per row: residual, norms, q, attention out, o-proj in, MLP gate/up/act),
    and k, v over the N + M key rows (saved by attention, 2 kv each, plus their pre-RoPE copies)."""
    per_m = 6 * s.hidden + 3 * s.q_width + 4 * s.intermediate
    per_key = 4 * s.kv_width
    return s.dtype_bytes * (s.m * per_m + (s.n_ctx + s.m) * per_key)


def checkpointed_layer_bytes(s: DrafterMemoryShape) -> int:
    """A checkpointed layer keeps only its input (the M x H residual; the context is shared by all layers)."""
    return s.dtype_bytes * s.m * s.hidden


def choose_checkpoint_layers(num_layers: int, per_layer: int, per_checkpointed: int, available: int) -> int:
    """How many layers (the first k) to checkpoint so the kept activations fit `available` bytes: 0 when all fit,
    num_layers when even that does not (the most memory checkpointing can save)."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if num_layers * per_layer <= available:
        return 0
    saved_each = per_layer - per_checkpointed
    if saved_each <= 0:
        return num_layers
    return min(num_layers, math.ceil((num_layers * per_layer - available) / saved_each))


@dataclass(frozen=True)
class CheckpointChoice:
    layers: int  # checkpointed (the first k)
    of: int
    per_layer_gib: float
    available_gib: float

    def line(self) -> str:
        return (f"drafter.grad_checkpoint auto: {self.layers} of {self.of} layers checkpointed (activations "
                f"{self.per_layer_gib:.2f} GiB per layer, {self.available_gib:.1f} GiB available after the target, "
                f"the drafter's weights and optimizer, and a {DEFAULT_MARGIN // GIB} GiB margin)")


def auto_checkpoint(s: DrafterMemoryShape, free_bytes: int, fixed_bytes: int, margin: int = DEFAULT_MARGIN
                    ) -> CheckpointChoice:
    """The decision from a measured free memory (torch.cuda.mem_get_info after the target is loaded) minus what the
    step holds regardless (`fixed_bytes`: drafter weights, gradients and AdamW state, the hidden-state buffer)."""
    available = max(0, free_bytes - fixed_bytes - margin)
    per = layer_activation_bytes(s)
    k = choose_checkpoint_layers(s.num_layers, per, checkpointed_layer_bytes(s), available)
    return CheckpointChoice(k, s.num_layers, per / GIB, available / GIB)


def resolve_grad_checkpoint(setting: bool | str, num_layers: int) -> int:
    """drafter.grad_checkpoint -> checkpointed layers before any measurement: true all, false none, auto all (the
    safe default; the trainer narrows it on CUDA from the measured memory)."""
    if setting is True or setting == "auto":
        return num_layers
    if setting is False:
        return 0
    raise ValueError(f"drafter.grad_checkpoint must be true, false or auto; got {setting!r}")


def apply_auto_checkpoint(drafter: Any, token_budget: int, kh: int, device: Any, log: Callable[[str], None]
                          ) -> CheckpointChoice | None:
    """On CUDA with drafter.grad_checkpoint auto: measure free memory now (after the target is loaded), decide,
    set drafter.checkpoint_layers and say it in one line. Elsewhere (CPU, true, false) nothing changes."""
    import torch

    cfg = drafter.cfg
    if cfg.grad_checkpoint != "auto" or getattr(device, "type", str(device)) != "cuda":
        return None
    layer = drafter.layers[0]
    attn = layer.self_attn if hasattr(layer, "self_attn") else None
    q_w = attn.q_proj.out_features if attn is not None and hasattr(attn, "q_proj") else cfg.num_heads * drafter.head_dim
    kv_w = attn.k_proj.out_features if attn is not None and hasattr(attn, "k_proj") else \
        cfg.num_kv_heads * drafter.head_dim
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    hidden = drafter.fc.out_features
    inter = next((m.out_features for n, m in layer.named_modules() if n.endswith("up_proj")), 3 * hidden)
    shape = DrafterMemoryShape(num_layers=len(drafter.layers), n_ctx=token_budget,
                               m=cfg.num_anchors * cfg.block_size, hidden=hidden, q_width=q_w, kv_width=kv_w,
                               intermediate=inter)
    free, _total = torch.cuda.mem_get_info(device)
    fixed = params * 16 + token_budget * kh * 2  # fp32 weight + grad + AdamW m, v; the bf16 hidden-state buffer
    choice = auto_checkpoint(shape, free, fixed)
    drafter.checkpoint_layers = choice.layers
    log(choice.line())
    return choice
