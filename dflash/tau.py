"""Exact serving tau from one teacher-forced pass: what greedy speculative decoding would accept, without decoding.

On a sequence that is the target's own greedy continuation of a prompt, greedy speculative decoding is deterministic,
and every quantity it depends on is a function of that sequence alone:
- the target's token at every position is the sequence's next token (it *is* the greedy continuation), so a verify
  forward accepts exactly the longest draft prefix that equals the sequence there, then commits the next token;
- the DFlash draft at anchor position a reads the target's taps of positions < a and the anchor token: one target
  forward over the whole sequence gives every anchor's taps at once (causal), and one drafter forward at every
  anchor (the training path, `DFlashDrafter.block_states`) gives every possible draft;
- prompt lookup's draft at a reads the committed tokens, i.e. the sequence up to a.
The decode loop's anchor chain (first anchor: the prefill's token, at the prompt length P; next anchor: anchor +
accepted + 1) is then a walk on the host over precomputed drafts. `walk` reproduces `speculative_generate`'s records
(anchors, drafts, accepted counts, output) step for step, so tau, acceptance per position and the histogram are the
decode loop's own (`dflash eval --method decode` checks that on CPU in float32: tests/test_tau.py).

The sequence must extend B-1 tokens past the last token decoding would output: the last verify step of the loop
compares drafts with target tokens beyond `max_new_tokens` (or past a stop token) before the output is cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from dflash.model import DFlashDrafter, DraftBatch
from dflash.speculative import Generation, NgramProposer

# Memory bounds for the drafter pass (elements): the dense [A*B, N + A*B] mask and the [A*(B-1), V] logits chunk.
MASK_ELEMENTS = 2**26
LOGIT_ELEMENTS = 2**26


def continuation_length(max_new_tokens: int, block_size: int) -> int:
    """New tokens a teacher-forced sequence needs so the walk can verify its last step like the decode loop does."""
    return max_new_tokens + block_size - 1


@contextmanager
def dense_attention(drafter: DFlashDrafter) -> Any:
    """The exact dense mask path for one evaluation, whatever the training drafter uses (flex compiled for the
    training shape would compile again for every evaluation shape); the training attributes come back unchanged
    (the same objects, so a compiled training step's guards still hold)."""
    import dataclasses

    cfg, backend = drafter.cfg, drafter.attention_backend
    drafter.cfg = dataclasses.replace(cfg, attention="dense")
    drafter.attention_backend = "dense"
    try:
        yield drafter
    finally:
        drafter.cfg = cfg
        drafter.attention_backend = backend


def drafts_at_anchors(drafter: DFlashDrafter, embed_tokens: nn.Embedding, lm_head: nn.Module, taps: Tensor,
                      seq: Sequence[int], first: int, last: int, logits_out: list[Tensor] | None = None) -> Tensor:
    """[last - first + 1, B-1] long (CPU): the drafter's greedy block at every anchor position first..last of `seq`,
    from the target's taps of the whole sequence [n, K*H] (one forward, causal). Anchors are chunked so the dense
    mask and the logits stay within MASK_ELEMENTS / LOGIT_ELEMENTS. `logits_out`, when given, receives the logits
    (float32, CPU, [anchors, B-1, V] chunks in order) so a caller can tell a numerical tie from a real difference."""
    b = drafter.cfg.block_size
    dev = taps.device
    n = len(seq)
    ids = torch.as_tensor(list(seq), dtype=torch.long, device=dev)
    pos = torch.arange(n, device=dev)
    batch = DraftBatch(hidden=taps, input_ids=ids, loss_mask=pos >= first, position_ids=pos,
                       doc_ids=torch.zeros(n, dtype=torch.long, device=dev))
    vocab = int(lm_head.weight.shape[0])
    # A anchors cost A*B*(n + A*B) mask elements: the largest A within the bound (at least one anchor).
    per = max(1, int(((n * n + 4 * MASK_ELEMENTS) ** 0.5 - n) / (2 * b)))
    rows = max(1, LOGIT_ELEMENTS // ((b - 1) * vocab))  # anchors per LM-head chunk
    out: list[Tensor] = []
    all_anchors = torch.arange(first, last + 1, device=dev)
    weight = lm_head.weight
    with torch.no_grad(), dense_attention(drafter):
        for s in range(0, all_anchors.numel(), per):
            anchors = all_anchors[s:s + per]
            states = drafter.block_states(batch, embed_tokens, anchors).reshape(len(anchors), b, -1)[:, 1:]
            for r in range(0, len(anchors), rows):
                logits = lm_head(states[r:r + rows].to(weight.dtype))
                out.append(logits.argmax(-1).cpu())
                if logits_out is not None:
                    logits_out.append(logits.float().cpu())
    return torch.cat(out) if out else torch.zeros((0, b - 1), dtype=torch.long)


def walk(seq: Sequence[int], prompt_len: int, draft: Callable[[int], Sequence[int]], max_new_tokens: int,
         block_size: int, stop_ids: Sequence[int] = ()) -> Generation:
    """The decode loop's records on a greedy sequence: `speculative_generate`, with the target's verify forward
    replaced by the sequence itself and the proposer by `draft(anchor_position)`."""
    s, p, stops = list(seq), prompt_len, set(stop_ids)
    if len(s) <= p:
        raise ValueError(f"sequence of {len(s)} tokens has no token after its {p}-token prompt")
    gen = Generation(tokens=[s[p]])
    while len(gen.tokens) < max_new_tokens and gen.tokens[-1] not in stops:
        a = p + len(gen.tokens) - 1  # the anchor: the last committed token
        drafts = [int(t) for t in draft(a)][: block_size - 1]
        if a + len(drafts) + 1 >= len(s):
            raise ValueError(f"sequence of {len(s)} tokens is too short to verify a block at anchor {a}: it needs "
                             f"{continuation_length(max_new_tokens, block_size)} tokens after the prompt")
        k = 0
        while k < len(drafts) and drafts[k] == s[a + 1 + k]:
            k += 1
        gen.anchor_pos.append(a)
        gen.drafts.append(drafts)
        gen.accepted.append(k)
        new = s[a + 1:a + k + 2]  # the accepted drafts and the target's token after them
        room = max_new_tokens - len(gen.tokens)
        cut = next((i for i, t in enumerate(new) if t in stops), None)
        gen.tokens += new[: min(room, len(new) if cut is None else cut + 1)]
    return gen


def teacher_forced(drafter: DFlashDrafter, embed_tokens: nn.Embedding, lm_head: nn.Module,
                   sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], taps_of: Callable[[int], Tensor],
                   max_new_tokens: int, stop_ids: Sequence[int] = (), ngram: bool = False
                   ) -> tuple[list[Generation], list[Generation] | None, dict[str, Any]]:
    """(DFlash generations, prompt-lookup generations or None, the training path's accuracy) on greedy sequences.

    `taps_of(i)` gives sequence i's target taps [n_i, K*H] on the drafter's device. The accuracy is what the step
    event's `acc` measures (every anchor on the output) and, at the anchors the walk visited, what serving matches.
    """
    b = drafter.cfg.block_size
    gens: list[Generation] = []
    ng: list[Generation] | None = [] if ngram else None
    proposer = NgramProposer()
    k = torch.arange(1, b)
    sums = {key: torch.zeros(b - 1, dtype=torch.float64) for key in ("all_hit", "all_n", "srv_hit", "srv_n")}
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens, strict=True)):
        seq = [int(t) for t in seq]
        last = p + max_new_tokens - 2  # the furthest anchor decoding can reach (one token short of the output)
        drafts = drafts_at_anchors(drafter, embed_tokens, lm_head, taps_of(i), seq, p, max(p, last)) \
            if last >= p else torch.zeros((0, b - 1), dtype=torch.long)
        rows = drafts.tolist()
        g = walk(seq, p, lambda a, rows=rows, p=p: rows[a - p], max_new_tokens, b, stop_ids)
        gens.append(g)
        if ng is not None:
            ng.append(walk(seq, p, lambda a, seq=seq: proposer.propose(seq[:a + 1], b - 1), max_new_tokens, b,
                           stop_ids))
        # Training-path accuracy on the output (targets inside it), at every anchor and at the walk's anchors.
        end = p + len(g.tokens) - 1  # last output position
        if drafts.shape[0] and end > p:
            anchors = torch.arange(p, end)
            tgt = anchors[:, None] + k[None, :]
            valid = tgt <= end
            ids = torch.tensor(seq)
            hit = (drafts[: len(anchors)] == ids[tgt.clamp(max=end)]) & valid
            srv = torch.zeros(len(anchors), dtype=torch.bool)
            srv[torch.tensor([a - p for a in g.anchor_pos if a < end], dtype=torch.long)] = True
            sums["all_hit"] += hit.sum(0).double()
            sums["all_n"] += valid.sum(0).double()
            sums["srv_hit"] += (hit & srv[:, None]).sum(0).double()
            sums["srv_n"] += (valid & srv[:, None]).sum(0).double()

    def rate(hit: Tensor, cnt: Tensor) -> list[Any]:
        return [round(float(h / c), 4) if c > 0 else None for h, c in zip(hit, cnt, strict=True)]

    acc = {"all": rate(sums["all_hit"], sums["all_n"]), "counts": [int(c) for c in sums["all_n"].tolist()],
           "at_serve_anchors": rate(sums["srv_hit"], sums["srv_n"])}
    return gens, ng, acc


__all__ = ["continuation_length", "dense_attention", "drafts_at_anchors", "teacher_forced", "walk"]
