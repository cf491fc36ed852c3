"""The frozen target: its architecture (a registry of families), building or loading it, and tapping hidden states.

Every rule about the target's shape (arch, depth, taps, embedding rows) lives here; the drafter sees only the taps.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import inspect
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dflash.kernels import inspect_kernels, quiet_expected_fallback_notice, varlen_usable
from dflash.target_config import (  # noqa: F401 (re-exported: the config types live in a torch-free module)
    ATTENTIONS,
    CUDA_GRAPHS,
    DEFAULT_FAMILY,
    DTYPE_NAMES,
    FAMILIES,
    FUSED_ELEMENTWISE,
    PACKINGS,
    TINY_ARCH,
    TINY_QWEN3_ARCH,
    TargetConfig,
    TargetFamily,
    TargetPretrainConfig,
    TargetRegenConfig,
    check_arch,
)
from dflash.target_fusion import Fusion, fuse

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # float32, bfloat16, float16
VARLEN_ATTENTION = "document_varlen"  # registered in transformers' AttentionInterface ("flash" in a name means flash-attn to it)


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


def resolve_tap_layers(tap_layers: list[int] | None, num_layers: int, num_draft_layers: int) -> list[int]:
    """The layers to tap: the configured ones (checked against the depth) or the DFlash default."""
    if tap_layers is None:
        try:
            return default_tap_layers(num_layers, num_draft_layers)
        except ValueError as exc:
            raise ValueError(f"target.tap_layers: {exc}; set target.tap_layers") from None
    if not tap_layers:
        raise ValueError("target.tap_layers: must name at least one layer")
    for t in tap_layers:
        if not 0 <= t < num_layers:
            raise ValueError(f"target.tap_layers: layer {t} is outside 0..{num_layers - 1}")
    return list(tap_layers)


def family_of(cfg: TargetConfig) -> TargetFamily:
    if cfg.family not in FAMILIES:
        raise ValueError(f"target.family: expected one of {', '.join(FAMILIES)}, got {cfg.family!r}")
    return FAMILIES[cfg.family]




def target_arch(cfg: TargetConfig, vocab: int | None = None) -> dict[str, Any]:
    """The random-init architecture: the family's tiny default, overridden by target.arch.

    The embedding gets `vocab` rows (the tokenizer's size) unless target.arch.vocab_size says more: a real target
    reserves ids past the tokenizer's last token (a drafter's mask token). A changed depth alone repeats the family's
    layer pattern to fit.
    """
    fam = family_of(cfg)
    arch = {**copy.deepcopy(fam.tiny), **copy.deepcopy(cfg.arch)}
    if vocab is not None and "vocab_size" not in cfg.arch:
        arch["vocab_size"] = vocab
    check_vocab_rows(cfg, vocab)
    n = arch["num_hidden_layers"]
    if "layer_types" in arch and len(arch["layer_types"]) != n:
        if "layer_types" in cfg.arch or not fam.layer_pattern:
            raise ValueError(f"target.arch.layer_types: has {len(arch['layer_types'])} entries for "
                             f"target.arch.num_hidden_layers={n}")
        arch["layer_types"] = [fam.layer_pattern[i % len(fam.layer_pattern)] for i in range(n)]
    return arch


def check_vocab_rows(cfg: TargetConfig, vocab: int | None, what: str = "the tokenizer's vocabulary") -> None:
    """target.arch.vocab_size may exceed the tokenizer's size (throughput runs at a real target's LM-head cost, e.g.
    248,320 rows; the extra rows never appear as inputs) but never fall short: every token id is an embedding row."""
    rows = cfg.arch.get("vocab_size")
    if cfg.path is None and vocab is not None and isinstance(rows, int) and rows < vocab:
        raise ValueError(f"target.arch.vocab_size: must be at least {what} ({vocab}): every token id is a row of "
                         f"the embedding and the LM head; got {rows}")


def target_hf_config(cfg: TargetConfig, vocab: int | None = None) -> Any:
    """The target's transformers config, from TARGET/config.json or built from target_arch; no weights."""
    if cfg.path is not None:
        p = Path(cfg.path)
        if not p.is_dir():
            what = "does not exist" if not p.exists() else "is not a directory"
            raise ValueError(f"target.path: {p} {what} (a local Hugging Face model directory)")
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(cfg.path, local_files_only=True)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"target.path: {cfg.path}: cannot read its config.json ({first})") from None
    try:
        return family_of(cfg).hf_config_class()(**target_arch(cfg, vocab))
    except TypeError as exc:
        raise ValueError(f"target.arch: {exc}") from None


