"""The exported drafter's own Hugging Face modeling file: `dflash export` copies it next to the weights as
`modeling_dflash.py` and registers it in config.json's `auto_map`, so `AutoModel.from_pretrained(dir,
trust_remote_code=True)` builds the real drafter (fc, hidden_norm, layers, norm) instead of a plain Qwen3Model.

Self-contained on purpose (torch + transformers only): whoever loads an export does not have this package. The
computation is the one `dflash.model.DFlashDrafter.block_states` trains, for the serving case of one block per row:
the block (anchor + mask tokens) attends to the fused target states of every position before the anchor and to
itself; a sliding-window layer lets the query at absolute position q read keys at positions >= q - w + 1 only (the
per-query rule of `dflash.model.block_attention_rule`). Which layers read their block causally (block token j only
from queries k >= j) is decided from config.json as vLLM (`_dflash_layer_causal`), SGLang and z-lab's modeling
decide it: `is_causal` for every layer, else `dflash_config.causal`, else causal iff the layer is sliding_attention.
`dflash export` writes `is_causal: false` for a drafter trained bidirectionally and leaves it out for one trained
with `drafter.sliding_block_causal`, so this model computes what was trained and what the engines serve. The call
signature is the one of z-lab/dflash's `DFlashDraftModel.forward`, so its generation loop can drive this model
unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel, Qwen3Config


def _dflash_value(config: Any, name: str, default: Any = None) -> Any:
    """`dflash_config[name]`, falling back to a top-level config attribute (both layouts exist in the wild)."""
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def _layer_causal(config: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx` reads its block causally, by the engines' rule (is_causal, then
    dflash_config.causal, then sliding_attention layers causal)."""
    is_causal = getattr(config, "is_causal", None)
    if is_causal is not None:
        return bool(is_causal)
    override = (getattr(config, "dflash_config", None) or {}).get("causal")
    if override is not None:
        return bool(override)
    types = getattr(config, "layer_types", None)
    return bool(types) and types[layer_idx] == "sliding_attention"


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 1e6)))


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float() if x.dtype != torch.float64 else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """[..., L, head_dim] cos and sin for arbitrary positions (fp32, or fp64 for an fp64 model), rotate-half layout."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=work) / head_dim))
    freqs = positions.to(work)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from [fused target context ; block]."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.num_heads
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        types = getattr(config, "layer_types", None)
        sliding = bool(types) and types[layer_idx] == "sliding_attention"
        self.sliding_window: int | None = int(config.sliding_window) if sliding else None
        self.causal = _layer_causal(config, layer_idx)

    def forward(self, x: Tensor, ctx: Tensor, q_pos: Tensor, kv_pos: Tensor, theta: float,
                attention_mask: Tensor | None, cache: Any | None) -> Tensor:
        bsz, q_len, _ = x.shape
        hd = self.head_dim
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(bsz, q_len, self.num_heads, hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(bsz, -1, self.num_kv_heads, hd)).transpose(1, 2)
        v = self.v_proj(kv_in).view(bsz, -1, self.num_kv_heads, hd).transpose(1, 2)
        cos_q, sin_q = _rope_tables(q_pos, hd, theta, x.dtype)
        cos_k, sin_k = _rope_tables(kv_pos, hd, theta, x.dtype)
        q = _apply_rope(q, cos_q[:, None], sin_q[:, None]).to(v.dtype)
        k = _apply_rope(k, cos_k[:, None], sin_k[:, None]).to(v.dtype)
        if cache is not None:  # a transformers Cache holding the keys of positions before these (contiguous)
            k, v = cache.update(k, v, self.layer_idx)
        # Absolute positions of every key: cached keys are the contiguous positions just before this call's.
        first = kv_pos[:, :1]
        key_pos = first - (k.shape[2] - kv_pos.shape[1]) + torch.arange(k.shape[2], device=x.device)[None, :]
        visible = torch.ones(bsz, 1, q_len, k.shape[2], dtype=torch.bool, device=x.device)
        if self.sliding_window is not None:
            visible = visible & (key_pos[:, None, None, :] > q_pos[:, None, :, None] - self.sliding_window)
        if self.causal:  # context keys all precede the anchor: only later block tokens are hidden
            visible = visible & (key_pos[:, None, None, :] <= q_pos[:, None, :, None])
        if attention_mask is not None:
            extra = attention_mask if attention_mask.dtype == torch.bool else attention_mask >= 0
            visible = visible & extra
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, self.num_heads * hd))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x: Tensor, ctx: Tensor, q_pos: Tensor, kv_pos: Tensor, theta: float,
                attention_mask: Tensor | None, cache: Any | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, q_pos, kv_pos, theta, attention_mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter: `forward` returns the final-normed block states; logits are the target's LM head of them."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.target_layer_ids = [int(x) for x in _dflash_value(config, "target_layer_ids", [])]
        if not self.target_layer_ids:
            raise ValueError("the drafter config must define dflash_config.target_layer_ids")
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = _dflash_value(config, "mask_token_id")
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, float(getattr(self.config, "initializer_range", 0.02)))
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, position_ids: Tensor, attention_mask: Tensor | None = None,
                noise_embedding: Tensor | None = None, target_hidden: Tensor | None = None,
                past_key_values: Any | None = None, use_cache: bool = False, **kwargs: Any) -> Tensor:
        """noise_embedding [b, B, H]: the target's embedding of [anchor, mask x (B-1)]; target_hidden [b, C, K*H]: the
        tapped target states (HF hidden_states[id + 1]) of the C positions before the anchor not yet in the cache;
        position_ids [b, C + B]: their absolute positions, context first. Returns [b, B, H]."""
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel needs noise_embedding and target_hidden")
        q_len, c_len = noise_embedding.shape[1], target_hidden.shape[1]
        if position_ids.ndim == 1:
            position_ids = position_ids[None, :]
        if position_ids.shape[-1] != c_len + q_len:
            raise ValueError(f"position_ids must cover the {c_len} context and {q_len} block positions, "
                             f"got {position_ids.shape[-1]}")
        position_ids = position_ids.expand(noise_embedding.shape[0], -1)
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        x = noise_embedding.to(dtype)
        q_pos = position_ids[:, c_len:]
        theta = _rope_theta(self.config)
        cache = past_key_values if use_cache or past_key_values is not None else None
        for layer in self.layers:
            x = layer(x, ctx, q_pos, position_ids, theta, attention_mask, cache)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor, output_head: nn.Module) -> Tensor:
        """Logits through the target's LM head (the drafter has none of its own)."""
        return output_head(hidden)


__all__ = ["DFlashDraftModel"]
