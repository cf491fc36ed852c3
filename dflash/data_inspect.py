"""`dflash data inspect`: what the configured data becomes before a GPU is spent on it (docs/data.md).

Documents, tokens, the length histogram against data.max_len and data.token_budget, the supervised share, what is
dropped and why, how full the fixed token-budget buffers are (the same make_pieces/pack_epoch training uses) and the
first document as training sees it, its supervised tokens marked. It reads and tokenizes the corpus only: no target,
no torch tensors. A training run logs the same lines once at start.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.data import Document, TokenizerAdapter, make_pieces, pack_epoch, token_lists

if TYPE_CHECKING:
    from dflash.config import DataConfig

BAR = 30  # width of the histogram bars
SAMPLE_TOKENS = 96  # tokens of the first document shown


@dataclass
class Summary:
    """Everything `dflash data inspect` prints, as numbers (also its --json output)."""

    documents: int
    kinds: dict[str, int]
    tokens: int
    supervised: int
    max_len: int
    min_len: int
    token_budget: int
    length_bins: list[tuple[str, int]]
    dropped: dict[str, dict[str, int]]
    pieces: int
    piece_tokens: int
    piece_supervised: int
    buffers: int
    fill_mean: float
    fill_min: float
    fill_bins: list[tuple[str, int]]
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def summarize(docs: list[Document], lengths: list[int], supervised: list[int], cfg: DataConfig, seed: int,
              sup_in: Callable[[int, int, int], int]) -> Summary:
    """The summary of a tokenized corpus: counts per document, and epoch 0's buffers as training packs them."""
    max_len, min_len, budget = cfg.max_len, cfg.min_len, cfg.token_budget
    kinds = Counter("token records" if d.ids is not None else "text" if d.text is not None else "chats" for d in docs)
    edges = sorted({max(2, min_len), max(2, max_len // 4), max(2, max_len // 2), max_len + 1, 2 * max_len + 1,
                    budget + 1})
    labels = []
    lo = 0
    for e in edges:
        if e > lo:
            labels.append((lo, e))
            lo = e
    counts = [0] * (len(labels) + 1)
    for n in lengths:
        counts[next((i for i, (a, b) in enumerate(labels) if a <= n < b), len(labels))] += 1
    names = [_range_name(a, b, max_len, budget) for a, b in labels] + [f">{lo - 1} (longer than a buffer)"]
    bins = [(names[i], c) for i, c in enumerate(counts) if c or i < len(labels)]

    pieces = make_pieces(lengths, max_len, min_len)
    dropped: dict[str, dict[str, int]] = {}

    def drop(reason: str, docs_n: int, tokens: int, sup: int) -> None:
        r = dropped.setdefault(reason, {"documents": 0, "tokens": 0, "supervised": 0})
        r["documents"] += docs_n
        r["tokens"] += tokens
        r["supervised"] += sup

    kept_tokens: Counter[int] = Counter()  # doc -> tokens in its pieces
    kept_sup: Counter[int] = Counter()
    for d, st, n in pieces:
        kept_tokens[d] += n
        kept_sup[d] += sup_in(d, st, n)
    for i, n in enumerate(lengths):
        k = kept_tokens.get(i, 0)
        if k == 0:
            drop(f"shorter than data.min_len={min_len} tokens", 1, n, supervised[i])
        elif k < n:
            drop(f"last piece (after the split at data.max_len={max_len}) shorter than data.min_len", 1, n - k,
                 supervised[i] - kept_sup[i])
    no_sup = sum(1 for i, s in enumerate(supervised) if s == 0 and kept_tokens.get(i, 0))
    notes = []
    if no_sup:
        notes.append(f"{no_sup} document(s) have no supervised token (a chat without an assistant turn): packed as "
                     "context, they teach the drafter nothing")
    piece_tokens = sum(p[2] for p in pieces)
    buffers = pack_epoch(pieces, budget, max_len, cfg.num_buckets, seed, 0) if pieces else []
    fills = [sum(p[2] for p in b) / budget for b in buffers]
    fill_counts = Counter(min(9, int(f * 10)) for f in fills)
    fill_bins = [(f"{10 * i:>3}-{10 * i + 10}%", fill_counts.get(i, 0)) for i in range(10) if fill_counts.get(i)]
    return Summary(documents=len(docs), kinds=dict(kinds), tokens=sum(lengths), supervised=sum(supervised),
                   max_len=max_len, min_len=min_len, token_budget=budget, length_bins=bins, dropped=dropped,
                   pieces=len(pieces), piece_tokens=piece_tokens,
                   piece_supervised=sum(kept_sup.values()),
                   buffers=len(buffers), fill_mean=sum(fills) / len(fills) if fills else 0.0,
                   fill_min=min(fills) if fills else 0.0, fill_bins=fill_bins, notes=notes)


def _range_name(a: int, b: int, max_len: int, budget: int) -> str:
    hi = b - 1
    tag = ""
    if hi == max_len:
        tag = " (one piece)"
    elif a > max_len and hi <= budget:
        tag = " (split into max_len pieces)"
    return f"{a}-{hi}{tag}"


def _bar(n: int, top: int) -> str:
    return "#" * (round(BAR * n / top) if top else 0)


def render(s: Summary) -> list[str]:
    """The summary as the lines `dflash data inspect` prints and a training run logs."""
    pct = (lambda a, b: f"{100 * a / b:.1f} %" if b else "-")  # noqa: E731
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(s.kinds.items()))
    out = [f"documents: {s.documents} ({kinds})",
           f"tokens: {s.tokens}, supervised (assistant/target) {s.supervised} = {pct(s.supervised, s.tokens)}",
           f"document length in tokens (data.max_len {s.max_len}, data.token_budget {s.token_budget}):"]
    top = max((c for _, c in s.length_bins), default=0)
    out += [f"  {name:<44} {c:>7}  {_bar(c, top)}" for name, c in s.length_bins]
    if s.dropped:
        out.append("dropped:")
        for reason, r in s.dropped.items():
            docs = f"{r['documents']} document(s), " if "shorter than data.min_len=" in reason else ""
            out.append(f"  {reason}: {docs}{r['tokens']} tokens ({r['supervised']} supervised)")
    else:
        out.append("dropped: nothing")
    out.append(f"pieces: {s.pieces} ({s.piece_tokens} tokens, {pct(s.piece_supervised, s.piece_tokens)} supervised)")
    out.append(f"buffers (epoch 0, {s.token_budget} tokens each): {s.buffers}, filled {100 * s.fill_mean:.1f} % on "
               f"average (lowest {100 * s.fill_min:.1f} %)")
    top = max((c for _, c in s.fill_bins), default=0)
    out += [f"  {name:<8} {c:>7}  {_bar(c, top)}" for name, c in s.fill_bins]
    out += [f"note: {n}" for n in s.notes]
    return out