@dataclass
class TargetShape:
    """The target's size from its config alone; vocab_size (embedding rows) is None while it is not known yet."""

    num_layers: int
    hidden_size: int
    vocab_size: int | None
    vocab_from: str  # where vocab_size came from, for messages


def target_shape(cfg: TargetConfig, vocab: int | None = None) -> TargetShape:
    """(layers, hidden size, embedding rows) without building anything, for checks before a run writes a file."""
    hf = target_hf_config(cfg, vocab)
    text = hf.get_text_config()
    if cfg.path is not None:
        return TargetShape(int(text.num_hidden_layers), int(text.hidden_size), int(text.vocab_size),
                           f"vocab_size in {cfg.path}/config.json")
    known = "vocab_size" in cfg.arch or vocab is not None
    where = "target.arch.vocab_size" if "vocab_size" in cfg.arch else "the tokenizer's vocabulary"
    return TargetShape(int(text.num_hidden_layers), int(text.hidden_size), int(text.vocab_size) if known else None,
                       where)


def _placement(device: torch.device) -> dict[str, Any]:
    """Load weights straight onto the GPU when accelerate is there (no full CPU copy of a 27B model first)."""
    if device.type == "cuda" and importlib.util.find_spec("accelerate") is not None:
        return {"device_map": {"": str(device)}}
    return {}


def build_target_model(cfg: TargetConfig, vocab: int | None = None, *, device: torch.device | str = "cpu",
                       dtype: torch.dtype | None = None,
                       on_progress: Callable[[int, int], None] | None = None) -> nn.Module:
    """The target's transformers causal-LM module (not frozen, not moved): from_pretrained(target.path), or a
    seeded random init of the family's arch with `vocab` embedding rows. What Target wraps; eval builds on it too."""
    device = torch.device(device)
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    quiet_expected_fallback_notice(device)  # on the CPU transformers' PyTorch reference is the only implementation
    from transformers import AutoModelForCausalLM

    if cfg.path is not None:
        if on_progress is not None:
            on_progress(0, 1)
        with _weight_loading_progress(on_progress):
            # use_kernels=False: transformers >= 5.2x defaults it to True where the `kernels` package is installed
            # (5.25 requires it), and on a GPU `kernelize` then swaps the GDN kernels and gated norms for copies
            # fetched from the Hugging Face Hub (`kernels-community/fla`), ignoring local_files_only: offline the
            # load fails (ConnectError, seen on the H100 in session 19), online the target silently stops running
            # the fla / causal-conv1d that probe_kernels reported. The target runs what is installed, nothing else.
            model = AutoModelForCausalLM.from_pretrained(cfg.path, local_files_only=True, dtype=dtype,
                                                         use_kernels=False, **_placement(device))
        if on_progress is not None:
            on_progress(1, 1)
        return model
    hf_cfg = target_hf_config(cfg, vocab)
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(cfg.seed)
        n = hf_cfg.num_hidden_layers
        if on_progress is not None:
            on_progress(0, n)
        # from_config(dtype=...) builds the weights in the target dtype but keeps RoPE's inv_freq in fp32, exactly
        # as from_pretrained does; `.to(bf16)` after building would round inv_freq too (5e-3 rel. drift, seen on GPU).
        # Built on the target device: a 3.6B random init took 147 s on the H200 machine's CPU (docs/perf.md).
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        if on_progress is not None:
            on_progress(n, n)
    return model


def probe_kernels(cfg: TargetConfig, vocab: int | None = None) -> dict[str, str]:
    """Which linear-attention kernels the target will bind, from a weightless (meta-device) instance.

    This lets `run_start` name the kernels before a multi-minute weight load, so a slow fallback is visible at once.
    """
    from transformers import AutoModelForCausalLM

    hf_cfg = target_hf_config(cfg, vocab)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    return inspect_kernels(model)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Turn the config's dtype string into a torch dtype; `auto` keeps CPU tests exact and GPU runs in bf16."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"target.dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


class _StopForward(Exception):
    """Raised from the hook on the deepest tapped layer: the layers above it (and the LM head) are never needed."""


