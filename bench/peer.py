"""Side by side with the field's trainers: the same DFlash drafter trained by `speculators` (0.9.0, the vLLM project's
trainer, offline from hidden-state files), by SpecForge (0.2.0, the SGLang project's trainer, its offline DFlash path:
no SGLang) and by dflash, on one target, one data set and equal target tokens, all measured by our exact
teacher-forced tau on the same held-out prompts. --peers picks the peers (default speculators,specforge).

One target and one data set for both: the quality bench's (bench/quality_h200.py: its 170M qwen3_5 target and its
greedy regenerated records, in the same --out, reused when there). Stages, each reusing --out:
  target, data  the quality bench's own stages (pretraining ~300 s, regeneration ~60 s on an H200).
  hs            --peer-records regenerated records spread evenly over the corpus (+ 16 that speculators holds out
                for its own validation split) written as speculators' offline data from our target forward: the `save_to_disk`
                set (input_ids, loss_mask, seq_len) and hidden_states/hs_{i}.safetensors (token_ids int64 [T],
                hidden_states bf16 [T, K+1, H]: the K taps by its layer-id convention (ours + 1), then the last
                layer before the final norm), checked with speculators' own `check_hidden_states` and its dataset
                loader. Its time counts as the peer's cost; its size is reported as GB per million tokens.
  peer          `python -m speculators.train` per seed (train.seed = 0..N-1) on those files, in the peer's Python
                (--peer-python): same drafter shape (layers, heads, head size, MLP, block 16, taps), the same
                records and epochs (so the same target tokens), lr, warm-up and cosine schedule, and anchors per
                token (--anchors per --token-budget tokens, as its 512 per 8192); its own recipe otherwise.
                The same forward also writes SpecForge's files (specforge-data/rows_0-2000/data_{i}.ckpt: one
                torch.save'd dict per training record, input_ids int64 [T], loss_mask int64 [T], hidden_states bf16
                [1, T, K*H], the K taps concatenated, z-lab tap ids), read back by its own OfflineManifestReader and
                DFlash normalizer; each writer is timed on its own (the shared forward counted for both).
                SpecForge: `python -m specforge.cli train -c run.yaml` per seed (training.strategy dflash,
                data.hidden_states_path): same drafter shape (draft.json, a DFlashDraftModel qwen3 config), lr,
                warm-up, cosine, epochs, grad clip, seed and loss_decay_gamma (its default None weights positions
                uniformly); it does not pack, so rows per step = --token-budget / mean record length and anchors per
                row = --anchors / rows (result-peer.json settings.specforge). On CPU (--smoke):
                training.fsdp_sharding NO_SHARD and attention_backend sdpa.
  ours          dflash train per seed on the same records and epochs (the target forward runs inside training).
  convert       each speculators checkpoint into the z-lab layout (dflash/speculators_format.py; its converter goes
                only z-lab -> speculators), passed through `dflash export --check`'s rules against the target; each
                SpecForge checkpoint through `specforge export --to hf` (z-lab names, but block_size only at the top
                level) and dflash/specforge_format.py (block_size into dflash_config, the same check). Seed 0 of each
                is checked against the peer's own model: the same block logits on a training record (float32).
  eval          our exact tau (teacher-forced, bf16) for every drafter at each --blocks size, and prompt lookup's:
                per seed, median and spread; the tau ratio ours/theirs; tokens/s, wall time to the same tokens
                (hidden-state writing included for the peer), peak GPU memory and disk per trainer.
  all           (default) all of them in order, as far as --call-seconds allows (exit 3: run it again).

What cannot be matched, and is stated in result-peer.json's "unmatched": speculators' default optimizer is Muon for
the 2-D weights (AdamW with torch's betas for the rest) where ours is AdamW (0.9, 0.95); its cosine ends at 0 where ours ends at 0.1 x lr; it packs documents into
rows of --token-budget tokens and takes --anchors per row where we fill fixed buffers of that budget; its labels are
the target's argmax (ours: the regenerated tokens; equal here, the records being the target's greedy output); its
position weights are D-PACE (alpha 0.5, its default for DFlash), ours exp(-(k-1)/gamma); it trains from bf16 files
written once, we recompute the target per step. Every drafter layer is full attention on both sides: speculators'
sliding layers count the window from the anchor and run the block causal, which no engine serves (docs/quality.md).
SpecForge's differences are in UNMATCHED_SPECFORGE (result-peer.json "unmatched_specforge").

The peer's Python: a virtual environment with speculators 0.9.0 (`./dev` builds .venv-peer: torch==2.13.0 and
speculators==0.9.0 from PyPI, then torchvision/torchaudio removed: transformers imports torchvision when present and
PyPI's fails beside that torch). On the GPU machine (no index there) the wheels carried in a git-ignored folder,
installed with --no-deps into a --target directory added to PYTHONPATH: speculators 0.9.0, hs-connectors 0.9.0,
datasets 5.1.0 (pyarrow is there already), dill, multiprocess, xxhash, fsspec, pandas, python-dateutil, tzdata, loguru 0.7.3,
pydantic-settings, python-dotenv, typer, click, shellingham, annotated-doc, openai, httpx, httpcore, h11, anyio,
sniffio, distro, jiter, httpx2, httpcore2, truststore, aiohttp and its parts (aiohappyeyeballs, aiosignal, attrs, frozenlist, multidict, propcache,
yarl), psutil, rich, markdown-it-py, mdurl, pygments, and for SpecForge specforge 0.2.0 and accelerate 1.16.0
(bench/peer_wheels.sh downloads the set for Python 3.12). SpecForge goes in with --no-deps everywhere (`./dev` puts it
in .venv-peer beside speculators, whose transformers and torch it runs on): it pins sglang==0.5.14 and torch==2.11.0,
which its offline path never imports.

Run: `python3 bench/peer.py --out DIR` until it exits 0 (each call within --call-seconds, 540 on a GPU); `--smoke`
runs the whole pipeline at toy sizes on CPU (plumbing, the format round trips, the reverse conversion; the test suite
runs it). Exit codes: 0 done, 1 a trainer or check failed, 2 bad input, 3 not finished within --call-seconds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

T_START = time.perf_counter()

import torch  # noqa: E402 - after the clock starts

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import quality_h200 as qb  # noqa: E402 - the shared target and data

STAGES = ("all", "target", "data", "hs", "peer", "ours", "convert", "eval")
PEERS = ("speculators", "specforge")
VAL_RECORDS = 16  # speculators always holds a validation split out (train_data_ratio must be < 1)

# Runs `python -m speculators.train ARGS` and records the process's peak GPU memory and wall time to a JSON file.
LAUNCHER = """
import atexit, json, runpy, sys, time
out = sys.argv[1]
sys.argv = ["speculators.train", *sys.argv[2:]]
t0 = time.time()
import torch
if not torch.cuda.is_available():
    # CPU stand-in for the GPU its trainer assumes (the --smoke run in the test suite; never on a GPU): the trainer
    # moves model and batches to `get_local_rank()` (0 = cuda:0) and synchronises the accelerator around steps; on
    # CPU the device is "cpu" and there is nothing to synchronise. Nothing else of its code path changes.
    import speculators.train.trainer as _trainer
    _trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *a, **k: None
def _done():
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    open(out, "w").write(json.dumps({"peak_bytes": peak, "seconds": time.time() - t0}))
atexit.register(_done)
runpy.run_module("speculators.train", run_name="__main__")
"""

# Speculators' own checks on the written files, in its Python: check_hidden_states on every file and its
# ArrowDataset on a few items (what its trainer reads).
VALIDATOR = """
import json, sys
from pathlib import Path
from safetensors.torch import load_file
from speculators.data_generation.offline import check_hidden_states
from speculators.train.data import ArrowDataset
d = Path(sys.argv[1]); n = int(sys.argv[2]); ratio = float(sys.argv[3])
from datasets import load_from_disk
ds = load_from_disk(str(d))
for i in range(len(ds)):
    check_hidden_states(load_file(str(d / "hidden_states" / f"hs_{i}.safetensors")), ds[i]["input_ids"].tolist())
