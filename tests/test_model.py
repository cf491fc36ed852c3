"""Tests for the DFlash drafter: mask rule, anchors, loss weights, chunked CE, and dense == naive per-block reference.

CPU only; the flex-vs-dense equality on a GPU lives in tests/gpu/test_gpu_checks.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.model import (
    DFlashDrafter,
    DraftBatch,
    DrafterConfig,
    FlexShape,
    MaskRule,
    anchor_candidates,
    copy_function,
    dense_mask,
    flex_kernels,
    flex_mask_mod,
    isolated_compile,
    layer_rules,
    sample_anchors,
)

H = 32
VOCAB = 97  # prime, so no other tensor dimension equals it by accident


def make_batch(
    n: int, doc_lengths: list[int], seed: int = 0, hidden_dim: int = 2 * H, unsupervised: int = 0
) -> DraftBatch:
    """A packed buffer: documents back to back, padding (doc -1) after them; first `unsupervised` tokens of each doc masked."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (n,), generator=g)
    doc = torch.full((n,), -1, dtype=torch.long)
    pos = torch.zeros(n, dtype=torch.long)
    lm = torch.zeros(n, dtype=torch.bool)
    start = 0
    for d, length in enumerate(doc_lengths):
        doc[start : start + length] = d
        pos[start : start + length] = torch.arange(length)
        lm[start + unsupervised : start + length] = True
        start += length
    assert start <= n
    hidden = torch.randn(n, hidden_dim, generator=g)
    return DraftBatch(hidden=hidden, input_ids=ids, loss_mask=lm, position_ids=pos, doc_ids=doc)


def frozen_target_parts(seed: int = 1, dtype: torch.dtype = torch.float32) -> tuple[nn.Embedding, nn.Linear]:
    torch.manual_seed(seed)
    emb = nn.Embedding(VOCAB, H).to(dtype).requires_grad_(False)
    head = nn.Linear(H, VOCAB, bias=False).to(dtype).requires_grad_(False)
    return emb, head


def make_drafter(seed: int = 2, **kw: object) -> DFlashDrafter:
    base: dict[str, object] = dict(
        num_layers=2, num_heads=4, num_kv_heads=2, block_size=4, num_anchors=6, mask_token_id=VOCAB - 1
    )
    base.update(kw)
    torch.manual_seed(seed)
    return DFlashDrafter(DrafterConfig(**base), target_hidden_size=H, num_taps=2)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- mask rule


def test_mask_rule_strict_before_anchor_same_doc_own_block() -> None:
    # N=10: doc 0 = 0..3, doc 1 = 4..6, padding 7..9. Anchors 2 (doc 0) and 5 (doc 1), B=3.
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, -1, -1, -1])
    anchors = torch.tensor([2, 5])
    mask = dense_mask(anchors, doc, block_size=3, window=None)
    assert mask.shape == (6, 10 + 6)
    expected = torch.zeros(6, 16, dtype=torch.bool)
    expected[0:3, [0, 1]] = True  # block 0 sees 0 and 1, NOT 2 (the anchor itself: strict <)
    expected[0:3, 10:13] = True  # and its whole block, bidirectionally
    expected[3:6, [4]] = True  # block 1 sees only position 4: doc 0 is another document
    expected[3:6, 13:16] = True
    assert torch.equal(mask, expected)


def test_mask_rule_sliding_window_and_padding() -> None:
    doc = torch.tensor([0] * 8 + [-1] * 2)
    anchors = torch.tensor([6, 9])  # 9 is a padding position (an unused anchor slot)
    mask = dense_mask(anchors, doc, block_size=2, window=3)
    # window 3 per query position: the anchor row (q=6) reads context 4, 5 (and itself, in the block);
    # the next row (q=7) reads context 5 only (keys 5..7 minus the anchor's own state, which is never context)
    assert mask[0, :10].nonzero().flatten().tolist() == [4, 5]
    assert mask[1, :10].nonzero().flatten().tolist() == [5]
    assert mask[0:2, 10:12].all()
    # a block anchored on padding sees no context at all (padding never matches a document), only its own block
    assert not mask[2:, :10].any()
    assert mask[2:, 12:].all() and not mask[2:, 10:12].any()
    no_window = dense_mask(anchors, doc, block_size=2, window=None)
    assert no_window[0, :10].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert no_window[1, :10].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]