@contextlib.contextmanager
def hf_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' own tqdm bars (`Loading weights`) on or off for one load, then as they were: on a pipe or in a
    log a carriage-return bar is one long unreadable line, so callers there say the load in a plain line instead."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


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
        vocab: int | None = None,
    ) -> None:
        if cfg.packing not in PACKINGS:
            raise ValueError(f"target.packing must be one of {', '.join(PACKINGS)}; got {cfg.packing!r}")
        if cfg.attention not in ATTENTIONS:
            raise ValueError(f"target.attention must be one of {', '.join(ATTENTIONS)}; got {cfg.attention!r}")
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.model = build_target_model(cfg, vocab, device=self.device, dtype=self.dtype, on_progress=on_progress)
        self.model.to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.config = self.model.config
        self.decoder = self._decoder(self.model)
        self.layers: nn.ModuleList = self.decoder.layers
        self.num_layers = len(self.layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.config.vocab_size)
        self.tap_layers: list[int] = resolve_tap_layers(cfg.tap_layers, self.num_layers, num_draft_layers)
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
        self.attention = resolve_target_attention(cfg.attention, self.packing, varlen_attn_available(),
                                                  self.model.dtype)
        if self.attention == "varlen":
            self.model.set_attn_implementation(register_varlen_attention())
        self.use_cuda_graph = resolve_cuda_graph(cfg.cuda_graph, self.device, self.packing)
        self.graphs: PackedGraphs | None = None
        # target.fused_elementwise: the packed forward's norms and activation as compiled fused kernels (decoding and
        # the padded path keep transformers' eager modules: their shapes never reach the compiler)
        self.fusion: Fusion | None = None
        if resolve_fused_elementwise(cfg.fused_elementwise, self.packing):
            self.fusion = fuse(self.model, log=lambda line: print(line, file=sys.stderr, flush=True))

    def enable_cuda_graph(self, token_budget: int, min_doc_len: int, max_doc_len: int,
                          log: Callable[[str], None]) -> bool:
        """Route hidden_states_packed through captured graphs (target.cuda_graph auto/on where it applies); the
        shapes come from the data config: token_budget, data.min_len (the document cap), data.max_len."""
        if self.use_cuda_graph and self.graphs is None:
            self.graphs = PackedGraphs(self, token_budget, min_doc_len, max_doc_len, log)
        return self.graphs is not None

    # ---------------------------------------------------------------- loading
    @staticmethod
    def _decoder(model: nn.Module) -> nn.Module:
        """The base decoder stack (no LM head): we never want logits from the target, only hidden states."""
        base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        if base is None or not hasattr(base, "layers"):
            raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
        return base

    # ---------------------------------------------------------------- forward
    def _tapped(self, fused: bool = False, **forward_kwargs: Any) -> Tensor:
        """Run the decoder up to the deepest tapped layer and concatenate the taps along the feature axis; `fused`:
        the packed forward, where target.fused_elementwise applies."""
        if fused and self.fusion is not None:
            with self.fusion.on():
                return self._tapped(**forward_kwargs)
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
        rule, seq_idx for the conv); full attention gets them too (a fused varlen kernel with target.attention
        varlen, else a block-diagonal mask transformers builds from the per-document positions).
        """
        if self.packing != "varlen":
            raise RuntimeError(
                f"hidden_states_packed needs packing=varlen (fla + causal-conv1d on CUDA); this target uses {self.packing!r}: "
                "packing without cu_seqlens leaks state between documents, call hidden_states() with padding instead"
            )
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"packed input_ids must be [1, N], got {tuple(input_ids.shape)}")
        if self.graphs is not None:  # target.cuda_graph: fixed-shape inputs, replayed (the tail's states are junk)
            return self.graphs(input_ids, cu_seqlens)[:, : input_ids.shape[1]]
        idx = packed_indices(cu_seqlens, input_ids.shape[1])
        return self._tapped(fused=True, **packed_forward_kwargs(idx, input_ids, self.device))

    def hidden_states_fixed(self, fixed: FixedPackedInputs) -> Tensor:
        """The eager forward over fixed-shape inputs ([1, token_budget, K*H]): what a graph captures, run directly."""
        if self.packing != "varlen":
            raise RuntimeError(f"hidden_states_fixed needs packing=varlen; this target uses {self.packing!r}")
        return self._tapped(fused=True, **packed_forward_kwargs(fixed, fixed.input_ids, self.device))


@dataclass
class PackedIndices:
    """What the varlen kernels need about a packed row, computed on the host from the boundaries alone."""

    cu_seqlens: Tensor  # [D+1] long (fla documents LongTensor cu_seqlens)
    position_ids: Tensor  # [N] long, position inside its document
    seq_idx: Tensor  # [N] int32, document index (causal-conv1d)
    max_len: int
    chunk_indices: Tensor  # [C, 2] long: (document, chunk within it) per FLA_CHUNK-token chunk, fla's layout


# The chunk length of fla's chunked Gated DeltaNet op as transformers calls it (its default).
FLA_CHUNK = 64


def packed_indices(cu_seqlens: Tensor, n: int) -> PackedIndices:
    """Check the boundaries and derive positions and document ids on the CPU.

    Done on the device, each check (`int(cu[-1])`), the longest document (`int(lengths.max())`) and
    `repeat_interleave` without an output size is a host sync that stalls the launch stream; here none is, and the
    caller's boundaries (built on the host from Python lengths) never make a round trip through the GPU.
    """
    cu = cu_seqlens.detach().to("cpu", torch.long)
    if cu.ndim != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be strictly increasing from 0 to N={n}, got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int32), lengths, output_size=n)
    position_ids = torch.arange(n) - cu[:-1][doc.long()]
    chunks = (lengths + FLA_CHUNK - 1) // FLA_CHUNK
    total = int(chunks.sum())
    chunk_doc = torch.repeat_interleave(torch.arange(chunks.numel()), chunks, output_size=total)
    chunk_idx = torch.arange(total) - (chunks.cumsum(0) - chunks)[chunk_doc]
    return PackedIndices(cu_seqlens=cu, position_ids=position_ids, seq_idx=doc, max_len=int(lengths.max()),
                         chunk_indices=torch.stack([chunk_doc, chunk_idx], 1))


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """Host -> device without a sync: pinned memory and a non-blocking copy on CUDA (a no-op where t already is)."""
    if t.device == device or device.type != "cuda":
        return t.to(device)
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


# ---------------------------------------------------------------------------------------------- varlen attention
def varlen_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention interface ([B, H, T, D] in, [B, T, H, D] out) over PyTorch's varlen flash attention.

    A packed row ([1, N] with cu_seq_lens_q) runs causal attention inside each document, fused, with no mask; the
    block-diagonal mask SDPA would get instead cannot run as a fused kernel and costs N^2. Without cu_seq_lens
    (right-padded rows) it is SDPA with is_causal: exact for every real token, since padding only follows them.
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        if query.shape[2] != key.shape[2]:
            # A cached decode (queries after cached keys): is_causal would align the mask top-left, and transformers
            # builds no mask for a registered function. Decoding must run sdpa (TargetLM and regen switch to it).
            raise RuntimeError(f"varlen attention got {query.shape[2]} queries over {key.shape[2]} keys (a cached "
                               "decode); decoding runs with attention sdpa (model.set_attn_implementation('sdpa'))")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=query.shape[2] > 1)
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention takes one packed row, got a batch of {query.shape[0]}")
    if query.dtype not in VARLEN_DTYPES:  # a half-precision target moved to float32 after it was set up
        raise RuntimeError(f"varlen attention runs PyTorch's flash kernel, float16/bfloat16 only; got {query.dtype}. "
                           "A float32 target packs with attention sdpa (model.set_attn_implementation('sdpa')).")
    from torch.nn.attention.varlen import varlen_attn

    t, hq, hkv = query.shape[2], query.shape[1], key.shape[1]
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    params = inspect.signature(varlen_attn).parameters
    opts: dict[str, Any] = {}
    if "scale" in params:  # torch 2.10's varlen_attn has no scale: fold it into q (its default is D^-0.5)
        opts["scale"] = scaling
    elif scaling is not None:
        q = q * (scaling * q.shape[-1] ** 0.5)
    if "enable_gqa" in params:
        opts["enable_gqa"] = hq != hkv
    elif hq != hkv:
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    if "is_causal" in params:
        opts["is_causal"] = True
    else:
        opts["window_size"] = (-1, 0)  # causal
    cu32 = cu.to(torch.int32)
    max_q = int(kwargs.get("max_length_q") or 0)
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu32, cu32, max_q, max_q, **opts)
    return out.reshape(1, t, hq, -1), None


def varlen_attn_available() -> bool:
    """Whether this torch has PyTorch's fused varlen attention (torch.nn.attention.varlen.varlen_attn, torch >= 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # PyTorch's varlen flash kernel refuses anything else


