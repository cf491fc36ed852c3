"""One road into training: what `dflash train` and the train() API check and take before a run may write to OUT —
config, data, resume check, run lock, target.pretrain/regen, tokenizer, target shape — each once per process.

Why one road: the CLI ran these, then train() ran them again and re-took the lock, and the Trainer loaded the
tokenizer a third time. Now the CLI only adds its steps as hooks (--init-from before the lock, target.pretrain and
target.regen under it) and train() calls preflight() once; the Trainer takes the tokenizer loaded here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash import locks
from dflash.checkpoint import list_checkpoints
from dflash.config import RunConfig, check_mask_token_id, check_run
from dflash.data import Document, TokenizerAdapter, bpe_to_train, load_tokenizer, read_documents
from dflash.pipeline import Roles, resolve_roles
from dflash.rundir import UsageError, check_resume_config, drop_unused_run_dir, hold_run_lock


def pick_device(roles: Roles) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(roles.local_rank % torch.cuda.device_count())
        return torch.device("cuda", roles.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def resumes(resume: bool | str, out: Path) -> bool:
    """`resume`: True/False, or "auto" (resume when OUT holds a checkpoint, `dflash train --resume auto`)."""
    return bool(list_checkpoints(out)) if resume == "auto" else bool(resume)


@dataclass
class RunPrep:
    """What preflight established and holds for the run: the (resolved) config and documents, roles and device,
    whether it resumes, the run lock (rank 0), and the tokenizer when reading it wrote nothing."""

    cfg: RunConfig
    out: Path
    roles: Roles
    device: torch.device
    docs: list[Document]
    resume: bool
    fresh: bool
    notes: list[str] = field(default_factory=list)  # data: what a person likely did not mean (read_documents)
    lock: Path | None = None
    created: bool = False  # OUT did not exist before the lock made it
    tok: TokenizerAdapter | None = None

    @property
    def tokenizer_cache(self) -> Path:
        """Where the tiny BPE is kept: data.tokenizer_cache, else OUT/tokenizer."""
        d = self.cfg.data
        return Path(d.tokenizer_cache) if d.tokenizer_cache else self.out / "tokenizer"

    def tokenizer_if_free(self) -> TokenizerAdapter | None:
        """The run's tokenizer, loaded once, when reading it writes nothing (a tokenizer directory, the one regenerated
        records are pinned to, a tiny BPE already cached); None when a BPE must be trained: the Trainer does that
        after OUT is opened (rank 0 writes it, the other ranks read it)."""
        if self.tok is None and bpe_to_train(self.cfg.data, self.docs, self.tokenizer_cache) is None:
            self.tok = load_tokenizer(self.cfg.data, self.docs, self.tokenizer_cache)
        return self.tok

    def release(self) -> None:
        """Give the run lock back; an OUT this preflight created and nothing else wrote to is removed first (a
        refused run leaves no directory behind)."""
        if self.lock is not None:
            if self.created:
                drop_unused_run_dir(self.out)
            locks.release(self.lock)
            self.lock = None


Hook = Callable[[RunPrep], None]


def preflight(cfg: RunConfig, out: str | Path, *, resume: bool | str = False, fresh: bool = False,
              docs: list[Document] | None = None, before_lock: Hook | None = None,
              under_lock: Hook | None = None) -> RunPrep:
    """Everything checked before a run may delete (--fresh) or write a thing in OUT, in this order: the config
    (shapes, target.path, device), the data, --fresh against --resume, `before_lock` (the CLI's --init-from check),
    the resume config check, the run lock (rank 0, for the job), `under_lock` (the CLI's target.pretrain /
    target.regen, which may replace cfg and docs: then the config is checked again and --resume auto looked at
    again), the tokenizer and what needs its size. Raises UsageError, DataError or ConfigError; the lock is given
    back on any failure."""
    roles = resolve_roles(cfg.dist)
    device = pick_device(roles)
    out = Path(out)
    check_run(cfg, device.type)
    notes: list[str] = []
    if docs is None:
        docs = read_documents(cfg.data, notes)  # read and validated before anything is written
    prep = RunPrep(cfg=cfg, out=out, roles=roles, device=device, docs=docs, resume=resumes(resume, out), fresh=fresh,
                   notes=notes)
    _fresh_or_resume(prep)
    _check_eval_length(cfg)
    if before_lock is not None:
        before_lock(prep)
    if prep.resume and not fresh:
        check_resume_config(out, cfg)  # a changed drafter/target/data: refused before anything is built or written
    # One writer per OUT: rank 0 holds OUT/run.lock for the job, before --fresh deletes or events.jsonl is truncated;
    # the OS drops it when the process ends, however it ends.
    prep.created = not out.exists()
    prep.lock = hold_run_lock(out) if roles.rank == 0 else None
    try:
        if under_lock is not None:
            cfg0, docs0 = prep.cfg, prep.docs
            under_lock(prep)
            if prep.cfg is not cfg0 or len(prep.docs) != len(docs0) or any(
                    a is not b for a, b in zip(prep.docs, docs0, strict=True)):
                check_run(prep.cfg, device.type)
                prep.tok = None  # other documents (regenerated records) may pin another tokenizer
            prep.resume = resumes(resume, out)  # under the lock: --resume auto follows what OUT holds now
            _fresh_or_resume(prep)
        _check_vocab(prep)
    except BaseException:
        prep.release()
        raise
    return prep


def _fresh_or_resume(prep: RunPrep) -> None:
    if prep.fresh and prep.resume:
        raise UsageError("--fresh and --resume exclude each other")


def _check_vocab(prep: RunPrep) -> None:
    """The tokenizer (loaded here once where that writes nothing) against the target's vocabulary and the mask
    token, known from a tokenizer directory before anything is written."""
    cfg = prep.cfg
    tok = prep.tokenizer_if_free()
    if tok is None or cfg.data.tokenizer is None or not (cfg.drafter.mask_token_id is not None
                                                         or "vocab_size" in cfg.target.arch):
        return
    from dflash.target import target_shape

    try:
        shape = target_shape(cfg.target, tok.vocab_size)
    except ValueError as exc:  # target.arch.vocab_size smaller than the tokenizer
        raise cfg.error(exc) from None
    if shape.vocab_size is not None:
        check_mask_token_id(cfg, shape.vocab_size, shape.vocab_from)


def _check_eval_length(cfg: RunConfig) -> None:
    """train.eval_*: a held-out sequence longer than the drafter pass can chunk is refused here, not at the first
    evaluation (dflash.measure.max_eval_tokens says why)."""
    from dflash.heldout import EvalSettings
    from dflash.measure import max_eval_tokens
    from dflash.tau import continuation_length

    t = cfg.train
    if not (t.checkpoint_every if t.eval_every is None else t.eval_every):
        return
    s, b = EvalSettings.of(cfg), cfg.drafter.block_size
    n, limit = s.prompt_tokens + continuation_length(s.new_tokens, b), max_eval_tokens(b)
    if n > limit:
        raise cfg.error(f"train.eval_new_tokens: held-out sequences of {s.prompt_tokens} prompt + {s.new_tokens} new "
                        f"+ {b - 1} tokens ({n}) exceed the {limit} the evaluation's drafter pass can chunk at "
                        f"block size {b}; lower train.eval_new_tokens / eval_prompt_tokens")


__all__ = ["Hook", "RunPrep", "pick_device", "preflight", "resumes"]