def plain_window_mask(anchors: list[int], doc: list[int], b: int, w: int | None, causal: bool = False,
                      from_anchor: bool = False) -> Tensor:
    """The serving rule written out with loops: query q = a + k sees context p (same document, p < a) and block
    token a + j (same block) only when that key's position lies in [q - w + 1, ...]; the block is bidirectional, or
    with `causal` (a sliding layer under sliding_block_causal) only j <= k. `from_anchor`: speculators' window,
    context p with a - p <= w for every block position, block keys unwindowed."""
    n = len(doc)
    out = torch.zeros(len(anchors) * b, n + len(anchors) * b, dtype=torch.bool)
    for i, a in enumerate(anchors):
        for k in range(b):
            q = a + k
            for p in range(n):
                in_window = w is None or (a - p <= w if from_anchor else q - w + 1 <= p)
                if doc[p] >= 0 and doc[p] == doc[a] and p < a and in_window:
                    out[i * b + k, p] = True
            for j in range(b):
                if (w is None or from_anchor or q - w + 1 <= a + j) and (not causal or j <= k):
                    out[i * b + k, n + i * b + j] = True
    return out


@pytest.mark.parametrize("window", [None, 1, 2, 3, 6])
@pytest.mark.parametrize(("causal", "from_anchor"), [(False, False), (True, False), (False, True), (True, True)])
def test_dense_and_flex_masks_follow_the_window_rule(window: int | None, causal: bool, from_anchor: bool) -> None:
    from torch.nn.attention.flex_attention import create_mask

    batch = make_batch(40, [13, 9, 11], seed=3)
    b = 4
    anchors, _ = sample_anchors(batch, 5, b, torch.Generator().manual_seed(0))
    plain = plain_window_mask(anchors.tolist(), batch.doc_ids.tolist(), b, window, causal, from_anchor)
    dense = dense_mask(anchors, batch.doc_ids, b, window, causal, from_anchor)
    mod = flex_mask_mod(anchors, batch.doc_ids, b, window, causal, from_anchor)
    flex = create_mask(mod, 1, 1, 20, 60, device="cpu")[0, 0]
    assert torch.equal(dense, plain)
    assert torch.equal(flex, plain)
    if window is not None and window < 12 and not from_anchor:  # later rows really see less context than the anchor
        rows = dense[:b, :40].sum(-1)
        assert rows[0] > rows[-1] or rows[0] == 0


# B=4, w=2; doc 0 = positions 0..6, doc 1 = 7..11; anchors 4 (doc 0) and 8 (doc 1, one earlier position in it).
# Per rule: for block offset k, (context positions, block offsets) it reads, for anchor 4 then anchor 8.
_HAND = {
    # per query (engines): query a+k reads p > a+k-2 and block j >= k-1; the block bidirectional
    ("query", False): [[({3}, {0, 1, 2, 3}), (set(), {0, 1, 2, 3}), (set(), {1, 2, 3}), (set(), {2, 3})],
                       [({7}, {0, 1, 2, 3}), (set(), {0, 1, 2, 3}), (set(), {1, 2, 3}), (set(), {2, 3})]],
    # per query, causal block (z-lab / vLLM without is_causal): j in [k-1, k]
    ("query", True): [[({3}, {0}), (set(), {0, 1}), (set(), {1, 2}), (set(), {2, 3})],
                      [({7}, {0}), (set(), {0, 1}), (set(), {1, 2}), (set(), {2, 3})]],
    # from the anchor (speculators, sliding_window_non_causal): context [a-2, a-1] for every k, the whole block
    ("anchor", False): [[({2, 3}, {0, 1, 2, 3})] * 4, [({7}, {0, 1, 2, 3})] * 4],
    # from the anchor, causal (speculators' default): context [a-2, a-1], block j <= k
    ("anchor", True): [[({2, 3}, set(range(k + 1))) for k in range(4)], [({7}, set(range(k + 1))) for k in range(4)]],
}


