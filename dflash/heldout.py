"""The held-out set a training run measures its drafter's serving tau on (`train.eval_every`, the `eval` event).

The target's greedy continuations of prompts the run never trains on (the prompts `dflash eval` picks for the same
checkpoint), together with the target's taps of every position: the target is frozen, so its taps never change, and
an evaluation during training is then only a drafter pass and a host walk (dflash/tau.py) — no target forward, in
any layout (a split run's drafter ranks hold no target). Made once with the training target itself, right after it is
loaded (split: target rank 0 makes it for drafter rank 0, `Remote`), and cached next to the regenerated training data,
keyed by everything that decides its content.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dflash.cache_entry import target_identity
from dflash.config import RunConfig
from dflash.data import TokenizerAdapter
from dflash.model import DFlashDrafter
from dflash.speculative import Generation, NgramProposer
from dflash.target import Target

FORMAT = 1
Log = Callable[[str], None]
# prompts, continuation length -> (prompt + continuation per prompt, the target's taps of each: [n, K*H] on the host)
Continue = Callable[[list[list[int]], int], tuple[list[list[int]], list[Tensor]]]


@dataclass
class EvalSettings:
    """What the held-out set holds: `prompts` prompts of `prompt_tokens` tokens, `new_tokens` decoded after each."""

    prompts: int
    prompt_tokens: int
    new_tokens: int

    @classmethod
    def of(cls, cfg: RunConfig) -> EvalSettings:
        """train.eval_* where set; else the regenerated training data's prompt and continuation lengths (the text
        the drafter learned to continue), else a quarter of data.max_len as prompt and up to 128 new tokens."""
        t, rc = cfg.train, getattr(cfg.target, "regen", None)
        p = t.eval_prompt_tokens or (rc.prompt_tokens if rc is not None and rc.prompt_tokens else None) \
            or max(1, min(cfg.data.max_len // 4, 256))
        n = t.eval_new_tokens or (rc.max_new_tokens if rc is not None and rc.max_new_tokens else None) \
            or max(1, min(cfg.data.max_len - p, 128))
        return cls(prompts=t.eval_prompts, prompt_tokens=p, new_tokens=n)


@dataclass
class HeldOutSet:
    sequences: list[list[int]]  # prompt + greedy continuation (new_tokens + B - 1 tokens, no stop)
    prompt_lens: list[int]
    new_tokens: int  # max_new_tokens of the decoding it stands for
    block_size: int
    stop_ids: list[int]
    taps: list[Tensor]  # per sequence [n, K*H], on the host, in the target's dtype
    path: Path
    source: str  # where the prompts come from (one line)
    ngram: list[Generation] = field(default_factory=list)  # prompt lookup's walk: fixed for the set

    @property
    def ngram_tau(self) -> float | None:
        from dflash.measure import acceptance_stats

        return acceptance_stats(self.ngram, self.block_size)["tau"] if self.ngram else None


def cache_dir_of(cfg: RunConfig) -> Path:
    """Next to the regenerated training data (target.regen.cache_dir), else the pretrained targets' cache root."""
    from dflash.pretrain import cache_root
    from dflash.target import TargetPretrainConfig

    rc = getattr(cfg.target, "regen", None)
    if rc is not None and rc.cache_dir:
        return Path(rc.cache_dir).expanduser()
    return cache_root(cfg.target.pretrain or TargetPretrainConfig())


def heldout_prompts(cfg: RunConfig, tok: TokenizerAdapter, settings: EvalSettings, total_steps: int,
                    n_drafters: int, run_dir: Path, docs: Sequence[Any] | None = None) -> tuple[list[list[int]], str]:
    """The prompts `dflash eval --num-prompts N --prompt-tokens P` picks for this run's checkpoints (same held-out
    documents, same order). `docs`: the corpus as configured (read when not given), not the records trained on."""
    from dflash.data import read_documents
    from dflash.measure import heldout_documents_of, prompts_from_documents

    docs = read_documents(cfg.data) if docs is None else docs
    pipeline = {"total_steps": total_steps, "feeds": [None] * n_drafters}
    held, desc = heldout_documents_of(cfg, docs, tok, pipeline, run_dir)
    prompts = prompts_from_documents(held, tok, settings.prompt_tokens, cfg.data.max_len, settings.prompts)
    return prompts, desc


