"""Where one colocated training step's time goes, per phase, measured with CUDA events on one GPU.

Phases of a step, in the trainer's order: data (host: laying out the buffer), target forward, drafter forward +
backward, optimizer (clip + AdamW + zero_grad), and the host gap (GPU idle between the optimizer of one step and the
target forward of the next: the trainer's per-step syncs and Python). Each with model FLOPs (dflash/flops.py),
achieved TFLOP/s and MFU against the bf16 matmul rate measured in the same run; the drafter also with hardware
FLOPs (recompute). Plus tokens/s, peak memory, recompiles after warm-up, dynamo fallbacks, host syncs per target
forward.

  python3 bench/step_phases.py bench/h200-27b-like.yaml                 # on the GPU machine
  python3 bench/step_phases.py bench/h200-27b-like.yaml --dry-run       # anywhere: the FLOPs model of a step
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
import torch  # noqa: E402

from dflash import fla_configs  # noqa: E402
from dflash.config import ConfigError  # noqa: E402
from dflash.flops import as_row, measure_matmul_tflops  # noqa: E402
from dflash.pipeline import prepare_buffer, run_target  # noqa: E402


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """The FLOPs model of a step on the config's synthetic buffers (no GPU, no weights)."""
    cfg = benchlib.load(args.config, args.vocab, args.attention, args.target_layers)
    costs, taps, text = benchlib.target_costs(cfg)
    hidden, vocab = int(text.hidden_size), int(text.vocab_size)
    corpus, buffers = benchlib.synthetic_buffers(cfg, args.buffers, args.seed)
    rows = []
    for i, pieces in enumerate(buffers):
        host = prepare_buffer(corpus, pieces, cfg.data.token_budget, "varlen")
        pairs = benchlib.sample_buffer_pairs(cfg, host.arrays, args.seed + i)
        rows.append({**benchlib.buffer_flops(cfg, costs, taps, hidden, vocab, pieces, pairs), "docs": len(pieces),
                     "pairs": pairs})
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("target", "target_attention", "drafter", "drafter_hw",
                                                              "drafter_lm_head", "tokens")}
    step = mean["target"] + mean["drafter"]
    peak = args.peak_tflops
    out = {
        "config": args.config, "layers_run": max(taps) + 1, "of_layers": len(costs), "taps": taps,
        "target_params_per_token_tflop": sum(c.per_token() for c in costs[: max(taps) + 1]) / 1e12,
        "buffers": len(rows), "real_tokens_mean": mean["tokens"], "docs_mean": sum(r["docs"] for r in rows) / len(rows),
        "tflop_per_step": {"target_forward": mean["target"] / 1e12,
                           "target_full_attention": mean["target_attention"] / 1e12,
                           "drafter_model": mean["drafter"] / 1e12, "drafter_hardware": mean["drafter_hw"] / 1e12,
                           "drafter_lm_head_fwd_bwd": mean["drafter_lm_head"] / 1e12, "step_model": step / 1e12},
        "at_peak_tflops": peak,
        "ms_at_100pct_mfu": {"target_forward": mean["target"] / peak / 1e9, "drafter": mean["drafter"] / peak / 1e9,
                             "step": step / peak / 1e9},
    }
    return out


