"""Greedy speculative decoding against a frozen Hugging Face causal LM: DFlash block drafts or prompt-lookup drafts.

One target forward verifies each drafted block; attention caches are cropped and Gated DeltaNet states rolled back.

The target is a plain `transformers` CausalLM plus the list of tapped layers (whatever builds it), so the same code
serves the hybrid `qwen3_5` family and full-attention families. Taps follow Hugging Face's `hidden_states[id + 1]`
(index 0 is the embedding output, the last entry is after the final norm), which is what exported drafters are read
with by every consumer.

Rollback of a partly rejected block: attention layers drop the rejected positions from their KV cache (`crop`). A
linear-attention layer's recurrent state is a running sum that cannot be cropped, so its conv and recurrent states are
snapshotted before the verify forward; after a partial acceptance they are restored and re-advanced over the accepted
tokens only. Re-advancing runs just the linear-attention token mixers, on the inputs they received in the verify
forward (captured by hooks; the target is causal, so those inputs are exact for accepted positions), not the whole
model: no MLP, no attention, no LM head. Models whose mixers cannot be found re-advance with a full forward.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.model import DFlashDrafter, MaskRule, dense_mask, rope_cos_sin


class LosslessError(RuntimeError):
    """Speculative output differs from the target's own greedy decoding (names the first differing position)."""


# ----------------------------------------------------------------------------- the target


@dataclass
class _Snapshot:
    attn_len: int
    linear: list[tuple[int, dict[int, Tensor], dict[int, Tensor]]]  # (layer index, conv states, recurrent states)


