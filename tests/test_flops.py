"""The FLOPs model (dflash/flops.py) against hand-computed counts for tiny configs and against torch's own
FlopCounterMode on real CPU forwards and backwards.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash.flops import (
    DrafterShape,
    causal_pairs,
    delta_rule_per_token,
    drafter_attention_pairs,
    drafter_step_flops,
    measure_matmul_tflops,
    mfu,
    target_forward_flops,
    target_layer_costs,
)
from dflash.model import DFlashDrafter, DraftBatch, DrafterConfig, dense_mask, sample_anchors
from dflash.target import TargetConfig, build_target_model, target_hf_config


def _meta_target(family: str = "qwen3_5", vocab: int = 512) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(target_hf_config(TargetConfig(family=family), vocab))


def test_target_layer_weights_and_per_token_counts_match_a_hand_count() -> None:
    """TINY_ARCH (hidden 64, inter 128, 4q/2kv x 16, GDN 2k/4v x 16, conv 4), counted by hand:
    GDN layer: in_proj_qkv 128x64 + in_proj_z 64x64 + in_proj_a/b 4x64 each + conv 128x4 + out_proj 64x64 = 17,408,
    full layer: q_proj 128x64 (gated: 2 x 4 x 16 rows) + k, v 32x64 + o 64x64 = 16,384; MLP 3 x 128 x 64 = 24,576."""
    costs = target_layer_costs(_meta_target())
    assert [c.kind for c in costs] == ["linear_attention", "linear_attention", "full_attention"] * 2
    assert costs[0].weights == 17_408 + 24_576 and costs[2].weights == 16_384 + 24_576
    # the delta rule, per value head and token, dk = dv = 16, chunk 64: 6*16*16 + 2*64*(3*16 + 2*16) + 2/3 * 64^2
    assert delta_rule_per_token(16, 16) == pytest.approx(1536 + 10_240 + 2730.6667, rel=1e-6)
    assert costs[0].per_token() == pytest.approx(2 * 41_984 + 4 * (1536 + 10_240 + 2730.6667), rel=1e-6)
    assert costs[2].per_token() == 2 * 40_960 and costs[0].per_pair() == 0
    assert costs[2].per_pair() == 2 * 4 * (16 + 16)  # QK^T and PV, 4 query heads


def test_target_forward_counts_layers_run_real_tokens_and_in_document_pairs() -> None:
    costs = target_layer_costs(_meta_target())
    assert causal_pairs([3, 5]) == 6 + 15
    f = target_forward_flops(costs, [3, 5], layers_run=3)
    per_token = 2 * costs[0].per_token() + costs[2].per_token()
    assert (f.tokens, f.layers_run, f.lm_head) == (8, 3, 0.0)
    assert f.linear == pytest.approx(8 * per_token) and f.attention == 21 * 256
    full = target_forward_flops(costs, [3, 5], layers_run=6, hidden_size=64, vocab_size=512, lm_head=True)
    assert full.lm_head == 2 * 64 * 512 * 8 and full.attention == 2 * 21 * 256
    assert full.total == pytest.approx(full.linear + full.attention + full.lm_head)


def test_target_linear_count_equals_torch_flop_counter_on_a_real_forward() -> None:
    """Independent check on a full-attention (qwen3) target: torch's FlopCounterMode over the decoder's real
    forward counts the same projection FLOPs (mm) as the weights-based model."""
    model = build_target_model(TargetConfig(family="qwen3"), vocab=128).eval()
    costs = target_layer_costs(model)
    ids = torch.randint(0, 128, (1, 10))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.model(input_ids=ids)
    mm = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op) and "bmm" not in str(op))
    assert mm == target_forward_flops(costs, [10], layers_run=len(costs)).linear


def _batch(n: int, lengths: list[int], hidden_dim: int, vocab: int, seed: int) -> DraftBatch:
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((n,), -1, dtype=torch.long)
    pos = torch.zeros(n, dtype=torch.long)
    start = 0
    for d, length in enumerate(lengths):
        doc[start:start + length], pos[start:start + length] = d, torch.arange(length)
        start += length
    return DraftBatch(hidden=torch.randn(n, hidden_dim, generator=g), input_ids=torch.randint(0, vocab - 1, (n,), generator=g),
                      loss_mask=doc >= 0, position_ids=pos, doc_ids=doc)


@pytest.mark.parametrize("window", [None, 1, 3, 6, 40])
@pytest.mark.parametrize(("causal", "from_anchor"), [(False, False), (True, False), (False, True), (True, True)])
def test_drafter_attention_pairs_equal_the_dense_mask_count(window: int | None, causal: bool,
                                                            from_anchor: bool) -> None:
    for seed in range(3):
        batch = _batch(48, [13, 9, 20], 8, 50, seed)
        anchors, _ = sample_anchors(batch, 7, 4, torch.Generator().manual_seed(seed))
        want = int(dense_mask(anchors, batch.doc_ids, 4, window, causal, from_anchor).sum())
        got = drafter_attention_pairs(batch.position_ids[anchors], batch.doc_ids[anchors] >= 0, 4, window, causal,
                                      from_anchor)
        assert got == want


def _shape(pairs: list[int], **kw: object) -> DrafterShape:
    base: dict[str, object] = dict(hidden=8, num_taps=2, num_heads=2, num_kv_heads=1, head_dim=4, intermediate=16,
                                   vocab=10, n_ctx=12, num_anchors=2, block_size=3, pairs=pairs)
    base.update(kw)
    return DrafterShape(**base)  # type: ignore[arg-type]


def test_drafter_step_flops_match_a_hand_count() -> None:
    """H 8, 2 taps, 2q/1kv x 4, inter 16, V 10, N 12, A 2, B 3 (M 6), two layers with 20 and 30 allowed pairs."""
    f = drafter_step_flops(_shape([20, 30]))
    assert f.parts == {
        "fc": 2 * 12 * 16 * 8,  # [N, K*H] @ [K*H, H]
        "q_o_proj": 2 * (2 * 6 * 8 * 8 * 2),  # two layers: q and o, [M, H] x [H, 8]
        "kv_proj": 2 * (2 * 18 * 8 * 4 * 2),  # k and v over N + M = 18 rows, [H, 4]
        "mlp": 2 * (2 * 6 * 8 * 16 * 3),
        "attention": 4 * 8 * (20 + 30),  # QK^T + PV over the allowed pairs, 2 heads x 4
        "lm_head": 2 * 6 * 8 * 10,
    }
    layers = 3072 + 4608 + 9216 + 1600  # q/o, k/v, MLP, attention
    assert f.model == sum(f.parts.values()) + 2 * layers + 3072 + 960  # bwd: layers 2x, fc 1x, lm head 1x
    assert f.hardware == f.model + 0.5 * 1600 + 960  # attention bwd recompute, CE logits recompute
    ck = drafter_step_flops(_shape([20, 30], grad_checkpoint=True))
    assert ck.model == f.model and ck.hardware == f.hardware + layers
    tiles = drafter_step_flops(_shape([20, 30], flex_hw_pairs=[36, 36]))
    assert tiles.model == f.model and tiles.hardware == pytest.approx(f.model + 3 * 32 * 22 + 0.5 * 32 * 72 + 960)


def test_drafter_hardware_count_equals_torch_flop_counter_on_a_dense_step() -> None:
    """Independent check of every matmul but attention: torch's FlopCounterMode over the dense CPU drafter's forward
    and backward counts exactly the model's projections, fc, LM head (forward, and input gradient) and the CE logits
    recomputed in backward. (It does not count SDPA's CPU math path; the attention pairs are checked against the
    dense mask above.)"""
    h, vocab, n, a, b = 16, 40, 32, 3, 4
    cfg = DrafterConfig(num_layers=2, num_heads=4, num_kv_heads=2, block_size=b, num_anchors=a,
                        mask_token_id=vocab - 1, intermediate_size=24, attention="dense", ce_chunk=5)
    torch.manual_seed(0)
    d = DFlashDrafter(cfg, target_hidden_size=h, num_taps=2)
    emb = torch.nn.Embedding(vocab, h).requires_grad_(False)
    head = torch.nn.Linear(h, vocab, bias=False).requires_grad_(False)
    batch = _batch(n, [12, 15], 2 * h, vocab, 0)
    with FlopCounterMode(display=False) as counter:
        d(batch, emb, head, generator=torch.Generator().manual_seed(0)).loss.backward()
    m = a * b
    shape = DrafterShape(hidden=h, num_taps=2, num_heads=4, num_kv_heads=2, head_dim=4, intermediate=24, vocab=vocab,
                         n_ctx=n, num_anchors=a, block_size=b, pairs=[m * (n + m)] * 2)
    f = drafter_step_flops(shape)
    assert counter.get_total_flops() == f.model - 3 * f.parts["attention"] + f.parts["lm_head"]


def test_matmul_rate_and_mfu() -> None:
    rate = measure_matmul_tflops("cpu", n=128, iters=2, dtype=torch.float32)
    assert 0 < rate < 100  # a CPU does well under 100 TFLOP/s
    assert mfu(2e12, 1.0, 4.0) == 0.5


def test_step_phases_dry_run_prints_the_flops_model_and_refuses_a_gpu_run_without_one() -> None:
    """bench/step_phases.py on this CPU machine: --dry-run gives the model for a config; a real run says it needs a
    GPU instead of timing the CPU."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "bench" / "step_phases.py"), str(root / "configs" / "h200-4b-like.yaml")]
    dry = subprocess.run([*cmd, "--dry-run", "--buffers", "2", "--peak-tflops", "1000"], capture_output=True,
                         text=True, timeout=300, check=True)
    report = json.loads(dry.stdout)
    assert (report["layers_run"], report["of_layers"], report["taps"]) == (30, 32, [1, 15, 29])
    fl = report["tflop_per_step"]
    assert fl["step_model"] == pytest.approx(fl["target_forward"] + fl["drafter_model"])
    assert fl["drafter_hardware"] > fl["drafter_model"] > fl["drafter_lm_head_fwd_bwd"] > 0
    assert report["ms_at_100pct_mfu"]["step"] == pytest.approx(fl["step_model"])  # TFLOP at 1000 TFLOP/s = ms
    # ~2 x 3.7B parameters (the 4B-like body without embeddings) x 30/32 layers per token, plus attention
    assert 5e-3 < report["target_params_per_token_tflop"] < 8e-3
    if not torch.cuda.is_available():
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert run.returncode == 1 and "needs a CUDA GPU" in run.stderr


