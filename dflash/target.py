"""The frozen target model: load (or randomly build) a transformers causal LM and tap its hidden states.

The drafter only ever sees the concatenation of a few tapped layers, so this module hides padding, packing and kernels.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from dflash.kernels import inspect_kernels, varlen_usable

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

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PACKINGS = ("auto", "pad", "varlen")


@dataclass
class TargetConfig:
    path: str | None = None  # local HF directory (from_pretrained, local_files_only); None -> random init from `arch`
    arch: dict[str, Any] = field(default_factory=dict)  # Qwen3_5TextConfig kwargs for random init, over TINY_ARCH
    tap_layers: list[int] | None = None  # None -> default_tap_layers(num_layers, num_draft_layers)
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU; or float32 | bfloat16 | float16
    packing: str = "auto"  # auto: varlen only if fla (+ causal-conv1d) is really bound, else pad; "pad" | "varlen"
    seed: int = 0  # random-init seed (deterministic weights)
    allow_slow_kernels: bool = False


def default_tap_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash rule: spread the taps from layer 1 to layer L-3, so they cover shallow to deep features.

    With a single draft layer there is no spread to make; like z-lab's reference we tap the middle layer (L // 2).
    """
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(
            f"the DFlash tap rule needs at least 4 target layers for {num_draft_layers} taps, got {num_target_layers}"
        )
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Turn the config's dtype string into a torch dtype; `auto` keeps CPU tests exact and GPU runs in bf16."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"target.dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


class _StopForward(Exception):
    """Raised from the hook on the deepest tapped layer: the layers above it (and the LM head) are never needed."""


