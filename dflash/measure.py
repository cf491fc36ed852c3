"""What both `dflash eval` and training measure a drafter with: tau statistics, held-out prompts, the target's greedy
continuations, and the one error class for input they cannot use (EvalError).

A library, not a verb: dflash/eval.py (the `eval` command), dflash/heldout.py (training's `eval` events) and
dflash/train.py import it; it imports neither. Held-out text is deterministic and never trained on by the run: with
the embedded corpus (Python's stdlib sources, capped at `data.max_chars`) the stdlib files after the cap; with
configured data the documents none of whose pieces is in any buffer the run's schedule feeds to the drafter.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash.config import RunConfig
from dflash.data import Document, TokenizerAdapter
from dflash.speculative import Generation


class EvalError(ValueError):
    """Unusable eval input (checkpoint, drafter dir, prompts, held-out split): one line, exit 2."""


# ----------------------------------------------------------------------------- held-out prompts
def embedded_heldout(max_chars: int, used: Sequence[Document]) -> list[Document]:
    """Stdlib sources after the ones the embedded corpus took (same sorted order; the file the cap cut is skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    last = max(d.source for d in used)
    out = []
    for path in sorted(root.glob("*.py")):
        if str(path) <= last:
            continue  # used, or before the last used file (left out only because it was unreadable or empty)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            out.append(Document(text=text, source=str(path)))
    return out


def scheduled_doc_indices(cfg: RunConfig, tok: TokenizerAdapter, docs: Sequence[Document],
                          pipeline: dict[str, Any] | None, run_dir: Path | None) -> set[int]:
    """Indices of the documents that have at least one piece in a buffer the run feeds its drafter (whole plan)."""
    from dflash.data import load_or_build_schedule, make_pieces, tokenize
    from dflash.pipeline import epochs_needed

    corpus = tokenize(docs, tok)
    pieces = make_pieces(corpus.lengths(), cfg.data.max_len, cfg.data.min_len)
    if pipeline is None:
        return {p[0] for p in pieces}  # plan unknown: every scheduled piece may have been trained on
    n_drafters = max(1, len(pipeline.get("feeds", [])))
    total = int(pipeline["total_steps"])
    first = load_or_build_schedule(corpus, cfg.data, cfg.train.seed, 1, Path("/nonexistent"), write=False)
    epochs = epochs_needed(len(first.epochs[0]), total, n_drafters)
    path = run_dir / "schedule.json" if run_dir is not None else Path("/nonexistent")
    sched = load_or_build_schedule(corpus, cfg.data, cfg.train.seed, epochs, path, write=False)
    need, g, used = total * n_drafters, 0, set()
    for ep in sched.epochs:
        for buf in ep:
            if g >= need:
                return used
            used.update(p[0] for p in buf)
            g += 1
    return used


def heldout_documents_of(cfg: RunConfig, docs: Sequence[Document], tok: TokenizerAdapter,
                         pipeline: dict[str, Any] | None, run_dir: Path | None) -> tuple[list[Document], str]:
    """heldout_documents for a run described by its config, planned length (`pipeline`: total_steps, feeds) and
    directory: what `dflash train` uses for its own eval set, so `dflash eval` on a checkpoint sees the same text."""
    if not cfg.data.paths:
        held = embedded_heldout(cfg.data.max_chars, docs)
        desc = f"stdlib sources after the embedded corpus cap (data.max_chars={cfg.data.max_chars}): {len(held)} files"
    else:
        used = scheduled_doc_indices(cfg, tok, docs, pipeline, run_dir)
        held = [d for i, d in enumerate(docs) if i not in used]
        desc = f"{len(held)} of {len(docs)} documents of data.paths that no buffer of the run's schedule holds"
    if not held:
        raise EvalError("no held-out documents: every document of this run's corpus is in its training schedule; "
                        "pass --prompts FILE")
    return held, desc


def prompts_from_documents(docs: Sequence[Document], tok: TokenizerAdapter, prompt_tokens: int, max_len: int,
                           num: int) -> list[list[int]]:
    """Prompts cut like training pieces: the first `prompt_tokens` tokens of consecutive max_len pieces, one piece of
    each document in turn (so the prompts spread over documents); chats: everything before the first assistant turn,
    rendered as training renders that reply's context (the record's tools, data.thinking's switch) and as `dflash
    regen` renders its prompt. Documents are tokenized only when reached (the held-out stdlib files are many)."""
    pieces: dict[int, list[list[int]]] = {}

    def doc_pieces(i: int) -> list[list[int]]:
        if i not in pieces:
            d = docs[i]
            if d.text is not None:
                ids = tok.encode(d.text)
                pieces[i] = [ids[s:s + prompt_tokens] for s in range(0, len(ids), max_len)
                             if len(ids) - s > prompt_tokens]
            else:
                msgs = d.messages or []
                first = next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), None)
                pieces[i] = [tok.chat_prompt(msgs[:first], d.tools)] if first else []
        return pieces[i]

    out: list[list[int]] = []
    depth = 0
    while len(out) < num:
        took = False
        for i in range(len(docs)):
            p = doc_pieces(i)
            if depth < len(p):
                took = True
                out.append(p[depth])
                if len(out) == num:
                    break
        if not took:
            break
        depth += 1
    return out