def render_sample(ids: list[int], mask: list[bool], tok: TokenizerAdapter, color: bool,
                  limit: int = SAMPLE_TOKENS) -> str:
    """The first tokens of a document decoded, supervised runs shown in green (a TTY) or between [[ and ]]."""
    parts = []
    i = 0
    ids, mask = ids[:limit], mask[:limit]
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        text = tok.decode(ids[i:j])
        if mask[i]:
            parts.append(f"\033[1;32m{text}\033[0m" if color else f"[[{text}]]")
        else:
            parts.append(text)
        i = j
    return "".join(parts)


def sample_header(limit: int, n: int, color: bool) -> str:
    how = "supervised tokens in green" if color else "supervised tokens between [[ and ]]"
    return f"first document ({min(limit, n)} of its {n} tokens; {how}):"


# ---------------------------------------------------------------------------------------------- the verb
def _tokenizer_cache(cfg: DataConfig, docs: list[Document], config_path: str | None) -> Path:
    """Where the tiny BPE is found or kept: data.tokenizer_cache, else the default run directory's (runs/<config
    name>/tokenizer) or the shared cache (pretrain's) when it already holds this corpus's BPE, else the shared cache."""
    from dflash.cache_entry import cache_home
    from dflash.data import tiny_tokenizer_name

    if cfg.tokenizer_cache:
        return Path(cfg.tokenizer_cache)
    shared = cache_home() / "tokenizer"
    name = tiny_tokenizer_name(cfg, docs)
    for cand in ([Path("runs") / Path(config_path).stem / "tokenizer"] if config_path else []) + [shared]:
        if (cand / name).is_file():
            return cand
    return shared


