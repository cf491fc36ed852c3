"""The drafter's configuration (`drafter:` in a run config), free of torch.

Split from dflash/model.py (which re-exports it) so the CLI can check a config file before it pays for importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DrafterConfig:
    num_layers: int = 1
    hidden_size: int | None = None  # None -> target hidden size (must equal it: embedding and LM head are shared)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None -> hidden_size // num_heads
    intermediate_size: int | None = None  # None -> ~3x hidden
    block_size: int = 16  # B
    num_anchors: int = 64  # fixed anchors per buffer
    loss_gamma: float = 7.0
    # Loss weight of block position k (issue 40's ablation): "exp" exp(-(k-1)/loss_gamma) (DFlash, SpecForge);
    # "dpace" D-PACE (speculators' default: the expected accepted run that position k is part of, from the drafter's
    # own detached confidences, smoothed by dpace_alpha); "uniform" 1 for every k >= 1. Always normalised by sum(w).
    position_weights: str = "exp"
    dpace_alpha: float = 0.5
    # How anchors are drawn in a buffer: "buffer" uniformly over its valid positions (long documents take most);
    # "document" each document the same expected share (short documents never starve).
    anchor_sampling: str = "buffer"
    mask_token_id: int | None = None  # None -> caller sets (tokenizer's mask token)
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = None  # per query position: q reads keys in [q-w+1, q] (+ its block); None = all
    # How a sliding-window layer (one whose window is not None) masks the block (issue 40's ablation: the trainers
    # disagree); full-attention layers always read their whole context and their whole block, whatever these say.
    # sliding_block_causal: block query k reads block key j only if j <= k (and the window allows it), z-lab's and
    # vLLM's rule for a config.json without is_causal; false: the whole block, bidirectionally (the export then says
    # is_causal: false).
    sliding_block_causal: bool = False
    # sliding_window_from: "query" counts the window per query position, as every engine serves it: the query at
    # a + k reads context p with (a + k) - p < w and block keys j with k - j < w. "anchor" is speculators' rule
    # (0.9.0, create_anchor_block_mask_mod): every block position reads context [a - w, a - 1] (a - p <= w) and its
    # block keys are not windowed at all (the whole block, or j <= k when sliding_block_causal); no engine serves it,
    # so `dflash export` refuses it (train and eval work).
    sliding_window_from: str = "query"
    attention: str = "auto"  # auto: flex on CUDA, dense on CPU | "flex" | "dense" | "flex-eager" (debug only)
    ce_chunk: int = 1024  # rows of logits per chunk (never full fp32 logits)
    grad_checkpoint: bool | str = False  # per-layer non-reentrant checkpointing: true | false | auto (dflash/memory.py)
    layer_sliding_windows: list[int | None] | None = None  # optional per-layer window (overrides sliding_window)