def resolve_target_attention(choice: str, packing: str, varlen_available: bool,
                             dtype: torch.dtype = torch.bfloat16) -> str:
    """target.attention -> the implementation used: auto picks varlen for packed rows when torch has it (the fused
    kernel; sdpa would get a dense block-diagonal mask) and the target runs in half precision (the flash kernel has
    no float32: "FlashAttention only support fp16 and bf16 data type"), sdpa otherwise (padded rows gain nothing)."""
    if choice not in ATTENTIONS:
        raise ValueError(f"target.attention must be one of {', '.join(ATTENTIONS)}; got {choice!r}")
    if choice == "auto":
        return "varlen" if packing == "varlen" and varlen_available and dtype in VARLEN_DTYPES else "sdpa"
    if choice == "varlen" and not varlen_available:
        raise ValueError(f"target.attention=varlen needs torch.nn.attention.varlen (torch >= 2.10); this is torch "
                         f"{torch.__version__}. Use attention: sdpa or auto.")
    if choice == "varlen" and packing == "varlen" and dtype not in VARLEN_DTYPES:  # padded rows run sdpa: fine
        raise ValueError(f"target.attention=varlen runs PyTorch's flash kernel on packed rows, which takes float16 or "
                         f"bfloat16 only; this target is {str(dtype).removeprefix('torch.')}. Use attention: sdpa or "
                         "auto.")
    return choice