@pytest.mark.parametrize(("window_from", "causal"), list(_HAND))
def test_each_sliding_rule_on_a_hand_enumerated_case(window_from: str, causal: bool) -> None:
    from torch.nn.attention.flex_attention import create_mask

    doc = torch.tensor([0] * 7 + [1] * 5)
    anchors = torch.tensor([4, 8])
    dense = dense_mask(anchors, doc, 4, 2, causal, window_from == "anchor")
    flex = create_mask(flex_mask_mod(anchors, doc, 4, 2, causal, window_from == "anchor"), 1, 1, 8, 20,
                       device="cpu")[0, 0]
    assert torch.equal(dense, flex)
    for i, rows in enumerate(_HAND[(window_from, causal)]):
        for k, (ctx, blk) in enumerate(rows):
            row = dense[i * 4 + k]
            assert set(row[:12].nonzero().flatten().tolist()) == ctx, (i, k)
            assert {j - i * 4 for j in row[12:].nonzero().flatten().tolist()} == blk, (i, k)
    # without a window (a full-attention layer) the sliding options are never applied to it
    assert layer_rules(DrafterConfig(num_layers=2, layer_sliding_windows=[2, None], sliding_block_causal=causal,
                                     sliding_window_from=window_from), [2, None])[1] == MaskRule(None, False, False)


def test_flex_mask_mod_is_the_dense_mask() -> None:
    from torch.nn.attention.flex_attention import create_mask

    batch = make_batch(40, [13, 9, 11], seed=3)
    anchors, _ = sample_anchors(batch, 5, 4, torch.Generator().manual_seed(0))
    for window in (None, 3):
        dense = dense_mask(anchors, batch.doc_ids, 4, window)
        flex = create_mask(flex_mask_mod(anchors, batch.doc_ids, 4, window), 1, 1, 20, 60, device="cpu")[0, 0]
        assert torch.equal(dense, flex)


def _closure(fn: object) -> dict[str, object]:
    code = fn.__code__  # type: ignore[attr-defined]
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__, strict=True)}  # type: ignore[attr-defined]


def test_flex_mask_closure_holds_only_config_sized_tensors() -> None:
    """What dynamo guards on in the mask_mod: tensors sized by the config (A anchors, N positions), the window as a
    0-d tensor, ints fixed by the config. Two windows give closures that differ only in tensor values, so the layers
    of a 4 sliding + 1 full drafter share one compiled graph."""
    batch = make_batch(40, [13, 9, 11], seed=3)
    anchors, _ = sample_anchors(batch, 5, 4, torch.Generator().manual_seed(0))
    closures = [_closure(flex_mask_mod(anchors, batch.doc_ids, 4, w, causal))
                for w, causal in ((None, False), (3, False), (2048, True))]
    for c in closures:
        sizes = {k: tuple(v.shape) for k, v in c.items() if isinstance(v, Tensor)}
        assert sizes == {"anchors": (5,), "doc_ids": (40,), "window_t": (), "causal_t": (), "anchor_t": ()}
        ints = {k: v for k, v in c.items() if not isinstance(v, Tensor)}
        assert ints == {"n": 40, "block_size": 4}  # config constants only: no per-layer window int or rule bool
    assert [int(c["window_t"]) for c in closures] == [40 + 5 * 4, 3, 2048]  # type: ignore[call-overload]
    assert [bool(c["causal_t"]) for c in closures] == [False, False, True]  # type: ignore[call-overload]


def _flex_drafter(**kw: object) -> DFlashDrafter:
    d = make_drafter(attention="flex", **kw)
    d.flex_compile_backend = "eager"  # dynamo's guards and caches, without code generation on this CPU
    return d.eval()


