"""The target's configuration types, free of torch: what `target:` in a run config may say, and the family registry.

Split from dflash/target.py so the CLI can check a config file completely before it pays for importing torch (seconds);
dflash/target.py re-exports every name here.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

# A tiny hybrid qwen3_5 text model: two groups of (linear, linear, full) attention layers, so both the Gated
# DeltaNet path and the full-attention path run in every CPU test. `vocab_size` is normally overridden by the caller
# with the tokenizer's vocabulary size.
TINY_ARCH: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}

# A tiny full-attention Qwen3 (Qwen3ForCausalLM): the plain KV-cache path, for tests and drafter evaluation.
TINY_QWEN3_ARCH: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class TargetFamily:
    """What random-initialising one architecture family takes. Adding a family is one entry in FAMILIES.

    `config_class` is a transformers class name (imported on use: transformers is slow to import); the causal LM is
    whatever AutoModelForCausalLM maps that config to. `layer_pattern` is repeated when only the depth is changed.
    """

    name: str
    config_class: str
    tiny: dict[str, Any]
    hybrid: bool  # linear-attention (Gated DeltaNet) layers: needs fla kernels to be fast, and state rollback in eval
    layer_pattern: tuple[str, ...] = ()

    def hf_config_class(self) -> type:
        return getattr(importlib.import_module("transformers"), self.config_class)


FAMILIES: dict[str, TargetFamily] = {f.name: f for f in (
    TargetFamily("qwen3_5", "Qwen3_5TextConfig", TINY_ARCH, hybrid=True,
                 layer_pattern=("linear_attention", "linear_attention", "full_attention")),
    TargetFamily("qwen3", "Qwen3Config", TINY_QWEN3_ARCH, hybrid=False),
)}
DEFAULT_FAMILY = "qwen3_5"
# The names of target.dtype (dflash/target.py maps them to torch dtypes).
DTYPE_NAMES = ("float32", "bfloat16", "float16")
PACKINGS = ("auto", "pad", "varlen")
# target.attention: how the full-attention layers attend in the packed training forward. sdpa: transformers' default
# (a packed row gets a block-diagonal mask, which SDPA runs densely); varlen: PyTorch's fused varlen flash attention
# over the documents' cu_seqlens (27B-like on an H200: 1650 ms vs 2013 ms per 16k-token buffer, docs/perf.md);
# auto: varlen where the row is packed (packing varlen) and this torch has varlen_attn, else sdpa. Decoding with a
# cache (regen, eval) always runs sdpa. (transformers' flex_attention path is not offered: Qwen3.5 models refuse it.)
ATTENTIONS = ("auto", "sdpa", "varlen")
CUDA_GRAPHS = ("off", "auto", "on")  # target.cuda_graph (dflash/target.py resolve_cuda_graph)
FUSED_ELEMENTWISE = ("off", "auto", "on")  # target.fused_elementwise (dflash/target.py resolve_fused_elementwise)
_ARCH_POSITIVE = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "vocab_size")


@dataclass
class TargetPretrainConfig:
    """Train the `arch` target as a language model on the run's corpus before use (dflash/pretrain.py), so the
    drafter has something worth predicting. Built once, then reused from a cache keyed by everything it depends on."""

    steps: int = 240
    batch_size: int = 16  # sequences per step
    seq_len: int = 128  # tokens per sequence (windows of the concatenated corpus)
    lr: float = 3e-3
    warmup_frac: float = 0.05
    cache_dir: str | None = None  # default: $DFLASH_CACHE, else $XDG_CACHE_HOME/dflash, else ~/.cache/dflash


@dataclass
class TargetRegenConfig:
    """Train the drafter on the target's own continuations of the corpus prompts (dflash/regen.py) instead of the
    corpus itself: built on first use (resumable), cached by target, tokenizer, corpus and these settings."""

    num_prompts: int | None = None  # the first N prompts in corpus order; None = all
    prompt_tokens: int | None = None  # None -> data.max_len // 4
    max_new_tokens: int | None = None  # None -> data.max_len - prompt_tokens
    temperature: float = 0.0  # 0 = greedy
    batch_size: int = 128
    cache_dir: str | None = None  # default: the same cache as target.pretrain


@dataclass
class TargetConfig:
    path: str | None = None  # local HF directory (from_pretrained, local_files_only); None -> random init from `arch`
    pretrain: TargetPretrainConfig | None = None  # with path None: pretrain `arch` on the corpus (cached), then use it
    regen: TargetRegenConfig | None = None  # train the drafter on this target's own continuations (cached)
    family: str = DEFAULT_FAMILY  # random init: a key of FAMILIES (qwen3_5 hybrid, qwen3 full attention)
    arch: dict[str, Any] = field(default_factory=dict)  # the family's HF config kwargs, over its tiny default
    tap_layers: list[int] | None = None  # None -> default_tap_layers(num_layers, num_draft_layers)
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU; or float32 | bfloat16 | float16
    packing: str = "auto"  # auto: varlen only if fla (+ causal-conv1d) is really bound, else pad; "pad" | "varlen"
    seed: int = 0  # random-init seed (deterministic weights)
    allow_slow_kernels: bool = False
    attention: str = "auto"  # full-attention layers in the packed forward: auto | sdpa | varlen (see ATTENTIONS)
    # The packed forward captured as CUDA graphs over fixed-shape inputs (issue 24): off | auto (CUDA + packing
    # varlen, else nothing) | on (refused where it cannot apply). Off until a GPU session has measured it.
    cuda_graph: str = "off"
    # The packed forward's Qwen3.5 norms, gated norms and SiLU*mul compiled into fused kernels (dflash/target_fusion.py;
    # issue 24): off | auto (where the packed varlen forward runs, else nothing) | on (refused where it cannot apply).
    # Decoding and the padded path stay eager either way. auto by default: the 27B-like training step 1.109x faster
    # with it on one H200 in one call (docs/perf.md, session 18); each kind is checked against eager on first use.
    fused_elementwise: str = "auto"


def check_arch(family: str, arch: dict[str, Any], keys: bool = True) -> None:
    """target.arch keys are HF config kwargs; those classes accept any kwarg, so a typo would pass silently.

    `keys=False` checks only the sizes: the known keys come from transformers' config class, whose import also
    imports torch (seconds), so the CLI's quick check before torch leaves them to the full check."""
    if family not in FAMILIES:
        return  # target.family names the problem
    if not keys:
        _check_arch_sizes(arch)
        _check_layer_types(FAMILIES[family], arch)
        return
    cls = FAMILIES[family].hf_config_class()
    known = set(cls().to_dict()) | set(inspect.signature(cls.__init__).parameters)
    known -= {"self", "kwargs", "_name_or_path", "transformers_version", "model_type"}
    for key in arch:
        if key not in known:
            raise ValueError(f"target.arch.{key}: unknown {cls.__name__} field (known: {', '.join(sorted(known))})")
    _check_arch_sizes(arch)
    _check_layer_types(FAMILIES[family], arch)