class TargetLM:
    """A frozen HF causal LM with tapped layers: cached forwards that return logits and taps, and cache rollback."""

    def __init__(self, model: nn.Module, tap_layers: Sequence[int]) -> None:
        from dflash.target import use_sdpa_for_decoding

        use_sdpa_for_decoding(model)
        self.model = model
        self.tap_layers = [int(t) for t in tap_layers]
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = cfg
        self.num_layers = int(cfg.num_hidden_layers)
        for t in self.tap_layers:
            if not 0 <= t < self.num_layers:
                raise ValueError(f"tap layer {t} is outside 0..{self.num_layers - 1}")
        params = inspect.signature(model.forward).parameters
        # transformers 5.x renamed past_key_values to cache; take whichever this model's forward accepts.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.forwards = 0  # full target forward passes run (prefill, verify, and full-forward re-advances)
        self.mixer_readvances = 0  # rollbacks re-advanced through the linear-attention mixers alone
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        layers = getattr(decoder, "layers", [])
        # The Gated DeltaNet token mixer of each linear-attention layer (qwen3_5: `layer.linear_attn`, whose
        # `layer_idx` addresses its cache layer). Empty for full-attention targets.
        self.mixers: dict[int, nn.Module] = {i: layer.linear_attn for i, layer in enumerate(layers)
                                             if hasattr(layer, "linear_attn")}
        self.readvance = "mixers" if self.mixers else "forward"

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def forward(self, ids: Sequence[int] | Tensor, start: int, cache: Any | None, keep: int,
                taps: bool = True) -> tuple[Tensor, Tensor | None]:
        """Feed `ids` at absolute positions start.. (the cache, when given, holds exactly positions 0..start-1).

        Returns the logits of the last `keep` positions [keep, V] (fp32) and the taps of every fed position [T, K*H]
        (None when `taps` is False).
        """
        x = torch.as_tensor(list(ids) if not isinstance(ids, Tensor) else ids, dtype=torch.long,
                            device=self.device).reshape(1, -1)
        t = x.shape[1]
        pos = torch.arange(start, start + t, device=self.device).unsqueeze(0)
        kwargs: dict[str, Any] = {"input_ids": x, "position_ids": pos, "logits_to_keep": max(keep, 1)}
        if cache is not None:
            kwargs[self._cache_kw] = cache
            kwargs["use_cache"] = True
        else:
            kwargs["use_cache"] = False
        if taps:
            kwargs["output_hidden_states"] = True
        with torch.no_grad():
            out = self.model(**kwargs)
        self.forwards += 1
        logits = out.logits[0, -keep:].float() if keep > 0 else out.logits[0, :0].float()
        if not taps:
            return logits, None
        hs = out.hidden_states  # L + 1 entries; [id + 1] is the output of decoder layer id (last one after the norm)
        return logits, torch.cat([hs[i + 1][0] for i in self.tap_layers], dim=-1)

    # -- rollback
    def snapshot(self, cache: Any) -> _Snapshot:
        """Everything a partly rejected verify forward overwrites in place: linear-attention states (cloned) and the
        attention cache length (attention layers are cropped back to it)."""
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        linear = []
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                conv = {k: v.clone() for k, v in layer.conv_states.items() if v is not None}
                rec = {k: v.clone() for k, v in layer.recurrent_states.items() if v is not None}
                linear.append((i, conv, rec))
        return _Snapshot(attn_len=self.cache_length(cache), linear=linear)

    @staticmethod
    def has_linear_layers(cache: Any) -> bool:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in cache.layers)

    @staticmethod
    def cache_length(cache: Any) -> int:
        from transformers.cache_utils import DynamicLayer

        lengths = {layer.get_seq_length() for layer in cache.layers if isinstance(layer, DynamicLayer)}
        if len(lengths) > 1:
            raise RuntimeError(f"attention cache layers disagree on their length: {sorted(lengths)}")
        return lengths.pop() if lengths else -1

    def crop_attention(self, cache: Any, length: int) -> None:
        """Cut every attention layer's KV back to positions 0..length-1 (linear-attention layers untouched)."""
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        for layer in cache.layers:
            if isinstance(layer, DynamicSlidingWindowLayer):
                raise NotImplementedError("speculative rollback of sliding-window target layers is not supported")
            if isinstance(layer, DynamicLayer) and layer.is_initialized:
                extra = layer.get_seq_length() - length
                if extra < 0:
                    raise RuntimeError(f"cannot crop an attention cache of {layer.get_seq_length()} to {length}")
                DynamicLayer.crop(layer, -extra)

    def restore(self, cache: Any, snap: _Snapshot, attn_len: int | None = None) -> None:
        """Put the linear-attention states back as they were when `snap` was taken (in place: static addresses are
        kept) and crop the attention layers to `attn_len` positions (default: their length at the snapshot)."""
        self.crop_attention(cache, snap.attn_len if attn_len is None else attn_len)
        for i, conv, rec in snap.linear:
            layer = cache.layers[i]
            for k, v in conv.items():
                layer.conv_states[k].copy_(v)
            for k, v in rec.items():
                layer.recurrent_states[k].copy_(v)


    def capture_mixer_inputs(self) -> tuple[dict[int, tuple[tuple[Any, ...], dict[str, Any]]], list[Any]]:
        """Hooks that record what each linear-attention mixer receives in the next forward: (captured, handles)."""
        captured: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

        def make(i: int) -> Any:
            def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                captured[i] = (args, kwargs)

            return hook

        handles = [m.register_forward_pre_hook(make(i), with_kwargs=True) for i, m in self.mixers.items()]
        return captured, handles

    def readvance_mixers(self, cache: Any, captured: dict[int, tuple[tuple[Any, ...], dict[str, Any]]],
                         count: int) -> None:
        """Advance every restored linear-attention state over the first `count` positions of the captured inputs."""
        if set(captured) != set(self.mixers):
            raise RuntimeError(f"mixer inputs captured for layers {sorted(captured)}, expected {sorted(self.mixers)}")

        def cut(v: Any) -> Any:  # per-position tensors ([batch, T, ...]) keep their first `count` positions
            return v[:, :count] if isinstance(v, Tensor) and v.ndim >= 2 and v.shape[1] == t else v

        with torch.no_grad():
            for i, (args, kwargs) in captured.items():
                hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                t = hs.shape[1]
                args = tuple(cut(a) for a in args)
                kwargs = {k: (cache if v is not None and k in ("cache", "cache_params", "past_key_values") else cut(v))
                          for k, v in kwargs.items()}
                self.mixers[i](*args, **kwargs)
        self.mixer_readvances += 1


# ----------------------------------------------------------------------------- proposers


