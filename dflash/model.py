"""The DFlash drafter: a few Qwen3-style layers that denoise a block of B tokens conditioned on tapped target states.

Read top to bottom: config and batch types, anchor sampling, the attention mask rule (dense and flex), the layers, the loss.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash.drafter_config import DrafterConfig  # a torch-free module, so the CLI checks a config before torch
from dflash.memory import resolve_grad_checkpoint

# ----------------------------------------------------------------------------- config and batch types


@dataclass
class DraftBatch:
    """One fixed-shape buffer of N = token_budget packed tokens; no shape here ever depends on the data."""

    hidden: Tensor  # [N, K*H] tapped target hidden states (target dtype)
    input_ids: Tensor  # [N] long
    loss_mask: Tensor  # [N] bool (supervised tokens; padding False)
    position_ids: Tensor  # [N] long, position within its document
    doc_ids: Tensor  # [N] long, document index in the buffer, -1 for padding

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DraftBatch:
        return DraftBatch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    def validate(self) -> None:
        """Shapes and dtypes, checked once where a buffer is built (cheap; no data-dependent host sync)."""
        n = self.input_ids.shape[0]
        if self.hidden.ndim != 2 or self.hidden.shape[0] != n:
            raise ValueError(f"DraftBatch.hidden must be [N, K*H] with N={n}, got {tuple(self.hidden.shape)}")
        for name in ("input_ids", "loss_mask", "position_ids", "doc_ids"):
            t = getattr(self, name)
            if t.shape != (n,):
                raise ValueError(f"DraftBatch.{name} must be [N={n}], got {tuple(t.shape)}")
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"DraftBatch.loss_mask must be bool, got {self.loss_mask.dtype}")


@dataclass
class DraftOutput:
    loss: Tensor  # scalar: sum(w * ce) / sum(w)
    acc: Tensor  # [B-1] accuracy per block position 1..B-1 (detached)
    weight_sum: Tensor  # scalar
    num_tokens: Tensor  # supervised predictions counted


# ----------------------------------------------------------------------------- anchors


def anchor_candidates(batch: DraftBatch) -> Tensor:
    """[N] bool: a may anchor a block when it and the next token are supervised and in the same document."""
    n = batch.input_ids.shape[0]
    valid = torch.zeros(n, dtype=torch.bool, device=batch.input_ids.device)
    same_doc = (batch.doc_ids[:-1] == batch.doc_ids[1:]) & (batch.doc_ids[:-1] >= 0)
    valid[:-1] = batch.loss_mask[:-1] & batch.loss_mask[1:] & same_doc
    return valid


def sample_anchors(
    batch: DraftBatch, num_anchors: int, block_size: int, generator: torch.Generator | None,
    per_document: bool = False,
) -> tuple[Tensor, Tensor]:
    """Pick `num_anchors` random valid anchor positions with fixed-shape ops: (anchors [A] long sorted, keep [A] bool).

    Random scores for valid positions, -1 for invalid ones, then top-k: the shape is A whatever the data, there is no
    nonzero/randperm and no host sync. With fewer valid positions than A the rest are filled with invalid positions
    whose `keep` is False. Sorted anchors keep neighbouring query tiles close in the context (sparser flex blocks).
    `block_size` is part of the signature for callers that want to exclude anchors near the end (not needed: labels
    past a document's end get weight 0).

    `per_document`: weighted sampling without replacement (Efraimidis-Spirakis: the top-k of log(u) / w) with each
    position's weight 1 / (its document's valid positions), so every document gets the same expected share of the
    anchors however short it is; still one topk over fixed shapes (the per-document counts are a scatter_add into N).
    """
    del block_size
    n = batch.input_ids.shape[0]
    if num_anchors > n:
        raise ValueError(f"num_anchors={num_anchors} exceeds the buffer's token budget N={n}")
    valid = anchor_candidates(batch)
    gen_device = generator.device if generator is not None else valid.device
    scores = torch.rand(n, generator=generator, device=gen_device).to(valid.device)
    if per_document:
        doc = batch.doc_ids.clamp(min=0)
        counts = torch.zeros(n, dtype=torch.float32, device=valid.device).scatter_add_(0, doc, valid.float())
        # log-keys: n_doc * log(u) (<= 0); invalid positions sort below every valid one
        scores = counts[doc].clamp(min=1.0) * torch.log(scores.clamp(min=1e-30))
        scores = torch.where(valid, scores, torch.full_like(scores, -float("inf")))
    else:
        scores = torch.where(valid, scores, torch.full_like(scores, -1.0))
    _, idx = torch.topk(scores, num_anchors, sorted=False)
    anchors, _ = torch.sort(idx)
    return anchors, valid[anchors]


# ----------------------------------------------------------------------------- the attention rule


def block_attention_rule(
    q_idx: Tensor, kv: Tensor, anchors: Tensor, doc_ids: Tensor, n_ctx: int, block_size: int,
    window: int | Tensor | None, causal: bool | Tensor = False, from_anchor: bool | Tensor = False,
) -> Tensor:
    """The one mask rule, elementwise (broadcasting): may query `q_idx` (block q_idx // B, offset q_idx % B) read key
    index `kv`?

    Keys 0..N-1 are context positions: allowed iff same document as the anchor and strictly before the anchor (`<`:
    the serving drafter never sees the anchor's own target state). Keys N.. are the blocks' own tokens: allowed iff
    they belong to the same block (bidirectional inside the block), and with `causal` only block keys j <= the
    query's offset k. The caller passes causal only for sliding-window layers (drafter.sliding_block_causal):
    full-attention layers always see the whole block.

    Sliding window `w`, per query position as serving engines apply it (`from_anchor` false): the query at absolute
    position q = a + k (anchor a, block offset k) reads keys at positions >= q - w + 1, i.e. [q-w+1, q] plus, when
    bidirectional, the later tokens of its own block. So a context position p needs q - p < w, and a block key at
    offset j needs k - j < w. `from_anchor` is speculators' rule instead (drafter.sliding_window_from: anchor):
    every block position reads context [a-w, a-1] (a - p <= w) and its block keys unwindowed; late block positions
    then read context that an engine's sliding-window layer will not give them at serving time.
    Both the dense mask and the flex mask_mod are this function, so they cannot disagree.
    """
    q_block = torch.div(q_idx, block_size, rounding_mode="floor")
    q_off = q_idx - q_block * block_size
    a = anchors[q_block]
    is_ctx = kv < n_ctx
    p = torch.clamp(kv, max=n_ctx - 1)
    doc_p = doc_ids[p]
    ctx_ok = is_ctx & (doc_p == doc_ids[a]) & (doc_p >= 0) & (p < a)
    kv_block = torch.div(kv - n_ctx, block_size, rounding_mode="floor")
    kv_off = kv - n_ctx - kv_block * block_size
    blk_ok = (~is_ctx) & (kv_block == q_block)
    if isinstance(causal, Tensor):  # a 0-d bool per layer (the flex closure): one graph for causal and not
        blk_ok = blk_ok & ((kv_off <= q_off) | ~causal)
    elif causal:
        blk_ok = blk_ok & (kv_off <= q_off)
    if window is None:
        return ctx_ok | blk_ok
    if isinstance(from_anchor, Tensor):  # a 0-d bool (the flex closure): both window rules in one graph
        ctx_ok = ctx_ok & torch.where(from_anchor, a - p <= window, a + q_off - p < window)
        blk_ok = blk_ok & ((q_off - kv_off < window) | from_anchor)
    elif from_anchor:
        ctx_ok = ctx_ok & (a - p <= window)
    else:
        ctx_ok = ctx_ok & (a + q_off - p < window)
        blk_ok = blk_ok & (q_off - kv_off < window)
    return ctx_ok | blk_ok


@dataclass(frozen=True)
class MaskRule:
    """How one layer masks its block: its window (None = full attention) and whether the block is causal there.

    Built from the drafter config by `layer_rules`, so the dense path, the flex path and the per-layer mask cache
    all key on the same thing. A full-attention layer's rule is always (None, False, False): the sliding options
    cannot change it."""

    window: int | None
    causal: bool = False
    from_anchor: bool = False


def layer_rules(cfg: DrafterConfig, windows: list[int | None]) -> list[MaskRule]:
    """One MaskRule per layer: causal and from_anchor only matter where the layer has a window (full-attention
    layers are never affected, so a full layer's rule is the same whatever the sliding options say)."""
    if cfg.sliding_window_from not in ("query", "anchor"):
        raise ValueError(f"drafter.sliding_window_from must be query or anchor, got {cfg.sliding_window_from!r}")
    anchor = cfg.sliding_window_from == "anchor"
    return [MaskRule(w, bool(cfg.sliding_block_causal) and w is not None, anchor and w is not None) for w in windows]


def dense_mask(anchors: Tensor, doc_ids: Tensor, block_size: int, window: int | None, causal: bool = False,
               from_anchor: bool = False) -> Tensor:
    """[A*B, N + A*B] bool mask for SDPA: exact, any device, with backward (memory grows as A*B*N: CPU/tests only)."""
    n = doc_ids.shape[0]
    m = anchors.shape[0] * block_size
    q_idx = torch.arange(m, device=doc_ids.device)
    kv = torch.arange(n + m, device=doc_ids.device)
    return block_attention_rule(q_idx[:, None], kv[None, :], anchors, doc_ids, n, block_size, window, causal,
                                from_anchor)


def flex_mask_mod(anchors: Tensor, doc_ids: Tensor, block_size: int, window: int | None, causal: bool = False,
                  from_anchor: bool = False) -> Callable[..., Tensor]:
    """The same rule as a flex-attention mask_mod (b, h, q_idx, kv_idx) -> bool.

    What the closure holds is what dynamo guards on when the mask is compiled: `anchors` [A] and `doc_ids` [N] (sized
    by the config, fixed for a run), the config's block size, and the window and the causal flag as 0-d tensors
    rather than Python values, so layers with different windows (a full layer and a sliding one, causal or not)
    share one compiled graph instead of one graph (and one cache entry) each. No window is a window longer than any
    query can see (N + A*B), which the rule treats exactly as None under either window rule. The window rule
    (`from_anchor`) is a 0-d tensor too: the compiled mask is per FlexShape and process-wide, so two drafters of one
    shape with different rules (tests, a bench comparing them) share it instead of recompiling.
    """
    n = doc_ids.shape[0]
    limit = window if window is not None else n + anchors.shape[0] * block_size
    # filled on the device, not copied from a host int: torch.tensor(limit, device=cuda) is a pageable host-to-device
    # copy, which makes the host wait for the GPU twice per drafter step (bench/step_phases.py, host_syncs)
    window_t = torch.full((), limit, dtype=torch.long, device=doc_ids.device)
    causal_t = torch.full((), bool(causal), dtype=torch.bool, device=doc_ids.device)
    anchor_t = torch.full((), bool(from_anchor), dtype=torch.bool, device=doc_ids.device)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return block_attention_rule(q_idx, kv_idx, anchors, doc_ids, n, block_size, window_t, causal_t, anchor_t)

    return mask_mod


@dataclass(frozen=True)
class FlexShape:
    """Everything a compiled flex graph is specialised on: one per drafter config (fixed for a run)."""

    q_len: int
    kv_len: int
    num_anchors: int
    n_ctx: int
    device: str
    backend: str = "inductor"


@dataclass
class FlexKernels:
    """The compiled flex_attention and create_block_mask of one FlexShape, each with its own recompile budget."""

    attention: Callable[..., Any]
    block_mask: Callable[..., Any]


_FLEX_KERNELS: dict[FlexShape, FlexKernels] = {}


def isolated_compile(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """torch.compile(fn) whose cache entries (and recompile_limit) belong to this call alone.

    Dynamo keeps its cache per code object: one process-wide compiled flex_attention shared by every shape it ever
    sees (tests, several drafters in one process) reaches recompile_limit (8) and then runs flex eagerly (10x slower,
    40x the memory, tests/gpu saw it). torch >= 2.13 isolates a compile call with `isolate_recompiles=True`; older
    versions get the same effect from a copy of the function with its own code object.
    """
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return torch.compile(fn, isolate_recompiles=True, **options)
    return torch.compile(copy_function(fn), **options)


def copy_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The same function with a new code object (dynamo's cache key), same globals, defaults and closure."""
    code = fn.__code__.replace()  # type: ignore[attr-defined]
    out = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)  # type: ignore[attr-defined]
    out.__kwdefaults__ = fn.__kwdefaults__  # type: ignore[attr-defined]
    out.__qualname__, out.__doc__ = fn.__qualname__, fn.__doc__
    return out


def flex_kernels(shape: FlexShape) -> FlexKernels:
    """The compiled pair for `shape`, built once per process and reused by every step with that shape.

    Compiled with dynamic=False (static shapes, the fastest kernels): within one FlexShape nothing the guards check
    changes from step to step except the data, and a new shape gets a new pair instead of evicting this one.
    """
    kernels = _FLEX_KERNELS.get(shape)
    if kernels is None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        opts = {"dynamic": False, "backend": shape.backend}
        kernels = FlexKernels(isolated_compile(flex_attention, **opts), isolated_compile(create_block_mask, **opts))
        _FLEX_KERNELS[shape] = kernels
    return kernels


def compiled_flex_attention(shape: FlexShape) -> Callable[..., Any]:
    """The compiled flex_attention for one shape (compiling per call, or per thread, is what broke before)."""
    return flex_kernels(shape).attention


def build_block_mask(mask_mod: Callable[..., Tensor], shape: FlexShape, device: torch.device) -> Any:
    """The flex BlockMask for this buffer; on CUDA its construction is compiled too (per FlexShape).

    Eager construction evaluates mask_mod over the whole [Q, KV] grid (GBs at training sizes); compiled, it never
    materialises it. torch deprecates create_block_mask's `_compile=True` in favour of compiling it, as here.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if torch.compiler.is_compiling() or (device.type != "cuda" and shape.backend == "inductor"):
        # Inside a compiled drafter step the enclosing compile traces it (a nested compile would only be inlined,
        # and building one there is a graph break); on CPU the eager grid is small.
        return create_block_mask(mask_mod, None, None, shape.q_len, shape.kv_len, device=device)
    return flex_kernels(shape).block_mask(mask_mod, None, None, shape.q_len, shape.kv_len, device=device)


def resolve_attention(choice: str, device: torch.device) -> str:
    """Config value -> the backend actually used: "dense", "flex-compiled" or "flex-eager"."""
    if choice == "auto":
        return "flex-compiled" if device.type == "cuda" else "dense"
    if choice == "flex":
        return "flex-compiled"
    if choice in ("dense", "flex-eager"):
        return choice
    raise ValueError(f"drafter.attention must be auto, flex, dense or flex-eager; got {choice!r}")


# ----------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float() if x.dtype != torch.float64 else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Qwen3 RoPE tables for arbitrary positions: [L, head_dim] cos and sin (computed in fp32 or fp64)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=work) / head_dim))
    freqs = positions.to(work)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [heads, L, head_dim]; rotate-half convention (as Qwen3 / HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA attention whose queries come from the block and whose keys/values come from [context ; block]."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        rope_q: tuple[Tensor, Tensor],
        rope_kv: tuple[Tensor, Tensor],
        attend: Callable[[Tensor, Tensor, Tensor], Tensor],
    ) -> Tensor:
        m, hd = x.shape[0], self.head_dim
        kv_in = torch.cat([ctx, x], dim=0)  # [N + M, H]: context features first, then the block tokens
        q = self.q_norm(self.q_proj(x).view(m, self.num_heads, hd)).transpose(0, 1)
        k = self.k_norm(self.k_proj(kv_in).view(-1, self.num_kv_heads, hd)).transpose(0, 1)
        v = self.v_proj(kv_in).view(-1, self.num_kv_heads, hd).transpose(0, 1)
        # One dtype for q, k, v (under autocast v is bf16 while the normed q/k are fp32); flex requires it.
        q = apply_rope(q, *rope_q).to(v.dtype)
        k = apply_rope(k, *rope_kv).to(v.dtype)
        out = attend(q, k, v)  # [heads, M, hd]
        return self.o_proj(out.transpose(0, 1).reshape(m, self.num_heads * hd))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, hidden: int, head_dim: int, intermediate: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.self_attn = Attention(hidden, cfg.num_heads, cfg.num_kv_heads, head_dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = MLP(hidden, intermediate)

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        rope_q: tuple[Tensor, Tensor],
        rope_kv: tuple[Tensor, Tensor],
        attend: Callable[[Tensor, Tensor, Tensor], Tensor],
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


def layer_step(
    layer: nn.Module,
    x: Tensor,
    ctx: Tensor,
    rope_q: tuple[Tensor, Tensor],
    rope_kv: tuple[Tensor, Tensor],
    attend: Callable[[Tensor, Tensor, Tensor], Tensor],
    recompute: bool,
) -> Tensor:
    """One decoder layer, its forward recomputed in backward when `recompute` (grad checkpointing).

    The unit that train.compile_scope regional compiles once and reuses for every layer: the layer is an argument,
    so its parameters are graph inputs (dynamo's inline_inbuilt_nn_modules, on by default since torch 2.5), not
    constants guarded by identity; `attend` is a closure that dynamo guards by its code and its cells' shapes (the
    mask, or flex's BlockMask), which are the same for every layer and every step. Only `recompute` takes part in
    the guards as a value: at most two graphs (checkpointed layers, the others).
    """
    if recompute:
        return checkpoint(layer, x, ctx, rope_q, rope_kv, attend, use_reentrant=False)
    return layer(x, ctx, rope_q, rope_kv, attend)


@dataclass
class Regions:
    """The compiled repeated units of a drafter step (train.compile_scope regional), each compiled once."""

    layer: Callable[..., Tensor]  # layer_step
    ce: Callable[..., tuple[Tensor, Tensor]]  # ce_step


COMPILE_SCOPES = ("whole", "regional")


def compile_regions(drafter: DFlashDrafter, backend: str = "inductor") -> Regions:
    """Compile the drafter's repeated units instead of the whole step (train.compile_scope regional).

    A whole-step compile traces every layer into one graph, so inductor generates, compiles and autotunes each
    layer's kernels again (the same kernels, num_layers times, forward, backward and recompute); the cold first
    step grows with the depth. Compiling `layer_step` once serves every layer (same code object, guards on shapes,
    parameters as inputs), and `ce_step` once serves every CE chunk (a last, shorter chunk adds one graph). What is
    left eager is small: the context projection, embeddings, RoPE tables, anchors, masks and labels. Each unit has
    its own recompile budget (isolated_compile), static shapes (the buffer's shape is fixed for a run), and lands in
    the FX graph / AOT autograd caches, so the mega-cache warm start (dflash/compile_cache.py) covers it.
    """
    regions = Regions(isolated_compile(layer_step, backend=backend, dynamic=False),
                      isolated_compile(ce_step, backend=backend, dynamic=False))
    drafter.regions = regions
    return regions


def compile_step_model(model: nn.Module, drafter: DFlashDrafter, scope: str, backend: str) -> nn.Module:
    """What the trainer calls for a step under train.compile (true): the whole model compiled (`whole`), or the
    model itself with the drafter's repeated units compiled (`regional`). `model` is the drafter or its DDP wrapper."""
    if scope == "regional":
        compile_regions(drafter, backend)
        return model
    if scope != "whole":
        raise ValueError(f"train.compile_scope must be one of {', '.join(COMPILE_SCOPES)}; got {scope!r}")
    drafter.regions = None
    return torch.compile(model, backend=backend)  # type: ignore[return-value]


# ----------------------------------------------------------------------------- the drafter


class DFlashDrafter(nn.Module):
    """Only these parameters are trained; the target's embedding and LM head are passed into forward, frozen."""

    def __init__(self, cfg: DrafterConfig, target_hidden_size: int, num_taps: int) -> None:
        super().__init__()
        hidden = cfg.hidden_size or target_hidden_size
        if hidden != target_hidden_size:
            raise ValueError(
                f"drafter.hidden_size={hidden} must equal the target hidden size {target_hidden_size}: "
                "the drafter reads the target's embedding and LM head"
            )
        if cfg.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2, got {cfg.block_size}")
        if cfg.num_layers < 1 or cfg.num_anchors < 1 or cfg.ce_chunk < 1 or num_taps < 1:
            raise ValueError("drafter.num_layers, num_anchors, ce_chunk and the number of taps must be >= 1")
        if cfg.layer_sliding_windows is not None and len(cfg.layer_sliding_windows) != cfg.num_layers:
            raise ValueError(
                f"drafter.layer_sliding_windows needs {cfg.num_layers} entries, got {len(cfg.layer_sliding_windows)}"
            )
        head_dim = cfg.head_dim or hidden // cfg.num_heads
        intermediate = cfg.intermediate_size or 3 * hidden
        self.cfg = cfg
        self.hidden_size, self.head_dim, self.num_taps = hidden, head_dim, num_taps
        self.fc = nn.Linear(num_taps * target_hidden_size, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, hidden, head_dim, intermediate) for _ in range(cfg.num_layers)])
        # The first k layers recompute their forward in backward: true all, false none, auto all until the trainer
        # narrows it from the memory it measures (dflash/memory.py).
        self.checkpoint_layers: int = resolve_grad_checkpoint(cfg.grad_checkpoint, cfg.num_layers)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.windows: list[int | None] = (
            list(cfg.layer_sliding_windows)
            if cfg.layer_sliding_windows is not None
            else [cfg.sliding_window] * cfg.num_layers
        )
        self.rules: list[MaskRule] = layer_rules(cfg, self.windows)
        default_device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.attention_backend: str = resolve_attention(cfg.attention, default_device)
        # torch.compile backend of the flex kernels: inductor in training; "eager" lets CPU tests run the compiled
        # path's guards and caches without code generation.
        self.flex_compile_backend = "inductor"
        # train.compile_scope regional: the compiled layer and CE chunk (compile_regions); None runs them eagerly
        # (or inside the whole-model compile).
        self.regions: Regions | None = None

    def position_weight(self, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """[B] loss weight per block position: 0 for position 0 (the anchor itself), exp(-(k-1)/gamma) for k >= 1
        (`position_weights: uniform`: 1). D-PACE depends on the drafter's confidences: see dpace_weights.

        Computed in fp64 and cast (not a buffer: `.bfloat16()` on the module must not round the weights).
        """
        k = torch.arange(self.cfg.block_size, dtype=torch.float64, device=device)
        decay = torch.ones_like(k) if self.cfg.position_weights == "uniform" else torch.exp(-(k - 1) / self.cfg.loss_gamma)
        w = torch.where(k >= 1, decay, torch.zeros_like(k))
        return w.to(dtype)

    def _regional(self) -> Regions | None:
        """The compiled units, for a training step only: evaluation (no grad, other shapes) stays eager, as it is
        under a whole-model compile, instead of compiling new graphs against the training step's recompile budget."""
        return self.regions if self.regions is not None and self.training and torch.is_grad_enabled() else None

    # -- attention backends: both return [heads, M, hd] from q [heads, M, hd], k/v [kv_heads, N+M, hd]
    def _dense_attend(self, mask: Tensor) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            rep = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
            return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None])[0]

        return attend

    def _flex_attend(self, block_mask: Any, shape: FlexShape | None) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        """flex_attention compiled for `shape`, or eager flex when shape is None (flex-eager, debugging only).

        Inside a compiled drafter step (dflash train compiles the whole step) plain flex_attention is what the
        enclosing compile fuses; the per-shape compiled one serves an uncompiled module.
        """
        from torch.nn.attention.flex_attention import flex_attention

        nested = torch.compiler.is_compiling() or self._regional() is not None  # traced by the compiled layer
        fn = compiled_flex_attention(shape) if shape is not None and not nested else flex_attention

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return fn(q[None], k[None], v[None], block_mask=block_mask, enable_gqa=True)[0]

        return attend

    def _attenders(self, anchors: Tensor, doc_ids: Tensor, m: int) -> list[Callable[[Tensor, Tensor, Tensor], Tensor]]:
        """One attend function per layer; layers sharing a MaskRule (window, causal, window rule) share one mask."""
        b = self.cfg.block_size
        n = doc_ids.shape[0]
        if self.cfg.attention == "auto":
            # auto follows the data: flex (compiled) for CUDA buffers, the exact dense rule elsewhere (flex has no
            # CPU backward). attention_backend always names what the last forward really used.
            self.attention_backend = resolve_attention("auto", doc_ids.device)
        backend = self.attention_backend
        cache: dict[MaskRule, Callable[[Tensor, Tensor, Tensor], Tensor]] = {}
        for r in self.rules:
            if r in cache:
                continue
            if backend == "dense":
                cache[r] = self._dense_attend(dense_mask(anchors, doc_ids, b, r.window, r.causal, r.from_anchor))
            else:
                shape = FlexShape(m, n + m, anchors.shape[0], n, str(doc_ids.device), self.flex_compile_backend)
                mod = flex_mask_mod(anchors, doc_ids, b, r.window, r.causal, r.from_anchor)
                block_mask = build_block_mask(mod, shape, doc_ids.device)
                cache[r] = self._flex_attend(block_mask, shape if backend == "flex-compiled" else None)
        return [cache[r] for r in self.rules]

    def block_states(self, batch: DraftBatch, embed_tokens: nn.Embedding, anchors: Tensor) -> Tensor:
        """[A*B, H] final-normed states of every block (anchor + B-1 mask tokens); logits are `lm_head` of these.

        The exported HF model (dflash/modeling_dflash.py) computes the same states for one block at serving time.
        """
        cfg, b = self.cfg, self.cfg.block_size
        ids, pos, docs = batch.input_ids, batch.position_ids, batch.doc_ids
        a = anchors.shape[0]
        m = a * b
        dtype = self.fc.weight.dtype
        # Context features: the concatenated taps, fused to H and normalised, once for all layers.
        ctx = self.hidden_norm(self.fc(batch.hidden.to(dtype)))
        # Blocks: [anchor token, mask x (B-1)], embedded with the target's frozen embedding.
        offs = torch.arange(b, device=ids.device)
        block_ids = torch.full((a, b), cfg.mask_token_id, dtype=ids.dtype, device=ids.device)
        block_ids[:, 0] = ids[anchors]
        x = embed_tokens(block_ids.reshape(m)).to(dtype)
        # Positions: context at its own document positions, block position k at anchor position + k.
        block_pos = (pos[anchors][:, None] + offs[None, :]).reshape(m)
        rope_q = rope_cos_sin(block_pos, self.head_dim, cfg.rope_theta, x.dtype)
        rope_kv = rope_cos_sin(torch.cat([pos, block_pos]), self.head_dim, cfg.rope_theta, x.dtype)

        regions = self._regional()
        run = regions.layer if regions is not None else layer_step
        if regions is not None and not x.requires_grad:
            # Layer 0's input comes from the frozen embedding and needs no grad, the other layers' inputs do: dynamo
            # guards requires_grad, so layer 0 would compile a graph of its own (its forward, recompute and backward
            # generated and compiled again: 6 -> 4 FX graphs on CPU, docs/warm-start.md). Asking for its grad (one
            # [M, H] leaf, dropped with the graph; the extra work is layer 0's input grad through its input norm and
            # the block rows' q/k/v projections) lets one layer graph serve all.
            x = x.detach().requires_grad_(True)
        for i, (layer, attend) in enumerate(zip(self.layers, self._attenders(anchors, docs, m), strict=True)):
            recompute = i < self.checkpoint_layers and self.training and torch.is_grad_enabled()
            x = run(layer, x, ctx, rope_q, rope_kv, attend, recompute)
        return self.norm(x)

    def forward(
        self,
        batch: DraftBatch,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
        anchors: Tensor | None = None,
        keep: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> DraftOutput:
        cfg, b = self.cfg, self.cfg.block_size
        if cfg.mask_token_id is None:
            raise ValueError("drafter.mask_token_id is not set (the caller sets it from the tokenizer's mask token)")
        batch.validate()
        if batch.hidden.shape[1] != self.fc.in_features:
            raise ValueError(
                f"DraftBatch.hidden has {batch.hidden.shape[1]} features; this drafter expects {self.num_taps} taps x "
                f"{self.fc.in_features // self.num_taps} = {self.fc.in_features}"
            )
        if anchors is None:
            anchors, keep = sample_anchors(batch, cfg.num_anchors, b, generator,
                                           per_document=cfg.anchor_sampling == "document")
        elif keep is None:
            keep = torch.ones_like(anchors, dtype=torch.bool)
        assert keep is not None
        ids, docs = batch.input_ids, batch.doc_ids
        n, a = ids.shape[0], anchors.shape[0]
        m = a * b
        offs = torch.arange(b, device=ids.device)
        x = self.block_states(batch, embed_tokens, anchors)

        # Labels: block position k predicts ids[a + k] if that token is in the anchor's document and supervised.
        tgt = anchors[:, None] + offs[None, :]
        in_range = tgt < n
        tgt_c = torch.clamp(tgt, max=n - 1)
        valid = in_range & (docs[tgt_c] == docs[anchors][:, None]) & batch.loss_mask[tgt_c] & keep[:, None]
        valid[:, 0] = False
        labels = ids[tgt_c].reshape(m)
        wdtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        if cfg.position_weights == "dpace":
            weights = dpace_weights(x.detach(), lm_head, labels, valid, cfg.dpace_alpha, cfg.ce_chunk).to(wdtype)
        else:
            weights = (self.position_weight(ids.device, wdtype)[None, :] * valid).reshape(m)
        regions = self._regional()
        loss_sum, correct = chunked_cross_entropy(x, lm_head, labels, weights, cfg.ce_chunk,
                                                  regions.ce if regions is not None else None)
        weight_sum = weights.sum()
        loss = loss_sum / weight_sum.clamp(min=1e-12)
        valid_f = valid.to(wdtype)
        counts = valid_f.sum(0)[1:]
        acc = ((correct.reshape(a, b) * valid_f).sum(0)[1:] / counts.clamp(min=1)).detach()
        return DraftOutput(loss=loss, acc=acc, weight_sum=weight_sum.detach(), num_tokens=valid.sum().detach())


def dpace_weights(hidden: Tensor, lm_head: nn.Linear, labels: Tensor, valid: Tensor, alpha: float,
                  chunk: int) -> Tensor:
    """[A*B] D-PACE position weights (speculators' default for DFlash): with q_k = exp(-CE_k) the drafter's
    (detached) probability of the right token at block position k, smoothed s_k = (1 - alpha) q_k + alpha (1 where
    unsupervised), the weight of k is sum_{j >= k} prod_{i <= j} s_i over supervised j: how much of the expected
    accepted run position k is part of. No grad; one extra chunked pass over the block logits."""
    a, b = valid.shape
    with torch.no_grad():
        ce = torch.cat([F.cross_entropy(F.linear(hidden[s:s + chunk].to(lm_head.weight.dtype), lm_head.weight,
                                                 lm_head.bias).float(), labels[s:s + chunk], reduction="none")
                        for s in range(0, hidden.shape[0], chunk)]).reshape(a, b)
        mask = valid.to(ce.dtype)
        smooth = torch.where(valid, (1.0 - alpha) * torch.exp(-ce) + alpha, torch.ones_like(ce))
        prefix = torch.cumprod(smooth, dim=-1)
        weight = torch.flip(torch.cumsum(torch.flip(prefix * mask, dims=[-1]), dim=-1), dims=[-1]) * mask
    return weight.reshape(a * b)


def chunked_cross_entropy(
    hidden: Tensor, lm_head: nn.Linear, labels: Tensor, weights: Tensor, chunk: int,
    run_chunk: Callable[..., tuple[Tensor, Tensor]] | None = None,
) -> tuple[Tensor, Tensor]:
    """sum(weights * CE(lm_head(hidden), labels)) and per-row top-1 correctness, `chunk` rows of logits at a time.

    Each chunk runs under non-reentrant checkpointing, so autograd keeps only the chunk's inputs: its fp32 logits
    ([chunk, V]) are freed at once and recomputed in backward, one chunk at a time. Shapes depend only on the config.
    `run_chunk` is ce_step compiled on its own (train.compile_scope regional); None runs ce_step as it is.
    """
    total = hidden.new_zeros((), dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    correct_parts = []
    step = run_chunk if run_chunk is not None else ce_step
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        part_loss, part_correct = step(hidden[sl], lm_head.weight, lm_head.bias, labels[sl], weights[sl])
        total = total + part_loss
        correct_parts.append(part_correct)
    return total, torch.cat(correct_parts)


def ce_step(
    h: Tensor, head_weight: Tensor, head_bias: Tensor | None, labels: Tensor, weights: Tensor
) -> tuple[Tensor, Tensor]:
    """One chunk of chunked_cross_entropy, its logits recomputed in backward (the unit compiled once, per chunk
    shape, by compile_regions)."""
    return checkpoint(_ce_chunk, h, head_weight, head_bias, labels, weights, use_reentrant=False)


def _ce_chunk(
    h: Tensor, head_weight: Tensor, head_bias: Tensor | None, labels: Tensor, weights: Tensor
) -> tuple[Tensor, Tensor]:
    logits = F.linear(h.to(head_weight.dtype), head_weight, head_bias)
    logits = logits.float() if logits.dtype != torch.float64 else logits
    ce = F.cross_entropy(logits, labels, reduction="none")
    correct = (logits.argmax(-1) == labels).to(torch.float32)
    return (ce * weights.to(ce.dtype)).sum(), correct


__all__ = [
    "DFlashDrafter",
    "DraftBatch",
    "DraftOutput",
    "DrafterConfig",
    "FlexShape",
    "MaskRule",
    "anchor_candidates",
    "block_attention_rule",
    "chunked_cross_entropy",
    "compile_regions",
    "dpace_weights",
    "compile_step_model",
    "dense_mask",
    "flex_kernels",
    "flex_mask_mod",
    "isolated_compile",
    "layer_rules",
    "sample_anchors",
]