def _check_layer_types(fam: TargetFamily, arch: dict[str, Any]) -> None:
    """A hybrid target needs a full-attention layer: transformers' generation cache asks its attention layers for the
    mask sizes, and one of linear layers alone fails at the first cached decode (the held-out set, regen, eval
    decode) with a traceback deep in transformers, after the run has started. Refused here, with the fix."""
    if not fam.hybrid:
        return
    n = arch.get("num_hidden_layers", fam.tiny["num_hidden_layers"])
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return  # _check_arch_sizes names it
    if "layer_types" in arch:
        types = arch["layer_types"]
        if isinstance(types, list) and types and "full_attention" not in types:
            raise ValueError("target.arch.layer_types: needs at least one full_attention layer (transformers' "
                             "generation cache fails with linear_attention layers alone)")
        return
    pattern = fam.layer_pattern or tuple(fam.tiny.get("layer_types", ()))
    if pattern and "full_attention" not in [pattern[i % len(pattern)] for i in range(n)]:
        least = pattern.index("full_attention") + 1
        raise ValueError(f"target.arch.num_hidden_layers: {n} layers of the {fam.name} pattern "
                         f"({', '.join(pattern)}, repeated) are all linear_attention; transformers' generation cache "
                         f"needs a full_attention layer: use at least {least}, or set target.arch.layer_types")


def _check_arch_sizes(arch: dict[str, Any]) -> None:
    for key in _ARCH_POSITIVE:
        v = arch.get(key, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            shown = repr(v) if isinstance(v, str) else f"{v!r} ({type(v).__name__})"
            raise ValueError(f"target.arch.{key}: must be an integer >= 1, got {shown}")
