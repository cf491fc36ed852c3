"""The project's target forward against plain transformers on the same model and the same real tokens, in one run.

Rows (one H200, the config's random-init target, its own weights shared by every row):
  project varlen/<attention>  the packed token-budget buffer through Target.hidden_states_packed (fla varlen for the
                              linear layers; full attention by sdpa or varlen), up to the deepest tap
  project varlen fixed-shape  the same, the row always token_budget long (tail = one dummy document)
  project padded              the same documents as right-padded rows through Target.hidden_states
  hf padded docs              plain transformers, the same documents as right-padded rows, all layers + LM head
  hf RxT                      plain transformers over R dense rows of T tokens (--rows, e.g. 8x2048 and 1x16384)
Each: median ms of --repeats (CUDA events, after a warm-up), real tokens/s, model TFLOP/s and MFU against the bf16
matmul rate measured in the run, peak memory, host syncs per call; and the project rows' largest relative error
against the padded forward per document (correctness travels with the speed).

  python3 bench/target_forward.py bench/h200-27b-like.yaml                     # on the GPU machine
  python3 bench/target_forward.py bench/h200-27b-like.yaml --attention sdpa,varlen --rows 8x2048
  python3 bench/target_forward.py bench/h200-27b-like.yaml --attention varlen --fla-configs $OUT/store   # + record
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402
import torch  # noqa: E402

from dflash import fla_configs  # noqa: E402
from dflash.config import ConfigError  # noqa: E402
from dflash.flops import as_row, measure_matmul_tflops, target_forward_flops  # noqa: E402
from dflash.pipeline import prepare_buffer  # noqa: E402
from dflash.target import ATTENTIONS  # noqa: E402


def parse_rows(text: str) -> list[tuple[int, int]]:
    """'8x2048,1x16384' -> [(8, 2048), (1, 16384)]."""
    out = []
    for part in filter(None, text.split(",")):
        r, _, t = part.partition("x")
        if not (r.isdigit() and t.isdigit()) or int(r) < 1 or int(t) < 1:
            raise argparse.ArgumentTypeError(f"--rows: expected RxT like 8x2048, got {part!r}")
        out.append((int(r), int(t)))
    return out


def parse_attentions(text: str) -> list[str]:
    names = [a for a in text.split(",") if a]
    choices = [a for a in ATTENTIONS if a != "auto"]  # a row times one implementation
    bad = [a for a in names if a not in choices]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--attention: choose from {', '.join(choices)}, got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("config", help="a dflash run config (e.g. bench/h200-27b-like.yaml)")
    p.add_argument("--attention", type=parse_attentions, default=["sdpa", "varlen"],
                   help="project rows' full-attention implementations (default sdpa,varlen)")
    p.add_argument("--rows", type=parse_rows, default=[(8, 2048), (1, 16384)],
                   help="plain transformers dense rows RxT (default 8x2048,1x16384)")
    p.add_argument("--vocab", type=int, help="override target.arch.vocab_size")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per row after one warm-up (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fixed-shape", action="store_true", help="skip the fixed-shape row")
    p.add_argument("--fused", action="store_true",
                   help="add a row with the target's norms and MLP activation compiled into fused kernels "
                        "(dflash/target_fusion.py), over the last --attention")
    p.add_argument("--fla-configs", metavar="DIR",
                   help="load fla's tuned kernel configs from DIR when it holds some (dflash/fla_configs.py), and "
                        "record what fla's autotuners chose here after every row ran: the target forward alone fits "
                        "a card that the whole 27B-like step does not, so this records a store to ship "
                        "(dflash/fla_seed) from an H100 too")
    p.add_argument("--json", help="also write the report here")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run on the CPU to check this script end to end (tiny configs; packed rows fail there: no fla)")
    args = p.parse_args(argv)
    dev = benchlib.require_cuda("bench/target_forward.py", cpu_smoke=args.cpu_smoke)
    store = Path(args.fla_configs) if args.fla_configs else None
    lines = {"enable": fla_configs.enable(store)}  # before the target (and fla) is built: fla reads its mode at import
    if lines["enable"]:
        print(lines["enable"], flush=True)
    report = run(args, dev)
    lines["record"] = fla_configs.record(store)
    if lines["record"]:
        print(lines["record"], flush=True)
    report["fla_configs"] = {"dir": str(store) if store else None, **lines}
    print(json.dumps(report, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The best project row against plain transformers: the padded documents (+LM head) and the best hf row timed;
    a ratio whose reference row did not run (out of memory) is None."""
    timed = [x for x in rows if "tok_per_s" in x]
    best_project = max((x for x in timed if x["phase"].startswith("project")), key=lambda x: x["tok_per_s"])
    hf_docs = next((x for x in timed if x["phase"] == "hf padded docs (+LM head)"), None)
    best_hf = max((x for x in timed if x["phase"].startswith("hf")), key=lambda x: x["tok_per_s"], default=None)

    def ratio(ref: dict[str, Any] | None) -> float | None:
        return None if ref is None else round(best_project["tok_per_s"] / ref["tok_per_s"], 3)

    return {"best_project": best_project["phase"], "best_project_tok_per_s": best_project["tok_per_s"],
            "hf_padded_docs_tok_per_s": hf_docs and hf_docs["tok_per_s"], "ratio_vs_hf_padded_docs": ratio(hf_docs),
            "best_hf": best_hf and best_hf["phase"], "ratio_vs_best_hf": ratio(best_hf),
            "not_run": [x["phase"] for x in rows if "error" in x]}