# ----------------------------------------------------------------------------- statistics
def acceptance_stats(gens: Sequence[Generation], block_size: int) -> dict[str, Any]:
    """tau and the acceptance histogram / per-position rates over every verify step of every prompt."""
    acc = [a for g in gens for a in g.accepted]
    steps = len(acc)
    hist = [sum(1 for a in acc if a == k) for k in range(block_size)]
    reach = [sum(1 for a in acc if a >= j) for j in range(block_size)]  # reach[0] = steps
    return {
        "tau": round(sum(a + 1 for a in acc) / steps, 4) if steps else None,
        "steps": steps,
        "accept_hist": hist,
        # P(the draft token at block position j was accepted), j = 1..B-1: what tau sums (tau = 1 + sum)
        "accept_by_position": [round(reach[j] / steps, 4) if steps else None for j in range(1, block_size)],
        # P(accepted at j | accepted up to j-1): the per-token acceptance at each position
        "accept_cond_by_position": [round(reach[j] / reach[j - 1], 4) if reach[j - 1] else None
                                    for j in range(1, block_size)],
    }


def tau_interval(methods: Sequence[Sequence[Generation]], resamples: int = 2000, seed: int = 0
                 ) -> list[tuple[float, float] | None]:
    """95 % bootstrap intervals over prompts of each method's pooled tau, plus (last) of the first method's tau over
    the second's, resampled paired (the same prompts for both): how much of a difference between two methods is
    the luck of a few prompts. Pooled tau of a resample = its verify steps' (accepted + 1) summed over its steps, the
    estimator `tau` itself uses. None where a method has no step."""
    n = len(methods[0])
    per = [[(sum(a + 1 for a in g.accepted), len(g.accepted)) for g in gens] for gens in methods]
    rng = random.Random(seed)
    draws: list[list[float]] = [[] for _ in range(len(methods) + 1)]
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        taus = []
        for m, rows in enumerate(per):
            num, den = sum(rows[i][0] for i in idx), sum(rows[i][1] for i in idx)
            taus.append(num / den if den else None)
            if den:
                draws[m].append(num / den)
        if len(methods) > 1 and taus[0] is not None and taus[1]:
            draws[-1].append(taus[0] / taus[1])

    def pct(xs: list[float]) -> tuple[float, float] | None:
        if not xs:
            return None
        xs = sorted(xs)
        return round(xs[int(0.025 * (len(xs) - 1))], 4), round(xs[int(0.975 * (len(xs) - 1))], 4)

    return [pct(d) for d in draws[: len(methods)]] + ([pct(draws[-1])] if len(methods) > 1 else [])


def max_eval_tokens(block_size: int) -> int:
    """The longest sequence (prompt + new tokens + B - 1) a teacher-forced evaluation takes at block size B.

    Why a limit: the drafter pass (dflash/tau.py, drafts_at_anchors) runs dense attention in chunks of A anchors,
    whose mask is A*B x (n + A*B) for an n-token sequence, and picks A so a chunk stays within tau.MASK_ELEMENTS; memory
    is then bounded whatever the length (time grows as B * new tokens * n). Below one anchor per chunk it cannot
    shrink further: one anchor's B x (n + B) block must fit, so n <= MASK_ELEMENTS / B - B (4,194,288 tokens at B=16)."""
    from dflash.tau import MASK_ELEMENTS

    return MASK_ELEMENTS // block_size - block_size


# ----------------------------------------------------------------------------- the target's continuations
def greedy_sequences(model: torch.nn.Module, device: torch.device, prompts: Sequence[Sequence[int]], new_tokens: int,
                     batch_size: int = 64, progress: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """prompt + the target's greedy continuation of `new_tokens` tokens (no stop: the walk decides where the output
    ends), for every prompt. Equally long prompts decode together (no padding, so every row is exactly the target's
    own continuation); a batch is what regen decodes with. `model`: a HF causal LM on sdpa (cached decoding)."""
    from dflash.regen import cuda_rows_cap, generate_batch

    if device.type == "cuda":
        batch_size = min(batch_size, cuda_rows_cap(model.config))
    order = sorted(range(len(prompts)), key=lambda j: (-len(prompts[j]), j))
    out: list[list[int] | None] = [None] * len(prompts)
    i = 0
    while i < len(order):
        group = [order[i]]
        while (i + len(group) < len(order) and len(group) < batch_size
               and len(prompts[order[i + len(group)]]) == len(prompts[group[0]])):
            group.append(order[i + len(group)])
        rows = generate_batch(model, [list(prompts[j]) for j in group], new_tokens, 0.0, [], device)
        for j, (gen, _why) in zip(group, rows, strict=True):
            out[j] = [*prompts[j], *gen]
        i += len(group)
        if progress is not None:  # `progress(prompts, tokens)` after each batch
            progress(len(group), sum(len(out[j] or []) - len(prompts[j]) for j in group))
    return [s for s in out if s is not None]


__all__ = ["EvalError", "acceptance_stats", "embedded_heldout", "greedy_sequences", "heldout_documents_of",
           "max_eval_tokens", "prompts_from_documents", "scheduled_doc_indices", "tau_interval"]