class Proposer(Protocol):
    """Where draft tokens come from. `start` sees the prompt's taps, `commit` the taps of the newly committed tokens
    (the anchor and the accepted drafts), `propose` returns up to `k` tokens to follow `seq`."""

    name: str

    def start(self, prompt: Sequence[int], taps: Tensor) -> None: ...

    def propose(self, seq: Sequence[int], k: int) -> list[int]: ...

    def commit(self, taps: Tensor) -> None: ...


class DFlashProposer:
    """DFlash block drafting: block = [anchor, mask x (B-1)] at positions a..a+B-1, keys/values from the fused taps of
    every committed position < a (the training mask rule, `dflash.model.dense_mask`, with a single anchor)."""

    name = "dflash"

    def __init__(self, drafter: DFlashDrafter, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        if drafter.cfg.mask_token_id is None:
            raise ValueError("the drafter has no mask_token_id")
        self.drafter = drafter.eval()
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.block_size = drafter.cfg.block_size
        self.ctx: Tensor | None = None  # [n_ctx, H] fused, normalised context features (position-independent)

    def _fuse(self, taps: Tensor) -> Tensor:
        d = self.drafter
        with torch.no_grad():
            return d.hidden_norm(d.fc(taps.to(d.fc.weight.dtype)))

    def start(self, prompt: Sequence[int], taps: Tensor) -> None:
        self.ctx = self._fuse(taps)

    def commit(self, taps: Tensor) -> None:
        assert self.ctx is not None
        self.ctx = torch.cat([self.ctx, self._fuse(taps)], dim=0)

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        return draft_block(self.drafter, self.embed_tokens, self.lm_head, self._ctx(len(seq)), int(seq[-1]))[:k]

    def _ctx(self, n: int) -> Tensor:
        if self.ctx is None or self.ctx.shape[0] != n - 1:
            got = None if self.ctx is None else self.ctx.shape[0]
            raise RuntimeError(f"context covers {got} positions, the anchor is at position {n - 1}")
        return self.ctx

    def propose_sample(self, seq: Sequence[int], k: int, temperature: float,
                       generator: torch.Generator) -> tuple[list[int], Tensor]:
        """Drafts drawn from the drafter's own distribution at `temperature`, and that distribution q [k, V].

        Every block position is drafted in one forward from [anchor, mask, ...], so the draft at position j does not
        depend on the drafts before it: q_j is its distribution given the committed prefix and the earlier drafts, as
        speculative sampling's acceptance rule min(1, p/q) requires."""
        logits = draft_block_logits(self.drafter, self.embed_tokens, self.lm_head, self._ctx(len(seq)),
                                    int(seq[-1]))[:k]
        q = _probs(logits, temperature)
        drafts = torch.multinomial(_on(generator, q), 1, generator=generator).squeeze(-1)
        return [int(t) for t in drafts.tolist()], q


def draft_block(drafter: DFlashDrafter, embed_tokens: nn.Embedding, lm_head: nn.Linear, ctx: Tensor,
                anchor: int) -> list[int]:
    """The drafter's greedy tokens for block positions 1..B-1 after `anchor` at position a = len(ctx)."""
    return [int(t) for t in draft_block_logits(drafter, embed_tokens, lm_head, ctx, anchor).argmax(-1).tolist()]


def draft_block_logits(drafter: DFlashDrafter, embed_tokens: nn.Embedding, lm_head: nn.Linear, ctx: Tensor,
                       anchor: int) -> Tensor:
    """The drafter's logits [B-1, V] for block positions 1..B-1 after `anchor` at position a = len(ctx): greedy
    drafts are their argmax (`draft_block`), sampled ones are drawn from their softmax at a temperature.

    Laid out as in training (`DFlashDrafter.block_states` over a buffer holding positions 0..a): keys are the context
    slots 0..a, then the block; slot a (the anchor's own target state) is never read (`p < a` in the mask rule), so it
    holds zeros here, where that state does not exist yet.
    """
    cfg, b = drafter.cfg, drafter.cfg.block_size
    a = ctx.shape[0]
    dev = ctx.device
    with torch.no_grad():
        block = torch.full((b,), int(cfg.mask_token_id), dtype=torch.long, device=dev)  # type: ignore[arg-type]
        block[0] = anchor
        dtype = drafter.fc.weight.dtype
        x = embed_tokens(block).to(dtype)
        slots = torch.cat([ctx.to(dtype), ctx.new_zeros((1, ctx.shape[1]), dtype=dtype)])
        block_pos = torch.arange(a, a + b, device=dev)
        rope_q = rope_cos_sin(block_pos, drafter.head_dim, cfg.rope_theta, x.dtype)
        rope_kv = rope_cos_sin(torch.cat([torch.arange(a + 1, device=dev), block_pos]), drafter.head_dim,
                               cfg.rope_theta, x.dtype)
        anchors = torch.tensor([a], device=dev)
        docs = torch.zeros(a + 1, dtype=torch.long, device=dev)
        masks: dict[MaskRule, Tensor] = {}
        for layer, r in zip(drafter.layers, drafter.rules, strict=True):  # each layer's window and block rule
            if r not in masks:
                masks[r] = dense_mask(anchors, docs, b, r.window, r.causal, r.from_anchor)  # [B, a + 1 + B]
            x = layer(x, slots, rope_q, rope_kv, _dense_attend(masks[r]))
        x = drafter.norm(x)
        return F.linear(x[1:].to(lm_head.weight.dtype), lm_head.weight, lm_head.bias)


def _dense_attend(mask: Tensor) -> Any:
    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None])[0]

    return attend


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max_ngram down to 1) in everything
    committed so far and propose what followed it. Training-free; strong on repetitive or copy-heavy text."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram

    def start(self, prompt: Sequence[int], taps: Tensor) -> None:
        pass

    def commit(self, taps: Tensor) -> None:
        pass

    def propose(self, seq: Sequence[int], k: int) -> list[int]:
        s = list(seq)
        n_tok = len(s)
        for n in range(min(self.max_ngram, n_tok - 1), 0, -1):
            tail = s[n_tok - n:]
            for start in range(n_tok - n - 1, -1, -1):  # latest match first, never the tail itself
                if s[start:start + n] == tail:
                    return s[start + n:start + n + k]
        return []