def run(args: argparse.Namespace, dev: benchlib.Dev) -> dict[str, Any]:
    from dflash.target import Target, register_varlen_attention

    cfg = benchlib.load(args.config, args.vocab)
    device = dev.device
    peak = measure_matmul_tflops(device) if dev.cuda else measure_matmul_tflops(device, 256, 4, torch.float32)
    print(f"bf16 matmul rate measured: {peak:.0f} TFLOP/s", flush=True)
    costs, taps, text = benchlib.target_costs(cfg)
    t0 = time.perf_counter()
    # the project rows run the eager packed forward (target.fused_elementwise defaults to auto); --fused adds a row
    cfg.target = dataclasses.replace(cfg.target, fused_elementwise="off")
    target = Target(cfg.target, cfg.drafter.num_layers, device, vocab=cfg.data.vocab_size)
    print(f"target built in {time.perf_counter() - t0:.1f} s: {target.num_layers} layers, packing {target.packing}, "
          f"kernels {target.kernels}", flush=True)
    if target.packing != "varlen" and dev.cuda:
        raise SystemExit("bench/target_forward.py: the target is not on the varlen path (fla + causal-conv1d "
                         f"missing? kernels {target.kernels}); nothing to compare")
    corpus, buffers = benchlib.synthetic_buffers(cfg, 1, args.seed)
    pieces = buffers[0]
    lengths = [n for _, _, n in pieces]
    real, n_budget = sum(lengths), cfg.data.token_budget
    layers_run, all_layers = max(taps) + 1, len(costs)
    hidden, vocab = target.hidden_size, target.vocab_size
    proj_flops = target_forward_flops(costs, lengths, layers_run).total
    rows: list[dict[str, Any]] = []
    model = target.model

    def measure(name: str, fn: Callable[[], Any], flops: float, tokens: int, extra: dict[str, Any]) -> Any:
        dev.sync()
        dev.reset_peak()
        base = dev.allocated()
        times, out = benchlib.time_cuda(fn, args.repeats, dev)
        mem = (dev.peak() - base) / 2**30
        syncs, where = benchlib.count_host_syncs(fn, dev)
        ms = benchlib.median(times)
        row = as_row(name, flops, ms / 1e3, peak, {"tokens": tokens, "tok_per_s": round(tokens / ms * 1e3),
                                                   "extra_mem_gib": round(mem, 2), "host_syncs": syncs,
                                                   "sync_sites": where, **extra})
        rows.append(row)
        print(f"{name:34} {ms:9.1f} ms {row['tok_per_s']:>8} tok/s  MFU {row['mfu'] * 100:5.1f}%  syncs {syncs}  "
              f"{extra or ''}", flush=True)
        return out

    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    att = torch.zeros_like(ids)
    o = 0
    packed_ids = prepare_buffer(corpus, pieces, n_budget, "varlen").packed_ids
    assert packed_ids is not None
    for i, n in enumerate(lengths):
        ids[i, :n], att[i, :n] = packed_ids[0, o:o + n], 1
        o += n
    ids_d, att_d = ids.to(device), att.to(device)
    print(f"buffer: {real} real tokens in {len(lengths)} documents (longest {max(lengths)}) of a {n_budget} budget; "
          f"project runs {layers_run} of {all_layers} layers", flush=True)

    # The reference every project row is checked against: the padded forward, default attention.
    model.set_attn_implementation("sdpa")
    refs = {"padded": measure("project padded (sdpa)", lambda: target.hidden_states(ids_d, att_d), proj_flops, real,
                              {})}

    def worst_doc_error(out: torch.Tensor) -> float:
        worst, o = 0.0, 0
        for i, n in enumerate(lengths):
            a, b = out[o:o + n].double(), refs["padded"][i, :n].double()
            worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-30)))
            o += n
        return worst

    for attention in args.attention:
        host = prepare_buffer(corpus, pieces, n_budget, "varlen")
        assert host.packed_ids is not None and host.cu_seqlens is not None
        pid, cu = host.packed_ids, host.cu_seqlens
        try:
            model.set_attn_implementation(register_varlen_attention() if attention == "varlen" else "sdpa")
            out = measure(f"project varlen ({attention})", lambda pid=pid, cu=cu: target.hidden_states_packed(pid, cu),
                          proj_flops, real, {})
            rows[-1]["max_rel_err_vs_padded"] = round(worst_doc_error(out[0]), 5)
            if not args.no_fixed_shape:
                fixed = prepare_buffer(corpus, pieces, n_budget, "varlen", fixed_shape=True)
                assert fixed.packed_ids is not None and fixed.cu_seqlens is not None
                fid, fcu = fixed.packed_ids, fixed.cu_seqlens
                out = measure(f"project varlen fixed-shape ({attention})",
                              lambda fid=fid, fcu=fcu: target.hidden_states_packed(fid, fcu), proj_flops, real, {})
                rows[-1]["max_rel_err_vs_padded"] = round(worst_doc_error(out[0][:real]), 5)
        except Exception as exc:  # noqa: BLE001 - one candidate failing must not lose the others' figures
            print(f"project varlen ({attention}): FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            rows.append({"phase": f"project varlen ({attention})", "error": f"{type(exc).__name__}: {exc}"[:500]})
    if args.fused:
        from dflash import target_fusion

        fusion = target_fusion.fuse(model)
        print(target_fusion.describe(fusion), flush=True)
        host = prepare_buffer(corpus, pieces, n_budget, "varlen")
        assert host.packed_ids is not None and host.cu_seqlens is not None
        attention = args.attention[-1]
        try:
            model.set_attn_implementation(register_varlen_attention() if attention == "varlen" else "sdpa")

            def fused(pid: torch.Tensor = host.packed_ids, cu: torch.Tensor = host.cu_seqlens) -> Any:
                with fusion.on():
                    return target.hidden_states_packed(pid, cu)

            t0 = time.perf_counter()
            fused()  # the compile, outside the timing (measure's warm-up would hide it)
            compile_s = time.perf_counter() - t0
            out = measure(f"project varlen fused ({attention})", fused, proj_flops, real,
                          {"compile_s": round(compile_s, 1), "checked": fusion.checked, "refused": fusion.refused})
            rows[-1]["max_rel_err_vs_padded"] = round(worst_doc_error(out[0]), 5)
        except Exception as exc:  # noqa: BLE001 - as above
            print(f"project varlen fused ({attention}): FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            rows.append({"phase": f"project varlen fused ({attention})",
                         "error": f"{type(exc).__name__}: {exc}"[:500]})
        target_fusion.unfuse(model)
    model.set_attn_implementation("sdpa")
    refs.clear()  # 1-2 GB at the 27B shape

    def hf(i: torch.Tensor, a: torch.Tensor | None) -> Any:
        with torch.inference_mode():
            return model(input_ids=i, attention_mask=a, use_cache=False).logits

    def hf_body(i: torch.Tensor, a: torch.Tensor | None) -> Any:
        with torch.inference_mode():
            return model.get_decoder()(input_ids=i, attention_mask=a, use_cache=False).last_hidden_state

    full = target_forward_flops(costs, lengths, all_layers, hidden, vocab, lm_head=True).total
    body = target_forward_flops(costs, lengths, all_layers).total
    def measure_hf(name: str, fn: Callable[[], Any], flops: float, tokens: int) -> None:
        """A plain-transformers row that does not fit the card (the 27B-like shape's 15.6 GiB of logits on an H100)
        is an error row, and the rows after it still run: the summary compares against the rows that fit."""
        try:
            measure(name, fn, flops, tokens, {"layers": all_layers})
        except torch.OutOfMemoryError as exc:
            first = str(exc).split(". Including")[0][:200]
            print(f"{name:34} out of memory ({first})", flush=True)
            rows.append({"phase": name, "error": f"OutOfMemoryError: {first}"})
            gc.collect()
            torch.cuda.empty_cache()

    measure_hf("hf padded docs (+LM head)", lambda: hf(ids_d, att_d), full, real)
    measure_hf("hf padded docs (decoder only)", lambda: hf_body(ids_d, att_d), body, real)
    for r, t in args.rows:
        dense = torch.randint(0, cfg.data.vocab_size, (r, t), device=device)
        f = target_forward_flops(costs, [t] * r, all_layers, hidden, vocab, lm_head=True).total
        fb = target_forward_flops(costs, [t] * r, all_layers).total
        measure_hf(f"hf {r}x{t} (+LM head)", lambda d=dense: hf(d, None), f, r * t)
        measure_hf(f"hf {r}x{t} (decoder only)", lambda d=dense: hf_body(d, None), fb, r * t)
    summary = summarize(rows)
    docs = (f"{summary['ratio_vs_hf_padded_docs']}x" if summary["ratio_vs_hf_padded_docs"] is not None
            else "(its padded-documents row did not run)")
    print(f"\nbest project row {summary['best_project']}: {summary['best_project_tok_per_s']} tok/s = {docs} plain "
          f"transformers on the same documents, {summary['ratio_vs_best_hf']}x its best row ({summary['best_hf']})",
          flush=True)
    return {"config": args.config, "device": dev.name(), "torch": torch.__version__,
            "bf16_matmul_tflops": round(peak, 1), "real_tokens": real, "documents": lengths,
            "layers_run": layers_run, "layers": all_layers, "vocab": vocab, "rows": rows, "summary": summary}


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as exc:  # a bad config or override: its one line, not a traceback
        sys.exit(f"{Path(__file__).name}: {exc}")
