"""`dflash pretrain-target`: train the random-init qwen3_5 hybrid target (`target.arch`) as a language model on the
run's corpus, and save it as a Hugging Face directory that `target.path` loads.

A random target gives a drafter nothing to learn (its greedy continuations are noise), so the tiny default pretrains
one. `target.pretrain` in a config makes that automatic: `resolve_target` builds it on first use into a cache keyed by
everything the weights depend on (arch, seed, settings, tokenizer content, corpus content) and reuses it afterwards,
the way the tiny BPE is cached (dflash/data.py `load_tokenizer`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash import locks
from dflash.cache_entry import cache_home, content_problem, record_content, structure_problem
from dflash.checkpoint import atomic_directory
from dflash.config import ConfigError, RunConfig
from dflash.data import (
    REGEN_MANIFEST,
    DataError,
    Document,
    TokenizerAdapter,
    corpus_fingerprint,
    load_tokenizer,
    pinned_origin,
    tokenize,
)
from dflash.kernels import fla_backward_refused, reference_delta_rule
from dflash.target import Target, TargetConfig, TargetPretrainConfig, use_sdpa_for_decoding

Log = Callable[[str], None]
_FORMAT = 1  # bump when the training procedure changes, so old cache entries are not reused
_DONE = "pretrain.json"  # written last: a directory without it is not a finished target


def replace_fields(obj: Any, **changes: Any) -> Any:
    """A copy of a config section with `changes`: pydantic models (RunConfig, DataConfig) or dataclasses."""
    if hasattr(obj, "model_copy"):
        return obj.model_copy(update=changes)
    return dataclasses.replace(obj, **changes)


def as_dict(obj: Any) -> dict[str, Any]:
    """A config section as plain data (pydantic model or dataclass)."""
    if hasattr(obj, "model_dump"):
        return dict(obj.model_dump(mode="python"))
    return dataclasses.asdict(obj)


def cache_root(pc: TargetPretrainConfig) -> Path:
    """Where pretrained targets are cached: target.pretrain.cache_dir, $DFLASH_CACHE, $XDG_CACHE_HOME/dflash, ~/.cache."""
    if pc.cache_dir:
        return Path(pc.cache_dir).expanduser()
    return cache_home()


def check_pretrain(pc: TargetPretrainConfig, where: str = "target.pretrain") -> None:
    """Ranges of the pretraining settings, as ConfigError lines naming the field."""
    for name in ("steps", "batch_size", "seq_len"):
        v = getattr(pc, name)
        if v < 1:
            raise ConfigError(f"{where}.{name}: must be at least 1, got {v}")
    if pc.seq_len < 2:
        raise ConfigError(f"{where}.seq_len: must be at least 2, got {pc.seq_len}")
    if not pc.lr > 0:
        raise ConfigError(f"{where}.lr: must be positive, got {pc.lr}")
    if not 0 <= pc.warmup_frac < 1:
        raise ConfigError(f"{where}.warmup_frac: must be in [0, 1), got {pc.warmup_frac}")


def _arch(cfg: RunConfig, vocab_size: int) -> dict[str, Any]:
    return {**cfg.target.arch, "vocab_size": int(vocab_size)}


def pretrain_key(cfg: RunConfig, docs: Sequence[Document], tok: TokenizerAdapter) -> str:
    """Content key of a pretrained target: a change to anything the weights depend on names another directory."""
    pc = cfg.target.pretrain or TargetPretrainConfig()
    settings = {k: v for k, v in as_dict(pc).items() if k != "cache_dir"}
    blob = json.dumps({"format": _FORMAT, "family": getattr(cfg.target, "family", None),
                       "arch": _arch(cfg, tok.vocab_size), "seed": cfg.target.seed,
                       "settings": settings, "tokenizer": tok.content_hash, "corpus": corpus_fingerprint(docs)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _lr(step: int, total: int, warmup_frac: float) -> float:
    """Linear warm-up, then cosine down to 10 %."""
    warm = max(1, int(round(total * warmup_frac))) if warmup_frac > 0 else 0
    if step < warm:
        return (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, total - warm))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def unigram_nats(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats/token) on `val` of the add-one unigram distribution of `train`: the bar a language model
    has to clear to have learned anything beyond token frequencies."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[val].mean())


def _windows(stream: torch.Tensor, seq_len: int, limit: int) -> torch.Tensor:
    n = min(limit, (stream.numel() - 1) // seq_len)
    return stream[: n * seq_len + 1].unfold(0, seq_len, seq_len)[:n] if n > 0 else stream[:0].view(0, seq_len)


def pretrain(cfg: RunConfig, docs: Sequence[Document], tok: TokenizerAdapter, out: str | Path, *,
             log: Log = print, device: torch.device | None = None, max_seconds: float | None = None) -> dict[str, Any]:
    """_pretrain into `out` holding its lock (`.NAME.lock` next to it): a second `pretrain-target` on the same
    directory is refused naming the first (locks.LockBusy); resolve_target already holds it (re-entrant)."""
    dst = Path(out)
    with locks.hold(locks.sibling_lock(dst), str(dst), hint="another pretrain-target writes there: wait for it to "
                    "end, or use another --out"):
        return _pretrain(cfg, docs, tok, dst, log=log, device=device, max_seconds=max_seconds)


def _pretrain(cfg: RunConfig, docs: Sequence[Document], tok: TokenizerAdapter, out: str | Path, *,
              log: Log = print, device: torch.device | None = None, max_seconds: float | None = None) -> dict[str, Any]:
    """Train `cfg.target.arch` (vocabulary = the tokenizer's) on the corpus and write an HF directory to `out`.

    The corpus is one token stream (documents in order, each ending with EOS; chats whole); the last 5 % is held out
    for the reported validation loss and the unigram bar. Steps draw `batch_size` random windows of `seq_len` tokens.
    Written atomically: a temp directory renamed to `out`, with pretrain.json (the summary) written last.
    `max_seconds` (benchmarks with a wall-clock budget) stops early; the summary says at which step.
    """
    pc = cfg.target.pretrain or TargetPretrainConfig()
    check_pretrain(pc)
    dev = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dst = Path(out)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise DataError(f"{dst}: exists and is not an empty directory")
    corpus = tokenize(docs, tok)
    stream = torch.cat(corpus.ids)
    n_val = max(pc.seq_len + 1, stream.numel() // 20)
    train, val = stream[:-n_val], stream[-n_val:]
    if train.numel() < 4 * (pc.seq_len + 1):
        raise DataError(f"target pretraining: the corpus has {stream.numel()} tokens, too few for "
                        f"target.pretrain.seq_len={pc.seq_len}")
    arch = _arch(cfg, tok.vocab_size)
    tcfg = replace_fields(TargetConfig(), family=cfg.target.family, arch=arch, seed=cfg.target.seed, dtype="float32")
    try:
        model = Target(tcfg, 1, dev).model  # the same random init `dflash train` would build from this arch
        use_sdpa_for_decoding(model)  # dense rows; and the saved config must not name a function only we register
    except ValueError as exc:
        raise ConfigError(f"target.arch: {exc}") from None
    model.train()
    model.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=pc.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr(s, pc.steps, pc.warmup_frac))
    gen = torch.Generator().manual_seed(cfg.target.seed)
    train_dev = train.to(dev)
    offs = torch.arange(pc.seq_len, device=dev)
    log(f"pretrain-target: {sum(p.numel() for p in params) / 1e6:.2f}M params, {train.numel()} train / "
        f"{val.numel()} val tokens, {pc.steps} steps x {pc.batch_size} x {pc.seq_len} on {dev}")
    t0 = time.perf_counter()
    losses: list[float] = []
    every = max(1, pc.steps // 10)
    autocast = dev.type == "cuda"
    steps_done = 0
    reference = fla_backward_refused(dev)
    if reference:
        log("pretrain-target: fla refuses its gated backward with this Triton on this card (fla #640): training "
            "through transformers' PyTorch delta rule (exact, slower); forwards keep fla")
    with reference_delta_rule(model) if reference else contextlib.nullcontext():
        for step in range(pc.steps):
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                log(f"pretrain-target: time budget of {max_seconds:.0f}s reached at step {step}/{pc.steps}")
                break
            starts = torch.randint(0, train.numel() - pc.seq_len, (pc.batch_size,), generator=gen).to(dev)
            x = train_dev[starts[:, None] + offs[None, :]]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=x, labels=x, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            steps_done = step + 1
            if not math.isfinite(losses[-1]):
                raise RuntimeError(f"target pretraining diverged: loss {losses[-1]} at step {step + 1}; lower "
                                   "target.pretrain.lr")
            if (step + 1) % every == 0 or step + 1 == pc.steps:
                recent = losses[-every:]
                log(f"pretrain-target: step {step + 1}/{pc.steps}  loss {sum(recent) / len(recent):.3f}  "
                    f"({time.perf_counter() - t0:.0f}s)")
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
        vx = _windows(val, pc.seq_len, 64).to(dev)
        val_loss = float(model(input_ids=vx, labels=vx, use_cache=False).loss) if vx.shape[0] else float("nan")
    uni = unigram_nats(train, val, tok.vocab_size)
    summary = {
        "format": _FORMAT, "key": pretrain_key(cfg, docs, tok), "arch": arch, "seed": cfg.target.seed,
        "settings": as_dict(pc), "tokenizer_hash": tok.content_hash, "vocab_size": tok.vocab_size,
        "corpus_fingerprint": corpus_fingerprint(docs), "tokens": {"train": train.numel(), "val": val.numel()},
        "loss": {"first": losses[0], "last10": sum(losses[-10:]) / len(losses[-10:]), "val": val_loss},
        "unigram_val_nats": uni, "seconds": round(seconds, 1), "steps_done": steps_done,
        "tokens_per_s": round(steps_done * pc.batch_size * pc.seq_len / max(seconds, 1e-9)), "device": str(dev),
        "torch": torch.__version__,
    }
    log(f"pretrain-target: done in {seconds:.0f}s: held-out loss {val_loss:.3f} nats/token vs unigram {uni:.3f}")
    with atomic_directory(dst) as tmp:
        model.to(torch.float32).save_pretrained(str(tmp))
        _save_hf_tokenizer(tok, tmp)
        (tmp / _DONE).write_text(json.dumps(summary, indent=2) + "\n")
        record_content(tmp)  # sizes + sha256 of every file: checked on each use of a cache entry
    return summary


def _save_hf_tokenizer(tok: TokenizerAdapter, out: Path) -> None:
    """Make the target directory a complete HF model: its tokenizer loads with AutoTokenizer (eval --target DIR)."""
    hf = getattr(tok, "_hf", None)
    if hf is not None:
        hf.save_pretrained(str(out))
        return
    from transformers import PreTrainedTokenizerFast

    from dflash.data import EOS, MASK, PAD

    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok._tiny, eos_token=EOS, pad_token=PAD, mask_token=MASK)
    wrapped.save_pretrained(str(out))


def resolve_target(cfg: RunConfig, docs: Sequence[Document], log: Log = print) -> RunConfig:
    """`cfg` with target.path at the pretrained target (built now on first use) when `target.pretrain` asks for one.

    The tiny BPE the target was trained with is pinned too (data.tokenizer_cache, unless the config sets it): every
    consumer of the returned config (train, regen, eval from the checkpoint) then encodes text with the very
    vocabulary the target learnt. A config with target.path, or without target.pretrain, comes back unchanged.
    """
    pc = cfg.target.pretrain
    if cfg.target.path is not None or pc is None:
        return cfg
    check_pretrain(pc)
    origin = pinned_origin(docs)
    if origin is not None:  # regenerated records: train against the very target that wrote them
        made_by = (origin.get("target") or {}).get("path")
        if not made_by or not Path(made_by).is_dir():
            raise DataError(f"{origin.get('dir')}/{REGEN_MANIFEST}: the target that made these records "
                            f"({made_by}) is not there; set target.path")
        log(f"target: {made_by} (the target that regenerated {origin.get('dir')})")
        return replace_fields(cfg, target=replace_fields(cfg.target, path=str(made_by)))
    root = cache_root(pc)
    data = cfg.data
    if data.tokenizer is None and data.tokenizer_cache is None:
        data = replace_fields(data, tokenizer_cache=str(root / "tokenizer"))
    tok = load_tokenizer(data, docs, data.tokenizer_cache or root / "tokenizer")
    key = pretrain_key(cfg, docs, tok)
    path = root / f"target-{key}"
    # Two runs started at once on a fresh cache: the second waits for the first's build and then reuses it.
    with locks.hold(locks.sibling_lock(path), f"target cache entry {path}", wait=True, log=log):
        problem = cached_target_problem(path, key) if path.exists() else "absent"
        if problem is None:
            log(f"target: pretrained {path} (cached)")
        else:
            if problem == "absent" or not (path / _DONE).exists():
                log(f"target: pretraining target.arch on the corpus (first use; cached as {path})")
            else:
                log(f"target: cache entry {path} is damaged ({problem}): rebuilding it")
            if path.exists():  # unfinished or damaged: ours by name, inside the cache, and we hold its lock
                try:
                    shutil.rmtree(path)
                except OSError as exc:
                    raise DataError(f"{path}: damaged cache entry ({problem}) that cannot be removed "
                                    f"({exc.strerror}); delete it by hand") from None
            path.parent.mkdir(parents=True, exist_ok=True)
            pretrain(cfg, docs, tok, path, log=log)
    return replace_fields(cfg, data=data, target=replace_fields(cfg.target, path=str(path)))


def cached_target_problem(path: Path, key: str) -> str | None:
    """None when a cached pretrained target is whole (cache_entry's content record); an entry of an older dflash
    (no record) is adopted when its structure checks out and pretrain.json names this key."""
    problem = content_problem(path)
    if problem is None or not problem.endswith("no content record"):
        return problem
    done = path / _DONE
    if not done.is_file():
        return f"{done}: missing (unfinished)"
    problem = structure_problem(path)
    if problem is None:
        try:
            recorded = json.loads(done.read_text()).get("key")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if recorded != key:
            return f"{done}: made for key {recorded}, not {key}"
        record_content(path)
    return problem


__all__ = ["as_dict", "cache_root", "check_pretrain", "pretrain", "pretrain_key", "replace_fields", "resolve_target",
           "unigram_nats"]
