"""What bench/step_phases.py and bench/target_forward.py share: the config with overrides, synthetic buffers,
the FLOPs of a buffer, CUDA-event timing and host-sync counting.

Synthetic data (random ids over the config's vocabulary, documents of random length packed by the run's own
schedule code): the cost of a step depends on shapes and document lengths, not on what the tokens say.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dflash.config import RunConfig, check_run, load_config  # noqa: E402
from dflash.data import Piece, TokenizedCorpus, make_pieces, pack_epoch  # noqa: E402
from dflash.flops import (  # noqa: E402
    DrafterShape,
    TargetLayerCost,
    drafter_attention_pairs,
    drafter_step_flops,
    target_forward_flops,
    target_layer_costs,
)
from dflash.model import DraftBatch, sample_anchors  # noqa: E402
from dflash.target import default_tap_layers, resolve_tap_layers, target_hf_config  # noqa: E402


def load(path: str, vocab: int | None = None, attention: str | None = None, layers: int | None = None) -> RunConfig:
    """The config, with target.arch.vocab_size / target.attention overridden, checked as `dflash train` would.

    `layers` keeps the target's first N layers (its layer_types cut to them, the taps scaled to the same depth
    fractions, so the last tap stays near the end and every kept layer runs): a shallower target of the same layer
    shapes, so fla compiles and tunes the same kernels for the same keys (they hold heads and head sizes, not depth)
    on a card the whole target does not fit (docs/perf.md, session 20)."""
    cfg = load_config(path)
    changes: dict[str, Any] = {}
    if vocab is not None:
        changes["arch"] = {**cfg.target.arch, "vocab_size": vocab}
        mask = cfg.drafter.mask_token_id
        if mask is not None and mask >= vocab:  # the config's reserved id is past the smaller vocabulary
            cfg.drafter = dataclasses.replace(cfg.drafter, mask_token_id=vocab - 1)
            print(f"--vocab {vocab}: drafter.mask_token_id {mask} -> {vocab - 1}", file=sys.stderr)
    if layers is not None:
        arch = dict(changes.get("arch") or cfg.target.arch)
        have = arch.get("num_hidden_layers")
        if not isinstance(have, int) or not 4 <= layers <= have:
            raise SystemExit(f"--target-layers {layers}: must be between 4 and the config's target.arch."
                             f"num_hidden_layers ({have})")
        arch["num_hidden_layers"] = layers
        if isinstance(arch.get("layer_types"), list):
            arch["layer_types"] = arch["layer_types"][:layers]
        changes["arch"] = arch
        taps = cfg.target.tap_layers or default_tap_layers(have, cfg.drafter.num_layers)

        def scaled(n: int) -> list[int]:
            return sorted({1 + round((t - 1) * (n - 2) / max(1, have - 2)) for t in taps})

        if len(scaled(layers)) < len(taps):  # two taps on one layer: the drafter's input would change shape
            least = next(n for n in range(layers, have + 1) if len(scaled(n)) == len(taps))
            raise SystemExit(f"--target-layers {layers}: too few for the config's {len(taps)} taps {list(taps)}; "
                             f"at least {least}")
        changes["tap_layers"] = scaled(layers)
    if cfg.drafter.mask_token_id is None:  # `dflash train` takes it from the tokenizer; a bench has none
        rows = int((changes.get("arch") or cfg.target.arch).get("vocab_size") or cfg.data.vocab_size)
        cfg.drafter = dataclasses.replace(cfg.drafter, mask_token_id=rows - 1)
        print(f"drafter.mask_token_id unset (no tokenizer here): the last embedding row, {rows - 1}", file=sys.stderr)
    if attention is not None:
        changes["attention"] = attention
    if changes:
        cfg.target = dataclasses.replace(cfg.target, **changes)
    check_run(cfg, "cuda")
    return cfg


def synthetic_corpus(cfg: RunConfig, tokens: int, seed: int = 0) -> TokenizedCorpus:
    """Random-id documents totalling about `tokens`, lengths log-uniform in [min_len, 2 max_len] (long documents are
    split into max_len pieces by the schedule, as real ones are), ids below the tiny tokenizer's data.vocab_size."""
    d = cfg.data
    rng = random.Random(f"bench:{seed}")
    g = torch.Generator().manual_seed(seed)
    ids, masks, total = [], [], 0
    lo, hi = math.log(max(2, d.min_len)), math.log(2 * d.max_len)
    while total < tokens:
        n = int(math.exp(rng.uniform(lo, hi)))
        ids.append(torch.randint(0, d.vocab_size, (n,), generator=g))
        masks.append(torch.ones(n, dtype=torch.bool))
        total += n
    return TokenizedCorpus(ids=ids, loss_mask=masks, fingerprint=f"synthetic:{seed}")