def gpu_run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the config's target and drafter, run warm-up + timed steps, report every phase."""
    from dflash.kernels import FlexWarningWatch, dynamo_counts, recompile_limit_hits
    from dflash.memory import apply_auto_checkpoint
    from dflash.model import DFlashDrafter, compile_step_model, sample_anchors
    from dflash.target import Target

    dev = benchlib.require_cuda("bench/step_phases.py", "; --dry-run prints the FLOPs model without one",
                                args.cpu_smoke)
    cfg = benchlib.load(args.config, args.vocab, args.attention, args.target_layers)
    device = dev.device
    peak = measure_matmul_tflops(device) if dev.cuda else measure_matmul_tflops(device, 256, 4, torch.float32)
    print(f"bf16 matmul rate measured: {peak:.0f} TFLOP/s", flush=True)
    costs, taps, text = benchlib.target_costs(cfg)
    total = args.warmup + args.steps
    corpus, buffers = benchlib.synthetic_buffers(cfg, total + args.profile_steps, args.seed)
    t0 = time.perf_counter()
    if args.cuda_graph is not None:
        cfg.target.cuda_graph = args.cuda_graph
    if args.fused_elementwise is not None:
        cfg.target.fused_elementwise = args.fused_elementwise
    fla_store = Path(args.fla_configs) if args.fla_configs else None
    seeded = fla_configs.seed(fla_store, fla_configs.seed_dir(torch.cuda.get_device_name(device))) \
        if args.fla_seed and fla_store is not None and device.type == "cuda" else ""
    if seeded:
        print(seeded, flush=True)
    fla_lines = {"dir": str(fla_store) if fla_store else None, "seed": seeded, "enable": fla_configs.enable(fla_store),
                 "record": ""}
    if fla_lines["enable"]:
        print(fla_lines["enable"], flush=True)
    try:
        target = Target(cfg.target, cfg.drafter.num_layers, device, vocab=cfg.data.vocab_size)
    except ValueError as exc:  # e.g. --cuda-graph on where it cannot apply: one line, no traceback
        raise SystemExit(f"bench/step_phases.py: {exc}") from None
    graphs = target.enable_cuda_graph(cfg.data.token_budget, cfg.data.min_len, cfg.data.max_len,
                                      lambda msg: print(msg, flush=True))
    fixed_shape = args.fixed_shape and not graphs  # the graph path lays out its own fixed-shape row
    print(f"target built in {time.perf_counter() - t0:.1f} s: {target.num_layers} layers, vocab {target.vocab_size}, "
          f"packing {target.packing}, attention {target.attention}, kernels {target.kernels}", flush=True)
    dcfg = cfg.drafter
    if args.grad_checkpoint is not None:
        dcfg.grad_checkpoint = {"true": True, "false": False}.get(args.grad_checkpoint, args.grad_checkpoint)
    torch.manual_seed(cfg.train.seed)
    drafter = DFlashDrafter(dcfg, target.hidden_size, len(target.tap_layers)).to(device)
    apply_auto_checkpoint(drafter, cfg.data.token_budget, target.hidden_size * len(target.tap_layers), device,
                          lambda msg: print(msg, flush=True))
    print(f"drafter: {drafter.checkpoint_layers} of {len(drafter.layers)} layers checkpointed "
          f"(drafter.grad_checkpoint {dcfg.grad_checkpoint}); HFU counts their recompute", flush=True)
    params = [p for p in drafter.parameters() if p.requires_grad]
    t = cfg.train
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay)
    compiled = t.compile in ("auto", "true")
    if args.compile_scope is not None:
        t.compile_scope = args.compile_scope
    # as dflash train does: the whole step, or one layer and one CE chunk compiled once (train.compile_scope)
    step_model = compile_step_model(drafter, drafter, t.compile_scope, t.compile_backend) if compiled else drafter
    gen = torch.Generator(device=device).manual_seed(t.seed)
    n = cfg.data.token_budget
    per_step: list[dict[str, Any]] = []
    fallbacks: list[str] = []
    frames_warm = hits_warm = retries_warm = 0
    first_split: dict[str, float] = {}
    rf = torch.profiler.record_function

    def one_step(i: int, pieces: Any) -> dict[str, Any]:
        """One step as dflash train runs it, with CUDA events at the phase boundaries (labelled for the profiler)."""
        nonlocal fallbacks
        ev = benchlib.Events(dev)
        h0 = time.perf_counter()
        with rf("phase:data"):
            host = prepare_buffer(corpus, pieces, n, target.packing, fixed_shape=fixed_shape)
        data_s = time.perf_counter() - h0
        ev.mark("start")
        h1 = time.perf_counter()
        with rf("phase:target"):
            batch = run_target(target, host, n).to(device, non_blocking=True)
        target_enqueue_s = time.perf_counter() - h1
        ev.mark("target")
        h2 = time.perf_counter()
        with rf("phase:drafter"):
            anchors, keep = sample_anchors(batch, dcfg.num_anchors, dcfg.block_size, gen)
            drafter.train()
            with FlexWarningWatch() as watch, torch.autocast(device.type, dtype=torch.bfloat16, enabled=dev.cuda):
                out = step_model(batch, target.embed_tokens, target.lm_head, anchors=anchors, keep=keep)
            out.loss.backward()
        drafter_enqueue_s = time.perf_counter() - h2
        ev.mark("drafter")
        with rf("phase:optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        ev.mark("optimizer")
        # What the trainer reads back every step (loss, counts, grad norm): host syncs, as in dflash train.
        loss, tokens, gnorm = float(out.loss.detach()), int(out.num_tokens), float(grad_norm)
        fallbacks += watch.fallbacks + watch.triggered
        return {"step": i, "loss": loss, "tokens": tokens, "grad_norm": gnorm, "data_s": data_s,
                "target_enqueue_s": target_enqueue_s, "drafter_enqueue_s": drafter_enqueue_s,
                "wall_s": time.perf_counter() - h0, "ev": ev, "pieces": pieces,
                "anchors": anchors, "arrays": host.arrays}  # not the batch: its hidden is ~1 GB

    for i, pieces in enumerate(buffers[:total]):
        if i == args.warmup:
            dev.sync()
            dev.reset_peak()
            frames_warm, hits_warm = dynamo_counts()["frames"], recompile_limit_hits()
            retries_warm = dev.alloc_retries()
        rec = one_step(i, pieces)
        per_step.append(rec)
        if i == 0:
            dev.sync()
            fla_lines["record"] = fla_configs.record(fla_store)  # as dflash train does after its first step
            if fla_lines["record"]:
                print(fla_lines["record"], flush=True)
            split = {k: round(rec["ev"].ms(a, b) / 1e3, 1) for k, (a, b) in {
                "target": ("start", "target"), "drafter": ("target", "drafter"),
                "optimizer": ("drafter", "optimizer")}.items()}
            first_split = split
            print(f"first step (compiles) {rec['wall_s']:.1f} s: target forward {split['target']} s (its kernels' "
                  f"first calls), drafter fwd+bwd {split['drafter']} s (the compile, scope "
                  f"{t.compile_scope if compiled else 'off'}), optimizer {split['optimizer']} s", flush=True)
    profile: dict[str, Any] | None = None
    if args.profile_steps:
        dev.sync()
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            prof_recs = [one_step(total + j, p) for j, p in enumerate(buffers[total:])]
        dev.sync()
        kernels = benchlib.kernel_ms(prof, len(prof_recs))
        ev_ms = {k: benchlib.median([r["ev"].ms(a, b) for r in prof_recs])
                 for k, (a, b) in {"target": ("start", "target"), "drafter": ("target", "drafter"),
                                   "optimizer": ("drafter", "optimizer")}.items()}
        profile = {"steps": len(prof_recs), "kernel_ms": {k: round(v, 1) for k, v in kernels.items()},
                   "event_ms": {k: round(v, 1) for k, v in ev_ms.items()},
                   "gpu_busy_in_phase": {k: round(kernels.get(k, 0.0) / v, 3) for k, v in ev_ms.items() if v > 0}}
    dev.sync()
    peak_mem = dev.peak() / 2**30
    recompiles = dynamo_counts()["frames"] - frames_warm
    limit_hits = recompile_limit_hits() - hits_warm
    alloc_retries = dev.alloc_retries() - retries_warm
    timed = per_step[args.warmup:]
    hidden, vocab = target.hidden_size, target.vocab_size
    rows_ms: dict[str, list[float]] = {k: [] for k in ("target", "drafter", "optimizer", "gap", "step")}
    fl: dict[str, list[float]] = {k: [] for k in ("target", "drafter", "drafter_hw", "tokens")}
    for j, rec in enumerate(timed):
        ev = rec["ev"]
        rows_ms["target"].append(ev.ms("start", "target"))
        rows_ms["drafter"].append(ev.ms("target", "drafter"))
        rows_ms["optimizer"].append(ev.ms("drafter", "optimizer"))
        if j + 1 < len(timed):  # a step ends where the next one's target forward starts
            nxt = timed[j + 1]["ev"]
            rows_ms["gap"].append(float(ev.marks["optimizer"].elapsed_time(nxt.marks["start"])))
            rows_ms["step"].append(float(ev.marks["start"].elapsed_time(nxt.marks["start"])))
        host_b = benchlib.host_batch(rec["arrays"])
        pairs = benchlib.anchor_pairs(cfg, host_b, rec["anchors"].cpu())
        hw_pairs = None
        if drafter.attention_backend != "dense":  # flex computes whole tiles: count them from its block mask
            dev_b = benchlib.host_batch({k: v.to(device) for k, v in rec["arrays"].items()})
            hw_pairs = benchlib.flex_tile_pairs(cfg, dev_b, rec["anchors"])
        f = benchlib.buffer_flops(cfg, costs, taps, hidden, vocab, rec["pieces"], pairs, hw_pairs,
                                 drafter.checkpoint_layers)
        for k in fl:
            fl[k].append(f[k])
    med = {k: benchlib.median(v) for k, v in rows_ms.items()}
    mean_fl = {k: sum(v) / len(v) for k, v in fl.items()}
    s = lambda k: med[k] / 1e3  # noqa: E731
    phases = [
        as_row("data (host)", 0.0, benchlib.median([r["data_s"] for r in timed]), peak, {"kind": "host wall"}),
        as_row("target forward", mean_fl["target"], s("target"), peak,
               {"host_enqueue_ms": round(benchlib.median([r["target_enqueue_s"] for r in timed]) * 1e3, 1)}),
        as_row("drafter fwd+bwd", mean_fl["drafter"], s("drafter"), peak,
               {"hfu": round(mean_fl["drafter_hw"] / s("drafter") / (peak * 1e12), 4),
                "host_enqueue_ms": round(benchlib.median([r["drafter_enqueue_s"] for r in timed]) * 1e3, 1)}),
        as_row("optimizer", 0.0, s("optimizer"), peak),
        as_row("host gap (GPU idle)", 0.0, s("gap"), peak),
        as_row("step", mean_fl["target"] + mean_fl["drafter"], s("step"), peak,
               {"tokens_per_s": round(mean_fl["tokens"] / s("step"))}),
    ]
    eval_report = eval_cost(args, cfg, drafter, target, s("step")) if args.eval_every is not None else None
    syncs, where = benchlib.count_host_syncs(lambda: run_target(target, prepare_buffer(
        corpus, buffers[-1], n, target.packing, fixed_shape=fixed_shape), n), dev)
    # The drafter's fwd+bwd too: a sync there makes the host wait for the target forward before it can enqueue the
    # rest of the drafter (its host_enqueue_ms then holds that wait), and leaves the GPU idle while it does.
    dbatch = run_target(target, prepare_buffer(corpus, buffers[-1], n, target.packing, fixed_shape=fixed_shape),
                        n).to(device)

    def drafter_once(b: Any) -> None:
        anchors, keep = sample_anchors(b, dcfg.num_anchors, dcfg.block_size, gen)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dev.cuda):
            out = step_model(b, target.embed_tokens, target.lm_head, anchors=anchors, keep=keep)
        out.loss.backward()

    dsyncs, dwhere = benchlib.count_host_syncs(functools.partial(drafter_once, dbatch), dev)
    opt.zero_grad(set_to_none=True)
    del dbatch
    g = target.graphs
    return {
        "config": args.config, "device": dev.name(), "torch": torch.__version__,
        "bf16_matmul_tflops": round(peak, 1), "steps_timed": len(timed), "warmup": args.warmup,
        "first_step_s": round(per_step[0]["wall_s"], 1), "first_step_split_s": first_split, "fla_configs": fla_lines,
        "compile_scope": t.compile_scope if compiled else None,
        "grad_checkpoint": str(dcfg.grad_checkpoint).lower(), "checkpoint_layers": drafter.checkpoint_layers,
        # the drafter's FLOPs a step, unrounded: model (what MFU counts) and hardware (recompute and whole tiles too)
        "drafter_flops": {"model": mean_fl["drafter"], "hardware": mean_fl["drafter_hw"]},
        "real_tokens_per_step": round(mean_fl["tokens"]),
        "target": {"layers_run": max(taps) + 1, "of": target.num_layers, "vocab": vocab, "packing": target.packing,
                   "attention": target.attention, "fixed_shape": args.fixed_shape,
                   "fused_elementwise": {"setting": cfg.target.fused_elementwise,
                                         "patched": target.fusion.patched if target.fusion else {},
                                         "checked": target.fusion.checked if target.fusion else {},
                                         "refused": target.fusion.refused if target.fusion else {}},
                   "cuda_graph": {"setting": cfg.target.cuda_graph, "active": g is not None,
                                  "captures": g.captures if g else 0, "replays": g.replays if g else 0,
                                  "rows_run_eagerly": g.unfit if g else 0, "capture_failed": g.failed if g else None}},
        "phases": phases, "peak_memory_gib": round(peak_mem, 1), "recompiles_after_warmup": recompiles,
        "recompile_limit_hits": limit_hits, "fallbacks": fallbacks[:5],
        "host_syncs_per_target_forward": syncs, "host_sync_sites": where,
        "host_syncs_per_drafter_step": dsyncs, "drafter_sync_sites": dwhere, "alloc_retries_timed": alloc_retries,
        "losses_first_last": [per_step[0]["loss"], per_step[-1]["loss"]],
        "profile": profile, "eval": eval_report,
    }