@contextlib.contextmanager
def _weight_loading_progress(on_progress: Callable[[int, int], None] | None) -> Iterator[None]:
    """Report transformers' own per-weight loading loop through `on_progress`.

    transformers 5.x iterates the checkpoint's parameter groups under `core_model_loading.tqdm(..., desc="Loading
    weights")`; we wrap that iterator for the duration of one load. If a version lacks it we report nothing here and
    the caller still reports start and end.
    """
    if on_progress is None:
        yield
        return
    try:
        from transformers import core_model_loading
    except ImportError:  # older transformers: no per-weight hook
        yield
        return
    original = getattr(core_model_loading, "tqdm", None)
    if original is None:
        yield
        return

    def reporting_tqdm(iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
        inner = original(iterable, *args, **kwargs)
        if kwargs.get("desc") != "Loading weights" or iterable is None:
            return inner
        total = len(iterable) if hasattr(iterable, "__len__") else 0

        def gen() -> Iterator[Any]:
            step = max(1, total // 100)  # at most ~100 progress reports per load
            for i, item in enumerate(inner):
                yield item
                if (i + 1) % step == 0 or i + 1 == total:
                    on_progress(i + 1, total)

        return gen()

    core_model_loading.tqdm = reporting_tqdm
    try:
        yield
    finally:
        core_model_loading.tqdm = original


class Target:
    """A frozen causal LM that turns token batches into the concatenated hidden states of its tapped layers."""

    def __init__(
        self,
        cfg: TargetConfig,
        num_draft_layers: int,
        device: torch.device,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        if cfg.packing not in _PACKINGS:
            raise ValueError(f"target.packing must be one of {', '.join(_PACKINGS)}; got {cfg.packing!r}")
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.model = self._load(cfg, on_progress)
        self.model.to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.config = self.model.config
        self.decoder = self._decoder(self.model)
        self.layers: nn.ModuleList = self.decoder.layers
        self.num_layers = len(self.layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        taps = (
            list(cfg.tap_layers)
            if cfg.tap_layers is not None
            else default_tap_layers(self.num_layers, num_draft_layers)
        )
        for t in taps:
            if not 0 <= t < self.num_layers:
                raise ValueError(f"target.tap_layers: layer {t} is outside 0..{self.num_layers - 1}")
        if not taps:
            raise ValueError("target.tap_layers must name at least one layer")
        self.tap_layers: list[int] = taps
        self.embed_tokens: nn.Embedding = self.model.get_input_embeddings()
        self.lm_head: nn.Linear = self.model.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError(f"{type(self.model).__name__} has no LM head (get_output_embeddings() is None)")
        self.kernels: dict[str, str] = inspect_kernels(self.model)
        fast_varlen = varlen_usable(self.kernels) and self.device.type == "cuda"
        if cfg.packing == "auto":
            self.packing = "varlen" if fast_varlen else "pad"
        elif cfg.packing == "varlen" and not fast_varlen:
            raise ValueError(
                "target.packing=varlen needs flash-linear-attention and causal-conv1d bound on a CUDA device "
                f"(kernels: {self.kernels}, device: {self.device}); without them packing leaks state between "
                "documents in the linear-attention layers. Use packing: pad."
            )
        else:
            self.packing = cfg.packing

    # ---------------------------------------------------------------- loading
    def _load(self, cfg: TargetConfig, on_progress: Callable[[int, int], None] | None) -> nn.Module:
        if cfg.path is not None:
            from transformers import AutoModelForCausalLM

            if on_progress is not None:
                on_progress(0, 1)
            with _weight_loading_progress(on_progress):
                model = AutoModelForCausalLM.from_pretrained(
                    cfg.path, local_files_only=True, dtype=self.dtype, **self._placement()
                )
            if on_progress is not None:
                on_progress(1, 1)
            return model
        from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

        arch = {**copy.deepcopy(TINY_ARCH), **copy.deepcopy(cfg.arch)}
        if "layer_types" in arch and len(arch["layer_types"]) != arch["num_hidden_layers"]:
            if "layer_types" not in cfg.arch:  # caller changed the depth only: repeat the tiny pattern to fit
                pattern = TINY_ARCH["layer_types"][:3]
                arch["layer_types"] = [pattern[i % 3] for i in range(arch["num_hidden_layers"])]
            else:
                raise ValueError(
                    f"target.arch.layer_types has {len(arch['layer_types'])} entries for "
                    f"num_hidden_layers={arch['num_hidden_layers']}"
                )
        try:
            hf_cfg = Qwen3_5TextConfig(**arch)
        except TypeError as e:
            raise ValueError(f"target.arch: {e}") from e
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(cfg.seed)
            n = hf_cfg.num_hidden_layers
            if on_progress is not None:
                on_progress(0, n)
            # from_config(dtype=...) builds the weights in the target dtype but keeps RoPE's inv_freq in fp32, exactly
            # as from_pretrained does; `.to(bf16)` after building would round inv_freq too (5e-3 rel. drift, seen on GPU).
            # Built on the target device: a 3.6B random init took 147 s on the H200 machine's CPU (docs/perf.md).
            with torch.device(self.device):
                model = AutoModelForCausalLM.from_config(hf_cfg, dtype=self.dtype)
            if on_progress is not None:
                on_progress(n, n)
        return model

    def _placement(self) -> dict[str, Any]:
        """Load weights straight onto the GPU when accelerate is there (no full CPU copy of a 27B model first)."""
        if self.device.type == "cuda" and importlib.util.find_spec("accelerate") is not None:
            return {"device_map": {"": str(self.device)}}
        return {}

    @staticmethod
    def _decoder(model: nn.Module) -> nn.Module:
        """The base decoder stack (no LM head): we never want logits from the target, only hidden states."""
        base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        if base is None or not hasattr(base, "layers"):
            raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
        return base

    # ---------------------------------------------------------------- forward
    def _tapped(self, **forward_kwargs: Any) -> Tensor:
        """Run the decoder up to the deepest tapped layer and concatenate the taps along the feature axis."""
        captured: dict[int, Tensor] = {}
        deepest = max(self.tap_layers)
        wanted = set(self.tap_layers)

        def make_hook(idx: int) -> Callable[..., None]:
            def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
                hs = output[0] if isinstance(output, tuple) else output
                captured[idx] = hs
                if idx == deepest:
                    raise _StopForward

            return hook

        handles = [self.layers[i].register_forward_hook(make_hook(i)) for i in sorted(wanted)]
        try:
            with torch.inference_mode():
                try:
                    self.decoder(use_cache=False, **forward_kwargs)
                except _StopForward:
                    pass
        finally:
            for h in handles:
                h.remove()
        missing = wanted - captured.keys()
        if missing:
            raise RuntimeError(f"tapped layers {sorted(missing)} produced no output")
        # Output of decoder layer i is hidden_states[i + 1] in HF's convention (index 0 is the embedding output),
        # except the last layer's, which HF reports after the final norm: consumers of the export read it so.
        last = self.num_layers - 1
        if last in captured and hasattr(self.decoder, "norm"):
            with torch.inference_mode():
                captured[last] = self.decoder.norm(captured[last])
        return torch.cat([captured[i] for i in self.tap_layers], dim=-1)

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[R, T] right-padded ids and mask -> [R, T, K*H]; rows are independent (positions past a row's end are junk).

        Right padding is exact for every real token: all target layers are causal (the conv and the delta rule scan
        left to right, attention is causal), so real tokens never read the padding after them.
        """
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"expected input_ids and attention_mask of one shape [R, T], got {tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
            )
        mask = attention_mask.to(self.device).long()
        if mask.shape[1] > 1 and bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError("attention_mask must be right-padded (ones then zeros in every row)")
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        return self._tapped(input_ids=input_ids.to(self.device), attention_mask=mask, position_ids=position_ids)

    def hidden_states_packed(self, input_ids: Tensor, cu_seqlens: Tensor) -> Tensor:
        """[1, N] packed documents with boundaries `cu_seqlens` ([D+1], starting 0, ending N) -> [1, N, K*H].

        Only on the fla varlen path: every linear-attention kernel receives the boundaries (cu_seqlens for the delta
        rule, seq_idx for the conv) and full attention gets a block-diagonal mask from the per-document positions.
        """
        if self.packing != "varlen":
            raise RuntimeError(
                f"hidden_states_packed needs packing=varlen (fla + causal-conv1d on CUDA); this target uses {self.packing!r}: "
                "packing without cu_seqlens leaks state between documents, call hidden_states() with padding instead"
            )
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"packed input_ids must be [1, N], got {tuple(input_ids.shape)}")
        n = input_ids.shape[1]
        cu = cu_seqlens.to(self.device, torch.long)  # fla documents cu_seqlens as LongTensor
        if cu.ndim != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be strictly increasing from 0 to N={n}, got {cu.tolist()}")
        lengths = cu[1:] - cu[:-1]
        doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=self.device, dtype=torch.int32), lengths)
        starts = cu[:-1].long()[doc.long()]
        position_ids = (torch.arange(n, device=self.device) - starts).unsqueeze(0)
        max_len = int(lengths.max())
        return self._tapped(
            input_ids=input_ids.to(self.device),
            position_ids=position_ids,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max_len,
            max_length_k=max_len,
            seq_idx=doc.unsqueeze(0),
        )
