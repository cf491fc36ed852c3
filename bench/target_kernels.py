"""Where the packed target forward's GPU time goes, by kernel kind: how much is matmul, fla's linear-attention kernels,
full attention, and the elementwise / normalisation work a fused kernel could shrink (issue 24's "target forward
≥ 1.15x plain transformers": the bound, measured before anything is built for it).

One packed token-budget buffer through Target.hidden_states_packed (as training runs it, after a warm-up call) under
torch.profiler; every CUDA kernel's time is put in one kind by its name, and the kinds and the top kernels are
printed with their share of the forward's kernel time.

  python3 bench/target_kernels.py bench/h200-27b-like.yaml --vocab 248320      # on the GPU machine
  python3 bench/target_kernels.py bench/h200-27b-like.yaml --cpu-smoke --layers 4   # anywhere: the script runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
import torch  # noqa: E402

from dflash.pipeline import prepare_buffer  # noqa: E402

# First match wins; the names are CUDA kernel names as torch.profiler reports them (cuBLAS/CUTLASS gemms, fla's
# Triton kernels by their Python names, PyTorch's flash / varlen attention, ATen's elementwise and reduction
# templates, inductor's generated triton_* kernels).
KINDS: list[tuple[str, str]] = [
    ("full attention", r"flash_fwd|flash|fmha|attention|attn"),
    ("matmul", r"gemm|cutlass|sm90_xmma|sm80_xmma|nvjet|cublas|ampere_.*_s16816|Kernel2"),
    ("fla (linear attention)", r"chunk_|gated_delta|fused_recurrent|l2norm|recompute_w_u|solve_tril|kkt|cumsum|"
                               r"prepare_|merge_"),
    ("conv1d", r"causal_conv1d|conv1d|conv_"),
    ("normalisation", r"norm|rsqrt|reduce|mean|welford"),
    ("elementwise", r"elementwise|vectorized|unrolled|silu|sigmoid|softplus|exp|mul|add|copy|cat|index|triton_"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "other")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("config", help="a dflash run config (e.g. bench/h200-27b-like.yaml)")
    p.add_argument("--vocab", type=int, help="override target.arch.vocab_size")
    p.add_argument("--calls", type=int, default=2, help="profiled forwards after one warm-up (default 2)")
    p.add_argument("--top", type=int, default=25, help="kernels listed by time (default 25)")
    p.add_argument("--layers", type=int, help="keep only the first N target layers (smoke runs)")
    p.add_argument("--fused", action="store_true",
                   help="profile with target.fused_elementwise on (the norms and activation as compiled kernels)")
    p.add_argument("--json", help="also write the report here")
    p.add_argument("--cpu-smoke", action="store_true", help="run on the CPU (checks the script; no GPU figures)")
    args = p.parse_args(argv)
    dev = benchlib.require_cuda("bench/target_kernels.py", cpu_smoke=args.cpu_smoke)
    cfg = benchlib.load(args.config, args.vocab)
    if args.layers:
        arch = dict(cfg.target.arch)
        arch["num_hidden_layers"] = args.layers
        if "layer_types" in arch:
            arch["layer_types"] = arch["layer_types"][:args.layers]
        taps = [t for t in (cfg.target.tap_layers or []) if t < args.layers] or [args.layers - 1]
        cfg.target = dataclasses.replace(cfg.target, arch=arch, tap_layers=taps)
    # eager unless --fused (target.fused_elementwise defaults to auto: on wherever the packed forward runs)
    cfg.target = dataclasses.replace(cfg.target, fused_elementwise="on" if args.fused else "off")
    from dflash.target import Target

    target = Target(cfg.target, cfg.drafter.num_layers, dev.device, vocab=cfg.data.vocab_size)
    print(f"target: {target.num_layers} layers, packing {target.packing}, kernels {target.kernels}, "
          f"fused_elementwise {cfg.target.fused_elementwise}", flush=True)
    corpus, buffers = benchlib.synthetic_buffers(cfg, 1)
    host = prepare_buffer(corpus, buffers[0], cfg.data.token_budget, "varlen")
    assert host.packed_ids is not None and host.cu_seqlens is not None
    pid, cu = host.packed_ids, host.cu_seqlens

    if target.packing == "varlen":
        def forward() -> Any:
            return target.hidden_states_packed(pid, cu)
    else:  # no fla here (the CPU smoke run): the same documents as right-padded rows, as training packs them then
        lengths = [int(n) for n in (cu[1:] - cu[:-1]).tolist()]
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, (o, n) in enumerate(zip(cu[:-1].tolist(), lengths, strict=True)):
            ids[i, :n], att[i, :n] = pid[0, o:o + n], 1
        ids, att = ids.to(dev.device), att.to(dev.device)
        print(f"packing {target.packing}: {len(lengths)} documents as padded rows", flush=True)

        def forward() -> Any:
            return target.hidden_states(ids, att)

    forward()
    forward()  # fused: the first call checks each kind against eager
    dev.sync()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.calls):
            forward()
        dev.sync()
    from torch.autograd import DeviceType

    per_kernel: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if dev.cuda and getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        us = float(getattr(e, "self_device_time_total", 0.0) or 0.0) if dev.cuda else float(e.self_cpu_time_total)
        if us > 0:
            per_kernel[e.key] += us / 1e3 / args.calls
    total = sum(per_kernel.values()) or 1.0
    kinds: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        kinds[kind_of(name)] += ms
    where = "GPU kernel" if dev.cuda else "CPU op (smoke: not GPU figures)"
    print(f"\n{dev.name()}: {where} ms per packed forward ({cfg.data.token_budget} tokens), {args.calls} calls")
    for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {k:24} {ms:9.1f} ms  {ms / total * 100:5.1f}%")
    print(f"  {'all':24} {total:9.1f} ms")
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:args.top]
    print("top kernels:")
    for name, ms in top:
        print(f"  {ms:8.2f} ms {ms / total * 100:5.1f}%  [{kind_of(name)}] {name[:110]}")
    report = {"config": args.config, "device": dev.name(), "torch": torch.__version__, "calls": args.calls,
              "fused_elementwise": cfg.target.fused_elementwise,
              "total_ms": round(total, 2), "kinds_ms": {k: round(v, 2) for k, v in kinds.items()},
              "top": [{"kernel": n, "ms": round(ms, 3), "kind": kind_of(n)} for n, ms in top]}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