def eval_cost(args: argparse.Namespace, cfg: Any, drafter: Any, target: Any, step_s: float) -> dict[str, Any]:
    """What `train.eval_every` costs at this shape: `dflash.heldout.evaluate` (the training loop's own call) on a
    held-out set of the size the config gets by default (train.eval_prompts sequences of prompt + new tokens + B-1,
    dflash.heldout.EvalSettings), random ids and taps (the cost does not depend on their values; a random drafter
    accepts ~nothing, the longest walk), timed after one warm-up, as a share of the training time between two
    evaluations measured in this run."""
    from dflash.heldout import EvalSettings, HeldOutSet, evaluate
    from dflash.tau import continuation_length

    st = EvalSettings.of(cfg)
    b = cfg.drafter.block_size
    n = st.prompt_tokens + continuation_length(st.new_tokens, b)
    g = torch.Generator().manual_seed(args.seed)
    kh = target.hidden_size * len(target.tap_layers)
    seqs = [torch.randint(0, cfg.data.vocab_size, (n,), generator=g).tolist() for _ in range(st.prompts)]
    taps = [torch.randn(n, kh, generator=g).to(target.dtype) for _ in range(st.prompts)]
    if target.device.type == "cuda":
        taps = [t.pin_memory() for t in taps]
    hs = HeldOutSet(sequences=seqs, prompt_lens=[st.prompt_tokens] * st.prompts, new_tokens=st.new_tokens,
                    block_size=b, stop_ids=[], taps=taps, path=Path("."), source="random")
    every = args.eval_every or cfg.train.checkpoint_every or 100
    runs = []
    for _ in range(3):
        with torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=target.device.type == "cuda"):
            t0 = time.perf_counter()
            res = evaluate(drafter, target.embed_tokens, target.lm_head, hs, target.device)
            runs.append(time.perf_counter() - t0)
    sec = benchlib.median(runs[1:])
    out = {"sequences": st.prompts, "sequence_tokens": n, "new_tokens": st.new_tokens, "block_size": b,
           "seconds_runs": [round(x, 3) for x in runs], "seconds": round(sec, 3), "every_steps": every,
           "step_s": round(step_s, 4), "share_of_training": round(sec / (sec + every * step_s), 5),
           "tau_random_drafter": res["tau"]}
    print(f"eval: {st.prompts} held-out sequences of {n} tokens at B={b}: {sec:.3f} s (runs {out['seconds_runs']}) "
          f"= {100 * out['share_of_training']:.2f} % of training at one eval every {every} steps of {step_s:.3f} s",
          flush=True)
    return out


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['device']}, torch {report['torch']}: bf16 matmul {report['bf16_matmul_tflops']} TFLOP/s; "
          f"{report['steps_timed']} timed steps after {report['warmup']}, first step {report['first_step_s']} s")
    print(f"{'phase':22} {'ms':>9} {'TFLOP':>8} {'TFLOP/s':>8} {'MFU':>6}  other")
    for r in report["phases"]:
        other = {k: v for k, v in r.items() if k not in ("phase", "ms", "tflop", "tflops_per_s", "mfu")}
        mfu = f"{r['mfu'] * 100:5.1f}%" if r["mfu"] is not None else "     -"
        tps = f"{r['tflops_per_s']:8.1f}" if r["tflop"] else "       -"
        print(f"{r['phase']:22} {r['ms']:9.1f} {r['tflop']:8.2f} {tps} {mfu}  {other or ''}")
    print(f"peak memory {report['peak_memory_gib']} GiB; recompiles after warm-up {report['recompiles_after_warmup']}; "
          f"recompile-limit fallbacks {report['recompile_limit_hits']} {report['fallbacks'] or ''}; "
          f"host syncs per target forward {report['host_syncs_per_target_forward']} {report['host_sync_sites']}, "
          f"per drafter fwd+bwd {report['host_syncs_per_drafter_step']} {report['drafter_sync_sites']}; "
          f"allocator retries in the timed steps {report['alloc_retries_timed']}")
    if report.get("profile"):
        pr = report["profile"]
        print(f"profiled {pr['steps']} steps: kernel ms {pr['kernel_ms']}; event ms {pr['event_ms']}; "
              f"GPU busy inside each phase {pr['gpu_busy_in_phase']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("config", help="a dflash run config (e.g. bench/h200-27b-like.yaml, configs/h200-4b-like.yaml)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps: compile, allocator (default 3)")
    p.add_argument("--vocab", type=int, help="override target.arch.vocab_size (e.g. 248320, the real LM-head cost)")
    p.add_argument("--attention", choices=("sdpa", "varlen"), help="override target.attention")
    p.add_argument("--fixed-shape", action="store_true", help="pad every packed target row to token_budget")
    p.add_argument("--fused-elementwise", choices=("off", "auto", "on"),
                   help="override target.fused_elementwise: the packed forward's norms and activation as compiled "
                        "fused kernels (dflash/target_fusion.py)")
    p.add_argument("--cuda-graph", choices=("off", "auto", "on"),
                   help="override target.cuda_graph: capture the packed target forward as CUDA graphs (issue 24)")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="extra steps under torch.profiler: GPU kernel time per phase against its event time, i.e. how "
                        "much of a phase the GPU sat waiting for the host (default 2; 0 = off)")
    p.add_argument("--target-layers", type=int, metavar="N",
                   help="keep the target's first N layers (same layer shapes, the configured taps scaled over them so every "
                        "kept layer runs): e.g. the 27B-like kernels and fla keys on an 80 GB card, where all 64 "
                        "layers do not fit")
    p.add_argument("--compile-scope", choices=("whole", "regional"),
                   help="override train.compile_scope: compile the whole drafter step, or one layer and one CE chunk "
                        "reused by all (issue 24: the cold first step)")
    p.add_argument("--grad-checkpoint", choices=("true", "false", "auto"),
                   help="override drafter.grad_checkpoint: recompute every layer's forward in backward, none, or as "
                        "many as the memory free after the target is loaded needs (issue 24: HFU vs MFU)")
    p.add_argument("--fla-configs", metavar="DIR",
                   help="load fla's tuned kernel configs from DIR (FLA_CACHE_MODE=strict) when it holds some, and record "
                        "this run's choices there after the first step, as dflash train does with its host store "
                        "(dflash/fla_configs.py; issue 24: the cold first step). Default: off, fla autotunes")
    p.add_argument("--fla-seed", action="store_true",
                   help="with --fla-configs: first merge the configs shipped with dflash for this GPU (dflash/fla_seed) "
                        "into DIR, as dflash train does on a fresh host")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry-run", action="store_true", help="print the FLOPs model of a step; needs no GPU")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the timed path on the CPU to check this script end to end (tiny configs; not GPU figures)")
    p.add_argument("--buffers", type=int, default=4, help="--dry-run: synthetic buffers averaged (default 4)")
    p.add_argument("--peak-tflops", type=float, default=788.0,
                   help="--dry-run: the rate for 'ms at 100%% MFU' (default 788, measured on an H200)")
    p.add_argument("--eval-every", type=int, nargs="?", const=0, default=None,
                   help="also time one train.eval_every evaluation (the eval event) at this shape and report it as a "
                        "share of the training between two of them (every N steps; bare: the config's "
                        "checkpoint_every, or 100)")
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    if args.steps < 2 or args.warmup < 1:
        p.error("--steps must be >= 2 and --warmup >= 1 (the first step compiles)")
    report = dry_run(args) if args.dry_run else gpu_run(args)
    if args.dry_run:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
        print(json.dumps(report, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as exc:  # a bad config or override: its one line, not a traceback
        sys.exit(f"{Path(__file__).name}: {exc}")