def test_step_phases_keeps_the_first_target_layers_with_taps_spread_over_them() -> None:
    """--target-layers N (the 27B-like kernels on an 80 GB card, docs/perf.md session 20): the first N layers with
    their layer types, the configured taps scaled so every kept layer runs and the drafter keeps its tap count, fewer
    target FLOPs per token; too few layers for the taps is refused with the least that works."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "bench" / "step_phases.py"), str(root / "bench" / "h200-27b-like.yaml"),
           "--dry-run", "--buffers", "1"]
    whole, cut = (json.loads(subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=300,
                                            check=True).stdout) for extra in ([], ["--target-layers", "8"]))
    assert (whole["layers_run"], whole["of_layers"], whole["taps"]) == (62, 64, [1, 16, 31, 46, 61])
    assert (cut["layers_run"], cut["of_layers"], cut["taps"]) == (8, 8, [1, 2, 4, 5, 7])
    assert cut["tflop_per_step"]["target_forward"] < whole["tflop_per_step"]["target_forward"] / 5
    assert cut["tflop_per_step"]["drafter_model"] == pytest.approx(whole["tflop_per_step"]["drafter_model"])
    few = subprocess.run([*cmd, "--target-layers", "5"], capture_output=True, text=True, timeout=300)
    assert few.returncode != 0 and "too few for the config's 5 taps" in few.stderr and "at least 6" in few.stderr


def test_target_forward_bench_parses_its_rows_and_refuses_a_cpu_run() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "bench"))
    import target_forward

    assert target_forward.parse_rows("8x2048,1x16384") == [(8, 2048), (1, 16384)]
    assert target_forward.parse_attentions("sdpa,varlen") == ["sdpa", "varlen"]
    for bad in ("8y2", "0x5"):
        with pytest.raises(Exception, match="expected RxT"):
            target_forward.parse_rows(bad)
    with pytest.raises(Exception, match="choose from sdpa, varlen, got"):
        target_forward.parse_attentions("flash")
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, str(root / "bench" / "target_forward.py"),
                              str(root / "bench" / "h200-27b-like.yaml")], capture_output=True, text=True, timeout=300)
        assert run.returncode == 1 and "needs a CUDA GPU" in run.stderr

    # the summary compares with the plain-transformers rows that ran: one out of memory (the 27B-like shape's
    # logits on an H100) leaves its ratio None and the best of the others as the reference
    rows = [{"phase": "project varlen (varlen)", "tok_per_s": 9706},
            {"phase": "project varlen fused (varlen)", "tok_per_s": 11732},
            {"phase": "hf padded docs (+LM head)", "error": "OutOfMemoryError: CUDA out of memory"},
            {"phase": "hf padded docs (decoder only)", "tok_per_s": 4763},
            {"phase": "hf 8x2048 (decoder only)", "tok_per_s": 9650}]
    s = target_forward.summarize(rows)
    assert s["best_project"] == "project varlen fused (varlen)" and s["ratio_vs_hf_padded_docs"] is None
    assert s["best_hf"] == "hf 8x2048 (decoder only)" and s["ratio_vs_best_hf"] == round(11732 / 9650, 3)
    assert s["not_run"] == ["hf padded docs (+LM head)"]
    rows[2] = {"phase": "hf padded docs (+LM head)", "tok_per_s": 4602}
    assert target_forward.summarize(rows)["ratio_vs_hf_padded_docs"] == round(11732 / 4602, 3)


def test_target_forward_bench_loads_and_records_fla_configs_around_its_rows(tmp_path: Path) -> None:
    """--fla-configs: the store is named in the report, fla is pointed at it before the target is built (here, on
    the CPU, it holds nothing yet: the line says so) and the record runs after the rows (no fla: nothing new)."""
    import json

    root = Path(__file__).resolve().parents[1]
    store = tmp_path / "store"
    run = subprocess.run([sys.executable, str(root / "bench" / "target_forward.py"), str(root / "configs" / "tiny.yaml"),
                          "--cpu-smoke", "--fla-configs", str(store), "--repeats", "1", "--rows", "2x64",
                          "--no-fixed-shape", "--attention", "sdpa"], capture_output=True, text=True, timeout=600,
                         cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(next(ln for ln in reversed(run.stdout.splitlines()) if ln.startswith("{")))
    assert report["fla_configs"]["dir"] == str(store)
    assert report["fla_configs"]["enable"] == (f"fla kernel configs: none recorded yet in {store}: fla autotunes, and "
                                               "this run records its choices after its first step")
    assert report["fla_configs"]["record"] == "" and report["summary"]["best_hf"] is not None


def test_kernel_time_per_labelled_phase_reads_a_real_profiler_run() -> None:
    """bench's profile summary over a real torch.profiler run (CPU here: the phases are found, no kernel ran)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import benchlib

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with torch.profiler.record_function("phase:target"):
                torch.randn(64, 64) @ torch.randn(64, 64)
            with torch.profiler.record_function("phase:drafter"):
                torch.randn(8).sum()
    got = benchlib.kernel_ms(prof, steps=2)
    assert got == {"target": 0.0, "drafter": 0.0, "all_kernels": 0.0}