def _key(cfg: RunConfig, tok: TokenizerAdapter, basis: dict[str, Any], settings: EvalSettings,
         block: int, device: torch.device) -> str:
    """`basis` names the prompts: their hash, or (configured data) what decides them, so that a cached set is found
    without tokenizing the corpus and building its schedule again at every start."""
    from dflash.pretrain import as_dict

    blob = json.dumps({"format": FORMAT, "target": target_identity(cfg.target), "tokenizer": tok.content_hash,
                       "prompts": basis, "settings": dataclasses.asdict(settings), "block_size": block,
                       "taps": {"tap_layers": cfg.target.tap_layers, "draft_layers": cfg.drafter.num_layers},
                       "numerics": {"dtype": cfg.target.dtype, "attention": cfg.target.attention,
                                    "device": device.type},
                       "target_cfg": {k: v for k, v in as_dict(cfg.target).items() if k in ("arch", "seed", "family")}},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _prompts_hash(prompts: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(json.dumps(list(map(list, prompts))).encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load(d: Path, log: Log) -> dict[str, Any] | None:
    """The cached set, verified (its taps file's sha256 as recorded); None (with a line saying why) otherwise."""
    meta_path, taps_path = d / "heldout.json", d / "taps.pt"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if not taps_path.is_file() or taps_path.stat().st_size != meta["taps_bytes"] or \
                _sha256(taps_path) != meta["taps_sha256"]:
            log(f"eval: the cached held-out set {d} does not verify (taps.pt changed or cut): rebuilding it")
            return None
        meta["taps"] = torch.load(taps_path, map_location="cpu", weights_only=True)
        return meta
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        log(f"eval: the cached held-out set {d} is unreadable ({type(exc).__name__}: {exc}): rebuilding it")
        return None


def continuations(target: Target, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[Tensor]]:
    """The held-out set's content, made with the (training) target: its greedy continuations, then one forward per
    sequence for the taps, as `dflash eval --method teacher-forced` runs it. Decoding runs on sdpa (transformers'
    cached decoding needs its own masks); the target goes back to its training attention afterwards."""
    from dflash.measure import greedy_sequences
    from dflash.target import decoding_attention

    with decoding_attention(target.model):
        seqs = greedy_sequences(target.model, target.device, prompts, new_tokens)
        taps: list[Tensor] = []
        for seq in seqs:
            ids = torch.tensor([seq], dtype=torch.long)
            with torch.no_grad():
                taps.append(target.hidden_states(ids, torch.ones_like(ids))[0].to("cpu").clone())
    if target.device.type == "cuda":
        torch.cuda.empty_cache()  # the decoding's KV cache: the drafter is built next and sizes itself on what is free
    return seqs, taps


class Remote:
    """A split run's two ends of the held-out set: drafter rank 0 holds no target, so it sends its prompts to target
    rank 0, which makes the set with its training target and sends it back. Drafter rank 0 always sends exactly one
    request (None when its cache had the set or evaluation is off) and target rank 0 always answers one."""

    def __init__(self, peer: int, device: torch.device, width: int, dtype: torch.dtype) -> None:
        self.peer, self.device, self.width, self.dtype = peer, device, width, dtype
        self.sent = False

    def __call__(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[Tensor]]:
        from dflash.pipeline import recv_object, send_object

        self.sent = True
        send_object({"prompts": prompts, "new_tokens": new_tokens}, self.peer, self.device)
        seqs: list[list[int]] = recv_object(self.peer, self.device)
        return seqs, [self._recv(len(s)) for s in seqs]

    def done(self) -> None:
        """Nothing more to ask (the cache had the set, or there was no prompt): target rank 0 stops waiting."""
        from dflash.pipeline import send_object

        if not self.sent:
            self.sent = True
            send_object(None, self.peer, self.device)

    def _recv(self, n: int) -> Tensor:
        import torch.distributed as dist

        from dflash.pipeline import comm_device

        buf = torch.zeros(n, self.width, dtype=self.dtype, device=comm_device(self.device))
        dist.recv(buf, self.peer)
        return buf.to("cpu")

    @staticmethod
    def serve(target: Target, peer: int, device: torch.device) -> bool:
        """Target rank 0: answer drafter rank 0's one request; True when a set was made."""
        import torch.distributed as dist

        from dflash.pipeline import comm_device, recv_object, send_object

        req = recv_object(peer, device)
        if req is None:
            return False
        seqs, taps = continuations(target, req["prompts"], int(req["new_tokens"]))
        send_object(seqs, peer, device)
        for t in taps:
            dist.send(t.to(comm_device(device)).contiguous(), peer)
        return True


def build(cfg: RunConfig, tok: TokenizerAdapter, make: Continue, *, block_size: int, total_steps: int,
          n_drafters: int, run_dir: Path, device: torch.device, log: Log = print) -> HeldOutSet:
    """Load the run's held-out set from the cache, or make it with `make` (the training target: `continuations`,
    or `Remote` in a split run) on first use and cache it.

    Raises dflash.measure.EvalError when the corpus has no held-out document."""
    from dflash.data import corpus_fingerprint, read_documents
    from dflash.measure import EvalError
    from dflash.pretrain import as_dict
    from dflash.regen import prompt_rendering
    from dflash.tau import continuation_length, walk

    settings = EvalSettings.of(cfg)
    docs = read_documents(cfg.data)
    prompts: list[list[int]] | None = None
    desc = ""
    if cfg.data.paths:  # held out = never scheduled: finding them tokenizes the corpus and builds its schedule
        basis = {"corpus": corpus_fingerprint(docs), "data": as_dict(cfg.data), "seed": cfg.train.seed,
                 "total_steps": total_steps, "drafters": n_drafters}
        if rendering := prompt_rendering(tok, docs):  # chat prompts as training renders them (tools, thinking)
            basis["rendering"] = rendering
    else:  # the stdlib files after the embedded corpus's cap: cheap to read, and they differ by Python version
        prompts, desc = heldout_prompts(cfg, tok, settings, total_steps, n_drafters, run_dir, docs)
        basis = {"sha256": _prompts_hash(prompts)}
    d = cache_dir_of(cfg) / f"heldout-{_key(cfg, tok, basis, settings, block_size, device)}"
    meta = _load(d, log)
    if meta is None:
        if prompts is None:
            prompts, desc = heldout_prompts(cfg, tok, settings, total_steps, n_drafters, run_dir, docs)
        if not prompts:
            raise EvalError(f"no held-out prompt of more than {settings.prompt_tokens} tokens ({desc})")
        t0 = time.perf_counter()
        log(f"eval: making the held-out set ({len(prompts)} prompts, {settings.new_tokens} new tokens each, "
            f"{desc}) with the training target; cached as {d}")
        seqs, taps = make(prompts, continuation_length(settings.new_tokens, block_size))
        tmp = d.parent / f".{d.name}.tmp{os.getpid()}"
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(taps, tmp / "taps.pt")
        meta = {"format": FORMAT, "sequences": seqs, "prompt_lens": [len(p) for p in prompts],
                "settings": dataclasses.asdict(settings), "block_size": block_size, "source": desc,
                "taps_bytes": (tmp / "taps.pt").stat().st_size, "taps_sha256": _sha256(tmp / "taps.pt"),
                "seconds": round(time.perf_counter() - t0, 2)}
        (tmp / "heldout.json").write_text(json.dumps(meta) + "\n")
        if d.exists():  # a corrupt entry (verified above): ours replaces it
            shutil.rmtree(d)
        try:
            os.replace(tmp, d)
        except OSError:  # another run cached the same set meanwhile: theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"eval: held-out set made in {meta['seconds']:.1f} s")
        meta["taps"] = taps
    hs = HeldOutSet(sequences=meta["sequences"], prompt_lens=meta["prompt_lens"], new_tokens=settings.new_tokens,
                    block_size=block_size, stop_ids=[int(tok.eos_id)], taps=meta["taps"], path=d,
                    source=meta["source"])
    b = block_size
    hs.ngram = [walk(s, p, lambda a, s=s: NgramProposer().propose(s[:a + 1], b - 1), hs.new_tokens, b, hs.stop_ids)
                for s, p in zip(hs.sequences, hs.prompt_lens, strict=True)]
    return hs


def evaluate(drafter: DFlashDrafter, embed_tokens: nn.Embedding, lm_head: nn.Module, hs: HeldOutSet,
             device: torch.device) -> dict[str, Any]:
    """The `eval` event's measurements (docs/events.md) of `drafter` on the held-out set: a drafter pass at every
    anchor of every sequence, then the decode loop's walk."""
    from dflash.measure import acceptance_stats, tau_interval
    from dflash.tau import teacher_forced

    t0 = time.perf_counter()
    was_training = drafter.training
    drafter.eval()
    try:
        gens, _, _ = teacher_forced(drafter, embed_tokens, lm_head, hs.sequences, hs.prompt_lens,
                                    lambda i: hs.taps[i].to(device, non_blocking=True), hs.new_tokens, hs.stop_ids)
    finally:
        drafter.train(was_training)
    stats = acceptance_stats(gens, hs.block_size)
    ci = tau_interval([gens])[0]
    return {"tau": stats["tau"], "accept_by_position": stats["accept_by_position"],
            "accept_hist": stats["accept_hist"], "ngram_tau": hs.ngram_tau, "block_size": hs.block_size,
            "sequences": len(gens), "tokens": sum(len(g.tokens) for g in gens),
            "seconds": round(time.perf_counter() - t0, 3), "tau_ci95": list(ci) if ci is not None else None}


__all__ = ["Continue", "EvalSettings", "HeldOutSet", "Remote", "build", "cache_dir_of", "continuations", "evaluate",
           "heldout_prompts"]