# ----------------------------------------------------------------------------- decoding loops


@dataclass
class Generation:
    """One prompt's speculative decoding: the new tokens and, per verify step, what was drafted and accepted."""

    tokens: list[int]
    anchor_pos: list[int] = field(default_factory=list)  # absolute position of each step's anchor
    drafts: list[list[int]] = field(default_factory=list)  # drafted tokens per step
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per step (tau = accepted + 1)
    seconds: float = 0.0
    target_forwards: int = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stop_at(tokens: list[int], stop_ids: set[int]) -> int | None:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return i
    return None


def target_greedy(target: TargetLM, prompt: Sequence[int], max_new_tokens: int,
                  stop_ids: Sequence[int] = ()) -> Generation:
    """The target's own greedy decoding, one token per cached forward: the reference output and the baseline speed."""
    stops = set(stop_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    f0 = target.forwards
    cache = target.new_cache()
    logits, _ = target.forward(prompt, 0, cache, keep=1, taps=False)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens and out[-1] not in stops:
        logits, _ = target.forward([out[-1]], len(prompt) + len(out) - 1, cache, keep=1, taps=False)
        out.append(int(logits[-1].argmax()))
    _sync(target.device)
    return Generation(tokens=out, seconds=time.perf_counter() - t0, target_forwards=target.forwards - f0)


def speculative_generate(target: TargetLM, proposer: Proposer, prompt: Sequence[int], max_new_tokens: int,
                         block_size: int, stop_ids: Sequence[int] = ()) -> Generation:
    """Greedy speculative decoding; the output is the target's greedy output whatever the proposer drafts.

    Per step: the anchor is the last committed token (position n-1), the proposer drafts up to B-1 tokens, one target
    forward over [anchor, drafts] yields the target's token at every block position, the longest matching draft
    prefix (k tokens) plus the target's token after it are committed. The recorded `accepted` is k as verified,
    before the output is cut at `max_new_tokens` or a stop token.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if not prompt:
        raise ValueError("empty prompt")

    def verify(logits: Tensor, drafts: list[int], _q: Tensor | None) -> tuple[int, int]:
        verified = [int(t) for t in logits.argmax(-1).tolist()]  # verified[j]: the target's token after the j-th block position
        k = 0
        while k < len(drafts) and drafts[k] == verified[k]:
            k += 1
        return k, verified[k]

    def draft(seq: list[int]) -> tuple[list[int], Tensor | None]:
        return [int(t) for t in proposer.propose(seq, block_size - 1)][: block_size - 1], None

    return _speculative_loop(target, proposer, prompt, max_new_tokens, stop_ids,
                             first=lambda last: int(last.argmax()), draft=draft, verify=verify)


def _speculative_loop(target: TargetLM, proposer: Proposer, prompt: Sequence[int], max_new_tokens: int,
                      stop_ids: Sequence[int], first: Callable[[Tensor], int],
                      draft: Callable[[list[int]], tuple[list[int], Tensor | None]],
                      verify: Callable[[Tensor, list[int], Tensor | None], tuple[int, int]]) -> Generation:
    """The one verify/commit/rollback loop behind greedy decoding and sampling, so the two cannot drift apart.

    `first` picks the token after the prompt from the prefill's last logits; `draft` proposes up to B-1 tokens (and,
    when sampled, their draft probabilities q); `verify` gives (k drafts accepted, the token committed after them).
    """
    stops = set(stop_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    f0 = target.forwards
    cache = target.new_cache()
    logits, taps = target.forward(prompt, 0, cache, keep=1)
    assert taps is not None
    proposer.start(prompt, taps)
    seq = [int(t) for t in prompt] + [first(logits[-1])]
    gen = Generation(tokens=[seq[-1]])
    linear = TargetLM.has_linear_layers(cache)
    while len(gen.tokens) < max_new_tokens and gen.tokens[-1] not in stops:
        n = len(seq)
        drafts, q = draft(seq)
        feed = [seq[-1], *drafts]
        snap = target.snapshot(cache) if linear and drafts else None
        captured, hooks = target.capture_mixer_inputs() if snap is not None and target.readvance == "mixers" \
            else ({}, [])
        try:
            logits, taps = target.forward(feed, n - 1, cache, keep=len(feed))
        finally:
            for h in hooks:
                h.remove()
        assert taps is not None
        k, nxt = verify(logits, drafts, q)
        gen.anchor_pos.append(n - 1)
        gen.drafts.append(drafts)
        gen.accepted.append(k)
        new = [*drafts[:k], nxt]
        room = max_new_tokens - len(gen.tokens)
        cut = _stop_at(new, stops)
        new = new[: min(room, len(new) if cut is None else cut + 1)]
        gen.tokens += new
        seq += new
        if len(gen.tokens) >= max_new_tokens or gen.tokens[-1] in stops:
            break  # the output is complete: nothing after this step reads the cache or the context
        proposer.commit(taps[: k + 1])  # the anchor and the accepted drafts: positions n-1 .. n-1+k
        if k < len(drafts):
            if snap is not None and target.readvance == "mixers":  # states advanced over rejected tokens
                target.restore(cache, snap, attn_len=n + k)  # attention keeps the accepted positions' KV
                target.readvance_mixers(cache, captured, k + 1)
            elif snap is not None:
                target.restore(cache, snap)
                target.forward(feed[: k + 1], n - 1, cache, keep=0, taps=False)
            else:
                target.crop_attention(cache, n + k)
    _sync(target.device)
    gen.seconds = time.perf_counter() - t0
    gen.target_forwards = target.forwards - f0
    return gen


def first_difference(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter length), or None."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def check_lossless(expected: Sequence[int], got: Sequence[int], what: str) -> None:
    i = first_difference(expected, got)
    if i is not None:
        e = expected[i] if i < len(expected) else "<end>"
        g = got[i] if i < len(got) else "<end>"
        raise LosslessError(f"{what}: output differs from the target's greedy decoding at new token {i} "
                            f"(target {e}, speculative {g})")


# ----------------------------------------------------------------------------- sampling (temperature > 0)
#
# Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al.
# 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"): a draft token x drawn from q is kept
# with probability min(1, p(x)/q(x)), p the target's distribution at that position; at the first rejection the token
# is drawn from norm(max(0, p - q)) instead and the block ends; after a fully accepted block a bonus token is drawn from
# p. Whatever q is, every committed token is distributed exactly as the target's own sampling at temperature T. A
# deterministic drafter (prompt lookup, or DFlash's greedy drafts) has a point mass for q: keep x with probability
# p(x), on rejection draw from p with x's mass removed. Every random draw goes through the caller's torch.Generator, so
# a run is reproducible from its seed on the same device (CPU and CUDA generators give different streams).


class SamplingProposer(Proposer, Protocol):
    """A proposer that can draw its drafts from a distribution it can state (`DFlashProposer`); proposers without
    `propose_sample` (`NgramProposer`) are verified with a point mass on what `propose` returns."""

    def propose_sample(self, seq: Sequence[int], k: int, temperature: float,
                       generator: torch.Generator) -> tuple[list[int], Tensor]: ...


def _probs(logits: Tensor, temperature: float) -> Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def _on(generator: torch.Generator, t: Tensor) -> Tensor:
    """`t` on the generator's device: torch draws with a generator only on that generator's device."""
    return t if t.device == generator.device else t.to(generator.device)


def _draw(probs: Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(_on(generator, probs), 1, generator=generator))


def verify_sampled(p: Tensor, drafts: Sequence[int], q: Tensor | None, generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling's verdict on one block: (k drafts accepted, the token committed after them).

    `p` [m+1, V]: the target's probabilities at the block positions (row j: the token after feed[j], feed = [anchor,
    drafts]); `drafts`: m tokens; `q` [m, V]: the distributions they were drawn from, or None for a point mass on each.
    Consumes m uniforms, then one categorical draw, from `generator` (the same count whatever is accepted)."""
    m = len(drafts)
    p = _on(generator, p)
    k = m
    if m:
        idx = torch.tensor([int(d) for d in drafts], device=p.device)[:, None]
        ratio = p[:m].gather(1, idx).squeeze(1)
        if q is not None:
            q = _on(generator, q.float())
            # q(x) > 0 for a token drawn from q; the floor only guards a caller whose q does not match its drafts.
            ratio = ratio / q[:m].gather(1, idx).squeeze(1).clamp_min(torch.finfo(torch.float32).tiny)
        u = torch.rand(m, generator=generator, device=p.device)
        k = int((u < ratio).to(torch.int64).cumprod(0).sum())  # accepted with probability min(1, ratio), in order
    if k == m:
        return k, _draw(p[m], generator)  # every draft accepted: the bonus token from p
    if q is None:
        residual = p[k].clone()
        residual[int(drafts[k])] = 0.0
    else:
        residual = (p[k] - q[k]).clamp_min(0.0)
    if not float(residual.sum()) > 0.0:  # p == q up to rounding (then rejection had probability ~0): draw from p
        residual = p[k]
    return k, _draw(residual, generator)