train = ArrowDataset(max_len=100000, datapath=str(d), on_missing="raise", train_ratio=ratio, split="train")
val = ArrowDataset(max_len=100000, datapath=str(d), on_missing="raise", train_ratio=ratio, split="val")
item = train[0]
print(json.dumps({"files_checked": len(ds), "train": len(train), "val": len(val),
                  "item_keys": sorted(item), "hidden": list(item["hidden_states"].shape)}))
"""


# speculators' own DFlashDraftModel on one record of its training files, at given anchors: its block logits (the
# round trip's reference: the converted export, loaded by dflash, must give the same). Float32, eager attention masks.
PARITY = """
import json, sys, torch
from safetensors.torch import load_file
from torch.nn.attention.flex_attention import create_mask
import speculators.models.dflash.core as core
from speculators.models.dflash import DFlashDraftModel
src, hs_path, anchors, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
model = DFlashDraftModel.from_pretrained(src).float().eval()
model.config.transformer_layer_config._attn_implementation = "sdpa"
model._create_mask_fn = create_mask
a = torch.tensor(anchors)
core.select_anchors = lambda loss_mask, n, b: (a, torch.ones(len(anchors), dtype=torch.bool))
f = load_file(hs_path)
ids, hs = f["token_ids"][None], f["hidden_states"].float()
t = ids.shape[1]
with torch.no_grad():
    _, logits, _, _, _ = model._backbone_forward(hs[:, :-1].flatten(1)[None], ids, torch.ones(1, t), hs[:, -1][None],
                                                  torch.zeros(1, t, dtype=torch.long), max_anchors=len(anchors))
torch.save(logits[0].float(), out)
"""


# Runs `python -m specforge.cli ARGS` (`specforge train -c run.yaml ...` or `specforge export ...`) in this process and
# records its peak GPU memory and wall time to a JSON file. Its offline path ("local_colocated", features on disk) runs
# as this one worker process: no SGLang, no torchrun (its launch plan for it is {"kind": "worker", "commands": []}).
SF_LAUNCHER = """
import atexit, json, runpy, sys, time
out = sys.argv[1]
sys.argv = ["specforge", *sys.argv[2:]]
t0 = time.time()
import torch
def _done():
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    open(out, "w").write(json.dumps({"peak_bytes": peak, "seconds": time.time() - t0}))
atexit.register(_done)
runpy.run_module("specforge.cli", run_name="__main__")
"""

# SpecForge's own reader on the written files, in its Python: its OfflineManifestReader with the eager per-file check
# (what its trainer lists) and its DFlash normalizer on every file (what its loader feeds the model).
SF_VALIDATOR = """
import json, os, sys
os.environ["SPECFORGE_VALIDATE_OFFLINE_FEATURES"] = "1"
from specforge.algorithms.common.dflash_family_data import build_offline_reader, normalize_offline_sample
from specforge.runtime.data_plane.feature_store import load_feature_file
d, max_len = sys.argv[1], int(sys.argv[2])
refs = build_offline_reader("dflash", d, run_id="check", ttt_length=1, max_len=max_len).read()
widths, tokens = set(), 0
for ref in refs:
    s = normalize_offline_sample(load_feature_file(ref.feature_store_uri[len("file://"):]), max_len)
    widths.add(int(s["hidden_states"].shape[-1])); tokens += int(s["input_ids"].shape[1])
print(json.dumps({"files": len(refs), "tokens": tokens, "reader_tokens": sum(r.num_tokens for r in refs),
                  "hidden_widths": sorted(widths), "keys": sorted(refs[0].feature_keys)}))
"""

# SpecForge's own DFlash model (specforge.modeling.draft.dflash, loaded from its HF export) inside its own training
# wrapper (OnlineDFlashModel: noise embedding, positions, block mask) on one training file at given anchors: its block
# logits, the round trip's reference. Float32, its sdpa mask.
SF_PARITY = """
import json, sys, torch
from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
from specforge.modeling.draft.dflash import DFlashDraftModel
from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead
from specforge.runtime.data_plane.feature_store import load_feature_file
src, target, feat, anchors, out, ekey, hkey = sys.argv[1:8]
anchors = json.loads(anchors)
draft = DFlashDraftModel.from_pretrained(src, dtype=torch.float32).eval()
draft.config._attn_implementation = "sdpa"
parts = TargetEmbeddingsAndHead.from_pretrained(target, embed_key=ekey, lm_head_key=hkey, device="cpu",
                                                dtype=torch.float32)
m = OnlineDFlashModel(draft, parts.lm_head, parts.embed_tokens, mask_token_id=int(draft.mask_token_id),
                      block_size=int(draft.block_size), attention_backend="sdpa").float().eval()
a = torch.tensor([anchors])
m._sample_anchor_positions = lambda seq_len, loss_mask, device: (a, torch.ones_like(a, dtype=torch.bool))
f = load_feature_file(feat)
with torch.no_grad():
    _, _, h = m._forward_draft_blocks(f["input_ids"][None], f["hidden_states"].float(), f["loss_mask"][None])
    logits = m.lm_head(h)