def inspect(cfg: DataConfig, seed: int, config_path: str | None = None, as_json: bool = False,
            notes: list[str] | None = None) -> int:
    """Read, tokenize and summarize; print. DataError propagates (the CLI prints its one line)."""
    from dflash.data import bpe_to_train, load_tokenizer, read_documents

    data_notes: list[str] = []
    docs = read_documents(cfg, data_notes)
    cache = _tokenizer_cache(cfg, docs, config_path)
    bpe = bpe_to_train(cfg, docs, cache)
    if bpe is not None:  # minutes on a large corpus, and a file in a shared directory: said before it starts
        print(f"dflash data inspect: no data.tokenizer: training a tiny BPE ({cfg.vocab_size} tokens) on this corpus "
              f"into {bpe} (data.tokenizer or --tokenizer names a real one)", file=sys.stderr, flush=True)
    tok = load_tokenizer(cfg, docs, cache)
    lengths: list[int] = []
    sup: list[int] = []
    masks: list[list[bool]] = []
    first: tuple[list[int], list[bool]] | None = None
    for ids, mask in token_lists(docs, tok):
        lengths.append(len(ids))
        sup.append(sum(mask))
        masks.append(list(mask))
        if first is None:
            first = (list(ids), list(mask))
    s = summarize(docs, lengths, sup, cfg, seed, lambda d, st, n: sum(masks[d][st:st + n]))
    s.notes = [*(notes or []), *data_notes, *s.notes]
    # every document dropped: a run would fail minutes later (after loading its target), so say it now, and exit 1
    rc = 0 if s.pieces else 1
    if as_json:
        d = s.as_dict()
        d["tokenizer"] = tok.source
        print(json.dumps(d))
        return rc
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    print(f"data: {', '.join(cfg.paths) if cfg.paths else 'the embedded corpus (Python stdlib sources)'}; "
          f"tokenizer {tok.source}")
    for line in render(s):
        print(line)
    if first is not None:
        print(sample_header(SAMPLE_TOKENS, len(first[0]), color))
        print(render_sample(first[0], first[1], tok, color))
    if rc:
        print("dflash data inspect: nothing to train on: every document was dropped (see `dropped` above; e.g. lower "
              "data.min_len, or add data)", file=sys.stderr)
    return rc


def training_summary_lines(docs: list[Document], corpus: Any, tok: TokenizerAdapter, cfg: DataConfig,
                           seed: int) -> list[str]:
    """The inspect summary of a training run's tokenized corpus, for its log at start."""
    lengths = corpus.lengths()
    sup = [int(m.sum()) for m in corpus.loss_mask]
    s = summarize(docs, lengths, sup, cfg, seed, lambda d, st, n: int(corpus.loss_mask[d][st:st + n].sum()))
    lines = ["data: " + line for line in render(s)]
    if lengths:
        ids, mask = corpus.ids[0].tolist(), corpus.loss_mask[0].tolist()
        lines.append("data: " + sample_header(SAMPLE_TOKENS, len(ids), False))
        lines.append("data: " + render_sample(ids, mask, tok, False).replace("\n", "\\n"))
    return lines