def target_sample(target: TargetLM, prompt: Sequence[int], max_new_tokens: int, temperature: float,
                  generator: torch.Generator, stop_ids: Sequence[int] = ()) -> Generation:
    """The target's own sampling at `temperature`, one token per cached forward: the distribution speculative sampling
    must reproduce, and the baseline speed. One categorical draw per token from `generator`."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    stops = set(stop_ids)
    _sync(target.device)
    t0 = time.perf_counter()
    f0 = target.forwards
    cache = target.new_cache()
    logits, _ = target.forward(prompt, 0, cache, keep=1, taps=False)
    out = [_draw(_probs(logits[-1], temperature), generator)]
    while len(out) < max_new_tokens and out[-1] not in stops:
        logits, _ = target.forward([out[-1]], len(prompt) + len(out) - 1, cache, keep=1, taps=False)
        out.append(_draw(_probs(logits[-1], temperature), generator))
    _sync(target.device)
    return Generation(tokens=out, seconds=time.perf_counter() - t0, target_forwards=target.forwards - f0)


def speculative_sample(target: TargetLM, proposer: Proposer, prompt: Sequence[int], max_new_tokens: int,
                       block_size: int, temperature: float, generator: torch.Generator,
                       stop_ids: Sequence[int] = (), draft: str = "sample") -> Generation:
    """Speculative sampling at `temperature` > 0: the output is distributed as the target's own sampling
    (`target_sample`), whatever the proposer drafts; the steps, cache rollback and the recorded `anchor_pos`,
    `drafts`, `accepted` are those of `speculative_generate` (tau = mean accepted + 1).

    `draft`: "sample" draws the drafts from the proposer's distribution where it has one (`propose_sample`: DFlash's
    q = softmax(drafter logits / T)) and verifies with min(1, p/q); "argmax" always uses `propose` (DFlash's greedy
    drafts) with a point-mass q. Prompt lookup is a point mass either way. Which gives the higher tau depends on how
    well the drafter is calibrated: accepted with probability sum(min(p, q)) when sampled, p(argmax q) when greedy.
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if not prompt:
        raise ValueError("empty prompt")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if draft not in ("sample", "argmax"):
        raise ValueError(f"draft must be 'sample' or 'argmax', got {draft!r}")
    sampler = getattr(proposer, "propose_sample", None) if draft == "sample" else None

    def draw_drafts(seq: list[int]) -> tuple[list[int], Tensor | None]:
        if sampler is None:
            return [int(t) for t in proposer.propose(seq, block_size - 1)][: block_size - 1], None
        drafted, q = sampler(seq, block_size - 1, temperature, generator)
        drafts = [int(t) for t in drafted][: block_size - 1]
        return drafts, q[: len(drafts)]

    return _speculative_loop(
        target, proposer, prompt, max_new_tokens, stop_ids,
        first=lambda last: _draw(_probs(last, temperature), generator), draft=draw_drafts,
        verify=lambda logits, drafts, q: verify_sampled(_probs(logits, temperature), drafts, q, generator))