def synthetic_buffers(cfg: RunConfig, count: int, seed: int = 0) -> tuple[TokenizedCorpus, list[list[Piece]]]:
    """`count` buffers packed by the run's own schedule (dflash.data.pack_epoch), fullest first."""
    d = cfg.data
    corpus = synthetic_corpus(cfg, int(d.token_budget * (count + 2) * 1.1), seed)
    pieces = make_pieces(corpus.lengths(), d.max_len, d.min_len)
    buffers = pack_epoch(pieces, d.token_budget, d.max_len, d.num_buckets, seed, 0)
    buffers.sort(key=lambda b: -sum(n for _, _, n in b))
    if len(buffers) < count:
        raise SystemExit(f"only {len(buffers)} synthetic buffers, asked for {count}")
    return corpus, buffers[:count]


def target_costs(cfg: RunConfig) -> tuple[list[TargetLayerCost], list[int], Any]:
    """Per-layer costs of the config's target (from a weightless instance), its taps and its HF config."""
    from transformers import AutoModelForCausalLM

    hf = target_hf_config(cfg.target, cfg.data.vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    text = hf.get_text_config()
    taps = resolve_tap_layers(cfg.target.tap_layers, int(text.num_hidden_layers), cfg.drafter.num_layers)
    return target_layer_costs(model), taps, text


def drafter_shape(cfg: RunConfig, hidden: int, vocab: int, pairs: list[int], num_taps: int) -> DrafterShape:
    r = cfg.drafter
    return DrafterShape(hidden=hidden, num_taps=num_taps,
                        num_heads=r.num_heads, num_kv_heads=r.num_kv_heads, head_dim=r.head_dim or hidden // r.num_heads,
                        intermediate=r.intermediate_size or 3 * hidden, vocab=vocab, n_ctx=cfg.data.token_budget,
                        num_anchors=r.num_anchors, block_size=r.block_size, pairs=pairs,
                        grad_checkpoint=r.grad_checkpoint is not False)


def layer_windows(cfg: RunConfig) -> list[int | None]:
    r = cfg.drafter
    return list(r.layer_sliding_windows) if r.layer_sliding_windows is not None else [r.sliding_window] * r.num_layers


def anchor_pairs(cfg: RunConfig, batch: DraftBatch, anchors: torch.Tensor) -> list[int]:
    """Allowed (query, key) pairs per drafter layer for these anchors (one host sync per window: after timing)."""
    from dflash.model import layer_rules

    b = cfg.drafter.block_size
    pos, in_doc = batch.position_ids[anchors], batch.doc_ids[anchors] >= 0
    rules = layer_rules(cfg.drafter, layer_windows(cfg))  # window, causal block, window from the anchor per layer
    cache: dict[Any, int] = {}
    for r in rules:
        if r not in cache:
            cache[r] = drafter_attention_pairs(pos, in_doc, b, r.window, r.causal, r.from_anchor)
    return [cache[r] for r in rules]


def flex_tile_pairs(cfg: RunConfig, batch: DraftBatch, anchors: torch.Tensor) -> list[int]:
    """Pairs flex computes per drafter layer (whole non-empty tiles of the block mask the drafter builds for these
    anchors): the hardware count of its attention, against anchor_pairs' allowed count."""
    from dflash.flops import block_mask_pairs
    from dflash.model import FlexShape, build_block_mask, flex_mask_mod, layer_rules

    b = cfg.drafter.block_size
    n, m = batch.doc_ids.shape[0], anchors.shape[0] * b
    dev = batch.doc_ids.device
    shape = FlexShape(m, n + m, anchors.shape[0], n, str(dev))
    rules = layer_rules(cfg.drafter, layer_windows(cfg))
    cache: dict[Any, int] = {}
    for r in rules:
        if r not in cache:
            mod = flex_mask_mod(anchors, batch.doc_ids, b, r.window, r.causal, r.from_anchor)
            cache[r] = block_mask_pairs(build_block_mask(mod, shape, dev))
    return [cache[r] for r in rules]


def host_batch(arrays: dict[str, torch.Tensor], hidden_dim: int = 0) -> DraftBatch:
    """A DraftBatch of a buffer's host arrays (no hidden states: enough to sample anchors and count pairs)."""
    n = arrays["input_ids"].shape[0]
    return DraftBatch(hidden=torch.zeros(n, hidden_dim), input_ids=arrays["input_ids"], loss_mask=arrays["loss_mask"],
                      position_ids=arrays["position_ids"], doc_ids=arrays["doc_ids"])


def buffer_flops(cfg: RunConfig, costs: Sequence[TargetLayerCost], taps: Sequence[int], hidden: int, vocab: int,
                 pieces: Sequence[Piece], pairs: list[int], hw_pairs: list[int] | None = None,
                 checkpoint_layers: int | None = None) -> dict[str, float]:
    """Model FLOPs of one step on this buffer: the target forward (layers up to the deepest tap, real tokens) and
    the drafter step (model and hardware)."""
    t = target_forward_flops(costs, [n for _, _, n in pieces], layers_run=max(taps) + 1)
    shape = drafter_shape(cfg, hidden, vocab, pairs, len(taps))
    shape.flex_hw_pairs = hw_pairs
    shape.checkpoint_layers = checkpoint_layers  # drafter.grad_checkpoint auto: what the drafter really recomputes
    dr = drafter_step_flops(shape)
    return {"target": t.total, "target_attention": t.attention, "drafter": dr.model, "drafter_hw": dr.hardware,
            "drafter_lm_head": dr.parts["lm_head"] * 2, "tokens": float(t.tokens)}


def sample_buffer_pairs(cfg: RunConfig, arrays: dict[str, torch.Tensor], seed: int) -> list[int]:
    """Anchors drawn as the drafter draws them (sample_anchors), their allowed pairs per layer (CPU)."""
    batch = host_batch(arrays)
    anchors, _ = sample_anchors(batch, cfg.drafter.num_anchors, cfg.drafter.block_size,
                                torch.Generator().manual_seed(seed))
    return anchor_pairs(cfg, batch, anchors)


class _HostEvent:
    """A CPU stand-in for torch.cuda.Event: CPU ops run synchronously, so the host clock at record() is their time."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: _HostEvent) -> float:
        return (other.t - self.t) * 1e3


class Dev:
    """The few device operations the benches need, on CUDA, or on the CPU for --cpu-smoke (checking the scripts'
    own logic end to end on a machine without a GPU; its figures are not GPU figures and say so)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def event(self) -> Any:
        return torch.cuda.Event(enable_timing=True) if self.cuda else _HostEvent()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else 0

    def alloc_retries(self) -> int:
        """The caching allocator's retries so far: each one freed cached blocks (cudaFree, a device-wide sync that
        torch's sync debug mode does not count) to satisfy an allocation."""
        return int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if self.cuda else 0

    def name(self) -> str:
        return torch.cuda.get_device_name() if self.cuda else "cpu (smoke run: not GPU figures)"


class Events:
    """Named events on the current stream; elapsed milliseconds between any two (GPU time, not host time)."""

    def __init__(self, dev: Dev) -> None:
        self.dev = dev
        self.marks: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        ev = self.dev.event()
        ev.record()
        self.marks[name] = ev

    def ms(self, a: str, b: str) -> float:
        return float(self.marks[a].elapsed_time(self.marks[b]))


def time_cuda(fn: Callable[[], Any], repeats: int, dev: Dev, warmup: int = 1) -> tuple[list[float], Any]:
    """Milliseconds of `fn` on the GPU (events around each call, synchronised once at the end), and its last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    dev.sync()
    pairs = []
    for _ in range(repeats):
        a, b = dev.event(), dev.event()
        a.record()
        out = fn()
        b.record()
        pairs.append((a, b))
    dev.sync()
    return [float(a.elapsed_time(b)) for a, b in pairs], out


def count_host_syncs(fn: Callable[[], Any], dev: Dev) -> tuple[int, list[str]]:
    """How many synchronising CUDA calls `fn` makes (torch's sync debug mode), with the first few call sites: the
    innermost Python frame, and after `<` the innermost frame of dflash's own code that led to it (a sync raised in
    torch's or inductor's code is placed by the dflash line that called it)."""
    if not dev.cuda:
        fn()
        return 0, ["n/a on cpu"]
    sites: list[str] = []

    def record(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "synchroniz" not in str(message).lower():
            return
        site = f"{Path(filename).name}:{lineno}"
        ours = [f for f in traceback.extract_stack()[:-1] if "dflash" in Path(f.filename).parts]
        if ours and Path(ours[-1].filename).name != Path(filename).name:
            site += f" < {Path(ours[-1].filename).name}:{ours[-1].lineno}"
        sites.append(site)

    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    return len(sites), sites[:8]


def kernel_ms(prof: Any, steps: int, prefix: str = "phase:") -> dict[str, float]:
    """GPU kernel milliseconds per step inside each `record_function(prefix + name)` range of a torch.profiler run,
    and "all_kernels": every kernel of the run per step. Set against a phase's CUDA-event time, the difference is
    time the GPU sat idle inside the phase (waiting for the host to launch)."""
    from torch.autograd import DeviceType

    out: dict[str, float] = {}
    total = 0.0
    for e in prof.key_averages():
        device_us = float(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)) or 0.0)
        if e.key.startswith(prefix):
            if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU:  # the host range, with its kernels
                out[e.key[len(prefix):]] = device_us / 1e3 / max(1, steps)
            continue  # the GPU-side copy of the annotation is a range, not kernels
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            total += float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) or 0.0)
    out["all_kernels"] = total / 1e3 / max(1, steps)
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def require_cuda(script: str, hint: str = "", cpu_smoke: bool = False) -> Dev:
    """Refuse to time anything without a GPU (CPU figures would be taken for GPU ones), unless this is a smoke run."""
    if cpu_smoke:
        return Dev(torch.device("cpu"))
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU (none here){hint}")
    return Dev(torch.device("cuda"))
