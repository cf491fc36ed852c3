"""Fixed-shape inputs of the packed target forward (issue 24 item 1, the CUDA-graph prerequisite), on the CPU.

fla, causal-conv1d and PyTorch's flash varlen kernel do not run on a CPU, so the packed-forward test runs through
stand-ins that consume the same arguments the way the kernels do: the delta rule walks `chunk_indices` and reads each
chunk's document bounds from `cu_seqlens` (a chunk past its document's end does nothing, as the kernels' masked loads
and stores do), the conv splits at `seq_idx`, attention walks `cu_seqlens` up to `max_q`; every token no kernel wrote
stays NaN (the kernels' outputs are torch.empty). On the GPU the real kernels are checked by
tests/gpu/test_cuda_graph_target.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dflash.target import (
    FLA_CHUNK,
    PackedGraphs,
    Target,
    TargetConfig,
    chunk_capacity,
    fixed_packed_inputs,
    max_documents,
    packed_indices,
    register_varlen_attention,
    resolve_cuda_graph,
    row_slots,
    slot_buckets,
)

CPU = torch.device("cpu")


def _compositions(total_max: int, lo: int, hi: int) -> list[list[int]]:
    """Every list of document lengths in [lo, hi] whose sum is <= total_max."""
    out: list[list[int]] = [[]]
    frontier: list[list[int]] = [[]]
    while frontier:
        nxt = []
        for c in frontier:
            for n in range(lo, hi + 1):
                if sum(c) + n <= total_max:
                    nxt.append([*c, n])
        out += nxt
        frontier = nxt
    return out


def _row(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 500, (1, sum(lengths)), generator=g)
    return ids, torch.tensor([0, *itertools.accumulate(lengths)])


@pytest.mark.parametrize("budget,lo,hi", [(12, 1, 12), (13, 2, 5), (16, 3, 4), (9, 9, 9), (10, 3, 10)])
def test_max_documents_bounds_every_row_and_is_reached(budget: int, lo: int, hi: int) -> None:
    """Real documents of data.min_len..data.max_len tokens, plus the dummy tail cut into pieces of <= max_len: the
    count never exceeds max_documents, and some row reaches it (the bound is tight)."""
    worst = 0
    for lengths in _compositions(budget, lo, hi):
        tail = budget - sum(lengths)
        docs = len(lengths) + math.ceil(tail / hi)
        worst = max(worst, docs)
        if lengths:
            fixed = fixed_packed_inputs(*_row(lengths), budget, hi, slot_buckets(budget, lo))
            assert fixed.documents == docs and fixed.documents + 1 <= fixed.slots
    assert worst == max_documents(budget, lo), (worst, max_documents(budget, lo))


def test_chunk_capacity_bounds_every_row_of_that_many_documents() -> None:
    """fla's chunk count of any row of d documents fits chunk_capacity(N, d + 1), brute force at a small chunk."""
    n, c = 14, 4
    for lengths in _compositions(n, 1, n):
        if sum(lengths) != n:
            continue
        need = sum(-(-x // c) for x in lengths)
        assert need <= chunk_capacity(n, len(lengths) + 1, chunk=c), lengths
    assert chunk_capacity(16384, 16) == (16384 + 63 * 15) // 64 == 270
    assert chunk_capacity(100, 1000) == 100  # never more chunks than tokens


def test_slot_buckets_double_up_to_the_cap() -> None:
    assert slot_buckets(16384, 64) == [16, 32, 64, 128, 256, 257]
    assert slot_buckets(100, 64) == [3]  # a tiny budget: one bucket, the cap
    assert max_documents(16384, 64) == 256 and max_documents(8, 8) == 1 and max_documents(9, 8) == 2
    with pytest.raises(ValueError, match="min_doc_len"):
        max_documents(16384, 0)


def test_fixed_inputs_never_take_a_shape_from_the_document_count() -> None:
    """Rows of 1..15 documents (with the tail's pieces) all get the shapes of the 16-slot bucket; with a single bucket, every count the budget
    admits gets one set of shapes."""
    n, lo, hi = 256, 8, 64
    shapes = set()
    for docs in range(1, 15):  # 14 documents of 14 tokens + the 60-token tail = 15
        lengths = [min(hi, max(lo, 200 // docs))] * docs
        f = fixed_packed_inputs(*_row(lengths), n, hi, slot_buckets(n, lo))
        shapes.add((f.slots, f.input_ids.shape, f.position_ids.shape, f.seq_idx.shape, f.cu_seqlens.shape,
                    f.chunk_indices.shape, f.max_len))
    assert len(shapes) == 1, shapes
    single = [slot_buckets(n, lo)[-1]]
    shapes = set()
    for docs in (1, 2, 7, 31):
        f = fixed_packed_inputs(*_row([lo] * docs), n, hi, single)
        shapes.add((f.input_ids.shape, f.cu_seqlens.shape, f.chunk_indices.shape, f.max_len))
    assert len(shapes) == 1, shapes


def test_padded_documents_are_empty_and_padding_chunks_point_at_an_empty_slot() -> None:
    lengths = [100, 64, 1, 129, 63]
    ids, cu = _row(lengths)
    n = 600
    f = fixed_packed_inputs(ids, cu, n, 200, slot_buckets(n, 1))
    bounds = [0, 100, 164, 165, 294, 357, 557, 600]  # the 243-token tail cut into 200 + 43
    assert f.cu_seqlens.tolist() == bounds + [n] * (f.slots + 1 - len(bounds)) and f.documents == 7
    assert f.cu_seqlens.dtype == torch.long and f.seq_idx.dtype == torch.int32
    plain = packed_indices(torch.tensor(bounds), n)
    assert torch.equal(f.position_ids, plain.position_ids) and torch.equal(f.seq_idx, plain.seq_idx)
    real = plain.chunk_indices.shape[0]
    assert torch.equal(f.chunk_indices[:real], plain.chunk_indices)
    assert (f.chunk_indices[real:] == torch.tensor([f.slots - 1, 0])).all()
    assert f.cu_seqlens[f.slots - 1] == f.cu_seqlens[f.slots] == n  # that slot is empty
    assert torch.equal(f.input_ids[0, :357], ids[0]) and (f.input_ids[0, 357:] == 0).all()


def test_row_slots_is_the_bucket_the_fixed_inputs_take_for_every_row() -> None:
    """The precapture (dflash/train.py) picks its rows by row_slots; the replay lays them out by
    fixed_packed_inputs: for 3000 random rows (1-80 documents of 1-24 tokens, at most 128 in all) they must agree,
    None where the inputs refuse the row."""
    import random

    n, hi, buckets = 128, 24, slot_buckets(128, 2)
    rng, seen = random.Random(0), set()
    for _ in range(3000):
        top = rng.choice((2, 3, 8, hi))
        lengths = [rng.randint(1, top) for _ in range(rng.randint(1, 80))]
        while sum(lengths) > n:
            lengths.pop()
        got = row_slots(lengths, n, hi, buckets)
        try:
            want: int | None = fixed_packed_inputs(*_row(lengths), n, hi, buckets).slots
        except ValueError:
            want = None
        assert got == want, lengths
        seen.add(got)
    assert seen == {*buckets, None}, (seen, buckets)  # every bucket and the refusal were met


def test_the_precapture_takes_the_first_row_of_each_bucket_no_graph_holds_yet() -> None:
    graphs = PackedGraphs(None, 256, 8, 64, print)  # its target is only used to capture: not here  # type: ignore[arg-type]
    assert graphs.buckets == [16, 32, 33]
    rows = [("a", [64, 64, 64, 64]),  # 4 documents, no tail: 16
            ("b", [8] * 20),           # 20 + the 96-token tail in 2 pieces, + the empty slot: 32
            ("c", [100]),              # longer than data.max_len: runs eagerly, needs no graph
            ("d", [8] * 14),           # 16 again: the first row of a bucket wins
            ("e", []),
            ("f", [1] * 40),           # 40 + 4 tail pieces: more than the cap holds, runs eagerly
            ("g", [8] * 31)]           # 31 + 1 tail piece + the empty slot: the cap, 33
    assert graphs.representatives(iter(rows)) == {16: "a", 32: "b", 33: "g"}
    graphs.graphs[16] = (None, {}, torch.empty(0))  # type: ignore[assignment]  # captured already
    assert graphs.representatives(rows) == {32: "b", 33: "g"}


def test_rows_the_fixed_shapes_cannot_hold_are_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="longer than the fixed-shape limit 64"):
        fixed_packed_inputs(*_row([65]), 128, 64, slot_buckets(128, 8))
    with pytest.raises(ValueError, match="19 documents"):  # 17 one-token documents + a 111-token tail in 2 pieces
        fixed_packed_inputs(*_row([1] * 17), 128, 64, slot_buckets(128, 8))
    with pytest.raises(ValueError, match="longer than the token budget"):
        fixed_packed_inputs(*_row([100, 40]), 128, 128, slot_buckets(128, 8))


def test_cuda_graph_setting_is_a_no_op_on_cpu_for_auto_and_refused_for_on(caplog: pytest.LogCaptureFixture) -> None:
    assert resolve_cuda_graph("auto", CPU, "pad") is False
    assert resolve_cuda_graph("off", torch.device("cuda"), "varlen") is False
    assert resolve_cuda_graph("auto", torch.device("cuda"), "varlen") is True
    assert resolve_cuda_graph("on", torch.device("cuda"), "varlen") is True
    with pytest.raises(ValueError, match="packing is 'pad'"):
        resolve_cuda_graph("on", torch.device("cuda"), "pad")
    with pytest.raises(ValueError, match="one of off, auto, on"):
        resolve_cuda_graph("yes", CPU, "pad")
    t = Target(TargetConfig(cuda_graph="auto"), num_draft_layers=2, device=CPU)
    assert t.enable_cuda_graph(64, 8, 32, log=lambda m: pytest.fail(f"logged on CPU: {m}")) is False
    assert t.graphs is None and not caplog.records
    with pytest.raises(ValueError, match=r"target.cuda_graph=on captures the packed target forward on CUDA; this "
                                         r"target is on cpu"):
        Target(TargetConfig(cuda_graph="on"), num_draft_layers=2, device=CPU)


def test_config_refuses_an_unknown_cuda_graph_value_by_field(tmp_path) -> None:
    from dflash.config import load_config

    base = (__import__("pathlib").Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml").read_text()
    p = tmp_path / "c.yaml"
    p.write_text(base.replace("target:\n", "target:\n  cuda_graph: always\n", 1))
    with pytest.raises(Exception, match=r"target\.cuda_graph.*one of off, auto, on"):
        load_config(p)


# ------------------------------------------------------------------------------------------ the packed forward
def _stand_ins(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Swap the varlen kernels for CPU stand-ins that consume their arguments as the kernels do (module docstring)."""
    from torch.nn.attention import varlen as varlen_mod
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    delta, conv = m.torch_chunk_gated_delta_rule, m.causal_conv1d_fn
    calls = {"delta": 0, "conv": 0, "attn": 0}

    def delta_rule(query, key, value, g, beta, chunk_size=FLA_CHUNK, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_indices=None, **_kw):
        assert cu_seqlens is not None and chunk_indices is not None and query.shape[0] == 1
        cu = cu_seqlens.tolist()
        out = torch.full_like(value, float("nan"))
        seen: dict[int, list[int]] = {}
        for d, c in chunk_indices.tolist():
            if c * chunk_size >= cu[d + 1] - cu[d]:
                continue  # a chunk past its document's end: every load and store of the kernel is masked
            seen.setdefault(d, []).append(c)
        for d, chunks in seen.items():
            bos, eos = cu[d], cu[d + 1]
            assert sorted(chunks) == list(range(-(-(eos - bos) // chunk_size))), (d, chunks)  # each chunk once
            o, _ = delta(query[:, bos:eos], key[:, bos:eos], value[:, bos:eos], g=g[:, bos:eos],
                         beta=beta[:, bos:eos], chunk_size=chunk_size, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            out[:, bos:eos] = o
        calls["delta"] += 1
        return out, None

    def conv1d(hidden_states, weight, bias=None, activation=None, seq_idx=None, **_kw):
        assert seq_idx is not None
        out = torch.full_like(hidden_states, float("nan"))
        ids = seq_idx[0].tolist()
        for _, grp in itertools.groupby(range(len(ids)), key=lambda i: ids[i]):
            span = list(grp)
            s, e = span[0], span[-1] + 1
            out[..., s:e] = conv(hidden_states[..., s:e], weight, bias, activation=activation)
        calls["conv"] += 1
        return out

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False, **_kw):
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k)
        out = torch.full_like(q, float("nan"))
        cu = cu_q.tolist()
        for bos, eos in itertools.pairwise(cu):
            if eos == bos:
                continue  # an empty sequence
            assert eos - bos <= max_q, f"document of {eos - bos} tokens over max_q {max_q}: the kernel skips its tail"
            o = torch.nn.functional.scaled_dot_product_attention(
                q[bos:eos].transpose(0, 1), k[bos:eos].transpose(0, 1), v[bos:eos].transpose(0, 1), is_causal=True,
                scale=scale, enable_gqa=enable_gqa)
            out[bos:eos] = o.transpose(0, 1)
        calls["attn"] += 1
        return out

    monkeypatch.setattr(m, "torch_chunk_gated_delta_rule", delta_rule)
    monkeypatch.setattr(m, "causal_conv1d_fn", conv1d)
    monkeypatch.setattr(varlen_mod, "varlen_attn", varlen_attn)
    return calls


def test_padded_fixed_inputs_give_the_unpadded_packed_forward_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same row through today's packed inputs and through the fixed-shape ones (tail, empty documents, padding
    chunk entries): identical tapped states on every real token, every token written, and both match the row's
    documents run alone (padded rows, the reference path) to bf16 rounding."""
    calls = _stand_ins(monkeypatch)
    target = Target(TargetConfig(seed=3, dtype="bfloat16"), num_draft_layers=2, device=CPU)
    target.packing, target.attention = "varlen", "varlen"  # what a CUDA target with fla gets; here the stand-ins
    target.model.set_attn_implementation(register_varlen_attention())
    lengths = [37, 64, 1, 129, 20, 65]
    ids, cu = _row(lengths, seed=7)
    n = 512
    unpadded = target.hidden_states_packed(ids, cu)[0]
    assert calls["delta"] and calls["conv"] and calls["attn"], calls  # the stand-ins really ran
    fixed = fixed_packed_inputs(ids, cu, n, 160, slot_buckets(n, 1))
    assert fixed.slots == 16 and fixed.documents == len(lengths) + 2  # the 196-token tail: 160 + 36
    padded = target.hidden_states_fixed(fixed)[0]
    assert padded.shape[0] == n and not torch.isnan(padded).any() and not torch.isnan(unpadded).any()
    assert torch.equal(padded[: sum(lengths)], unpadded)
    # a second row with a different document count, same bucket: same shapes, still exact
    ids2, cu2 = _row([150, 5, 5, 90], seed=8)
    f2 = fixed_packed_inputs(ids2, cu2, n, 160, slot_buckets(n, 1))
    assert f2.cu_seqlens.shape == fixed.cu_seqlens.shape and f2.chunk_indices.shape == fixed.chunk_indices.shape
    assert torch.equal(target.hidden_states_fixed(f2)[0, :250], target.hidden_states_packed(ids2, cu2)[0])
    # and the documents alone, right-padded rows through transformers' own path
    ref_mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    ref_ids = torch.zeros_like(ref_mask)
    for i, (a, b) in enumerate(itertools.pairwise(cu.tolist())):
        ref_ids[i, : b - a], ref_mask[i, : b - a] = ids[0, a:b], 1
    monkeypatch.undo()
    plain = Target(TargetConfig(seed=3, dtype="bfloat16"), num_draft_layers=2, device=CPU)
    ref = plain.hidden_states(ref_ids, ref_mask)
    for i, (a, b) in enumerate(itertools.pairwise(cu.tolist())):
        torch.testing.assert_close(padded[a:b].float(), ref[i, : b - a].float(), rtol=3e-2, atol=3e-2)


def test_a_missing_chunk_entry_leaves_tokens_unwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for the stand-in (and the reason chunk_indices must be exact): drop one chunk entry and the
    delta rule's coverage check fails instead of passing silently."""
    _stand_ins(monkeypatch)
    target = Target(TargetConfig(seed=3, dtype="bfloat16"), num_draft_layers=2, device=CPU)
    target.packing, target.attention = "varlen", "varlen"
    target.model.set_attn_implementation(register_varlen_attention())
    ids, cu = _row([130, 20])
    f = fixed_packed_inputs(ids, cu, 256, 128 + 32, slot_buckets(256, 1))
    f.chunk_indices[1] = torch.tensor([f.slots - 1, 0])  # chunk 1 of document 0 replaced by padding
    with pytest.raises(AssertionError):
        target.hidden_states_fixed(f)