def test_both_benches_run_end_to_end_in_a_cpu_smoke_run(tmp_path: Path) -> None:
    """--cpu-smoke runs the timed paths of bench/step_phases.py and bench/target_forward.py on this CPU with a tiny
    config: every phase is timed and has its FLOPs, the step is whole, and target_forward's packed rows (fla-only)
    fail as named rows while the padded and plain-transformers rows are measured. Not GPU figures."""
    import json
    import subprocess
    import sys

    import yaml
    from dflash_fixtures import tiny_run_yaml

    cfg = tiny_run_yaml(drafter={"mask_token_id": 511, "layer_sliding_windows": [8]}, train={"compile": "false"})
    cfg["target"]["tap_layers"] = [1, 2]
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    root = Path(__file__).resolve().parents[1]

    def run(script: str, *extra: str) -> dict[str, object]:
        out = subprocess.run([sys.executable, str(root / "bench" / script), str(path), "--cpu-smoke", *extra],
                             capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    steps = run("step_phases.py", "--steps", "3", "--warmup", "1", "--profile-steps", "1", "--eval-every", "50",
                "--cuda-graph", "auto")  # auto: nothing to capture on a CPU, and nothing said about it
    assert steps["device"].startswith("cpu (smoke run") and steps["steps_timed"] == 3
    ev = steps["eval"]  # the train.eval_every evaluation at this shape: the training loop's own call, timed
    assert (ev["sequences"], ev["block_size"], ev["every_steps"]) == (32, 4, 50)  # type: ignore[index]
    assert ev["sequence_tokens"] == 12 + 36 + 3 and 0 < ev["share_of_training"] < 1  # type: ignore[index]
    assert ev["seconds"] > 0 and 1.0 <= ev["tau_random_drafter"] <= 4  # type: ignore[index]
    phases = {r["phase"]: r for r in steps["phases"]}  # type: ignore[union-attr]
    assert list(phases) == ["data (host)", "target forward", "drafter fwd+bwd", "optimizer", "host gap (GPU idle)",
                            "step"]
    assert all(phases[p]["ms"] > 0 for p in ("target forward", "drafter fwd+bwd", "optimizer", "step"))
    assert phases["step"]["tflop"] == pytest.approx(phases["target forward"]["tflop"] + phases["drafter fwd+bwd"]["tflop"],
                                                    abs=2e-3)
    assert phases["drafter fwd+bwd"]["hfu"] >= phases["drafter fwd+bwd"]["mfu"] > 0
    assert steps["target"] == {"layers_run": 3, "of": 4, "vocab": 512, "packing": "pad", "attention": "sdpa",
                               "fixed_shape": False,
                               "fused_elementwise": {"setting": "auto", "patched": {}, "checked": {}, "refused": {}},
                               "cuda_graph": {"setting": "auto", "active": False, "captures": 0, "replays": 0,
                                              "rows_run_eagerly": 0, "capture_failed": None}}
    refused = subprocess.run([sys.executable, str(root / "bench" / "step_phases.py"), str(path), "--cpu-smoke",
                              "--cuda-graph", "on"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        "bench/step_phases.py: target.cuda_graph=on captures the packed target forward on CUDA; this target is on "
        "cpu. Use cuda_graph: auto or off.")
    assert steps["profile"]["steps"] == 1 and steps["recompile_limit_hits"] == 0  # type: ignore[index]
    fwd = run("target_forward.py", "--rows", "2x64", "--repeats", "2")
    rows = {r["phase"]: r for r in fwd["rows"]}  # type: ignore[union-attr]
    assert "error" in rows["project varlen (varlen)"] and "packing=varlen" in rows["project varlen (varlen)"]["error"]
    for name in ("project padded (sdpa)", "hf padded docs (+LM head)", "hf 2x64 (decoder only)"):
        assert rows[name]["tok_per_s"] > 0 and rows[name]["mfu"] > 0
    assert fwd["summary"]["best_project"] == "project padded (sdpa)"  # type: ignore[index]


def test_flex_computes_whole_tiles_of_the_block_mask() -> None:
    """Hardware pairs of flex attention = every 128x128 tile holding at least one allowed pair, computed whole:
    counted from the BlockMask, checked against the tiles of the dense mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.flops import block_mask_pairs
    from dflash.model import flex_mask_mod

    batch = _batch(600, [150, 300, 100], 8, 50, 1)
    for window in (None, 64):
        anchors, _ = sample_anchors(batch, 40, 4, torch.Generator().manual_seed(2))
        m, n = 160, 600
        bm = create_block_mask(flex_mask_mod(anchors, batch.doc_ids, 4, window), None, None, m, n + m, device="cpu")
        dense = dense_mask(anchors, batch.doc_ids, 4, window)
        tiles = sum(bool(dense[q:q + 128, k:k + 128].any()) for q in range(0, m, 128) for k in range(0, n + m, 128))
        assert block_mask_pairs(bm) == tiles * 128 * 128 >= int(dense.sum())


def test_target_kernels_sorts_kernels_into_kinds_and_runs_on_the_cpu(tmp_path: Path) -> None:
    """bench/target_kernels.py: kernel names as the H100 profile showed them land in their kind (flash attention's
    kernel names cutlass, yet is attention), and a CPU smoke run writes its report."""
    import json

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "bench"))
    import target_kernels

    names = {"void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 64, 64, 4, cutlass::bfloat16_t":
             "full attention", "nvjet_sm90_tst_256x160_64x4_1x2_h_bz_coopA_TNT": "matmul",
             "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": "fla (linear attention)",
             "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "normalisation",
             "triton_poi_fused_mul_silu_0": "elementwise",
             "void causal_conv1d_channellast_fwd_kernel<Causal_conv1d_channellast_fwd_kernel_traits<128": "conv1d",
             "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda": "elementwise",
             "Memset (Device)": "other"}
    assert {n: target_kernels.kind_of(n) for n in names} == names
    out = tmp_path / "tk.json"
    run = subprocess.run([sys.executable, str(root / "bench" / "target_kernels.py"), str(root / "configs" / "tiny.yaml"),
                          "--cpu-smoke", "--calls", "1", "--top", "3", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["device"].startswith("cpu (smoke run") and len(report["top"]) == 3
    assert report["total_ms"] > 0 and abs(sum(report["kinds_ms"].values()) - report["total_ms"]) < 0.1