def prompt_generator(device: torch.device | str, seed: int, prompt_index: int) -> torch.Generator:
    """The generator for one prompt of a sampled evaluation: its own stream per (seed, prompt), so a prompt's draws
    do not depend on which prompts ran before it or on the method."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + prompt_index)


def sampled_generations(target: TargetLM, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]],
                        max_new_tokens: int, temperature: float, seed: int = 0, stop_ids: Sequence[int] = (),
                        baseline_ngram: bool = False, draft: str = "sample") -> dict[str, list[Generation]]:
    """What `dflash eval --temperature T` decodes: every prompt sampled by the target alone ("target"), by speculative
    sampling with DFlash drafts ("dflash") and, with `baseline_ngram`, with prompt lookup ("ngram"); one untimed
    warm-up first. Each (prompt, method) gets `prompt_generator(target.device, seed, i)`.

    How eval uses it: `gens = sampled_generations(...)`, then the greedy report's statistics on these lists
    (`acceptance_stats(gens["dflash"], b)` for tau / accept_hist / accept_by_position, `tau_interval`, tokens/s from
    `Generation.seconds`, the same for "ngram" under `baseline`). There is no per-prompt lossless check at T > 0 (two
    correct samplers give different tokens); losslessness in distribution is what tests/test_speculative_sampling.py
    checks, so the report should say `lossless: null` (not checked per prompt) rather than true.
    """
    b = drafter.cfg.block_size
    dev = target.device
    dflash = DFlashProposer(drafter, target.embed_tokens, target.lm_head)
    speculative_sample(target, dflash, prompts[0], min(2 * b, max_new_tokens), b, temperature,
                       prompt_generator(dev, seed, len(prompts)), stop_ids, draft)
    out: dict[str, list[Generation]] = {"target": [], "dflash": []}
    if baseline_ngram:
        out["ngram"] = []
    for i, prompt in enumerate(prompts):
        out["target"].append(target_sample(target, prompt, max_new_tokens, temperature,
                                           prompt_generator(dev, seed, i), stop_ids))
        out["dflash"].append(speculative_sample(target, dflash, prompt, max_new_tokens, b, temperature,
                                                prompt_generator(dev, seed, i), stop_ids, draft))
        if baseline_ngram:
            out["ngram"].append(speculative_sample(target, NgramProposer(), prompt, max_new_tokens, b, temperature,
                                                   prompt_generator(dev, seed, i), stop_ids, draft))
    return out


__all__ = [
    "DFlashProposer",
    "Generation",
    "LosslessError",
    "NgramProposer",
    "Proposer",
    "SamplingProposer",
    "TargetLM",
    "check_lossless",
    "draft_block",
    "draft_block_logits",
    "first_difference",
    "prompt_generator",
    "sampled_generations",
    "speculative_generate",
    "speculative_sample",
    "target_greedy",
    "target_sample",
    "verify_sampled",
]