def test_compiled_flex_over_more_shapes_than_the_recompile_limit_never_falls_back() -> None:
    """One process, more drafter shapes than dynamo's recompile_limit, two windows each: every shape gets its own
    compiled pair, nothing runs eagerly, and flex gives the dense rule's states."""
    from torch._dynamo import config as dynamo_config

    from dflash.kernels import FlexWarningWatch, recompile_limit_hits

    emb, _ = frozen_target_parts()
    limit = 3  # lowered from dynamo's 8 to keep the test short; one shared compiled flex would give up at shape 4
    shapes = [(48, 3), (64, 5), (80, 6), (64, 3), (80, 5)]
    hits = recompile_limit_hits()
    with dynamo_config.patch(recompile_limit=limit), FlexWarningWatch() as watch, torch.no_grad():
        for i, (n, a) in enumerate(shapes):
            flex = _flex_drafter(num_anchors=a, layer_sliding_windows=[5, None])
            dense = make_drafter(attention="dense", num_anchors=a, layer_sliding_windows=[5, None]).eval()
            batch = make_batch(n, [n // 3, n // 2], seed=i)
            anchors, _ = sample_anchors(batch, a, 4, torch.Generator().manual_seed(i))
            got = flex.block_states(batch, emb, anchors)
            want = dense.block_states(batch, emb, anchors)
            assert flex.attention_backend == "flex-compiled"
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert watch.fallbacks == [] and watch.triggered == [] and not watch.flex_fell_back
    assert recompile_limit_hits() == hits
    assert flex_kernels(FlexShape(4 * 6, 80 + 24, 6, 80, "cpu", "eager")) is flex_kernels(
        FlexShape(4 * 6, 80 + 24, 6, 80, "cpu", "eager"))


def test_the_whole_flex_drafter_compiles_as_one_graph() -> None:
    """dflash train compiles the whole drafter step: inside it the flex kernels are traced by that compile (no
    per-shape compiled function is built or looked up there), so the step is one graph, without graph breaks."""
    emb, _ = frozen_target_parts()
    flex = _flex_drafter(layer_sliding_windows=[5, None])
    batch = make_batch(48, [16, 24], seed=0)
    anchors, keep = sample_anchors(batch, 6, 4, torch.Generator().manual_seed(0))
    _, head = frozen_target_parts()
    with torch.no_grad():
        explained = torch._dynamo.explain(flex)(batch, emb, head, anchors=anchors, keep=keep)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("window_from", ["query", "anchor"])
def test_full_and_causal_sliding_layers_share_one_compiled_mask_graph(window_from: str) -> None:
    """A full layer and a causal sliding layer differ only in their 0-d window, causal and window-rule tensors: with
    dynamo's recompile_limit at 1, building every layer's block mask (and attending) never falls back, also when a
    drafter of the same shape with the other window rule compiled the mask first, and flex gives the dense states."""
    from torch._dynamo import config as dynamo_config

    from dflash.kernels import FlexWarningWatch

    emb, _ = frozen_target_parts()
    kw: dict[str, object] = dict(num_anchors=7, layer_sliding_windows=[5, None, 3], num_layers=3,
                                 sliding_block_causal=True, sliding_window_from=window_from)
    flex = _flex_drafter(**kw)
    dense = make_drafter(attention="dense", **kw).eval()
    assert [r.causal for r in flex.rules] == [True, False, True]
    batch = make_batch(56, [20, 30], seed=4)
    anchors, _ = sample_anchors(batch, 7, 4, torch.Generator().manual_seed(4))
    with dynamo_config.patch(recompile_limit=1), FlexWarningWatch() as watch, torch.no_grad():
        got = flex.block_states(batch, emb, anchors)
    assert watch.fallbacks == [] and not watch.flex_fell_back
    torch.testing.assert_close(got, dense.block_states(batch, emb, anchors), rtol=1e-4, atol=1e-5)


def test_watch_reports_dynamo_falling_back_at_the_recompile_limit() -> None:
    """A real fallback: compiled flex_attention with recompile_limit 1 sees a second shape, dynamo gives up and runs
    it eagerly; the watch names the function from dynamo's own counters and warning log."""
    from torch._dynamo import config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    from dflash.kernels import FlexWarningWatch, recompile_limit_hits

    fn = isolated_compile(flex_attention, backend="eager", dynamic=False)
    hits = recompile_limit_hits()
    with dynamo_config.patch(recompile_limit=1), FlexWarningWatch() as watch:
        for m in (16, 32):
            q = torch.randn(1, 2, m, 8)
            fn(q, q, q)
    assert recompile_limit_hits() == hits + 1
    assert len(watch.fallbacks) == 1 and "flex_attention" in watch.fallbacks[0], watch.fallbacks
    assert "recompile_limit" in watch.fallbacks[0] and watch.flex_fell_back


def test_copied_functions_have_their_own_recompile_budget() -> None:
    """The isolation older torch gets from copy_function: each copy compiles its shape once; only reusing one copy
    for a second shape (recompile_limit 1) falls back."""
    from torch._dynamo import config as dynamo_config

    from dflash.kernels import FlexWarningWatch

    def scaled(x: Tensor, k: int = 2) -> Tensor:
        return x * k + 1

    copy = copy_function(scaled)
    assert copy.__code__ is not scaled.__code__ and copy(torch.ones(2)).tolist() == [3.0, 3.0]
    with dynamo_config.patch(recompile_limit=1), FlexWarningWatch() as watch:
        for n in (3, 5, 7):
            torch.compile(copy_function(scaled), backend="eager", dynamic=False)(torch.ones(n))
    assert watch.fallbacks == []
    with dynamo_config.patch(recompile_limit=1), FlexWarningWatch() as watch:
        shared = torch.compile(copy_function(scaled), backend="eager", dynamic=False)
        for n in (3, 5):
            shared(torch.ones(n))
    assert len(watch.fallbacks) == 1 and "scaled" in watch.fallbacks[0]


# ----------------------------------------------------------------------------- anchors


def test_anchors_respect_loss_mask_docs_and_fixed_count() -> None:
    batch = make_batch(64, [20, 15, 18], seed=4, unsupervised=5)
    valid = anchor_candidates(batch)
    for seed in range(5):
        anchors, keep = sample_anchors(batch, 12, 4, torch.Generator().manual_seed(seed))
        assert anchors.shape == (12,) and keep.shape == (12,) and keep.dtype == torch.bool
        assert keep.all()  # 28 valid positions >= 12
        a = anchors[keep]
        assert len(set(a.tolist())) == len(a)
        assert batch.loss_mask[a].all() and batch.loss_mask[a + 1].all()
        assert torch.equal(batch.doc_ids[a], batch.doc_ids[a + 1]) and (batch.doc_ids[a] >= 0).all()
        assert torch.equal(anchors, torch.sort(anchors).values)
    # the candidate rule itself: last token of a doc can't anchor (next token is another doc), first 5 of each can't
    assert valid.sum().item() == (20 - 5 - 1) + (15 - 5 - 1) + (18 - 5 - 1)
    a1, _ = sample_anchors(batch, 12, 4, torch.Generator().manual_seed(1))
    a2, _ = sample_anchors(batch, 12, 4, torch.Generator().manual_seed(1))
    a3, _ = sample_anchors(batch, 12, 4, torch.Generator().manual_seed(2))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)


def test_anchors_with_fewer_valid_positions_pad_with_keep_false() -> None:
    batch = make_batch(32, [6], seed=5)  # 5 valid anchor positions (0..4), the rest padding
    anchors, keep = sample_anchors(batch, 8, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (8,)
    assert keep.sum().item() == 5
    assert sorted(anchors[keep].tolist()) == [0, 1, 2, 3, 4]
    assert not anchor_candidates(batch)[anchors[~keep]].any()
    with pytest.raises(ValueError, match="exceeds the buffer"):
        sample_anchors(batch, 33, 4, None)


# ----------------------------------------------------------------------------- naive reference


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """x: [L, heads, d]; explicit per-pair rotation written independently of the model's table code."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    half = d // 2
    for i in range(half):
        angle = positions.to(x.dtype) * (theta ** (-(2 * i) / d))
        c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        x1, x2 = x[:, :, i], x[:, :, i + half]
        out[:, :, i] = x1 * c - x2 * s
        out[:, :, i + half] = x2 * c + x1 * s
    return out


def naive_drafter_loss(
    d: DFlashDrafter, batch: DraftBatch, emb: nn.Embedding, head: nn.Linear, anchors: Tensor, keep: Tensor
) -> tuple[Tensor, list[float]]:
    """One block at a time, Python loops over allowed keys, explicit softmax attention: the spec, written plainly."""
    cfg = d.cfg
    b, n = cfg.block_size, batch.input_ids.shape[0]
    ctx = _rms(batch.hidden.to(d.fc.weight.dtype) @ d.fc.weight.T, d.hidden_norm.weight, cfg.rms_norm_eps)
    total, wsum = 0.0, 0.0
    correct = [0.0] * (b - 1)
    count = [0.0] * (b - 1)
    for j in range(anchors.shape[0]):
        a = int(anchors[j])
        allowed = [
            p for p in range(n) if batch.doc_ids[p] == batch.doc_ids[a] and batch.doc_ids[p] >= 0 and p < a
        ]
        # per query position window: query a + kq reads keys at positions >= a + kq - w + 1; from the anchor: context
        # [a - w, a - 1], the block unwindowed; causal (sliding layers only): block key a + j only if j <= kq
        win = cfg.sliding_window
        key_at = allowed + [a + j for j in range(b)]

        def seen(kq: int, key: int, win: int | None = win, a: int = a) -> bool:
            if win is None:
                return True
            if cfg.sliding_block_causal and key >= a and key - a > kq:
                return False
            if cfg.sliding_window_from == "anchor":
                return key >= a or a - key <= win
            return a + kq - win + 1 <= key

        bias = torch.tensor([[0.0 if seen(kq, key) else -math.inf for key in key_at] for kq in range(b)],
                            dtype=ctx.dtype)
        ids = torch.tensor([int(batch.input_ids[a])] + [cfg.mask_token_id] * (b - 1))
        x = emb(ids).to(ctx.dtype)
        bpos = batch.position_ids[a] + torch.arange(b)
        cpos = batch.position_ids[allowed] if allowed else torch.zeros(0, dtype=torch.long)
        for layer in d.layers:
            at = layer.self_attn
            hd, nh, nkv = at.head_dim, at.num_heads, at.num_kv_heads
            xn = _rms(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
            kv_in = torch.cat([ctx[allowed], xn]) if allowed else xn
            kv_pos = torch.cat([cpos, bpos])
            q = _rms((xn @ at.q_proj.weight.T).view(b, nh, hd), at.q_norm.weight, cfg.rms_norm_eps)
            k = _rms((kv_in @ at.k_proj.weight.T).view(-1, nkv, hd), at.k_norm.weight, cfg.rms_norm_eps)
            v = (kv_in @ at.v_proj.weight.T).view(-1, nkv, hd)
            q, k = _rope(q, bpos, cfg.rope_theta), _rope(k, kv_pos, cfg.rope_theta)
            heads = []
            for h in range(nh):
                g = h // (nh // nkv)
                scores = q[:, h] @ k[:, g].T / math.sqrt(hd) + bias
                heads.append(torch.softmax(scores, dim=-1) @ v[:, g])
            x = x + torch.cat(heads, dim=-1) @ at.o_proj.weight.T
            xm = _rms(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            mlp = layer.mlp
            x = x + (F.silu(xm @ mlp.gate_proj.weight.T) * (xm @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
        x = _rms(x, d.norm.weight, cfg.rms_norm_eps)
        logits = x @ head.weight.T
        for k_pos in range(1, b):
            t = a + k_pos
            if not keep[j] or t >= n or batch.doc_ids[t] != batch.doc_ids[a] or not batch.loss_mask[t]:
                continue
            w = math.exp(-(k_pos - 1) / cfg.loss_gamma)
            total = total + w * F.cross_entropy(logits[k_pos][None], batch.input_ids[t][None])
            wsum += w
            count[k_pos - 1] += 1
            correct[k_pos - 1] += float(logits[k_pos].argmax() == batch.input_ids[t])
    acc = [c / max(n_, 1) for c, n_ in zip(correct, count, strict=True)]
    return total / wsum, acc


@pytest.mark.parametrize(("window", "causal", "window_from"), [
    (None, False, "query"), (2, False, "query"), (5, False, "query"), (2, True, "query"), (5, True, "anchor"),
    (3, False, "anchor"), (None, True, "anchor"),
])
def test_dense_equals_naive_per_block_loop_forward_and_grads(window: int | None, causal: bool,
                                                             window_from: str) -> None:
    emb, head = frozen_target_parts(dtype=torch.float64)
    d = make_drafter(sliding_window=window, ce_chunk=7, sliding_block_causal=causal,
                     sliding_window_from=window_from).double()
    batch = make_batch(48, [17, 12, 14], seed=6)
    batch.hidden = batch.hidden.double()
    batch.loss_mask[3] = False  # a hole inside a document: its label must get weight 0
    anchors, keep = sample_anchors(batch, 6, 4, torch.Generator().manual_seed(3))
    keep = keep.clone()
    keep[1] = False  # a dropped slot contributes nothing
    out = d(batch, emb, head, anchors=anchors, keep=keep)
    out.loss.backward()
    grads = {k: p.grad.clone() for k, p in d.named_parameters()}
    d.zero_grad()
    ref_loss, ref_acc = naive_drafter_loss(d, batch, emb, head, anchors, keep)
    ref_loss.backward()
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.acc, torch.tensor(ref_acc, dtype=out.acc.dtype), rtol=0, atol=1e-12)
    for k, p in d.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-8, atol=1e-10, msg=lambda m, k=k: f"{k}: {m}")
    assert all(g.abs().sum() > 0 for g in grads.values())


# ----------------------------------------------------------------------------- loss weights and CE chunks


def test_loss_weights_decay_and_position_zero_unsupervised() -> None:
    emb, head = frozen_target_parts()
    gamma, b, a = 3.0, 5, 4
    d = make_drafter(block_size=b, num_anchors=a, loss_gamma=gamma)
    batch = make_batch(40, [40], seed=7)
    anchors = torch.tensor([1, 10, 20, 38])  # the last block runs past the buffer end: only position 1 is in range
    keep = torch.tensor([True, True, False, True])
    out = d(batch, emb, head, anchors=anchors, keep=keep)
    w = [math.exp(-(k - 1) / gamma) for k in range(1, b)]
    assert out.weight_sum.item() == pytest.approx(2 * sum(w) + w[0])
    assert out.num_tokens.item() == 2 * (b - 1) + 1
    pw = d.position_weight()
    assert pw[0].item() == 0.0 and pw[1].item() == 1.0 and pw[4].item() == pytest.approx(w[3])


def test_chunked_ce_equals_unchunked() -> None:
    emb, head = frozen_target_parts()
    batch = make_batch(60, [30, 25], seed=8)
    results = []
    for chunk in (5, 7, 10_000):
        d = make_drafter(ce_chunk=chunk)
        out = d(batch, emb, head, generator=torch.Generator().manual_seed(0))
        out.loss.backward()
        results.append((out.loss.detach(), out.acc, [p.grad.clone() for p in d.parameters()]))
    for loss, acc, grads in results[:2]:
        torch.testing.assert_close(loss, results[2][0], rtol=1e-6, atol=1e-6)
        assert torch.equal(acc, results[2][1])
        for g, g_ref in zip(grads, results[2][2], strict=True):
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)


class _ShapeRecorder(TorchDispatchMode):
    """Record every tensor any aten op produces (forward and backward), to find logits-shaped results."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_no_logits_beyond_one_chunk_exist_or_are_kept_for_backward() -> None:
    emb, head = frozen_target_parts()
    chunk = 6
    d = make_drafter(ce_chunk=chunk, num_anchors=8)  # 8 blocks x 4 = 32 rows -> 6 chunks
    batch = make_batch(50, [50], seed=9)
    saved: list[tuple[int, ...]] = []

    def pack(t: Tensor) -> Tensor:
        if t is not head.weight:
            saved.append(tuple(t.shape))
        return t

    rec = _ShapeRecorder()
    with rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = d(batch, emb, head, generator=torch.Generator().manual_seed(0))
        out.loss.backward()
    # (H, VOCAB) is the head weight's transpose inside linear/mm, not logits
    logits_like = [s for s in rec.shapes if s and s[-1] == VOCAB and s != (H, VOCAB)]
    assert logits_like, "the recorder must see the chunk logits"
    assert max(math.prod(s) for s in logits_like) <= chunk * VOCAB
    # autograd holds no logits between forward and backward: each chunk is recomputed (checkpointed)
    assert not [s for s in saved if VOCAB in s]


# ----------------------------------------------------------------------------- shapes, parameters, options


def test_output_shapes_fixed_by_config_not_data() -> None:
    emb, head = frozen_target_parts()
    d = make_drafter(num_anchors=7, block_size=5)
    outs = [
        d(make_batch(64, layout, seed=s), emb, head, generator=torch.Generator().manual_seed(s))
        for s, layout in enumerate([[64], [10, 20, 30], [5]])
    ]
    for o in outs:
        assert o.loss.shape == () and o.acc.shape == (4,) and o.weight_sum.shape == () and o.num_tokens.shape == ()
        assert torch.isfinite(o.loss)
    assert outs[2].num_tokens.item() <= 4 * 4  # 4 valid anchors in a 5-token doc, at most 4 labels each


def test_embedding_and_head_are_not_drafter_parameters() -> None:
    emb, head = frozen_target_parts()
    d = make_drafter()
    names = set(d.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= names
    assert all(p is not emb.weight and p is not head.weight for p in d.parameters())
    out = d(make_batch(30, [30]), emb, head, generator=torch.Generator().manual_seed(0))
    out.loss.backward()
    assert emb.weight.grad is None and head.weight.grad is None


def test_grad_checkpoint_gives_same_gradients() -> None:
    emb, head = frozen_target_parts()
    batch = make_batch(40, [40], seed=10)
    grads = []
    for gc in (False, True):
        d = make_drafter(grad_checkpoint=gc)
        d.train()
        d(batch, emb, head, generator=torch.Generator().manual_seed(0)).loss.backward()
        grads.append([p.grad for p in d.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(("causal", "window_from"), [(False, "query"), (True, "query"), (True, "anchor")])
def test_flex_eager_on_cpu_matches_dense_forward(causal: bool, window_from: str) -> None:
    emb, head = frozen_target_parts()
    kw: dict[str, object] = dict(layer_sliding_windows=[6, None], sliding_block_causal=causal,
                                 sliding_window_from=window_from)
    d = make_drafter(**kw)
    f = make_drafter(attention="flex-eager", **kw)
    f.load_state_dict(d.state_dict())
    batch = make_batch(40, [18, 20], seed=11)
    with torch.no_grad():
        dense = d(batch, emb, head, generator=torch.Generator().manual_seed(0))
        flex = f(batch, emb, head, generator=torch.Generator().manual_seed(0))
    assert (d.attention_backend, f.attention_backend) == ("dense", "flex-eager")
    torch.testing.assert_close(flex.loss, dense.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flex.acc, dense.acc)


def test_auto_attention_reports_the_backend_the_data_gets() -> None:
    from dflash.model import resolve_attention

    emb, head = frozen_target_parts()
    d = make_drafter(attention="auto")
    d(make_batch(30, [30]), emb, head, generator=torch.Generator().manual_seed(0))
    assert d.attention_backend == "dense"  # CPU buffers: the exact dense rule, whatever GPU the machine has
    assert resolve_attention("auto", torch.device("cuda")) == "flex-compiled"
    assert resolve_attention("flex", torch.device("cpu")) == "flex-compiled"
    assert resolve_attention("dense", torch.device("cuda")) == "dense"


def test_bad_config_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="must equal the target hidden size"):
        DFlashDrafter(DrafterConfig(hidden_size=48), target_hidden_size=H, num_taps=2)
    with pytest.raises(ValueError, match="attention"):
        DFlashDrafter(DrafterConfig(attention="sparse"), target_hidden_size=H, num_taps=2)
    emb, head = frozen_target_parts()
    d = make_drafter(mask_token_id=None)
    with pytest.raises(ValueError, match="mask_token_id"):
        d(make_batch(20, [20]), emb, head)
    d = make_drafter()
    with pytest.raises(ValueError, match="expects 2 taps"):
        d(make_batch(20, [20], hidden_dim=3 * H), emb, head)
    bad = make_batch(20, [20])
    bad.loss_mask = bad.loss_mask.long()
    with pytest.raises(ValueError, match="loss_mask must be bool"):
        d(bad, emb, head)
    bad = make_batch(20, [20])
    bad.doc_ids = bad.doc_ids[:10]
    with pytest.raises(ValueError, match="doc_ids"):
        d(bad, emb, head)


def test_drafter_learns_a_fixed_batch() -> None:
    """A few AdamW steps on one buffer must drive the loss down: gradients reach every layer the right way."""
    emb, head = frozen_target_parts()
    d = make_drafter(num_anchors=8)
    batch = make_batch(64, [64], seed=12)
    anchors, keep = sample_anchors(batch, 8, 4, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = d(batch, emb, head, anchors=anchors, keep=keep).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