torch.save(logits[0].float(), out)  # [A*B, V], as dflash's block_states + head
"""


def parse_overrides(spec: str) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """`NAME=section.key:value+section.key:value;NAME2=...` -> [(name, {section: {key: value}})]: values read as
    YAML scalars (so 0.5, true, dpace). Each variant is one of our drafters with those config fields changed."""
    import yaml

    out: list[tuple[str, dict[str, dict[str, Any]]]] = []
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        name, _, body = item.partition("=")
        if not name.isidentifier() or not body:
            raise SystemExit(f"--ours-variants: expected NAME=section.key:value[+...], got {item!r}")
        changes: dict[str, dict[str, Any]] = {}
        for part in body.split("+"):
            key, sep, value = part.partition(":")
            section, dot, field = key.partition(".")
            if not (sep and dot and section in ("drafter", "train", "data", "target")):
                raise SystemExit(f"--ours-variants {name}: expected section.key:value, got {part!r}")
            changes.setdefault(section, {})[field] = yaml.safe_load(value)
        out.append((name, changes))
    return out


def spread_indices(total: int, want: int) -> list[int]:
    """`want` indices evenly spaced over `total` records, in order. The records are in corpus order (regen writes
    them so), and the held-out prompts come from every 20th file of the whole corpus: the first N records would be
    the first files only (the 2026-12-07 H100 run took the first 4096 of 16,380, a quarter of the corpus)."""
    if want >= total:
        return list(range(total))
    return [int((i + 0.5) * total / want) for i in range(want)]


def gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / 2**30, 3)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def median_spread(values: list[float | None]) -> dict[str, Any]:
    return qb.median_spread(values)


# What cannot be matched between SpecForge 0.2.0's offline DFlash recipe and ours (result-peer.json
# "unmatched_specforge"); everything else is set to ours in its run config (PeerBench.sf_run).
UNMATCHED_SPECFORGE = [
    "optimizer: specforge AdamW with torch's defaults (betas 0.9, 0.999, weight decay 0) over fp32 master copies of "
    "bf16 weights (no setting changes them); ours AdamW (0.9, 0.95), weight decay 0.01",
    "cosine floor: specforge 0, ours 0.1 x lr",
    "packing: specforge pads batch_size rows (one record each; no packing) with num_anchors per row, matched in "
    "expectation (settings.specforge: rows = token_budget / mean record length, anchors per row = anchors / rows); "
    "ours fixed buffers of token_budget tokens with anchors per buffer",
    "epoch ends: specforge drops each epoch's last partial batch (drop_last), up to batch_size - 1 records",
    "anchors: specforge samples them where the token and the next are both supervised, at most num_anchors per row",
    "hidden states: specforge bf16 files written once (the K taps concatenated); ours the target recomputed per step",
]


class PeerBench(qb.Bench):
    """The quality bench's target and data, then the peer's and our drafters on a subset of its records."""

    def __init__(self, args: Any, work: Path, dev: torch.device) -> None:
        super().__init__(args, work, dev)
        self.peer_dir = work / "peer"
        self.records_n = 48 if self.smoke else args.peer_records
        self.epochs = 2 if self.smoke else args.peer_epochs
        self.budget = 1024 if self.smoke else args.token_budget
        self.anchors_n = 64 if self.smoke else args.anchors
        self.peer_python = args.peer_python
        self.layers = 1 if self.smoke else args.drafter_layers
        self.variants_ours = parse_overrides(args.ours_variants)
        self.peers = [p for p in PEERS if p in args.peers.split(",")]

    # --- bookkeeping: the peer's units and their H200-sized guesses (replaced by times measured in this --out)

    def estimate(self, kind: str) -> float:
        seen = [u["seconds"] for k, u in self.state["units"].items() if k.startswith(kind + "/")]
        if seen:
            return float(max(seen))
        if self.dev.type != "cuda":
            return 0.0
        if kind in ("pretrain", "regen", "drafter", "eval", "check"):
            return super().estimate(kind)
        tokens = self.records_n * self.max_len * self.epochs
        return {"hs": 30 + self.records_n * 0.01, "peer": 60 + tokens / 60_000, "specforge": 60 + tokens / 60_000,
                "ours": 60 + tokens / 100_000, "convert": 10, "peer_eval": 30 + 6 * len(self.blocks)}[kind]

    # --- layout

    def subset_dir(self) -> Path:
        return self.peer_dir / "records"

    def hs_dir(self) -> Path:
        return self.peer_dir / "speculators-data"

    def ours_dir(self, seed: int, variant: str = "") -> Path:
        return self.peer_dir / (f"ours-{variant}-seed{seed}" if variant else f"ours-seed{seed}")

    def theirs_dir(self, seed: int) -> Path:
        return self.peer_dir / f"speculators-seed{seed}"

    def converted_dir(self, seed: int) -> Path:
        return self.peer_dir / f"speculators-seed{seed}-zlab"

    def sf_data_dir(self) -> Path:
        return self.peer_dir / "specforge-data"

    def sf_dir(self, seed: int) -> Path:
        return self.peer_dir / f"specforge-seed{seed}"

    def sf_converted_dir(self, seed: int) -> Path:
        return self.peer_dir / f"specforge-seed{seed}-zlab"

    def taps(self) -> list[int]:
        """Our tap layers for this target and drafter depth (z-lab ids: hidden_states[id + 1])."""
        from dflash.target import resolve_tap_layers

        arch = self.base["target"]["arch"]
        return resolve_tap_layers(None, int(arch["num_hidden_layers"]), self.layers)

    def records(self) -> list[dict[str, Any]]:
        path = self.regen_dir(0) / "regen.jsonl"
        if not path.is_file():
            raise qb.Refused(f"{path}: no regenerated records yet; run --stage data first")
        lines = path.read_text().splitlines()
        want = self.records_n + VAL_RECORDS
        if len(lines) < want:
            raise qb.Refused(f"{path}: {len(lines)} records, fewer than --peer-records {self.records_n} + "
                             f"{VAL_RECORDS} held out by speculators")
        return [json.loads(lines[i]) for i in spread_indices(len(lines), want)]

    def peer_state(self) -> dict[str, Any]:
        return self.state.setdefault("peer", {})

    # --- stages

    def stage_hs(self) -> int:
        """The training subset for both trainers, and each selected peer's offline files, all written from one target
        forward pass: each writer is timed on its own, and its time (plus the shared forward) is its peer's cost."""
        from dflash.specforge_format import write_ckpt_file
        from dflash.speculators_format import write_dataset, write_hs_file

        done = self.peer_state().get("hs")
        fresh = not (done and done.get("records") == self.records_n and done.get("selection") == "spread")
        need_spec = "speculators" in self.peers and (fresh or "bytes" not in done or not self.hs_dir().is_dir())
        sf_done = self.peer_state().get("hs_specforge")
        need_sf = "specforge" in self.peers and (fresh or not sf_done or not self.sf_data_dir().is_dir())
        if not (fresh or need_spec or need_sf):
            return 0
        if not self.may_start("hs", "writing the peers' hidden-state files"):
            return 3
        t0 = time.perf_counter()
        recs = self.records()
        import shutil

        hs = self.hs_dir()
        sf = self.sf_data_dir()
        if fresh:
            # Our trainer's copy: the same records_n regenerated records, pinned by the same regen manifest.
            sub = self.subset_dir()
            sub.mkdir(parents=True, exist_ok=True)
            (sub / "regen.jsonl").write_text("".join(json.dumps(r, separators=(",", ":")) + "\n"
                                                     for r in recs[: self.records_n]))
            (sub / "regen.json").write_bytes((self.regen_dir(0) / "regen.json").read_bytes())
            tok_src = self.regen_dir(0) / "tokenizer"  # the manifest names it relative to itself, pinned by its hash
            if tok_src.is_dir() and not (sub / "tokenizer").exists():
                shutil.copytree(tok_src, sub / "tokenizer")
            # New training records: every drafter trained on the old ones is stale (our own outputs under --out).
            stale = [hs, sf, *self.peer_dir.glob("speculators-seed*"), *self.peer_dir.glob("specforge-seed*"),
                     *self.peer_dir.glob("ours-*seed*")]
        else:  # the same records: only the missing peer's files are written, nothing trained is stale
            stale = [d for d, need in ((hs, need_spec), (sf, need_sf)) if need]
        for d in stale:
            if d.is_dir():
                shutil.rmtree(d)  # our own output directory under --out, rewritten whole
        # Speculators' copy: records_n for training + VAL_RECORDS its loader splits off for validation. SpecForge's:
        # the records_n training records only (it has no validation split of its own).
        todo = recs if need_spec else recs[: self.records_n]
        t1 = time.perf_counter()
        model = self.load_hf_target()
        taps = self.taps()
        layers = model.model.layers
        grabbed: dict[int, torch.Tensor] = {}
        hooks = [layers[i].register_forward_hook(lambda _m, _a, out, i=i: grabbed.__setitem__(
            i, out[0] if isinstance(out, tuple) else out)) for i in [*taps, len(layers) - 1]]
        written = sf_written = tokens = sf_tokens = 0
        t_spec = t_sf = 0.0
        order = sorted(range(len(todo)), key=lambda i: len(todo[i]["input_ids"]))
        batch = 8 if self.smoke else 64
        with torch.no_grad():
            for s in range(0, len(order), batch):
                idx = order[s: s + batch]
                lens = [len(todo[i]["input_ids"]) for i in idx]
                width = max(lens)
                ids = torch.zeros(len(idx), width, dtype=torch.long)
                att = torch.zeros(len(idx), width, dtype=torch.long)
                for r, i in enumerate(idx):  # right padding: a causal target's earlier positions never see it
                    ids[r, : lens[r]] = torch.tensor(todo[i]["input_ids"])
                    att[r, : lens[r]] = 1
                model(input_ids=ids.to(self.dev), attention_mask=att.to(self.dev), use_cache=False)
                stack = torch.stack([grabbed[i] for i in [*taps, len(layers) - 1]], dim=2)  # [b, T, K+1, H]
                if self.dev.type == "cuda":
                    torch.cuda.synchronize()  # the forward is shared: neither writer's clock may absorb it
                tokens += sum(lens)
                if need_spec:
                    tw = time.perf_counter()
                    for r, i in enumerate(idx):
                        written += write_hs_file(hs, i, ids[r, : lens[r]].clone(), stack[r, : lens[r]])
                    t_spec += time.perf_counter() - tw
                if need_sf:
                    tw = time.perf_counter()
                    for r, i in enumerate(idx):
                        if i < self.records_n:  # the K taps concatenated on the last axis: [T, K*H]
                            sf_written += write_ckpt_file(sf, i, ids[r, : lens[r]].clone(),
                                                          torch.tensor(todo[i]["loss_mask"]),
                                                          stack[r, : lens[r], : len(taps)].flatten(1))
                            sf_tokens += lens[r]
                    t_sf += time.perf_counter() - tw
        for h in hooks:
            h.remove()
        shared = time.perf_counter() - t1 - t_spec - t_sf  # target load + forward passes
        train_tokens = sum(len(r["input_ids"]) for r in recs[: self.records_n])
        ratio = (self.records_n + 0.5) / (self.records_n + VAL_RECORDS)
        info: dict[str, Any] = {"records": self.records_n, "selection": "spread", "val_records": VAL_RECORDS,
                                "train_ratio": ratio, "train_tokens": train_tokens, "taps_zlab": taps}
        c_spec = c_sf = 0.0
        if need_spec:
            tw = time.perf_counter()
            write_dataset(hs, recs)
            t_spec += time.perf_counter() - tw
            tc = time.perf_counter()
            check = self.run_peer([self.peer_python, "-c", VALIDATOR, str(hs),
                                   str(len(recs)), repr(ratio)], "speculators' checks of the written files")
            c_spec = time.perf_counter() - tc
            spec_check = json.loads(check.strip().splitlines()[-1])
            if spec_check["train"] != self.records_n:
                raise qb.Refused(f"speculators' loader split {spec_check['train']} training records, not "
                                 f"{self.records_n}")
            info.update({"tokens": tokens, "bytes": written,
                         "gb_per_million_tokens": round(written / 1e9 / (tokens / 1e6), 3),
                         "write_seconds": round(shared + t_spec, 1), "speculators_check": spec_check,
                         "aux_ids_speculators": [t + 1 for t in taps]})
        elif not fresh:
            info = done
        self.peer_state()["hs"] = info
        if need_sf:
            max_len = max(len(r["input_ids"]) for r in recs[: self.records_n])
            tc = time.perf_counter()
            out = self.run_peer([self.peer_python, "-c", SF_VALIDATOR, str(sf), str(max_len)],
                                "specforge's reader on the written files")
            c_sf = time.perf_counter() - tc
            sf_check = json.loads(out.strip().splitlines()[-1])
            if sf_check["files"] != self.records_n or sf_check["tokens"] != sf_tokens:
                raise qb.Refused(f"specforge's reader found {sf_check['files']} files / {sf_check['tokens']} tokens, "
                                 f"not {self.records_n} / {sf_tokens}")
            self.peer_state()["hs_specforge"] = {
                "records": self.records_n, "tokens": sf_tokens, "max_len": max_len, "bytes": sf_written,
                "gb_per_million_tokens": round(sf_written / 1e9 / (sf_tokens / 1e6), 3),
                "write_seconds": round(shared + t_sf, 1), "specforge_check": sf_check, "taps_zlab": taps}
        total = time.perf_counter() - t0
        # each peer's unit: the whole stage less the other peer's writer and check
        if need_spec:
            self.record("hs", "all", total - t_sf - c_sf)
        if need_sf:
            self.record("hs", "specforge", total - t_spec - c_spec)
        self.save_state()
        if need_spec:
            print(f"hs: {len(recs)} records, {tokens} tokens, {written / 1e9:.3f} GB "
                  f"({info['gb_per_million_tokens']} GB per million tokens) in {info['write_seconds']:.1f}s; "
                  f"speculators' checks: {info['speculators_check']}", flush=True)
        if need_sf:
            sfi = self.peer_state()["hs_specforge"]
            print(f"hs specforge: {self.records_n} records, {sf_tokens} tokens, {sf_written / 1e9:.3f} GB "
                  f"({sfi['gb_per_million_tokens']} GB per million tokens) in {sfi['write_seconds']:.1f}s; "
                  f"specforge's reader: {sfi['specforge_check']}", flush=True)
        self.stage("hs", t0)
        return 0

    def load_hf_target(self) -> Any:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(self.target_dir(0)), dtype=torch.bfloat16, use_kernels=False)
        return model.to(self.dev).eval()

    def run_peer(self, argv: list[str], what: str, log: Path | None = None) -> str:
        env = dict(os.environ)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("w") as fh:
                r = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)
            text = log.read_text()
        else:
            p = subprocess.run(argv, capture_output=True, text=True, env=env)
            r, text = p, p.stdout + p.stderr
        if r.returncode != 0:
            tail = "\n".join(text.splitlines()[-25:])
            raise PeerFailed(f"{what}: exit {r.returncode}\n{tail}")
        return text

    def draft_config(self) -> dict[str, Any]:
        """The drafter shape as a qwen3 config for speculators' --draft-config (every layer full attention)."""
        d = self.base["drafter"]
        hidden = int(self.base["target"]["arch"]["hidden_size"])
        heads = int(d["num_heads"])
        return {"model_type": "qwen3", "hidden_size": hidden, "intermediate_size": 3 * hidden,
                "num_hidden_layers": self.layers, "num_attention_heads": heads,
                "num_key_value_heads": int(d["num_kv_heads"]), "head_dim": hidden // heads, "hidden_act": "silu",
                "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
                "vocab_size": self.tok.vocab_size, "max_position_embeddings": 4096, "attention_bias": False,
                "layer_types": ["full_attention"] * self.layers, "sliding_window": None, "use_sliding_window": False,
                "tie_word_embeddings": False}

    def mask_token_id(self) -> int:
        from dflash.config import config_from_dict

        cfg = config_from_dict(self.ours_run(0), "<peer>")
        mask = cfg.drafter.mask_token_id
        return int(mask if mask is not None else self.tok.mask_token_id)

    def stage_peer(self) -> int:
        """Each selected peer's drafters, one per seed: speculators', then SpecForge's."""
        for run in ([self.stage_speculators] if "speculators" in self.peers else []) + \
                ([self.stage_specforge] if "specforge" in self.peers else []):
            rc = run()
            if rc != 0:
                return rc
        return 0

    def target_keys(self) -> tuple[str, str]:
        """The target's embedding and LM head names in its safetensors (SpecForge loads only those two tensors)."""
        import struct

        names: list[str] = []
        for f in sorted(self.target_dir(0).glob("*.safetensors")):
            with f.open("rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                names += [k for k in json.loads(fh.read(n)) if k != "__metadata__"]
        embed = next((k for k in sorted(names, key=len) if k.endswith("embed_tokens.weight")), None)
        if embed is None:
            raise qb.Refused(f"{self.target_dir(0)}: no *embed_tokens.weight in its safetensors")
        head = next((k for k in sorted(names, key=len) if k.endswith("lm_head.weight")), "lm_head.weight")
        return embed, head  # a tied target has no lm_head: SpecForge then reuses the embedding (tie_word_embeddings)

    def sf_shape(self) -> dict[str, Any]:
        """SpecForge does not pack: a step is batch_size padded rows with num_anchors per row. Matched to ours in
        expectation: rows per step = token budget / mean record length, anchors per row = anchors per step / rows."""
        hs = self.peer_state()["hs"]
        mean = hs["train_tokens"] / self.records_n
        rows = max(1, round(self.budget / mean))
        return {"mean_record_tokens": round(mean, 1), "batch_size": rows,
                "num_anchors": max(1, round(self.anchors_n / rows)),
                "max_length": self.peer_state()["hs_specforge"]["max_len"]}

    def sf_draft_config(self) -> dict[str, Any]:
        """The drafter shape (draft_config's qwen3 config) as SpecForge's DFlashDraftModel config: our taps (z-lab
        ids, as its own), our mask token, block 16, every layer full attention."""
        cfg = self.draft_config()
        return {**cfg, "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
                "rope_theta": cfg["rope_parameters"]["rope_theta"],
                "num_target_layers": int(self.base["target"]["arch"]["num_hidden_layers"]),
                "block_size": self.b_train,
                "dflash_config": {"target_layer_ids": self.taps(), "mask_token_id": self.mask_token_id()}}

    def sf_run(self, seed: int) -> dict[str, Any]:
        """SpecForge's run config (its `specforge train -c` YAML): our lr, warm-up fraction, cosine, epochs, grad
        clip, position decay gamma (its default, None, weights every position alike) and seed; anchors per token as
        sf_shape. On CPU (--smoke) its two needed changes: no FSDP sharding (NO_SHARD) and sdpa for flex attention."""
        shape = self.sf_shape()
        ours = self.ours_run(seed)
        d = self.sf_dir(seed)
        embed, head = self.target_keys()
        cpu = self.dev.type != "cuda"
        return {
            "model": {"target_model_path": str(self.target_dir(0)), "draft_model_config": str(d / "draft.json"),
                      "mask_token_id": self.mask_token_id(), "embedding_key": embed, "lm_head_key": head,
                      "torch_dtype": "bfloat16"},
            "data": {"hidden_states_path": str(self.sf_data_dir()), "max_length": shape["max_length"],
                     "cache_dir": str(d / "cache"), "dataloader_num_workers": 0 if cpu else 4},
            "training": {"strategy": "dflash", "num_epochs": self.epochs, "batch_size": shape["batch_size"],
                         "learning_rate": float(self.base["train"]["lr"]), "lr_scheduler": "cosine",
                         "warmup_ratio": float(self.base["train"]["warmup_frac"]),
                         "max_grad_norm": float(ours["train"].get("grad_clip", 1.0)),
                         "attention_backend": "sdpa" if cpu else "flex_attention",
                         "fsdp_sharding": "NO_SHARD" if cpu else "SHARD_GRAD_OP",
                         "num_anchors": shape["num_anchors"], "loss_type": "dflash",
                         "loss_decay_gamma": float(ours["drafter"]["loss_gamma"]),
                         "save_interval": 0, "log_interval": 10, "seed": seed},
            "run_id": f"specforge-seed{seed}",
            "output_dir": str(d / "out"),
        }

    def stage_specforge(self) -> int:
        """`specforge train -c run.yaml` per seed in the peer's Python, offline from the .ckpt files."""
        import yaml

        if self.peer_state().get("hs_specforge") is None:
            raise qb.Refused("no specforge data yet; run --stage hs first")
        for k in self.seeds:
            d = self.sf_dir(k)
            if self.sf_checkpoint(k) is not None and (d / "bench-peak.json").is_file():
                continue
            if not self.may_start("specforge", f"specforge seed {k}"):
                return 3
            t0 = time.perf_counter()
            if d.is_dir():
                import shutil

                shutil.rmtree(d)  # our own output under --out: a run cut short, trained again from its start
            d.mkdir(parents=True)
            (d / "draft.json").write_text(json.dumps(self.sf_draft_config(), indent=2) + "\n")
            (d / "run.yaml").write_text(yaml.safe_dump(self.sf_run(k), sort_keys=False))
            self.run_peer([self.peer_python, "-c", SF_LAUNCHER, str(d / "bench-peak.json"), "train", "-c",
                           str(d / "run.yaml")], f"specforge seed {k}", d / "train.log")
            if self.sf_checkpoint(k) is None:
                raise PeerFailed(f"specforge seed {k}: no checkpoint under {d / 'out'}; see {d / 'train.log'}")
            self.record_peer_run("specforge", "specforge", k, d, t0, f"; {self.sf_shape()}")
        return 0

    def record_peer_run(self, unit: str, name: str, seed: int, d: Path, t0: float, more: str = "") -> None:
        """A peer trainer's seed done: its launcher's peak memory and training time recorded as unit `unit`."""
        peak = json.loads((d / "bench-peak.json").read_text())
        self.record(unit, f"seed{seed}", time.perf_counter() - t0, peak_bytes=peak["peak_bytes"],
                    train_seconds=peak["seconds"])
        print(f"{name} seed {seed}: trained in {time.perf_counter() - t0:.0f}s (peak "
              f"{gib(peak['peak_bytes'])} GiB{more})", flush=True)
        self.stage(f"{unit}_seed{seed}", t0)

    def sf_checkpoint(self, seed: int) -> Path | None:
        """SpecForge's last checkpoint: output_dir/<run_id>-step<N>/ with training_state.pt (its -latest link)."""
        root = self.sf_dir(seed) / "out"
        steps = sorted((p for p in root.glob(f"specforge-seed{seed}-step*")
                        if p.is_dir() and (p / "training_state.pt").is_file()),
                       key=lambda p: int(p.name.rpartition("step")[2])) if root.is_dir() else []
        return steps[-1] if steps else None

    def stage_speculators(self) -> int:
        """`python -m speculators.train` per seed in the peer's Python, offline from its hidden-state files."""
        hs = self.peer_state().get("hs")
        if hs is None or "aux_ids_speculators" not in hs:
            raise qb.Refused("no speculators data yet; run --stage hs first")
        dcfg = self.peer_dir / "draft-config.json"
        dcfg.write_text(json.dumps(self.draft_config(), indent=2) + "\n")
        for k in self.seeds:
            d = self.theirs_dir(k)
            if self.peer_checkpoint(k) is not None and (d / "bench-peak.json").is_file():
                continue
            if not self.may_start("peer", f"speculators seed {k}"):
                return 3
            t0 = time.perf_counter()
            argv = [self.peer_python, "-c", LAUNCHER, str(d / "bench-peak.json"),
                    "--speculator-type", "dflash", "--seed", str(k),
                    "--verifier-name-or-path", str(self.target_dir(0)), "--draft-config", str(dcfg),
                    "--target-layer-ids", *[str(a) for a in hs["aux_ids_speculators"]],
                    "--mask-token-id", str(self.mask_token_id()), "--block-size", str(self.b_train),
                    "--data-path", str(self.hs_dir()), "--hidden-states-backend", "file", "--on-missing", "raise",
                    "--total-seq-len", str(self.budget), "--max-anchors", str(self.anchors_n),
                    "--train-data-ratio", repr(hs["train_ratio"]), "--hidden-states-dtype", "bfloat16",
                    "--num-workers", "2", "--prefetch-factor", "2",
                    "--lr", repr(self.base["train"]["lr"]), "--scheduler-type", "cosine",
                    "--scheduler-warmup-ratio", repr(self.base["train"]["warmup_frac"]),
                    "--epochs", str(self.epochs), "--save-path", str(d / "checkpoints"), "--log-dir", str(d / "logs"),
                    "--no-resume-from-checkpoint"]
            if self.dev.type == "cuda":
                argv += ["--loss-implementation", self.args.peer_loss]
            else:
                # no Triton (its fused losses), no flex backward and no bf16 autocast on CPU
                argv += ["--loss-implementation", "eager", "--draft-attn-impl", "sdpa"]
                argv[argv.index("--hidden-states-dtype") + 1] = "float32"
            self.run_peer(argv, f"speculators seed {k}", d / "train.log")
            self.record_peer_run("peer", "speculators", k, d, t0)
        return 0

    def peer_checkpoint(self, seed: int) -> Path | None:
        """speculators' last epoch directory (save_path/<epoch>/ with config.json)."""
        root = self.theirs_dir(seed) / "checkpoints"
        if not root.is_dir():
            return None
        epochs = sorted((p for p in root.iterdir() if p.is_dir() and p.name.isdigit() and (p / "config.json").is_file()),
                        key=lambda p: int(p.name))
        return epochs[-1] if epochs else None

    def ours_run(self, seed: int, changes: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        run = self.run_dict(seed, "dense" if self.smoke else self.args.drafter_attention,
                            "false" if self.smoke else self.args.drafter_compile, "pad" if self.smoke else self.args.packing)
        run["data"] = {**run["data"], "paths": [str(self.subset_dir())], "token_budget": self.budget}
        run["drafter"] = {**run["drafter"], "num_layers": self.layers, "num_anchors": self.anchors_n}
        run["target"] = {**run["target"], "tap_layers": self.taps()}
        run["train"] = {**run["train"], "max_steps": None, "epochs": self.epochs, "eval_every": 0}
        for section, fields in (changes or {}).items():
            run[section] = {**run[section], **fields}
        return run

    def our_drafters(self) -> list[tuple[str, int, dict[str, dict[str, Any]]]]:
        """(variant, seed, changes): the default recipe for every seed, each --ours-variants on seed 0."""
        return [("", k, {}) for k in self.seeds] + [(n, self.seeds[0], c) for n, c in self.variants_ours]

    def stage_ours(self) -> int:
        from dflash.config import config_from_dict
        from dflash.train import train

        if not (self.subset_dir() / "regen.jsonl").is_file():
            raise qb.Refused("no training subset yet; run --stage hs first")
        for variant, k, changes in self.our_drafters():
            d = self.ours_dir(k, variant)
            run = self.ours_run(k, changes)
            done = d / "bench-peak.json"
            if done.is_file() and self.ours_checkpoint(k, variant) is not None \
                    and json.loads(done.read_text()).get("run") == json.loads(json.dumps(run)):
                continue
            what = f"dflash seed {k}" + (f" variant {variant}" if variant else "")
            if not self.may_start("ours", what):
                return 3
            t0 = time.perf_counter()
            if self.dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            res = train(config_from_dict(run, f"<peer ours seed {k} {variant}>"), d, fresh=True)
            if res.exit_code != 0:
                raise PeerFailed(f"{what}: training failed (exit {res.exit_code}); see {d}/train.log")
            peak = torch.cuda.max_memory_allocated() if self.dev.type == "cuda" else None
            secs = time.perf_counter() - t0
            done.write_text(json.dumps({"peak_bytes": peak, "seconds": secs, "run": run}, default=str) + "\n")
            self.record("ours", f"seed{k}" + (f"-{variant}" if variant else ""), secs, peak_bytes=peak)
            print(f"{what}: trained in {secs:.0f}s (peak {gib(peak)} GiB)", flush=True)
            self.stage(f"ours_seed{k}" + (f"_{variant}" if variant else ""), t0)
        return 0

    def ours_checkpoint(self, seed: int, variant: str = "") -> Path | None:
        root = self.ours_dir(seed, variant) / "checkpoints"
        steps = sorted(root.glob("step-*"), key=lambda p: int(p.name.split("-")[1])) if root.is_dir() else []
        return steps[-1] if steps else None

    def stage_convert(self) -> int:
        """Each peer's checkpoints into the z-lab layout, each passed through `dflash export --check`'s rules."""
        for run in ([self.convert_speculators] if "speculators" in self.peers else []) + \
                ([self.convert_specforge] if "specforge" in self.peers else []):
            rc = run()
            if rc != 0:
                return rc
        return 0

    def convert_specforge(self) -> int:
        """`specforge export --to hf` (its own exporter: z-lab weight names and target_layer_ids, block_size only at
        the top level), then dflash.specforge_format.specforge_to_zlab (block_size into dflash_config, our modeling
        file, `dflash export --check` against the target)."""
        from dflash.specforge_format import specforge_to_zlab

        for k in self.seeds:
            src = self.sf_checkpoint(k)
            if src is None:
                raise qb.Refused(f"no specforge checkpoint for seed {k}; run --stage peer first")
            dst = self.sf_converted_dir(k)
            marker = dst / "dflash_export.json"
            hf = self.sf_dir(k) / "hf"
            if marker.is_file() and json.loads(marker.read_text()).get("source") == str(hf.resolve()) \
                    and (hf / "source.txt").is_file() and (hf / "source.txt").read_text() == str(src.resolve()):
                continue
            import shutil

            for old in (hf, dst):
                if old.exists():
                    shutil.rmtree(old)  # our own output under --out, from an older checkpoint
            if not self.may_start("convert", f"converting specforge seed {k}"):
                return 3
            t0 = time.perf_counter()
            self.run_peer([self.peer_python, "-m", "specforge.cli", "export", "--to", "hf", "--checkpoint", str(src),
                           "--draft-config", str(self.sf_dir(k) / "draft.json"), "--output-dir", str(hf)],
                          f"specforge export of seed {k}", self.sf_dir(k) / "export.log")
            (hf / "source.txt").write_text(str(src.resolve()))
            specforge_to_zlab(hf, dst, self.target_dir(0))
            self.record("convert", f"specforge-seed{k}", time.perf_counter() - t0)
            print(f"converted {src} -> {hf} (specforge export --to hf) -> {dst} (passes dflash export --check "
                  f"against {self.target_dir(0)})", flush=True)
            if k == self.seeds[0]:
                self.peer_state()["parity_specforge"] = self.parity_specforge(hf, dst)
                self.save_state()
        return 0

    def parity_specforge(self, hf: Path, dst: Path) -> dict[str, Any]:
        """The round trip, measured: SpecForge's own DFlash model (its HF export, in its training wrapper) and
        dflash's loader of the converted export give the same block logits on a training file at the same anchors
        (float32 on the CPU)."""
        from dflash.eval import load_export
        from dflash.model import DraftBatch
        from dflash.specforge_format import ckpt_file

        feat = ckpt_file(self.sf_data_dir(), 0)
        rec = torch.load(feat)
        ids, hs = rec["input_ids"], rec["hidden_states"][0].float()
        t = ids.shape[0]
        anchors = sorted({1, t // 3, t // 2, t - self.b_train - 1})
        ref_path = self.peer_dir / "parity-logits-specforge.pt"
        embed_key, head_key = self.target_keys()
        self.run_peer([self.peer_python, "-c", SF_PARITY, str(hf), str(self.target_dir(0)), str(feat),
                       json.dumps(anchors), str(ref_path), embed_key, head_key], "specforge's model on one record")
        theirs = torch.load(ref_path)
        drafter = load_export(dst).drafter.float()
        from transformers import AutoModelForCausalLM

        # the target's float32 weights, as SpecForge's TargetEmbeddingsAndHead reads them (not peer_heads' bf16 copy
        # on the CPU: its rounding alone is a 3e-4 relative logit difference)
        model = AutoModelForCausalLM.from_pretrained(str(self.target_dir(0)), dtype=torch.float32, use_kernels=False)
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        batch = DraftBatch(hidden=hs, input_ids=ids, loss_mask=torch.ones(t, dtype=torch.bool),
                           position_ids=torch.arange(t), doc_ids=torch.zeros(t, dtype=torch.long))
        with torch.no_grad():
            ours = head(drafter.block_states(batch, embed, torch.tensor(anchors)))
        return compare_block_logits("specforge's model", ours, theirs, anchors)

    def convert_speculators(self) -> int:
        from dflash.speculators_format import speculators_to_zlab

        for k in self.seeds:
            src = self.peer_checkpoint(k)
            if src is None:
                raise qb.Refused(f"no speculators checkpoint for seed {k}; run --stage peer first")
            dst = self.converted_dir(k)
            marker = dst / "dflash_export.json"
            if marker.is_file() and json.loads(marker.read_text()).get("source") == str(src.resolve()):
                continue
            if dst.exists():
                import shutil

                shutil.rmtree(dst)  # our own output under --out, from an older checkpoint
            if not self.may_start("convert", f"converting speculators seed {k}"):
                return 3
            t0 = time.perf_counter()
            speculators_to_zlab(src, dst, self.target_dir(0))
            self.record("convert", f"seed{k}", time.perf_counter() - t0)
            print(f"converted {src} -> {dst} (passes dflash export --check against {self.target_dir(0)})", flush=True)
            if k == self.seeds[0]:
                self.peer_state()["parity"] = self.parity(src, dst)
                self.save_state()
        return 0

    def parity(self, src: Path, dst: Path) -> dict[str, Any]:
        """The round trip, measured: speculators' own model (its checkpoint) and dflash's loader of the converted
        export give the same block logits on a training record at the same anchors (float32 on the CPU)."""
        from safetensors.torch import load_file

        from dflash.eval import load_export
        from dflash.model import DraftBatch
        from dflash.speculators_format import hs_file

        rec = load_file(str(hs_file(self.hs_dir(), 0)))
        ids, hs = rec["token_ids"], rec["hidden_states"].float()
        t = ids.shape[0]
        anchors = sorted({1, t // 3, t // 2, t - self.b_train - 1})
        ref_path = self.peer_dir / "parity-logits.pt"
        self.run_peer([self.peer_python, "-c", PARITY, str(src), str(hs_file(self.hs_dir(), 0)), json.dumps(anchors),
                       str(ref_path)], "speculators' model on one record")
        theirs = torch.load(ref_path)
        loaded = load_export(dst)
        drafter = loaded.drafter.float()
        embed, head = self.peer_heads()
        batch = DraftBatch(hidden=hs[:, :-1].flatten(1), input_ids=ids, loss_mask=torch.ones(t, dtype=torch.bool),
                           position_ids=torch.arange(t), doc_ids=torch.zeros(t, dtype=torch.long))
        with torch.no_grad():
            ours = head(drafter.block_states(batch, embed, torch.tensor(anchors)))
        return compare_block_logits("speculators' model", ours, theirs, anchors)

    def peer_heads(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """The target's embedding and LM head (float32, CPU): what both drafters draft through."""
        model = self.load_hf_target() if self.dev.type == "cpu" else None
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(self.target_dir(0)), dtype=torch.float32,
                                                         use_kernels=False).eval()
        return model.get_input_embeddings().float(), model.get_output_embeddings().float()

    def stage_peer_eval(self) -> int:
        """Our exact tau for every drafter, one at a time: each result is kept in bench-state.json under the
        drafter's checkpoint identity, so a call that runs out of --call-seconds loses nothing and a later call
        with more --ours-variants evaluates only the new drafters."""
        from dflash.eval import evaluate_teacher_forced, greedy_sequences, load_checkpoint, load_export
        from dflash.speculative import TargetLM
        from dflash.target import Target, TargetConfig
        from dflash.tau import continuation_length

        jobs = [("ours" if not v else f"ours-{v}", k) for v, k, _ in self.our_drafters()] + \
            [("theirs", k) for k in self.seeds if "speculators" in self.peers] + \
            [("specforge", k) for k in self.seeds if "specforge" in self.peers]
        cache = self.peer_state().setdefault("eval", {})
        settings = json.dumps({"blocks": self.blocks, "eval": self.eval_settings(), "dtype": self.args.eval_dtype},
                              sort_keys=True, default=str)
        per: dict[str, dict[str, dict[str, Any]]] = {who: {} for who, _ in jobs}
        target = lm_model = seqs = prompts = None
        for who, k in jobs:
            if who.startswith("ours"):
                variant = who.partition("-")[2]
                src = self.ours_checkpoint(k, variant)
                if src is None:
                    raise qb.Refused(f"no dflash checkpoint for seed {k} {variant}; run --stage ours first")
            else:
                src = self.converted_dir(k) if who == "theirs" else self.sf_converted_dir(k)
                if not (src / "config.json").is_file():
                    raise qb.Refused(f"{'speculators' if who == 'theirs' else who} seed {k} not converted; run "
                                     "--stage convert first")
            ident = f"{src}@{src.stat().st_mtime_ns}|{settings}"
            hit = cache.get(f"{who}/{k}")
            if hit is not None and hit.get("ident") == ident:
                per[who][str(k)] = hit["result"]
                continue
            if not self.may_start("peer_eval", f"teacher-forced tau of {who} seed {k}"):
                return 3
            t0 = time.perf_counter()
            if target is None:
                _, prompts = self.heldout_prompts()
                target = Target(TargetConfig(path=str(self.target_dir(0))), 1, self.dev)
                target.model.to(getattr(torch, self.args.eval_dtype))
                lm_model = target.model
            loaded = load_checkpoint(src) if who.startswith("ours") else load_export(src)
            loaded.drafter.to(device=self.dev, dtype=getattr(torch, self.args.eval_dtype))
            lm = TargetLM(lm_model, loaded.tap_layers)
            if seqs is None:
                seqs = greedy_sequences(lm.model, lm.device, prompts,
                                        continuation_length(self.n_new, max(self.blocks)))
            result: dict[str, dict[str, Any]] = {}
            for b in self.blocks:
                import dataclasses

                loaded.drafter.cfg = dataclasses.replace(loaded.drafter.cfg, block_size=b)
                r = evaluate_teacher_forced(lm, loaded.drafter, prompts, self.n_new, [self.tok.eos_id],
                                            baseline_ngram=True, sequences=seqs)
                result[f"B{b}"] = {"tau": r["tau"], "ngram_tau": r["baseline"]["ngram"]["tau"],
                                   "accept_by_position": r.get("accept_by_position")}
                print(f"{who:>6} seed {k} B={b}: tau {qb.num(r['tau'])}  ngram "
                      f"{qb.num(r['baseline']['ngram']['tau'])}", flush=True)
            per[who][str(k)] = result
            cache[f"{who}/{k}"] = {"ident": ident, "result": result}
            self.record("peer_eval", f"{who}-seed{k}", time.perf_counter() - t0)
        out = self.summary(per)
        (self.work / "result-peer.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
        self.print_summary(out)
        return 0

    def cost(self, who: str) -> dict[str, Any]:
        """Trainer `who`'s cost (ours, theirs = speculators, specforge): a peer's wall time includes writing its
        hidden-state files (the shared target forward plus its own writer)."""
        units = self.state["units"]
        hs = self.peer_state().get("hs") or {}
        tokens = hs.get("train_tokens", 0) * self.epochs
        sf = self.peer_state().get("hs_specforge") or {}
        unit = {"theirs": "peer", "ours": "ours", "specforge": "specforge"}[who]
        write = {"theirs": "hs/all", "specforge": "hs/specforge"}.get(who)
        rows = []
        for k in self.seeds:
            u = units.get(f"{unit}/seed{k}") or {}
            secs = u.get("seconds")
            if secs is None:
                continue
            wall = secs + (units.get(write, {}).get("seconds", 0.0) if write else 0.0)
            rows.append({"seed": k, "train_seconds": secs, "wall_seconds": round(wall, 1),
                         "tokens_per_s": round(tokens / secs, 1) if secs else None,
                         "peak_gib": gib(u.get("peak_bytes"))})
        walls = [r["wall_seconds"] for r in rows]
        return {"target_tokens": tokens, "per_seed": rows,
                "wall_seconds_median": statistics.median(walls) if walls else None,
                "tokens_per_s_median": statistics.median([r["tokens_per_s"] for r in rows]) if rows else None,
                "peak_gib_max": max((r["peak_gib"] or 0) for r in rows) if rows else None,
                "disk_gb": round(hs.get("bytes", 0) / 1e9, 3) if who == "theirs" else
                round(sf.get("bytes", 0) / 1e9, 3) if who == "specforge" else round(dir_bytes(self.subset_dir()) / 1e9, 4),
                "hidden_state_write_seconds": hs.get("write_seconds") if who == "theirs" else
                sf.get("write_seconds") if who == "specforge" else None,
                **({"gb_per_million_tokens": (hs if who == "theirs" else sf).get("gb_per_million_tokens")}
                   if who != "ours" else {})}

    def summary(self, per: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
        spec, sf = "speculators" in self.peers, "specforge" in self.peers
        blocks: dict[str, Any] = {}
        for b in self.blocks:
            key = f"B{b}"
            ours = [per["ours"][str(k)][key]["tau"] for k in self.seeds]
            ngram = [per["ours"][str(k)][key]["ngram_tau"] for k in self.seeds]
            mo = median_spread(ours)
            row: dict[str, Any] = {"ours": mo}
            for who, name, on in (("theirs", "tau_ratio", spec), ("specforge", "tau_ratio_specforge", sf)):
                if on:
                    m = median_spread([per[who][str(k)][key]["tau"] for k in self.seeds])
                    row[who] = m
                    row[name] = round(mo["median"] / m["median"], 4) if mo["median"] and m["median"] else None
            blocks[key] = {"ours": mo, **({"theirs": row["theirs"]} if spec else {}), "ngram": median_spread(ngram),
                           **{k: v for k, v in row.items() if k not in ("ours", "theirs")}}
        ablations: dict[str, Any] = {}
        base = per["ours"].get(str(self.seeds[0]), {})
        for name, changes in self.variants_ours:
            row = per.get(f"ours-{name}", {}).get(str(self.seeds[0]), {})
            ablations[name] = {"changes": changes, **{
                key: {"tau": row[key]["tau"], "delta_vs_default_seed": round(row[key]["tau"] - base[key]["tau"], 4)}
                for key in row if key in base and row[key]["tau"] is not None and base[key]["tau"] is not None}}
        co = self.cost("ours")
        costs = {"ours": co, **({"theirs": self.cost("theirs")} if spec else {}),
                 **({"specforge": self.cost("specforge")} if sf else {})}

        def wall_ratio(who: str) -> float | None:
            c = costs.get(who)
            return round(co["wall_seconds_median"] / c["wall_seconds_median"], 4) \
                if c and co["wall_seconds_median"] and c["wall_seconds_median"] else None

        out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "smoke": self.smoke,
               "gpu": torch.cuda.get_device_name(0) if self.dev.type == "cuda" else None,
               "torch": torch.__version__, "peer": "speculators 0.9.0" if spec else None, "peers": self.peers,
               "settings": {"records": self.records_n, "epochs": self.epochs, "token_budget": self.budget,
                            "anchors": self.anchors_n, "drafter": self.draft_config(), "taps_zlab": self.taps(),
                            "lr": self.base["train"]["lr"], "warmup_frac": self.base["train"]["warmup_frac"],
                            "seeds": len(self.seeds), "eval": self.eval_settings(),
                            **({"specforge": self.sf_shape()} if sf else {})},
               "unmatched": ["optimizer: theirs Muon (its default: 2-D weights, match_rms_adamw, weight decay 0.1) "
                             "with AdamW (betas 0.9, 0.999) for the rest; ours AdamW (0.9, 0.95), weight decay 0.01",
                             "cosine floor: theirs 0, ours 0.1 x lr",
                             "position weights: theirs D-PACE (alpha 0.5), ours exp(-(k-1)/7)",
                             "packing: theirs rows of token_budget with anchors per row; ours fixed buffers",
                             "labels: theirs the target's argmax, ours the regenerated tokens (equal for greedy "
                             "regeneration up to bf16 ties)",
                             "hidden states: theirs bf16 files written once; ours the target recomputed per step"],
               "blocks": blocks, "per_seed": per, "ablations": ablations, "cost": costs,
               "wall_ratio": wall_ratio("theirs"), "hs": self.peer_state().get("hs"), "units_s": self.state["units"]}
        if sf:
            out.update({"peer_specforge": "specforge 0.2.0", "unmatched_specforge": UNMATCHED_SPECFORGE,
                        "wall_ratio_specforge": wall_ratio("specforge"),
                        "hs_specforge": self.peer_state().get("hs_specforge"),
                        "parity_specforge": self.peer_state().get("parity_specforge")})
        return out

    @staticmethod
    def print_summary(out: dict[str, Any]) -> None:
        def cell(s: dict[str, Any] | None) -> str:
            return "-" if s is None or s["median"] is None else f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"

        spec, sf = "theirs" in out["cost"], "specforge" in out["cost"]
        print(f"\nexact tau (teacher-forced), median [min-max] over {out['settings']['seeds']} seed(s):")
        print(f"{'B':>4}  {'dflash':<20}{'speculators':<20}" + (f"{'specforge':<20}" if sf else "")
              + f"{'prompt lookup':<20}ratio" + ("  ratio (specforge)" if sf else ""))
        for b, row in out["blocks"].items():
            print(f"{b[1:]:>4}  {cell(row['ours']):<20}{cell(row.get('theirs')):<20}"
                  + (f"{cell(row['specforge']):<20}" if sf else "") + f"{cell(row['ngram']):<20}"
                  f"{row.get('tau_ratio')}" + (f"  {row['tau_ratio_specforge']}" if sf else ""))
        for who in ("ours", "theirs", "specforge"):
            c = out["cost"].get(who)
            if c is None:
                continue
            per_m = f" ({c['gb_per_million_tokens']} GB per million tokens)" if c.get("gb_per_million_tokens") else ""
            print(f"{who:>6}: {c['target_tokens']} target tokens, wall {c['wall_seconds_median']} s (median), "
                  f"{c['tokens_per_s_median']} tok/s, peak {c['peak_gib_max']} GiB, disk {c['disk_gb']} GB" + per_m)
        for name, row in out.get("ablations", {}).items():
            cells = ", ".join(f"{b}: {v['tau']:.2f} ({v['delta_vs_default_seed']:+.2f})" for b, v in row.items()
                              if b.startswith("B"))
            print(f"ablation {name} {row['changes']}: {cells} (seed 0, against the default drafter)")
        b16 = out["blocks"].get("B16") or next(iter(out["blocks"].values()))
        if spec:
            print(f"peer: speculators 0.9.0, bench target, B=16: tau ratio {b16['tau_ratio']} (ours "
                  f"{qb.num(b16['ours']['median'])} / theirs {qb.num(b16['theirs']['median'])}, medians of "
                  f"{out['settings']['seeds']} seeds), wall ratio {out['wall_ratio']} ({out['gpu'] or 'CPU smoke'}, "
                  f"{out['date'][:10]})")
        if sf:
            print(f"peer: specforge 0.2.0, bench target, B=16: tau ratio {b16['tau_ratio_specforge']} (ours "
                  f"{qb.num(b16['ours']['median'])} / specforge {qb.num(b16['specforge']['median'])}, medians of "
                  f"{out['settings']['seeds']} seeds), wall ratio {out['wall_ratio_specforge']} "
                  f"({out['gpu'] or 'CPU smoke'}, {out['date'][:10]})")


class PeerFailed(RuntimeError):
    """A trainer or a check in the peer's Python failed: exit 1 with its output's tail."""


def compare_block_logits(whose: str, ours: torch.Tensor, theirs: torch.Tensor, anchors: list[int]) -> dict[str, Any]:
    """The round trip's verdict: our loader of the converted export against the peer's own model, same blocks;
    PeerFailed above a 1e-3 relative logit difference (a wrong conversion, not rounding)."""
    diff = float((ours - theirs).abs().max())
    rel = float((ours - theirs).norm() / theirs.norm())
    same_argmax = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    print(f"round trip: {whose} vs the converted export in dflash, {len(anchors)} blocks: max |diff| "
          f"{diff:.2e}, relative {rel:.2e}, same argmax {same_argmax:.4f}", flush=True)
    if rel > 1e-3:
        raise PeerFailed(f"the converted export drafts differently from {whose} (relative logit "
                         f"difference {rel:.2e}): the conversion is wrong")
    return {"anchors": anchors, "max_abs_diff": diff, "rel_diff": rel, "same_argmax": same_argmax}


def default_peer_python() -> str:
    local = BENCH.parent / ".venv-peer" / "bin" / "python"
    return str(local) if local.is_file() else sys.executable


def main() -> int:
    ap = qb.build_parser(__doc__, STAGES)
    ap.add_argument("--peer-records", type=int, default=4096,
                    help="regenerated records both trainers train on (N spread evenly over the corpus; speculators' "
                         "files for them take 6.15 GB per million tokens at this target's 3 x 1024 features)")
    ap.add_argument("--peer-epochs", type=int, default=6, help="epochs over those records, both trainers")
    ap.add_argument("--token-budget", type=int, default=16384,
                    help="tokens per step: our buffer, speculators' --total-seq-len (with --anchors per it)")
    ap.add_argument("--ours-variants", default="",
                    help="ablations: more dflash drafters on seed 0, each with config fields changed, "
                         "NAME=section.key:value[+section.key:value] separated by ';' (e.g. "
                         "'dpace=drafter.position_weights:dpace;doc=drafter.anchor_sampling:document'); result-peer.json "
                         "'ablations' gives each one's tau and its difference from the default drafter of seed 0")
    ap.add_argument("--peer-loss", default="fused", choices=["fused", "eager"],
                    help="speculators' --loss-implementation on the GPU (eager: its compatibility path; its fused "
                         "Triton CE failed to compile under torch 2.11's dynamo on an H100, 2026-12-07)")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help="the peer trainers, comma-separated: speculators (0.9.0), specforge (0.2.0, offline DFlash); "
                         "each can be left out")
    ap.add_argument("--peer-python", default=default_peer_python(),
                    help="the Python with speculators and specforge installed (default: .venv-peer's, else this one)")
    args = ap.parse_args()
    smoke = args.smoke
    dev = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    if dev.type != "cuda" and not smoke:
        print("no CUDA device: run with --smoke for a CPU plumbing check", file=sys.stderr)
        return 2
    peers = [p for p in args.peers.split(",") if p]
    if not peers or any(p not in PEERS for p in peers):
        print(f"--peers: a comma-separated subset of {','.join(PEERS)}, got {args.peers!r}", file=sys.stderr)
        return 2
    if args.seeds < 1 or args.peer_records < 1 or args.peer_epochs < 1:
        print("--seeds, --peer-records and --peer-epochs must be at least 1", file=sys.stderr)
        return 2
    from dflash.config import ConfigError
    from dflash.data import DataError
    from dflash.speculators_format import ConvertError

    work = Path(args.out or "peer-out")
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TRITON_CACHE_DIR", str(work / "triton-cache"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor-cache"))
    bench = PeerBench(args, work, dev)
    bench.t_call = T_START
    order = ["target", "data", "hs", "peer", "ours", "convert", "eval"]
    stages = order if args.stage == "all" else [args.stage]
    rc = 0
    try:
        bench.prepare()
        for name in stages:
            rc = {"target": bench.stage_target, "data": bench.stage_data, "hs": bench.stage_hs,
                  "peer": bench.stage_peer, "ours": bench.stage_ours, "convert": bench.stage_convert,
                  "eval": bench.stage_peer_eval}[name]()
            if rc != 0:
                break
    except (qb.Refused, ConfigError, DataError, ConvertError) as exc:
        print(f"refused: {exc}", file=sys.stderr)
        rc = 2
    except PeerFailed as exc:
        print(f"failed: {exc}", file=sys.stderr)
        rc = 1
    finally:
        bench.state["calls"].append(bench.call_record(rc))
        bench.save_state()
    return rc


if __name__ == "__main__":
    sys.exit(main())