def use_sdpa_for_decoding(model: nn.Module) -> None:
    """Put a model whose full attention runs the packed-row varlen function back on sdpa: cached decoding (regen,
    eval) needs transformers' own masks, which it builds only for its built-in implementations."""
    if getattr(model.config, "_attn_implementation", None) == VARLEN_ATTENTION:
        model.set_attn_implementation("sdpa")


@contextlib.contextmanager
def decoding_attention(model: nn.Module) -> Iterator[None]:
    """Cached decoding on the training target (the held-out set, dflash/heldout.py): sdpa inside, and the packed-row
    varlen function back afterwards when the target trained with it."""
    before = getattr(model.config, "_attn_implementation", None)
    use_sdpa_for_decoding(model)
    try:
        yield
    finally:
        if before == VARLEN_ATTENTION:
            model.set_attn_implementation(register_varlen_attention())


def register_varlen_attention() -> str:
    """Register varlen_attention_forward with transformers (idempotent) and return its name.

    Registered attention functions get no mask from transformers (only built-in implementations do), which is what
    varlen wants: the boundaries come as cu_seq_lens, and padded rows are right-padded and causal.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    return VARLEN_ATTENTION


# ---------------------------------------------------------------------------------------------- fixed-shape inputs
# Issue 24: a CUDA graph replays fixed shapes only, so every input of the packed forward gets a shape that depends on
# the token budget and a document-slot bucket, never on the batch's document count. Padded "documents" are empty
# (repeated final offsets): fla's kernels mask every load and store by the document's length (eos - bos = 0), the
# conv sees no token of them, and varlen attention skips a zero-length sequence.
FIRST_SLOT_BUCKET = 16  # smallest document-slot count; buckets double up to the cap


def max_documents(token_budget: int, min_doc_len: int) -> int:
    """Documents one fixed-shape row can hold: real ones (each >= min_doc_len tokens) plus the dummy tail's pieces.

    Real documents r <= floor(real / min); the tail (t = token_budget - real tokens) is cut into pieces of at most
    max_doc_len >= min tokens, ceil(t / max) <= ceil(t / min) of them; together <= ceil(budget / min), reached by
    floor(budget / min) full documents and a short tail (tests/test_target_fixed_shape.py checks it by brute force).
    """
    if token_budget < 1 or min_doc_len < 1:
        raise ValueError(f"token_budget and min_doc_len must be >= 1, got {token_budget} and {min_doc_len}")
    return -(-token_budget // min_doc_len)


def chunk_capacity(token_budget: int, slots: int, chunk: int = FLA_CHUNK) -> int:
    """fla chunks a row with at most `slots - 1` documents can need: sum ceil(L_i / C) <= (N + (C - 1) D) // C, and
    never more than N (a chunk holds at least one token)."""
    return min(token_budget, (token_budget + (chunk - 1) * max(slots - 1, 0)) // chunk)


def row_slots(lengths: Sequence[int], token_budget: int, max_doc_len: int, buckets: Sequence[int]) -> int | None:
    """The bucket a packed row of these document lengths is replayed in: its documents plus its dummy tail's pieces
    (of at most max_doc_len tokens each), plus one always-empty slot. None where the largest bucket cannot hold it."""
    tail = token_budget - sum(lengths)
    docs = len(lengths) + len(range(0, max(tail, 0), max_doc_len))
    return next((s for s in buckets if s >= docs + 1), None)


def slot_buckets(token_budget: int, min_doc_len: int) -> list[int]:
    """Document-slot counts a graph is captured for: 16, 32, ... and the cap (max documents + one always-empty slot).

    One bucket for every count would pad a 12-document row to 257 slots at the 27B-like shape (min_len 64), and the
    padded chunk entries are not free (fla's per-chunk kernels run their tiles on masked data): a bucket keeps the
    padding within 2x of what the row needs, at the price of one capture per bucket met (at most 6 there).
    """
    cap = max_documents(token_budget, min_doc_len) + 1
    out, s = [], FIRST_SLOT_BUCKET
    while s < cap:
        out.append(s)
        s *= 2
    return [*out, cap]


@dataclass
class FixedPackedInputs:
    """Every input of the packed forward, each of a shape fixed by (token_budget, slots): what a graph captures."""

    input_ids: Tensor  # [1, N] long, the dummy tail's ids are 0
    position_ids: Tensor  # [N] long
    seq_idx: Tensor  # [N] int32
    cu_seqlens: Tensor  # [slots + 1] long; entries past the last document repeat N (empty documents)
    chunk_indices: Tensor  # [chunk_capacity(N, slots), 2] long; padding rows point at the last (empty) slot
    max_len: int  # the longest document a row may hold (a constant of the run, not of the batch)
    slots: int
    documents: int  # real documents plus the dummy tail's pieces (the rest of the slots are empty)


def fixed_packed_inputs(input_ids: Tensor, cu_seqlens: Tensor, token_budget: int, max_doc_len: int,
                        buckets: list[int]) -> FixedPackedInputs:
    """The fixed-shape inputs of one packed row of n <= token_budget tokens with boundaries `cu_seqlens` (ending at n).

    The row is padded to token_budget with a dummy tail cut into pieces of at most max_doc_len tokens (so the
    attention's max length stays a run constant), then cu_seqlens to the smallest bucket that leaves one slot empty
    (the padding chunk entries point there). Refuses a row whose documents do not fit the largest bucket or exceed
    max_doc_len, naming the numbers.
    """
    n = input_ids.shape[-1]
    if n > token_budget:
        raise ValueError(f"packed row of {n} tokens is longer than the token budget {token_budget}")
    idx = packed_indices(cu_seqlens, n)
    lengths = (idx.cu_seqlens[1:] - idx.cu_seqlens[:-1]).tolist()
    if max(lengths) > max_doc_len:
        raise ValueError(f"a document of {max(lengths)} tokens is longer than the fixed-shape limit {max_doc_len} "
                         "(data.max_len)")
    tail = token_budget - n
    found = row_slots(lengths, token_budget, max_doc_len, buckets)
    lengths += [min(max_doc_len, tail - i) for i in range(0, tail, max_doc_len)]
    docs = len(lengths)
    if found is None:
        raise ValueError(f"packed row has {docs} documents (with its tail's pieces); the fixed-shape inputs hold "
                         f"{buckets[-1] - 1} (token budget / data.min_len, rounded up)")
    slots = found
    bounds = [0, *itertools.accumulate(lengths)]
    cu = torch.tensor(bounds + [token_budget] * (slots + 1 - len(bounds)), dtype=torch.long)
    full = packed_indices(torch.tensor(bounds), token_budget)
    cap = chunk_capacity(token_budget, slots)
    chunks = full.chunk_indices
    pad = torch.tensor([[slots - 1, 0]], dtype=torch.long).expand(cap - chunks.shape[0], 2)
    ids = torch.zeros(1, token_budget, dtype=input_ids.dtype)
    ids[0, :n] = input_ids.reshape(-1).cpu()
    return FixedPackedInputs(input_ids=ids, position_ids=full.position_ids, seq_idx=full.seq_idx, cu_seqlens=cu,
                             chunk_indices=torch.cat([chunks, pad]), max_len=max_doc_len, slots=slots,
                             documents=docs)


def packed_forward_kwargs(inp: FixedPackedInputs | PackedIndices, input_ids: Tensor, device: torch.device
                          ) -> dict[str, Any]:
    """The decoder kwargs of a packed row (what transformers hands the varlen kernels), on `device` without a sync."""
    if isinstance(inp, FixedPackedInputs):
        cu, max_len, cu_cpu = to_device(inp.cu_seqlens, device), inp.max_len, None
    else:
        cu, max_len, cu_cpu = to_device(inp.cu_seqlens, device), inp.max_len, inp.cu_seqlens
    kwargs: dict[str, Any] = {
        "input_ids": to_device(input_ids, device),
        "position_ids": to_device(inp.position_ids, device).unsqueeze(0),
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len,
        "seq_idx": to_device(inp.seq_idx, device).unsqueeze(0),
        # fla's chunk op takes its chunk index as given (transformers passes the kwargs its signature names): built
        # here, copied without a sync; left to fla it is built on the host from cu_seqlens_cpu and copied from
        # pageable memory, which makes the host wait for the GPU once per forward.
        "chunk_indices": to_device(inp.chunk_indices, device),
    }
    if cu_cpu is not None:  # a graph must not bake a host tensor in; fla needs it only without chunk_indices
        kwargs["cu_seqlens_cpu"] = cu_cpu
    return kwargs


@contextlib.contextmanager
def fla_tensor_cache_off() -> Iterator[None]:
    """fla memoises its index helpers (prepare_chunk_offsets, prepare_lens) by the *identity* of cu_seqlens. A graph's
    static cu_seqlens is one object whose contents change every batch: a cached result would be baked into the
    capture and replayed stale. With the cache off during warm-up and capture, the helpers are recorded as kernels."""
    mod = sys.modules.get("fla.utils")
    if mod is None or not hasattr(mod, "FLA_DISABLE_TENSOR_CACHE"):
        yield
        return
    before = mod.FLA_DISABLE_TENSOR_CACHE
    mod.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        mod.FLA_DISABLE_TENSOR_CACHE = before


def resolve_fused_elementwise(choice: str, packing: str) -> bool:
    """target.fused_elementwise -> whether to fuse: off never; auto where the packed varlen forward runs (the only
    path that uses the fused kernels), silently not elsewhere; on the same, refused where it would do nothing."""
    if choice not in FUSED_ELEMENTWISE:
        raise ValueError(f"target.fused_elementwise must be one of {', '.join(FUSED_ELEMENTWISE)}; got {choice!r}")
    if choice == "on" and packing != "varlen":
        raise ValueError(f"target.fused_elementwise=on fuses the packed varlen target forward; this target packs "
                         f"{packing!r} (varlen needs CUDA with fla and causal-conv1d). Use fused_elementwise: auto "
                         "or off.")
    return choice != "off" and packing == "varlen"


def resolve_cuda_graph(choice: str, device: torch.device, packing: str) -> bool:
    """target.cuda_graph -> whether to capture: off never; auto where it can apply (CUDA and packed varlen rows),
    silently not elsewhere; on the same, but refused where it cannot apply (one line naming the reason)."""
    if choice not in CUDA_GRAPHS:
        raise ValueError(f"target.cuda_graph must be one of {', '.join(CUDA_GRAPHS)}; got {choice!r}")
    usable = device.type == "cuda" and packing == "varlen"
    if choice == "on" and not usable:
        why = f"this target is on {device.type}" if device.type != "cuda" else f"packing is {packing!r}, not varlen"
        raise ValueError(f"target.cuda_graph=on captures the packed target forward on CUDA; {why}. Use "
                         "cuda_graph: auto or off.")
    return choice != "off" and usable


class PackedGraphs:
    """The packed target forward captured as CUDA graphs, one per document-slot bucket met, sharing one memory pool.

    Each call lays the row out as fixed-shape inputs, copies them into the bucket's static buffers (non-blocking, from
    pinned memory) and replays. The result is the graph's static output: valid until the next call (run_target copies
    it out at once, on the same stream). A capture that raises is reported once through `log` and every later call
    runs the eager forward (`failed` holds the reason).
    """

    def __init__(self, target: Target, token_budget: int, min_doc_len: int, max_doc_len: int,
                 log: Callable[[str], None]) -> None:
        self.target, self.n, self.log = target, token_budget, log
        self.max_len = min(max_doc_len, token_budget)
        self.buckets = slot_buckets(token_budget, min_doc_len)
        self.graphs: dict[int, tuple[Any, dict[str, Tensor], Tensor]] = {}
        self.captures = 0
        self.replays = 0
        self.unfit = 0  # rows that did not fit the fixed shapes (ran eagerly)
        self.failed: str | None = None
        self.pool: Any = None

    def __call__(self, input_ids: Tensor, cu_seqlens: Tensor) -> Tensor:
        try:
            fixed = fixed_packed_inputs(input_ids, cu_seqlens, self.n, self.max_len, self.buckets)
        except ValueError as exc:  # a row the fixed shapes cannot hold: this one runs eagerly, said once
            if not self.unfit:
                self.log(f"target.cuda_graph: {exc}; such rows run the eager forward")
            self.unfit += 1
            idx = packed_indices(cu_seqlens, input_ids.shape[1])
            return self.target._tapped(**packed_forward_kwargs(idx, input_ids, self.target.device))
        if self.failed is None and fixed.slots not in self.graphs:
            try:
                self._capture(fixed)
            except Exception as exc:  # noqa: BLE001 - any capture failure falls back to the eager forward
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                self.failed = f"{type(exc).__name__}: {first}"
                self.log(f"target.cuda_graph: capture failed ({self.failed}); the target forward runs eagerly")
        if self.failed is not None:
            return self.target._tapped(**packed_forward_kwargs(fixed, fixed.input_ids, self.target.device))
        graph, static, out = self.graphs[fixed.slots]
        self._fill(static, fixed)
        graph.replay()
        self.replays += 1
        return out

    def representatives(self, rows: Iterable[tuple[Any, Sequence[int]]]) -> dict[int, Any]:
        """For each bucket the rows need and no graph holds yet, the first row (its key) that needs it: running the
        target on those before the first step captures every graph the run will replay (rows of a longer document
        than data.max_len, or more documents than the largest bucket, run eagerly and need none)."""
        out: dict[int, Any] = {}
        for key, lengths in rows:
            if not lengths or max(lengths) > self.max_len:
                continue
            slots = row_slots(lengths, self.n, self.max_len, self.buckets)
            if slots is not None and slots not in self.graphs and slots not in out:
                out[slots] = key
        return dict(sorted(out.items()))

    @staticmethod
    def _fill(static: dict[str, Tensor], fixed: FixedPackedInputs) -> None:
        for name, src in (("input_ids", fixed.input_ids), ("position_ids", fixed.position_ids.unsqueeze(0)),
                          ("seq_idx", fixed.seq_idx.unsqueeze(0)), ("cu_seq_lens_q", fixed.cu_seqlens),
                          ("chunk_indices", fixed.chunk_indices)):
            static[name].copy_(to_device(src, static[name].device), non_blocking=True)

    def _capture(self, fixed: FixedPackedInputs) -> None:
        dev = self.target.device
        kwargs = packed_forward_kwargs(fixed, fixed.input_ids, dev)
        kwargs = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in kwargs.items()}  # own static buffers
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_q"]
        static = {k: v for k, v in kwargs.items() if isinstance(v, Tensor)}
        with fla_tensor_cache_off():
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # Triton autotuning, lazy init, cuBLAS workspaces, fused kernels' compile and
                    self.target._tapped(fused=True, **kwargs)  # first-call check happen outside the capture
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.target._tapped(fused=True, **kwargs)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[fixed.slots] = (graph, static, out)
        self.captures += 1
        self.log(f"target.cuda_graph: captured the packed forward for {fixed.slots} document slots "
                 f"({fixed.chunk_indices.shape[0]} chunk slots, {self.n} tokens)")
